"""Triton kernels of the fused MoE expert-MLP backward: everything between the GEMMs.

Four memory-bound kernels replace the fp32 torch glue of the portable path
(:mod:`common.torch_backward`); each reads its inputs once and writes BF16 GEMM operands:

* :func:`gather_rows` -- ``out[s] = src[idx[s]]`` (0 where ``idx[s] < 0``), cast to the output
  dtype in the same pass (X and dY into the grouped layout).
* :func:`activation_backward` -- the epilogue of the down-projection dgrad: from ``dh_raw`` and
  the forward checkpoint, the gated-activation backward with the strict clamp masks, ``a * h``
  and the affinity gradient ``dA`` written straight into its dense ``[T, E]`` cell
  (REFERENCE §2).
* :func:`token_sum` -- ``dX[t] = sum_k rows[row_of_slot[t, k]]`` in fp32, each token summing its
  own rows in slot order: deterministic, no atomics.
* :func:`segment_colsum` -- per-expert column sums (bias gradients), one program per
  (expert, column tile), rows in order: deterministic.

Each kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors (the
CPU tests run the same kernel source with ``TRITON_INTERPRET=1``). Importing this module needs
``triton``; it does not query the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_launch import TritonKernel, cast, rne_bf16

__all__ = [
    "activation_args", "activation_backward", "gather_rows", "segment_colsum", "token_sum",
    "zero_empty_groups",
]


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


# ------------------------------------------------------------------- activation backward
def activation_args(activation, clamp_limits) -> tuple[tuple[float, ...], dict]:
    """The launch arguments every gated-activation kernel takes (forward and backward):
    ``((g_lo, g_hi, u_lo, u_hi), {ACT_ALPHA, UP_OFFSET, G_HAS_LO, G_HAS_HI, U_HAS_LO,
    U_HAS_HI})`` of an :class:`~common.problem.Activation` and a ClampLimits (absent limits: 0.0
    and a False flag)."""
    cl = clamp_limits
    sides = (cl.non_linear_clamp_lower_limit, cl.non_linear_clamp_upper_limit,
             cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit)
    limits = tuple(0.0 if v is None else float(v) for v in sides)
    meta = {"ACT_ALPHA": float(activation.alpha), "UP_OFFSET": float(activation.up_offset)}
    meta.update(zip(("G_HAS_LO", "G_HAS_HI", "U_HAS_LO", "U_HAS_HI"),
                    (v is not None for v in sides)))
    return limits, meta


def _activation_backward_kernel(
    dh_ptr, stride_dh,
    act_ptr, stride_act_r, stride_act_c,
    r2p_ptr, pair_token_ptr, pair_expert_ptr, pair_alpha_ptr,
    dy_ptr, stride_dy, bd_ptr, stride_bd,
    dgu_ptr, stride_dgu, ah_ptr, stride_ah, da_ptr,
    S, I, H, E,
    g_lo, g_hi, u_lo, u_hi,
    ACT_ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    G_HAS_LO: tl.constexpr, G_HAS_HI: tl.constexpr,
    U_HAS_LO: tl.constexpr, U_HAS_HI: tl.constexpr,
    HAS_BD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, RNE_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < S
    pair = tl.load(r2p_ptr + rows, mask=in_rows, other=-1).to(tl.int64)
    valid = pair >= 0
    p = tl.where(valid, pair, 0)
    alpha = tl.load(pair_alpha_ptr + p, mask=valid, other=0.0).to(tl.float32)
    rows64 = rows.to(tl.int64)
    da = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        m = valid[:, None] & (cols < I)[None, :]
        dh_raw = tl.load(dh_ptr + rows64[:, None] * stride_dh + cols[None, :], mask=m, other=0.0)
        dh_raw = dh_raw.to(tl.float32)
        a_row = act_ptr + p[:, None] * stride_act_r + cols[None, :]
        g = tl.load(a_row, mask=m, other=0.0).to(tl.float32)
        u = tl.load(a_row + stride_act_c, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(ACT_ALPHA * g)
        gs = g * s
        up = u + UP_OFFSET
        h = gs * up
        da += tl.sum(tl.where(m, dh_raw * h, 0.0), axis=1)
        dh = alpha[:, None] * dh_raw
        dg = dh * up * s * (1.0 + ACT_ALPHA * g * (1.0 - s))
        du = dh * gs
        mg = m  # strict clamp masks: the gradient passes where lo < value < hi
        if G_HAS_LO:
            mg = mg & (g > g_lo)
        if G_HAS_HI:
            mg = mg & (g < g_hi)
        mu = m
        if U_HAS_LO:
            mu = mu & (u > u_lo)
        if U_HAS_HI:
            mu = mu & (u < u_hi)
        dg = tl.where(mg, dg, 0.0)
        du = tl.where(mu, du, 0.0)
        ah = tl.where(m, alpha[:, None] * h, 0.0)
        out_m = in_rows[:, None] & (cols < I)[None, :]
        dgu_row = dgu_ptr + rows64[:, None] * stride_dgu + cols[None, :]
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_row, cast(dg, out_ty, RNE_BF16), mask=out_m)
        tl.store(dgu_row + I, cast(du, out_ty, RNE_BF16), mask=out_m)
        ah_row = ah_ptr + rows64[:, None] * stride_ah + cols[None, :]
        tl.store(ah_row, cast(ah, out_ty, RNE_BF16), mask=out_m)
    expert = tl.load(pair_expert_ptr + p, mask=valid, other=0).to(tl.int64)
    if HAS_BD:  # dA += <dY, b_down[e]> (the forward scales the down bias by the affinity)
        for h0 in range(0, H, BLOCK_H):
            hc = h0 + tl.arange(0, BLOCK_H)
            mh = valid[:, None] & (hc < H)[None, :]
            dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + hc[None, :], mask=mh, other=0.0)
            bd = tl.load(bd_ptr + expert[:, None] * stride_bd + hc[None, :], mask=mh, other=0.0)
            da += tl.sum(tl.where(mh, dy.to(tl.float32) * bd.to(tl.float32), 0.0), axis=1)
    token = tl.load(pair_token_ptr + p, mask=valid, other=0).to(tl.int64)
    tl.store(da_ptr + token * E + expert, da, mask=valid)


_ACTIVATION_BACKWARD = TritonKernel(_activation_backward_kernel)


def activation_backward(
    dh_raw_SI: torch.Tensor,
    act_R2I: torch.Tensor,
    row_to_pair_S: torch.Tensor,
    plan,
    *,
    activation,
    clamp_limits,
    dy_SH: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    operand_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated-activation backward of every grouped row, with the affinity gradient.

    Per row s of pair p (token t, expert e, affinity a), with g, u the stored (clamped)
    checkpoint, ``sg = sigmoid(alpha * g)`` and ``h = g * sg * (u + up_offset)`` (REFERENCE §2,
    :class:`common.problem.Activation`)::

        dA[t, e]   = <dh_raw, h> (+ <dY, b_down[e]>)
        dg         = a * dh_raw * (u + up_offset) * sg * (1 + alpha * g * (1 - sg)) * mask_g
        du         = a * dh_raw * g * sg * mask_u
        d_gate_up  = [dg, du];   a_h = a * h

    Args:
        dh_raw_SI: [S, I] float, ``dY_rows @ W_down[e]^T`` (BF16 from the grouped GEMM).
        act_R2I: [R, 2, I] float, the forward checkpoint in the plan's pair order (unit stride
            along I).
        row_to_pair_S: [S] int64, pair of each grouped row, -1 for padding rows.
        plan: the :class:`~common.routing.RoutingPlan` (pair tokens, experts, affinities).
        activation: :class:`~common.problem.Activation`.  clamp_limits: ClampLimits.
        dy_SH, b_down_EH: grouped dY rows [S, H] and the down bias [E, H], only with a bias.
        operand_dtype: dtype of the two outputs that feed GEMMs (BF16).
    Returns:
        ``(d_gate_up_S2I [S, 2I], a_h_SI [S, I], dA_TE [T, E] fp32)``; padding rows of the first
        two are exactly 0, and dA is 0 where a token is not routed.
    """
    S, I = dh_raw_SI.shape
    T, E = plan.num_tokens, plan.num_experts
    dev = dh_raw_SI.device
    dgu = torch.empty(S, 2 * I, dtype=operand_dtype, device=dev)
    ah = torch.empty(S, I, dtype=operand_dtype, device=dev)
    da = torch.zeros(T, E, dtype=torch.float32, device=dev)
    if S == 0 or I == 0:
        return dgu, ah, da
    if act_R2I.stride(2) != 1:
        act_R2I = act_R2I.contiguous()
    if dh_raw_SI.stride(1) != 1:
        dh_raw_SI = dh_raw_SI.contiguous()
    has_bd = b_down_EH is not None
    if has_bd:
        dy_SH = dy_SH if dy_SH.stride(1) == 1 else dy_SH.contiguous()
        b_down_EH = b_down_EH if b_down_EH.stride(1) == 1 else b_down_EH.contiguous()
        H = dy_SH.shape[1]
    else:
        dy_SH, b_down_EH, H = dh_raw_SI, dh_raw_SI, 1  # unused stand-ins
    limits, act_meta = activation_args(activation, clamp_limits)
    BLOCK_M = 16
    BLOCK_I = min(128, triton.next_power_of_2(I))
    BLOCK_H = min(256, triton.next_power_of_2(H))
    _ACTIVATION_BACKWARD.launch(
        dev, (triton.cdiv(S, BLOCK_M),),
        dh_raw_SI, dh_raw_SI.stride(0),
        act_R2I, act_R2I.stride(0), act_R2I.stride(1),
        row_to_pair_S, plan.pair_token_R, plan.pair_expert_R, plan.pair_affinity_R,
        dy_SH, dy_SH.stride(0), b_down_EH, b_down_EH.stride(0),
        dgu, dgu.stride(0), ah, ah.stride(0), da,
        S, I, H, E, *limits, **act_meta,
        HAS_BD=has_bd,
        BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_H=BLOCK_H, RNE_BF16=rne_bf16(operand_dtype),
        num_warps=4,
    )
    return dgu, ah, da


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
