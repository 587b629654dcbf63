"""The torch twins of the varlen-M grouped GEMMs (the kernels' references in the tests; the CPU
paths of :mod:`cuda_kernels.grouped_mm.api`).

``out[r] = A[idx[r]] @ W[e]`` for the rows r of expert e, in ``acc_dtype`` (float32: the kernel's
accumulator; float64 for the twin's own test) and rounded once to ``out_dtype``. Padding rows
(``idx < 0``) and rows past the last offset are exactly 0 (selects, so a NaN in W or in the
source's other rows cannot reach them). Reads the offsets on the host: a reference, not a fast
path, and not CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from common.activation import activation_backward, gated_terms

__all__ = [
    "down_dgrad_activation_torch",
    "expert_segments",
    "gate_up_activation_torch",
    "gathered_rows",
    "grouped_mm_gather_torch",
]


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


def gate_up_activation_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None,
    row_to_pair_S: torch.Tensor,
    pair_affinity_R: torch.Tensor,
    *,
    activation,
    clamp_limits,
    bias_E2I: torch.Tensor | None = None,
    checkpoint_rows: bool = False,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused gate/up epilogue's twin: the grouped GEMM in ``acc_dtype`` (NOT rounded), then
    per row s of pair p (``row_to_pair_S[s]``, -1 = padding) of expert e with affinity a::

        g = clamp_gate(acc[s, :I] + bias[e, :I])     u = clamp_up(acc[s, I:] + bias[e, I:])
        h = g * sigmoid(alpha * g) * (u + up_offset)
        a_h[s] = a * h (0 for padding rows)          act[p] = [g, u]

    each rounded once to ``out_dtype``; checkpoint rows no real pair refers to are 0. With
    ``checkpoint_rows`` the checkpoint is ``act[s] = [g, u]`` at the row itself ([S, 2I], 0 for
    padding rows).

    Args:
        x, w, offsets_E, row_index: as :func:`grouped_mm_gather_torch` (w [E, H, 2I]: gate
            columns first).
        row_to_pair_S: [S] int64 pair of each row. pair_affinity_R: [R] float.
        activation: ``common.problem.Activation``. clamp_limits: ``ClampLimits`` or None.
        bias_E2I: optional [E, 2I] (or [E, 2, I]) gate/up bias.
        checkpoint_rows: the checkpoint in grouped row order [S, 2I] (else pair order).
    Returns:
        ``(act [R, 2, I] or [S, 2I], a_h [S, I])`` in ``out_dtype``.
    """
    S = row_to_pair_S.shape[0]
    R = pair_affinity_R.shape[0]
    I = w.shape[2] // 2
    acc = grouped_mm_gather_torch(
        x, w, offsets_E, row_index, acc_dtype=acc_dtype, out_dtype=acc_dtype
    )
    if bias_E2I is not None:
        seg = expert_segments(offsets_E, S)
        counts = torch.tensor([t - b for b, t in seg] + [S - (seg[-1][1] if seg else 0)])
        row_e = torch.repeat_interleave(torch.arange(len(seg) + 1), counts).clamp(max=len(seg) - 1)
        acc = acc + bias_E2I.reshape(len(seg), 2 * I).to(acc_dtype)[row_e.to(acc.device)]
    g, u = acc[:, :I], acc[:, I:]
    cl = clamp_limits
    if cl is not None:
        g = cl.clamp_gate(g)
        u = cl.clamp_up(u)
    h = gated_terms(activation, g, u).h
    valid = row_to_pair_S >= 0
    p = row_to_pair_S.clamp(min=0)
    a = torch.where(valid, pair_affinity_R.to(acc_dtype)[p] if R else p.to(acc_dtype), 0)
    ah = torch.where(valid[:, None], a[:, None] * h, torch.zeros((), dtype=acc_dtype))
    if checkpoint_rows:
        act = torch.where(valid[:, None], torch.cat([g, u], 1), torch.zeros((), dtype=acc_dtype))
        return act.to(out_dtype), ah.to(out_dtype)
    act = torch.zeros(R + 1, 2, I, dtype=out_dtype, device=x.device)
    dest = torch.where(valid, row_to_pair_S, torch.full_like(row_to_pair_S, R))
    act.index_put_((dest,), torch.stack([g, u], 1).to(out_dtype))
    return act[:R], ah.to(out_dtype)


def down_dgrad_activation_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None,
    row_to_pair_S: torch.Tensor,
    pair_affinity_R: torch.Tensor,
    act_R2I: torch.Tensor,
    *,
    activation,
    clamp_limits,
    acc_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused down-dgrad epilogue's twin: ``dh_raw = a[row_index] @ w[e]`` in ``acc_dtype``
    (NOT rounded; ``w`` [E, H, I] = ``w_down`` transposed), then per row s of pair p (affinity
    alpha) with the checkpoint's stored g, u (``act_R2I[p]``, or ``act_R2I[s]`` of a [S, 2I]
    checkpoint in grouped row order), ``s = sigmoid(act.alpha * g)``::

        dA_row[s]      = sum_j dh_raw * h                 h = g * s * (u + up_offset)
        d_gate_up[s]   = [alpha dh_raw (u + c) s (1 + act.alpha g (1 - s)) mask_g,
                          alpha dh_raw g s mask_u]
        a_h[s]         = alpha * h

    (REFERENCE §2; strict clamp masks from the stored values), 0 for padding rows.

    Returns:
        ``(d_gate_up [S, 2I], a_h [S, I]`` in ``out_dtype``, ``dA_row [S]`` in ``acc_dtype``).
    """
    I = w.shape[2]
    dh = grouped_mm_gather_torch(a, w, offsets_E, row_index, acc_dtype=acc_dtype,
                                 out_dtype=acc_dtype)
    valid = row_to_pair_S >= 0
    p = row_to_pair_S.clamp(min=0)
    R = pair_affinity_R.shape[0]
    if act_R2I.dim() == 2:  # [S, 2I]: row s's own g, u
        gu = act_R2I.to(acc_dtype).reshape(-1, 2, I)
        al = pair_affinity_R.to(acc_dtype)[p] if R else torch.zeros_like(gu[:, 0, 0])
    elif R:
        gu = act_R2I.to(acc_dtype)[p]
        al = pair_affinity_R.to(acc_dtype)[p]
    else:
        gu = torch.zeros(p.shape[0], 2, I, dtype=acc_dtype, device=a.device)
        al = torch.zeros(p.shape[0], dtype=acc_dtype, device=a.device)
    zero = torch.zeros((), dtype=acc_dtype)
    gu = torch.where(valid[:, None, None], gu, zero)
    al = torch.where(valid, al, zero)[:, None]
    dh = torch.where(valid[:, None], dh, zero)
    g, u = gu[:, 0], gu[:, 1]
    dg, du, h = activation_backward(activation, g, u, al * dh, clamp_limits)
    da = (dh * h).sum(1)
    dgu = torch.cat([dg, du], 1)
    return dgu.to(out_dtype), (al * h).to(out_dtype), da
