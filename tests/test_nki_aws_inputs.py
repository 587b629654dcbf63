"""Issue 24 item 3: AWS-style inputs (``tests/aws_style_inputs.py``: the recipe of nki-library's
``build_mxfp8_moe_bwd_inputs``, our own code) through our kernel on the interpreter, scale
packing on and off: the same bits, and the bits of the MX golden twin.
"""

from __future__ import annotations

import pytest
import torch

from common.problem import ClampLimits
from common.routing import plan_routing
from nki_kernels.blockwise_mm_bwd_mxfp8_torch import prequantize_weight_k_major
from tests.aws_style_inputs import build_aws_style_bwd_inputs, random_router, routing_tables
from tests.test_nki_kernel import OUT_NAMES, run_golden, run_kernel

CLAMP = ClampLimits(linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
                    non_linear_clamp_upper_limit=7.0)
CASES = {
    # name: (build_aws_style_bwd_inputs kwargs, lnc, extra kernel options)
    "top2_B128_lnc2": ({"T": 96, "H": 256, "I": 128, "E": 4, "B": 128, "top_k": 2}, 2, {}),
    "top1_B256_H384_lnc1": ({"T": 64, "H": 384, "I": 256, "E": 3, "B": 256, "top_k": 1}, 1, {}),
    "top4_B1024_clamp_bias_lnc2": (
        {"T": 48, "H": 256, "I": 256, "E": 4, "B": 1024, "top_k": 4, "clamp_limits": CLAMP}, 2,
        {"clamp_limits": CLAMP, "bias": True}),
}


def _equal(a, b, what):
    assert len(a) == len(b)
    for name, x, y in zip(OUT_NAMES, a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{name}: {what}"


def test_routing_tables_match_common_routing():
    """The AWS-style tables (built from the dense mask) equal common.routing's blockwise layout
    of the same routing: two independent constructions of REFERENCE §1.1."""
    T, K, E, B = 200, 3, 6, 128
    router = random_router(T, K, E, seed=3)
    N = -(-(T * K - (E - 1)) // B) + E - 1
    mask, tpti, b2e = routing_tables(router, E, B, N)
    assert mask.sum() == T * K and (mask.sum(1) == K).all()
    aff = torch.rand(T, K, generator=torch.Generator().manual_seed(1)) + 0.5
    lay = plan_routing(router, aff, E).blockwise(B, "skip")
    assert lay.num_blocks == N
    assert torch.equal(lay.token_position_to_id.to(torch.int32), tpti)
    assert torch.equal(lay.block_to_expert.to(torch.int32).reshape(N, 1), b2e)


def test_inputs_follow_the_recipe():
    kw = build_aws_style_bwd_inputs(T=64, H=128, I=128, E=4, B=128, top_k=2)
    again = build_aws_style_bwd_inputs(T=64, H=128, I=128, E=4, B=128, top_k=2)
    for k, v in kw.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, again[k]), k  # reproducible per shape
    w = kw["gate_up_proj_weight"].float()
    assert w.abs().max() <= 0.1005 and w.min() < -0.09 and w.max() > 0.09  # BF16 of U(-0.1, 0.1)
    x, dy = kw["hidden_states"].float(), kw["output_hidden_states_grad"].float()
    assert x.min() >= 0 and x.max() <= 1 and dy.abs().max() <= 1 and dy.min() < -0.9
    ea = kw["expert_affinities_masked"].float().reshape(64, 4)
    assert ((ea > 0).sum(1) <= 2).all() and (ea >= 0).all()  # masked: 0 where not routed
    tpti = kw["token_position_to_id"]
    assert (tpti == -1).any() and kw["is_tensor_update_accumulating"]
    ck = kw["gate_up_proj_act_checkpoint_T"].reshape(-1, 2, 128, 128)
    pad = (tpti.reshape(-1, 128) < 0)
    assert (ck.permute(0, 3, 1, 2)[pad] == 0).all()  # padding slots hold a zero row's values


@pytest.mark.parametrize("case", sorted(CASES))
def test_scale_packing_on_off_same_bits(case):
    mk, lnc, extra = CASES[case]
    kw = build_aws_style_bwd_inputs(**mk)
    packed, _ = run_kernel(kw, lnc=lnc, use_scale_packing=True, **extra)
    unpacked, _ = run_kernel(kw, lnc=lnc, use_scale_packing=False, **extra)
    _equal(packed, unpacked, "scale packing on != off")
    _equal(packed, run_golden(kw, **extra), "kernel != MX golden twin")


def test_prequantized_weights_scale_packing_on_off_same_bits():
    """AWS's builder can pre-quantize the weights; ours in our K-major layout: packed and
    unpacked scale tiles of pre-quantized weights give the bits of on-chip quantization."""
    kw = build_aws_style_bwd_inputs(T=64, H=384, I=128, E=2, B=128, top_k=2)
    E, H, _, I = kw["gate_up_proj_weight"].shape
    gu_w, gu_s = prequantize_weight_k_major(kw["gate_up_proj_weight"].reshape(E, H, 2 * I))
    d_w, d_s = prequantize_weight_k_major(kw["down_proj_weight"])
    pq = dict(kw, gate_up_proj_weight=gu_w, down_proj_weight=d_w)
    ref, _ = run_kernel(kw, use_scale_packing=False)
    for pack in (True, False):
        out, _ = run_kernel(pq, gate_up_weight_scales=gu_s, down_weight_scales=d_s,
                            use_scale_packing=pack)
        _equal(out, ref, f"pre-quantized, use_scale_packing={pack}")
