"""Types and tables of the grouped-wgrad contract: output dtypes, alignment and workspace tables
(each with why), ``TupleDict`` (the wrappers' result), ``WgradContract`` (the static contract,
the API's compile-cache key), and what the one validation pipeline (``pipeline.py``) reads and
returns: ``WgradCall`` (a call's arguments, by name), ``ArgNames`` (the names its messages give
them) and ``Operands`` (a format's operand metadata). Imports no CuTe DSL and queries no GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..gemm.tiles import SM100_TILES

# ---------------------------------------------------------------------------------------------
# Tables of the contract (seed, "BF16 contract"), each with why.
# ---------------------------------------------------------------------------------------------

#: Output dtypes of the BF16 contract, with the names the kernel keys use.
OUTPUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: SM100 BF16 contract: every expert token count is a multiple of 256 (the kernel's fixed K pad).
SM100_GROUP_ALIGN = SM100_TILES.group_align
#: TMA: global addresses and non-unit strides are multiples of 16 bytes (CUDA driver
#: cuTensorMapEncodeTiled); the seed's "16-byte-aligned output address per expert" is the same rule.
TMA_ALIGN_BYTES = 16
#: Offsets are int32 loaded by the scheduler: 4-byte aligned. The pointer array is int64: 8 bytes.
OFFSETS_ALIGN_BYTES = 4
POINTERS_ALIGN_BYTES = 8
#: Per-expert runtime TMA descriptors of cuDNN's block-scaled wgrad, 128 bytes each (CUtensorMap
#: size): A, B, SFA, SFB for every expert, plus the output's in discrete mode. cuDNN's test pins
#: ``get_grouped_gemm_wgrad_workspace_size_sm100(2) == 1024`` (dense, either input order) and a
#: discrete size that is a multiple of 128. The SM100 BF16 kernel builds at most 3 per expert
#: (ragged K-major A and B, the discrete output: ``sm100_bf16.descriptors_per_expert``), so this
#: size, kept as cuDNN documents it, always holds them.
TMA_DESCRIPTOR_BYTES = 128
DESCRIPTORS_PER_EXPERT = {"dense": 4, "discrete": 5}
#: Operand dtypes whose matching pair selects the block-scaled backend (seed, "Block-scaled
#: contract"): FP8 E4M3 / E5M2, FP4 E2M1 packed two per byte (uint8 or ``float4_e2m1fn_x2``).
BLOCK_SCALED_DTYPES = tuple(
    d
    for d in (
        getattr(torch, "float4_e2m1fn_x2", None),
        torch.uint8,
        torch.float8_e5m2,
        torch.float8_e4m3fn,
    )
    if d is not None
)
#: Block-scaled formats: (element kind, scale dtype, sf_vec_size) -> name. Source: the seed and
#: cuDNN frontend's dtype / sf_vec_size rule (FP8 only with E8M0 scales at 32; E4M3 scales only
#: for FP4 at 16, with per-expert fp32 global scales); the twin's table (blockscaled_ref.py).
BLOCKSCALED_FORMATS = {
    ("e4m3", torch.float8_e8m0fnu, 32): "mxfp8",
    ("e5m2", torch.float8_e8m0fnu, 32): "mxfp8",
    ("e2m1", torch.float8_e8m0fnu, 32): "mxfp4",
    ("e2m1", torch.float8_e4m3fn, 16): "nvfp4",
}
#: Scale-factor dtypes of the block-scaled contract, with their key names.
SF_DTYPES = {torch.float8_e8m0fnu: "float8_e8m0fnu", torch.float8_e4m3fn: "float8_e4m3fn"}
#: Per-expert token-count rule of the block-scaled backend, per API arch and format: every
#: expert's tokens a multiple of this. SM100 (cuDNN's kernel, the seed): whole 128x4 scale atoms
#: per expert, 4 * sf_vec_size tokens (128 MXFP8 / MXFP4, 64 NVFP4), so that each expert's scales
#: start at column begin / sf_vec_size. SM90 and the generic entry ("torch"): any count for
#: MXFP8 (a partial group is zero-padded and each expert's scales start at its own atom column:
#: ``common.mx_atoms``), even counts for FP4 (two tokens per byte).
BLOCKSCALED_TOKEN_ALIGN = {
    "sm100": {"mxfp8": 128, "mxfp4": 128, "nvfp4": 64},
    "sm90": {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2},
    "torch": {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2},
}
# The tiling rules (tile M / N / K, clusters, partial tiles) are tiles.py's, in one place.
#: Output modes: one dense [E, H, I] tensor, or one int64 address per expert.
OUTPUT_MODES = ("dense", "discrete")
#: Kernel-key dtype names back to torch dtypes.
NAME_TO_DTYPE = {v: k for k, v in OUTPUT_DTYPES.items()}


def elem_bytes(dtype_name: str) -> int:
    """Bytes per element of an output dtype name ("bfloat16", "float16", "float32")."""
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype_name]


# ---------------------------------------------------------------------------------------------
# TupleDict
# ---------------------------------------------------------------------------------------------


class TupleDict:
    """Result of the wrappers: ordered named items with keyed access and tuple unpacking.

    ``result["wgrad_tensor"]`` returns the item by name, ``result[0]`` by position, and
    ``(wgrad,) = result`` unpacks the values in order. ``keys()``, ``values()``, ``items()``,
    ``len()`` and ``in`` (on names) behave as for a dict. The wrappers return exactly one item,
    ``wgrad_tensor``.
    """

    __slots__ = ("_items",)

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return list(self._items.values())[key]
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def keys(self):
        return self._items.keys()

    def values(self):
        return self._items.values()

    def items(self):
        return self._items.items()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={type(v).__name__}" for k, v in self._items.items())
        return f"TupleDict({inner})"


# ---------------------------------------------------------------------------------------------
# The static contract = the compile-cache key
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockScaledSpec:
    """The block-scaled part of a static contract (part of the cache key).

    Fields:
        fmt: "mxfp8" | "mxfp4" | "nvfp4".
        ab_dtype: torch dtype name of A and B ("float8_e4m3fn", "float8_e5m2", "uint8",
            "float4_e2m1fn_x2").
        sf_dtype: "float8_e8m0fnu" (MX) | "float8_e4m3fn" (NVFP4).
        sf_vec_size: tokens per scale group: 32 (MX) | 16 (NVFP4).
        token_align: the per-expert token multiple the call's offsets obey
            (:data:`BLOCKSCALED_TOKEN_ALIGN`; 1 = any count).
        sf_fp8_dtype_override: cuDNN's keyword; only None is supported (no Rubin kernel).
    """

    fmt: str
    ab_dtype: str
    sf_dtype: str
    sf_vec_size: int
    token_align: int
    sf_fp8_dtype_override: str | None = None

    @property
    def packed_fp4(self) -> bool:
        """Two E2M1 tokens per byte: the token axis of A / B is ``tokens_sum / 2`` long."""
        return self.fmt in ("mxfp4", "nvfp4")


@dataclass(frozen=True)
class WgradContract:
    """Static contract of one grouped-wgrad operator; the compile-cache key.

    The token dimension (tokens_sum and the split into experts) is dynamic and is NOT part of the
    key: new splits never recompile.

    Fields:
        arch: "sm90" | "sm100" | "torch".
        hidden: H (the GEMM's M). intermediate: I (the GEMM's N). num_experts: E.
        a_major: "k" (A strides (S, 1)) | "m" (A strides (1, H)).
        b_major: "k" (B strides (1, S)) | "n" (B strides (I, 1)).
        out_dtype: "bfloat16" | "float16" | "float32".
        output_mode: "dense" (E, H, I) tensor | "discrete" int64 pointer per expert.
        accumulate: ``accumulate_on_output``.
        input_order: "tensor2d" | "tensor_ragged".
        mma_tiler_mn: (tile M, tile N) or None (SM90: chosen per shape from ``configs/cuda``).
        cluster_shape_mn: (cluster M, cluster N) or None (default of the arch).
        block_scaled: None (BF16 operands) or the :class:`BlockScaledSpec` of FP8 / FP4
            operands; the BF16 kernel families never see a block-scaled contract.
    """

    arch: str
    hidden: int
    intermediate: int
    num_experts: int
    a_major: str
    b_major: str
    out_dtype: str
    output_mode: str
    accumulate: bool
    input_order: str
    mma_tiler_mn: tuple[int, int] | None
    cluster_shape_mn: tuple[int, int] | None
    block_scaled: BlockScaledSpec | None = None


# ---------------------------------------------------------------------------------------------
# What the validation pipeline reads and returns
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArgNames:
    """The names the error messages give a call's tensor arguments: ``a_tensor`` in a call,
    ``sample_a`` among a class's samples, ``a_HS`` in ``grouped_wgrad_fp32``, ``a`` for a JAX
    array."""

    a: str = "a_tensor"
    b: str = "b_tensor"
    offsets: str = "offsets_tensor"
    sfa: str = "sfa_tensor"
    sfb: str = "sfb_tensor"
    global_scale_a: str = "global_scale_a"
    global_scale_b: str = "global_scale_b"
    wgrad: str = "wgrad_tensor"
    wgrad_ptrs: str = "wgrad_ptrs"
    workspace: str = "descriptor_workspace"


#: The wrappers', ``execute``'s and ``grouped_gemm_wgrad``'s names.
CALL_NAMES = ArgNames()
#: The class constructors' samples.
SAMPLE_NAMES = ArgNames(
    "sample_a", "sample_b", "sample_offsets", "sample_sfa", "sample_sfb",
    "sample_global_scale_a", "sample_global_scale_b", "sample_wgrad",
)
#: ``grouped_wgrad_fp32`` / ``kernel_unsupported_reason``.
FP32_NAMES = ArgNames("a_HS", "b_SI", "offsets_E")


@dataclass
class WgradCall:
    """The arguments of one grouped-wgrad call, by name: what ``pipeline.validate_call`` checks.

    Every entry (the wrappers, the classes' samples and ``execute``, ``grouped_gemm_wgrad``,
    ``grouped_wgrad_into``, ``kernel_unsupported_reason``, the JAX entries) builds one; the fields
    are the wrappers' arguments of the same name (``a`` / ``b`` / ``offsets`` / ``sfa`` / ``sfb``
    are ``a_tensor`` / ``b_tensor`` / ``offsets_tensor`` / ``sfa_tensor`` / ``sfb_tensor``), plus:

    Fields:
        workspace: cuDNN's ``execute(workspace=)``, an alias of ``descriptor_workspace``.
        names: the argument names of the messages (:class:`ArgNames`).
        num_experts, wgrad_shape, wgrad_expert: a class's discrete-output samples
            (``num_experts``, ``wgrad_shape``, ``sample_wgrad_expert``).
    """

    a: Any
    b: Any
    offsets: Any
    sfa: Any = None
    sfb: Any = None
    global_scale_a: Any = None
    global_scale_b: Any = None
    output_mode: str = "dense"
    wgrad_tensor: Any = None
    wgrad_ptrs: Any = None
    wgrad_dtype: Any = torch.bfloat16
    acc_dtype: Any = torch.float32
    mma_tiler_mn: Any = None
    cluster_shape_mn: Any = None
    sf_vec_size: Any = 16
    sf_fp8_dtype_override: Any = None
    accumulate_on_output: bool = False
    input_order: Any = "tensor2d"
    current_stream: Any = None
    descriptor_workspace: Any = None
    workspace: Any = None
    validate_offsets: bool = True
    names: ArgNames = CALL_NAMES
    num_experts: int | None = None
    wgrad_shape: Any = None
    wgrad_expert: Any = None


@dataclass(frozen=True)
class Operands:
    """A format's operand metadata of a validated call (host metadata only).

    Fields:
        hidden, tokens_sum, intermediate, num_experts: H, S, I, E.
        a_majors, b_majors: the layouts A's / B's strides express, in order of preference
            (several only where the layout is moot: size-1 dims or no elements).
        spec: the block-scaled format (:class:`BlockScaledSpec`), None for BF16.
        tensors: the format's other tensor arguments by message name (the scale tensors), for
            the one-device rule.
    """

    hidden: int
    tokens_sum: int
    intermediate: int
    num_experts: int
    a_majors: tuple[str, ...]
    b_majors: tuple[str, ...]
    spec: BlockScaledSpec | None = None
    tensors: dict = field(default_factory=dict)
