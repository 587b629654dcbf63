"""Triton kernels that move grouped rows: gathers into the grouped layout and per-token /
per-expert sums out of it (the forward's combine and the backward's dX and bias gradients).

Memory-bound kernels that replace the fp32 torch glue of the portable path
(:mod:`common.torch_backward`); each reads its inputs once:

* :func:`gather_rows` -- ``out[s] = src[idx[s]]`` (0 where ``idx[s] < 0``), cast to the output
  dtype in the same pass (X and dY into the grouped layout).
* :func:`token_sum` -- ``dX[t] = sum_k rows[row_of_slot[t, k]]`` in fp32, each token summing its
  own rows in slot order: deterministic, no atomics.
* :func:`segment_colsum` -- per-expert column sums (bias gradients), one program per
  (expert, column tile), rows in order: deterministic.
* :func:`zero_empty_groups` -- zero the [M, N] block of every expert with no rows.

Each kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors (the
CPU tests run the same kernel source with ``TRITON_INTERPRET=1``). Importing this module needs
``triton``; it does not query the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TritonKernel, cast, rne_bf16

__all__ = ["gather_rows", "segment_colsum", "token_sum", "zero_empty_groups"]


# ------------------------------------------------------------------------------------ gather
def _gather_rows_kernel(
    src_ptr, idx_ptr, out_ptr, S, H, stride_src, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, RNE_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = rows < S
    in_cols = cols < H
    idx = tl.load(idx_ptr + rows, mask=in_rows, other=-1).to(tl.int64)
    take = (idx >= 0)[:, None] & in_cols[None, :]
    v = tl.load(src_ptr + idx[:, None] * stride_src + cols[None, :], mask=take, other=0.0)
    v = tl.where(take, v, 0.0)
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    v = cast(v, out_ptr.dtype.element_ty, RNE_BF16)
    tl.store(dst, v, mask=in_rows[:, None] & in_cols[None, :])


_GATHER = TritonKernel(_gather_rows_kernel)


def gather_rows(
    src_TH: torch.Tensor, idx_S: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``out[s] = src_TH[idx_S[s]]``, exactly 0 where ``idx_S[s] < 0``, in ``dtype``.

    Args:
        src_TH: [T, H] floating, unit stride along H.  idx_S: [S] int32/int64, same device.
        dtype: output dtype (the cast happens in the same pass).
    Returns:
        [S, H] ``dtype``, contiguous. Padding rows are written with a select, so NaN in
        ``src_TH`` never reaches them.
    """
    S, H = idx_S.shape[0], src_TH.shape[1]
    if src_TH.stride(1) != 1:
        src_TH = src_TH.contiguous()
    out = torch.empty(S, H, dtype=dtype, device=src_TH.device)
    if S == 0 or H == 0:
        return out
    if src_TH.shape[0] == 0:
        return out.zero_()
    BLOCK_M, BLOCK_H = 4, min(1024, triton.next_power_of_2(H))
    grid = (triton.cdiv(S, BLOCK_M), triton.cdiv(H, BLOCK_H))
    _GATHER.launch(
        src_TH.device, grid, src_TH, idx_S, out, S, H, src_TH.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_H=BLOCK_H, RNE_BF16=rne_bf16(dtype) and src_TH.dtype != dtype,
        num_warps=4,
    )
    return out


# ------------------------------------------------------------------------------- token sum
def _token_sum_kernel(
    rows_ptr, stride_rows, slot_rows_ptr, out_ptr, stride_out, T, H,
    r2p_ptr, pair_expert_ptr, pair_alpha_ptr, bias_ptr, stride_bias,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, RNE_BF16: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_t = toks < T
    in_h = cols < H
    toks64 = toks.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # slot order: the same sum order on every run
        r = tl.load(slot_rows_ptr + toks64 * K + k, mask=in_t, other=-1).to(tl.int64)
        m = (r >= 0)[:, None] & in_h[None, :]
        v = tl.load(rows_ptr + r[:, None] * stride_rows + cols[None, :], mask=m, other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:  # + a * bias[e] of the row's pair (the forward's down bias)
            p = tl.load(r2p_ptr + r, mask=r >= 0, other=-1).to(tl.int64)
            ok = p >= 0
            p = tl.where(ok, p, 0)
            a = tl.load(pair_alpha_ptr + p, mask=ok, other=0.0).to(tl.float32)
            e = tl.load(pair_expert_ptr + p, mask=ok, other=0).to(tl.int64)
            b = tl.load(bias_ptr + e[:, None] * stride_bias + cols[None, :], mask=m, other=0.0)
            v = v + a[:, None] * b.to(tl.float32)
        acc += tl.where(m, v, 0.0)
    dst = out_ptr + toks64[:, None] * stride_out + cols[None, :]
    acc = cast(acc, out_ptr.dtype.element_ty, RNE_BF16)
    tl.store(dst, acc, mask=in_t[:, None] & in_h[None, :])


_TOKEN_SUM = TritonKernel(_token_sum_kernel)


def token_sum(
    rows_SH: torch.Tensor,
    slot_rows_TK: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    bias_EH: torch.Tensor | None = None,
    row_to_pair_S: torch.Tensor | None = None,
    plan=None,
) -> torch.Tensor:
    """``out[t] = sum_k rows_SH[slot_rows_TK[t, k]]`` over ``slot_rows_TK[t, k] >= 0``; with
    ``bias_EH`` each row adds ``a_p * bias_EH[e_p]`` of its pair p (the forward's affinity-scaled
    down bias).

    Args:
        rows_SH: [S, H] float, unit stride along H.
        slot_rows_TK: [T, K] int64 contiguous, the grouped row of each router slot; -1 for
            dropped slots and for all but one slot of a merged duplicate pair.
        dtype: output dtype; the sum runs in fp32, in slot order (bitwise deterministic).
        bias_EH: optional [E, H] float bias; needs ``row_to_pair_S`` ([S] int64, -1 on padding
            rows) and ``plan`` (its ``pair_expert_R`` and ``pair_affinity_R``).
    Returns:
        [T, H] ``dtype``.
    Raises:
        ValueError: ``bias_EH`` without ``row_to_pair_S`` and ``plan``.
    """
    T, K = slot_rows_TK.shape
    H = rows_SH.shape[1]
    out = torch.empty(T, H, dtype=dtype, device=rows_SH.device)
    if T == 0 or H == 0:
        return out
    if rows_SH.shape[0] == 0:
        return out.zero_()
    has_bias = bias_EH is not None
    if has_bias:
        if row_to_pair_S is None or plan is None:
            raise ValueError("token_sum: bias_EH needs row_to_pair_S and plan")
        bias = bias_EH if bias_EH.stride(1) == 1 else bias_EH.contiguous()
        r2p, p_e, p_a = row_to_pair_S, plan.pair_expert_R, plan.pair_affinity_R
    else:
        bias, r2p, p_e, p_a = rows_SH, slot_rows_TK, slot_rows_TK, rows_SH  # unused stand-ins
    BLOCK_T, BLOCK_H = 8, min(256, triton.next_power_of_2(H))
    _TOKEN_SUM.launch(
        rows_SH.device, (triton.cdiv(T, BLOCK_T), triton.cdiv(H, BLOCK_H)),
        rows_SH, rows_SH.stride(0), slot_rows_TK.contiguous(), out, out.stride(0), T, H,
        r2p, p_e, p_a, bias, bias.stride(0),
        K=K, HAS_BIAS=has_bias, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, RNE_BF16=rne_bf16(dtype),
        num_warps=4,
    )
    return out


# --------------------------------------------------------------------------- segment sums
def _segment_colsum_kernel(
    x_ptr, stride_x, offs_ptr, r2p_ptr, pair_alpha_ptr, out_ptr, stride_out, N,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    begin = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(begin, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        pair = tl.load(r2p_ptr + rows, mask=rows < end, other=-1).to(tl.int64)
        m = (pair >= 0)[:, None] & in_n[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
        v = tl.where(m, v.to(tl.float32), 0.0)
        if HAS_SCALE:
            a = tl.load(pair_alpha_ptr + tl.where(pair >= 0, pair, 0), mask=pair >= 0, other=0.0)
            v = v * a.to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + e * stride_out + cols, tl.sum(acc, axis=0), mask=in_n)


_SEGMENT_COLSUM = TritonKernel(_segment_colsum_kernel)


def segment_colsum(
    x_SN: torch.Tensor,
    offsets_E: torch.Tensor,
    row_to_pair_S: torch.Tensor,
    pair_scale_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert column sums of the real rows: ``out[e] = sum_{s in e, pair(s) >= 0} w_s x[s]``.

    Args:
        x_SN: [S, N] float, unit stride along N.  offsets_E: [E] int32 cumulative row ends.
        row_to_pair_S: [S] int64, -1 marks padding rows (skipped, whatever they hold).
        pair_scale_R: optional [R] per-pair row weight ``w`` (the affinity), else 1.
    Returns:
        [E, N] fp32; rows summed in order (bitwise deterministic).
    """
    S, N = x_SN.shape
    E = offsets_E.shape[0]
    out = torch.zeros(E, N, dtype=torch.float32, device=x_SN.device)
    if S == 0 or N == 0 or E == 0:
        return out
    BLOCK_M, BLOCK_N = 16, min(256, triton.next_power_of_2(N))
    scale = pair_scale_R if pair_scale_R is not None else x_SN
    _SEGMENT_COLSUM.launch(
        x_SN.device, (E, triton.cdiv(N, BLOCK_N)),
        x_SN, x_SN.stride(0), offsets_E, row_to_pair_S, scale, out, out.stride(0), N,
        HAS_SCALE=pair_scale_R is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4,
    )
    return out


# ------------------------------------------------------------------------- empty experts
def _zero_empty_groups_kernel(out_ptr, offs_ptr, MN, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    e = tl.program_id(0)
    begin = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    if begin == end:  # an expert without rows: its whole [M, N] gradient is 0
        base = out_ptr + e.to(tl.int64) * MN
        for start in range(tl.program_id(1) * BLOCK, MN, SPLIT * BLOCK):
            idx = start + tl.arange(0, BLOCK)
            tl.store(base + idx, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=idx < MN)


_ZERO_EMPTY_GROUPS = TritonKernel(_zero_empty_groups_kernel)


def zero_empty_groups(out_EMN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Write 0 over ``out_EMN[e]`` for every expert e with no rows (equal consecutive offsets),
    in place, without a host read; experts with rows are not touched (REFERENCE §7).

    Args:
        out_EMN: [E, M, N] contiguous.  offsets_E: [E] int32 cumulative row ends.
    Returns:
        ``out_EMN``.
    """
    E = out_EMN.shape[0]
    MN = out_EMN[0].numel() if E else 0
    if E == 0 or MN == 0:
        return out_EMN
    SPLIT, BLOCK = 32, 2048
    _ZERO_EMPTY_GROUPS.launch(
        out_EMN.device, (E, SPLIT), out_EMN, offsets_E, MN, BLOCK=BLOCK, SPLIT=SPLIT, num_warps=4
    )
    return out_EMN
