"""Per-engine work counters of the interpreter and a modeled Trainium time.

Every interpreted instruction adds to the counters of the current program instance (core) and the
current region (``region("phase1")``; work outside any region goes to ``"kernel"``).

Time model (REFERENCE.md §5 numbers; the per-instruction costs are our assumptions):

* TensorE, 2.4 GHz: a matmul streams its moving tensor one column per cycle through the array
  (128 rows x 128 columns for BF16, 512 x 128 for MXFP8), so an instruction costs ``N`` cycles
  (moving free size) plus ``TENSOR_FIXED_CYCLES``. Peak = 79 TFLOP/s BF16, 315 TFLOP/s MXFP8 per
  core (Trainium3). A PE transpose costs as a matmul with the data as moving tensor.
* VectorE / ScalarE / GpSimd at the vector clock (Trainium3 1.2 GHz, Trainium2 0.96 GHz): one
  element per partition per cycle (all active partitions in parallel), ``quantize_mx`` four
  (its "4x mode"), plus ``ENGINE_FIXED_CYCLES`` per instruction.
* DMA: bytes moved / per-core HBM bandwidth (Trainium3 4.7 TB/s / 8 cores; Trainium2
  2.9 TB/s / 8), no fixed cost.
* The modeled time of a region is the MAX over engines of their busy times (engines assumed to
  overlap perfectly), and the max over cores under LNC2. It is a lower bound on real time.
* ``tensor_e_utilization`` = TensorE useful time at peak (MACs / peak MAC rate) / modeled time,
  i.e. the fraction of the core's peak MXFP8/BF16 throughput achieved.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["ENGINES", "TIME_MODEL", "Counters", "Profile"]

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")

TENSOR_FIXED_CYCLES = 64  # assumption: issue + drain per matmul instruction
ENGINE_FIXED_CYCLES = 64  # assumption: per Vector/Scalar/GpSimd instruction overhead

TIME_MODEL = {
    "trn3": {"tensor_hz": 2.4e9, "vector_hz": 1.2e9, "hbm_bytes_per_s": 4.7e12 / 8,
             "bf16_flops": 79e12, "mx_flops": 315e12},
    "trn2": {"tensor_hz": 2.4e9, "vector_hz": 0.96e9, "hbm_bytes_per_s": 2.9e12 / 8,
             "bf16_flops": 79e12, "mx_flops": 0.0},
}


class Counters:
    """Work of one (core, region): instruction counts, elements, MACs, bytes, busy cycles."""

    __slots__ = ("cycles", "dma_bytes", "elements", "instructions", "macs_bf16", "macs_mx")

    def __init__(self):
        self.instructions = defaultdict(int)  # engine -> count
        self.elements = defaultdict(int)  # engine -> elements processed (tensor: MACs)
        self.cycles = defaultdict(float)  # engine -> busy cycles at that engine's clock
        self.macs_bf16 = 0
        self.macs_mx = 0
        self.dma_bytes = 0

    def add(self, other: Counters) -> None:
        for e in ENGINES:
            self.instructions[e] += other.instructions[e]
            self.elements[e] += other.elements[e]
            self.cycles[e] += other.cycles[e]
        self.macs_bf16 += other.macs_bf16
        self.macs_mx += other.macs_mx
        self.dma_bytes += other.dma_bytes

    def as_dict(self) -> dict:
        return {
            "instructions": dict(self.instructions), "elements": dict(self.elements),
            "macs_bf16": self.macs_bf16, "macs_mx": self.macs_mx, "dma_bytes": self.dma_bytes,
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
        m = self.model
        return {
            "tensor": c.cycles["tensor"] / m["tensor_hz"] * 1e6,
            "vector": c.cycles["vector"] / m["vector_hz"] * 1e6,
            "scalar": c.cycles["scalar"] / m["vector_hz"] * 1e6,
            "gpsimd": c.cycles["gpsimd"] / m["vector_hz"] * 1e6,
            "dma": c.dma_bytes / m["hbm_bytes_per_s"] * 1e6,
        }

    def modeled_time_us(self, region: str | None = None) -> float:
        """Modeled time of ``region`` (None: whole launch) in microseconds.

        Max over engines (perfect overlap assumed), then max over cores (cores run in parallel).
        """
        cores = self.cores or [0]
        return max(max(self.engine_time_us(region, c).values()) for c in cores)

    def tensor_useful_time_us(self, region: str | None = None, core: int | None = None) -> float:
        """MACs at the TensorE peak rate (BF16 79, MXFP8 315 TFLOP/s per core on trn3), in us."""
        c = self.counters(region, core)
        m = self.model
        t = 2.0 * c.macs_bf16 / m["bf16_flops"]
        if c.macs_mx:
            t += 2.0 * c.macs_mx / m["mx_flops"]
        return t * 1e6

    def tensor_e_utilization(self, region: str | None = None) -> float:
        """Fraction of TensorE peak achieved in ``region``: useful time / modeled time (0..1).

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
                "tensor_e_util": self.tensor_e_utilization(r),
                "engine_us": self.engine_time_us(r), "macs_mx": c.macs_mx,
                "macs_bf16": c.macs_bf16, "dma_bytes": c.dma_bytes,
                "instructions": sum(c.instructions.values()),
            })
        return rows

    def __repr__(self) -> str:
        parts = [f"{r['region']}: {r['modeled_us']:.1f} us, TensorE {100 * r['tensor_e_util']:.0f}%"
                 for r in self.summary()]
        return f"Profile({self.target}; " + "; ".join(parts) + ")"
