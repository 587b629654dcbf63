"""Error metrics against a float64 reference, and the one table of thresholds the tests use.

SQNR (signal-to-quantization-noise ratio) in dB, as torchao's MX tests use it:
``SQNR = 20 log10(||ref|| / ||out - ref||)`` (Frobenius norms); +inf when equal.
Max relative error: ``max |out - ref| / max |ref|`` (normalized by the largest reference value,
so near-zero reference cells do not dominate).
"""

from __future__ import annotations

import math

import torch

__all__ = ["SQNR_MIN_DB", "compare", "max_rel_err", "rel_fro_err", "sqnr_db"]

# Minimum SQNR (dB) against float64, per backend and gradient kind. Why each value:
# - torch (BF16 operands, fp32 accumulation): BF16 rounding of inputs alone gives ~45-50 dB;
#   dA sums long products, so 35 dB leaves margin for the fp32-accumulated reductions.
# - nki (MXFP8 E4M3 operands, 3 mantissa bits): torchao's MX training tests ask >= 27 dB for
#   outputs and >= 24 dB for weight gradients; the issue asks >= 24 dB on every output.
SQNR_MIN_DB = {
    ("torch", "default"): 35.0,
    ("nki", "default"): 24.0,
}


_CHUNK = 1 << 22  # elements per float64 chunk: bounds the temporary memory of huge gradients


def _stats(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float, float, bool]:
    """(sum (out-ref)^2, sum ref^2, max |out-ref|, max |ref|, all finite), in float64 chunks."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o_flat = out.detach().reshape(-1)
    r_flat = ref.detach().reshape(-1)
    noise2 = signal2 = dmax = rmax = 0.0
    finite = True
    for start in range(0, o_flat.numel(), _CHUNK):
        o = o_flat[start : start + _CHUNK].to(torch.float64).cpu()
        r = r_flat[start : start + _CHUNK].to(torch.float64).cpu()
        if not bool(torch.isfinite(o).all()):
            finite = False
            break
        d = o - r
        noise2 += float(torch.dot(d, d))
        signal2 += float(torch.dot(r, r))
        dmax = max(dmax, float(d.abs().max()))
        rmax = max(rmax, float(r.abs().max()))
    return noise2, signal2, dmax, rmax, finite


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """All three metrics from one pass: ``{"sqnr_db", "max_rel_err", "rel_fro_err"}``."""
    noise2, signal2, dmax, rmax, finite = _stats(out, ref)
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
