"""MX (microscaling) numerics shared by every backend: quantize, dequantize, reference MX matmul.

An MX block is ``block_size`` elements along the contraction axis that share one power-of-two scale
``X = 2^(b - 127)`` stored as an E8M0 byte ``b`` (byte 255 = NaN). The elements are ``V / X`` rounded
to nearest-even in the element format (FP8 E4M3, FP8 E5M2 or FP4 E2M1) after clamping to ±max, so
every element cast saturates. Sources: OCP Microscaling Formats (MX) v1.0 spec §5-§6.3 and Table 1;
REFERENCE.md §4; NKI_API.md §3.12 and §4.4-§4.6.

Scale rules (``scale_rule``), with ``amax = max |V|`` over the group:

* ``"ocp"``: ``X = 2^(floor(log2 amax) - emax_elem)`` (OCP v1.0 §6.3; torchao ``FLOOR``).
  Elements may saturate (e.g. amax 500 in E4M3: 500 / 2^0 → 448).
* ``"rceil"``: ``X = 2^ceil(log2(amax / max_elem))`` with ``amax / max_elem`` computed once in the
  input's compute precision (fp32, or fp64 for fp64 input) and the ceiling taken exactly, as
  Blackwell's ``cvt.rp.satfinite.ue8m0x2.f32`` and cuBLAS do. Elements never exceed max_elem.
* ``"trainium"``: ``X = 2^(floor(log2 amax) - (emax_elem - 1))``, one binade more than ``"ocp"``,
  as NKI ``nisa.quantize_mx`` does (NKI_API.md §3.12): |V / X| < 2·2^emax_elem before rounding,
  so E4M3 elements are at most 256 after rounding (255.9 rounds to 256) and never saturate.

For every rule: an all-zero group gets byte 0 (``X = 2^-127``); an exponent below -127 is clamped to
-127 (byte 0) and the elements are still computed as ``V / 2^-127`` (tiny elements flush to 0 by
the element rounding); an exponent above 127 (only reachable with fp64 input, amax ≳ 2^135) gives
byte 255, as OCP's reference code (microsoft/microxcaling ``_quantize_mx``) does.

NaN / Inf policy (OCP v1.0: "if X is NaN, every element of the block is NaN regardless of P_i"; the
spec's reference code maps a NaN or Inf amax to a NaN scale). A group holding any NaN or ±Inf gets
scale byte 255; its FP8 elements are stored as NaN and its FP4 elements (E2M1 has no NaN) as +0, so
:func:`dequantize_mx` returns NaN for the whole group.

Where torchao 0.18 (``torchao.prototype.mx_formats.mx_tensor.to_mx``) differs (everything else,
data and scale bits, matches for e4m3 / e5m2 / fp4 on fp32 and bf16 input; tests/test_mx.py):

1. Byte-0 groups with nonzero elements (amax < 2^(emax-126) with "ocp", amax ≤ max·2^-127 with
   "rceil"): torchao ``FLOOR`` divides by 2^-126 (its ``F32_MIN_NORMAL`` clamp) and ``RCEIL``
   multiplies by 1.0; both store elements that do not decode to V under the byte-0 scale. We use
   the scale the byte encodes, 2^-127, as OCP's reference code does.
2. Inf without NaN: torchao ``FLOOR`` derives a finite scale from Inf's exponent field (byte 247 for
   E4M3) and saturates; torchao ``RCEIL`` gives byte 254. We give byte 255 (OCP).
3. NaN: torchao also gives byte 255 but its element bits differ (FLOOR stores 0 for the finite
   elements); the group decodes to NaN either way.
4. ``"rceil"`` in eager torchao takes ``ceil(torch.log2(amax / max))`` in fp32, which rounds
   ``log2`` of a value within ~2^-17 relative above a power of two down to that power (e.g.
   amax = 448·2^5·(1 + 2^-23) gives 2^5 instead of 2^6). We take the exact ceiling, as Blackwell's
   ``cvt.rp`` (and torchao's own compiled SM100 path) does; bf16 inputs never hit the difference.

FP4 (E2M1) data are packed two per uint8 along ``axis``: element ``2i`` in the low nibble and
``2i + 1`` in the high nibble of byte ``i`` (torchao ``pack_uint4`` order, NKI_API.md §4.4).
Nibble codes are E2M1 bit patterns (sign bit 3, exponent bits 2-1, mantissa bit 0).

Layouts (``layout``): ``"contiguous"``: group ``g`` = elements ``[g·B, (g+1)·B)`` along ``axis``.
``"wrapx"`` (Trainium WRAPX, NKI_API.md §4.6, block_size must be 32, axis length K a multiple of
128): K is cut into 512-wide tiles from the start, then a remainder ``K % 512`` into a 256-wide tile
(if ≥ 256) and a 128-wide tile (if 128 remains). In a tile of width TK starting at ``k0``, with
``vs = TK / 4``, group ``g`` (``g < vs / 8``) is ``{k0 + i·vs + 8g + j : i < 4, j < 8}``. Scale
index ``s`` along ``axis`` enumerates groups tile-major, then ``g``; :func:`wrapx_permutation` gives
the element order. Data keep the input's element positions in both layouts.

Element rounding uses library casts: torch ``.to(float8_*)`` for FP8 (after a clamp, since
ml_dtypes returns NaN on overflow while torch saturates) and ``ml_dtypes.float4_e2m1fn`` for FP4
(computed on the CPU). fp64 input is first rounded to fp32 with round-to-odd, which makes the
following fp32 → element rounding a correct single rounding of the fp64 value (torch and ml_dtypes
both cast fp64 through fp32 and would double-round).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

__all__ = [
    "E8M0_BIAS",
    "E8M0_NAN",
    "ELEMENT_FORMATS",
    "LAYOUTS",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_MIN_GLOBAL_SCALE",
    "SCALE_RULES",
    "ElementFormat",
    "dequantize_mx",
    "dequantize_nvfp4",
    "mx_matmul",
    "quantize_mx",
    "quantize_nvfp4",
    "wrapx_permutation",
]


@dataclass(frozen=True)
class ElementFormat:
    """One MX element format.

    Attributes:
        name: "e4m3" | "e5m2" | "e2m1".
        storage_dtype: dtype of the returned data tensor (uint8 for packed FP4).
        max: largest finite magnitude.
        emax: exponent of the largest normal binade (OCP MX v1.0 Table 1 "emax_elem").
        ebits, mbits: exponent and mantissa field widths.
    """

    name: str
    storage_dtype: torch.dtype
    max: float
    emax: int
    ebits: int
    mbits: int


# Element formats. Source: OCP MX v1.0 spec Table 1 (FP8 E4M3 max 448 emax 8, FP8 E5M2 max 57344
# emax 15, FP4 E2M1 max 6 emax 2), the same figures as OCP OFP8 v1.0 and ml_dtypes.finfo
# (cross-checked in tests/test_mx.py).
ELEMENT_FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", torch.float8_e4m3fn, 448.0, 8, 4, 3),
    "e5m2": ElementFormat("e5m2", torch.float8_e5m2, 57344.0, 15, 5, 2),
    "e2m1": ElementFormat("e2m1", torch.uint8, 6.0, 2, 2, 1),
}
SCALE_RULES = ("ocp", "rceil", "trainium")
LAYOUTS = ("contiguous", "wrapx")
E8M0_BIAS = 127
E8M0_NAN = 255
WRAPX_BLOCK_SIZE = 32
NVFP4_BLOCK_SIZE = 16
_E4M3_MIN_NORMAL = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny
# Floor of the NVFP4 global scale g. The element multiplier is (1/g) / s with the block scale s
# as small as 2^-6, so 1/g must stay below 2^(128-6) for it to be finite in fp32: g >= 2^-121
# keeps g a normal fp32, 1/g <= 2^121 and (1/g)/s <= 2^127. amax(x)/(448*6) falls below it only
# for amax < ~2^-109.6, where the unfloored recipe gave an infinite multiplier and NaN codes.
NVFP4_MIN_GLOBAL_SCALE = 2.0**-121
_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The 16 E2M1 code values, taken from ml_dtypes (code = E2M1 bit pattern).
_E2M1_VALUES = torch.from_numpy(
    np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
)


# ----------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------


def _elem_format(elem: str) -> ElementFormat:
    if elem not in ELEMENT_FORMATS:
        raise ValueError(f"elem must be one of {tuple(ELEMENT_FORMATS)}; got {elem!r}")
    return ELEMENT_FORMATS[elem]


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def _norm_axis(axis: int, ndim: int, what: str = "x") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int; got {axis!r}")
    if ndim == 0:
        raise ValueError(f"{what} must have at least one dimension to quantize along axis")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for {what} with {ndim} dimensions")
    return axis % ndim


def _check_block(block_size: int, layout: str, length: int, what: str) -> None:
    """Validate block_size against the layout and the axis length ``length`` (unpacked)."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if layout == "wrapx":
        if block_size != WRAPX_BLOCK_SIZE:
            raise ValueError(f"block_size must be 32 for layout='wrapx'; got {block_size}")
        if length % 128:
            raise ValueError(
                f"{what}: layout='wrapx' needs the axis length to be a multiple of 128; got {length}"
            )
    if length % block_size:
        raise ValueError(
            f"{what}: axis length {length} is not a multiple of block_size={block_size}"
        )


# ----------------------------------------------------------------------------------------------
# WRAPX group order
# ----------------------------------------------------------------------------------------------


def _wrapx_tiles(k: int) -> list[tuple[int, int]]:
    """(start, width) of the WRAPX K tiles: 512-wide tiles, then a 256 and a 128 remainder."""
    tiles = [(k0, 512) for k0 in range(0, k - k % 512, 512)]
    k0 = k - k % 512
    for width in (256, 128):
        if k - k0 >= width:
            tiles.append((k0, width))
            k0 += width
    return tiles


@functools.lru_cache(maxsize=64)
def _wrapx_perm_cpu(k: int) -> torch.Tensor:
    parts = []
    for width in (512, 256, 128):
        starts = [k0 for k0, w in _wrapx_tiles(k) if w == width]
        if not starts:
            continue
        vs = width // 4
        g = torch.arange(vs // 8).view(-1, 1, 1) * 8
        i = torch.arange(4).view(1, -1, 1) * vs
        j = torch.arange(8).view(1, 1, -1)
        within = (g + i + j).reshape(-1)  # [width], group-major, then i, then j
        parts.append((torch.tensor(starts).view(-1, 1) + within.view(1, -1)).reshape(-1))
    # tiles of different widths never interleave: 512-tiles first, then 256, then 128
    perm = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return perm


def wrapx_permutation(k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Element order of the Trainium WRAPX layout along a contraction axis of length ``k``.

    ``perm`` is an int64 tensor ``[k]`` such that ``x[..., perm].view(..., k // 32, 32)[..., s, :]``
    are the 32 elements of WRAPX group ``s`` (the scale index): tiles in K order (512-wide, then a
    256 and a 128 remainder), inside a tile of width TK at ``k0`` group ``g`` in order, and inside a
    group the elements ``k0 + i·(TK/4) + 8g + j`` ordered by ``i`` then ``j`` (NKI_API.md §4.6).

    Raises:
        ValueError: ``k`` not a non-negative multiple of 128.
    """
    if not isinstance(k, int) or k < 0 or k % 128:
        raise ValueError(f"k must be a non-negative multiple of 128 for WRAPX; got {k!r}")
    return _wrapx_perm_cpu(k).to(device) if device is not None else _wrapx_perm_cpu(k).clone()


# ----------------------------------------------------------------------------------------------
# exact numeric helpers
# ----------------------------------------------------------------------------------------------


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2.0 ** e`` for int tensor ``e`` in [-149, 127] (fp32) or [-1022, 1023] (fp64)."""
    if dtype == torch.float64:
        return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 v) as int32 for finite v > 0 (exact, subnormals included)."""
    _, e = torch.frexp(v)
    return e - 1


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) as int32 for finite v > 0 (exact)."""
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, e - 1, e)


def _to_fp32_round_to_odd(v: torch.Tensor) -> torch.Tensor:
    """Round fp64 ``v`` to fp32 with round-to-odd (so a later rounding to ≤ 21 bits is single)."""
    f = v.to(torch.float32)
    back = f.to(torch.float64)
    inexact = back != v
    # truncate toward zero when RNE rounded away from zero
    away = inexact & (back.abs() > v.abs())
    f = torch.where(away, torch.nextafter(f, torch.zeros_like(f)), f)
    bits = f.view(torch.int32)
    f = torch.where(inexact & torch.isfinite(f), (bits | 1).view(torch.float32), f)
    return f


def _encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 ``v`` already clamped to ±6; NaN → code 0."""
    v = torch.nan_to_num(v, nan=0.0)
    codes = v.detach().cpu().numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return torch.from_numpy(codes.copy()).to(v.device)


def _round_elements(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Saturating round-to-nearest-even of scaled values ``v`` (fp32/fp64) to ``fmt`` storage.

    FP8 → torch float8 tensor; E2M1 → unpacked uint8 codes.
    """
    v = torch.clamp(v, -fmt.max, fmt.max)  # NaN-preserving
    if v.dtype == torch.float64:
        v = _to_fp32_round_to_odd(v)
    if fmt.name == "e2m1":
        return _encode_e2m1(v)
    return v.to(fmt.storage_dtype)


def _decode_elements(data: torch.Tensor, fmt: ElementFormat, dtype: torch.dtype) -> torch.Tensor:
    """Element values (exact) in ``dtype`` from stored data (E2M1: unpacked codes)."""
    if fmt.name == "e2m1":
        return _E2M1_VALUES.to(device=data.device, dtype=dtype)[data.long()]
    return data.to(dtype)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes → [..., n] uint8, even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 → [..., 2n] codes (inverse of :func:`_pack_nibbles`)."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# MX quantize / dequantize
# ----------------------------------------------------------------------------------------------


def _scale_exponent(
    amax: torch.Tensor, fmt: ElementFormat, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(byte uint8, exponent int32 in [-127, 127] (0 where bad), bad bool) per group amax."""
    finite = torch.isfinite(amax)
    positive = finite & (amax > 0)
    safe = torch.where(positive, amax, torch.ones_like(amax))
    if scale_rule == "ocp":
        e = _floor_log2(safe) - fmt.emax
    elif scale_rule == "trainium":
        e = _floor_log2(safe) - (fmt.emax - 1)
    else:  # rceil
        descale = safe / fmt.max
        e = torch.where(descale > 0, _ceil_log2(torch.where(descale > 0, descale, 1.0)), -127)
    e = torch.where(positive, e, torch.full_like(e, -E8M0_BIAS)).clamp(min=-E8M0_BIAS)
    bad = ~finite | (e > E8M0_BIAS)
    byte = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    e = torch.where(bad, torch.zeros_like(e), e)
    return byte, e, bad


def quantize_mx(
    x: torch.Tensor,
    *,
    elem: str = "e4m3",
    block_size: int = 32,
    scale_rule: str = "ocp",
    axis: int = -1,
    layout: str = "contiguous",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MX along ``axis`` (the contraction axis); see the module docstring.

    Args:
        x: float tensor (fp16 / bf16 / fp32 / fp64), any rank >= 1, any device. fp16/bf16 are
            computed in fp32 (exact), fp64 in fp64.
        elem: "e4m3" | "e5m2" | "e2m1".
        block_size: elements per scale group (must be 32 for ``layout="wrapx"``).
        scale_rule: "ocp" | "rceil" | "trainium".
        axis: the axis the groups run along; its length K must be a multiple of block_size (and of
            128 for "wrapx"; even for "e2m1").
        layout: "contiguous" | "wrapx".

    Returns:
        (data, scale): data has x's shape and dtype ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``,
        or for "e2m1" uint8 with axis length K/2 (two codes per byte, even element low nibble).
        scale is ``torch.float8_e8m0fnu`` with x's shape except axis length K / block_size.

    Raises:
        ValueError: bad elem / scale_rule / layout / block_size / axis, K not divisible, non-float x.
    """
    fmt = _elem_format(elem)
    _check_choice("scale_rule", scale_rule, SCALE_RULES)
    _check_choice("layout", layout, LAYOUTS)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float16/bfloat16/float32/float64 tensor; got {got}")
    ax = _norm_axis(axis, x.dim())
    k = x.shape[ax]
    _check_block(block_size, layout, k, "x")
    if fmt.name == "e2m1" and k % 2:
        raise ValueError(f"x: elem='e2m1' packs pairs along axis, so K must be even; got {k}")

    cdt = _compute_dtype(x.dtype)
    xk = x.detach().to(cdt).movedim(ax, -1)
    perm = wrapx_permutation(k, x.device) if layout == "wrapx" else None
    if perm is not None:
        xk = xk[..., perm]
    groups = xk.reshape(*xk.shape[:-1], k // block_size, block_size)
    amax = groups.abs().amax(dim=-1)
    # amax of a group with NaN is NaN on torch, but make it explicit for every backend
    amax = torch.where(groups.isnan().any(dim=-1), torch.full_like(amax, float("nan")), amax)
    byte, e, bad = _scale_exponent(amax, fmt, scale_rule)
    scaled = groups * _pow2(-e, cdt).unsqueeze(-1)
    scaled = torch.where(bad.unsqueeze(-1), torch.full_like(scaled, float("nan")), scaled)
    data = _round_elements(scaled, fmt).reshape(xk.shape)
    if perm is not None:
        out = torch.empty_like(data)
        out[..., perm] = data
        data = out
    if fmt.name == "e2m1":
        data = _pack_nibbles(data)
    data = data.movedim(-1, ax).contiguous()
    scale = byte.view(torch.float8_e8m0fnu).movedim(-1, ax).contiguous()
    return data, scale


def dequantize_mx(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    elem: str = "e4m3",
    block_size: int = 32,
    axis: int = -1,
    layout: str = "contiguous",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode MX data: ``element_value · 2^(scale_byte - 127)`` (byte 255 → NaN for the group).

    Args:
        data: as returned by :func:`quantize_mx` (float8 tensor, or packed uint8 for "e2m1").
        scale: ``torch.float8_e8m0fnu`` (or uint8 bytes) with data's shape except axis length
            K / block_size (K = unpacked axis length).
        elem, block_size, axis, layout: as given to :func:`quantize_mx`.
        dtype: output float dtype. The product is formed in fp64 for fp64 output, else in fp32
            (exact unless it leaves the fp32 range: 448·2^127 → inf), then cast to ``dtype``.

    Returns:
        Tensor of shape ``x.shape`` (unpacked) and ``dtype``.

    Raises:
        ValueError: bad elem / layout / block_size / axis / dtype, wrong data or scale dtype, or a
            data/scale shape mismatch.
    """
    fmt = _elem_format(elem)
    _check_choice("layout", layout, LAYOUTS)
    if dtype not in _FLOAT_INPUTS:
        raise ValueError(f"dtype must be one of {_FLOAT_INPUTS}; got {dtype}")
    if not isinstance(data, torch.Tensor) or data.dtype != fmt.storage_dtype:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"data must be a {fmt.storage_dtype} tensor for elem={elem!r}; got {got}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (
        torch.float8_e8m0fnu,
        torch.uint8,
    ):
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a float8_e8m0fnu (or uint8) tensor; got {got}")
    ax = _norm_axis(axis, data.dim(), "data")
    k = data.shape[ax] * (2 if fmt.name == "e2m1" else 1)
    _check_block(block_size, layout, k, "data")
    want = list(data.shape)
    want[ax] = k // block_size
    if list(scale.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}: "
            f"expected {tuple(want)} (axis {ax} of length K / block_size = {k}/{block_size})"
        )
    if scale.device != data.device:
        raise ValueError(f"scale is on {scale.device} but data is on {data.device}")

    cdt = _compute_dtype(dtype)
    dk = data.movedim(ax, -1)
    if fmt.name == "e2m1":
        dk = _unpack_nibbles(dk)
    vals = _decode_elements(dk, fmt, cdt)
    perm = wrapx_permutation(k, data.device) if layout == "wrapx" else None
    if perm is not None:
        vals = vals[..., perm]
    groups = vals.reshape(*vals.shape[:-1], k // block_size, block_size)
    byte = scale.view(torch.uint8).movedim(ax, -1).to(torch.int32)
    factor = _pow2((byte - E8M0_BIAS).clamp(max=127), cdt)
    factor = torch.where(byte == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    out = (groups * factor.unsqueeze(-1)).reshape(vals.shape)
    if perm is not None:
        res = torch.empty_like(out)
        res[..., perm] = out
        out = res
    return out.movedim(-1, ax).to(dtype).contiguous()


def mx_matmul(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    *,
    elem: str = "e4m3",
    block_size: int = 32,
    scale_rule: str = "ocp",
    layout: str = "contiguous",
) -> torch.Tensor:
    """Reference MX matmul: quantize both operands along K, dequantize, multiply in fp32.

    Args:
        a_MK: float [M, K]; b_KN: float [K, N] (same device); K a multiple of block_size.
        elem, block_size, scale_rule, layout: as for :func:`quantize_mx` (both operands).

    Returns:
        fp32 [M, N] = dequant(a) @ dequant(b) with fp32 accumulation (each dequantized operand
        is exact in fp32 barring overflow).

    Raises:
        ValueError: operands not 2-D, K mismatch, or any :func:`quantize_mx` error.
    """
    for name, t in (("a_MK", a_MK), ("b_KN", b_KN)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a_MK.dim() != 2 or b_KN.dim() != 2:
        raise ValueError(
            f"a_MK and b_KN must be 2-D; got {tuple(a_MK.shape)} and {tuple(b_KN.shape)}"
        )
    if a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"K mismatch: a_MK {tuple(a_MK.shape)} vs b_KN {tuple(b_KN.shape)}")
    opts = {"elem": elem, "block_size": block_size, "layout": layout}
    qa = quantize_mx(a_MK, scale_rule=scale_rule, axis=1, **opts)
    qb = quantize_mx(b_KN, scale_rule=scale_rule, axis=0, **opts)
    a32 = dequantize_mx(*qa, axis=1, **opts)
    b32 = dequantize_mx(*qb, axis=0, **opts)
    return a32 @ b32


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def quantize_nvfp4(
    x: torch.Tensor, *, axis: int = -1, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: FP4 E2M1 elements, 16-element blocks with E4M3 block scales, fp32 global scale.

    Following NVIDIA's two-level recipe as torchao 0.18 ``nvfp4_quantize`` implements it (all in
    fp32): ``global = max(amax(x) / (448·6), 2^-121)`` when not given (1.0 if x is all zero);
    ``s = e4m3(clamp(amax_block / 6 / global, 2^-6, 448))`` (RNE); elements
    ``e2m1(clamp(x · ((1 / global) / s), ±6))`` (RNE). Decoding is ``elem · (global · s)``.

    The floor :data:`NVFP4_MIN_GLOBAL_SCALE` keeps the global scale and its reciprocal finite
    for tiny tensors, down to and below the smallest fp32 normal. It binds only when
    ``amax(x) / (448·6) < 2^-121`` in fp32, i.e. amax(x) < 448·6·2^-121 ≈ 1.011e-33: at or above
    that the result is the recipe's bit for bit (and scaling x by a power of two scales the
    decoded values by it exactly). Below it the global scale is 2^-121 instead of
    amax / (448·6), so the largest block scale falls below 448 and every block scale rounds to
    E4M3 at other points (the small ones clamp to 2^-6 sooner), and the decoded values of a
    block move with its decoded scale. Against the same tensor brought near 1 by a power of two,
    N(0, 1) data at amax 1e-33 / 1e-35 / 1e-37: ~93 % of the decoded values change, by a median
    relative 1.1 / 2.8 / 2.9 % (24 / 36 / 49 of 16384 flip to or from 0), while the error
    against x keeps its size (relative RMS 0.0958 / 0.0956 / 0.0965 vs 0.0954).

    Args:
        x: float tensor (fp16 / bf16 / fp32 / fp64; computed in fp32), axis length a multiple of 16.
        axis: the axis the 16-element blocks run along.
        global_scale: finite fp32 per-tensor scale >= :data:`NVFP4_MIN_GLOBAL_SCALE` (python
            float or 0-d tensor), or None.

    Returns:
        (data uint8 [.., K/2 at axis, ..] packed like MX e2m1, scale float8_e4m3fn [.., K/16, ..],
        global_scale fp32 0-d tensor).

    Raises:
        ValueError: non-float x, bad axis, axis length not a multiple of 16, or a global_scale that
            is not a finite scalar >= ``NVFP4_MIN_GLOBAL_SCALE``.

    torchao's ``nvfp4_quantize(x, 16, per_tensor_scale=None)`` is single-level (block scales alone,
    no division by a global scale); ``global_scale=1.0`` here reproduces it bit for bit.

    A NaN anywhere in x (when global_scale is None) makes the global scale NaN; a NaN in a block
    makes that block's scale NaN. Its NaN elements are stored as +0.
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a float16/bfloat16/float32/float64 tensor; got {got}")
    ax = _norm_axis(axis, x.dim())
    k = x.shape[ax]
    _check_block(NVFP4_BLOCK_SIZE, "contiguous", k, "x")
    xk = x.detach().to(torch.float32).movedim(ax, -1)
    if global_scale is None:
        amax = xk.abs().amax() if xk.numel() else torch.zeros((), device=x.device)
        g = amax / (448.0 * 6.0)
        g = torch.where(g == 0, torch.ones_like(g), g.clamp(min=NVFP4_MIN_GLOBAL_SCALE))
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if g.numel() != 1 or not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
            raise ValueError(f"global_scale must be a positive finite scalar; got {global_scale!r}")
        if not bool((g >= NVFP4_MIN_GLOBAL_SCALE).all()):
            raise ValueError(
                f"global_scale must be >= 2^-121 (NVFP4_MIN_GLOBAL_SCALE) so that its reciprocal "
                f"divided by the smallest block scale stays finite; got {global_scale!r}"
            )
        g = g.reshape(())
    groups = xk.reshape(*xk.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block = groups.abs().amax(dim=-1) / 6.0
    s8 = torch.clamp(block / g, _E4M3_MIN_NORMAL, 448.0).to(torch.float8_e4m3fn)
    recip = (1.0 / g) / s8.to(torch.float32)
    codes = _round_elements(groups * recip.unsqueeze(-1), ELEMENT_FORMATS["e2m1"])
    data = _pack_nibbles(codes.reshape(xk.shape)).movedim(-1, ax).contiguous()
    return data, s8.movedim(-1, ax).contiguous(), g


def dequantize_nvfp4(
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    *,
    axis: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode NVFP4: ``e2m1_value · (global_scale · scale_e4m3)`` in fp32, cast to ``dtype``.

    Args:
        data: packed uint8 [.., K/2, ..]; scale: float8_e4m3fn [.., K/16, ..]; global_scale: fp32
            scalar; axis: the block axis; dtype: output float dtype.

    Raises:
        ValueError: wrong dtypes, data/scale shape mismatch, or a global_scale that is not a
            positive finite scalar.
    """
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise ValueError("data must be a packed uint8 tensor")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn:
        raise ValueError("scale must be a float8_e4m3fn tensor")
    if dtype not in _FLOAT_INPUTS:
        raise ValueError(f"dtype must be one of {_FLOAT_INPUTS}; got {dtype}")
    ax = _norm_axis(axis, data.dim(), "data")
    k = data.shape[ax] * 2
    _check_block(NVFP4_BLOCK_SIZE, "contiguous", k, "data")
    want = list(data.shape)
    want[ax] = k // NVFP4_BLOCK_SIZE
    if list(scale.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)}: "
            f"expected {tuple(want)}"
        )
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=data.device).reshape(())
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        raise ValueError(f"global_scale must be a positive finite scalar; got {global_scale!r}")
    vals = _decode_elements(
        _unpack_nibbles(data.movedim(ax, -1)), ELEMENT_FORMATS["e2m1"], torch.float32
    )
    groups = vals.reshape(*vals.shape[:-1], k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    total = g * scale.movedim(ax, -1).to(torch.float32)
    out = (groups * total.unsqueeze(-1)).reshape(vals.shape)
    return out.movedim(-1, ax).to(dtype).contiguous()
