"""Pairwise comparison of gradients against a baseline, overall and per expert.

For one gradient ``out`` against the baseline ``ref`` (same shape), :func:`compare_tensor` gives:

* ``sqnr_db`` -- ``10 log10(sum ref^2 / sum (out-ref)^2)`` (+inf when equal, -inf for a zero
  reference with a nonzero ``out``, NaN when ``out`` holds NaN/inf), as :mod:`common.metrics`;
* ``max_rel_err`` -- ``max |out-ref| / max |ref|``;
* ``cosine`` -- ``<out, ref> / (||out|| ||ref||)`` (1 when both are zero, 0 when one is);
* ``bit_identical`` -- the fraction of elements whose values are exactly equal;
* ``ulp_hist`` -- counts of the BF16 ULP distance ``|ord(bf16(out)) - ord(bf16(ref))|`` in the
  bins :data:`ULP_BINS` (``ord`` maps a BF16 bit pattern to an integer that is monotone in the
  value, +0 and -0 both 0), plus ``"nan"`` for elements where either side is NaN;
* for expert-indexed gradients (:data:`EXPERT_AXIS`: the weight and bias gradients along E, dA
  along its E columns) ``per_expert_sqnr_db`` (a list, expert order) and its ``min`` /
  ``median`` / ``max``.

dA ``[T, E]`` is dense with structural zeros where a token is not routed to an expert (every
backend writes exact zeros there). Given the routing (``routed_TE``, see :func:`routed_mask_TE`),
its ``bit_identical`` and ``ulp_hist`` count the routed cells only (``routed_only`` is True,
``routed_cells`` their number, ``bit_identical_all_cells`` the fraction over all T*E cells), so
they measure the computed values rather than ``1 - K/E`` of free matches. SQNR, max error,
cosine and per-expert SQNR are unchanged by the zeros and stay over all cells.

Everything is computed in float64 on the CPU in chunks, so gradients of full-size models fit.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from common.metrics import CHUNK, all_finite, error_sums, metrics_from_sums

__all__ = [
    "EXPERT_AXIS",
    "GRAD_LABELS",
    "ULP_BINS",
    "bf16_ulp_distance",
    "compare_grads",
    "compare_tensor",
    "per_expert_sqnr",
    "routed_mask_TE",
]

# (label, lower, upper) inclusive bounds of the BF16 ULP-distance histogram.
ULP_BINS: tuple[tuple[str, int, int], ...] = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3-4", 3, 4),
    ("5-8", 5, 8),
    ("9-16", 9, 16),
    ("17-64", 17, 64),
    ("65-256", 65, 256),
    (">256", 257, 1 << 40),
)
EXPERT_AXIS = {
    "affinity_grad_TE": 1,
    "w_gate_up_grad_EH2I": 0,
    "w_down_grad_EIH": 0,
    "b_gate_up_grad_E2I": 0,
    "b_down_grad_EH": 0,
}
GRAD_LABELS = {
    "hidden_states_grad_TH": "dX [T,H]",
    "affinity_grad_TE": "dA [T,E]",
    "w_gate_up_grad_EH2I": "dW_gate_up [E,H,2,I]",
    "w_down_grad_EIH": "dW_down [E,I,H]",
    "b_gate_up_grad_E2I": "dB_gate_up [E,2,I]",
    "b_down_grad_EH": "dB_down [E,H]",
}
_ULP_EDGES = torch.tensor([hi for _, _, hi in ULP_BINS[:-1]], dtype=torch.int32)


def _bf16_order(x: torch.Tensor) -> torch.Tensor:
    """int32 that orders BF16 values like the reals (sign-magnitude -> two's complement)."""
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    mag = bits & 0x7FFF
    return torch.where(bits >= 0x8000, -mag, mag)


def bf16_ulp_distance(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise BF16 ULP distance of ``out`` and ``ref`` after rounding both to BF16 (RNE);
    -1 where either is NaN."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    d = (_bf16_order(o) - _bf16_order(r)).abs()
    nan = torch.isnan(o) | torch.isnan(r)
    return torch.where(nan, torch.full_like(d, -1), d).to(torch.int64)


def _ulp_counts(d: torch.Tensor) -> list[int]:
    """Counts of the nonnegative ULP distances ``d`` in the bins of :data:`ULP_BINS`."""
    idx = torch.bucketize(d, _ULP_EDGES)  # edges = the bins' upper bounds
    return torch.bincount(idx, minlength=len(ULP_BINS)).tolist()


def compare_tensor(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """All pairwise metrics of one gradient (see the module docstring).

    One pass in float64 chunks (:data:`common.metrics.CHUNK` elements, the chunks of
    :func:`common.metrics.compare`, so SQNR and max error are bit-identical to it). Where a
    chunk is finite (``sum (out-ref)^2`` finite) the NaN masks are skipped.

    Raises:
        ValueError: shapes differ.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs baseline {tuple(ref.shape)}")
    o_flat, r_flat = out.detach().reshape(-1), ref.detach().reshape(-1)
    noise2 = signal2 = dmax = rmax = 0.0
    base_finite = True
    dot = oo = rr = 0.0
    equal = 0
    counts = [0] * len(ULP_BINS)
    nans = 0
    n = o_flat.numel()
    for start in range(0, n, CHUNK):
        o = o_flat[start : start + CHUNK].to("cpu", torch.float64)
        r = r_flat[start : start + CHUNK].to("cpu", torch.float64)
        d = o - r
        n2 = float(torch.dot(d, d))
        r2 = float(torch.dot(r, r))
        chunk_finite = math.isfinite(n2)  # then every o and r of the chunk is finite
        if base_finite and not chunk_finite and not all_finite(o):
            base_finite = False  # as common.metrics: the SQNR and max error are NaN
        if base_finite:
            noise2 += n2
            signal2 += r2
            lo, hi = torch.aminmax(d)
            dmax = max(dmax, float(hi), -float(lo))
            lo, hi = torch.aminmax(r)
            rmax = max(rmax, float(hi), -float(lo))
        del d
        if chunk_finite:
            dot += float(torch.dot(o, r))
            oo += float(torch.dot(o, o))
            rr += r2
        else:
            finite = torch.isfinite(o) & torch.isfinite(r)
            of, rf = torch.where(finite, o, 0.0), torch.where(finite, r, 0.0)
            dot += float(torch.dot(of, rf))
            oo += float(torch.dot(of, of))
            rr += float(torch.dot(rf, rf))
            del of, rf, finite
        equal += int((o == r).sum())
        u = (_bf16_order(o) - _bf16_order(r)).abs_()
        if not chunk_finite:
            nan = torch.isnan(o) | torch.isnan(r)
            nans += int(nan.sum())
            u = u[~nan]
        counts = [a + b for a, b in zip(counts, _ulp_counts(u))]
    base = metrics_from_sums(noise2, signal2, dmax, rmax, base_finite)
    hist = {label: c for (label, _, _), c in zip(ULP_BINS, counts)}
    hist["nan"] = nans
    if oo == 0.0 and rr == 0.0:
        cosine = 1.0
    elif oo == 0.0 or rr == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(oo * rr)
    if math.isnan(base["sqnr_db"]):  # NaN / inf in out
        cosine = math.nan
    return {
        "shape": list(out.shape),
        "sqnr_db": base["sqnr_db"],
        "max_rel_err": base["max_rel_err"],
        "cosine": cosine,
        "bit_identical": equal / n if n else 1.0,
        "ulp_hist": hist,
    }


def per_expert_sqnr(out: torch.Tensor, ref: torch.Tensor, axis: int) -> list[float]:
    """SQNR (dB) of each slice ``out.select(axis, e)`` against ``ref``'s, in expert order."""
    sums = (error_sums(out.select(axis, e), ref.select(axis, e), need_max=False)
            for e in range(out.shape[axis]))
    return [metrics_from_sums(*s)["sqnr_db"] for s in sums]


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    if any(math.isnan(v) for v in values):
        return {"min": math.nan, "median": math.nan, "max": math.nan}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def routed_mask_TE(plan) -> torch.Tensor:
    """[T, E] bool on the CPU: True where the :class:`~common.routing.RoutingPlan` routes token
    t to expert e (the cells of dA that are computed; the rest are structural zeros)."""
    T, E = plan.num_tokens, plan.num_experts
    mask = torch.zeros(T, E, dtype=torch.bool)
    tok = plan.pair_token_R.detach().to("cpu")
    exp = plan.pair_expert_R.detach().to("cpu")
    valid = tok >= 0
    mask[tok[valid], exp[valid]] = True
    return mask


def compare_grads(out, ref, *, routed_TE: torch.Tensor | None = None) -> dict[str, dict[str, Any]]:
    """Metrics of every gradient present in both ``out`` and ``ref`` (:class:`MoEGrads`), keyed
    by field name; expert-indexed ones also carry ``per_expert_sqnr_db`` and
    ``per_expert`` = {min, median, max}.

    Args:
        routed_TE: optional [T, E] bool mask of routed cells (:func:`routed_mask_TE` of the
            problem's plan): dA's ``bit_identical`` and ``ulp_hist`` then count those cells only.
    """
    result: dict[str, dict[str, Any]] = {}
    for name in GRAD_LABELS:
        o, r = getattr(out, name, None), getattr(ref, name, None)
        if o is None or r is None:
            continue
        m = compare_tensor(o, r)
        if name == "affinity_grad_TE" and routed_TE is not None:
            mask = routed_TE.to("cpu", torch.bool)
            if tuple(mask.shape) != tuple(o.shape):
                raise ValueError(
                    f"routed_TE must be [T, E] = {list(o.shape)}, got {list(mask.shape)}"
                )
            routed = compare_tensor(o.detach().to("cpu")[mask], r.detach().to("cpu")[mask])
            m["bit_identical_all_cells"] = m["bit_identical"]
            m["bit_identical"] = routed["bit_identical"]
            m["ulp_hist"] = routed["ulp_hist"]
            m["routed_only"] = True
            m["routed_cells"] = int(mask.sum())
        if name in EXPERT_AXIS:
            per = per_expert_sqnr(o, r, EXPERT_AXIS[name])
            m["per_expert_sqnr_db"] = per
            m["per_expert"] = _summary(per)
        result[name] = m
    return result
