"""The torchtitan seam on rows already in expert order (issue 32): the identity routing
(:func:`common.routing.presorted_routing`) against :func:`common.routing.plan_routing` of the
same ids, the fused pipelines on it (CPU: Triton's interpreter, the GEMMs in torch, the CuTe
kernels' torch twins) against the same pipelines with the routing build, and that the identity
path runs no routing build, no gather and no per-token combine. GPU tests (``gpu``-marked): the
seam through the fused CUDA path against torchtitan's formula, without host synchronisation.
"""

from __future__ import annotations

import pytest
import torch

from common.metrics import sqnr_db
from common.problem import MoEBackwardProblem
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
