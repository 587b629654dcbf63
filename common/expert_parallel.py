"""Expert parallelism (EP): the MoE expert MLP with experts spread over the ranks of a
``torch.distributed`` group, tokens exchanged by all-to-all, our backward on each rank's experts.

Dimensions (legend in :mod:`common.shapes`): T tokens of this rank, H hidden, I expert
intermediate, E experts (global), e = E / ep local experts of one rank, K top_k, ep ranks.
Rank r owns experts ``[r*e, (r+1)*e)``.

The exchange is torchtitan's ``AllToAllTokenDispatcher`` (torchtitan 0.3.0,
``torchtitan/models/common/token_dispatcher.py``), written with
``torch.distributed.all_to_all_single`` so that it runs without torchtitan:

1. sort this rank's routed slots by expert (stable, so by token inside an expert; dropped
   slots, expert -1, are not sent);
2. counts exchange: ``all_to_all_single`` of the per-expert counts ``[E]`` -> the counts
   ``[ep, e]`` every rank sends to each local expert; the split lists are read on the host
   (one device-to-host sync per layer, as torchtitan's dispatcher);
3. token exchange: the rows ``x[token]`` and their affinities, rank-major then expert-major
   (torchtitan's layout before its ``_permute``);
4. the local experts: :func:`common.layer.moe_experts` with top_k = 1 per received row (its
   expert, its affinity), so the affinity multiply and the affinity gradient are ours, and the
   backward goes through :mod:`common.dispatch` (the fused ``cuda-sm90`` backward on an H200);
5. the reverse exchange of the scaled rows and a sum over each token's slots (fp32, one
   rounding to x's dtype).

Autograd: each exchange is an ``autograd.Function`` whose backward is the reverse exchange
(the transposed split lists); the dispatch exchanges rows and affinities in one Function, so
every rank issues its collectives in the same order in forward and in backward. Every rank
must call forward and backward the same number of times (collectives), also with no tokens.

Public names: :func:`expert_parallel_moe` (functional), :class:`ExpertParallelMoEExperts`
(``nn.Module`` holding this rank's experts), :func:`local_expert_range`, and the torchtitan
hook :func:`use_moe_experts_in_torchtitan` (our backward inside torchtitan's own MoE and
dispatchers).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.layer import MoEExperts, MoEExpertsOptions, moe_experts, run_experts_grouped_mm

__all__ = [
    "ExpertParallelMoEExperts",
    "expert_parallel_moe",
    "local_expert_range",
    "torchtitan_grouped_experts_forward",
    "use_moe_experts_in_torchtitan",
]


# ------------------------------------------------------------------------------- group helpers
def _group_size_rank(group) -> tuple[int, int]:
    """``(ep, rank)`` of ``group``; ``group=None`` is the default group, or a single rank when
    ``torch.distributed`` is not initialised (then nothing is exchanged)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def local_expert_range(num_experts: int, group=None) -> range:
    """The global expert ids this rank owns: ``range(rank*e, (rank+1)*e)``, e = E / ep.

    Raises:
        ValueError: E not divisible by the group size.
    """
    ep, rank = _group_size_rank(group)
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel group size {ep}"
        )
    e = num_experts // ep
    return range(rank * e, (rank + 1) * e)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _Dispatch(torch.autograd.Function):
    """Rows and their affinities to the ranks of their experts; backward: the reverse."""

    @staticmethod
    def forward(ctx, rows_NH, affinity_N1, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return (
            _all_to_all(rows_NH, output_splits, input_splits, group),
            _all_to_all(affinity_N1, output_splits, input_splits, group),
        )

    @staticmethod
    def backward(ctx, grad_rows_RH, grad_affinity_R1):
        output_splits, input_splits = ctx.splits
        return (
            _all_to_all(grad_rows_RH, input_splits, output_splits, ctx.group),
            _all_to_all(grad_affinity_R1, input_splits, output_splits, ctx.group),
            None, None, None,
        )


class _Combine(torch.autograd.Function):
    """Expert outputs back to the ranks of their tokens; backward: the dispatch direction."""

    @staticmethod
    def forward(ctx, rows_RH, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(rows_RH, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_NH):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad_NH, input_splits, output_splits, ctx.group), None, None, None


# ---------------------------------------------------------------------------------- functional
def expert_parallel_moe(
    hidden_states_TH: torch.Tensor,
    expert_index_TK: torch.Tensor,
    affinity_TK: torch.Tensor,
    w_gate_up_eH2I: torch.Tensor,
    w_down_eIH: torch.Tensor,
    b_gate_up_e2I: torch.Tensor | None = None,
    b_down_eH: torch.Tensor | None = None,
    *,
    num_experts: int,
    group=None,
    options: MoEExpertsOptions | None = None,
) -> torch.Tensor:
    """``y = sum_k a[t,k] * MLP_{e[t,k]}(x[t])`` with the experts spread over ``group``.

    Called on every rank of ``group`` with that rank's tokens (T may differ between ranks, also
    0) and that rank's experts (the slice :func:`local_expert_range`).

    Args:
        hidden_states_TH: [T, H] float, this rank's tokens.
        expert_index_TK: [T, K] int, GLOBAL expert ids in [-1, E) (-1 = dropped slot).
        affinity_TK: [T, K] float, router weights (may require grad).
        w_gate_up_eH2I: [e, H, 2, I] float, this rank's experts (gate 0, up 1).
        w_down_eIH: [e, I, H] float.  b_gate_up_e2I: optional [e, 2, I].  b_down_eH: optional
            [e, H].
        num_experts: E, the global expert count (divisible by the group size; e = E / ep).
        group: the expert-parallel process group (default: the default group; without an
            initialised ``torch.distributed``, a single rank and no exchange).
        options: :class:`~common.layer.MoEExpertsOptions` of the local experts (backend, ...).
    Returns:
        y [T, H] in ``hidden_states_TH.dtype``. Gradients: x, affinity (0 on dropped slots),
        this rank's weights (from every rank's tokens routed to them), biases.
    Raises:
        ValueError: a bad argument (named): E not divisible by ep, local weights not [e, ...],
            expert ids outside [-1, E) (checked on this rank's ids before any exchange).
    Notes:
        One host read of the split sizes per call (as torchtitan's all-to-all dispatcher); so
        not CUDA-graph capturable. The sum over a token's K slots is in fp32, rounded once.
    """
    ep, rank = _group_size_rank(group)
    experts = local_expert_range(num_experts, group)
    e = len(experts)
    if not isinstance(w_gate_up_eH2I, torch.Tensor) or w_gate_up_eH2I.dim() != 4:
        raise ValueError(f"w_gate_up_eH2I must be [e, H, 2, I], got {w_gate_up_eH2I!r:.60}")
    if w_gate_up_eH2I.shape[0] != e:
        raise ValueError(
            f"w_gate_up_eH2I holds {w_gate_up_eH2I.shape[0]} experts but this rank owns "
            f"e = num_experts / ep = {num_experts} / {ep} = {e}"
        )
    if not isinstance(expert_index_TK, torch.Tensor) or expert_index_TK.dim() != 2:
        raise ValueError("expert_index_TK must be a 2-D [T, K] integer tensor")
    if expert_index_TK.numel():
        lo, hi = int(expert_index_TK.min()), int(expert_index_TK.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"expert_index_TK values must lie in [-1, num_experts={num_experts}), found "
                f"range [{lo}, {hi}]"
            )
    opts = MoEExpertsOptions() if options is None else options
    if ep == 1:
        return moe_experts(
            hidden_states_TH, expert_index_TK, affinity_TK, w_gate_up_eH2I, w_down_eIH,
            b_gate_up_e2I, b_down_eH, options=opts,
        )

    T, H = hidden_states_TH.shape
    K = expert_index_TK.shape[1]
    device = hidden_states_TH.device
    # 1. this rank's slots sorted by expert (stable: token order inside an expert), drops last
    idx_S = expert_index_TK.reshape(-1).to(torch.int64)
    key_S = torch.where(idx_S >= 0, idx_S, num_experts)
    order_S = torch.argsort(key_S, stable=True)
    counts_E = torch.bincount(key_S, minlength=num_experts + 1)[:num_experts]
    # 2. counts exchange: recv_counts[r, j] = rows rank r sends to my local expert j
    recv_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts, counts_E, group=group)
    input_splits = counts_E.view(ep, e).sum(1).tolist()  # host read, as torchtitan's dispatcher
    output_splits = recv_counts.view(ep, e).sum(1).tolist()
    sent_N = order_S[: sum(input_splits)]
    token_N = sent_N // K
    # 3. rows and affinities to the experts' ranks
    x_recv_RH, a_recv_R1 = _Dispatch.apply(
        hidden_states_TH[token_N], affinity_TK.reshape(-1)[sent_N].unsqueeze(1),
        output_splits, input_splits, group,
    )
    local_R1 = torch.repeat_interleave(
        torch.arange(e, device=device).repeat(ep), recv_counts.to(device),
        output_size=x_recv_RH.shape[0],
    ).unsqueeze(1)
    # 4. our layer on the local experts, one slot per received row
    y_recv_RH = moe_experts(
        x_recv_RH, local_R1, a_recv_R1, w_gate_up_eH2I, w_down_eIH, b_gate_up_e2I, b_down_eH,
        options=opts,
    )
    # 5. back to the tokens' rank, summed over each token's slots
    y_NH = _Combine.apply(y_recv_RH, input_splits, output_splits, group)
    out_TH = torch.zeros(T, H, dtype=torch.float32, device=device)
    return out_TH.index_add(0, token_N, y_NH.float()).to(hidden_states_TH.dtype)


# -------------------------------------------------------------------------------------- module
class ExpertParallelMoEExperts(nn.Module):
    """The routed experts of one MoE layer, e = E / ep of them on each rank of ``group``.

    ``local`` is a :class:`~common.layer.MoEExperts` of this rank's e experts (its parameters
    are this rank's: no gradient all-reduce over the EP group). ``forward(x_TH,
    expert_index_TK, affinity_TK)`` takes GLOBAL expert ids; see :func:`expert_parallel_moe`.

    Args:
        num_experts, hidden, intermediate: E (global), H, I.
        group: the expert-parallel process group (None: the default group, or one rank).
        **layer_kwargs: to :class:`~common.layer.MoEExperts` (dtype, device, bias, backend, ...).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, group=None,
                 **layer_kwargs: Any) -> None:
        super().__init__()
        self.num_experts, self.group = num_experts, group
        self.experts = local_expert_range(num_experts, group)
        self.local = MoEExperts(len(self.experts), hidden, intermediate, **layer_kwargs)

    @classmethod
    def from_experts(cls, layer: MoEExperts, group=None) -> ExpertParallelMoEExperts:
        """This rank's slice of a full :class:`~common.layer.MoEExperts` (weights copied), with
        its options; e.g. every rank builds the same seeded full layer and keeps its experts."""
        o = layer.options
        ep_layer = cls(
            layer.num_experts, layer.hidden, layer.intermediate, group=group, bias=layer.bias,
            dtype=layer.w_gate_up.dtype, device=layer.w_gate_up.device,
            clamp_limits=o.clamp_limits, activation=o.activation, backend=o.backend,
            validate_routing=o.validate_routing, accumulate_main_grad=o.accumulate_main_grad,
        )
        sl = slice(ep_layer.experts.start, ep_layer.experts.stop)
        with torch.no_grad():
            for name, p in ep_layer.local.named_parameters():
                p.copy_(getattr(layer, name)[sl])
        return ep_layer

    def forward(self, hidden_states_TH: torch.Tensor, expert_index_TK: torch.Tensor,
                affinity_TK: torch.Tensor) -> torch.Tensor:
        loc = self.local
        return expert_parallel_moe(
            hidden_states_TH, expert_index_TK, affinity_TK, loc.w_gate_up, loc.w_down,
            loc.b_gate_up, loc.b_down, num_experts=self.num_experts, group=self.group,
            options=loc.options,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, experts={self.experts.start}..{self.experts.stop - 1}"


# ---------------------------------------------------------------------------------- torchtitan
def torchtitan_grouped_experts_forward(self, x_RD: torch.Tensor,
                                       num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``forward`` for torchtitan 0.3.0's ``GroupedExperts`` (``torchtitan.models.common.moe``):
    the same result from rows in expert order, through :func:`common.layer.run_experts_grouped_mm`
    (our backward). EP-sharded DTensor weights are used through ``to_local()`` as torchtitan's
    own forward does; under EP ``x_RD`` is the dispatcher's output (received rows in local
    expert order) and the counts are those of the local experts."""
    ws = []
    for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD):
        ws.append(w.to_local() if hasattr(w, "to_local") else w)
    return run_experts_grouped_mm(ws[0], ws[1], ws[2], x_RD, num_tokens_per_expert_E)


def use_moe_experts_in_torchtitan(model: nn.Module) -> int:
    """Make every torchtitan ``GroupedExperts`` in ``model`` run our expert MLP and backward.

    torchtitan's router, token dispatchers (local, all-to-all, ...) and combine stay as they
    are; only the expert computation between dispatch and combine is replaced (instance-level
    ``forward``, so other models are untouched). Call after building (and parallelising) the
    model. Returns how many modules were changed.

    Raises:
        ImportError: torchtitan (tested: 0.3.0, ``pip install moe-bwd-kernels[torchtitan]``) is
            not importable.
    """
    from torchtitan.models.common.moe import GroupedExperts

    n = 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.forward = types.MethodType(torchtitan_grouped_experts_forward, m)
            n += 1
    return n
