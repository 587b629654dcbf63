"""The layer's weight gradients reading X and dY through the routing index (issue 33, item 5).

Where the grouped wgrad's implementation gathers in its operand load
(``cuda_kernels.grouped_wgrad.api.WGRAD_GATHER_BACKENDS``) the fused backward passes X [T, H] /
dY [T, H] and ``layout.row_to_token_S`` to ``grouped_wgrad_into`` instead of gathered [S, H]
copies, and the forward keeps no X rows (``Backend.keeps_x_rows``: one decision,
``cuda_kernels.moe.grouped_mm_choice.keeps_x_rows``, for the forward, the fake implementation
and the backward). On the CPU no wgrad kernel gathers, so these tests stand a gathering twin in
for the kernel (:func:`_install_twin`: ``"torch"`` named a gathering backend, a
``grouped_wgrad_into`` that gathers with torch indexing and runs the torch twin). Every result
is compared bit for bit with the path without the index (the operand gathered by the Triton
pass first, as before item 5), which is also what runs where the API names no gathering
backend. GPU (``gpu``-marked): the layer's step with the SM90 gather kernel against the same
step with the gathering switched off (bitwise, and the forward's saved memory) and against the
portable backend.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_torch_backward import routing  # the same seeded router as the twin's tests

from common import dispatch, layer_ops
from common.inputs import make_problem
from common.layer import MoEExperts, MoEExpertsOptions
from common.metrics import sqnr_db
from common.problem import GPT_OSS, ClampLimits
from common.shapes import static_tokens_sum
from common.torch_backward import ALIGN, grouped_layout

bwd = pytest.importorskip("cuda_kernels.moe.backward")
fwd = pytest.importorskip("cuda_kernels.moe.forward")
from cuda_kernels.grouped_wgrad import api  # noqa: E402
from cuda_kernels.moe import grouped_mm_choice as choice  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
bf16 = torch.bfloat16
CLAMP = ClampLimits(linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
                    non_linear_clamp_upper_limit=7.0)
T, H, I, E, K = 40, 64, 32, 5, 2
UNROUTED = 7  # a token whose slots are all dropped: its X and dY rows are NaN, never read


def _rows(src_TK: torch.Tensor, idx_S: torch.Tensor) -> torch.Tensor:
    """``src_TK[idx_S]`` with 0 where ``idx_S < 0`` (the gathering kernel's contract)."""
    got = src_TK[idx_S.clamp(min=0)]
    return torch.where((idx_S >= 0)[:, None], got, torch.zeros((), dtype=got.dtype))


def _table_gathers(m) -> None:
    """On a monkeypatch ``m``: the per-shape table says ``wgrad_gather: true`` for every shape
    (configs/cuda/grouped_mm_choice.yaml's default is false: a measured memory / time trade)."""
    table = {k: {**row, choice.WGRAD_GATHER: True} for k, row in choice.grouped_mm_table().items()}
    m.setattr(choice, "grouped_mm_table", lambda: table)


def _install_twin(m) -> list:
    """On a monkeypatch ``m``: ``"torch"`` a gathering wgrad backend and a
    ``grouped_wgrad_into`` honouring ``a_rows_S`` / ``b_rows_S``. Returns the list that
    receives ``(a_rows given, b_rows given)`` per call."""
    calls = []

    def into(a_HS, b_SI, offsets_E, out_EHI, *, accumulate=False, backend="sm90",
             a_rows_S=None, b_rows_S=None):
        assert backend == "torch"
        calls.append((a_rows_S is not None, b_rows_S is not None))
        if a_rows_S is not None:  # an [H, T] source in the kernel's operand dtype
            assert a_HS.dtype == bf16 and a_HS.stride(0) == 1
            a_HS = _rows(a_HS.t(), a_rows_S).t()
        if b_rows_S is not None:  # a [T, I] source
            assert b_SI.dtype == bf16 and b_SI.stride(1) == 1
            b_SI = _rows(b_SI, b_rows_S)
        if not accumulate:  # poisoned: every element must be written
            out_EHI.fill_(float("nan"))
        api.grouped_gemm_wgrad(a_HS, b_SI, offsets_E, wgrad_tensor=out_EHI,
                               accumulate_on_output=accumulate, backend="torch",
                               validate_offsets=False)

    m.setattr(api, "WGRAD_GATHER_BACKENDS", ("torch",), raising=False)
    m.setattr(api, "wgrad_gather_enabled", lambda name: name == "torch")
    m.setattr(api, "grouped_wgrad_into", into)
    _table_gathers(m)
    return calls


@pytest.fixture
def gather_twin(monkeypatch):
    return _install_twin(monkeypatch)


def _problem(*, bias=False, clamp=None, activation=None, weights="contiguous", seed=0):
    ei, af = routing(T, K, E, seed + 5, dup_token=0, drop_frac=0.2, empty=(3,))
    ei[UNROUTED] = -1
    kw = {} if activation is None else {"activation": activation}
    p = make_problem(T, H, I, E, K, seed=seed, bias=bias, clamp_limits=clamp, expert_index=ei,
                     affinity=af, device=DEV, **kw)
    p.hidden_states_TH[UNROUTED] = float("nan")
    p.output_grad_TH[UNROUTED] = float("nan")
    if weights == "torchtitan":  # w_gate_up a view of [E, 2I, H], w_down of [E, H, I]
        wgu = p.w_gate_up_EH2I.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        wd = p.w_down_EIH.transpose(1, 2).contiguous().transpose(1, 2)
        p = dataclasses.replace(p, w_gate_up_EH2I=wgu, w_down_EIH=wd)
    elif weights == "interleaved":  # gpt-oss's gate_up_proj [E, H, 2I], gate even
        w = p.w_gate_up_EH2I.transpose(2, 3).contiguous().transpose(2, 3)
        p = dataclasses.replace(p, w_gate_up_EH2I=w)
    return p


def _assert_same(got, want):
    got, want = got.named(), want.named()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].stride() == v.stride(), k
        assert bool(torch.isfinite(got[k]).all()), k
        assert torch.equal(got[k], v), k


# --------------------------------------------------------------------------------- backward
CASES = {
    # name: problem keywords, backward keywords
    "plain": ({}, {}),
    "bias_clamp": ({"bias": True, "clamp": CLAMP}, {}),
    "gpt_oss_interleaved": (
        {"bias": True, "clamp": CLAMP, "activation": GPT_OSS, "weights": "interleaved"}, {}),
    "torchtitan": ({"weights": "torchtitan"}, {}),
    "accumulate": ({}, {"accumulate_into": True}),
    "bf16_grads": ({}, {"grad_dtype": bf16}),
}


@pytest.mark.parametrize("impl", ["cublas", "ours-gemm", "ours"])
@pytest.mark.parametrize("case", list(CASES))
def test_backward_through_the_index_equals_the_gathered_operands_bitwise(case, impl,
                                                                        monkeypatch):
    """Both wgrads read X and dY through ``row_to_token_S`` (in both operand orientations:
    torchtitan's memory swaps them; into main_grad buffers too): the gradients are those of
    the path that gathers the operands first, bit for bit, also with the forward's X rows.
    NaN in the X / dY rows of an unrouted token is never read."""
    pkw, bkw = CASES[case]
    if impl == "ours" and pkw.get("weights") == "interleaved":
        pytest.skip("the fused dgated epilogue takes gate/up halves, not interleaved columns")
    p = _problem(**pkw)
    layout = grouped_layout(p.plan, E)

    def run(**extra):
        kw = {"layout": layout, "grouped_mm": impl, **bkw, **extra}
        if kw.pop("accumulate_into", None):
            kw["accumulate_into"] = (torch.full((E, H, 2, I), 0.5, device=DEV),
                                     torch.full((E, I, H), -0.25, device=DEV))
        return bwd.moe_backward_fused(p, **kw)

    with monkeypatch.context() as m:
        m.setattr(api, "wgrad_gather_enabled", lambda name: False)
        want = run()
        assert "wgrad_gather" not in want.info
        x_rows = layout.gather_rows(p.hidden_states_TH.to(bf16))
        _assert_same(run(x_rows_S=x_rows), want)
    with monkeypatch.context() as m:
        calls = _install_twin(m)
        got = run()
    _assert_same(got, want)
    # dW_down reads dY as B (as A in torchtitan's w2 memory), dW_gate_up X as A (as B in
    # torchtitan's [E, 2I, H]); with biases the dY rows exist (their gradient reads them), and
    # dW_down reads those
    swapped = pkw.get("weights") == "torchtitan"
    want_calls = [(True, False), (False, True)] if swapped else [(False, True), (True, False)]
    if pkw.get("bias"):
        want_calls = want_calls[1:]
    assert calls == want_calls
    assert got.info["wgrad_gather"] == len(want_calls) and got.info["wgrad_backend"] == "torch"


@pytest.mark.parametrize("impl", ["cublas", "ours-gemm", "ours"])
@pytest.mark.parametrize("bias", [False, True])
def test_dy_rows_are_written_only_where_something_reads_them(impl, bias, monkeypatch):
    """With a gathering wgrad the down dgrad writes no dY rows (no ``dy_rows_out`` side output,
    the cuBLAS path's gathered rows dropped after its GEMM) unless the bias gradients read
    them; without one they are written as before."""
    p = _problem(bias=bias)
    layout = grouped_layout(p.plan, E)
    seen = []
    real_dgated, real_gathered = bwd.gmm.down_dgrad_backward, bwd.gathered_times_experts

    def dgated(*a, dy_rows_out=None, **k):
        seen.append(dy_rows_out is not None)
        return real_dgated(*a, dy_rows_out=dy_rows_out, **k)

    def gathered(*a, keep_rows=True, **k):
        rows, out = real_gathered(*a, keep_rows=keep_rows, **k)
        seen.append(rows is not None)
        return rows, out

    monkeypatch.setattr(bwd.gmm, "down_dgrad_backward", dgated)
    monkeypatch.setattr(bwd, "gathered_times_experts", gathered)
    with monkeypatch.context() as m:
        m.setattr(api, "wgrad_gather_enabled", lambda name: False)
        want = bwd.moe_backward_fused(p, layout=layout, grouped_mm=impl)
    with monkeypatch.context() as m:
        _install_twin(m)
        got = bwd.moe_backward_fused(p, layout=layout, grouped_mm=impl)
    assert seen == [True, bias]
    _assert_same(got, want)


def test_an_explicit_wgrad_backend_that_cannot_run_still_raises(gather_twin):
    p = _problem()
    with pytest.raises(RuntimeError, match="wgrad_backend='sm100' cannot run"):
        bwd.moe_backward_fused(p, layout=grouped_layout(p.plan, E), wgrad_backend="sm100")
    assert gather_twin == []


# ---------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("impl", ["cublas", "ours-gemm", "ours"])
def test_forward_keeps_no_x_rows_where_the_wgrad_gathers(impl, monkeypatch):
    """The forward keeps no [S, H] X rows where the backward's gate/up wgrad gathers (the
    fused kernels write no ``x_rows_out``), the same y and checkpoint; the backward on that
    state gives the gradients of the state with X rows, bit for bit (and the unrouted token's
    NaN row of X is read by neither). Where no wgrad gathers
    (the API without it, the CPU's twin) it keeps them as before."""
    ei, af = routing(T, K, E, 5, dup_token=0, drop_frac=0.2, empty=(3,))  # _problem's
    ei[UNROUTED] = -1
    p = _problem()
    x, wgu, wd = p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH  # (x: a NaN row, unread)
    seen = []
    real = fwd.gmm.gate_up_forward

    def gated(*a, x_rows_out=None, **k):
        seen.append(x_rows_out is not None)
        return real(*a, x_rows_out=x_rows_out, **k)

    monkeypatch.setattr(fwd.gmm, "gate_up_forward", gated)
    with monkeypatch.context() as m:
        m.setattr(api, "wgrad_gather_enabled", lambda name: False)
        kept = fwd.moe_forward_fused(x, af, ei, wgu, wd, grouped_mm=impl)
        assert kept.x_rows_S is not None and tuple(kept.x_rows_S.shape) == (
            kept.layout.tokens_sum, H)
        assert choice.keeps_x_rows(x.device, E, H, I)
        want = bwd.moe_backward_fused(
            dataclasses.replace(p, plan=kept.plan, hidden_states_TH=x,
                                act_checkpoint_R2I=kept.checkpoint),
            layout=kept.layout, x_rows_S=kept.x_rows_S, grouped_mm=impl)
    with monkeypatch.context() as m:
        _install_twin(m)
        assert not choice.keeps_x_rows(x.device, E, H, I)
        out = fwd.moe_forward_fused(x, af, ei, wgu, wd, grouped_mm=impl)
        assert out.x_rows_S is None
        assert torch.equal(out.y_TH, kept.y_TH)
        assert torch.equal(out.checkpoint, kept.checkpoint)
        # asked to keep them (a caller whose backward will not gather): kept
        again = fwd.moe_forward_fused(x, af, ei, wgu, wd, grouped_mm=impl, keep_x_rows=True)
        assert torch.equal(again.x_rows_S, kept.x_rows_S)
        got = bwd.moe_backward_fused(
            dataclasses.replace(p, plan=out.plan, hidden_states_TH=x,
                                act_checkpoint_R2I=out.checkpoint),
            layout=out.layout, x_rows_S=out.x_rows_S, grouped_mm=impl)
    assert seen == ([True, False, True] if impl == "ours" else [])
    _assert_same(got, want)


# --------------------------------------------------------------------- the layer and its op
@pytest.fixture
def cuda_backend_on_cpu(monkeypatch):
    """The cuda-sm90 backend's real declaration (forward, run, keeps_x_rows) runnable on CPU
    tensors (Triton's interpreter, the GEMMs' twins)."""
    if DEV != "cpu":
        pytest.skip("the CPU stand-in of the CUDA backend")
    real = dispatch.registered_backends()["cuda-sm90"]
    monkeypatch.setitem(dispatch._REGISTRY, "cuda-sm90",
                        dataclasses.replace(real, check=lambda: None))


def _layer_step(layer, x, idx, aff, dy):
    xl, al = x.detach().requires_grad_(), aff.detach().requires_grad_()
    for q in layer.parameters():
        q.grad = None
    y = layer(xl, idx, al)
    saved = y.grad_fn.saved_tensors
    y.backward(dy)
    return saved, [y.detach(), xl.grad, al.grad] + [q.grad.clone() for q in layer.parameters()]


def _layer_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(dtype)
    ei, af = routing(T, K, E, 9, drop_frac=0.2)
    dy = torch.randn(T, H, generator=g).to(dtype)
    return x, ei, af, dy


@pytest.mark.parametrize("bias", [False, True])
def test_layer_saves_no_x_rows_where_the_wgrad_gathers(bias, cuda_backend_on_cpu, monkeypatch):
    """Through ``torch.ops.moe_bwd.experts_forward``: the autograd node saves a [0, H] X-rows
    tensor where the wgrad gathers ([S, H] where not: the API without a gathering backend), and
    the step's output and gradients are the same bit for bit."""
    torch.manual_seed(0)
    layer = MoEExperts(E, H, I, bias=bias, backend="cuda-sm90", dtype=torch.float32)
    x, ei, af, dy = _layer_inputs()
    S = static_tokens_sum(T * K, E, ALIGN)
    with monkeypatch.context() as m:
        m.setattr(api, "wgrad_gather_enabled", lambda name: False)
        saved, want = _layer_step(layer, x, ei, af, dy)
        # (x, w_gate_up, w_down, b_gate_up, b_down, checkpoint, X rows, *routing)
        assert saved[6].dtype == bf16 and tuple(saved[6].shape) == (S, H)
    with monkeypatch.context() as m:
        calls = _install_twin(m)
        saved, got = _layer_step(layer, x, ei, af, dy)
    assert calls == ([(True, False)] if bias else [(False, True), (True, False)])
    assert tuple(saved[6].shape) == (0, H)
    # the BF16 state the node holds is the checkpoint alone
    assert sum(t.numel() for t in saved if t is not None and t.dtype == bf16) == (
        saved[5].numel())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_main_grad_layer_through_the_index(cuda_backend_on_cpu, monkeypatch):
    """``accumulate_main_grad`` (``MoEExpertsFunction``, the wgrads added into the fp32
    buffers in the kernel): the same buffers with and without the gathering wgrad."""
    x, ei, af, dy = _layer_inputs()
    got = []
    for gather in (False, True):
        with monkeypatch.context() as m:
            if gather:
                calls = _install_twin(m)
            else:
                m.setattr(api, "wgrad_gather_enabled", lambda name: False)
            torch.manual_seed(0)
            layer = MoEExperts(E, H, I, backend="cuda-sm90", dtype=torch.float32,
                               accumulate_main_grad=True)
            for q in (layer.w_gate_up, layer.w_down):
                q.main_grad = torch.full_like(q, 0.5)
            layer(x, ei, af).backward(dy)
            got.append((layer.w_gate_up.main_grad, layer.w_down.main_grad))
    assert calls == [(False, True), (True, False)]
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_layer_op_fake_impl_agrees_with_the_forward(cuda_backend_on_cpu, gather_twin):
    """``opcheck`` of ``experts_forward`` with the backend whose wgrad gathers: the fake
    implementation's X rows ([0, H]) are the real op's."""
    torch.manual_seed(0)
    x, ei, af, _ = _layer_inputs(bf16)
    w = (torch.randn(E, H, 2, I) * H**-0.5).bfloat16()
    wd = (torch.randn(E, I, H) * I**-0.5).bfloat16()
    key = layer_ops.options_key(MoEExpertsOptions(backend="cuda-sm90"))
    out = torch.ops.moe_bwd.experts_forward(x, af, w, wd, None, None, ei, key)
    assert tuple(out[2].shape) == (0, H)
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward, (x, af, w, wd, None, None, ei, key),
                          test_utils=("test_schema", "test_faketensor"))


def test_layer_compiles_once_with_the_gathering_wgrad(cuda_backend_on_cpu, gather_twin):
    """torch.compile(fullgraph=True): one graph for three routings, bitwise eager's."""
    from test_layer_forward import assert_compiles_once_like_eager

    torch.manual_seed(0)
    layer = MoEExperts(4, 32, 16, bias=True, backend="cuda-sm90", dtype=torch.float32)

    def block(x, idx, aff):
        return layer(x, idx, aff).square().sum()

    assert_compiles_once_like_eager(block, layer, 16, 32, 4, 2, routings=3)
    # the gate/up wgrad (dW_down reads the dY rows the bias gradient needs), compiled and
    # eager, three routings
    assert gather_twin == [(True, False)] * 2 * 3


def test_keeps_x_rows_is_one_decision_of_shape_dtype_and_options(monkeypatch):
    """The forward's ``keeps_x_rows``: False exactly where the backward's gate/up wgrad runs a
    gathering kernel (the SM90 kernel, here pretended present): BF16 gradients off the 128
    grid go to cuBLAS (kept), fp32 and main_grad accumulation stay on the kernel (not kept),
    ``wgrad_backend="torch"`` / ``"sm100"`` (the 16-row layout is off its contract) keep them;
    the CPU and an API without gathering backends keep them."""
    monkeypatch.setattr(choice, "_GATHERED_CHOICE", {})
    monkeypatch.setattr(api, "select_grouped_wgrad_backend", lambda dev: (
        ("sm90", "") if torch.device(dev).type == "cuda" else ("torch", "cpu")))
    monkeypatch.setattr(api, "WGRAD_GATHER_BACKENDS", ("sm90",), raising=False)
    from cuda_kernels.gemm.sm90 import wgrad_bf16

    monkeypatch.setattr(wgrad_bf16, "GATHER_VERIFIED_ON_GPU", False)
    monkeypatch.delenv(wgrad_bf16.GATHER_ENABLE_ENV, raising=False)
    cuda = torch.device("cuda")
    keeps = choice.keeps_x_rows
    with monkeypatch.context() as m:  # the gather keys' gate closed: the copies are kept
        _table_gathers(m)
        assert keeps(cuda, 128, 2048, 768)
    monkeypatch.setenv(wgrad_bf16.GATHER_ENABLE_ENV, "1")
    assert keeps(cuda, 128, 2048, 768) is (not choice.table_wgrad_gather(128, 2048, 768))
    with monkeypatch.context() as m:  # the table's per-shape trade decides first
        table = {k: {**row, choice.WGRAD_GATHER: False}
                 for k, row in choice.grouped_mm_table().items()}
        m.setattr(choice, "grouped_mm_table", lambda: table)
        assert keeps(cuda, 128, 2048, 768)
    _table_gathers(monkeypatch)
    assert not keeps(cuda, 128, 2048, 768)  # qwen3-30b-a3b: fp32 grads by default
    assert not keeps(cuda, 128, 2048, 768, grad_dtype=bf16)
    assert keeps(cuda, 32, 2880, 2880, grad_dtype=bf16)  # gpt-oss: cuBLAS's wgrad
    assert not keeps(cuda, 32, 2880, 2880)  # fp32 out: ours
    assert not keeps(cuda, 32, 2880, 2880, grad_dtype=bf16, accumulate=True)
    assert keeps(cuda, 128, 2048, 768, wgrad_backend="torch")
    assert keeps(cuda, 128, 2048, 768, wgrad_backend="sm100")
    assert keeps(cuda, 128, 2048, 768, wgrad_backend="bogus")  # (the backward names it)
    assert keeps(cuda, 8, 200, 128)  # off the kernel's tiles: the twin
    assert keeps(torch.device("cpu"), 128, 2048, 768)
    # the backend's hook, as the layer calls it (its options in the call)
    hook = dispatch.registered_backends()["cuda-sm90"].keeps_x_rows
    call = {"device": cuda, "E": 128, "H": 2048, "I": 768, "grad_dtype": bf16,
            "accumulate": False, "backend_options": {}, "grouped_mm": "auto"}
    assert hook(call) is False
    assert hook({**call, "backend_options": {"wgrad_backend": "torch"}}) is True
    monkeypatch.setattr(api, "wgrad_gather_enabled", lambda name: False)
    assert keeps(cuda, 128, 2048, 768)


# --------------------------------------------------------------------------------------- GPU
def _gpu_gather_backend():
    if "sm90" not in getattr(api, "WGRAD_GATHER_BACKENDS", ()):
        pytest.skip("the wgrad API names no gathering SM90 kernel")
    from common.dispatch import detect_backend

    if detect_backend("cuda") != "cuda-sm90":
        pytest.skip("SM90 only")


@gpu
@needs_cuda
@pytest.mark.parametrize("grouped_mm", ["auto", "cublas", "ours", "ours-gemm"])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_layer_step_with_the_gather_wgrad_equals_the_gathered_copies(grouped_mm, bias,
                                                                        monkeypatch):
    """The layer's step (default options) with the SM90 wgrad reading X and dY through the
    routing index: output and every gradient bitwise those of the same step with the
    gathering switched off (the gathered copies, as before item 5); the forward saves S*H
    BF16 bytes less for the backward (no X rows; memory_allocated agrees within the caching
    allocator's block rounding, up to 1 MiB: 128 KiB off with biases, H100 2026-12-06); and the
    step agrees with the
    portable backend."""
    _gpu_gather_backend()
    _table_gathers(monkeypatch)
    from cuda_kernels.gemm.sm90 import wgrad_bf16

    monkeypatch.setenv(wgrad_bf16.GATHER_ENABLE_ENV, "1")  # the gather keys themselves
    Tg, Hg, Ig, Eg, Kg = 1024, 512, 256, 8, 2
    torch.manual_seed(0)
    layer = MoEExperts(Eg, Hg, Ig, device="cuda", bias=bias, grouped_mm=grouped_mm)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(Tg, Hg, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(Eg, generator=g)[:Kg] for _ in range(Tg)]).cuda()
    idx[3] = -1  # an unrouted token
    aff = (torch.rand(Tg, Kg, generator=g) + 0.05).cuda()
    dy = torch.randn(Tg, Hg, generator=g).bfloat16().cuda()
    S = static_tokens_sum(Tg * Kg, Eg, ALIGN)

    def step():
        xl, al = x.detach().requires_grad_(), aff.detach().requires_grad_()
        for q in layer.parameters():
            q.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = layer(xl, idx, al)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        # (x, w_gate_up, w_down, b_gate_up, b_down, checkpoint, X rows, *routing)
        saved = y.grad_fn.saved_tensors
        rows = [tuple(saved[6].shape)]
        # the bytes the backward holds on to (each storage once); memory_allocated would
        # also see the caching allocator's unsplit blocks (up to 1 MiB over a request)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in saved if t is not None and t.numel()}
        sizes = sum(storages.values())
        y.backward(dy)
        torch.cuda.synchronize()
        return held, rows, [y.detach(), xl.grad, al.grad] + [
            q.grad.clone() for q in layer.parameters()], sizes

    step()  # warm-up: compiles the kernels
    held, rows, got, sizes = step()
    assert rows == [(0, Hg)]
    with monkeypatch.context() as m:
        m.setattr(api, "wgrad_gather_enabled", lambda name: False)
        step()
        held_off, rows_off, want, sizes_off = step()
    assert rows_off == [(S, Hg)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert sizes_off - sizes == S * Hg * 2, (sizes_off, sizes)
    assert held_off - held >= S * Hg * 2 - (1 << 20), (held_off, held)
    ref = MoEExperts(Eg, Hg, Ig, device="cuda", bias=bias, backend="torch")
    ref.load_state_dict(layer.state_dict())
    xl, al = x.detach().requires_grad_(), aff.detach().requires_grad_()
    y = ref(xl, idx, al)
    y.backward(dy)
    for a, b in zip(got, [y.detach(), xl.grad, al.grad] + [q.grad for q in ref.parameters()]):
        assert sqnr_db(a.double().cpu(), b.double().cpu()) >= 40
