"""Per-engine work counters of the interpreter and a MODELED Trainium time.

Every interpreted instruction adds to the counters of the current program instance (core) and the
current region (``region("phase1")``; work outside any region goes to ``"kernel"``). Every time
this module returns is *modeled* (no Trainium has run this code); the constants and their public
sources are in :data:`CONSTANTS` (one ``(value, source)`` pair each) and in the interpreter
README's time-model section.

Time model
----------
* **TensorE** (2.4 GHz): an instruction streams its moving tensor one column per cycle through
  the array (128 x 128 BF16, logically 512 x 128 MXFP8), so it costs ``N`` (moving free size)
  + ``TENSOR_FIXED_CYCLES`` cycles. AWS's perf guide gives the matmul initiation interval as
  ``max(N, 64)``; ``N + 64`` is the conservative side of that.
* **VectorE / ScalarE / GpSimd** (Trn3 1.2 GHz): ``F / lanes_rate + ENGINE_FIXED_CYCLES`` per
  instruction, with ``F`` the free size per partition (all partitions run in parallel) and
  ``lanes_rate`` the data-path width / 128 for *non*-2-byte data (VectorE 2, ScalarE 1,
  GpSimd 1 on Trn3): the interpreter does not pass dtypes to the counters, so the BF16 "2x/4x"
  modes are not credited (conservative). ``quantize_mx`` runs at its documented 4 elements per
  partition per cycle.
* **DMA**: per instruction ``DMA_FIXED_NS`` (descriptor generation) + per contiguous chunk
  ``DMA_DESC_NS`` + ``bytes / bandwidth``, the descriptor and byte terms split over the DMA
  engines the transfer touches (one engine per 8 partitions, at most 16). A *chunk* is the
  longest run of bytes contiguous on both sides (on-chip: within one partition; indirect rows:
  one row), recorded by the interpreter per DMA. Bandwidth per engine = min(33 B/ns, the core's
  HBM share / 16); ``dma_transpose`` at 90 % of it.
* **Overlap** (a dependency-aware approximation, not a scheduler): the instructions of a region
  are cut into *segments*, a segment being a maximal run of consecutive instructions of one core
  in that region (a new block re-entering ``phase1`` starts a new segment). In a segment, the DMAs
  issued before its first compute instruction are loads that compute waits on (nothing to
  overlap with), and the DMAs issued after its last compute instruction are stores that wait on
  compute; both are exposed, each with the ``DMA_LATENCY_NS`` trigger-to-start latency. The
  segment costs ``max(head + max_compute_engine_busy + tail, dma_busy, max_compute_engine_busy)``
  (+ latencies); the DMAs in between are assumed to overlap compute perfectly. A region's time on
  a core is the sum over its segments, which is never below the old perfect-overlap figure
  (:meth:`Profile.perfect_overlap_time_us`, max over engines). Cores run in parallel (max over
  cores under LNC2). Not modeled: dependencies between compute engines, semaphore waits,
  SBUF/PSUM port contention, DMA queue priorities, prefetch across segments.
* ``tensor_e_utilization`` = TensorE useful time at peak (MACs / peak MAC rate) / modeled time.
"""

from __future__ import annotations

import math
from collections import defaultdict

__all__ = ["CONSTANTS", "ENGINES", "TIME_MODEL", "Counters", "Profile", "dma_cost_ns",
           "dma_run_bytes"]

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")
COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")

_SDK = "aws-neuron/aws-neuron-sdk @ 81ce03ae"
_ARCH3 = f"{_SDK} nki/guides/architecture/trainium3_arch.rst"
_ARCH2 = f"{_SDK} nki/guides/architecture/trainium2_arch.rst"
_ARCH1 = f"{_SDK} nki/guides/architecture/trainium_inferentia2_arch.rst"
_DMABW = f"{_SDK} nki/deep-dives/nki-dma-bandwidth-guide.rst"
_DMAOV = f"{_SDK} nki/get-started/about/nki-dma-overview.rst"
_DGE = f"{_SDK} nki/deep-dives/nki-dge.rst"
_PERF = f"{_SDK} nki/deep-dives/nki_perf_guide.rst"

# name -> (value, source). Values without a public number say so and give the reason.
CONSTANTS = {
    "TENSOR_HZ": (2.4e9, f"{_ARCH3} 'Compute Engine Specifications': Tensor 2.4 GHz (same on Trn2)"),
    "VECTOR_HZ_TRN3": (1.2e9, f"{_ARCH3} table: Vector/Scalar/GpSimd 1.2 GHz"),
    "VECTOR_HZ_TRN2": (0.96e9, f"{_ARCH2} table: Vector 0.96 GHz (Scalar/GpSimd 1.2; we use "
                       "0.96 for all three: conservative)"),
    "BF16_FLOPS": (79e12, f"{_ARCH3} 'Tensor Engine': 79 BF16/FP16/TF32 TFLOPS per NeuronCore-v4"),
    "MX_FLOPS": (315e12, f"{_ARCH3} 'Tensor Engine': 315 MXFP8/MXFP4 TFLOPS per NeuronCore-v4"),
    "HBM_BYTES_PER_S_TRN3": (4.7e12 / 8, f"{_ARCH3}: 4 HBM stacks, 4.7 TB/s per device; / 8 "
                             "NeuronCores (even share, our assumption)"),
    "HBM_BYTES_PER_S_TRN2": (2.9e12 / 8, f"{_ARCH2}: 2.9 TB/s per device / 8 NeuronCores"),
    "TENSOR_FIXED_CYCLES": (64, f"{_PERF}: 'MM_INIT_LATENCY (64 cycles on trn1)', matmul issue "
                            "interval max(N, 64); charged as + 64 per instruction (conservative; "
                            "Trn3 value not public)"),
    "ENGINE_FIXED_CYCLES": (64, f"{_ARCH1} 'Tensor access overhead': ~60 cycles on "
                            "NeuronCore-v2 per SBUF/PSUM access (100 cycles for dependent "
                            "back-to-back VectorE instructions); Trn3 value not public"),
    "VECTOR_LANE_RATE": (2.0, f"{_ARCH3} table: Vector 512 BF16/FP16/FP8 or 256 other elements "
                         "per cycle over 128 lanes -> 2 (non-2-byte rate used: dtypes are not "
                         "counted, so BF16's 4 is not credited)"),
    "SCALAR_LANE_RATE": (1.0, f"{_ARCH3} table: Scalar 256 BF16/FP16/FP8 or 128 other elements "
                         "per cycle -> 1 (non-2-byte rate, as above)"),
    "GPSIMD_LANE_RATE": (1.0, f"{_ARCH3} table: GpSimd 128 elements per cycle for all types -> 1"),
    "QUANTIZE_MX_LANE_RATE": (4.0, f"{_ARCH3} 'QuantizeMX': four input elements per partition "
                              "per cycle (4x Vector performance mode)"),
    "DMA_ENGINES": (16, f"{_DMAOV}: 'Each NeuronCore (v2-v4) is paired with 16 DMA engines'"),
    "DMA_PARTITIONS_PER_ENGINE": (8, f"{_DMAOV}: 'each DMA engine is typically responsible for "
                                  "moving data for eight SBUF partitions'"),
    "DMA_ENGINE_BYTES_PER_NS_TRN3": (33.0, f"{_DMABW} table: TRN3 33 B/ns per engine, 16 "
                                     "engines, 528 GB/s per NeuronCore"),
    "DMA_ENGINE_BYTES_PER_NS_TRN2": (23.0, f"{_DMABW} table: TRN2 23 B/ns per engine"),
    "DMA_LATENCY_NS": (1300.0, f"{_DMABW}: descriptor setup, synchronization and "
                       "semaphore-to-start latency '~1300 ns cross-engine'; exposed only where "
                       "a dependency waits on it (segment head/tail)"),
    "DMA_FIXED_NS": (600.0, f"{_DGE}: 'Each hardware-DGE DMA instruction takes approximately "
                     "600 ns to execute'; charged to every DMA instruction and serialized on "
                     "the core's DMA timeline (conservative: DMAs on different queues can "
                     "overlap this; the SWDGE / static-descriptor cost is not public)"),
    "DMA_DESC_NS": (8.0, "not public. Chosen so that efficiency(chunk) = chunk / (chunk + 33 "
                    f"B/ns x 8 ns) reproduces {_DMABW}'s saturation curve: < 256 B 'severely "
                    "overhead-bound' (128 B: 33 %), >= 2 KiB 'approaches peak' (89 %), >= 4 KiB "
                    "'saturates' (94 %); a 2-byte element gets 0.8 % of peak"),
    "DMA_TRANSPOSE_EFFICIENCY": (0.9, f"{_ARCH2} 'DMA transpose can achieve up to 90% DMA "
                                 "throughput utilization' (Trn2 figure; Trn3 not public)"),
}


def _c(name):
    return CONSTANTS[name][0]


TENSOR_FIXED_CYCLES = _c("TENSOR_FIXED_CYCLES")
ENGINE_FIXED_CYCLES = _c("ENGINE_FIXED_CYCLES")

TIME_MODEL = {
    "trn3": {"tensor_hz": _c("TENSOR_HZ"), "vector_hz": _c("VECTOR_HZ_TRN3"),
             "hbm_bytes_per_s": _c("HBM_BYTES_PER_S_TRN3"),
             "bf16_flops": _c("BF16_FLOPS"), "mx_flops": _c("MX_FLOPS"),
             "dma_engine_bytes_per_ns": _c("DMA_ENGINE_BYTES_PER_NS_TRN3"),
             "lane_rate": {"vector": _c("VECTOR_LANE_RATE"), "scalar": _c("SCALAR_LANE_RATE"),
                           "gpsimd": _c("GPSIMD_LANE_RATE")}},
    "trn2": {"tensor_hz": _c("TENSOR_HZ"), "vector_hz": _c("VECTOR_HZ_TRN2"),
             "hbm_bytes_per_s": _c("HBM_BYTES_PER_S_TRN2"),
             "bf16_flops": _c("BF16_FLOPS"), "mx_flops": 0.0,
             "dma_engine_bytes_per_ns": _c("DMA_ENGINE_BYTES_PER_NS_TRN2"),
             "lane_rate": {"vector": _c("VECTOR_LANE_RATE"), "scalar": 1.0, "gpsimd": 1.0}},
}


def dma_run_bytes(shape, bstrides, itemsize, split_first: bool) -> int:
    """Bytes of the innermost run of a view that is contiguous in memory.

    ``split_first``: the leading axis never joins the run (on-chip partitions are separate
    memories; rows of an indirect access pattern are addressed one by one).
    """
    run = itemsize
    first = 1 if split_first else 0
    for ax in range(len(shape) - 1, first - 1, -1):
        if shape[ax] == 1:
            continue
        if bstrides[ax] != run:
            break
        run *= shape[ax]
    return max(run, itemsize)


def dma_cost_ns(model: dict, nbytes: int, chunk: int, partitions: int,
                transpose: bool = False) -> float:
    """Modeled busy time of one DMA instruction on the core's DMA timeline, in ns."""
    if nbytes <= 0:
        return _c("DMA_FIXED_NS")
    chunk = max(1, min(int(chunk), int(nbytes)))
    engines = min(_c("DMA_ENGINES"), max(1, math.ceil(partitions / _c("DMA_PARTITIONS_PER_ENGINE"))))
    bw = min(model["dma_engine_bytes_per_ns"], model["hbm_bytes_per_s"] / 1e9 / _c("DMA_ENGINES"))
    if transpose:
        bw *= _c("DMA_TRANSPOSE_EFFICIENCY")
    n_desc = math.ceil(nbytes / chunk)
    return _c("DMA_FIXED_NS") + (n_desc * _c("DMA_DESC_NS") + nbytes / bw) / engines


class Counters:
    """Work of one (core, region): instruction counts, elements, MACs, bytes, busy time.

    ``busy_ns`` holds the modeled busy time per engine; ``bound_ns`` the modeled time of the
    closed segments (see the module docstring) and ``_seg`` the open one.
    """

    __slots__ = ("_seg", "bound_ns", "busy_ns", "cycles", "dma_bytes", "dma_bytes_by_chunk",
                 "dma_chunks", "dma_count", "elements", "instructions", "macs_bf16", "macs_mx")

    def __init__(self):
        self.instructions = defaultdict(int)  # engine -> count
        self.elements = defaultdict(int)  # engine -> elements processed (tensor: MACs)
        self.cycles = defaultdict(float)  # engine -> busy cycles at that engine's clock
        self.busy_ns = defaultdict(float)  # engine -> modeled busy ns
        self.macs_bf16 = 0
        self.macs_mx = 0
        self.dma_bytes = 0
        self.dma_count = 0
        self.dma_chunks = 0  # contiguous chunks (descriptors) over all DMAs
        # bytes moved per chunk size, chunk rounded down to a power of two (where DMA time goes)
        self.dma_bytes_by_chunk = defaultdict(int)
        self.bound_ns = 0.0
        self._seg = None  # open segment: [head_dma, tail_dma, dma, compute{}, seen_compute]

    # --- segments -------------------------------------------------------------------------
    def open_segment(self) -> None:
        if self._seg is None:
            self._seg = [0.0, 0.0, 0.0, defaultdict(float), False]

    def close_segment(self) -> None:
        self.bound_ns += self._segment_ns()
        self._seg = None

    def _segment_ns(self) -> float:
        if self._seg is None:
            return 0.0
        head, tail, dma, comp, _ = self._seg
        cmax = max(comp.values(), default=0.0)
        lat = _c("DMA_LATENCY_NS")
        chain = head + (lat if head else 0.0) + cmax + tail + (lat if tail else 0.0)
        return max(chain, dma + (lat if dma else 0.0), cmax)

    def total_ns(self) -> float:
        """Modeled time of this (core, region): closed segments + the open one."""
        return self.bound_ns + self._segment_ns()

    def record(self, engine: str, ns: float) -> None:
        """Adds ``ns`` of busy time of ``engine`` to the counters and the open segment."""
        self.busy_ns[engine] += ns
        self.open_segment()
        seg = self._seg
        if engine == "dma":
            seg[2] += ns
            if seg[4]:
                seg[1] += ns
            else:
                seg[0] += ns
        else:
            seg[3][engine] += ns
            seg[4] = True
            seg[1] = 0.0  # DMAs issued before this compute overlap it

    def add(self, other: Counters) -> None:
        for e in ENGINES:
            self.instructions[e] += other.instructions[e]
            self.elements[e] += other.elements[e]
            self.cycles[e] += other.cycles[e]
            self.busy_ns[e] += other.busy_ns[e]
        self.macs_bf16 += other.macs_bf16
        self.macs_mx += other.macs_mx
        self.dma_bytes += other.dma_bytes
        self.dma_count += other.dma_count
        self.dma_chunks += other.dma_chunks
        for k, v in other.dma_bytes_by_chunk.items():
            self.dma_bytes_by_chunk[k] += v
        self.bound_ns += other.total_ns()

    def as_dict(self) -> dict:
        return {
            "instructions": dict(self.instructions), "elements": dict(self.elements),
            "macs_bf16": self.macs_bf16, "macs_mx": self.macs_mx, "dma_bytes": self.dma_bytes,
            "dma_count": self.dma_count, "dma_chunks": self.dma_chunks,
            "dma_bytes_by_chunk": dict(sorted(self.dma_bytes_by_chunk.items())),
            "modeled_busy_ns": dict(self.busy_ns), "modeled_ns": self.total_ns(),
        }


class Profile:
    """Counters of one interpreted launch, per core and per region, with the time model.

    Attributes:
        target: "trn3" or "trn2" (selects the time model).
    """

    def __init__(self, target: str = "trn3"):
        self.target = target
        self.model = TIME_MODEL[target]
        self._cores: dict = {}
        # per core after a launch: {"sbuf_peak_bytes": per-partition SBUF peak,
        # "psum_peak_banks": PSUM banks peak}
        self.memory: dict = {}

    def _core(self, core: int) -> dict:
        d = self._cores.get(core)
        if d is None:
            d = self._cores[core] = defaultdict(Counters)
        return d

    # --- recording (called by the interpreter) ----------------------------------------------
    def engine_ns(self, engine: str, cycles: float) -> float:
        """Modeled ns of ``cycles`` cycles at ``engine``'s clock."""
        hz = self.model["tensor_hz"] if engine == "tensor" else self.model["vector_hz"]
        return cycles / hz * 1e9

    # --- queries ----------------------------------------------------------------------------
    @property
    def regions(self) -> list:
        """Region names in first-seen order."""
        seen = []
        for d in self._cores.values():
            for r in d:
                if r not in seen:
                    seen.append(r)
        return seen

    @property
    def cores(self) -> list:
        return sorted(self._cores)

    def counters(self, region: str | None = None, core: int | None = None) -> Counters:
        """Summed counters of ``region`` (None: all) on ``core`` (None: all cores)."""
        out = Counters()
        for c, d in self._cores.items():
            if core is not None and c != core:
                continue
            for r, cnt in d.items():
                if region is None or r == region:
                    out.add(cnt)
        return out

    def engine_time_us(self, region: str | None = None, core: int | None = None) -> dict:
        """Modeled busy time per engine in microseconds (summed over the given cores)."""
        c = self.counters(region, core)
        return {e: c.busy_ns[e] / 1e3 for e in ENGINES}

    def perfect_overlap_time_us(self, region: str | None = None) -> float:
        """The old, optimistic figure: max over engines of busy time, max over cores (modeled)."""
        cores = self.cores or [0]
        return max(max(self.engine_time_us(region, c).values()) for c in cores)

    def modeled_time_us(self, region: str | None = None) -> float:
        """Modeled time of ``region`` (None: whole launch) in microseconds.

        Per core: the sum of the region's segment bounds (module docstring); then the max over
        cores (cores run in parallel). The whole launch is the sum over regions per core.
        """
        cores = self.cores or [0]
        return max(self.counters(region, c).total_ns() for c in cores) / 1e3

    def tensor_useful_time_us(self, region: str | None = None, core: int | None = None) -> float:
        """MACs at the TensorE peak rate (BF16 79, MXFP8 315 TFLOP/s per core on trn3), in us."""
        c = self.counters(region, core)
        m = self.model
        t = 2.0 * c.macs_bf16 / m["bf16_flops"]
        if c.macs_mx:
            t += 2.0 * c.macs_mx / m["mx_flops"]
        return t * 1e6

    def tensor_e_utilization(self, region: str | None = None) -> float:
        """Modeled fraction of TensorE peak in ``region``: useful time / modeled time (0..1).

        Under LNC2 the useful time is averaged over cores (each core has its own TensorE).
        """
        t = self.modeled_time_us(region)
        if t <= 0:
            return 0.0
        cores = self.cores or [0]
        useful = sum(self.tensor_useful_time_us(region, c) for c in cores) / len(cores)
        return useful / t

    def summary(self) -> list:
        """One dict per region: modeled time, utilization, MACs, DMA bytes, instructions."""
        rows = []
        for r in self.regions:
            c = self.counters(r)
            rows.append({
                "region": r, "modeled_us": self.modeled_time_us(r),
                "perfect_overlap_us": self.perfect_overlap_time_us(r),
                "tensor_e_util": self.tensor_e_utilization(r),
                "engine_us": self.engine_time_us(r), "macs_mx": c.macs_mx,
                "macs_bf16": c.macs_bf16, "dma_bytes": c.dma_bytes, "dma_count": c.dma_count,
                "dma_chunks": c.dma_chunks,
                "dma_bytes_by_chunk": dict(sorted(c.dma_bytes_by_chunk.items())),
                "instructions": sum(c.instructions.values()),
            })
        return rows

    def __repr__(self) -> str:
        parts = [f"{r['region']}: {r['modeled_us']:.1f} us modeled, TensorE "
                 f"{100 * r['tensor_e_util']:.0f}% (modeled)" for r in self.summary()]
        return f"Profile({self.target}; " + "; ".join(parts) + ")"
