"""The grouped wgrad as a registered torch op: opcheck and a fullgraph torch.compile trace."""

import torch

from common.reference import grouped_wgrad_reference
from cuda_kernels.grouped_wgrad.ops import grouped_wgrad_op


def _operands(counts, H=32, I=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = sum(counts)
    a = torch.randn(S, H, generator=g).bfloat16().t()  # [H, S] M-major, as the backward holds it
    b = torch.randn(S, I, generator=g).bfloat16()
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return a, b, offsets


def test_op_matches_reference_and_passes_opcheck():
    a, b, offsets = _operands([5, 0, 11, 16])
    out = torch.ops.moe_bwd.grouped_wgrad(a, b, offsets)
    ref = grouped_wgrad_reference(a, b, offsets)
    assert out.dtype == torch.float32 and out.shape == (4, 32, 16)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(out[1]) == 0  # the empty expert
    torch.library.opcheck(grouped_wgrad_op, (a, b, offsets))


def test_op_traces_with_fullgraph_compile():
    a, b, offsets = _operands([8, 8, 16])

    def f(a, b, offsets):
        return torch.ops.moe_bwd.grouped_wgrad(a, b, offsets) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, b, offsets), f(a, b, offsets))
