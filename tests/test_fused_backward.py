"""Tests of the fused GPU backward (cuda_kernels/moe/backward.py) against its twins.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1) and the GEMMs in torch; with one, everything runs on the GPU. Either way the
fused path must match the portable ``torch`` backend (same BF16 operand roundings) and reach the
SQNR table's per-gradient floor against float64 (``sqnr_floor("fused", g)``). GPU-only
properties (no host sync, CUDA-graph replay with new routing, bitwise determinism) are
``gpu``-marked.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from common.inputs import make_problem
from common.metrics import sqnr_db, sqnr_floor
from common.problem import GPT_OSS, ClampLimits
from common.reference import reference_backward
from common.routing import plan_routing
from common.torch_backward import grouped_layout, moe_backward_torch

from test_torch_backward import routing  # the same seeded router as the twin's tests

kernels = pytest.importorskip("cuda_kernels.triton.rows")
from cuda_kernels.moe import moe_backward_fused  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fused vs the portable path on the same inputs: both round the same BF16 operands; they differ by
# fp32 summation order, fp32 vs BF16 weight-gradient outputs, and the bias sums over BF16 rows
TWIN_MIN_DB = 45.0
GPT_OSS_CLAMP = ClampLimits(
    linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0, non_linear_clamp_upper_limit=7.0
)


CASES = {
    # name: (T, H, I, E, K, routing kwargs, bias, clamp, activation)
    "plain": (48, 64, 32, 4, 2, {}, False, None, None),
    "odd_sizes": (20, 24, 40, 3, 2, {}, False, None, None),
    "empty_experts": (40, 32, 16, 6, 2, {"empty": (0, 2, 3, 5)}, False, None, None),
    "duplicates_dropped": (32, 32, 24, 5, 3, {"dup_token": 0, "drop_frac": 0.3}, False, None, None),
    "bias_clamp": (
        40, 64, 32, 4, 2, {"drop_frac": 0.1}, True,
        ClampLimits(linear_clamp_upper_limit=0.5, linear_clamp_lower_limit=-0.5,
                    non_linear_clamp_upper_limit=0.625), None,
    ),
    "gpt_oss": (32, 64, 32, 4, 2, {}, True, GPT_OSS_CLAMP, GPT_OSS),
    "top1_one_expert": (16, 16, 8, 1, 1, {}, False, None, None),
    "one_token": (1, 32, 16, 4, 2, {}, False, None, None),
}


def _problem(name, seed=0, device=DEV):
    T, H, I, E, K, rkw, bias, clamp, act = CASES[name]
    ei, af = routing(T, K, E, seed + 11, **rkw)
    kw = {} if act is None else {"activation": act}
    try:
        return make_problem(T, H, I, E, K, seed=seed, bias=bias, clamp_limits=clamp,
                            expert_index=ei, affinity=af, device=device, **kw)
    except TypeError:  # make_problem without the activation keyword: build the SwiGLU problem
        pytest.skip("make_problem has no activation keyword yet")


def _on_cpu(p):
    """The same problem on the CPU (the twins run there)."""
    if p.hidden_states_TH.device.type == "cpu":
        return p
    plan = p.plan
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    out = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    out["plan"] = dataclasses.replace(
        plan, **{f.name: getattr(plan, f.name).cpu() for f in dataclasses.fields(plan)
                 if isinstance(getattr(plan, f.name), torch.Tensor)}
    )
    return dataclasses.replace(p, **out)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_twin_and_reference(name):
    p = _problem(name)
    fused = moe_backward_fused(p)
    cpu = _on_cpu(p)
    twin = moe_backward_torch(cpu)
    ref = reference_backward(cpu)
    for key, out in fused.named().items():
        assert out.dtype == torch.float32, key
        assert torch.isfinite(out).all(), key
        got = out.cpu()
        assert sqnr_db(got, ref.named()[key]) >= sqnr_floor("fused", key), key
        assert sqnr_db(got, twin.named()[key]) >= TWIN_MIN_DB, key


def test_empty_experts_get_exact_zero_weight_grads():
    p = _problem("empty_experts")
    g = moe_backward_fused(p)
    for e in (0, 2, 3, 5):
        assert torch.count_nonzero(g.w_gate_up_grad_EH2I[e]) == 0
        assert torch.count_nonzero(g.w_down_grad_EIH[e]) == 0


def test_nan_in_padding_pairs_and_unrouted_rows_never_leaks():
    p = _problem("duplicates_dropped")
    ref = moe_backward_fused(p)
    act = p.act_checkpoint_R2I.clone()
    n = int(p.plan.num_pairs)
    act[n:] = float("nan")
    x = p.hidden_states_TH.clone()
    routed = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    routed[p.plan.pair_token_R[:n]] = True
    x[~routed] = float("nan")  # tokens whose every slot is dropped are never read
    q = dataclasses.replace(p, act_checkpoint_R2I=act, hidden_states_TH=x)
    got = moe_backward_fused(q)
    for key, out in got.named().items():
        want = ref.named()[key]
        if key.startswith("dX"):
            out, want = out[routed], want[routed]
        assert torch.equal(out, want), key


def test_bf16_grads_and_dtypes():
    p = _problem("bias_clamp")
    f32 = moe_backward_fused(p)
    b16 = moe_backward_fused(p, grad_dtype=torch.bfloat16)
    for key, out in b16.named().items():
        want_dtype = torch.float32 if key.startswith("dA") else torch.bfloat16
        assert out.dtype == want_dtype, key
        assert sqnr_db(out.float().cpu(), f32.named()[key].cpu()) >= 45.0, key


def test_accumulate_into_main_grad_buffers():
    p = _problem("plain")
    fresh = moe_backward_fused(p)
    gu = torch.full(p.w_gate_up_EH2I.shape, 256.0, device=p.hidden_states_TH.device)
    dn = torch.full(p.w_down_EIH.shape, -3.0, device=p.hidden_states_TH.device)
    g = moe_backward_fused(p, accumulate_into=(gu, dn))
    assert g.w_gate_up_grad_EH2I is gu and g.w_down_grad_EIH is dn
    torch.testing.assert_close(gu - 256.0, fresh.w_gate_up_grad_EH2I, atol=2e-5, rtol=0)
    torch.testing.assert_close(dn + 3.0, fresh.w_down_grad_EIH, atol=1e-6, rtol=1e-6)
    # fp32 accumulation: 256 + 1 is 257 (a BF16 round trip would give 256)
    one = torch.zeros_like(gu)
    assert float((256.0 + one + 1.0)[0, 0, 0, 0]) == 257.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"grad_dtype": torch.float16}, "grad_dtype"),
        ({"wgrad_backend": "cublas"}, "wgrad_backend"),
        ({"accumulate_into": "buf"}, "accumulate_into"),
        ({"accumulate_into": (torch.zeros(1), torch.zeros(1))}, r"accumulate_into\[dW_gate_up\]"),
    ],
)
def test_bad_options_raise_before_any_write(kwargs, match):
    p = _problem("plain")
    with pytest.raises(ValueError, match=match):
        moe_backward_fused(p, **kwargs)


def test_accumulate_buffers_of_wrong_dtype_are_left_untouched():
    p = _problem("plain")
    dev = p.hidden_states_TH.device
    gu = torch.full(p.w_gate_up_EH2I.shape, 7.0, device=dev)
    dn = torch.full(p.w_down_EIH.shape, 7.0, dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match=r"accumulate_into\[dW_down\].*float32"):
        moe_backward_fused(p, accumulate_into=(gu, dn))
    assert bool((gu == 7.0).all()) and bool((dn == 7.0).all())


def test_bad_problem_raises_value_error():
    p = _problem("plain")
    q = dataclasses.replace(p, output_grad_TH=p.output_grad_TH[:, :-1])
    with pytest.raises(ValueError, match="output_grad_TH"):
        moe_backward_fused(q)


def test_slot_rows_dedupes_merged_pairs_and_drops():
    ei = torch.tensor([[1, 1, -1], [0, 2, 1]])
    af = torch.ones(2, 3)
    plan = plan_routing(ei, af, 3)
    layout = grouped_layout(plan, 3)
    rows = layout.slot_to_row_TK
    assert rows[0, 1] == -1 and rows[0, 2] == -1 and rows[0, 0] >= 0
    assert (rows[1] >= 0).all()
    tok = layout.row_to_token_S
    assert tok[rows[0, 0]] == 0 and all(int(tok[r]) == 1 for r in rows[1])


def test_gather_rows_zero_padding_and_cast():
    src = torch.randn(5, 40, device=DEV)
    src[3] = float("nan")  # never gathered
    idx = torch.tensor([4, -1, 0, 0, 2, -1], device=DEV)
    out = kernels.gather_rows(src, idx, torch.bfloat16)
    want = torch.where((idx >= 0)[:, None], src[idx.clamp(min=0)], 0.0).bfloat16()
    assert torch.equal(out, want)


def test_segment_colsum_skips_padding_rows():
    x = torch.randn(8, 20, device=DEV)
    x[[2, 7]] = float("nan")  # padding rows
    r2p = torch.tensor([0, 1, -1, 2, 3, 4, 5, -1], device=DEV)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32, device=DEV)
    scale = torch.arange(1, 7, dtype=torch.float32, device=DEV)
    out = kernels.segment_colsum(x, offs, r2p, scale)
    w = scale[r2p.clamp(min=0)]
    xs = torch.where((r2p >= 0)[:, None], x * w[:, None], 0.0)
    want = torch.stack([xs[:3].sum(0), torch.zeros(20, device=DEV), xs[3:].sum(0)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- GPU only
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
def test_gpu_bitwise_deterministic():
    p = make_problem(512, 256, 128, 16, 4, seed=3, device="cuda", bias=True)
    a = moe_backward_fused(p)
    b = moe_backward_fused(p)
    for key in a.named():
        assert torch.equal(a.named()[key], b.named()[key]), key


@gpu
@needs_cuda
def test_gpu_no_host_sync():
    p = make_problem(512, 256, 128, 16, 4, seed=4, device="cuda")
    moe_backward_fused(p)  # compile / warm up outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_backward_fused(p)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_routing():
    T, H, I, E, K = 256, 256, 128, 8, 2
    g = torch.Generator().manual_seed(7)
    routes = []
    for empty in ((), (3,)):  # distinct experts per token; the second routing leaves expert 3 empty
        live = torch.tensor([e for e in range(E) if e not in empty])
        pick = torch.stack([live[torch.randperm(live.numel(), generator=g)[:K]] for _ in range(T)])
        routes.append((pick, torch.rand(T, K, generator=g) + 0.05))
    problems = [make_problem(T, H, I, E, K, seed=5, device="cuda", expert_index=ei, affinity=af)
                for ei, af in routes]
    ei = routes[0][0].cuda()
    af = routes[0][1].cuda()
    act = problems[0].act_checkpoint_R2I.clone()

    def step():
        plan = plan_routing(ei, af, E, validate=False)
        return moe_backward_fused(dataclasses.replace(problems[0], plan=plan,
                                                      act_checkpoint_R2I=act))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for (ei_new, af_new), p in zip(routes, problems):
        ei.copy_(ei_new)
        af.copy_(af_new)
        act.copy_(p.act_checkpoint_R2I)
        graph.replay()
        torch.cuda.synchronize()
        want = moe_backward_fused(p)
        for key, got in out.named().items():
            assert torch.equal(got, want.named()[key]), key


@gpu
@needs_cuda
def test_gpu_dispatch_runs_fused_on_sm90():
    from common.dispatch import run_backward

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("SM90 only")
    p = make_problem(256, 256, 128, 8, 2, seed=6, device="cuda")
    g = run_backward(p, backend="cuda-sm90")
    assert g.info["backend"] == "cuda-sm90" and g.info["wgrad_backend"] == "sm90"
    ref = reference_backward(_on_cpu(p))
    for key, out in g.named().items():
        assert sqnr_db(out.cpu(), ref.named()[key]) >= sqnr_floor("cuda-sm90", key), key
    assert not math.isnan(float(g.affinity_grad_TE.sum()))


def test_forward_state_layout_and_x_rows_give_the_same_grads():
    p = _problem("duplicates_dropped")
    E = p.w_gate_up_EH2I.shape[0]
    layout = grouped_layout(p.plan, E)
    x_rows = layout.gather_rows(p.hidden_states_TH.bfloat16())
    want = moe_backward_fused(p)
    got = moe_backward_fused(p, layout=layout, x_rows_S=x_rows)
    for key, out in got.named().items():
        assert torch.equal(out, want.named()[key]), key
    with pytest.raises(ValueError, match="x_rows_S"):
        moe_backward_fused(p, layout=layout, x_rows_S=x_rows[:-1])
    with pytest.raises(ValueError, match="layout"):
        moe_backward_fused(p, x_rows_S=x_rows)


def test_zero_empty_groups_touches_only_empty_experts():
    out = torch.randn(4, 3, 50, device=DEV)
    keep = out.clone()
    offs = torch.tensor([5, 5, 9, 9], dtype=torch.int32, device=DEV)  # experts 1 and 3 are empty
    kernels.zero_empty_groups(out, offs)
    assert torch.equal(out[[0, 2]], keep[[0, 2]])
    assert torch.count_nonzero(out[[1, 3]]) == 0


def test_wgrad_choice_uses_cublas_only_for_bf16_off_grid_sizes(monkeypatch):
    from cuda_kernels.moe import backward as fused

    monkeypatch.setattr(fused.api, "select_grouped_wgrad_backend", lambda dev: ("sm90", ""))
    monkeypatch.setattr(fused.api, "kernel_unsupported_reason", lambda *a: None)
    a = torch.empty(2880, 64, dtype=torch.bfloat16).t().contiguous().t()  # [H, S], M-major
    b = torch.empty(64, 5760, dtype=torch.bfloat16)
    offs = torch.tensor([64], dtype=torch.int32)
    bf16, f32 = torch.bfloat16, torch.float32
    choose = fused._choose_wgrad
    assert choose(a, b, offs, bf16, False, "auto", 16)[0] == "cublas"
    assert choose(a, b, offs, f32, False, "auto", 16)[0] == "sm90"  # fp32: our kernel
    assert choose(a, b, offs, bf16, True, "auto", 16)[0] == "sm90"  # accumulate
    assert choose(a, b, offs, bf16, False, "sm90", 16)[0] == "sm90"  # explicit
    a128 = torch.empty(2048, 64, dtype=torch.bfloat16).t().contiguous().t()
    b128 = torch.empty(64, 1536, dtype=torch.bfloat16)
    assert choose(a128, b128, offs, bf16, False, "auto", 16)[0] == "sm90"


def test_sm100_kernel_never_gets_rows_off_its_256_row_contract(monkeypatch):
    """The SM100 kernel poisons experts whose row count breaks its contract: the fused path's
    16-row layout must never reach it (auto falls back, an explicit request raises)."""
    from cuda_kernels.moe import backward as fused

    monkeypatch.setattr(fused.api, "select_grouped_wgrad_backend", lambda dev: ("sm100", ""))
    monkeypatch.setattr(fused.api, "kernel_unsupported_reason", lambda *a: None)
    a = torch.empty(2048, 64, dtype=torch.bfloat16).t().contiguous().t()
    b = torch.empty(64, 1536, dtype=torch.bfloat16)
    offs = torch.tensor([64], dtype=torch.int32)
    name, why = fused._choose_wgrad(a, b, offs, torch.float32, False, "auto", 16)
    assert name == "torch" and "256" in why
    assert fused._choose_wgrad(a, b, offs, torch.float32, False, "auto", 256)[0] == "sm100"
    with pytest.raises(RuntimeError, match="256"):
        fused._choose_wgrad(a, b, offs, torch.float32, False, "sm100", 16)


@pytest.mark.parametrize("weights, accumulate, impl", [
    ("contiguous", False, "cublas"), ("contiguous", False, "ours-gemm"),
    ("interleaved", False, "cublas"), ("interleaved", True, "cublas"),
])
def test_grouped_row_checkpoint_gives_the_pair_order_gradients_bitwise(weights, accumulate, impl):
    """Without a gate/up bias and a clamp the fused forward keeps the gate/up GEMM's own output
    rows [S, 2I] as the checkpoint (grouped row order, the weight's column order: interleaved
    for gpt-oss's memory layout, also where a main_grad accumulation writes d_gate_up
    concatenated). The backward reading it by row gives the gradients of the same values in
    pair order [R, 2, I] bit for bit; NaN in the rows no pair owns is never read."""
    from cuda_kernels.moe import moe_forward_fused

    name = "duplicates_dropped"
    T, H, I, E, K, rkw, *_ = CASES[name]
    ei, af = routing(T, K, E, 11, **rkw)
    p = _problem(name)
    w = p.w_gate_up_EH2I.bfloat16()
    interleaved = weights == "interleaved"
    if interleaved:  # memory [E, H, I, 2]: gate i, up i side by side (gpt-oss's gate_up_proj)
        w = w.transpose(2, 3).contiguous().transpose(2, 3)
    out = moe_forward_fused(p.hidden_states_TH, af.to(DEV), ei.to(DEV), w, p.w_down_EIH,
                            grouped_mm=impl)
    S = out.layout.tokens_sum
    assert tuple(out.checkpoint.shape) == (S, 2 * I) and out.checkpoint.dtype == torch.bfloat16
    ck = out.checkpoint.clone()
    ck[out.layout.row_to_pair_S < 0] = float("nan")
    pairs = out.checkpoint_pairs(gate_up_interleaved=interleaved)
    assert tuple(pairs.shape) == (T * K, 2, I)
    q = dataclasses.replace(p, w_gate_up_EH2I=w, plan=out.plan, act_checkpoint_R2I=ck)
    kw = {"layout": out.layout, "x_rows_S": out.x_rows_S, "grouped_mm": impl}

    def acc():
        if not accumulate:
            return None
        return (torch.zeros(E, H, 2, I, device=DEV), torch.zeros(E, I, H, device=DEV))

    got = moe_backward_fused(q, accumulate_into=acc(), **kw)
    want = moe_backward_fused(dataclasses.replace(q, act_checkpoint_R2I=pairs),
                              accumulate_into=acc(), **kw)
    for key, g in got.named().items():
        assert bool(torch.isfinite(g).all()), key
        assert torch.equal(g, want.named()[key]), key
    # the row form needs the layout it was written in, with its S rows; only this backward
    # reads it (the fused dgated kernel included: below)
    with pytest.raises(ValueError, match="needs the layout"):
        moe_backward_fused(q)
    with pytest.raises(ValueError, match=f"S={S} rows"):
        moe_backward_fused(dataclasses.replace(q, act_checkpoint_R2I=torch.cat([ck, ck[:16]])),
                           layout=out.layout)
    with pytest.raises(ValueError, match=r"act_checkpoint_R2I must have shape .*grouped-row"):
        moe_backward_torch(_on_cpu(q))
    from cuda_kernels.triton.activation import activation_backward

    with pytest.raises(ValueError, match=r"checkpoint must be \[R=\d+, 2, I=\d+\]"):
        activation_backward(torch.zeros(S, I, device=DEV), ck[:, :I], out.layout.row_to_pair_S,
                            out.plan, activation=q.activation, clamp_limits=ClampLimits())
    if not interleaved:  # "ours": the dgated epilogue loads row s's g, u at row s
        ours = {**kw, "grouped_mm": "ours"}
        got = moe_backward_fused(q, **ours)
        want = moe_backward_fused(dataclasses.replace(q, act_checkpoint_R2I=pairs), **ours)
        for key, g in got.named().items():
            assert bool(torch.isfinite(g).all()), key
            assert torch.equal(g, want.named()[key]), key
    else:  # its interleaved columns are not the two halves the fused epilogue reads
        with pytest.raises(RuntimeError, match="interleaves them"):
            moe_backward_fused(q, accumulate_into=acc(), **{**kw, "grouped_mm": "ours"})
