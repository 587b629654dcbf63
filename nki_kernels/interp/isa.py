"""``nki.isa`` for the CPU interpreter: the instruction subset of NKI_API.md §3.

Signatures (names, order, defaults) are those of the public stub ``nki/api/nki/isa/__init__.py``.
Semantics common to all compute instructions: inputs are read as fp32, the math runs in fp32, and
the result is rounded once (round-to-nearest-even) to ``dst.dtype``; float -> int conversions
round to nearest even and saturate (NaN -> 0). Same-dtype copies are bit-exact. Each call checks
Trainium's rules and raises :class:`~nki_kernels.interp.core.NkiError` (naming the instruction and
the rule) before writing anything; each call adds its work to the current profile region.
"""

from __future__ import annotations

import enum
import math
import weakref

import numpy as np

from . import dtypes as _dt
from . import mxops
from . import profile as _profile
from .core import PMAX, IndirectAP, NkiBarrierError, NkiError, NkiTensor, current, psum, sbuf
from .ops import TOKENS, Op

__all__ = [
    "MATMUL_PRECISION",
    "NkiInstruction",
    "activation",
    "activation_reduce",
    "affine_select",
    "core_barrier",
    "dge_mode",
    "dma_compute",
    "dma_copy",
    "dma_engine",
    "dma_transpose",
    "engine",
    "get_nc_sub_version",
    "get_nc_version",
    "gpsimd_engine",
    "iota",
    "matmul_perf_mode",
    "memset",
    "nc_matmul",
    "nc_matmul_mx",
    "nc_stream_shuffle",
    "nc_transpose",
    "nc_version",
    "oob_mode",
    "quantize_mx",
    "reduce_cmd",
    "scalar_engine",
    "sendrecv",
    "tensor_copy",
    "tensor_copy_predicated",
    "tensor_engine",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_tensor",
    "vector_engine",
]


class engine(enum.Enum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class matmul_perf_mode(enum.Enum):
    none = 0
    double_row = 1


class nc_version(enum.Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.Enum):
    dma = 1
    gpsimd_dma = 2


# aliases: instruction parameters named like the enums (engine=, dge_mode=, ...) shadow them
_Engine, _DgeMode, _OobMode, _ReduceCmd = engine, dge_mode, oob_mode, reduce_cmd

scalar_engine = engine.scalar
vector_engine = engine.vector
gpsimd_engine = engine.gpsimd
tensor_engine = engine.tensor

# Accumulation width of nc_matmul / nc_matmul_mx inside one instruction. "float64" (default): the
# products of bf16 / fp8 pairs and their sums of <= 512 terms are exact in float64, so the result is
# the exact sum rounded once to fp32, independent of BLAS blocking and of how a kernel tiles N (LNC1
# and LNC2 agree bit for bit). "float32": BLAS sgemm, ~4x faster, results depend on tile shapes.
# AWS leaves TensorE's summation order undocumented (NKI_API.md §6).
MATMUL_PRECISION = {"value": "float64"}

ENGINE_FIXED = _profile.ENGINE_FIXED_CYCLES  # per-instruction cycles (profile.CONSTANTS)
TENSOR_FIXED = _profile.TENSOR_FIXED_CYCLES


class NkiInstruction:
    """Handle returned by every ISA call; ``depends_on`` is accepted and ignored."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def depends_on(self, *producers):
        return self


def get_nc_version() -> nc_version:
    return nc_version(current().spec["nc_version"])


def get_nc_sub_version() -> int:
    return 0


# ------------------------------------------------------------------------------------------------
# helpers


def _err(instr, msg):
    return NkiError(f"nisa.{instr}: {msg}")


def _tensor(instr, arg, t, allow_indirect=False):
    if isinstance(t, NkiTensor):
        return t
    if allow_indirect and isinstance(t, IndirectAP):
        return t
    alt = " or an indirect .ap()" if allow_indirect else ""
    raise _err(instr, f"{arg} must be an NkiTensor{alt}"
               f", got {type(t).__name__}")


def _onchip(instr, arg, t, allow=(sbuf, psum), start_rule=True):
    if t.buffer not in allow:
        names = "/".join(b.value for b in allow)
        raise _err(instr, f"{arg} must live in {names}, got {t.buffer.value}")
    if t.shape[0] > PMAX:
        raise _err(instr, f"{arg} has {t.shape[0]} partitions (max {PMAX})")
    if start_rule:
        _start_ok(instr, arg, t)


# Start-partition rule of compute-engine operands (NKI_API.md §4.3): 64 < n <= 128 partitions
# start at 0; 32 < n <= 64 at 0 or 64; n <= 32 at 0, 32, 64 or 96. MX scale views are exempt
# (offsets 0/4/8/12 inside a quadrant). DMA is not constrained.
CHECK_PARTITION_START = {"value": True}


def _start_ok(instr, arg, t):
    if not CHECK_PARTITION_START["value"] or not t.is_onchip:
        return
    pb = t.storage.pbytes
    p0 = t.boffset // pb if pb else 0
    n = t.shape[0]
    if n > 64:
        ok = p0 == 0
    elif n > 32:
        ok = p0 in (0, 64)
    else:
        ok = p0 % 32 == 0
    if not ok:
        raise _err(instr, f"{arg} spans {n} partitions starting at partition {p0}; engines "
                   "need start 0 (n > 64), 0/64 (32 < n <= 64) or 0/32/64/96 (n <= 32)")


def _pf(t):
    P = t.shape[0]
    return P, (t.size // P if P else 0)


def _same_pf(instr, a, an, b, bn):
    pa, fa = _pf(a)
    pb, fb = _pf(b)
    if pa != pb:
        raise _err(instr, f"{an} has {pa} partitions but {bn} has {pb}")
    if fa != fb:
        raise _err(instr, f"{an} has {fa} elements per partition but {bn} has {fb}")
    return pa, fa


def _no_x4(instr, arg, t):
    if _dt.is_x4(t.dtype):
        raise _err(instr, f"{arg} has packed dtype {t.dtype}; only quantize_mx/nc_matmul_mx, "
                   "same-dtype copies and DMA handle x4 data")


def _f32(t) -> np.ndarray:
    a = t._np()
    return a if a.dtype == np.float32 else a.astype(np.float32)


_INT_RANGE = {}


def _cast(res: np.ndarray, dtype: str) -> np.ndarray:
    """Round ``res`` once to ``dtype`` (RNE; ints saturate, NaN -> 0)."""
    npdt = _dt.np_dtype(dtype)
    if res.dtype == npdt:
        return res
    if _dt.is_int(dtype):
        info = _INT_RANGE.get(npdt)
        if info is None:
            ii = np.iinfo(npdt)
            info = _INT_RANGE[npdt] = (ii.min, ii.max)
        if res.dtype.kind == "f":
            r = np.rint(res.astype(np.float64))
            r = np.nan_to_num(r, nan=0.0, posinf=info[1], neginf=info[0])
            return np.clip(r, info[0], info[1]).astype(npdt)
        return np.clip(res, info[0], info[1]).astype(npdt)
    if res.dtype.kind in "iu":
        res = res.astype(np.float32)
    return res.astype(npdt)


def _write(dst: NkiTensor, res: np.ndarray) -> None:
    arr = dst._np()
    arr[...] = _cast(res, dst.dtype).reshape(dst.shape)
    st = dst.storage
    if st.written is not None:
        dst._written_flags()[...] = 1
    st.version += 1


def _count(engine_name, cycles, elements, macs_mx=0, macs_bf16=0, dma_bytes=0, dma=None,
           lane_rate=None):
    """Adds one instruction's work to the current (core, region) counters and modeled time.

    Vector/Scalar/GpSimd ``cycles`` come in at one element per partition per cycle plus
    ``ENGINE_FIXED``; the data part is divided by the engine's lane rate (``lane_rate`` overrides,
    e.g. ``quantize_mx`` whose cycles already include its 4x mode). ``dma``: ``(src, dst)``
    views, or ``(chunk_bytes, partitions, transpose)``, for the DMA cost model.
    """
    ctx = current()
    region = ctx.region_stack[-1]
    c = ctx.counters[region]
    prof = ctx.profile
    prev = getattr(ctx, "_seg_open", None)
    if prev is not c:
        if prev is not None:
            prev.close_segment()
        ctx._seg_open = c
    c.instructions[engine_name] += 1
    c.elements[engine_name] += elements
    if engine_name == "dma":
        chunk, parts, transpose = _dma_shape(dma, dma_bytes)
        c.dma_count += 1
        c.dma_chunks += math.ceil(dma_bytes / chunk) if dma_bytes else 0
        if dma_bytes:
            c.dma_bytes_by_chunk[1 << (max(1, int(min(chunk, dma_bytes))).bit_length() - 1)] += dma_bytes
        c.record("dma", _profile.dma_cost_ns(prof.model, dma_bytes, chunk, parts, transpose))
    else:
        if engine_name != "tensor":
            rate = lane_rate or prof.model["lane_rate"][engine_name]
            cycles = ENGINE_FIXED + max(0.0, cycles - ENGINE_FIXED) / rate
        c.cycles[engine_name] += cycles
        c.record(engine_name, prof.engine_ns(engine_name, cycles))
    if macs_mx:
        c.macs_mx += macs_mx
    if macs_bf16:
        c.macs_bf16 += macs_bf16
    if dma_bytes:
        c.dma_bytes += dma_bytes


def _view_run(t) -> int:
    split = t.is_onchip or (isinstance(t, IndirectAP) and t.vector_offset is not None)
    return _profile.dma_run_bytes(t.shape, t.bstrides, t.itemsize, split)


def _dma_shape(dma, nbytes):
    """``(chunk_bytes, partitions, transpose)`` of a DMA from its views (see :func:`_count`)."""
    if dma is None:
        return max(nbytes, 1), PMAX, False
    if isinstance(dma[0], (int, float)):
        return dma
    views, transpose = dma[:-1], dma[-1]
    chunk = min(_view_run(t) for t in views)
    parts = PMAX
    for t in views:
        if t.is_onchip:
            parts = t.shape[0]
            break
    return chunk, parts, transpose


def _engine_name(instr, eng, default, allowed):
    if eng is None or eng is engine.unknown:
        return default
    if not isinstance(eng, engine):
        raise _err(instr, f"engine must be an nisa.engine member, got {eng!r}")
    if eng not in allowed:
        raise _err(instr, f"engine={eng.name} not allowed (one of "
                   f"{', '.join(e.name for e in allowed)})")
    return eng.name


def _op(instr, arg, op, kinds):
    if not isinstance(op, Op):
        raise _err(instr, f"{arg} must be an nl op token (e.g. nl.add), got {op!r}")
    if op.kind not in kinds:
        raise _err(instr, f"{arg}=nl.{op.name} is not a {'/'.join(kinds)} op")
    return op


def _psum_engine_rule(instr, eng, *tensors):
    if eng == "gpsimd" and any(t.buffer is psum for t in tensors):
        raise _err(instr, "GpSimd cannot access PSUM")


# ------------------------------------------------------------------------------------------------
# DMA


def _dma_read(instr, src, oob_skip):
    """Values of src as [R, per_row] in src's storage dtype, and the valid mask [R] (or None)."""
    if isinstance(src, IndirectAP):
        fast = src.row_table(instr, oob_skip)
        if fast is not None:
            table, idx, valid = fast
            vals = table[np.where(valid, idx, 0)]
            return vals.reshape(valid.shape[0], -1), valid
        flat, index, valid = src.resolve(instr, oob_skip)
        vals = flat[index]
        return vals.reshape(valid.shape[0], -1), valid
    return src._np(), None


def _scatter(instr, dst, vals, skip):
    """Write [R, per_row] ``vals`` (dst dtype) through the indirect ``dst``; skipped rows are
    dropped."""
    fast = dst.row_table(instr, skip)
    if fast is not None:
        table, idx, valid = fast
        R = valid.shape[0]
        v = np.asarray(vals).reshape((R,) + table.shape[1:])
        table[idx[valid]] = v[valid]
    else:
        flat, index, dvalid = dst.resolve(instr, skip)
        R = dvalid.shape[0]
        v = np.asarray(vals).reshape(R, -1)
        flat[index.reshape(R, -1)[dvalid]] = v[dvalid]
    dst.storage.version += 1


def _convert(instr, vals, src_dtype, dst, dge):
    if src_dtype == dst.dtype:
        return vals
    if _dt.is_x4(src_dtype) or _dt.is_x4(dst.dtype):
        raise _err(instr, f"cannot convert {src_dtype} to {dst.dtype} (packed x4); use .view()")
    if dge is dge_mode.hwdge:
        raise _err(instr, f"HWDGE moves raw bytes: src dtype {src_dtype} != dst dtype "
                   f"{dst.dtype} (use .view())")
    return _cast(vals.astype(np.float32), dst.dtype)


def _no_psum_dma(instr, *ts):
    for t in ts:
        if t.buffer is psum:
            raise _err(instr, "DMA cannot read or write PSUM")


def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None):
    """``dst = src`` element-wise in row-major order (NKI_API.md §3.1).

    src/dst: HBM or SBUF views (not PSUM) with equal element counts; either may be an indirect
    ``.ap()`` (gather on src, scatter on dst). Same dtype: raw byte copy; otherwise via fp32
    (not allowed with HWDGE). ``oob_mode.skip``: out-of-bounds rows are dropped and the
    destination keeps its contents; ``oob_mode.error``: raises :class:`NkiOOBError`.
    """
    instr = "dma_copy"
    dst = _tensor(instr, "dst", dst, True)
    src = _tensor(instr, "src", src, True)
    _no_psum_dma(instr, dst, src)
    if isinstance(dst, IndirectAP) and isinstance(src, IndirectAP):
        raise _err(instr, "only one of src/dst may be indirect")
    if dst.size != src.size:
        raise _err(instr, f"element counts differ: dst {dst.shape} ({dst.size}) vs src "
                   f"{src.shape} ({src.size})")
    skip = _oob_skip(instr, oob_mode)
    if engine not in (None, _Engine.unknown):
        if dge_mode is not _DgeMode.hwdge:
            raise _err(instr, "engine= selects the HWDGE queue and needs dge_mode=hwdge")
        if engine not in (_Engine.sync, _Engine.scalar):
            raise _err(instr, f"engine={engine} not allowed with hwdge (sync or scalar)")
    if (isinstance(dst, IndirectAP) or isinstance(src, IndirectAP)):
        ind = dst if isinstance(dst, IndirectAP) else src
        if ind.vector_offset is not None and dge_mode is _DgeMode.hwdge:
            raise _err(instr, "vector_offset (indirect) DMA needs SWDGE, not hwdge")
    vals, valid = _dma_read(instr, src, skip)
    if isinstance(dst, IndirectAP):
        _scatter(instr, dst, _convert(instr, vals, src.dtype, dst, dge_mode), skip)
    else:
        vals = _convert(instr, vals, src.dtype, dst, dge_mode)
        out = dst._np()
        if valid is None:
            out[...] = np.asarray(vals).reshape(dst.shape)
        elif valid.all():
            out[...] = vals.reshape(dst.shape)
        else:
            R = valid.shape[0]
            old = out.reshape(R, -1) if out.flags.c_contiguous else out.copy().reshape(R, -1)
            merged = np.where(valid[:, None], vals.reshape(R, -1), old)
            out[...] = merged.reshape(dst.shape)
        dst.storage.version += 1
    nbytes = dst.size * dst.itemsize
    _count("dma", 0, dst.size, dma_bytes=nbytes, dma=(src, dst, False))
    return NkiInstruction(name)


def _oob_skip(instr, mode):
    if mode is oob_mode.skip:
        return True
    if mode is oob_mode.error or mode is None:
        return False
    raise _err(instr, f"oob_mode must be nisa.oob_mode.error/skip, got {mode!r}")


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown,
                  oob_mode=oob_mode.error, name=None):
    """``dst = transpose(src, axes)`` by DMA (NKI_API.md §3.2); dst in SBUF, same dtype.

    ``axes`` (default by rank): (1,0), (2,1,0) or (3,1,2,0). An indirect src (vector offset of
    2-D uint32 indices [Pi, Ni]) gathers rows ``indices.T.flatten()[:src.shape[0]]`` first.
    """
    instr = "dma_transpose"
    dst = _tensor(instr, "dst", dst)
    src = _tensor(instr, "src", src, True)
    if dst.buffer is not sbuf:
        raise _err(instr, f"dst must be in SBUF, got {dst.buffer.value}")
    _no_psum_dma(instr, src)
    if src.dtype != dst.dtype:
        raise _err(instr, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    nd = len(src.shape)
    default = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    if nd not in default:
        raise _err(instr, f"src must be 2-, 3- or 4-D, got {src.shape}")
    axes = default[nd] if axes is None else tuple(axes)
    if axes != default[nd]:
        raise _err(instr, f"axes {axes} not allowed for {nd}-D src (only {default[nd]})")
    skip = _oob_skip(instr, oob_mode)
    sh = src.shape
    if dge_mode is _DgeMode.hwdge:
        if isinstance(src, IndirectAP):
            raise _err(instr, "an indirect src needs SWDGE, not hwdge")
        if src.itemsize != 2:
            raise _err(instr, f"hwdge transpose needs a 2-byte dtype, got {src.dtype}")
        if nd == 2 and sh[0] != 16:
            raise _err(instr, f"hwdge 2-D transpose needs src.shape[0] == 16, got {sh}")
        if nd > 2 and (sh[0] not in (1, 2, 4, 8, 16) or (sh[0] * sh[-2]) % 16):
            raise _err(instr, f"hwdge {nd}-D transpose needs src.shape[0] in (1,2,4,8,16) and "
                       f"src.shape[0]*src.shape[-2] % 16 == 0, got {sh}")
        if sh[-1] > 128:
            raise _err(instr, f"hwdge transpose needs src.shape[-1] <= 128, got {sh}")
    if isinstance(src, IndirectAP):
        if src.vector_offset is None:
            raise _err(instr, "indirect src needs a vector_offset")
        if src.itemsize != 2:
            raise _err(instr, "indirect dma_transpose needs a 2-byte dtype")
        if sh[-1] > 128 or sh[0] % 16:
            raise _err(instr, f"indirect src needs shape[-1] <= 128 and shape[0] % 16 == 0, "
                       f"got {sh}")
        if nd == 4 and sh[1] != 1 and sh[2] != 1:
            raise _err(instr, f"indirect 4-D src needs shape[1] == 1 or shape[2] == 1, got {sh}")
        ip = src.vector_offset.shape[0]
        if not 16 <= ip <= 128 or ip % 16:
            raise _err(instr, f"indices need 16..128 partitions, a multiple of 16; got {ip}")
        vals, valid = _gather_transposed_rows(instr, src, skip)
    else:
        if skip:
            raise _err(instr, "oob_mode.skip is only valid with an indirect src")
        vals, valid = src._np(), None
    out_shape = tuple(src.shape[a] for a in axes)
    if tuple(dst.shape) != out_shape and dst.size != math.prod(out_shape):
        raise _err(instr, f"dst shape {dst.shape} does not match transposed src {out_shape}")
    res = np.transpose(vals, axes)
    out = dst._np()
    if valid is None or valid.all():
        out[...] = res.reshape(dst.shape)
    else:
        # rows of src become the LAST dst axis; skipped rows leave their dst column unchanged
        old = out.copy().reshape(out_shape)
        mask = valid.reshape((1,) * (nd - 1) + (-1,))
        out[...] = np.where(mask, res, old).reshape(dst.shape)
    dst.storage.version += 1
    _count("dma", 0, dst.size, dma_bytes=dst.size * dst.itemsize,
           dma=(src, True))
    return NkiInstruction(name)


def _gather_transposed_rows(instr, src: IndirectAP, skip):
    idx_t = src.vector_offset
    if idx_t.dtype != _dt.uint32:
        raise _err(instr, f"indirect indices must be uint32, got {idx_t.dtype}")
    ind = idx_t._np().astype(np.int64)
    if ind.ndim != 2:
        raise _err(instr, "indirect indices must be a 2-D (P, N) tile")
    R = src.shape[0]
    flat_idx = ind.T.reshape(-1)[:R]
    if flat_idx.size < R:
        raise _err(instr, f"indices hold {ind.size} entries, src needs {R}")
    isz = src.itemsize
    nel = src.storage.data.shape[0] // isz
    flat = np.ndarray((nel,), src._npdt, buffer=src.storage.data, offset=0, strides=(isz,))
    from .core import _pattern_index

    inner = _pattern_index(src.shape[1:], [s // isz for s in src.bstrides[1:]])
    valid = (flat_idx >= 0) & (flat_idx < src.rows)
    if (~valid).any() and not skip:
        raise NkiError(f"nisa.{instr}: indirect index out of bounds [0, {src.rows})")
    rows = np.where(valid, flat_idx, 0)
    index = src.boffset // isz + rows.reshape((-1,) + (1,) * len(inner.shape)) * (
        src.row_bytes // isz) + inner
    if index.size and index.max() >= nel:
        raise NkiError(f"nisa.{instr}: indirect access past the end of {src.name!r}")
    return flat[index], valid


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error,
                name=None):
    """DMA-engine ``dst = sum_i srcs[i] * scales[i]`` in fp32, cast to ``dst.dtype`` (§3.3).

    Only ``nl.add`` and scales of 1.0. An indirect ``dst`` (scatter read-add-write) or an
    indirect source (gather) follows ``oob_mode``; skipped rows leave dst unchanged.
    """
    instr = "dma_compute"
    reduce_op = _op(instr, "reduce_op", reduce_op, ("arith",))
    if reduce_op.name != "add":
        raise _err(instr, "only reduce_op=nl.add is supported")
    srcs = list(srcs)
    if not 1 <= len(srcs) <= 16:
        raise _err(instr, f"1..16 sources, got {len(srcs)}")
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise _err(instr, "all scales must be 1.0")
    skip = _oob_skip(instr, oob_mode)
    dst = _tensor(instr, "dst", dst, True)
    acc = None
    valid_all = None
    for i, s in enumerate(srcs):
        s = _tensor(instr, f"srcs[{i}]", s, True)
        srcs[i] = s
        if s.size != dst.size:
            raise _err(instr, f"srcs[{i}] has {s.size} elements, dst {dst.size}")
        vals, valid = _dma_read(instr, s, skip)
        v = np.asarray(vals).astype(np.float32).reshape(-1)
        acc = v if acc is None else acc + v
        if valid is not None:
            valid_all = valid if valid_all is None else valid_all & valid
    if isinstance(dst, IndirectAP):
        _scatter(instr, dst, _cast(acc, dst.dtype).reshape(dst.shape[0], -1), skip)
    else:
        if valid_all is not None and not valid_all.all():
            R = valid_all.shape[0]
            old = dst._np().astype(np.float32).reshape(R, -1)
            acc = np.where(valid_all[:, None], acc.reshape(R, -1), old)
        _write(dst, acc)
    _count("dma", 0, dst.size, dma_bytes=dst.size * dst.itemsize * (len(srcs) + 1),
           dma=(*srcs, dst, False))
    return NkiInstruction(name)


# ------------------------------------------------------------------------------------------------
# Vector / Scalar / GpSimd


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """``dst = src`` on Vector/Scalar/GpSimd (§3.4); same dtype bit-exact, else via fp32."""
    instr = "tensor_copy"
    dst = _tensor(instr, "dst", dst)
    src = _tensor(instr, "src", src)
    _onchip(instr, "dst", dst)
    _onchip(instr, "src", src)
    P, F = _same_pf(instr, dst, "dst", src, "src")
    eng = _engine_name(instr, engine, "vector", (_Engine.vector,
                                                 _Engine.scalar,
                                                 _Engine.gpsimd))
    _psum_engine_rule(instr, eng, dst, src)
    if dst.buffer is psum and current().spec["nc_version"] >= 4 and dst.itemsize != 4:
        raise _err(instr, f"a copy into PSUM needs a 4-byte dtype on trn3, got {dst.dtype}")
    if src.dtype == dst.dtype:
        val = src._np().reshape(dst.shape) if src.shape != dst.shape else src._np()
        out = dst._np()
        out[...] = val
        if dst.storage.written is not None:
            dst._written_flags()[...] = 1
        dst.storage.version += 1
    else:
        _no_x4(instr, "src", src)
        _no_x4(instr, "dst", dst)
        _write(dst, _f32(src))
    _count(eng, F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with a constant (§3.5). Int dtypes need an int value; x4 only 0."""
    instr = "memset"
    dst = _tensor(instr, "dst", dst)
    _onchip(instr, "dst", dst)
    eng = _engine_name(instr, engine, "vector", (_Engine.vector,
                                                 _Engine.gpsimd))
    _psum_engine_rule(instr, eng, dst)
    P, F = _pf(dst)
    if _dt.is_x4(dst.dtype):
        if value != 0:
            raise _err(instr, f"packed dtype {dst.dtype} accepts only value=0, got {value!r}")
        dst._np()[...] = 0
        if dst.storage.written is not None:
            dst._written_flags()[...] = 1
        dst.storage.version += 1
    else:
        if _dt.is_int(dst.dtype) and not isinstance(value, (int, np.integer, bool)):
            raise _err(instr, f"integer dst ({dst.dtype}) needs an int value, got {value!r}")
        if _dt.is_int(dst.dtype):
            _write(dst, np.full(dst.shape, int(value), dtype=np.int64))
        else:
            _write(dst, np.full(dst.shape, value, dtype=np.float32))
    _count(eng, F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[c, ...] = offset + c*channel_multiplier + sum_k i_k*step_k`` in int32 (§3.5)."""
    instr = "iota"
    dst = _tensor(instr, "dst", dst)
    _onchip(instr, "dst", dst, (sbuf,))
    pat = [(int(s), int(n)) for s, n in pattern]
    if not 1 <= len(pat) <= 4:
        raise _err(instr, f"pattern needs 1..4 [step, num] pairs, got {len(pat)}")
    P, F = _pf(dst)
    nfree = math.prod(n for _, n in pat)
    if nfree != F:
        raise _err(instr, f"pattern covers {nfree} elements per partition, dst has {F}")
    from .core import _pattern_index

    free = _pattern_index(tuple(n for _, n in pat), [s for s, _ in pat]).reshape(1, -1)
    val = int(offset) + np.arange(P, dtype=np.int64)[:, None] * int(channel_multiplier) + free
    val = val.astype(np.int32).astype(np.int64)  # computed in int32
    _write(dst, val if _dt.is_int(dst.dtype) else val.astype(np.float32))
    _count("gpsimd", F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def _int_exact(*ts):
    return all(t.dtype in (_dt.int32, _dt.uint32) for t in ts) and not any(
        t.buffer is psum for t in ts)


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """Element-wise ``dst = data1 op data2`` (§3.6); same partitions and elements/partition.

    fp32 math then one rounding; all-int32/uint32 operands (none in PSUM) run exactly in integer
    arithmetic on GpSimd. At most one input in PSUM. Bitvec ops need integer dtypes.
    """
    instr = "tensor_tensor"
    dst = _tensor(instr, "dst", dst)
    data1 = _tensor(instr, "data1", data1)
    data2 = _tensor(instr, "data2", data2)
    for n, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        _onchip(instr, n, t)
        _no_x4(instr, n, t)
    P, F = _same_pf(instr, dst, "dst", data1, "data1")
    _same_pf(instr, dst, "dst", data2, "data2")
    if data1.buffer is psum and data2.buffer is psum:
        raise _err(instr, "at most one of data1/data2 may be in PSUM")
    op = _op(instr, "op", op, ("arith", "bitvec"))
    exact = _int_exact(dst, data1, data2)
    default = "gpsimd" if (exact or op.name == "power") else "vector"
    eng = _engine_name(instr, engine, default, (_Engine.vector,
                                                _Engine.gpsimd))
    _psum_engine_rule(instr, eng, dst, data1, data2)
    a = data1._np().reshape(P, F)
    b = data2._np().reshape(P, F)
    if op.kind == "bitvec":
        for n, t in (("dst", dst), ("data1", data1), ("data2", data2)):
            if not _dt.is_int(t.dtype):
                raise _err(instr, f"bitvec op nl.{op.name} needs integer {n}, got {t.dtype}")
        res = op.fn(a.astype(np.int64), b.astype(np.int64))
        res = _wrap_int(res, dst.dtype)
    elif exact and op.name not in ("divide", "power"):
        with np.errstate(all="ignore"):
            res = op.fn(a.astype(np.int64), b.astype(np.int64))
    else:
        with np.errstate(all="ignore"):
            res = op.fn(a.astype(np.float32), b.astype(np.float32)).astype(np.float32)
    _write(dst, res)
    _count(eng, F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def _wrap_int(res, dtype):
    npdt = _dt.np_dtype(dtype)
    bits = npdt.itemsize * 8
    r = res.astype(np.int64) & ((1 << bits) - 1)
    return r.astype(np.dtype(f"uint{bits}")).view(npdt)


def _scalar_operand(instr, arg, v, P):
    """A compile-time scalar or a (P, 1) tile -> float32 array broadcastable to [P, F]."""
    if isinstance(v, NkiTensor):
        _onchip(instr, arg, v)
        if v.shape[0] != P or v.size != P:
            raise _err(instr, f"{arg} tile must be ({P}, 1), got {v.shape}")
        return v._np().reshape(P, 1)
    if isinstance(v, (int, float, np.integer, np.floating, bool)):
        return np.float32(v) if not isinstance(v, (int, np.integer)) else v
    raise _err(instr, f"{arg} must be a scalar or a ({P}, 1) tile, got {type(v).__name__}")


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, engine=engine.unknown, name=None):
    """``dst = (data op0 operand0) op1 operand1`` (§3.7); operands scalars or (P,1) tiles.

    Arithmetic in fp32 (exact for ints only below 2^24); bitvec ops (both ops) on raw integers.
    ``reverse`` swaps the operand order of that stage.
    """
    instr = "tensor_scalar"
    dst = _tensor(instr, "dst", dst)
    data = _tensor(instr, "data", data)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    _no_x4(instr, "dst", dst)
    _no_x4(instr, "data", data)
    P, F = _same_pf(instr, dst, "dst", data, "data")
    op0 = _op(instr, "op0", op0, ("arith", "bitvec"))
    if op1 is not None:
        op1 = _op(instr, "op1", op1, ("arith", "bitvec"))
        if (op0.kind == "bitvec") != (op1.kind == "bitvec"):
            raise _err(instr, "op0 and op1 must both be bitvec or both arithmetic")
    bitvec = op0.kind == "bitvec"
    eng = _engine_name(instr, engine, "vector", (_Engine.vector,
                                                 _Engine.scalar,
                                                 _Engine.gpsimd))
    if bitvec and eng != "vector":
        raise _err(instr, "bitvec ops run only on VectorE")
    # SDK stub nisa.tensor_scalar, ``engine``: "nki.isa.engine.gpsimd (only allowed for rsqrt)"
    if eng == "gpsimd" and any(o is not None and o.name != "rsqrt" for o in (op0, op1)):
        raise _err(instr, "engine=gpsimd is only allowed for rsqrt (SDK stub); got "
                   f"op0=nl.{op0.name}" + (f", op1=nl.{op1.name}" if op1 is not None else ""))
    if (eng == "scalar" and current().spec["nc_version"] < 4
            and any(o is not None and o.name not in ("multiply", "add") for o in (op0, op1))):
        raise _err(instr, "ScalarE on trn2 supports only multiply and add stages")
    _psum_engine_rule(instr, eng, dst, data)
    x = data._np().reshape(P, F)
    if bitvec:
        if not (_dt.is_int(data.dtype) and _dt.is_int(dst.dtype)):
            raise _err(instr, "bitvec ops need integer data and dst")
        x = x.astype(np.int64)
    else:
        x = x.astype(np.float32)

    def stage(x, op, v, rev, arg):
        o = _scalar_operand(instr, arg, v, P)
        if bitvec:
            o = np.asarray(o).astype(np.int64)
        else:
            o = np.asarray(o, dtype=np.float32) if not isinstance(o, np.ndarray) else o.astype(
                np.float32)
        if op.name == "bypass":
            return x
        with np.errstate(all="ignore"):
            r = op.fn(o, x) if rev else op.fn(x, o)
        return r if bitvec else r.astype(np.float32)

    res = stage(x, op0, operand0, reverse0, "operand0")
    if op1 is not None:
        if operand1 is None:
            raise _err(instr, "op1 given without operand1")
        res = stage(res, op1, operand1, reverse1, "operand1")
    if bitvec:
        res = _wrap_int(res, dst.dtype)
    _write(dst, res)
    _count(eng, F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


_REDUCE_OK = {"add", "subtract", "multiply", "maximum", "minimum", "logical_and", "logical_or",
              "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor"}


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """Reduce the trailing free ``axis`` (int or tuple ending at the last dim) of ``data`` (§3.8).

    fp32 arithmetic (pairwise order), ``negate`` multiplies by -1, then one rounding to dst.
    """
    instr = "tensor_reduce"
    dst = _tensor(instr, "dst", dst)
    data = _tensor(instr, "data", data)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    _no_x4(instr, "data", data)
    op = _op(instr, "op", op, ("arith", "bitvec"))
    if op.name not in _REDUCE_OK:
        raise _err(instr, f"nl.{op.name} is not a legal reduction op")
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    nd = data.ndim
    axes = tuple(sorted(int(a) % nd for a in axes))
    if 0 in axes:
        raise _err(instr, "cannot reduce the partition axis 0")
    if axes != tuple(range(nd - len(axes), nd)):
        raise _err(instr, f"axis {axis} must be the trailing free axes of a {nd}-D tensor")
    P = data.shape[0]
    keep = math.prod(data.shape[1:nd - len(axes)])
    red = math.prod(data.shape[nd - len(axes):])
    if dst.shape[0] != P or dst.size // max(P, 1) != keep:
        raise _err(instr, f"dst {dst.shape} does not hold the reduced shape ({P}, {keep})")
    x = data._np().reshape(P, keep, red)
    with np.errstate(all="ignore"):
        if op.kind == "bitvec":
            res = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
                   "bitwise_xor": np.bitwise_xor}[op.name].reduce(x.astype(np.int64), axis=-1)
        else:
            xf = x.astype(np.float32)
            n = op.name
            if n == "add":
                res = xf.sum(axis=-1, dtype=np.float32)
            elif n == "subtract":
                res = xf[..., 0] - xf[..., 1:].sum(axis=-1, dtype=np.float32)
            elif n == "multiply":
                res = xf.prod(axis=-1, dtype=np.float32)
            elif n == "maximum":
                res = xf.max(axis=-1)
            elif n == "minimum":
                res = xf.min(axis=-1)
            else:
                nz = xf != 0
                res = {"logical_and": nz.all(-1), "logical_or": nz.any(-1),
                       "logical_xor": (nz.sum(-1) % 2 == 1)}[n].astype(np.float32)
            if negate:
                res = -res
    _write(dst, res)
    _count("vector", keep * red + ENGINE_FIXED, P * keep * red)
    return NkiInstruction(name)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    """ScalarE ``dst = op(data * scale + bias)`` in fp32 (§3.9).

    ``scale``: scalar or (P,1) tile; ``bias``: (P,1) tile or scalar. Optional per-partition sum of
    the output into the engine's accumulation registers (``reduce_cmd``), read out into
    ``reduce_res`` (P,1). The function is the exact formula in fp32 (hardware uses
    piecewise-polynomial tables; see :mod:`.ops`).
    """
    instr = "activation"
    dst = _tensor(instr, "dst", dst)
    data = _tensor(instr, "data", data)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    _no_x4(instr, "data", data)
    P, F = _same_pf(instr, dst, "dst", data, "data")
    op = _op(instr, "op", op, ("act", "arith"))
    if op.kind == "arith" and op.name != "bypass":
        raise _err(instr, f"nl.{op.name} is not an activation function")
    if op.fn is None:
        raise _err(instr, f"nl.{op.name} is not supported by the interpreter")
    x = data._np().reshape(P, F).astype(np.float32)
    s = _scalar_operand(instr, "scale", scale, P)
    with np.errstate(all="ignore"):
        x = (x * np.asarray(s, dtype=np.float32)).astype(np.float32)
        if bias is not None:
            x = (x + np.asarray(_scalar_operand(instr, "bias", bias, P), dtype=np.float32)).astype(
                np.float32)
        out = (x if op.name == "bypass" else op.fn(x)).astype(np.float32)
    ctx = current()
    cmd = reduce_cmd
    if cmd is not _ReduceCmd.idle or reduce_res is not None:
        if reduce_op is not None:
            _op(instr, "reduce_op", reduce_op, ("arith",))
            if reduce_op.name != "add":
                raise _err(instr, "reduce_op must be nl.add")
        regs = ctx.act_registers
        if cmd in (_ReduceCmd.reset, _ReduceCmd.reset_reduce):
            regs[:P] = 0
        if cmd in (_ReduceCmd.reduce, _ReduceCmd.reset_reduce,
                   _ReduceCmd.load_reduce):
            regs[:P] = regs[:P] + out.sum(axis=1, dtype=np.float32)
        if reduce_res is not None:
            reduce_res = _tensor(instr, "reduce_res", reduce_res)
            if reduce_res.shape[0] != P or reduce_res.size != P:
                raise _err(instr, f"reduce_res must be ({P}, 1), got {reduce_res.shape}")
    _write(dst, out)
    if reduce_res is not None:
        _write(reduce_res, ctx.act_registers[:P].copy())
    _count("scalar", F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd.reset_reduce`` (§3.9)."""
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op,
                      reduce_res=reduce_res, reduce_cmd=reduce_cmd.reset_reduce, name=name)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """``dst[j, i] = data[i, j]`` (free dims flattened), bit-exact (§3.10).

    TensorE (dst in PSUM, data in SBUF, <= [128, 128]) or VectorE (<= [32, 32]); the default
    engine follows dst: PSUM -> TensorE, SBUF -> VectorE.
    """
    instr = "nc_transpose"
    dst = _tensor(instr, "dst", dst)
    data = _tensor(instr, "data", data)
    _onchip(instr, "dst", dst)
    _onchip(instr, "data", data)
    if dst.dtype != data.dtype:
        raise _err(instr, f"dst dtype {dst.dtype} != data dtype {data.dtype}")
    default = "tensor" if dst.buffer is psum else "vector"
    eng = _engine_name(instr, engine, default, (_Engine.tensor,
                                                _Engine.vector))
    P, F = _pf(data)
    Pd, Fd = _pf(dst)
    if (Pd, Fd) != (F, P):
        raise _err(instr, f"dst {dst.shape} must be the transpose ({F}, {P}) of data {data.shape}")
    if eng == "tensor":
        if dst.buffer is not psum or data.buffer is not sbuf:
            raise _err(instr, "TensorE transpose reads SBUF and writes PSUM")
        if P > 128 or F > 128:
            raise _err(instr, f"TensorE transpose is limited to [128, 128], got [{P}, {F}]")
    else:
        if P > 32 or F > 32:
            raise _err(instr, f"VectorE transpose is limited to [32, 32], got [{P}, {F}]")
    val = data._np().reshape(P, F).T
    dst._np()[...] = val.reshape(dst.shape)
    if dst.storage.written is not None:
        dst._written_flags()[...] = 1
    dst.storage.version += 1
    if eng == "tensor":
        _count("tensor", P + TENSOR_FIXED, P * F)
    else:
        _count("vector", F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Cross-partition move inside each 32-partition quadrant (§3.14).

    Output partition ``32q + i`` copies input partition ``32q + mask[i]`` (255 = leave it); a
    1-partition src broadcasts.
    """
    instr = "nc_stream_shuffle"
    dst = _tensor(instr, "dst", dst)
    src = _tensor(instr, "src", src)
    _onchip(instr, "dst", dst)
    _onchip(instr, "src", src)
    if src.dtype != dst.dtype:
        raise _err(instr, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32:
        raise _err(instr, f"shuffle_mask needs 32 entries, got {len(mask)}")
    Ps, Fs = _pf(src)
    Pd, Fd = _pf(dst)
    if Fs != Fd:
        raise _err(instr, f"src has {Fs} elements per partition, dst {Fd}")
    sv = src._np().reshape(Ps, Fs).copy()
    out = dst._np().reshape(Pd, Fd) if dst._np().flags.c_contiguous else None
    res = dst._np().reshape(Pd, Fd).copy()
    nq = -(-max(Ps, Pd) // 32)
    for q in range(nq):
        for i, m in enumerate(mask):
            p = 32 * q + i
            if m == 255 or p >= Pd:
                continue
            sp = 32 * q + m if Ps > 1 else 0
            if sp >= Ps:
                raise _err(instr, f"mask[{i}]={m} reads src partition {sp} of {Ps}")
            res[p] = sv[sp]
    if out is not None:
        out[...] = res
    else:
        dst._np()[...] = res.reshape(dst.shape)
    if dst.storage.written is not None:
        dst._written_flags()[...] = 1
    dst.storage.version += 1
    _count("vector", Fd + ENGINE_FIXED, Pd * Fd)
    return NkiInstruction(name)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value,
                  cmp_op=None, offset=0, name=None):
    """GpSimd ``dst = on_true_tile where cmp_op(affine, 0) else on_false_value`` (§3.15)."""
    instr = "affine_select"
    dst = _tensor(instr, "dst", dst)
    on_true_tile = _tensor(instr, "on_true_tile", on_true_tile)
    _onchip(instr, "dst", dst, (sbuf,))
    P, F = _same_pf(instr, dst, "dst", on_true_tile, "on_true_tile")
    cmp_op = TOKENS["equal"] if cmp_op is None else _op(instr, "cmp_op", cmp_op, ("arith",))
    pat = [(int(s), int(n)) for s, n in pattern]
    from .core import _pattern_index

    free = _pattern_index(tuple(n for _, n in pat), [s for s, _ in pat]).reshape(1, -1)
    if free.shape[1] != F:
        raise _err(instr, f"pattern covers {free.shape[1]} elements, dst has {F}")
    val = (int(offset) + np.arange(P)[:, None] * int(channel_multiplier) + free).astype(np.float32)
    pred = cmp_op.fn(val, np.float32(0)) != 0
    res = np.where(pred, on_true_tile._np().reshape(P, F).astype(np.float32),
                   np.float32(on_false_value))
    _write(dst, res)
    _count("gpsimd", F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """VectorE: copy ``src`` (tile or scalar) into ``dst`` where ``predicate`` != 0 (§3.15)."""
    instr = "tensor_copy_predicated"
    dst = _tensor(instr, "dst", dst)
    predicate = _tensor(instr, "predicate", predicate)
    _onchip(instr, "dst", dst)
    P, F = _same_pf(instr, dst, "dst", predicate, "predicate")
    pred = predicate._np().reshape(P, F) != 0
    if reverse_pred:
        pred = ~pred
    old = dst._np().reshape(P, F).astype(np.float32)
    if isinstance(src, NkiTensor):
        _same_pf(instr, dst, "dst", src, "src")
        new = src._np().reshape(P, F).astype(np.float32)
    else:
        new = np.float32(src)
    _write(dst, np.where(pred, new, old))
    _count("vector", F + ENGINE_FIXED, P * F)
    return NkiInstruction(name)


# ------------------------------------------------------------------------------------------------
# TensorE


def _accumulate_write(instr, dst, res, accumulate):
    """Write a matmul result into PSUM: overwrite, add, or auto (first write overwrites)."""
    out = dst._np()
    res = res.reshape(dst.shape)
    flags = dst._written_flags()
    if accumulate is None:
        written = flags != 0
        if written.any():
            old = out.astype(np.float32)
            res = np.where(written, (old + res).astype(np.float32), res)
    elif accumulate:
        if not (flags != 0).all():
            raise _err(instr, "accumulate=True onto an uninitialized PSUM location")
        res = (out.astype(np.float32) + res).astype(np.float32)
    out[...] = _cast(res, dst.dtype)
    flags[...] = 1
    dst.storage.version += 1


def _matmul_dst(instr, dst, M, N, nc):
    if dst.buffer is not psum:
        raise _err(instr, f"dst must be in PSUM, got {dst.buffer.value}")
    if dst.dtype not in (_dt.float32, _dt.bfloat16):
        raise _err(instr, f"dst dtype must be float32 or bfloat16, got {dst.dtype}")
    if dst.dtype == _dt.bfloat16 and nc < 4:
        raise _err(instr, "a bfloat16 PSUM dst needs trn3")
    Pd, Fd = _pf(dst)
    if (Pd, Fd) != (M, N):
        raise _err(instr, f"dst {dst.shape} must be [{M}, {N}]")
    if nc < 4:
        start = (dst.boffset % dst.storage.pbytes) % 2048 if dst.storage.pbytes else 0
        if start + N * dst.itemsize > 2048:
            raise _err(instr, f"dst of {N} x {dst.itemsize} B per partition starting {start} B "
                       "into a bank crosses the 2 KiB PSUM bank (trn2: one bank per matmul)")
    else:
        limit = 4096 if dst.dtype == _dt.float32 else 8192
        if N > limit:
            raise _err(instr, f"moving free size {N} exceeds {limit} ({dst.dtype} dst, "
                       "8 PSUM banks)")


_MM_IN = {_dt.bfloat16, _dt.float16, _dt.float32, _dt.tfloat32, _dt.float8_e4m3,
          _dt.float8_e5m2, _dt.float8_e4m3fn}


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    """TensorE ``dst[M, N] (=|+=) stationary[K, M]^T @ moving[K, N]`` (§3.11).

    K <= 128 partitions, M <= 128, N <= 512 (trn2) / 4096 fp32 / 8192 bf16 (trn3). Products and
    sums in fp32 (``MATMUL_PRECISION``), one rounding per instruction; ``accumulate=None`` adds
    onto PSUM locations already written since allocation. ``is_transpose=True``: bit-exact
    transpose of ``moving`` (stationary must be identity-shaped).
    """
    instr = "nc_matmul"
    dst = _tensor(instr, "dst", dst)
    stationary = _tensor(instr, "stationary", stationary)
    moving = _tensor(instr, "moving", moving)
    _onchip(instr, "stationary", stationary, (sbuf,))
    _onchip(instr, "moving", moving, (sbuf,))
    nc = current().spec["nc_version"]
    for n, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in _MM_IN or (t.dtype == _dt.float8_e4m3fn and nc < 4):
            raise _err(instr, f"{n} dtype {t.dtype} not supported on this target")
    if {stationary.dtype, moving.dtype} == {_dt.float8_e4m3, _dt.float8_e4m3fn}:
        raise _err(instr, "legacy float8_e4m3 and float8_e4m3fn operands cannot be mixed")
    if (stationary.dtype in (_dt.float32, _dt.tfloat32)) != (moving.dtype in (_dt.float32,
                                                                             _dt.tfloat32)):
        raise _err(instr, "fp32/tf32 operands can only be multiplied with fp32/tf32")
    K, M = _pf(stationary)
    K2, N = _pf(moving)
    if K != K2:
        raise _err(instr, f"stationary has {K} partitions, moving {K2} (contraction must match)")
    if M > 128:
        raise _err(instr, f"stationary free size {M} > 128")
    if nc < 4 and N > 512:
        raise _err(instr, f"moving free size {N} > 512 on trn2")
    _check_tiling(instr, tile_position, tile_size, K, M, row_only=False)
    if is_transpose:
        if dst.dtype != moving.dtype:
            raise _err(instr, "is_transpose needs dst dtype == moving dtype")
        _onchip(instr, "dst", dst, (psum,))
        if _pf(dst) != (N, K):
            raise _err(instr, f"transpose dst must be [{N}, {K}]")
        dst._np()[...] = moving._np().reshape(K, N).T.reshape(dst.shape)
        dst._written_flags()[...] = 1
        dst.storage.version += 1
        _count("tensor", N + TENSOR_FIXED, K * N)
        return NkiInstruction(name)
    _matmul_dst(instr, dst, M, N, nc)
    prec = np.float64 if MATMUL_PRECISION["value"] == "float64" else np.float32
    a = stationary._np().reshape(K, M).astype(prec)
    b = moving._np().reshape(K, N).astype(prec)
    res = _mm(a, b)
    _accumulate_write(instr, dst, res, accumulate)
    _count("tensor", N + TENSOR_FIXED, K * M * N, macs_bf16=K * M * N)
    return NkiInstruction(name)


def _view_key(t):
    st = t.storage
    return (st.uid, st.version, t.boffset, t.shape, t.bstrides, t.dtype)


# MX scale packing (NKI_API.md §4.5): a scale view may start at offset 0, 4, 8 or 12 inside a
# quadrant, so up to four operands share one scale tile. The offset rule is the ISA's; the
# provenance check below catches a kernel that packs wrongly (two operands' scales in one slot, or
# a matmul reading another slot): quantize_mx records, per x4 element it writes, the word and the
# scale byte of its group (shadow arrays of the data storage); nc_matmul_mx then requires the
# scale view to hold that byte for every element whose word is still the one quantize_mx wrote
# (data rewritten since, e.g. by DMA, is not checked).
CHECK_SCALE_PACKING = {"value": True}
SCALE_OFFSETS = (0, 4, 8, 12)
_MX_META: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Storage -> (words, scales)


def _scale_offset_ok(instr, arg, scale):
    """A scale view starts at partition offset 0/4/8/12 of its quadrant (§4.5)."""
    if not CHECK_SCALE_PACKING["value"]:
        return
    p0 = _start_partition(scale)
    if p0 % 32 not in SCALE_OFFSETS:
        raise _err(instr, f"{arg} view starts at partition {p0} (offset {p0 % 32} inside its "
                   "quadrant); MX scale views start at offset 0, 4, 8 or 12 of a quadrant")


def _shadow(meta_arr, t) -> np.ndarray:
    return np.ndarray(t.shape, np.uint32, buffer=meta_arr, offset=t.boffset, strides=t.bstrides)


def _record_quantized(dst, scale, P, C):
    """quantize_mx wrote ``dst`` ([P, C] x4 words) with group scales ``scale`` [P/8, C]."""
    if not CHECK_SCALE_PACKING["value"] or dst.itemsize != 4:
        return
    st = dst.storage
    meta = _MX_META.get(st)
    if meta is None:
        meta = _MX_META[st] = (np.zeros_like(st.data), np.zeros_like(st.data))
    _shadow(meta[0], dst)[...] = dst._np_as(np.uint32)
    exp = np.repeat(np.asarray(scale, np.uint32), 8, axis=0) | np.uint32(0x100)
    _shadow(meta[1], dst)[...] = exp.reshape(dst.shape)


def _check_scale_provenance(instr, arg, data, sc_rows, P, C):
    """The scale bytes an MX matmul reads (``sc_rows`` [P/8, C]) are those quantize_mx wrote for
    the data's groups (where the data still holds quantize_mx's words)."""
    if not CHECK_SCALE_PACKING["value"] or data.itemsize != 4:
        return
    meta = _MX_META.get(data.storage)
    if meta is None:
        return
    words = _shadow(meta[0], data).reshape(P, C)
    exp = _shadow(meta[1], data).reshape(P, C)
    valid = ((exp >> 8) & 1).astype(bool) & (data._np_as(np.uint32).reshape(P, C) == words)
    got = np.repeat(np.asarray(sc_rows, np.uint32), 8, axis=0)
    bad = valid & ((exp & 0xFF) != got)
    if bad.any():
        p, c = (int(v[0]) for v in np.nonzero(bad))
        raise _err(instr, f"{arg}_scale does not hold the scales quantize_mx wrote for {arg} "
                   f"(first at data partition {p}, column {c}: scale byte {int(got[p, c])}, "
                   f"quantize_mx wrote {int(exp[p, c] & 0xFF)}); another operand's scales "
                   "overwrote them or the view reads another packing slot")


def _dequant_operand(instr, arg, data, scale, P, C, prec):
    """[P*4, C] dequantized operand (contraction rows p*4+i), cached per program instance
    until either storage is written again (tiles reused across instructions dequantize once)."""
    cache = current().deq_cache
    key = (_view_key(data), _view_key(scale), prec)
    hit = cache.get(key)
    if hit is not None:
        return hit
    _scale_offset_ok(instr, f"{arg}_scale", scale)
    sc, rows = _scale_view_rows(instr, f"{arg}_scale", scale, P, C)
    _check_scale_provenance(instr, arg, data, sc[rows], P, C)
    v = mxops.dequantize_x4(data._np().reshape(P, C), data.dtype, sc[rows], prec)
    v = np.ascontiguousarray(v.transpose(0, 2, 1)).reshape(P * 4, C)
    if len(cache) >= 8:
        cache.pop(next(iter(cache)))
    cache[key] = v
    return v


def _check_tiling(instr, tile_position, tile_size, K, M, row_only):
    """PE-array tiling (§3.11/§3.13): both or neither; sizes 32/64/128, aligned positions, the
    operands must fit the tile (rows = contraction partitions, cols = stationary columns)."""
    if not tile_position and not tile_size:
        return
    if not tile_position or not tile_size:
        raise _err(instr, "tile_position and tile_size must be given together")
    (r, c), (rs, cs) = tuple(tile_position), tuple(tile_size)
    if rs not in (32, 64, 128) or cs not in (32, 64, 128):
        raise _err(instr, f"tile_size {tile_size} must use 32, 64 or 128")
    if row_only and (cs != 128 or c != 0):
        raise _err(instr, "nc_matmul_mx tiles rows only: tile_size=(rows, 128), "
                   "tile_position=(row, 0)")
    if r % rs or c % cs or r + rs > 128 or c + cs > 128:
        raise _err(instr, f"tile_position {tile_position} not aligned to tile_size {tile_size}")
    if K > rs or M > cs:
        raise _err(instr, f"operands ({K} partitions, {M} columns) exceed tile_size {tile_size}")


def _start_partition(t) -> int:
    pb = t.storage.pbytes
    return t.boffset // pb if pb else 0


CHECK_MX_PLACEMENT = {"value": True}


def _mx_placement(instr, stationary, moving, dst, tile_position):
    """PE placement of an MX matmul (SDK stub ``nc_matmul_mx``, "Tiling Mode").

    The contraction runs over the PE rows, which read the operands' SBUF partitions: without
    tiling the full array is used (``tile_position=(0, 0)``), so both operands start at partition
    0; an operand at partition 32/64/96 needs row tiling with ``start_row`` equal to its start
    partition. Only row tiling exists for ``nc_matmul_mx`` (``start_column`` must be 0), and the
    stationary's columns land on PSUM partitions from ``start_column`` on (column tiling of
    ``nc_matmul``, nki-library ``mlp_tkg_down_projection.py``), so ``dst`` starts at partition 0.
    """
    if not CHECK_MX_PLACEMENT["value"]:
        return
    row = int(tuple(tile_position)[0]) if tile_position else 0
    for arg, t in (("stationary", stationary), ("moving", moving)):
        p0 = _start_partition(t)
        if p0 != row:
            hint = (f"pass tile_position=({p0}, 0), tile_size=(rows, 128)" if p0 else
                    "place the operand at the row tile's partitions")
            raise _err(instr, f"{arg} starts at partition {p0} but the PE row tile starts at "
                       f"row {row} (tile_position={tile_position!r}); {hint}")
    if _start_partition(dst) != 0:
        raise _err(instr, f"dst starts at partition {_start_partition(dst)}; nc_matmul_mx has "
                   "only row tiling (start_column 0), so its output starts at PSUM partition 0")


def _mm(a_KM: np.ndarray, b_KN: np.ndarray) -> np.ndarray:
    """``a^T @ b`` in the operands' precision (torch BLAS), rounded once to float32."""
    import torch

    r = torch.from_numpy(a_KM).T @ torch.from_numpy(np.ascontiguousarray(b_KN))
    return r.numpy().astype(np.float32)


def _need_mx(instr):
    if not current().spec["has_mx"]:
        raise _err(instr, f"MX instructions exist only on trn3 (NeuronCore-v4); target is "
                   f"{current().target}")


def _scale_view_rows(instr, arg, scale, P, C):
    """Read the [P/8, C] scale bytes of an operand from its scale view (§4.5)."""
    if scale.dtype not in (_dt.float8_e8m0fnu, _dt.uint8):
        raise _err(instr, f"{arg} dtype must be float8_e8m0fnu or uint8, got {scale.dtype}")
    if scale.buffer is not sbuf:
        raise _err(instr, f"{arg} must be in SBUF")
    G = P // 8
    rows = mxops.scale_rows(G)
    Ps, Fs = _pf(scale)
    if Fs != C:
        raise _err(instr, f"{arg} has {Fs} elements per partition, data has {C} x4 columns")
    if rows[-1] >= Ps:
        raise _err(instr, f"{arg} view has {Ps} partitions; {G} scale rows need partition "
                   f"{rows[-1]} (rows 0-3 of each 32-partition quadrant)")
    return scale._np_as(np.uint8).reshape(Ps, C), rows


def quantize_mx(dst, src, dst_scale, name=None):
    """Quantize a BF16/FP16 [P, F] tile to MXFP8 x4 data [P, F/4] and E8M0 scales (§3.12).

    Group = 8 partitions x 4 consecutive free elements (one x4 column). Scale rule and cast from
    ``common.mx`` (``scale_rule="trainium"``): ``X = 2^(floor(log2 amax) - (emax - 1))``, zero
    group -> byte 0. Scales land at partitions ``32*(r//4) + r%4`` of ``dst_scale``.

    Raises:
        NkiError: not trn3; P % 32 != 0 or P > 128; F % 4 != 0; dtypes or shapes wrong; the
            scale view starts at an offset other than 0/4/8/12 of a quadrant (§4.5).
    """
    instr = "quantize_mx"
    _need_mx(instr)
    dst = _tensor(instr, "dst", dst)
    src = _tensor(instr, "src", src)
    dst_scale = _tensor(instr, "dst_scale", dst_scale)
    _onchip(instr, "dst", dst, (sbuf,))
    _onchip(instr, "src", src, (sbuf,))
    _onchip(instr, "dst_scale", dst_scale, (sbuf,), start_rule=False)
    if src.dtype not in (_dt.bfloat16, _dt.float16):
        raise _err(instr, f"src dtype must be bfloat16 or float16, got {src.dtype}")
    if dst.dtype not in (_dt.float8_e4m3fn_x4, _dt.float8_e5m2_x4):
        raise _err(instr, f"dst dtype must be float8_e4m3fn_x4 or float8_e5m2_x4, got {dst.dtype}")
    P, F = _pf(src)
    if P % 32 or P > 128:
        raise _err(instr, f"src partitions {P} must be a multiple of 32 and <= 128")
    if F % 4:
        raise _err(instr, f"src free size {F} must be a multiple of 4")
    Pd, Fd = _pf(dst)
    if (Pd, Fd) != (P, F // 4):
        raise _err(instr, f"dst {dst.shape} must hold [{P}, {F // 4}] x4 elements")
    _scale_offset_ok(instr, "dst_scale", dst_scale)
    sc_arr, rows = _scale_view_rows(instr, "dst_scale", dst_scale, P, F // 4)
    x = src._np().reshape(P, F).astype(np.float32)
    words, scale = mxops.quantize_groups(x, mxops.ELEM_OF_X4[dst.dtype])
    dst._np()[...] = words.reshape(dst.shape)
    dst.storage.version += 1
    sc_arr[rows, :] = scale
    _record_quantized(dst, scale, P, F // 4)
    dst_scale.storage.version += 1
    _count("vector", F / 4 + ENGINE_FIXED, P * F, lane_rate=1.0)  # 4x mode in F / 4
    return NkiInstruction(name)


_X4_DT = (_dt.float8_e4m3fn_x4, _dt.float8_e5m2_x4, _dt.float4_e2m1fn_x4)


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None,
                 tile_size=None, accumulate=None, name=None):
    """TensorE MX matmul ``dst[M, N] (=|+=) sum_{p, i} deq(S)[p, m, i] * deq(Mv)[p, n, i]`` (§3.13).

    stationary [P, M] and moving [P, N] x4 tiles (P % 32 == 0, P <= 128, M even <= 128,
    N <= 4096 fp32 / 8192 bf16 dst), scale views [>= P/8 rows, M] / [.., N] in the quadrant
    layout. Dequantization is exact; the sum runs in fp32 (``MATMUL_PRECISION``) and is rounded
    once per instruction; ``accumulate=None`` auto-detects the first write to each PSUM element.
    Scale views may start at offset 0/4/8/12 of a quadrant (scale packing, §4.5); a view that
    does not hold the scales ``quantize_mx`` wrote for the data (packing slots overlapping or
    mixed up) raises.
    """
    instr = "nc_matmul_mx"
    _need_mx(instr)
    dst = _tensor(instr, "dst", dst)
    stationary = _tensor(instr, "stationary", stationary)
    moving = _tensor(instr, "moving", moving)
    stationary_scale = _tensor(instr, "stationary_scale", stationary_scale)
    moving_scale = _tensor(instr, "moving_scale", moving_scale)
    for n, t in (("stationary", stationary), ("moving", moving)):
        _onchip(instr, n, t, (sbuf,))
        if t.dtype not in _X4_DT:
            raise _err(instr, f"{n} dtype must be an MX x4 dtype, got {t.dtype}")
    P, M = _pf(stationary)
    P2, N = _pf(moving)
    if P != P2:
        raise _err(instr, f"stationary has {P} partitions, moving {P2}")
    if P % 32 or P > 128:
        raise _err(instr, f"partitions {P} must be a multiple of 32 and <= 128")
    if M % 2 or M > 128:
        raise _err(instr, f"stationary free size {M} must be even and <= 128")
    if P not in (32, 64, 128):
        # nki-library output_projection_cte_parameters.py: "nc_matmul_mx supports partition dim
        # of 32, 64, 128 but not 96"
        raise _err(instr, f"partitions {P} must be 32, 64 or 128 (96 is not supported)")
    _check_tiling(instr, tile_position, tile_size, P, M, row_only=True)
    _mx_placement(instr, stationary, moving, dst, tile_position)
    _matmul_dst(instr, dst, M, N, current().spec["nc_version"])
    prec = np.float64 if MATMUL_PRECISION["value"] == "float64" else np.float32
    a = _dequant_operand(instr, "stationary", stationary, stationary_scale, P, M, prec)
    b = _dequant_operand(instr, "moving", moving, moving_scale, P, N, prec)
    res = _mm(a, b)
    _accumulate_write(instr, dst, res, accumulate)
    _count("tensor", N + TENSOR_FIXED, 4 * P * M * N, macs_mx=4 * P * M * N)
    return NkiInstruction(name)


# ------------------------------------------------------------------------------------------------
# LNC2 communication


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma,
             name=None):
    """Send this core's SBUF ``src`` to core ``send_to_rank``'s ``dst``; receive the peer's
    ``src`` from ``recv_from_rank`` into this core's ``dst`` (§3.16). Same dtype and shape.
    """
    instr = "sendrecv"
    src = _tensor(instr, "src", src)
    dst = _tensor(instr, "dst", dst)
    _onchip(instr, "src", src, (sbuf,), start_rule=False)
    _onchip(instr, "dst", dst, (sbuf,), start_rule=False)
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise _err(instr, f"src {src.shape}/{src.dtype} and dst {dst.shape}/{dst.dtype} must match")
    ctx = current()
    if ctx.num_programs < 2:
        raise _err(instr, "needs LNC2 (two program instances)")
    me = ctx.program_id
    for r, n in ((send_to_rank, "send_to_rank"), (recv_from_rank, "recv_from_rank")):
        if int(r) not in range(ctx.num_programs) or int(r) == me:
            raise _err(instr, f"{n}={r} must be the other core's rank")
    import queue

    sh = ctx.shared
    sh.mailbox((pipe_id, me, int(send_to_rank))).put(src._np().copy())
    box = sh.mailbox((pipe_id, int(recv_from_rank), me))
    waited = 0.0
    while True:
        try:
            val = box.get(timeout=0.2)
            break
        except queue.Empty:
            waited += 0.2
            if sh.barrier.broken:
                raise NkiBarrierError(f"nisa.{instr}: core {recv_from_rank} will not send "
                                      f"({sh.barrier.broken})") from None
            if waited >= sh.timeout_s:
                sh.barrier.abort(f"sendrecv timed out after {sh.timeout_s} s")
                raise NkiBarrierError(f"nisa.{instr}: timed out waiting for core "
                                      f"{recv_from_rank} on pipe {pipe_id}") from None
    dst._np()[...] = val
    dst.storage.version += 1
    _count("dma", 0, dst.size, dma_bytes=dst.size * dst.itemsize,
           dma=(src, dst, False))
    return NkiInstruction(name)


def core_barrier(data, cores, engine=engine.gpsimd, name=None):
    """Both cores of ``cores=(0, 1)`` wait for each other (§3.16); a no-op under LNC1."""
    instr = "core_barrier"
    if tuple(cores) != (0, 1):
        raise _err(instr, f"cores must be (0, 1), got {cores!r}")
    ctx = current()
    if ctx.num_programs > 1:
        ctx.shared.barrier.wait(ctx.shared.timeout_s, f"nisa.{instr}")
    return NkiInstruction(name)


# ------------------------------------------------------------------------------------------------
# Registers (§3.17): scalar values of the engine sequencers, for dynamic loops and scalar offsets


class VirtualRegister:
    """A 32-bit sequencer register (``nisa.register_alloc``); ``value`` is a Python int."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = 4 if value is None else int(value)  # uninitialized: the int sentinel

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"

    def __index__(self):
        raise TypeError("a VirtualRegister cannot be used in Python control flow or indexing; "
                        "use nl.dynamic_range / nl.fori_loop / scalar_offset")

    __bool__ = __index__
    __int__ = __index__


def _reg(instr, arg, r):
    if not isinstance(r, VirtualRegister):
        raise _err(instr, f"{arg} must be a VirtualRegister (nisa.register_alloc), got {r!r}")
    return r


def _wrap32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def register_alloc(x=None) -> VirtualRegister:
    """A new register, initialized with int ``x`` (or the sentinel 4)."""
    if x is not None and not isinstance(x, (int, np.integer)):
        raise _err("register_alloc", f"x must be an int or None, got {x!r}")
    return VirtualRegister(None if x is None else _wrap32(int(x)))


def register_move(dst, src):
    """``dst = src`` (a compile-time int or another register)."""
    dst = _reg("register_move", "dst", dst)
    if isinstance(src, VirtualRegister):
        dst.value = src.value
    elif isinstance(src, (int, np.integer)):
        dst.value = _wrap32(int(src))
    else:
        raise _err("register_move", f"src must be an int or a VirtualRegister, got {src!r}")


def register_load(dst, src):
    """Load the single 32-bit integer element of ``src`` (HBM or SBUF) into ``dst``.

    Raises:
        NkiError: ``src`` has more than one element or a non-integer dtype (a register load moves
            raw 32-bit words; load an int32 tile).
    """
    instr = "register_load"
    dst = _reg(instr, "dst", dst)
    src = _tensor(instr, "src", src)
    if src.size != 1:
        raise _err(instr, f"src must hold exactly one element, got shape {src.shape}")
    if not _dt.is_int(src.dtype) or src.itemsize > 4:
        raise _err(instr, f"src dtype must be a <= 32-bit integer type, got {src.dtype}")
    dst.value = int(src._np().reshape(-1)[0])


def register_store(dst, src):
    """Store register ``src`` into the single element of ``dst`` (integer dtype)."""
    instr = "register_store"
    dst = _tensor(instr, "dst", dst)
    src = _reg(instr, "src", src)
    if dst.size != 1 or not _dt.is_int(dst.dtype):
        raise _err(instr, f"dst must be a one-element integer tensor, got {dst.shape} {dst.dtype}")
    _write(dst, np.array([src.value], dtype=np.int64))
