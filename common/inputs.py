"""Seeded synthetic inputs for one MoE layer's backward: weights, router output, checkpoint.

Used by the ``moe-bwd`` command line, the tests and the benchmarks so that every backend sees
the same problem. Scales keep every activation O(1): X ~ N(0, 1), gate/up weights ~ N(0, 1/H),
down weights ~ N(0, 1/I), dY ~ N(0, 1), biases ~ N(0, 0.1^2). Every tensor is drawn by the
counter-based generator :func:`common.counter_rng.normal` (65536 normal quantiles picked by a
hash of the seed, the tensor's field name and the element index; rounded to the compute dtype,
BF16, once) directly on the target device: the same bits on every device, and no CPU draws to
copy to a GPU. The router is simulated on the CPU (:mod:`common.router_sim`, seed + 1). The
checkpoint is the clamped gate/up pre-activations of a BF16 forward with fp32 accumulation
(:func:`common.torch_backward.moe_forward_checkpoint_torch`), computed on the target device and
stored in BF16 as a training forward stores it. The problem carries its
:class:`~common.problem.Activation` (SwiGLU, or gpt-oss for ``swiglu_clamped`` models).
"""

from __future__ import annotations

import torch

from common.counter_rng import normal
from common.models import MoEModelShape
from common.problem import SWIGLU, Activation, ClampLimits, MoEBackwardProblem
from common.router_sim import simulate_model_routing, simulate_router
from common.routing import plan_routing
from common.torch_backward import moe_forward_checkpoint_torch

__all__ = ["make_problem", "make_problem_for_model"]


def make_problem(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int = 0,
    bias: bool = False,
    clamp_limits: ClampLimits | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    expert_index: torch.Tensor | None = None,
    affinity: torch.Tensor | None = None,
    skew: float = 1.0,
    activation: Activation | None = None,
    weights=None,
) -> MoEBackwardProblem:
    """A seeded :class:`MoEBackwardProblem` of the given sizes.

    Args:
        num_tokens, hidden, intermediate, num_experts, top_k: T, H, I, E, K.
        seed: seeds every draw (:func:`common.counter_rng.normal`, one stream per tensor, named
            by its field: ``hidden_states_TH``, ``output_grad_TH``, ``w_gate_up_EH2I``,
            ``w_down_EIH``, ``b_gate_up_E2I``, ``b_down_EH``; drawn on ``device``, where the
            checkpoint forward runs; the simulated router uses ``seed + 1``).
        bias: draw gate/up and down biases.
        clamp_limits: optional clamp of the pre-activations (forward and masks).
        dtype: compute dtype of inputs, weights and checkpoint (BF16).
        device: where the problem lives.
        expert_index, affinity: optional router output [T, K]; default the seeded router
            simulation (softmax top-k with load skew ``skew``).
        activation: the problem's :class:`~common.problem.Activation`; None = SwiGLU. The
            checkpoint (pre-activations) does not depend on it.
        weights: optional :class:`~common.loaders.ExpertWeights` (real expert weights) used
            instead of the seeded draws; ``x`` and ``dy`` are the same seeded draws either way
            (each tensor has its own stream). Its biases are used when ``bias`` (and must then be
            there).
    Raises:
        ValueError: bad sizes (from the router simulation / routing validation), or an
            ``activation`` that is not an Activation.
    """
    if activation is None:
        activation = SWIGLU
    if not isinstance(activation, Activation):
        raise ValueError(
            f"activation must be an Activation or None, got {type(activation).__name__}"
        )
    T, H, I, E = num_tokens, hidden, intermediate, num_experts
    dev = torch.device(device)

    def randn(name, *shape, std=1.0):
        return normal(shape, seed=seed, stream=name, std=std, dtype=dtype, device=dev)

    if expert_index is None:
        expert_index, affinity = simulate_router(T, E, top_k, seed=seed + 1, skew=skew)
    x = randn("hidden_states_TH", T, H)
    dy = randn("output_grad_TH", T, H)
    if weights is None:
        w_gate_up = randn("w_gate_up_EH2I", E, H, 2, I, std=H**-0.5)
        w_down = randn("w_down_EIH", E, I, H, std=I**-0.5)
        b_gate_up = randn("b_gate_up_E2I", E, 2, I, std=0.1) if bias else None
        b_down = randn("b_down_EH", E, H, std=0.1) if bias else None
    else:
        w_gate_up, w_down = weights.w_gate_up_EH2I.to(dtype), weights.w_down_EIH.to(dtype)
        if tuple(w_gate_up.shape) != (E, H, 2, I) or tuple(w_down.shape) != (E, I, H):
            raise ValueError(
                f"weights: shapes {list(w_gate_up.shape)} / {list(w_down.shape)} do not match "
                f"E={E}, H={H}, I={I}"
            )
        b_gate_up = b_down = None
        if bias:
            if weights.b_gate_up_E2I is None or weights.b_down_EH is None:
                raise ValueError("weights: the problem has biases but the weights carry none")
            b_gate_up, b_down = weights.b_gate_up_E2I.to(dtype), weights.b_down_EH.to(dtype)

    def mv(t):  # a no-op (the same tensor) for tensors already on the device
        return None if t is None else t.to(dev)

    # Loaded weights and the router output move; the checkpoint forward runs where the problem
    # lives: a large model's forward (6 R H I FLOPs) must not run on the CPU of a GPU box.
    w_gate_up, w_down = mv(w_gate_up), mv(w_down)
    b_gate_up, b_down = mv(b_gate_up), mv(b_down)
    plan = plan_routing(mv(expert_index), mv(affinity.float()), E)
    act = moe_forward_checkpoint_torch(
        x, w_gate_up, plan, b_gate_up_E2I=b_gate_up, clamp_limits=clamp_limits, compute_dtype=dtype
    )
    return MoEBackwardProblem(
        hidden_states_TH=x,
        output_grad_TH=dy,
        w_gate_up_EH2I=w_gate_up,
        w_down_EIH=w_down,
        plan=plan,
        act_checkpoint_R2I=act,
        b_gate_up_E2I=b_gate_up,
        b_down_EH=b_down,
        clamp_limits=clamp_limits,
        activation=activation,
    )


def make_problem_for_model(
    model: MoEModelShape,
    num_tokens: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    skew: float = 1.0,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights=None,
) -> MoEBackwardProblem:
    """:func:`make_problem` with a model's shape, router kind, biases, clamp limits and
    activation: ``swiglu_clamped`` models (gpt-oss) get ``Activation("gpt_oss",
    alpha=model.swiglu_alpha, up_offset=1.0)`` (:data:`~common.problem.GPT_OSS` for 1.702),
    the others SwiGLU.

    ``routing`` (``(expert_index, affinity)`` [T, K], e.g. :func:`common.loaders.load_routing`)
    replaces the router simulation; ``weights`` (:class:`common.loaders.ExpertWeights`) replaces
    the seeded expert weights (and biases).

    Raises:
        ValueError: a model that applies the router affinity to the expert INPUT
            (``affinity_on="input"``, Llama 4): every backend here scales the expert output, so
            its gradients would be those of another function.
    """
    if model.affinity_on != "output":
        raise ValueError(
            f"model {model.name!r} applies the router affinity to the expert input "
            f"(affinity_on={model.affinity_on!r}, as Llama 4 does); this package's forward, "
            "reference and every backend scale the expert OUTPUT by it, so the gradients would "
            "be those of another function: not run"
        )
    if routing is not None:
        expert_index, affinity = routing
    else:
        expert_index, affinity = simulate_model_routing(
            model, num_tokens, seed=seed + 1, skew=skew
        )
    activation, clamp_limits = model.expert_activation()
    return make_problem(
        num_tokens,
        model.hidden,
        model.intermediate,
        model.experts,
        model.top_k,
        seed=seed,
        bias=model.has_bias,
        clamp_limits=clamp_limits,
        dtype=dtype,
        device=device,
        expert_index=expert_index,
        affinity=affinity,
        activation=activation,
        weights=weights,
    )
