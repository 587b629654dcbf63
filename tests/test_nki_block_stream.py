"""Block sizes up to 4096 (issue 11, item 4): the kernel streams a block's slots.

Phases 1-2 run per sub-block of SB slots (``_sub_block_slots``); phases 3-4 contract over the
whole block with operands streamed per WRAPX tile along B in column slabs (``_wgrad_cols``).
Neither changes a value, so the kernel must equal its MX-faithful golden twin bit for bit
(``torch.equal``) at B = 1024 / 2048 / 4096 (small H / I, few tokens), also with the sub-blocks
forced down to 128 slots. The SBUF / PSUM plan of the big model shapes is checked by the
interpreter's budgets on a one-block run (marked ``slow``).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from tests.test_nki_kernel import GPT_OSS_CLAMP, OUT_NAMES, make_problem, run_golden, run_kernel

kmod = importlib.import_module("nki_kernels.blockwise_mm_bwd_mxfp8")  # the module, not the entry


def assert_bitwise(out, gold):
    assert len(out) == len(gold)
    for name, o, g in zip(OUT_NAMES, out, gold):
        assert o.dtype == g.dtype and o.shape == g.shape, name
        assert torch.equal(o, g), f"{name}: kernel != golden twin"


@pytest.mark.parametrize(
    "B,lnc,H,I,T,K,E",
    [
        (1024, 1, 256, 256, 48, 2, 2),
        (1024, 2, 384, 384, 40, 2, 3),
        (2048, 2, 256, 256, 48, 2, 2),
        (4096, 1, 256, 256, 48, 2, 2),
        (4096, 2, 256, 128, 40, 3, 4),
    ],
)
def test_large_blocks_equal_twin_bitwise(B, lnc, H, I, T, K, E):
    kw, _ = make_problem(T=T, H=H, I=I, E=E, K=K, B=B, clamp=GPT_OSS_CLAMP, bias=True)
    opts = {"bias": True, "clamp_limits": GPT_OSS_CLAMP}
    g = kmod._Geo(T, H, I, E, 1, B, 0, lnc)
    assert g.NSUB > 1 and g.NKT == B // 512  # the streamed path
    out, _ = run_kernel(kw, lnc=lnc, **opts)
    assert_bitwise(out, run_golden(kw, **opts))


def test_streamed_block_scale_packing_is_bit_identical():
    """Scale packing on a streamed block (packed d_gate_up^T scales through the HBM stash, two
    K tiles per operand in phases 1-2, four scale views per tile in phases 3-4): the unpacked
    kernel's bits."""
    B, lnc, H, I, T, K, E = 1024, 2, 384, 384, 40, 2, 3
    kw, _ = make_problem(T=T, H=H, I=I, E=E, K=K, B=B)
    assert kmod._Geo(T, H, I, E, 1, B, 0, lnc).NSUB > 1
    packed, _ = run_kernel(kw, lnc=lnc, use_scale_packing=True)
    unpacked, _ = run_kernel(kw, lnc=lnc, use_scale_packing=False)
    for name, x, y in zip(OUT_NAMES, packed, unpacked):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("B,lnc,padding", [(256, 2, "skip"), (512, 1, "zero_row"),
                                           (1024, 2, "skip")])
def test_sub_blocks_of_128_slots_equal_twin_bitwise(monkeypatch, B, lnc, padding):
    """Sub-blocks forced to 128 slots (the size the large-I models get): still bit-identical,
    including B = 256 (slot layout of 64 partitions read back from the HBM block scratch),
    fp32 accumulation and the zero-row padding."""
    monkeypatch.setattr(kmod, "SUB_BLOCK_RESERVE", kmod.SBUF_PLAN_BYTES)
    assert kmod._sub_block_slots(B, 256, 256, lnc) == 128
    kw, _ = make_problem(T=64, H=256, I=256, E=3, K=2, B=B, padding=padding, bias=True)
    opts = {"bias": True, "accumulation_dtype": "float32"}
    if padding == "zero_row":
        opts["skip_dma"] = kmod.SkipMode()
    out, _ = run_kernel(kw, lnc=lnc, **opts)
    assert_bitwise(out, run_golden(kw, **opts))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_streamed_phase2_stashed_operand_equals_twin_bitwise(monkeypatch, pack):
    """Phase 2 of a streamed block with d_gate_up^T stashed in HBM and reloaded per weight
    column block (the large-I models' path, where the resident operand does not fit; forced
    here by leaving no SBUF for it): still the twin's bits."""
    monkeypatch.setattr(kmod, "PHASE2_RESERVE", kmod.SBUF_PLAN_BYTES)
    B, lnc, H, I, T, K, E = 1024, 2, 384, 384, 40, 2, 3
    g = kmod._Geo(T, H, I, E, 1, B, 0, lnc)
    assert g.NSUB > 1
    assert not kmod._phase2_plan(g, kmod._Tiling(None, B, 2 * I, H // lnc, H, pack))[0]
    kw, _ = make_problem(T=T, H=H, I=I, E=E, K=K, B=B)
    out, _ = run_kernel(kw, lnc=lnc, use_scale_packing=pack)
    assert_bitwise(out, run_golden(kw))


@pytest.mark.parametrize("variant", ["outer_slabs", "row_groups"])
def test_wgrad_slabs_and_row_groups_equal_twin_bitwise(monkeypatch, variant):
    """Phases 3-4 with the gathered operand in 4 slabs of 128 columns, or the dW
    read-add-write in groups of row tiles that do not divide the rows (tile_m = 96, 3 row tiles
    of 512 columns per DMA: phase 3 groups of 3 and 2 tiles and a 32-row remainder, phase 4 a
    group of 2 and a 64-row remainder): the twin's bits."""
    if variant == "outer_slabs":
        monkeypatch.setattr(kmod, "_wgrad_outer_cols", lambda *a: 128)
    else:
        monkeypatch.setattr(kmod, "WGRAD_RMW_BYTES", 3 * 512 * 2)
    cfg = kmod.MatmulMxfp8KernelConfig(M=0, K=0, N=0, tile_m=96)
    opts = {"phase3_config": cfg, "phase4_config": cfg}
    kw, _ = make_problem(T=64, H=512, I=256, E=2, K=2, B=512)
    out, _ = run_kernel(kw, lnc=1, **opts)
    assert_bitwise(out, run_golden(kw, **opts))


def test_packing_lets_larger_blocks_fit_at_deepseek_v3():
    """The SBUF plan at DeepSeek-V3 (H 7168, I 2048), B = 4096, LNC2: with scale packing the
    resident d_gate_up^T leaves room for 3 phase-2 weight column blocks instead of 4, and the
    gathered operand of phases 3-4 fits in one slab instead of two (pure trace-time plan)."""
    H, I, B = 7168, 2048, 4096
    g = kmod._Geo(8, H, I, 1, 1, B, 0, 2)
    plan = {}
    for pack in (True, False):
        tl2 = kmod._Tiling(None, B, 2 * I, H // 2, H, pack)
        resident, n_block = kmod._phase2_plan(g, tl2)
        cb = min(kmod.WGRAD_COL_BLOCK, kmod._wgrad_cols(g.NKT, 2 * I, 128))
        outer = kmod._wgrad_outer_cols(g, g.Hs, cb, pack, 2, False)
        plan[pack] = (resident, -(-g.Hs // n_block), -(-g.Hs // outer))
    assert plan == {True: (True, 3, 1), False: (True, 4, 2)}


def test_block_size_4096_is_accepted_and_8192_rejected():
    from nki_kernels.validation import BLOCK_SIZES

    assert BLOCK_SIZES[-3:] == (1024, 2048, 4096)
    kw, _ = make_problem(T=16, H=128, I=128, E=2, K=1, B=4096)
    out, _ = run_kernel(kw, lnc=1, is_tensor_update_accumulating=False)
    assert_bitwise(out, run_golden(kw, is_tensor_update_accumulating=False))


# ------------------------------------------------------------- SBUF / PSUM plan, model shapes
# (H, I_TP) of the models; LNC2. Peaks measured by this test (bytes per partition of
# SBUF, PSUM banks) on one block with 8 tokens: the interpreter checks every allocation against
# nki-library's trn3 budget (245496 B SBUF, 8 PSUM banks) and raises NkiCapacityError beyond it.
MODEL_SHAPES = {
    "deepseek-v3": (7168, 2048),
    "qwen3-235b-a22b": (4096, 1536),
    "llama-4-scout": (5120, 8192),
    "mixtral-8x7b": (4096, 14336),
}


def _fast_arithmetic(monkeypatch):
    """Keep every rule and budget check of the interpreter, drop the MX arithmetic (values are
    irrelevant to the plan): dequantized operands are zeros, quantize_mx writes zero words."""
    import numpy as np

    from nki_kernels.interp import isa, mxops

    monkeypatch.setattr(isa, "_dequant_operand",
                        lambda instr, arg, data, scale, P, C, prec: np.zeros((P * 4, C), prec))
    monkeypatch.setitem(isa.MATMUL_PRECISION, "value", "float32")
    monkeypatch.setattr(mxops, "quantize_groups", lambda src, elem, impl=None: (
        np.zeros((src.shape[0], src.shape[1] // 4), np.uint32),
        np.zeros((src.shape[0] // 8, src.shape[1] // 4), np.uint8)))


def _one_block_plan(H, I, B, lnc=2, T=8, use_scale_packing=True):
    """Run one live block (T tokens, E = 1, the rest padding) at a model shape; returns the
    per-core peaks {"sbuf_peak_bytes", "psum_peak_banks"} of core 0."""
    from nki_kernels._nki import simulate

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).bfloat16()
    dy = torch.randn(T, H, generator=gen).bfloat16()
    wgu = torch.randn(1, H, 2, I, generator=gen).bfloat16()
    wd = torch.randn(1, I, H, generator=gen).bfloat16()
    tpti = torch.full((B,), -1, dtype=torch.int32)
    tpti[:T] = torch.arange(T, dtype=torch.int32)
    ck = torch.randn(1, 2, I, B, generator=gen).bfloat16()
    k = simulate(kmod.blockwise_mm_bwd_mxfp8, lnc=lnc)
    k(x, torch.rand(T, 1).bfloat16(), wgu, wd, tpti, torch.zeros(1, 1, dtype=torch.int32), dy,
      B, gate_up_proj_act_checkpoint_T=ck, skip_dma=kmod.SkipMode(skip_token=True),
      run_with_lnc2=lnc == 2, use_scale_packing=use_scale_packing)
    return k.last_profile.memory[0]


def test_model_shape_plan_fits_qwen3_235b_b1024(monkeypatch):
    """CI-sized check of the plan at a model shape: Qwen3-235B-A22B experts, B = 1024, LNC2."""
    _fast_arithmetic(monkeypatch)
    H, I = MODEL_SHAPES["qwen3-235b-a22b"]
    mem = _one_block_plan(H, I, 1024)
    assert mem["sbuf_peak_bytes"] <= kmod.SBUF_PLAN_BYTES and mem["psum_peak_banks"] <= 8


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("NKI_SLOW_TESTS"),
                    reason="one-block runs at model shapes, 20 s - minutes each: NKI_SLOW_TESTS=1")
@pytest.mark.parametrize("B,pack", [(1024, True), (2048, True), (4096, True), (4096, False)])
@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_model_shape_plan_fits(monkeypatch, model, B, pack):
    _fast_arithmetic(monkeypatch)
    H, I = MODEL_SHAPES[model]
    mem = _one_block_plan(H, I, B, use_scale_packing=pack)
    print(f"[plan] {model} B={B} LNC2 packing={pack}: SBUF {mem['sbuf_peak_bytes']} "
          f"B/partition, PSUM {mem['psum_peak_banks']} banks")
    assert mem["sbuf_peak_bytes"] <= kmod.SBUF_PLAN_BYTES and mem["psum_peak_banks"] <= 8
