"""Error metrics against a float64 reference, and the one table of SQNR floors the tests use.

SQNR (signal-to-quantization-noise ratio) in dB, as torchao's MX tests use it:
``SQNR = 20 log10(||ref|| / ||out - ref||)`` (Frobenius norms); +inf when equal.
Max relative error: ``max |out - ref| / max |ref|`` (normalized by the largest reference value,
so near-zero reference cells do not dominate).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SQNR_GRADIENTS",
    "SQNR_MIN_DB",
    "CHUNK",
    "all_finite",
    "error_sums",
    "metrics_from_sums",
    "compare",
    "max_rel_err",
    "rel_fro_err",
    "sqnr_db",
    "sqnr_floor",
]

SQNR_MIN_DB: dict[tuple[str, str], float] = {
    # default: callers that check every gradient against one number (layer / CLI / activation)
    ("torch", "default"): 35.0,
    ("fused", "default"): 35.0,
    ("nki", "default"): 24.0,
    # torch backend: BF16 operands, fp32 accumulation, BF16 GEMM outputs
    ("torch", "dX"): 47.5,
    ("torch", "dA"): 50.5,
    ("torch", "dW_gate_up"): 47.5,
    ("torch", "dW_down"): 50.0,
    ("torch", "dB_gate_up"): 53.5,
    ("torch", "dB_down"): 120.0,
    # fused CUDA backward (cuda-sm90 / cuda-sm100; Triton interpreter on CPU): fp32 weight grads
    ("fused", "dX"): 47.5,
    ("fused", "dA"): 49.0,
    ("fused", "dW_gate_up"): 48.5,
    ("fused", "dW_down"): 49.5,
    ("fused", "dB_gate_up"): 49.0,
    ("fused", "dB_down"): 120.0,
    # the fused forward (cuda_kernels/moe): y [T, H] in BF16, the BF16 checkpoint
    ("fused", "y"): 45.0,
    ("fused", "act"): 52.0,
    # NKI MXFP8 kernel (nki, nki-sim, nki-twin): MX E4M3 operands, fp32 PSUM, BF16 outputs
    ("nki", "dX"): 24.0,
    ("nki", "dA"): 24.5,
    ("nki", "dW_gate_up"): 24.0,
    ("nki", "dW_down"): 26.5,
    ("nki", "dB_gate_up"): 26.5,
    ("nki", "dB_down"): 50.5,
}
"""Minimum SQNR (dB) against the float64 reference, per ``(backend family, gradient)``.

Families: ``torch`` (the portable backend), ``fused`` (the fused CUDA backward: ``cuda-sm90``,
``cuda-sm100``, and its Triton-interpreter run on CPU), ``nki`` (the Trainium MXFP8 kernel:
``nki``, ``nki-sim``, ``nki-twin``). Gradients: ``dX dA dW_gate_up dW_down dB_gate_up
dB_down`` (and the fused forward's ``y`` and checkpoint ``act``); ``(family, "default")`` is the
single bar for callers that check all gradients against one number. Read a floor with
:func:`sqnr_floor`, which also takes the display names (``"dX [T,H]"``) and field names
(``"hidden_states_grad_TH"``).
"""

SQNR_GRADIENTS = ("dX", "dA", "dW_gate_up", "dW_down", "dB_gate_up", "dB_down")
_FIELD_TO_GRAD = {
    "hidden_states_grad_TH": "dX",
    "affinity_grad_TE": "dA",
    "w_gate_up_grad_EH2I": "dW_gate_up",
    "w_down_grad_EIH": "dW_down",
    "b_gate_up_grad_E2I": "dB_gate_up",
    "b_down_grad_EH": "dB_down",
}
_BACKEND_FAMILY = {
    "torch": "torch",
    "cuda-sm90": "fused",
    "cuda-sm100": "fused",
    "fused": "fused",
    "nki": "nki",
    "nki-sim": "nki",
    "nki-twin": "nki",
}


def sqnr_floor(family: str, gradient: str = "default") -> float:
    """The SQNR floor (dB) vs float64 of one gradient for one backend family (see SQNR_MIN_DB).

    Args:
        family: ``torch``, ``fused`` or ``nki``, or a backend name (``cuda-sm90``, ``nki-sim``...).
        gradient: ``dX``... (:data:`SQNR_GRADIENTS`), a display name (``"dX [T,H]"``), a
            :class:`~common.problem.MoEGrads` field name, or ``"default"``.
    Raises:
        KeyError: unknown family or gradient.
    """
    fam = _BACKEND_FAMILY.get(family)
    if fam is None:
        raise KeyError(f"unknown backend family {family!r}")
    name = gradient.split(" ", 1)[0]
    name = _FIELD_TO_GRAD.get(name, name)
    if (fam, name) not in SQNR_MIN_DB:
        raise KeyError(f"no SQNR floor for ({fam!r}, {gradient!r})")
    return SQNR_MIN_DB[(fam, name)]


CHUNK = 1 << 22  # elements per float64 chunk: bounds the temporary memory of huge gradients


def all_finite(t: torch.Tensor) -> bool:
    """True when every element of ``t`` is finite, checked in chunks of :data:`CHUNK` elements
    (``torch.isfinite`` of a whole tensor allocates ``|t|`` in ``t``'s dtype plus two bool
    masks: 2.5 GiB for one fp32 weight gradient of qwen3-30b-a3b)."""
    if not t.is_floating_point() and not t.is_complex():
        return True
    flat = t.detach().reshape(-1)
    return all(
        bool(torch.isfinite(flat[s : s + CHUNK]).all()) for s in range(0, flat.numel(), CHUNK)
    )


def error_sums(
    out: torch.Tensor, ref: torch.Tensor, need_max: bool = True
) -> tuple[float, float, float, float, bool]:
    """(sum (out-ref)^2, sum ref^2, max |out-ref|, max |ref|, all finite), in float64 chunks.

    One float64 temporary per chunk (``d = out - ref`` in place); ``out``'s finiteness is read
    off ``sum d^2`` (finite only when every ``d`` is, and then every ``out`` is: an inf or NaN
    ``out`` makes ``d`` inf or NaN) and checked elementwise only when that sum is not finite.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o_flat = out.detach().reshape(-1)
    r_flat = ref.detach().reshape(-1)
    # On out's device, sums kept there and read once at the end: a GPU gradient is neither
    # copied to the host chunk by chunk nor synchronised per chunk (the GPU main job's
    # comparison copied every gradient and its float64 reference through the host).
    dev = o_flat.device
    acc = torch.zeros(4, dtype=torch.float64, device=dev)  # noise2, signal2, dmax, rmax
    for start in range(0, o_flat.numel(), CHUNK):
        r = r_flat[start : start + CHUNK].to(dev, torch.float64)
        d = o_flat[start : start + CHUNK].to(torch.float64, copy=True)
        d.sub_(r)
        acc[0] += torch.dot(d, d)
        acc[1] += torch.dot(r, r)
        if need_max:
            acc[2] = torch.maximum(acc[2], d.abs_().max())
            acc[3] = torch.maximum(acc[3], r.abs().max())
    noise2, signal2, dmax, rmax = acc.tolist()
    return noise2, signal2, dmax, rmax, math.isfinite(noise2) or all_finite(out)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """All three metrics from one pass: ``{"sqnr_db", "max_rel_err", "rel_fro_err"}``."""
    return metrics_from_sums(*error_sums(out, ref))


def metrics_from_sums(noise2, signal2, dmax, rmax, finite) -> dict[str, float]:
    """:func:`compare`'s metrics from the sums of :func:`error_sums` (also used by
    :mod:`common.compare`)."""
    if not finite:
        return {"sqnr_db": math.nan, "max_rel_err": math.nan, "rel_fro_err": math.nan}
    sq = (
        math.inf
        if noise2 == 0.0
        else (-math.inf if signal2 == 0.0 else 10 * math.log10(signal2 / noise2))
    )
    mr = (0.0 if dmax == 0.0 else math.inf) if rmax == 0.0 else dmax / rmax
    rf = (0.0 if noise2 == 0.0 else math.inf) if signal2 == 0.0 else math.sqrt(noise2 / signal2)
    return {"sqnr_db": sq, "max_rel_err": mr, "rel_fro_err": rf}


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """SQNR of ``out`` against ``ref`` in dB (+inf when identical; NaN if out has NaN/inf).

    Raises:
        ValueError: shapes differ.
    """
    return compare(out, ref)["sqnr_db"]


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` (0 when both are all zero; NaN if out has NaN/inf)."""
    return compare(out, ref)["max_rel_err"]


def rel_fro_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius; NaN if out has NaN/inf)."""
    return compare(out, ref)["rel_fro_err"]
