"""Tests of the shared launch layer of the grouped wgrad (``gemm/launch.py``).

CPU part: which stream every step of a launch runs on. The compiled kernel takes its stream from
torch's current stream (TVM-FFI environment stream), so the launcher must make the launch stream
current before it enqueues or allocates anything: the family's ``prepare`` hook, the
``tensor_ragged`` repack, the dynamic scheduler's tile counter and the kernel. On the CPU the
stream switch is observed through ``launch.on_stream`` (replaced by a recorder that tracks the
"current" stream); the fake kernel, the repack and the counter record what was current when they
ran. What this cannot show (that ``torch.cuda.stream`` really is what the kernel launches on) is
the GPU test at the end: an SM90 ``tensor_ragged`` launch on a side stream while the caller's
stream is still busy.
"""

import contextlib
import importlib.util
import itertools

import pytest
import torch

from cuda_kernels.gemm import launch
from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90
from cuda_kernels.gemm.sm100 import wgrad_bf16 as sm100

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

_DEFAULT = "caller's current stream"
_SIDE = "launch stream"


class _StreamRecorder:
    """Stands in for ``launch.on_stream``: keeps the 'current stream' and a log of events."""

    def __init__(self):
        self.current = _DEFAULT
        self.log = []

    @contextlib.contextmanager
    def on_stream(self, stream):
        saved = self.current
        if stream is not None:
            self.current = stream
        self.log.append(("enter", self.current))
        try:
            yield
        finally:
            self.current = saved
            self.log.append(("exit", saved))

    def event(self, what):
        self.log.append((what, self.current))


class _FakeKernel:
    def __init__(self, rec):
        self.rec = rec
        self.calls = []

    def __call__(self, *args):
        self.rec.event("kernel")
        self.calls.append(args)


@pytest.fixture
def rec(monkeypatch):
    rec = _StreamRecorder()
    monkeypatch.setattr(launch, "on_stream", rec.on_stream)
    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    monkeypatch.setattr(launch, "_max_active_clusters", lambda index, cluster: None)
    real_repack, real_counter = launch.ragged_to_2d, launch._zeroed_counter

    def repack(*args):
        rec.event("repack")
        return real_repack(*args)

    def counter(device, *length):
        rec.event("counter")
        return real_counter(device, *length)

    monkeypatch.setattr(launch, "ragged_to_2d", repack)
    monkeypatch.setattr(launch, "_zeroed_counter", counter)
    return rec


def _family(monkeypatch, family, rec):
    fake = _FakeKernel(rec)
    family.cache_clear()
    monkeypatch.setattr(family, "_compile", lambda key, arch, dump_dir=None: fake)
    return fake


def _ragged(x_XS, counts):
    """Per-expert (rows, K_e) row-major blocks, concatenated, as the caller's (rows, S) view."""
    bounds = [0, *itertools.accumulate(counts)]
    blocks = [x_XS[:, lo:hi].contiguous().flatten() for lo, hi in itertools.pairwise(bounds)]
    return torch.cat(blocks).as_strided(x_XS.shape, (x_XS.shape[1], 1))


@pytest.mark.parametrize("stream", [None, _SIDE])
def test_sm90_ragged_repack_counter_and_kernel_run_on_the_launch_stream(monkeypatch, rec, stream):
    fake = _family(monkeypatch, sm90.FAMILY, rec)
    counts = (64, 0, 128)
    m, n, s = 128, 64, sum(counts)
    a2d = torch.randn(m, s).to(torch.bfloat16)
    b2d_t = torch.randn(n, s).to(torch.bfloat16)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    key = sm90.Sm90WgradKey(
        m, n, 3, a_major="k", b_major="k", input_order="tensor_ragged",
        tile=sm90.Sm90TileConfig(128, 64, 64, 4),
    )
    out = torch.empty(3, m, n)
    sm90.compile_sm90_wgrad(key)(_ragged(a2d, counts), _ragged(b2d_t, counts).t(), off, out,
                                 stream=stream)
    want = _DEFAULT if stream is None else _SIDE
    # every enqueue / allocation happens inside the launch stream, none before or after it
    assert rec.log == [
        ("enter", want), ("repack", want), ("repack", want), ("counter", want), ("kernel", want),
        ("exit", _DEFAULT),
    ]
    # the SM90 kernel's call: the tile counter, then the two row indexes (None: no gather)
    ((fa, fb_nk, _off, _out, counter, a_rows, b_rows, _grid),) = fake.calls
    assert a_rows is None and b_rows is None
    assert torch.equal(fa, a2d) and torch.equal(fb_nk, b2d_t)
    assert counter.dtype == torch.int32 and counter.tolist() == [0]  # a fresh zeroed counter


def test_sm90_each_launch_gets_its_own_zeroed_counter(monkeypatch, rec):
    fake = _family(monkeypatch, sm90.FAMILY, rec)
    key = sm90.Sm90WgradKey(128, 64, 2, tile=sm90.Sm90TileConfig(128, 64, 64, 4))
    launcher = sm90.compile_sm90_wgrad(key)
    a = torch.zeros(128, 64, dtype=torch.bfloat16)
    b = torch.zeros(64, 64, dtype=torch.bfloat16)
    off = torch.tensor([32, 64], dtype=torch.int32)
    launcher(a, b, off, torch.empty(2, 128, 64), stream=_SIDE)
    fake.calls[0][4].fill_(99)  # as the kernel's atomics leave it
    launcher(a, b, off, torch.empty(2, 128, 64), stream=_SIDE)
    c0, c1 = fake.calls[0][4], fake.calls[1][4]
    assert c1 is not c0 and c1.tolist() == [0]


@pytest.mark.parametrize("stream", [None, _SIDE])
def test_sm100_ragged_in_place_workspace_and_kernel_run_on_the_launch_stream(
    monkeypatch, rec, stream
):
    """SM100: tensor_ragged K-major operands are not repacked (per-expert TMA descriptors
    address them in place); the descriptor workspace (none given: allocated per launch) and the
    counter with its per-expert flags are allocated on the launch stream, before the kernel."""
    monkeypatch.setenv(sm100.ENABLE_ENV, "1")
    fake = _family(monkeypatch, sm100.FAMILY, rec)
    real_ws = launch.descriptor_workspace_view

    def workspace(*args):
        rec.event("workspace")
        return real_ws(*args)

    monkeypatch.setattr(launch, "descriptor_workspace_view", workspace)
    counts = (256, 0, 512)
    m, n, s = 128, 64, sum(counts)
    a2d = torch.randn(m, s).to(torch.bfloat16)
    b2d_t = torch.randn(n, s).to(torch.bfloat16)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    key = sm100.Sm100WgradKey(
        m, n, 3, a_major="k", b_major="k", input_order="tensor_ragged",
        tile=sm100.Sm100TileConfig(128, 64, 64, 4),
    )
    a, b = _ragged(a2d, counts), _ragged(b2d_t, counts).t()
    sm100.compile_sm100_wgrad(key)(a, b, off, torch.empty(3, m, n), stream=stream)
    want = _DEFAULT if stream is None else _SIDE
    assert rec.log == [
        ("enter", want), ("workspace", want), ("counter", want), ("kernel", want),
        ("exit", _DEFAULT),
    ]  # no ("repack", ...)
    ((fa, fb_nk, _off, _out, counter, _grid, ws),) = fake.calls
    assert fa is a and fb_nk.data_ptr() == b.data_ptr()
    assert counter.tolist() == [0] * 4 and ws.numel() * 8 == 3 * 2 * 128


@pytest.mark.parametrize("stream", [None, _SIDE])
def test_sm100_no_token_fill_and_stand_ins_run_on_the_launch_stream(monkeypatch, rec, stream):
    monkeypatch.setenv(sm100.ENABLE_ENV, "1")
    fake = _family(monkeypatch, sm100.FAMILY, rec)
    real_prepare = sm100.FAMILY.prepare

    def prepare(*args):
        rec.event("prepare")
        return real_prepare(*args)

    monkeypatch.setattr(sm100.FAMILY, "prepare", prepare)
    want = _DEFAULT if stream is None else _SIDE
    a = torch.zeros(256, 0, dtype=torch.bfloat16)
    b = torch.zeros(0, 128, dtype=torch.bfloat16)
    off = torch.zeros(2, dtype=torch.int32)
    dense = sm100.Sm100WgradKey(256, 128, 2, tile=sm100.Sm100TileConfig(128, 128, 64, 4))
    out = torch.full((2, 256, 128), 7.0)
    sm100.compile_sm100_wgrad(dense)(a, b, off, out, stream=stream)
    assert rec.log == [("enter", want), ("prepare", want), ("exit", _DEFAULT)]
    assert fake.calls == [] and torch.all(out == 0)

    rec.log.clear()
    discrete = sm100.Sm100WgradKey(
        256, 128, 2, output_mode="discrete", tile=sm100.Sm100TileConfig(128, 128, 64, 4)
    )
    ptrs = torch.tensor([4096, 8192], dtype=torch.int64)
    sm100.compile_sm100_wgrad(discrete)(a, b, off, ptrs, stream=stream)
    assert rec.log[0] == ("enter", want) and rec.log[-1] == ("exit", _DEFAULT)
    assert ("prepare", want) in rec.log and ("kernel", want) in rec.log
    assert all(where == want for what, where in rec.log[:-1])


def test_gate_refuses_before_entering_any_stream(monkeypatch, rec):
    monkeypatch.delenv(sm100.ENABLE_ENV, raising=False)
    fake = _family(monkeypatch, sm100.FAMILY, rec)
    key = sm100.Sm100WgradKey(256, 128, 2, tile=sm100.Sm100TileConfig(128, 128, 64, 4))
    a = torch.zeros(256, 256, dtype=torch.bfloat16)
    b = torch.zeros(256, 128, dtype=torch.bfloat16)
    off = torch.tensor([256, 256], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not yet verified"):
        sm100.compile_sm100_wgrad(key)(a, b, off, torch.empty(2, 256, 128), stream=_SIDE)
    assert rec.log == [] and fake.calls == []


def test_without_cute_dsl_the_argument_and_the_gate_come_first(monkeypatch):
    """Without CuTe DSL a bad key still gets its ValueError, and a launcher of a gated family its
    gate's reason; only then is the missing package named (offline compiles have no gate)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a)
    )
    sm100.FAMILY.cache_clear()
    compiles = sm100.FAMILY.compile_count
    key = sm100.Sm100WgradKey(256, 128, 2, tile=sm100.Sm100TileConfig(128, 128, 64, 4))
    with pytest.raises(ValueError, match="Sm100WgradKey or an api.WgradContract"):
        sm100.compile_sm100_wgrad((256, 256))
    with pytest.raises(ValueError, match="want a Sm90GroupedMmKey"):
        from cuda_kernels.gemm.sm90 import grouped_mm

        grouped_mm.compile_grouped_mm_offline("not a key")
    monkeypatch.delenv(sm100.ENABLE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="not yet verified"):
        sm100.compile_sm100_wgrad(key)
    with pytest.raises(RuntimeError, match="compile_sm100_wgrad_offline needs nvidia-cutlass-dsl"):
        sm100.compile_sm100_wgrad_offline(key)
    monkeypatch.setenv(sm100.ENABLE_ENV, "1")
    with pytest.raises(RuntimeError, match="compile_sm100_wgrad needs nvidia-cutlass-dsl"):
        sm100.compile_sm100_wgrad(key)
    with pytest.raises(RuntimeError, match="compile_sm90_wgrad needs nvidia-cutlass-dsl"):
        sm90.compile_sm90_wgrad(sm90.Sm90WgradKey(128, 64, 2, tile=sm90.Sm90TileConfig()))
    assert sm100.FAMILY.compile_count == compiles  # nothing compiled


def test_on_stream_is_torch_stream_context():
    """The real ``on_stream``: torch's StreamContext of the given stream (what sets the TVM-FFI
    environment stream the compiled kernel launches on), a no-op context for None."""
    marker = object()
    ctx = launch.on_stream(marker)
    assert isinstance(ctx, torch.cuda.StreamContext) and ctx.stream is marker
    assert isinstance(launch.on_stream(None), contextlib.nullcontext)


# ------------------------------------------------------------------------------------------------
# Persistent grid: as many clusters as can be resident
# ------------------------------------------------------------------------------------------------


def test_resident_clusters(monkeypatch):
    monkeypatch.setattr(launch, "num_sms", lambda index: 148)
    asked = []

    def driver(index, cluster):
        asked.append((index, cluster))
        return 70  # e.g. GPCs with an odd SM count: fewer than 148 // 2 pairs

    monkeypatch.setattr(launch, "_max_active_clusters", driver)
    assert launch.resident_clusters(0, 1) == 148  # 1-CTA "clusters": SMs x CTAs per SM
    assert launch.resident_clusters(0, 1, 2) == 296
    assert asked == []  # no driver query without a real cluster
    assert launch.resident_clusters(1, 2) == 70  # the driver's cluster occupancy
    assert asked == [(1, 2)]
    assert launch.resident_clusters(0, 2, 3) == 148 * 3 // 2  # several CTAs per SM: the bound
    monkeypatch.setattr(launch, "_max_active_clusters", lambda index, cluster: None)
    assert launch.resident_clusters(0, 2) == 74  # no driver answer: the GPC-blind bound
    assert launch.resident_clusters(0, 4) == 37


def test_max_active_clusters_is_not_asked_during_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(launch, "_OCCUPANCY", {})
    assert launch._max_active_clusters(0, 2) is None
    assert launch._OCCUPANCY == {}  # nothing cached from a capture


def test_max_active_clusters_caches_and_survives_driver_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "_OCCUPANCY", {(0, 2): 66})
    assert launch._max_active_clusters(0, 2) == 66
    if not torch.cuda.is_available():  # the real query fails without a GPU: no answer, no cache
        assert launch._max_active_clusters(0, 4) is None
        assert (0, 4) not in launch._OCCUPANCY


def test_sm100_grid_is_the_resident_cluster_count(monkeypatch):
    monkeypatch.setattr(launch, "num_sms", lambda index: 148)
    monkeypatch.setattr(launch, "_max_active_clusters", lambda index, cluster: 70)
    many = sm100.Sm100WgradKey(4096, 4096, 8, tile=sm100.Sm100TileConfig(256, 256, 64, 6))
    assert many.num_tiles == 8 * 16 * 16
    assert sm100.FAMILY.grid_size(many, torch.device("cpu")) == 70
    one_cta = sm100.Sm100WgradKey(4096, 4096, 8, tile=sm100.Sm100TileConfig(128, 128, 64, 6))
    assert sm100.FAMILY.grid_size(one_cta, torch.device("cpu")) == 148
    few = sm100.Sm100WgradKey(256, 256, 2, tile=sm100.Sm100TileConfig(256, 256, 64, 6))
    assert sm100.FAMILY.grid_size(few, torch.device("cpu")) == 2  # never more than the tiles
    # SM90 (cluster (1, 1), one CTA per SM): unchanged, one CTA per SM
    sm90_key = sm90.Sm90WgradKey(4096, 4096, 8, tile=sm90.Sm90TileConfig(128, 128, 64, 6))
    assert sm90.FAMILY.grid_size(sm90_key, torch.device("cpu")) == 148


def test_sm100_ctas_per_sm_is_one_for_every_accepted_tile():
    rules = sm100.SM100_TILES
    configs = [config for _n, _c, config in sm100.load_sm100_tile_rules()]
    for tile_m in rules.tile_m:
        for tile_n in rules.tile_n:
            for tile_k in rules.tile_k:
                stages = rules.stages_for(tile_m, tile_n, tile_k)
                configs.append(sm100.Sm100TileConfig(tile_m, tile_n, tile_k, stages))
    for config in configs:
        key = sm100.Sm100WgradKey(1024, 1024, 128, tile=config)
        assert sm100.ctas_per_sm(key) == 1, config
    # the formula is live: a 2-stage 128 x 32 ring (40 KiB) would leave room for 5 CTAs
    tiny = sm100.Sm100WgradKey(1024, 1024, 8, tile=sm100.Sm100TileConfig(128, 32, 64, 2))
    assert sm100.ctas_per_sm(tiny) == 228 * 1024 // (2 * 20480 + 1024 + 64 + 1024)


# ------------------------------------------------------------------------------------------------
# GPU (H200): a launch on a side stream while the caller's current stream is still busy
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and CuTe DSL")
@pytest.mark.parametrize("accumulate", [False, True])
def test_sm90_ragged_launch_on_a_side_stream_is_ordered(accumulate):
    """Before the fix the repack ran on the current stream, behind a long sleep, while the kernel
    ran at once on the side stream and read the repack's not-yet-written temporary."""
    torch.manual_seed(0)
    counts = [192, 0, 320, 64, 448]
    m, n, e, s = 256, 256, len(counts), sum(counts)
    a2d = torch.randn(m, s, device="cuda").to(torch.bfloat16)
    b2d_t = torch.randn(n, s, device="cuda").to(torch.bfloat16)
    off = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a_in, b_in = _ragged(a2d, counts), _ragged(b2d_t, counts).t()
    ref = torch.zeros(e, m, n, device="cuda")
    bounds = [0, *itertools.accumulate(counts)]
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        ref[i] = a2d[:, lo:hi].float() @ b2d_t[:, lo:hi].float().t()
    init = torch.randn(e, m, n, device="cuda") if accumulate else torch.zeros(e, m, n,
                                                                             device="cuda")
    key = sm90.Sm90WgradKey(
        m, n, e, a_major="k", b_major="k", input_order="tensor_ragged", accumulate=accumulate,
        out_dtype="float32", tile=sm90.select_sm90_tile_config(m, n, e),
    )
    launcher = sm90.compile_sm90_wgrad(key)
    for _ in range(3):
        out = init.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # inputs and out are ready for it
        torch.cuda._sleep(200_000_000)  # the caller's stream stays busy (~0.1 s)
        launcher(a_in, b_in, off, out, stream=side)
        torch.cuda.current_stream().wait_stream(side)
        got = out - init if accumulate else out
        rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 1e-5, rel
