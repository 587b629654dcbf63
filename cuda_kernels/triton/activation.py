"""Triton kernels of the gated activation: the forward epilogue of the gate/up GEMM and its
derivative, the epilogue of the down-projection dgrad, in one file (their formula is
:mod:`common.activation`'s torch definition, written here in Triton).

* :func:`activation_forward` -- bias, clamp and the gated activation of every grouped row in one
  pass, writing the BF16 checkpoint the backward reads (clamped pre-activations ``[R, 2, I]`` in
  the plan's pair order; not written where the caller keeps the GEMM's output rows as the
  checkpoint: no bias, no clamp) and the down GEMM's operand ``a * h`` (BF16, grouped rows). No
  fp32 intermediate goes through HBM.
* :func:`activation_backward` -- from ``dh_raw`` and the forward checkpoint (by pair, or by row
  in the grouped row order), the gated-activation backward with the strict clamp masks,
  ``a * h`` and the affinity gradient ``dA`` written straight into its dense ``[T, E]`` cell
  (REFERENCE §2).

Easy to get wrong: gpt-oss's interleaved gate/up columns (gate i at 2i, up i at 2i + 1) are
read and written as contiguous [BLOCK_M, 2 BLOCK_I] tiles split / joined in registers, never as
two column-stride-2 accesses; a grouped-row checkpoint's column order is the forward GEMM's
(the weight's), which can differ from the order ``d_gate_up`` is written in (a main_grad
accumulation writes the concatenated order for an interleaved weight).
* :func:`activation_args` -- the launch arguments both take (an Activation and ClampLimits as
  scalars and constexpr flags).

Each kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``). Importing this module needs ``triton``; it does not query the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import TritonKernel, cast, rne_bf16

__all__ = ["activation_args", "activation_backward", "activation_forward"]


@triton.jit
def _load_gate_up(g_rows, u_rows, i0, I, valid, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                  GU_INTERLEAVED: tl.constexpr):
    """Gate and up columns ``i0 .. i0 + BLOCK_I`` as two fp32 [BLOCK_M, BLOCK_I] tiles, 0 where
    ``valid`` is False or the column is past I. ``g_rows`` / ``u_rows``: [BLOCK_M] pointers to
    column 0 of the gate and the up operand's rows.

    Two operands (the halves ``gu[:, :I]`` / ``gu[:, I:]`` of one [S, 2I] row, or two [S, I]
    rows): gate i at column i of one, up i at column i of the other (two contiguous loads).
    Interleaved (gpt-oss's own weight layout; both pointers are the one [S, 2I] row): gate i at
    2i, up i at 2i + 1 -- one contiguous [BLOCK_M, 2 * BLOCK_I] load split in registers (two
    loads at column stride 2 would use half of every memory transaction)."""
    if GU_INTERLEAVED:
        c2 = 2 * i0 + tl.arange(0, 2 * BLOCK_I)
        m2 = valid[:, None] & (c2 < 2 * I)[None, :]
        gu = tl.load(g_rows[:, None] + c2[None, :], mask=m2, other=0.0)
        g, u = tl.split(tl.reshape(gu, [BLOCK_M, BLOCK_I, 2]))
    else:
        cols = i0 + tl.arange(0, BLOCK_I)
        m = valid[:, None] & (cols < I)[None, :]
        g = tl.load(g_rows[:, None] + cols[None, :], mask=m, other=0.0)
        u = tl.load(u_rows[:, None] + cols[None, :], mask=m, other=0.0)
    return g.to(tl.float32), u.to(tl.float32)


@triton.jit
def _store_gate_up(g_rows, u_rows, i0, I, g, u, valid, BLOCK_M: tl.constexpr,
                   BLOCK_I: tl.constexpr, GU_INTERLEAVED: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_I] tiles ``g`` and ``u`` (already in the rows' dtype) at the
    gate and up columns ``i0 .. i0 + BLOCK_I`` where ``valid`` and the column is inside I; the
    column order of :func:`_load_gate_up` (interleaved: joined in registers, one contiguous
    [BLOCK_M, 2 * BLOCK_I] store at ``g_rows``)."""
    if GU_INTERLEAVED:
        c2 = 2 * i0 + tl.arange(0, 2 * BLOCK_I)
        m2 = valid[:, None] & (c2 < 2 * I)[None, :]
        gu = tl.reshape(tl.join(g, u), [BLOCK_M, 2 * BLOCK_I])
        tl.store(g_rows[:, None] + c2[None, :], gu, mask=m2)
    else:
        cols = i0 + tl.arange(0, BLOCK_I)
        m = valid[:, None] & (cols < I)[None, :]
        tl.store(g_rows[:, None] + cols[None, :], g, mask=m)
        tl.store(u_rows[:, None] + cols[None, :], u, mask=m)


def _activation_forward_kernel(
    gu_ptr, stride_gu, up_ptr, stride_up, bgu_ptr, stride_bgu,
    r2p_ptr, pair_expert_ptr, pair_alpha_ptr, num_pairs_ptr,
    act_ptr, stride_act_r, stride_act_c, ah_ptr, stride_ah,
    S, R, I,
    g_lo, g_hi, u_lo, u_hi,
    ACT_ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    G_HAS_LO: tl.constexpr, G_HAS_HI: tl.constexpr,
    U_HAS_LO: tl.constexpr, U_HAS_HI: tl.constexpr,
    HAS_BIAS: tl.constexpr, GU_INTERLEAVED: tl.constexpr, WRITE_ACT: tl.constexpr,
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
    tail = rows64 < 0
    if WRITE_ACT:
        num_pairs = tl.load(num_pairs_ptr).to(tl.int64)
        tail = (rows64 >= num_pairs) & (rows64 < R)
    out_ty = ah_ptr.dtype.element_ty
    act_ty = act_ptr.dtype.element_ty
    for i0 in range(0, I, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        in_i = (cols < I)[None, :]
        m = valid[:, None] & in_i
        g, u = _load_gate_up(gu_ptr + rows64 * stride_gu, up_ptr + rows64 * stride_up, i0, I,
                             valid, BLOCK_M, BLOCK_I, GU_INTERLEAVED)
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
        if WRITE_ACT:
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
    gate_up_interleaved: bool = False,
    up_SI: torch.Tensor | None = None,
    pair_checkpoint: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Bias, clamp and gated activation of every grouped row (REFERENCE §2).

    Per row s of pair p (expert e, affinity a), with ``[g_raw, u_raw] = gu_S2I[s]`` (or
    ``g_raw = gu_S2I[s]``, ``u_raw = up_SI[s]`` with two operands)::

        g = clamp_gate(g_raw + b_gate_up[e, 0])      u = clamp_up(u_raw + b_gate_up[e, 1])
        h = g * sigmoid(alpha * g) * (u + up_offset)  # SwiGLU: alpha 1, up_offset 0
        act[p] = [g, u]  (rounded to operand_dtype)   a_h[s] = a * h  (rounded once)

    in fp32 registers (the clamp keeps the value at the limit; the backward's strict masks read
    the stored value). Without a bias and a clamp, ``[g, u]`` is ``gu_S2I[s]`` itself: the
    caller may then keep the GEMM's BF16 output rows as the checkpoint, in grouped row order
    (``pair_checkpoint=False``: no ``act`` is written; :func:`activation_backward` reads either).

    Args:
        gu_S2I: [S, 2I] float, the gate/up GEMM's output rows (gate columns first; with
            ``gate_up_interleaved`` gate i at column 2i and up i at 2i + 1, the GEMM's output on
            gpt-oss's interleaved weight), unit stride along columns. With ``up_SI``: the gate
            GEMM's output rows [S, I] (separate gate and up weights, torchtitan's w1 / w3).
        row_to_pair_S: [S] int64, the plan pair of each grouped row, -1 for padding rows.
        plan: the :class:`~common.routing.RoutingPlan` (pair experts, merged affinities,
            ``num_pairs``); R = ``plan.pair_token_R.shape[0]`` <= S.
        activation: :class:`~common.problem.Activation`.  clamp_limits: ClampLimits.
        b_gate_up_E2I: optional [E, 2, I] gate/up bias.
        operand_dtype: dtype of both outputs (BF16).
        gate_up_interleaved: ``gu_S2I``'s columns interleaved (above).
        up_SI: optional [S, I] float, the up GEMM's output rows; ``gu_S2I`` is then the gate's
            [S, I] (not with ``gate_up_interleaved``). Both are read in place (unit stride
            along columns, any row stride).
        pair_checkpoint: write the checkpoint ``act`` (default); False only without a bias and
            a clamp (above).
    Returns:
        ``(act_R2I [R, 2, I], a_h_SI [S, I])``: the checkpoint in the plan's pair order
        (entries past ``num_pairs`` exactly 0; None without ``pair_checkpoint``) and the down
        GEMM's rows (padding rows 0).
    Raises:
        ValueError: S < R (not a grouped layout of this plan); ``up_SI`` not of the gate rows'
            shape and device, or given with ``gate_up_interleaved``; ``pair_checkpoint=False``
            with a gate/up bias or an active clamp.
    """
    if up_SI is None:
        S, I2 = gu_S2I.shape
        I = I2 // 2
    else:
        S, I = gu_S2I.shape
        if gate_up_interleaved:
            raise ValueError("up_SI (separate gate and up rows) cannot be interleaved")
        if tuple(up_SI.shape) != (S, I) or up_SI.device != gu_S2I.device:
            raise ValueError(
                f"up_SI must be [S={S}, I={I}] on {gu_S2I.device} like the gate rows, got "
                f"{list(up_SI.shape)} on {up_SI.device}"
            )
    R = plan.pair_token_R.shape[0]
    if S < R:
        raise ValueError(f"gu_S2I has {S} rows, fewer than the plan's R={R} pair slots")
    has_bias = b_gate_up_E2I is not None
    if not pair_checkpoint and (has_bias or clamp_limits.is_active):
        raise ValueError(
            "pair_checkpoint=False keeps the GEMM's output rows as the checkpoint, which they "
            "are only without a gate/up bias and a clamp; this call has "
            + ("a gate/up bias" if has_bias else f"clamp limits {clamp_limits!r}")
        )
    dev = gu_S2I.device
    act = torch.empty(R, 2, I, dtype=operand_dtype, device=dev) if pair_checkpoint else None
    ah = torch.empty(S, I, dtype=operand_dtype, device=dev)
    if S == 0 or I == 0:
        return (act.zero_() if pair_checkpoint else None), ah
    if gu_S2I.stride(1) != 1:
        gu_S2I = gu_S2I.contiguous()
    # the gate and up operands: one code path for the concatenated halves of one [S, 2I] row
    # and two separate [S, I] rows; the interleaved row is both (columns 2i / 2i + 1)
    if up_SI is not None:
        gate, up = gu_S2I, up_SI if up_SI.stride(1) == 1 else up_SI.contiguous()
    elif gate_up_interleaved:
        gate, up = gu_S2I, gu_S2I
    else:
        gate, up = gu_S2I[:, :I], gu_S2I[:, I:]
    act_arg = act if pair_checkpoint else ah  # (a stand-in the kernel does not touch)
    bgu = b_gate_up_E2I.reshape(-1, 2 * I).contiguous() if has_bias else gu_S2I
    limits, act_meta = activation_args(activation, clamp_limits)
    BLOCK_M = 16
    BLOCK_I = min(128, triton.next_power_of_2(I))
    _ACTIVATION_FORWARD.launch(
        dev, (triton.cdiv(S, BLOCK_M),),
        gate, gate.stride(0), up, up.stride(0), bgu, bgu.stride(0),
        row_to_pair_S, plan.pair_expert_R, plan.pair_affinity_R, plan.num_pairs,
        act_arg, act_arg.stride(0), act_arg.stride(1), ah, ah.stride(0),
        S, R, I, *limits, **act_meta,
        HAS_BIAS=has_bias, GU_INTERLEAVED=bool(gate_up_interleaved),
        WRITE_ACT=bool(pair_checkpoint), BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I,
        RNE_BF16=rne_bf16(operand_dtype),
        num_warps=4,
    )
    return act, ah


# ------------------------------------------------------------------------------- backward
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
    dgu_ptr, stride_dgu, du_ptr, stride_du, ah_ptr, stride_ah, da_ptr,
    S, I, H, E,
    g_lo, g_hi, u_lo, u_hi,
    ACT_ALPHA: tl.constexpr, UP_OFFSET: tl.constexpr,
    G_HAS_LO: tl.constexpr, G_HAS_HI: tl.constexpr,
    U_HAS_LO: tl.constexpr, U_HAS_HI: tl.constexpr,
    HAS_BD: tl.constexpr, GU_INTERLEAVED: tl.constexpr,
    CK_ROWS: tl.constexpr, CK_INTERLEAVED: tl.constexpr,
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
        if CK_ROWS:  # the checkpoint in grouped row order: this row's own [S, 2I] row
            ck_rows = act_ptr + rows64 * stride_act_r  # [S, 2I]: halves or interleaved
            if CK_INTERLEAVED:
                ck_up = ck_rows
            else:
                ck_up = ck_rows + I
            g, u = _load_gate_up(ck_rows, ck_up, i0, I, valid, BLOCK_M, BLOCK_I, CK_INTERLEAVED)
        else:  # [R, 2, I] in the plan's pair order
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
        out_ty = dgu_ptr.dtype.element_ty
        _store_gate_up(dgu_ptr + rows64 * stride_dgu, du_ptr + rows64 * stride_du, i0, I,
                       cast(dg, out_ty, RNE_BF16), cast(du, out_ty, RNE_BF16), in_rows,
                       BLOCK_M, BLOCK_I, GU_INTERLEAVED)
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
    checkpoint: torch.Tensor,
    row_to_pair_S: torch.Tensor,
    plan,
    *,
    activation,
    clamp_limits,
    dy_SH: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    operand_dtype: torch.dtype = torch.bfloat16,
    gate_up_interleaved: bool = False,
    gate_up_apart: bool = False,
    checkpoint_interleaved: bool = False,
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
        checkpoint: the forward checkpoint (g, u of every pair), either ``[R, 2, I]`` float in
            the plan's pair order (unit stride along I), read through ``row_to_pair_S``, or
            ``[S, 2I]`` float in the grouped row order (row s holds its own pair's g, u: the
            gate/up GEMM's output rows where there is no bias and no clamp; unit stride along
            columns), read at row s.
        row_to_pair_S: [S] int64, pair of each grouped row, -1 for padding rows.
        plan: the :class:`~common.routing.RoutingPlan` (pair tokens, experts, affinities).
        activation: :class:`~common.problem.Activation`.  clamp_limits: ClampLimits.
        dy_SH, b_down_EH: grouped dY rows [S, H] and the down bias [E, H], only with a bias.
        operand_dtype: dtype of the two outputs that feed GEMMs (BF16).
        gate_up_interleaved: write ``d_gate_up`` with dg i at column 2i and du i at 2i + 1 (the
            layout of gpt-oss's interleaved weight) instead of the two halves.
        gate_up_apart: write ``d_gate_up`` as [2, S, I]: dg rows then du rows, each a dense
            [S, I] operand of its own weight's GEMMs (separate gate and up weights, torchtitan's
            w1 / w3). Not with ``gate_up_interleaved``.
        checkpoint_interleaved: an [S, 2I] checkpoint's columns are interleaved (g i at 2i,
            u i at 2i + 1: the forward GEMM's output on an interleaved weight), else halves.
    Returns:
        ``(d_gate_up_S2I [S, 2I] ([2, S, I] with gate_up_apart), a_h_SI [S, I], dA_TE [T, E]
        fp32)``; padding rows of the first two are exactly 0, and dA is 0 where a token is not
        routed.
    Raises:
        ValueError: ``gate_up_apart`` with ``gate_up_interleaved``; ``checkpoint`` is neither
            [R, 2, I] nor [S, 2I].
    """
    if gate_up_apart and gate_up_interleaved:
        raise ValueError("gate_up_apart and gate_up_interleaved exclude each other")
    S, I = dh_raw_SI.shape
    T, E = plan.num_tokens, plan.num_experts
    R = plan.pair_token_R.shape[0]
    rows_ck = checkpoint.dim() == 2
    if tuple(checkpoint.shape) not in ((R, 2, I), (S, 2 * I)):
        raise ValueError(
            f"checkpoint must be [R={R}, 2, I={I}] (pair order) or [S={S}, {2 * I}] (grouped "
            f"row order), got {list(checkpoint.shape)}"
        )
    dev = dh_raw_SI.device
    dgu = torch.empty(*((2, S, I) if gate_up_apart else (S, 2 * I)), dtype=operand_dtype,
                      device=dev)
    ah = torch.empty(S, I, dtype=operand_dtype, device=dev)
    da = torch.zeros(T, E, dtype=torch.float32, device=dev)
    if S == 0 or I == 0:
        return dgu, ah, da
    if checkpoint.stride(-1) != 1:
        checkpoint = checkpoint.contiguous()
    ck_col = 0 if rows_ck else checkpoint.stride(1)
    if dh_raw_SI.stride(1) != 1:
        dh_raw_SI = dh_raw_SI.contiguous()
    has_bd = b_down_EH is not None
    if has_bd:
        dy_SH = dy_SH if dy_SH.stride(1) == 1 else dy_SH.contiguous()
        b_down_EH = b_down_EH if b_down_EH.stride(1) == 1 else b_down_EH.contiguous()
        H = dy_SH.shape[1]
    else:
        dy_SH, b_down_EH, H = dh_raw_SI, dh_raw_SI, 1  # unused stand-ins
    # where dg and du go: one code path for the halves of one [S, 2I] row and two [S, I] rows;
    # the interleaved row takes both (columns 2i / 2i + 1)
    if gate_up_apart:
        dg_out, du_out = dgu[0], dgu[1]
    elif gate_up_interleaved:
        dg_out, du_out = dgu, dgu
    else:
        dg_out, du_out = dgu[:, :I], dgu[:, I:]
    limits, act_meta = activation_args(activation, clamp_limits)
    BLOCK_M = 16
    BLOCK_I = min(128, triton.next_power_of_2(I))
    BLOCK_H = min(256, triton.next_power_of_2(H))
    _ACTIVATION_BACKWARD.launch(
        dev, (triton.cdiv(S, BLOCK_M),),
        dh_raw_SI, dh_raw_SI.stride(0),
        checkpoint, checkpoint.stride(0), ck_col,
        row_to_pair_S, plan.pair_token_R, plan.pair_expert_R, plan.pair_affinity_R,
        dy_SH, dy_SH.stride(0), b_down_EH, b_down_EH.stride(0),
        dg_out, dg_out.stride(0), du_out, du_out.stride(0), ah, ah.stride(0), da,
        S, I, H, E, *limits, **act_meta,
        HAS_BD=has_bd, GU_INTERLEAVED=bool(gate_up_interleaved),
        CK_ROWS=rows_ck, CK_INTERLEAVED=rows_ck and bool(checkpoint_interleaved),
        BLOCK_M=BLOCK_M, BLOCK_I=BLOCK_I, BLOCK_H=BLOCK_H, RNE_BF16=rne_bf16(operand_dtype),
        num_warps=4,
    )
    return dgu, ah, da
