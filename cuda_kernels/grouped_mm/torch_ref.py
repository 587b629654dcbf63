"""The torch twin of the varlen-M grouped GEMM (the kernels' reference in the tests; the CPU path
of :func:`cuda_kernels.grouped_mm.api.grouped_mm_gather`).

``out[r] = A[idx[r]] @ W[e]`` for the rows r of expert e, in ``acc_dtype`` (float32: the kernel's
accumulator; float64 for the twin's own test) and rounded once to ``out_dtype``. Padding rows
(``idx < 0``) and rows past the last offset are exactly 0 (selects, so a NaN in W or in the
source's other rows cannot reach them). Reads the offsets on the host: a reference, not a fast
path, and not CUDA-graph capturable.
"""

from __future__ import annotations

import torch

__all__ = ["expert_segments", "gathered_rows", "grouped_mm_gather_torch"]


def expert_segments(offsets_E: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    """``[(begin, end)]`` row range of each expert (host read of the offsets) as the kernel
    derives them: ends clamped into ``[0, num_rows]``, then their running maximum (a decreasing
    offset gives an empty range; the ranges never overlap)."""
    out, begin = [], 0
    for v in offsets_E.to(torch.int64).tolist():
        end = max(begin, min(max(int(v), 0), num_rows))
        out.append((begin, end))
        begin = end
    return out


def gathered_rows(a: torch.Tensor, row_index: torch.Tensor | None, dtype: torch.dtype):
    """``[S, K]`` rows of ``a`` through ``row_index`` (``a`` itself without it) in ``dtype``;
    rows whose index is negative are exactly 0 (a select: the source is not read there)."""
    if row_index is None:
        return a.to(dtype)
    idx = row_index.to(torch.int64)
    valid = idx >= 0
    rows = a[idx.clamp(min=0)].to(dtype) if a.shape[0] else a.new_zeros(idx.shape[0], a.shape[1])
    return torch.where(valid[:, None], rows.to(dtype), torch.zeros((), dtype=dtype))


def grouped_mm_gather_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None = None,
    *,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``out[r] = a[row_index[r]] @ w[e]`` for the rows of each expert e.

    Args:
        a: [T, K] source rows (gathered through ``row_index``), or [S, K] rows already in the
            grouped order when ``row_index`` is None.
        w: [E, K, N] expert matrices (any strides).
        offsets_E: [E] cumulative row ends of the experts.
        row_index: optional [S] integer source row of each output row, negative = padding.
        acc_dtype: the accumulation dtype (operands are converted to it first).
        out_dtype: the dtype of the result (one rounding of the accumulated value).
    Returns:
        [S, N] ``out_dtype``; padding rows and rows past the last offset exactly 0.
    """
    S = row_index.shape[0] if row_index is not None else a.shape[0]
    rows = gathered_rows(a, row_index, acc_dtype)
    out = torch.zeros(S, w.shape[2], dtype=acc_dtype, device=a.device)
    for e, (b, t) in enumerate(expert_segments(offsets_E, S)):
        if t > b:
            out[b:t] = rows[b:t] @ w[e].to(acc_dtype)
    if row_index is not None:
        out = torch.where((row_index >= 0)[:, None], out, torch.zeros((), dtype=acc_dtype))
    return out.to(out_dtype)
