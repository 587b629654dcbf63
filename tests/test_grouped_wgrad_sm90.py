"""Tests of the SM90 (Hopper) CuTe DSL grouped wgrad kernel (gemm/sm90/wgrad_bf16.py).

CPU part (CI): key / tile-config validation, the YAML tile rules, and an offline compile for
``sm_90a`` whose PTX must contain wgmma and TMA bulk-tensor loads (skipped when nvidia-cutlass-dsl
is not installed).

GPU part (``gpu`` + ``sm90`` markers, skipped without an SM90 device): correctness against an fp32
per-expert reference over a grid of layouts, output dtypes, output modes and accumulation, with
uneven splits holding empty experts and outputs poisoned by NaN before each call; all experts
empty; a NaN first row in the expert after a ragged K tile (no leakage across experts); FP32
accumulation 256 + 1 == 257; CUDA graph capture and replay with new offsets values; no recompile
for new splits. The GPU tests drive the kernel through ``compile_sm90_wgrad``'s launcher (the
public API wraps the same launcher).
"""

import importlib.util
import math
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90
from cuda_kernels.gemm.sm90.wgrad_bf16 import (
    Sm90TileConfig,
    Sm90WgradKey,
    select_sm90_tile_config,
)

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_cute = pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed")

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ------------------------------------------------------------------------------------------------
# CPU: keys, tile rules, offline compile
# ------------------------------------------------------------------------------------------------


def test_select_tile_config_rules():
    pp192 = Sm90TileConfig(128, 192, 64, 5, True, swizzle=8)
    assert select_sm90_tile_config(2048, 1536, 128) == pp192
    assert select_sm90_tile_config(4096, 28672, 8) == pp192  # dense: partial N tiles
    assert select_sm90_tile_config(768, 2048, 128) == pp192
    # accumulating with many experts: 128x128 pingpong, old tile prefetched into L2
    acc = select_sm90_tile_config(2048, 1536, 128, accumulate=True)
    assert (acc.tile_n, acc.pingpong, acc.acc_epilogue, acc.epi_n) == (128, True, "l2prefetch", 64)
    # discrete outputs need whole tiles: 28672 % 192 != 0 -> the next rule that divides
    assert select_sm90_tile_config(4096, 28672, 8, output_mode="discrete") == Sm90TileConfig(
        128, 256, 64, 4
    )
    assert select_sm90_tile_config(2048, 1536, 16, output_mode="discrete") == pp192
    assert select_sm90_tile_config(2048, 1536, 16, accumulate=True).tile_n == 256
    assert select_sm90_tile_config(2048, 512, 16).tile_n == 256  # N < 1024: no 192 tiles
    cfg = select_sm90_tile_config(256, 384, 4)  # 384 = 3 * 128, not a multiple of 256
    assert (cfg.tile_m, cfg.tile_n) == (128, 128)
    cfg = select_sm90_tile_config(192, 64, 2)
    assert (cfg.tile_m, cfg.tile_n) == (64, 64)
    with pytest.raises(ValueError, match="multiples of 64"):
        select_sm90_tile_config(100, 128, 2)
    assert select_sm90_tile_config(256, 512, 64, mma_tiler_mn=(128, 256)) == Sm90TileConfig(
        128, 256, 64, 4
    )
    assert select_sm90_tile_config(256, 512, 64, mma_tiler_mn=(64, 128)).stages == 8
    with pytest.raises(ValueError, match="must divide"):
        select_sm90_tile_config(256, 512, 64, mma_tiler_mn=(128, 192))
    with pytest.raises(ValueError, match="tile_m"):
        select_sm90_tile_config(256, 512, 64, mma_tiler_mn=(96, 128))
    with pytest.raises(ValueError, match="tile_m"):  # tile M 192: a removed loser
        select_sm90_tile_config(384, 512, 64, mma_tiler_mn=(192, 128))
    with pytest.raises(ValueError, match="positive"):
        select_sm90_tile_config(0, 128, 2)


def test_tile_config_validation():
    with pytest.raises(ValueError, match="tile_m"):
        Sm90TileConfig(tile_m=96)
    with pytest.raises(ValueError, match="tile_m"):  # tile M 192 lost (benchmarks/RESULTS.md)
        Sm90TileConfig(192, 128, 64, 5, True)
    with pytest.raises(ValueError, match="tile_n"):
        Sm90TileConfig(tile_n=260)
    with pytest.raises(ValueError, match="tile_k"):
        Sm90TileConfig(tile_k=32)
    with pytest.raises(ValueError, match="overflow"):
        Sm90TileConfig(tile_m=128, tile_n=256, stages=5)
    assert Sm90TileConfig().stage_bytes == 2 * 64 * (128 + 256)
    assert Sm90TileConfig(tile_m=64).consumer_warp_groups == 1


def test_key_validation_and_hashing():
    tile = Sm90TileConfig()
    key = Sm90WgradKey(256, 512, 4, tile=tile)
    assert key == Sm90WgradKey(256, 512, 4, tile=Sm90TileConfig())
    assert hash(key) == hash(Sm90WgradKey(256, 512, 4, tile=Sm90TileConfig()))
    assert key.num_tiles == 4 * 2 * 2
    for kwargs, word in [
        ({"a_major": "n"}, "a_major"),
        ({"b_major": "m"}, "b_major"),
        ({"out_dtype": "float64"}, "out_dtype"),
        ({"output_mode": "sparse"}, "output_mode"),
        ({"input_order": "ragged"}, "input_order"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90WgradKey(256, 512, 4, tile=tile, **kwargs)
    # dense outputs may end in partial tiles (TMA clips); discrete outputs need whole tiles
    assert Sm90WgradKey(192, 384, 4, tile=tile).num_tiles == 4 * 2 * 2
    with pytest.raises(ValueError, match="hidden"):
        Sm90WgradKey(192, 512, 4, tile=tile, output_mode="discrete")
    with pytest.raises(ValueError, match="intermediate"):
        Sm90WgradKey(256, 384, 4, tile=tile, output_mode="discrete")
    with pytest.raises(ValueError, match="num_experts"):
        Sm90WgradKey(256, 512, 0, tile=tile)


@needs_cute
def test_offline_compile_sm90a_has_wgmma_and_tma():
    key = Sm90WgradKey(
        256, 256, 4, a_major="m", b_major="n", tile=select_sm90_tile_config(256, 256, 4)
    )
    ptx = sm90.compile_sm90_wgrad_offline(key, arch="sm_90a")
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and ".bf16" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert "mbarrier" in ptx
    assert "setmaxnreg" in ptx  # producer / consumer register split


@needs_cute
def test_offline_compile_ignores_the_present_gpu_arch():
    # On a B200 (or a machine without GPU) CuTe DSL detects sm_100a / sm_100: the sm_90a compile
    # pins its target (issue 8 item 2) and restores the DSL's state afterwards.
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    saved = envar.__dict__.get("_arch")
    try:
        envar.arch = "sm_100a"
        key = Sm90WgradKey(
            256, 256, 4, a_major="k", b_major="n", tile=select_sm90_tile_config(256, 256, 4)
        )
        ptx = sm90.compile_sm90_wgrad_offline(key, arch="sm_90a")
        assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
        assert envar.arch == "sm_100a"
    finally:
        envar._arch = saved


# ------------------------------------------------------------------------------------------------
# CPU: the speed variants (Sm90TileConfig fields; benchmarks/bench_grouped_wgrad.py --variants)
# ------------------------------------------------------------------------------------------------


def test_variant_fields_default_to_the_measured_kernel():
    t = Sm90TileConfig()
    assert (t.acc_epilogue, t.epi_n, t.swizzle) == ("reduce", 32, 0)
    assert t.cluster_shape_mn == (1, 1)
    # the YAML rows use only the variants measured to win (benchmarks/RESULTS.md, issue 12)
    won = {"accumulate-many-experts": "128x128s6pp-l2pf-e64", "pingpong-192": "128x192s5pp-sw8"}
    for name, _cond, cfg in sm90.load_sm90_tile_rules():
        plain = f"{cfg.tile_m}x{cfg.tile_n}s{cfg.stages}" + ("pp" if cfg.pingpong else "")
        assert cfg.variant_name == won.get(name, plain)
    v = Sm90TileConfig(128, 128, 64, 6, acc_epilogue="l2prefetch", epi_n=64, swizzle=4)
    assert v.cluster_shape_mn == (1, 1)
    assert v.variant_name == "128x128s6-l2pf-e64-sw4"


def test_variant_field_validation():
    for kwargs, word in [
        ({"acc_epilogue": "atomic"}, "acc_epilogue"),
        ({"acc_epilogue": "prefetch"}, "acc_epilogue"),
        ({"epi_n": 24}, "epi_n"),
        ({"tile_n": 128, "epi_n": 256}, "epi_n"),
        ({"tile_n": 192, "epi_n": 128}, "epi_n"),
        ({"tile_n": 64, "epi_n": 48}, "epi_n"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90TileConfig(**kwargs)
    with pytest.raises(TypeError, match="epi_stages"):  # removed: as many buffers as fit, <= 2
        Sm90TileConfig(epi_stages=3)


def _variant_ptx(tile, **key_kwargs):
    kw = dict(a_major="m", b_major="n")
    kw.update(key_kwargs)
    m = kw.pop("m", 256)
    n = kw.pop("n", 256)
    return sm90.compile_sm90_wgrad_offline(Sm90WgradKey(m, n, 4, tile=tile, **kw), "sm_90a")


_T = Sm90TileConfig
_VARIANT_PTX = [
    # (id, tile, key kwargs, PTX that must appear, PTX that must not)
    ("reduce-e64", _T(128, 128, 64, 5, True, epi_n=64),
     {"out_dtype": "float32", "accumulate": True},
     ["cp.reduce.async.bulk.tensor.3d.global.shared::cta.add"],
     ["cp.async.bulk.tensor.3d.shared::cta.global"]),
    ("l2prefetch", _T(128, 128, 64, 6, True, acc_epilogue="l2prefetch"),
     {"out_dtype": "float32", "accumulate": True},
     ["cp.async.bulk.prefetch.tensor.3d.L2.global", "cp.reduce.async.bulk.tensor.3d"],
     ["cp.async.bulk.tensor.3d.shared::cta.global"]),
    ("l2prefetch-not-without-accumulate", _T(128, 128, 64, 6, True, acc_epilogue="l2prefetch"),
     {"out_dtype": "float32"}, ["cp.async.bulk.tensor.3d.global.shared::cta"],
     ["cp.async.bulk.prefetch.tensor", "cp.reduce.async.bulk"]),
]


@needs_cute
@pytest.mark.parametrize("case", _VARIANT_PTX, ids=[c[0] for c in _VARIANT_PTX])
def test_offline_compile_speed_variants(case):
    _id, tile, key_kwargs, must, must_not = case
    ptx = _variant_ptx(tile, **key_kwargs)
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    for text in must:
        assert text in ptx, f"{_id}: {text!r} missing from the PTX"
    for text in must_not:
        assert text not in ptx, f"{_id}: unexpected {text!r} in the PTX"


@needs_cute
def test_variant_that_leaves_no_pipeline_room_is_refused():
    key = Sm90WgradKey(  # 16384 experts' bookkeeping (128 KiB) + a store buffer: < 2 stages
        256, 256, 16384, a_major="m", b_major="n", out_dtype="float32", accumulate=True,
        tile=Sm90TileConfig(128, 256, 64, 4, epi_n=128),
    )
    with pytest.raises(ValueError, match="no room"):
        sm90.kernel_class()(key)


# ------------------------------------------------------------------------------------------------
# GPU helpers
# ------------------------------------------------------------------------------------------------


def _offsets_from_counts(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _make_inputs(m, n, counts, a_major, b_major, gen, device="cuda"):
    s = int(sum(counts))
    x_SM = torch.randn(s, m, generator=gen).to(torch.bfloat16)
    dy_SN = torch.randn(s, n, generator=gen).to(torch.bfloat16)
    a = x_SM.t().contiguous() if a_major == "k" else x_SM.t()  # (M, S)
    b = dy_SN if b_major == "n" else dy_SN.t().contiguous().t()  # (S, N)
    return a.to(device), b.to(device)


def _reference(a, b, counts):
    """fp32 per-expert reference [E, M, N] (NaN propagates)."""
    m, n = a.shape[0], b.shape[1]
    ref = torch.zeros(len(counts), m, n, dtype=torch.float32, device=a.device)
    begin = 0
    for e, c in enumerate(counts):
        if c:
            ref[e] = a[:, begin : begin + c].float() @ b[begin : begin + c].float()
        begin += c
    return ref


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


_TOL = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-5}


def _run(key, a, b, offsets, out_init=None):
    """Run the kernel; returns the (E, M, N) result (dense view of discrete outputs too)."""
    e, m, n = key.num_experts, key.hidden, key.intermediate
    dt = _TORCH_DTYPES[key.out_dtype]
    if out_init is None:
        out = torch.full((e, m, n), float("nan"), dtype=dt, device=a.device)
    else:
        out = out_init.clone()
    launcher = sm90.compile_sm90_wgrad(key)
    if key.output_mode == "dense":
        launcher(a, b, offsets, out)
    else:
        outs = [out[i].clone() for i in range(e)]  # one separate allocation per expert
        ptrs = torch.tensor([t.data_ptr() for t in outs], dtype=torch.int64, device=a.device)
        launcher(a, b, offsets, ptrs)
        torch.cuda.synchronize()
        out = torch.stack(outs)
    torch.cuda.synchronize()
    return out


def _uneven_counts(num_experts, gen, mean, multiple=1):
    counts = torch.randint(0, 2 * mean + 1, (num_experts,), generator=gen).tolist()
    for i in range(0, num_experts, 3):
        counts[i] = 0  # every third expert empty
    if num_experts > 1:
        counts[-1] = max(counts[-1], 1)
    total = sum(counts)
    counts[-1] += (-total) % multiple
    return counts


# ------------------------------------------------------------------------------------------------
# GPU correctness
# ------------------------------------------------------------------------------------------------

_GRID = [
    # (E, M, N, mean tokens, a_major, b_major, out_dtype, mode, accumulate, input_order)
    (4, 256, 256, 200, "k", "n", "bfloat16", "dense", False, "tensor2d"),
    (4, 256, 256, 200, "m", "n", "bfloat16", "dense", False, "tensor2d"),
    (4, 256, 256, 200, "k", "k", "bfloat16", "dense", False, "tensor2d"),
    (4, 256, 256, 200, "m", "k", "bfloat16", "dense", False, "tensor2d"),
    (4, 256, 512, 150, "m", "n", "float16", "dense", False, "tensor2d"),
    (4, 256, 512, 150, "m", "n", "float32", "dense", False, "tensor2d"),
    (4, 256, 512, 150, "k", "k", "float32", "discrete", False, "tensor2d"),
    (4, 256, 512, 150, "m", "n", "bfloat16", "discrete", True, "tensor2d"),
    (4, 256, 512, 150, "m", "n", "float32", "dense", True, "tensor2d"),
    (4, 256, 512, 150, "k", "n", "float16", "dense", True, "tensor2d"),
    (1, 128, 128, 300, "m", "n", "bfloat16", "dense", False, "tensor2d"),
    (1, 7168, 256, 130, "m", "n", "bfloat16", "dense", False, "tensor2d"),
    (4, 128, 7168, 70, "k", "k", "bfloat16", "dense", False, "tensor2d"),
    (32, 512, 384, 90, "m", "n", "bfloat16", "dense", False, "tensor2d"),
    (128, 256, 256, 20, "m", "n", "float32", "dense", False, "tensor2d"),
    (128, 192, 64, 20, "k", "n", "bfloat16", "discrete", False, "tensor2d"),
    (4, 256, 256, 200, "k", "k", "bfloat16", "dense", False, "tensor_ragged"),
    (8, 256, 256, 300, "m", "n", "bfloat16", "dense", False, "pingpong"),
    (8, 256, 256, 300, "k", "k", "float32", "discrete", True, "pingpong"),
    (4, 256, 256, 200, "m", "n", "float32", "dense", False, "tensor_ragged"),
]


def _as_ragged(x_RS, counts):
    """Rebuild a K-major (rows, S) operand as per-expert (rows, K_e) blocks (tensor_ragged)."""
    rows = x_RS.shape[0]
    blocks, begin = [], 0
    for c in counts:
        blocks.append(x_RS[:, begin : begin + c].contiguous().reshape(-1))
        begin += c
    flat = torch.cat(blocks) if blocks else x_RS.new_empty(0)
    return torch.as_strided(flat, (rows, x_RS.shape[1]), (x_RS.shape[1], 1))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
@pytest.mark.parametrize("case", _GRID, ids=lambda c: "-".join(str(x) for x in c))
def test_grid_matches_fp32_reference(case):
    e, m, n, mean, a_major, b_major, out_dtype, mode, accumulate, order = case
    gen = torch.Generator().manual_seed(_GRID.index(case))
    multiple = 8 if "k" in (a_major, b_major) else 1
    counts = _uneven_counts(e, gen, mean, multiple)
    a, b = _make_inputs(m, n, counts, a_major, b_major, gen)
    offsets = _offsets_from_counts(counts, "cuda")
    tile = select_sm90_tile_config(m, n, e)
    if order == "pingpong":  # (grid entry: tensor2d with the pingpong schedule)
        order, tile = "tensor2d", Sm90TileConfig(128, 128, 64, 6, pingpong=True)
    key = Sm90WgradKey(
        m, n, e, a_major=a_major, b_major=b_major, out_dtype=out_dtype, output_mode=mode,
        accumulate=accumulate, input_order=order, tile=tile,
    )
    ref = _reference(a, b, counts)
    a_in, b_in = a, b
    if order == "tensor_ragged":
        if a_major == "k":
            a_in = _as_ragged(a, counts)
        if b_major == "k":
            b_in = _as_ragged(b.t(), counts).t()
    init = None
    if accumulate:
        init = torch.randn(e, m, n, device="cuda").to(_TORCH_DTYPES[out_dtype])
        ref = ref + init.float()
    out = _run(key, a_in, b_in, offsets, init)
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements remain"
    for i, c in enumerate(counts):
        if c == 0 and not accumulate:
            assert (out[i] == 0).all(), f"empty expert {i} must be zeros"
        if c == 0 and accumulate:
            assert torch.equal(out[i], init[i]), f"empty expert {i} must be untouched"
    assert _rel_err(out, ref) < _TOL[out_dtype]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
def test_all_experts_empty_and_no_recompile():
    m, n, e = 256, 256, 8
    key = Sm90WgradKey(m, n, e, a_major="m", b_major="n", tile=select_sm90_tile_config(m, n, e))
    gen = torch.Generator().manual_seed(1)
    sm90.compile_sm90_wgrad(key)
    before = sm90.COMPILE_COUNT
    a, b = _make_inputs(m, n, [0] * e, "m", "n", gen)
    out = _run(key, a, b, torch.zeros(e, dtype=torch.int32, device="cuda"))
    assert (out == 0).all()
    for counts in ([5, 0, 77, 1, 0, 64, 3, 130], [0] * 7 + [1000]):
        a, b = _make_inputs(m, n, counts, "m", "n", gen)
        out = _run(key, a, b, _offsets_from_counts(counts, "cuda"))
        assert _rel_err(out, _reference(a, b, counts)) < 1e-2
    assert sm90.COMPILE_COUNT == before, "a new split recompiled the kernel"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("a_major,b_major", [("k", "k"), ("m", "n"), ("k", "n")])
def test_ragged_tile_does_not_read_next_expert(a_major, b_major, pingpong):
    m, n = 128, 256
    # expert 0 ends mid-tile (its last TMA box covers expert 1's first rows); expert 4 starts at
    # row 163, not 16-byte aligned, so with a K-major operand its first box starts at row 160
    # inside expert 3.
    counts = [70, 58, 0, 35, 37]
    gen = torch.Generator().manual_seed(2)
    a, b = _make_inputs(m, n, counts, a_major, b_major, gen)
    for row in (70, 162):  # first row of expert 1, last row of expert 3 (both operands)
        a[:, row] = float("nan")
        b[row, :] = float("nan")
    tile = select_sm90_tile_config(m, n, 5)
    if pingpong:
        tile = Sm90TileConfig(128, 128, 64, 6, pingpong=True)
    key = Sm90WgradKey(
        m, n, 5, a_major=a_major, b_major=b_major, out_dtype="float32", tile=tile
    )
    out = _run(key, a, b, _offsets_from_counts(counts, "cuda"))
    ref = _reference(a, b, counts)
    for i in (1, 3):
        assert out[i].isnan().all() and ref[i].isnan().all()
    assert (out[2] == 0).all()
    for i in (0, 4):
        assert torch.isfinite(out[i]).all(), f"NaN of a neighbour leaked into expert {i}"
        assert _rel_err(out[i], ref[i]) < 1e-5


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
def test_fp32_accumulate_256_plus_1():
    m, n = 128, 256
    key = Sm90WgradKey(
        m, n, 2, a_major="m", b_major="n", out_dtype="float32", accumulate=True,
        tile=select_sm90_tile_config(m, n, 2),
    )
    counts = [1, 0]
    a = torch.ones(m, 1, dtype=torch.bfloat16, device="cuda").t().contiguous().t()
    b = torch.ones(1, n, dtype=torch.bfloat16, device="cuda")
    out = torch.full((2, m, n), 256.0, device="cuda")
    sm90.compile_sm90_wgrad(key)(a, b, _offsets_from_counts(counts, "cuda"), out)
    torch.cuda.synchronize()
    assert (out[0] == 257.0).all() and (out[1] == 256.0).all()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
def test_cuda_graph_replay_with_new_offsets():
    m, n, e = 256, 512, 4
    key = Sm90WgradKey(
        m, n, e, a_major="m", b_major="n", out_dtype="float32",
        tile=select_sm90_tile_config(m, n, e),
    )
    gen = torch.Generator().manual_seed(3)
    counts1, counts2 = [100, 0, 300, 112], [0, 256, 1, 255]
    s = sum(counts1)
    assert s == sum(counts2)
    a, b = _make_inputs(m, n, counts1, "m", "n", gen)
    offsets = _offsets_from_counts(counts1, "cuda")
    out = torch.full((e, m, n), float("nan"), device="cuda")
    launcher = sm90.compile_sm90_wgrad(key)
    launcher(a, b, offsets, out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        launcher(a, b, offsets, out)
    torch.cuda.synchronize()
    for counts in (counts1, counts2):
        offsets.copy_(_offsets_from_counts(counts, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(a, b, counts)) < 1e-5
    assert math.isfinite(out.sum().item())


# ------------------------------------------------------------------------------------------------
# GPU: the speed variants
# ------------------------------------------------------------------------------------------------

_GPU_VARIANTS = [
    # (id, tile, (E, M, N), a_major, b_major, out_dtype, mode, accumulate)
    ("reduce-e64", _T(128, 128, 64, 5, True, epi_n=64), (7, 256, 256), "m", "n", "float32",
     "dense", True),
    ("l2prefetch-pingpong", _T(128, 128, 64, 6, True, acc_epilogue="l2prefetch"), (7, 256, 320),
     "m", "n", "float32", "dense", True),
    ("l2prefetch-bf16-partial", _T(128, 192, 64, 5, True, acc_epilogue="l2prefetch"),
     (5, 200, 400), "k", "k", "bfloat16", "dense", True),
    ("swizzle-partial-band", _T(64, 128, 64, 8, swizzle=3), (5, 448, 384), "m", "n", "float32",
     "dense", True),
    ("swizzle-pingpong", _T(128, 128, 64, 6, True, swizzle=2), (6, 640, 256), "k", "n",
     "bfloat16", "dense", False),
    # partial output tiles at the M and N edges (dense outputs: TMA zero-fills, clips)
    ("partial-n-192pp", _T(128, 192, 64, 4, True), (5, 256, 320), "m", "n", "bfloat16", "dense",
     False),
    ("partial-mn-192pp-acc", _T(128, 192, 64, 4, True), (6, 320, 400), "k", "k", "float32",
     "dense", True),
    ("partial-mn-64pp-acc", _T(128, 64, 64, 8, True), (5, 200, 200), "m", "n", "float32",
     "dense", True),
    ("partial-mn-coop-256", _T(128, 256, 64, 4), (4, 136, 264), "m", "k", "bfloat16", "dense",
     False),
    ("partial-mn-coop-acc", _T(128, 128, 64, 6), (5, 328, 264), "m", "n", "float32", "dense",
     True),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
@pytest.mark.parametrize("case", _GPU_VARIANTS, ids=[c[0] for c in _GPU_VARIANTS])
def test_speed_variants_match_fp32_reference(case):
    """Every variant against the fp32 reference on uneven splits with empty experts, three
    launches in a row (a zeroed tile counter per launch)."""
    _id, tile, (e, m, n), a_major, b_major, out_dtype, mode, accumulate = case
    gen = torch.Generator().manual_seed(7 + _GPU_VARIANTS.index(case))
    multiple = 8 if "k" in (a_major, b_major) else 1
    counts = _uneven_counts(e, gen, 150, multiple)
    a, b = _make_inputs(m, n, counts, a_major, b_major, gen)
    offsets = _offsets_from_counts(counts, "cuda")
    key = Sm90WgradKey(
        m, n, e, a_major=a_major, b_major=b_major, out_dtype=out_dtype, output_mode=mode,
        accumulate=accumulate, tile=tile,
    )
    ref = _reference(a, b, counts)
    init = None
    if accumulate:
        init = torch.randn(e, m, n, device="cuda").to(_TORCH_DTYPES[out_dtype])
        ref = ref + init.float()
    for _ in range(3):
        out = _run(key, a, b, offsets, init)
        assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements remain"
        for i, c in enumerate(counts):
            if c == 0 and accumulate:
                assert torch.equal(out[i], init[i]), f"empty expert {i} must be untouched"
            if c == 0 and not accumulate:
                assert (out[i] == 0).all(), f"empty expert {i} must be zeros"
        assert _rel_err(out, ref) < _TOL[out_dtype]


# ------------------------------------------------------------------------------------------------
# GPU: the public API (cuda_kernels.grouped_wgrad) on Hopper drives this kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
def test_public_api_on_hopper_uses_the_sm90_kernel():
    from cuda_kernels.grouped_wgrad import (
        GroupedGemmWgradSm90,
        grouped_gemm_wgrad,
        grouped_gemm_wgrad_wrapper_sm90,
        select_grouped_wgrad_backend,
    )

    assert select_grouped_wgrad_backend("cuda")[0] == "sm90"
    m, n, e = 256, 512, 6
    gen = torch.Generator().manual_seed(5)
    counts = [0, 130, 7, 0, 300, 51]
    a, b = _make_inputs(m, n, counts, "m", "n", gen)
    offsets = _offsets_from_counts(counts, "cuda")
    ref = _reference(a, b, counts)

    res = grouped_gemm_wgrad_wrapper_sm90(
        a_tensor=a, b_tensor=b, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
        output_mode="dense", wgrad_dtype=torch.float32,
    )
    (w,) = res
    assert w is res["wgrad_tensor"] and w.shape == (e, m, n)
    assert _rel_err(w, ref) < 1e-5

    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in counts]
    ptrs = torch.tensor([t.data_ptr() for t in outs], dtype=torch.int64, device="cuda")
    res = grouped_gemm_wgrad_wrapper_sm90(
        a_tensor=a, b_tensor=b, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
        output_mode="discrete", wgrad_ptrs=ptrs, wgrad_dtype=torch.bfloat16,
    )
    torch.cuda.synchronize()
    assert res["wgrad_tensor"] is None
    assert _rel_err(torch.stack(outs), ref) < 1e-2

    out = torch.full((e, m, n), float("nan"), device="cuda")
    op = GroupedGemmWgradSm90(
        sample_a=a, sample_b=b, sample_sfa=None, sample_sfb=None, sample_offsets=offsets,
        sample_wgrad=out, acc_dtype=torch.float32,
    )
    op.check_support()
    op.compile()
    before = sm90.COMPILE_COUNT
    counts2 = [64, 0, 0, 300, 0, 124]  # same tokens_sum, new split: no recompile
    offsets.copy_(_offsets_from_counts(counts2, "cuda"))
    op.execute(
        a_tensor=a, b_tensor=b, sfa_tensor=None, sfb_tensor=None, offsets_tensor=offsets,
        wgrad_tensor=out,
    )
    torch.cuda.synchronize()
    assert sm90.COMPILE_COUNT == before
    assert _rel_err(out, _reference(a, b, counts2)) < 1e-5

    w = grouped_gemm_wgrad(a, b, offsets, wgrad_dtype=torch.float32)["wgrad_tensor"]
    assert _rel_err(w, _reference(a, b, counts2)) < 1e-5


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
@pytest.mark.skipif(
    shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH"
)
def test_compute_sanitizer_memcheck_clean_on_a_small_case():
    # K-major operands, an unaligned expert start, ragged tails and the pingpong schedule
    case = "tests/test_grouped_wgrad_sm90.py::test_ragged_tile_does_not_read_next_expert[k-k-True]"
    proc = subprocess.run(
        [
            "compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no",
            "--error-exitcode", "9", sys.executable, "-m", "pytest", "-q", "-p",
            "no:cacheprovider", case,
        ],
        capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).parents[1],
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr
