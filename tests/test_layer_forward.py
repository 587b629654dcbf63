"""The layer's training step beyond the backward (issue 20): the fused GPU forward's Triton kernels
against the portable forward (CPU: Triton's interpreter), the ``torch.library`` custom ops
(``opcheck``, ``torch.compile(fullgraph=True)`` with no recompile on new routing), and the
routing validation modes. GPU tests (``gpu``-marked, skipped without CUDA): the default layer
with no host synchronisation, CUDA-graph capture and replay with new routing bitwise equal to
eager, bitwise determinism, and the device-side routing assert (in a subprocess: a device assert
ends the CUDA context).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_torch_backward import routing  # the same seeded router as the twin's tests

from common import layer_ops
from common.layer import MoEExperts, MoEExpertsOptions, moe_experts
from common.metrics import sqnr_db
from common.problem import GPT_OSS, ClampLimits
from common.routing import ROUTING_ERRORS, plan_routing, routing_error_code
from common.torch_backward import grouped_layout, moe_layer_forward_torch

fwd = pytest.importorskip("cuda_kernels.moe.forward")
from cuda_kernels.triton.activation import activation_forward  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CLAMP = ClampLimits(
    linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0, non_linear_clamp_upper_limit=1.0
)
CASES = {
    # name: (T, H, I, E, K, routing kwargs, bias, clamp, activation)
    "plain": (40, 64, 32, 4, 2, {}, False, None, None),
    "duplicates_dropped_empty": (
        32, 32, 24, 6, 3, {"dup_token": 0, "drop_frac": 0.3, "empty": (1, 4)}, False, None, None
    ),
    "bias_clamp": (24, 64, 32, 4, 2, {"drop_frac": 0.1}, True, CLAMP, None),
    "gpt_oss": (24, 64, 48, 4, 2, {}, True, CLAMP, GPT_OSS),
    "one_token_top1": (1, 16, 8, 3, 1, {}, False, None, None),
}


def _inputs(name, seed=0, device=DEV):
    T, H, I, E, K, rkw, bias, clamp, act = CASES[name]
    ei, af = routing(T, K, E, seed + 3, **rkw)
    g = torch.Generator().manual_seed(seed)
    d = {
        "hidden_states_TH": torch.randn(T, H, generator=g).bfloat16(),
        "affinity_TK": af.float(),
        "expert_index_TK": ei,
        "w_gate_up_EH2I": (torch.randn(E, H, 2, I, generator=g) * H**-0.5).bfloat16(),
        "w_down_EIH": (torch.randn(E, I, H, generator=g) * I**-0.5).bfloat16(),
        "b_gate_up_E2I": 0.3 * torch.randn(E, 2, I, generator=g) if bias else None,
        "b_down_EH": 0.3 * torch.randn(E, H, generator=g) if bias else None,
    }
    d = {k: (v.to(device) if v is not None else None) for k, v in d.items()}
    return d, {"clamp_limits": clamp, "activation": act}


def _positional(d):
    return (d["hidden_states_TH"], d["affinity_TK"], d["expert_index_TK"], d["w_gate_up_EH2I"],
            d["w_down_EIH"], d["b_gate_up_E2I"], d["b_down_EH"])


# ------------------------------------------------------------------ fused forward vs its twin
@pytest.mark.parametrize("name", list(CASES))
def test_fused_forward_matches_the_portable_forward(name):
    """Same BF16 GEMM operands and fp32 epilogue math: on the CPU (interpreter; the GEMMs are
    torch's there) the checkpoint and X rows are bit-identical and y agrees to fp32 summation
    order (observed: identical). Without a gate/up bias and a clamp the fused forward keeps the
    GEMM's output rows [S, 2I] as the checkpoint (no pair-order copy): the same values."""
    d, kw = _inputs(name)
    want = moe_layer_forward_torch(*_positional(d), **kw)
    got = fwd.moe_forward_fused(*_positional(d), **kw)
    assert got.y_TH.dtype == d["hidden_states_TH"].dtype
    T, K = d["expert_index_TK"].shape
    I = d["w_down_EIH"].shape[1]
    rows = d["b_gate_up_E2I"] is None and kw["clamp_limits"] is None
    shape = (got.layout.tokens_sum, 2 * I) if rows else (T * K, 2, I)
    assert tuple(got.checkpoint.shape) == shape and got.checkpoint.dtype == torch.bfloat16
    assert torch.equal(got.checkpoint_pairs(), want.checkpoint)
    assert torch.equal(got.x_rows_S, want.x_rows_S)
    assert sqnr_db(got.y_TH.double(), want.y_TH.double()) >= 60
    for f in ("offsets_E", "row_to_token_S", "row_to_pair_S", "slot_to_row_TK"):
        assert torch.equal(getattr(got.layout, f), getattr(want.layout, f)), f


def _gate_up_rows():
    """``(E, plan, layout, gu [S, 2I] BF16 random)``: the gate/up GEMM's output rows of the
    duplicates / dropped / empty-expert case, for the activation pass alone."""
    d, _ = _inputs("duplicates_dropped_empty")
    E = d["w_gate_up_EH2I"].shape[0]
    plan = plan_routing(d["expert_index_TK"], d["affinity_TK"], E)
    layout = grouped_layout(plan, E)
    S, I = layout.tokens_sum, d["w_down_EIH"].shape[1]
    return E, plan, layout, torch.randn(S, 2 * I, device=DEV).bfloat16()


def test_activation_forward_writes_padding_zero_whatever_the_inputs():
    """NaN in the GEMM's padding rows never reaches a_h (padding rows exactly 0) and the
    checkpoint's slots past the real pairs are 0 (the kernel allocates with torch.empty)."""
    _, plan, layout, gu = _gate_up_rows()
    pad = layout.row_to_pair_S < 0
    gu[pad] = float("nan")
    for _ in range(2):  # the second run reuses freed (now non-zero) memory
        act, ah = activation_forward(gu, layout.row_to_pair_S, plan, activation=GPT_OSS,
                                     clamp_limits=CLAMP)
        assert bool(torch.isfinite(act).all()) and bool(torch.isfinite(ah).all())
        assert not bool(ah[pad].any())
        assert not bool(act[int(plan.num_pairs):].any())


def test_activation_forward_without_the_pair_checkpoint():
    """``pair_checkpoint=False`` (the caller keeps the GEMM's rows as the checkpoint) writes
    the same a*h and no act; refused with a gate/up bias or a clamp, before any output."""
    E, plan, layout, gu = _gate_up_rows()
    I = gu.shape[1] // 2
    kw = {"activation": GPT_OSS, "clamp_limits": ClampLimits()}
    act, want = activation_forward(gu, layout.row_to_pair_S, plan, **kw)
    none, got = activation_forward(gu, layout.row_to_pair_S, plan, pair_checkpoint=False, **kw)
    assert none is None and torch.equal(got, want)
    with pytest.raises(ValueError, match="pair_checkpoint=False.*clamp limits"):
        activation_forward(gu, layout.row_to_pair_S, plan, activation=GPT_OSS,
                           clamp_limits=CLAMP, pair_checkpoint=False)
    with pytest.raises(ValueError, match="pair_checkpoint=False.*gate/up bias"):
        activation_forward(gu, layout.row_to_pair_S, plan, pair_checkpoint=False,
                           b_gate_up_E2I=torch.zeros(E, 2, I, device=DEV), **kw)


# ------------------------------------------------------------------------------- custom ops
def _layer_args(bias: bool, seed: int, device="cpu", T=16, H=32, I=16, E=4, K=2):
    g = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(T, H, generator=g).requires_grad_(),
        (torch.rand(T, K, generator=g) + 0.1).requires_grad_(),
        (torch.randn(E, H, 2, I, generator=g) * H**-0.5).requires_grad_(),
        (torch.randn(E, I, H, generator=g) * I**-0.5).requires_grad_(),
        (0.2 * torch.randn(E, 2, I, generator=g)).requires_grad_() if bias else None,
        (0.2 * torch.randn(E, H, generator=g)).requires_grad_() if bias else None,
        torch.randint(-1, E, (T, K), generator=g),
    ]
    return [a.to(device) if a is not None else None for a in args]


def test_options_key_survives_pickle_and_copy():
    """The ops' options key is process-local: pickle and deepcopy rebuild it from the fields."""
    import copy
    import pickle

    o = MoEExpertsOptions(backend="torch", validate_routing="host", clamp_limits=CLAMP)
    for c in (pickle.loads(pickle.dumps(o)), copy.deepcopy(o)):
        assert c == o and c._op_key == o._op_key == layer_ops.options_key(o)
    layer = MoEExperts(2, 8, 4, dtype=torch.float32)
    assert pickle.loads(pickle.dumps(layer)).options._op_key == layer.options._op_key


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_experts_forward(bias):
    key = layer_ops.options_key(MoEExpertsOptions(backend="torch"))
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward, (*_layer_args(bias, 1), key))


def test_compile_fullgraph_no_recompile_on_new_routing():
    """A block holding the layer compiles as one graph; three routings, one compile; the
    compiled loss and gradients equal eager's."""
    T, H, I, E, K = 16, 32, 16, 4, 2
    torch.manual_seed(0)
    layer = MoEExperts(E, H, I, bias=True, dtype=torch.float32)
    lin = torch.nn.Linear(H, H)

    def block(x, idx, aff):
        return layer(lin(x), idx, aff).square().sum()

    assert_compiles_once_like_eager(block, layer, T, H, E, K, routings=3)


def assert_compiles_once_like_eager(block, layer, T, H, E, K, routings, device="cpu"):
    """``block(x, idx, aff)`` (a loss through ``layer``) compiled with ``fullgraph=True``
    (aot_eager): over ``routings`` seeded random routings (dropped slots included) one graph,
    and the loss and the gradients of x, aff, ``layer.w_gate_up`` and ``layer.b_down`` bitwise
    equal to eager's."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(2)
    for _ in range(routings):
        x = torch.randn(T, H, generator=g).to(device)
        idx = torch.randint(-1, E, (T, K), generator=g).to(device)
        aff = torch.rand(T, K, generator=g).to(device)
        outs = []
        for fn in (compiled, block):
            xl, al = x.clone().requires_grad_(), aff.clone().requires_grad_()
            loss = fn(xl, idx, al)
            grads = torch.autograd.grad(loss, [xl, al, layer.w_gate_up, layer.b_down])
            outs.append((loss.detach(), *grads))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_compile_inductor_runs_the_seam():
    from common.layer import run_experts_grouped_mm

    E, I, H = 3, 16, 32
    g = torch.Generator().manual_seed(4)
    w1, w3 = (torch.randn(E, I, H, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(E, H, I, generator=g).requires_grad_()
    x = torch.randn(10, H, generator=g).requires_grad_()
    counts = torch.tensor([4, 0, 5])
    fn = torch.compile(run_experts_grouped_mm, fullgraph=True)
    y = fn(w1, w2, w3, x, counts)
    assert torch.equal(y, run_experts_grouped_mm(w1, w2, w3, x, counts))
    y.sum().backward()
    assert x.grad is not None and w1.grad is not None and w2.grad is not None


# ---------------------------------------------------------------------------------- validation
def test_routing_error_code_bits():
    E = 4
    idx = torch.tensor([[0, 1], [2, -1]])
    aff = torch.tensor([[0.5, 0.5], [1.0, float("nan")]])  # NaN on a dropped slot: ignored
    assert int(routing_error_code(idx, aff, E)) == 0
    bit = {rule: b for b, _, rule in ROUTING_ERRORS}
    cases = [
        (torch.tensor([[0, 4], [2, -1]]), aff, "an expert id lies outside [-1, num_experts)"),
        (torch.tensor([[0, -2], [2, -1]]), aff, "an expert id lies outside [-1, num_experts)"),
        (idx, torch.tensor([[0.5, float("inf")], [1.0, 0.0]]),
         "a routed slot's affinity is NaN or inf"),
        (idx, torch.tensor([[0.5, -0.1], [1.0, 0.0]]), "a routed slot's affinity is negative"),
    ]
    for i, a, rule in cases:
        assert int(routing_error_code(i, a, E)) == bit[rule], rule


@pytest.mark.parametrize("mode", ["device", "host"])
def test_bad_routing_is_a_value_error_on_the_cpu(mode):
    x, aff, wgu, wd, _, _, idx = _layer_args(False, 3)
    opts = MoEExpertsOptions(backend="torch", validate_routing=mode)
    with pytest.raises(ValueError, match=r"expert_index_TK values must lie in \[-1"):
        moe_experts(x, idx + 5, aff, wgu, wd, options=opts)
    with pytest.raises(ValueError, match="affinity_TK must be >= 0"):
        moe_experts(x, idx.clamp(min=0), -aff.detach(), wgu, wd, options=opts)


def test_validation_off_runs_bad_affinities():
    x, aff, wgu, wd, _, _, idx = _layer_args(False, 3)
    opts = MoEExpertsOptions(backend="torch", validate_routing="off")
    y = moe_experts(x, idx.clamp(min=0), -aff.detach(), wgu, wd, options=opts)
    assert y.shape == x.shape


# ----------------------------------------------------------------------------------------- GPU
def _gpu_layer(T=512, H=256, I=128, E=8, K=2, seed=0, bias=False, grouped_mm="auto"):
    torch.manual_seed(seed)
    if grouped_mm in ("ours", "ours-gemm"):
        from common.dispatch import detect_backend

        if detect_backend("cuda") != "cuda-sm90":
            pytest.skip(f"grouped_mm={grouped_mm!r} runs on SM90 only")
    layer = MoEExperts(E, H, I, device="cuda", bias=bias, grouped_mm=grouped_mm)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    aff = (torch.rand(T, K, generator=g) + 0.05).cuda()
    dy = torch.randn(T, H, generator=g).bfloat16().cuda()
    return layer, x, idx, aff, dy


def _step(layer, x, idx, aff, dy):
    xl, al = x.detach().requires_grad_(), aff.detach().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    y = layer(xl, idx, al)
    y.backward(dy)
    return [y.detach(), xl.grad, al.grad] + [p.grad for p in layer.parameters()]


@gpu
@needs_cuda
@pytest.mark.parametrize("grouped_mm", ["auto", "ours", "ours-gemm"])
def test_gpu_default_layer_no_host_sync_and_deterministic(grouped_mm):
    """The layer (default options; and with our gather-GEMM kernels, fused or not) reads no
    device value on the host and is bitwise deterministic."""
    layer, x, idx, aff, dy = _gpu_layer(bias=True, grouped_mm=grouped_mm)
    first = _step(layer, x, idx, aff, dy)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = _step(layer, x, idx, aff, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_fused_forward_matches_the_portable_forward():
    from common.dispatch import detect_backend

    if detect_backend("cuda") != "cuda-sm90":
        pytest.skip("SM90 only")
    for name in CASES:
        d, kw = _inputs(name, device="cuda")
        want = moe_layer_forward_torch(*_positional(d), **kw)
        got = fwd.moe_forward_fused(*_positional(d), **kw)
        assert sqnr_db(got.y_TH.double().cpu(), want.y_TH.double().cpu()) >= 40, name
        assert sqnr_db(got.checkpoint_pairs().double().cpu(), want.checkpoint.double().cpu()
                       ) >= 40, name


@gpu
@needs_cuda
@pytest.mark.parametrize("grouped_mm", ["auto", "ours", "ours-gemm"])
def test_gpu_cuda_graph_replay_with_new_routing_equals_eager(grouped_mm):
    """Forward + backward captured once in a CUDA graph, replayed with new routing (a skewed
    one, then the first again): bitwise the eager step's outputs and gradients, with cuBLAS or
    with our gather-GEMM kernels (``grouped_mm="ours"`` / ``"ours-gemm"``: their side outputs
    and tile schedules built on the device)."""
    layer, x, idx0, aff0, dy = _gpu_layer(seed=3, grouped_mm=grouped_mm)
    _, _, idx1, aff1, _ = _gpu_layer(seed=4)
    idx1[:, 0] = 0  # a skewed second routing: expert 0 everywhere
    idx, aff = idx0.clone(), aff0.clone()
    xs, ys = x.clone(), dy.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _step(layer, xs, idx, aff, ys)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    xl, al = xs.detach().requires_grad_(), aff.detach().requires_grad_()
    with torch.cuda.graph(graph):
        y = layer(xl, idx, al)
        grads = torch.autograd.grad(y, [xl, al, *layer.parameters()], ys)
    for new_idx, new_aff in ((idx1, aff1), (idx0, aff0)):
        idx.copy_(new_idx)
        aff.copy_(new_aff)
        graph.replay()
        torch.cuda.synchronize()
        want = _step(layer, x, new_idx, new_aff, dy)
        assert torch.equal(y, want[0])
        for a, b in zip(grads, want[1:]):
            assert torch.equal(a, b)


@gpu
@needs_cuda
def test_gpu_compile_fullgraph_inductor_no_recompile():
    """torch.compile(fullgraph=True) with inductor of a block holding the layer, on the GPU:
    one graph for two routings; loss and gradients equal to eager's up to inductor's own
    reduction order in the square-sum around the layer (the layer's ops are opaque to it)."""
    import torch._dynamo.testing

    layer, x, idx0, aff0, dy = _gpu_layer(seed=5)
    _, _, idx1, aff1, _ = _gpu_layer(seed=6)

    def block(x, idx, aff):
        return layer(x, idx, aff).float().square().sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    for idx, aff in ((idx0, aff0), (idx1, aff1)):
        outs = []
        for fn in (compiled, block):
            xl, al = x.detach().requires_grad_(), aff.detach().requires_grad_()
            loss = fn(xl, idx, al)
            outs.append((loss.detach(), *torch.autograd.grad(loss, [xl, al, layer.w_down])))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


_BAD_ROUTING = """
import torch
from common.layer import MoEExperts
layer = MoEExperts(4, 64, 32, device="cuda")
x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
idx = torch.randint(0, 4, (8, 2), device="cuda")
aff = torch.rand(8, 2, device="cuda")
layer(x, idx, aff)  # warm-up: a kernel's first load would report the error early
torch.cuda.synchronize()
idx[3, 1] = 7
y = layer(x, idx, aff)
print("QUEUED", flush=True)
torch.cuda.synchronize()
print("NOT RAISED", flush=True)
"""


@gpu
@needs_cuda
def test_gpu_bad_routing_surfaces_at_the_next_synchronisation():
    r = subprocess.run([sys.executable, "-c", _BAD_ROUTING], capture_output=True, text=True,
                       timeout=300)
    assert "QUEUED" in r.stdout and "NOT RAISED" not in r.stdout, r.stdout + r.stderr
    assert r.returncode != 0 and "device-side assert" in r.stderr, r.stderr[-2000:]
    assert "expert_index_TK: an expert id lies outside [-1, num_experts)" in r.stderr


# ------------------------------------------------------------------ torchtitan weight layout
def test_fused_backward_writes_grads_in_torchtitan_weight_layout():
    """Weights whose memory is torchtitan's (``[w1; w3]`` [E, 2I, H] behind the [E, H, 2, I]
    view, ``w2`` [E, H, I] behind [E, I, H]) get gradients in that memory layout, equal to the
    contiguous weights' gradients."""
    import dataclasses

    from common.inputs import make_problem
    from common.layer import down_from_torchtitan, gate_up_from_torchtitan
    from cuda_kernels.moe import moe_backward_fused

    p = make_problem(24, 32, 16, 4, 2, seed=3, device=DEV)
    w1 = p.w_gate_up_EH2I[:, :, 0].transpose(1, 2).contiguous()
    w3 = p.w_gate_up_EH2I[:, :, 1].transpose(1, 2).contiguous()
    w2 = p.w_down_EIH.transpose(1, 2).contiguous()
    tt = dataclasses.replace(p, w_gate_up_EH2I=gate_up_from_torchtitan(w1, w3),
                             w_down_EIH=down_from_torchtitan(w2))
    assert not tt.w_gate_up_EH2I.is_contiguous() and not tt.w_down_EIH.is_contiguous()
    want = moe_backward_fused(p, grad_dtype=torch.bfloat16)
    got = moe_backward_fused(tt, grad_dtype=torch.bfloat16)
    assert got.w_gate_up_grad_EH2I.stride() == tt.w_gate_up_EH2I.stride()
    assert got.w_down_grad_EIH.stride() == tt.w_down_EIH.stride()
    for key, g in got.named().items():
        torch.testing.assert_close(g.float(), want.named()[key].float(), rtol=0, atol=0, msg=key)


def test_seam_grads_reach_torchtitan_weights_in_their_layout():
    from common.layer import run_experts_grouped_mm

    E, I, H = 3, 16, 32
    g = torch.Generator().manual_seed(6)
    w1, w3 = (torch.randn(E, I, H, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(E, H, I, generator=g).requires_grad_()
    x = torch.randn(12, H, generator=g).requires_grad_()
    y = run_experts_grouped_mm(w1, w2, w3, x, torch.tensor([5, 0, 6]))
    y.square().sum().backward()
    for w in (w1, w2, w3):
        assert w.grad.shape == w.shape and w.grad.is_contiguous()
        assert bool(torch.isfinite(w.grad).all()) and bool(w.grad.abs().sum() > 0)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_forward_against_float64(name):
    """y and the checkpoint against the float64 reference forward on the same (BF16) inputs;
    floors in ``common.metrics.SQNR_MIN_DB`` (measured on CPU: y 48.0-52.0, act 54.6-58.0 dB)."""
    from common.metrics import sqnr_floor
    from common.reference import reference_forward

    d, kw = _inputs(name)
    got = fwd.moe_forward_fused(*_positional(d), **kw)
    E = d["w_gate_up_EH2I"].shape[0]
    plan = plan_routing(d["expert_index_TK"].cpu(), d["affinity_TK"].cpu(), E)

    def f64(t):
        return None if t is None else t.double().cpu()

    y, act = reference_forward(
        f64(d["hidden_states_TH"]), f64(d["w_gate_up_EH2I"]), f64(d["w_down_EIH"]), plan,
        b_gate_up_E2I=f64(d["b_gate_up_E2I"]), b_down_EH=f64(d["b_down_EH"]), **kw,
    )
    assert sqnr_db(got.y_TH.double().cpu(), y) >= sqnr_floor("fused", "y")
    assert sqnr_db(got.checkpoint_pairs().double().cpu(), act) >= sqnr_floor("fused", "act")
