"""Tests of the SM90 varlen-M grouped GEMM kernel (cuda_kernels/gemm/sm90/grouped_mm.py).

CPU part (CI): offline compiles for ``sm_90a`` of three keys (gather-A with cp.async producers and
an N-major W; A by TMA with a K-major W on the pingpong schedule; gather-A with an int32 index,
64-row tiles and partial N tiles), their PTX checked for the instructions the design rests on,
and assembled by ptxas when one that knows the PTX ISA is installed (no spills); the same for
``write_a_rows`` keys (the gathered-rows side output) of the three epilogues, cooperative and
pingpong, whose barrier instructions must be those of the key without it; tile_n 192.

GPU part (``gpu`` + ``sm90`` markers, skipped without an SM90 device and CuTe DSL): the kernel
against the torch twin (fp32 accumulation, one BF16 rounding) over a grid of splits (uneven with
empty experts, one hot expert, every expert empty, rows past the last offset, T not a tile
multiple), the model shapes' N / K (qwen3-30b-a3b and mixtral-8x7b gate/up and down), both W
majors, both index dtypes, the three tile schedules, tile_n 192; outputs poisoned with NaN before
each launch; NaN planted in the gathered source's rows that no index refers to (a padding row that
were read would show: the kernel has no select); bitwise determinism over two launches; A in row
order by TMA; a row-strided A; CUDA-graph replay with new offsets; no recompile for a new split;
the gathered-rows side output (``a_rows_out``, store / gated / dgated, cooperative / pingpong /
64-row tiles) bitwise equal to ``gather_rows`` on every row (NaN-poisoned before) and the main
outputs bitwise those of the call without it; the TMA-store epilogue (``epi_tma``: store, gated
and dgated with the row-order checkpoint) bitwise equal to the register epilogue, whole and
partial tiles side by side, and its offline PTX (stmatrix, 2-D TMA stores, no spills); the
dgated TMA path's gate (refused until verified on a GPU, unless opted in).
"""

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from _ptxas import assemble_without_spills

from common.problem import Activation, ClampLimits
from common.routing import plan_routing
from cuda_kernels.grouped_mm import (
    down_dgrad_activation_torch,
    down_dgrad_backward,
    gate_up_activation_torch,
    gate_up_forward,
    grouped_mm_dgated,
    grouped_mm_gated,
    grouped_mm_gather,
    grouped_mm_gather_torch,
)
from cuda_kernels.gemm.sm90 import grouped_mm as sm90
from cuda_kernels.gemm.sm90.grouped_mm import GatedEpilogue, Sm90GroupedMmKey, Sm90GroupedMmTile

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_cute = pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed")
_GPU_MARKS = (
    pytest.mark.gpu,
    pytest.mark.sm90,
    pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL"),
)


def gpu(fn):
    """The GPU tests' marks: ``gpu``, ``sm90`` and the skip without an SM90 device / CuTe DSL."""
    for mark in _GPU_MARKS:
        fn = mark(fn)
    return fn
BF16 = torch.bfloat16
_T = Sm90GroupedMmTile

# ------------------------------------------------------------------------------------------------
# CPU: offline compiles
# ------------------------------------------------------------------------------------------------

_ROWS_PTX = ["cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc",
             r"cp.async.wait_group\s+[1-9]\d*;", "ld.shared.v4.b32", "st.global.v4.b32",
             "ld.global.v4.b32"]
_TMA_PTX = ["stmatrix.sync.aligned.m8n8.x4.shared.b16",
            "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group",
            "cp.async.bulk.wait_group.read", "st.global.b32"]
_OFFLINE = [
    # (id, key, PTX that must appear, PTX that must not)
    ("gather-n-major-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, tile=_T(128, 256, 64, 4)),
     ["cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "fence.proxy.async",
      "cp.async.bulk.tensor.3d", "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
      r"setmaxnreg.dec.sync.aligned.u32\s+56;"],
     ["cp.async.bulk.tensor.2d"]),
    ("tma-a-k-major-pingpong",
     Sm90GroupedMmKey(2048, 768, 128, gather_a=False, w_major="k",
                      tile=_T(128, 128, 64, 6, pingpong=True)),
     ["cp.async.bulk.tensor.2d", "cp.async.bulk.tensor.3d", "bar.sync",
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"],
     ["cp.async.cg.shared.global", "fence.proxy.async"]),
    ("gated-swiglu-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated", gated=GatedEpilogue(),
                      tile=_T(128, 256, 64, 4)),
     ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "ex2.approx",
      "cvt.rn.bf16x2.f32", "cp.async.mbarrier.arrive.noinc"],
     []),
    ("gated-gpt-oss-bias-pingpong-partial",
     Sm90GroupedMmKey(5760, 2880, 128, epilogue="gated",
                      gated=GatedEpilogue(1.702, 1.0, None, 7.0, -7.0, 7.0, True),
                      tile=_T(128, 128, 64, 6, pingpong=True)),
     ["wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "ex2.approx", "bar.sync"],
     []),
    ("dgated-swiglu-k-major-pingpong",
     Sm90GroupedMmKey(768, 2048, 128, w_major="k", epilogue="dgated", gated=GatedEpilogue(),
                      tile=_T(128, 128, 64, 6, pingpong=True)),
     ["shfl.sync.bfly.b32", "ld.global.b32", "ex2.approx", "rcp.approx.ftz.f32",
      "cp.async.mbarrier.arrive.noinc"],
     # the checkpoint is read as 4-byte words into the chunk buffers, the sigmoid has no IEEE
     # division (the old per-use 2 x b16 loads and div.rn are gone)
     ["ld.global.v2.b16", "div.rn.f32"]),
    ("gather-int32-64row-partial-n",
     Sm90GroupedMmKey(2880, 2880, 16, index_dtype="int32", tile=_T(64, 256, 64, 4)),
     ["cp.async.cg.shared.global", "cp.async.mbarrier.arrive.noinc", "ld.global.b32",
      "fence.proxy.async"],
     []),
    # write_a_rows: the gathered rows copied out of the stages (16-byte shared loads and global
    # stores after cp.async.wait_group stages - 1), the rows past the last expert by 16-byte
    # global loads
    ("rows-gather-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, tile=_T(128, 256, 64, 4), write_a_rows=True),
     _ROWS_PTX + ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], []),
    ("rows-gather-int32-pingpong-partial-k",
     Sm90GroupedMmKey(2048, 1000, 16, index_dtype="int32", w_major="k", write_a_rows=True,
                      tile=_T(128, 128, 64, 6, pingpong=True)),
     _ROWS_PTX + ["bar.sync"], []),
    ("rows-gather-64row",
     Sm90GroupedMmKey(2880, 2880, 16, write_a_rows=True, tile=_T(64, 256, 64, 4)),
     _ROWS_PTX + ["fence.proxy.async"], []),
    ("rows-gated-swiglu-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated", gated=GatedEpilogue(),
                      tile=_T(128, 256, 64, 4), write_a_rows=True),
     _ROWS_PTX + ["ex2.approx", "cvt.rn.bf16x2.f32"], []),
    ("rows-gated-gpt-oss-bias-pingpong",
     Sm90GroupedMmKey(5760, 2880, 128, epilogue="gated",
                      gated=GatedEpilogue(1.702, 1.0, None, 7.0, -7.0, 7.0, True),
                      tile=_T(128, 128, 64, 6, pingpong=True), write_a_rows=True),
     _ROWS_PTX + ["bar.sync"], []),
    ("rows-dgated-swiglu-128x256",
     Sm90GroupedMmKey(768, 2048, 128, w_major="k", epilogue="dgated", gated=GatedEpilogue(),
                      tile=_T(128, 256, 64, 4), write_a_rows=True),
     _ROWS_PTX + ["shfl.sync.bfly.b32"], []),
    # tile_n 192 (quack's Hopper tile): 96 (cooperative) / 192 (pingpong) accumulators a thread
    ("gather-coop-128x192",
     Sm90GroupedMmKey(1536, 4096, 128, tile=_T(128, 192, 64, 5)),
     ["wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16", "cp.async.mbarrier.arrive.noinc"],
     []),
    ("gather-pingpong-128x192",
     Sm90GroupedMmKey(3072, 4096, 128, tile=_T(128, 192, 64, 5, True)),
     ["wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16", "bar.sync"],
     []),
    ("rows-gather-coop-128x192",
     Sm90GroupedMmKey(3072, 4096, 128, tile=_T(128, 192, 64, 5), write_a_rows=True),
     _ROWS_PTX, []),
    # the TMA-store epilogue (epi_tma): stmatrix into the sub-tiles, 2-D TMA stores, the
    # register stores kept for the experts' partial tiles
    ("epi-tma-gather-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, tile=_T(128, 256, 64, 4, epi_tma=True)),
     _TMA_PTX + ["cvt.rn.bf16x2.f32"], []),
    ("epi-tma-rows-pingpong",
     Sm90GroupedMmKey(2048, 768, 128, gather_a=False, w_major="k",
                      tile=_T(128, 128, 64, 6, pingpong=True, epi_tma=True)),
     _TMA_PTX, []),
    ("epi-tma-gated-swiglu-128x256",
     Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated",
                      gated=GatedEpilogue(checkpoint_rows=True),
                      tile=_T(128, 256, 64, 4, epi_tma=True)),
     _TMA_PTX + ["ex2.approx"], []),
    ("epi-tma-gated-rows-gpt-oss-bias",
     Sm90GroupedMmKey(3072, 2880, 32, epilogue="gated",
                      gated=GatedEpilogue(1.702, 1.0, None, 7.0, -7.0, 7.0, True, True),
                      tile=_T(128, 256, 64, 4, epi_tma=True), write_a_rows=True),
     _TMA_PTX + _ROWS_PTX + ["ex2.approx"], []),
    ("rows-dgated-gpt-oss-pingpong",
     Sm90GroupedMmKey(2880, 2880, 32, w_major="k", epilogue="dgated",
                      gated=GatedEpilogue(1.702, 1.0, None, 7.0, -7.0, 7.0),
                      tile=_T(128, 128, 64, 6, pingpong=True), write_a_rows=True),
     _ROWS_PTX + ["shfl.sync.bfly.b32", "bar.sync"], []),
]


@needs_cute
@pytest.mark.parametrize("case", _OFFLINE, ids=[c[0] for c in _OFFLINE])
def test_offline_compile_sm90a(case, tmp_path):
    _id, key, must, must_not = case
    ptx = sm90.compile_grouped_mm_offline(key, "sm_90a")
    assert ".target sm_90a" in ptx
    for text in must:
        assert re.search(text if "\\s" in text else re.escape(text), ptx), (
            f"{_id}: {text!r} missing from the PTX"
        )
    for text in must_not:
        assert text not in ptx, f"{_id}: unexpected {text!r} in the PTX"
    assemble_without_spills(ptx, tmp_path, "sm_90a")  # skips if no ptxas knows this PTX ISA


@needs_cute
@pytest.mark.parametrize("epilogue", ["store", "dgated"])
def test_offline_write_a_rows_leaves_the_barriers_alone(epilogue):
    """The side output adds no barrier traffic: the same mbarrier / cp.async-arrive
    instructions (by kind and count) as the key without it; only the copy-out is added."""
    gated = GatedEpilogue() if epilogue == "dgated" else None
    base = Sm90GroupedMmKey(1024, 512, 8, epilogue=epilogue, gated=gated,
                            tile=_T(128, 128, 64, 6, pingpong=True))
    ptx0 = sm90.compile_grouped_mm_offline(base)
    ptx1 = sm90.compile_grouped_mm_offline(dataclasses.replace(base, write_a_rows=True))

    def barrier_ops(ptx):
        return sorted(m.group(0) for m in re.finditer(r"\b(mbarrier|cp\.async\.mbarrier)"
                                                        r"\.[a-z_.:0-9]+", ptx))

    assert barrier_ops(ptx0) == barrier_ops(ptx1)
    assert "st.global.v4.b32" in ptx1 and "ld.shared.v4.b32" in ptx1
    assert ptx1.count("fence.proxy.async") == ptx0.count("fence.proxy.async")


@needs_cute
def test_offline_dgated_epi_tma(tmp_path):
    """The dgated epilogue's TMA-store path: stmatrix and 2-D TMA stores of its
    sub-tiles beside the register path of the experts' last tiles, no spills."""
    key = Sm90GroupedMmKey(768, 2048, 128, w_major="k", epilogue="dgated",
                           gated=GatedEpilogue(checkpoint_rows=True),
                           tile=_T(128, 256, 64, 4, epi_tma=True))
    ptx = sm90.compile_grouped_mm_offline(key, "sm_90a")
    for text in _TMA_PTX + ["shfl.sync.bfly.b32", "rcp.approx.ftz.f32"]:
        assert text in ptx, f"{text!r} missing from the PTX"
    assemble_without_spills(ptx, tmp_path, "sm_90a")


@needs_cute
def test_offline_compile_is_cached_per_key_only_for_runtime_compiles():
    before = sm90.FAMILY.compile_count
    key = _OFFLINE[0][1]
    sm90.compile_grouped_mm_offline(key)
    assert sm90.FAMILY.compile_count == before  # offline compiles are not the runtime cache
    with pytest.raises(ValueError, match="want a Sm90GroupedMmKey"):
        sm90.FAMILY.offline_ptx("not a key", "sm_90a")


# ------------------------------------------------------------------------------------------------
# GPU helpers
# ------------------------------------------------------------------------------------------------


def _routing(T, E, top_k, gen, hot=None, empty_every=3):
    """A grouped layout (common.routing, align 16) of random top-k routing over the live experts
    (every ``empty_every``-th expert empty; ``hot``: that expert takes 90 % of the slots)."""
    return _routing_plan(T, E, top_k, gen, hot, empty_every)[1]


def _routing_plan(T, E, top_k, gen, hot=None, empty_every=3):
    """``(plan, layout)`` of :func:`_routing`'s routing, on the GPU."""
    live = [e for e in range(E) if empty_every == 0 or e % empty_every] or [0]
    top_k = min(top_k, len(live))
    pick = torch.stack([torch.randperm(len(live), generator=gen)[:top_k] for _ in range(T)])
    expert_index = torch.tensor(live)[pick]
    if hot is not None:  # (a duplicate expert in a token's top-k is merged by the plan)
        expert_index[: int(0.9 * T), 0] = hot
    affinity = torch.rand(T, top_k, generator=gen)
    plan = plan_routing(expert_index.cuda(), affinity.cuda(), E)
    return plan, plan.grouped(align=16)


def _operands(T, K, N, E, gen, w_major="n", lda=None):
    lda = lda or K
    # slice on the device: ``.cuda()`` of a row-strided CPU view would copy it contiguous
    a = torch.randn(T, lda, generator=gen).to(BF16).cuda()[:, :K]
    w = (torch.randn(E, K, N, generator=gen) / K**0.5).to(BF16)
    if w_major == "k":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    return a, w.cuda()


def _check_close(out, ref):
    """Kernel vs twin: both accumulate in fp32 and round once to BF16; only the summation order
    differs, so elements agree to about one BF16 ulp."""
    assert out.shape == ref.shape and out.dtype == BF16
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN elements remain"
    diff = (out.float() - ref.float()).abs()
    tol = 2**-7 * ref.float().abs() + 1e-3
    bad = (diff > tol).sum().item()
    assert bad == 0, f"{bad} elements beyond one BF16 ulp, max diff {diff.max().item()}"


def _run(a, w, layout_or_offsets, idx, tile=None):
    offsets = layout_or_offsets
    out = torch.full((idx.shape[0] if idx is not None else a.shape[0], w.shape[2]),
                     float("nan"), dtype=BF16, device="cuda")
    grouped_mm_gather(a, w, offsets, idx, out, backend="sm90", tile=tile)
    torch.cuda.synchronize()
    return out


_GRID = [
    # (id, T, K, N, E, top_k, tile, w_major, index dtype, hot expert)
    ("uneven-128x256", 300, 256, 512, 8, 2, _T(128, 256, 64, 4), "n", torch.int64, None),
    ("uneven-128x128", 300, 256, 384, 8, 2, _T(128, 128, 64, 6), "n", torch.int64, None),
    ("pingpong-k-major", 300, 192, 256, 6, 2, _T(128, 128, 64, 6, True), "k", torch.int32, None),
    ("64-row-tiles", 77, 128, 128, 5, 3, _T(64, 128, 64, 8), "n", torch.int64, None),
    ("one-hot-expert", 1000, 128, 256, 16, 2, _T(128, 256, 64, 4), "n", torch.int64, 5),
    ("partial-n-and-k", 130, 200, 200, 4, 2, _T(128, 128, 64, 6), "n", torch.int64, None),
    ("qwen3-gate-up", 256, 2048, 1536, 128, 8, None, "n", torch.int64, None),
    ("qwen3-down", 256, 768, 2048, 128, 8, None, "n", torch.int64, None),
    ("mixtral-gate-up", 96, 4096, 28672, 8, 2, None, "n", torch.int64, None),
    ("mixtral-down", 96, 14336, 4096, 8, 2, None, "n", torch.int64, None),
    ("gpt-oss-gate-up", 128, 2880, 5760, 32, 4, None, "n", torch.int64, None),
    # tile_n 192 (quack's Hopper tile)
    ("uneven-128x192pp", 300, 256, 384, 8, 2, _T(128, 192, 64, 5, True), "n", torch.int64, None),
]


_ROWS_CASES = ("uneven-128x256", "pingpong-k-major", "partial-n-and-k", "qwen3-down")
_GRID_RUNS = [(c, True) for c in _GRID] + [(c, False) for c in _GRID if c[0] in _ROWS_CASES]


@gpu
@pytest.mark.parametrize(
    "case,gather", _GRID_RUNS, ids=[f"{c[0]}-{'gather' if g else 'rows'}" for c, g in _GRID_RUNS]
)
def test_grid_matches_twin(case, gather):
    _id, T, K, N, E, top_k, tile, w_major, idx_dtype, hot = case
    gen = torch.Generator().manual_seed(_GRID.index(case))
    layout = _routing(T, E, top_k, gen, hot=hot)
    a, w = _operands(T, K, N, E, gen, w_major)
    idx = layout.row_to_token_S.to(idx_dtype).cuda()
    offsets = layout.offsets_E.cuda()
    ref = grouped_mm_gather_torch(a, w, offsets, idx)
    if gather:
        out = _run(a, w, offsets, idx, tile)
    else:  # A already in row order (padding rows 0, as the layer's gather writes them)
        rows = torch.where((idx >= 0)[:, None], a[idx.clamp(min=0).long()], 0)
        out = torch.full_like(ref, float("nan"))
        grouped_mm_gather(rows, w, offsets, None, out, backend="sm90", tile=tile)
        torch.cuda.synchronize()
    _check_close(out, ref)
    pad = idx < 0
    assert (out[pad] == 0).all(), "padding rows must be exactly 0"


@gpu
@pytest.mark.parametrize("tile", [_T(128, 256, 64, 4), _T(128, 128, 64, 6, True)],
                         ids=["coop", "pingpong"])
def test_unreferenced_nan_rows_never_reach_padding_rows(tile):
    """NaN in the source rows that no valid index refers to, in particular row 0 and row T-1
    (what a padding index of -1 would read if it were clamped or wrapped): no select hides them
    in the kernel, so a read padding row would be NaN."""
    gen = torch.Generator().manual_seed(11)
    T, K, N, E = 260, 256, 256, 6
    layout = _routing(T, E, 2, gen)
    a, w = _operands(T, K, N, E, gen)
    idx = layout.row_to_token_S.cuda().clone()
    for t in (0, T - 1, 17):
        idx[idx == t] = -1  # those tokens' rows become padding rows
        a[t] = float("nan")
    out = _run(a, w, layout.offsets_E.cuda(), idx, tile)
    assert (out[idx < 0] == 0).all()
    _check_close(out, grouped_mm_gather_torch(a, w, layout.offsets_E.cuda(), idx))


def _splits_case(counts, extra, K=128, N=256):
    gen = torch.Generator().manual_seed(len(counts) + extra)
    E = len(counts)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    S = int(offsets[-1]) + extra if E else extra
    T = 50
    a, w = _operands(T, K, N, E, gen)
    idx = torch.randint(-1, T, (S,), generator=gen).cuda()
    return a, w, offsets.cuda(), idx


@pytest.mark.parametrize(
    "counts,extra",
    [([0] * 8, 64), ([0] * 8, 0), ([3, 0, 1, 200, 0, 0, 0, 0], 0), ([0] * 5 + [0, 0, 129], 33),
     ([1] * 8, 1)],
    ids=["all-empty", "nothing", "tiny-and-empty", "past-last-offset", "one-row-experts"],
)
@gpu
def test_splits_off_the_16_row_grid(counts, extra):
    """Any row count per expert (the kernel does not need the layout's 16-row alignment), empty
    experts, rows past the last offset (zeros)."""
    a, w, offsets, idx = _splits_case(counts, extra)
    S = idx.shape[0]
    if S == 0:
        out = torch.empty(0, w.shape[2], dtype=BF16, device="cuda")
        assert grouped_mm_gather(a, w, offsets, idx, out, backend="sm90") is out
        return
    out = _run(a, w, offsets, idx)
    ref = grouped_mm_gather_torch(a, w, offsets, idx)
    _check_close(out, ref)
    last = int(offsets[-1])
    assert (out[last:] == 0).all()


@gpu
def test_bitwise_deterministic_and_no_recompile_for_new_splits():
    gen = torch.Generator().manual_seed(5)
    T, K, N, E = 400, 512, 768, 16
    layout = _routing(T, E, 4, gen)
    a, w = _operands(T, K, N, E, gen)
    idx, offsets = layout.row_to_token_S.cuda(), layout.offsets_E.cuda()
    out1 = _run(a, w, offsets, idx)
    before = sm90.FAMILY.compile_count
    out2 = _run(a, w, offsets, idx)
    assert torch.equal(out1, out2)
    layout2 = _routing(T + 37, E, 4, gen, hot=3)
    a2, _ = _operands(T + 37, K, N, E, gen)
    out3 = _run(a2, w, layout2.offsets_E.cuda(), layout2.row_to_token_S.cuda())
    _check_close(out3, grouped_mm_gather_torch(a2, w, layout2.offsets_E.cuda(),
                                               layout2.row_to_token_S.cuda()))
    assert sm90.FAMILY.compile_count == before, "a new split / token count recompiled"


@gpu
def test_row_strided_source_and_rows_mode():
    gen = torch.Generator().manual_seed(6)
    T, K, N, E = 150, 256, 256, 4
    layout = _routing(T, E, 2, gen)
    a, w = _operands(T, K, N, E, gen, lda=K + 64)  # a view: row stride K + 64
    assert a.stride(0) == K + 64
    idx, offsets = layout.row_to_token_S.cuda(), layout.offsets_E.cuda()
    _check_close(_run(a, w, offsets, idx), grouped_mm_gather_torch(a, w, offsets, idx))
    rows = torch.randn(idx.shape[0], K + 8, generator=gen).to(BF16).cuda()[:, :K]
    out = _run(rows, w, offsets, None)
    _check_close(out, grouped_mm_gather_torch(rows, w, offsets))


@gpu
@pytest.mark.parametrize(
    "seed,T,tile", [(7, 300, None), (8, 600, _T(128, 256, 64, 4, epi_tma=True))],
    ids=["default", "epi-tma"],
)
def test_cuda_graph_replay_with_new_offsets(seed, T, tile):
    """A captured launch replays with new offsets and indices; with ``epi_tma`` (TMA descriptors
    built per launch from the tensors; more or fewer whole tiles per split) it also stays
    bitwise the register path."""
    gen = torch.Generator().manual_seed(seed)
    K, N, E = 256, 512, 8
    l1 = _routing(T, E, 2, gen)
    l2 = _routing(T, E, 2, gen, hot=2)
    S = max(l1.tokens_sum, l2.tokens_sum)
    a, w = _operands(T, K, N, E, gen)

    def padded(layout):
        idx = torch.full((S,), -1, dtype=torch.int64)
        idx[: layout.tokens_sum] = layout.row_to_token_S
        return idx.cuda(), layout.offsets_E.cuda()

    idx, offsets = padded(l1)
    out = torch.full((S, N), float("nan"), dtype=BF16, device="cuda")
    grouped_mm_gather(a, w, offsets, idx, out, backend="sm90", tile=tile)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        grouped_mm_gather(a, w, offsets, idx, out, backend="sm90", tile=tile)
    torch.cuda.synchronize()
    for layout in (l1, l2):
        i2, o2 = padded(layout)
        idx.copy_(i2)
        offsets.copy_(o2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_close(out, grouped_mm_gather_torch(a, w, offsets, idx))
        if tile is not None:
            assert torch.equal(out, _run(a, w, offsets, idx, _register_tile(tile)))


# ------------------------------------------------------------------------------------------------
# GPU: the TMA-store epilogue (Sm90GroupedMmTile.epi_tma) against the register stores
# ------------------------------------------------------------------------------------------------

_TMA_GRID = [
    # (id, T, K, N, E, top_k, tile, hot expert); every case has whole tiles (TMA stores) and
    # experts' last partial tiles (register stores) side by side
    ("coop-128x256", 700, 256, 512, 8, 2, _T(128, 256, 64, 4, epi_tma=True), None),
    ("pingpong-128x128", 700, 192, 256, 6, 2, _T(128, 128, 64, 6, True, epi_tma=True), None),
    ("64-row-tiles", 300, 128, 128, 5, 3, _T(64, 128, 64, 8, epi_tma=True), None),
    ("hot-expert-partial-n", 1000, 200, 200, 4, 2, _T(128, 128, 64, 6, epi_tma=True), 1),
    ("128x192pp", 700, 256, 384, 8, 2, _T(128, 192, 64, 5, True, epi_tma=True), None),
]


def _register_tile(tile):
    return dataclasses.replace(tile, epi_tma=False)


@gpu
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "rows"])
@pytest.mark.parametrize("case", _TMA_GRID, ids=[c[0] for c in _TMA_GRID])
def test_epi_tma_store_is_the_register_store_bitwise(case, gather):
    """The TMA-store epilogue writes what the register stores write, bit for bit, on every row
    (NaN-poisoned before): whole tiles through shared memory, partial ones from registers,
    padding rows +0; and it matches the twin."""
    _id, T, K, N, E, top_k, tile, hot = case
    gen = torch.Generator().manual_seed(90 + _TMA_GRID.index(case))
    layout = _routing(T, E, top_k, gen, hot=hot)
    a, w = _operands(T, K, N, E, gen)
    idx, offsets = layout.row_to_token_S.cuda(), layout.offsets_E.cuda()
    if not gather:
        a = torch.where((idx >= 0)[:, None], a[idx.clamp(min=0)], 0)
        idx = None
    out_tma = _run(a, w, offsets, idx, tile)
    out_reg = _run(a, w, offsets, idx, _register_tile(tile))
    assert torch.equal(out_tma, out_reg)
    ref = grouped_mm_gather_torch(a, w, offsets, idx)
    _check_close(out_tma, ref)


@gpu
def test_epi_tma_rows_past_the_last_expert_and_empty_experts():
    """Whole tiles of the rows past the last offset (zeros) and one-tile experts next to empty
    ones, with the gathered-rows side output on: bitwise the register epilogue's."""
    counts, extra = [256, 0, 129, 0, 128, 3, 0, 384], 300
    a, w, offsets, idx = _splits_case(counts, extra, K=192, N=256)
    tile = _T(128, 256, 64, 4, epi_tma=True)
    outs = []
    for t in (tile, _register_tile(tile)):
        out = torch.full((idx.shape[0], 256), float("nan"), dtype=BF16, device="cuda")
        rows = torch.full((idx.shape[0], 192), float("nan"), dtype=BF16, device="cuda")
        grouped_mm_gather(a, w, offsets, idx, out, backend="sm90", tile=t, a_rows_out=rows)
        torch.cuda.synchronize()
        outs.append((out, rows))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert (outs[0][0][int(offsets[-1]):] == 0).all()
    _check_close(outs[0][0], grouped_mm_gather_torch(a, w, offsets, idx))


# ------------------------------------------------------------------------------------------------
# GPU: the gated (forward gate/up) epilogue
# ------------------------------------------------------------------------------------------------

_GATED_ACTS = {
    "swiglu": (Activation("swiglu"), None, False),
    "gpt-oss": (Activation("gpt_oss", 1.702, 1.0),
                ClampLimits(linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
                            non_linear_clamp_upper_limit=7.0), True),
}


def _within_ulps(out, ref, n, floor=1e-5):
    """Every element within ``n`` BF16 ulps of ``ref`` (ulp of |ref|'s binade) plus ``floor``."""
    d = (out.float() - ref.float()).abs()
    ulp = torch.ldexp(torch.ones_like(d), torch.frexp(ref.float()).exponent - 8)
    bad = int((d > n * ulp + floor).sum())
    assert bad == 0, f"{bad} elements beyond {n} ulps (max diff {d.max().item()})"


def _preact_sum_bound(x, w, layout, plan, R):
    """[R, 2, I] fp32 bound on the difference of two fp32 sums of the gate/up pre-activation in
    different orders: ``K * 2^-24 * (|x[token]| @ |w[e]|)`` per pair (pair order, as the
    checkpoint), plus one BF16 ulp of the pre-rounding magnitude is left to the caller."""
    K = x.shape[1]
    ends = layout.offsets_E.tolist()
    rows = layout.row_to_token_S
    pair = layout.row_to_pair_S
    mag = torch.zeros(R, w.shape[2], dtype=torch.float32, device=x.device)
    begin = 0
    for e, end in enumerate(ends):
        idx, p = rows[begin:end], pair[begin:end]
        live = idx >= 0
        if live.any():
            mag[p[live]] = x[idx[live]].float().abs() @ w[e].float().abs()
        begin = end
    return (K * 2.0**-24 * mag).view(R, 2, -1)


def _ah_bound(act_t, pre, act_fn, layout, plan):
    """[S, I] fp32 bound on ``a * h`` from pre-activation errors ``pre + 1 ulp`` of g and u:
    ``a (|dh/dg| dg + |dh/du| du)`` at the twin's clamped g, u (derivatives as
    ``common.problem.Activation`` states them), in row order (padding rows 0)."""
    g, u = act_t[:, 0].float(), act_t[:, 1].float()
    ulp = lambda v: torch.ldexp(torch.ones_like(v), torch.frexp(v).exponent - 8)  # noqa: E731
    dg, du = pre[:, 0] + ulp(g), pre[:, 1] + ulp(u)
    s = torch.sigmoid(act_fn.alpha * g)
    up = u + act_fn.up_offset
    dh_dg = up * s * (1 + act_fn.alpha * g * (1 - s))
    dh_du = g * s
    per_pair = plan.pair_affinity_R.float().abs()[:, None] * (
        dh_dg.abs() * dg + dh_du.abs() * du
    )
    r2p = layout.row_to_pair_S
    out = per_pair[r2p.clamp(min=0)]
    return torch.where((r2p >= 0)[:, None], out, torch.zeros_like(out))


_GATED_GRID = [
    # (id, T, H, I, E, top_k, activation, tile)
    ("swiglu-coop-128x256", 300, 256, 384, 8, 2, "swiglu", _T(128, 256, 64, 4)),
    ("swiglu-pingpong-128x128", 300, 256, 192, 8, 2, "swiglu", _T(128, 128, 64, 6, True)),
    ("gpt-oss-partial-i", 200, 192, 200, 6, 2, "gpt-oss", _T(128, 256, 64, 4)),
    ("gpt-oss-pingpong-partial", 200, 192, 200, 6, 2, "gpt-oss", _T(128, 128, 64, 6, True)),
    ("qwen3-30b", 256, 2048, 768, 128, 8, "swiglu", None),
    ("gpt-oss-120b", 128, 2880, 2880, 32, 4, "gpt-oss", None),
]


def _gated_case(T, H, I, E, top_k, name, gen, hot=None):
    """A gate/up problem on the GPU: ``(args, bias, plan, layout, act_fn, clamp)``, ``args`` the
    positional operands of ``grouped_mm_gated`` (x [T, H] and w [E, H, 2I] BF16, offsets, the
    row -> token and row -> pair indexes, the pair affinities, num_pairs), ``bias`` [E, 2, I]
    fp32 for the activations that take one (else None)."""
    act_fn, clamp, with_bias = _GATED_ACTS[name]
    plan, layout = _routing_plan(T, E, top_k, gen, hot=hot)
    x = torch.randn(T, H, generator=gen).to(BF16).cuda()
    w = (torch.randn(E, H, 2 * I, generator=gen) * 2 / H**0.5).to(BF16).cuda()
    bias = torch.randn(E, 2, I, generator=gen).cuda() if with_bias else None
    args = (x, w, layout.offsets_E, layout.row_to_token_S, layout.row_to_pair_S,
            plan.pair_affinity_R, plan.num_pairs)
    return args, bias, plan, layout, act_fn, clamp


@gpu
@pytest.mark.parametrize("case", _GATED_GRID, ids=[c[0] for c in _GATED_GRID])
def test_gated_matches_twin_and_writes_everything(case):
    _id, T, H, I, E, top_k, name, tile = case
    gen = torch.Generator().manual_seed(_GATED_GRID.index(case))
    args, bias, plan, layout, act_fn, clamp = _gated_case(T, H, I, E, top_k, name, gen)
    x, w = args[:2]
    R, S = plan.pair_token_R.shape[0], layout.tokens_sum
    act = torch.full((R, 2, I), float("nan"), dtype=BF16, device="cuda")
    ah = torch.full((S, I), float("nan"), dtype=BF16, device="cuda")
    grouped_mm_gated(*args, activation=act_fn, clamp_limits=clamp, bias=bias, act_out=act,
                     ah_out=ah, backend="sm90", tile=tile)
    torch.cuda.synchronize()
    assert torch.isfinite(act).all() and torch.isfinite(ah).all(), "unwritten outputs remain"
    act_t, ah_t = gate_up_activation_torch(
        *args[:-1], activation=act_fn, clamp_limits=clamp, bias_E2I=bias
    )
    # The checkpoint is the clamped pre-activation g + bias: with a bias the value can be far
    # below the K-term sum it cancels from (gpt-oss-120b, K = 2880: 1 element 0.03125 off at a
    # small |ref|, H200 2026-12-02), so its bound is 1 ulp of the value plus the fp32 summation
    # bound K * 2^-24 * sum_k |x w| (wgmma's order vs torch's); a * h within 2 ulps plus that
    # bound carried through the activation's derivatives (4 elements of the same case were up
    # to 0.0625 off under a flat 2-ulp bound, H200 2026-12-02T02:55Z).
    pre = _preact_sum_bound(x, w, layout, plan, R)
    _within_ulps(act, act_t, 1, floor=pre)
    _within_ulps(ah, ah_t, 2, floor=_ah_bound(act_t, pre, act_fn, layout, plan))
    assert (ah[layout.row_to_pair_S < 0] == 0).all()
    assert (act[int(plan.num_pairs):] == 0).all()
    act2, ah2 = grouped_mm_gated(*args, activation=act_fn, clamp_limits=clamp, bias=bias,
                                 backend="sm90", tile=tile)
    assert torch.equal(act2, act) and torch.equal(ah2, ah), "not bitwise deterministic"


def _pairs_in_rows(act_R2I, layout):
    """A pair-order checkpoint [R, 2, I] in grouped row order [S, 2I] (padding rows 0)."""
    r2p = layout.row_to_pair_S
    rows = act_R2I[r2p.clamp(min=0)].reshape(r2p.shape[0], -1)
    return torch.where((r2p >= 0)[:, None], rows, torch.zeros_like(rows))


@gpu
@pytest.mark.parametrize("case", _GATED_GRID, ids=[c[0] for c in _GATED_GRID])
def test_gated_checkpoint_rows_is_the_pair_checkpoint_in_row_order(case):
    """``checkpoint_rows``: every row of the [S, 2I] checkpoint (NaN-poisoned) is its pair's
    row of the pair-order checkpoint, bit for bit, padding rows +0, and ``a_h`` is unchanged:
    the two forms differ only in where the epilogue stores."""
    _id, T, H, I, E, top_k, name, tile = case
    gen = torch.Generator().manual_seed(60 + _GATED_GRID.index(case))
    args, bias, plan, layout, act_fn, clamp = _gated_case(T, H, I, E, top_k, name, gen)
    S = layout.tokens_sum
    kw = dict(activation=act_fn, clamp_limits=clamp, bias=bias, backend="sm90", tile=tile)
    act_p, ah_p = grouped_mm_gated(*args, **kw)
    act_r = torch.full((S, 2 * I), float("nan"), dtype=BF16, device="cuda")
    ah_r = torch.full((S, I), float("nan"), dtype=BF16, device="cuda")
    grouped_mm_gated(*args, **kw, act_out=act_r, ah_out=ah_r, checkpoint_rows=True)
    torch.cuda.synchronize()
    assert torch.equal(ah_r, ah_p)
    assert torch.equal(act_r, _pairs_in_rows(act_p, layout))
    twin_r, _ = gate_up_activation_torch(*args[:-1], activation=act_fn, clamp_limits=clamp,
                                        bias_E2I=bias, checkpoint_rows=True)
    twin_p, _ = gate_up_activation_torch(*args[:-1], activation=act_fn, clamp_limits=clamp,
                                        bias_E2I=bias)
    assert torch.equal(twin_r, _pairs_in_rows(twin_p, layout))


_GATED_TMA_TILES = {
    "coop-128x256": _T(128, 256, 64, 4, epi_tma=True),
    "pingpong-128x128": _T(128, 128, 64, 6, True, epi_tma=True),
    "pingpong-64x256": _T(64, 256, 64, 5, True, epi_tma=True),
}


@gpu
@pytest.mark.parametrize("tile_id", list(_GATED_TMA_TILES))
@pytest.mark.parametrize("name", list(_GATED_ACTS))
def test_gated_epi_tma_is_the_register_epilogue_bitwise(name, tile_id):
    """The gated epilogue with the row-order checkpoint through TMA stores (whole tiles; the
    experts' last tiles from registers): ``a_h`` and the checkpoint (NaN-poisoned) bit for bit
    those of the register epilogue, with bias and clamp (gpt-oss) and without (SwiGLU)."""
    tile = _GATED_TMA_TILES[tile_id]
    gen = torch.Generator().manual_seed(70)
    T, H, I, E = 700, 256, 384, 8
    args, bias, plan, layout, act_fn, clamp = _gated_case(T, H, I, E, 2, name, gen, hot=3)
    S = layout.tokens_sum
    outs = []
    for t in (tile, _register_tile(tile)):
        act = torch.full((S, 2 * I), float("nan"), dtype=BF16, device="cuda")
        ah = torch.full((S, I), float("nan"), dtype=BF16, device="cuda")
        grouped_mm_gated(*args, activation=act_fn, clamp_limits=clamp, bias=bias, act_out=act,
                         ah_out=ah, backend="sm90", tile=t, checkpoint_rows=True)
        torch.cuda.synchronize()
        outs.append((act, ah))
    assert torch.equal(outs[0][0], outs[1][0]), "checkpoint differs"
    assert torch.equal(outs[0][1], outs[1][1]), "a_h differs"
    assert (outs[0][1][layout.row_to_pair_S < 0] == 0).all()


@gpu
@pytest.mark.parametrize("name", list(_GATED_ACTS))
def test_gated_matches_the_layers_gemm_then_pass(name):
    """Against what the layer runs today: cuBLAS's grouped GEMM on gathered rows (BF16 out),
    then ``activation_forward``; the fused path skips the BF16 rounding of the pre-activation,
    so the checkpoint differs by at most half an ulp of the accumulator plus one rounding
    flip."""
    from cuda_kernels.triton.rows import gather_rows
    from cuda_kernels.triton.activation import activation_forward

    gen = torch.Generator().manual_seed(21)
    T, H, I, E = 512, 1024, 512, 16
    (x, w, *_), bias, plan, layout, act_fn, clamp = _gated_case(T, H, I, E, 4, name, gen)
    gu = torch._grouped_mm(gather_rows(x, layout.row_to_token_S), w, offs=layout.offsets_E)
    act_p, ah_p = activation_forward(gu, layout.row_to_pair_S, plan, activation=act_fn,
                                     clamp_limits=clamp or ClampLimits(), b_gate_up_E2I=bias)
    act_f, ah_f = gate_up_forward(x, w.reshape(E, H, 2, I), layout, plan, activation=act_fn,
                                  clamp_limits=clamp, b_gate_up_E2I=bias, backend="sm90")
    torch.cuda.synchronize()
    d = (act_f.float() - act_p.float()).abs()
    g_abs = torch.zeros(plan.pair_token_R.shape[0] + 1, 2 * I, device="cuda")
    r2p = layout.row_to_pair_S
    g_abs[torch.where(r2p >= 0, r2p, g_abs.shape[0] - 1)] = gu.float().abs()
    g_abs = g_abs[:-1].reshape(-1, 2, I)
    ulp = torch.ldexp(torch.ones_like(d), torch.frexp(act_p.float()).exponent - 8)
    assert (d <= 2**-8 * g_abs * 1.01 + ulp + 1e-5).all()
    rel = ((ah_f.float() - ah_p.float()).norm() / ah_p.float().norm()).item()
    assert rel < 5e-3
    assert torch.equal(act_f[int(plan.num_pairs):], act_p[int(plan.num_pairs):])


# ------------------------------------------------------------------------------------------------
# GPU: the dgated (backward down-dgrad) epilogue
# ------------------------------------------------------------------------------------------------


def _dgated_case(T, H, I, E, top_k, name, gen):
    (x, w_gu, *_), bias, plan, layout, act_fn, clamp = _gated_case(T, H, I, E, top_k, name, gen)
    act, _ = gate_up_forward(x, w_gu.reshape(E, H, 2, I), layout, plan, activation=act_fn,
                             clamp_limits=clamp, b_gate_up_E2I=bias, backend="torch")
    dy = torch.randn(T, H, generator=gen).to(BF16).cuda()
    w_d = (torch.randn(E, I, H, generator=gen) / I**0.5).to(BF16).cuda()
    return dy, w_d, act, plan, layout, act_fn, clamp


_DGATED_GRID = [
    # (id, T, H, I, E, top_k, activation, tile)
    ("swiglu-coop-128x256", 300, 256, 384, 8, 2, "swiglu", _T(128, 256, 64, 4)),
    ("gpt-oss-pingpong-partial-i", 200, 192, 200, 6, 2, "gpt-oss", _T(128, 128, 64, 6, True)),
    ("qwen3-30b", 256, 2048, 768, 128, 8, "swiglu", None),
    ("gpt-oss-120b", 128, 2880, 2880, 32, 4, "gpt-oss", None),
]


@gpu
@pytest.mark.parametrize("case", _DGATED_GRID, ids=[c[0] for c in _DGATED_GRID])
def test_dgated_matches_twin(case):
    _id, T, H, I, E, top_k, name, tile = case
    gen = torch.Generator().manual_seed(40 + _DGATED_GRID.index(case))
    dy, w_d, act, plan, layout, act_fn, clamp = _dgated_case(T, H, I, E, top_k, name, gen)
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, layout.row_to_token_S,
            layout.row_to_pair_S, plan.pair_affinity_R, act)
    dgu, ah, da = grouped_mm_dgated(*args, activation=act_fn, clamp_limits=clamp,
                                    backend="sm90", tile=tile)
    torch.cuda.synchronize()
    dgu_t, ah_t, da_t = down_dgrad_activation_torch(*args, activation=act_fn,
                                                    clamp_limits=clamp)
    assert torch.isfinite(dgu).all() and torch.isfinite(ah).all() and torch.isfinite(da).all()
    _within_ulps(dgu, dgu_t, 2)
    _within_ulps(ah, ah_t, 1)
    torch.testing.assert_close(da, da_t, rtol=1e-4, atol=1e-4 * da_t.abs().max().item())
    pad = layout.row_to_pair_S < 0
    assert (dgu[pad] == 0).all() and (ah[pad] == 0).all() and (da[pad] == 0).all()
    again = grouped_mm_dgated(*args, activation=act_fn, clamp_limits=clamp, backend="sm90",
                              tile=tile)
    for x, y in zip((dgu, ah, da), again):
        assert torch.equal(x, y), "not bitwise deterministic"


@gpu
@pytest.mark.parametrize("case", _DGATED_GRID, ids=[c[0] for c in _DGATED_GRID])
def test_dgated_reads_the_row_order_checkpoint(case):
    """A checkpoint in grouped row order [S, 2I] gives the pair-order outputs bit for bit
    (the epilogue loads row s's g, u at row s instead of at its pair's row)."""
    _id, T, H, I, E, top_k, name, tile = case
    gen = torch.Generator().manual_seed(70 + _DGATED_GRID.index(case))
    dy, w_d, act, plan, layout, act_fn, clamp = _dgated_case(T, H, I, E, top_k, name, gen)
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, layout.row_to_token_S,
            layout.row_to_pair_S, plan.pair_affinity_R)
    kw = dict(activation=act_fn, clamp_limits=clamp, backend="sm90", tile=tile)
    by_pair = grouped_mm_dgated(*args, act, **kw)
    by_row = grouped_mm_dgated(*args, _pairs_in_rows(act, layout), **kw)
    torch.cuda.synchronize()
    for p, r in zip(by_pair, by_row):
        assert torch.equal(p, r)


_DGATED_TMA_TILES = {
    "coop-128x256": _T(128, 256, 64, 4, epi_tma=True),
    "coop-128x128": _T(128, 128, 64, 6, epi_tma=True),
    "64-row": _T(64, 256, 64, 4, epi_tma=True),
    "pingpong-64x256": _T(64, 256, 64, 5, True, epi_tma=True),
}


@gpu
@pytest.mark.parametrize("tile_id", list(_DGATED_TMA_TILES))
@pytest.mark.parametrize("name", list(_GATED_ACTS))
def test_dgated_epi_tma_is_the_register_epilogue_bitwise(name, tile_id):
    """The dgated epilogue with the row-order checkpoint through TMA stores (whole tiles; the
    experts' last tiles from registers): d_gate_up, a_h and the affinity gradient bit for bit
    those of the register epilogue, with the clamp masks (gpt-oss) and without (SwiGLU)."""
    tile = _DGATED_TMA_TILES[tile_id]
    gen = torch.Generator().manual_seed(80)
    T, H, I, E = 700, 256, 512, 8
    dy, w_d, act, plan, layout, act_fn, clamp = _dgated_case(T, H, I, E, 2, name, gen)
    S = layout.tokens_sum
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, layout.row_to_token_S,
            layout.row_to_pair_S, plan.pair_affinity_R, _pairs_in_rows(act, layout))
    outs = []
    for t in (tile, _register_tile(tile)):
        outs.append(grouped_mm_dgated(*args, activation=act_fn, clamp_limits=clamp,
                                      backend="sm90", tile=t))
        torch.cuda.synchronize()
    for x, y, what in zip(*outs, ("d_gate_up", "a_h", "dA")):
        assert torch.equal(x, y), f"{what} differs"
    assert all(torch.isfinite(x).all() for x in outs[0])
    assert outs[0][0].shape == (S, 2 * I)


@gpu
@pytest.mark.parametrize("name", list(_GATED_ACTS))
def test_dgated_matches_the_layers_gemm_then_pass(name):
    """Against the backward's first steps today: cuBLAS's grouped GEMM of gathered dY rows
    (BF16 dh_raw), then ``activation_backward``."""
    from cuda_kernels.triton.activation import activation_backward
    from cuda_kernels.triton.rows import gather_rows

    gen = torch.Generator().manual_seed(50)
    T, H, I, E = 512, 1024, 512, 16
    dy, w_d, act, plan, layout, act_fn, clamp = _dgated_case(T, H, I, E, 4, name, gen)
    dh = torch._grouped_mm(gather_rows(dy, layout.row_to_token_S), w_d.transpose(1, 2),
                           offs=layout.offsets_E)
    dgu_p, ah_p, da_p = activation_backward(dh, act, layout.row_to_pair_S, plan,
                                            activation=act_fn,
                                            clamp_limits=clamp or ClampLimits())
    dgu_f, ah_f, da_f = down_dgrad_backward(dy, w_d, layout, plan, act, activation=act_fn,
                                            clamp_limits=clamp, backend="sm90")
    torch.cuda.synchronize()
    _within_ulps(ah_f, ah_p, 1)
    rel = ((dgu_f.float() - dgu_p.float()).norm() / dgu_p.float().norm()).item()
    assert rel < 5e-3
    torch.testing.assert_close(da_f, da_p, rtol=2e-2, atol=1e-2 * da_p.abs().max().item())
    assert torch.equal(da_f == 0, da_p == 0)


# ------------------------------------------------------------------------------------------------
# GPU: the gathered-rows side output (a_rows_out / write_a_rows), every epilogue
# ------------------------------------------------------------------------------------------------


def _bits(t):
    """Bit patterns (BF16 -> int16, fp32 -> int32): torch.equal would take -0.0 for +0.0."""
    return t.contiguous().view(torch.int16 if t.dtype == BF16 else torch.int32)


def _assert_bitwise(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bad = int((_bits(got) != _bits(want)).sum())
    assert bad == 0, f"{what}: {bad} elements differ bitwise"


def _rows_layout(T, E, top_k, gen, hot=None, extra=0):
    """``(plan, layout)`` of :func:`_routing_plan` (align 16: padding rows; every third expert
    empty), with tokens 0 and T-1 turned into padding rows (their source rows get NaN: a read
    padding row would show) and ``extra`` rows past ``offsets_E[-1]`` whose index is VALID
    (the last one -1): the side output holds gather_rows' output there too."""
    plan, layout = _routing_plan(T, E, top_k, gen, hot=hot)
    idx = layout.row_to_token_S.clone()
    for t in (0, T - 1):
        idx[idx == t] = -1
    r2p = layout.row_to_pair_S
    if extra:
        past = torch.randint(1, T - 1, (extra,), generator=gen).cuda()
        past[-1] = -1
        idx = torch.cat([idx, past])
        r2p = torch.cat([r2p, torch.full((extra,), -1, dtype=r2p.dtype, device=r2p.device)])
    layout = dataclasses.replace(layout, row_to_token_S=idx, row_to_pair_S=r2p,
                                 tokens_sum=idx.shape[0])
    assert (idx < 0).any() and (extra == 0 or int(layout.offsets_E[-1]) < idx.shape[0])
    return plan, layout


def _nan_rows(src, T):
    """``src`` [T, K] with NaN in rows 0 and T-1 (no index refers to them)."""
    src = src.clone()
    src[0] = float("nan")
    src[T - 1] = float("nan")
    return src


def _poison(S, K):
    return torch.full((S, K), float("nan"), dtype=BF16, device="cuda")


_ROWS_GRID = [
    # (id, epilogue, T, K, N (store) or I (gated / dgated), E, top_k, hot, extra, tile,
    #  w_major, index dtype, activation)
    ("store-coop-uneven-past-last", "store", 300, 256, 512, 8, 2, None, 40,
     _T(128, 256, 64, 4), "n", torch.int64, None),
    ("store-pingpong-hot-k-major-int32-partial-k", "store", 400, 200, 256, 6, 2, 2, 17,
     _T(128, 128, 64, 6, True), "k", torch.int32, None),
    ("store-64row-one-k-tile", "store", 77, 64, 128, 5, 3, None, 3,
     _T(64, 128, 64, 8), "n", torch.int64, None),
    ("store-coop-192-hot-past-last", "store", 400, 256, 384, 8, 2, 3, 40,
     _T(128, 192, 64, 5), "n", torch.int64, None),
    ("gated-swiglu-coop-wrapper", "gated", 300, 256, 384, 8, 2, None, 20,
     _T(128, 256, 64, 4), "n", torch.int64, "swiglu"),
    # (top_k 1: a hot expert merges no duplicate pairs, so R = T <= S)
    ("gated-gpt-oss-pingpong-hot-bias", "gated", 200, 192, 200, 6, 1, 1, 9,
     _T(128, 128, 64, 6, True), "n", torch.int64, "gpt-oss"),
    ("dgated-swiglu-coop-wrapper", "dgated", 300, 256, 384, 8, 2, None, 20,
     _T(128, 256, 64, 4), "k", torch.int64, "swiglu"),
    ("dgated-gpt-oss-pingpong-hot", "dgated", 200, 192, 200, 6, 2, 4, 9,
     _T(128, 128, 64, 6, True), "k", torch.int64, "gpt-oss"),
]


@gpu
@pytest.mark.parametrize("case", _ROWS_GRID, ids=[c[0] for c in _ROWS_GRID])
def test_a_rows_out_is_gather_rows_bitwise_and_outputs_unchanged(case):
    """The kernel's side output (NaN-poisoned before) against the layer's gather pass, bitwise,
    on every row (padding rows +0, rows past the last expert with valid indices gathered, rows
    of the next expert's tile untouched: uneven, empty and hot experts), and the main outputs
    bitwise those of the same call without it (one compile per key: ``write_a_rows``)."""
    from cuda_kernels.triton.rows import gather_rows

    _id, epi, T, K, n, E, top_k, hot, extra, tile, w_major, idx_dtype, act_name = case
    gen = torch.Generator().manual_seed(70 + _ROWS_GRID.index(case))
    plan, layout = _rows_layout(T, E, top_k, gen, hot=hot, extra=extra)
    idx = layout.row_to_token_S.to(idx_dtype)
    S = idx.shape[0]
    before = sm90.FAMILY.compile_count
    if epi == "store":
        a, w = _operands(T, K, n, E, gen, w_major)
        a = _nan_rows(a, T)
        offsets = layout.offsets_E
        out0 = torch.full((S, n), float("nan"), dtype=BF16, device="cuda")
        grouped_mm_gather(a, w, offsets, idx, out0, backend="sm90", tile=tile)
        rows = _poison(S, K)
        out1 = torch.full_like(out0, float("nan"))
        grouped_mm_gather(a, w, offsets, idx, out1, backend="sm90", tile=tile, a_rows_out=rows)
        torch.cuda.synchronize()
        assert not out1.isnan().any()
        mains = [(out1, out0, "out")]
    elif epi == "gated":
        act_fn, clamp, with_bias = _GATED_ACTS[act_name]
        a = _nan_rows(torch.randn(T, K, generator=gen).to(BF16).cuda(), T)
        w = (torch.randn(E, K, 2 * n, generator=gen) * 2 / K**0.5).to(BF16).cuda()
        bias = torch.randn(E, 2, n, generator=gen).cuda() if with_bias else None
        rows = _poison(S, K)
        if _id.endswith("wrapper"):  # the layer's entry: x_rows_out
            kw = {"activation": act_fn, "clamp_limits": clamp, "b_gate_up_E2I": bias,
                  "backend": "sm90", "tile": tile}
            w4 = w.reshape(E, K, 2, n)
            got0 = gate_up_forward(a, w4, layout, plan, **kw)
            got1 = gate_up_forward(a, w4, layout, plan, **kw, x_rows_out=rows)
        else:
            args = (a, w, layout.offsets_E, idx, layout.row_to_pair_S, plan.pair_affinity_R,
                    plan.num_pairs)
            kw = {"activation": act_fn, "clamp_limits": clamp, "bias": bias,
                  "backend": "sm90", "tile": tile}
            got0 = grouped_mm_gated(*args, **kw)
            got1 = grouped_mm_gated(*args, **kw, a_rows_out=rows)
        torch.cuda.synchronize()
        mains = list(zip(got1, got0, ("act", "a_h")))
    else:
        act_fn, clamp, with_bias = _GATED_ACTS[act_name]
        a = _nan_rows(torch.randn(T, K, generator=gen).to(BF16).cuda(), T)  # dY [T, H]
        w_d = (torch.randn(E, n, K, generator=gen) / n**0.5).to(BF16).cuda()  # [E, I, H]
        R = plan.pair_token_R.shape[0]
        act = (torch.randn(R, 2, n, generator=gen) * 3).to(BF16).cuda()
        rows = _poison(S, K)
        if _id.endswith("wrapper"):  # the layer's entry: dy_rows_out
            kw = {"activation": act_fn, "clamp_limits": clamp, "backend": "sm90", "tile": tile}
            got0 = down_dgrad_backward(a, w_d, layout, plan, act, **kw)
            got1 = down_dgrad_backward(a, w_d, layout, plan, act, **kw, dy_rows_out=rows)
        else:
            args = (a, w_d.transpose(1, 2), layout.offsets_E, idx, layout.row_to_pair_S,
                    plan.pair_affinity_R, act)
            kw = {"activation": act_fn, "clamp_limits": clamp, "backend": "sm90", "tile": tile}
            got0 = grouped_mm_dgated(*args, **kw)
            got1 = grouped_mm_dgated(*args, **kw, a_rows_out=rows)
        torch.cuda.synchronize()
        mains = list(zip(got1, got0, ("d_gate_up", "a_h", "dA")))
    assert sm90.FAMILY.compile_count - before <= 2  # at most the key and its write_a_rows twin
    for got, want, what in mains:
        _assert_bitwise(got, want, f"{what} with a_rows_out vs without")
    want_rows = gather_rows(a, idx, torch.bfloat16)
    _assert_bitwise(rows, want_rows, "a_rows_out vs gather_rows")
    assert (_bits(rows[idx < 0]) == 0).all(), "padding rows must be +0.0"
    last = int(layout.offsets_E[-1])
    if extra:
        assert (idx[last:] >= 0).any() and torch.isfinite(rows[last:][idx[last:] >= 0]).all()


@pytest.mark.parametrize(
    "counts,extra",
    [([0] * 8, 64), ([3, 0, 1, 200, 0, 0, 0, 0], 0), ([0] * 5 + [0, 0, 129], 33),
     ([1] * 8, 1)],
    ids=["all-empty", "tiny-and-empty", "past-last-offset", "one-row-experts"],
)
@gpu
def test_a_rows_out_off_the_16_row_grid(counts, extra):
    """The side output on :func:`test_splits_off_the_16_row_grid`'s splits (random indices,
    -1 included, on every row: all rows past the last expert when every expert is empty; one-row
    experts: a tile per row), one key: bitwise gather_rows, main output unchanged."""
    from cuda_kernels.triton.rows import gather_rows

    a, w, offsets, idx = _splits_case(counts, extra)
    S, K = idx.shape[0], a.shape[1]
    out0 = _run(a, w, offsets, idx)
    rows = _poison(S, K)
    out1 = torch.full_like(out0, float("nan"))
    grouped_mm_gather(a, w, offsets, idx, out1, backend="sm90", a_rows_out=rows)
    torch.cuda.synchronize()
    _assert_bitwise(out1, out0, "out with a_rows_out vs without")
    _assert_bitwise(rows, gather_rows(a, idx, torch.bfloat16), "a_rows_out vs gather_rows")
