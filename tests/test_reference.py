"""Tests of common/reference.py against torch.autograd of an independent float64 forward.

The forward below is written from REFERENCE §2 as a naive loop over tokens and experts (no
layouts, no sorting); its autograd gradients are the expected values of the float64 backward,
in both the blockwise-native API (both padding conventions) and the plan-based one.
"""

from __future__ import annotations

import pytest
import torch

from common.problem import ClampLimits, MoEBackwardProblem
from common.reference import (
    AFFINITY_ON_H,
    AFFINITY_ON_I,
    grouped_wgrad_reference,
    moe_backward_reference,
    moe_forward_reference,
    reference_backward,
    reference_forward,
)
from common.routing import plan_routing

F64 = torch.float64
NAN = float("nan")


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-12) -> None:
    """max |out - ref| <= tol * max |ref| (exact equality when ref is all zero)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == F64
    assert bool(torch.isfinite(out).all())
    diff = (out - ref).abs().max().item() if out.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert diff <= tol * scale, f"max abs diff {diff:.3e} vs scale {scale:.3e}"


# ------------------------------------------------------------------- the independent forward


def naive_forward(x_TH, A_TE, routed, wgu, wd, bgu, bd, clamp: ClampLimits | None):
    """y [T, H] = sum over routed (t, e) of A[t, e] * (silu(g) * u @ Wd[e] + bd[e]).

    ``routed`` is a set of (token, expert). Returns (y, {(t, e): (g, u)} clamped, detached).
    """
    T, H = x_TH.shape
    E = wgu.shape[0]
    cl = clamp or ClampLimits()
    rows, act = [], {}
    for t in range(T):
        acc = torch.zeros(H, dtype=F64)
        for e in range(E):
            if (t, e) not in routed:
                continue
            g = x_TH[t] @ wgu[e, :, 0]
            u = x_TH[t] @ wgu[e, :, 1]
            if bgu is not None:
                g = g + bgu[e, 0]
                u = u + bgu[e, 1]
            lo, hi = cl.non_linear_clamp_lower_limit, cl.non_linear_clamp_upper_limit
            if lo is not None or hi is not None:
                g = torch.clamp(g, min=lo, max=hi)
            lo, hi = cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit
            if lo is not None or hi is not None:
                u = torch.clamp(u, min=lo, max=hi)
            act[(t, e)] = (g.detach().clone(), u.detach().clone())
            h = g * torch.sigmoid(g) * u
            out = h @ wd[e]
            if bd is not None:
                out = out + bd[e]
            acc = acc + A_TE[t, e] * out
        rows.append(acc)
    y = torch.stack(rows) if rows else torch.zeros(0, H, dtype=F64)
    return y, act


def make_case(seed=0, T=10, H=8, I=6, E=5, K=3, bias=False, clamp=None):
    """Random float64 inputs, a routing with a duplicate, dropped slots and an empty expert."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, E, (T, K), generator=g)
    ei[ei == 3] = 2  # expert 3 stays empty
    ei[0] = torch.tensor([1, 1, 4])  # duplicate expert in token 0's top-k
    ei[2, 1] = -1
    ei[5] = -1  # token 5 fully dropped
    af = torch.rand(T, K, generator=g, dtype=F64) + 0.1
    d = {
        "x": torch.randn(T, H, generator=g, dtype=F64),
        "dy": torch.randn(T, H, generator=g, dtype=F64),
        "wgu": torch.randn(E, H, 2, I, generator=g, dtype=F64) * H**-0.5 * 1.5,
        "wd": torch.randn(E, I, H, generator=g, dtype=F64) * I**-0.5,
        "bgu": torch.randn(E, 2, I, generator=g, dtype=F64) * 0.3 if bias else None,
        "bd": torch.randn(E, H, generator=g, dtype=F64) * 0.3 if bias else None,
    }
    plan = plan_routing(ei, af, E)
    return d, plan, clamp


def autograd_grads(d, plan, clamp):
    """Gradients of sum(y * dY) by torch.autograd of :func:`naive_forward`."""
    A = plan.affinity_dense_TE().clone().requires_grad_(True)
    routed = {
        (int(t), int(e))
        for t, e in zip(plan.pair_token_R.tolist(), plan.pair_expert_R.tolist())
        if t >= 0
    }
    leaves = {k: (v.clone().requires_grad_(True) if v is not None else None) for k, v in d.items()}
    y, act = naive_forward(
        leaves["x"], A, routed, leaves["wgu"], leaves["wd"], leaves["bgu"], leaves["bd"], clamp
    )
    y.backward(d["dy"])

    def grad(t):
        return torch.zeros_like(t) if t.grad is None else t.grad

    out = {
        "dX": grad(leaves["x"]),
        "dA": grad(A),
        "dWgu": grad(leaves["wgu"]),
        "dWd": grad(leaves["wd"]),
    }
    if leaves["bgu"] is not None:
        out["dBgu"] = grad(leaves["bgu"])
        out["dBd"] = grad(leaves["bd"])
    return y.detach(), act, out, routed


def blockwise_checkpoint(layout, act, I):
    """[N, 2, I, B] from the per-(t, e) activations by a slot loop; padding slots 0."""
    N, B = layout.num_blocks, layout.block_size
    ck = torch.zeros(N, 2, I, B, dtype=F64)
    tpti = layout.token_position_to_id.tolist()
    b2e = layout.block_to_expert.flatten().tolist()
    for j, t in enumerate(tpti):
        if 0 <= t < layout.num_tokens:
            g, u = act[(t, b2e[j // B])]
            ck[j // B, 0, :, j % B] = g
            ck[j // B, 1, :, j % B] = u
    return ck


def pair_checkpoint(plan, act, I, fill=0.0):
    R = plan.pair_token_R.shape[0]
    ck = torch.full((R, 2, I), fill, dtype=F64)
    for p, (t, e) in enumerate(zip(plan.pair_token_R.tolist(), plan.pair_expert_R.tolist())):
        if t >= 0:
            ck[p, 0], ck[p, 1] = act[(t, e)]
    return ck


CLAMP = ClampLimits(
    linear_clamp_upper_limit=0.6,
    linear_clamp_lower_limit=-0.7,
    non_linear_clamp_upper_limit=0.8,
    non_linear_clamp_lower_limit=-0.5,
)


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("affinity_option", [AFFINITY_ON_I, AFFINITY_ON_H])
@pytest.mark.parametrize("padding", ["skip", "zero_row"])
def test_blockwise_backward_equals_autograd(bias, clamp, affinity_option, padding):
    d, plan, clamp = make_case(seed=1, bias=bias, clamp=clamp)
    T, E = plan.num_tokens, plan.num_experts
    I = d["wgu"].shape[3]
    y_ref, act, want, _ = autograd_grads(d, plan, clamp)
    if clamp is not None:  # the clamps bite on some values and not on others
        gs = torch.stack([g for g, _ in act.values()])
        us = torch.stack([u for _, u in act.values()])
        assert (gs == 0.8).any() and (gs == -0.5).any() and ((gs > -0.5) & (gs < 0.8)).any()
        assert (us == 0.6).any() and (us == -0.7).any()
    L = plan.blockwise(3, padding=padding)
    x = L.pad_token_rows(d["x"])
    dy = L.pad_token_rows(d["dy"])
    kw = {
        "b_gate_up": d["bgu"], "b_down": d["bd"], "clamp_limits": clamp,
        "affinity_option": affinity_option, "padding": padding,
    }
    args = (L.token_position_to_id, L.block_to_expert, L.expert_affinities_masked, 3)
    # forward: output and checkpoint equal the naive forward's
    y, ck = moe_forward_reference(x, d["wgu"], d["wd"], *args, **kw)
    assert_rel(y, y_ref)
    ck_want = blockwise_checkpoint(L, act, I)
    assert_rel(ck, ck_want)
    # backward from the naive checkpoint
    out = moe_backward_reference(x, dy, d["wgu"], d["wd"], ck_want, *args, **kw)
    assert len(out) == (6 if bias else 4)
    extra = 1 if padding == "zero_row" else 0
    assert out[0].shape == (T + extra, d["x"].shape[1])
    assert_rel(out[0][:T], want["dX"])
    if extra:
        assert not out[0][T].any()
    assert out[1].shape == ((T + extra) * E, 1)
    assert_rel(out[1][: T * E].reshape(T, E), want["dA"])
    if extra:
        assert not out[1][T * E :].any()
    assert_rel(out[2], want["dWgu"])
    assert_rel(out[3], want["dWd"])
    assert not out[2][3].any() and not out[3][3].any()  # empty expert 3
    if bias:
        assert_rel(out[4], want["dBgu"])
        assert_rel(out[5], want["dBd"])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("clamp", [None, CLAMP], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("affinity_option", [AFFINITY_ON_I, AFFINITY_ON_H])
def test_plan_backward_equals_autograd_and_blockwise(bias, clamp, affinity_option):
    d, plan, clamp = make_case(seed=2, bias=bias, clamp=clamp)
    T, E = plan.num_tokens, plan.num_experts
    I = d["wgu"].shape[3]
    y_ref, act, want, _ = autograd_grads(d, plan, clamp)
    y, act_R = reference_forward(
        d["x"], d["wgu"], d["wd"], plan, b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"],
        clamp_limits=clamp, affinity_option=affinity_option,
    )
    assert_rel(y, y_ref)
    assert_rel(act_R, pair_checkpoint(plan, act, I))
    problem = MoEBackwardProblem(
        d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, act, I, fill=NAN),
        b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"], clamp_limits=clamp,
    )
    grads = reference_backward(problem, affinity_option)
    assert_rel(grads.hidden_states_grad_TH, want["dX"])
    assert_rel(grads.affinity_grad_TE, want["dA"])
    assert_rel(grads.w_gate_up_grad_EH2I, want["dWgu"])
    assert_rel(grads.w_down_grad_EIH, want["dWd"])
    if bias:
        assert_rel(grads.b_gate_up_grad_E2I, want["dBgu"])
        assert_rel(grads.b_down_grad_EH, want["dBd"])
    else:
        assert grads.b_gate_up_grad_E2I is None and grads.b_down_grad_EH is None
    # per-slot affinity grads: token 0's duplicate slots (expert 1 twice) get the same value
    slot = plan.slot_affinity_grad(grads.affinity_grad_TE)
    assert float(slot[0, 0]) == float(slot[0, 1]) == float(grads.affinity_grad_TE[0, 1])
    assert float(slot[2, 1]) == 0.0 and not slot[5].any()
    # the blockwise-native path agrees
    L = plan.blockwise(4, padding="skip")
    out = moe_backward_reference(
        d["x"], d["dy"], d["wgu"], d["wd"], L.checkpoint_from_pairs(act_R),
        L.token_position_to_id, L.block_to_expert, L.expert_affinities_masked, 4,
        b_gate_up=d["bgu"], b_down=d["bd"], clamp_limits=clamp, affinity_option=affinity_option,
    )
    assert_rel(out[0], grads.hidden_states_grad_TH)
    assert_rel(out[1].reshape(T, E), grads.affinity_grad_TE)
    assert_rel(out[2], grads.w_gate_up_grad_EH2I)
    assert_rel(out[3], grads.w_down_grad_EIH)


@pytest.mark.parametrize("padding", ["skip", "zero_row"])
def test_padding_slots_contribute_nothing(padding):
    d, plan, clamp = make_case(seed=3, bias=True, clamp=CLAMP)
    T, E = plan.num_tokens, plan.num_experts
    I = d["wgu"].shape[3]
    _, act, _, _ = autograd_grads(d, plan, clamp)
    L = plan.blockwise(4, padding=padding)
    ck = blockwise_checkpoint(L, act, I)
    args = (L.token_position_to_id, L.block_to_expert, L.expert_affinities_masked, 4)
    kw = {"b_gate_up": d["bgu"], "b_down": d["bd"], "clamp_limits": clamp, "padding": padding}
    x, dy = L.pad_token_rows(d["x"]), L.pad_token_rows(d["dy"])
    clean = moe_backward_reference(x, dy, d["wgu"], d["wd"], ck, *args, **kw)

    pad_slots = (L.position_to_pair < 0).reshape(L.num_blocks, 4)
    assert pad_slots.any()
    ck_nan = ck.clone().permute(0, 3, 1, 2)  # [N, B, 2, I] view of the slots
    ck_nan[pad_slots] = NAN
    ck_nan = ck_nan.permute(0, 2, 3, 1)
    x_nan, dy_nan, aff = x.clone(), dy.clone(), L.expert_affinities_masked
    if padding == "zero_row":
        x_nan[T] = NAN
        dy_nan[T] = NAN
        aff = aff.clone()
        aff[T * E :] = NAN
    args_nan = (L.token_position_to_id, L.block_to_expert, aff, 4)
    dirty = moe_backward_reference(x_nan, dy_nan, d["wgu"], d["wd"], ck_nan, *args_nan, **kw)
    for a, b in zip(dirty, clean):
        assert bool(torch.isfinite(a).all())
        assert torch.equal(a, b)


def test_plan_padding_pairs_contribute_nothing():
    d, plan, clamp = make_case(seed=4)
    I = d["wgu"].shape[3]
    _, act, _, _ = autograd_grads(d, plan, clamp)
    assert int(plan.num_pairs) < plan.pair_token_R.shape[0]
    zero = MoEBackwardProblem(d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, act, I))
    nan = MoEBackwardProblem(
        d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, act, I, fill=NAN)
    )
    a, b = reference_backward(zero), reference_backward(nan)
    for k in a.named():
        assert bool(torch.isfinite(b.named()[k]).all())
        assert torch.equal(a.named()[k], b.named()[k])


def test_reference_no_pairs_gives_zero_grads():
    E, H, I = 3, 4, 5
    plan = plan_routing(torch.full((4, 2), -1), torch.ones(4, 2, dtype=F64), E)
    x = torch.randn(4, H, dtype=F64)
    problem = MoEBackwardProblem(
        x, torch.randn(4, H, dtype=F64), torch.randn(E, H, 2, I, dtype=F64),
        torch.randn(E, I, H, dtype=F64), plan, torch.full((8, 2, I), NAN, dtype=F64),
    )
    g = reference_backward(problem)
    for t in g.named().values():
        assert not t.any()
    assert g.affinity_grad_TE.shape == (4, E)


# ------------------------------------------------------------------------- grouped wgrad


def loop_wgrad(a_HS, b_SI, offsets):
    """Sum of outer products row by row."""
    E, H, I = len(offsets), a_HS.shape[0], b_SI.shape[1]
    out = torch.zeros(E, H, I, dtype=F64)
    begin = 0
    for e, end in enumerate(offsets):
        for s in range(begin, end):
            out[e] += torch.outer(a_HS[:, s].to(F64), b_SI[s].to(F64))
        begin = end
    return out


@pytest.mark.parametrize(
    "offsets,S",
    [
        ([3, 3, 7, 12], 12),
        ([0, 5, 5, 9], 14),  # leading and consecutive empty experts, rows past the last offset
        ([4, 8, 8, 8], 11),  # trailing empty experts
        ([0, 0, 0], 6),  # every expert empty
        ([0, 0], 0),  # tokens_sum = 0
    ],
)
@pytest.mark.parametrize("odt", [torch.int32, torch.int64])
def test_grouped_wgrad_reference_vs_loop(offsets, S, odt):
    g = torch.Generator().manual_seed(5)
    H, I = 5, 3
    a_SH = torch.randn(S, H, generator=g, dtype=torch.float32)
    b = torch.randn(S, I, generator=g, dtype=torch.float32)
    last = offsets[-1]
    want = loop_wgrad(a_SH.t(), b, offsets)
    a_SH[last:] = NAN  # rows past the last offset are garbage
    b[last:] = NAN
    out = grouped_wgrad_reference(a_SH.t(), b, torch.tensor(offsets, dtype=odt))
    assert out.shape == (len(offsets), H, I)
    assert_rel(out, want)
    begin = 0
    for e, end in enumerate(offsets):
        if end == begin:
            assert not out[e].any()
        begin = end


def test_slot_affinity_grad_equals_autograd_per_slot():
    """Autograd w.r.t. the router's [T, K] affinities (duplicates summed inside the graph)."""
    d, plan, _ = make_case(seed=6, bias=True)
    T, E = plan.num_tokens, plan.num_experts
    I = d["wgu"].shape[3]
    g = torch.Generator().manual_seed(6)
    ei = torch.tensor([[1, 1, 3], [0, 2, -1], [4, 0, 2]] + [[2, 4, 0]] * (T - 3))
    af = torch.rand(T, 3, generator=g, dtype=F64) + 0.1
    af[0] = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    plan = plan_routing(ei, af, E)
    assert float(plan.affinity_dense_TE()[0, 1]) == pytest.approx(0.5, abs=1e-15)
    af_leaf = af.clone().requires_grad_(True)
    A = torch.zeros(T, E, dtype=F64)
    for t in range(T):  # dense affinities built from the slots inside the graph
        for k in range(3):
            if ei[t, k] >= 0:
                A = A.index_put((torch.tensor([t]), ei[t, k : k + 1]), af_leaf[t, k : k + 1],
                                accumulate=True)
    routed = {(t, int(e)) for t in range(T) for e in ei[t] if e >= 0}
    y, act = naive_forward(d["x"], A, routed, d["wgu"], d["wd"], d["bgu"], d["bd"], None)
    y.backward(d["dy"])
    problem = MoEBackwardProblem(
        d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, act, I),
        b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"],
    )
    slot = plan.slot_affinity_grad(reference_backward(problem).affinity_grad_TE)
    want = af_leaf.grad.clone()
    assert float(want[1, 2]) == 0.0  # dropped slot
    assert_rel(slot, want)
    assert float(slot[0, 0]) == float(slot[0, 1])
