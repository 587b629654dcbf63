"""Triton kernels of the fused MoE expert-MLP forward: everything between its two grouped GEMMs.

* :func:`activation_forward` -- the epilogue of the gate/up GEMM: bias, clamp and the gated
  activation of every grouped row in one pass, writing the BF16 checkpoint the backward reads
  (clamped pre-activations ``[R, 2, I]`` in the plan's pair order) and the down GEMM's operand
  ``a * h`` (BF16, grouped rows). No fp32 intermediate goes through HBM.

The top-k combine of the forward is :func:`cuda_kernels.moe_backward.kernels.token_sum` (each
token sums its own rows in slot order, with the affinity-scaled down bias when there is one):
deterministic, no atomics.

Each kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``). Importing this module needs ``triton``; it does not query the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe_backward.kernels import activation_args
from ..triton_launch import TritonKernel, cast, rne_bf16

__all__ = ["activation_forward"]


def _activation_forward_kernel(
    gu_ptr, stride_gu, bgu_ptr, stride_bgu,
    r2p_ptr, pair_expert_ptr, pair_alpha_ptr, num_pairs_ptr,
    act_ptr, stride_act_r, stride_act_c, ah_ptr, stride_ah,
    S, R, I,
    g_lo, g_hi, u_lo, u_hi,
    ACT_ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    G_HAS_LO: tl.constexpr, G_HAS_HI: tl.constexpr,
    U_HAS_LO: tl.constexpr, U_HAS_HI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, RNE_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < S
    rows64 = rows.to(tl.int64)
    pair = tl.load(r2p_ptr + rows, mask=in_rows, other=-1).to(tl.int64)
    valid = pair >= 0
    p = tl.where(valid, pair, 0)
    alpha = tl.load(pair_alpha_ptr + p, mask=valid, other=0.0).to(tl.float32)
    expert = tl.zeros([BLOCK_M], dtype=tl.int64)
    if HAS_BIAS:
        expert = tl.load(pair_expert_ptr + p, mask=valid, other=0).to(tl.int64)
    # Pair slots past the real pairs are checkpoint padding: this program zeroes the ones whose
    # index equals one of its row numbers (S >= R, so the grid covers every pair slot).
    num_pairs = tl.load(num_pairs_ptr).to(tl.int64)
    tail = (rows64 >= num_pairs) & (rows64 < R)
    out_ty = ah_ptr.dtype.element_ty
    act_ty = act_ptr.dtype.element_ty
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        in_i = (cols < I)[None, :]
        m = valid[:, None] & in_i
        src = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
        g = tl.load(src, mask=m, other=0.0).to(tl.float32)
        u = tl.load(src + I, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = bgu_ptr + expert[:, None] * stride_bgu + cols[None, :]
            g += tl.load(b, mask=m, other=0.0).to(tl.float32)
            u += tl.load(b + I, mask=m, other=0.0).to(tl.float32)
        if G_HAS_LO:
            g = tl.maximum(g, g_lo)
        if G_HAS_HI:
            g = tl.minimum(g, g_hi)
        if U_HAS_LO:
            u = tl.maximum(u, u_lo)
        if U_HAS_HI:
            u = tl.minimum(u, u_hi)
        h = g * tl.sigmoid(ACT_ALPHA * g) * (u + UP_OFFSET)
        ah = tl.where(m, alpha[:, None] * h, 0.0)
        tl.store(ah_ptr + rows64[:, None] * stride_ah + cols[None, :],
                 cast(ah, out_ty, RNE_BF16), mask=in_rows[:, None] & in_i)
        dst = act_ptr + p[:, None] * stride_act_r + cols[None, :]
        tl.store(dst, cast(g, act_ty, RNE_BF16), mask=m)
        tl.store(dst + stride_act_c, cast(u, act_ty, RNE_BF16), mask=m)
        zero = tl.zeros([BLOCK_M, BLOCK_I], dtype=act_ty)
        pad = act_ptr + rows64[:, None] * stride_act_r + cols[None, :]
        tl.store(pad, zero, mask=tail[:, None] & in_i)
        tl.store(pad + stride_act_c, zero, mask=tail[:, None] & in_i)


_ACTIVATION_FORWARD = TritonKernel(_activation_forward_kernel)


def activation_forward(
    gu_S2I: torch.Tensor,
    row_to_pair_S: torch.Tensor,
    plan,
    *,
    activation,
    clamp_limits,
    b_gate_up_E2I: torch.Tensor | None = None,
    operand_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias, clamp and gated activation of every grouped row (REFERENCE §2).

    Per row s of pair p (expert e, affinity a), with ``[g_raw, u_raw] = gu_S2I[s]``::

        g = clamp_gate(g_raw + b_gate_up[e, 0])      u = clamp_up(u_raw + b_gate_up[e, 1])
        h = g * sigmoid(alpha * g) * (u + up_offset)  # SwiGLU: alpha 1, up_offset 0
        act[p] = [g, u]  (rounded to operand_dtype)   a_h[s] = a * h  (rounded once)

    in fp32 registers (the clamp keeps the value at the limit; the backward's strict masks read
    the stored value).

    Args:
        gu_S2I: [S, 2I] float, the gate/up GEMM's output rows (gate columns first), unit stride
            along columns.
        row_to_pair_S: [S] int64, the plan pair of each grouped row, -1 for padding rows.
        plan: the :class:`~common.routing.RoutingPlan` (pair experts, merged affinities,
            ``num_pairs``); R = ``plan.pair_token_R.shape[0]`` <= S.
        activation: :class:`~common.problem.Activation`.  clamp_limits: ClampLimits.
        b_gate_up_E2I: optional [E, 2, I] gate/up bias.
        operand_dtype: dtype of both outputs (BF16).
    Returns:
        ``(act_R2I [R, 2, I], a_h_SI [S, I])``: the checkpoint in the plan's pair order
        (entries past ``num_pairs`` exactly 0) and the down GEMM's rows (padding rows 0).
    Raises:
        ValueError: S < R (not a grouped layout of this plan).
    """
    S, I2 = gu_S2I.shape
    I = I2 // 2
    R = plan.pair_token_R.shape[0]
    if S < R:
        raise ValueError(f"gu_S2I has {S} rows, fewer than the plan's R={R} pair slots")
    dev = gu_S2I.device
    act = torch.empty(R, 2, I, dtype=operand_dtype, device=dev)
    ah = torch.empty(S, I, dtype=operand_dtype, device=dev)
    if S == 0 or I == 0:
        return act.zero_(), ah
    if gu_S2I.stride(1) != 1:
        gu_S2I = gu_S2I.contiguous()
    has_bias = b_gate_up_E2I is not None
    bgu = b_gate_up_E2I.reshape(-1, 2 * I).contiguous() if has_bias else gu_S2I
    limits, act_meta = activation_args(activation, clamp_limits)
    BLOCK_M = 16
    BLOCK_I = min(128, triton.next_power_of_2(I))
    _ACTIVATION_FORWARD.launch(
        dev, (triton.cdiv(S, BLOCK_M),),
        gu_S2I, gu_S2I.stride(0), bgu, bgu.stride(0),
        row_to_pair_S, plan.pair_expert_R, plan.pair_affinity_R, plan.num_pairs,
        act, act.stride(0), act.stride(1), ah, ah.stride(0),
        S, R, I, *limits, **act_meta,
        HAS_BIAS=has_bias,
        BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, RNE_BF16=rne_bf16(operand_dtype),
        num_warps=4,
    )
    return act, ah
