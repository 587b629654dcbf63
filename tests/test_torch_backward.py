"""Tests of the portable ``torch`` backend (common/torch_backward.py) against the float64 reference.

Each gradient g must reach ``sqnr_floor("torch", g)`` (common/metrics.py's table) against the
reference on the same BF16 inputs; empty experts' weight gradients must be exactly zero; NaN in the checkpoint's
padding pairs must not reach any gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.inputs import make_problem
from common.metrics import sqnr_db, sqnr_floor
from common.problem import ClampLimits
from common.reference import reference_backward
from common.torch_backward import grouped_wgrad_default, moe_backward_torch


def routing(T, K, E, seed, *, empty=(), dup_token=None, drop_frac=0.0):
    """Seeded router output with chosen empty experts, a duplicate and dropped slots."""
    g = torch.Generator().manual_seed(seed)
    live = torch.tensor([e for e in range(E) if e not in empty])
    ei = live[torch.randint(0, live.numel(), (T, K), generator=g)]
    if drop_frac:
        ei[torch.rand(T, K, generator=g) < drop_frac] = -1
    if dup_token is not None and K >= 2:
        ei[dup_token, 0] = ei[dup_token, 1] = live[0]
    af = torch.rand(T, K, generator=g) + 0.05
    return ei, af


CASES = {
    # name: (T, H, I, E, K, routing kwargs, bias, clamp)
    "grouped_mm_shapes": (48, 64, 32, 4, 2, {}, False, None),
    "loop_shapes": (20, 12, 10, 3, 2, {}, False, None),
    "empty_experts": (40, 32, 16, 6, 2, {"empty": (0, 2, 3, 5)}, False, None),
    "duplicates_dropped": (32, 32, 24, 5, 3, {"dup_token": 0, "drop_frac": 0.3}, False, None),
    "bias_clamp": (
        40, 64, 32, 4, 2, {"drop_frac": 0.1}, True,
        ClampLimits(linear_clamp_upper_limit=0.5, linear_clamp_lower_limit=-0.5,
                    non_linear_clamp_upper_limit=0.625),
    ),
    "top1_one_expert": (16, 16, 8, 1, 1, {}, False, None),
}


def _problem(name, seed=0):
    T, H, I, E, K, rkw, bias, clamp = CASES[name]
    ei, af = routing(T, K, E, seed + 11, **rkw)
    return make_problem(T, H, I, E, K, seed=seed, bias=bias, clamp_limits=clamp,
                        expert_index=ei, affinity=af)


def _assert_close_to_reference(grads, ref):
    names = ref.named()
    assert list(grads.named()) == list(names)
    for k, want in names.items():
        out = grads.named()[k]
        assert out.shape == want.shape, k
        assert out.dtype == torch.float32, k
        assert bool(torch.isfinite(out).all()), k
        s = sqnr_db(out, want)
        floor = sqnr_floor("torch", k)
        assert s >= floor, f"{k}: SQNR {s:.1f} dB < {floor} dB"


@pytest.mark.parametrize("name", list(CASES))
def test_torch_backend_vs_reference(name):
    problem = _problem(name)
    grads = moe_backward_torch(problem)
    ref = reference_backward(problem)
    _assert_close_to_reference(grads, ref)
    # experts with no token get exactly zero weight (and bias) gradients
    empty = (problem.plan.tokens_per_expert_E == 0).nonzero().flatten().tolist()
    if name == "empty_experts":
        assert empty == [0, 2, 3, 5]
    for e in empty:
        assert not grads.w_gate_up_grad_EH2I[e].any()
        assert not grads.w_down_grad_EIH[e].any()
        assert not grads.affinity_grad_TE[:, e].any()


def test_clamp_case_masks_gradients():
    problem = _problem("bias_clamp")
    act = problem.act_checkpoint_R2I[: int(problem.plan.num_pairs)].float()
    assert (act[:, 1] == 0.5).any() and (act[:, 0] == 0.625).any()  # the clamps bite
    grads = moe_backward_torch(problem)
    ref = reference_backward(problem)
    _assert_close_to_reference(grads, ref)
    assert grads.b_gate_up_grad_E2I.shape == (4, 2, 32)
    assert grads.b_down_grad_EH.shape == (4, 64)


def test_duplicate_slots_share_affinity_grad():
    problem = _problem("duplicates_dropped")
    plan = problem.plan
    grads = moe_backward_torch(problem)
    ref = reference_backward(problem)
    slot = plan.slot_affinity_grad(grads.affinity_grad_TE)
    s2p = plan.slot_to_pair_TK
    assert int(s2p[0, 0]) == int(s2p[0, 1]) >= 0  # token 0: expert 0 twice, one merged pair
    assert float(slot[0, 0]) == float(slot[0, 1]) == float(grads.affinity_grad_TE[0, 0])
    assert float(slot[0, 0]) == pytest.approx(float(ref.affinity_grad_TE[0, 0]), rel=2e-2)
    assert (s2p == -1).any()
    assert not slot[s2p == -1].any()


def test_nan_in_checkpoint_padding_pairs():
    problem = _problem("duplicates_dropped")
    P = int(problem.plan.num_pairs)
    assert P < problem.act_checkpoint_R2I.shape[0]
    clean = moe_backward_torch(problem)
    problem.act_checkpoint_R2I = problem.act_checkpoint_R2I.clone()
    problem.act_checkpoint_R2I[P:] = float("nan")
    dirty = moe_backward_torch(problem)
    for k, v in dirty.named().items():
        assert bool(torch.isfinite(v).all()), k
        assert torch.equal(v, clean.named()[k]), k


def test_zero_tokens():
    ei = torch.zeros(0, 2, dtype=torch.int64)
    af = torch.zeros(0, 2)
    problem = make_problem(0, 16, 8, 3, 2, expert_index=ei, affinity=af)
    grads = moe_backward_torch(problem)
    assert grads.hidden_states_grad_TH.shape == (0, 16)
    assert grads.affinity_grad_TE.shape == (0, 3)
    assert grads.w_gate_up_grad_EH2I.shape == (3, 16, 2, 8)
    assert not grads.w_gate_up_grad_EH2I.any() and not grads.w_down_grad_EIH.any()


@pytest.mark.parametrize("use_default", [True, False])
def test_custom_grouped_wgrad_is_used(use_default):
    problem = _problem("grouped_mm_shapes")
    calls = []

    def wgrad(a_HS, b_SI, offsets_E):
        calls.append((tuple(a_HS.shape), tuple(b_SI.shape), offsets_E.tolist()))
        if use_default:
            return grouped_wgrad_default(a_HS, b_SI, offsets_E)
        # fp32 per-expert loop (what a CUDA kernel with fp32 output provides)
        ends = offsets_E.tolist()
        out = torch.zeros(offsets_E.numel(), a_HS.shape[0], b_SI.shape[1])
        for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
            out[e] = a_HS[:, s:t].float() @ b_SI[s:t].float()
        return out

    grads = moe_backward_torch(problem, grouped_wgrad=wgrad)
    assert len(calls) == 2
    (a1, b1, off1), (a2, b2, off2) = calls
    assert a1[0] == 64 and b1[1] == 2 * 32 and a2[0] == 32 and b2[1] == 64
    assert off1 == off2 and off1[-1] == a1[1]
    assert all(v % 16 == 0 for v in off1)
    _assert_close_to_reference(grads, reference_backward(problem))


def test_sqnr_threshold_is_meaningful():
    """A wrong gradient (sign flip on one expert) falls below the threshold."""
    problem = _problem("grouped_mm_shapes")
    grads = moe_backward_torch(problem)
    ref = reference_backward(problem)
    bad = grads.w_down_grad_EIH.clone()
    bad[1] = -bad[1]
    assert sqnr_db(bad, ref.w_down_grad_EIH) < sqnr_floor("torch", "dW_down")
    assert math.isfinite(sqnr_db(grads.w_down_grad_EIH, ref.w_down_grad_EIH))


def test_sqnr_floor_names_and_families():
    """One table serves every spelling of a gradient; MX floors sit below the BF16 ones."""
    assert sqnr_floor("torch", "dX") == sqnr_floor("torch", "dX [T,H]")
    assert sqnr_floor("torch", "dX") == sqnr_floor("torch", "hidden_states_grad_TH")
    assert sqnr_floor("cuda-sm90", "dW_down") == sqnr_floor("fused", "dW_down")
    assert sqnr_floor("nki-sim", "default") == sqnr_floor("nki", "default") == 24.0
    for g in ("dX", "dA", "dW_gate_up", "dW_down", "dB_gate_up", "dB_down"):
        assert sqnr_floor("nki", g) < sqnr_floor("torch", g)
    with pytest.raises(KeyError):
        sqnr_floor("tpu", "dX")
    with pytest.raises(KeyError):
        sqnr_floor("torch", "dQ")
