"""gpt-oss's interleaved gate/up weight (gate at even, up at odd columns; issue 32) without a
per-call weight copy: :func:`common.torch_backward.gate_up_matrix` views it as the GEMM's matrix,
the activation passes read the GEMM's interleaved columns and write ``d_gate_up`` in that order,
and the weight gradient lands in the weight's own memory layout. CPU: Triton's interpreter, the
GEMMs in torch; against the same weights in the layer's contiguous [E, H, 2, I] layout.
"""

from __future__ import annotations

import pytest
import torch
from test_torch_backward import routing  # the same seeded router as the twin's tests

from common.metrics import sqnr_db
from common.problem import GPT_OSS, ClampLimits, MoEBackwardProblem
from common.routing import plan_routing
from common.torch_backward import (
    gate_up_from_matrix,
    gate_up_matrix,
    grouped_layout,
    moe_backward_torch,
    moe_layer_forward_torch,
)

fwd = pytest.importorskip("cuda_kernels.moe.forward")
bwd = pytest.importorskip("cuda_kernels.moe.backward")
steps = pytest.importorskip("cuda_kernels.moe.steps")
from cuda_kernels.triton.activation import activation_backward, activation_forward  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
T, H, I, E, K = 24, 64, 32, 4, 2  # multiples of 8 (the CuTe kernels run them on a GPU)
CLAMP = ClampLimits(linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0,
                    non_linear_clamp_upper_limit=1.0)


def _layouts(w_EH2I):
    """The same weight in three memories: the layer's contiguous [E, H, 2, I], gpt-oss's
    ``gate_up_proj`` [E, H, 2I] interleaved (transformers' ``is_transposed``) and [E, 2I, H]
    interleaved, each seen as [E, H, 2, I]."""
    tr = w_EH2I.transpose(2, 3).contiguous().view(E, H, 2 * I)  # [E, H, 2I], gate even
    nt = tr.transpose(1, 2).contiguous()  # [E, 2I, H]
    return {
        "contiguous": w_EH2I.contiguous(),
        "interleaved_EH2I": tr.view(E, H, I, 2).transpose(2, 3),
        "interleaved_E2IH": nt.view(E, I, 2, H).permute(0, 3, 2, 1),
    }


def test_gate_up_matrix_is_a_view_of_the_interleaved_memories():
    w = torch.randn(E, H, 2, I)
    for name, v in _layouts(w).items():
        m, interleaved = gate_up_matrix(v)
        assert interleaved == (name != "contiguous"), name
        assert m.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), name
        assert torch.equal(gate_up_from_matrix(m, interleaved), w), name
        assert gate_up_from_matrix(m.contiguous(), interleaved).shape == (E, H, 2, I)


# I: one full column tile (BLOCK_I = 32); I = 24 under a 32-wide tile and I = 160 over two
# 128-wide tiles, where the interleaved load / store masks a tile's tail.
@pytest.mark.parametrize("i_dim", [I, 24, 160])
def test_activation_kernels_read_and_write_interleaved_columns(i_dim):
    """The interleaved passes (one contiguous [BLOCK_M, 2 BLOCK_I] load / store per tile, split
    and joined in registers) give the concatenated passes' values bit for bit."""
    ei, af = routing(T, K, E, 3)
    plan = plan_routing(ei.to(DEV), af.to(DEV), E)
    layout = grouped_layout(plan, E)
    S = layout.tokens_sum
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(S, 2, i_dim, generator=g).bfloat16().to(DEV)
    kw = {"activation": GPT_OSS, "clamp_limits": CLAMP,
          "b_gate_up_E2I": torch.randn(E, 2, i_dim, generator=g).to(DEV)}
    want = activation_forward(gu.reshape(S, 2 * i_dim), layout.row_to_pair_S, plan, **kw)
    got = activation_forward(gu.transpose(1, 2).reshape(S, 2 * i_dim), layout.row_to_pair_S,
                             plan, gate_up_interleaved=True, **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    dh = torch.randn(S, i_dim, generator=g).bfloat16().to(DEV)
    kw.pop("b_gate_up_E2I")
    want = activation_backward(dh, want[0], layout.row_to_pair_S, plan, **kw)
    got = activation_backward(dh, got[0], layout.row_to_pair_S, plan, gate_up_interleaved=True,
                              **kw)
    inter = got[0].view(S, i_dim, 2).transpose(1, 2).reshape(S, 2 * i_dim)
    assert torch.equal(inter, want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def _problem(seed=0):
    ei, af = routing(T, K, E, seed + 3, drop_frac=0.1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    wgu = (torch.randn(E, H, 2, I, generator=g) * H**-0.5).bfloat16()
    wd = (torch.randn(E, I, H, generator=g) * I**-0.5).bfloat16()
    bgu, bd = 0.3 * torch.randn(E, 2, I, generator=g), 0.3 * torch.randn(E, H, generator=g)
    return [t.to(DEV) for t in (x, af.float(), ei, wgu, wd, bgu, bd, dy)]


def _step(forward, backward, x, af, ei, wgu, wd, bgu, bd, dy, **kw):
    out = forward(x, af, ei, wgu, wd, bgu, bd, clamp_limits=CLAMP, activation=GPT_OSS, **kw)
    p = MoEBackwardProblem(hidden_states_TH=x, output_grad_TH=dy, w_gate_up_EH2I=wgu,
                           w_down_EIH=wd, plan=out.plan, act_checkpoint_R2I=out.checkpoint,
                           b_gate_up_E2I=bgu, b_down_EH=bd, clamp_limits=CLAMP,
                           activation=GPT_OSS)
    return out, backward(p, out)


def _fused_backward(impl):
    return lambda p, out: bwd.moe_backward_fused(p, grad_dtype=torch.bfloat16, layout=out.layout,
                                                 x_rows_S=out.x_rows_S, grouped_mm=impl)


@pytest.mark.parametrize("impl", ["cublas", "ours-gemm", "auto"])
@pytest.mark.parametrize("layout", ["interleaved_EH2I", "interleaved_E2IH"])
def test_fused_pipelines_on_interleaved_weights(monkeypatch, impl, layout):
    """y, the checkpoint and every gradient as with the contiguous weight; the GEMMs read the
    weight's own storage (no copy) and dW_gate_up comes back in its memory layout."""
    x, af, ei, wgu, wd, bgu, bd, dy = _problem()
    wv = _layouts(wgu)[layout]
    run = (lambda w: _step(lambda *a, **k: fwd.moe_forward_fused(*a, grouped_mm=impl, **k),
                           _fused_backward(impl), x, af, ei, w, wd, bgu, bd, dy))
    want_out, want = run(wgu)
    seen = []
    orig = steps.rows_times_experts

    def record(a, w, offs):
        seen.append(w.untyped_storage().data_ptr())
        return orig(a, w, offs)

    for mod in (steps, fwd, bwd):
        monkeypatch.setattr(mod, "rows_times_experts", record)
    got_out, got = run(wv)
    assert torch.equal(got_out.checkpoint, want_out.checkpoint)
    assert sqnr_db(got_out.y_TH.double(), want_out.y_TH.double()) >= 50
    assert wv.untyped_storage().data_ptr() in seen  # the dX GEMM read the weight itself
    assert got.w_gate_up_grad_EH2I.stride() == wv.stride()
    for key, g in got.named().items():
        assert sqnr_db(g.double(), want.named()[key].double()) >= 50, key


def test_ours_refuses_interleaved_weights_by_name():
    x, af, ei, wgu, wd, bgu, bd, dy = _problem()
    wv = _layouts(wgu)["interleaved_EH2I"]
    with pytest.raises(RuntimeError, match="interleaves them"):
        fwd.moe_forward_fused(x, af, ei, wv, wd, bgu, bd, clamp_limits=CLAMP,
                              activation=GPT_OSS, grouped_mm="ours")


@pytest.mark.parametrize("layout", ["interleaved_EH2I", "interleaved_E2IH"])
def test_portable_path_on_interleaved_weights(layout):
    x, af, ei, wgu, wd, bgu, bd, dy = (t.cpu() for t in _problem(1))
    wv = _layouts(wgu)[layout]
    runs = [_step(moe_layer_forward_torch, lambda p, out: moe_backward_torch(p),
                  x, af, ei, w, wd, bgu, bd, dy) for w in (wgu, wv)]
    (want_out, want), (got_out, got) = runs
    assert torch.equal(got_out.checkpoint, want_out.checkpoint)
    assert sqnr_db(got_out.y_TH.double(), want_out.y_TH.double()) >= 50
    for key, g in got.named().items():
        assert sqnr_db(g.double(), want.named()[key].double()) >= 50, key
