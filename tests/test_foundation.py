"""Foundation fixes of issue 9 item 6: expert-id dtypes, the static block count, NVFP4 tiny amax.

* every integer dtype torch has (int8/16/32/64, uint8/16/32/64) gives the same routing plan for
  the same ids, or a ValueError naming the dtype;
* ``static_num_blocks`` equals REFERENCE §1.1's ``ceil((T*K - (E-1)) / B) + E - 1`` exactly,
  also when ``T*K < E-1`` (no clamping), and layouts built with it stay consistent, down to the
  NKI kernel on the interpreter;
* NVFP4's global scale and its reciprocal stay finite for a tensor whose amax is tiny, down to
  the smallest fp32 normal (and below).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from common.mx import NVFP4_MIN_GLOBAL_SCALE, dequantize_nvfp4, quantize_nvfp4
from common.routing import plan_routing
from common.shapes import static_num_blocks

SIGNED = [torch.int8, torch.int16, torch.int32, torch.int64]
UNSIGNED = [torch.uint8] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64")
                            if hasattr(torch, n)]
PLAN_FIELDS = ("pair_token_R", "pair_expert_R", "pair_affinity_R", "slot_to_pair_TK",
               "tokens_per_expert_E", "num_pairs")


def _plan_equal(a, b):
    for f in PLAN_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    la, lb = a.blockwise(4), b.blockwise(4)
    assert torch.equal(la.token_position_to_id, lb.token_position_to_id)
    assert torch.equal(la.block_to_expert, lb.block_to_expert)
    ga, gb = a.grouped(align=4), b.grouped(align=4)
    assert torch.equal(ga.offsets_E, gb.offsets_E)


# ------------------------------------------------------------------------- expert-id dtypes
def _routing(with_dropped: bool):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (11, 3), generator=g)
    if with_dropped:
        ids[2, 1] = -1
        ids[7, :] = -1
    return ids, torch.rand(11, 3, generator=g)


@pytest.mark.parametrize("dtype", SIGNED, ids=str)
def test_signed_id_dtypes_give_the_same_plan(dtype):
    ids, aff = _routing(with_dropped=True)
    _plan_equal(plan_routing(ids.to(dtype), aff, 6), plan_routing(ids, aff, 6))


@pytest.mark.parametrize("dtype", UNSIGNED, ids=str)
def test_unsigned_id_dtypes_give_the_same_plan(dtype):
    ids, aff = _routing(with_dropped=False)
    _plan_equal(plan_routing(ids.to(dtype), aff, 6), plan_routing(ids, aff, 6))


@pytest.mark.parametrize("dtype", SIGNED + UNSIGNED, ids=str)
def test_out_of_range_id_error_names_the_dtype(dtype):
    ids, aff = _routing(with_dropped=False)
    ids[0, 0] = 6
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"expert_index \({name}\).*\[-1, num_experts=6\)"):
        plan_routing(ids.to(dtype), aff, 6)


def test_uint64_id_above_int64_range_is_refused():
    if not hasattr(torch, "uint64"):
        pytest.skip("torch without uint64")
    ids = torch.zeros(2, 1, dtype=torch.uint64)
    ids[1, 0] = torch.tensor(-1, dtype=torch.int64).to(torch.uint64)  # 2^64 - 1, not "dropped"
    with pytest.raises(ValueError, match=r"expert_index \(uint64\).*2\^63"):
        plan_routing(ids, torch.ones(2, 1), 4)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64], ids=str)
def test_non_integer_id_dtype_error_names_it(dtype):
    with pytest.raises(ValueError, match=rf"integer dtype.*got {dtype}"):
        plan_routing(torch.zeros(2, 1).to(dtype), torch.ones(2, 1), 4)


# ------------------------------------------------------------------------- static block count
def _formula(T, K, E, B):
    """REFERENCE §1.1 with exact rational arithmetic."""
    return math.ceil(Fraction(T * K - (E - 1), B)) + E - 1


@pytest.mark.parametrize("T", [0, 1, 2, 5, 100, 4096])
@pytest.mark.parametrize("K", [1, 2, 8])
@pytest.mark.parametrize("E", [1, 2, 8, 130, 384])
@pytest.mark.parametrize("B", [1, 2, 128, 512])
def test_static_num_blocks_is_the_formula(T, K, E, B):
    n = static_num_blocks(T, K, E, B)
    assert n == _formula(T, K, E, B)
    if T * K < E - 1:
        assert n >= T * K


def test_static_num_blocks_below_e_minus_1():
    """The case the old clamp got wrong: T*K = 4 slots, 136 experts, B = 128 -> 134, not 135."""
    assert static_num_blocks(2, 2, 136, 128) == math.ceil((4 - 135) / 128) + 135 == 134
    assert static_num_blocks(0, 1, 6, 1) == 0  # no slots, B = 1: nothing to launch
    assert static_num_blocks(3, 1, 5, 1) == 3  # = T*K, each slot its own block


def test_static_num_blocks_rejects_bad_sizes():
    for args in [(-1, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0), (1.0, 1, 1, 1),
                 (True, 1, 1, 1)]:
        with pytest.raises(ValueError, match="static_num_blocks"):
            static_num_blocks(*args)


@pytest.mark.parametrize("padding", ["skip", "zero_row"])
def test_layout_with_few_slots_many_experts_is_consistent(padding):
    """T*K < E-1 - B: every routed slot sits in a block of its expert, blocks ascend by expert,
    the trailing padding blocks belong to E-1, and N is the formula's."""
    T, K, E, B = 3, 2, 140, 4
    ids = torch.tensor([[5, 139], [0, 5], [77, 3]])
    aff = torch.full((T, K), 0.5)
    lay = plan_routing(ids, aff, E).blockwise(B, padding)
    N = lay.num_blocks
    assert N == _formula(T, K, E, B) == math.ceil((6 - 139) / 4) + 139 == 106
    tpti = lay.token_position_to_id.reshape(N, B)
    b2e = lay.block_to_expert.flatten()
    assert (b2e[1:] >= b2e[:-1]).all()
    pad = -1 if padding == "skip" else T
    seen = set()
    for n in range(N):
        for t in tpti[n].tolist():
            if t != pad:
                seen.add((t, int(b2e[n])))
    assert seen == {(t, int(e)) for t in range(T) for e in ids[t]}
    used = len({int(e) for e in ids.flatten()})
    assert (b2e[used:] == E - 1).all() and (tpti[used:] == pad).all()


def test_nki_kernel_on_a_layout_with_fewer_blocks_than_experts():
    """The kernel (interpreter) and its torch twin agree on a layout with N < E - 1."""
    from nki_kernels.backend import prepare_blockwise_args
    from nki_kernels.blockwise_mm_bwd_mxfp8_torch import blockwise_mm_bwd_mxfp8_torch
    from nki_kernels.blockwise_mm_bwd_mxfp8 import blockwise_mm_bwd_mxfp8
    from nki_kernels._nki import simulate
    from common.inputs import make_problem

    T, E = 2, 136
    ids = torch.tensor([[0, 135], [0, 7]])
    p = make_problem(T, 128, 128, E, 2, expert_index=ids, affinity=torch.full((T, 2), 0.5))
    args, kw, lay = prepare_blockwise_args(p, block_size=128)
    assert lay.num_blocks == static_num_blocks(T, 2, E, 128) == 134 < E - 1
    out = simulate(blockwise_mm_bwd_mxfp8, lnc=1)(*args, **kw)
    ref = blockwise_mm_bwd_mxfp8_torch(
        *args, gate_up_proj_act_checkpoint_T=kw["gate_up_proj_act_checkpoint_T"]
    )
    for o, r in zip(out, ref):
        assert torch.equal(torch.as_tensor(o), r)


# --------------------------------------------------------------------------------- NVFP4 tiny
F32_MIN_NORMAL = torch.finfo(torch.float32).tiny  # 2^-126


@pytest.mark.parametrize("amax", [F32_MIN_NORMAL, 4 * F32_MIN_NORMAL, 2.0**-110, 2.0**-100,
                                  F32_MIN_NORMAL / 8])
def test_nvfp4_tiny_amax_keeps_scales_finite(amax):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 64, generator=g, dtype=torch.float64) * 2 - 1
    x = x / x.abs().max() * amax
    x[1, 16:32] = 0.0  # an all-zero block: the smallest block scale 2^-6
    x = x.float()
    assert float(x.abs().max()) == pytest.approx(amax, rel=1e-6)
    data, scale, gs = quantize_nvfp4(x)
    assert torch.isfinite(gs) and float(gs) > 0 and math.isfinite(1.0 / float(gs))
    assert torch.isfinite(torch.reciprocal(gs))
    assert float(gs) >= NVFP4_MIN_GLOBAL_SCALE
    assert torch.isfinite(scale.float()).all()
    y = dequantize_nvfp4(data, scale, gs)
    assert torch.isfinite(y).all()
    assert (y[1, 16:32] == 0).all()
    if amax >= F32_MIN_NORMAL:  # subnormal tensors stay finite but may flush to 0
        # the largest element round-trips within a quarter of amax (E2M1 codes 2..6 reach it)
        i = x.abs().argmax()
        assert abs(float(y.flatten()[i]) - float(x.flatten()[i])) <= 0.25 * amax


def test_nvfp4_ordinary_amax_unchanged_by_the_floor():
    """The floor only acts below amax ~ 2^-109.6: ordinary tensors keep amax / (448*6)."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 1e-20
    _, _, gs = quantize_nvfp4(x)
    assert torch.equal(gs, x.abs().amax() / (448.0 * 6.0))


def _nvfp4_round_trip(x):
    data, scale, gs = quantize_nvfp4(x)
    return dequantize_nvfp4(data, scale, gs), gs


@pytest.mark.parametrize("amax", [1e-30, 1.02e-33, 1e-33, 1e-35, 1e-37])
def test_nvfp4_floor_changes_values_only_below_its_threshold(amax):
    """quantize_nvfp4's docstring: the 2^-121 floor binds only for amax < 448*6*2^-121
    (~1.011e-33). Above, the result is the recipe's: scaling x by a power of two scales the
    decoded values exactly. Below, the global scale is 2^-121 and most decoded values shift
    (median relative shift 1-3 % on N(0, 1) data) while the error against x keeps its size.
    The reference: the same tensor brought near 1 by a power of two."""
    threshold = 448.0 * 6.0 * NVFP4_MIN_GLOBAL_SCALE
    assert threshold == pytest.approx(1.0111e-33, rel=1e-4)
    base = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = base / base.abs().max() * amax
    k = math.floor(math.log2(amax))
    got, gs = _nvfp4_round_trip(x)
    want = _nvfp4_round_trip(x * 2.0**-k)[0] * 2.0**k
    rms = float((got.double() - x.double()).norm() / x.double().norm())
    rms_want = float((want.double() - x.double()).norm() / x.double().norm())
    if amax >= threshold:
        assert torch.equal(gs, x.abs().amax() / (448.0 * 6.0))
        assert torch.equal(got, want)
        return
    assert float(gs) == NVFP4_MIN_GLOBAL_SCALE
    changed = got != want
    shift = ((got - want).abs() / want.abs())[changed & (want != 0)]
    assert 0.85 <= float(changed.float().mean()) <= 0.97
    assert 0.01 <= float(shift.median()) <= 0.03, float(shift.median())
    assert rms_want == pytest.approx(0.0954, abs=5e-4)
    assert rms_want <= rms <= rms_want * 1.02  # the error's size is unchanged within 2 %


def test_nvfp4_global_scale_below_floor_refused():
    with pytest.raises(ValueError, match="global_scale must be >= 2\\^-121"):
        quantize_nvfp4(torch.ones(1, 16), global_scale=2.0**-126)
