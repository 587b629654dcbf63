"""The interpreter's modeled Trainium time (nki_kernels/interp/profile.py): DMA cost by contiguous
chunk, a fixed cost per DMA, engine rates, the segment overlap bound, sourced constants."""

import numpy as np
import pytest

from nki_kernels.interp import isa as nisa
from nki_kernels.interp import language as nl
from nki_kernels.interp import profile as prof
from nki_kernels.interp import simulate
from nki_kernels.interp.runtime import region

TRN3 = prof.TIME_MODEL["trn3"]


def test_every_constant_has_a_value_and_a_source():
    assert prof.CONSTANTS
    for name, entry in prof.CONSTANTS.items():
        value, source = entry
        assert isinstance(value, (int, float)) and value > 0, name
        assert isinstance(source, str) and len(source) > 20, name
        # a public source file, or an explicit "not public" with the reason
        assert ("aws-neuron-sdk" in source) or ("not public" in source), name


def test_strided_two_byte_dma_costs_more_than_contiguous():
    nbytes = 128 * 2048 * 2
    strided = prof.dma_cost_ns(TRN3, nbytes, 2, 128)
    contiguous = prof.dma_cost_ns(TRN3, nbytes, 4096, 128)
    assert strided > 50 * contiguous


def test_fixed_cost_per_dma():
    fixed = prof.CONSTANTS["DMA_FIXED_NS"][0]
    assert prof.dma_cost_ns(TRN3, 0, 1, 128) == pytest.approx(fixed)
    assert prof.dma_cost_ns(TRN3, 2, 2, 1) > fixed
    # two DMAs of half the bytes cost one fixed cost more than one DMA of all of them
    one = prof.dma_cost_ns(TRN3, 1 << 20, 8192, 128)
    two = 2 * prof.dma_cost_ns(TRN3, 1 << 19, 8192, 128)
    assert two - one == pytest.approx(fixed, rel=1e-6)


@pytest.mark.parametrize("chunk", [2, 64, 512, 4096])
def test_dma_cost_monotonic_in_bytes(chunk):
    costs = [prof.dma_cost_ns(TRN3, n, chunk, 128) for n in (2, 64, 1024, 65536, 1 << 20)]
    assert all(b >= a for a, b in zip(costs, costs[1:]))
    assert costs[-1] > costs[0]


def test_dma_efficiency_curve_and_partitions():
    bw = 16 * TRN3["dma_engine_bytes_per_ns"]  # B/ns at full partitions
    n = 1 << 22

    def eff(chunk):
        return n / bw / (prof.dma_cost_ns(TRN3, n, chunk, 128) - prof.CONSTANTS["DMA_FIXED_NS"][0])

    assert eff(128) < 0.5 < 0.85 < eff(2048) < eff(4096) < 1.0
    # fewer partitions -> fewer DMA engines -> slower
    assert prof.dma_cost_ns(TRN3, n, 4096, 8) > 10 * prof.dma_cost_ns(TRN3, n, 4096, 128)


def test_run_bytes_of_views():
    # HBM [64, 256] bf16, full rows: one run; every other column: one element
    assert prof.dma_run_bytes((64, 256), (512, 2), 2, False) == 64 * 256 * 2
    assert prof.dma_run_bytes((64, 128), (512, 4), 2, False) == 2
    # on-chip: runs stop at the partition
    assert prof.dma_run_bytes((128, 256), (512, 2), 2, True) == 512


def _copy_kernel(x, strided):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    P, F = x.shape
    with region("copy"):
        t = nl.ndarray((P, 2 * F), nl.bfloat16)
        if strided:
            view = t.reshape((P, F, 2))[:, :, 0]
        else:
            view = t[:, 0:F]
        nisa.dma_copy(view, x)
        u = nl.ndarray((P, F), nl.bfloat16)
        nisa.tensor_copy(u, view)
        nisa.dma_copy(out, u)
    return out


def test_interpreter_records_chunks_and_charges_strided_more():
    import torch

    x = torch.randn(128, 512, dtype=torch.bfloat16)
    times = {}
    for strided in (False, True):
        sim = simulate(_copy_kernel)
        out = sim(x, strided)
        assert torch.equal(out, x)
        p = sim.last_profile
        c = p.counters("copy")
        assert c.dma_count == 2 and c.dma_bytes == 2 * 128 * 512 * 2
        assert c.dma_chunks == (128 * 512 + 128 if strided else 128 + 128)
        want = {2: 128 * 1024, 1024: 128 * 1024} if strided else {1024: 2 * 128 * 1024}
        assert dict(c.dma_bytes_by_chunk) == want
        times[strided] = p.modeled_time_us("copy")
        # head load and tail store wait on / for the copy: nothing overlaps
        eng = p.engine_time_us("copy")
        lat = prof.CONSTANTS["DMA_LATENCY_NS"][0] / 1e3
        assert times[strided] == pytest.approx(eng["dma"] + eng["vector"] + 2 * lat)
        assert times[strided] >= p.perfect_overlap_time_us("copy")
    assert times[True] > 5 * times[False]


def _overlap_kernel(x, n):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    P, F = x.shape
    for _ in range(n):
        with region("phase"):
            t = nl.ndarray((P, F), nl.float32)
            nisa.dma_copy(t, x)
            for _ in range(8):
                nisa.activation(t, nl.exp, t)
            nisa.dma_copy(t, x)  # in the middle: overlaps compute
            nisa.activation(t, nl.exp, t)
            nisa.dma_copy(out, t)
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_phase_time_at_least_perfect_overlap_and_additive_over_segments(n):
    import torch

    x = torch.randn(128, 256, dtype=torch.float32) * 0.01
    sim = simulate(_overlap_kernel)
    sim(x, n)
    p = sim.last_profile
    t = p.modeled_time_us("phase")
    assert t >= p.perfect_overlap_time_us("phase")
    eng = p.engine_time_us("phase")
    per_dma = eng["dma"] / (3 * n)
    lat = prof.CONSTANTS["DMA_LATENCY_NS"][0] / 1e3
    # per segment: head load + compute + tail store (+ 2 latencies); the middle DMA overlaps
    assert t == pytest.approx(n * (2 * per_dma + 2 * lat) + eng["scalar"])
    assert p.modeled_time_us() >= p.modeled_time_us("phase")


def test_engine_rates_from_the_arch_table():
    import torch

    def k(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        with region("r"):
            t = nl.ndarray(x.shape, nl.float32)
            nisa.dma_copy(t, x)
            nisa.tensor_copy(t, t, engine=nisa.vector_engine)
            nisa.tensor_copy(t, t, engine=nisa.gpsimd_engine)
            nisa.dma_copy(out, t)
        return out

    x = torch.zeros(128, 1024, dtype=torch.float32)
    sim = simulate(k)
    sim(x)
    eng = sim.last_profile.engine_time_us("r")
    fixed = prof.ENGINE_FIXED_CYCLES
    hz = TRN3["vector_hz"]
    assert eng["vector"] == pytest.approx((1024 / 2 + fixed) / hz * 1e6)
    assert eng["gpsimd"] == pytest.approx((1024 / 1 + fixed) / hz * 1e6)


def test_summary_labels_modeled():
    p = prof.Profile("trn3")
    assert "modeled" in repr(p) or repr(p).startswith("Profile(trn3")
    assert np.isfinite(p.modeled_time_us())
