"""Autograd wrapper: a SwiGLU expert MLP whose backward is the NKI blockwise MXFP8 kernel.

In the style of training stacks' MoE layers (e.g. NxD / torchtitan expert MLPs with a custom
backward): the forward computes the expert MLP in torch and saves the activation checkpoint
(clamped gate/up pre-activations per routed pair); the backward builds a
:class:`~common.problem.MoEBackwardProblem` and runs a backend (``nki-sim`` by default: the
kernel on our CPU interpreter; ``nki`` on Trainium), which slices padding and returns gradients
in the model's layouts: W_gate_up grads ``[E, H, 2, I]``, W_down ``[E, I, H]``, and per-slot
affinity grads ``[T, K]`` through ``plan.slot_affinity_grad``.

Math (REFERENCE §2), per routed pair (t, e) with affinity a:
``g = clamp_gate(x Wg + bg)``, ``u = clamp_up(x Wu + bu)``, ``h = silu(g) * u``,
``y[t] += a * (h Wd + bd)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from common.layer import first_order_only
from common.problem import ClampLimits, MoEBackwardProblem
from common.routing import RoutingPlan, plan_routing
from common.torch_backward import moe_forward_torch

__all__ = ["MoEExpertMLPFunction", "expert_mlp_forward", "moe_expert_mlp"]


def expert_mlp_forward(
    hidden_states_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    plan: RoutingPlan,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU expert MLP forward over a routing plan, fp32 math.

    Args:
        hidden_states_TH: [T, H] float (BF16 in training).
        w_gate_up_EH2I: [E, H, 2, I] float, gate (index 0) / up (index 1).
        w_down_EIH: [E, I, H] float.
        plan: :class:`~common.routing.RoutingPlan` with T tokens and E experts.
        b_gate_up_E2I: optional [E, 2, I]; b_down_EH: optional [E, H].
        clamp_limits: optional :class:`~common.problem.ClampLimits` (non_linear = gate,
            linear = up).

    Returns:
        ``(y_TH, act_checkpoint_R2I)``: y [T, H] in ``hidden_states_TH.dtype``; the checkpoint
        [R, 2, I] in ``hidden_states_TH.dtype`` (clamped g, u of each pair in the plan's pair
        order; padding rows 0).

    Raises:
        ValueError: shapes that disagree with each other or with the plan.

    Computed by :func:`common.torch_backward.moe_forward_torch` with fp32 operands (grouped
    GEMMs on the plan's grouped layout; no host read of the routing on CUDA).
    """
    T, H = hidden_states_TH.shape
    if w_gate_up_EH2I.dim() != 4 or w_gate_up_EH2I.shape[1] != H or w_gate_up_EH2I.shape[2] != 2:
        raise ValueError(
            f"w_gate_up_EH2I must be [E, H={H}, 2, I], got {tuple(w_gate_up_EH2I.shape)}"
        )
    E, _, _, I = w_gate_up_EH2I.shape
    if tuple(w_down_EIH.shape) != (E, I, H):
        raise ValueError(f"w_down_EIH must be [E={E}, I={I}, H={H}], got {tuple(w_down_EIH.shape)}")
    if plan.num_tokens != T or plan.num_experts != E:
        raise ValueError(
            f"plan has T={plan.num_tokens}, E={plan.num_experts}; tensors have T={T}, E={E}"
        )
    y, act = moe_forward_torch(
        hidden_states_TH, w_gate_up_EH2I, w_down_EIH, plan, b_gate_up_E2I=b_gate_up_E2I,
        b_down_EH=b_down_EH, clamp_limits=clamp_limits, compute_dtype=torch.float32,
    )
    return y.to(hidden_states_TH.dtype), act.to(hidden_states_TH.dtype)


class MoEExpertMLPFunction(torch.autograd.Function):
    """``y = MoE expert MLP(x)`` with the NKI blockwise MXFP8 kernel as its backward.

    ``apply(hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
    expert_index_TK, clamp_limits, backend, options)``; differentiable in the first six
    (biases may be None). Gradients: dX [T, H], d_affinity [T, K] (per router slot; dropped
    slots 0), dW_gate_up [E, H, 2, I], dW_down [E, I, H], d_b_gate_up [E, 2, I], d_b_down [E, H],
    each in its input's dtype. First order only: the backward is marked ``once_differentiable``,
    so differentiating the gradients (double backward) raises RuntimeError.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_states_TH: torch.Tensor,
        affinity_TK: torch.Tensor,
        w_gate_up_EH2I: torch.Tensor,
        w_down_EIH: torch.Tensor,
        b_gate_up_E2I: torch.Tensor | None,
        b_down_EH: torch.Tensor | None,
        expert_index_TK: torch.Tensor,
        clamp_limits: ClampLimits | None,
        backend: str,
        options: dict,
    ) -> torch.Tensor:
        from common.dispatch import resolve_backend

        # Resolve the backward's backend now, so an unusable one fails before any work.
        chosen = resolve_backend(backend, hidden_states_TH.device)
        plan = plan_routing(expert_index_TK, affinity_TK.detach(), w_down_EIH.shape[0])
        y_TH, act_R2I = expert_mlp_forward(
            hidden_states_TH,
            w_gate_up_EH2I,
            w_down_EIH,
            plan,
            b_gate_up_E2I,
            b_down_EH,
            clamp_limits,
        )
        ctx.save_for_backward(
            hidden_states_TH, w_gate_up_EH2I, w_down_EIH, act_R2I, b_gate_up_E2I, b_down_EH
        )
        ctx.plan = plan
        ctx.clamp_limits = clamp_limits
        ctx.backend = chosen
        ctx.options = dict(options)
        ctx.affinity_dtype = affinity_TK.dtype
        return y_TH

    @staticmethod
    @first_order_only
    @once_differentiable
    def backward(ctx: Any, grad_y_TH: torch.Tensor):
        x, wgu, wd, act, bgu, bd = ctx.saved_tensors
        problem = MoEBackwardProblem(
            hidden_states_TH=x,
            output_grad_TH=grad_y_TH.contiguous(),
            w_gate_up_EH2I=wgu,
            w_down_EIH=wd,
            plan=ctx.plan,
            act_checkpoint_R2I=act,
            b_gate_up_E2I=bgu,
            b_down_EH=bd,
            clamp_limits=ctx.clamp_limits,
        )
        grads = ctx.backend.run(problem, **ctx.options)
        need = ctx.needs_input_grad
        dx = grads.hidden_states_grad_TH.to(x.dtype) if need[0] else None
        d_aff = (
            ctx.plan.slot_affinity_grad(grads.affinity_grad_TE).to(ctx.affinity_dtype)
            if need[1]
            else None
        )
        dwgu = grads.w_gate_up_grad_EH2I.to(wgu.dtype) if need[2] else None
        dwd = grads.w_down_grad_EIH.to(wd.dtype) if need[3] else None
        dbgu = grads.b_gate_up_grad_E2I.to(bgu.dtype) if need[4] and bgu is not None else None
        dbd = grads.b_down_grad_EH.to(bd.dtype) if need[5] and bd is not None else None
        return dx, d_aff, dwgu, dwd, dbgu, dbd, None, None, None, None


def moe_expert_mlp(
    hidden_states_TH: torch.Tensor,
    expert_index_TK: torch.Tensor,
    affinity_TK: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    *,
    clamp_limits: ClampLimits | None = None,
    backend: str = "nki-sim",
    **options: Any,
) -> torch.Tensor:
    """MoE expert MLP (SwiGLU, affinity-weighted sum over top_k) with the NKI MXFP8 backward.

    Args:
        hidden_states_TH: [T, H] float (BF16 in training).
        expert_index_TK: [T, K] int, expert of each router slot, -1 = dropped.
        affinity_TK: [T, K] float, router weights (differentiable).
        w_gate_up_EH2I: [E, H, 2, I]; w_down_EIH: [E, I, H]; optional biases [E, 2, I], [E, H].
        clamp_limits: optional :class:`~common.problem.ClampLimits`.
        backend: a :mod:`common.dispatch` backend name for the backward (``"nki-sim"``,
            ``"nki"``, or ``"reference"``/``"torch"`` for comparison).
        **options: passed to the backend's run (for nki/nki-sim: block_size, padding,
            run_with_lnc2, accumulation_dtype, phase_configs, ...).

    Returns:
        y [T, H] in ``hidden_states_TH.dtype``.

    Raises:
        ValueError: bad routing or shapes (from :func:`common.routing.plan_routing` and the
            forward); RuntimeError in backward when the backend cannot run here.
    """
    return MoEExpertMLPFunction.apply(
        hidden_states_TH,
        affinity_TK,
        w_gate_up_EH2I,
        w_down_EIH,
        b_gate_up_E2I,
        b_down_EH,
        expert_index_TK,
        clamp_limits,
        backend,
        options,
    )
