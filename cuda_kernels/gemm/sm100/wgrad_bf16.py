"""Blackwell (SM100) grouped weight-gradient kernel in CuTe DSL: compiled, NOT hardware-verified.

``Wgrad[e] = A[:, begin:end] @ B[begin:end, :]`` for every expert ``e``.

Status (read first): this kernel has been compiled offline for ``sm_100a`` (PTX checked for
tcgen05.mma, tcgen05.alloc / TMEM loads, TMA bulk-tensor copies and, where used, the per-expert
descriptor build (tensormap.replace, tensormap proxy fences), and assembled by ptxas for sm_100a
without spills) but it has NEVER RUN on a Blackwell GPU; no numerical result of it has been
checked, nor the device-built descriptors. The API may compile it, but its
launcher refuses to run unless the environment sets ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``; without
that it raises ``RuntimeError`` ("compiled but not yet verified on hardware"), and
:func:`unverified_reason` tells dispatchers to use another backend.

Operation (the cuDNN frontend's grouped-wgrad contract,
``shared/seeds/grouped_gemm_wgrad_sm100.md``; REFERENCE §1.2): for expert ``e`` with token range
``[begin, end)`` (``begin = offsets[e-1]``, 0 for ``e = 0``, ``end = offsets[e]``), the ``(M, N) =
(hidden, intermediate)`` product of ``A[:, begin:end]`` (``(M, K_e)``) and ``B[begin:end, :]``
(``(K_e, N)``) with fp32 accumulators, written (or added) in BF16, FP16 or FP32. The SM100 BF16
contract makes every ``K_e`` a multiple of 256, so with ``tile_k`` dividing 256 every K tile lies
inside one expert: no masking of rows, and an expert's first K tile index is simply ``begin /
tile_k``.

Structure (persistent: as many CTAs / 2-CTA clusters as can be resident, ``launch.resident_clusters``;
warp-specialized; the
idioms of CUTLASS's Blackwell CuTe DSL dense GEMM, written for this operation):

- warp 5 (TMA): issues TMA loads of ``(tile_m, tile_k)`` A and ``(tile_n, tile_k)`` B tiles into a
  ``stages``-deep shared-memory ring (PipelineTmaUmma: mbarrier transaction counts);
- warp 4 (MMA): issues ``tcgen05.mma`` (kind f16, BF16 in, FP32 out) with the accumulator in tensor
  memory (TMEM), two accumulator buffers so one tile's epilogue overlaps the next tile's mainloop;
  ``tile_m = 256`` uses the 2-CTA MMA (cta_group::2, a (2, 1) cluster: each CTA holds 128 rows of
  A and half of B);
- warps 0-3 (epilogue): allocate TMEM, load the accumulator (``tcgen05.ld``), convert, stage
  sub-tiles in shared memory and TMA-store them, or TMA reduce-add when ``accumulate``; dense
  outputs through one ``(M, N, E)`` descriptor, discrete outputs (an int64 pointer per expert)
  through the expert's own ``(M, N)`` descriptor (below). Only the JAX adapter, which passes no
  descriptor workspace, still stores discrete outputs from registers (loaded and added first
  when accumulating);
- per-expert TMA descriptors (discrete outputs; ``tensor_ragged`` K-major operands, whose
  per-expert row stride ``K_e`` no single descriptor can express): built on the device, in the
  descriptor workspace (``descriptor_workspace_bytes``: 128 bytes each, expert-major, at most 3
  per expert), as CUTLASS's Blackwell grouped GEMM updates its tensormaps: the TMA warp that
  first takes a tile of expert ``e`` claims the expert's flag (``atom.cas`` on a per-launch
  zeroed word after the tile counter), copies each host-encoded template descriptor into the
  expert's slot, patches in the expert's address, dims and strides (``tensormap.replace``),
  releases it (``fence.proxy.tensormap::generic.release``) and publishes the flag; every other
  warp that needs it waits for the flag (``ld.acquire``) and every user acquires the
  descriptor (``fence.proxy.tensormap::generic.acquire``) before its first TMA through it. A
  claimant builds at once, so no wait depends on a CTA that is not resident. Ragged operands
  are thus read in place: no repack, no ``(rows, S)`` index tensor;
- scheduling: tile ids run over the experts sorted by token count (largest first, sorted on the
  device from ``offsets``). 1-CTA tiles (``tile_m = 128``): dynamic persistent, as in the SM90
  kernel: the TMA warp takes the next id from a global int32 atomic counter (zeroed per launch by
  the launcher, on the launch stream) and passes it to the MMA and epilogue warps through a
  4-deep shared-memory ring, so greedy taking is LPT list scheduling and uneven experts balance.
  2-CTA tiles (``tile_m = 256``): dynamic too; both CTAs of a pair must take the same id, so the
  leader CTA's (cluster rank 0) TMA warp takes it from the counter and broadcasts it into both
  CTAs' rings (``st.async.shared::cluster`` with complete_tx on each CTA's slot mbarrier; every
  consumer thread of the pair releases the slot on the leader's mbarrier, a remote arrive), and
  the pair leaves through a cluster barrier. Cluster launch control (``try_cancel``) is not used:
  it steals not-yet-launched clusters, and the persistent grid launches all of them at once;
- every tile's token range is read from ``offsets`` on the device (no host read, CUDA-graph
  capturable); the token dimension is dynamic, so new splits never recompile;
- empty experts issue no loads and no MMAs; their tiles are written as zeros (overwrite) or left
  untouched (accumulate). Rows of other experts are never read. An expert whose range breaks the
  contract (possible only when the caller skips the host check of the offsets) gets NaN written
  (or added) instead of a silently wrong result.

Supported: A K-major or M-major, B K-major or N-major, dense ``(E, M, N)`` or discrete (pointer
per expert) output in BF16 / FP16 / FP32, overwrite or accumulate, ``input_order`` "tensor2d" and
"tensor_ragged" (K-major ragged operands through per-expert descriptors, in place; M-/N-major
ragged operands are the tensor2d memory). Dense outputs may end in partial tiles (hidden /
intermediate not multiples of the tile: TMA zero-fills the loads and clips the stores of each
expert). Not supported: clusters other
than (1, 1) for ``tile_m = 128`` and (2, 1) for ``tile_m = 256`` (no TMA multicast), partial tiles
with discrete outputs, a dynamic tile scheduler for the 2-CTA tile.

Public names (mirroring ``sm90_bf16``): ``Sm100TileConfig``, ``Sm100WgradKey``,
``select_sm100_tile_config``, ``compile_sm100_wgrad`` (cached; ``COMPILE_COUNT`` counts real
compiles), ``compile_sm100_wgrad_offline`` (PTX text for ``sm_100a`` without a GPU),
``descriptors_per_expert`` / ``descriptor_workspace_bytes``, ``unverified_reason``,
``ENABLE_ENV``. The kernel's host side is its key and kernel plugged into
``launch.KernelFamily`` (``FAMILY``: the opt-in gate, the no-token path, the SM100 compile
target, the counter's per-expert flags, the descriptor workspace and in-place ragged operands
are its hooks), which compiles, caches and launches. CuTe DSL is imported only inside the
compile functions.
"""

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

from ..keys import KernelKey
from ..launch import KernelFamily, key_of_contract
from ..tile_sched import scheduler_base
from ..tiles import SM100_TILES, rules_loader, select_tile

__all__ = [
    "COMPILE_COUNT",  # noqa: F822 - served by the module __getattr__ (FAMILY.compile_count)
    "ENABLE_ENV",
    "Sm100TileConfig",
    "Sm100WgradKey",
    "compile_sm100_wgrad",
    "compile_sm100_wgrad_offline",
    "counter_len",
    "ctas_per_sm",
    "descriptor_workspace_bytes",
    "descriptors_per_expert",
    "kernel_class",
    "load_sm100_tile_rules",
    "select_sm100_tile_config",
    "sm100_key_from_contract",
    "target_arch",
    "unavailable_reason",
    "unverified_reason",
]

#: Environment variable that must be "1" before the launcher runs the (hardware-unverified) kernel.
ENABLE_ENV = "MOE_BWD_ENABLE_UNVERIFIED_SM100"

#: Usable dynamic shared memory per CTA on B200 (CUDA programming guide, compute capability 10.0:
#: 228 KiB per SM, 227 KiB per block).
_SMEM_BYTES = SM100_TILES.smem_bytes
#: Shared memory kept for mbarriers, the TMEM pointer and the expert sort (lens + perm per expert).
_SMEM_HEADER = SM100_TILES.smem_reserved
#: Epilogue staging buffers (TMA store sub-tiles) per CTA.
_EPI_STAGES = 2
#: Depth of the tile-id ring between the scheduling (TMA) warp and the MMA / epilogue warps.
_SCHED_STAGES = 4
#: SM100 contract: expert token counts are multiples of this (api.SM100_GROUP_ALIGN).
_GROUP_ALIGN = SM100_TILES.group_align
#: One TMA descriptor (CUtensorMap) in the descriptor workspace: 128 bytes, 64-byte aligned
#: (CUDA driver API, ``CUtensorMap``: ``alignas(64)``, 16 x 64-bit words; the launcher checks
#: the workspace's alignment, ``launch.descriptor_workspace_view``).
_TMA_DESC_BYTES = 128


def unverified_reason() -> str | None:
    """Why the SM100 kernel must not run here, or None when the caller opted in.

    Returns None only when the environment sets ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``.
    """
    if os.environ.get(ENABLE_ENV) == "1":
        return None
    return (
        "the SM100 grouped wgrad kernel is compiled but not yet verified on hardware; set "
        f"{ENABLE_ENV}=1 to run it anyway (results unchecked), or use the torch / sm90 paths"
    )


def unavailable_reason() -> str | None:
    """The family's gate in ``registry.KernelProvider.unavailable``: :func:`unverified_reason`
    (automatic dispatch never picks the kernel without the opt-in; an explicit call compiles it
    and its launcher refuses to run)."""
    return unverified_reason()


@dataclasses.dataclass(frozen=True)
class Sm100TileConfig:
    """One MMA tile of the SM100 kernel (a row of ``configs/cuda/sm100_tiles.yaml``).

    Attributes (accepted values: ``tiles.SM100_TILES``):
        tile_m: output rows (hidden) per MMA tile: 128 (1-CTA tcgen05.mma) or 256 (2-CTA
            tcgen05.mma over a (2, 1) cluster, 128 rows per CTA).
        tile_n: output columns (intermediate) per MMA tile, a multiple of 32 in [32, 256].
        tile_k: tokens per pipeline stage, 64 or 128 (divides the 256-token expert alignment, so
            no K tile straddles two experts).
        stages: depth of the shared-memory ring of (A, B) tiles, >= 2 (the kernel lowers it when
            the epilogue's staging buffers need the room).

    Raises:
        ValueError: a field outside the ranges above or stages that overflow shared memory.
    """

    tile_m: int = 256
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4

    def __post_init__(self) -> None:
        SM100_TILES.check_config(self)

    @property
    def use_2cta(self) -> bool:
        """True for ``tile_m = 256``: the 2-CTA tcgen05.mma (cta_group::2)."""
        return self.tile_m == SM100_TILES.two_cta_tile_m

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        """The CTA cluster: (2, 1) for the 2-CTA MMA, else (1, 1)."""
        return SM100_TILES.cluster_for(self.tile_m)

    @property
    def cta_tile_mn(self) -> tuple[int, int]:
        """(rows, columns) of the output one CTA writes: (128, tile_n)."""
        return (128, self.tile_n)

    @property
    def stage_bytes(self) -> int:
        """Bytes of one pipeline stage in one CTA: 128 bf16 A rows plus this CTA's B rows (the
        2-CTA MMA splits B between the pair)."""
        return SM100_TILES.stage_bytes(self.tile_m, self.tile_n, self.tile_k)


@dataclasses.dataclass(frozen=True)
class Sm100WgradKey(KernelKey):
    """Static contract of one compiled SM100 kernel (the compile-cache key): the fields of
    ``keys.KernelKey`` (``accumulate``: TMA reduce-add) and the :class:`Sm100TileConfig`
    ``tile``. Dense outputs may end in partial tiles (TMA zero-fills loads and clips stores per
    expert); discrete outputs keep the rule that the tile divides hidden and intermediate: the
    JAX adapter (no descriptor workspace) still stores them from registers without predication.

    Raises:
        ValueError: a field outside its values, or hidden / intermediate that the tile does not
            divide for discrete outputs.
    """

    _TILES = SM100_TILES

    tile: Sm100TileConfig = Sm100TileConfig()


#: The rows of ``configs/cuda/sm100_tiles.yaml``, read once: ``load_sm100_tile_rules()``.
load_sm100_tile_rules = rules_loader(SM100_TILES, Sm100TileConfig)


def select_sm100_tile_config(
    hidden: int,
    intermediate: int,
    num_experts: int,
    tokens_hint: int | None = None,
    *,
    mma_tiler_mn: tuple[int, int] | None = None,
    cluster_shape_mn: tuple[int, int] | None = None,
) -> Sm100TileConfig:
    """The SM100 tile config of an ``(E, M, N)`` problem, from ``configs/cuda/sm100_tiles.yaml``
    (the arguments of every family's selector: :func:`tiles.select_tile`).

    Args:
        mma_tiler_mn: a caller's ``(tile_m, tile_n)`` instead of the rules, with ``tile_k = 64``
            and as many stages (up to 8) as shared memory holds; it need not divide hidden and
            intermediate (dense outputs end in partial tiles; :class:`Sm100WgradKey` refuses
            that for discrete outputs).
        cluster_shape_mn: None, or the cluster the tile implies: (1, 1) for tile_m 128, (2, 1)
            for tile_m 256 (the only clusters this kernel is built for).

    Returns:
        The first rule's :class:`Sm100TileConfig` whose conditions hold (or the caller's tile).

    Raises:
        ValueError: non-positive sizes; no rule fits (the file's last rule has no conditions);
            an ``mma_tiler_mn`` outside the tile rules; a ``cluster_shape_mn`` other than the
            tile's.
    """
    if mma_tiler_mn is not None and int(mma_tiler_mn[0]) not in SM100_TILES.tile_m:
        raise ValueError(
            f"select_sm100_tile_config: mma_tiler_mn={mma_tiler_mn}: tile_m must be "
            + " or ".join(str(m) for m in SM100_TILES.tile_m)
        )
    config = select_tile(
        SM100_TILES, Sm100TileConfig, load_sm100_tile_rules, hidden, intermediate, num_experts,
        mma_tiler_mn=mma_tiler_mn, who="select_sm100_tile_config",
    )
    if config is None:
        raise ValueError(
            f"select_sm100_tile_config: no rule of {SM100_TILES.yaml.name} fits "
            f"hidden={hidden}, intermediate={intermediate}"
        )
    if cluster_shape_mn is not None and tuple(cluster_shape_mn) != config.cluster_shape_mn:
        raise ValueError(
            f"select_sm100_tile_config: cluster_shape_mn={tuple(cluster_shape_mn)} unsupported "
            f"with tile_m={config.tile_m}: the SM100 kernel is built for cluster "
            f"{config.cluster_shape_mn} only"
        )
    return config


def _descriptor_slots(key: Any) -> tuple[str, ...]:
    """The per-expert TMA descriptors the kernel of ``key`` builds on the device, in slot order:
    ``"a"`` / ``"b"`` for a ``tensor_ragged`` K-major A / B (the expert's ``(rows, K_e)`` block,
    addressed in place), ``"c"`` for a discrete output (the expert's pointer)."""
    slots = []
    if key.input_order == "tensor_ragged":
        if key.a_major == "k":
            slots.append("a")
        if key.b_major == "k":
            slots.append("b")
    if key.output_mode == "discrete":
        slots.append("c")
    return tuple(slots)


def descriptors_per_expert(key: Any) -> int:
    """TMA descriptors (128 bytes each) the kernel of ``key`` builds per expert: 0 to 3 (A and B
    of ``tensor_ragged`` K-major operands, the output in discrete mode)."""
    return len(_descriptor_slots(key))


def descriptor_workspace_bytes(key: Any) -> int:
    """Bytes of descriptor workspace the kernel of ``key`` writes: ``E x descriptors_per_expert x
    128``, at most 3 descriptors per expert, within cuDNN's documented size
    (``get_grouped_gemm_wgrad_workspace_size_sm100``: 4 per expert dense, 5 discrete), so any
    buffer sized the cuDNN way holds them."""
    return key.num_experts * descriptors_per_expert(key) * _TMA_DESC_BYTES


def counter_len(key: Any) -> int:
    """Int32 words of the zeroed per-launch counter: the tile counter, then one descriptor flag
    per expert when the kernel builds descriptors."""
    return 1 + (key.num_experts if descriptors_per_expert(key) else 0)


def sm100_key_from_contract(contract: Any) -> Sm100WgradKey:
    """The :class:`Sm100WgradKey` of an ``api.WgradContract`` (tile from its ``mma_tiler_mn``,
    else from ``configs/cuda/sm100_tiles.yaml`` per shape through ``tiles.match_rule``); the
    tile is part of the key, so each rule's tile is its own compiled kernel.

    Note: ``grouped_gemm_wgrad_wrapper_sm100`` and ``grouped_gemm_wgrad_jax_sm100`` default
    ``mma_tiler_mn`` to cuDNN's (256, 256); the class, ``grouped_wgrad_into`` and
    ``grouped_gemm_wgrad`` pass None, so their contracts reach the YAML rules.

    Raises:
        ValueError: the contract is outside what :class:`Sm100WgradKey` accepts (tiles that do
            not divide the shape, unsupported clusters).
    """
    return key_of_contract(
        Sm100WgradKey, select_sm100_tile_config, contract,
        cluster_shape_mn=contract.cluster_shape_mn,
    )


# --------------------------------------------------------------------------------------------
# The kernel (CuTe DSL imported lazily)
# --------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import cute, memory, pipeline, tensor_utils
    from cutlass.cute.nvgpu import cpasync, tcgen05
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.utils.gemm import sm100 as sm100_epi

    out_types = {
        "bfloat16": cutlass.BFloat16,
        "float16": cutlass.Float16,
        "float32": cutlass.Float32,
    }

    class Sm100GroupedWgradKernel(scheduler_base()):
        """Persistent, warp-specialized tcgen05 grouped wgrad for one :class:`Sm100WgradKey`
        (the tile scheduler's ``next_tile`` / ``take_tile``: ``tile_sched.scheduler_base()``)."""

        def __init__(self, key: Sm100WgradKey):
            self.key = key
            t = key.tile
            self.use_2cta_instrs = t.use_2cta
            self.cta_group = tcgen05.CtaGroup.TWO if t.use_2cta else tcgen05.CtaGroup.ONE
            self.cluster_shape_mn = t.cluster_shape_mn
            self.cluster_m = t.cluster_shape_mn[0]
            self.mma_tiler = (t.tile_m, t.tile_n, t.tile_k)
            self.cta_tile_shape_mnk = (128, t.tile_n, t.tile_k)
            self.tile_k = t.tile_k
            self.ab_dtype = cutlass.BFloat16
            self.acc_dtype = cutlass.Float32
            self.c_dtype = out_types[key.out_dtype]
            self.c_layout = LayoutEnum.ROW_MAJOR
            self.m_tiles = key.m_tiles
            self.n_tiles = key.n_tiles
            self.tiles_per_expert = self.m_tiles * self.n_tiles
            self.num_tiles = key.num_tiles
            self.num_acc_stage = 2
            self.num_c_stage = _EPI_STAGES
            self.epilogue_warp_id = (0, 1, 2, 3)
            self.mma_warp_id = 4
            self.tma_warp_id = 5
            self.threads_per_cta = 32 * 6
            self.epilog_sync_bar_id = 1
            self.tmem_alloc_sync_bar_id = 2
            self.occupancy = 1
            self.stages = t.stages
            # Per-expert TMA descriptors, built on the device into the descriptor workspace
            # (``descriptors_per_expert``): the discrete output of each expert (its pointer), and
            # each tensor_ragged K-major operand (its (rows, K_e) block addressed in place).
            # Without a workspace (the JAX adapter, tensor2d only) discrete outputs are stored
            # from registers instead; ``__call__`` settles that.
            desc = _descriptor_slots(key)
            self.desc_a = "a" in desc
            self.desc_b = "b" in desc
            self.desc_c = "c" in desc
            self.num_desc = len(desc)
            # TMA store epilogue: dense outputs, and discrete ones with per-expert descriptors
            self.tma_epi = key.output_mode == "dense" or self.desc_c
            # dynamic persistent scheduling (a global atomic tile counter, as the SM90 kernel).
            # One CTA (``dynamic``): its TMA warp takes the ids and rings them to its own warps.
            # A (2, 1) cluster (``cluster_sched``): both CTAs of a pair must take the same id, so
            # the leader's TMA warp takes it and broadcasts it into both CTAs' rings
            # (``st.async`` to the peer's shared memory, completing the slot's mbarrier).
            self.dynamic = not t.use_2cta
            self.cluster_sched = t.use_2cta
            # TMA warp: slice the tile's global views before (True) or after (False) the
            # per-expert descriptor work; either is correct, each kernel keeps the order its
            # generated code was verified with (the emitted instruction order follows it)
            self.tile_views_first = True

        def make_tiled_mma(self, a_major_mode, b_major_mode):
            """The tcgen05 MMA of the kernel (BF16 inputs, fp32 accumulator)."""
            return sm100_utils.make_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                a_major_mode,
                b_major_mode,
                self.acc_dtype,
                self.cta_group,
                self.mma_tiler[:2],
            )

        #: what the "no room for 2 pipeline stages" error adds
        _no_room_detail = " with its epilogue"

        def _setup(self, a_major_mode, b_major_mode):
            """The MMA, the cluster layout, the epilogue tile and the staged shared-memory
            layouts (as many stages as fit, at most ``stages``), the TMEM columns."""
            tiled_mma = self.make_tiled_mma(a_major_mode, b_major_mode)
            self.cluster_layout_vmnk = cute.tiled_divide(
                cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma.thr_id.shape,)
            )
            self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
                self.cta_tile_shape_mnk, self.use_2cta_instrs, self.c_layout, self.c_dtype
            )
            c_one = sm100_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 1)
            c_bytes = cute.size_in_bytes(self.c_dtype, c_one) * self.num_c_stage
            if not self.tma_epi:
                c_bytes = 0  # discrete outputs without a workspace: stored from registers
            a_one = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
            b_one = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, 1)
            stage_bytes = (
                cute.size_in_bytes(self.ab_dtype, a_one)
                + cute.size_in_bytes(self.ab_dtype, b_one)
                + self.extra_stage_bytes(tiled_mma)
            )
            header = _SMEM_HEADER + 8 * self.key.num_experts
            fit = (_SMEM_BYTES - header - c_bytes) // stage_bytes
            self.num_ab_stage = min(self.stages, fit)
            if self.num_ab_stage < 2:
                raise ValueError(
                    f"{self.key.tile} leaves no room for 2 pipeline stages{self._no_room_detail}"
                )
            self.a_smem_layout_staged = sm100_utils.make_smem_layout_a(
                tiled_mma, self.mma_tiler, self.ab_dtype, self.num_ab_stage
            )
            self.b_smem_layout_staged = sm100_utils.make_smem_layout_b(
                tiled_mma, self.mma_tiler, self.ab_dtype, self.num_ab_stage
            )
            self.setup_extra_layouts(tiled_mma)
            self.c_smem_layout_staged = sm100_utils.make_smem_layout_epi(
                self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage
            )
            self.num_tmem_alloc_cols = self.tmem_alloc_cols(tiled_mma)
            return tiled_mma

        def extra_stage_bytes(self, tiled_mma):
            """Hook: shared-memory bytes a stage holds beyond A and B (0: none)."""
            return 0

        def setup_extra_layouts(self, tiled_mma):
            """Hook: staged shared-memory layouts beyond A, B and the output (none)."""

        def tmem_alloc_cols(self, tiled_mma):
            """TMEM columns to allocate: the two fp32 accumulators."""
            acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
            acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
            return memory.get_num_tmem_alloc_cols(acc_fake, arch="sm_100")

        def make_ab_load_atoms(self, tiled_mma, mA, mB):
            """The TMA load atoms (and TMA views) of A and B (multicast along the cluster), the
            A atom's op (the scales of A share it) and the bytes of one stage of A and B."""
            a_op = sm100_utils.cluster_shape_to_tma_atom_A(
                self.cluster_shape_mn, tiled_mma.thr_id
            )
            a_smem_one = cute.slice_(self.a_smem_layout_staged, (None, None, None, 0))
            tma_atom_a, tma_a = cute.nvgpu.make_tiled_tma_atom_A(
                a_op, mA, a_smem_one, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
            )
            b_op = sm100_utils.cluster_shape_to_tma_atom_B(
                self.cluster_shape_mn, tiled_mma.thr_id
            )
            b_smem_one = cute.slice_(self.b_smem_layout_staged, (None, None, None, 0))
            tma_atom_b, tma_b = cute.nvgpu.make_tiled_tma_atom_B(
                b_op, mB, b_smem_one, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
            )
            ab_bytes = cute.size_in_bytes(self.ab_dtype, a_smem_one) + cute.size_in_bytes(
                self.ab_dtype, b_smem_one
            )
            return tma_atom_a, tma_a, tma_atom_b, tma_b, a_op, ab_bytes

        def make_store_atom(self, mOut, mDesc):
            """The TMA store (reduce-add when accumulating) atom of the output and its view:
            the stacked (M, N, E) dense output, or with per-expert descriptors a template
            (M, N, 1) descriptor: each expert's copy in the workspace gets its own base address
            on the device (``build_descriptors``); the template's address (the 64-byte aligned
            workspace) is never accessed through it."""
            m, n, e = self.key.hidden, self.key.intermediate, self.key.num_experts
            if self.desc_c:
                mC_mne = cute.make_tensor(
                    cute.recast_ptr(mDesc.iterator, dtype=self.c_dtype),
                    cute.make_layout((m, n, 1), stride=(n, 1, m * n)),
                )
            else:
                mC_mne = cute.make_tensor(
                    mOut.iterator, cute.make_layout((m, n, e), stride=(n, 1, m * n))
                )
            store_op = cpasync.CopyBulkTensorTileS2GOp()
            if self.key.accumulate:
                store_op = cpasync.CopyReduceBulkTensorTileS2GOp()
            epi_smem_one = cute.select(self.c_smem_layout_staged, mode=[0, 1])
            return cpasync.make_tiled_tma_atom(store_op, mC_mne, epi_smem_one, self.epi_tile)

        def make_shared_storage(self):
            """The kernel's shared-memory header: the rings' mbarriers, the TMEM handshake, the
            expert sort (lengths, order) and the tile-id ring."""

            @cute.struct
            class SharedStorage:
                ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
                acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
                tmem_dealloc_mbar: cutlass.Int64
                tmem_holding_buf: cutlass.Int32
                lens: cute.struct.MemRange[cutlass.Int32, self.key.num_experts]
                perm: cute.struct.MemRange[cutlass.Int32, self.key.num_experts]
                sched_mbar: cute.struct.MemRange[cutlass.Int64, _SCHED_STAGES * 2]
                sched: cute.struct.MemRange[cutlass.Int32, _SCHED_STAGES]

            return SharedStorage

        def launch_kernel(self, kernel, num_clusters, stream):
            """Launch the persistent grid (``num_clusters`` clusters) of ``kernel``."""
            kernel.launch(
                grid=[num_clusters * self.cluster_m, 1, 1],
                block=[self.threads_per_cta, 1, 1],
                cluster=(*self.cluster_shape_mn, 1),
                min_blocks_per_mp=1,
                stream=stream,
            )

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (M, S) bf16
            mB: cute.Tensor,  # (N, S) bf16 (B transposed view)
            mOffsets: cute.Tensor,  # (E,) int32
            mOut: cute.Tensor,  # (E, M, N) dense
            mCounter: cute.Tensor,  # (1,) int32 zeroed at launch: the tile counter; (1 + E,)
            # with descriptors: then [1 + e] is expert e's descriptor flag (0 / 1 building / 2)
            num_clusters: cutlass.Int32,
            stream,
            mDesc: cute.Tensor = None,  # (16 * slots,) int64, 64-byte aligned: the workspace
        ):
            if cutlass.const_expr(mDesc is None):
                # no descriptor workspace (the JAX adapter: tensor2d, discrete from registers)
                if cutlass.const_expr(self.desc_a or self.desc_b):
                    raise ValueError(
                        "tensor_ragged K-major operands need the descriptor workspace"
                    )
                self.desc_c = False
                self.num_desc = 0
                self.tma_epi = self.key.output_mode == "dense"
            a_major_mode = LayoutEnum.from_tensor(mA).mma_major_mode()
            b_major_mode = LayoutEnum.from_tensor(mB).mma_major_mode()
            tiled_mma = self._setup(a_major_mode, b_major_mode)
            atom_thr_size = cute.size(tiled_mma.thr_id.shape)

            tma_atom_a, tma_a, tma_atom_b, tma_b, _a_op, ab_bytes = self.make_ab_load_atoms(
                tiled_mma, mA, mB
            )
            self.num_tma_load_bytes = ab_bytes * atom_thr_size

            tma_atom_c, tma_c = tma_atom_a, mOut  # discrete without workspace: registers
            if cutlass.const_expr(self.tma_epi):
                tma_atom_c, tma_c = self.make_store_atom(mOut, mDesc)

            self.shared_storage = self.make_shared_storage()
            kernel = self.kernel(
                tiled_mma,
                tma_atom_a,
                tma_a,
                tma_atom_b,
                tma_b,
                tma_atom_c,
                tma_c,
                mOffsets,
                mCounter,
                mA,
                mB,
                mOut,
                mDesc if cutlass.const_expr(mDesc is not None) else mOffsets,
                self.cluster_layout_vmnk,
                self.a_smem_layout_staged,
                self.b_smem_layout_staged,
                self.c_smem_layout_staged,
                self.epi_tile,
            )
            self.launch_kernel(kernel, num_clusters, stream)

        @cute.jit
        def publish_tile(self, mCounter, lane, sched_pipe, sched_state, sSched):
            """Leader CTA's scheduling (TMA) warp, (2, 1) cluster: take the next tile id from
            the global counter (lane 0) and broadcast it into slot ``sched_state`` of both CTAs'
            rings. Lane ``r`` < 2 arms CTA ``r``'s full mbarrier (arrive + expect 4 bytes) and
            stores the id there with ``st.async.shared::cluster``, whose completion (complete_tx)
            fills the slot; the slot is free again once every consumer thread of both CTAs has
            arrived on the leader's empty mbarrier (``take_tile``). Every warp of both CTAs,
            this one included, reads the id back with ``take_tile``."""
            t = self.claim_tile(mCounter, lane)
            sched_pipe.producer_acquire(sched_state)
            if lane < self.cluster_m:
                cute.arch.store_async_dsmem(
                    sSched.iterator + sched_state.index,
                    t,
                    sched_pipe.producer_get_barrier(sched_state),
                    lane,
                )

        @cute.jit
        def tile_coords(self, tile: cutlass.Int32, sPerm: cute.Tensor, mOffsets: cute.Tensor):
            """(expert, m_idx, n_idx, first K tile, K tiles, bad) of MMA tile id ``tile``. Ids
            run over the experts sorted by token count (largest first), m fastest within an
            expert. ``bad``: the expert's range breaks the contract (decreasing offsets, or a
            begin / length not a multiple of tile_k, a begin below 0 or an end past tokens_sum,
            possible only when the caller skipped the host validation); it then gets no K tiles
            and its output is poisoned with NaN."""
            rank_e = tile // self.tiles_per_expert
            e = sPerm[rank_e]
            rem = tile - rank_e * self.tiles_per_expert
            n_idx = rem // self.m_tiles
            m_idx = rem - n_idx * self.m_tiles
            k_end = mOffsets[e]
            k_begin = cutlass.Int32(0)
            if e > 0:
                k_begin = mOffsets[e - 1]
            k_len = k_end - k_begin
            bad = cutlass.Boolean(False)
            if k_len < 0:
                bad = cutlass.Boolean(True)
            # the range must lie inside the operands (0 <= begin, end <= tokens_sum): a
            # per-expert descriptor of a range outside them would declare memory beyond the
            # allocation (TMA zero-fills only past the declared dims: docs/sm100-tma-bounds.md)
            if k_begin < 0:
                bad = cutlass.Boolean(True)
            if k_end > self.tokens_sum:
                bad = cutlass.Boolean(True)
            if k_begin % self.tile_k != 0:
                bad = cutlass.Boolean(True)
            if k_len % self.tile_k != 0:
                bad = cutlass.Boolean(True)
            n_k = k_len // self.tile_k
            if bad:
                n_k = cutlass.Int32(0)
            return e, m_idx, n_idx, k_begin // self.tile_k, n_k, bad

        def desc_ptr(self, mDesc, e, slot: int, space=None):
            """Pointer to expert ``e``'s descriptor ``slot`` (its index in
            ``_descriptor_slots``) in the workspace: 128 bytes (16 int64) per descriptor,
            ``num_desc`` per expert, expert-major. ``space``: None for the gmem pointer that
            tensormap.replace / the fences take, ``generic`` for the TMA copies."""
            p = mDesc.iterator + (e * self.num_desc + slot) * (_TMA_DESC_BYTES // 8)
            tm = tensor_utils.TensorMapManager(
                tensor_utils.TensorMapUpdateMode.GMEM, _TMA_DESC_BYTES
            )
            if space is None:
                return tm.get_tensormap_ptr(p)
            return tm.get_tensormap_ptr(p, space)

        @cute.jit
        def init_descriptor(self, tm, tma_atom, mDesc, e, slot: int):
            """Copy ``tma_atom``'s host-encoded descriptor (the template) into expert ``e``'s
            ``slot`` and return the slot's pointer. The DSL's copy moves the descriptor's first
            64 bytes; one lane zeroes the other 64 of the 128-byte slot, so that no byte of it
            is left from an earlier use of the workspace."""
            ptr = self.desc_ptr(mDesc, e, slot)
            tm.init_tensormap_from_atom(tma_atom, ptr, self.tma_warp_id)
            base = (e * self.num_desc + slot) * (_TMA_DESC_BYTES // 8)
            with cute.arch.elect_one():
                for w in cutlass.range_constexpr(_TMA_DESC_BYTES // 16, _TMA_DESC_BYTES // 8):
                    mDesc[base + w] = cutlass.Int64(0)
            cute.arch.sync_warp()
            tm.fence_tensormap_initialization()
            return ptr

        @cute.jit
        def build_descriptors(
            self, e, k_begin, n_k, mA_g, mB_g, mPtrs, mDesc, tma_atom_a, tma_atom_b, tma_atom_c
        ):
            """One warp writes expert ``e``'s descriptors into the workspace: each is the
            host-encoded template of its TMA atom (copied by one lane), then the expert's base
            address, shape and strides patched in (``tensormap.replace``, the whole warp), then
            released to the tensormap proxy (``fence.proxy.tensormap::generic.release.gpu``).
            The output's (discrete) always; the ragged operands' only when the expert has K
            tiles (a TMA box needs a non-empty tensor, and an empty expert loads nothing)."""
            warp = self.tma_warp_id
            tm = tensor_utils.TensorMapManager(
                tensor_utils.TensorMapUpdateMode.GMEM, _TMA_DESC_BYTES
            )
            m, n = self.key.hidden, self.key.intermediate
            k_len = n_k * self.tile_k
            off_a = cutlass.Int64(k_begin) * m  # expert e's (M, K_e) block, element offset
            off_b = cutlass.Int64(k_begin) * n
            if cutlass.const_expr(self.desc_a):
                if n_k > 0:
                    ptr = self.init_descriptor(tm, tma_atom_a, mDesc, e, 0)
                    a_e = cute.make_tensor(
                        mA_g.iterator + off_a, cute.make_layout((m, k_len), stride=(k_len, 1))
                    )
                    tm.update_tensormap((a_e,), (tma_atom_a,), (ptr,), warp, (None,))
            if cutlass.const_expr(self.desc_b):
                if n_k > 0:
                    ptr = self.init_descriptor(tm, tma_atom_b, mDesc, e, int(self.desc_a))
                    b_e = cute.make_tensor(
                        mB_g.iterator + off_b, cute.make_layout((n, k_len), stride=(k_len, 1))
                    )
                    tm.update_tensormap((b_e,), (tma_atom_b,), (ptr,), warp, (None,))
            if cutlass.const_expr(self.desc_c):
                ptr = self.init_descriptor(tm, tma_atom_c, mDesc, e, self.num_desc - 1)
                c_e = cute.make_tensor(
                    cute.make_ptr(
                        self.c_dtype, mPtrs[e], cute.AddressSpace.gmem, assumed_align=16
                    ),
                    cute.make_layout((m, n, 1), stride=(n, 1, m * n)),
                )
                tm.update_tensormap((c_e,), (tma_atom_c,), (ptr,), warp, (None,))

        @cute.jit
        def ensure_descriptors(
            self, e, k_begin, n_k, lane, mCounter, mA_g, mB_g, mPtrs, mDesc,
            tma_atom_a, tma_atom_b, tma_atom_c,
        ):
            """TMA warp, for each tile it takes: expert ``e``'s descriptors exist once this
            returns. The first warp (of any CTA) that needs them claims the expert's flag
            (``mCounter[1 + e]``: 0 -> 1, ``atom.cas`` acq_rel), builds them and publishes
            (flag 2, release); every other warp spins on the flag (ld.acquire). A claimant
            builds at once, waiting on nothing, so no spin can wait on a CTA that is not
            resident. The caller still acquires each descriptor for the tensormap proxy
            (``fence.proxy.tensormap::generic.acquire``) before a TMA uses it."""
            flag = mCounter.iterator + 1 + e
            state = cutlass.Int32(0)
            if lane == 0:
                state = cute.arch.atomic_cas(
                    flag, cmp=cutlass.Int32(0), val=cutlass.Int32(1), sem="acq_rel", scope="gpu"
                )
            state = cute.arch.shuffle_sync(state, 0)
            if state == 0:
                self.build_descriptors(
                    e, k_begin, n_k, mA_g, mB_g, mPtrs, mDesc, tma_atom_a, tma_atom_b,
                    tma_atom_c,
                )
                if lane == 0:
                    cute.arch.atomic_exch(flag, cutlass.Int32(2), sem="release", scope="gpu")
            else:
                self.wait_descriptors(e, lane, mCounter)
            cute.arch.sync_warp()

        @cute.jit
        def wait_descriptors(self, e, lane, mCounter):
            """Lane 0 spins until expert ``e``'s descriptors are published (flag 2, ld.acquire
            at gpu scope); the warp then proceeds together."""
            if lane == 0:
                flag = mCounter.iterator + 1 + e
                state = cute.arch.load(flag, cutlass.Int32, sem="acquire", scope="gpu")
                while state != 2:
                    state = cute.arch.load(flag, cutlass.Int32, sem="acquire", scope="gpu")
            cute.arch.sync_warp()

        def expert_c(self, ptr_int, thr_mma):
            """This CTA's ((MMA_M), (MMA_N), RestM, RestN, 1) view of one discrete (M, N) row-major
            output at address ``ptr_int`` (16-byte aligned; traced inline, not a device call)."""
            m, n = self.key.hidden, self.key.intermediate
            ptr = cute.make_ptr(self.c_dtype, ptr_int, cute.AddressSpace.gmem, assumed_align=16)
            mC_e = cute.make_tensor(ptr, cute.make_layout((m, n, 1), stride=(n, 1, m * n)))
            tile_mn = cute.slice_(self.mma_tiler, (None, None, 0))
            gC_e = cute.local_tile(mC_e, tile_mn, (None, None, None))
            return sm100_epi.transform_partitioned_tensor_layout(thr_mma.partition_C(gC_e))

        def prefetch_descriptors(self, tma_atom_a, tma_atom_b, tma_atom_c, extra_atoms=()):
            """TMA warp: prefetch the kernel-parameter descriptors it uses (not the per-expert
            ones in the workspace): A's, B's, then ``extra_atoms``', then the output's."""
            if not self.desc_a:
                cpasync.prefetch_descriptor(tma_atom_a)
            if not self.desc_b:
                cpasync.prefetch_descriptor(tma_atom_b)
            for atom in extra_atoms:
                cpasync.prefetch_descriptor(atom)
            if self.tma_epi and not self.desc_c:
                cpasync.prefetch_descriptor(tma_atom_c)

        def allocate_ab(self, smem, a_smem_layout_staged, b_smem_layout_staged):
            """The staged A and B tiles in shared memory (swizzled, 128-byte aligned)."""
            sA = smem.allocate_tensor(
                element_type=self.ab_dtype,
                layout=a_smem_layout_staged.outer,
                byte_alignment=128,
                swizzle=a_smem_layout_staged.inner,
            )
            sB = smem.allocate_tensor(
                element_type=self.ab_dtype,
                layout=b_smem_layout_staged.outer,
                byte_alignment=128,
                swizzle=b_smem_layout_staged.inner,
            )
            return sA, sB

        def allocate_c(self, smem, c_smem_layout_staged):
            """The epilogue's staged output sub-tiles (None without a TMA-store epilogue)."""
            sC = None
            if self.tma_epi:
                sC = smem.allocate_tensor(
                    element_type=self.c_dtype,
                    layout=c_smem_layout_staged.outer,
                    byte_alignment=128,
                    swizzle=c_smem_layout_staged.inner,
                )
            return sC

        def partition_ab(self, thr_mma, mA_mk, mB_nk):
            """This CTA's MMA partitions of the global A (bM, bK, RestM, RestK) and
            B (bN, bK, RestN, RestK) tiles: (MMA, MMA_M, MMA_K, RestM, RestK) and
            (MMA, MMA_N, MMA_K, RestN, RestK)."""
            gA = cute.local_tile(
                mA_mk, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None)
            )
            gB = cute.local_tile(
                mB_nk, cute.slice_(self.mma_tiler, (0, None, None)), (None, None)
            )
            return thr_mma.partition_A(gA), thr_mma.partition_B(gB)

        def partition_c(self, thr_mma, mC):
            """The MMA partition (MMA, MMA_M, MMA_N, RestM, RestN, E) of the output's
            (bM, bN, RestM, RestN, E) tiles (None without a TMA-store epilogue)."""
            tCgC = None
            if self.tma_epi:
                gC = cute.local_tile(
                    mC, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)
                )
                tCgC = thr_mma.partition_C(gC)
            return tCgC

        def cta_layouts(self, cluster_layout_vmnk):
            """The cluster's CTA layouts along which A (and its scales) / B are multicast."""
            a_cta_layout = cute.make_layout(
                cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape
            )
            b_cta_layout = cute.make_layout(
                cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape
            )
            return a_cta_layout, b_cta_layout

        def tma_partition(self, tma_atom, cta_coord, cta_layout, sX, tCgX):
            """(smem, gmem) TMA partitions of one staged operand and its MMA-partitioned
            global tiles."""
            return cpasync.tma_partition(
                tma_atom,
                cta_coord,
                cta_layout,
                cute.group_modes(sX, 0, 3),
                cute.group_modes(tCgX, 0, 3),
            )

        def mma_fragments(self, tiled_mma, sA, sB):
            """The MMA's A / B smem descriptors (MMA, MMA_M|N, MMA_K, STAGE) and the layout of
            the staged TMEM accumulators."""
            tCrA = tiled_mma.make_fragment_A(sA)
            tCrB = tiled_mma.make_fragment_B(sB)
            acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
            tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
            return tCrA, tCrB, tCtAcc_fake

        @cute.jit
        def make_pipelines(self, storage, cluster_layout_vmnk, use_2cta):
            """The A/B stage ring (TMA -> MMA), the accumulator ring (MMA -> epilogue), the
            tile-id ring of the dynamic scheduler, and the TMEM allocator; then the cluster-wide
            init arrive (``sort_experts`` waits for it)."""
            ab_pipe = pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.ab_mbar.data_ptr(),
                num_stages=self.num_ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                tx_count=self.num_tma_load_bytes,
                cta_layout_vmnk=cluster_layout_vmnk,
                defer_sync=True,
            )
            acc_consumers = len(self.epilogue_warp_id) * (2 if use_2cta else 1)
            acc_pipe = pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.acc_mbar.data_ptr(),
                num_stages=self.num_acc_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, acc_consumers),
                cta_layout_vmnk=cluster_layout_vmnk,
                defer_sync=True,
            )
            # Dynamic tile scheduler: the (leader) TMA warp takes tile ids from the global
            # atomic counter and passes them to the MMA warp and the epilogue warps through a
            # small shared-memory ring (every thread of those warps waits and releases).
            if cutlass.const_expr(self.cluster_sched):
                # (2, 1) cluster: the leader broadcasts each id into both CTAs' rings (one
                # st.async of 4 bytes per CTA); the consumers are every thread of the TMA, MMA
                # and epilogue warps of both CTAs, arriving on the leader's empty mbarrier.
                sched_pipe = pipeline.PipelineClcFetchAsync.create(
                    barrier_storage=storage.sched_mbar.data_ptr(),
                    num_stages=_SCHED_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread,
                        32 * (2 + len(self.epilogue_warp_id)) * self.cluster_m,
                    ),
                    tx_count=4,
                    cta_layout_vmnk=cluster_layout_vmnk,
                    defer_sync=True,
                )
            else:
                sched_pipe = pipeline.PipelineAsync.create(
                    barrier_storage=storage.sched_mbar.data_ptr(),
                    num_stages=_SCHED_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                    consumer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, 32 * (1 + len(self.epilogue_warp_id))
                    ),
                    defer_sync=True,
                )
            sSched = storage.sched.get_tensor(cute.make_layout(_SCHED_STAGES))
            tmem_alloc_barrier = pipeline.NamedBarrier(
                barrier_id=self.tmem_alloc_sync_bar_id,
                num_threads=32 * (1 + len(self.epilogue_warp_id)),
            )
            tmem = memory.TmemAllocator(
                storage.tmem_holding_buf.ptr,
                barrier_for_retrieve=tmem_alloc_barrier,
                allocator_warp_id=self.epilogue_warp_id[0],
                is_two_cta=use_2cta,
                two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
            )
            pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)
            return ab_pipe, acc_pipe, sched_pipe, sSched, tmem

        @cute.jit
        def tma_warp(
            self, ab_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mA_g, mB_g, mPtrs,
            mDesc, tma_atom_a, tAgA, tAsA, a_mcast_mask, tma_atom_b, tBgB, tBsB, b_mcast_mask,
            tma_atom_c, cta_rank_in_cluster, cluster_id, extra=None,
        ):
            """The TMA (scheduling) warp: takes the tile ids (``next_tile`` / ``publish_tile``),
            ensures each expert's per-expert descriptors, and loads the A / B tiles of every K
            tile into the stage ring; ``extra`` (None here) is what the subclass's
            ``tma_tile_extra`` / ``tma_stage_extra`` load on the same stage mbarrier."""
            prod_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_ab_stage
            )
            lane = cute.arch.lane_idx()
            sched_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, _SCHED_STAGES
            )
            sched_cstate = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, _SCHED_STAGES
            )
            is_sched_leader = cta_rank_in_cluster == 0
            tile = cluster_id
            if cutlass.const_expr(self.dynamic):
                tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                sched_state.advance()
            if cutlass.const_expr(self.cluster_sched):
                if is_sched_leader:
                    self.publish_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                sched_state.advance()
                tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                sched_cstate.advance()
            last_e = cutlass.Int32(-1)
            while tile < self.num_tiles:
                e, m_idx, n_idx, k0, n_k, _bad = self.tile_coords(tile, sPerm, mOffsets)
                if cutlass.const_expr(self.tile_views_first):
                    tAgA_t, tBgB_t, extra_t = self.tma_tile_views(tAgA, tBgB, extra, m_idx, n_idx)
                # per-expert descriptors address the expert's operand from its first token
                k0_a = k0
                k0_b = k0
                desc_a = None
                desc_b = None
                if cutlass.const_expr(self.desc_a):
                    k0_a = cutlass.Int32(0)
                    desc_a = self.desc_ptr(mDesc, e, 0, cute.AddressSpace.generic)
                if cutlass.const_expr(self.desc_b):
                    k0_b = cutlass.Int32(0)
                    desc_b = self.desc_ptr(
                        mDesc, e, int(self.desc_a), cute.AddressSpace.generic
                    )
                if cutlass.const_expr(self.num_desc > 0):
                    if e != last_e:
                        self.ensure_descriptors(
                            e, k0 * self.tile_k, n_k, lane, mCounter, mA_g, mB_g, mPtrs,
                            mDesc, tma_atom_a, tma_atom_b, tma_atom_c,
                        )
                        if n_k > 0:
                            if cutlass.const_expr(self.desc_a):
                                cpasync.fence_tma_desc_acquire(self.desc_ptr(mDesc, e, 0))
                            if cutlass.const_expr(self.desc_b):
                                cpasync.fence_tma_desc_acquire(
                                    self.desc_ptr(mDesc, e, int(self.desc_a))
                                )
                        last_e = e
                if cutlass.const_expr(not self.tile_views_first):
                    tAgA_t, tBgB_t, extra_t = self.tma_tile_views(tAgA, tBgB, extra, m_idx, n_idx)
                for kt in cutlass.range(n_k, unroll=1):
                    ab_pipe.producer_acquire(prod_state)
                    bar = ab_pipe.producer_get_barrier(prod_state)
                    cute.copy(
                        tma_atom_a,
                        tAgA_t[(None, k0_a + kt)],
                        tAsA[(None, prod_state.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=a_mcast_mask,
                        tma_desc_ptr=desc_a,
                    )
                    cute.copy(
                        tma_atom_b,
                        tBgB_t[(None, k0_b + kt)],
                        tBsB[(None, prod_state.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=b_mcast_mask,
                        tma_desc_ptr=desc_b,
                    )
                    self.tma_stage_extra(extra_t, k0 + kt, prod_state.index, bar)
                    ab_pipe.producer_commit(prod_state)
                    prod_state.advance()
                if cutlass.const_expr(self.dynamic):
                    tile = self.next_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                    sched_state.advance()
                else:
                    if is_sched_leader:
                        self.publish_tile(mCounter, lane, sched_pipe, sched_state, sSched)
                    sched_state.advance()
                    tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                    sched_cstate.advance()
            ab_pipe.producer_tail(prod_state)

        def tma_tile_views(self, tAgA, tBgB, extra, m_idx, n_idx):
            """TMA warp, per tile: the tile's A / B global views (all K tiles) and
            ``tma_tile_extra``'s."""
            tAgA_t = tAgA[(None, m_idx, None)]
            tBgB_t = tBgB[(None, n_idx, None)]
            return tAgA_t, tBgB_t, self.tma_tile_extra(extra, m_idx, n_idx)

        def tma_tile_extra(self, extra, m_idx, n_idx):
            """Hook (TMA warp, per tile): the tile's views of the ``extra`` operands loaded
            with each stage. None: the BF16 kernel loads only A and B."""
            return None

        def tma_stage_extra(self, extra_t, k, stage, bar):
            """Hook (TMA warp, per K tile ``k``): extra TMA loads into ring slot ``stage`` on
            the stage's mbarrier ``bar``, after A and B. Nothing for the BF16 kernel."""

        @cute.jit
        def mma_warp(
            self, tiled_mma, tmem, tCtAcc_fake, tCrA, tCrB, ab_pipe, acc_pipe, sched_pipe,
            sSched, sPerm, mOffsets, is_leader_cta, extra=None,
        ):
            """The MMA warp: for each tile with K tiles, accumulate every stage into the next
            TMEM accumulator (the leader CTA issues the 2-CTA MMAs) and hand it to the
            epilogue. Hooks for what a subclass adds: ``mma_extra_setup`` (once),
            ``mma_stage_extra`` (per stage, after its wait) and ``mma_kblock_extra`` (before
            each MMA instruction); ``extra`` (None here) is passed to ``mma_extra_setup``."""
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            mma_extra = self.mma_extra_setup(tiled_mma, tmem_ptr, extra)
            cons_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_ab_stage
            )
            acc_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_acc_stage
            )
            num_kblocks = cute.size(tCrA, mode=[2])
            sched_cstate = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, _SCHED_STAGES
            )
            tile = self.take_tile(sched_pipe, sched_cstate, sSched)
            sched_cstate.advance()
            while tile < self.num_tiles:
                _e, _m, _n, _k0, n_k, _bad = self.tile_coords(tile, sPerm, mOffsets)
                if n_k > 0:
                    tCtAcc = tCtAcc_base[(None, None, None, acc_state.index)]
                    if is_leader_cta:
                        acc_pipe.producer_acquire(acc_state)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                    for _kt in cutlass.range(n_k, unroll=1):
                        if is_leader_cta:
                            ab_pipe.consumer_wait(cons_state)
                            self.mma_stage_extra(mma_extra, cons_state.index)
                            for kb in cutlass.range(num_kblocks, unroll_full=True):
                                crd = (None, None, kb, cons_state.index)
                                self.mma_kblock_extra(tiled_mma, mma_extra, kb)
                                cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                            ab_pipe.consumer_release(cons_state)
                        cons_state.advance()
                    if is_leader_cta:
                        acc_pipe.producer_commit(acc_state)
                    acc_state.advance()
                tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                sched_cstate.advance()
            acc_pipe.producer_tail(acc_state)

        def mma_extra_setup(self, tiled_mma, tmem_ptr, extra):
            """Hook (MMA warp, once): state for the other MMA hooks. None for the BF16 kernel."""
            return None

        def mma_stage_extra(self, mma_extra, stage):
            """Hook (MMA warp, per stage ``stage`` once it is full). Nothing for the BF16 kernel."""

        def mma_kblock_extra(self, tiled_mma, mma_extra, kb):
            """Hook (MMA warp, before the MMA of k-block ``kb``). Nothing for the BF16 kernel."""

        @cute.jit
        def epilogue_warps(
            self, tidx, warp_idx, tmem, tCtAcc_fake, tCgC, thr_mma, sC, epi_tile, tma_atom_c,
            mC, acc_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mDesc, extra=None,
        ):
            """The epilogue warps (they also allocate and free the TMEM): for each tile, the
            accumulator (zeros for an empty expert, NaN for a contract breach) through
            registers into the output: staged in shared memory and TMA-stored (reduce-add when
            accumulating), or, discrete without a descriptor workspace, stored from registers.
            Hooks: ``epi_tile_scale`` (per tile, from ``extra``; None here) and ``epi_scale``
            (the fp32 accumulator values before the conversion)."""
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)

            tCtAcc_mn = sm100_epi.transform_partitioned_tensor_layout(tCtAcc_base)
            if cutlass.const_expr(self.tma_epi):
                tCgC_mn = sm100_epi.transform_partitioned_tensor_layout(tCgC)
            else:
                tCgC_mn = self.expert_c(mC[0], thr_mma)  # shapes only
            tiled_t2r, tTR_tAcc_base, tTR_rAcc = sm100_epi.epilogue_tmem_copy_and_partition(
                self, tidx, tCtAcc_mn, tCgC_mn, epi_tile, self.use_2cta_instrs
            )
            thr_t2r = tiled_t2r.get_slice(tidx)
            tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            tTR_rOld = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
            epi_barrier = pipeline.NamedBarrier(
                barrier_id=self.epilog_sync_bar_id,
                num_threads=32 * len(self.epilogue_warp_id),
            )
            if cutlass.const_expr(self.tma_epi):
                tiled_r2s, tRS_rC, tRS_sC = sm100_epi.epilogue_smem_copy_and_partition(
                    self, tiled_t2r, tTR_rC, tidx, sC
                )
                tCgC_epi = cute.flat_divide(tCgC_mn, epi_tile)
                bSG_sC, bSG_gC_all = cpasync.tma_partition(
                    tma_atom_c,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sC, 0, 2),
                    cute.group_modes(tCgC_epi, 0, 2),
                )
                c_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.num_c_stage,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, 32 * len(self.epilogue_warp_id)
                    ),
                )
            acc_cstate = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stage
            )
            epi_count = cutlass.Int32(0)
            sched_cstate = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, _SCHED_STAGES
            )
            tile = self.take_tile(sched_pipe, sched_cstate, sSched)
            sched_cstate.advance()
            epi_last_e = cutlass.Int32(-1)
            while tile < self.num_tiles:
                e, m_idx, n_idx, _k0, n_k, bad = self.tile_coords(tile, sPerm, mOffsets)
                e_c = e  # the output's expert coordinate: 0 with per-expert descriptors
                desc_c = None
                if cutlass.const_expr(self.desc_c):
                    e_c = cutlass.Int32(0)
                    desc_c = self.desc_ptr(
                        mDesc, e, self.num_desc - 1, cute.AddressSpace.generic
                    )
                    # the storing warp: this CTA's TMA warp ensures every expert it takes
                    # (empty ones too); wait for the flag, then acquire the descriptor
                    if warp_idx == self.epilogue_warp_id[0]:
                        if e != epi_last_e:
                            self.wait_descriptors(e, cute.arch.lane_idx(), mCounter)
                            cpasync.fence_tma_desc_acquire(
                                self.desc_ptr(mDesc, e, self.num_desc - 1)
                            )
                            epi_last_e = e
                # 2-CTA: this CTA writes rows [128 v, 128 v + 128) of the 256-row MMA tile.
                tTR_tAcc = tTR_tAcc_base[(None, None, None, None, None, acc_cstate.index)]
                tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
                subtiles = cute.size(tTR_tAcc.shape, mode=[3])
                gscale = self.epi_tile_scale(extra, e)
                write = cutlass.Boolean(True)
                if cutlass.const_expr(self.key.accumulate):
                    write = n_k > 0  # empty expert: leave the output untouched
                    if bad:
                        write = cutlass.Boolean(True)
                if n_k > 0:
                    acc_pipe.consumer_wait(acc_cstate)
                if cutlass.const_expr(self.tma_epi):
                    # registers -> smem sub-tile -> TMA store (TMA reduce-add if accumulate)
                    bSG_gC = bSG_gC_all[(None, None, None, m_idx, n_idx, e_c)]
                    bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
                    if write:
                        for sub in cutlass.range_constexpr(subtiles):
                            if n_k > 0:
                                cute.copy(
                                    tiled_t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc
                                )
                                vals = tiled_r2s.retile(tTR_rAcc).load()
                                vals = self.epi_scale(vals, gscale)
                                tRS_rC.store(vals.to(self.c_dtype))
                            elif bad:
                                tRS_rC.fill(float("nan"))  # offsets broke the contract
                            else:
                                tRS_rC.fill(0.0)  # empty expert, overwrite: zeros
                            buf = epi_count % self.num_c_stage
                            cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
                            cute.arch.fence_proxy("async.shared", space="cta")
                            epi_barrier.arrive_and_wait()
                            if warp_idx == self.epilogue_warp_id[0]:
                                cute.copy(
                                    tma_atom_c,
                                    bSG_sC[(None, buf)],
                                    bSG_gC[(None, sub)],
                                    tma_desc_ptr=desc_c,
                                )
                                c_pipe.producer_commit()
                                c_pipe.producer_acquire()
                            epi_barrier.arrive_and_wait()
                            epi_count += 1
                else:
                    # discrete without a descriptor workspace (the JAX adapter): registers
                    # -> the expert's own (M, N) output (pointer mC[e])
                    gC_e = self.expert_c(mC[e], thr_mma)
                    tTR_gC = thr_t2r.partition_D(cute.flat_divide(gC_e, epi_tile))
                    tTR_gC = tTR_gC[(None, None, None, None, None, m_idx, n_idx, 0)]
                    tTR_gC = cute.group_modes(tTR_gC, 3, cute.rank(tTR_gC))
                    if write:
                        for sub in cutlass.range_constexpr(subtiles):
                            g_sub = tTR_gC[(None, None, None, sub)]
                            if n_k > 0:
                                cute.copy(
                                    tiled_t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc
                                )
                                acc_vec = self.epi_scale(tTR_rAcc.load(), gscale)
                                if cutlass.const_expr(self.key.accumulate):
                                    cute.autovec_copy(g_sub, tTR_rOld)
                                    acc_vec = acc_vec + tTR_rOld.load().to(self.acc_dtype)
                                tTR_rC.store(acc_vec.to(self.c_dtype))
                            elif bad:
                                tTR_rC.fill(float("nan"))  # offsets broke the contract
                            else:
                                tTR_rC.fill(0.0)  # empty expert, overwrite: zeros
                            cute.autovec_copy(tTR_rC, g_sub)
                if n_k > 0:
                    # all tcgen05.ld of this buffer complete before the MMA may overwrite it
                    cute.arch.fence_view_async_tmem_load()
                    with cute.arch.elect_one():
                        acc_pipe.consumer_release(acc_cstate)
                    acc_cstate.advance()
                tile = self.take_tile(sched_pipe, sched_cstate, sSched)
                sched_cstate.advance()
            if cutlass.const_expr(self.tma_epi):
                c_pipe.producer_tail()
            # every epilogue warp's last TMEM load is done before the allocator warp frees
            epi_barrier.arrive_and_wait()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

        def epi_tile_scale(self, extra, e):
            """Hook (epilogue, per tile of expert ``e``): the tile's scale for ``epi_scale``.
            None for the BF16 kernel."""
            return None

        def epi_scale(self, vals, scale):
            """Hook (epilogue): the fp32 accumulator values ``vals`` scaled by the tile's
            ``scale`` before the output conversion. The BF16 kernel's are unscaled."""
            return vals

        @cute.jit
        def sort_experts(self, storage, mOffsets, tidx, cluster_layout_vmnk):
            """Every thread: the experts sorted by token count, largest first (ties by index),
            from the device offsets: returns ``sPerm`` (``sPerm[rank] = expert``). Both CTAs of
            a cluster compute the same order. Waits for the pipelines' barrier init (cluster
            wide) between the two passes."""
            num_e = self.key.num_experts
            sLens = storage.lens.get_tensor(cute.make_layout(num_e))
            sPerm = storage.perm.get_tensor(cute.make_layout(num_e))
            for ei in cutlass.range(tidx, num_e, self.threads_per_cta, unroll=1):
                prev = cutlass.Int32(0)
                if ei > 0:
                    prev = mOffsets[ei - 1]
                sLens[ei] = mOffsets[ei] - prev
            pipeline.pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)
            cute.arch.sync_threads()
            for ei in cutlass.range(tidx, num_e, self.threads_per_cta, unroll=1):
                my_len = sLens[ei]
                rank = cutlass.Int32(0)
                for e2 in cutlass.range(num_e, unroll=4):
                    l2 = sLens[e2]
                    if l2 > my_len or (l2 == my_len and e2 < ei):
                        rank += 1
                sPerm[rank] = ei
            cute.arch.sync_threads()
            return sPerm

        @cute.kernel
        def kernel(
            self,
            tiled_mma: cute.TiledMma,
            tma_atom_a: cute.CopyAtom,
            mA_mk: cute.Tensor,
            tma_atom_b: cute.CopyAtom,
            mB_nk: cute.Tensor,
            tma_atom_c: cute.CopyAtom,
            mC: cute.Tensor,  # TMA view of (M, N, E) dense / (M, N, 1) per-expert descriptor;
            # discrete without workspace: (E,) int64 pointers
            mOffsets: cute.Tensor,
            mCounter: cute.Tensor,
            mA_g: cute.Tensor,  # A, B and the output as passed (ragged / per-expert addresses)
            mB_g: cute.Tensor,
            mPtrs: cute.Tensor,
            mDesc: cute.Tensor,  # the descriptor workspace (unused without descriptors)
            cluster_layout_vmnk: cute.Layout,
            a_smem_layout_staged: cute.ComposedLayout,
            b_smem_layout_staged: cute.ComposedLayout,
            c_smem_layout_staged: cute.ComposedLayout,
            epi_tile: cute.Tile,
        ):
            self.tokens_sum = mA_mk.shape[1]  # tile_coords' range check (S, dynamic)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            if warp_idx == self.tma_warp_id:
                self.prefetch_descriptors(tma_atom_a, tma_atom_b, tma_atom_c)

            use_2cta = cute.size(tiled_mma.thr_id.shape) == 2
            bidx, _, _ = cute.arch.block_idx()
            mma_tile_coord_v = bidx % cute.size(tiled_mma.thr_id.shape)
            is_leader_cta = mma_tile_coord_v == 0
            cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            block_in_cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)
            cluster_id = bidx // self.cluster_m

            smem = memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)

            ab_pipe, acc_pipe, sched_pipe, sSched, tmem = self.make_pipelines(
                storage, cluster_layout_vmnk, use_2cta
            )

            sA, sB = self.allocate_ab(smem, a_smem_layout_staged, b_smem_layout_staged)
            sC = self.allocate_c(smem, c_smem_layout_staged)

            a_mcast_mask = None
            b_mcast_mask = None
            if cutlass.const_expr(self.use_2cta_instrs):
                a_mcast_mask = cpasync.create_tma_multicast_mask(
                    cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=2
                )
                b_mcast_mask = cpasync.create_tma_multicast_mask(
                    cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=1
                )

            # Global tiles, partitioned for the MMA and the TMA loads
            thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
            tCgA, tCgB = self.partition_ab(thr_mma, mA_mk, mB_nk)
            tCgC = self.partition_c(thr_mma, mC)
            a_cta_layout, b_cta_layout = self.cta_layouts(cluster_layout_vmnk)
            tAsA, tAgA = self.tma_partition(
                tma_atom_a, block_in_cluster_coord_vmnk[2], a_cta_layout, sA, tCgA
            )
            tBsB, tBgB = self.tma_partition(
                tma_atom_b, block_in_cluster_coord_vmnk[1], b_cta_layout, sB, tCgB
            )
            tCrA, tCrB, tCtAcc_fake = self.mma_fragments(tiled_mma, sA, sB)

            sPerm = self.sort_experts(storage, mOffsets, tidx, cluster_layout_vmnk)

            # ---------------- TMA warp ----------------
            if warp_idx == self.tma_warp_id:
                self.tma_warp(
                    ab_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mA_g, mB_g, mPtrs,
                    mDesc, tma_atom_a, tAgA, tAsA, a_mcast_mask, tma_atom_b, tBgB, tBsB,
                    b_mcast_mask, tma_atom_c, cta_rank_in_cluster, cluster_id,
                )

            # ---------------- MMA warp ----------------
            if warp_idx == self.mma_warp_id:
                self.mma_warp(
                    tiled_mma, tmem, tCtAcc_fake, tCrA, tCrB, ab_pipe, acc_pipe, sched_pipe,
                    sSched, sPerm, mOffsets, is_leader_cta,
                )

            # ---------------- epilogue warps ----------------
            if warp_idx < self.mma_warp_id:
                self.epilogue_warps(
                    tidx, warp_idx, tmem, tCtAcc_fake, tCgC, thr_mma, sC, epi_tile, tma_atom_c,
                    mC, acc_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mDesc,
                )

            if cutlass.const_expr(self.cluster_sched):
                # (2, 1) cluster: no CTA exits while the other may still arrive on its ring
                # mbarriers (the peer's releases go to the leader's shared memory)
                cute.arch.cluster_arrive_relaxed()
                cute.arch.cluster_wait()

    return Sm100GroupedWgradKernel


#: The kernel class, built once on first use (CuTe DSL is imported then): ``kernel_class()(key)``.
kernel_class = functools.cache(_build_kernel_class)


#: Targets the kernel is built for (tcgen05 with the arch-specific feature set).
_SM100_TARGETS = ("sm_100a", "sm_103a", "sm_110a")


def target_arch() -> str:
    """The present GPU's arch when it is one of ``_SM100_TARGETS``, else ``"sm_100a"``.

    Never the arch of another GPU family: a compile on an H200 (CI, the cache tests) targets
    ``sm_100a`` instead of failing CuTe DSL's tcgen05 arch check with ``sm_90a``.
    """
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}a"
        if arch in _SM100_TARGETS:
            return arch
    return "sm_100a"


def _as_key(key_or_contract: Any) -> Sm100WgradKey:
    if isinstance(key_or_contract, Sm100WgradKey):
        return key_or_contract
    if hasattr(key_or_contract, "mma_tiler_mn") and hasattr(key_or_contract, "hidden"):
        return sm100_key_from_contract(key_or_contract)
    raise ValueError(
        f"compile_sm100_wgrad: expected a Sm100WgradKey or an api.WgradContract, got "
        f"{type(key_or_contract).__name__}"
    )


#: Shared memory of one SM and what the hardware keeps per resident CTA (CUDA C++ Programming
#: Guide, "Technical Specifications per Compute Capability", 10.0: 228 KiB per SM, at most 227 KiB
#: per block, 1 KiB reserved per block).
_SM_SMEM_BYTES = 228 * 1024
_CTA_SMEM_RESERVED = 1024
#: Tensor memory columns per SM (PTX ISA, tcgen05 "Tensor Memory": 128 lanes x 512 columns).
_TMEM_COLUMNS = 512


def ctas_per_sm(key: Sm100WgradKey) -> int:
    """CTAs of ``key``'s kernel that fit one SM at once: the smaller of what shared memory and
    tensor memory allow (``launch.resident_clusters`` sizes the persistent grid with it).

    Shared memory: a CTA holds at least its A/B ring (``stages`` stages, or as many as fit next to
    the header, whichever is fewer: the kernel only lowers ``stages``) plus the header, and the
    hardware keeps 1 KiB per CTA; ``228 KiB // (footprint + 1 KiB)``. Tensor memory: two fp32
    accumulators of ``tile_n`` columns each, allocated as a power of two >= 32 columns, out of
    512. Every tile the rules accept has a ring above half an SM's shared memory (the smallest,
    128 x 32 with 8 stages of 20 KiB, holds 160 KiB), so this is 1 for each of them.
    """
    tile = key.tile
    header = _SMEM_HEADER + 8 * key.num_experts
    ring_stages = min(tile.stages, max(1, (_SMEM_BYTES - header) // tile.stage_bytes))
    smem = ring_stages * tile.stage_bytes + header
    by_smem = _SM_SMEM_BYTES // (smem + _CTA_SMEM_RESERVED)
    cols = max(32, 1 << (2 * tile.tile_n - 1).bit_length())
    by_tmem = _TMEM_COLUMNS // cols
    return max(1, min(by_smem, by_tmem))


def _zero_tokens(x, k_major: bool, transpose: bool):
    """A 256-token zero stand-in for an operand with no tokens, in the operand's layout."""
    import torch

    rows = x.shape[1] if transpose else x.shape[0]
    if k_major:
        y = torch.zeros(rows, _GROUP_ALIGN, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(_GROUP_ALIGN, rows, dtype=x.dtype, device=x.device).t()
    return y.t() if transpose else y


def _no_tokens(key: Sm100WgradKey, a, b, out, stream):
    """The launch hook of ``tokens_sum = 0`` (every expert empty; TMA has no 0-sized boxes; called
    with the launch ``stream`` already current, so its fills and stand-ins are ordered with it):
    nothing to do when accumulating, dense zeros written on the host side, and for discrete
    outputs 256 zero tokens (never read: every expert's range is empty) so that the kernel's TMA
    descriptors are valid while it writes the zeros through the pointers."""
    if a.shape[1] != 0:
        return a, b
    if key.accumulate:
        return None
    if key.output_mode == "dense":
        out.zero_()  # on the launch stream: the launcher runs its hooks inside that stream
        return None
    a = _zero_tokens(a, key.a_major == "k", transpose=False)
    b = _zero_tokens(b, key.b_major == "k", transpose=True)
    return a, b


#: The SM100 family in the shared compile-cache / launch layer: a persistent grid of as many
#: clusters as can be resident (``ctas_per_sm``; the driver's cluster occupancy for the (2, 1)
#: cluster of the 2-CTA tile), the runtime compile pinned to an SM100 target,
#: every launch gated on the hardware opt-in (``unverified_reason``), tokens_sum = 0 on the host.
FAMILY = KernelFamily(
    "sm100",
    lambda key: kernel_class()(key),
    sm100_key_from_contract,
    runtime_arch=target_arch,
    gate=unverified_reason,
    prepare=_no_tokens,
    as_key=_as_key,
    tile_counter=True,
    ctas_per_sm=ctas_per_sm,
    counter_len=counter_len,
    workspace_bytes=descriptor_workspace_bytes,
    ragged_in_place=True,
)


__getattr__ = FAMILY.module_getattr(__name__)  # COMPILE_COUNT: the family's count


def compile_sm100_wgrad(key: Any) -> Callable[..., None]:
    """Compile (once per key, cached) the SM100 grouped wgrad kernel and return its launcher.

    Args:
        key: a :class:`Sm100WgradKey`, or an ``api.WgradContract`` (converted by
            :func:`sm100_key_from_contract`).

    ``launcher(a, b, offsets, out, stream=None)`` runs on already-validated torch CUDA tensors:

    - ``a``: ``(hidden, tokens_sum)`` bf16, K-major (stride ``(S, 1)``) or M-major (``(1, M)``);
    - ``b``: ``(tokens_sum, intermediate)`` bf16, K-major (``(1, S)``) or N-major (``(N, 1)``);
    - ``offsets``: ``(E,)`` int32 cumulative expert ends on the device, each expert a multiple of
      256 tokens (the SM100 contract; never read on the host here);
    - ``out``: dense ``(E, M, N)`` contiguous tensor of ``key.out_dtype``, or for
      ``output_mode="discrete"`` an ``(E,)`` int64 tensor of 16-byte aligned ``(M, N)`` row-major
      output addresses;
    - ``stream``: a ``torch.cuda.Stream`` (default: the current stream);
    - ``descriptor_workspace`` (keyword): the caller's uint8 buffer (contiguous, 64-byte aligned,
      at least :func:`descriptor_workspace_bytes`; cuDNN's
      ``get_grouped_gemm_wgrad_workspace_size_sm100`` is always enough) for the per-expert TMA
      descriptors of discrete outputs and ``tensor_ragged`` K-major operands, rewritten at each
      launch (do not share it between launches that may overlap); None: one is allocated per
      launch on the launch stream. Unused (may be None) when the key needs no descriptors.

    The launcher raises ``RuntimeError`` unless ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``: the kernel
    is compiled but has never been verified on Blackwell hardware; ``ValueError`` for a
    ``descriptor_workspace`` it cannot use (nothing launched).

    Raises:
        RuntimeError: CuTe DSL (nvidia-cutlass-dsl) is not installed or the compile fails.
        ValueError: the key / contract is outside what the kernel is built for.
    """
    return FAMILY.launcher(key)


#: ``compile_sm100_wgrad_offline(key, arch="sm_100a")``: the PTX of ``key`` for
#: ``arch``, compiled without a GPU (CI): ``FAMILY.offline_ptx``.
compile_sm100_wgrad_offline = FAMILY.offline_compiler("sm_100a")
