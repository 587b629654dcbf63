"""What GPU users already run for the MoE expert-MLP backward, built from one MoEBackwardProblem.

``build_autograd_baseline(problem, with_perm)`` returns the timed callable and a converter of its
result into the gradients of :class:`~common.problem.MoEGrads` (for ``--check``). The forward is
run once when the baseline is built (never timed); the timed call is
``torch.autograd.grad(y, leaves, dY, retain_graph=True)``. ``build_autograd_recipe`` is the same
recipe with its forward as a callable (``benchmarks/bench_moe_layer.py`` times it too);
``build_sonicmoe_step`` likewise for SonicMoE.

* ``with_perm=False`` (torchtitan-style experts): leaves ``x_S`` [S, H] bf16 (rows already in
  expert order, zero padding rows), ``w_gu`` [E, H, 2I] bf16, ``w_down`` [E, I, H] bf16,
  ``alpha_S`` [S] fp32 (routing weight per row), plus the biases if the problem has them.
  ``gu = _grouped_mm(x_S, w_gu, offs)`` (+ b_gate_up), clamp, activation
  ``h = g * sigmoid(a g) * (u + up_offset)`` (SwiGLU: ``silu(g) * u``) in bf16,
  ``y_S = _grouped_mm((h * alpha_S).bf16(), w_down, offs)`` (+ alpha * b_down). Per-row biases
  are ``index_select`` gathers (backward: an atomic ``index_add``, not advanced indexing's
  sorting backward).
* ``with_perm=True``: the token permutation inside autograd as well: leaves ``x`` [T, H] and the
  per-pair affinities ``alpha_R`` [R]; ``x_S`` / ``alpha_S`` are ``index_select`` gathers (padding
  rows read an appended zero row), ``y = zeros[T+1, H].index_add(0, token, y_S)[:T]``.

On the CPU the grouped GEMMs are a per-expert loop of ``torch.mm`` (``torch._grouped_mm`` is slow
or missing there); the segment bounds are read on the host once, at build time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from common.problem import ClampLimits, MoEBackwardProblem
from common.torch_backward import grouped_layout

__all__ = [
    "AutogradRecipe", "build_autograd_baseline", "build_autograd_recipe", "build_sonicmoe",
    "build_sonicmoe_step",
]


def _gmm(x_SK: torch.Tensor, w_EKN: torch.Tensor, offs: torch.Tensor, segs) -> torch.Tensor:
    """Grouped rows x per-expert matrix (bf16 in/out), differentiable."""
    if segs is None:
        return torch._grouped_mm(x_SK, w_EKN, offs=offs)
    parts = [x_SK[s:t] @ w_EKN[e] for e, (s, t) in enumerate(segs) if t > s]
    end = segs[-1][1]
    if end < x_SK.shape[0]:  # rows past the last offset (none with a static layout)
        parts.append(x_SK.new_zeros(x_SK.shape[0] - end, w_EKN.shape[2]))
    return torch.cat(parts, 0)


def _segments(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.to(torch.int64).tolist()  # host read, once, at build time (CPU loop only)
    return list(zip([0] + ends[:-1], ends))


def _leaf(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).requires_grad_()


@dataclass
class AutogradRecipe:
    """The torchtitan-style recipe of one problem, its forward not yet run.

    ``forward()`` builds the autograd graph (grad mode on) and returns ``y`` ([T, H] with the
    permutation, else the [S, H] rows); ``leaves`` are the tensors its gradients are taken for
    (x, w_gu, w_down, alpha[, b_gu, b_down]); ``dY`` the output gradient in ``y``'s layout;
    ``to_grads(grads)`` maps gradients in ``leaves`` order to ``MoEGrads.named()``'s names and
    ``to_y(y)`` maps ``y`` to the [T, H] token output."""

    forward: Callable[[], torch.Tensor]
    leaves: list
    dY: torch.Tensor
    to_grads: Callable
    to_y: Callable[[torch.Tensor], torch.Tensor]


def build_autograd_baseline(p: MoEBackwardProblem, with_perm: bool):
    """``(fn, to_grads)``: ``fn()`` runs the timed backward, ``to_grads(fn())`` maps its result
    to ``{"dX [T,H]": ..., "dA [T,E]": ..., ...}`` (the names of ``MoEGrads.named()``)."""
    r = build_autograd_recipe(p, with_perm)
    y = r.forward()  # once, at build time (never timed)

    def fn():
        return torch.autograd.grad(y, r.leaves, r.dY, retain_graph=True)

    return fn, r.to_grads


def build_autograd_recipe(p: MoEBackwardProblem, with_perm: bool) -> AutogradRecipe:
    """The recipe of :func:`build_autograd_baseline` (module docstring) with its forward as a
    callable: each ``forward()`` call runs the token gather (``with_perm``), both grouped GEMMs,
    the activation and the scatter back, recording autograd."""
    plan = p.plan
    dev = p.hidden_states_TH.device
    T, H = p.hidden_states_TH.shape
    E, _, _, I = p.w_gate_up_EH2I.shape
    R = plan.pair_token_R.shape[0]
    bf = torch.bfloat16
    layout = grouped_layout(plan, E)
    offs = layout.offsets_E
    segs = None if dev.type == "cuda" else _segments(offs)
    r2p = layout.row_to_pair_S  # expert of each row (E-1 for padding rows, which are zero)
    row_expert = torch.where(r2p >= 0, plan.pair_expert_R[r2p.clamp(min=0)], E - 1)
    tok_S = torch.where(layout.row_to_token_S >= 0, layout.row_to_token_S, T)
    pair_S = torch.where(layout.row_to_pair_S >= 0, layout.row_to_pair_S, R)

    w_gu = _leaf(p.w_gate_up_EH2I.to(bf).reshape(E, H, 2 * I))
    w_d = _leaf(p.w_down_EIH, bf)
    b_gu = _leaf(p.b_gate_up_E2I, bf)
    b_d = _leaf(p.b_down_EH, bf)
    if with_perm:
        x = _leaf(p.hidden_states_TH, bf)
        alpha = _leaf(plan.pair_affinity_R, torch.float32)
        dY = p.output_grad_TH.to(bf)
    else:
        x = _leaf(layout.gather_rows(p.hidden_states_TH.to(bf)))
        alpha = _leaf(layout.gather_pairs(plan.pair_affinity_R), torch.float32)
        dY = layout.gather_rows(p.output_grad_TH.to(bf))  # pre-sorted, not timed

    @torch.enable_grad()
    def forward() -> torch.Tensor:
        if with_perm:
            x_S = torch.cat([x, x.new_zeros(1, H)]).index_select(0, tok_S)
            alpha_S = torch.cat([alpha, alpha.new_zeros(1)]).index_select(0, pair_S)
        else:
            x_S, alpha_S = x, alpha
        gu = _gmm(x_S, w_gu, offs, segs)
        if b_gu is not None:
            gu = gu + b_gu.reshape(E, 2 * I).index_select(0, row_expert)  # bwd: index_add
        cl = p.clamp_limits or ClampLimits()
        g, u = cl.clamp_gate(gu[:, :I]), cl.clamp_up(gu[:, I:])
        act = getattr(p, "activation", None)
        if act is None or getattr(act, "is_swiglu", True):
            h = F.silu(g) * u
        else:
            h = g * torch.sigmoid(act.alpha * g) * (u + act.up_offset)
        y_S = _gmm((h * alpha_S[:, None]).to(bf), w_d, offs, segs)
        if b_d is not None:
            y_S = y_S + (alpha_S[:, None] * b_d.float().index_select(0, row_expert)).to(bf)
        return y_S.new_zeros(T + 1, H).index_add(0, tok_S, y_S)[:T] if with_perm else y_S

    leaves = [x, w_gu, w_d, alpha] + [b for b in (b_gu, b_d) if b is not None]

    def to_y(y: torch.Tensor) -> torch.Tensor:
        return y if with_perm else layout.scatter_add_rows(y)

    def to_grads(res) -> dict[str, torch.Tensor]:
        dx, dwgu, dwd, dalpha = (r.float() for r in res[:4])
        if not with_perm:
            dx = layout.scatter_add_rows(dx)
            dalpha = dalpha.new_zeros(R + 1).index_put_((pair_S,), dalpha)[:R]
        valid = plan.pair_valid_R
        cell = torch.where(valid, plan.pair_token_R * E + plan.pair_expert_R, T * E)
        dA = dalpha.new_zeros(T * E + 1).index_put_((cell,), torch.where(valid, dalpha, 0.0))
        out = {
            "dX [T,H]": dx,
            "dA [T,E]": dA[: T * E].reshape(T, E),
            "dW_gate_up [E,H,2,I]": dwgu.reshape(E, H, 2, I),
            "dW_down [E,I,H]": dwd,
        }
        rest = iter(res[4:])
        if b_gu is not None:
            out["dB_gate_up [E,2,I]"] = next(rest).float()
        if b_d is not None:
            out["dB_down [E,H]"] = next(rest).float()
        return out

    return AutogradRecipe(forward, leaves, dY, to_grads, to_y)


def build_sonicmoe(problem: MoEBackwardProblem, tuned: bool | None = None):
    """SonicMoE's expert layer (``sonicmoe.moe_general_routing_inputs``, on quack's CuTe DSL
    grouped GEMMs) on the problem's inputs; the timed call is its backward through autograd.

    SonicMoE computes plain SwiGLU with gate/up interleaved along 2I (``c_fc.weight`` [E, 2I, H],
    rows 2i / 2i+1 = gate / up column i) and takes its weights as the views its own ``MoE`` module
    passes (``weight.permute(1, 2, 0)``). Its router scores weight the expert outputs, as ours.
    Clamp limits, gpt-oss's activation and biases are not offered: such problems raise
    ``NotImplementedError`` (the row is then skipped, saying so). Routing must have no dropped
    slots. Returns ``(fn, None)``: SonicMoE's gradients are not mapped back for ``--check``.
    ``tuned``: see :func:`build_sonicmoe_step` (None: SonicMoE as installed).
    """
    forward, leaves, dy = build_sonicmoe_step(problem, tuned)
    out = forward()  # once, at build time (never timed)
    return (lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)), None


def _set_sonic_tuning(tuned: bool) -> None:
    """SonicMoE calls quack's ``gemm`` / ``gemm_gated`` / ``gemm_dgated`` without ``tuned``, so
    quack's default ``tuned=True`` (its autotuner: ~100 s of compiles per shape, and again per
    token count) applies. ``tuned=False`` rebinds those names in SonicMoE's modules to
    ``partial(..., tuned=False)`` (quack's default config per call); True restores quack's."""
    import quack.gemm_interface as qg
    import sonicmoe.functional as sf
    from sonicmoe.functional import backward as sb
    from sonicmoe.functional import forward as sw

    for mod in (sf, sw, sb):
        for name in ("gemm", "gemm_gated", "gemm_dgated"):
            if hasattr(mod, name):
                orig = getattr(qg, name)
                setattr(mod, name, orig if tuned else functools.partial(orig, tuned=False))


def build_sonicmoe_step(problem: MoEBackwardProblem, tuned: bool | None = None):
    """``(forward, leaves, dy)`` of SonicMoE's expert layer on the problem's inputs (layout and
    restrictions of :func:`build_sonicmoe`): ``forward()`` runs its forward through autograd and
    returns ``out`` [T, H]; ``leaves`` = x, scores, c_fc, c_proj. ``tuned``: None leaves SonicMoE
    as installed (quack autotunes), False/True switches quack's autotuner off/on for SonicMoE's
    GEMMs (:func:`_set_sonic_tuning`)."""
    import sonicmoe
    from sonicmoe.enums import ActivationType

    p = problem
    if p.has_bias or (p.clamp_limits is not None and p.clamp_limits.is_active):
        raise NotImplementedError("SonicMoE has no clamp limits or these biases")
    if not p.activation.is_swiglu:
        raise NotImplementedError(f"SonicMoE has no {p.activation.name} activation")
    E, H, _, I = p.w_gate_up_EH2I.shape
    T, K = p.plan.num_tokens, p.plan.top_k
    s2p = p.plan.slot_to_pair_TK
    expert_TK = p.plan.pair_expert_R[s2p.clamp(min=0)]
    score_TK = p.plan.pair_affinity_R[s2p.clamp(min=0)].float()
    dev = p.hidden_states_TH.device
    token_R = torch.arange(T, device=dev, dtype=torch.int32).repeat_interleave(K)
    # c_fc.weight [E, 2I, H] interleaved gate/up, c_proj.weight [E, H, I]
    c_fc = p.w_gate_up_EH2I.bfloat16().permute(0, 3, 2, 1).reshape(E, 2 * I, H).contiguous()
    c_proj = p.w_down_EIH.bfloat16().transpose(1, 2).contiguous()
    c_fc.requires_grad_()
    c_proj.requires_grad_()
    x = p.hidden_states_TH.bfloat16().detach().requires_grad_()
    scores = score_TK.reshape(-1).detach().requires_grad_()
    if tuned is not None:
        _set_sonic_tuning(tuned)
    expert_R = expert_TK.reshape(-1).to(torch.int32)
    stream = torch.cuda.current_stream().cuda_stream

    @torch.enable_grad()
    def forward() -> torch.Tensor:
        out, _ = sonicmoe.moe_general_routing_inputs(
            x, scores, token_R, expert_R, c_fc.permute(1, 2, 0), None, c_proj.permute(1, 2, 0),
            None, E, stream, ActivationType.SWIGLU,
        )
        return out

    dy = p.output_grad_TH.to(x.dtype)
    return forward, [x, scores, c_fc, c_proj], dy
