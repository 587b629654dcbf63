"""Seeded simulation of a trained MoE router: expert ids and affinities for benchmarks and tests.

Real routers are not uniform: a few experts are "hot" for most batches. The simulation models this
with one Gaussian score per (token, expert) plus one bias per expert, drawn once per seed::

    b_E      ~ N(0, 1)                                 # expert popularity, drawn first
    z_TE     ~ N(0, 1)                                 # token-expert affinity noise
    logit_TE = logit_scale * (z_TE + SKEW_SCALE * skew * b_E)

then applies the routing function of the chosen ``kind`` (see :data:`ROUTER_KINDS`). The expert
bias is drawn before the token scores, so for a fixed seed the same experts are hot whatever the
token count.

Load skew (``skew``): ``skew = 0`` gives a uniform expected load. ``SKEW_SCALE = 0.2`` was
calibrated so that the default ``skew = 1.0`` gives a max/mean tokens-per-expert ratio in the range
trained routers show (measured with this module, T = 16384 tokens, mean of seeds 0..4, softmax_topk):

    ======================  ====  ====  ====  ====  =====  =====  =====
    (E, K)                  8, 2  16,1  32,4  64,8  128,8  256,8  384,8
    ======================  ====  ====  ====  ====  =====  =====  =====
    max/mean at skew = 0    1.02  1.06  1.05  1.04  1.08   1.14   1.15
    max/mean at skew = 1    1.35  1.74  1.79  2.14  2.49   2.91   3.35
    max/mean at skew = 2    1.70  2.68  2.78  3.56  4.76   6.14   7.63
    ======================  ====  ====  ====  ====  =====  =====  =====

(At skew = 0 the ratio above 1 is only sampling noise of T*K/E slots per expert.)

Routing functions (``kind``), scores ``s`` per token over all E experts, top-k set ``S``:

- ``softmax_topk``: ``p = softmax(logit)``, pick the k largest, affinity ``p[S]``, optionally
  renormalised over ``S`` (``norm_topk_prob``). Qwen3-MoE, OLMoE (HF ``Qwen3MoeSparseMoeBlock``,
  ``OlmoeSparseMoeBlock``).
- ``topk_softmax``: pick the k largest logits, affinity ``softmax(logit[S])`` (sums to 1 always).
  Mixtral, gpt-oss (HF ``MixtralSparseMoeBlock``; openai/gpt-oss ``MLPBlock``).
- ``sigmoid_topk``: ``s = sigmoid(logit)``; optionally group-limited selection (``n_group`` groups
  of E/n_group experts, each group scored by the sum of its top-2 ``s``, only the best
  ``topk_group`` groups eligible); pick the k largest ``s``, affinity ``s[S]``, optionally
  renormalised over ``S``, times ``routed_scaling_factor``. DeepSeek-V3 / Kimi-K2 (``noaux_tc``;
  the simulated expert bias plays the role of the load imbalance the correction bias fights).
- ``topk_sigmoid``: pick the k largest logits, affinity ``sigmoid(logit[S])``. Llama 4.

``routed_scaling_factor`` multiplies the affinities of every kind (1.0 = none).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "ROUTER_KINDS",
    "SKEW_SCALE",
    "load_stats",
    "route_logits",
    "simulate_model_routing",
    "simulate_router",
]

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid")

# Standard deviation of the per-expert bias per unit of ``skew``, in units of the token score's
# standard deviation. Calibrated so that skew = 1 gives max/mean load 1.3-3.4 (table above).
SKEW_SCALE = 0.2


def _check_int(name: str, value, minimum: int, caller: str = "simulate_router") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        msg = f"{caller}: {name} must be an int, got {type(value).__name__}"
        raise ValueError(msg)
    if value < minimum:
        raise ValueError(f"{caller}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(
    name: str,
    value,
    *,
    minimum: float,
    maximum: float = math.inf,
    open_min: bool = False,
    caller: str = "simulate_router",
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{caller}: {name} must be a real number, got {type(value).__name__}"
        raise ValueError(msg)
    value = float(value)
    too_low = value <= minimum if open_min else value < minimum
    if not math.isfinite(value) or too_low or value > maximum:
        bound = f"> {minimum}" if open_min else f">= {minimum}"
        upper = f" and <= {maximum}" if math.isfinite(maximum) else ""
        raise ValueError(f"{caller}: {name} must be finite, {bound}{upper}; got {value}")
    return value


def _check_routing_args(
    num_experts, top_k, kind, norm_topk_prob, routed_scaling_factor, n_group, topk_group, caller
):
    """Validate the routing-function arguments shared by simulate_router and route_logits."""
    top_k = _check_int("top_k", top_k, 1, caller)
    if top_k > num_experts:
        raise ValueError(
            f"{caller}: top_k must be <= num_experts, got top_k={top_k}, num_experts={num_experts}"
        )
    _check_float(
        "routed_scaling_factor", routed_scaling_factor, minimum=0.0, open_min=True, caller=caller
    )
    if kind not in ROUTER_KINDS:
        raise ValueError(f"{caller}: kind must be one of {ROUTER_KINDS}, got {kind!r}")
    if not isinstance(norm_topk_prob, bool):
        msg = f"{caller}: norm_topk_prob must be a bool, got {norm_topk_prob!r}"
        raise ValueError(msg)
    n_group = _check_int("n_group", n_group, 1, caller)
    topk_group = _check_int("topk_group", topk_group, 1, caller)
    if kind != "sigmoid_topk" and (n_group != 1 or topk_group != 1):
        raise ValueError(
            f"{caller}: n_group/topk_group apply to kind='sigmoid_topk' only, "
            f"got n_group={n_group}, topk_group={topk_group} for kind={kind!r}"
        )
    if num_experts % n_group != 0:
        raise ValueError(
            f"{caller}: n_group must divide num_experts, got n_group={n_group}, "
            f"num_experts={num_experts}"
        )
    if topk_group > n_group:
        raise ValueError(
            f"{caller}: topk_group must be <= n_group, got "
            f"topk_group={topk_group}, n_group={n_group}"
        )
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"{caller}: top_k={top_k} exceeds the experts eligible after group "
            f"limiting (topk_group * num_experts / n_group = "
            f"{topk_group * (num_experts // n_group)})"
        )


def simulate_router(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int,
    skew: float = 1.0,
    kind: str = "softmax_topk",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
    logit_scale: float = 1.0,
    drop_fraction: float = 0.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulate the router output of a trained MoE layer, deterministically for a seed.

    Dimensions: T = num_tokens, E = num_experts, K = top_k.

    Args:
        num_tokens: T >= 0 tokens.
        num_experts: E >= 1 routed experts.
        top_k: K, 1 <= K <= E experts per token.
        seed: seed of the ``torch.Generator`` (on ``device``) that draws every random number. The
            same arguments give bit-identical outputs; streams differ between device types.
        skew: >= 0, load skew; the per-expert bias has std ``SKEW_SCALE * skew`` relative to the
            unit-std token scores (module docstring: 0 = uniform load, 1 = typical trained router).
        kind: routing function, one of :data:`ROUTER_KINDS` (module docstring).
        norm_topk_prob: renormalise the top-k affinities to sum to 1 (``softmax_topk``,
            ``sigmoid_topk``; ``topk_softmax`` always sums to 1, ``topk_sigmoid`` never
            renormalises).
        routed_scaling_factor: > 0, multiplies all affinities (DeepSeek-V3: 2.5, Kimi-K2: 2.827).
        n_group, topk_group: group-limited selection for ``sigmoid_topk`` (DeepSeek-V3: 8, 4);
            n_group must divide E, 1 <= topk_group <= n_group, K <= topk_group * E / n_group.
            Other kinds need n_group = topk_group = 1.
        logit_scale: > 0, multiplies the logits: larger = more peaked affinities. Does not change
            which experts are selected.
        drop_fraction: in [0, 1]; exactly ``round(drop_fraction * T * K)`` slots, chosen at
            random, get expert id -1 (dropped) and affinity 0.
        device: where the outputs live (and the generator runs).
        dtype: floating dtype of the affinities (computed in float32, then cast).

    Returns:
        expert_index_TK: [T, K] int64 on ``device``; distinct experts per token in descending
            score order; -1 marks a dropped slot.
        affinity_TK: [T, K] ``dtype`` on ``device``; >= 0; 0 for dropped slots.

    Raises:
        ValueError: any argument outside the ranges above (the message names the argument).
    """
    num_tokens = _check_int("num_tokens", num_tokens, 0)
    num_experts = _check_int("num_experts", num_experts, 1)
    _check_routing_args(
        num_experts,
        top_k,
        kind,
        norm_topk_prob,
        routed_scaling_factor,
        n_group,
        topk_group,
        "simulate_router",
    )
    seed = _check_int("seed", seed, 0)
    skew = _check_float("skew", skew, minimum=0.0)
    logit_scale = _check_float("logit_scale", logit_scale, minimum=0.0, open_min=True)
    drop_fraction = _check_float("drop_fraction", drop_fraction, minimum=0.0, maximum=1.0)
    top_k, n_group, topk_group = int(top_k), int(n_group), int(topk_group)
    routed_scaling_factor = float(routed_scaling_factor)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"simulate_router: dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device)

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    f32 = torch.float32
    bias_E = torch.randn(num_experts, generator=gen, device=device, dtype=f32)
    z_TE = torch.randn(num_tokens, num_experts, generator=gen, device=device, dtype=f32)
    logit_TE = (z_TE + (SKEW_SCALE * skew) * bias_E) * logit_scale

    expert_index_TK, affinity_TK = _route(
        logit_TE,
        top_k,
        kind=kind,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
        n_group=n_group,
        topk_group=topk_group,
    )

    num_slots = num_tokens * top_k
    num_drop = round(drop_fraction * num_slots)
    if num_drop > 0:
        drop_R = torch.randperm(num_slots, generator=gen, device=device)[:num_drop]
        expert_index_TK = (
            expert_index_TK.reshape(-1).index_fill(0, drop_R, -1).view_as(expert_index_TK)
        )
        affinity_TK = affinity_TK.reshape(-1).index_fill(0, drop_R, 0.0).view_as(affinity_TK)
    return expert_index_TK.to(torch.int64).contiguous(), affinity_TK.to(dtype).contiguous()


def route_logits(
    logit_TE: torch.Tensor,
    top_k: int,
    *,
    kind: str = "softmax_topk",
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a router's selection and affinity function to given logits (no randomness).

    Args:
        logit_TE: [T, E] floating router logits (any device).
        top_k, kind, norm_topk_prob, routed_scaling_factor, n_group, topk_group: as
            :func:`simulate_router`.

    Returns:
        expert_index_TK int64 [T, K], affinity_TK float32 [T, K] (on the logits' device).

    Raises:
        ValueError: a non-2-D / non-floating ``logit_TE`` or an argument out of range.
    """
    if (
        not isinstance(logit_TE, torch.Tensor)
        or logit_TE.dim() != 2
        or not logit_TE.dtype.is_floating_point
    ):
        raise ValueError("route_logits: logit_TE must be a 2-D floating tensor [T, E]")
    num_experts = logit_TE.shape[1]
    _check_routing_args(
        num_experts,
        top_k,
        kind,
        norm_topk_prob,
        routed_scaling_factor,
        n_group,
        topk_group,
        "route_logits",
    )
    idx, aff = _route(
        logit_TE.float(),
        top_k,
        kind=kind,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=float(routed_scaling_factor),
        n_group=n_group,
        topk_group=topk_group,
    )
    return idx.to(torch.int64), aff


def _route(logit_TE, top_k, *, kind, norm_topk_prob, routed_scaling_factor, n_group, topk_group):
    """The routing functions of the module docstring on float32 logits [T, E] (validated)."""
    num_tokens, num_experts = logit_TE.shape
    if kind == "softmax_topk":
        prob_TE = torch.softmax(logit_TE, dim=-1)
        affinity_TK, expert_index_TK = prob_TE.topk(top_k, dim=-1)
        if norm_topk_prob:
            affinity_TK = affinity_TK / affinity_TK.sum(dim=-1, keepdim=True)
    elif kind == "topk_softmax":
        top_logit_TK, expert_index_TK = logit_TE.topk(top_k, dim=-1)
        affinity_TK = torch.softmax(top_logit_TK, dim=-1)
    elif kind == "topk_sigmoid":
        top_logit_TK, expert_index_TK = logit_TE.topk(top_k, dim=-1)
        affinity_TK = torch.sigmoid(top_logit_TK)
    else:  # sigmoid_topk
        score_TE = torch.sigmoid(logit_TE)
        select_TE = score_TE
        if n_group > 1:
            per_group = num_experts // n_group
            grouped_TGX = score_TE.view(num_tokens, n_group, per_group)
            group_score_TG = grouped_TGX.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
            keep_group_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
            keep_group_TG.scatter_(1, group_score_TG.topk(topk_group, dim=-1).indices, True)
            keep_TE = keep_group_TG.repeat_interleave(per_group, dim=1)
            select_TE = score_TE.masked_fill(~keep_TE, -1.0)  # sigmoid scores are > 0
        expert_index_TK = select_TE.topk(top_k, dim=-1).indices
        affinity_TK = score_TE.gather(1, expert_index_TK)
        if norm_topk_prob:
            affinity_TK = affinity_TK / affinity_TK.sum(dim=-1, keepdim=True)
    return expert_index_TK, affinity_TK * routed_scaling_factor


def simulate_model_routing(
    model,
    num_tokens: int,
    *,
    seed: int,
    skew: float = 1.0,
    drop_fraction: float = 0.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`simulate_router` with the router of a model (a ``common.models.MoEModelShape``).

    Uses the model's E, top_k, router kind, norm_topk_prob, routed_scaling_factor and expert
    groups. Returns ``(expert_index_TK int64 [T, K], affinity_TK dtype [T, K])``.

    Raises:
        ValueError: as :func:`simulate_router`.
    """
    return simulate_router(
        num_tokens,
        model.experts,
        model.top_k,
        seed=seed,
        skew=skew,
        kind=model.router,
        norm_topk_prob=model.norm_topk_prob,
        routed_scaling_factor=model.routed_scaling_factor,
        n_group=model.n_group,
        topk_group=model.topk_group,
        drop_fraction=drop_fraction,
        device=device,
        dtype=dtype,
    )


def load_stats(expert_index_TK: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Per-expert load summary of a routing: tokens per expert and the max/mean ratio.

    Args:
        expert_index_TK: [T, K] int, -1 = dropped slot (ignored).
        num_experts: E >= 1.

    Returns:
        ``{"max": float, "mean": float, "min": float, "max_over_mean": float,
        "empty_experts": float}`` over the E experts' routed slot counts (``max_over_mean`` is
        0 when no slot is routed). Reads the data on the host (not for hot paths).

    Raises:
        ValueError: ids outside [-1, E).
    """
    if expert_index_TK.numel() and (
        int(expert_index_TK.min()) < -1 or int(expert_index_TK.max()) >= num_experts
    ):
        raise ValueError(f"load_stats: expert_index_TK must hold ids in [-1, {num_experts})")
    ids = expert_index_TK.reshape(-1)
    ids = ids[ids >= 0]
    load_E = torch.bincount(ids.cpu(), minlength=num_experts).to(torch.float64)
    mean = float(load_E.mean())
    return {
        "max": float(load_E.max()),
        "mean": mean,
        "min": float(load_E.min()),
        "max_over_mean": float(load_E.max()) / mean if mean > 0 else 0.0,
        "empty_experts": float((load_E == 0).sum()),
    }
