"""Float64 reference of the gated (SwiGLU / gpt-oss) expert MLP forward and backward, and of
the grouped wgrad.

The twin every kernel is tested against. Math (REFERENCE §2, generalized to the
:class:`~common.problem.Activation` ``h = g * sigmoid(alpha g) * (u + c)``), per routed pair
(t, e) with affinity a = A[t, e], gate/up weights ``Wg, Wu = w_gate_up[e, :, 0],
w_gate_up[e, :, 1]`` [H, I], down weight ``Wd = w_down[e]`` [I, H], optional biases ``bg, bu``
[I], ``bd`` [H]::

    g = clamp_g(x Wg + bg);  u = clamp_u(x Wu + bu);  h = g * sigmoid(alpha g) * (u + c)
    Y[t] += a * (h Wd + bd)

    dh_raw  = dY Wd^T                          s = sigmoid(alpha g)
    dA[t,e] = <dh_raw, h> + <dY, bd>           (bias term only with biases)
    dh      = a * dh_raw
    dg      = dh * (u + c) * s * (1 + alpha g (1 - s)) * mask_g   mask: stored value strictly
    du      = dh * g * s * mask_u                  inside (lower, upper); no limit, no mask
    dWd[e] += (a h)^T dY     dWg[e] += x^T dg    dWu[e] += x^T du
    dX[t]  += dg Wg^T + du Wu^T                 (summed over the token's experts)
    dbd[e] += a dY           dbg[e] += dg        dbu[e] += du

SwiGLU (the default, ``SWIGLU``) is ``alpha = 1, c = 0``: ``h = silu(g) * u``, ``dg = dh * u *
s * (1 + g (1 - s))``, ``du = dh * silu(g)``. gpt-oss (``GPT_OSS``; openai/gpt-oss
``gpt_oss/torch/model.py``) is ``alpha = 1.702, c = 1`` with its clamp (gate above at 7, up to
[-7, 7]) given as :class:`~common.problem.ClampLimits`; the masks act on the stored clamped g, u.
``non_linear_*`` clamp limits apply to the gate g, ``linear_*`` to up u (AWS's names).
AFFINITY_ON_I applies ``a`` to h before the down projection, AFFINITY_ON_H to the output after
it; the two are equal in exact arithmetic and differ here only by float64 rounding order.

All functions compute in float64 on the inputs' device and never read padding: padding slots
and rows (token id -1 or T, rows past the last offset) are removed by selection, so NaN there
cannot reach a result.
"""

from __future__ import annotations

import torch

from common.activation import activation_backward, activation_forward
from common.problem import SWIGLU, Activation, ClampLimits, MoEBackwardProblem, MoEGrads
from common.routing import RoutingPlan

__all__ = [
    "AFFINITY_ON_H",
    "AFFINITY_ON_I",
    "grouped_wgrad_reference",
    "moe_backward_reference",
    "moe_forward_reference",
    "reference_backward",
    "reference_forward",
]

AFFINITY_ON_I = "on_i"
AFFINITY_ON_H = "on_h"
_F64 = torch.float64


def _check_affinity_option(affinity_option: str) -> None:
    if affinity_option not in (AFFINITY_ON_I, AFFINITY_ON_H):
        raise ValueError(
            f"affinity_option must be {AFFINITY_ON_I!r} or {AFFINITY_ON_H!r}, "
            f"got {affinity_option!r}"
        )


def _check_weights(
    x_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    b_gate_up_E2I: torch.Tensor | None,
    b_down_EH: torch.Tensor | None,
) -> tuple[int, int, int]:
    if x_TH.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(x_TH.shape)}")
    H = x_TH.shape[1]
    if w_gate_up_EH2I.dim() != 4 or w_gate_up_EH2I.shape[1] != H or w_gate_up_EH2I.shape[2] != 2:
        raise ValueError(
            f"w_gate_up must be [E, H={H}, 2, I], got shape {tuple(w_gate_up_EH2I.shape)}"
        )
    E, _, _, I = w_gate_up_EH2I.shape
    if tuple(w_down_EIH.shape) != (E, I, H):
        raise ValueError(
            f"w_down must be [E, I, H] = [{E}, {I}, {H}], got {tuple(w_down_EIH.shape)}"
        )
    if b_gate_up_E2I is not None and tuple(b_gate_up_E2I.shape) != (E, 2, I):
        raise ValueError(
            f"b_gate_up must be [E, 2, I] = [{E}, 2, {I}], got {tuple(b_gate_up_E2I.shape)}"
        )
    if b_down_EH is not None and tuple(b_down_EH.shape) != (E, H):
        raise ValueError(f"b_down must be [E, H] = [{E}, {H}], got {tuple(b_down_EH.shape)}")
    for name, t in (
        ("hidden_states", x_TH),
        ("w_gate_up", w_gate_up_EH2I),
        ("w_down", w_down_EIH),
        ("b_gate_up", b_gate_up_E2I),
        ("b_down", b_down_EH),
    ):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.device != x_TH.device:
            raise ValueError(
                f"{name} is on device {t.device} but hidden_states is on {x_TH.device}"
            )
    return E, H, I


# ------------------------------------------------------------------------------------- core
def _pairs_forward(
    x_TH,
    w_gate_up_EH2I,
    w_down_EIH,
    tok_P,
    exp_P,
    aff_P,
    bg_E2I,
    bd_EH,
    clamp,
    affinity_option,
    with_output=True,
    activation=SWIGLU,
):
    """Per-pair forward; returns (y_TH float64 or None, act_P2I float64).

    ``h = g * sigmoid(alpha g) * (u + up_offset)`` of ``activation`` (SwiGLU: ``silu(g) * u``).
    """
    T, H = x_TH.shape
    I = w_gate_up_EH2I.shape[3]
    P = tok_P.shape[0]
    y = torch.zeros(T, H, dtype=_F64, device=x_TH.device) if with_output else None
    act = torch.zeros(P, 2, I, dtype=_F64, device=x_TH.device)
    cl = clamp or ClampLimits()
    for e in torch.unique(exp_P).tolist():
        sel = (exp_P == e).nonzero().flatten()
        tok = tok_P[sel]
        x = x_TH[tok].to(_F64)
        a = aff_P[sel].to(_F64)[:, None]
        w = w_gate_up_EH2I[e].to(_F64)
        g = x @ w[:, 0]
        u = x @ w[:, 1]
        if bg_E2I is not None:
            g = g + bg_E2I[e, 0].to(_F64)
            u = u + bg_E2I[e, 1].to(_F64)
        g = cl.clamp_gate(g)
        u = cl.clamp_up(u)
        act[sel, 0] = g
        act[sel, 1] = u
        if not with_output:
            continue
        h = activation_forward(activation, g, u)
        wd = w_down_EIH[e].to(_F64)
        if affinity_option == AFFINITY_ON_I:
            out = (a * h) @ wd
            if bd_EH is not None:
                out = out + a * bd_EH[e].to(_F64)
        else:
            out = h @ wd
            if bd_EH is not None:
                out = out + bd_EH[e].to(_F64)
            out = a * out
        y.index_add_(0, tok, out)
    return (y if with_output else None), act


def _pairs_backward(
    x_TH,
    dy_TH,
    w_gate_up_EH2I,
    w_down_EIH,
    tok_P,
    exp_P,
    aff_P,
    act_P2I,
    bg_E2I,
    bd_EH,
    clamp,
    affinity_option,
    activation=SWIGLU,
):
    """Per-pair backward. Returns (dX_TH, dA_P, dWgu_EH2I, dWd_EIH, dBgu_E2I, dBd_EH) float64.

    With ``s = sigmoid(alpha g)`` and ``c = up_offset`` of ``activation``:
    ``dg = dh (u + c) s (1 + alpha g (1 - s))``, ``du = dh g s`` (SwiGLU: alpha 1, c 0).
    """
    T, H = x_TH.shape
    E, _, _, I = w_gate_up_EH2I.shape
    dev = x_TH.device
    dX = torch.zeros(T, H, dtype=_F64, device=dev)
    dA = torch.zeros(tok_P.shape[0], dtype=_F64, device=dev)
    dWgu = torch.zeros(E, H, 2, I, dtype=_F64, device=dev)
    dWd = torch.zeros(E, I, H, dtype=_F64, device=dev)
    dBgu = torch.zeros(E, 2, I, dtype=_F64, device=dev)
    dBd = torch.zeros(E, H, dtype=_F64, device=dev)
    cl = clamp or ClampLimits()
    for e in torch.unique(exp_P).tolist():
        sel = (exp_P == e).nonzero().flatten()
        tok = tok_P[sel]
        x = x_TH[tok].to(_F64)
        dy = dy_TH[tok].to(_F64)
        a = aff_P[sel].to(_F64)[:, None]
        g = act_P2I[sel, 0].to(_F64)
        u = act_P2I[sel, 1].to(_F64)
        # One float64 copy of one expert's weight matrix at a time (each is freed after use).
        dh_raw = dy @ w_down_EIH[e].to(_F64).T
        dg, du, h = activation_backward(activation, g, u, a * dh_raw, cl)
        da = (dh_raw * h).sum(-1)
        if bd_EH is not None:
            da = da + dy @ bd_EH[e].to(_F64)
        dA[sel] = da
        if affinity_option == AFFINITY_ON_I:
            dWd[e] = (a * h).T @ dy
        else:
            dWd[e] = h.T @ (a * dy)
        dWgu[e, :, 0] = x.T @ dg
        dWgu[e, :, 1] = x.T @ du
        dx = dg @ w_gate_up_EH2I[e, :, 0].to(_F64).T
        dx = dx + du @ w_gate_up_EH2I[e, :, 1].to(_F64).T
        dX.index_add_(0, tok, dx)
        del dx
        dBd[e] = (a * dy).sum(0)
        dBgu[e, 0] = dg.sum(0)
        dBgu[e, 1] = du.sum(0)
    return dX, dA, dWgu, dWd, dBgu, dBd


# ------------------------------------------------------------------------- blockwise-native
def _check_blockwise(
    token_position_to_id, block_to_expert, expert_affinities_masked, block_size, padding, device
) -> int:
    """Validate the blockwise routing tensors; returns N."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    for name, t in (
        ("token_position_to_id", token_position_to_id),
        ("block_to_expert", block_to_expert),
    ):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(
                f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t))}"
            )
    if not expert_affinities_masked.is_floating_point():
        raise ValueError(
            "expert_affinities_masked must be a floating tensor, got "
            f"{expert_affinities_masked.dtype}"
        )
    for name, t in (
        ("token_position_to_id", token_position_to_id),
        ("block_to_expert", block_to_expert),
        ("expert_affinities_masked", expert_affinities_masked),
    ):
        if t.device != device:
            raise ValueError(f"{name} is on device {t.device} but hidden_states is on {device}")
    n = token_position_to_id.numel()
    if n % block_size:
        raise ValueError(
            f"token_position_to_id length {n} must be a multiple of block_size={block_size}"
        )
    return n // block_size


def _blockwise_pairs(
    token_position_to_id,
    block_to_expert,
    expert_affinities_masked,
    block_size,
    num_tokens,
    num_experts,
    padding,
):
    """Real slots of a blockwise layout -> (position, token, expert, affinity).

    Ids in [0, T) are real; the padding id is -1 (``skip``) or T (``zero_row``); any other id
    raises (a silently skipped slot would drop a real token).
    """
    B = block_size
    tpti = token_position_to_id.reshape(-1).to(torch.int64)
    N = tpti.numel() // B
    b2e = block_to_expert.reshape(-1).to(torch.int64)
    if b2e.numel() != N:
        raise ValueError(f"block_to_expert must have N={N} entries, got {b2e.numel()}")
    if N and (int(b2e.min()) < 0 or int(b2e.max()) >= num_experts):
        raise ValueError(f"block_to_expert values must lie in [0, E={num_experts})")
    pad = -1 if padding == "skip" else num_tokens
    bad = ~(((tpti >= 0) & (tpti < num_tokens)) | (tpti == pad))
    if bool(bad.any()):
        raise ValueError(
            f"token_position_to_id holds ids outside [0, T={num_tokens}) other than the padding "
            f"id {pad} of padding={padding!r}, e.g. {int(tpti[bad][0])}"
        )
    pos = ((tpti >= 0) & (tpti < num_tokens)).nonzero().flatten()
    tok = tpti[pos]
    exp = b2e[pos // B]
    aff = expert_affinities_masked.reshape(-1)[tok * num_experts + exp]
    return pos, tok, exp, aff


def moe_forward_reference(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    expert_affinities_masked: torch.Tensor,
    block_size: int,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
    affinity_option: str = AFFINITY_ON_I,
    padding: str = "skip",
    activation: Activation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 gated expert-MLP forward (SwiGLU by default) on the NKI blockwise layout.

    Dimensions: T tokens, H hidden, I intermediate, E experts, B block_size, N blocks.

    Args:
        hidden_states: [T, H] (or [T+1, H] with the zero padding row) float.
        w_gate_up: [E, H, 2, I].  w_down: [E, I, H].
        token_position_to_id: [N*B] int, token per slot; -1 or T = padding.
        block_to_expert: [N, 1] int.
        expert_affinities_masked: [T*E, 1] (or [(T+1)*E, 1]) float, dense affinities.
        block_size: B.
        b_gate_up: optional [E, 2, I].  b_down: optional [E, H].
        clamp_limits: optional :class:`ClampLimits`.  affinity_option: "on_i" or "on_h".
        padding: "skip" (padding slots hold -1) or "zero_row" (hidden_states and affinities
            carry the extra row T; slots holding T are padding and row T is never read, so it
            may hold anything, NaN included). Any other id outside [0, T) raises.
        activation: the :class:`~common.problem.Activation` ``h = g sigmoid(alpha g) (u + c)``;
            None = SwiGLU. The checkpoint (pre-activations) does not depend on it.
    Returns:
        (y [T, H] float64, gate_up_proj_act_checkpoint_T [N, 2, I, B] float64): the output and
        the clamped gate/up pre-activations per slot (padding slots 0), B contiguous.
    Raises:
        ValueError: inconsistent shapes, dtypes or ids, or an ``activation`` that is not an
            Activation.
    """
    _check_affinity_option(affinity_option)
    act_fn = Activation.resolve(activation)
    E, _, I = _check_weights(hidden_states, w_gate_up, w_down, b_gate_up, b_down)
    N = _check_blockwise(
        token_position_to_id,
        block_to_expert,
        expert_affinities_masked,
        block_size,
        padding,
        hidden_states.device,
    )
    T = _num_tokens_of(padding, hidden_states, expert_affinities_masked, E)
    pos, tok, exp, aff = _blockwise_pairs(
        token_position_to_id, block_to_expert, expert_affinities_masked, block_size, T, E, padding
    )
    y, act = _pairs_forward(
        hidden_states[:T],
        w_gate_up,
        w_down,
        tok,
        exp,
        aff,
        b_gate_up,
        b_down,
        clamp_limits,
        affinity_option,
        activation=act_fn,
    )
    B = block_size
    ckpt = torch.zeros(N * B, 2, I, dtype=_F64, device=hidden_states.device)
    ckpt[pos] = act
    return y, ckpt.reshape(N, B, 2, I).permute(0, 2, 3, 1).contiguous()


def _num_tokens_of(padding, hidden_states, expert_affinities_masked, E) -> int:
    """T: rows of hidden_states, minus the zero padding row for ``padding="zero_row"``."""
    if padding not in ("skip", "zero_row"):
        raise ValueError(f"padding must be 'skip' or 'zero_row', got {padding!r}")
    rows = hidden_states.shape[0]
    aff_rows = expert_affinities_masked.numel()
    if aff_rows != rows * E:
        raise ValueError(
            f"expert_affinities_masked must have (hidden_states rows) x E = {rows}*{E} elements, "
            f"got {aff_rows}"
        )
    if padding == "zero_row":
        if rows < 1:
            raise ValueError('padding="zero_row" needs the extra zero row T in hidden_states')
        return rows - 1
    return rows


def moe_backward_reference(
    hidden_states: torch.Tensor,
    output_hidden_states_grad: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    gate_up_proj_act_checkpoint_T: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    expert_affinities_masked: torch.Tensor,
    block_size: int,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
    affinity_option: str = AFFINITY_ON_I,
    padding: str = "skip",
    activation: Activation | None = None,
) -> tuple[torch.Tensor, ...]:
    """Float64 backward on the NKI blockwise layout: the twin of ``blockwise_mm_bwd_mxfp8``.

    Args: as :func:`moe_forward_reference`, plus
        output_hidden_states_grad: [T, H] (or [T+1, H]) dY.
        gate_up_proj_act_checkpoint_T: [N, 2, I, B] clamped gate/up pre-activations.
        activation: as in :func:`moe_forward_reference` (None = SwiGLU, the kernel's).
    Returns:
        ``(dX, dA, dW_gate_up, dW_down)`` or, when a bias is given, ``(dX, dA, dW_gate_up,
        dW_down, dB_gate_up, dB_down)``, float64, shaped like their inputs: dX like
        ``hidden_states`` (the padding row T, if any, is 0), dA like
        ``expert_affinities_masked`` ([T*E, 1]; includes ``<dY, b_down>`` when ``b_down`` is
        given), dW_gate_up [E, H, 2, I], dW_down [E, I, H], dB_gate_up [E, 2, I], dB_down [E, H].
    Raises:
        ValueError: inconsistent shapes, dtypes or ids, or an ``activation`` that is not an
            Activation.
    """
    _check_affinity_option(affinity_option)
    act_fn = Activation.resolve(activation)
    E, _, I = _check_weights(hidden_states, w_gate_up, w_down, b_gate_up, b_down)
    if output_hidden_states_grad.shape != hidden_states.shape:
        raise ValueError(
            f"output_hidden_states_grad shape {tuple(output_hidden_states_grad.shape)} must equal "
            f"hidden_states shape {tuple(hidden_states.shape)}"
        )
    N = _check_blockwise(
        token_position_to_id,
        block_to_expert,
        expert_affinities_masked,
        block_size,
        padding,
        hidden_states.device,
    )
    T = _num_tokens_of(padding, hidden_states, expert_affinities_masked, E)
    B = block_size
    for name, t in (
        ("output_hidden_states_grad", output_hidden_states_grad),
        ("gate_up_proj_act_checkpoint_T", gate_up_proj_act_checkpoint_T),
    ):
        if t.device != hidden_states.device:
            raise ValueError(
                f"{name} is on device {t.device} but hidden_states is on {hidden_states.device}"
            )
    if tuple(gate_up_proj_act_checkpoint_T.shape) != (N, 2, I, B):
        raise ValueError(
            f"gate_up_proj_act_checkpoint_T must be [N, 2, I, B] = [{N}, 2, {I}, {B}], got "
            f"{tuple(gate_up_proj_act_checkpoint_T.shape)}"
        )
    pos, tok, exp, aff = _blockwise_pairs(
        token_position_to_id, block_to_expert, expert_affinities_masked, B, T, E, padding
    )
    act = gate_up_proj_act_checkpoint_T.permute(0, 3, 1, 2).reshape(N * B, 2, I)[pos]
    dX, dA_P, dWgu, dWd, dBgu, dBd = _pairs_backward(
        hidden_states,
        output_hidden_states_grad,
        w_gate_up,
        w_down,
        tok,
        exp,
        aff,
        act,
        b_gate_up,
        b_down,
        clamp_limits,
        affinity_option,
        activation=act_fn,
    )
    dA = torch.zeros(expert_affinities_masked.numel(), dtype=_F64, device=hidden_states.device)
    dA[tok * E + exp] = dA_P
    dX = torch.where((torch.arange(dX.shape[0], device=dX.device) < T)[:, None], dX, 0.0)
    out = (dX, dA.reshape(expert_affinities_masked.shape), dWgu, dWd)
    if b_gate_up is not None or b_down is not None:
        out = out + (dBgu, dBd)
    return out


# ------------------------------------------------------------------------------ plan-based
def _plan_pairs(plan: RoutingPlan):
    valid = plan.pair_valid_R
    idx = valid.nonzero().flatten()
    return idx, plan.pair_token_R[idx], plan.pair_expert_R[idx], plan.pair_affinity_R[idx]


def reference_forward(
    hidden_states_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    plan: RoutingPlan,
    *,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
    affinity_option: str = AFFINITY_ON_I,
    with_output: bool = True,
    activation: Activation | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Float64 forward from a :class:`RoutingPlan`.

    ``with_output=False`` skips the down projection (the checkpoint alone; y is None).
    ``activation``: the :class:`~common.problem.Activation` (None = SwiGLU); it changes y only,
    not the checkpoint of pre-activations.

    Returns:
        (y_TH [T, H] float64, act_checkpoint_R2I [R, 2, I] float64 in the plan's pair order;
        padding rows 0) -- the checkpoint a :class:`MoEBackwardProblem` carries.
    """
    _check_affinity_option(affinity_option)
    act_fn = Activation.resolve(activation)
    E, _, I = _check_weights(hidden_states_TH, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH)
    _check_plan(plan, hidden_states_TH, E)
    idx, tok, exp, aff = _plan_pairs(plan)
    y, act = _pairs_forward(
        hidden_states_TH,
        w_gate_up_EH2I,
        w_down_EIH,
        tok,
        exp,
        aff,
        b_gate_up_E2I,
        b_down_EH,
        clamp_limits,
        affinity_option,
        with_output,
        activation=act_fn,
    )
    R = plan.pair_token_R.shape[0]
    act_R = torch.zeros(R, 2, I, dtype=_F64, device=hidden_states_TH.device)
    act_R[idx] = act
    return y, act_R


def _check_plan(plan: RoutingPlan, x_TH: torch.Tensor, E: int) -> None:
    if plan.num_tokens != x_TH.shape[0]:
        raise ValueError(
            f"plan has T={plan.num_tokens} tokens, hidden_states has {x_TH.shape[0]} rows"
        )
    if plan.num_experts != E:
        raise ValueError(f"plan has E={plan.num_experts} experts, the weights have {E}")


def reference_backward(
    problem: MoEBackwardProblem, affinity_option: str = AFFINITY_ON_I
) -> MoEGrads:
    """Float64 backward of a :class:`MoEBackwardProblem` (any backend's twin), with the
    problem's ``activation`` (SwiGLU or gpt-oss, :class:`~common.problem.Activation`).

    Returns:
        :class:`MoEGrads` in float64; ``affinity_grad_TE`` is dense [T, E] and includes the
        down-bias term. Bias grads are present when the problem has biases.
    """
    _check_affinity_option(affinity_option)
    p = problem
    p.validate()
    E = p.w_gate_up_EH2I.shape[0]
    idx, tok, exp, aff = _plan_pairs(p.plan)
    dX, dA_P, dWgu, dWd, dBgu, dBd = _pairs_backward(
        p.hidden_states_TH,
        p.output_grad_TH,
        p.w_gate_up_EH2I,
        p.w_down_EIH,
        tok,
        exp,
        aff,
        p.act_checkpoint_R2I[idx],
        p.b_gate_up_E2I,
        p.b_down_EH,
        p.clamp_limits,
        affinity_option,
        activation=p.activation,
    )
    T = p.plan.num_tokens
    dA = torch.zeros(T * E, dtype=_F64, device=dX.device)
    dA[tok * E + exp] = dA_P
    has_bias = p.has_bias
    return MoEGrads(
        hidden_states_grad_TH=dX,
        affinity_grad_TE=dA.reshape(T, E),
        w_gate_up_grad_EH2I=dWgu,
        w_down_grad_EIH=dWd,
        b_gate_up_grad_E2I=dBgu if has_bias else None,
        b_down_grad_EH=dBd if has_bias else None,
    )


# ------------------------------------------------------------------------------ grouped wgrad
def grouped_wgrad_reference(
    a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """Float64 twin of the grouped weight-gradient GEMM of the cuDNN-style API.

    ``Wgrad[e] = a_HS[:, begin:end] @ b_SI[begin:end, :]`` with ``begin = offsets_E[e-1]`` (0 for
    e = 0) and ``end = offsets_E[e]`` (seed ``grouped_gemm_wgrad_sm100.md``). Rows past the last
    offset are never read. Empty experts give zeros.

    Args:
        a_HS: [H, S] float (any strides).  b_SI: [S, I] float.  offsets_E: [E] int, cumulative
            ends, non-decreasing, ``offsets_E[-1] <= S``.
    Returns:
        [E, H, I] float64.
    Raises:
        ValueError: bad ranks, mismatched S, decreasing or out-of-range offsets.
    """
    if a_HS.dim() != 2 or b_SI.dim() != 2:
        raise ValueError(
            f"a must be [H, S] and b [S, I]; got {tuple(a_HS.shape)} and {tuple(b_SI.shape)}"
        )
    if a_HS.shape[1] != b_SI.shape[0]:
        raise ValueError(f"a is [H, S={a_HS.shape[1]}] but b is [S={b_SI.shape[0]}, I]")
    if offsets_E.dim() != 1 or offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "offsets must be a 1-D int32/int64 tensor, got "
            f"{offsets_E.dtype} {tuple(offsets_E.shape)}"
        )
    ends = offsets_E.to(torch.int64).cpu()
    E = ends.numel()
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    if E and (bool((ends < begins).any()) or int(ends[-1]) > a_HS.shape[1] or int(begins[0]) < 0):
        raise ValueError(
            "offsets must be non-decreasing cumulative ends with offsets[-1] <= tokens_sum"
        )
    H, I = a_HS.shape[0], b_SI.shape[1]
    out = torch.zeros(E, H, I, dtype=_F64, device=a_HS.device)
    for e in range(E):
        s, t = int(begins[e]), int(ends[e])
        if t > s:
            out[e] = a_HS[:, s:t].to(_F64) @ b_SI[s:t].to(_F64)
    return out
