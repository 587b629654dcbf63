"""MX numerics of ``quantize_mx`` / ``nc_matmul_mx`` for the interpreter.

The scale rule and element cast come from ``common.mx.quantize_mx(..., scale_rule="trainium")``
(one place for the numerics of the whole package, ARCHITECTURE.md). Trainium's hardware group is
8 partitions x 4 consecutive free elements (one x4 column); we gather each group into 32
contiguous values and call ``common.mx`` with ``layout="contiguous"`` (NKI_API.md §3.12).

``QUANTIZE_IMPL["value"] = "fast"`` selects :func:`_quantize_groups_fast`, a torch twin of the
same rule (REFERENCE.md §4: ``X = 2^(floor(log2 amax) - (emax - 1))``, emax 8 for E4M3 / 15 for
E5M2, all-zero group -> byte 0, NaN/Inf group -> byte 255, elements cast with round-to-nearest-even),
about 2x faster per call; the tests check it against ``common.mx`` bit for bit.

Scale placement (NKI_API.md §4.5): logical scale row ``r`` (data partitions ``8r..8r+7``) lives at
partition ``32*(r//4) + r%4`` of the scale view.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["ELEM_OF_X4", "dequantize_x4", "quantize_groups", "scale_rows"]

ELEM_OF_X4 = {"float8_e4m3fn_x4": "e4m3", "float8_e5m2_x4": "e5m2", "float4_e2m1fn_x4": "e2m1"}
_EMAX = {"e4m3": 8, "e5m2": 15}
_FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}

# value of every fp8 byte, as float32 (lookup tables for dequantization)
_LUT = {e: np.arange(256, dtype=np.uint8).view(t).astype(np.float32) for e, t in _FP8.items()}
_FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                       dtype=np.float32)
_LUT["e2m1"] = _FP4_VALUES
_LUT64 = {e: v.astype(np.float64) for e, v in _LUT.items()}
# 2^(b - 127) for every E8M0 byte; byte 255 is NaN
_SCALE_LUT64 = np.ldexp(1.0, np.arange(256) - 127)
_SCALE_LUT64[255] = np.nan
_SCALE_LUT = _SCALE_LUT64.astype(np.float32)


def scale_rows(n_rows: int) -> np.ndarray:
    """Partition (relative to the scale view) of each logical scale row ``r < n_rows``."""
    r = np.arange(n_rows)
    return 32 * (r // 4) + (r % 4)


def _common_quantize():
    try:
        from common import mx as cmx
    except ImportError:  # common.mx not there (parallel build): the local twin below is used
        return None
    return getattr(cmx, "quantize_mx", None)


# Which implementation quantize_mx uses: "common" = common.mx.quantize_mx (the package's single
# definition of the rule), "fast" = the torch twin below, about 2x faster per call and checked bit
# for bit against common.mx by tests/test_nki_interp.py (random data, zero / tiny / huge / NaN /
# Inf groups, e4m3 and e5m2). "auto" = "common" when importable, else "fast". (On the Qwen3-30B-A3B
# shape both give bit-identical gradients; quantization is a few percent of the run time.)
QUANTIZE_IMPL = {"value": "auto"}


def _quantize_groups_fast(g: np.ndarray, elem: str):
    """Trainium rule on [..., 32] float32 groups -> (fp8 bytes [..., 32], scale bytes [...]).

    Same rule as common.mx with scale_rule="trainium" (REFERENCE.md §4): e = floor(log2 amax) -
    (emax - 1) clamped at -127; all-zero group -> byte 0; a group with NaN/Inf -> byte 255 and NaN
    elements; elements = V * 2^-e rounded to nearest even (|V * 2^-e| < 2^(emax+1), no saturation).
    """
    import torch

    emax = _EMAX[elem]
    t = torch.from_numpy(np.ascontiguousarray(g))
    amax = t.abs().amax(dim=-1)  # NaN propagates
    finite = torch.isfinite(amax)
    positive = finite & (amax > 0)
    _, ex = torch.frexp(torch.where(positive, amax, torch.ones_like(amax)))
    e = torch.where(positive, ex - emax, torch.full_like(ex, -127)).clamp(min=-127)
    byte = torch.where(finite, e + 127, torch.full_like(e, 255)).to(torch.uint8)
    e = torch.where(finite, e, torch.zeros_like(e))
    scale = ((127 - e) << 23).view(torch.float32)  # 2^-e, -e in [-120, 127]: a normal float
    scaled = t * scale.unsqueeze(-1)
    if not bool(finite.all()):
        scaled = torch.where(finite.unsqueeze(-1), scaled, torch.full_like(scaled, float("nan")))
    tdt = torch.float8_e4m3fn if elem == "e4m3" else torch.float8_e5m2
    data = scaled.to(tdt).view(torch.uint8).numpy()
    return data, byte.numpy()


def _quantize_groups_local(g: np.ndarray, elem: str):
    """NumPy twin used only when torch is unavailable (same rule)."""
    emax = _EMAX[elem]
    amax = np.max(np.abs(g), axis=-1)
    _, ex = np.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1) -> floor(log2 amax) = ex - 1
    sexp = ex.astype(np.int64) - 1 - (emax - 1)
    byte = np.clip(sexp + 127, 0, 254)
    byte = np.where(amax == 0, 0, byte)
    byte = np.where(np.isfinite(amax), byte, 255).astype(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.ldexp(g, -(byte.astype(np.int32) - 127)[..., None])
    data = q.astype(_FP8[elem]).view(np.uint8)
    data = np.where(np.isfinite(amax)[..., None], data, np.uint8(0x7F))  # NaN byte, as torch
    return data, byte


def _quantize_groups_common(fn, g: np.ndarray, elem: str):
    import torch

    x = torch.from_numpy(np.ascontiguousarray(g))
    data, scale = fn(x, elem=elem, block_size=32, scale_rule="trainium", axis=-1,
                     layout="contiguous")
    data_u8 = data.contiguous().view(torch.uint8).numpy()
    s = scale.contiguous().view(torch.uint8).numpy()
    return data_u8, s.reshape(g.shape[:-1])


def quantize_groups(src_PF: np.ndarray, elem: str, impl: str | None = None):
    """Quantize a [P, F] float tile with Trainium's grouping.

    Args:
        src_PF: [P, F] float32 (values of the bf16/fp16 source); P % 8 == 0, F % 4 == 0.
        elem: "e4m3" or "e5m2".
        impl: "common", "fast" or "numpy"; None = ``QUANTIZE_IMPL`` ("auto": "common" when
            common.mx imports, else "fast").

    Returns:
        (packed [P, F/4] uint32 x4 words, scale bytes [P/8, F/4] uint8).

    Raises:
        RuntimeError: impl="common" while common.mx is not importable.
    """
    P, F = src_PF.shape
    g = src_PF.reshape(P // 8, 8, F // 4, 4).transpose(0, 2, 1, 3).reshape(P // 8, F // 4, 32)
    impl = impl or QUANTIZE_IMPL["value"]
    if impl == "auto":
        impl = "common" if _common_quantize() is not None else "fast"
    if impl == "common":
        fn = _common_quantize()
        if fn is None:
            raise RuntimeError("quantize_groups: common.mx.quantize_mx is not importable")
        data, scale = _quantize_groups_common(fn, g, elem)
    elif impl == "fast":
        data, scale = _quantize_groups_fast(g, elem)
    elif impl == "numpy":
        data, scale = _quantize_groups_local(g, elem)
    else:
        raise ValueError(f"impl must be 'common', 'fast' or 'numpy', got {impl!r}")
    data = data.reshape(P // 8, F // 4, 8, 4).transpose(0, 2, 1, 3).reshape(P, F)
    return np.ascontiguousarray(data).view(np.uint32), scale


def unpack_x4(words: np.ndarray, dtype: str) -> np.ndarray:
    """[P, C] packed words -> [P, C, 4] element codes (uint8; fp4 as nibbles)."""
    if dtype == "float4_e2m1fn_x4":
        b = np.ascontiguousarray(words).view(np.uint8).reshape(words.shape + (2,))
        out = np.empty(words.shape + (4,), np.uint8)
        out[..., 0] = b[..., 0] & 0xF
        out[..., 1] = b[..., 0] >> 4
        out[..., 2] = b[..., 1] & 0xF
        out[..., 3] = b[..., 1] >> 4
        return out
    return np.ascontiguousarray(words).view(np.uint8).reshape(words.shape + (4,))


def dequantize_x4(words: np.ndarray, dtype: str, scale_bytes_GC: np.ndarray,
                  out_dtype=np.float32) -> np.ndarray:
    """Dequantize an x4 tile: [P, C] words and [P/8, C] scale bytes -> [P, C, 4] values.

    ``value = elem(byte) * 2^(scale - 127)``; scale byte 255 gives NaN.
    """
    P, C = words.shape
    lut = _LUT64[ELEM_OF_X4[dtype]] if out_dtype == np.float64 else _LUT[ELEM_OF_X4[dtype]]
    vals = lut[unpack_x4(words, dtype)]
    slut = _SCALE_LUT64 if out_dtype == np.float64 else _SCALE_LUT
    vals.reshape(P // 8, 8, C, 4)[...] *= slut[scale_bytes_GC][:, None, :, None]
    return vals
