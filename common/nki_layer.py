"""A SwiGLU expert MLP whose backward is the NKI blockwise MXFP8 kernel (the training layer with
the ``nki`` backends' defaults: it sits beside :mod:`common.layer`, above the backends, which it
reaches by name through :mod:`common.dispatch`).

:func:`moe_expert_mlp` is :func:`common.layer.moe_experts` (one autograd Function for every
backend: BF16-operand forward that saves the activation checkpoint, backward through
:mod:`common.dispatch`) with the NKI defaults: backend ``nki-sim`` (the kernel on our CPU
interpreter; ``nki`` on Trainium) and the kernel's options (block_size, padding, run_with_lnc2,
accumulation_dtype, phase_configs, ...) passed through. Gradients come back in the model's
layouts: W_gate_up ``[E, H, 2, I]``, W_down ``[E, I, H]``, per-slot affinity ``[T, K]``.
:func:`expert_mlp_forward` is the fp32 forward (output and checkpoint) for references.

Math (REFERENCE §2), per routed pair (t, e) with affinity a:
``g = clamp_gate(x Wg + bg)``, ``u = clamp_up(x Wu + bu)``, ``h = silu(g) * u``,
``y[t] += a * (h Wd + bd)``.
"""

from __future__ import annotations

from typing import Any

import torch

from common.layer import MoEExpertsOptions, moe_experts
from common.problem import ClampLimits
from common.routing import RoutingPlan
from common.torch_backward import moe_forward_torch

__all__ = ["expert_mlp_forward", "moe_expert_mlp"]


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
    """MoE expert MLP (SwiGLU, affinity-weighted sum over top_k) with the NKI MXFP8 backward:
    :func:`common.layer.moe_experts` with ``backend`` and ``options`` as its
    :class:`~common.layer.MoEExpertsOptions`.

    Args:
        hidden_states_TH: [T, H] float (BF16 in training).
        expert_index_TK: [T, K] int, expert of each router slot, -1 = dropped.
        affinity_TK: [T, K] float, router weights (differentiable).
        w_gate_up_EH2I: [E, H, 2, I]; w_down_EIH: [E, I, H]; optional biases [E, 2, I], [E, H].
        clamp_limits: optional :class:`~common.problem.ClampLimits`.
        backend: a :mod:`common.dispatch` backend name for the backward (``"nki-sim"``,
            ``"nki"``, or ``"reference"``/``"torch"`` for comparison). ``"reference"`` is
            not a float64 anchor here: it runs the float64 backward on what the forward saved,
            the BF16 checkpoint ``act [R, 2, I]``, and returns gradients in the inputs' dtype,
            so against a float64 forward + backward of the same inputs it is bounded by the
            BF16 checkpoint at ~47-52 dB (measured, T=256 H=512 I=256 E=16 top-4: 47.3-49.9 dB
            with float32 inputs, 50.2-52.0 dB with BF16 inputs; the ``"torch"`` backward there:
            45.7-50.4 dB). For a float64 anchor call :func:`common.reference.reference_forward`
            and :func:`common.reference.reference_backward` on float64 tensors.
        **options: passed to the backend's run (for nki/nki-sim: block_size, padding,
            run_with_lnc2, accumulation_dtype, phase_configs, ...).

    Returns:
        y [T, H] in ``hidden_states_TH.dtype``.

    Raises:
        ValueError: bad routing, shapes or options (named), in forward; a backend option the
            backend does not know, in backward. RuntimeError: a backend that cannot run here
            (in forward); a double backward.
    """
    opts = MoEExpertsOptions(
        clamp_limits=clamp_limits, backend=backend, backend_options=tuple(sorted(options.items()))
    )
    return moe_experts(hidden_states_TH, expert_index_TK, affinity_TK, w_gate_up_EH2I,
                       w_down_EIH, b_gate_up_E2I, b_down_EH, options=opts)
