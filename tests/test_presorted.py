"""The torchtitan seam on rows already in expert order (issue 32): the identity routing
(:func:`common.routing.presorted_routing`) against :func:`common.routing.plan_routing` of the
same ids, the fused pipelines on it (CPU: Triton's interpreter, the GEMMs in torch, the CuTe
kernels' torch twins) against the same pipelines with the routing build, and that the identity
path runs no routing build, no gather and no per-token combine. Separate gate and up weights
(torchtitan's ``w1`` / ``w3``, issue 32 item 2): the two-operand activation passes against the
concatenated ones, the split pipelines (``moe_forward_split_gate_up`` /
``moe_backward_split_gate_up``) against the concatenated weight's and float64, the seam's op on
that pipeline reading the weights in place (no copy, concatenation or transposition of a weight;
gradients straight into the parameters' layout), the portable path's results, bad input. GPU
tests (``gpu``-marked): the seam through the fused CUDA path against torchtitan's formula,
without host synchronisation.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from common.metrics import sqnr_db
from common.problem import GPT_OSS, ClampLimits, MoEBackwardProblem
from common.routing import plan_routing, presorted_routing

fwd = pytest.importorskip("cuda_kernels.moe.forward")
bwd = pytest.importorskip("cuda_kernels.moe.backward")
steps = pytest.importorskip("cuda_kernels.moe.steps")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I = 4, 64, 32  # multiples of 8 (the CuTe kernels run them on a GPU)
COUNTS = [3, 0, 5, 2]  # an empty expert
ROWS = 13  # three trailing padding rows


def _expert_ids(counts, rows):
    """[rows, 1] expert of each row in order, -1 past the total (the seam's old routing)."""
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.cat([ids, ids.new_full((rows - ids.numel(),), -1)]).reshape(rows, 1)


@pytest.mark.parametrize("counts, rows", [(COUNTS, ROWS), ([0, 0, 0, 0], 5), ([2, 2, 2, 2], 8),
                                          ([6, 0, 0, 1], 7)])
def test_presorted_routing_is_plan_routing_of_the_sorted_ids(counts, rows):
    plan, layout = presorted_routing(torch.tensor(counts), rows)
    ids = _expert_ids(counts, rows)
    want = plan_routing(ids, torch.ones(rows, 1), len(counts))
    for f in ("pair_token_R", "pair_expert_R", "pair_affinity_R", "slot_to_pair_TK",
              "tokens_per_expert_E", "num_pairs"):
        assert torch.equal(getattr(plan, f), getattr(want, f)), f
    r = torch.arange(rows)
    real = torch.where(r < sum(counts), r, -1)
    assert layout.identity and layout.tokens_sum == rows and layout.align == 1
    assert torch.equal(layout.offsets_E, torch.tensor(counts).cumsum(0).to(torch.int32))
    for f in ("row_to_token_S", "row_to_pair_S"):
        assert torch.equal(getattr(layout, f), real), f
    assert torch.equal(layout.slot_to_row_TK, real.reshape(rows, 1))


@pytest.mark.parametrize("counts, effective", [([9, 9, 0, 0], [9, 4, 0, 0]),
                                               ([-3, 4, 2**62, 5], [0, 4, 9, 0])])
def test_presorted_routing_clamps_bad_counts(counts, effective):
    plan, layout = presorted_routing(torch.tensor(counts), 13)
    want, want_layout = presorted_routing(torch.tensor(effective), 13)
    assert torch.equal(layout.offsets_E, want_layout.offsets_E)
    assert torch.equal(plan.pair_expert_R, want.pair_expert_R)
    with pytest.raises(ValueError, match="num_rows_per_expert_E"):
        presorted_routing(torch.ones(4), 13)


def _problem_inputs(seed=0, nan_padding=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, H, generator=g).bfloat16()
    dy = torch.randn(ROWS, H, generator=g).bfloat16()
    if nan_padding:  # padding rows are never read: NaN there changes nothing
        x[sum(COUNTS):] = float("nan")
        dy[sum(COUNTS):] = float("nan")
    wgu = (torch.randn(E, H, 2, I, generator=g) * H**-0.5).bfloat16()
    wd = (torch.randn(E, I, H, generator=g) * I**-0.5).bfloat16()
    return [t.to(DEV) for t in (x, dy, wgu, wd)]


def _run(x, dy, wgu, wd, impl, routing):
    """The fused forward and backward, with the given routing or (None) the routing build."""
    if routing is None:
        ids = _expert_ids(COUNTS, ROWS).to(DEV)
        out = fwd.moe_forward_fused(x, torch.ones(ROWS, 1, device=DEV), ids, wgu, wd,
                                    grouped_mm=impl)
    else:
        out = fwd.moe_forward_fused(x, None, None, wgu, wd, grouped_mm=impl, routing=routing)
    p = MoEBackwardProblem(hidden_states_TH=x, output_grad_TH=dy, w_gate_up_EH2I=wgu,
                           w_down_EIH=wd, plan=out.plan, act_checkpoint_R2I=out.checkpoint)
    grads = bwd.moe_backward_fused(p, grad_dtype=torch.bfloat16, layout=out.layout,
                                   x_rows_S=None if routing is not None else out.x_rows_S,
                                   grouped_mm=impl)
    return out, grads


@pytest.mark.parametrize("impl", ["cublas", "ours", "ours-gemm"])
def test_fused_pipelines_on_the_identity_layout_match_the_routing_build(impl):
    """Same math, same checkpoint; y and the gradients agree with the routed pipeline's (the
    GEMMs' row blocking differs: fp32 sums in another order), padding rows give exactly 0 and
    NaN in the padding rows of x and dY reaches nothing."""
    x, dy, wgu, wd = _problem_inputs()
    want_out, want = _run(x, dy, wgu, wd, impl, None)
    got_out, got = _run(x, dy, wgu, wd, impl, presorted_routing(torch.tensor(COUNTS, device=DEV),
                                                                ROWS))
    n = sum(COUNTS)
    assert torch.equal(got_out.checkpoint_pairs(), want_out.checkpoint_pairs())
    assert got_out.y_TH.dtype == x.dtype and not bool(got_out.y_TH[n:].any())
    assert sqnr_db(got_out.y_TH[:n].double(), want_out.y_TH[:n].double()) >= 45
    assert not bool(got.hidden_states_grad_TH[n:].any())
    for key, g in got.named().items():
        if key.startswith("affinity"):
            continue  # (the seam has no affinity)
        w = want.named()[key]
        assert bool(torch.isfinite(g).all()), key
        assert sqnr_db(g.double(), w.double()) >= 45, key


def test_identity_path_builds_no_routing_gathers_nothing_and_combines_nothing(monkeypatch):
    """With the identity layout the forward and backward never call the routing build, the row
    gathers or the per-token sum, and the GEMMs read x and dY in place (same storage)."""
    def refuse(*_a, **_k):
        raise AssertionError("called on the identity path")

    for mod, name in ((fwd, "build_routing"), (fwd, "token_sum"), (steps, "gather_rows"),
                      (bwd, "gather_rows"), (bwd, "token_sum")):
        monkeypatch.setattr(mod, name, refuse)
    seen = []
    orig = steps.rows_times_experts

    def record(a, w, offs):
        seen.append(a.untyped_storage().data_ptr())
        return orig(a, w, offs)

    monkeypatch.setattr(steps, "rows_times_experts", record)
    x, dy, wgu, wd = _problem_inputs(nan_padding=False)
    out, grads = _run(x, dy, wgu, wd, "cublas", presorted_routing(
        torch.tensor(COUNTS, device=DEV), ROWS))
    ptrs = {t.untyped_storage().data_ptr() for t in (x, dy)}
    assert len(ptrs & set(seen)) == 2  # the gate/up GEMM read x, the down dgrad dY
    assert out.x_rows_S is x
    assert bool(grads.w_gate_up_grad_EH2I.abs().sum() > 0)


@gpu
@needs_cuda
def test_seam_on_cuda_matches_torchtitan_formula_without_sync():
    """The seam on the fused CUDA path: y and the gradients against torchtitan's formula in
    float64 on the same BF16 inputs, no host synchronisation (``set_sync_debug_mode``)."""
    from common.layer import run_experts_grouped_mm

    E_, H_, I_ = 8, 256, 128
    counts = torch.tensor([40, 0, 17, 64, 3, 0, 90, 26], device="cuda")
    rows = int(counts.sum()) + 5
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = ((torch.randn(E_, I_, H_, generator=g, device="cuda") * H_**-0.5).bfloat16()
              for _ in range(2))
    w2 = (torch.randn(E_, H_, I_, generator=g, device="cuda") * I_**-0.5).bfloat16()
    x = torch.randn(rows, H_, generator=g, device="cuda").bfloat16()
    dy = torch.randn(rows, H_, generator=g, device="cuda").bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    warm = run_experts_grouped_mm(leaves[1], leaves[2], leaves[3], leaves[0], counts)
    torch.autograd.backward(warm, dy)  # compiles and caches every choice first
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = run_experts_grouped_mm(leaves[1], leaves[2], leaves[3], leaves[0], counts)
        torch.autograd.backward(y, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = [t.double().requires_grad_() for t in (x, w1, w2, w3)]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = ref[0][start:start + n]
        h = torch.nn.functional.silu(xe @ ref[1][e].T) * (xe @ ref[3][e].T)
        outs.append(h @ ref[2][e].T)
        start += n
    outs.append(ref[0].new_zeros(rows - start, H_))
    y_ref = torch.cat(outs)
    torch.autograd.backward(y_ref, dy.double())
    assert not bool(y[start:].any())
    assert sqnr_db(y.double(), y_ref) >= 40
    for name, a, b in zip(("dx", "dw1", "dw2", "dw3"), leaves, ref):
        assert sqnr_db(a.grad.double(), b.grad) >= 38, name


def _seam_args(rows=ROWS, seed=1):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, I, H, generator=g).requires_grad_() for _ in range(2))
    w2 = torch.randn(E, H, I, generator=g).requires_grad_()
    return w1, w2, w3, torch.randn(rows, H, generator=g).requires_grad_()


def test_opcheck_experts_forward_presorted():
    from common import layer_ops
    from common.layer import MoEExpertsOptions, down_from_torchtitan, gate_up_from_torchtitan

    w1, w2, w3, x = _seam_args()
    key = layer_ops.options_key(MoEExpertsOptions(validate_routing="off"))
    wgu = gate_up_from_torchtitan(w1, w3).detach().requires_grad_()
    wd = down_from_torchtitan(w2).detach().requires_grad_()
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward_presorted,
                          (x, wgu, wd, torch.tensor(COUNTS), key))


def test_compiled_seam_no_recompile_on_new_counts():
    """``torch.compile(fullgraph=True)`` of the seam: one graph for three count vectors (same
    rows), results equal eager's."""
    from common.layer import run_experts_grouped_mm

    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(run_experts_grouped_mm, fullgraph=True, backend=counter)
    w1, w2, w3, x = _seam_args()
    for counts in (COUNTS, [0, 13, 0, 0], [1, 2, 3, 4]):
        n = torch.tensor(counts)
        y = fn(w1, w2, w3, x, n)
        assert torch.equal(y, run_experts_grouped_mm(w1, w2, w3, x, n))
        assert not bool(y[sum(counts):].any())
    assert counter.frame_count == 1


def test_seam_with_zero_rows():
    from common.layer import run_experts_grouped_mm

    w1, w2, w3, x = _seam_args(rows=0)
    y = run_experts_grouped_mm(w1, w2, w3, x, torch.zeros(E, dtype=torch.int64))
    assert y.shape == (0, H)
    y.sum().backward()
    for t in (x, w1, w2, w3):
        assert t.grad.shape == t.shape and not bool(t.grad.any())



# ------------------------------------------------------ separate gate and up weights (w1 / w3)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from cuda_kernels.triton.activation import activation_backward, activation_forward  # noqa: E402

SPLIT_MIN_DB = 45.0  # the split pipeline against the concatenated one: dX rounds twice (BF16)
CLAMP = ClampLimits(linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0,
                    non_linear_clamp_upper_limit=1.0)


def test_activation_passes_take_gate_and_up_as_two_operands():
    """Forward: gate and up read through two row pointers (``up_SI``, any row stride) give
    bit for bit the outputs of the concatenated [S, 2I] row; backward: ``gate_up_apart`` writes
    dg and du as two dense [S, I] that equal the concatenated row's halves (routed plan with
    affinities, dropped slots, bias, clamps and gpt-oss's activation)."""
    from test_torch_backward import routing

    from common.torch_backward import grouped_layout

    T, K = 24, 2
    ei, af = routing(T, K, E, 3, drop_frac=0.1)
    plan = plan_routing(ei.to(DEV), af.to(DEV), E)
    layout = grouped_layout(plan, E)
    S = layout.tokens_sum
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(S, 2 * I, generator=g).bfloat16().to(DEV)
    kw = {"activation": GPT_OSS, "clamp_limits": CLAMP}
    bias = torch.randn(E, 2, I, generator=g).to(DEV)
    want = activation_forward(gu, layout.row_to_pair_S, plan, b_gate_up_E2I=bias, **kw)
    wide = torch.full((S, 3 * I), float("nan"), dtype=torch.bfloat16, device=DEV)
    wide[:, I:2 * I] = gu[:, I:]  # up rows at row stride 3I, NaN around them
    got = activation_forward(gu[:, :I].contiguous(), layout.row_to_pair_S, plan,
                             b_gate_up_E2I=bias, up_SI=wide[:, I:2 * I], **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    dh = torch.randn(S, I, generator=g).bfloat16().to(DEV)
    want = activation_backward(dh, want[0], layout.row_to_pair_S, plan, **kw)
    got = activation_backward(dh, got[0], layout.row_to_pair_S, plan, gate_up_apart=True, **kw)
    assert got[0].shape == (2, S, I) and got[0][0].is_contiguous() and got[0][1].is_contiguous()
    assert torch.equal(got[0][0], want[0][:, :I]) and torch.equal(got[0][1], want[0][:, I:])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    pad = layout.row_to_pair_S < 0
    assert bool(pad.any()) and not bool(got[0][:, pad].any())  # padding rows exactly 0


def _split_inputs(seed=0, nan_padding=True):
    """``(x, dy, w1, w3, w2)`` BF16 as torchtitan holds them: w1 / w3 [E, I, H], w2 [E, H, I]."""
    x, dy, _, _ = _problem_inputs(seed, nan_padding)
    g = torch.Generator().manual_seed(seed + 100)
    w1, w3 = ((torch.randn(E, I, H, generator=g) * H**-0.5).bfloat16().to(DEV)
              for _ in range(2))
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16().to(DEV)
    return x, dy, w1, w3, w2


def _cat_EH2I(w1, w3):
    """The concatenated [E, H, 2, I] weight of today's copy path (``gate_up_from_torchtitan``)."""
    return torch.cat([w1, w3], dim=1).view(E, 2, I, H).permute(0, 3, 1, 2)


def _titan_f64(x, w1, w2, w3, counts, dy):
    """torchtitan's GroupedExperts math in float64: ``(y, dx, dw1, dw2, dw3)``."""
    leaves = [t.double().requires_grad_() for t in (x, w1, w2, w3)]
    xd, w1d, w2d, w3d = leaves
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = xd[start:start + n]
        h = torch.nn.functional.silu(xe @ w1d[e].T) * (xe @ w3d[e].T)
        outs.append(h @ w2d[e].T)
        start += n
    outs.append(xd.new_zeros(xd.shape[0] - start, xd.shape[1]))
    y = torch.cat(outs)
    dyd = torch.nan_to_num(dy.double())[: y.shape[0]]
    dyd[start:] = 0
    torch.autograd.backward(y, dyd)
    return (y.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("impl", ["cublas", "ours-gemm", "auto"])
def test_split_gate_up_pipelines_match_the_concatenated_weight(impl):
    """y, the checkpoint and every gradient of the two-operand pipelines against the fused
    pipelines on ``cat([w1, w3])`` (today's copy path) on the same identity layout, and against
    float64; padding rows give exactly 0, NaN in the padding rows of x and dY reaches nothing,
    dW_gate / dW_up come back [E, I, H] contiguous (w1 / w3's layout) and dW_down in w2's."""
    x, dy, w1, w3, w2 = _split_inputs()
    wd = w2.transpose(1, 2)
    rt = presorted_routing(torch.tensor(COUNTS, device=DEV), ROWS)
    got_out = fwd.moe_forward_split_gate_up(x, w1, w3, wd, rt, grouped_mm=impl)
    dx, dw1, dw3, dw2, info = bwd.moe_backward_split_gate_up(
        dy, x, w1, w3, wd, got_out.checkpoint, rt, grad_dtype=torch.bfloat16, grouped_mm=impl)
    wgu = _cat_EH2I(w1, w3)
    want_out, want = _run(x, dy, wgu, wd, "cublas" if impl == "auto" else impl, rt)
    n = sum(COUNTS)
    assert torch.equal(got_out.checkpoint, want_out.checkpoint_pairs())
    assert got_out.x_rows_S is x  # read in place
    assert got_out.y_TH.dtype == x.dtype and not bool(got_out.y_TH[n:].any())
    assert sqnr_db(got_out.y_TH[:n].double(), want_out.y_TH[:n].double()) >= SPLIT_MIN_DB
    assert not bool(dx[n:].any())
    dwgu = want.w_gate_up_grad_EH2I
    pairs = {"dx": (dx, want.hidden_states_grad_TH), "dw1": (dw1, dwgu[:, :, 0].transpose(1, 2)),
             "dw3": (dw3, dwgu[:, :, 1].transpose(1, 2)), "dw2": (dw2, want.w_down_grad_EIH)}
    for key, (a, b) in pairs.items():
        assert a.dtype == torch.bfloat16 and bool(torch.isfinite(a).all()), key
        assert sqnr_db(a.double(), b.double()) >= SPLIT_MIN_DB, key
    assert dw1.is_contiguous() and dw3.is_contiguous() and dw1.shape == (E, I, H)
    assert dw2.transpose(1, 2).is_contiguous()  # w2's [E, H, I] memory, no transpose
    assert info["grouped_mm"] == ("ours-gemm" if impl == "ours-gemm" else "cublas")
    ref = _titan_f64(x[:n], w1, w2, w3, COUNTS, dy)
    for key, a, b in zip(("y", "dx", "dw1", "dw2", "dw3"),
                         (got_out.y_TH[:n], dx[:n], dw1, dw2.transpose(1, 2), dw3), ref):
        assert sqnr_db(a.double(), b) >= 38, key


class _WeightReads(TorchDispatchMode):
    """Records every op that reads a weight's storage and is neither a view nor a GEMM (a copy,
    concatenation, transposition into new memory, dtype cast, ...), and the seam's custom ops'
    weight arguments' storages (``moe_bwd`` ops are the boundary: allowed)."""

    def __init__(self, weights):
        super().__init__()
        self.ptrs = {w.untyped_storage().data_ptr() for w in weights}
        self.copies = []
        self.op_inputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)]
        hit = [a for a in flat if a.untyped_storage().data_ptr() in self.ptrs]
        name = func.name()
        if name.startswith("moe_bwd::"):
            self.op_inputs.append((name, [a.untyped_storage().data_ptr() for a in flat]))
        elif hit and not func.is_view and "mm" not in name and name != "aten::matmul":
            self.copies.append(name)
        return func(*args, **kwargs)


def _stand_in_cuda_backend(monkeypatch, record):
    """The seam's ops on the CUDA backend's split pipeline on CPU tensors (Triton's interpreter,
    the GEMMs in torch): the ``cuda-sm90`` Backend without its device check; each hook runs
    inside :class:`_WeightReads` and appends ``(its mode, its outputs' data pointers)`` to
    ``record`` (pointers only: a reference kept here would make autograd copy a gradient). The
    CPU GEMMs keep BF16 operands (this CPU's BF16 matmul widens them to fp32 otherwise: a copy
    that the GPU's GEMMs do not make)."""
    import dataclasses

    import cuda_kernels.backend  # noqa: F401 - registers the CUDA backends
    from common import dispatch, layer_ops, torch_backward

    real = dispatch.registered_backends()["cuda-sm90"]

    def watched(fn):
        def run(*args, **kwargs):
            mode = _WeightReads(args[2:5] if len(args) > 6 else args[1:4])
            with mode:
                out = fn(*args, **kwargs)
            tensors = out[:4] if isinstance(out, tuple) else (out.y_TH,)
            record.append((mode, [t.data_ptr() for t in tensors]))
            return out
        return run

    stand_in = dataclasses.replace(
        real, check=lambda: None, forward_split_gate_up=watched(real.forward_split_gate_up),
        run_split_gate_up=watched(real.run_split_gate_up))
    monkeypatch.setattr(layer_ops, "resolve_backend", lambda name, device: stand_in)
    monkeypatch.setattr(torch_backward, "_cpu_has_fast_bf16", lambda: True)


def _seam_leaves(x, w1, w3, w2):
    return [t.detach().clone().requires_grad_() for t in (x, w1, w2, w3)]


def test_seam_reads_separate_w1_w3_in_place_and_writes_their_grads_in_place(monkeypatch):
    """The seam on torchtitan's separate w1 / w3 (CUDA pipeline, on the CPU): the op receives
    w1's and w3's own storage, nothing before or inside it copies, concatenates or transposes a
    weight (every op that reads one is a view or a GEMM), and the gradients the pipeline writes
    ARE the parameters' ``.grad`` (same memory: [E, I, H] as w1 / w3 hold it, nothing split or
    copied afterwards). Values against float64 and against the portable CPU path."""
    from common.layer import run_experts_grouped_mm

    x0, dy, w10, w30, w20 = _split_inputs(nan_padding=False)
    counts = torch.tensor(COUNTS, device=DEV)
    record = []
    _stand_in_cuda_backend(monkeypatch, record)
    x, w1, w2, w3 = _seam_leaves(x0, w10, w30, w20)
    outer = _WeightReads([w1, w2, w3])
    with outer:
        y = run_experts_grouped_mm(w1, w2, w3, x, counts)
        y.backward(dy)
    (fmode, _), (bmode, bout) = record
    assert outer.copies == [] and fmode.copies == [] and bmode.copies == []
    ptrs = [w1.untyped_storage().data_ptr(), w3.untyped_storage().data_ptr()]
    fwd_op = [p for name, p in outer.op_inputs if "experts_forward_presorted_split" in name]
    assert len(fwd_op) == 1 and fwd_op[0][1:3] == ptrs  # (x, w1, w3, w2, counts)
    assert bout[1:] == [w1.grad.data_ptr(), w3.grad.data_ptr(), w2.grad.data_ptr()]
    for w in (w1, w2, w3):
        assert w.grad.stride() == w.stride()
    n = sum(COUNTS)
    ref = _titan_f64(x0[:n], w10, w20, w30, COUNTS, dy)
    ours = (y[:n], x.grad[:n], w1.grad, w2.grad, w3.grad)
    for key, a, b in zip(("y", "dx", "dw1", "dw2", "dw3"), ours, ref):
        assert sqnr_db(a.detach().double(), b) >= 38, key
    assert not bool(y[n:].any()) and not bool(x.grad[n:].any())
    monkeypatch.undo()  # the portable path (the CPU's backend): the same results
    px, pw1, pw2, pw3 = _seam_leaves(x0, w10, w30, w20)
    py = run_experts_grouped_mm(pw1, pw2, pw3, px, counts)
    py.backward(dy)
    for key, a, b in zip(("y", "dx", "dw1", "dw2", "dw3"), ours,
                         (py[:n], px.grad[:n], pw1.grad, pw2.grad, pw3.grad)):
        assert sqnr_db(a.detach().double(), b.detach().double()) >= 40, key


def test_portable_seam_passes_w1_w3_storage_to_the_op():
    """On the portable CPU path the seam itself copies no weight either: the op receives w1 and
    w3 (it concatenates them inside, on the CPU only: the path of backends without
    ``forward_split_gate_up``)."""
    from common.layer import run_experts_grouped_mm

    x0, dy, w10, w30, w20 = (t.cpu() for t in _split_inputs(nan_padding=False))
    x, w1, w2, w3 = _seam_leaves(x0, w10, w30, w20)
    outer = _WeightReads([w1, w2, w3])
    with outer:
        run_experts_grouped_mm(w1, w2, w3, x, torch.tensor(COUNTS)).backward(dy)
    assert outer.copies == []
    names = [name for name, _ in outer.op_inputs]
    assert names == ["moe_bwd::experts_forward_presorted_split",
                     "moe_bwd::experts_backward_presorted_split"]
    ptrs = [w1.untyped_storage().data_ptr(), w3.untyped_storage().data_ptr()]
    assert outer.op_inputs[0][1][1:3] == ptrs and outer.op_inputs[1][1][2:4] == ptrs


def test_seam_keeps_the_view_for_fused_storage_and_compiles_to_the_split_op():
    """Eager: w1 / w3 halves of one [E, 2I, H] leaf go to the one-operand op as a view of that
    storage. Compiled (``fullgraph=True``, storage identity not traceable): the split op, no
    ``cat`` in the graph, the same values."""
    from common.layer import run_experts_grouped_mm

    g = torch.Generator().manual_seed(7)
    W = torch.randn(E, 2 * I, H, generator=g).requires_grad_()
    w2 = torch.randn(E, H, I, generator=g).requires_grad_()
    x = torch.randn(ROWS, H, generator=g)
    counts = torch.tensor(COUNTS)
    mode = _WeightReads([W, w2])
    with mode:
        y = run_experts_grouped_mm(W[:, :I], w2, W[:, I:], x, counts)
    assert [n for n, _ in mode.op_inputs] == ["moe_bwd::experts_forward_presorted"]
    assert mode.op_inputs[0][1][1] == W.untyped_storage().data_ptr() and mode.copies == []
    graphs = torch._dynamo.testing.EagerAndRecordGraphs()
    fn = torch.compile(run_experts_grouped_mm, fullgraph=True, backend=graphs)
    yc = fn(W[:, :I], w2, W[:, I:], x, counts)
    code = graphs.graphs[0].code
    assert "experts_forward_presorted_split" in code and "cat" not in code
    torch.testing.assert_close(yc, y, rtol=1e-2, atol=1e-2)


def test_opcheck_experts_forward_presorted_split():
    from common import layer_ops
    from common.layer import MoEExpertsOptions, down_from_torchtitan

    w1, w2, w3, x = _seam_args()
    key = layer_ops.options_key(MoEExpertsOptions(validate_routing="off"))
    wd = down_from_torchtitan(w2).detach().requires_grad_()
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward_presorted_split,
                          (x, w1, w3, wd, torch.tensor(COUNTS), key))


def test_split_gate_up_bad_input():
    """Each bad argument of the split pipelines and the two-operand activation passes is a
    named error before any output is written."""
    x, dy, w1, w3, w2 = _split_inputs()
    wd = w2.transpose(1, 2)
    rt = presorted_routing(torch.tensor(COUNTS, device=DEV), ROWS)
    act = fwd.moe_forward_split_gate_up(x, w1, w3, wd, rt).checkpoint
    f = fwd.moe_forward_split_gate_up
    b = bwd.moe_backward_split_gate_up
    cases = [
        (lambda: f(x[:, :8], w1, w3, wd, rt), ValueError, "w_gate_EIH"),
        (lambda: f(x, w1, w3[:, :8], wd, rt), ValueError, "w_up_EIH"),
        (lambda: f(x, w1, w3, w2, rt), ValueError, "w_down_EIH"),
        (lambda: f(x.long(), w1, w3, wd, rt), ValueError, "x_SH"),
        (lambda: f(x, w1, w3.to("meta"), wd, rt), ValueError, "w_up_EIH is on meta"),
        (lambda: f(x, w1, w3, wd, presorted_routing(torch.tensor(COUNTS), ROWS + 1)),
         ValueError, "identity layout"),
        (lambda: f(x, w1, w3, wd, rt, grouped_mm="ours"), RuntimeError, "separate gate and up"),
        (lambda: f(x, w1, w3, wd, rt, grouped_mm="bogus"), ValueError, "grouped_mm"),
        (lambda: b(dy[:4], x, w1, w3, wd, act, rt), ValueError, "grad_y_SH"),
        (lambda: b(dy, x, w1, w3, wd, act[:, 0], rt), ValueError, "act_R2I"),
        (lambda: b(dy, x, w1, w3, wd, act, rt, grad_dtype=torch.float16), ValueError,
         "grad_dtype"),
        (lambda: b(dy, x, w1, w3, wd, act, rt, grouped_mm="ours"), RuntimeError, "separate"),
        (lambda: activation_forward(x[:, :I], rt[1].row_to_pair_S, rt[0], activation=None,
                                    clamp_limits=ClampLimits(), up_SI=x[:5, :I]),
         ValueError, "up_SI"),
        (lambda: activation_forward(x[:, :I], rt[1].row_to_pair_S, rt[0], activation=None,
                                    clamp_limits=ClampLimits(), up_SI=x[:, :I],
                                    gate_up_interleaved=True), ValueError, "interleaved"),
        (lambda: activation_backward(x[:, :I], act, rt[1].row_to_pair_S, rt[0], activation=None,
                                     clamp_limits=ClampLimits(), gate_up_apart=True,
                                     gate_up_interleaved=True), ValueError, "exclude"),
    ]
    plan_layout = plan_routing(_expert_ids(COUNTS, ROWS).to(DEV), torch.ones(ROWS, 1,
                                                                            device=DEV), E)
    from common.torch_backward import grouped_layout

    cases.append((lambda: f(x, w1, w3, wd, (plan_layout, grouped_layout(plan_layout, E))),
                  ValueError, "identity layout"))
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
