"""Operator and activation tokens of ``nki.language`` (``nl.add``, ``nl.silu``, ...).

Each token is an :class:`Op` with its NKI name and a NumPy implementation on float32 (arithmetic,
comparison, activation) or on integers (bitvec). Math definitions follow NKI_API.md §2.4/§3.9:
``silu(x) = x*sigmoid(x)``, ``silu_dx(x) = s*(1 + x*(1 - s))`` with ``s = sigmoid(x)``,
``gelu_apprx_sigmoid(x) = x*sigmoid(1.702x)``. Trainium evaluates activations with undocumented
piecewise polynomials; the interpreter uses the exact formula in fp32 (results may differ from
hardware by a few ULP of the output dtype).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ACTIVATIONS", "ARITH", "BITVEC", "Op"]


class Op:
    """An NKI op token. ``kind`` is "arith", "bitvec", "unary" or "act"."""

    __slots__ = ("fn", "kind", "name")

    def __init__(self, name, kind, fn):
        self.name, self.kind, self.fn = name, kind, fn

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"nl.{self.name}(...) as a high-level tensor op is not supported by the interpreter; "
            "pass it as op= to an nki.isa instruction")


def _sig(x):
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)


def _b(x):
    return x.astype(np.float32)


def _torch_unary(name):
    def f(x):
        import torch

        return getattr(torch, name)(torch.from_numpy(np.ascontiguousarray(x))).numpy()
    return f


def _softplus(x):
    with np.errstate(over="ignore"):
        return np.logaddexp(np.float32(0), x).astype(np.float32)


_SQRT_2_PI = np.float32(math.sqrt(2.0 / math.pi))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))
_erf = _torch_unary("erf")


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))).astype(np.float32)


def _gelu_dx(x):
    cdf = 0.5 * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))
    return (cdf + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)).astype(np.float32)


def _gelu_tanh(x):
    return (0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + np.float32(0.044715) * x ** 3)))).astype(
        np.float32)


def _gelu_sig_dx(x):
    s = _sig(np.float32(1.702) * x)
    return (s + np.float32(1.702) * x * s * (1 - s)).astype(np.float32)


def _sign(x):
    return np.sign(x).astype(np.float32)


with np.errstate(all="ignore"):
    pass

ARITH = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum,
    "equal": lambda a, b: _b(a == b), "not_equal": lambda a, b: _b(a != b),
    "greater": lambda a, b: _b(a > b), "greater_equal": lambda a, b: _b(a >= b),
    "less": lambda a, b: _b(a < b), "less_equal": lambda a, b: _b(a <= b),
    "logical_and": lambda a, b: _b((a != 0) & (b != 0)),
    "logical_or": lambda a, b: _b((a != 0) | (b != 0)),
    "logical_xor": lambda a, b: _b((a != 0) ^ (b != 0)),
    "power": np.power,
    "abs_max": lambda a, b: np.maximum(np.abs(a), np.abs(b)),
    "abs_min": lambda a, b: np.minimum(np.abs(a), np.abs(b)),
}


def _shr(a, b):
    # logical shift right on the raw bits (arithmetic shift is not supported by NKI)
    ua = a.astype(np.int64) & 0xFFFFFFFF
    return ua >> b.astype(np.int64)


BITVEC = {
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "left_shift": lambda a, b: np.left_shift(a.astype(np.int64), b.astype(np.int64)),
    "right_shift": _shr,
}

UNARY = {
    "abs": np.abs, "square": np.square, "relu": lambda x: np.maximum(x, np.float32(0)),
    "rsqrt": lambda x: (1.0 / np.sqrt(x)).astype(np.float32),
    "reciprocal": lambda x: (1.0 / x).astype(np.float32),
    "invert": np.invert,
}

ACTIVATIONS = {
    "copy": lambda x: x, "identity": lambda x: x, "bypass": lambda x: x,
    "square": np.square, "sigmoid": _sig, "relu": lambda x: np.maximum(x, np.float32(0)),
    "gelu": _gelu, "gelu_dx": _gelu_dx, "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": lambda x: (x * _sig(np.float32(1.702) * x)).astype(np.float32),
    "gelu_apprx_sigmoid_dx": _gelu_sig_dx,
    "silu": lambda x: (x * _sig(x)).astype(np.float32),
    "silu_dx": lambda x: (_sig(x) * (1 + x * (1 - _sig(x)))).astype(np.float32),
    "tanh": np.tanh, "softplus": _softplus,
    "mish": lambda x: (x * np.tanh(_softplus(x))).astype(np.float32),
    "erf": _erf, "erf_dx": lambda x: (np.float32(2 / math.sqrt(math.pi)) * np.exp(-x * x)).astype(
        np.float32),
    "exp": np.exp, "log": np.log, "sin": np.sin, "arctan": np.arctan, "sqrt": np.sqrt,
    "rsqrt": UNARY["rsqrt"], "reciprocal": UNARY["reciprocal"], "sign": _sign, "abs": np.abs,
}

TOKENS: dict = {}
for _n, _f in ARITH.items():
    TOKENS[_n] = Op(_n, "arith", _f)
for _n, _f in BITVEC.items():
    TOKENS[_n] = Op(_n, "bitvec", _f)
TOKENS["invert"] = Op("invert", "bitvec", np.invert)
for _n, _f in ACTIVATIONS.items():
    if _n not in TOKENS:
        TOKENS[_n] = Op(_n, "act", _f)
TOKENS["prelu"] = Op("prelu", "act", None)
# nl.bypass: a no-op stage (tensor_scalar op0/op1, activation op)
TOKENS["bypass"] = Op("bypass", "arith", lambda a, b=None: a)
