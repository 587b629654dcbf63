"""What the SM90 (Hopper) wgmma kernel families share: the BF16 grouped wgrad (``sm90_bf16``),
the MXFP8 grouped wgrad (``sm90_mxfp8``, whose kernel class derives from the BF16 one) and the
varlen-M grouped GEMM (``cuda_kernels/gemm/sm90/grouped_mm.py``).

All three are CTA-persistent and warp-specialized the same way: warp group 0 produces the
stages of a shared-memory ring of (A, B) tiles, and consumer warp groups issue wgmma with fp32
accumulators, either two warp groups sharing each 128-row tile (cooperative: a 64-row slab
each) or, with ``pingpong``, two consumer groups of one warp group owning alternate tiles.

- :class:`Sm90Tiling`: plain Python, the frozen dataclass both tile dataclasses derive from
  (``Sm90TileConfig``, ``Sm90GroupedMmTile``): the tile fields, their check, the tile's short
  name, its stage bytes and its consumer structure.
- :func:`kernel_base`: the kernels' base class, built once on first use (CuTe DSL is imported
  inside that cached builder only, as the kernel modules do): the kernel fields taken from the
  tile, the accumulator fence, the staged TMA partition, the tiled wgmma with its staged
  shared-memory layouts, the TMA load atoms, the TMA-store epilogue's sub-tiles (registers ->
  ``stmatrix`` -> shared memory -> TMA store: the wgrad kernel's dense outputs and the varlen-M
  kernel's ``epi_tma`` tiles), the pingpong groups' turns on the pipeline and the persistent
  launch.

No CuTe DSL, torch or GPU query at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from ..tiles import SM90_TILES

__all__ = ["Sm90Tiling", "kernel_base"]


@dataclasses.dataclass(frozen=True)
class Sm90Tiling:
    """One CTA tile of an SM90 wgmma kernel: the fields every SM90 tile dataclass starts with
    (a subclass adds its speed variants) and what the kernels read from them.

    Attributes (accepted values: ``tiles.SM90_TILES``):
        tile_m: output rows per CTA tile, 64 or 128 (cooperative: one 64-row slab per consumer
            warp group; pingpong: one warp group per tile).
        tile_n: output columns per CTA tile, a multiple of 16 in [16, 256].
        tile_k: the contraction per pipeline stage (tokens of the wgrad, K of the grouped GEMM),
            64 (one 128-byte swizzle row of bf16).
        stages: depth of the shared-memory ring of (A, B) tiles, >= 2 (a kernel lowers it to
            what fits beside its other shared memory).
        pingpong: two consumer warp groups own alternate output tiles (one warp group per tile,
            its epilogue overlapping the other's mainloop) instead of sharing each tile.

    Raises:
        ValueError: a field outside the ranges above or stages that overflow shared memory.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    pingpong: bool = False

    def __post_init__(self) -> None:
        SM90_TILES.check_config(self)

    @property
    def variant_name(self) -> str:
        """Short name of the tile (benchmark rows): ``<tile_m>x<tile_n>s<stages>``, ``pp`` for
        pingpong (a config with speed variants appends their suffixes)."""
        return f"{self.tile_m}x{self.tile_n}s{self.stages}{'pp' if self.pingpong else ''}"

    @property
    def stage_bytes(self) -> int:
        """Bytes of one pipeline stage: a bf16 A tile plus a bf16 B tile (W for the grouped
        GEMM)."""
        return SM90_TILES.stage_bytes(self.tile_m, self.tile_n, self.tile_k)

    @property
    def consumer_groups(self) -> int:
        """Consumer groups per CTA, each owning whole output tiles (2 for pingpong, else 1)."""
        return 2 if self.pingpong else 1

    @property
    def wgs_per_group(self) -> int:
        """Warp groups sharing one output tile: one per 64-row slab (cooperative), else 1."""
        return 1 if self.pingpong else self.tile_m // 64

    @property
    def consumer_warp_groups(self) -> int:
        """Consumer (wgmma) warp groups per CTA."""
        return self.consumer_groups * self.wgs_per_group


@functools.cache
def kernel_base() -> type:
    """The base class of the SM90 kernel classes (built once; CuTe DSL is imported here).

    Its methods read the fields a kernel's ``__init__`` sets: :meth:`init_tiling`'s, and
    ``ab_dtype``, ``acc_dtype``, ``stages`` (what fits shared memory) and, before a launch,
    ``shared_storage`` (the kernel's shared-memory struct).
    """
    import cutlass
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import cute, pipeline
    from cutlass.tensor_utils import LayoutEnum
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    @cute.jit
    def fence_accumulators(acc: cute.Tensor):
        """Pin each accumulator register behind an empty volatile asm (CUTLASS's
        warpgroup_fence_operand): the epilogue's reads then cannot be scheduled above
        ``wgmma.wait_group``, which would make ptxas serialize every wgmma (C7514)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = cutlass.Float32(
                llvm.inline_asm(
                    T.f32(),
                    [cutlass.Float32(acc[i]).ir_value()],
                    "",
                    "=f,0",
                    has_side_effects=True,
                    is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT,
                )
            )

    class Sm90KernelBase:
        """What the SM90 wgmma kernels share (see the module docstring); also
        ``fence_accumulators(acc)`` (a static method, set below)."""

        #: The CuTe type of each output dtype name of the wgrad keys (``out_dtype``).
        out_types = {
            "bfloat16": cutlass.BFloat16,
            "float16": cutlass.Float16,
            "float32": cutlass.Float32,
        }

        def init_tiling(self, key) -> None:
            """The kernel fields of ``key`` and its tile ``key.tile`` (``consumer_groups``,
            ``wgs_per_group``, ``consumer_warp_groups``): ``key``, ``tile_m`` / ``tile_n`` /
            ``tile_k``, ``num_consumer_wgs``, ``num_groups``, ``wgs_per_group``, ``threads``
            (a producer warp group and the consumers) and ``group_threads`` (one consumer
            group's)."""
            self.key = key
            t = key.tile
            self.tile_m, self.tile_n, self.tile_k = t.tile_m, t.tile_n, t.tile_k
            self.num_consumer_wgs = t.consumer_warp_groups
            self.num_groups = t.consumer_groups
            self.wgs_per_group = t.wgs_per_group
            self.threads = 128 * (1 + self.num_consumer_wgs)
            self.group_threads = 128 * self.wgs_per_group

        @staticmethod
        def stage_tma_partition(tma_atom, sX, gX):
            """(smem, gmem) TMA partitions of staged tiles ``sX`` and global tiles ``gX`` (one
            CTA, no multicast)."""
            return cute.nvgpu.cpasync.tma_partition(
                tma_atom,
                0,
                cute.make_layout(1),
                cute.group_modes(sX, 0, 2),
                cute.group_modes(gX, 0, 2),
            )

        def make_wgmma_and_smem(self, a_layout, b_layout, mma_n: int):
            """Host side: the tiled wgmma (``wgs_per_group`` 64-row slabs of a tile, ``mma_n``
            wide) of operands with the major modes of ``a_layout`` / ``b_layout``
            (``LayoutEnum``) and the ``stages``-deep shared-memory layouts of the
            ``(tile_m, tile_k)`` A and ``(mma_n, tile_k)`` B tiles. Returns (tiled_mma,
            a_smem_staged, b_smem_staged)."""
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                a_layout.sm90_mma_major_mode(),
                b_layout.sm90_mma_major_mode(),
                self.acc_dtype,
                (self.wgs_per_group, 1, 1),
                tiler_mn=(64, mma_n),
            )
            tile_mnk = (self.tile_m, mma_n, self.tile_k)
            a_smem_staged = sm90_utils.make_smem_layout_a(
                a_layout, tile_mnk, self.ab_dtype, self.stages
            )
            b_smem_staged = sm90_utils.make_smem_layout_b(
                b_layout, tile_mnk, self.ab_dtype, self.stages
            )
            return tiled_mma, a_smem_staged, b_smem_staged

        def make_tma_load(self, mX, smem_staged, rows: int):
            """Host side: the TMA load atom and tensor of ``mX`` into one stage of
            ``smem_staged``, ``(rows, tile_k)`` boxes. Returns (tma_atom, tma_tensor)."""
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                mX,
                cute.slice_(smem_staged, (None, None, 0)),
                (rows, self.tile_k),
            )

        # ---- the TMA-store epilogue: registers -> shared memory (stmatrix) -> TMA, in
        # epi_tile sub-tiles. They use out_dtype / acc_dtype / epi_tile / epi_stages /
        # num_groups / group_threads (the kernel's __init__ sets the epi_* fields).

        def epi_smem_layout(self):
            """Staged shared-memory layout of the epilogue sub-tiles: ``epi_stages`` buffers of
            ``epi_tile`` per consumer group (row-major output)."""
            return sm90_utils.make_smem_layout_epi(
                self.out_dtype,
                LayoutEnum.ROW_MAJOR,
                self.epi_tile,
                self.epi_stages * self.num_groups,
            )

        def epi_setup(self, tiled_mma, sC, ctid):
            """A consumer thread's register -> shared copy (stmatrix) of an accumulator's
            sub-tiles and the TMA store pipeline (``epi_stages`` buffers per group). An
            accumulator of ``tiled_mma``'s fragment goes through it as
            ``epi.tiled_r2s.retile(acc)``."""
            r2s_atom = sm90_utils.get_smem_store_op(
                LayoutEnum.ROW_MAJOR, self.out_dtype, self.acc_dtype
            )
            c_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.out_dtype
            )
            tiled_r2s = cute.make_tiled_copy_S(
                r2s_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma)
            )
            thr_r2s = tiled_r2s.get_slice(ctid)
            tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, buffer)
            rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
            tRS_rC = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
            tRS_rC_out = cute.make_rmem_tensor(rC_shape, self.out_dtype)
            sub_size = cute.size(tRS_rC)
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_stages,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.group_threads
                ),
            )
            return types.SimpleNamespace(
                tiled_r2s=tiled_r2s, tRS_sC=tRS_sC, tRS_rC=tRS_rC,
                tRS_rC_out=tRS_rC_out, sub_size=sub_size,
                store_pipe=store_pipe,
            )

        def epi_partition(self, tma_atom_c, sC, gC_t):
            """(smem, gmem) TMA partitions of one ``(tile_m, tile_n)`` output tile ``gC_t`` in
            ``epi_tile`` sub-tiles, their count and their (row-major) coordinate layout."""
            gC_epi = cute.zipped_divide(gC_t, self.epi_tile)
            bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
                tma_atom_c,
                0,
                cute.make_layout(1),
                cute.group_modes(sC, 0, 2),
                gC_epi,
            )
            n_sub = cute.size(gC_epi, mode=[1])
            sub_shape = gC_epi.shape[1]
            sub_layout = cute.make_layout(sub_shape, stride=(sub_shape[1], 1))
            return bSG_sC, bSG_gC, n_sub, sub_layout

        @cute.jit
        def epi_store_subtiles(  # noqa: PLR0913
            self, epi, tRS_acc, tma_atom_c, bSG_sC, bSG_gC, n_sub: cutlass.Constexpr, sub_layout,
            group, epi_count, warp_idx, store_warp, mask_barrier,
        ):
            """Store an accumulator (``tRS_acc``: retiled by ``epi.tiled_r2s``) sub-tile by
            sub-tile (:meth:`epi_store_subtile`). Returns the advanced buffer counter."""
            for si in cutlass.range_constexpr(n_sub):
                epi_count = self.epi_store_subtile(
                    epi, tRS_acc, tma_atom_c, bSG_sC, bSG_gC, si, sub_layout, group, epi_count,
                    warp_idx, store_warp, mask_barrier,
                )
            return epi_count

        @cute.jit
        def epi_store_subtile(  # noqa: PLR0913
            self, epi, tRS_acc, tma_atom_c, bSG_sC, bSG_gC, si: cutlass.Constexpr, sub_layout,
            group, epi_count, warp_idx, store_warp, mask_barrier,
        ):
            """Store sub-tile ``si`` of an accumulator (``tRS_acc``, retiled): convert,
            stmatrix into the group's next epilogue buffer, fence + group barrier, one warp
            issues the TMA store (or reduce-add) and waits until a buffer is free again
            (``epi_stages`` stores in flight), group barrier. Returns the advanced buffer
            counter."""
            sub_size, store_pipe = epi.sub_size, epi.store_pipe
            for v in cutlass.range_constexpr(sub_size):
                epi.tRS_rC[v] = tRS_acc[si * sub_size + v]
            epi.tRS_rC_out.store(epi.tRS_rC.load().to(self.out_dtype))
            buf = (
                group * self.epi_stages
                + epi_count % self.epi_stages
            )
            cute.copy(
                epi.tiled_r2s,
                epi.tRS_rC_out,
                epi.tRS_sC[(None, None, None, buf)],
            )
            cute.arch.fence_proxy("async.shared", space="cta")
            mask_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                cute.copy(
                    tma_atom_c,
                    bSG_sC[(None, buf)],
                    bSG_gC[(None, sub_layout.get_hier_coord(si))],
                )
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            mask_barrier.arrive_and_wait()
            return epi_count + 1

        # ---- pingpong: two consumer groups take turns on the pipeline (one group: no-ops) ----

        @cute.jit
        def owns_tile(self, j, group):
            """Consumers: whether the CTA's ``j``-th tile is consumer group ``group``'s
            (pingpong: alternate tiles; one group: every tile)."""
            mine = cutlass.Boolean(True)
            if cutlass.const_expr(self.num_groups > 1):
                mine = (j % self.num_groups) == group
            return mine

        @cute.jit
        def wait_turn(self, j, group, first_barrier: cutlass.Constexpr):
            """Pingpong: before the mainloop of the CTA's ``j``-th tile (but its first), group
            ``group`` waits until the other group's mainloop is done (the pipeline's stage
            order) on named barrier ``first_barrier + group``, which the other group's
            :meth:`pass_turn` arrives at."""
            if cutlass.const_expr(self.num_groups > 1):  # noqa: SIM102
                if j > 0:
                    pipeline.NamedBarrier(
                        barrier_id=first_barrier + group, num_threads=2 * self.group_threads
                    ).arrive_and_wait()

        @cute.jit
        def pass_turn(self, group, more, first_barrier: cutlass.Constexpr):
            """Pingpong: after its mainloop, group ``group`` lets the other group's begin when
            the CTA has a tile left (``more``): it arrives at the other group's
            :meth:`wait_turn` barrier, ``first_barrier + 1 - group``."""
            if cutlass.const_expr(self.num_groups > 1):  # noqa: SIM102
                if more:
                    pipeline.NamedBarrier(
                        barrier_id=first_barrier + 1 - group, num_threads=2 * self.group_threads
                    ).arrive()

        def launch_persistent(
            self, kernel, num_ctas, stream, ctas_per_sm: int = 1, smem_carveout=None
        ) -> None:
            """Launch ``kernel`` (a ``@cute.kernel`` called on its arguments) as the persistent
            grid: ``num_ctas`` CTAs of ``threads`` threads, no cluster, the dynamic shared
            memory of ``shared_storage``, at least ``ctas_per_sm`` CTAs resident per SM
            (``smem_carveout``: the preferred shared-memory carveout in percent, None: the
            driver's choice), on ``stream``."""
            kernel.launch(
                grid=[num_ctas, 1, 1],
                block=[self.threads, 1, 1],
                cluster=None,
                smem=self.shared_storage.size_in_bytes(),
                min_blocks_per_mp=ctas_per_sm,
                preferred_smem_carveout=smem_carveout,
                stream=stream,
            )

    Sm90KernelBase.fence_accumulators = staticmethod(fence_accumulators)
    return Sm90KernelBase
