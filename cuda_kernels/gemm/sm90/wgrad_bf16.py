"""Hopper (SM90) grouped weight-gradient kernel in CuTe DSL.

``Wgrad[e] = A[:, begin:end] @ B[begin:end, :]`` for every expert ``e``.

For expert ``e`` with token range ``[begin, end)`` (``begin = offsets[e-1]``, 0 for ``e = 0``,
``end = offsets[e]``; REFERENCE §1.2, the cuDNN frontend's grouped-wgrad contract), the kernel
computes the ``(M, N) = (hidden, intermediate)`` product of ``A[:, begin:end]`` (``(M, K_e)``) and
``B[begin:end, :]`` (``(K_e, N)``) with fp32 accumulators, and writes (or adds into) the output in
BF16, FP16 or FP32.

Structure (one CTA per SM, persistent, warp-specialized):

- warp group 0 is the producer: one warp takes tile ids from a global atomic counter (dynamic
  persistent scheduler; ids run over the experts sorted by token count, largest first, so greedy
  taking is LPT list scheduling and uneven experts balance) and issues TMA loads of
  ``(tile_m, 64)`` A tiles and ``(tile_n, 64)`` B tiles into a ``stages``-deep shared-memory ring
  (mbarrier pipeline);
- consumer warp groups issue wgmma with fp32 accumulators. Cooperative tiles: two warp groups
  share a 128-row tile (a 64-row slab each). Pingpong tiles: two warp groups own alternate tiles
  and take turns on the pipeline, so one's epilogue overlaps the other's mainloop;
- epilogue: dense outputs go registers -> shared memory (stmatrix) -> TMA store, or TMA reduce-add
  when accumulating (``accumulate_on_output``), in (rows, 32) sub-tiles; discrete outputs (one
  pointer per expert, read on the device) are stored from registers. Dense outputs may end in
  partial tiles (the TMA boxes zero-fill loads past hidden / intermediate and clip the stores);
  discrete outputs need whole tiles;
- every tile's token range is read from ``offsets`` on the device (no host read, CUDA-graph
  capturable); the token dimension is dynamic, so new splits never recompile;
- ragged K: the TMA box of an expert's last K tile may straddle into the next expert's rows (or
  past ``tokens_sum``, which TMA zero-fills), and with a K-major operand the first box starts at
  the expert's begin rounded down to 8 tokens (TMA needs a 16-byte aligned innermost coordinate).
  The consumers zero the rows outside the expert in shared memory (both operands: ``0 * NaN`` is
  NaN), fence the async proxy and sync before the wgmma reads them;
- gathered operands (key fields ``gather_a`` / ``gather_b``: A's token columns / B's token rows
  read through a row index, the MoE routing index, instead of from a gathered copy): the whole
  producer warp group loads them. Warp 0 still takes the tile ids (all 128 producer threads read
  them back from the tile-id ring) and issues the TMA box of the other operand; the producer
  threads copy the K rows of each stage in 16-byte ``cp.async`` chunks into the swizzled
  MN-major stage, consecutive threads along one row (:func:`gather_thread_layout`: with tiles
  of a multiple of 64 columns, 8 threads a row, 4 rows 16 apart and ``extent / 64`` chunks of
  each a thread; a warp instruction reads 4 whole 128-byte row segments, coalesced, and writes
  4 whole 128-byte lines of shared memory, free of bank conflicts), the rows' index entries
  loaded one stage ahead into registers; a chunk is zero-filled by the copy's predicate for a
  padding row (index < 0), a token outside the expert or columns past hidden / intermediate.
  Every producer thread arrives on the stage's full barrier
  (``cp.async.mbarrier.arrive.noinc``: 1 + 128 arrivals, TMA bytes of the other operand only).
  The consumers fence the async proxy before wgmma and zero only a TMA operand's rows;
- empty experts issue no loads and write zeros, or leave the output untouched when accumulating;
- speed variants, fields of :class:`Sm90TileConfig` (defaults: the kernel above): epilogue
  sub-tile width (``epi_n``), the old output tile prefetched into L2 for the reduce-add
  (``acc_epilogue="l2prefetch"``: the YAML's rule for accumulating with many experts) and bands
  of M tiles walked N column by N column inside an expert (``swizzle``: the YAML's 128x192
  rule). (Variants measured on the H200 that lost -- a shared-memory prefetch accumulate
  epilogue, (2, 1) clusters with B multicast, a tile id fetched one tile ahead, a self-resetting
  tile counter, tile M 192, a chosen count of epilogue store stages -- were removed; their
  numbers are in benchmarks/RESULTS.md.)

Public names (docs/CONTRACTS.md): ``Sm90TileConfig``, ``Sm90WgradKey``, ``select_sm90_tile_config``,
``sm90_key_from_contract``, ``compile_sm90_wgrad`` (cached; ``COMPILE_COUNT`` counts real
compiles) and ``compile_sm90_wgrad_offline`` (PTX text for ``sm_90a`` without a GPU): the kernel's
host side is its key and kernel plugged into ``launch.KernelFamily`` (``FAMILY``), which compiles,
caches and launches. CuTe DSL is imported only inside the compile functions.
"""



import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

from ..keys import KernelKey
from ..launch import KernelFamily, fake_offsets_and_out, fake_wgrad_operands, key_of_contract
from ..tile_sched import scheduler_base
from ..tiles import SM90_TILES, rules_loader, select_tile
from .common import Sm90Tiling, kernel_base

__all__ = [
    "COMPILE_COUNT",  # noqa: F822 - served by the module __getattr__ (FAMILY.compile_count)
    "Sm90TileConfig",
    "Sm90WgradKey",
    "compile_sm90_wgrad",
    "compile_sm90_wgrad_offline",
    "load_sm90_tile_rules",
    "select_sm90_tile_config",
    "sm90_key_from_contract",
]

_SMEM_BYTES = SM90_TILES.smem_bytes  # usable dynamic shared memory per CTA on H100/H200
_SCHED_STAGES = 4  # depth of the tile-id ring between the producer warp and the consumers


#: True once the gathering producer's GPU tests (``tests/test_grouped_wgrad_gather.py -m gpu``:
#: bit-exact against the dense kernel on gathered copies) have passed with this source: the
#: coalesced producer (8 threads per 128-byte K row) passed them on an H100 on 2026-12-06T13:57Z,
#: and ``bench_grouped_wgrad.py --gather`` found every case bitwise equal (``benchmarks/
#: RESULTS.md``). Set it back to False (the env opt-in then opens the gate) if the producer
#: changes before it runs on a GPU again.
GATHER_VERIFIED_ON_GPU = True
GATHER_ENABLE_ENV = "MOE_BWD_ENABLE_UNVERIFIED_SM90_WGRAD_GATHER"


def gather_enabled() -> bool:
    """Whether ``grouped_wgrad_into`` may run the gather keys (``gather_a`` / ``gather_b``):
    verified on a GPU, or opted in with ``MOE_BWD_ENABLE_UNVERIFIED_SM90_WGRAD_GATHER=1``.
    Otherwise it gathers the operand first and runs the dense kernel (same bits, a copy)."""
    return GATHER_VERIFIED_ON_GPU or os.environ.get(GATHER_ENABLE_ENV) == "1"


def gather_thread_layout(extent: int, tile_k: int = 64) -> tuple[int, int, int]:
    """The gather producers' split of one gathered MN-major ``(extent, tile_k)`` stage (128
    threads, 16-byte chunks): ``(threads_per_row, rows_per_thread, chunks_per_thread_row)``.
    Consecutive threads take consecutive chunks of one K row, 8 per row where they divide the
    row's ``extent / 8`` chunks (every extent that is a multiple of 64: a warp instruction
    reads 4 whole 128-byte row segments and writes 4 whole 128-byte lines of the 128-byte
    swizzled stage, one chunk per 4 banks); else 4 or 2 (extent a multiple of 32 or 16).
    Thread ``t`` copies K rows ``t // threads_per_row + (128 // threads_per_row) * j``
    (``j < rows_per_thread``), chunks ``t % threads_per_row + threads_per_row * p``
    (``p < chunks_per_thread_row``) of each.

    Raises:
        ValueError: ``extent`` not a multiple of 16 or ``tile_k`` not a multiple of 64 (a
            thread would own no whole row).
    """
    if extent <= 0 or extent % 16 or tile_k <= 0 or tile_k % 64:
        raise ValueError(
            f"gather_thread_layout: extent must be a positive multiple of 16 and tile_k of 64, "
            f"got extent={extent}, tile_k={tile_k}"
        )
    chunks = extent // 8
    per_row = math.gcd(chunks, 8)
    return per_row, tile_k * per_row // 128, chunks // per_row


@dataclasses.dataclass(frozen=True)
class Sm90TileConfig(Sm90Tiling):
    """One CTA tile of the SM90 kernel (a row of ``configs/cuda/sm90_tiles.yaml``): the fields
    ``tile_m`` (output rows: hidden), ``tile_n`` (columns: intermediate), ``tile_k`` (tokens per
    stage), ``stages`` and ``pingpong`` of ``sm90.common.Sm90Tiling``, its stage bytes and
    consumer structure, and speed variants.

    Speed variants (the defaults are the measured behaviour; ``benchmarks/bench_grouped_wgrad.py
    --variants`` sweeps them):
        acc_epilogue: how a dense output is accumulated into (``accumulate_on_output``):
            ``"reduce"`` (TMA reduce-add of each sub-tile) or ``"l2prefetch"`` (the producer
            warp prefetches the old output tile into L2 by TMA when the tile's loads start, so
            the epilogue's TMA reduce-add finds it there instead of waiting on DRAM; any dense
            output).
        epi_n: columns of one epilogue sub-tile (TMA store box): 32 (default, as measured), or
            a multiple of 16 dividing tile_n. The store / reduce-add epilogues keep as many
            staging buffers of it per consumer group as fit, at most 2 (the measured default).
        swizzle: tile order inside an expert. 0: M tiles fastest, one N column after another
            (the measured default); G > 0: bands of G M tiles, each band walked N column by N
            column (an L2 working set of G A tiles and all of B instead of all of A).

    Raises:
        ValueError: a field outside the ranges of ``Sm90Tiling`` and above, or stages that
            overflow shared memory.
    """

    acc_epilogue: str = "reduce"
    epi_n: int = 32
    swizzle: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()  # the tile fields (tiles.SM90_TILES)
        cls = type(self).__name__
        if self.acc_epilogue not in ("reduce", "l2prefetch"):
            raise ValueError(
                f"{cls}.acc_epilogue must be 'reduce' or 'l2prefetch', got {self.acc_epilogue!r}"
            )
        if self.epi_n != 32 and (  # (32: the measured kernel's width, for every tile_n)
            self.epi_n % 16 or not 16 <= self.epi_n <= self.tile_n or self.tile_n % self.epi_n
        ):
            raise ValueError(
                f"{cls}.epi_n must be a multiple of 16 dividing tile_n={self.tile_n}, "
                f"got {self.epi_n}"
            )
        if not 0 <= self.swizzle <= 64:
            raise ValueError(f"{cls}.swizzle must be in [0, 64], got {self.swizzle}")

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        """The CTA cluster: (1, 1) (no clusters on SM90)."""
        return SM90_TILES.cluster_for(self.tile_m)

    @property
    def variant_name(self) -> str:
        """Short name of the tile and its speed variants (benchmark rows)."""
        name = super().variant_name
        if self.acc_epilogue != "reduce":
            name += {"l2prefetch": "-l2pf"}[self.acc_epilogue]
        if self.epi_n != 32:
            name += f"-e{self.epi_n}"
        if self.swizzle:
            name += f"-sw{self.swizzle}"
        return name


@dataclasses.dataclass(frozen=True)
class Sm90WgradKey(KernelKey):
    """Static contract of one compiled SM90 kernel (the compile-cache key): the fields of
    ``keys.KernelKey`` and the :class:`Sm90TileConfig` ``tile``; dense outputs may end in
    partial tiles (TMA zero-fills the loads and clips the stores), discrete outputs need a tile
    that divides hidden and intermediate. ``input_order``: see
    :func:`compile_sm90_wgrad`.

    Gathered operands (compile-time fields; the defaults compile the kernel without gather):
        gather_a: A's token columns are read through an index: A column ``s`` is
            ``A_src[:, a_rows[s]]`` (zeros where ``a_rows[s] < 0``), ``A_src`` an M-major
            ``(hidden, T)`` view (``a_major="m"``: e.g. ``X.t()`` of a row-major ``[T, H]``
            ``X``). The producer warp group copies its rows with ``cp.async`` instead of TMA.
        gather_b: likewise B row ``s`` is ``B_src[b_rows[s], :]``, ``B_src`` a row-major
            ``(T, intermediate)`` tensor (``b_major="n"``).
        index_dtype: ``"int64"`` or ``"int32"``: the dtype of the index (of both, when both
            operands are gathered; ignored without gather).

    Raises:
        ValueError: a field outside its values, hidden / intermediate that the tile does not
            divide, or a gathered operand that is not MN-major / not ``tensor2d``.
    """

    _TILES = SM90_TILES

    tile: Sm90TileConfig = Sm90TileConfig()
    gather_a: bool = False
    gather_b: bool = False
    index_dtype: str = "int64"

    def __post_init__(self) -> None:
        super().__post_init__()
        cls = type(self).__name__
        for name in ("gather_a", "gather_b"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{cls}.{name} must be a bool, got {getattr(self, name)!r}")
        if self.index_dtype not in ("int64", "int32"):
            raise ValueError(
                f"{cls}.index_dtype must be 'int64' or 'int32', got {self.index_dtype!r}"
            )
        if self.gather_a and self.a_major != "m":
            raise ValueError(
                f"{cls}: gather_a reads A's token columns as M-major rows (a_major='m'), got "
                f"a_major={self.a_major!r}"
            )
        if self.gather_b and self.b_major != "n":
            raise ValueError(
                f"{cls}: gather_b reads B's token rows as N-major rows (b_major='n'), got "
                f"b_major={self.b_major!r}"
            )
        if (self.gather_a or self.gather_b) and self.input_order != "tensor2d":
            raise ValueError(
                f"{cls}: a gathered operand needs input_order='tensor2d', got "
                f"{self.input_order!r}"
            )

    @property
    def gather(self) -> bool:
        """Whether any operand is read through an index."""
        return self.gather_a or self.gather_b


#: The rows of ``configs/cuda/sm90_tiles.yaml``, read once: ``load_sm90_tile_rules()``.
load_sm90_tile_rules = rules_loader(SM90_TILES, Sm90TileConfig)


def select_sm90_tile_config(
    hidden: int,
    intermediate: int,
    num_experts: int,
    tokens_hint: int | None = None,
    *,
    mma_tiler_mn: tuple[int, int] | None = None,
    output_mode: str = "dense",
    accumulate: bool = False,
) -> Sm90TileConfig:
    """The SM90 tile config of an ``(E, M, N)`` problem, from ``configs/cuda/sm90_tiles.yaml``
    (the arguments of every family's selector: :func:`tiles.select_tile`).

    Args:
        output_mode: "dense" outputs may end in partial tiles; "discrete" ones take the first
            rule whose tile divides hidden and intermediate.
        accumulate: accumulating into the output (rules may ask for it: their epilogue).
        mma_tiler_mn: a caller's ``(tile_m, tile_n)`` instead of the rules: cooperative schedule
            with as many stages (up to 8) as shared memory holds.

    Returns:
        The first rule's :class:`Sm90TileConfig` whose divisibility conditions hold.

    Raises:
        ValueError: no rule fits (hidden and intermediate must be multiples of 64), non-positive
            sizes, or an ``mma_tiler_mn`` outside the tile rules or not dividing hidden and
            intermediate.
    """
    config = select_tile(
        SM90_TILES, Sm90TileConfig, load_sm90_tile_rules, hidden, intermediate, num_experts,
        mma_tiler_mn=mma_tiler_mn, who="select_sm90_tile_config", accumulate=accumulate,
        whole_tiles=output_mode != "dense",
    )
    if mma_tiler_mn is not None and (hidden % config.tile_m or intermediate % config.tile_n):
        raise ValueError(
            f"select_sm90_tile_config: mma_tiler_mn={mma_tiler_mn} must divide "
            f"hidden={hidden} and intermediate={intermediate}"
        )
    if config is None:
        raise ValueError(
            f"select_sm90_tile_config: no SM90 tile fits hidden={hidden}, "
            f"intermediate={intermediate} (both must be multiples of 64)"
        )
    return config


# --------------------------------------------------------------------------------------------
# The kernel (CuTe DSL imported lazily)
# --------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    from cutlass import cute, memory, pipeline
    from cutlass.tensor_utils import LayoutEnum

    base = kernel_base()
    fence_accumulators = base.fence_accumulators

    class Sm90GroupedWgradKernel(base, scheduler_base()):
        """CTA-persistent, warp-specialized grouped wgrad for one :class:`Sm90WgradKey` (the
        tile fields, loads and launch of ``sm90.common.kernel_base()``; the tile scheduler's
        ``next_tile`` / ``take_tile`` of ``tile_sched.scheduler_base()``)."""

        def __init__(self, key: Sm90WgradKey):
            self.init_tiling(key)
            t = key.tile
            self.m_tiles = key.m_tiles  # dense outputs may end in partial tiles (TMA clips)
            self.n_tiles = key.n_tiles
            self.tiles_per_expert = self.m_tiles * self.n_tiles
            self.num_tiles = key.num_tiles
            self.out_dtype = self.out_types[key.out_dtype]
            self.ab_dtype = cutlass.BFloat16
            self.acc_dtype = cutlass.Float32
            self.align_k = 8 if "k" in (key.a_major, key.b_major) else 1
            # Dense outputs leave through shared memory and TMA stores (TMA reduce-add when
            # accumulating), in (tile_m, epi_n) sub-tiles, epi_stages buffers per consumer group;
            # discrete outputs (a pointer per expert) are stored from registers.
            self.tma_epi = key.output_mode == "dense"
            # accumulate with the reduce-add, the old tile prefetched into L2 by the producer
            self.l2_prefetch_c = self.tma_epi and key.accumulate and t.acc_epilogue == "l2prefetch"
            # one warp group per tile (pingpong / 64-row tiles): its accumulator fragment is
            # ordered by 64-row wgmma slab, so the sub-tiles are (64, epi_n), n fastest
            self.epi_tile = (self.tile_m if self.wgs_per_group > 1 else 64, t.epi_n)
            self.n_sub = (self.tile_m // self.epi_tile[0]) * (self.tile_n // t.epi_n)
            out_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[key.out_dtype]
            sub_bytes = self.epi_tile[0] * t.epi_n * out_bytes
            self.swizzle = t.swizzle
            header = 2048 + 8 * key.num_experts + 16 * t.stages
            self.epi_stages = 2
            while self.tma_epi and self.epi_stages > 1 and (
                header
                + t.stage_bytes * t.stages
                + sub_bytes * self.epi_stages * self.num_groups
                > _SMEM_BYTES
            ):
                self.epi_stages -= 1
            epi_bytes = sub_bytes * self.epi_stages * self.num_groups if self.tma_epi else 0
            self.stages = min(t.stages, (_SMEM_BYTES - header - epi_bytes) // t.stage_bytes)
            if self.stages < 2:
                raise ValueError(f"{t} leaves no room for 2 pipeline stages with its epilogue")
            # gathered operands: the producer warp group's 128 threads copy the K rows of a
            # stage with cp.async, consecutive threads along one row (gather_thread_layout: 8
            # per row, 4 rows and extent / 64 chunks per thread for the YAML's tiles), the
            # rows' index entries kept in registers, loaded one stage ahead. That keeps more
            # registers than a TMA-only producer warp; the consumers take what the producers
            # give up (setmaxnreg steps of 8)
            self.gather_a, self.gather_b = key.gather_a, key.gather_b
            self.gather = key.gather
            self.idx_dtype = {"int64": cutlass.Int64, "int32": cutlass.Int32}[key.index_dtype]
            self.producer_regs = 56 if self.gather else 40
            self.consumer_regs = (
                (224 if self.gather else 232) if self.num_consumer_wgs == 2 else 160
            )

        def make_storage(self, a_cosize: int, b_cosize: int, epi_cosize: int):
            """The kernel's shared-memory struct (built in a plain method, outside the code the
            DSL's preprocessor rewrites)."""
            mem, align = cute.struct.MemRange, cute.struct.Align
            fields = {
                **self.sched_storage_fields(),
                "sA": align[mem[self.ab_dtype, a_cosize], 1024],
                "sB": align[mem[self.ab_dtype, b_cosize], 1024],
                "sC": align[mem[self.out_dtype, epi_cosize], 1024],
            }
            return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        def sched_storage_fields(self):
            """The head of the shared-memory struct (shared with the MXFP8 kernel): the (A, B)
            ring's and the tile-id ring's mbarriers, the tile-id ring, the expert token counts
            and the experts' size order."""
            mem = cute.struct.MemRange
            return {
                "mbar": mem[cutlass.Int64, self.stages * 2],
                "sched_mbar": mem[cutlass.Int64, _SCHED_STAGES * 2],
                "sched": mem[cutlass.Int32, _SCHED_STAGES],
                "lens": mem[cutlass.Int32, self.key.num_experts],
                "perm": mem[cutlass.Int32, self.key.num_experts],
            }

        @cute.jit
        def expert_bounds(self, mOffsets: cute.Tensor, e: cutlass.Int32):
            """(k_begin, k_end): expert e's token range from the device offsets."""
            k_end = mOffsets[e]
            k_begin = cutlass.Int32(0)
            if e > 0:
                k_begin = mOffsets[e - 1]
            return k_begin, k_end

        @cute.jit
        def k_range(self, mOffsets: cute.Tensor, e: cutlass.Int32):
            """(k_base, head, k_len, n_k) of expert e: tiles start at k_base (k_begin aligned
            down to 8 tokens = 16 bytes when an operand is K-major: TMA needs a 16-byte aligned
            innermost coordinate), head = rows of the previous expert in the first tile,
            k_len = rows from k_base to the expert's end, n_k = number of K tiles."""
            k_begin, k_end = self.expert_bounds(mOffsets, e)
            k_base = k_begin
            if cutlass.const_expr(self.align_k > 1):
                k_base = k_begin - k_begin % self.align_k
            k_len = k_end - k_base
            n_k = (k_len + self.tile_k - 1) // self.tile_k
            if k_end <= k_begin:
                n_k = cutlass.Int32(0)
            return k_base, k_begin - k_base, k_len, n_k

        @cute.jit
        def zero_rows(
            self,
            sX: cute.Tensor,
            extent: cutlass.Constexpr,
            mn_major: cutlass.Constexpr,
            lo: cutlass.Int32,
            hi: cutlass.Int32,
            stage: cutlass.Int32,
            ctid: cutlass.Int32,
        ):
            """Zero K rows [0, lo) and [hi, tile_k) of one (extent, tile_k) operand stage.
            MN-major stages are zeroed in 8-element (16-byte) chunks, which the 128-byte
            swizzle keeps contiguous; K-major stages element by element."""
            tk = self.tile_k
            n_bad = lo + tk - hi
            if cutlass.const_expr(mn_major):
                chunks = extent // 8
                zeros = cute.make_rmem_tensor((8,), self.ab_dtype)
                zeros.fill(0.0)
                for i in cutlass.range(ctid, chunks * n_bad, self.group_threads, unroll=1):
                    r = i // chunks
                    c = i - r * chunks
                    kk = r
                    if r >= lo:
                        kk = hi + r - lo
                    row = sX[(None, kk, stage)]
                    cute.autovec_copy(zeros, cute.local_tile(row, (8,), (c,)))
            else:
                for i in cutlass.range(ctid, extent * n_bad, self.group_threads, unroll=1):
                    r = i // extent
                    mm = i - r * extent
                    kk = r
                    if r >= lo:
                        kk = hi + r - lo
                    sX[(mm, kk, stage)] = self.ab_dtype(0.0)

        # ---- gathered operands (gather_a / gather_b): the producer warp group's cp.async ----

        @cute.jit
        def producer_tile(self, mCounter, lane, warp_idx, sched_pipe, sched_state, sched_cstate,
                          sSched):
            """Gather producers (the whole producer warp group): warp 0 takes the next tile id
            from the global counter and publishes it into the tile-id ring (as the TMA
            producer warp does); then every producer thread reads it back from the ring, as
            the consumers do (the ring counts the 128 producer threads among its readers). The
            caller advances both states."""
            if warp_idx == 0:
                self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
            return self.take_tile(sched_pipe, sched_cstate, sSched)

        @cute.jit
        def gather_stage(  # noqa: PLR0913
            self,
            atom: cute.CopyAtom,
            mG: cute.Tensor,
            sX: cute.Tensor,
            extent: cutlass.Constexpr,
            total: cutlass.Constexpr,
            col0: cutlass.Int32,
            src: cute.Tensor,
            ptid: cutlass.Int32,
            stage: cutlass.Int32,
        ):
            """Producer thread ``ptid``'s share of one gathered MN-major ``(extent, tile_k)``
            stage, columns ``[col0, col0 + extent)`` of ``mG`` (``(total, T)``, stride
            ``(1, ld)``): its K rows and 16-byte chunks of :func:`gather_thread_layout` (K row
            ``j`` of this thread is source row ``src[j]``, its index entry: :meth:`row_index`).
            Consecutive threads take consecutive chunks of one row, so one cp.async
            instruction reads whole row segments (4 x 128 bytes with 8 threads per row); the
            swizzle keeps each chunk contiguous in shared memory, and with the 128-byte
            swizzle the 8 chunks of a row segment fill one 128-byte line (one chunk per 4
            banks: no bank conflict). cp.async zero-fills a chunk whose predicate is false:
            ``src < 0`` (a padding row, or a token outside the expert) or columns past
            ``total``."""
            per_row, rows_per_thread, passes = gather_thread_layout(extent, self.tile_k)
            row_in = ptid // per_row
            chunk_in = ptid % per_row
            ld_bytes = cutlass.Int64(mG.stride[1]) * 2
            base = mG.iterator.toint() + cutlass.Int64(col0) * 2
            for j in cutlass.range_constexpr(rows_per_thread):
                ok = src[j] >= 0
                row_addr = base + cutlass.max(src[j], cutlass.Int64(0)) * ld_bytes
                row = sX[(None, row_in + j * (128 // per_row), stage)]
                for p in cutlass.range_constexpr(passes):
                    c = chunk_in + per_row * p
                    ok_c = ok
                    if cutlass.const_expr(total % extent != 0):  # a partial last tile: columns
                        ok_c = ok and col0 + c * 8 < total
                    self.gather_chunk(atom, ok_c, row_addr, row, c)

        @cute.jit
        def gather_chunk(self, atom, ok, row_addr, row, c):
            """One 16-byte cp.async: chunk ``c`` of the source row at byte address
            ``row_addr`` into chunk ``c`` of the stage's K row ``row`` (zero-filled where
            ``ok`` is false)."""
            pred = cute.make_rmem_tensor((1,), cutlass.Boolean)
            pred[0] = ok
            src_t = cute.make_tensor(
                cute.make_ptr(
                    self.ab_dtype,
                    row_addr + cutlass.Int64(c) * 16,
                    cute.AddressSpace.gmem,
                    assumed_align=16,
                ),
                cute.make_layout(((8, 1),)),
            )
            dst = cute.local_tile(row, (8,), (c,))
            dst_t = cute.make_tensor(dst.iterator, cute.make_layout(((8, 1),)))
            cute.copy(atom, src_t, dst_t, pred=pred)

        @cute.jit
        def row_index(self, mIdx, s, k_begin, k_end):
            """The source row of token ``s`` (``mIdx[s]``), or -1 outside the expert's tokens
            ``[k_begin, k_end)`` (the index is not read there: it may end at ``k_end``)."""
            src = cutlass.Int64(-1)
            if s >= k_begin and s < k_end:
                src = cutlass.Int64(mIdx[s])
            return src

        @cute.jit
        def stage_rows(self, src, mIdx, s0, extent: cutlass.Constexpr, ptid, k_begin, k_end):
            """``src[j]`` = the source row of producer thread ``ptid``'s K row ``j`` of an
            ``extent``-wide gathered stage (:func:`gather_thread_layout`) whose first token is
            ``s0`` (:meth:`row_index`)."""
            per_row, rows_per_thread, _ = gather_thread_layout(extent, self.tile_k)
            for j in cutlass.range_constexpr(rows_per_thread):
                src[j] = self.row_index(
                    mIdx, s0 + ptid // per_row + j * (128 // per_row), k_begin, k_end
                )

        @cute.jit
        def produce_gather(  # noqa: PLR0913
            self, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_cl, tma_cl, sA, sB, sC,
            mGA, mGB, mIdxA, mIdxB, sPerm, mOffsets, mCounter, ab_pipe, sched_pipe, sSched,
            warp_idx, ptid,
        ):
            """The producer warp group with a gathered operand: per tile (ids from the ring:
            :meth:`producer_tile`) and K stage, every thread waits for the stage to be free
            (the index entries of its K rows of the stage already in registers, loaded one
            stage ahead: :meth:`stage_rows`); warp 0 arms the full barrier with the TMA bytes
            of the operand that stays on TMA (none when both are gathered) and issues its box;
            every thread issues its cp.async chunks of the gathered operand(s)
            (:meth:`gather_stage`, :func:`gather_thread_layout`) and
            arrives on the full barrier when they land (``noinc``: the barrier counts 1 + 128
            arrivals). Rows outside the expert are zero-filled here, so the consumers zero
            only a TMA operand's."""
            tk = self.tile_k
            prod_state, sched_state = self.producer_states()
            sched_cstate = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, _SCHED_STAGES
            )
            lane = cute.arch.lane_idx()
            atom = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                self.ab_dtype,
                num_bits_per_copy=128,
            )
            # the index entries of this thread's K rows of a gathered stage, a stage ahead
            src_a, src_b = None, None
            if cutlass.const_expr(self.gather_a):
                src_a = cute.make_rmem_tensor(
                    (gather_thread_layout(self.tile_m, tk)[1],), cutlass.Int64
                )
            if cutlass.const_expr(self.gather_b):
                src_b = cute.make_rmem_tensor(
                    (gather_thread_layout(self.tile_n, tk)[1],), cutlass.Int64
                )
            gCl_all = None
            if cutlass.const_expr(self.l2_prefetch_c):
                gCl_all = cute.local_tile(tma_cl, (self.tile_m, self.tile_n), (None, None, None))
            tile = self.producer_tile(
                mCounter, lane, warp_idx, sched_pipe, sched_state, sched_cstate, sSched
            )
            sched_state.advance()
            sched_cstate.advance()
            while tile < self.num_tiles:
                e, m_idx, n_idx = self.tile_coords(tile, sPerm)
                k_base, head, k_len, n_k = self.k_range(mOffsets, e)
                k_begin = k_base + head
                k_end = k_base + k_len
                tAsA, tAgA, tBsB, tBgB = None, None, None, None
                if cutlass.const_expr(not self.gather_a):
                    tAsA, tAgA = self.operand_load_partition(
                        tma_atom_a, tma_a, sA, self.tile_m, k_base, m_idx
                    )
                if cutlass.const_expr(not self.gather_b):
                    tBsB, tBgB = self.operand_load_partition(
                        tma_atom_b, tma_b, sB, self.tile_n, k_base, n_idx
                    )
                if cutlass.const_expr(self.l2_prefetch_c):
                    if warp_idx == 0 and n_k > 0:
                        self.prefetch_old_tile(tma_atom_cl, sC, gCl_all, m_idx, n_idx, e)
                # the index entries of this thread's K rows, loaded one stage ahead (their
                # latency hides behind the wait for a free stage)
                if cutlass.const_expr(self.gather_a):
                    self.stage_rows(src_a, mIdxA, k_base, self.tile_m, ptid, k_begin, k_end)
                if cutlass.const_expr(self.gather_b):
                    self.stage_rows(src_b, mIdxB, k_base, self.tile_n, ptid, k_begin, k_end)
                for kt in cutlass.range(n_k, unroll=1):
                    ab_pipe.sync_object_empty.wait(prod_state.index, prod_state.phase)
                    bar = ab_pipe.producer_get_barrier(prod_state)
                    if warp_idx == 0:
                        # one arrival, arming the TMA bytes (0 when both are gathered)
                        ab_pipe.sync_object_full.arrive(prod_state.index, None)
                        if cutlass.const_expr(not self.gather_a):
                            cute.copy(
                                tma_atom_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                        if cutlass.const_expr(not self.gather_b):
                            cute.copy(
                                tma_atom_b, tBgB[(None, kt)], tBsB[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                    s_next = k_base + (kt + 1) * tk
                    if cutlass.const_expr(self.gather_a):
                        self.gather_stage(
                            atom, mGA, sA, self.tile_m, self.key.hidden,
                            m_idx * self.tile_m, src_a, ptid, prod_state.index,
                        )
                        self.stage_rows(src_a, mIdxA, s_next, self.tile_m, ptid, k_begin, k_end)
                    if cutlass.const_expr(self.gather_b):
                        self.gather_stage(
                            atom, mGB, sB, self.tile_n, self.key.intermediate,
                            n_idx * self.tile_n, src_b, ptid, prod_state.index,
                        )
                        self.stage_rows(src_b, mIdxB, s_next, self.tile_n, ptid, k_begin, k_end)
                    cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                    prod_state.advance()
                tile = self.producer_tile(
                    mCounter, lane, warp_idx, sched_pipe, sched_state, sched_cstate, sSched
                )
                sched_state.advance()
                sched_cstate.advance()
            # the tail: every stage released by the consumers before the producers exit (the
            # waits of PipelineTmaAsync.producer_tail, without its arrivals)
            for _i in cutlass.range_constexpr(self.stages):
                ab_pipe.sync_object_empty.wait(prod_state.index, prod_state.phase)
                prod_state.advance()
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)

        # ---- the kernel prologue and loads, shared with the MXFP8 kernel (sm90_mxfp8) ----

        def operand_load_partition(self, tma_atom, tma, sX, extent, k0, idx):
            """Producer: the TMA partition (smem stages, gmem K tiles from token ``k0``) of one
            operand's ``(extent, tile_k)`` tiles of block ``idx``. Returns (smem, gmem)."""
            gX = cute.local_tile(
                cute.domain_offset((0, k0), tma), (extent, self.tile_k), (idx, None)
            )
            return self.stage_tma_partition(tma_atom, sX, gX)

        def ab_load_partitions(  # noqa: PLR0913
            self, tma_atom_a, tma_a, tma_atom_b, tma_b, sA, sB, k0, m_idx, n_idx
        ):
            """Producer: the TMA partitions (:meth:`operand_load_partition`) of the A tiles of
            output row block ``m_idx`` and the B tiles of column block ``n_idx``. Returns
            (tAsA, tAgA, tBsB, tBgB)."""
            tAsA, tAgA = self.operand_load_partition(tma_atom_a, tma_a, sA, self.tile_m, k0, m_idx)
            tBsB, tBgB = self.operand_load_partition(tma_atom_b, tma_b, sB, self.tile_n, k0, n_idx)
            return tAsA, tAgA, tBsB, tBgB

        @cute.jit
        def prefetch_old_tile(self, tma_atom_cl, sC, gCl_all, m_idx, n_idx, e):
            """``acc_epilogue="l2prefetch"``: the old output tile ``(m_idx, n_idx)`` of expert
            ``e`` into L2 (sub-tile TMA boxes, one elected thread), for the epilogue's
            reduce-add."""
            _sC_part, gC_part = cute.nvgpu.cpasync.tma_partition(
                tma_atom_cl,
                0,
                cute.make_layout(1),
                cute.group_modes(sC, 0, 2),
                cute.zipped_divide(gCl_all[(None, None, m_idx, n_idx, e)], self.epi_tile),
            )
            with cute.arch.elect_one():
                cute.prefetch(tma_atom_cl, gC_part)

        def mma_fragments(self, tiled_mma, sA, sB, slab_thread):
            """Consumer warp group: the wgmma operand fragments of its slab (``slab_thread``:
            the slab's first thread in ``tiled_mma``) over the A / B stages and the number of
            wgmma k blocks per stage. Returns (tCrA, tCrB, num_k_blocks)."""
            thr_mma = tiled_mma.get_slice(slab_thread)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            return tCrA, tCrB, cute.size(tCrA, mode=[2])

        def producer_states(self):
            """Producer warp pipeline states: the (A, B) ring's and the tile-id ring's."""
            return (
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, _SCHED_STAGES),
            )

        def consumer_states(self):
            """Consumer pipeline states: (read, release) of the (A, B) ring and the tile-id
            ring's."""
            return (
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, _SCHED_STAGES),
            )

        def setup_pipelines(
            self, a_smem_staged, b_smem_staged, extra_tx_bytes: int = 0,
            gather_a: bool = False, gather_b: bool = False,
        ):
            """Allocate the shared-memory struct and create (deferred init) the (A, B) stage
            ring and the tile-id ring. Every stage's loads complete ``extra_tx_bytes`` beyond
            its A and B tiles (the MXFP8 scale atoms). A gathered operand (``gather_a`` /
            ``gather_b``) brings no TMA bytes: its stage is complete when the producer warp
            group's 128 threads have arrived (``cp.async.mbarrier.arrive.noinc``) besides
            the one arrival that arms the TMA bytes, and those 128 threads read the tile-id
            ring too. Returns (storage, ab_pipe, sched_pipe, sSched)."""
            a_smem_one = cute.slice_(a_smem_staged, (None, None, 0))
            b_smem_one = cute.slice_(b_smem_staged, (None, None, 0))
            tx_bytes = extra_tx_bytes
            if not gather_a:
                tx_bytes += cute.size_in_bytes(self.ab_dtype, a_smem_one)
            if not gather_b:
                tx_bytes += cute.size_in_bytes(self.ab_dtype, b_smem_one)
            gather_threads = 128 if (gather_a or gather_b) else 0

            smem = memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 1 + gather_threads
                ),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.wgs_per_group * 4
                ),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            # Dynamic tile scheduler: the producer warp takes tile ids from a global atomic
            # counter and passes them to the consumers through a small smem ring.
            sched_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.sched_mbar.data_ptr(),
                num_stages=_SCHED_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 128 * self.num_consumer_wgs + gather_threads
                ),
                defer_sync=True,
            )
            sSched = storage.sched.get_tensor(cute.make_layout(_SCHED_STAGES))
            return storage, ab_pipe, sched_pipe, sSched

        @cute.jit
        def sort_experts(self, mOffsets, storage, tidx, scale_starts: cutlass.Constexpr = False):
            """Experts sorted by token count, largest first (ties by index), from the device
            offsets: sPerm[rank] = expert, so heavy experts' tiles go first (balance). Waits for
            the pipelines' init (``pipeline_init_wait``, which syncs the CTA) between counting
            and ranking, and syncs the CTA at the end. ``scale_starts`` (the MXFP8 kernel):
            negative counts clamp to 0 and ``sStart[e]`` gets the expert's first scale atom
            column (the prefix sum of ceil(count / tile_k)). Returns (sPerm, sStart or None)."""
            num_e = self.key.num_experts
            sLens = storage.lens.get_tensor(cute.make_layout(num_e))
            sPerm = storage.perm.get_tensor(cute.make_layout(num_e))
            sStart = None
            if cutlass.const_expr(scale_starts):
                sStart = storage.start.get_tensor(cute.make_layout(num_e))
            for ei in cutlass.range(tidx, num_e, self.threads, unroll=1):
                prev = cutlass.Int32(0)
                if ei > 0:
                    prev = mOffsets[ei - 1]
                ln = mOffsets[ei] - prev
                if cutlass.const_expr(scale_starts):  # noqa: SIM102
                    if ln < 0:
                        ln = cutlass.Int32(0)
                sLens[ei] = ln
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))  # syncs the CTA
            for ei in cutlass.range(tidx, num_e, self.threads, unroll=1):
                my_len = sLens[ei]
                rank = cutlass.Int32(0)
                start = cutlass.Int32(0)
                for e2 in cutlass.range(num_e, unroll=4):
                    l2 = sLens[e2]
                    if l2 > my_len or (l2 == my_len and e2 < ei):
                        rank += 1
                    if cutlass.const_expr(scale_starts):  # noqa: SIM102
                        if e2 < ei:
                            start += (l2 + self.tile_k - 1) // self.tile_k
                sPerm[rank] = ei
                if cutlass.const_expr(scale_starts):
                    sStart[ei] = start
            cute.arch.sync_threads()
            return sPerm, sStart

        # ---- the TMA epilogue (dense outputs; the sub-tile machinery is the base's:
        # gemm/sm90/common.py) ----

        def epi_store_op(self):
            """TMA store, or TMA reduce-add when accumulating."""
            if self.key.accumulate:
                return cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp()
            return cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()

        def epi_tma_atom(self, op, mOut, epi_smem_staged):
            """TMA atom of ``op`` over the dense ``(E, M, N)`` output viewed as ``(M, N, E)``,
            one ``epi_tile`` box per copy."""
            m, n, e = self.key.hidden, self.key.intermediate, self.key.num_experts
            mC_mne = cute.make_tensor(
                mOut.iterator, cute.make_layout((m, n, e), stride=(n, 1, m * n))
            )
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                op,
                mC_mne,
                cute.slice_(epi_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        @cute.jit
        def epi_store_tile(  # noqa: PLR0913
            self, epi, tRS_acc, tma_atom_c, sC, gC_all, e, m_idx, n_idx, group, epi_count,
            warp_idx, store_warp, mask_barrier,
        ):
            """Store the accumulator (``tRS_acc``, retiled) as output tile (m_idx, n_idx) of expert e (``gC_all``:
            the output's tiles) through ``group``'s sub-tile TMA stores (``epi_partition``,
            ``epi_store_subtiles``). Returns the advanced buffer counter."""
            bSG_sC, bSG_gC, n_sub, sub_layout = self.epi_partition(
                tma_atom_c, sC, gC_all[(None, None, m_idx, n_idx, e)]
            )
            return self.epi_store_subtiles(
                epi, tRS_acc, tma_atom_c, bSG_sC, bSG_gC, n_sub, sub_layout, group, epi_count,
                warp_idx, store_warp, mask_barrier,
            )

        @cute.jit
        def store_regs_autovec(self, acc, r_out, out_ptr, thr_mma_epi, m_idx, n_idx, n_k):
            """Store the accumulator from registers as output tile (m_idx, n_idx) of the
            row-major (hidden, intermediate) output at ``out_ptr`` (this thread's elements,
            converted in ``r_out``); when accumulating, add the old values first (an empty
            expert, ``n_k == 0``, leaves the output untouched)."""
            mC = cute.make_tensor(
                out_ptr,
                cute.make_layout(
                    (self.key.hidden, self.key.intermediate),
                    stride=(self.key.intermediate, 1),
                ),
            )
            gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (m_idx, n_idx))
            tCgC = thr_mma_epi.partition_C(gC)
            if cutlass.const_expr(self.key.accumulate):
                if n_k > 0:
                    cute.autovec_copy(tCgC, r_out)
                    acc.store(acc.load() + r_out.load().to(self.acc_dtype))
                    r_out.store(acc.load().to(self.out_dtype))
                    cute.autovec_copy(r_out, tCgC)
            else:
                r_out.store(acc.load().to(self.out_dtype))
                cute.autovec_copy(r_out, tCgC)

        @cute.jit
        def tile_coords(self, tile, sPerm):
            """(e, m_idx, n_idx) of scheduler tile ``tile``: ids run over experts sorted by size
            (largest first), then N tiles, then M tiles (or, with ``swizzle``, bands of M tiles
            walked N column by N column)."""
            rank_e = tile // self.tiles_per_expert
            e = sPerm[rank_e]
            rem = tile - rank_e * self.tiles_per_expert
            n_idx = rem // self.m_tiles
            m_idx = rem - n_idx * self.m_tiles
            if cutlass.const_expr(self.swizzle > 0):
                # bands of `swizzle` M tiles, each walked N column by N column
                band = rem // (self.swizzle * self.n_tiles)
                inner = rem - band * (self.swizzle * self.n_tiles)
                rows = cutlass.min(self.swizzle, self.m_tiles - band * self.swizzle)
                n_idx = inner // rows
                m_idx = band * self.swizzle + inner - n_idx * rows
            return e, m_idx, n_idx

        def make_mma_and_ab_loads(self, mA, mB, load_a: bool = True, load_b: bool = True):
            """Host side (shared with the MXFP8 kernel): the tiled wgmma (``wgs_per_group``
            64-row slabs of a tile, ``tile_n`` wide), the ``stages``-deep shared-memory layouts
            of A and B and their TMA load atoms ((tile_m, tile_k) / (tile_n, tile_k) boxes;
            None for an operand that is not loaded by TMA: ``load_a`` / ``load_b`` False, a
            gathered operand). Returns (tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a,
            tma_a, tma_atom_b, tma_b)."""
            tiled_mma, a_smem_staged, b_smem_staged = self.make_wgmma_and_smem(
                LayoutEnum.from_tensor(mA), LayoutEnum.from_tensor(mB), self.tile_n
            )
            tma_atom_a, tma_a, tma_atom_b, tma_b = None, None, None, None
            if load_a:
                tma_atom_a, tma_a = self.make_tma_load(mA, a_smem_staged, self.tile_m)
            if load_b:
                tma_atom_b, tma_b = self.make_tma_load(mB, b_smem_staged, self.tile_n)
            return tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a, tma_a, tma_atom_b, tma_b

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (M, S) bf16
            mB: cute.Tensor,  # (N, S) bf16 (B transposed view)
            mOffsets: cute.Tensor,  # (E,) int32
            mOut: cute.Tensor,  # (E, M, N) dense or (E,) int64 pointers
            mCounter: cute.Tensor,  # (1,) int32, zero at launch: the dynamic tile counter
            mIdxA: cute.Tensor,  # gather_a: (S,) int64 / int32 token -> A column; else None
            mIdxB: cute.Tensor,  # gather_b: (S,) token -> B row; else None
            num_ctas: cutlass.Int32,
            stream,
        ):
            # gather_a: mA is the (M, T) M-major source; gather_b: mB the (N, T) N-major view
            # of the (T, N) source; both are read by cp.async, not TMA
            tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a, tma_a, tma_atom_b, tma_b = (
                self.make_mma_and_ab_loads(mA, mB, not self.gather_a, not self.gather_b)
            )
            mGA, mGB = None, None  # the gathered sources (None: loaded by TMA)
            if cutlass.const_expr(self.gather_a):
                mGA = mA
            if cutlass.const_expr(self.gather_b):
                mGB = mB
            epi_smem_staged = a_smem_staged  # placeholder when the epilogue stores from registers
            epi_cosize = 64
            if cutlass.const_expr(self.tma_epi):
                epi_smem_staged = self.epi_smem_layout()
                epi_cosize = cute.cosize(epi_smem_staged)

            tma_atom_c, tma_c = tma_atom_a, tma_a  # placeholders for the discrete mode
            tma_atom_cl, tma_cl = tma_atom_a, tma_a  # old-output L2 prefetches (l2prefetch)
            if cutlass.const_expr(self.tma_epi):
                if cutlass.const_expr(self.l2_prefetch_c):
                    tma_atom_cl, tma_cl = self.epi_tma_atom(
                        cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mOut, epi_smem_staged
                    )
                tma_atom_c, tma_c = self.epi_tma_atom(
                    self.epi_store_op(), mOut, epi_smem_staged
                )

            self.shared_storage = self.make_storage(
                cute.cosize(a_smem_staged), cute.cosize(b_smem_staged), epi_cosize
            )
            kernel = self.kernel(
                tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, tma_atom_cl, tma_cl,
                mOffsets, mOut, mCounter, num_ctas, tiled_mma, a_smem_staged, b_smem_staged,
                epi_smem_staged, mGA, mGB, mIdxA, mIdxB,
            )
            self.launch_persistent(kernel, num_ctas, stream)

        @cute.kernel
        def kernel(
            self,
            tma_atom_a: cute.CopyAtom,
            tma_a: cute.Tensor,
            tma_atom_b: cute.CopyAtom,
            tma_b: cute.Tensor,
            tma_atom_c: cute.CopyAtom,
            tma_c: cute.Tensor,
            tma_atom_cl: cute.CopyAtom,
            tma_cl: cute.Tensor,
            mOffsets: cute.Tensor,
            mOut: cute.Tensor,
            mCounter: cute.Tensor,
            num_ctas: cutlass.Int32,  # (unused by the kernel: the grid size)
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            epi_smem_staged: cute.ComposedLayout,
            mGA: cute.Tensor,  # gather_a: (M, T) source; else None
            mGB: cute.Tensor,  # gather_b: (N, T) source view; else None
            mIdxA: cute.Tensor,
            mIdxB: cute.Tensor,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)

            if warp_idx == 0:
                if cutlass.const_expr(not self.gather_a):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
                if cutlass.const_expr(not self.gather_b):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
                if cutlass.const_expr(self.tma_epi):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)

            storage, ab_pipe, sched_pipe, sSched = self.setup_pipelines(
                a_smem_staged, b_smem_staged, 0, self.gather_a, self.gather_b
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)

            sPerm, _ = self.sort_experts(mOffsets, storage, tidx)

            tk = self.tile_k
            gC_all = None
            sC = None  # (discrete outputs: no epilogue buffers)
            if cutlass.const_expr(self.tma_epi):
                sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
                gC_all = cute.local_tile(tma_c, (self.tile_m, self.tile_n), (None, None, None))

            if wg_idx == 0:
                # ---------------- producer warp group: TMA loads ----------------
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if cutlass.const_expr(self.gather):
                    # the whole warp group: TMA of the other operand and cp.async gathers
                    self.produce_gather(
                        tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_cl, tma_cl, sA, sB, sC,
                        mGA, mGB, mIdxA, mIdxB, sPerm, mOffsets, mCounter, ab_pipe, sched_pipe,
                        sSched, warp_idx, tidx,
                    )
                elif warp_idx == 0:
                    prod_state, sched_state = self.producer_states()
                    lane = cute.arch.lane_idx()
                    gCl_all = None
                    if cutlass.const_expr(self.l2_prefetch_c):
                        gCl_all = cute.local_tile(
                            tma_cl, (self.tile_m, self.tile_n), (None, None, None)
                        )
                    tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                    sched_state.advance()
                    while tile < self.num_tiles:
                        e, m_idx, n_idx = self.tile_coords(tile, sPerm)
                        k_base, _head, _k_len, n_k = self.k_range(mOffsets, e)
                        tAsA, tAgA, tBsB, tBgB = self.ab_load_partitions(
                            tma_atom_a, tma_a, tma_atom_b, tma_b, sA, sB, k_base, m_idx, n_idx
                        )
                        if cutlass.const_expr(self.l2_prefetch_c):
                            if n_k > 0:
                                self.prefetch_old_tile(tma_atom_cl, sC, gCl_all, m_idx, n_idx, e)
                        for kt in cutlass.range(n_k, unroll=1):
                            ab_pipe.producer_acquire(prod_state)
                            bar = ab_pipe.producer_get_barrier(prod_state)
                            cute.copy(
                                tma_atom_a,
                                tAgA[(None, kt)],
                                tAsA[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                            cute.copy(
                                tma_atom_b,
                                tBgB[(None, kt)],
                                tBsB[(None, prod_state.index)],
                                tma_bar_ptr=bar,
                            )
                            ab_pipe.producer_commit(prod_state)
                            prod_state.advance()
                        tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                        sched_state.advance()
                    ab_pipe.producer_tail(prod_state)
            else:
                # ---------------- consumer warp groups: wgmma + epilogue ----------------
                cute.arch.setmaxregister_increase(self.consumer_regs)
                group = (wg_idx - 1) // self.wgs_per_group
                ctid = tidx - 128 - group * self.group_threads  # thread index in its group
                mask_barrier = pipeline.NamedBarrier(
                    barrier_id=1 + group, num_threads=self.group_threads
                )
                thr_mma_epi = tiled_mma.get_slice(ctid)
                tCrA, tCrB, num_k_blocks = self.mma_fragments(
                    tiled_mma, sA, sB, ((wg_idx - 1) % self.wgs_per_group) * 128
                )

                # Accumulator fragment shaped like this thread's share of one output tile.
                ref_tile = cute.make_identity_tensor((self.tile_m, self.tile_n))
                acc_shape = thr_mma_epi.partition_C(ref_tile).shape
                acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                r_out = cute.make_rmem_tensor(acc_shape, self.out_dtype)
                if cutlass.const_expr(self.tma_epi):
                    epi = self.epi_setup(tiled_mma, sC, ctid)
                    tRS_acc = epi.tiled_r2s.retile(acc)
                    store_pipe = epi.store_pipe
                    store_warp = 4 + group * 4 * self.wgs_per_group
                    epi_count = cutlass.Int32(0)

                read_state, release_state, sched_cstate = self.consumer_states()
                tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                sched_cstate.advance()
                j = cutlass.Int32(0)  # local tile counter of this CTA
                while tile < self.num_tiles:
                    e, m_idx, n_idx = self.tile_coords(tile, sPerm)
                    _k_base, head, k_len, n_k = self.k_range(mOffsets, e)

                    next_tile = cutlass.Int32(0)
                    if self.owns_tile(j, group):
                        # pingpong turns: named barriers 3 and 4 (1 and 2 mask the groups)
                        self.wait_turn(j, group, 3)
                        acc.fill(0.0)
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                        for kt in cutlass.range(n_k, unroll=1):
                            ab_pipe.consumer_wait(read_state)
                            if cutlass.const_expr(self.gather):
                                # cp.async (generic proxy) wrote the gathered stage: make it
                                # visible to wgmma (async proxy)
                                cute.arch.fence_proxy("async.shared", space="cta")
                            stage = read_state.index
                            lo = cutlass.Int32(0)  # rows [0, lo) belong to the previous expert
                            if kt == 0:
                                lo = head
                            hi = k_len - kt * tk  # rows [hi, tk) belong to the next expert
                            if hi > tk:
                                hi = cutlass.Int32(tk)
                            if cutlass.const_expr(not (self.gather_a and self.gather_b)):  # noqa: SIM102
                                if lo > 0 or hi < tk:
                                    # Zero the rows outside the expert in the operands loaded
                                    # by TMA (a gathered operand's cp.async zero-filled them).
                                    if cutlass.const_expr(not self.gather_a):
                                        self.zero_rows(
                                            sA, self.tile_m, self.key.a_major == "m", lo, hi,
                                            stage, ctid,
                                        )
                                    if cutlass.const_expr(not self.gather_b):
                                        self.zero_rows(
                                            sB, self.tile_n, self.key.b_major == "n", lo, hi,
                                            stage, ctid,
                                        )
                                    cute.arch.fence_proxy("async.shared", space="cta")
                                    mask_barrier.arrive_and_wait()
                            for kb in cutlass.range_constexpr(num_k_blocks):
                                cute.gemm(
                                    tiled_mma,
                                    acc,
                                    tCrA[(None, None, kb, stage)],
                                    tCrB[(None, None, kb, stage)],
                                    acc,
                                )
                            cute.nvgpu.warpgroup.commit_group()
                            cute.nvgpu.warpgroup.wait_group(1)
                            if kt > 0:
                                ab_pipe.consumer_release(release_state)
                                release_state.advance()
                            read_state.advance()
                        next_tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                        sched_cstate.advance()
                        self.pass_turn(group, next_tile < self.num_tiles, 3)
                        cute.nvgpu.warpgroup.wait_group(0)
                        fence_accumulators(acc)
                        if n_k > 0:
                            ab_pipe.consumer_release(release_state)
                            release_state.advance()

                        # ---------------- epilogue ----------------
                        if cutlass.const_expr(self.tma_epi):
                            # registers -> smem sub-tile (stmatrix) -> TMA store / reduce-add
                            skip = cutlass.Boolean(False)
                            if cutlass.const_expr(self.key.accumulate):
                                skip = n_k == 0  # empty expert: output untouched
                            if not skip:
                                epi_count = self.epi_store_tile(
                                    epi, tRS_acc, tma_atom_c, sC, gC_all, e, m_idx, n_idx, group,
                                    epi_count, warp_idx, store_warp, mask_barrier,
                                )
                        else:
                            # registers -> global (discrete outputs: a pointer per expert)
                            out_ptr = cute.make_ptr(
                                self.out_dtype,
                                mOut[e],
                                cute.AddressSpace.gmem,
                                assumed_align=16,
                            )
                            self.store_regs_autovec(
                                acc, r_out, out_ptr, thr_mma_epi, m_idx, n_idx, n_k
                            )
                    else:
                        # another consumer group's tile: step over its pipeline stages
                        for _kt in cutlass.range(n_k, unroll=1):
                            read_state.advance()
                            release_state.advance()
                        next_tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                        sched_cstate.advance()
                    j += 1
                    tile = next_tile
                if cutlass.const_expr(self.tma_epi):  # noqa: SIM102
                    if warp_idx == store_warp:
                        store_pipe.producer_tail()  # all TMA stores done before exit

    return Sm90GroupedWgradKernel


#: The kernel class, built once on first use (CuTe DSL is imported then): ``kernel_class()(key)``.
kernel_class = functools.cache(_build_kernel_class)


def sm90_key_from_contract(contract: Any) -> Sm90WgradKey:
    """The :class:`Sm90WgradKey` of an ``api.WgradContract`` (tile from its ``mma_tiler_mn``,
    else from ``configs/cuda/sm90_tiles.yaml``).

    Raises:
        ValueError: no tile fits hidden / intermediate (multiples of 64 at least; discrete
            outputs need whole tiles).
    """
    return key_of_contract(
        Sm90WgradKey, select_sm90_tile_config, contract,
        output_mode=contract.output_mode, accumulate=contract.accumulate,
    )


def fake_operands(key: Sm90WgradKey) -> tuple:
    """Fake (shape-only) operands of a compile: ``a, b_NS, offsets, out, tile_counter, a_rows,
    b_rows``. Without gather, ``launch.fake_wgrad_operands`` (a symbolic ``tokens_sum``) and
    None for both indexes (compile-time constants: no kernel parameter, the code of a key
    without gather fields). A gathered operand is its ``(hidden | intermediate, T)`` MN-major
    source with a symbolic row count ``T`` and token stride, its index ``(S,)``."""
    import cutlass
    from cutlass import cute

    counter = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
    if not key.gather:
        return (*fake_wgrad_operands(key), counter, None, None)
    m, n = key.hidden, key.intermediate
    any_k_major = key.a_major == "k" or key.b_major == "k"
    s = cute.sym_int32(divisibility=8 if any_k_major else 1, symbol="tokens_sum")

    def operand(rows, gathered, k_major, name):
        if gathered:  # (rows, T) with stride (1, ld): the MN-major source
            t = cute.sym_int32(symbol=f"src_rows_{name}")
            ld = cute.sym_int64(divisibility=8, symbol=f"ld_{name}")
            return cute.runtime.make_fake_tensor(
                cutlass.BFloat16, (rows, t), (1, ld), assumed_align=16
            )
        return cute.runtime.make_fake_compact_tensor(
            cutlass.BFloat16, (rows, s), stride_order=(1, 0) if k_major else (0, 1),
            assumed_align=16,
        )

    idx_t, align = {"int64": (cutlass.Int64, 8), "int32": (cutlass.Int32, 4)}[key.index_dtype]

    def index(gathered):
        if not gathered:
            return None
        return cute.runtime.make_fake_tensor(idx_t, (s,), (1,), assumed_align=align)

    a = operand(m, key.gather_a, key.a_major == "k", "a")
    b = operand(n, key.gather_b, key.b_major == "k", "b")
    return (a, b, *fake_offsets_and_out(key), counter, index(key.gather_a),
            index(key.gather_b))


class _Sm90Family(KernelFamily):
    """``launch.KernelFamily`` with the SM90 launch call: the tile counter, then the two
    indexes (None without gather: :func:`fake_operands`); the cache, compile, offline PTX and
    grid are the shared layer's."""

    def _launch(  # noqa: PLR0913
        self, key, fn, a, b, offsets, out, stream=None, descriptor_workspace=None,
        a_rows=None, b_rows=None,
    ) -> None:
        """One launch on the launch stream (see ``KernelFamily._launch``): ``a_rows`` /
        ``b_rows`` ([S] int64 / int32, the key's ``index_dtype``) with a gathered key, then
        ``a`` / ``b`` are the ``[H, T]`` M-major / ``[T, I]`` row-major sources.

        Raises:
            ValueError: a gathered key without its index, or an index without gather.
        """
        for name, gathered, rows in (("a_rows", key.gather_a, a_rows),
                                     ("b_rows", key.gather_b, b_rows)):
            if gathered != (rows is not None):
                raise ValueError(
                    f"{name}: {'required' if gathered else 'must be None'} for a key with "
                    f"gather_{name[0]}={gathered}"
                )

        def with_rows(a, b_t, offsets, out, counter, grid, *tail):
            fn(a, b_t, offsets, out, counter, a_rows, b_rows, grid, *tail)

        # the shared launch (stream, ragged repack, counter, grid), the indexes inserted
        super()._launch(key, with_rows, a, b, offsets, out, stream, descriptor_workspace)


#: The SM90 family in the shared compile-cache / launch layer: a dynamic persistent scheduler
#: (a zeroed tile counter per launch), compiled for the present GPU (the path verified on the
#: H200, 2026-12-01; only offline compiles pin an arch).
FAMILY = _Sm90Family(
    "sm90", lambda key: kernel_class()(key), sm90_key_from_contract, tile_counter=True,
    fake_operands=fake_operands,
)


__getattr__ = FAMILY.module_getattr(__name__)  # COMPILE_COUNT: the family's count


def compile_sm90_wgrad(key: Sm90WgradKey) -> Callable[..., None]:
    """Compile (once per key, cached) the SM90 grouped wgrad kernel and return its launcher.

    ``launcher(a, b, offsets, out, stream=None, a_rows=None, b_rows=None)`` runs on
    already-validated torch CUDA tensors:

    - ``a``: ``(hidden, tokens_sum)`` bf16, K-major (stride ``(S, 1)``) or M-major (``(1, M)``);
      ``tokens_sum`` a multiple of 8 when any operand is K-major (TMA 16-byte strides);
    - ``b``: ``(tokens_sum, intermediate)`` bf16, K-major (``(1, S)``) or N-major (``(N, 1)``);
    - ``offsets``: ``(E,)`` int32 cumulative expert ends on the device (never read on the host);
    - ``out``: dense ``(E, M, N)`` contiguous tensor of ``key.out_dtype``, or for
      ``output_mode="discrete"`` an ``(E,)`` int64 tensor of 16-byte aligned ``(M, N)`` row-major
      output addresses;
    - ``stream``: a ``torch.cuda.Stream`` (default: the current stream; capturable in a CUDA graph);
    - ``a_rows`` / ``b_rows`` (keys with ``gather_a`` / ``gather_b``, required there and None
      otherwise): ``(tokens_sum,)`` contiguous index of ``key.index_dtype``; then ``a`` is the
      ``(hidden, T)`` M-major source (strides ``(1, ld)``, ``ld`` a multiple of 8) whose column
      ``a_rows[s]`` is A's column ``s``, ``b`` the ``(T, intermediate)`` row-major source
      (strides ``(ld, 1)``) whose row ``b_rows[s]`` is B's row ``s``; a negative index reads
      zeros; only the rows of ``[0, offsets[-1])`` read their index (never on the host).

    ``input_order="tensor_ragged"``: an operand whose unit-stride axis is M / N has the same memory
    as tensor2d; a K-major ragged operand (per-expert ``(rows, K_e)`` blocks) is first repacked on
    the device by torch ops into the tensor2d layout (``launch.ragged_to_2d``: no host read,
    CUDA-graph capturable, but an extra pass over that operand and a ``rows x tokens_sum`` int64
    index: a correctness path, not a fast one).

    Each call allocates a 4-byte zeroed tile counter on the launch stream (the dynamic
    scheduler's), so concurrent launches on different streams do not share it.

    Raises:
        RuntimeError: CuTe DSL (nvidia-cutlass-dsl) is not installed or the compile fails.
    """
    return FAMILY.launcher(key)


#: ``compile_sm90_wgrad_offline(key, arch="sm_90a")``: the PTX of ``key`` for
#: ``arch``, compiled without a GPU (CI): ``FAMILY.offline_ptx``.
compile_sm90_wgrad_offline = FAMILY.offline_compiler("sm_90a")
