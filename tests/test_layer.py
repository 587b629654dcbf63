"""Tests of the training layer (common/layer.py): MoEExperts / MoEExpertsFunction, the Megatron
main_grad path, the torchtitan adapter, and double-backward refusal of every autograd Function of
the package (plus the grouped-wgrad torch.library op, which has no autograd formula).

Everything runs on the CPU with tiny shapes. The layer computes with BF16 GEMM operands, so it is
compared by SQNR against float64 twins: ``common.reference.reference_backward`` and torch autograd
of an independent float64 forward written here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common import dispatch
from common.layer import (
    MoEExperts,
    MoEExpertsFunction,
    MoEExpertsOptions,
    down_from_torchtitan,
    gate_up_from_torchtitan,
    moe_experts,
    run_experts_grouped_mm,
)
from common.metrics import SQNR_MIN_DB, sqnr_db
from common.models import load_model
from common.problem import GPT_OSS, SWIGLU, Activation, ClampLimits, MoEBackwardProblem
from common.reference import reference_backward, reference_forward
from common.routing import plan_routing

SQNR_MIN = SQNR_MIN_DB[("torch", "default")]
T, H, I, E, K = 8, 32, 16, 4, 2
# Every routing feature: dropped slots, a duplicate expert (token 2), an unused expert (3).
EXPERT_INDEX_TK = torch.tensor(
    [[0, 1], [2, -1], [1, 1], [0, 2], [2, 0], [1, 2], [-1, 0], [2, 1]]
)
# Limits exact in BF16 and inside the range of the pre-activations (~N(0, 1)), so they bite.
# The layer's checkpoint is BF16: a pre-activation just inside a limit that rounds ONTO it is
# masked as clamped (its gradient dropped), while the float64 twins pass it. At these tiny shapes
# no element lands there; at T=512, H=256 about 0.05 % do, which costs ~25 dB against the float64
# checkpoint (measured 2026-12-01, CPU torch and H200 cuda-sm90 alike; 49 dB against the layer's
# own BF16 checkpoint).
CLAMP = ClampLimits(
    linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0, non_linear_clamp_upper_limit=1.0
)


def _leaves(seed: int, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = {
        "x": torch.randn(T, H, generator=g),
        "aff": torch.rand(T, K, generator=g) + 0.1,
        "wgu": torch.randn(E, H, 2, I, generator=g) * H**-0.5,
        "wd": torch.randn(E, I, H, generator=g) * I**-0.5,
        "dy": torch.randn(T, H, generator=g),
    }
    if bias:
        out["bgu"] = 0.2 * torch.randn(E, 2, I, generator=g)
        out["bd"] = 0.2 * torch.randn(E, H, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


def _f64_forward(x, idx, aff, wgu, wd, bgu, bd, clamp, act: Activation):
    """An independent float64 forward (per slot, differentiable by torch autograd)."""
    y = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        e = idx[:, k]
        live = (e >= 0)[:, None]
        ec = e.clamp(min=0)
        gu = torch.einsum("th,thci->tci", x, wgu[ec])
        if bgu is not None:
            gu = gu + bgu[ec]
        g, u = gu[:, 0], gu[:, 1]
        if clamp is not None:
            g = g.clamp(clamp.non_linear_clamp_lower_limit, clamp.non_linear_clamp_upper_limit)
            u = u.clamp(clamp.linear_clamp_lower_limit, clamp.linear_clamp_upper_limit)
        h = g * torch.sigmoid(act.alpha * g) * (u + act.up_offset)
        out = torch.einsum("ti,tih->th", h, wd[ec])
        if bd is not None:
            out = out + bd[ec]
        y = y + torch.where(live, aff[:, k : k + 1] * out, torch.zeros((), dtype=x.dtype))
    return y


def _assert_sqnr(out: torch.Tensor, ref: torch.Tensor, name: str, floor: float = SQNR_MIN):
    s = sqnr_db(out.double(), ref.double())
    assert s >= floor, f"{name}: SQNR {s:.1f} dB < {floor}"


# --------------------------------------------------------------------------- layer vs float64
@pytest.mark.parametrize(
    "activation, clamp, bias",
    [(SWIGLU, None, False), (GPT_OSS, CLAMP, True)],
    ids=["swiglu", "gpt_oss_clamp_bias"],
)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_layer_grads_match_reference_and_float64_autograd(activation, clamp, bias, backend):
    d = _leaves(1, bias)
    m = MoEExperts(
        E, H, I, bias=bias, clamp_limits=clamp, activation=activation, backend=backend,
        dtype=torch.float32,
    )
    with torch.no_grad():
        m.w_gate_up.copy_(d["wgu"])
        m.w_down.copy_(d["wd"])
        if bias:
            m.b_gate_up.copy_(d["bgu"])
            m.b_down.copy_(d["bd"])
    x = d["x"].clone().requires_grad_()
    aff = d["aff"].clone().requires_grad_()
    y = m(x, EXPERT_INDEX_TK, aff)
    assert y.dtype == torch.float32 and y.shape == (T, H)
    (y * d["dy"]).sum().backward()
    ours = {"dX": x.grad, "dA": aff.grad, "dWgu": m.w_gate_up.grad, "dWd": m.w_down.grad}
    if bias:
        ours.update(dBgu=m.b_gate_up.grad, dBd=m.b_down.grad)

    # (a) the float64 reference backward of the equivalent problem
    f64 = {k: v.double() for k, v in d.items()}
    plan = plan_routing(EXPERT_INDEX_TK, f64["aff"], E)
    y_ref, act = reference_forward(
        f64["x"], f64["wgu"], f64["wd"], plan, b_gate_up_E2I=f64.get("bgu"),
        b_down_EH=f64.get("bd"), clamp_limits=clamp, activation=activation,
    )
    _assert_sqnr(y, y_ref, "y vs reference_forward")
    ref = reference_backward(
        MoEBackwardProblem(
            f64["x"], f64["dy"], f64["wgu"], f64["wd"], plan, act, f64.get("bgu"),
            f64.get("bd"), clamp, activation,
        )
    )
    want = {
        "dX": ref.hidden_states_grad_TH,
        "dA": plan.slot_affinity_grad(ref.affinity_grad_TE),
        "dWgu": ref.w_gate_up_grad_EH2I,
        "dWd": ref.w_down_grad_EIH,
    }
    if bias:
        want.update(dBgu=ref.b_gate_up_grad_E2I, dBd=ref.b_down_grad_EH)
    for name in want:
        _assert_sqnr(ours[name], want[name], f"{name} vs reference_backward")

    # (b) torch autograd of an independent float64 forward
    leaves = {k: v.clone().requires_grad_() for k, v in f64.items() if k != "dy"}
    y64 = _f64_forward(
        leaves["x"], EXPERT_INDEX_TK, leaves["aff"], leaves["wgu"], leaves["wd"],
        leaves.get("bgu"), leaves.get("bd"), clamp, activation,
    )
    torch.testing.assert_close(y64, y_ref)  # the two float64 forwards agree
    (y64 * f64["dy"]).sum().backward()
    names = {"dX": "x", "dA": "aff", "dWgu": "wgu", "dWd": "wd", "dBgu": "bgu", "dBd": "bd"}
    for name in ours:
        _assert_sqnr(ours[name], leaves[names[name]].grad, f"{name} vs float64 autograd")

    # routing edge cases: dropped slots get 0, duplicate slots share the merged gradient
    dropped = EXPERT_INDEX_TK < 0
    assert torch.all(aff.grad[dropped] == 0)
    assert aff.grad[2, 0] == aff.grad[2, 1]
    assert torch.count_nonzero(m.w_gate_up.grad[3]) == 0  # expert 3 gets no token


def test_bf16_module_grads_keep_param_dtypes_and_affinity_without_grad():
    d = _leaves(2, bias=True)
    torch.manual_seed(0)
    m = MoEExperts(E, H, I, bias=True)
    assert m.w_gate_up.dtype == torch.bfloat16
    x = d["x"].bfloat16().requires_grad_()
    aff = d["aff"]  # no requires_grad: the Function returns None for it
    y = m(x, EXPERT_INDEX_TK, aff)
    assert y.dtype == torch.bfloat16
    (y.float() * d["dy"]).sum().backward()
    assert aff.grad is None
    assert x.grad.dtype == torch.bfloat16
    for p in m.parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16

    # the same grads as the functional form with an fp32 affinity that does require grad
    aff2 = aff.clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y2 = moe_experts(x2, EXPERT_INDEX_TK, aff2, m.w_gate_up, m.w_down, m.b_gate_up, m.b_down,
                     options=m.options)
    torch.testing.assert_close(y2, y)
    (y2.float() * d["dy"]).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    assert aff2.grad.dtype == torch.float32 and torch.all(aff2.grad[EXPERT_INDEX_TK < 0] == 0)


def test_all_dropped_and_zero_tokens():
    m = MoEExperts(E, H, I, dtype=torch.float32)
    x = torch.randn(3, H, requires_grad=True)
    y = m(x, torch.full((3, K), -1), torch.rand(3, K))
    assert torch.count_nonzero(y) == 0
    y.sum().backward()
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(m.w_down.grad) == 0
    x0 = torch.zeros(0, H, requires_grad=True)
    y0 = m(x0, torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K))
    y0.sum().backward()
    assert y0.shape == (0, H) and x0.grad.shape == (0, H)


def test_backward_gets_no_zero_filled_grads_for_the_saved_outputs():
    """The custom op's outputs besides y (the [R, 2, I] checkpoint, the kept rows, the routing
    tables) are non-differentiable: autograd must not zero-fill a gradient for each of them
    per step (on the H200 that fill was 0.28 ms of an 8 ms qwen3-30b-a3b step)."""
    from torch.profiler import ProfilerActivity, profile

    T_, K_, I_ = 37, 3, 256
    torch.manual_seed(5)
    m = MoEExperts(E, H, I_)
    assert m.options.uses_custom_op
    x = torch.randn(T_, H, dtype=torch.bfloat16, requires_grad=True)
    y = m(x, torch.randint(0, E, (T_, K_)), torch.rand(T_, K_))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y.backward(torch.randn_like(y))
    act_shapes = ([T_ * K_, 2, I_], [T_ * K_, 2 * I_])
    fills = [e.input_shapes for e in prof.events()
             if e.name in ("aten::zero_", "aten::fill_", "aten::zeros", "aten::zeros_like")
             and e.input_shapes and e.input_shapes[0] in act_shapes]
    assert not fills, fills
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


# ------------------------------------------------------------------------------ main_grad
def _main_grad_module(dtype, device="cpu"):
    torch.manual_seed(3)
    m = MoEExperts(E, H, I, accumulate_main_grad=True, dtype=dtype).to(device)
    for p in (m.w_gate_up, m.w_down):
        p.main_grad = torch.full(p.shape, 256.0, device=device)
    return m


def _grads_without_main_grad(m: MoEExperts, x, aff, dy):
    """The fp32 weight grads of the same call, without main_grad (fp32 copies of the weights)."""
    dev = m.w_gate_up.device
    ref = MoEExperts(E, H, I, dtype=torch.float32, backend=m.options.backend).to(dev)
    with torch.no_grad():
        ref.w_gate_up.copy_(m.w_gate_up.float())
        ref.w_down.copy_(m.w_down.float())
    (ref(x, EXPERT_INDEX_TK.to(dev), aff).float() * dy).sum().backward()
    return ref.w_gate_up.grad, ref.w_down.grad


def test_main_grad_accumulates_in_fp32_and_returns_none():
    # 256 + 1 must give 257: a BF16 round trip of the sum would give 256.
    assert torch.tensor(256.0, dtype=torch.bfloat16) + 1 == 256
    m = _main_grad_module(torch.bfloat16)
    d = _leaves(4, bias=False)
    x = d["x"].bfloat16()
    dy = 8.0 * d["dy"]  # gradient cells of order 1
    for _ in range(2):
        y = m(x, EXPERT_INDEX_TK, d["aff"])
        (y.float() * dy).sum().backward()
    assert m.w_gate_up.grad is None and m.w_down.grad is None  # added to main_grad instead
    g_gu, g_d = _grads_without_main_grad(m, x.float(), d["aff"], dy)
    for mg, g in ((m.w_gate_up.main_grad, g_gu), (m.w_down.main_grad, g_d)):
        assert mg.dtype == torch.float32
        torch.testing.assert_close(mg, 256.0 + g + g, rtol=0, atol=1e-4)
        # cells that BF16 accumulation would have lost (|2g| < 1 next to 256) did move
        lost = (256.0 + 2 * g).bfloat16().float() != 256.0 + 2 * g
        assert bool(lost.any()) and torch.all((mg - 256.0)[lost] != 0)


def test_main_grad_missing_on_a_weight_is_an_error_not_a_silent_fallback():
    m = MoEExperts(E, H, I, accumulate_main_grad=True, dtype=torch.float32)
    m.w_gate_up.main_grad = torch.zeros(m.w_gate_up.shape)  # only one weight has one
    d = _leaves(5, bias=False)
    with pytest.raises(RuntimeError, match="w_down_EIH has no main_grad"):
        (m(d["x"], EXPERT_INDEX_TK, d["aff"]) * d["dy"]).sum().backward()
    assert torch.count_nonzero(m.w_gate_up.main_grad) == 0
    assert m.w_gate_up.grad is None and m.w_down.grad is None


def test_main_grad_through_the_cuda_backend_entry(monkeypatch):
    """The cuda-sm90 branch (grad_dtype, accumulate_into) with the fused backward standing in
    for the GPU backend: on the GPU when there is one, else its CPU run (Triton interpreter)."""
    fused = pytest.importorskip("cuda_kernels.moe.backward")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dispatch.registered_backends()
    calls = []

    def run(problem, **options):
        calls.append(sorted(options))
        return fused.moe_backward_fused(problem, **options)

    # the real declaration (options, layer_state), without its forward: the portable one runs
    fake = dataclasses.replace(dispatch.registered_backends()["cuda-sm90"], check=lambda: None,
                               run=run, forward=None)
    monkeypatch.setitem(dispatch._REGISTRY, "cuda-sm90", fake)
    d = {k: v.to(dev) for k, v in _leaves(6, bias=True).items()}
    idx = EXPERT_INDEX_TK.to(dev)
    dy = 8.0 * d["dy"]

    m = _main_grad_module(torch.bfloat16, dev)
    m.options = MoEExpertsOptions(backend="cuda-sm90", accumulate_main_grad=True)
    (m(d["x"].bfloat16(), idx, d["aff"]).float() * dy).sum().backward()
    assert calls[-1] == ["accumulate_into", "grad_dtype", "grouped_mm", "layout", "x_rows_S"]
    assert m.w_gate_up.grad is None
    g_gu, g_d = _grads_without_main_grad(m, d["x"], d["aff"], dy)
    _assert_sqnr(m.w_gate_up.main_grad - 256.0, g_gu, "fused main_grad dWgu")
    _assert_sqnr(m.w_down.main_grad - 256.0, g_d, "fused main_grad dWd")

    # without main_grad: grads written directly in the parameters' BF16, biases included
    m2 = MoEExperts(E, H, I, bias=True, backend="cuda-sm90", device=dev)
    x = d["x"].bfloat16().requires_grad_()
    (m2(x, idx, d["aff"]).float() * dy).sum().backward()
    assert calls[-1] == ["grad_dtype", "grouped_mm", "layout", "x_rows_S"]
    assert x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.bfloat16 for p in m2.parameters())


# ------------------------------------------------------------------------------ module API
def test_module_init_repr_reset_and_from_model():
    torch.manual_seed(0)
    a = MoEExperts(E, H, I, bias=True, dtype=torch.float32)
    torch.manual_seed(0)
    b = MoEExperts(E, H, I, bias=True, dtype=torch.float32)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert [n for n, _ in a.named_parameters()] == ["w_gate_up", "w_down", "b_gate_up", "b_down"]
    assert torch.count_nonzero(a.b_down) == 0
    big = MoEExperts(8, 256, 128, dtype=torch.float32)
    assert abs(big.w_gate_up.std().item() - 256**-0.5) < 0.05 * 256**-0.5
    assert abs(big.w_down.std().item() - 128**-0.5) < 0.05 * 128**-0.5
    gen = torch.Generator().manual_seed(7)
    a.reset_parameters(generator=gen)
    b.reset_parameters(generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.w_down, b.w_down)
    assert "num_experts=4" in repr(a) and "bias=True" in repr(a) and "swiglu" in repr(a)
    assert [n for n, _ in MoEExperts(E, H, I).named_parameters()] == ["w_gate_up", "w_down"]

    oss = MoEExperts.from_model(load_model("gpt-oss-120b"), device="meta")
    assert oss.w_gate_up.shape == (128, 2880, 2, 2880) and oss.bias
    assert oss.options.activation == Activation("gpt_oss", alpha=1.702, up_offset=1.0)
    assert oss.options.clamp_limits == ClampLimits(
        linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
        non_linear_clamp_upper_limit=7.0,
    )
    assert "gpt_oss" in repr(oss) and "clamp_limits=(gate<=7.0, -7.0<=up<=7.0)" in repr(oss)
    qwen = MoEExperts.from_model(load_model("qwen3-30b-a3b").shrink(8), backend="torch")
    assert qwen.options.activation == SWIGLU and qwen.options.clamp_limits is None
    assert not qwen.bias and qwen.w_down.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="affinity_on"):
        MoEExperts.from_model(load_model("llama-4-scout"), device="meta")
    with pytest.raises(ValueError, match="model_shape"):
        MoEExperts.from_model("gpt-oss-20b")


# ---------------------------------------------------------------------------------- bad input
def _call(**over):
    d = _leaves(8, bias=True)
    args = {
        "hidden_states_TH": d["x"],
        "expert_index_TK": EXPERT_INDEX_TK,
        "affinity_TK": d["aff"],
        "w_gate_up_EH2I": d["wgu"],
        "w_down_EIH": d["wd"],
        "b_gate_up_E2I": d["bgu"],
        "b_down_EH": d["bd"],
    }
    options = over.pop("options", MoEExpertsOptions(backend="torch"))
    args.update(over)
    return moe_experts(**args, options=options)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"hidden_states_TH": torch.zeros(T)}, "hidden_states_TH"),
        ({"hidden_states_TH": torch.zeros(T, H, dtype=torch.long)}, "hidden_states_TH"),
        ({"w_gate_up_EH2I": torch.zeros(E, H + 1, 2, I)}, "w_gate_up_EH2I"),
        ({"w_down_EIH": torch.zeros(E, H, I)}, "w_down_EIH"),
        ({"b_gate_up_E2I": torch.zeros(E, I)}, "b_gate_up_E2I"),
        ({"b_down_EH": torch.zeros(E + 1, H)}, "b_down_EH"),
        ({"affinity_TK": torch.zeros(T, K + 1)}, "affinity_TK"),
        ({"affinity_TK": torch.zeros(T, K, dtype=torch.long)}, "affinity_TK"),
        ({"expert_index_TK": EXPERT_INDEX_TK.float()}, "expert_index_TK"),
        ({"expert_index_TK": EXPERT_INDEX_TK[:-1]}, "expert_index_TK"),
        ({"expert_index_TK": EXPERT_INDEX_TK + 2}, r"expert_index_TK values .*\[-1, num_experts"),
        ({"expert_index_TK": EXPERT_INDEX_TK - 1}, "expert_index_TK values"),
        ({"affinity_TK": torch.full((T, K), float("nan"))}, "affinity_TK must be finite"),
        ({"w_down_EIH": torch.zeros(E, I, H, device="meta")}, "w_down_EIH is on device meta"),
        ({"options": {"backend": "torch"}}, "options must be a MoEExpertsOptions"),
    ],
)
def test_bad_input_names_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_bad_options_and_module_args():
    with pytest.raises(ValueError, match="clamp_limits"):
        MoEExpertsOptions(clamp_limits={"linear_clamp_upper_limit": 1.0})
    with pytest.raises(ValueError, match="activation"):
        MoEExpertsOptions(activation="gpt_oss")
    with pytest.raises(ValueError, match="validate_routing"):
        MoEExpertsOptions(validate_routing=1)
    with pytest.raises(ValueError, match="validate_routing"):
        MoEExpertsOptions(validate_routing="always")
    assert MoEExpertsOptions(validate_routing=True).validate_routing == "host"
    assert MoEExpertsOptions(validate_routing=False).validate_routing == "off"
    with pytest.raises(ValueError, match="backend"):
        MoEExpertsOptions(backend="")
    with pytest.raises(ValueError, match="num_experts"):
        MoEExperts(0, H, I)
    with pytest.raises(ValueError, match="intermediate"):
        MoEExperts(E, H, 2.5)
    with pytest.raises(ValueError, match="dtype"):
        MoEExperts(E, H, I, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend 'nope'"):
        _call(options=MoEExpertsOptions(backend="nope"))
    # skipping validation is allowed (CUDA-graph capture): good routing still works
    _call(options=MoEExpertsOptions(backend="torch", validate_routing=False))
    for bad in ({"block_size": 128}, (("block_size",),), ((1, 2),)):
        with pytest.raises(ValueError, match="backend_options"):
            MoEExpertsOptions(backend_options=bad)


def test_backend_options_reach_the_backend(monkeypatch):
    """``backend_options`` go to the backend's run in backward, as keyword arguments."""
    import common.layer_ops as layer_mod
    from common import dispatch

    d = _leaves(12, bias=False)
    seen = []
    real = dispatch.resolve_backend("torch", "cpu")

    def run(problem, **options):
        seen.append(options)
        return real.run(problem)

    monkeypatch.setattr(layer_mod, "resolve_backend",
                        lambda name, device: dataclasses.replace(real, run=run))
    opts = MoEExpertsOptions(backend="torch", backend_options=(("block_size", 256),))
    x = d["x"].clone().requires_grad_()
    moe_experts(x, EXPERT_INDEX_TK, d["aff"], d["wgu"], d["wd"], options=opts).sum().backward()
    assert seen == [{"block_size": 256}] and x.grad is not None


def test_the_forward_resolves_the_backend_once(monkeypatch):
    """One forward asks :func:`common.dispatch.resolve_backend` once (each call asks the device
    and the backend's checks: host time on every step), however many of its answers it uses
    (the forward, ``keeps_x_rows``, the checkpoint-shape check); the backward once more."""
    import common.layer_ops as layer_mod

    d = _leaves(13, bias=False)
    calls = []
    real = layer_mod.resolve_backend

    def counting(name, device):
        calls.append(name)
        return real(name, device)

    monkeypatch.setattr(layer_mod, "resolve_backend", counting)
    x = d["x"].clone().requires_grad_()
    y = moe_experts(x, EXPERT_INDEX_TK, d["aff"], d["wgu"], d["wd"],
                    options=MoEExpertsOptions(backend="torch"))
    assert calls == ["torch"]
    y.sum().backward()
    assert calls == ["torch", "torch"] and x.grad is not None


# --------------------------------------------------------------------------------- torchtitan
def _torchtitan_formula(w1, w2, w3, x, counts):
    """torchtitan's GroupedExperts math, per expert in plain torch (rows in expert order,
    trailing padding rows give 0), at the inputs' precision."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        h = torch.nn.functional.silu(xe @ w1[e].transpose(0, 1)) * (xe @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
        start += n
    outs.append(x.new_zeros(x.shape[0] - start, x.shape[1]))
    return torch.cat(outs)


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_torchtitan_weight_views_share_storage_when_possible():
    g = torch.Generator().manual_seed(9)
    W = torch.randn(E, 2 * I, H, generator=g)
    w1, w3 = W[:, :I], W[:, I:]
    want = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2)
    v = gate_up_from_torchtitan(w1, w3)
    assert v.shape == (E, H, 2, I) and _same_storage(v, W) and torch.equal(v, want)
    # gpt-oss style interleaved rows of one tensor: also a view
    vi = gate_up_from_torchtitan(W[:, 0::2], W[:, 1::2])
    assert _same_storage(vi, W)
    assert torch.equal(vi[:, :, 0], W[:, 0::2].transpose(1, 2))
    # torchtitan's separate parameters, or w3 before w1 in memory: a contiguous copy
    c = gate_up_from_torchtitan(w1.clone(), w3.clone())
    assert not _same_storage(c, W) and torch.equal(c, want)
    assert c.permute(0, 2, 3, 1).is_contiguous()  # torchtitan's [E, 2I, H] memory, no transpose
    assert not _same_storage(gate_up_from_torchtitan(w3, w1), W)
    assert not _same_storage(gate_up_from_torchtitan(w1, w1), W)  # the same tensor twice
    w2 = torch.randn(E, H, I, generator=g)
    d = down_from_torchtitan(w2)
    assert d.shape == (E, I, H) and _same_storage(d, w2) and torch.equal(d[1], w2[1].T)

    # under autograd: a view of the base when w1/w3 are differentiable views of one leaf ...
    Wl = W.clone().requires_grad_()
    vl = gate_up_from_torchtitan(Wl[:, :I], Wl[:, I:])
    assert _same_storage(vl, Wl)
    (vl * want).sum().backward()
    torch.testing.assert_close(Wl.grad, W)  # each cell of W sits once in the view
    # ... and a differentiable copy for two leaves that happen to share a storage
    a = W[:, :I].detach().requires_grad_()
    b = W[:, I:].detach().requires_grad_()
    cl = gate_up_from_torchtitan(a, b)
    assert not _same_storage(cl, W)
    cl.sum().backward()
    assert torch.equal(a.grad, torch.ones_like(a)) and torch.equal(b.grad, torch.ones_like(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fused_w13", [False, True], ids=["separate_w1_w3", "halves_of_one"])
def test_run_experts_grouped_mm_matches_torchtitan_formula(dtype, fused_w13):
    g = torch.Generator().manual_seed(10)
    counts = torch.tensor([3, 0, 5, 2])  # an empty expert
    rows = int(counts.sum()) + 3  # three trailing padding rows
    x0 = torch.randn(rows, H, generator=g, dtype=dtype)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=dtype) * H**-0.5
    w20 = torch.randn(E, H, I, generator=g, dtype=dtype) * I**-0.5
    dy = torch.randn(rows, H, generator=g, dtype=dtype)

    def leaves():
        x, w2 = x0.clone().requires_grad_(), w20.clone().requires_grad_()
        if fused_w13:
            W = w13.clone().requires_grad_()
            return x, W[:, :I], w2, W[:, I:], [x, W, w2]
        w1 = w13[:, :I].clone().requires_grad_()
        w3 = w13[:, I:].clone().requires_grad_()
        return x, w1, w2, w3, [x, w1, w2, w3]

    x, w1, w2, w3, ours = leaves()
    y = run_experts_grouped_mm(w1, w2, w3, x, counts)
    assert y.dtype == dtype and y.shape == (rows, H)
    assert torch.count_nonzero(y[-3:]) == 0
    (y * dy).sum().backward()
    x, w1, w2, w3, theirs = leaves()
    y_ref = _torchtitan_formula(w1, w2, w3, x, counts)
    (y_ref * dy).sum().backward()
    _assert_sqnr(y, y_ref, "y")
    for name, a, b in zip(("x", "w1|W", "w2", "w3"), ours, theirs):
        assert a.grad is not None and a.grad.dtype == dtype, name
        _assert_sqnr(a.grad, b.grad, f"d{name}")
    # int32 counts (torchtitan's histc output is float-converted to int upstream) work too
    y32 = run_experts_grouped_mm(w1, w2, w3, x0, counts.to(torch.int32))
    torch.testing.assert_close(y32, y.detach())


@pytest.mark.parametrize(
    "over, match",
    [
        ({"w1": torch.zeros(E, I)}, "w1"),
        ({"w3": torch.zeros(E, I + 1, H)}, "w3"),
        ({"w2": torch.zeros(E, I, H)}, "w2"),
        ({"x": torch.zeros(4, H + 1)}, "x must"),
        ({"x": torch.zeros(4, H, dtype=torch.long)}, "x must be a floating"),
        ({"num_tokens_per_expert": torch.ones(E)}, "num_tokens_per_expert"),
        ({"num_tokens_per_expert": torch.ones(E + 1, dtype=torch.long)}, "num_tokens_per_expert"),
        ({"w2": torch.zeros(E, H, I, device="meta")}, "w2 is on device meta"),
    ],
)
def test_torchtitan_adapter_bad_input(over, match):
    args = {
        "w1": torch.zeros(E, I, H),
        "w2": torch.zeros(E, H, I),
        "w3": torch.zeros(E, I, H),
        "x": torch.zeros(4, H),
        "num_tokens_per_expert": torch.ones(E, dtype=torch.long),
    }
    args.update(over)
    with pytest.raises(ValueError, match=match):
        run_experts_grouped_mm(**args)
    with pytest.raises(ValueError, match="w2"):
        down_from_torchtitan(torch.zeros(E, H))


_ADAPTER_CRASH = """
import torch
from common.layer import run_experts_grouped_mm
E, I, H = 4, 16, 32
try:
    run_experts_grouped_mm(torch.zeros(E, I, H), torch.zeros(E, H, I), torch.zeros(E, I, H),
                           torch.zeros(8, H), torch.tensor([3, 3, 3, 3]))
except ValueError as exc:
    print("ValueError:", exc)
"""


def test_torchtitan_adapter_counts_beyond_rows_do_not_crash_the_process():
    """Counts summing past x's rows once made ``repeat_interleave`` write past its output
    (``free(): invalid next size``, the interpreter aborted): run in a subprocess so that a
    regression fails this test instead of killing the suite."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _ADAPTER_CRASH], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "ValueError: num_tokens_per_expert must sum to at most the rows of x (8)" in r.stdout
    assert "sum 12" in r.stdout


@pytest.mark.parametrize(
    "counts, match",
    [
        ([3, 3, 3, 3],
         r"num_tokens_per_expert must sum to at most the rows of x \(8\), got sum 12"),
        ([9, 0, 0, 0], r"num_tokens_per_expert must sum to at most the rows of x \(8\)"),
        ([2**62] * 4, rf"must sum to at most the rows of x \(8\), got a count of {2**62}"),
        ([-1, 2, 2, 2], r"num_tokens_per_expert must be >= 0 .*experts \[0\]"),
        ([2, -5, 9, 0], r"num_tokens_per_expert must be >= 0 .*experts \[1\]"),
    ],
)
def test_torchtitan_adapter_bad_counts_on_cpu(counts, match):
    w1, w3, w2 = torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I)
    with pytest.raises(ValueError, match=match):
        run_experts_grouped_mm(w1, w2, w3, torch.zeros(8, H), torch.tensor(counts))


@pytest.mark.parametrize(
    "counts, effective",
    [
        ([3, 3, 3, 3], [3, 3, 2, 0]),  # cut off at the rows of x
        ([-4, 2, 2, 2], [0, 2, 2, 2]),  # a negative count counts as 0
        ([2**62, -(2**62), 1, 1], [8, 0, 0, 0]),
        ([1, 1, 1, 1], [1, 1, 1, 1]),  # valid counts: unchanged, the rest is padding
    ],
)
def test_torchtitan_adapter_device_path_is_memory_safe(monkeypatch, counts, effective):
    """Where counts are not read back (a device), any counts give the result of the clamped
    counts and never an out-of-bounds write; exercised on the CPU with the host check off."""
    import common.layer as layer_mod

    monkeypatch.setattr(layer_mod, "_check_counts_on_host", lambda n, rows: None)
    g = torch.Generator().manual_seed(5)
    w1, w3 = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    w2, x = torch.randn(E, H, I, generator=g), torch.randn(8, H, generator=g)
    y = run_experts_grouped_mm(w1, w2, w3, x, torch.tensor(counts))
    want = run_experts_grouped_mm(w1, w2, w3, x, torch.tensor(effective))
    assert torch.equal(y, want)


def test_unknown_backend_refused_at_construction():
    for make in (lambda: MoEExpertsOptions(backend="bogus"),
                 lambda: MoEExperts(4, 64, 32, backend="bogus")):
        with pytest.raises(ValueError, match=r"backend 'bogus' is unknown.*'auto' or one of"):
            make()
    MoEExpertsOptions(backend="auto"), MoEExpertsOptions(backend="nki-twin")  # known names pass


def test_backend_registered_by_a_plugin_is_accepted(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    dispatch.register_backend(dataclasses.replace(dispatch.resolve_backend("torch"), name="mine"))
    assert MoEExpertsOptions(backend="mine").backend == "mine"


def test_backend_shape_check_runs_in_forward_without_cli_advice():
    """An NKI backend refuses H, I not multiples of 128 and gpt-oss's activation in forward
    (not first in backward), and the message speaks to a Python caller (no ``--shrink``)."""
    torch.manual_seed(0)
    m = MoEExperts(4, 64, 32, backend="nki-twin", dtype=torch.float32)
    x, idx, aff = torch.randn(8, 64), torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
    with pytest.raises(ValueError) as exc:
        m(x, idx, aff)
    msg = str(exc.value)
    assert "backend 'nki-twin'" in msg and "H=64 and I=32 must be multiples of 128" in msg
    assert "--shrink" not in msg
    gpt = MoEExperts.from_model(load_model("gpt-oss-20b").scaled(hidden=128, intermediate=128),
                                backend="nki-twin", dtype=torch.float32)
    x, idx = torch.randn(8, 128), torch.randint(0, gpt.num_experts, (8, 2))
    with pytest.raises(ValueError, match=r"backend 'nki-twin'.*activation 'gpt_oss'"):
        gpt(x, idx, aff)


# ------------------------------------------------------------------------ double backward
def _double_backward(loss, params):
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    total = sum(g.float().pow(2).sum() for g in grads if g is not None)
    total.backward()


def test_double_backward_is_refused_by_the_layer():
    m = MoEExperts(E, H, I, bias=True, dtype=torch.float32)
    d = _leaves(11, bias=False)
    x = d["x"].requires_grad_()
    aff = d["aff"].requires_grad_()
    y = m(x, EXPERT_INDEX_TK, aff)
    # y**2: the incoming gradient depends on the parameters, so a second order exists
    with pytest.raises(RuntimeError, match="first-order only"):
        _double_backward(y.pow(2).sum(), [x, aff, *m.parameters()])


def test_double_backward_is_refused_by_the_torchtitan_adapter():
    w1, w3 = torch.randn(E, I, H, requires_grad=True), torch.randn(E, I, H, requires_grad=True)
    w2 = torch.randn(E, H, I, requires_grad=True)
    x = torch.randn(6, H, requires_grad=True)
    y = run_experts_grouped_mm(w1, w2, w3, x, torch.tensor([2, 2, 0, 2]))
    with pytest.raises(RuntimeError, match="first-order only"):
        _double_backward(y.pow(2).sum(), [x, w1, w2, w3])


def test_double_backward_is_refused_through_nki_moe_expert_mlp():
    from common.nki_layer import moe_expert_mlp

    d = _leaves(12, bias=False)
    leaves = [d["x"], d["aff"], d["wgu"], d["wd"]]
    x, aff, wgu, wd = (t.clone().requires_grad_() for t in leaves)
    y = moe_expert_mlp(x, EXPERT_INDEX_TK, aff, wgu, wd, backend="reference")
    y.pow(2).sum().backward(retain_graph=True)  # first order works
    assert x.grad is not None and wgu.grad is not None
    with pytest.raises(RuntimeError, match="first-order only"):
        _double_backward(y.pow(2).sum(), [x, aff, wgu, wd])


def test_grouped_wgrad_op_has_no_autograd_formula():
    """``torch.ops.moe_bwd.grouped_wgrad`` registers no autograd: differentiating through it
    (first or second order) raises instead of returning a wrong gradient."""
    pytest.importorskip("cuda_kernels.grouped_wgrad.ops")
    a = torch.randn(8, 32, requires_grad=True)
    b = torch.randn(32, 4)
    out = torch.ops.moe_bwd.grouped_wgrad(a, b, torch.tensor([16, 32], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def test_function_apply_directly():
    """The Function itself validates and runs (no module needed)."""
    d = _leaves(13, bias=False)
    x = d["x"].requires_grad_()
    y = MoEExpertsFunction.apply(
        x, d["aff"], d["wgu"], d["wd"], None, None, EXPERT_INDEX_TK, MoEExpertsOptions()
    )
    y.sum().backward()
    assert x.grad.shape == (T, H)
    with pytest.raises(ValueError, match="options"):
        MoEExpertsFunction.apply(x, d["aff"], d["wgu"], d["wd"], None, None, EXPERT_INDEX_TK, None)


@pytest.mark.parametrize("loss", ["sum", "square"])
def test_create_graph_through_the_layer_raises_whatever_the_loss(loss):
    """once_differentiable alone lets create_graph=True through when the incoming gradient does
    not require grad (a linear loss): the gradient then silently has no graph (Hessian = 0)."""
    m = MoEExperts(2, 8, 4, dtype=torch.float32)
    x = torch.randn(2, 8, requires_grad=True)
    y = m(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    out = y.sum() if loss == "sum" else y.square().sum()
    with pytest.raises(RuntimeError, match="first-order only"):
        torch.autograd.grad(out, x, create_graph=True)
    g, = torch.autograd.grad(m(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)).sum(), x)
    assert g.shape == x.shape  # first order still works
