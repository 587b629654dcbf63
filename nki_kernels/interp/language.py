"""``nki.language`` for the CPU interpreter (the subset of NKI_API.md §2).

Names and signatures follow the public stub ``nki/api/nki/language/__init__.py``: dtypes are
``str`` constants, buffers are :class:`MemoryRegion` members, loops are Python ranges, op tokens
are :class:`~nki_kernels.interp.ops.Op` objects.
"""

from __future__ import annotations

import contextlib

from . import core as _core
from . import dtypes as _dt
from .core import MemoryRegion, NkiTensor, hbm, private_hbm, psum, sbuf, shared_hbm
from .dtypes import (  # noqa: F401
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .ops import TOKENS as _TOKENS

__all__ = [
    "MemoryRegion",
    "NKIObject",
    "NkiTensor",
    "affine_range",
    "ds",
    "empty_like",
    "full",
    "hbm",
    "is_hbm",
    "is_on_chip",
    "is_psum",
    "is_sbuf",
    "ndarray",
    "no_reorder",
    "num_programs",
    "ones",
    "private_hbm",
    "program_id",
    "program_ndim",
    "psum",
    "sbuf",
    "sequential_range",
    "shared_hbm",
    "static_range",
    "tensor",
    "tile_size",
    "zeros",
    "zeros_like",
]

tensor = NkiTensor


def ndarray(shape, dtype, buffer=sbuf, name="", address=None) -> NkiTensor:
    """New uninitialized tensor (filled with NaN / 4 sentinels) in ``buffer``.

    Raises:
        NkiError: partition dim > 128 on SBUF/PSUM. NkiCapacityError: SBUF/PSUM budget exceeded.
        ValueError: bad shape, dtype or buffer.
    """
    return _core.current().allocate(shape, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name="") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    from . import isa

    if t.is_onchip and buffer is not psum:
        isa.memset(t, int(fill_value) if _dt.is_int(t.dtype) else fill_value)
    else:
        arr = t._np()
        arr[...] = isa._cast(__import__("numpy").full(t.shape, fill_value, dtype="float64"),
                             t.dtype)
    return t


def zeros(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def zeros_like(x, dtype=None, buffer=None, name="") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x, dtype=None, buffer=None, name="") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ds(start, size) -> slice:
    """``nl.ds(start, size)`` == ``slice(start, start + size)``."""
    start, size = int(start), int(size)
    if size < 0:
        raise ValueError(f"ds: negative size {size}")
    return slice(start, start + size)


def affine_range(start, stop=None, step=1):
    return range(start, stop, step) if stop is not None else range(start)


sequential_range = affine_range
static_range = affine_range


def _reg_value(v, what):
    from .isa import VirtualRegister

    if isinstance(v, VirtualRegister):
        return v.value
    if isinstance(v, (int,)) or hasattr(v, "__index__"):
        return int(v)
    raise TypeError(f"{what}: expected an int or a VirtualRegister, got {v!r}")


ALLOW_DYNAMIC_RANGE = {"value": False}


def dynamic_range(start, stop=None, step=1):
    """Runtime loop: bounds may be VirtualRegisters (read when the loop starts).

    Deprecated by NKI 0.6.0 (SDK ``nki/migration/index.rst``: "Deprecated: dynamic
    ``nl.dynamic_range`` ... Use instead :func:`~nki.language.fori_loop`"), so it raises unless
    ``ALLOW_DYNAMIC_RANGE["value"]`` is set (tests of the loop semantics only).
    """
    if not ALLOW_DYNAMIC_RANGE["value"]:
        raise _core.NkiError("nl.dynamic_range is deprecated since NKI 0.6.0 and will be removed; "
                             "use nl.fori_loop(lower, upper, body_fun) (SDK migration guide)")
    return _dynamic_range(start, stop, step)


def _dynamic_range(start, stop=None, step=1):
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"dynamic_range: step must be a compile-time positive int, got {step!r}")
    if stop is None:
        return range(_reg_value(start, "dynamic_range stop"))
    return range(_reg_value(start, "dynamic_range start"), _reg_value(stop, "dynamic_range stop"),
                 step)


def fori_loop(lower, upper, body_fun, step=1):
    """``for i in range(lower, upper, step): body_fun(i)`` with ``i`` a VirtualRegister."""
    from .isa import VirtualRegister

    for i in _dynamic_range(lower, upper, step):
        if body_fun(VirtualRegister(i)) is not None:
            # SDK migration guide, "Rules for migrated loops": "The fori_loop body function
            # cannot return a value."
            raise _core.NkiError("nl.fori_loop: the body function cannot return a value")


def while_loop(init, body_fun):
    """``r = init; while r != 0: r = body_fun(r)`` (registers; the body returns the next one)."""
    from .isa import VirtualRegister

    if not isinstance(init, VirtualRegister):
        raise TypeError(f"while_loop: init must be a VirtualRegister, got {init!r}")
    r = VirtualRegister(init.value)
    while r.value != 0:
        nxt = body_fun(r)
        if not isinstance(nxt, VirtualRegister):
            raise TypeError("while_loop: body_fun must return the next condition register")
        r = VirtualRegister(nxt.value)


def load(src, dtype=None):
    """High-level load: a new SBUF tile holding ``src`` (converted to ``dtype``)."""
    from . import isa

    t = ndarray(src.shape if src.is_onchip or len(src.shape) > 1 else (1,) + tuple(src.shape),
                dtype or src.dtype, buffer=sbuf)
    isa.dma_copy(t, src)
    return t


def store(dst, value):
    """High-level store: DMA ``value`` (an SBUF tile) into ``dst``."""
    from . import isa

    isa.dma_copy(dst, value)


def program_id(axis=0) -> int:
    if axis != 0:
        raise ValueError("program_id: only a 1-D grid (axis=0) is supported")
    return _core.current().program_id


def num_programs(axes=0) -> int:
    if axes not in (0, None):
        raise ValueError("num_programs: only a 1-D grid (axes=0) is supported")
    return _core.current().num_programs


def program_ndim() -> int:
    ctx = _core.current()
    if not ctx.launched:
        raise _core.NkiError("nl.program_ndim() outside a kernel launch: launch the kernel with "
                             "nki.jit on Trainium or nki_kernels.interp.simulate(kernel)(...) on "
                             "the CPU")
    return ctx.grid_ndim


class _TileSize:
    """``nl.tile_size`` constants (NKI_API.md §2.4, §4.1); SBUF sizes follow the target."""

    pmax = 128
    psum_bank_fmax = 512
    psum_bank_fmax_bytes = 2048
    psum_num_banks = 8
    psum_fmax = 2048
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 4

    @property
    def sbuf_size_bytes(self) -> int:
        return _core.current().spec["sbuf_bytes"] * 128

    @property
    def sbuf_fmax_bytes(self) -> int:
        """Usable SBUF bytes per partition (the stub's definition)."""
        return _core.current().spec["sbuf_usable_bytes"]

    @property
    def sbuf_fmax(self) -> int:
        return _core.current().spec["sbuf_usable_bytes"] // 4

    @property
    def total_available_sbuf_size(self) -> int:
        return _core.current().spec["sbuf_usable_bytes"]


tile_size = _TileSize()


class NKIObject:
    """Base class of objects usable inside kernels (stores keyword arguments as attributes)."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)


def no_reorder():
    return contextlib.nullcontext()


def is_hbm(buffer) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer) -> bool:
    return buffer in (sbuf, psum)


def is_psum(buffer) -> bool:
    return buffer is psum


def is_sbuf(buffer) -> bool:
    return buffer is sbuf


globals().update(_TOKENS)
__all__ += list(_TOKENS)
