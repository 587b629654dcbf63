"""Hopper (SM90) MXFP8 grouped weight gradient in CuTe DSL: FP8 wgmma with MX promotion.

``out[e] = deq(A)[:, begin:end] @ deq(B)[begin:end, :]`` for every expert ``e``, with ``deq`` the
MXFP8 decoding (element times its 32-token group's E8M0 scale); the results are those of the twin
``blockscaled_ref.grouped_wgrad_blockscaled_torch`` up to fp32 summation order.

Hopper has no block-scaled MMA, so the scales are applied in registers (the DeepGEMM promotion
pattern at MX granularity): every wgmma instruction is ``64 x tile_n x 32`` FP8 (E4M3 or E5M2,
both operands K-major along tokens, as FP8 wgmma requires) and covers exactly one MX group; its
product goes into a fresh fp32 fragment (``ACCUMULATE`` off), which is then added to the main fp32
accumulator multiplied by ``2^(sa-127) * 2^(sb-127)`` (the row's and the column's group scales, a
product of two powers of two: exact in fp32 away from its under/overflow). Two fresh fragments
alternate, so group ``g``'s promotion overlaps group ``g+1``'s wgmma.

Structure (shared with ``sm90_bf16``: the kernel class inherits the BF16 kernel's, whose methods
(and ``sm90.common.kernel_base()``'s) give the pipelines, the expert sort, the tile order, the
scheduler, the A / B loads, the launch and the epilogues; the scale loads, the promotion mainloop
and the packed stores are this module's):

- warp group 0 is the producer: one warp takes tile ids from a global atomic counter (dynamic
  persistent scheduler over experts sorted by token count, largest first) and issues, per stage of
  128 tokens (4 MX groups), the TMA loads of the ``(tile_m, 128)`` A and ``(tile_n, 128)`` B FP8
  tiles and of the scale atoms: one stage of an expert is exactly one 128x4 scale atom column
  (``common/mx_atoms``: 512 contiguous bytes per 128 rows), loaded by TMA through a
  ``(bytes / 256, 256)`` view of the scale tensor; everything completes on the stage's mbarrier;
- consumer warp groups (cooperative, one 64-row slab each) run the wgmma + promotion mainloop and
  store the fp32 accumulator from registers (dense or discrete outputs, optional accumulate);
- every expert's stages start at its first token (``token_layout="direct"``) or, in the padded
  layout (``token_layout="padded"``), at ``32 * s_e`` where ``s_e`` is its first scale column:
  then every stage is 128-token aligned and the partial group's missing tokens are the zero
  padding of the repacked operand (:func:`pad_tokens_to_scale_layout`);
- direct layout: the tokens past an expert's end inside its partial last group (the next expert's
  or TMA's zero fill) are zeroed in shared memory in both operands (``0 * NaN`` is NaN), the async
  proxy fenced, and groups past the expert's last group are neither promoted nor read for scales
  (their padding scale bytes may hold anything);
- empty experts write zeros, or leave the output untouched when accumulating.

Direct layout and TMA: the A / B boxes start at the expert's first token, the innermost (token)
coordinate, which TMA needs 16-byte aligned: the direct layout is only valid when every expert
begins at a multiple of 16 tokens (the python entry checks it; the 2026-12-01 illegal instruction
came from direct cases with begins such as 37). With that rule the direct layout was verified on
the H200 (2026-12, whole grid, compute-sanitizer) and ``"auto"`` picks it when every expert begins
at a multiple of 16 tokens (no opt-in switch any more). ``"auto"`` uses the raw operands as the
padded layout when every expert but the last holds a multiple of 128 tokens (no repack).

Tiles (:class:`Sm90MxTileConfig`): the measured default (:func:`select_sm90_mx_tile_config`:
64 x 128, two CTAs per SM, the stage's scales decoded once into an fp32 factor table in shared
memory, packed register stores) and, where it does not divide the problem, 128 x 64 / 64 x 64
tiles with per-thread scale decoding and the BF16 kernel's register epilogue. The losing and
diagnostic variants of the 2026-12-01 sweeps (cross-stage and deep-issue mainloops, the TMA
epilogue, the producer-decoded table, promotions that are wrong on purpose) were removed; their
numbers are in ``benchmarks/RESULTS.md``.

Host side: :class:`Sm90MxWgradKey` (``keys.KMajorKernelKey`` + ``elem`` + ``token_layout`` +
:class:`Sm90MxTileConfig`), ``FAMILY`` (a :class:`launch.KernelFamily` whose compile / launch
hooks take the scale operands), :func:`compile_sm90_mxfp8_wgrad`,
:func:`compile_sm90_mxfp8_wgrad_offline` (PTX for ``sm_90a`` without a GPU) and the python entry
:func:`grouped_wgrad_mxfp8_sm90`. CuTe DSL is imported only inside the compile functions.
"""



import contextlib
import dataclasses
import functools
import os
import types
from collections.abc import Callable
from typing import Any

from ..keys import KMajorKernelKey
from ..launch import KernelFamily, fake_offsets_and_out
from ..tiles import SM90_TILES, TileRules

__all__ = [
    "COMPILE_COUNT",  # noqa: F822 - served by the module __getattr__ (FAMILY.compile_count)
    "SM90_MX_TILES",
    "Sm90MxTileConfig",
    "Sm90MxWgradKey",
    "compile_sm90_mxfp8_wgrad",
    "compile_sm90_mxfp8_wgrad_offline",
    "contract_launcher",
    "grouped_wgrad_mxfp8_sm90",
    "pad_tokens_to_scale_layout",
    "select_sm90_mx_tile_config",
    "supports",
    "unavailable_reason",
]

SF_VEC = 32  # tokens per MX group = the k of one FP8 wgmma instruction
TILE_K = 128  # tokens per pipeline stage = 4 groups = one 128x4 scale atom column
ATOM_BYTES = 512
ELEMS = ("e4m3", "e5m2")
TOKEN_LAYOUTS = ("direct", "padded")
PROMOTE_MODES = ("scaled", "table")
EPILOGUES = ("autovec", "packed")


@dataclasses.dataclass(frozen=True)
class _MxTileRules(TileRules):
    """The SM90 tile rules with FP8 stages: 1-byte A and B tiles plus their scale atoms."""

    def stage_bytes(self, tile_m: int, tile_n: int, tile_k: int) -> int:
        atoms = -(-tile_m // 128) + -(-tile_n // 128)
        return tile_k * (tile_m + tile_n) + ATOM_BYTES * atoms


#: Tiles of the SM90 MXFP8 kernel: tile_m 64 / 128 (one consumer warp group per 64 rows),
#: tile_n 64 or 128 (two fresh fp32 fragments + the accumulator stay in registers), 128 tokens
#: per stage; hidden and intermediate must be multiples of the tile.
SM90_MX_TILES = _MxTileRules(
    arch="SM90",
    tile_m=(64, 128),
    tile_n_step=64,
    tile_k=(TILE_K,),
    two_cta_tile_m=None,
    max_cluster_ctas=1,
    group_align=1,
    dense_partial_tiles=False,
    yaml=SM90_TILES.yaml,
    tile_n_max=128,
    smem_reserved=4096,
)


@dataclasses.dataclass(frozen=True)
class Sm90MxTileConfig:
    """One CTA tile of the SM90 MXFP8 kernel (values: :data:`SM90_MX_TILES`).

    Attributes:
        tile_m: output rows per tile, 64 or 128 (64 x consumer warp groups).
        tile_n: output columns per tile, 64 or 128.
        tile_k: tokens per stage, 128 (4 MX groups, one scale atom column).
        stages: depth of the shared-memory ring, >= 2.
        ctas_per_sm: persistent CTAs per SM (1 or 2; 2 only with ``tile_m == 64``, one consumer
            warp group: two co-resident CTAs overlap one's epilogue / promotion with the
            other's wgmma, a pingpong by occupancy). Shared memory per CTA is then halved.
        promote: how a group's fresh fragment is added to the accumulator. ``"scaled"``: the
            thread loads its rows' and columns' 32-bit scale words once per stage and decodes
            the E8M0 byte of group g into an fp32 power of two per distinct row / column (int
            shift + mask), then ``acc += tmp * (fa * fb)``; ``"table"``: each consumer warp
            group decodes the stage's scales once into an fp32 table in shared memory
            (double-buffered, one word per thread per stage, then a warp-group barrier), the
            promotion then only loads fa / fb.
        epilogue: ``"autovec"`` (the BF16 kernel's register -> global copy: with a 16-bit
            output it emits one 2-byte store per element, 64 ``STG.U16`` per thread at
            128x128) or ``"packed"`` (each thread's two adjacent columns packed into one 32-bit
            store for bf16 / fp16 outputs, one 64-bit store for fp32).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = TILE_K
    stages: int = 6
    ctas_per_sm: int = 1
    promote: str = "scaled"
    epilogue: str = "autovec"

    def __post_init__(self) -> None:
        SM90_MX_TILES.check_config(self)
        cls = type(self).__name__
        if self.promote not in PROMOTE_MODES:
            raise ValueError(f"{cls}.promote must be one of {PROMOTE_MODES}, got {self.promote!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"{cls}.epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"{cls}.ctas_per_sm must be 1 or 2, got {self.ctas_per_sm}")
        if self.ctas_per_sm == 2:
            if self.tile_m != 64:
                raise ValueError(f"{cls}.ctas_per_sm=2 needs tile_m=64 (registers)")
            need = self.stage_bytes * self.stages + SM90_MX_TILES.smem_reserved
            if self.promote == "table":
                need += 4 * 2 * 4 * (64 + self.tile_n) * (self.tile_m // 64)
            if 2 * need > SM90_MX_TILES.smem_bytes:
                raise ValueError(
                    f"{cls}: ctas_per_sm=2 with {self.stages} stages of {self.stage_bytes} bytes "
                    f"overflows the {SM90_MX_TILES.smem_bytes}-byte shared memory of an SM"
                )

    @property
    def variant(self) -> str:
        """Short name of the config (benchmark rows), e.g. ``64x128s4-2cta-table-pk``."""
        return (f"{self.tile_m}x{self.tile_n}s{self.stages}"
                f"{'-2cta' if self.ctas_per_sm == 2 else ''}"
                f"{'-table' if self.promote == 'table' else ''}"
                f"{'-pk' if self.epilogue == 'packed' else ''}")

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        return (1, 1)

    @property
    def stage_bytes(self) -> int:
        return SM90_MX_TILES.stage_bytes(self.tile_m, self.tile_n, self.tile_k)

    @property
    def consumer_groups(self) -> int:
        """Consumer groups per CTA: 1 (the kernel is cooperative only)."""
        return 1

    @property
    def wgs_per_group(self) -> int:
        """Warp groups sharing one output tile: one per 64-row slab."""
        return self.tile_m // 64

    @property
    def consumer_warp_groups(self) -> int:
        """Consumer (wgmma) warp groups per CTA."""
        return self.tile_m // 64


@dataclasses.dataclass(frozen=True)
class Sm90MxWgradKey(KMajorKernelKey):
    """Static contract of one compiled SM90 MXFP8 kernel (its compile-cache key).

    The ``keys.KMajorKernelKey`` fields (FP8 wgmma's rules: ``a_major = b_major = "k"``,
    both operands K-major along tokens; ``input_order="tensor2d"``), plus:

    Attributes:
        elem: ``"e4m3"`` or ``"e5m2"`` (both operands).
        token_layout: ``"direct"`` (stages start at each expert's first token) or ``"padded"``
            (expert ``e`` starts at token column ``32 * s_e``, :func:`pad_tokens_to_scale_layout`).
        tile: :class:`Sm90MxTileConfig`, dividing hidden and intermediate.

    Raises:
        ValueError: a field outside its values.
    """

    _TILES = SM90_MX_TILES
    _K_MAJOR_WHY = "FP8 wgmma needs both operands K-major along tokens"

    elem: str = "e4m3"
    token_layout: str = "direct"
    tile: Sm90MxTileConfig = Sm90MxTileConfig()

    def elems(self) -> tuple[str, ...]:
        return ELEMS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_layout not in TOKEN_LAYOUTS:
            raise ValueError(
                f"{type(self).__name__}.token_layout must be one of {TOKEN_LAYOUTS}, got "
                f"{self.token_layout!r}"
            )


def select_sm90_mx_tile_config(hidden: int, intermediate: int) -> Sm90MxTileConfig:
    """The measured best tile where it divides ``(hidden, intermediate)``, else the largest tile
    that does (stages: as many as fit, <= 8).

    Best (H200 sweep of 2026-12-01, ``bench_grouped_wgrad_mxfp8.py --sweep``, 128 x 2048 x 1536,
    65536 tokens): 64 x 128 tiles, two CTAs per SM, the factor table in shared memory, packed
    epilogue stores — 0.41x our BF16 kernel against 0.25x for 128 x 128 (67.2 dB vs the twin).

    Raises:
        ValueError: hidden or intermediate is not a multiple of 64.
    """
    if hidden % 64 == 0 and intermediate % 128 == 0:
        return Sm90MxTileConfig(64, 128, TILE_K, 4, ctas_per_sm=2, promote="table",
                                epilogue="packed")
    for tm in (128, 64):
        for tn in (128, 64):
            if hidden % tm == 0 and intermediate % tn == 0:
                return Sm90MxTileConfig(tm, tn, TILE_K, SM90_MX_TILES.stages_for(tm, tn, TILE_K))
    raise ValueError(
        f"select_sm90_mx_tile_config: no SM90 MXFP8 tile fits hidden={hidden}, "
        f"intermediate={intermediate} (both must be multiples of 64)"
    )


def sweep_tile_configs(hidden: int, intermediate: int) -> list[Sm90MxTileConfig]:
    """The tile configs ``bench_grouped_wgrad_mxfp8.py --sweep`` measures for ``(hidden,
    intermediate)`` (those that divide the problem): the default first, then the runner-up of
    the 2026-12-01 sweep (128 x 128, factor table, packed stores: 0.39x BF16 against the default's
    0.41x) and the old default (128 x 128, per-thread scales, register epilogue: 0.25x), so a
    re-run shows whether the ranking still holds. The removed variants' numbers are in
    ``benchmarks/RESULTS.md``."""
    out: list[Sm90MxTileConfig] = []
    with contextlib.suppress(ValueError):
        out.append(select_sm90_mx_tile_config(hidden, intermediate))
    s128 = SM90_MX_TILES.stages_for(128, 128, TILE_K)
    for cfg in (Sm90MxTileConfig(128, 128, TILE_K, s128, promote="table", epilogue="packed"),
                Sm90MxTileConfig(128, 128, TILE_K, s128)):
        if hidden % cfg.tile_m == 0 and intermediate % cfg.tile_n == 0 and cfg not in out:
            out.append(cfg)
    return out


# --------------------------------------------------------------------------------------------
# The kernel (CuTe DSL imported lazily)
# --------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    from cutlass import cute, pipeline
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    from .wgrad_bf16 import kernel_class as _bf16_kernel_class

    base = _bf16_kernel_class()
    fence_accumulators = base.fence_accumulators

    @cute.jit
    def scale_of(word: cutlass.Int32, g: cutlass.Constexpr) -> cutlass.Float32:
        """2^(s-127) of byte g of a little-endian word of 4 E8M0 scales (exact: the byte is the
        fp32 exponent field; byte 0 gives 0, byte 255 gives inf, both only where the group is
        all zero or NaN)."""
        bits = (word >> (8 * g)) & 0xFF
        bits = bits << 23
        return cutlass.Float32(llvm.bitcast(T.f32(), cutlass.Int32(bits).ir_value()))

    elem_types = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}

    class Sm90MxGroupedWgradKernel(base):
        """The BF16 kernel (its prologue, scheduler, A / B loads and epilogue methods) with
        scale loads and an FP8 + MX-promotion mainloop."""

        def __init__(self, key: Sm90MxWgradKey):
            self.init_tiling(key)  # (sm90.common.kernel_base: one consumer group)
            t = key.tile
            self.m_tiles = key.hidden // self.tile_m
            self.n_tiles = key.intermediate // self.tile_n
            self.tiles_per_expert = self.m_tiles * self.n_tiles
            self.swizzle = 0  # tile_coords: M tiles fastest, one N column after another
            self.num_tiles = key.num_tiles
            self.out_dtype = self.out_types[key.out_dtype]
            self.ab_dtype = elem_types[key.elem]
            self.acc_dtype = cutlass.Float32
            self.m_pad_atoms = -(-key.hidden // 128)  # 128-row blocks of A's scales
            self.n_pad_atoms = -(-key.intermediate // 128)
            # promote="table": per consumer warp group 2 buffers x 4 groups x (64 rows +
            # tile_n columns) fp32 factors
            self.fac_row = 64 + t.tile_n
            self.fac_len = 4
            if t.promote == "table":
                self.fac_len = self.num_consumer_wgs * 2 * 4 * self.fac_row
            header = 4096 + 12 * key.num_experts + 16 * t.stages + 4 * self.fac_len
            self.stages = min(t.stages, (SM90_MX_TILES.smem_bytes - header) // t.stage_bytes)
            if self.stages < 2:
                raise ValueError(f"{t} leaves no room for 2 pipeline stages")
            self.ctas_per_sm = t.ctas_per_sm
            if self.ctas_per_sm == 2:
                self.stages = t.stages  # checked by the config: two CTAs fit an SM
            self.producer_regs = 40
            # one consumer warp group: 160 spilled 1.4 KB at 64x128 (ptxas -v); 232 fits the
            # pool (128 * 40 + 128 * 232 <= 65536)
            self.consumer_regs = 232
            if self.ctas_per_sm == 2:
                # launch cap 65536 / (2 * 256) = 128 per thread; the consumer warp group takes
                # the half-SM pool minus the producer's 40: (32768 - 128 * 40) / 128 = 216
                self.consumer_regs = 216

        @cute.jit
        def expert_range(self, mOffsets, sStart, e: cutlass.Int32):
            """(k0, k_len, n_k, atom0) of expert e: its first token column, token count, stages
            (= scale atom columns, ceil(k_len / 128)) and first atom column s_e / 4."""
            k_begin, k_end = self.expert_bounds(mOffsets, e)
            k_len = k_end - k_begin
            if k_len < 0:
                k_len = cutlass.Int32(0)
            n_k = (k_len + self.tile_k - 1) // self.tile_k
            atom0 = sStart[e]
            k0 = k_begin
            if cutlass.const_expr(self.key.token_layout == "padded"):
                k0 = atom0 * self.tile_k
            return k0, k_len, n_k, atom0

        @cute.jit
        def zero_tail(self, sX, extent: cutlass.Constexpr, lo, hi, stage, ctid):
            """Zero token columns [lo, hi) of one K-major (extent, 128) FP8 stage."""
            zero = cute.make_rmem_tensor((1,), self.ab_dtype)
            zero.fill(0.0)
            for i in cutlass.range(ctid, extent * (hi - lo), self.group_threads, unroll=1):
                r = i // extent
                mm = i - r * extent
                sX[(mm, lo + r, stage)] = zero[0]

        @cute.jit
        def __call__(
            self,
            mA8: cute.Tensor,  # (M, S_data) uint8 (FP8 bytes), K-major
            mB8: cute.Tensor,  # (N, S_data) uint8, K-major
            mSFA: cute.Tensor,  # (bytes / 256, 256) uint8: A's scales, 128x4 atoms
            mSFB: cute.Tensor,  # (bytes / 256, 256) uint8: B's scales
            mOffsets: cute.Tensor,  # (E,) int32
            mOut: cute.Tensor,  # (E, M, N) dense or (E,) int64 pointers
            mCounter: cute.Tensor,  # (1,) int32, zero at launch
            num_ctas: cutlass.Int32,
            stream,
        ):
            mA = cute.make_tensor(cute.recast_ptr(mA8.iterator, dtype=self.ab_dtype), mA8.layout)
            mB = cute.make_tensor(cute.recast_ptr(mB8.iterator, dtype=self.ab_dtype), mB8.layout)
            # the BF16 kernel's wgmma and A / B loads (one consumer group: wgs_per_group slabs)
            tiled_mma, a_smem_staged, b_smem_staged, tma_atom_a, tma_a, tma_atom_b, tma_b = (
                self.make_mma_and_ab_loads(mA, mB)
            )
            # one scale atom (512 bytes) = a (2, 256) box of the scale tensor's byte view
            atom_smem = cute.make_layout((2, 256), stride=(256, 1))
            tma_atom_sfa, tma_sfa = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mSFA, atom_smem, (2, 256)
            )
            tma_atom_sfb, tma_sfb = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mSFB, atom_smem, (2, 256)
            )

            self.shared_storage = self.make_storage(
                cute.cosize(a_smem_staged), cute.cosize(b_smem_staged)
            )
            args = (
                tma_atom_a,
                tma_a,
                tma_atom_b,
                tma_b,
                tma_atom_sfa,
                tma_sfa,
                tma_atom_sfb,
                tma_sfb,
                mOffsets,
                mOut,
                mCounter,
                tiled_mma,
                a_smem_staged,
                b_smem_staged,
            )
            self.launch_persistent(
                self.kernel(*args), num_ctas, stream, ctas_per_sm=self.ctas_per_sm,
                # set explicitly: with min_blocks_per_mp > 1 the DSL otherwise asks the driver
                # for the SM's shared memory (no offline compile)
                smem_carveout=100 if self.ctas_per_sm > 1 else None,
            )

        def make_storage(self, a_cosize: int, b_cosize: int):
            """The kernel's shared-memory struct (a plain method: the DSL's preprocessor would
            turn a conditional class body into code)."""
            mem, align = cute.struct.MemRange, cute.struct.Align
            fields = {
                **self.sched_storage_fields(),
                "start": mem[cutlass.Int32, self.key.num_experts],
                "sSFA": align[mem[cutlass.Uint8, ATOM_BYTES * self.stages], 128],
                "sSFB": align[mem[cutlass.Uint8, ATOM_BYTES * self.stages], 128],
                "fac": align[mem[cutlass.Float32, self.fac_len], 16],
                "sA": align[mem[self.ab_dtype, a_cosize], 1024],
                "sB": align[mem[self.ab_dtype, b_cosize], 1024],
            }
            return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        @cute.kernel
        def kernel(
            self,
            tma_atom_a: cute.CopyAtom,
            tma_a: cute.Tensor,
            tma_atom_b: cute.CopyAtom,
            tma_b: cute.Tensor,
            tma_atom_sfa: cute.CopyAtom,
            tma_sfa: cute.Tensor,
            tma_atom_sfb: cute.CopyAtom,
            tma_sfb: cute.Tensor,
            mOffsets: cute.Tensor,
            mOut: cute.Tensor,
            mCounter: cute.Tensor,
            tiled_mma: cute.TiledMma,
            a_smem_staged: cute.ComposedLayout,
            b_smem_staged: cute.ComposedLayout,
        ):
            self.kernel_body(
                tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa, tma_atom_sfb,
                tma_sfb, mOffsets, mOut, mCounter, tiled_mma, a_smem_staged, b_smem_staged,
            )

        @cute.jit
        def kernel_body(  # noqa: PLR0913
            self, tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_sfa, tma_sfa, tma_atom_sfb,
            tma_sfb, mOffsets, mOut, mCounter, tiled_mma, a_smem_staged, b_smem_staged,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)

            if warp_idx == 0:
                for atom in (tma_atom_a, tma_atom_b, tma_atom_sfa, tma_atom_sfb):
                    cute.nvgpu.cpasync.prefetch_descriptor(atom)

            # every stage also loads an A and a B scale atom
            storage, ab_pipe, sched_pipe, sSched = self.setup_pipelines(
                a_smem_staged, b_smem_staged, extra_tx_bytes=2 * ATOM_BYTES,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
            sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
            atom_stages = cute.make_layout((2, 256, self.stages), stride=(256, 1, ATOM_BYTES))
            sSFA = storage.sSFA.get_tensor(atom_stages)
            sSFB = storage.sSFB.get_tensor(atom_stages)
            # the same bytes as 32-bit words: word (r % 32) * 4 + (r % 128) // 32 of an atom
            # holds row r's 4 group scales
            words = cute.make_layout(ATOM_BYTES // 4 * self.stages)
            wSFA = cute.make_tensor(
                cute.recast_ptr(storage.sSFA.data_ptr(), dtype=cutlass.Int32), words
            )
            wSFB = cute.make_tensor(
                cute.recast_ptr(storage.sSFB.data_ptr(), dtype=cutlass.Int32), words
            )

            # The size order (the BF16 kernel's) and the first scale atom column of each expert
            # (prefix sum of ceil(count / 128)).
            sPerm, sStart = self.sort_experts(mOffsets, storage, tidx, scale_starts=True)

            tk = self.tile_k

            if wg_idx == 0:
                # ---------------- producer warp group: TMA loads ----------------
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    prod_state, sched_state = self.producer_states()
                    lane = cute.arch.lane_idx()
                    gSFA = cute.local_tile(tma_sfa, (2, 256), (None, 0))
                    gSFB = cute.local_tile(tma_sfb, (2, 256), (None, 0))
                    tFsA, tFgA = self.stage_tma_partition(tma_atom_sfa, sSFA, gSFA)
                    tFsB, tFgB = self.stage_tma_partition(tma_atom_sfb, sSFB, gSFB)
                    tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                    sched_state.advance()
                    while tile < self.num_tiles:
                        e, m_idx, n_idx = self.tile_coords(tile, sPerm)
                        k0, _k_len, n_k, atom0 = self.expert_range(mOffsets, sStart, e)
                        # atom index of (row block rb, atom column c): blocks * atom0 + rb * n_k + c
                        sfa0 = self.m_pad_atoms * atom0 + (m_idx * self.tile_m // 128) * n_k
                        sfb0 = self.n_pad_atoms * atom0 + (n_idx * self.tile_n // 128) * n_k
                        tAsA, tAgA, tBsB, tBgB = self.ab_load_partitions(
                            tma_atom_a, tma_a, tma_atom_b, tma_b, sA, sB, k0, m_idx, n_idx
                        )
                        for kt in cutlass.range(n_k, unroll=1):
                            ab_pipe.producer_acquire(prod_state)
                            bar = ab_pipe.producer_get_barrier(prod_state)
                            st = prod_state.index
                            cute.copy(
                                tma_atom_a, tAgA[(None, kt)], tAsA[(None, st)], tma_bar_ptr=bar
                            )
                            cute.copy(
                                tma_atom_b, tBgB[(None, kt)], tBsB[(None, st)], tma_bar_ptr=bar
                            )
                            cute.copy(
                                tma_atom_sfa,
                                tFgA[(None, sfa0 + kt)],
                                tFsA[(None, st)],
                                tma_bar_ptr=bar,
                            )
                            cute.copy(
                                tma_atom_sfb,
                                tFgB[(None, sfb0 + kt)],
                                tFsB[(None, st)],
                                tma_bar_ptr=bar,
                            )
                            ab_pipe.producer_commit(prod_state)
                            prod_state.advance()
                        tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                        sched_state.advance()
                    ab_pipe.producer_tail(prod_state)
            else:
                # ---------------- consumer warp groups: wgmma + MX promotion ----------------
                cute.arch.setmaxregister_increase(self.consumer_regs)
                ctid = tidx - 128  # thread index among the consumers
                mask_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.group_threads)
                thr_mma_epi = tiled_mma.get_slice(ctid)
                # num_k_blocks = 4 groups of 32 tokens
                tCrA, tCrB, num_k_blocks = self.mma_fragments(
                    tiled_mma, sA, sB, (wg_idx - 1) * 128
                )

                ref_tile = cute.make_identity_tensor((self.tile_m, self.tile_n))
                tCcC = thr_mma_epi.partition_C(ref_tile)
                acc_shape = tCcC.shape
                n_acc = cute.size(acc_shape)
                acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                tmp0 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                tmp1 = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                r_out = cute.make_rmem_tensor(acc_shape, self.out_dtype)
                # This thread's scale words: one per accumulator element (row / column of the
                # tile -> word of its atom); the row's atom row is (m_idx * tile_m) % 128 + r.
                wa = cute.make_rmem_tensor(acc_shape, cutlass.Int32)
                wb = cute.make_rmem_tensor(acc_shape, cutlass.Int32)
                fab = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
                wgl = wg_idx - 1  # consumer warp group (its 64-row slab of the tile)
                fac = storage.fac.get_tensor(cute.make_layout(self.fac_len))
                # promote="table": per element its row in the warp group's slab and its column
                # (+ 64) in the factor table, computed once outside the loops
                fri = cute.make_rmem_tensor(acc_shape, cutlass.Int32)
                fci = cute.make_rmem_tensor(acc_shape, cutlass.Int32)
                if cutlass.const_expr(self.key.tile.promote == "table"):
                    for i in cutlass.range_constexpr(n_acc):
                        r, c = tCcC[i]
                        fri[i] = r - 64 * wgl
                        fci[i] = 64 + c
                sc = types.SimpleNamespace(
                    wa=wa, wb=wb, fab=fab, tCcC=tCcC, wSFA=wSFA, wSFB=wSFB, fac=fac, wgl=wgl,
                    wtid=tidx % 128, fri=fri, fci=fci,
                    # a static id (a dynamic one makes ptxas reserve all 16 named barriers, and
                    # two CTAs per SM could not co-reside): all consumer warp groups
                    bar=pipeline.NamedBarrier(barrier_id=2, num_threads=self.group_threads),
                )

                read_state, release_state, sched_cstate = self.consumer_states()
                tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                sched_cstate.advance()
                while tile < self.num_tiles:
                    e, m_idx, n_idx = self.tile_coords(tile, sPerm)
                    _k0, k_len, n_k, _atom0 = self.expert_range(mOffsets, sStart, e)
                    row0 = (m_idx * self.tile_m) % 128
                    col0 = (n_idx * self.tile_n) % 128
                    acc.fill(0.0)
                    for kt in cutlass.range(n_k, unroll=1):
                        ab_pipe.consumer_wait(read_state)
                        stage = read_state.index
                        rest = k_len - kt * tk  # tokens of the expert in this stage (> 0)
                        if cutlass.const_expr(self.key.token_layout == "direct"):
                            self.zero_partial_group(sA, sB, k_len, kt, stage, ctid, mask_barrier)
                        self.stage_scales(sc, stage, kt % 2, row0, col0)
                        fbuf = kt % 2  # the stage's factor buffer (promote="table")
                        for kb in cutlass.range_constexpr(num_k_blocks):
                            tmp = tmp0 if kb % 2 == 0 else tmp1
                            fence_accumulators(tmp)
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                            cute.nvgpu.warpgroup.fence()
                            cute.gemm(
                                tiled_mma,
                                tmp,
                                tCrA[(None, None, kb, stage)],
                                tCrB[(None, None, kb, stage)],
                                tmp,
                            )
                            cute.nvgpu.warpgroup.commit_group()
                            if cutlass.const_expr(kb > 0):
                                cute.nvgpu.warpgroup.wait_group(1)
                                self.promote(
                                    acc, tmp1 if kb % 2 == 0 else tmp0, sc, kb - 1, rest, fbuf
                                )
                        cute.nvgpu.warpgroup.wait_group(0)
                        self.promote(
                            acc, tmp0 if (num_k_blocks - 1) % 2 == 0 else tmp1, sc,
                            num_k_blocks - 1, rest, fbuf,
                        )
                        ab_pipe.consumer_release(read_state)
                        read_state.advance()
                    next_tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                    sched_cstate.advance()
                    # ---------------- epilogue (registers -> global) ----------------
                    self.store_regs(acc, r_out, mOut, thr_mma_epi, tCcC, e, m_idx, n_idx, n_k)
                    tile = next_tile

        @cute.jit
        def store_regs(self, acc, r_out, mOut, thr_mma_epi, tCcC, e, m_idx, n_idx, n_k):
            """Epilogue from registers: ``"autovec"`` or ``"packed"``."""
            if cutlass.const_expr(self.key.output_mode == "dense"):
                m, n = self.key.hidden, self.key.intermediate
                out_ptr = mOut.iterator + cutlass.Int64(e) * (m * n)
            else:
                out_ptr = cute.make_ptr(
                    self.out_dtype, mOut[e], cute.AddressSpace.gmem, assumed_align=16
                )
            if cutlass.const_expr(self.key.tile.epilogue == "packed"):
                self.store_packed(acc, r_out, out_ptr, tCcC, m_idx, n_idx, n_k)
            else:  # the BF16 kernel's register epilogue
                self.store_regs_autovec(acc, r_out, out_ptr, thr_mma_epi, m_idx, n_idx, n_k)

        @cute.jit
        def stage_scales(self, sc, stage, buf, row0, col0):
            """Make one stage's scales ready for its promotions. ``scaled``: this thread's
            row / column words (per accumulator element; equal words load once, CSE).
            ``table``: the warp group decodes its 64 rows' and tile_n columns' E8M0 scales
            into fp32 factors in shared memory buffer ``buf`` (one word per thread), then
            syncs the warp group (the other buffer may still be read by late promotions)."""
            if cutlass.const_expr(self.key.tile.promote == "scaled"):
                for i in cutlass.range_constexpr(cute.size(sc.fab)):
                    r, c = sc.tCcC[i]
                    ra = row0 + r
                    cb = col0 + c
                    sc.wa[i] = sc.wSFA[stage * 128 + (ra % 32) * 4 + ra // 32]
                    sc.wb[i] = sc.wSFB[stage * 128 + (cb % 32) * 4 + cb // 32]
            if cutlass.const_expr(self.key.tile.promote == "table"):
                L = self.fac_row  # noqa: N806
                base = (sc.wgl * 2 + buf) * 4 * L
                for it in cutlass.range_constexpr(-(-L // 128)):
                    i = sc.wtid + 128 * it
                    if i < L:
                        w = cutlass.Int32(0)
                        if i < 64:
                            t_ra = row0 + 64 * sc.wgl + i
                            w = sc.wSFA[stage * 128 + (t_ra % 32) * 4 + t_ra // 32]
                        else:
                            t_cb = col0 + i - 64
                            w = sc.wSFB[stage * 128 + (t_cb % 32) * 4 + t_cb // 32]
                        for g in cutlass.range_constexpr(4):
                            sc.fac[base + g * L + i] = scale_of(w, g)
                sc.bar.arrive_and_wait()

        @cute.jit
        def zero_partial_group(self, sA, sB, k_len, kt, stage, ctid, mask_barrier):
            """Direct layout: zero the tokens past the expert's end inside its partial last
            group in both operands (uniform condition over the consumer warp groups)."""
            rest = k_len - kt * self.tile_k
            hi = ((rest + SF_VEC - 1) // SF_VEC) * SF_VEC
            if rest < hi and rest < self.tile_k:
                self.zero_tail(sA, self.tile_m, rest, hi, stage, ctid)
                self.zero_tail(sB, self.tile_n, rest, hi, stage, ctid)
                cute.arch.fence_proxy("async.shared", space="cta")
                mask_barrier.arrive_and_wait()

        @cute.jit
        def store_packed(self, acc, r_out, out_ptr, tCcC, m_idx, n_idx, n_k):
            """Epilogue ``"packed"``: the thread's two adjacent columns (fragment elements 2j,
            2j+1: the wgmma C layout's innermost mode) go out as one 32-bit word (bf16 / fp16)
            or one 64-bit word (fp32); ``accumulate`` reads the old pair the same way."""
            m, n = self.key.hidden, self.key.intermediate
            wide = cutlass.Int64 if cutlass.const_expr(self.out_dtype.width == 32) else (
                cutlass.Int32)
            # the expert's output base is 16-byte aligned (dense: E x M x N with M, N multiples
            # of 64; discrete: checked), so every packed word is naturally aligned
            mW = cute.make_tensor(
                cute.make_ptr(wide, out_ptr.toint(), cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((m, n // 2), stride=(n // 2, 1)),
            )
            r0 = m_idx * self.tile_m
            c0 = (n_idx * self.tile_n) // 2
            rW = cute.recast_tensor(r_out, wide)
            do_store = True
            if cutlass.const_expr(self.key.accumulate):
                do_store = n_k > 0
            if do_store:
                if cutlass.const_expr(self.key.accumulate):
                    for j in cutlass.range_constexpr(cute.size(rW)):
                        r, c = tCcC[2 * j]
                        rW[j] = mW[(r0 + r, c0 + c // 2)]
                    acc.store(acc.load() + r_out.load().to(self.acc_dtype))
                r_out.store(acc.load().to(self.out_dtype))
                for j in cutlass.range_constexpr(cute.size(rW)):
                    r, c = tCcC[2 * j]
                    mW[(r0 + r, c0 + c // 2)] = rW[j]

        @cute.jit
        def promote(self, acc, tmp, sc, g: cutlass.Constexpr, rest, buf):
            """acc += tmp * 2^(sa-127) * 2^(sb-127) for group g of the stage, when the group
            holds tokens of the expert (a group past the expert's end is skipped: its scales are
            padding). ``buf``: the stage's factor buffer (``promote="table"``: kt % 2)."""
            fence_accumulators(tmp)
            mode = self.key.tile.promote
            if rest > g * SF_VEC:
                if cutlass.const_expr(mode == "scaled"):
                    for i in cutlass.range_constexpr(cute.size(sc.fab)):
                        sc.fab[i] = scale_of(sc.wa[i], g) * scale_of(sc.wb[i], g)
                if cutlass.const_expr(mode == "table"):
                    L = self.fac_row  # noqa: N806
                    base = (sc.wgl * 2 + buf) * 4 * L + g * L
                    for i in cutlass.range_constexpr(cute.size(sc.fab)):
                        sc.fab[i] = sc.fac[base + sc.fri[i]] * sc.fac[base + sc.fci[i]]
                for i in cutlass.range_constexpr(cute.size(sc.fab)):
                    acc[i] = acc[i] + tmp[i] * sc.fab[i]

    return Sm90MxGroupedWgradKernel


#: The kernel class, built once on first use (CuTe DSL is imported then): ``kernel_class()(key)``.
kernel_class = functools.cache(_build_kernel_class)


# --------------------------------------------------------------------------------------------
# Host side: the kernel family (compile cache, offline PTX, launcher)
# --------------------------------------------------------------------------------------------


def _fake_operands(key: Sm90MxWgradKey):
    """Fake (shape-only) operands of a compile: FP8 data as uint8 ``(rows, S_data)`` with a
    symbolic token count and row stride (the quantizer's rows are padded to 32 tokens), the scale
    tensors as ``(bytes / 256, 256)`` uint8 views, offsets, output."""
    import cutlass
    from cutlass import cute

    m, n = key.hidden, key.intermediate
    s_a = cute.sym_int32(divisibility=1, symbol="tokens_a")  # padded layouts may differ
    s_b = cute.sym_int32(divisibility=1, symbol="tokens_b")
    lda = cute.sym_int32(divisibility=16, symbol="lda")
    ldb = cute.sym_int32(divisibility=16, symbol="ldb")
    a = cute.runtime.make_fake_tensor(cutlass.Uint8, (m, s_a), (lda, 1), assumed_align=16)
    b = cute.runtime.make_fake_tensor(cutlass.Uint8, (n, s_b), (ldb, 1), assumed_align=16)
    sfa = cute.runtime.make_fake_compact_tensor(
        cutlass.Uint8, (cute.sym_int32(symbol="sfa_rows"), 256), stride_order=(1, 0),
        assumed_align=16,
    )
    sfb = cute.runtime.make_fake_compact_tensor(
        cutlass.Uint8, (cute.sym_int32(symbol="sfb_rows"), 256), stride_order=(1, 0),
        assumed_align=16,
    )
    offsets, out = fake_offsets_and_out(key)
    counter = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
    return a, b, sfa, sfb, offsets, out, counter


class _MxFamily(KernelFamily):
    """``launch.KernelFamily`` with the MXFP8 launch call (it carries the two scale tensors); the
    cache, compile (``fake_operands=_fake_operands``), offline PTX, module ``COMPILE_COUNT`` and
    launcher plumbing are the shared layer's."""

    def _launch(self, key, fn, a, b, sfa, sfb, offsets, out, stream=None) -> None:  # noqa: PLR0913
        import torch

        from ..launch import num_sms

        sms = num_sms(a.device.index or 0) * key.tile.ctas_per_sm
        grid = max(1, min(key.num_tiles, sms))
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            counter = torch.zeros(1, dtype=torch.int32, device=a.device)
            fn(a, b, sfa, sfb, offsets, out, counter, grid)


def _key_from_contract(contract: Any) -> Sm90MxWgradKey:
    raise ValueError(
        "the SM90 MXFP8 kernel is reached through grouped_wgrad_mxfp8_sm90 (the block-scaled "
        "contract is not wired to it yet)"
    )


#: The SM90 MXFP8 family: a dynamic persistent scheduler (a zeroed tile counter per launch),
#: compiled for the present GPU (only offline compiles pin an arch). Not verified on a GPU yet.
FAMILY = _MxFamily(
    "sm90_mxfp8", lambda key: kernel_class()(key), _key_from_contract, tile_counter=True,
    fake_operands=_fake_operands,
)

__getattr__ = FAMILY.module_getattr(__name__)  # COMPILE_COUNT: the family's count


def compile_sm90_mxfp8_wgrad(key: Sm90MxWgradKey) -> Callable[..., None]:
    """Compile (once per key, cached) the SM90 MXFP8 kernel and return its raw launcher.

    ``launcher(a, b, sfa, sfb, offsets, out, stream=None)`` on already-validated CUDA tensors:
    ``a`` ``(M, S_data)`` uint8 (FP8 bytes, unit stride along tokens, row stride a multiple of
    16), ``b`` ``(N, S_data)`` likewise, ``sfa`` / ``sfb`` the scale tensors as contiguous
    ``(bytes / 256, 256)`` uint8 views, ``offsets`` ``(E,)`` int32, ``out`` dense ``(E, M, N)`` or
    ``(E,)`` int64 pointers. :func:`grouped_wgrad_mxfp8_sm90` is the checked entry.

    Raises:
        RuntimeError: CuTe DSL is not installed or the compile fails.
    """
    return FAMILY.launcher(key)


#: ``compile_sm90_mxfp8_wgrad_offline(key, arch="sm_90a")``: the PTX of ``key`` for
#: ``arch``, compiled without a GPU (CI): ``FAMILY.offline_ptx``.
compile_sm90_mxfp8_wgrad_offline = FAMILY.offline_compiler("sm_90a")


# --------------------------------------------------------------------------------------------
# The python entry
# --------------------------------------------------------------------------------------------


#: True once the GPU tests (tests/test_grouped_wgrad_sm90_mxfp8.py, the block-scaled API's GPU
#: tests through the registry) have passed on an H200 with this source.
VERIFIED_ON_GPU = False
ENABLE_ENV = "MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8"


def enabled() -> bool:
    """Whether the block-scaled API may route MXFP8 calls to this kernel (the registry's gate,
    :func:`unavailable_reason`): verified on a GPU, or opted in with
    ``MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1``."""
    return VERIFIED_ON_GPU or os.environ.get(ENABLE_ENV) == "1"


def unavailable_reason() -> str | None:
    """The family's gate in ``registry.KernelProvider.unavailable``: the API routes MXFP8 calls
    here only while :func:`enabled` (the python entry :func:`grouped_wgrad_mxfp8_sm90` always
    runs)."""
    if enabled():
        return None
    return (
        "the SM90 MXFP8 kernel is not verified on a GPU yet; set "
        f"{ENABLE_ENV}=1 to route block-scaled MXFP8 calls to it"
    )


def supports(contract: Any) -> str | None:
    """Why the kernel cannot serve the block-scaled ``contract``, or None: MXFP8, both operands
    K-major along tokens (FP8 wgmma), ``tensor2d``; any token count per expert."""
    spec = getattr(contract, "block_scaled", None)
    if spec is None or spec.fmt != "mxfp8":
        return "only block-scaled MXFP8 contracts are built"
    if contract.a_major != "k" or contract.b_major != "k":
        return "both operands must be K-major along tokens (FP8 wgmma)"
    if contract.input_order != "tensor2d":
        return "only input_order='tensor2d' is built"
    return None


def contract_launcher(contract: Any) -> Callable[..., None]:
    """The kernel behind the block-scaled launcher signature (``blockscaled.Launcher``): the API
    has checked every rule and reads nothing on the host here, so the operands go through the
    padded token layout (:func:`pad_tokens_to_scale_layout`)."""
    import torch

    out_dtype = getattr(torch, contract.out_dtype)  # "bfloat16" / "float16" / "float32"

    def launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a=None, global_scale_b=None,
                 descriptor_workspace=None, stream=None):
        del global_scale_a, global_scale_b, descriptor_workspace  # MXFP8: none; TMA: its own
        grouped_wgrad_mxfp8_sm90(
            a, sfa, b, sfb, offsets, out, out_dtype=out_dtype, accumulate=contract.accumulate,
            output_mode=contract.output_mode, token_layout="padded", validate=False,
            stream=stream,
        )

    return launcher


def _err(msg: str) -> ValueError:
    return ValueError(f"grouped_wgrad_mxfp8_sm90: {msg}")


def _expert_atom_starts(offsets_E):
    """(begins, counts, first atom column s_e / 4) per expert, int64 on the offsets' device."""
    import torch

    ends = offsets_E.to(torch.int64)
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = (ends - begins).clamp_min(0)
    atoms = (counts + TILE_K - 1) // TILE_K
    starts = torch.cumsum(atoms, 0) - atoms
    return begins, counts, starts


def pad_tokens_to_scale_layout(data_RS, offsets_E, scale_cols: int):
    """Repack a K-major MX operand ``[rows, S]`` so that expert ``e`` starts at token column
    ``32 * s_e`` (``s_e`` its first scale column, ``common/mx_atoms``): ``[rows, 32 *
    scale_cols]`` uint8, zero outside the experts' tokens. On the device, no host read (CUDA-graph
    capturable); every expert then starts 128-token aligned, like its scale atoms."""
    import torch

    rows, s = data_RS.shape
    out = torch.zeros((rows, SF_VEC * scale_cols), dtype=torch.uint8, device=data_RS.device)
    if s == 0 or rows == 0:
        return out
    begins, counts, starts = _expert_atom_starts(offsets_E)
    col_expert = torch.repeat_interleave(
        torch.arange(counts.numel(), device=data_RS.device), counts, output_size=s
    )
    col = torch.arange(s, device=data_RS.device)
    dest = starts[col_expert] * TILE_K + (col - begins[col_expert])
    out.index_copy_(1, dest, data_RS.view(torch.uint8))
    return out


def grouped_wgrad_mxfp8_sm90(
    a_data,
    a_scales,
    b_data,
    b_scales,
    offsets,
    out=None,
    *,
    out_dtype=None,
    accumulate: bool = False,
    output_mode: str = "dense",
    token_layout: str = "auto",
    tile: Sm90MxTileConfig | None = None,
    validate: bool = True,
    stream=None,
):
    """MXFP8 grouped weight gradient on an SM90 GPU (FP8 wgmma + MX promotion).

    Dimensions: M hidden, N intermediate, S tokens_sum, E experts.

    Args:
        a_data: ``[M, S]`` ``float8_e4m3fn`` / ``float8_e5m2``, unit stride along tokens, row
            stride a multiple of 16, 16-byte aligned (``quantize_wgrad_operand``'s data).
        a_scales: ``float8_e8m0fnu`` ``[round_up(M,128), cols]`` contiguous, K-grouped 128x4
            atoms (``common/mx_atoms``), cols a multiple of 4 holding every expert's columns.
        b_data: ``[S, N]`` same dtype, unit stride along tokens (the dY operand's data ``.t()``).
        b_scales: ``[round_up(N,128), cols']`` like ``a_scales``.
        offsets: ``[E]`` int32 cumulative token ends on the device: non-decreasing, last == S,
            any count per expert (0 included).
        out: optional ``[E, M, N]`` contiguous bf16 / fp16 / fp32 (dense), or with
            ``output_mode="discrete"`` an ``(E,)`` int64 tensor of 16-byte aligned row-major
            ``(M, N)`` output addresses (then ``out_dtype`` names their dtype). Required when
            ``accumulate``.
        out_dtype: dtype of an allocated output (default float32).
        accumulate: ``out[e] += result`` (fp32 sum, rounded once); empty experts untouched.
        token_layout: ``"direct"`` (the kernel reads each expert at its first token, which
            must be a multiple of 16 tokens: TMA's 16-byte aligned innermost coordinate;
            checked when validating), ``"padded"`` (the operands are first repacked on the device
            so that every expert starts at its scale column:
            :func:`pad_tokens_to_scale_layout`) or ``"auto"`` (with validation: no repack when
            every expert but the last holds a multiple of 128 tokens (the operands already are
            in the padded layout), else direct when every expert begins at a multiple of 16
            tokens, else padded; without validation: padded).
        tile: a :class:`Sm90MxTileConfig` (default: :func:`select_sm90_mx_tile_config`).
        validate: read the offsets on the host to check them (one sync); False: nothing read on
            the host, the caller guarantees the rules.
        stream: a ``torch.cuda.Stream`` (default: the current one).

    Returns:
        The ``[E, M, N]`` output (``out`` when given; the pointer tensor for discrete outputs).

    Raises:
        ValueError: a rule above, before anything is written.
        RuntimeError: CuTe DSL missing or the compile fails.
    """
    import torch

    from common.mx_atoms import grouped_scale_cols, round_up

    fp8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    if output_mode not in ("dense", "discrete"):
        raise _err(f"output_mode must be 'dense' or 'discrete'; got {output_mode!r}")
    if token_layout not in ("auto", *TOKEN_LAYOUTS):
        raise _err(f"token_layout must be 'auto', 'direct' or 'padded'; got {token_layout!r}")
    for name, t in (("a_data", a_data), ("b_data", b_data), ("a_scales", a_scales),
                    ("b_scales", b_scales), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise _err(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if a_data.dim() != 2 or b_data.dim() != 2:
        raise _err(f"a_data and b_data must be rank-2; got {tuple(a_data.shape)} and "
                   f"{tuple(b_data.shape)}")
    if a_data.dtype not in fp8 or b_data.dtype != a_data.dtype:
        raise _err(f"a_data and b_data must share one FP8 dtype (float8_e4m3fn or float8_e5m2); "
                   f"got {a_data.dtype} and {b_data.dtype}")
    elem = fp8[a_data.dtype]
    m, s = a_data.shape
    s_b, n = b_data.shape
    if s_b != s:
        raise _err(f"token dims differ: a_data has S={s}, b_data has S={s_b}")
    if m < 1 or n < 1:
        raise _err(f"hidden and intermediate must be positive; got M={m}, N={n}")
    for name, t, stride_t, ld in (("a_data", a_data, 1, 0), ("b_data", b_data, 0, 1)):
        if s > 1 and t.stride(stride_t) != 1:
            raise _err(f"{name} must have unit stride along tokens (K-major: FP8 wgmma needs "
                       f"both operands K-major); got strides {tuple(t.stride())}")
        if t.stride(ld) % 16 or t.data_ptr() % 16:
            raise _err(f"{name}'s row stride ({t.stride(ld)}) and address must be multiples of "
                       "16 bytes (TMA)")
    for name, sf, rows in (("a_scales", a_scales, m), ("b_scales", b_scales, n)):
        rp = round_up(rows, 128)
        if sf.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise _err(f"{name} must be float8_e8m0fnu (or its uint8 bytes); got {sf.dtype}")
        if sf.dim() != 2 or sf.shape[0] != rp or sf.shape[1] % 4 or sf.shape[1] < 4:
            raise _err(f"{name} must be [round_up(rows,128)={rp}, cols] with cols a positive "
                       f"multiple of 4; got {tuple(sf.shape)}")
        if not sf.is_contiguous() or sf.data_ptr() % 16:
            raise _err(f"{name} must be contiguous and 16-byte aligned (128x4 atoms)")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.numel() == 0:
        raise _err("offsets must be a non-empty rank-1 int32 tensor")
    if not offsets.is_contiguous():
        raise _err("offsets must be contiguous")
    devs = {t.device for t in (a_data, b_data, a_scales, b_scales, offsets)}
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise _err(f"out must be a torch.Tensor; got {type(out).__name__}")
        devs.add(out.device)
    if len(devs) != 1 or next(iter(devs)).type != "cuda":
        raise _err(f"every tensor must be on one CUDA device; got {sorted(map(str, devs))}")
    num_e = offsets.numel()
    out_dtypes = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                  torch.float32: "float32"}
    if output_mode == "dense":
        if out is not None:
            if tuple(out.shape) != (num_e, m, n) or not out.is_contiguous():
                raise _err(f"out must be a contiguous [E, M, N] = {(num_e, m, n)} tensor; got "
                           f"{tuple(out.shape)}")
            if out.dtype not in out_dtypes:
                raise _err(f"out dtype must be bfloat16, float16 or float32; got {out.dtype}")
            if out_dtype is not None and out_dtype != out.dtype:
                raise _err(f"out_dtype={out_dtype} differs from out.dtype={out.dtype}")
            out_dtype = out.dtype
        elif accumulate:
            raise _err("accumulate=True needs an initialized out tensor")
    else:
        if out is None or out.dtype != torch.int64 or tuple(out.shape) != (num_e,):
            raise _err("output_mode='discrete' needs out as an (E,) int64 tensor of addresses")
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if out_dtype not in out_dtypes:
        raise _err(f"out_dtype must be bfloat16, float16 or float32; got {out_dtype}")
    if tile is None:
        try:
            tile = select_sm90_mx_tile_config(m, n)
        except ValueError as exc:
            raise _err(str(exc)) from exc
    try:
        key_probe = Sm90MxWgradKey(m, n, num_e, out_dtype=out_dtypes[out_dtype],
                                   output_mode=output_mode, accumulate=accumulate, elem=elem,
                                   tile=tile)
    except ValueError as exc:
        raise _err(str(exc)) from exc
    aligned = identity = False
    if validate:
        from ..launch import host_offset_ends

        ends = host_offset_ends(offsets, s, arg="offsets", err=_err)
        need = grouped_scale_cols(ends, SF_VEC)[2]
        for name, sf in (("a_scales", a_scales), ("b_scales", b_scales)):
            if sf.shape[1] < need:
                raise _err(f"{name} has {sf.shape[1]} columns; these offsets need {need} (the "
                           "experts' padded scale columns)")
        aligned = all(b % 16 == 0 for b in [0, *ends[:-1]])
        # every expert but the last holds a multiple of 128 tokens: each begins at 32 * s_e,
        # i.e. the operands already are in the padded layout (the last expert's tail is past
        # the data: TMA's zero fill)
        counts = [b - a for a, b in zip([0, *ends[:-1]], ends)]
        identity = all(c % TILE_K == 0 for c in counts[:-1])
        if output_mode == "discrete":
            for e, p in enumerate(out.tolist()):
                if p == 0 or p % 16:
                    raise _err(f"discrete output address {e} must be non-null and 16-byte "
                               f"aligned; got {p:#x}")
    if token_layout == "direct":
        if validate and not aligned:
            raise _err("token_layout='direct' needs every expert to begin at a multiple of 16 "
                       "tokens (TMA: 16-byte aligned innermost coordinate); use 'padded' or "
                       "'auto'")
    layout, repack = token_layout, token_layout == "padded"
    if token_layout == "auto":
        layout, repack = "padded", True
        if validate and identity:
            repack = False  # the operands already are in the padded layout
        elif validate and aligned:
            layout, repack = "direct", False
    key = dataclasses.replace(key_probe, token_layout=layout)
    if out is None:
        out = torch.empty((num_e, m, n), dtype=out_dtype, device=a_data.device)
    if s == 0:  # no tokens at all: zeros (nothing to add when accumulating); no launch
        if not accumulate:
            if output_mode == "dense":
                out.zero_()
            else:
                raise _err("tokens_sum == 0 with discrete outputs: nothing to launch; zero them")
        return out
    a_rs = a_data.view(torch.uint8)  # [M, S]
    b_rs = b_data.t().view(torch.uint8)  # [N, S]
    if repack:
        a_rs = pad_tokens_to_scale_layout(a_rs, offsets, a_scales.shape[1])
        b_rs = pad_tokens_to_scale_layout(b_rs, offsets, b_scales.shape[1])
    sfa = a_scales.view(torch.uint8).view(-1, 256)
    sfb = b_scales.view(torch.uint8).view(-1, 256)
    launcher = compile_sm90_mxfp8_wgrad(key)
    launcher(a_rs, b_rs, sfa, sfb, offsets, out, stream=stream)
    return out
