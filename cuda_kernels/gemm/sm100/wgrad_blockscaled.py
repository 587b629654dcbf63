"""Blackwell (SM100) block-scaled grouped weight gradient in CuTe DSL: compiled, NOT hardware-verified.

``out[e] = deq(A)[:, begin:end] @ deq(B)[begin:end, :]`` (times ``gsa[e] * gsb[e]`` for NVFP4) for
every expert ``e``; ``deq`` is the MX / NVFP4 decoding (element times its group's scale). The twin
``blockscaled_ref.grouped_wgrad_blockscaled_torch`` defines the results.

Status (read first): compiled offline for ``sm_100a`` (PTX checked for the block-scaled
``tcgen05.mma`` kinds ``mxf8f6f4`` / ``mxf4nvf4`` with ``block_scale``, for ``tcgen05.cp`` of the
scale factors into tensor memory and, for discrete outputs, for the per-expert descriptor build
(tensormap.replace, tensormap proxy fences) and the TMA stores through those descriptors;
assembled by ptxas for sm_100a without spills) but it has NEVER RUN on a Blackwell GPU. Its launcher
refuses to run unless ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1`` (the same gate as ``sm100_bf16``),
and the registry (``registry.py``) routes SM100 block-scaled contracts to it only then.

Formats (``BlockScaledSpec.fmt``):

- ``"mxfp8"``: A, B FP8 E4M3 or E5M2 with E8M0 scales, ``sf_vec = 32``; ``tcgen05.mma`` kind
  ``mxf8f6f4`` (k = 32 per instruction, one scale per row per instruction); a pipeline stage is
  128 tokens = 4 scale columns = one 128x4 scale atom column;
- ``"nvfp4"``: A, B FP4 E2M1 (two tokens per byte) with E4M3 scales, ``sf_vec = 16``, plus
  per-expert fp32 global scales; kind ``mxf4nvf4`` (k = 64 per instruction, 4 scales per row);
  a stage is 64 tokens = one scale atom column; the epilogue multiplies the fp32 accumulator by
  ``gsa[e] * gsb[e]`` (computed on the launch stream) before the conversion;
- ``"mxfp4"``: A, B FP4 E2M1 (two tokens per byte) with E8M0 scales, ``sf_vec = 32``; CuTe DSL's
  ``MmaMXF4Op`` (k = 64 per instruction, 2 scales per row), which it emits as
  ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block32`` (the PTX ISA's mxf4nvf4 kind with
  UE8M0 scales at block 32, i.e. MXFP4; ``kind::mxf4`` is the same operation); a stage is 128
  tokens = 4 scale columns = one atom column, as for MXFP8.

Contract (the seed's ``_sm100`` surface, ``BlockScaledSpec.token_align``): every expert's token
count is a multiple of 128 (MXFP8, MXFP4) / 64 (NVFP4), so every stage lies inside one expert and an
expert's scale columns start at ``begin / sf_vec``, a multiple of 4: the per-expert scale blocks
``(round_up(rows, 128), k_e / sf_vec)`` concatenate into exactly the 128x4-atom layout of the
whole ``(round_up(rows, 128), tokens_sum / sf_vec)`` matrix (SWIZZLE_32_4_4: atom ``(i, j)`` at
``512 * (i * cols / 4 + j)``, inside it row ``r`` column ``c`` at ``16 * (r % 32) + 4 * (r // 32)
+ c``), which the kernel reads with CuTe's ``blockscaled_layout.tile_atom_to_shape_SF``. Both
operands are K-major along tokens (``a`` ``(M, S)``, ``b`` ``(S, N)`` with stride ``(1, S)``).

Structure: the BF16 kernel's (``sm100_bf16``), whose kernel class this one subclasses. Its kernel
body is the BF16 class's, once: ``_setup``, the load / store atoms, ``make_pipelines``,
``sort_experts``, the partitions, ``tma_warp``, ``mma_warp`` and ``epilogue_warps``; this class
overrides only their hooks (``make_tiled_mma``, ``extra_stage_bytes`` / ``setup_extra_layouts`` /
``tmem_alloc_cols``, ``tma_tile_extra`` / ``tma_stage_extra``, ``mma_extra_setup`` /
``mma_stage_extra`` / ``mma_kblock_extra``, ``epi_tile_scale`` / ``epi_scale``) and keeps its own
``__call__`` / ``kernel`` (its extra operands). Reused unchanged: the expert sort (largest first), ``tile_coords`` (tile id -> expert / m / n / K range,
contract breaches poisoned with NaN), the dynamic persistent scheduler (``next_tile`` /
``take_tile``: a global atomic counter read by the TMA warp, handed to the MMA and epilogue warps
through a shared-memory ring), the warp roles (TMA warp 5, MMA warp 4, epilogue warps 0-3), the
two TMEM accumulators and the TMA-store epilogue. What differs: the TMA warp also loads the scale
atoms of the stage (``(128, 4)`` scales of A and of B, 512 bytes each) on the stage's mbarrier;
the MMA warp copies them from shared memory into tensor memory with ``tcgen05.cp``
(``Cp4x32x128bOp``; the 32x4x4 "warpx4" broadcast the MMA's scale layout expects) and points the
block-scaled MMA at them (``tcgen05.Field.SFA`` / ``SFB``); the NVFP4 epilogue scales.

Discrete outputs (an int64 address per expert) reuse the BF16 kernel's per-expert TMA
descriptors unchanged (its ``ensure_descriptors`` / ``build_descriptors`` / ``wait_descriptors``
/ ``desc_ptr``): the TMA warp that first takes a tile of expert ``e`` claims the expert's flag
(the counter's word ``1 + e``), copies the host-encoded ``(M, N, 1)`` template of the output's
TMA store into the expert's 128-byte slot of the caller's descriptor workspace, patches in the
expert's address (``tensormap.replace``) and releases it; the storing epilogue warp waits for the
flag and acquires the descriptor before its first TMA store (or reduce-add) through it. The
workspace thus holds real per-expert descriptors, rewritten at every launch: each call site
(and each CUDA-graph replay of it) uses its own workspace, so nothing mutable is shared.

Built: ``tile = (128, 128)`` (1-CTA tcgen05, cluster (1, 1), dynamic scheduler), dense outputs
(partial tiles clipped by TMA) and discrete outputs (whole tiles: hidden and intermediate
multiples of 128) in BF16 / FP16 / FP32, overwrite or TMA reduce-add. Not built (the hook
returns None for them, the twin runs): the 2-CTA 256-row tile and ``tile_n = 256`` (two
128-column accumulators plus the scale columns exceed TMEM's 512 columns without the
overlapped-accumulator trick; the 2-CTA tile needs the scale atoms split / multicast across the
pair), ``tensor_ragged``, token counts that are not multiples of the stage.

Public names: :class:`Sm100BsTileConfig`, :class:`Sm100BlockScaledKey`,
:func:`sm100_blockscaled_key_from_contract`, :func:`compile_sm100_blockscaled_wgrad`,
:func:`compile_sm100_blockscaled_wgrad_offline`, :func:`supports`, ``FAMILY`` (a
:class:`launch.KernelFamily`). CuTe DSL is imported only inside the compile functions.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..keys import KMajorKernelKey
from ..launch import KernelFamily, contract_key_fields, fake_offsets_and_out
from ..tiles import SM100_TILES
from .wgrad_bf16 import (
    ENABLE_ENV,
    counter_len,
    descriptor_workspace_bytes,
    target_arch,
    unverified_reason,
)

__all__ = [
    "COMPILE_COUNT",  # noqa: F822 - served by the module __getattr__ (FAMILY.compile_count)
    "ENABLE_ENV",
    "FORMATS",
    "Sm100BlockScaledKey",
    "Sm100BsTileConfig",
    "compile_sm100_blockscaled_wgrad",
    "compile_sm100_blockscaled_wgrad_offline",
    "contract_launcher",
    "sm100_blockscaled_key_from_contract",
    "supports",
    "unavailable_reason",
]

#: fmt -> (element names, scale dtype name, sf_vec, tokens per stage = token_align of ``_sm100``)
#: MXFP4 (FP4 E2M1 with E8M0 scales at sf_vec 32): ``tcgen05.mma`` kind ``mxf4`` (CuTe DSL's
#: ``MmaMXF4Op``, k = 64 per instruction, 2 scales per row); a stage is 128 tokens = 4 scale
#: columns = one 128x4 atom column, as for MXFP8.
FORMATS = {
    "mxfp8": (("e4m3", "e5m2"), "float8_e8m0fnu", 32, 128),
    "mxfp4": (("e2m1",), "float8_e8m0fnu", 32, 128),
    "nvfp4": (("e2m1",), "float8_e4m3fn", 16, 64),
}
#: fmt -> the CuTe DSL scale dtype name (``cutlass.<name>``)
_SF_CUTLASS = {"mxfp8": "Float8E8M0FNU", "mxfp4": "Float8E8M0FNU", "nvfp4": "Float8E4M3FN"}
#: torch dtype names of A / B (``BlockScaledSpec.ab_dtype``) -> element name
_AB_DTYPE_ELEM = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "uint8": "e2m1",
    "float4_e2m1fn_x2": "e2m1",
}
_SMEM_BYTES = SM100_TILES.smem_bytes
_SMEM_HEADER = SM100_TILES.smem_reserved
_EPI_STAGES = 2
_SCHED_STAGES = 4  # the BF16 kernel's tile-id ring depth (its next_tile / take_tile)
_MAX_STAGES = 8


@dataclasses.dataclass(frozen=True)
class Sm100BsTileConfig:
    """One MMA tile of the block-scaled kernel.

    Attributes:
        tile_m: 128 (1-CTA tcgen05; the 2-CTA tile is not built).
        tile_n: 128 (one scale atom of B; 256 needs the overlapped accumulator, not built).
        tile_k: tokens per stage: 128 (MXFP8, MXFP4) or 64 (NVFP4), one scale atom column.
        stages: depth of the shared-memory ring, 2..8 (lowered when shared memory is short).

    Raises:
        ValueError: a field outside those values.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    stages: int = 6

    def __post_init__(self) -> None:
        if self.tile_m != 128:
            raise ValueError(f"Sm100BsTileConfig.tile_m must be 128, got {self.tile_m!r}")
        if self.tile_n != 128:
            raise ValueError(f"Sm100BsTileConfig.tile_n must be 128, got {self.tile_n!r}")
        if self.tile_k not in (64, 128):
            raise ValueError(f"Sm100BsTileConfig.tile_k must be 64 or 128, got {self.tile_k!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= _MAX_STAGES:
            raise ValueError(
                f"Sm100BsTileConfig.stages must be an int in [2, {_MAX_STAGES}], got "
                f"{self.stages!r}"
            )

    @property
    def use_2cta(self) -> bool:
        return False

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        return (1, 1)


@dataclasses.dataclass(frozen=True)
class Sm100BlockScaledKey(KMajorKernelKey):
    """Static contract of one compiled SM100 block-scaled kernel (its compile-cache key): the
    ``keys.KMajorKernelKey`` fields, plus

    Attributes:
        fmt: ``"mxfp8"``, ``"mxfp4"`` or ``"nvfp4"``.
        elem: ``"e4m3"`` / ``"e5m2"`` (MXFP8), ``"e2m1"`` (MXFP4, NVFP4).
        tile: :class:`Sm100BsTileConfig` whose ``tile_k`` is the format's stage (128 / 128 /
            64).

    Both operands are K-major along tokens (``a_major = b_major = "k"``), ``tensor2d``; dense
    or discrete output (discrete: hidden and intermediate multiples of the 128x128 tile, the
    ``keys.KernelKey`` rule of the SM100 family).

    Raises:
        ValueError: a field outside its values.
    """

    _TILES = SM100_TILES
    _K_MAJOR_WHY = "block-scaled operands must both be K-major along tokens"

    fmt: str = "mxfp8"
    elem: str = "e4m3"
    tile: Sm100BsTileConfig = Sm100BsTileConfig()

    def elems(self) -> tuple[str, ...]:
        """The element types of the key's ``fmt`` (checked here, before them)."""
        if self.fmt not in FORMATS:
            raise ValueError(
                f"{type(self).__name__}.fmt must be one of {tuple(FORMATS)}, got {self.fmt!r}"
            )
        return FORMATS[self.fmt][0]

    def __post_init__(self) -> None:
        super().__post_init__()
        stage = FORMATS[self.fmt][3]
        if self.tile.tile_k != stage:
            raise ValueError(
                f"{type(self).__name__}: {self.fmt} stages are {stage} tokens (one scale atom "
                f"column); got tile_k={self.tile.tile_k}"
            )

    @property
    def sf_vec(self) -> int:
        return FORMATS[self.fmt][2]

    @property
    def packed_fp4(self) -> bool:
        """FP4 operands (MXFP4, NVFP4): two tokens per byte."""
        return self.elem == "e2m1"


def _tile_for(fmt: str) -> Sm100BsTileConfig:
    stage = FORMATS[fmt][3]
    return Sm100BsTileConfig(128, 128, stage, 6 if fmt == "mxfp8" else _MAX_STAGES)


#: The output tile of every built config (discrete outputs have no partial tiles: the
#: ``keys.KernelKey`` rule of the SM100 family).
_TILE_MN = (128, 128)


def supports(contract: Any) -> str | None:
    """Why the kernel cannot serve the block-scaled ``contract`` (a sentence), or None.

    The contract's ``mma_tiler_mn`` / ``cluster_shape_mn`` (cuDNN's performance knobs, which the
    API fills with its (256, 256) default) do not change results and are not binding here: the
    kernel runs its own (128, 128) 1-CTA tile.
    """
    spec = getattr(contract, "block_scaled", None)
    if spec is None:
        return "not a block-scaled contract"
    if contract.arch != "sm100":
        return f"arch {contract.arch!r} is not sm100"
    if spec.fmt not in FORMATS:
        return f"format {spec.fmt!r} is not built ({', '.join(FORMATS)})"
    elems, sf_dtype, sf_vec, stage = FORMATS[spec.fmt]
    if spec.sf_dtype != sf_dtype or spec.sf_vec_size != sf_vec:
        return f"{spec.fmt} needs {sf_dtype} scales at sf_vec {sf_vec}"
    if _AB_DTYPE_ELEM.get(spec.ab_dtype) not in elems:
        return f"operand dtype {spec.ab_dtype!r} is not built for {spec.fmt}"
    if spec.sf_fp8_dtype_override is not None:
        return "sf_fp8_dtype_override is not supported"
    if spec.token_align % stage:
        return (
            f"token counts must be multiples of {stage} (the _sm100 surface); this call allows "
            f"multiples of {spec.token_align}"
        )
    if contract.a_major != "k" or contract.b_major != "k":
        return "both operands must be K-major along tokens"
    if contract.input_order != "tensor2d":
        return "only input_order='tensor2d' is built"
    if contract.output_mode == "discrete" and (
        contract.hidden % _TILE_MN[0] or contract.intermediate % _TILE_MN[1]
    ):
        return (
            f"discrete outputs need hidden and intermediate multiples of the {_TILE_MN[0]}x"
            f"{_TILE_MN[1]} tile (no partial tiles); got {contract.hidden}x"
            f"{contract.intermediate}"
        )
    return None


def unavailable_reason() -> str | None:
    """The family's gate in ``registry.KernelProvider.unavailable``: the BF16 SM100 kernel's
    hardware opt-in (``sm100_bf16.unverified_reason``)."""
    from . import wgrad_bf16

    return wgrad_bf16.unverified_reason()


def contract_launcher(contract: Any) -> Callable[..., None]:
    """The launcher of a supported block-scaled ``contract`` in the block-scaled signature
    (``blockscaled.Launcher``), compiled on its first launch (cached per key by ``FAMILY``; the
    launch re-checks the opt-in)."""

    def launcher(a, b, sfa, sfb, offsets, out, **kw):
        compile_sm100_blockscaled_wgrad(contract)(a, b, sfa, sfb, offsets, out, **kw)

    return launcher


def sm100_blockscaled_key_from_contract(contract: Any) -> Sm100BlockScaledKey:
    """The :class:`Sm100BlockScaledKey` of a block-scaled ``api.WgradContract``.

    Raises:
        ValueError: the contract is outside what the kernel is built for (:func:`supports`).
    """
    why = supports(contract)
    if why is not None:
        raise ValueError(f"sm100_blockscaled: {why}")
    spec = contract.block_scaled
    return Sm100BlockScaledKey(
        **contract_key_fields(contract),
        fmt=spec.fmt,
        elem=_AB_DTYPE_ELEM[spec.ab_dtype],
        tile=_tile_for(spec.fmt),
    )


# --------------------------------------------------------------------------------------------
# The kernel (CuTe DSL imported lazily)
# --------------------------------------------------------------------------------------------


def _build_kernel_class():
    import cutlass
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.utils.blockscaled_layout as bs_layout
    from cutlass import cute, memory
    from cutlass.cute.nvgpu import tcgen05
    from cutlass.tensor_utils import LayoutEnum

    from .wgrad_bf16 import kernel_class as _bf16_kernel_class

    elem_types = {
        "e4m3": cutlass.Float8E4M3FN,
        "e5m2": cutlass.Float8E5M2,
        "e2m1": cutlass.Float4E2M1FN,
    }
    base = _bf16_kernel_class()

    class Sm100BlockScaledWgradKernel(base):
        """The BF16 kernel's persistent tcgen05 structure with block-scaled MMAs."""

        def __init__(self, key: Sm100BlockScaledKey):
            # tile fields, warp roles, dynamic scheduler (1-CTA), and the per-expert descriptor
            # slots (``sm100_bf16._descriptor_slots``: the output's, in discrete mode)
            super().__init__(key)
            self.ab_dtype = elem_types[key.elem]
            self.sf_dtype = getattr(cutlass, _SF_CUTLASS[key.fmt])
            self.sf_vec = key.sf_vec
            self.nvfp4 = key.fmt == "nvfp4"
            self.tile_views_first = False  # the TMA warp slices after the descriptor work

        _no_room_detail = ""

        def make_tiled_mma(self, a_major_mode, b_major_mode):
            """The block-scaled tcgen05 MMA (scale dtype and vector size of the format)."""
            return sm100_utils.make_blockscaled_trivial_tiled_mma(
                self.ab_dtype,
                self.ab_dtype,
                a_major_mode,
                b_major_mode,
                self.sf_dtype,
                self.sf_vec,
                self.cta_group,
                self.mma_tiler[:2],
            )

        def extra_stage_bytes(self, tiled_mma):
            """A stage also holds the scale atoms of A and of B."""
            sfa_one = bs_layout.make_smem_layout_sfa(tiled_mma, self.mma_tiler, self.sf_vec, 1)
            sfb_one = bs_layout.make_smem_layout_sfb(tiled_mma, self.mma_tiler, self.sf_vec, 1)
            return cute.size_in_bytes(self.sf_dtype, sfa_one) + cute.size_in_bytes(
                self.sf_dtype, sfb_one
            )

        def setup_extra_layouts(self, tiled_mma):
            """The staged scale-atom layouts of A and B."""
            self.sfa_smem_layout_staged = bs_layout.make_smem_layout_sfa(
                tiled_mma, self.mma_tiler, self.sf_vec, self.num_ab_stage
            )
            self.sfb_smem_layout_staged = bs_layout.make_smem_layout_sfb(
                tiled_mma, self.mma_tiler, self.sf_vec, self.num_ab_stage
            )

        def tmem_alloc_cols(self, tiled_mma):
            """TMEM: two fp32 accumulators (tile_n columns each), then the scales of A and B
            (32 rows per column group: (128 / 32) columns per MMA instruction of the stage)."""
            k_insts = self.mma_tiler[2] // cute.size(tiled_mma.shape_mnk, mode=[2])
            self.num_acc_tmem_cols = self.mma_tiler[1] * self.num_acc_stage
            self.num_sfa_tmem_cols = (self.mma_tiler[0] // 32) * k_insts
            self.num_sfb_tmem_cols = (self.mma_tiler[1] // 32) * k_insts
            used = self.num_acc_tmem_cols + self.num_sfa_tmem_cols + self.num_sfb_tmem_cols
            return max(32, 1 << (used - 1).bit_length())

        @cute.jit
        def __call__(
            self,
            mA: cute.Tensor,  # (M, S) FP8 / FP4, K-major
            mB: cute.Tensor,  # (N, S) FP8 / FP4, K-major (B transposed view)
            mSFA: cute.Tensor,  # (round_up(M, 128), cols) scales of A in 128x4 atoms
            mSFB: cute.Tensor,  # (round_up(N, 128), cols') scales of B in 128x4 atoms
            mGs: cute.Tensor,  # (E,) fp32 gsa * gsb (NVFP4; unread for MXFP8)
            mOffsets: cute.Tensor,  # (E,) int32
            mOut: cute.Tensor,  # (E, M, N) dense, or (E,) int64 output addresses (discrete)
            mCounter: cute.Tensor,  # (1,) int32, zero at launch: the tile counter; (1 + E,)
            # with descriptors: then [1 + e] is expert e's descriptor flag (0 / 1 building / 2)
            num_clusters: cutlass.Int32,
            stream,
            mDesc: cute.Tensor = None,  # (16 * E,) int64, 64-byte aligned: the workspace
        ):
            if cutlass.const_expr(self.desc_c and mDesc is None):
                raise ValueError("discrete outputs need the descriptor workspace")
            a_major_mode = LayoutEnum.from_tensor(mA).mma_major_mode()
            b_major_mode = LayoutEnum.from_tensor(mB).mma_major_mode()
            tiled_mma = self._setup(a_major_mode, b_major_mode)
            atom_thr_size = cute.size(tiled_mma.thr_id.shape)

            # scale tensors: the 128x4 atom layout of (rows, cols * sf_vec) tokens; ``cols`` is
            # the caller's column count (>= tokens_sum / sf_vec: the API accepts more), so the
            # row-block stride of the atoms is the tensor's, not one derived from tokens_sum
            m_rows = mA.shape[0]
            n_rows = mB.shape[0]
            sfa_k = mSFA.shape[1] * self.sf_vec
            sfb_k = mSFB.shape[1] * self.sf_vec
            sfa_layout = bs_layout.tile_atom_to_shape_SF((m_rows, sfa_k, 1), self.sf_vec)
            sfb_layout = bs_layout.tile_atom_to_shape_SF((n_rows, sfb_k, 1), self.sf_vec)
            mSFA_mkl = cute.make_tensor(mSFA.iterator, sfa_layout)
            mSFB_nkl = cute.make_tensor(mSFB.iterator, sfb_layout)

            tma_atom_a, tma_a, tma_atom_b, tma_b, a_op, ab_bytes = self.make_ab_load_atoms(
                tiled_mma, mA, mB
            )
            sfa_smem_one = cute.slice_(self.sfa_smem_layout_staged, (None, None, None, 0))
            tma_atom_sfa, tma_sfa = cute.nvgpu.make_tiled_tma_atom_A(
                a_op,
                mSFA_mkl,
                sfa_smem_one,
                self.mma_tiler,
                tiled_mma,
                self.cluster_layout_vmnk.shape,
                internal_type=cutlass.Int16,
            )
            sfb_op = sm100_utils.cluster_shape_to_tma_atom_SFB(
                self.cluster_shape_mn, tiled_mma.thr_id
            )
            sfb_smem_one = cute.slice_(self.sfb_smem_layout_staged, (None, None, None, 0))
            tma_atom_sfb, tma_sfb = cute.nvgpu.make_tiled_tma_atom_B(
                sfb_op,
                mSFB_nkl,
                sfb_smem_one,
                self.mma_tiler,
                tiled_mma,
                self.cluster_layout_vmnk.shape,
                internal_type=cutlass.Int16,
            )
            self.num_tma_load_bytes = (
                ab_bytes
                + cute.size_in_bytes(self.sf_dtype, sfa_smem_one)
                + cute.size_in_bytes(self.sf_dtype, sfb_smem_one)
            ) * atom_thr_size

            # the BF16 kernel's output store (per-expert template descriptor when discrete)
            tma_atom_c, tma_c = self.make_store_atom(mOut, mDesc)

            self.shared_storage = self.make_shared_storage()
            kernel = self.kernel(
                tiled_mma,
                tma_atom_a,
                tma_a,
                tma_atom_b,
                tma_b,
                tma_atom_sfa,
                tma_sfa,
                tma_atom_sfb,
                tma_sfb,
                tma_atom_c,
                tma_c,
                mGs,
                mOffsets,
                mCounter,
                mOut,
                mDesc if cutlass.const_expr(mDesc is not None) else mOffsets,
                self.cluster_layout_vmnk,
                self.a_smem_layout_staged,
                self.b_smem_layout_staged,
                self.sfa_smem_layout_staged,
                self.sfb_smem_layout_staged,
                self.c_smem_layout_staged,
                self.epi_tile,
            )
            self.launch_kernel(kernel, num_clusters, stream)

        def tma_tile_extra(self, extra, m_idx, n_idx):
            """The tile's scale-atom views (A's rows ``m_idx``, B's rows ``n_idx``)."""
            tma_atom_sfa, tAgSFA, tAsSFA, tma_atom_sfb, tBgSFB, tBsSFB = extra
            tAgSFA_t = tAgSFA[(None, m_idx, None, 0)]
            tBgSFB_t = tBgSFB[(None, n_idx, None, 0)]
            return tma_atom_sfa, tAgSFA_t, tAsSFA, tma_atom_sfb, tBgSFB_t, tBsSFB

        def tma_stage_extra(self, extra_t, k, stage, bar):
            """The stage's scale atoms of A and B, on the stage's mbarrier after A and B."""
            tma_atom_sfa, tAgSFA_t, tAsSFA, tma_atom_sfb, tBgSFB_t, tBsSFB = extra_t
            cute.copy(tma_atom_sfa, tAgSFA_t[(None, k)], tAsSFA[(None, stage)], tma_bar_ptr=bar)
            cute.copy(tma_atom_sfb, tBgSFB_t[(None, k)], tBsSFB[(None, stage)], tma_bar_ptr=bar)

        def mma_extra_setup(self, tiled_mma, tmem_ptr, extra):
            """The scales' TMEM columns (after the two accumulators: A's, then B's) and their
            tcgen05.cp (shared -> tensor memory) partitions."""
            sSFA, sSFB, sfa_smem_layout_staged, sfb_smem_layout_staged = extra
            sfa_ptr = cute.recast_ptr(tmem_ptr + self.num_acc_tmem_cols, dtype=self.sf_dtype)
            tCtSFA = cute.make_tensor(
                sfa_ptr,
                bs_layout.make_tmem_layout_sfa(
                    tiled_mma,
                    self.mma_tiler,
                    self.sf_vec,
                    cute.slice_(sfa_smem_layout_staged, (None, None, None, 0)),
                ),
            )
            sfb_ptr = cute.recast_ptr(
                tmem_ptr + self.num_acc_tmem_cols + self.num_sfa_tmem_cols,
                dtype=self.sf_dtype,
            )
            tCtSFB = cute.make_tensor(
                sfb_ptr,
                bs_layout.make_tmem_layout_sfb(
                    tiled_mma,
                    self.mma_tiler,
                    self.sf_vec,
                    cute.slice_(sfb_smem_layout_staged, (None, None, None, 0)),
                ),
            )
            s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self.s2t_partition(sSFA, tCtSFA)
            s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self.s2t_partition(sSFB, tCtSFB)
            return (
                tCtSFA, tCtSFB, s2t_sfa, tCsSFA_s2t, tCtSFA_s2t, s2t_sfb, tCsSFB_s2t, tCtSFB_s2t
            )

        def mma_stage_extra(self, mma_extra, stage):
            """tcgen05.cp of the stage's scale atoms into tensor memory (before its MMAs)."""
            _sfa, _sfb, s2t_sfa, tCsSFA_s2t, tCtSFA_s2t, s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = (
                mma_extra
            )
            s_crd = (None, None, None, None, stage)
            cute.copy(s2t_sfa, tCsSFA_s2t[s_crd], tCtSFA_s2t)
            cute.copy(s2t_sfb, tCsSFB_s2t[s_crd], tCtSFB_s2t)

        def mma_kblock_extra(self, tiled_mma, mma_extra, kb):
            """Point the block-scaled MMA of k-block ``kb`` at its scales in tensor memory."""
            tCtSFA, tCtSFB = mma_extra[0], mma_extra[1]
            sf_crd = (None, None, kb)
            tiled_mma.set(tcgen05.Field.SFA, tCtSFA[sf_crd].iterator)
            tiled_mma.set(tcgen05.Field.SFB, tCtSFB[sf_crd].iterator)

        def epi_tile_scale(self, extra, e):
            """NVFP4: the expert's global-scale product ``gsa[e] * gsb[e]`` (``extra`` is the
            (E,) fp32 tensor ``mGs``); 1 for the MX formats (unused)."""
            gscale = cutlass.Float32(1.0)
            if self.nvfp4:
                gscale = extra[e]
            return gscale

        def epi_scale(self, vals, scale):
            """NVFP4: the accumulator times the expert's global-scale product."""
            if self.nvfp4:
                vals = vals * scale
            return vals

        def s2t_partition(self, sSF, tSF):
            """tcgen05.cp (shared -> tensor memory) of one scale operand: the tiled copy, the
            staged shared-memory source (as smem descriptors) and the TMEM destination."""
            sSF_c = cute.filter_zeros(sSF)
            tSF_c = cute.filter_zeros(tSF)
            atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(self.cta_group), self.sf_dtype)
            tiled = tcgen05.make_s2t_copy(atom, tSF_c)
            thr = tiled.get_slice(0)
            src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(sSF_c))
            return tiled, src, thr.partition_D(tSF_c)

        @cute.kernel
        def kernel(  # noqa: PLR0913, PLR0915
            self,
            tiled_mma: cute.TiledMma,
            tma_atom_a: cute.CopyAtom,
            mA_mk: cute.Tensor,
            tma_atom_b: cute.CopyAtom,
            mB_nk: cute.Tensor,
            tma_atom_sfa: cute.CopyAtom,
            mSFA_mkl: cute.Tensor,
            tma_atom_sfb: cute.CopyAtom,
            mSFB_nkl: cute.Tensor,
            tma_atom_c: cute.CopyAtom,
            mC: cute.Tensor,  # the TMA view of (M, N, E) dense / (M, N, 1) per-expert descriptor
            mGs: cute.Tensor,
            mOffsets: cute.Tensor,
            mCounter: cute.Tensor,
            mPtrs: cute.Tensor,  # the output as passed ((E,) int64 addresses when discrete)
            mDesc: cute.Tensor,  # the descriptor workspace (unused without descriptors)
            cluster_layout_vmnk: cute.Layout,
            a_smem_layout_staged: cute.ComposedLayout,
            b_smem_layout_staged: cute.ComposedLayout,
            sfa_smem_layout_staged: cute.Layout,
            sfb_smem_layout_staged: cute.Layout,
            c_smem_layout_staged: cute.ComposedLayout,
            epi_tile: cute.Tile,
        ):
            self.tokens_sum = mA_mk.shape[1]  # tile_coords' range check (S, dynamic)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            if warp_idx == self.tma_warp_id:
                self.prefetch_descriptors(
                    tma_atom_a, tma_atom_b, tma_atom_c, extra_atoms=(tma_atom_sfa, tma_atom_sfb)
                )

            cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            block_in_cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)

            smem = memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe, acc_pipe, sched_pipe, sSched, tmem = self.make_pipelines(
                storage, cluster_layout_vmnk, False
            )

            sA, sB = self.allocate_ab(smem, a_smem_layout_staged, b_smem_layout_staged)
            sSFA = smem.allocate_tensor(
                element_type=self.sf_dtype, layout=sfa_smem_layout_staged, byte_alignment=128
            )
            sSFB = smem.allocate_tensor(
                element_type=self.sf_dtype, layout=sfb_smem_layout_staged, byte_alignment=128
            )
            sC = self.allocate_c(smem, c_smem_layout_staged)

            # Global tiles (the BF16 kernel's), and the scale tiles with a trailing L = 1 mode
            thr_mma = tiled_mma.get_slice(0)
            tCgA, tCgB = self.partition_ab(thr_mma, mA_mk, mB_nk)
            gSFA = cute.local_tile(
                mSFA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None)
            )
            gSFB = cute.local_tile(
                mSFB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None)
            )
            tCgSFA = thr_mma.partition_A(gSFA)
            tCgSFB = thr_mma.partition_B(gSFB)
            tCgC = self.partition_c(thr_mma, mC)

            a_cta_layout, b_cta_layout = self.cta_layouts(cluster_layout_vmnk)
            a_coord = block_in_cluster_coord_vmnk[2]
            b_coord = block_in_cluster_coord_vmnk[1]
            tAsA, tAgA = self.tma_partition(tma_atom_a, a_coord, a_cta_layout, sA, tCgA)
            tBsB, tBgB = self.tma_partition(tma_atom_b, b_coord, b_cta_layout, sB, tCgB)
            tAsSFA, tAgSFA = self.tma_partition(tma_atom_sfa, a_coord, a_cta_layout, sSFA, tCgSFA)
            tAsSFA = cute.filter_zeros(tAsSFA)
            tAgSFA = cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = self.tma_partition(tma_atom_sfb, b_coord, b_cta_layout, sSFB, tCgSFB)
            tBsSFB = cute.filter_zeros(tBsSFB)
            tBgSFB = cute.filter_zeros(tBgSFB)
            tCrA, tCrB, tCtAcc_fake = self.mma_fragments(tiled_mma, sA, sB)

            # Experts sorted by token count, largest first (the BF16 kernel's order)
            sPerm = self.sort_experts(storage, mOffsets, tidx, cluster_layout_vmnk)

            # ---------------- TMA warp: A, B and their scale atoms per stage ----------------
            if warp_idx == self.tma_warp_id:
                self.tma_warp(
                    ab_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mA_mk, mB_nk, mPtrs,
                    mDesc, tma_atom_a, tAgA, tAsA, None, tma_atom_b, tBgB, tBsB, None,
                    tma_atom_c, cta_rank_in_cluster, None,
                    extra=(tma_atom_sfa, tAgSFA, tAsSFA, tma_atom_sfb, tBgSFB, tBsSFB),
                )

            # ---------------- MMA warp: tcgen05.cp scales, block-scaled tcgen05.mma ----------
            if warp_idx == self.mma_warp_id:
                self.mma_warp(
                    tiled_mma, tmem, tCtAcc_fake, tCrA, tCrB, ab_pipe, acc_pipe, sched_pipe,
                    sSched, sPerm, mOffsets, cutlass.Boolean(True),
                    extra=(sSFA, sSFB, sfa_smem_layout_staged, sfb_smem_layout_staged),
                )

            # ---------------- epilogue warps (TMA store / reduce-add) ----------------
            if warp_idx < self.mma_warp_id:
                self.epilogue_warps(
                    tidx, warp_idx, tmem, tCtAcc_fake, tCgC, thr_mma, sC, epi_tile, tma_atom_c,
                    mC, acc_pipe, sched_pipe, sSched, sPerm, mOffsets, mCounter, mDesc,
                    extra=mGs,
                )

    return Sm100BlockScaledWgradKernel


#: The kernel class, built once on first use (CuTe DSL is imported then): ``kernel_class()(key)``.
kernel_class = functools.cache(_build_kernel_class)


# --------------------------------------------------------------------------------------------
# Host side: the kernel family
# --------------------------------------------------------------------------------------------


def _fake_operands(key: Sm100BlockScaledKey):
    """Shape-only operands of a compile: A ``(M, S)`` / B ``(N, S)`` in the element type with a
    symbolic token count (a multiple of the stage) and unit stride along tokens, the scale tensors
    ``(round_up(rows, 128), cols)`` in the scale dtype (cols symbolic), the global-scale product, offsets, output (dense ``(E, M, N)`` or discrete ``(E,)``
    int64 addresses), counter (plus one descriptor flag per expert in discrete mode). The
    descriptor workspace (discrete) is appended by ``KernelFamily._compile``."""
    import cutlass
    from cutlass import cute

    elem_t = {
        "e4m3": cutlass.Float8E4M3FN,
        "e5m2": cutlass.Float8E5M2,
        "e2m1": cutlass.Float4E2M1FN,
    }[key.elem]
    sf_t = getattr(cutlass, _SF_CUTLASS[key.fmt])
    m, n, e = key.hidden, key.intermediate, key.num_experts
    s = cute.sym_int32(divisibility=key.tile.tile_k, symbol="tokens_sum")
    a = cute.runtime.make_fake_tensor(elem_t, (m, s), (s, 1), assumed_align=16)
    b = cute.runtime.make_fake_tensor(elem_t, (n, s), (s, 1), assumed_align=16)
    sfa = cute.runtime.make_fake_compact_tensor(
        sf_t,
        (-(-m // 128) * 128, cute.sym_int32(divisibility=4, symbol="sfa_cols")),
        stride_order=(1, 0),
        assumed_align=16,
    )
    sfb = cute.runtime.make_fake_compact_tensor(
        sf_t,
        (-(-n // 128) * 128, cute.sym_int32(divisibility=4, symbol="sfb_cols")),
        stride_order=(1, 0),
        assumed_align=16,
    )
    gs = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (e,), assumed_align=4)
    offsets, out = fake_offsets_and_out(key)
    counter = cute.runtime.make_fake_compact_tensor(
        cutlass.Int32, (counter_len(key),), assumed_align=4
    )
    return a, b, sfa, sfb, gs, offsets, out, counter


class _BsFamily(KernelFamily):
    """``launch.KernelFamily`` with the block-scaled launch call (the cache, compile with
    ``fake_operands=_fake_operands``, offline PTX, module ``COMPILE_COUNT``, grid sizing and the
    opt-in gate are the shared layer's)."""

    def _launch(  # noqa: PLR0913
        self,
        key,
        fn,
        a,
        b,
        sfa,
        sfb,
        offsets,
        out,
        *,
        global_scale_a=None,
        global_scale_b=None,
        descriptor_workspace=None,
        stream=None,
    ) -> None:
        """One launch on validated CUDA tensors (``dispatch.BlockScaledLauncher``'s signature):
        ``a`` ``(M, S)`` / ``b`` ``(S, N)`` K-major along tokens (FP4: packed bytes, two tokens per
        byte), ``sfa`` / ``sfb`` the 128x4-atom scale tensors, ``offsets`` ``(E,)`` int32 (every
        count a multiple of the stage), ``out`` dense ``(E, M, N)`` or, discrete, ``(E,)`` int64
        16-byte aligned ``(M, N)`` row-major output addresses.

        Dense outputs and the operands go through the kernel-parameter TMA descriptors the
        TVM-FFI entry encodes per launch. Discrete outputs go through per-expert descriptors that
        the kernel builds on the device in ``descriptor_workspace`` (the caller's uint8 buffer,
        contiguous, 64-byte aligned, at least ``descriptor_workspace_bytes(key)``: 128 bytes per
        expert, within cuDNN's ``get_grouped_gemm_wgrad_workspace_size_sm100``; None: one is
        allocated per launch on the launch stream), as the BF16 kernel does
        (``launch.descriptor_workspace_view``); each call site owns its workspace, so CUDA-graph
        replays of several call sites never share mutable descriptors. The counter gets one
        zeroed descriptor flag per expert after the tile counter.
        """
        import torch

        from ..launch import descriptor_workspace_view, on_stream

        reason = unverified_reason()
        if reason is not None:
            raise RuntimeError(reason)
        with on_stream(stream):
            if a.shape[-1] == 0:  # no tokens: nothing to read (TMA has no 0-sized boxes)
                if key.accumulate:
                    return
                if key.output_mode == "dense":
                    out.zero_()
                    return
                # discrete: the kernel writes the zeros through the pointers (no host read of
                # them); one stage of zero stand-ins keeps its TMA descriptors valid, and no
                # expert has a token to read
                a, b, sfa, sfb = _zero_stage(key, a, b, sfa, sfb)
            if key.packed_fp4:
                a = a.view(torch.float4_e2m1fn_x2)
                b = b.view(torch.float4_e2m1fn_x2)
            if key.fmt == "nvfp4":
                gs = (global_scale_a.float() * global_scale_b.float()).contiguous()
            else:
                gs = torch.ones(key.num_experts, dtype=torch.float32, device=a.device)
            grid = self.grid_size(key, a.device)
            tail = ()
            ws_bytes = self.workspace_bytes(key)
            if ws_bytes:
                tail = (descriptor_workspace_view(descriptor_workspace, ws_bytes, a.device),)
            fn(
                a,
                b.t(),
                sfa,
                sfb,
                gs,
                offsets,
                out,
                self.counter_for(key, a.device),
                grid,
                *tail,
            )


def _zero_stage(key: Sm100BlockScaledKey, a, b, sfa, sfb):
    """Zero stand-ins of one stage (``tile_k`` tokens; FP4 packed two per byte) for operands and
    scales without tokens, in their layouts (A ``(M, k)`` and B ``(k, N)`` with stride ``(1, k)``
    K-major, scales ``(rows, 4)``: one 128x4 atom column)."""
    import torch

    cols = key.tile.tile_k // (2 if key.packed_fp4 else 1)
    a0 = torch.zeros(a.shape[0], cols, dtype=a.dtype, device=a.device)
    b0 = torch.zeros(b.shape[1], cols, dtype=b.dtype, device=b.device).t()
    sfa0 = torch.zeros(sfa.shape[0], 4, dtype=sfa.dtype, device=sfa.device)
    sfb0 = torch.zeros(sfb.shape[0], 4, dtype=sfb.dtype, device=sfb.device)
    return a0, b0, sfa0, sfb0


def _as_key(key_or_contract: Any) -> Sm100BlockScaledKey:
    if isinstance(key_or_contract, Sm100BlockScaledKey):
        return key_or_contract
    if getattr(key_or_contract, "block_scaled", None) is not None:
        return sm100_blockscaled_key_from_contract(key_or_contract)
    raise ValueError(
        "compile_sm100_blockscaled_wgrad: expected a Sm100BlockScaledKey or a block-scaled "
        f"api.WgradContract, got {type(key_or_contract).__name__}"
    )


#: The SM100 block-scaled family: dynamic persistent (a zeroed tile counter per launch), one
#: 1-CTA cluster per SM, runtime compiles pinned to an SM100 target, launches gated on
#: ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1`` (the BF16 SM100 kernel's gate).
FAMILY = _BsFamily(
    "sm100_blockscaled",
    lambda key: kernel_class()(key),
    sm100_blockscaled_key_from_contract,
    runtime_arch=target_arch,
    gate=unverified_reason,
    as_key=_as_key,
    tile_counter=True,
    ctas_per_sm=lambda key: 1,
    fake_operands=_fake_operands,
    counter_len=counter_len,
    workspace_bytes=descriptor_workspace_bytes,
)

__getattr__ = FAMILY.module_getattr(__name__)  # COMPILE_COUNT: the family's count


def compile_sm100_blockscaled_wgrad(key: Any) -> Callable[..., None]:
    """Compile (once per key, cached) and return the launcher
    ``launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a=None, global_scale_b=None,
    descriptor_workspace=None, stream=None)`` (see ``_BsFamily._launch``); it raises
    ``RuntimeError`` unless ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``.

    Raises:
        RuntimeError: CuTe DSL is not installed or the compile fails.
        ValueError: the key / contract is outside what the kernel is built for.
    """
    return FAMILY.launcher(key)


#: ``compile_sm100_blockscaled_wgrad_offline(key, arch="sm_100a")``: the PTX of ``key`` for
#: ``arch``, compiled without a GPU (CI): ``FAMILY.offline_ptx``.
compile_sm100_blockscaled_wgrad_offline = FAMILY.offline_compiler("sm_100a")
