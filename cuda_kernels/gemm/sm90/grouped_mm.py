"""Hopper (SM90) varlen-M grouped GEMM in CuTe DSL: ``out[r] = A[idx[r]] @ W[e]`` for the rows r
of expert e, A's rows gathered through an index.

Rows are in the grouped layout (REFERENCE §1.2, ``common.routing.GroupedLayout``): expert e owns
rows ``[offsets[e-1], offsets[e])`` (0 for e = 0) of the ``S``-row output; rows from
``offsets[E-1]`` to ``S`` belong to no expert and are written as zeros. ``K`` (the contraction)
and ``N`` are static; ``S``, the gathered source's row count ``T`` and the split are dynamic (new
splits never recompile; the offsets are read on the device only: CUDA-graph capturable).

Structure (one CTA per SM, persistent, warp-specialized; the wgrad kernel
``gemm/sm90/wgrad_bf16.py`` is the model for the pipelines and the mainloop, and
``gemm/sm90/common.py`` holds what the two share: the tile's consumer structure, the
tiled wgmma with its staged shared-memory layouts, the TMA load atoms, the accumulator fence and
the persistent launch):

- prologue: warp 0 reads the offsets and writes, per expert, its first row, its row count and
  its first tile id (a warp prefix sum of ``ceil(rows / tile_m) * n_tiles``) into shared memory;
  every tile costs the same (K is fixed), so the tiles are dealt statically: CTA ``b`` takes
  tiles ``b, b + grid, b + 2 grid, ...`` (no tile counter, no memset before the launch). A tile id
  is mapped to (expert, M tile, N tile) by a binary search over the first tile ids; inside an
  expert M tiles run fastest (the consecutive tiles in flight share one column block of W[e]);
- warp group 0 produces the (A, W) stages of a ``stages``-deep shared-memory ring:
  * ``gather_a``: its 128 threads copy A's rows through the index with ``cp.async`` (16-byte
    chunks, 8 threads per 128-byte row of a 64-wide K tile, into the 128-byte-swizzled layout
    wgmma reads; Hopper's TMA cannot gather rows). A padding row (index < 0), a row past the
    expert's end and a K chunk past K are zero-filled by the copy itself (source size 0: nothing
    is read). Each thread's copies arrive on the stage's full barrier when they land
    (``cp.async.mbarrier.arrive.noinc``), W's TMA box adds its bytes to the same barrier;
  * ``write_a_rows`` (with ``gather_a``; the API's ``a_rows_out``): the kernel also writes the
    gathered rows into an ``[S, K]`` BF16 side output, so the layer needs no separate gather
    pass for the weight gradients. The N tiles of one M tile load the same rows, so the copy-out
    is spread over them: N tile ``n`` writes K tiles ``t = n, n + n_tiles, ...`` (one tile
    writing all of them ran behind the others on long K: ``benchmarks/RESULTS.md``). Every
    producer thread commits its cp.async chunks of a K tile as one group; ``stages - 1`` K tiles
    later (``cp.async.wait_group stages - 1``: the copies have landed and are visible to the
    thread that issued them; the stage is the one this thread refills next) it loads the same
    16-byte chunks of a K tile it writes back from the stage (the same ``tAsA`` addresses) and
    stores them to the side output's rows ``row0 + r`` for ``r < rows`` (never a row of the next
    expert's tiles); after a tile's last K tile it waits for its copies and writes its share of
    the last ``stages - 1`` K tiles too. A padding row is what cp.async zero-filled:
    +0. The rows past the last expert (tiles that load no stage) are gathered global to global
    by their ``n_idx == 0`` tile's producer threads (16-byte loads and stores, +0 for a
    negative index), so every row of the side output is written exactly once, whatever the
    offsets. The barriers, their arrival counts and the fences are those of the plain kernel
    (the copy-out only reads the ring): chosen over loading the rows into registers and
    storing them to shared memory by hand, which would need plain arrivals, a writer-side
    proxy fence and synchronous loads (one stage in flight) on those tiles, and registers the
    producer does not have (64 registers with the side output, 56 without). The cost is the
    copy-out itself and the wait for the last stages at the end of a tile that writes one of
    them (a lag of one K tile, measured first, kept only one group of copies in flight and cost
    more than the gather pass it replaced);
  * otherwise (A already in row order, ``[S, K]``) one warp loads A's ``(tile_m, 64)`` boxes by
    TMA starting at the tile's first row (rows past the expert are loaded but never stored, rows
    past S are zero-filled by TMA);
  * W[e] always by TMA (``(tile_n, 64)`` boxes of the ``(N, K, E)`` view, N- or K-major; boxes
    past N or K are zero-filled).
- consumer warp groups issue wgmma with fp32 accumulators. Cooperative tiles: two warp groups
  share a 128-row tile (a 64-row slab each); pingpong: two warp groups own alternate tiles and
  take turns on the pipeline, one's epilogue overlapping the other's mainloop. With ``gather_a``
  each consumer thread fences the async proxy after a stage's barrier completes (cp.async
  writes through the generic proxy, wgmma reads through the async proxy; a variant without the
  fence, measured on the H200, bought nothing: ``benchmarks/RESULTS.md``);
- epilogue ``"gated"`` (the forward gate/up GEMM, W = ``w_gate_up`` [E, H, 2I]): a tile covers
  gate columns ``[j, j + tile_n / 2)`` and the same up columns ``I + j ...``: two W boxes per
  stage, two wgmma accumulators of ``tile_n / 2`` columns. From the fp32 accumulators, per row
  s of pair p (``row_to_pair[s]``, -1 = padding) with affinity a: bias (fp32, per expert),
  clamp, ``h = g * sigmoid(alpha g) * (u + up_offset)``, then ``a_h[s] = a * h`` (0 for padding
  rows: a select) and the checkpoint ``act[p] = [g, u]`` (clamped, in the plan's pair order),
  each rounded once to BF16; checkpoint rows ``[num_pairs, R)`` are zeroed by the tile whose
  output row has that index (as ``cuda_kernels.triton.activation.activation_forward`` does).
  The numerics differ from GEMM-then-pass in one place: the pass reads the pre-activation after the GEMM
  rounded it to BF16, the fused epilogue uses the fp32 accumulator (one rounding less);
- epilogue ``"dgated"`` (the backward down-dgrad GEMM, A = dY gathered, W = ``w_down``
  transposed [E, H, I]): the accumulator is ``dh_raw``; per row s of pair p with affinity a and
  the checkpoint's stored g, u (two 4-byte loads per column pair, issued a chunk of column
  groups ahead of their use, the first chunk before the mainloop): the activation backward with
  the strict clamp masks, ``d_gate_up[s] = [dg, du]`` and ``a_h[s] = a * h`` in BF16 (0 for
  padding rows: selects), and the row's partial ``sum_j dh_raw * h`` over the tile's columns
  (each thread's columns, then the 4 threads that share a row by two butterfly shuffles: a
  fixed order) into an fp32 ``[S, n_tiles]`` buffer the host sums over N tiles (deterministic,
  no atomics). As for ``"gated"``, the difference from GEMM-then-pass is one rounding less
  (``dh_raw`` is not rounded to BF16);
- epilogue ``"store"``: the fp32 accumulator rounded once to BF16 (RNE) and stored from
  registers (4-byte stores) with row predicates (the tile's rows inside the expert and below S)
  and column predicates (below N, only when N is not a multiple of tile_n). A padding row's A
  row is zero-filled, so its output is exactly +0 for a finite W (no select: a NaN planted in
  the source would show if a padding row were read);
- the TMA-store epilogue (``Sm90GroupedMmTile.epi_tma``; the shipped tile rules set it): a tile
  whose rows all lie inside its expert (every tile but each expert's last, when partial) leaves
  through shared memory instead: per (tile rows, 32)-column sub-tile, the values rounded to
  BF16, ``stmatrix`` into one of two staging buffers per consumer group, a proxy fence and a
  group barrier, one warp's 2-D TMA store (``gemm/sm90/common.py``, shared with the wgrad
  kernel), so the stores drain while the next tile's mainloop runs; the partial tiles keep the
  register stores (a TMA box cannot stop at an expert's last row; the next expert's rows belong
  to another tile). For ``"store"``; for ``"gated"`` with the row-order checkpoint (bias and
  clamp applied in place, then g and u stored, then ``a * h`` computed in place and stored); for
  ``"dgated"`` with the row-order checkpoint and one 64-row wgmma slab a thread (per sub-tile,
  which is one checkpoint load chunk: dg in place, du and ``a * h`` in two fragment-shaped
  temporaries of which one sub-tile is live, three TMA stores; the row partials from registers).
  Not for a partial last N tile of the fused epilogues (a box would cross from g into u), nor
  for the pair-order checkpoint. Bit for bit the register epilogue's values (GPU tests).

Run on the H200 (``tests/test_grouped_mm_sm90.py``: the correctness grid against the torch twin
and graph replay; compute-sanitizer through ``benchmarks/grouped_mm_device_run.sh``; speed:
``benchmarks/bench_grouped_mm.py``, ``--tiles mainloop`` for the tile sweep). The tile comes
from ``configs/cuda/sm90_grouped_mm_tiles.yaml`` (:func:`select_grouped_mm_tile`: general rules
and per-shape ones, by epilogue; one measured rule for every shape so far).

Public names: :class:`Sm90GroupedMmTile`, :class:`GatedEpilogue`, :class:`Sm90GroupedMmKey`,
:func:`epilogue_tile_reason`, :func:`select_grouped_mm_tile` (:func:`load_grouped_mm_tile_rules`),
:func:`tile_schedule` (the schedule in Python), :func:`fake_operands`, :func:`compile_grouped_mm`
(cached; ``FAMILY.compile_count`` counts real compiles) and :func:`compile_grouped_mm_offline`
(PTX text for ``sm_90a`` without a GPU). CuTe DSL is imported only inside the compile functions.
"""


import dataclasses
import functools
import math
from typing import Any

from ..launch import KernelFamily, num_sms
from ..tiles import SM90_TILES
from .common import Sm90Tiling, kernel_base
from .grouped_mm_epilogues import epilogue_mixins

__all__ = [
    "EPILOGUES",
    "FAMILY",
    "GatedEpilogue",
    "Sm90GroupedMmKey",
    "Sm90GroupedMmTile",
    "compile_grouped_mm",
    "compile_grouped_mm_offline",
    "epilogue_tile_reason",
    "fake_operands",
    "load_grouped_mm_tile_rules",
    "select_grouped_mm_tile",
    "tile_schedule",
]

EPILOGUES = ("store", "gated", "dgated")
"""Epilogues of the kernel: ``"store"`` (BF16 ``out[S, N]``), ``"gated"`` (the forward gate/up
epilogue: BF16 ``a_h[S, I]`` and checkpoint ``act[R, 2, I]``, N = 2I) and ``"dgated"`` (the
backward down-dgrad epilogue: BF16 ``d_gate_up[S, 2I]`` and ``a_h[S, I]`` and fp32 partial row
sums of ``dh_raw * h`` per N tile, N = I)."""

_SMEM_BYTES = SM90_TILES.smem_bytes  # usable dynamic shared memory per CTA on H100/H200

_INDEX_DTYPES = ("int64", "int32")


@dataclasses.dataclass(frozen=True)
class Sm90GroupedMmTile(Sm90Tiling):
    """One CTA tile of the SM90 varlen-M grouped GEMM: the fields of the wgrad kernel's tiles
    (``gemm.sm90.common.Sm90Tiling``: ``tile_m``, ``tile_n``, ``tile_k`` = K per stage,
    ``stages`` of the (A, W) ring, lowered to what fits, and ``pingpong``), its name
    (``variant_name``), stage bytes and consumer structure, and how the epilogue stores:

    Attributes:
        epi_tma: the TMA-store epilogue (measured faster on every GEMM timed and in the
            layer: ``benchmarks/RESULTS.md``, 2026-12-06; the field defaults to False, the
            register stores, and both rules of ``configs/cuda/sm90_grouped_mm_tiles.yaml`` set
            it). A tile whose rows all lie inside its expert stores through shared memory: each
            output (the ``"store"`` epilogue's; the ``"gated"`` one's ``a_h`` and row-order
            checkpoint; the ``"dgated"`` one's ``d_gate_up`` and ``a_h``) is rounded to BF16,
            written to a (rows, 32) sub-tile by ``stmatrix`` and stored by TMA, two sub-tile
            buffers per consumer group in flight, so the stores drain under the next tile's
            mainloop. An expert's last (partial) tile keeps the register stores (a TMA box
            cannot stop at the expert's last row). The fused epilogues take it with the
            row-order checkpoint only and not on a partial last N tile (``"dgated"``: also one
            64-row wgmma slab per thread, i.e. cooperative or 64-row tiles); elsewhere the flag
            has no effect (the module docstring).

    Raises:
        ValueError: a field outside the ranges of ``Sm90Tiling``, stages that overflow shared
            memory, or a ``pingpong`` / ``epi_tma`` that is not a bool.
    """

    epi_tma: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()  # the tile fields (gemm.tiles.SM90_TILES)
        for name in ("pingpong", "epi_tma"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{type(self).__name__}.{name} must be a bool, got {getattr(self, name)!r}"
                )

    @property
    def variant_name(self) -> str:
        """``Sm90Tiling``'s name, ``-tma`` appended for the TMA-store epilogue."""
        return super().variant_name + ("-tma" if self.epi_tma else "")


#: Most fp32 accumulators per consumer thread of a pingpong tile with the gathered-rows side
#: output: its producers take 64 registers, leaving the consumers 216 (128 x 192 spilled
#: 1956 bytes under ptxas 13.0; 128 x 176 none).
_ROWS_PINGPONG_MAX_ACC = 176


def epilogue_tile_reason(
    epilogue: str, tile: Sm90GroupedMmTile, write_a_rows: bool = False
) -> str | None:
    """Why ``epilogue`` (one of :data:`EPILOGUES`), with the gathered-rows side output when
    ``write_a_rows``, cannot run with ``tile``, or None: the ``"gated"`` epilogue needs tile_n
    128 or 256 (two accumulators of 64 or 128 columns); the side output leaves a pingpong
    tile's consumers room for at most 176 accumulators a thread (tile_n <= 176 with tile_m
    128)."""
    acc = tile.tile_m * tile.tile_n // (128 * tile.wgs_per_group)
    if write_a_rows and tile.pingpong and acc > _ROWS_PINGPONG_MAX_ACC:
        return (f"the gathered-rows side output (write_a_rows) leaves a pingpong consumer 216 "
                f"registers: at most {_ROWS_PINGPONG_MAX_ACC} fp32 accumulators a thread, the "
                f"tile {tile.variant_name} has {acc}")
    if epilogue == "gated" and tile.tile_n not in (128, 256):
        return (f"the gated epilogue needs tile_n 128 or 256 (two accumulators of 64 or 128 "
                f"columns), got {tile.tile_n}")
    return None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class GatedEpilogue:
    """The static part of the ``"gated"`` epilogue (compile-time constants of the kernel).

    Attributes:
        alpha, up_offset: the activation ``h = g * sigmoid(alpha * g) * (u + up_offset)``
            (``common.problem.Activation``: SwiGLU 1, 0; gpt-oss 1.702, 1).
        gate_lo, gate_hi, up_lo, up_hi: clamp limits of g and u (None: no limit;
            ``common.problem.ClampLimits``' ``non_linear_*`` and ``linear_*``).
        has_bias: a per-expert fp32 bias ``[E, 2I]`` is added before the clamp.
        checkpoint_rows: the checkpoint ``act`` is ``[S, 2I]`` in grouped row order (row s holds
            its own ``[g, u]``; padding rows and rows past the last expert +0) instead of
            ``[R, 2, I]`` in the plan's pair order: the ``"gated"`` epilogue writes it so and
            the ``"dgated"`` one reads it so (the layer's form without bias or clamp,
            ``cuda_kernels.moe.grouped_mm_choice.checkpoint_in_rows``).

    Raises:
        ValueError: a non-finite value, alpha <= 0, a lower limit not below its upper one, or
            a ``has_bias`` / ``checkpoint_rows`` that is not a bool.
    """

    alpha: float = 1.0
    up_offset: float = 0.0
    gate_lo: float | None = None
    gate_hi: float | None = None
    up_lo: float | None = None
    up_hi: float | None = None
    has_bias: bool = False
    checkpoint_rows: bool = False

    def __post_init__(self) -> None:
        cls = type(self).__name__
        if not _finite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"{cls}.alpha must be a finite number > 0, got {self.alpha!r}")
        if not _finite(self.up_offset):
            raise ValueError(f"{cls}.up_offset must be a finite number, got {self.up_offset!r}")
        for side in ("gate", "up"):
            lo, hi = getattr(self, f"{side}_lo"), getattr(self, f"{side}_hi")
            for name, v in ((f"{side}_lo", lo), (f"{side}_hi", hi)):
                if v is not None and not _finite(v):
                    raise ValueError(f"{cls}.{name} must be a finite number or None, got {v!r}")
            if lo is not None and hi is not None and not lo < hi:
                raise ValueError(f"{cls}: {side}_lo ({lo}) must be < {side}_hi ({hi})")
        for name in ("has_bias", "checkpoint_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{cls}.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, activation, clamp_limits, has_bias: bool,
           checkpoint_rows: bool = False) -> "GatedEpilogue":
        """From a ``common.problem.Activation`` and ``ClampLimits`` (None: none)."""
        cl = clamp_limits
        return cls(
            alpha=float(activation.alpha),
            up_offset=float(activation.up_offset),
            gate_lo=None if cl is None else cl.non_linear_clamp_lower_limit,
            gate_hi=None if cl is None else cl.non_linear_clamp_upper_limit,
            up_lo=None if cl is None else cl.linear_clamp_lower_limit,
            up_hi=None if cl is None else cl.linear_clamp_upper_limit,
            has_bias=bool(has_bias),
            checkpoint_rows=bool(checkpoint_rows),
        )


@dataclasses.dataclass(frozen=True)
class Sm90GroupedMmKey:
    """Static contract of one compiled kernel (the compile-cache key).

    The row counts (``S``, and ``T`` of a gathered A), A's row stride and the offsets values are
    dynamic and not part of it.

    Attributes:
        n: N, output columns (W[e] is K x N).
        k: K, the contraction (A's columns, W[e]'s rows).
        num_experts: E.
        gather_a: A's rows are read through an index (``[S]`` int64/int32, -1 = padding row)
            from a ``[T, K]`` source; False: A is ``[S, K]`` already in row order.
        index_dtype: ``"int64"`` or ``"int32"`` (the index; ignored without ``gather_a``).
        w_major: ``"n"`` (W ``[E, K, N]`` contiguous, N fastest: the layer's weights) or ``"k"``
            (W's memory is ``[E, N, K]`` contiguous: K fastest).
        epilogue: one of :data:`EPILOGUES`.
        tile: the :class:`Sm90GroupedMmTile`.
        gated: the :class:`GatedEpilogue` (required by, and only with, ``epilogue="gated"`` or
            ``"dgated"``). ``"gated"``: N = 2I with I a multiple of 8, and tile_n 128 or 256 (two
            accumulators of tile_n / 2 columns). ``"dgated"``: N = I, no bias (the affinity
            gradient's bias term is the caller's), the clamp limits give the strict masks.
        write_a_rows: (only with ``gather_a``) the kernel also writes the gathered rows into an
            ``[S, K]`` BF16 side output (every row: ``A[idx[s]]``, +0 for ``idx[s] < 0``; the
            ``a_rows_out`` of :mod:`~cuda_kernels.grouped_mm.api`), for any epilogue.

    Raises:
        ValueError: a field outside its values; N or K not a multiple of 8 (16-byte rows); a
            tile whose accumulators exceed 192 fp32 registers per consumer thread.
    """

    n: int
    k: int
    num_experts: int
    gather_a: bool = True
    index_dtype: str = "int64"
    w_major: str = "n"
    epilogue: str = "store"
    tile: Sm90GroupedMmTile = Sm90GroupedMmTile()
    gated: GatedEpilogue | None = None
    write_a_rows: bool = False

    def __post_init__(self) -> None:
        cls = type(self).__name__
        for name in ("n", "k", "num_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{cls}.{name} must be a positive int, got {value!r}")
        for name in ("n", "k"):
            if getattr(self, name) % 8:
                raise ValueError(
                    f"{cls}.{name} must be a multiple of 8 (16-byte BF16 rows for TMA and "
                    f"cp.async), got {getattr(self, name)}"
                )
        if not isinstance(self.gather_a, bool):
            raise ValueError(f"{cls}.gather_a must be a bool, got {self.gather_a!r}")
        if not isinstance(self.write_a_rows, bool):
            raise ValueError(f"{cls}.write_a_rows must be a bool, got {self.write_a_rows!r}")
        if self.write_a_rows and not self.gather_a:
            raise ValueError(
                f"{cls}.write_a_rows needs gather_a (without it A is already the rows)"
            )
        if self.index_dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{cls}.index_dtype must be one of {_INDEX_DTYPES}, got {self.index_dtype!r}"
            )
        if self.w_major not in ("n", "k"):
            raise ValueError(f"{cls}.w_major must be 'n' or 'k', got {self.w_major!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"{cls}.epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if not isinstance(self.tile, Sm90GroupedMmTile):
            msg = f"{cls}.tile must be a Sm90GroupedMmTile, got {self.tile!r}"
            raise ValueError(msg)
        t = self.tile
        acc_regs = t.tile_m * t.tile_n // (128 * t.wgs_per_group)
        if acc_regs > 192:
            raise ValueError(
                f"{cls}: tile {t.variant_name} holds {acc_regs} fp32 accumulators per consumer "
                "thread (at most 192: pingpong tiles own 128 rows per warp group)"
            )
        if (self.epilogue in ("gated", "dgated")) != (self.gated is not None):
            raise ValueError(
                f"{cls}.gated must be a GatedEpilogue exactly when epilogue is 'gated' or "
                "'dgated'"
            )
        if self.gated is not None and not isinstance(self.gated, GatedEpilogue):
            raise ValueError(f"{cls}.gated must be a GatedEpilogue, got {self.gated!r}")
        if self.epilogue == "dgated" and self.gated.has_bias:
            raise ValueError(f"{cls}: the dgated epilogue takes no bias (has_bias must be False)")
        if self.epilogue == "gated" and self.n % 16:
            raise ValueError(
                f"{cls}: the gated epilogue needs N = 2I with I a multiple of 8, got N={self.n}"
            )
        why = epilogue_tile_reason(self.epilogue, t, self.write_a_rows)
        if why is not None:
            raise ValueError(f"{cls}: {why}")

    @property
    def out_cols(self) -> int:
        """Columns of the main output: N (``"store"``, ``"dgated"``) or I = N / 2 (``"gated"``:
        ``a_h``)."""
        return self.n // 2 if self.epilogue == "gated" else self.n

    @property
    def n_tiles(self) -> int:
        """Output tiles along N: ``ceil(N / tile_n)``."""
        return -(-self.n // self.tile.tile_n)

    @property
    def k_tiles(self) -> int:
        """Pipeline stages per output tile: ``ceil(K / tile_k)``."""
        return -(-self.k // self.tile.tile_k)

    def max_tiles(self, rows: int) -> int:
        """An upper bound of the tiles of a launch over ``rows`` output rows, whatever the
        split: ``(ceil(rows / tile_m) + E) * n_tiles`` (each expert's last M tile may be
        partial; the rows past the last expert count as one more group)."""
        return (-(-rows // self.tile.tile_m) + self.num_experts) * self.n_tiles


#: Conditions of a rule of ``configs/cuda/sm90_grouped_mm_tiles.yaml``: lower bounds, exact
#: sizes (one GEMM of one model) and the epilogues the rule is for.
_TILE_BOUNDS = ("min_n", "min_k", "min_experts")
_TILE_EXACT = ("n", "k", "experts")
_TILE_CONDITIONS = (*_TILE_BOUNDS, *_TILE_EXACT, "epilogue")


def _rule_epilogues(name: str, cond: dict, path) -> tuple[str, ...]:
    """The epilogues a rule's ``epilogue`` condition names (a name or a list), all of them
    when it has none."""
    value = cond.get("epilogue", list(EPILOGUES))
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [e for e in names if e not in EPILOGUES]
    if bad or not names:
        raise RuntimeError(
            f"cannot read SM90 grouped_mm tile configs from {path}: rule {name!r} has epilogue "
            f"{value!r} (want one of {EPILOGUES} or a list of them)"
        )
    return names


@functools.cache
def load_grouped_mm_tile_rules() -> tuple:
    """Rules of ``configs/cuda/sm90_grouped_mm_tiles.yaml`` as ``(name, conditions,
    Sm90GroupedMmTile)`` in file order, read once (``gemm.tiles.load_tile_rules``); a rule's
    ``epilogue`` condition is read as a tuple of names.

    Raises:
        RuntimeError: the file is missing or malformed (an unknown condition, a size condition
            that is not a positive int, an unknown epilogue, or a rule whose tile an epilogue
            it names cannot run: ``epilogue_tile_reason``).
    """
    from common.config_files import config_path

    from ..tiles import load_tile_rules

    path = config_path("cuda", "sm90_grouped_mm_tiles.yaml")
    rules = []
    for name, cond, tile in load_tile_rules(path, Sm90GroupedMmTile, "SM90 grouped_mm"):
        unknown = set(cond) - set(_TILE_CONDITIONS)
        if unknown:
            raise RuntimeError(
                f"cannot read SM90 grouped_mm tile configs from {path}: rule {name!r} has unknown "
                f"conditions {sorted(unknown)} (known: {_TILE_CONDITIONS})"
            )
        for c in (*_TILE_BOUNDS, *_TILE_EXACT):
            v = cond.get(c, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise RuntimeError(
                    f"cannot read SM90 grouped_mm tile configs from {path}: rule {name!r} has "
                    f"{c}: {v!r} (want a positive int)"
                )
        epilogues = _rule_epilogues(name, cond, path)
        if "epilogue" in cond:  # named epilogues must be able to run the tile
            for e in epilogues:
                why = epilogue_tile_reason(e, tile)
                if why is not None:
                    raise RuntimeError(
                        f"cannot read SM90 grouped_mm tile configs from {path}: rule {name!r}: "
                        f"{why}"
                    )
            cond = {**cond, "epilogue": epilogues}
        rules.append((name, cond, tile))
    return tuple(rules)


def _rule_holds(cond: dict, n: int, k: int, num_experts: int, epilogue: str) -> bool:
    """Whether a rule's conditions hold for an ``(N, K, E)`` problem with ``epilogue``."""
    have = {"n": n, "k": k, "experts": num_experts}
    if any(have[c[4:]] < v for c, v in cond.items() if c in _TILE_BOUNDS):
        return False
    if any(have[c] != v for c, v in cond.items() if c in _TILE_EXACT):
        return False
    return epilogue in cond.get("epilogue", EPILOGUES)


def select_grouped_mm_tile(
    n: int, k: int, num_experts: int, epilogue: str = "store", write_a_rows: bool = False
) -> Sm90GroupedMmTile:
    """The tile for an ``(N, K, E)`` problem with ``epilogue`` (and the gathered-rows side
    output when ``write_a_rows``): the first rule of ``configs/cuda/sm90_grouped_mm_tiles.yaml``
    whose conditions hold (lower bounds ``min_n``, ``min_k``, ``min_experts``; exact ``n``,
    ``k``, ``experts``; ``epilogue``: the epilogues the rule is for, all without it) and whose
    tile the call can run (:func:`epilogue_tile_reason`: a rule whose tile the fused epilogues
    or the side output cannot take is skipped for them). As shipped: 128 x 256 cooperative
    (4 stages) when N >= 256, else 128 x 128 (6 stages), both with the TMA-store epilogue, the
    measured best (the file's comment).

    Raises:
        ValueError: non-positive sizes or an unknown epilogue.
        RuntimeError: the file is malformed or no rule holds.
    """
    if n < 1 or k < 1 or num_experts < 1:
        raise ValueError(
            f"select_grouped_mm_tile: sizes must be positive, got n={n}, k={k}, "
            f"num_experts={num_experts}"
        )
    if epilogue not in EPILOGUES:
        raise ValueError(
            f"select_grouped_mm_tile: epilogue must be one of {EPILOGUES}, got {epilogue!r}"
        )
    for _name, cond, tile in load_grouped_mm_tile_rules():
        if _rule_holds(cond, n, k, num_experts, epilogue) and (
            epilogue_tile_reason(epilogue, tile, write_a_rows) is None
        ):
            return tile
    raise RuntimeError(
        f"configs/cuda/sm90_grouped_mm_tiles.yaml has no rule for n={n}, k={k}, "
        f"num_experts={num_experts}, epilogue={epilogue!r}, write_a_rows={write_a_rows}: end "
        "it with a rule without conditions whose tile every epilogue can run"
    )


def tile_schedule(offsets: list[int], num_rows: int, key: Sm90GroupedMmKey) -> list[tuple]:
    """The kernel's tile schedule written in Python (for tests and the benchmark's tile counts):
    ``[(group, n_idx, row0, rows)]`` in tile-id order, as the prologue's prefix sums and
    ``tile_coords`` compute them on the device (group E: the rows past the last expert). CTA
    ``b`` of a ``grid``-CTA launch takes ids ``b, b + grid, ...``."""
    tm, n_tiles = key.tile.tile_m, key.n_tiles
    out, begin = [], 0
    for g, raw in enumerate([*offsets, num_rows]):
        end = max(begin, min(max(int(raw), 0), num_rows))  # running max of the clamped ends
        count = end - begin
        m_tiles = -(-count // tm)
        for rem in range(m_tiles * n_tiles):
            n_idx, m_idx = divmod(rem, m_tiles)
            out.append((g, n_idx, begin + m_idx * tm, min(count - m_idx * tm, tm)))
        begin = end
    return out


# --------------------------------------------------------------------------------------------
# The kernel (CuTe DSL imported lazily)
# --------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    from cutlass import cute, memory, pipeline
    from cutlass.tensor_utils import LayoutEnum

    base = kernel_base()  # the SM90 kernels' share (gemm/sm90/common.py)
    fence_accumulators = base.fence_accumulators

    index_types = {"int64": cutlass.Int64, "int32": cutlass.Int32}

    class GroupedMmSm90(base):
        """The mainloop base: CTA-persistent, warp-specialized varlen-M grouped GEMM for one key
        (the tile fields, loads and launch of ``kernel_base()``): schedule, cp.async gather and
        TMA producers, wgmma consumers; the epilogues are mixins (``grouped_mm_epilogues.py``)."""

        def __init__(self, key: Sm90GroupedMmKey):
            self.init_tiling(key)
            t = key.tile
            self.num_e = key.num_experts
            self.n_tiles = key.n_tiles
            self.gated = key.epilogue == "gated"
            self.dgated = key.epilogue == "dgated"
            # gated: two accumulators (gate, up) of tile_n / 2 columns, one W box each
            self.n_acc = 2 if self.gated else 1
            self.mma_n = self.tile_n // self.n_acc
            self.out_cols = key.out_cols  # N, or I for the gated epilogue
            self.partial_n = self.out_cols % self.mma_n != 0  # the last N tile: column checks
            self.k_tiles = key.k_tiles
            self.gather = key.gather_a
            self.write_rows = key.write_a_rows  # (only with gather_a: the key checks)
            self.ab_dtype = cutlass.BFloat16
            self.acc_dtype = cutlass.Float32
            self.out_dtype = cutlass.BFloat16
            self.idx_dtype = index_types[key.index_dtype]
            # the schedule tables: first row, row count (E + 1 groups: the experts and the
            # rows past the last one) and first tile id (E + 2 entries: the last is the total)
            self.sched_chunks = -(-(self.num_e + 1) // 32)
            self.search_top = 1 << (self.num_e.bit_length() - 1)  # largest power of 2 <= E
            # the TMA-store epilogue (tile.epi_tma): where the key's epilogue can take it (the
            # fused ones: with the row-order checkpoint only and no partial last N tile, where a
            # TMA box would cross from g into u; dgated: one wgmma slab a thread, whose
            # checkpoint load chunks are the 32-column sub-tiles), (epi_tile) sub-tiles of BF16
            # staged in epi_stages buffers per consumer group; a pingpong group's fragment is
            # ordered by 64-row wgmma slab, so its sub-tiles are (64, 32) (as the wgrad kernel's)
            self.epi_tma = t.epi_tma and self.mma_n % 32 == 0 and (
                key.epilogue == "store"
                or (key.epilogue == "gated" and key.gated.checkpoint_rows
                    and not self.partial_n)
                or (key.epilogue == "dgated" and key.gated.checkpoint_rows
                    and not self.partial_n and t.tile_m == 64 * t.wgs_per_group)
            )
            self.epi_tile = (self.tile_m if self.wgs_per_group > 1 else 64, 32)
            self.epi_stages = 2
            epi_bytes = (
                self.epi_tile[0] * self.epi_tile[1] * 2 * self.epi_stages * self.num_groups
                if self.epi_tma else 0
            )
            header = 1024 + 12 * (self.num_e + 2) + 16 * t.stages
            self.stages = min(t.stages, (_SMEM_BYTES - header - epi_bytes) // t.stage_bytes)
            if self.stages < 2:
                raise ValueError(f"{t} leaves no room for 2 pipeline stages")
            # write_a_rows: a K tile is copied back out of its stage this many K tiles after its
            # cp.async was issued (just before the same thread refills that stage), so
            # stages - 1 groups of copies stay in flight, as without the side output
            self.rows_lag = self.stages - 1
            # cp.async producers keep 8 row offsets and predicates per thread: more registers
            # than a TMA-only producer warp needs (and the side output's copy-out more still);
            # the consumers take what the producers give up of the CTA's 168 per thread, in
            # setmaxnreg's steps of 8 (with the side output 8 x 128 registers stay unused)
            self.producer_regs = (64 if self.write_rows else 56) if self.gather else 40
            self.consumer_regs = (
                ((216 if self.write_rows else 224) if self.gather else 232)
                if self.num_consumer_wgs == 2 else 160
            )
            # gather: 8 threads per 128-byte row, the 128 producer threads cover 16 rows a pass
            self.rows_per_pass = 128 // (self.tile_k // 8)
            self.rows_per_thread = self.tile_m // self.rows_per_pass

        def make_storage(self, a_cosize: int, b_cosize: int, epi_cosize: int):
            """The kernel's shared-memory struct (built in a plain method, outside the code the
            DSL's preprocessor rewrites); ``sC``, the TMA-store epilogue's sub-tiles, only with
            ``epi_tma``."""
            mem, align = cute.struct.MemRange, cute.struct.Align
            ne = self.num_e
            fields = {
                "mbar": mem[cutlass.Int64, self.stages * 2],
                "tile_start": mem[cutlass.Int32, ne + 2],
                "row_begin": mem[cutlass.Int32, ne + 1],
                "row_count": mem[cutlass.Int32, ne + 1],
                "sA": align[mem[self.ab_dtype, a_cosize], 1024],
                "sB": align[mem[self.ab_dtype, b_cosize], 1024],
            }
            if self.gated:
                fields["sB2"] = align[mem[self.ab_dtype, b_cosize], 1024]
            if self.epi_tma:
                fields["sC"] = align[mem[self.out_dtype, epi_cosize], 1024]
            return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        # ---- the schedule: per-expert tables in shared memory, static tile dealing ----

        @cute.jit
        def build_schedule(self, mOffsets, num_rows, storage, warp_idx):
            """Warp 0: for each group g (the E experts, then the rows past the last expert)
            its first row, its row count and its first tile id (exclusive prefix sum of
            ``ceil(rows / tile_m) * n_tiles``); entry E + 1 of the tile ids is the total.
            Group g's rows are ``[max(end[<g]), max(end[<=g]))`` with ``end`` the offsets
            clamped into [0, S] (S for the last group): the layout's ranges for valid offsets,
            and for offsets that break the contract (decreasing, past S) still disjoint ranges
            inside the output (memory-safe, each row written at most once)."""
            ne = self.num_e
            sStart = storage.tile_start.get_tensor(cute.make_layout(ne + 2))
            sBegin = storage.row_begin.get_tensor(cute.make_layout(ne + 1))
            sCount = storage.row_count.get_tensor(cute.make_layout(ne + 1))
            if warp_idx == 0:
                lane = cute.arch.lane_idx()
                ends = cute.make_rmem_tensor((self.sched_chunks,), cutlass.Int32)
                # all loads first (independent: one memory latency), then the scans
                for c in cutlass.range_constexpr(self.sched_chunks):
                    g = c * 32 + lane
                    end = num_rows
                    if g < ne:
                        end = mOffsets[g]
                    ends[c] = end
                carry_tiles = cutlass.Int32(0)
                carry_end = cutlass.Int32(0)
                for c in cutlass.range_constexpr(self.sched_chunks):
                    g = c * 32 + lane
                    # inclusive running max of the clamped ends (then carried across chunks)
                    top = cutlass.min(cutlass.max(ends[c], cutlass.Int32(0)), num_rows)
                    for d in cutlass.range_constexpr(5):
                        up = cute.arch.shuffle_sync_up(top, 1 << d)
                        if lane >= (1 << d):
                            top = cutlass.max(top, up)
                    top = cutlass.max(top, carry_end)
                    begin = cute.arch.shuffle_sync_up(top, 1)
                    if lane == 0:
                        begin = carry_end
                    count = top - begin
                    tiles = (count + self.tile_m - 1) // self.tile_m * self.n_tiles
                    incl = tiles
                    for d in cutlass.range_constexpr(5):
                        up = cute.arch.shuffle_sync_up(incl, 1 << d)
                        if lane >= (1 << d):
                            incl = incl + up
                    if g <= ne:
                        sStart[g] = carry_tiles + incl - tiles
                        sBegin[g] = begin
                        sCount[g] = count
                    carry_tiles = carry_tiles + cute.arch.shuffle_sync(incl, 31)
                    carry_end = cute.arch.shuffle_sync(top, 31)
                if lane == 0:
                    sStart[ne + 1] = carry_tiles
            return sStart, sBegin, sCount

        @cute.jit
        def tile_coords(self, tile, sStart, sBegin, sCount):
            """(group, n_idx, row0, rows) of tile id ``tile``: its group g (the last with
            ``first tile id <= tile``: a binary search), its N tile, its first output row and
            its valid row count (<= tile_m). M tiles run fastest inside a group."""
            g = cutlass.Int32(0)
            for step in cutlass.range_constexpr(self.num_e.bit_length()):
                cand = g + (self.search_top >> step)
                if cand <= self.num_e:  # noqa: SIM102
                    if sStart[cand] <= tile:
                        g = cand
            rem = tile - sStart[g]
            count = sCount[g]
            m_tiles = (count + self.tile_m - 1) // self.tile_m
            n_idx = rem // m_tiles
            m_off = (rem - n_idx * m_tiles) * self.tile_m
            rows = cutlass.min(count - m_off, cutlass.Int32(self.tile_m))
            return g, n_idx, sBegin[g] + m_off, rows

        # ---- host side: MMA, shared-memory layouts, TMA atoms ----

        def make_mma_and_loads(self, mA, mW):
            """The tiled wgmma (``wgs_per_group`` 64-row slabs, ``mma_n`` wide: ``tile_n``, or
            ``tile_n / 2`` per accumulator of the gated epilogue), the staged shared-memory
            layouts of A and of one W box and the TMA atoms of W and (without gather) A."""
            tiled_mma, a_smem_staged, b_smem_staged = self.make_wgmma_and_smem(
                LayoutEnum.ROW_MAJOR,  # A is (rows, K), K contiguous
                LayoutEnum.from_tensor(mW),  # W viewed (N, K, E)
                self.mma_n,
            )
            tma_atom_b, tma_b = self.make_tma_load(mW, b_smem_staged, self.mma_n)
            tma_atom_a, tma_a = tma_atom_b, tma_b  # placeholders for the gather path
            if cutlass.const_expr(not self.gather):
                tma_atom_a, tma_a = self.make_tma_load(mA, a_smem_staged, self.tile_m)
            return tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a, tma_a, tma_atom_b, tma_b

        def epi_tma_store(self, mX, epi_smem_staged):
            """Host side: the TMA store atom and tensor of a row-major BF16 output ``mX`` (S
            rows) from one ``epi_tile`` sub-tile of ``epi_smem_staged``."""
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                mX,
                cute.slice_(epi_smem_staged, (None, None, 0)),
                self.epi_tile,
            )

        def gather_copy(self):
            """The cp.async tiled copy of the gather producers: 128 threads, 8 per 128-byte row
            (16-byte chunks, L2 only: ``cp.async.cg``)."""
            atom = cute.make_copy_atom(
                cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                self.ab_dtype,
                num_bits_per_copy=128,
            )
            per_row = self.tile_k // 8
            tiled = cute.make_tiled_copy_tv(
                atom,
                cute.make_layout((self.rows_per_pass, per_row), stride=(per_row, 1)),
                cute.make_layout((1, 8)),
            )
            return atom, tiled

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (T, K) gathered source, or (S, K) rows in order; K contiguous
            mIdx: cute.Tensor,  # (S,) row index (gather), else a placeholder
            mW: cute.Tensor,  # (N, K, E) view of W
            mOffsets: cute.Tensor,  # (E,) int32 cumulative expert ends
            mOut: cute.Tensor,  # (S, N) bf16 row-major; gated / dgated: a_h (S, I)
            mAux0: cute.Tensor,  # gated: bias (E, 2I) fp32; dgated: d_gate_up (S, 2I) bf16
            mR2P: cute.Tensor,  # gated / dgated: (S,) int64 row -> pair
            mAlpha: cute.Tensor,  # gated / dgated: (R,) fp32 pair affinities
            mAux1: cute.Tensor,  # gated: num_pairs (1,) int64; dgated: dA partials (S, n_tiles)
            mAct: cute.Tensor,  # gated: (R, 2I) bf16 checkpoint out; dgated: checkpoint in
            # (placeholders where the epilogue does not use them)
            mRows: cute.Tensor,  # write_a_rows: (S, K) bf16 gathered rows out; else None
            num_ctas: cutlass.Int32,
            stream,
        ):
            tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a, tma_a, tma_atom_b, tma_b = (
                self.make_mma_and_loads(mA, mW)
            )
            # the TMA-store epilogue's atoms: the main output (out, or a_h) and the fused
            # epilogues' second one, the gated one's row-order checkpoint or the dgated one's
            # d_gate_up (None where unused: compile-time constants, no kernel parameters)
            epi_smem_staged = None
            tma_atom_c, tma_c, tma_atom_aux, tma_aux = None, None, None, None
            epi_cosize = 0
            if cutlass.const_expr(self.epi_tma):
                epi_smem_staged = self.epi_smem_layout()
                epi_cosize = cute.cosize(epi_smem_staged)
                tma_atom_c, tma_c = self.epi_tma_store(mOut, epi_smem_staged)
                if cutlass.const_expr(self.gated):
                    tma_atom_aux, tma_aux = self.epi_tma_store(mAct, epi_smem_staged)
                if cutlass.const_expr(self.dgated):
                    tma_atom_aux, tma_aux = self.epi_tma_store(mAux0, epi_smem_staged)
            self.shared_storage = self.make_storage(
                cute.cosize(a_smem_staged), cute.cosize(b_smem_staged), epi_cosize
            )
            kernel = self.kernel(
                tma_atom_a, tma_a, tma_atom_b, tma_b, mA, mIdx, mOffsets, mOut, mAux0, mR2P,
                mAlpha, mAux1, mAct, mRows, tiled_mma, a_smem_staged, b_smem_staged,
                tma_atom_c, tma_c, tma_atom_aux, tma_aux, epi_smem_staged,
            )
            self.launch_persistent(kernel, num_ctas, stream)

        @cute.kernel
        def kernel(
            self,
            tma_atom_a: cute.CopyAtom,
            tma_a: cute.Tensor,
            tma_atom_b: cute.CopyAtom,
            tma_b: cute.Tensor,
            mA: cute.Tensor,
            mIdx: cute.Tensor,
            mOffsets: cute.Tensor,
            mOut: cute.Tensor,
            mAux0: cute.Tensor,
            mR2P: cute.Tensor,
            mAlpha: cute.Tensor,
            mAux1: cute.Tensor,
            mAct: cute.Tensor,
            mRows: cute.Tensor,
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
            tma_atom_c,  # cute.CopyAtom | None (None: the annotation would refuse it)
            tma_c,
            tma_atom_aux,
            tma_aux,
            epi_smem_staged,  # cute.ComposedLayout | None
        ):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            num_rows = mOut.shape[0]  # S

            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
                if cutlass.const_expr(not self.gather):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
                if cutlass.const_expr(self.epi_tma):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)
                    if cutlass.const_expr(self.gated or self.dgated):
                        cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_aux)

            # ---- pipelines: the (A, W) ring; full = W's TMA bytes (+ A's), and with gather
            # the 128 producer threads' cp.async arrivals ----
            b_one = cute.slice_(b_smem_staged, (None, None, 0))
            a_one = cute.slice_(a_smem_staged, (None, None, 0))
            tx_bytes = cute.size_in_bytes(self.ab_dtype, b_one) * self.n_acc
            if cutlass.const_expr(not self.gather):
                tx_bytes += cute.size_in_bytes(self.ab_dtype, a_one)
            smem = memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 1 + (128 if self.gather else 0)
                ),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.wgs_per_group * 4
                ),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            sBs = [sB]
            if cutlass.const_expr(self.gated):
                sBs.append(
                    storage.sB2.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
                )
            sC = None
            if cutlass.const_expr(self.epi_tma):
                sC = storage.sC.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

            sStart, sBegin, sCount = self.build_schedule(mOffsets, num_rows, storage, warp_idx)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))  # syncs the CTA
            cute.arch.sync_threads()  # the schedule tables are visible to every warp
            total = sStart[self.num_e + 1]

            if wg_idx == 0:
                # ---------------- producer warp group ----------------
                cute.arch.setmaxregister_decrease(self.producer_regs)
                prod_state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                if cutlass.const_expr(self.gather):
                    self.produce_gather(
                        tma_atom_b, tma_b, mA, mIdx, sA, sBs, ab_pipe, prod_state, sStart,
                        sBegin, sCount, total, bidx, gdim, warp_idx, tidx, mRows,
                    )
                elif warp_idx == 0:
                    self.produce_tma(
                        tma_atom_a, tma_a, tma_atom_b, tma_b, sA, sBs, ab_pipe, prod_state,
                        sStart, sBegin, sCount, total, bidx, gdim,
                    )
            else:
                # ---------------- consumer warp groups: wgmma + epilogue ----------------
                cute.arch.setmaxregister_increase(self.consumer_regs)
                if cutlass.const_expr(self.epi_tma):
                    # read again here: with the TMA-store epilogue's registers, a total kept
                    # live across setmaxnreg was spilled to local memory (ptxas 13.0)
                    total = sStart[self.num_e + 1]
                self.consume(
                    tiled_mma, sA, sBs, ab_pipe, mOut, (mAux0, mR2P, mAlpha, mAux1, mAct),
                    sStart, sBegin, sCount, total, bidx, gdim, wg_idx, tidx,
                    (sC, tma_atom_c, tma_c, tma_atom_aux, tma_aux, warp_idx),
                )

        # ---- producers ----

        def w_partitions(self, tma_atom_b, tma_b, sBs, g, n_idx):
            """(smem, gmem) TMA partitions of the W boxes of N tile ``n_idx`` of expert ``g``:
            one box, or (gated) the gate box at column ``n_idx * mma_n`` and the up box ``I``
            columns further."""
            parts = []
            for i in range(self.n_acc):
                mW = tma_b[(None, None, g)]
                if i == 1:
                    mW = cute.domain_offset((self.out_cols, 0), mW)
                gB = cute.local_tile(mW, (self.mma_n, self.tile_k), (n_idx, None))
                parts.append(self.stage_tma_partition(tma_atom_b, sBs[i], gB))
            return parts

        def copy_w(self, tma_atom_b, w_parts, kt, stage, bar):
            """TMA of the W box(es) of K tile ``kt`` into ``stage``, completing on ``bar``."""
            for tBsB, tBgB in w_parts:
                cute.copy(tma_atom_b, tBgB[(None, kt)], tBsB[(None, stage)], tma_bar_ptr=bar)

        @cute.jit
        def produce_tma(
            self, tma_atom_a, tma_a, tma_atom_b, tma_b, sA, sBs, ab_pipe, prod_state, sStart,
            sBegin, sCount, total, bidx, gdim,
        ):
            """One warp: TMA loads of A's (tile_m, tile_k) boxes from the tile's first row and
            of W[e]'s (tile_n, tile_k) boxes, for every tile of this CTA."""
            tile = bidx
            while tile < total:
                g, n_idx, row0, _rows = self.tile_coords(tile, sStart, sBegin, sCount)
                if g < self.num_e:  # the rows past the last expert load nothing
                    gA = cute.local_tile(
                        cute.domain_offset((row0, 0), tma_a),
                        (self.tile_m, self.tile_k),
                        (0, None),
                    )
                    tAsA, tAgA = self.stage_tma_partition(tma_atom_a, sA, gA)
                    w_parts = self.w_partitions(tma_atom_b, tma_b, sBs, g, n_idx)
                    for kt in cutlass.range(self.k_tiles, unroll=1):
                        ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        cute.copy(
                            tma_atom_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)],
                            tma_bar_ptr=bar,
                        )
                        self.copy_w(tma_atom_b, w_parts, kt, prod_state.index, bar)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                tile += gdim
            ab_pipe.producer_tail(prod_state)

        @cute.jit
        def produce_gather(
            self, tma_atom_b, tma_b, mA, mIdx, sA, sBs, ab_pipe, prod_state, sStart, sBegin,
            sCount, total, bidx, gdim, warp_idx, ptid, mRows,
        ):
            """The 128 producer threads: per tile, each thread reads the index of its
            ``rows_per_thread`` rows (rows ``ptid // 8 + 16 j`` of the tile), then per K tile
            waits for the stage to be free, warp 0 arms the full barrier with W's bytes and
            issues W's TMA box, and every thread issues its 16-byte cp.async chunks (column
            chunk ``ptid % 8``; zero-filled for a padding row, a row past the expert and a
            chunk past K) and arrives on the full barrier when they land.

            ``write_a_rows``: the N tiles of one M tile load the same rows, so N tile
            ``n_idx`` copies K tiles ``t`` with ``t % n_tiles == n_idx`` back out of their
            stage (spread over the N tiles: one tile copying every K tile ran behind the
            others on long K) into ``mRows`` (the tile's rows only): each thread copies its
            chunks of K tile ``t = kt - rows_lag`` at step ``kt`` (``rows_lag = stages - 1``:
            the stage this thread refills next, after its cp.async group has landed:
            ``cp.async.wait_group rows_lag``), the last ``rows_lag`` K tiles after the loop;
            the rows past the last expert (no stages) are gathered global to global by their
            ``n_idx == 0`` tile (:meth:`rows_past_experts`). The barriers and their counts are
            untouched. (A lag of one K tile, measured first, left one group of copies in
            flight on those tiles and cost more than the separate gather pass it replaces:
            ``benchmarks/RESULTS.md``.)"""
            atom, tiled = self.gather_copy()
            thr = tiled.get_slice(ptid)
            tAsA = thr.partition_D(sA)  # (CPY, rows_per_thread, 1, stages)
            chunk = ptid % (self.tile_k // 8)
            row_in = ptid // (self.tile_k // 8)
            a_base = mA.iterator.toint()
            lda_bytes = cutlass.Int64(mA.stride[0]) * 2
            src_off = cute.make_rmem_tensor((self.rows_per_thread,), cutlass.Int64)
            ok = cute.make_rmem_tensor((self.rows_per_thread,), cutlass.Boolean)
            pred = cute.make_rmem_tensor((1,), cutlass.Boolean)
            tile = bidx
            while tile < total:
                g, n_idx, row0, rows = self.tile_coords(tile, sStart, sBegin, sCount)
                if g < self.num_e:  # the rows past the last expert load nothing
                    for j in cutlass.range_constexpr(self.rows_per_thread):
                        r = row_in + j * self.rows_per_pass
                        src = cutlass.Int64(-1)
                        if r < rows:
                            src = cutlass.Int64(mIdx[row0 + r])
                        ok[j] = src >= 0
                        src_off[j] = cutlass.max(src, cutlass.Int64(0)) * lda_bytes
                    w_parts = self.w_partitions(tma_atom_b, tma_b, sBs, g, n_idx)
                    next_copy = n_idx  # write_a_rows: the next K tile this N tile copies out
                    for kt in cutlass.range(self.k_tiles, unroll=1):
                        ab_pipe.sync_object_empty.wait(prod_state.index, prod_state.phase)
                        if warp_idx == 0:
                            ab_pipe.sync_object_full.arrive(prod_state.index, None)
                            self.copy_w(
                                tma_atom_b, w_parts, kt, prod_state.index,
                                ab_pipe.producer_get_barrier(prod_state),
                            )
                        col = kt * self.tile_k + chunk * 8
                        in_k = col < self.key.k
                        col_bytes = cutlass.Int64(col) * 2
                        for j in cutlass.range_constexpr(self.rows_per_thread):
                            src_ptr = cute.make_ptr(
                                self.ab_dtype,
                                a_base + src_off[j] + col_bytes,
                                cute.AddressSpace.gmem,
                                assumed_align=16,
                            )
                            src_t = cute.make_tensor(src_ptr, cute.make_layout(((8, 1),)))
                            pred[0] = ok[j] and in_k
                            cute.copy(
                                atom, src_t, tAsA[(None, j, 0, prod_state.index)], pred=pred
                            )
                        cute.arch.cp_async_mbarrier_arrive_noinc(
                            ab_pipe.producer_get_barrier(prod_state)
                        )
                        if cutlass.const_expr(self.write_rows):
                            cute.arch.cp_async_commit_group()
                            if kt - self.rows_lag == next_copy:  # K tile next_copy landed
                                cute.arch.cp_async_wait_group(self.rows_lag)
                                self.rows_from_stage(
                                    tAsA,
                                    (prod_state.index + self.stages - self.rows_lag)
                                    % self.stages,
                                    next_copy, row0, rows, row_in, chunk, mRows,
                                )
                                next_copy += self.n_tiles
                        prod_state.advance()
                    if cutlass.const_expr(self.write_rows):
                        # the tile's last K tiles, not yet copied out
                        for i in cutlass.range(self.rows_lag, unroll=1):
                            if i + (self.k_tiles - self.rows_lag) == next_copy:
                                cute.arch.cp_async_wait_group(0)
                                self.rows_from_stage(
                                    tAsA,
                                    (prod_state.index + (self.stages - self.rows_lag) + i)
                                    % self.stages,
                                    next_copy, row0, rows, row_in, chunk, mRows,
                                )
                                next_copy += self.n_tiles
                if cutlass.const_expr(self.write_rows):  # noqa: SIM102
                    if g >= self.num_e and n_idx == 0:
                        self.rows_past_experts(
                            mA, mIdx, row0, rows, row_in, chunk, a_base, lda_bytes, mRows
                        )
                tile += gdim
            # every copy of this thread has landed before it exits
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)

        @cute.jit
        def rows_from_stage(self, tAsA, stage, kt, row0, rows, row_in, chunk, mRows):
            """``write_a_rows``: this thread's 16-byte chunks of K tile ``kt`` in ``stage``
            (what its cp.async wrote: the gathered row, or zeros for a padding row) -> ``mRows``
            rows ``row0 + r`` for the tile's rows ``r < rows`` (never a row of the next
            expert's tiles), columns ``[col, col + 8)`` below K. The caller has waited for the
            copies (``cp.async.wait_group``: visible to this thread)."""
            col = kt * self.tile_k + chunk * 8
            if col < self.key.k:
                rows_base = mRows.iterator.toint()
                v = cute.make_rmem_tensor((8,), self.ab_dtype)
                for j in cutlass.range_constexpr(self.rows_per_thread):
                    r = row_in + j * self.rows_per_pass
                    if r < rows:
                        cute.autovec_copy(tAsA[(None, j, 0, stage)], v)
                        self.store_chunk(
                            v, rows_base + (cutlass.Int64(row0 + r) * self.key.k + col) * 2
                        )

        @cute.jit
        def rows_past_experts(
            self, mA, mIdx, row0, rows, row_in, chunk, a_base, lda_bytes, mRows
        ):
            """``write_a_rows``, a tile of the rows past the last expert (its ``n_idx == 0``
            one; no stage is loaded for it): this thread's rows ``r < rows`` gathered straight
            from global memory, 16 bytes per load and store, every K chunk; +0 for a negative
            index (``mRows`` is ``gather_rows``' output on every row, these included)."""
            rows_base = mRows.iterator.toint()
            v = cute.make_rmem_tensor((8,), self.ab_dtype)
            for j in cutlass.range_constexpr(self.rows_per_thread):
                r = row_in + j * self.rows_per_pass
                if r < rows:
                    src = cutlass.Int64(mIdx[row0 + r])
                    dst_row = rows_base + cutlass.Int64(row0 + r) * (self.key.k * 2)
                    for kt in cutlass.range(self.k_tiles, unroll=1):
                        col = kt * self.tile_k + chunk * 8
                        if col < self.key.k:
                            v.fill(0.0)
                            if src >= 0:
                                src_t = cute.make_tensor(
                                    cute.make_ptr(
                                        self.ab_dtype,
                                        a_base + src * lda_bytes + cutlass.Int64(col) * 2,
                                        cute.AddressSpace.gmem,
                                        assumed_align=16,
                                    ),
                                    cute.make_layout(8),
                                )
                                cute.autovec_copy(src_t, v)
                            self.store_chunk(v, dst_row + cutlass.Int64(col) * 2)

        @cute.jit
        def store_chunk(self, v, addr):
            """Store 8 BF16 registers ``v`` as one 16-byte word at global address ``addr``."""
            dst = cute.make_tensor(
                cute.make_ptr(self.ab_dtype, addr, cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout(8),
            )
            cute.autovec_copy(v, dst)

        # ---- consumers ----

        @cute.jit
        def consume(
            self, tiled_mma, sA, sBs, ab_pipe, mOut, epi_tensors, sStart, sBegin, sCount, total,
            bidx, gdim, wg_idx, tidx, epi_tma_args,
        ):
            """Consumer warp groups: per owned tile, the mainloop (wgmma over the K stages,
            one wgmma batch in flight) and the epilogue; tiles of the other group (pingpong)
            are stepped over in the pipeline. With ``epi_tma`` a tile whose rows all lie inside
            its expert (``rows == tile_m``) stores through shared memory and TMA
            (``epi_tma_args``: the sub-tile buffers, the atoms of the main output and of the
            fused epilogues' second one, the warp index), the others from registers; the group's first warp
            waits for its last TMA stores before the kernel ends."""
            group = (wg_idx - 1) // self.wgs_per_group
            ctid = tidx - 128 - group * self.group_threads  # thread index in its group
            slab_thread = ((wg_idx - 1) % self.wgs_per_group) * 128
            thr_mma = tiled_mma.get_slice(slab_thread)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrBs = [tiled_mma.make_fragment_B(thr_mma.partition_B(sX)) for sX in sBs]
            num_k_blocks = cute.size(tCrA, mode=[2])
            thr_mma_epi = tiled_mma.get_slice(ctid)
            ref_tile = cute.make_identity_tensor((self.tile_m, self.mma_n))
            tCcC = thr_mma_epi.partition_C(ref_tile)  # (row, col) of each accumulator value
            accs = [cute.make_rmem_tensor(tCcC.shape, self.acc_dtype) for _ in sBs]
            # the fused epilogues' per-row tables (row_slots), filled before each tile's
            # mainloop so their dependent loads (row -> pair -> affinity) land under it
            n_mm = cute.size(accs[0], mode=[1])
            slots = 2 * n_mm
            mAux0, mR2P, mAlpha, mAux1, mAct = epi_tensors
            pair_s = cute.make_rmem_tensor((slots,), cutlass.Int64)
            alpha_s = cute.make_rmem_tensor((slots,), cutlass.Float32)
            in_s = cute.make_rmem_tensor((slots,), cutlass.Boolean)
            tail_s = cute.make_rmem_tensor((slots,), cutlass.Boolean)
            num_pairs = cutlass.Int64(0)
            num_r = cutlass.Int64(0)
            if cutlass.const_expr(self.gated):
                num_pairs = cutlass.Int64(mAux1[0])
                num_r = cutlass.Int64(mAct.shape[0])
            # the fused epilogues' global loads (dgated: the checkpoint; gated: the bias) in
            # chunks of column groups, each issued a chunk ahead of its use; chunk 0 before the
            # mainloop, so it lands under it
            n_q = cute.size(accs[0], mode=[0]) // 4
            bufs = []
            if cutlass.const_expr(self.dgated):
                ch = self.load_chunk(n_q, slots)
                bufs = [cute.make_rmem_tensor((2, 2, slots, ch), self.out_dtype)
                        for _ in range(n_q // ch)]
            if cutlass.const_expr(self.gated):
                ch = self.load_chunk(n_q, 2)
                bufs = [cute.make_rmem_tensor((2, 2, ch), self.acc_dtype)
                        for _ in range(n_q // ch)]
            # the TMA-store epilogue: stmatrix copies of the accumulators, the store pipeline,
            # the group's first warp issuing the stores, named barrier 3 + group (1 and 2 are
            # the pingpong turns)
            sC, tma_atom_c, tma_c, tma_atom_aux, tma_aux, warp_idx = epi_tma_args
            if cutlass.const_expr(self.epi_tma):
                epi = self.epi_setup(tiled_mma, sC, ctid)
                store_pipe = epi.store_pipe
                # dgated: du and a * h beside dg (in the accumulator), one sub-tile's worth of
                # them live at a time
                tmps = []
                if cutlass.const_expr(self.dgated):
                    tmps = [cute.make_rmem_tensor(tCcC.shape, self.acc_dtype) for _ in range(2)]
                tRS_accs = [epi.tiled_r2s.retile(acc) for acc in (*accs, *tmps)]
                store_warp = 4 + group * 4 * self.wgs_per_group
                epi_barrier = pipeline.NamedBarrier(
                    barrier_id=3 + group, num_threads=self.group_threads
                )
                epi_count = cutlass.Int32(0)
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            j = cutlass.Int32(0)  # local tile counter of this CTA
            tile = bidx
            while tile < total:
                g, n_idx, row0, rows = self.tile_coords(tile, sStart, sBegin, sCount)
                n_k = cutlass.Int32(self.k_tiles)
                if g >= self.num_e:
                    n_k = cutlass.Int32(0)  # rows past the last expert: zeros, no loads
                if self.owns_tile(j, group):
                    if cutlass.const_expr(self.gated or self.dgated):
                        self.row_slots(tCcC, n_mm, row0, rows, mR2P, mAlpha, pair_s, alpha_s,
                                       in_s, tail_s, num_pairs, num_r,
                                       self.gated and not self.key.gated.checkpoint_rows)
                    if cutlass.const_expr(self.dgated):
                        self.checkpoint_loads(bufs[0], 0, tCcC, n_idx * self.mma_n, row0,
                                              pair_s, mAct.iterator.toint())
                    if cutlass.const_expr(self.gated and self.key.gated.has_bias):
                        self.bias_loads(bufs[0], 0, tCcC, n_idx * self.mma_n, mAux0,
                                        self.bias_row(g))
                    self.wait_turn(j, group, 1)  # pingpong turns: named barriers 1 and 2
                    for acc in accs:
                        acc.fill(0.0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    for kt in cutlass.range(n_k, unroll=1):
                        ab_pipe.consumer_wait(read_state)
                        if cutlass.const_expr(self.gather):  # cp.async wrote the stage's A
                            cute.arch.fence_proxy("async.shared", space="cta")
                        stage = read_state.index
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            for i in cutlass.range_constexpr(self.n_acc):
                                cute.gemm(
                                    tiled_mma,
                                    accs[i],
                                    tCrA[(None, None, kb, stage)],
                                    tCrBs[i][(None, None, kb, stage)],
                                    accs[i],
                                )
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(1)
                        if kt > 0:
                            ab_pipe.consumer_release(release_state)
                            release_state.advance()
                        read_state.advance()
                    self.pass_turn(group, tile + gdim < total, 1)
                    cute.nvgpu.warpgroup.wait_group(0)
                    for acc in accs:
                        fence_accumulators(acc)
                    if n_k > 0:
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                    regs = (accs, tCcC, g, n_idx, row0, rows, mOut, epi_tensors, pair_s,
                            alpha_s, in_s, tail_s, bufs)
                    if cutlass.const_expr(self.epi_tma):
                        if rows == self.tile_m:  # every row inside the expert: TMA stores
                            tma_store = (epi, sC, group, warp_idx, store_warp, epi_barrier)
                            if cutlass.const_expr(self.gated):
                                epi_count = self.epilogue_gated_tma(
                                    accs[0], accs[1], tRS_accs, tCcC, g, n_idx, row0, mAux0,
                                    pair_s, alpha_s, bufs, tma_store, (tma_atom_c, tma_c),
                                    (tma_atom_aux, tma_aux), epi_count,
                                )
                            elif cutlass.const_expr(self.dgated):
                                epi_count = self.epilogue_dgated_tma(
                                    accs[0], tmps, tRS_accs, tCcC, n_idx, row0,
                                    mAux1, mAct, pair_s, alpha_s, in_s, bufs,
                                    tma_store, (tma_atom_c, tma_c), (tma_atom_aux, tma_aux),
                                    epi_count,
                                )
                            else:
                                epi_count = self.store_tile_tma(
                                    tRS_accs[0], tma_store, (tma_atom_c, tma_c),
                                    n_idx * self.mma_n, row0, epi_count,
                                )
                        else:
                            self.register_epilogue(*regs)
                    else:
                        self.register_epilogue(*regs)
                else:
                    # another consumer group's tile: step over its pipeline stages
                    for _kt in cutlass.range(n_k, unroll=1):
                        read_state.advance()
                        release_state.advance()
                j += 1
                tile += gdim
            if cutlass.const_expr(self.epi_tma):  # noqa: SIM102
                if warp_idx == store_warp:
                    store_pipe.producer_tail()  # the last TMA stores land before exit

        @cute.jit
        def register_epilogue(
            self, accs, tCcC, g, n_idx, row0, rows, mOut, epi_tensors, pair_s, alpha_s, in_s,
            tail_s, bufs,
        ):
            """The key's epilogue from registers (every tile without ``epi_tma``; with it, the
            tiles that end past their expert's last row)."""
            mAux0, _mR2P, _mAlpha, mAux1, mAct = epi_tensors
            if cutlass.const_expr(self.gated):
                self.epilogue_gated(
                    accs[0], accs[1], tCcC, g, n_idx, row0, mOut, mAux0, mAct,
                    pair_s, alpha_s, in_s, tail_s, bufs,
                )
            elif cutlass.const_expr(self.dgated):
                self.epilogue_dgated(
                    accs[0], tCcC, n_idx, row0, mOut, mAux0, mAux1, mAct,
                    pair_s, alpha_s, in_s, bufs,
                )
            else:
                self.epilogue_store(accs[0], tCcC, mOut, n_idx, row0, rows)

    epi = epilogue_mixins()

    class Sm90GroupedMmKernel(epi.store, epi.gated, epi.dgated, GroupedMmSm90):
        """The kernel of a key: the mainloop with the three epilogues composed onto it (the key
        picks one at compile time)."""

    return Sm90GroupedMmKernel


@functools.lru_cache(maxsize=1)
def _kernel_class():
    return _build_kernel_class()


def fake_operands(key: Sm90GroupedMmKey) -> tuple:
    """Fake (shape-only) operands of a compile: ``a, idx, w (N, K, E view), offsets, out`` and
    the gated epilogue's ``bias, row_to_pair, pair_affinity, num_pairs, act`` (placeholders for
    ``"store"``; ``act`` has the S rows with ``checkpoint_rows``, else R) and, last, the
    ``[S, K]`` gathered-rows output of a ``write_a_rows`` key (None
    otherwise: a compile-time constant, no kernel parameter), with symbolic row counts (``S``;
    ``T`` of a gathered source; ``R``) and A's row stride, so one compile serves every split and
    token count."""
    import cutlass
    from cutlass import cute

    n, k, e = key.n, key.k, key.num_experts
    s = cute.sym_int32(symbol="rows_S")
    lda = cute.sym_int64(divisibility=8, symbol="lda")
    if key.gather_a:
        t = cute.sym_int32(symbol="rows_T")
        a = cute.runtime.make_fake_tensor(cutlass.BFloat16, (t, k), (lda, 1), assumed_align=16)
        idx_t = {"int64": cutlass.Int64, "int32": cutlass.Int32}[key.index_dtype]
        idx = cute.runtime.make_fake_tensor(
            idx_t, (s,), (1,), assumed_align=8 if key.index_dtype == "int64" else 4
        )
    else:
        a = cute.runtime.make_fake_tensor(cutlass.BFloat16, (s, k), (lda, 1), assumed_align=16)
        idx = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    w_stride = (1, n, k * n) if key.w_major == "n" else (k, 1, k * n)
    w = cute.runtime.make_fake_tensor(cutlass.BFloat16, (n, k, e), w_stride, assumed_align=16)
    offsets = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    c = key.out_cols
    out = cute.runtime.make_fake_tensor(cutlass.BFloat16, (s, c), (c, 1), assumed_align=16)

    def placeholder():  # an unused operand: the launcher passes the offsets
        return cute.runtime.make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)

    rows = None  # the gathered-rows side output (write_a_rows), else a constexpr None
    if key.write_a_rows:
        rows = cute.runtime.make_fake_tensor(cutlass.BFloat16, (s, k), (k, 1), assumed_align=16)
    if key.epilogue == "store":
        return a, idx, w, offsets, out, *(placeholder() for _ in range(5)), rows
    r = cute.sym_int32(symbol="pairs_R")
    ck_rows = s if key.gated.checkpoint_rows else r  # the checkpoint's rows: S or the R pairs
    if key.epilogue == "dgated":
        i2 = 2 * key.n
        dgu = cute.runtime.make_fake_tensor(cutlass.BFloat16, (s, i2), (i2, 1), assumed_align=16)
        r2p = cute.runtime.make_fake_tensor(cutlass.Int64, (s,), (1,), assumed_align=8)
        alpha = cute.runtime.make_fake_tensor(cutlass.Float32, (r,), (1,), assumed_align=4)
        part = cute.runtime.make_fake_tensor(
            cutlass.Float32, (s, key.n_tiles), (key.n_tiles, 1), assumed_align=4
        )
        act = cute.runtime.make_fake_tensor(cutlass.BFloat16, (ck_rows, i2), (i2, 1),
                                            assumed_align=16)
        return a, idx, w, offsets, out, dgu, r2p, alpha, part, act, rows
    bias = placeholder()
    if key.gated.has_bias:
        bias = cute.runtime.make_fake_compact_tensor(
            cutlass.Float32, (e, n), stride_order=(1, 0), assumed_align=16
        )
    r2p = cute.runtime.make_fake_tensor(cutlass.Int64, (s,), (1,), assumed_align=8)
    alpha = cute.runtime.make_fake_tensor(cutlass.Float32, (r,), (1,), assumed_align=4)
    num_pairs = cute.runtime.make_fake_compact_tensor(cutlass.Int64, (1,), assumed_align=8)
    act = cute.runtime.make_fake_tensor(cutlass.BFloat16, (ck_rows, n), (n, 1), assumed_align=16)
    return a, idx, w, offsets, out, bias, r2p, alpha, num_pairs, act, rows


def _launch(key: Sm90GroupedMmKey, fn: Any, *operands) -> None:
    """One launch of a compiled kernel on the current stream: ``operands`` are those of
    :func:`fake_operands` (real tensors; ``out`` the fifth, its rows S); the persistent grid is
    one CTA per SM, no more than the tiles S rows can have."""
    out = operands[4]
    grid = max(1, min(key.max_tiles(out.shape[0]), num_sms(out.device.index or 0)))
    fn(*operands, grid)


def _no_contract(contract: Any) -> Sm90GroupedMmKey:
    raise ValueError("the varlen-M family is reached through cuda_kernels.grouped_mm, "
                     "not through a wgrad contract")


#: The varlen-M family: compile cache, offline compile and launcher (the engine's
#: ``KernelFamily``), registered as ``problem="varlen_m"``.
FAMILY = KernelFamily(
    "sm90_grouped_mm", lambda key: _kernel_class()(key), _no_contract,
    fake_operands=fake_operands, key_type=Sm90GroupedMmKey, launch=_launch,
    compile_name="compile_grouped_mm",
)


def compile_grouped_mm(key: Sm90GroupedMmKey) -> Any:
    """Compile (once per key, cached) the kernel for the present GPU; returns the compiled
    function, called ``fn(a, idx, w_NKE, offsets, out, bias, row_to_pair, pair_affinity,
    num_pairs, act, a_rows, num_ctas)`` on the current stream (the operands of
    :func:`fake_operands`; ``a_rows``: the ``[S, K]`` gathered-rows output of a
    ``write_a_rows`` key, else None; :mod:`cuda_kernels.grouped_mm.api` validates and
    launches).

    Raises:
        ValueError: not a :class:`Sm90GroupedMmKey`.
        RuntimeError: CuTe DSL (nvidia-cutlass-dsl) is not installed or the compile fails.
    """
    return FAMILY.compiled(FAMILY.check_key(key))


def compile_grouped_mm_offline(key: Sm90GroupedMmKey, arch: str = "sm_90a") -> str:
    """Compile ``key`` for ``arch`` without a GPU (nothing loaded) and return the PTX text.

    Raises:
        ValueError: not a :class:`Sm90GroupedMmKey`.
        RuntimeError: CuTe DSL is not installed or produced no PTX.
    """
    return FAMILY.offline_ptx(key, arch)
