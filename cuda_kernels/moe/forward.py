"""The fused GPU MoE expert-MLP forward of the layer: two grouped GEMMs with one pass between them.

Per call (rows in the grouped layout of the plan, REFERENCE §1.2; math REFERENCE §2)::

    plan, layout, err = build_routing(expert_index, affinity)   # Triton, no host read
    x_S      = gather_rows(X)                                   # BF16 (Triton)
    gu_S     = x_S @ W_gate_up[e]                               # grouped GEMM, BF16 out (cuBLAS)
    act, ah  = activation_forward(gu_S, b_gate_up, clamp, ...)  # one pass (Triton): checkpoint
                                                                # [R, 2, I] + a*h rows, BF16
    out_S    = ah @ W_down[e]                                   # grouped GEMM, BF16 out (cuBLAS)
    y        = token_sum(out_S (+ a * b_down[e]))               # each token sums its rows (Triton)

Where there is no gate/up bias and no clamp, ``gu_S`` already is the checkpoint (the
pre-activations, rounded to BF16 once): the pass then writes no ``act`` and the forward keeps
``gu_S`` itself as the checkpoint, in grouped row order [S, 2I], which the backward's activation
pass reads at its own row (:func:`.grouped_mm_choice.checkpoint_in_rows` decides, from the
layer's options only, so one layer's checkpoint keeps one form).

With ``grouped_mm="ours"`` (or ``"auto"`` where ``configs/cuda/grouped_mm_choice.yaml`` says so:
:mod:`cuda_kernels.moe.grouped_mm_choice`) the first three steps are one kernel::

    act, ah  = gate_up_forward(X, W_gate_up, ..., x_rows_out=x_S)   # gather + GEMM + activation
                                                                    # (CuTe DSL), x_S side-written
                                                                    # where kept (below)

which reads the pre-activation from its fp32 accumulator (one BF16 rounding fewer than the
pass: a checkpoint value can differ by one BF16 ulp) and writes the checkpoint in the same
form (row order where ``checkpoint_in_rows``, which the fused backward reads as well). With
``"ours-gemm"`` the gather and the GEMM are one kernel
(:func:`cuda_kernels.grouped_mm.grouped_mm_gather`, x_S side-written) and the activation stays
a pass.

:func:`moe_forward_split_gate_up` is the same forward on rows already in expert order (an identity
layout: nothing gathered, nothing combined) with the gate and up weights as two operands
(torchtitan's ``w1`` / ``w3`` [E, I, H], read in place: no per-call concatenation)::

    g_S, u_S = x @ W_gate[e]^T, x @ W_up[e]^T                   # two grouped GEMMs, N = I
    act, ah  = activation_forward(g_S, up_SI=u_S, ...)          # one pass, two row pointers
    y        = ah @ W_down[e]                                   # grouped GEMM, y itself

Where the backward's gate/up weight gradient reads X through the routing index itself
(:func:`.grouped_mm_choice.keeps_x_rows`: the shape's ``wgrad_gather`` in
``configs/cuda/grouped_mm_choice.yaml``, and our SM90 wgrad kernel gathers in its operand
load) the forward keeps no ``x_S``: no side output, and the cuBLAS path's gathered rows are
freed after the gate/up GEMM. Elsewhere (the table's default, cuBLAS's wgrad off the 128 grid,
the CPU) it keeps them as before.

No fp32 intermediate goes through HBM, no atomics (bitwise deterministic), no host read of device
values (CUDA-graph capturable). The backward (:mod:`cuda_kernels.moe.backward`) reuses the plan,
the layout, the checkpoint and ``x_S`` where kept. On CPU tensors under ``TRITON_INTERPRET=1``
the Triton kernels run interpreted and the GEMMs in torch: how CPU CI tests this path against
its twin, :func:`common.torch_backward.moe_layer_forward_torch`.
"""

from __future__ import annotations

import torch

from common.problem import Activation, ClampLimits
from common.torch_backward import ALIGN, LayerForward, gate_up_matrix

from .. import grouped_mm as gmm
from ..triton.activation import activation_forward
from ..triton.routing import build_routing, check_routing_async
from ..triton.rows import token_sum
from .grouped_mm_choice import (
    check_grouped_mm,
    checkpoint_in_rows,
    keeps_x_rows,
    kernel_rows,
    pick,
)
from .steps import (
    check_split_gate_up,
    covering_offsets,
    gathered_times_experts,
    identity_rows,
    rows_times_experts,
)

__all__ = ["moe_forward_fused", "moe_forward_split_gate_up"]


def moe_forward_fused(
    hidden_states_TH: torch.Tensor,
    affinity_TK: torch.Tensor,
    expert_index_TK: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    *,
    clamp_limits: ClampLimits | None = None,
    activation: Activation | None = None,
    check_routing: bool = False,
    grouped_mm: str = "auto",
    routing=None,
    keep_x_rows: bool | None = None,
) -> LayerForward:
    """The layer's forward, fused: BF16 GEMM operands, fp32 accumulation, BF16 in HBM.

    Dimensions: T tokens, H hidden, I intermediate, E experts, K top_k, R = T*K, S grouped rows.

    Args:
        hidden_states_TH: [T, H] float (BF16 in training), unit stride along H.
        affinity_TK: [T, K] float router weights (values of dropped slots ignored).
        expert_index_TK: [T, K] integer expert ids, -1 = dropped slot.
        w_gate_up_EH2I: [E, H, 2, I].  w_down_EIH: [E, I, H].  Any float dtype (BF16 operands).
        b_gate_up_E2I: optional [E, 2, I].  b_down_EH: optional [E, H].
        clamp_limits, activation: as :func:`common.torch_backward.moe_forward_torch`.
        check_routing: queue the device-side routing check (bad ids or affinities surface at
            the next synchronisation as a device-side assert naming the argument;
            :func:`.routing.check_routing_async`). Unchecked bad ids are treated as dropped
            slots (memory-safe).
        grouped_mm: ``"cublas"`` (gather pass, cuBLAS GEMM, activation pass), ``"ours"`` (the
            fused :func:`cuda_kernels.grouped_mm.gate_up_forward`), ``"ours-gemm"`` (our
            gathering GEMM, then the activation pass) or ``"auto"`` (default: the
            per-shape table, cuBLAS where our kernel cannot run;
            :mod:`cuda_kernels.moe.grouped_mm_choice`). Same outputs either way (within one BF16
            rounding of the pre-activation).
        routing: optional ``(plan, layout)`` already built (then ``affinity_TK`` and
            ``expert_index_TK`` may be None and no routing build runs). With an identity layout
            (:func:`common.routing.presorted_routing`: rows already in expert order) nothing is
            gathered (the GEMM reads ``hidden_states_TH`` in place; ``x_rows_S`` is those rows)
            and, without a down bias, y is the down GEMM's output (no per-token combine).
        keep_x_rows: keep the gathered X rows [S, H] for the backward (``x_rows_S``). False:
            none is kept -- the gathering GEMMs write no side output and the cuBLAS path's
            gathered rows are freed after the gate/up GEMM -- because the backward's gate/up
            wgrad reads X through the routing index. None (default):
            :func:`.grouped_mm_choice.keeps_x_rows` with the fused backward's defaults (the
            layer passes its own answer, from its options). An identity layout's rows are X
            itself: kept either way.
    Returns:
        :class:`~common.torch_backward.LayerForward`: y [T, H] in the input's dtype, the BF16
        checkpoint ([S, 2I] in the layout's row order where
        :func:`.grouped_mm_choice.checkpoint_in_rows` says so, else [R, 2, I] in the plan's
        pair order), the BF16 X rows [S, H] (None where ``keep_x_rows`` is False), the plan
        and the layout.
    Raises:
        ValueError: ``grouped_mm`` not one of :data:`.grouped_mm_choice.GROUPED_MM`.
        RuntimeError: CPU tensors without the Triton interpreter; ``grouped_mm="ours"`` /
            ``"ours-gemm"`` where its kernel cannot run this call (the message says why).
    """
    check_grouped_mm(grouped_mm)
    act_fn = Activation.resolve(activation)
    E, H, _, I = w_gate_up_EH2I.shape
    bf16 = torch.bfloat16
    if routing is None:
        plan, layout, error_code = build_routing(expert_index_TK, affinity_TK.detach(), E,
                                                 align=ALIGN)
        if check_routing:
            check_routing_async(error_code)
    else:
        plan, layout = routing
    offs = layout.offsets_E
    w_gu, interleaved = gate_up_matrix(w_gate_up_EH2I.to(bf16))  # a view, also for gpt-oss
    x_TH = hidden_states_TH
    rows_ck = checkpoint_in_rows(gate_up_bias=b_gate_up_E2I is not None,
                                 clamp_limits=clamp_limits)
    impl = pick("forward_gate_up", grouped_mm, x_TH, w_gu, layout.row_to_token_S,
                gate_up_interleaved=interleaved)
    if keep_x_rows is None:
        keep_x_rows = keeps_x_rows(x_TH.device, E, H, I)
    keep_x_rows = bool(keep_x_rows) or layout.identity
    if impl == "ours":
        # (an identity layout's rows are x itself: the kernel reads them, no side output)
        # (none either where the backward's wgrad reads X through the index: keep_x_rows)
        x_S = None if layout.identity or not keep_x_rows else torch.empty(
            layout.tokens_sum, H, dtype=bf16, device=x_TH.device)
        ck, ah_S = gmm.gate_up_forward(
            kernel_rows(x_TH), w_gu, layout, plan, activation=act_fn, clamp_limits=clamp_limits,
            b_gate_up_E2I=b_gate_up_E2I, backend="auto",
            x_rows_out=x_S, checkpoint_rows=rows_ck,
        )
        if layout.identity:
            x_S = identity_rows(x_TH)
    else:
        x_S, gu_S = gathered_times_experts(impl, x_TH, w_gu, layout, keep_rows=keep_x_rows)
        ck, ah_S = activation_forward(
            gu_S, layout.row_to_pair_S, plan, activation=act_fn,
            clamp_limits=clamp_limits or ClampLimits(), b_gate_up_E2I=b_gate_up_E2I,
            gate_up_interleaved=interleaved, pair_checkpoint=not rows_ck,
        )
        if rows_ck:  # (BF16 already on the GPU; the CPU twins' GEMMs give BF16 values in fp32)
            ck = gu_S.to(bf16)
        del gu_S
    if layout.identity and b_down_EH is None:  # each row is its own token: y is out_S
        y_TH = rows_times_experts(ah_S, w_down_EIH.to(bf16), covering_offsets(layout))
        return LayerForward(y_TH.to(hidden_states_TH.dtype), ck, x_S, plan, layout)
    out_S = rows_times_experts(ah_S, w_down_EIH.to(bf16), offs)
    del ah_S
    y_TH = token_sum(
        out_S, layout.slot_to_row_TK, hidden_states_TH.dtype,
        bias_EH=b_down_EH, row_to_pair_S=layout.row_to_pair_S, plan=plan,
    )
    return LayerForward(y_TH, ck, x_S, plan, layout)


def moe_forward_split_gate_up(
    x_SH: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EIH: torch.Tensor,
    routing,
    *,
    clamp_limits: ClampLimits | None = None,
    activation: Activation | None = None,
    grouped_mm: str = "auto",
) -> LayerForward:
    """The layer's forward on rows already in expert order with separate gate and up weights
    (torchtitan's ``GroupedExperts``: ``w1`` gate, ``w3`` up), each read in place by its GEMM.

    Dimensions: S rows (= T = R), H hidden, I intermediate, E experts.

    Per row s of expert e: ``g = x[s] W_gate[e]^T``, ``u = x[s] W_up[e]^T`` (two grouped GEMMs,
    BF16 out), then the clamps and ``h = g sigmoid(alpha g) (u + up_offset)`` in one Triton pass
    that reads g and u through two row pointers and writes the checkpoint ``[g, u]`` and the down
    GEMM's operand ``h`` (affinity 1), then ``y[s] = h W_down[e]`` (rows past the counts: 0). No
    weight is copied, concatenated or transposed (``.to(bfloat16)`` is a no-op on BF16 weights).
    The same math as :func:`moe_forward_fused` on ``[w_gate; w_up]`` and the identity layout.

    Args:
        x_SH: [S, H] float rows in expert order (read in place when BF16 and contiguous).
        w_gate_EIH, w_up_EIH: [E, I, H] float, any strides (torchtitan's ``w1`` / ``w3``).
        w_down_EIH: [E, I, H] float (torchtitan's ``w2`` [E, H, I] seen transposed).
        routing: ``(plan, layout)`` of :func:`common.routing.presorted_routing` (an identity
            layout of S rows).
        clamp_limits, activation: as :func:`moe_forward_fused`.
        grouped_mm: ``"auto"`` / ``"cublas"``: the two gate/up GEMMs on cuBLAS
            (``torch._grouped_mm``; the per-shape table was measured for the concatenated
            N = 2I GEMM on gathered rows, so it is not read here); ``"ours-gemm"``: our grouped
            GEMM (:func:`cuda_kernels.grouped_mm.grouped_mm_gather` without a gather; its torch
            twin on CPU tensors). ``"ours"`` is refused: its fused epilogue reads one
            [E, H, 2I] weight.
    Returns:
        :class:`~common.torch_backward.LayerForward`: y [S, H] in ``x_SH``'s dtype, the BF16
        checkpoint [S, 2, I], the BF16 X rows (``x_SH`` itself when BF16 and contiguous), the
        plan and the layout.
    Raises:
        ValueError: bad shapes, dtypes or devices (named), a layout that is not an identity
            layout, a ``grouped_mm`` value not in :data:`.grouped_mm_choice.GROUPED_MM`.
        RuntimeError: ``grouped_mm="ours"``; CPU tensors without the Triton interpreter.
    """
    plan, layout = routing
    check_split_gate_up(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH, layout)
    check_grouped_mm(grouped_mm)
    if grouped_mm == "ours":
        raise RuntimeError(
            "grouped_mm='ours' cannot run with separate gate and up weights: the fused "
            "epilogue reads one [E, H, 2I] gate/up weight; use 'auto', 'cublas' or 'ours-gemm'"
        )
    impl = "ours-gemm" if grouped_mm == "ours-gemm" else "cublas"
    bf16 = torch.bfloat16
    x_S = identity_rows(x_SH)
    _, g_S = gathered_times_experts(impl, x_S, w_gate_EIH.to(bf16).transpose(1, 2), layout)
    _, u_S = gathered_times_experts(impl, x_S, w_up_EIH.to(bf16).transpose(1, 2), layout)
    act_R2I, ah_S = activation_forward(
        g_S, layout.row_to_pair_S, plan, activation=Activation.resolve(activation),
        clamp_limits=clamp_limits or ClampLimits(), up_SI=u_S,
    )
    del g_S, u_S
    y_SH = rows_times_experts(ah_S, w_down_EIH.to(bf16), covering_offsets(layout))
    return LayerForward(y_SH.to(x_SH.dtype), act_R2I, x_S, plan, layout)
