"""The gated activation ``h = g * sigmoid(alpha g) * (u + up_offset)`` (common.problem.Activation).

gpt-oss (``GPT_OSS``: alpha 1.702, up offset 1) through every path that computes it: the float64
reference (plan-based and blockwise-native) against torch.autograd of an independent float64
forward written here from the formula, the portable torch backend against the reference (SQNR),
the inputs built for a gpt-oss model, the NKI backends' refusal (their kernel is SiLU only), and
the CLI's summary line. SwiGLU stays the default and gives the same results when named.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common import cli
from common.dispatch import registered_backends
from common.inputs import make_problem, make_problem_for_model
from common.metrics import SQNR_MIN_DB, sqnr_db
from common.models import load_model
from common.problem import GPT_OSS, SWIGLU, Activation, ClampLimits, MoEBackwardProblem
from common.reference import (
    AFFINITY_ON_H,
    AFFINITY_ON_I,
    moe_backward_reference,
    moe_forward_reference,
    reference_backward,
    reference_forward,
)
from common.routing import plan_routing
from common.torch_backward import moe_backward_torch, moe_forward_torch

F64 = torch.float64
NAN = float("nan")
SQNR_MIN = SQNR_MIN_DB[("torch", "default")]

# gpt-oss's clamp pattern (gate above only, up on both sides), at limits the O(1) test values
# reach; all three are exact in BF16 so the strict masks see the stored limit.
OSS_CLAMP = ClampLimits(
    non_linear_clamp_upper_limit=0.5,
    linear_clamp_upper_limit=0.75,
    linear_clamp_lower_limit=-0.75,
)


def assert_rel(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-12) -> None:
    """max |out - ref| <= tol * max |ref|, float64 and finite."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == F64
    assert bool(torch.isfinite(out).all())
    diff = (out - ref).abs().max().item() if out.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    assert diff <= tol * scale, f"max abs diff {diff:.3e} vs scale {scale:.3e}"


# ------------------------------------------------------------------- the independent forward


def naive_forward(x_TH, A_TE, routed, wgu, wd, bgu, bd, clamp, act: Activation):
    """y [T, H] = sum over routed (t, e) of A[t, e] * (h @ Wd[e] + bd[e]) with
    ``h = g * sigmoid(alpha g) * (u + up_offset)`` on the clamped g, u (openai/gpt-oss
    ``swiglu``: ``x_glu * sigmoid(alpha * x_glu) * (x_linear + 1)``).

    Returns (y, {(t, e): (g, u)} clamped, detached).
    """
    T, H = x_TH.shape
    E = wgu.shape[0]
    cl = clamp or ClampLimits()
    rows, saved = [], {}
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
            if cl.non_linear_clamp_upper_limit is not None:
                g = torch.clamp(g, max=cl.non_linear_clamp_upper_limit)
            lo, hi = cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit
            if lo is not None or hi is not None:
                u = torch.clamp(u, min=lo, max=hi)
            saved[(t, e)] = (g.detach().clone(), u.detach().clone())
            h = g * torch.sigmoid(act.alpha * g) * (u + act.up_offset)
            out = h @ wd[e]
            if bd is not None:
                out = out + bd[e]
            acc = acc + A_TE[t, e] * out
        rows.append(acc)
    return torch.stack(rows), saved


def make_case(seed=0, T=9, H=8, I=6, E=4, K=2, bias=False):
    """Float64 inputs; routing with a duplicate expert in a top-k, a dropped slot, empty expert 3."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, 3, (T, K), generator=g)
    ei[0] = torch.tensor([1, 1])
    ei[2, 1] = -1
    af = torch.rand(T, K, generator=g, dtype=F64) + 0.1
    d = {
        "x": torch.randn(T, H, generator=g, dtype=F64),
        "dy": torch.randn(T, H, generator=g, dtype=F64),
        "wgu": torch.randn(E, H, 2, I, generator=g, dtype=F64) * H**-0.5 * 1.5,
        "wd": torch.randn(E, I, H, generator=g, dtype=F64) * I**-0.5,
        "bgu": torch.randn(E, 2, I, generator=g, dtype=F64) * 0.3 if bias else None,
        "bd": torch.randn(E, H, generator=g, dtype=F64) * 0.3 if bias else None,
    }
    return d, plan_routing(ei, af, E)


def autograd_grads(d, plan, clamp, act):
    """Gradients of sum(y * dY) by torch.autograd of :func:`naive_forward`."""
    A = plan.affinity_dense_TE().clone().requires_grad_(True)
    routed = {
        (int(t), int(e))
        for t, e in zip(plan.pair_token_R.tolist(), plan.pair_expert_R.tolist())
        if t >= 0
    }
    leaves = {k: (v.clone().requires_grad_(True) if v is not None else None) for k, v in d.items()}
    y, saved = naive_forward(
        leaves["x"], A, routed, leaves["wgu"], leaves["wd"], leaves["bgu"], leaves["bd"],
        clamp, act,
    )
    y.backward(d["dy"])

    def grad(t):
        return torch.zeros_like(t) if t.grad is None else t.grad

    want = {"dX": grad(leaves["x"]), "dA": grad(A), "dWgu": grad(leaves["wgu"]),
            "dWd": grad(leaves["wd"])}
    if leaves["bgu"] is not None:
        want["dBgu"] = grad(leaves["bgu"])
        want["dBd"] = grad(leaves["bd"])
    return y.detach(), saved, want


def pair_checkpoint(plan, saved, I, fill=0.0):
    """[R, 2, I] in the plan's pair order from the per-(t, e) values; padding pairs ``fill``."""
    R = plan.pair_token_R.shape[0]
    ck = torch.full((R, 2, I), fill, dtype=F64)
    for p, (t, e) in enumerate(zip(plan.pair_token_R.tolist(), plan.pair_expert_R.tolist())):
        if t >= 0:
            ck[p, 0], ck[p, 1] = saved[(t, e)]
    return ck


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("clamp", [None, OSS_CLAMP], ids=["noclamp", "clamp"])
@pytest.mark.parametrize("affinity_option", [AFFINITY_ON_I, AFFINITY_ON_H])
def test_reference_gpt_oss_equals_autograd(bias, clamp, affinity_option):
    d, plan = make_case(seed=4, bias=bias)
    T, E, I = plan.num_tokens, plan.num_experts, d["wgu"].shape[3]
    y_want, saved, want = autograd_grads(d, plan, clamp, GPT_OSS)
    if clamp is not None:  # the clamps bite on some values and not on others
        gs = torch.stack([g for g, _ in saved.values()])
        us = torch.stack([u for _, u in saved.values()])
        assert (gs == 0.5).any() and (gs < 0.5).any()
        assert (us == 0.75).any() and (us == -0.75).any() and (us.abs() < 0.75).any()
    # plan-based forward and backward (NaN in padding pairs must not leak)
    y, act_R = reference_forward(
        d["x"], d["wgu"], d["wd"], plan, b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"],
        clamp_limits=clamp, affinity_option=affinity_option, activation=GPT_OSS,
    )
    assert_rel(y, y_want)
    assert_rel(act_R, pair_checkpoint(plan, saved, I))
    problem = MoEBackwardProblem(
        d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, saved, I, fill=NAN),
        b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"], clamp_limits=clamp, activation=GPT_OSS,
    )
    grads = reference_backward(problem, affinity_option)
    assert_rel(grads.hidden_states_grad_TH, want["dX"])
    assert_rel(grads.affinity_grad_TE, want["dA"])
    assert_rel(grads.w_gate_up_grad_EH2I, want["dWgu"])
    assert_rel(grads.w_down_grad_EIH, want["dWd"])
    if bias:
        assert_rel(grads.b_gate_up_grad_E2I, want["dBgu"])
        assert_rel(grads.b_down_grad_EH, want["dBd"])
    # the blockwise-native API agrees (forward and backward)
    L = plan.blockwise(4, padding="skip")
    args = (L.token_position_to_id, L.block_to_expert, L.expert_affinities_masked, 4)
    kw = {"b_gate_up": d["bgu"], "b_down": d["bd"], "clamp_limits": clamp,
          "affinity_option": affinity_option, "activation": GPT_OSS}
    y_b, ck = moe_forward_reference(d["x"], d["wgu"], d["wd"], *args, **kw)
    assert_rel(y_b, y_want)
    out = moe_backward_reference(d["x"], d["dy"], d["wgu"], d["wd"], ck, *args, **kw)
    assert_rel(out[0], want["dX"])
    assert_rel(out[1].reshape(T, E), want["dA"])
    assert_rel(out[2], want["dWgu"])
    assert_rel(out[3], want["dWd"])
    if bias:
        assert_rel(out[4], want["dBgu"])
        assert_rel(out[5], want["dBd"])


def test_reference_other_alpha_and_offset_equals_autograd():
    """Not only GPT_OSS's constants: any alpha > 0 and offset go through the same formula."""
    act = Activation("custom", alpha=0.37, up_offset=-2.5)
    d, plan = make_case(seed=6, bias=True)
    I = d["wgu"].shape[3]
    _, saved, want = autograd_grads(d, plan, OSS_CLAMP, act)
    problem = MoEBackwardProblem(
        d["x"], d["dy"], d["wgu"], d["wd"], plan, pair_checkpoint(plan, saved, I),
        b_gate_up_E2I=d["bgu"], b_down_EH=d["bd"], clamp_limits=OSS_CLAMP, activation=act,
    )
    grads = reference_backward(problem)
    assert_rel(grads.hidden_states_grad_TH, want["dX"])
    assert_rel(grads.affinity_grad_TE, want["dA"])
    assert_rel(grads.w_gate_up_grad_EH2I, want["dWgu"])
    assert_rel(grads.b_gate_up_grad_E2I, want["dBgu"])


def _bf16_problem(activation, *, bias, clamp, T=40, H=64, I=32, E=4, K=2, seed=0):
    return make_problem(T, H, I, E, K, seed=seed, bias=bias, clamp_limits=clamp,
                        activation=activation)


@pytest.mark.parametrize(
    "bias,clamp,shape",
    [(False, None, (40, 64, 32, 4, 2)), (True, OSS_CLAMP, (40, 64, 32, 4, 2)),
     (True, OSS_CLAMP, (20, 12, 10, 3, 2))],
    ids=["plain", "bias_clamp", "loop_shapes"],
)
def test_torch_backend_gpt_oss_vs_reference(bias, clamp, shape):
    T, H, I, E, K = shape
    problem = _bf16_problem(GPT_OSS, bias=bias, clamp=clamp, T=T, H=H, I=I, E=E, K=K)
    assert problem.activation == GPT_OSS
    grads = moe_backward_torch(problem)
    ref = reference_backward(problem)
    assert list(grads.named()) == list(ref.named())
    for k, want in ref.named().items():
        out = grads.named()[k]
        assert out.dtype == torch.float32 and bool(torch.isfinite(out).all()), k
        s = sqnr_db(out, want)
        assert s >= SQNR_MIN, f"{k}: SQNR {s:.1f} dB < {SQNR_MIN} dB"
    # the activation is not ignored: SwiGLU's gradients of the same inputs are far off
    swiglu_ref = reference_backward(dataclasses.replace(problem, activation=SWIGLU))
    assert sqnr_db(swiglu_ref.hidden_states_grad_TH, ref.hidden_states_grad_TH) < 10.0


def test_torch_forward_gpt_oss_vs_reference():
    p = _bf16_problem(GPT_OSS, bias=True, clamp=OSS_CLAMP)
    kw = {"b_gate_up_E2I": p.b_gate_up_E2I, "b_down_EH": p.b_down_EH,
          "clamp_limits": p.clamp_limits, "activation": GPT_OSS}
    y32, act32 = moe_forward_torch(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan,
                                   compute_dtype=torch.float32, **kw)
    y_ref, act_ref = reference_forward(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan,
                                       **kw)
    assert sqnr_db(y32, y_ref) >= 100.0  # fp32 throughout
    assert sqnr_db(act32, act_ref) >= 100.0
    # BF16 forward as training runs it
    y16, act16 = moe_forward_torch(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan, **kw)
    assert sqnr_db(y16, y_ref) >= SQNR_MIN
    # the checkpoint holds pre-activations: the activation does not change it
    assert torch.equal(act16, p.act_checkpoint_R2I)
    y_sw, _ = moe_forward_torch(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan,
                                **{**kw, "activation": None})
    assert sqnr_db(y_sw, y_ref) < 10.0


def test_swiglu_default_and_named_give_identical_results():
    """None, SWIGLU and an equal Activation give bit-identical SwiGLU results everywhere."""
    p = _bf16_problem(None, bias=True, clamp=OSS_CLAMP)
    assert p.activation == SWIGLU and p.activation.is_swiglu
    named = dataclasses.replace(p, activation=Activation("swiglu", alpha=1.0, up_offset=0.0))
    for fn in (moe_backward_torch, reference_backward):
        a, b = fn(p).named(), fn(named).named()
        assert all(torch.equal(a[k], b[k]) for k in a)
    kw = {"b_gate_up_E2I": p.b_gate_up_E2I, "b_down_EH": p.b_down_EH,
          "clamp_limits": p.clamp_limits}
    args = (p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan)
    for fwd in (moe_forward_torch, reference_forward):
        y0, a0 = fwd(*args, **kw)
        y1, a1 = fwd(*args, **kw, activation=SWIGLU)
        assert torch.equal(y0, y1) and torch.equal(a0, a1)
    # and the SwiGLU reference still is silu(g) * u: GPT_OSS with alpha 1, offset 0 is SwiGLU
    as_oss = dataclasses.replace(p, activation=Activation("gpt_oss", alpha=1.0, up_offset=0.0))
    a, b = reference_backward(p).named(), reference_backward(as_oss).named()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_make_problem_for_model_carries_the_activation():
    oss = load_model("gpt-oss-20b").shrink(24)
    p = make_problem_for_model(oss, 8, seed=1)
    assert p.activation == GPT_OSS
    assert p.activation == Activation("gpt_oss", alpha=oss.swiglu_alpha, up_offset=1.0)
    assert p.clamp_limits == ClampLimits(**oss.clamp_limits)
    assert p.has_bias
    qwen = make_problem_for_model(load_model("qwen3-30b-a3b").shrink(16), 8, seed=1)
    assert qwen.activation == SWIGLU
    # make_problem passes the activation through and leaves the seeded tensors unchanged
    a = make_problem(8, 16, 8, 3, 2, seed=5, activation=GPT_OSS)
    b = make_problem(8, 16, 8, 3, 2, seed=5)
    assert a.activation == GPT_OSS and b.activation == SWIGLU
    assert torch.equal(a.act_checkpoint_R2I, b.act_checkpoint_R2I)


@pytest.mark.parametrize("backend", ["nki", "nki-sim"])
def test_nki_backends_reject_non_swiglu(monkeypatch, backend):
    import nki_kernels.backend as nb

    # "nki" needs the Neuron SDK: pretend it imports; the activation check comes first anyway.
    monkeypatch.setattr(nb, "check_nki", lambda: None)
    monkeypatch.setattr(nb, "check_nki_sim", lambda: None)
    p = make_problem(8, 16, 8, 2, 1, seed=0, activation=GPT_OSS)
    run = registered_backends()[backend].run
    with pytest.raises(ValueError, match="activation") as info:
        run(p)
    assert "gpt_oss" in str(info.value) and "SwiGLU" in str(info.value)
    with pytest.raises(ValueError, match="activation"):
        nb.prepare_blockwise_args(p)


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": 0.0}, {"alpha": -1.0}, {"alpha": NAN}, {"alpha": math.inf}, {"alpha": "1"},
     {"up_offset": NAN}, {"up_offset": -math.inf}, {"name": 3}, {"name": ""}],
    ids=lambda kw: repr(kw),
)
def test_activation_validation(kwargs):
    with pytest.raises(ValueError, match="Activation"):
        Activation(**kwargs)


def test_non_activation_arguments_raise():
    p = make_problem(8, 16, 8, 2, 1, seed=0)
    bad = dataclasses.replace(p, activation="gpt_oss")
    for fn in (bad.validate, lambda: reference_backward(bad), lambda: moe_backward_torch(bad)):
        with pytest.raises(ValueError, match="activation"):
            fn()
    args = (p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan)
    for fwd in (moe_forward_torch, reference_forward):
        with pytest.raises(ValueError, match="activation"):
            fwd(*args, activation="gpt_oss")
    with pytest.raises(ValueError, match="activation"):
        make_problem(8, 16, 8, 2, 1, activation=1.702)


def test_cli_prints_the_activation(capsys, monkeypatch):
    monkeypatch.setattr(
        cli, "load_model", lambda name: load_model(name).scaled(hidden=64, intermediate=64)
    )
    assert cli.main(["run", "--model", "gpt-oss-20b", "--tokens", "16", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "activation: gpt_oss" in out and "1.702" in out
    assert cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "8", "--device", "cpu"]) == 0
    assert "activation: swiglu" in capsys.readouterr().out
    rc = cli.main(["run", "--model", "gpt-oss-20b", "--tokens", "8", "--device", "cpu",
                   "--backend", "nki-sim"])
    err = capsys.readouterr().err  # errors go to stderr
    assert rc == 2 and "activation 'gpt_oss'" in err
