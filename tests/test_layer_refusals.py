"""What a new user of :class:`common.layer.MoEExperts` meets first: bad arguments give the same
ValueError under ``torch.compile(fullgraph=True)`` as in eager, a device or backend that cannot
run is refused when the module is built or moved, and ``validate_routing="off"`` does what its
docstring says with out-of-range ids."""

from __future__ import annotations

import pytest
import torch

from common import dispatch
from common.layer import MoEExperts

T, H, I, E, K = 16, 32, 16, 4, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    idx = torch.randint(0, E, (T, K), generator=g)
    aff = torch.rand(T, K, generator=g)
    return x, idx, aff


def _bad_calls():
    x, idx, aff = _inputs()
    return {
        "token count": ((x, idx[:-1], aff[:-1]), r"expert_index_TK must be a 2-D \[T=16, K\]"),
        "x dtype": ((x.to(torch.int32), idx, aff), "hidden_states_TH must be a floating"),
        "id dtype": ((x, idx.float(), aff), "expert_index_TK must have an integer dtype"),
        "affinity shape": ((x, idx, aff[:, :1]), r"affinity_TK must have shape \[16, 2\]"),
        "id range": ((x, idx + E, aff), r"values must lie in \[-1, num_experts=4\)"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_compiled_fullgraph_raises_the_eager_value_error(case):
    args, pattern = _bad_calls()[case]
    layer = MoEExperts(E, H, I, dtype=torch.float32)

    def block(x, idx, aff):
        return layer(x, idx, aff).sum()

    with pytest.raises(ValueError, match=pattern) as eager:
        block(*args)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError) as traced:
        compiled(*args)
    assert str(traced.value) == str(eager.value)
    # and the compiled block still computes good calls, equal to eager
    assert torch.equal(compiled(*_inputs()), block(*_inputs()))


def test_compiled_wrong_weight_shape_raises_the_eager_value_error():
    layer = MoEExperts(E, H, I, dtype=torch.float32)
    layer.w_down = torch.nn.Parameter(torch.zeros(E, I + 1, H))

    def block(x, idx, aff):
        return layer(x, idx, aff)

    with pytest.raises(ValueError, match=r"w_down_EIH must have shape \[4, 16, 32\]") as eager:
        block(*_inputs())
    torch._dynamo.reset()
    with pytest.raises(ValueError) as traced:
        torch.compile(block, fullgraph=True, backend="aot_eager")(*_inputs())
    assert str(traced.value) == str(eager.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_cuda_device_refused_at_build_and_at_move():
    with pytest.raises(RuntimeError, match="device 'cuda' cannot be used here"):
        MoEExperts(E, H, I, device="cuda")
    layer = MoEExperts(E, H, I)
    with pytest.raises(RuntimeError, match="cannot move to that device"):
        layer.to("cuda")


@pytest.mark.parametrize("name", ["cuda-sm90", "cuda-sm100", "nki"])
def test_unrunnable_backend_refused_at_build(name):
    reason = dispatch._unavailable_reason(name)
    if reason is None:
        pytest.skip(f"{name} can run on this machine")
    with pytest.raises(RuntimeError, match=f"backend '{name}'.*cannot run here") as err:
        MoEExperts(E, H, I, backend=name)
    assert reason in str(err.value)


def test_backend_checked_again_when_moved(monkeypatch):
    """A backend that can run on one device only: built on the meta device (not checked), it
    is refused when ``to_empty`` places it on the CPU."""
    fake = dispatch.Backend(name="cuda-sm90", summary="test", check=lambda: "no SM90 GPU here",
                            run=None)
    monkeypatch.setitem(dispatch._REGISTRY, "cuda-sm90", fake)
    layer = MoEExperts(E, H, I, backend="cuda-sm90", device="meta")
    with pytest.raises(RuntimeError, match="backend 'cuda-sm90'.*no SM90 GPU here"):
        layer.to_empty(device="cpu")


def test_validate_routing_off_drops_out_of_range_ids():
    """``"off"``: ids 100 and -7 (E = 4) act exactly as dropped slots (-1): same y, zero
    affinity gradient on those slots."""
    x, idx, aff = _inputs()
    bad = idx.clone()
    bad[0, 0], bad[3, 1] = 100, -7
    dropped = idx.clone()
    dropped[0, 0], dropped[3, 1] = -1, -1
    layer = MoEExperts(E, H, I, dtype=torch.float32, validate_routing="off")
    outs = []
    for ids in (bad, dropped):
        a = aff.clone().requires_grad_()
        y = layer(x, ids, a)
        y.square().sum().backward()
        outs.append((y.detach(), a.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1][0, 0] == 0 and outs[0][1][3, 1] == 0
    with pytest.raises(ValueError, match="must lie in"):
        MoEExperts(E, H, I, dtype=torch.float32)(x, bad, aff)  # the default ("device") refuses
