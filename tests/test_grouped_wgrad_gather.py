"""Grouped wgrad with gathered operands (issue 33 item 5): A's columns / B's rows read through a
row index (``a_rows_S`` / ``b_rows_S``; -1 = padding row) instead of from a dense gathered copy.

CPU part: the torch twin with rows is bit-exact with the dense twin on a gathered copy (fp32 and
bf16 outputs, accumulate, empty experts, padding rows, NaN-poisoned source rows that no index
names); the index checks of ``grouped_wgrad_into`` (ValueError naming the argument, output
untouched); the gather-first fallback of a backend without in-kernel gather; the kernel key and
launch of the SM90 path on a faked device; the key rules; offline ``sm_90a`` compiles of the
gather keys (cp.async chunk count, no TMA box for a gathered operand, no ptxas spill).

GPU part (``gpu`` + ``sm90``, skipped without an SM90 device): the gather kernel against the dense
kernel on gathered copies, bit-exact, outputs NaN-poisoned first: qwen3-30b-like and odd sizes
(experts of 0, 1, 7, 129 rows), a_rows / b_rows alone and both, int64 / int32 indexes,
accumulating fp32, pingpong / cooperative / 64-row tiles, CUDA-graph replay.
"""

import dataclasses
import importlib.util
import re

import pytest
import torch
from _ptxas import assemble_without_spills

from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90
from cuda_kernels.gemm.sm90.wgrad_bf16 import Sm90TileConfig, Sm90WgradKey
from cuda_kernels.grouped_wgrad import api, wrappers
from cuda_kernels.grouped_wgrad.torch_ref import gather_operands, grouped_wgrad_torch

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_cute = pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed")
needs_sm90 = pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and "
                                "CuTe DSL")


@pytest.fixture(autouse=True)
def _gather_gate_open(monkeypatch):
    """This file tests the gather keys themselves: their gate open (until
    ``wgrad_bf16.GATHER_VERIFIED_ON_GPU``); ``test_closed_gate_gathers_first`` closes it."""
    monkeypatch.setenv(sm90.GATHER_ENABLE_ENV, "1")


def test_closed_gate_gathers_first(monkeypatch):
    """With the gate closed (unverified source, no opt-in) ``grouped_wgrad_into`` on SM90 does
    not build a gather key: it gathers the operand first and runs the dense path."""
    monkeypatch.delenv(sm90.GATHER_ENABLE_ENV)
    monkeypatch.setattr(sm90, "GATHER_VERIFIED_ON_GPU", False)
    assert not sm90.gather_enabled()
    seen = []
    monkeypatch.setattr(wrappers, "_compile_gathered", lambda *a, **k: seen.append(a))
    dense = []

    def into(a, b, offsets, out, *, accumulate=False, backend="sm90", a_rows_S=None,
             b_rows_S=None):
        assert a_rows_S is None and b_rows_S is None
        dense.append((tuple(a.shape), tuple(b.shape)))

    real = wrappers.grouped_wgrad_into
    monkeypatch.setattr(wrappers, "grouped_wgrad_into", into)
    x, dy, rows, offs = _problem([3, 0, 9], 16, 8)
    out = torch.full((3, 16, 8), float("nan"))
    wrappers._gathered_into(x.t(), dy, offs, out, False, "sm90", rows, rows)
    assert seen == [] and dense == [((16, rows.shape[0]), (rows.shape[0], 8))]
    monkeypatch.setenv(sm90.GATHER_ENABLE_ENV, "1")
    assert sm90.gather_enabled() and real is not into


def _problem(counts, hidden, inter, *, tokens=None, pad_every=5, seed=0, index_dtype=torch.int64,
             device="cpu"):
    """Sources X [T, H], dY [T, I] (bf16; the rows no index names are NaN) and a row index [S]
    over the experts' rows (every ``pad_every``-th row of an expert a padding row, -1), with the
    offsets [E] int32. Returns (x_TH, dy_TI, rows_S, offsets_E)."""
    gen = torch.Generator().manual_seed(seed)
    s = sum(counts)
    t = tokens if tokens is not None else max(s, 1) + 3
    rows = torch.randint(0, t, (s,), generator=gen)
    if pad_every:
        rows[torch.arange(s) % pad_every == pad_every - 1] = -1
    x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16)
    dy = torch.randn(t, inter, generator=gen).to(torch.bfloat16)
    unused = torch.ones(t, dtype=torch.bool)
    unused[rows[rows >= 0]] = False
    x[unused] = float("nan")
    dy[unused] = float("nan")
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return (x.to(device), dy.to(device), rows.to(index_dtype).to(device), offsets.to(device))


def _dense(src_TC, rows_S):
    """The dense gathered copy [S, C] (zeros for padding rows), built by hand."""
    out = torch.zeros(rows_S.shape[0], src_TC.shape[1], dtype=src_TC.dtype, device=src_TC.device)
    keep = rows_S >= 0
    out[keep] = src_TC[rows_S[keep].long()]
    return out


_COUNTS = [0, 1, 7, 129, 0, 40]


# ------------------------------------------------------------------------------------------------
# CPU: the torch twin with rows
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["a", "b", "both"])
@pytest.mark.parametrize("out_dtype,accumulate", [(torch.float32, False), (torch.bfloat16, False),
                                                  (torch.float32, True)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_twin_with_rows_is_the_dense_twin_on_a_gathered_copy(which, out_dtype, accumulate,
                                                             index_dtype):
    hidden, inter = 48, 40
    x, dy, rows, offsets = _problem(_COUNTS, hidden, inter, index_dtype=index_dtype)
    s = rows.shape[0]
    x_SH, dy_SI = _dense(x, rows), _dense(dy, rows)
    assert torch.isfinite(x_SH.float()).all()  # no NaN row is named by the index
    a_rows = rows if which in ("a", "both") else None
    b_rows = rows if which in ("b", "both") else None
    a_src = x.t() if a_rows is not None else x_SH.t()
    b_src = dy if b_rows is not None else dy_SI
    e = len(_COUNTS)
    init = torch.randn(e, hidden, inter, generator=torch.Generator().manual_seed(9)).to(out_dtype)
    want = init.clone() if accumulate else torch.full_like(init, float("nan"))
    got = want.clone()
    grouped_wgrad_torch(x_SH.t(), dy_SI, offsets, out=want, accumulate=accumulate)
    grouped_wgrad_torch(a_src, b_src, offsets, out=got, accumulate=accumulate, a_rows_S=a_rows,
                        b_rows_S=b_rows)
    assert x.shape[0] != s  # the sources' T differs from S
    assert torch.equal(got, want)  # bit-exact (NaN-free: the NaN rows were never read)
    assert not got.isnan().any()
    for i, c in enumerate(_COUNTS):
        if c == 0:
            assert torch.equal(got[i], init[i]) if accumulate else bool((got[i] == 0).all())


def test_twin_padding_rows_are_zeros_even_over_nan_sources():
    # every row a padding row, the source all NaN (and T == 0): the product is exact zeros
    x = torch.full((4, 16), float("nan"), dtype=torch.bfloat16)
    rows = torch.full((9,), -1, dtype=torch.int64)
    offsets = torch.tensor([4, 9], dtype=torch.int32)
    b = torch.randn(9, 8).to(torch.bfloat16)
    out = grouped_wgrad_torch(x.t(), b, offsets, a_rows_S=rows)
    assert (out == 0).all()
    a_g, b_g = gather_operands(x[:0].t(), b, rows, None)
    assert a_g.shape == (16, 9) and (a_g == 0).all() and b_g is b


def test_gather_operands_layouts():
    x, dy, rows, _ = _problem([5, 6], 32, 24)
    a, b = gather_operands(x.t(), dy, rows, rows)
    assert a.shape == (32, 11) and a.stride() == (1, 32)  # M-major, as X.t() of rows
    assert b.shape == (11, 24) and b.stride() == (24, 1)
    assert torch.equal(a.t(), _dense(x, rows)) and torch.equal(b, _dense(dy, rows))


# ------------------------------------------------------------------------------------------------
# CPU: grouped_wgrad_into's index checks, fallback, SM90 key
# ------------------------------------------------------------------------------------------------


def _into_args():
    x, dy, rows, offsets = _problem([3, 0, 5], 64, 64)
    out = torch.full((3, 64, 64), float("nan"))
    return x, dy, rows, offsets, out


@pytest.mark.parametrize("backend", ["sm90", "sm100"])
def test_into_index_checks_name_the_argument(backend):
    x, dy, rows, offsets, out = _into_args()
    s = rows.shape[0]
    dense_dy = _dense(dy, rows)
    bad = [
        (dict(a_rows_S=rows.float()), "a_rows_S"),
        (dict(a_rows_S=rows[None]), "a_rows_S"),
        (dict(a_rows_S=rows.to("meta")), "a_rows_S"),
        (dict(a_rows_S=[0, 1]), "a_rows_S"),
        (dict(a_rows_S=rows[:-1]), "S differ"),
        (dict(b_rows_S=rows.to(torch.int16)), "b_rows_S"),
        (dict(a_rows_S=rows, b_rows_S=rows[1:]), "S differ"),
    ]
    for kwargs, word in bad:
        b_src = dy if "b_rows_S" in kwargs else dense_dy
        a_src = x.t() if "a_rows_S" in kwargs else _dense(x, rows).t()
        with pytest.raises(ValueError, match=word):
            api.grouped_wgrad_into(a_src, b_src, offsets, out, backend=backend, **kwargs)
    with pytest.raises(ValueError, match="a_HS must be torch.bfloat16"):
        api.grouped_wgrad_into(x.t().float(), dense_dy, offsets, out, backend=backend,
                               a_rows_S=rows)
    assert out.isnan().all(), "an output was written before a check failed"
    assert s == dense_dy.shape[0]


def test_gather_backends_table():
    assert api.WGRAD_GATHER_BACKENDS == ("sm90",)
    import cuda_kernels

    assert cuda_kernels.WGRAD_GATHER_BACKENDS is api.WGRAD_GATHER_BACKENDS


def test_into_without_kernel_gather_gathers_first(monkeypatch):
    """sm100 (no in-kernel gather): the dense path gets the gathered copies."""
    x, dy, rows, offsets, out = _into_args()
    seen = []

    def fake_run_wrapper(cls, call):
        seen.append((cls, call.a, call.b))

        class Op:
            def launch(self, *args, **kwargs):
                pass

        return None, Op()

    monkeypatch.setattr(wrappers, "run_wrapper", fake_run_wrapper)
    api.grouped_wgrad_into(x.t(), dy, offsets, out, backend="sm100", a_rows_S=rows,
                           b_rows_S=rows.to(torch.int32))
    (cls, a, b), = seen
    assert cls is api.GroupedGemmWgradSm100
    assert torch.equal(a, _dense(x, rows).t()) and a.stride() == (1, 64)
    assert torch.equal(b, _dense(dy, rows))


def test_into_sm90_builds_the_gather_key_and_passes_the_indexes(monkeypatch):
    """The SM90 path on a faked device: the contract's key with the gather fields, the sources
    and indexes handed to the launcher as given (no gathered copy), validated once per key."""
    x, dy, rows, offsets, out = _into_args()
    launched, keys = [], []

    def fake_launcher(key):
        keys.append(key)
        return lambda *args, **kwargs: launched.append((args, kwargs))

    monkeypatch.setattr(wrappers, "require_device", lambda *a, **k: None)
    monkeypatch.setattr(sm90.FAMILY, "launcher", fake_launcher)
    monkeypatch.setattr(wrappers.bf16, "_family", lambda c: (None, sm90))
    wrappers.clear_grouped_wgrad_caches()
    try:
        for _ in range(2):
            api.grouped_wgrad_into(x.t(), dy, offsets, out, accumulate=True, a_rows_S=rows,
                                   b_rows_S=rows.to(torch.int32))
        api.grouped_wgrad_into(x.t(), _dense(dy, rows), offsets, out, a_rows_S=rows.int())
    finally:
        wrappers.clear_grouped_wgrad_caches()
    assert len(keys) == 2  # one compile per metadata key
    k0, k1 = keys
    assert (k0.gather_a, k0.gather_b, k0.index_dtype, k0.a_major, k0.b_major) == (
        True, True, "int64", "m", "n")
    assert k0.accumulate and (k0.hidden, k0.intermediate, k0.num_experts) == (64, 64, 3)
    assert (k1.gather_a, k1.gather_b, k1.index_dtype, k1.accumulate) == (True, False, "int32",
                                                                         False)
    assert k0.tile == sm90.select_sm90_tile_config(64, 64, 3, accumulate=True)
    (args, kwargs) = launched[0]
    assert args[0].data_ptr() == x.data_ptr() and args[1] is dy and args[3] is out
    assert kwargs["a_rows"] is rows and kwargs["b_rows"].dtype == torch.int64
    assert len(launched) == 3
    assert out.isnan().all()  # the fake launcher wrote nothing


def test_into_sm90_rules_of_the_dense_call_still_apply(monkeypatch):
    x, dy, rows, offsets, out = _into_args()
    monkeypatch.setattr(wrappers, "require_device", lambda *a, **k: None)
    monkeypatch.setattr(sm90.FAMILY, "launcher", lambda key: pytest.fail("launched"))
    monkeypatch.setattr(wrappers.bf16, "_family", lambda c: (None, sm90))
    wrappers.clear_grouped_wgrad_caches()
    with pytest.raises(ValueError, match="out_EHI"):
        api.grouped_wgrad_into(x.t(), dy, offsets, out[:, :, :16], a_rows_S=rows, b_rows_S=rows)
    with pytest.raises(ValueError, match="offsets_E must be torch.int32"):
        api.grouped_wgrad_into(x.t(), dy, offsets.long(), out, a_rows_S=rows, b_rows_S=rows)
    with pytest.raises(ValueError, match="a_HS: data pointer"):
        x_SH = _dense(x, rows)
        xs = torch.empty(x_SH.numel() + 1, dtype=torch.bfloat16)[1:].view(x_SH.shape)
        xs.copy_(x_SH)
        api.grouped_wgrad_into(xs.t(), dy, offsets, out,
                               b_rows_S=rows)  # b gathered, a (dense [H, S]) misaligned
    assert out.isnan().all()


def test_into_sm90_gathers_first_for_a_layout_the_kernel_cannot_read(monkeypatch):
    """A K-major A source ([H, T] row-major) cannot be read by 16-byte row chunks: gathered
    first, then the dense SM90 path."""
    x, dy, rows, offsets, out = _into_args()
    seen = []
    monkeypatch.setattr(wrappers, "_compile_gathered", lambda *a: pytest.fail("kernel path"))
    monkeypatch.setattr(wrappers, "run_wrapper",
                        lambda cls, call: (seen.append(call.a), (None, _NoOp()))[1])
    api.grouped_wgrad_into(x.t().contiguous(), _dense(dy, rows), offsets, out, a_rows_S=rows)
    assert torch.equal(seen[0], _dense(x, rows).t())


class _NoOp:
    def launch(self, *args, **kwargs):
        pass


# ------------------------------------------------------------------------------------------------
# CPU: key rules, offline compile of the gather keys
# ------------------------------------------------------------------------------------------------


def test_gather_key_rules():
    tile = Sm90TileConfig()
    key = Sm90WgradKey(256, 256, 4, a_major="m", b_major="n", tile=tile)
    assert (key.gather_a, key.gather_b, key.gather, key.index_dtype) == (False, False, False,
                                                                         "int64")
    assert Sm90WgradKey(256, 256, 4, a_major="m", tile=tile, gather_a=True).gather
    for kwargs, word in [
        (dict(a_major="k", gather_a=True), "a_major"),
        (dict(b_major="k", gather_b=True), "b_major"),
        (dict(a_major="m", gather_a=True, input_order="tensor_ragged"), "tensor2d"),
        (dict(index_dtype="int16"), "index_dtype"),
        (dict(gather_a=1), "gather_a"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90WgradKey(256, 256, 4, tile=tile, **kwargs)


def _mn_major_stage_byte(extent, m, k, tile_k=64):
    """Byte offset of element (m, k) of an SM90 MN-major bf16 ``(extent, tile_k)`` stage: the
    swizzle atoms ``make_smem_layout_a/b`` build (widest of 128 / 64 / 32 bytes dividing a row
    of ``extent``, 8 K rows each, K atoms first: ``S<3,4,3> o ((64,2),(8,8)):((1,4096),(64,512))``
    for extent 128), the swizzle applied to byte addresses (16-byte unit ^= K row % atom rows)."""
    atom_bytes = max(b for b in (128, 64, 32) if (2 * extent) % b == 0)
    atom = atom_bytes // 2  # elements along MN
    e = m % atom + (m // atom) * atom * tile_k + (k % 8) * atom + (k // 8) * atom * 8
    byte = 2 * e
    bits = {128: 3, 64: 2, 32: 1}[atom_bytes]
    return byte ^ (((byte >> 7) & ((1 << bits) - 1)) << 4)


@pytest.mark.parametrize("extent", [64, 128, 192, 256, 80, 96, 144, 240])
def test_gather_thread_layout_is_coalesced_and_free_of_bank_conflicts(extent):
    """The gather producers' split of a stage (sm90.gather_thread_layout): every (K row, 16-byte
    chunk) of the stage is copied by exactly one of the 128 threads; each warp-wide cp.async
    reads whole row segments (8 x 16 contiguous bytes per row where extent % 64 == 0) and its
    shared-memory writes take the minimum 4 wavefronts (512 bytes; each 8-thread phase hits 32
    distinct banks)."""
    per_row, rows, passes = sm90.gather_thread_layout(extent)
    chunks = extent // 8
    assert per_row * passes == chunks and rows * 128 == 64 * per_row
    if extent % 64 == 0:
        assert (per_row, rows, passes) == (8, 4, extent // 64)
    seen = {}
    for warp in range(4):
        for j in range(rows):
            for p in range(passes):
                segments = {}  # K row -> its chunks read by this instruction
                wavefronts = 0
                for phase in range(4):
                    words = {}
                    for lane in range(8 * phase, 8 * phase + 8):
                        t = 32 * warp + lane
                        k = t // per_row + (128 // per_row) * j
                        c = t % per_row + per_row * p
                        seen[(k, c)] = seen.get((k, c), 0) + 1
                        segments.setdefault(k, []).append(c)
                        byte = _mn_major_stage_byte(extent, 8 * c, k)
                        for w in range(byte // 4, byte // 4 + 4):
                            words.setdefault(w % 32, set()).add(w)
                    wavefronts += max(len(v) for v in words.values())
                assert wavefronts == 4, (extent, warp, j, p)
                for cs in segments.values():  # consecutive chunks of one row
                    assert sorted(cs) == list(range(min(cs), min(cs) + per_row))
                assert len(segments) == 32 // per_row
    assert len(seen) == 64 * chunks and set(seen.values()) == {1}


def test_gather_thread_layout_rejects_extents_it_cannot_split():
    for extent, tile_k in [(72, 64), (0, 64), (128, 32)]:
        with pytest.raises(ValueError, match="gather_thread_layout"):
            sm90.gather_thread_layout(extent, tile_k)


_T = Sm90TileConfig
_OFFLINE = [
    # (id, key kwargs, tile, cp.async chunks per thread and stage, TMA boxes per stage)
    ("a-pp128", dict(gather_a=True), _T(128, 128, 64, 6, True), 8, 2),
    ("b-pp192-int32", dict(gather_b=True, index_dtype="int32"), _T(128, 192, 64, 5, True,
                                                                    swizzle=8), 12, 2),
    ("both-coop256", dict(gather_a=True, gather_b=True), _T(128, 256, 64, 4), 24, 0),
    ("a-kmajorB-acc32", dict(gather_a=True, b_major="k", out_dtype="float32", accumulate=True),
     _T(128, 256, 64, 4), 8, None),
    ("b-kmajorA-discrete", dict(gather_b=True, a_major="k", output_mode="discrete"),
     _T(128, 256, 64, 4), 16, None),
    ("both-l2pf-partial", dict(gather_a=True, gather_b=True, out_dtype="float32",
                               accumulate=True, hidden=320, intermediate=200),
     _T(128, 128, 64, 6, True, acc_epilogue="l2prefetch"), 16, 0),
    ("a-64row", dict(gather_a=True, hidden=320, intermediate=208), _T(64, 128, 64, 8), 4, 2),
    # tile_n not a multiple of 64: 2 and 4 threads per row (gather_thread_layout)
    ("b-80-partial", dict(gather_b=True, intermediate=208), _T(128, 80, 64, 4), 5, 2),
    ("both-96", dict(gather_a=True, gather_b=True, intermediate=192), _T(128, 96, 64, 6), 14, 0),
]


@needs_cute
@pytest.mark.parametrize("case", _OFFLINE, ids=[c[0] for c in _OFFLINE])
def test_offline_compile_gather_keys(case, tmp_path):
    _id, kwargs, tile, chunks, tma_boxes = case
    kw = dict(a_major="m", b_major="n", hidden=2048, intermediate=768)
    kw.update(kwargs)
    m, n = kw.pop("hidden"), kw.pop("intermediate")
    key = Sm90WgradKey(m, n, 16, tile=tile, **kw)
    ptx = sm90.compile_sm90_wgrad_offline(key, "sm_90a")
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx
    # one 16-byte zero-filling cp.async per chunk (src-size operand), one noinc arrival a stage
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, %r\d+;", ptx)
    assert len(copies) == chunks, _id
    assert ptx.count("cp.async.mbarrier.arrive.noinc") == 1
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx))
    if tma_boxes is not None:
        assert loads == tma_boxes, f"{_id}: {loads} TMA loads"
    assert "fence.proxy.async.shared::cta" in ptx
    full = 1 + 128  # the TMA arm + the producer warp group's cp.async arrivals
    assert re.search(rf"mov\.b32\s+(%r\d+), {full};\s+mbarrier\.init\.shared\.b64\s+\[%r\d+\], "
                     r"\1;", ptx), "full barriers must count 1 + 128 arrivals"
    assemble_without_spills(ptx, tmp_path, "sm_90a")


# ------------------------------------------------------------------------------------------------
# GPU: the gather kernel against the dense kernel on gathered copies (bit-exact)
# ------------------------------------------------------------------------------------------------

_GPU = [
    # (id, counts, H, I, T)
    ("odd", [0, 1, 7, 129, 0, 64, 3], 256, 384, 300),
    ("qwen3-30b-like", None, 2048, 768, 4096),
]


def _gpu_counts(cid, counts):
    if counts is not None:
        return counts
    gen = torch.Generator().manual_seed(3)  # 128 experts, ~4096 tokens x top-8, some empty
    c = torch.randint(0, 513, (128,), generator=gen)
    c[::11] = 0
    return c.tolist()


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
@pytest.mark.parametrize("which", ["a", "b", "both"])
@pytest.mark.parametrize("out_dtype,accumulate", [(torch.bfloat16, False),
                                                  (torch.float32, True)])
@pytest.mark.parametrize("case", _GPU, ids=[c[0] for c in _GPU])
def test_gather_kernel_matches_dense_kernel_bitwise(case, which, out_dtype, accumulate):
    cid, counts, hidden, inter, tokens = case
    counts = _gpu_counts(cid, counts)
    x, dy, rows, offsets = _problem(counts, hidden, inter, tokens=tokens, device="cuda")
    x_SH, dy_SI = _dense(x, rows), _dense(dy, rows)
    e = len(counts)
    init = torch.randn(e, hidden, inter, device="cuda").to(out_dtype)
    base = init if accumulate else torch.full_like(init, float("nan"))
    want, got = base.clone(), base.clone()
    api.grouped_wgrad_into(x_SH.t(), dy_SI, offsets, want, accumulate=accumulate)
    a_rows = rows if which in ("a", "both") else None
    b_rows = rows.int() if which in ("b", "both") else None
    api.grouped_wgrad_into(x.t() if a_rows is not None else x_SH.t(),
                           dy if b_rows is not None else dy_SI, offsets, got,
                           accumulate=accumulate, a_rows_S=a_rows, b_rows_S=b_rows)
    torch.cuda.synchronize()
    assert not got.isnan().any(), "NaN: an unwritten output or a NaN source row was read"
    assert torch.equal(got, want)
    ref = grouped_wgrad_torch(x_SH.t(), dy_SI, offsets.cpu().cuda(), out_dtype=torch.float32)
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[i], init[i]) if accumulate else bool((got[i] == 0).all())
    if not accumulate:
        rel = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert rel < 1e-2


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
@pytest.mark.parametrize("tile", [_T(128, 128, 64, 6, True), _T(128, 256, 64, 4),
                                  _T(64, 128, 64, 8), _T(128, 192, 64, 5, True, swizzle=8),
                                  _T(128, 80, 64, 4), _T(128, 96, 64, 6, True)],
                         ids=lambda t: t.variant_name)
@pytest.mark.parametrize("gather", [(True, False), (False, True), (True, True)],
                         ids=["a", "b", "both"])
def test_gather_kernel_tiles_bitwise(tile, gather):
    """The launcher directly, per tile (pingpong, cooperative, 64-row, 192-wide, 80- and
    96-wide: 2 and 4 gather threads per row; hidden 320 and intermediate 208 / 400 leave
    partial M / N tiles), int32 index, fp32 output."""
    counts = [0, 1, 7, 129, 0, 64, 3]
    hidden, inter = 320, 208 if tile.tile_n != 192 else 400
    x, dy, rows, offsets = _problem(counts, hidden, inter, tokens=250, device="cuda",
                                    index_dtype=torch.int32)
    ga, gb = gather
    dense = Sm90WgradKey(hidden, inter, len(counts), a_major="m", b_major="n",
                         out_dtype="float32", tile=tile)
    key = dataclasses.replace(dense, gather_a=ga, gather_b=gb, index_dtype="int32")
    want = torch.full((len(counts), hidden, inter), float("nan"), device="cuda")
    got = want.clone()
    x_SH, dy_SI = _dense(x, rows), _dense(dy, rows)
    sm90.compile_sm90_wgrad(dense)(x_SH.t(), dy_SI, offsets, want)
    sm90.compile_sm90_wgrad(key)(x.t() if ga else x_SH.t(), dy if gb else dy_SI, offsets, got,
                                 a_rows=rows if ga else None, b_rows=rows if gb else None)
    torch.cuda.synchronize()
    assert not got.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
def test_gather_kernel_cuda_graph_replay_with_new_rows():
    counts = [5, 0, 77, 130]
    x, dy, rows, offsets = _problem(counts, 256, 256, tokens=200, device="cuda")
    out = torch.full((4, 256, 256), float("nan"), device="cuda")
    api.grouped_wgrad_into(x.t(), dy, offsets, out, a_rows_S=rows, b_rows_S=rows)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.grouped_wgrad_into(x.t(), dy, offsets, out, a_rows_S=rows, b_rows_S=rows)
    for seed in (1, 2):
        x2, dy2, rows2, _ = _problem(counts, 256, 256, tokens=200, seed=seed, device="cuda")
        x.copy_(x2)
        dy.copy_(dy2)
        rows.copy_(rows2)
        out.fill_(float("nan"))
        graph.replay()
        want = torch.full_like(out, float("nan"))
        api.grouped_wgrad_into(_dense(x, rows).t(), _dense(dy, rows), offsets, want)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_sm90_launcher_passes_the_indexes(monkeypatch):
    """The launcher of a gathered key hands the indexes to the kernel after the tile counter
    (None for a key without gather), and refuses a missing / unexpected index."""
    from cuda_kernels.gemm import launch

    calls = []
    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    sm90.FAMILY.cache_clear()
    monkeypatch.setattr(sm90.FAMILY, "_compile",
                        lambda key, arch, dump_dir=None: lambda *args: calls.append(args))
    try:
        x, dy, rows, offsets = _problem([3, 0, 5], 128, 64)
        dense = Sm90WgradKey(128, 64, 3, a_major="m", b_major="n", tile=_T(128, 64, 64, 4))
        key = dataclasses.replace(dense, gather_a=True)
        out = torch.full((3, 128, 64), float("nan"))
        sm90.compile_sm90_wgrad(key)(x.t(), _dense(dy, rows), offsets, out, a_rows=rows)
        ((a, b_t, _off, _out, counter, a_rows, b_rows, grid),) = calls
        assert a_rows is rows and b_rows is None and a.data_ptr() == x.data_ptr()
        assert counter.tolist() == [0] and grid == 3
        with pytest.raises(ValueError, match="a_rows: required"):
            sm90.compile_sm90_wgrad(key)(x.t(), _dense(dy, rows), offsets, out)
        with pytest.raises(ValueError, match="b_rows: must be None"):
            sm90.compile_sm90_wgrad(key)(x.t(), dy, offsets, out, a_rows=rows, b_rows=rows)
        with pytest.raises(ValueError, match="a_rows: must be None"):
            sm90.compile_sm90_wgrad(dense)(_dense(x, rows).t(), _dense(dy, rows), offsets, out,
                                           a_rows=rows)
        assert len(calls) == 1 and out.isnan().all()
    finally:
        sm90.FAMILY.cache_clear()
