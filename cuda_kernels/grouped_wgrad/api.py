"""Grouped GEMM weight-gradient API (the cuDNN frontend's seed): validation, cache, classes, wrappers.

Dimensions: H hidden (the GEMM's M), I intermediate (N), S tokens_sum (K, grouped by expert),
E num_experts. Legend in ``common/shapes.py``.

Operation (seed ``shared/seeds/grouped_gemm_wgrad_sm100.md``): for expert ``e`` with
``begin = offsets[e - 1]`` (0 for ``e = 0``) and ``end = offsets[e]``::

    Wgrad[e] = A[:, begin:end] @ B[begin:end, :]            (fp32 accumulation)

Public names:
    ``GroupedGemmWgradSm100`` / ``grouped_gemm_wgrad_wrapper_sm100`` — the seed's surface; refuse
        devices below SM100. The SM100 kernel (``sm100_bf16.py``, tcgen05) is built and compiled
        offline for ``sm_100a`` but has never run on a Blackwell GPU: its launcher raises
        ``RuntimeError`` unless ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``, and ``auto`` dispatch
        never picks it without that opt-in.
    ``GroupedGemmWgradSm90`` / ``grouped_gemm_wgrad_wrapper_sm90`` — the same surface and contract
        on Hopper (the CuTe DSL kernel of ``sm90_bf16.py``), except that expert token counts may
        be any value >= 0. Refuse devices that are not SM 9.x (sm_90a code does not run elsewhere).
    ``grouped_gemm_wgrad`` — picks the SM100 or SM90 kernel by device and falls back to the torch
        implementation (``torch_ref.grouped_wgrad_torch``) elsewhere, CPU included.
    ``get_grouped_gemm_wgrad_workspace_size_sm100``, ``TupleDict``, ``WgradContract``.

Validation of offsets VALUES and pointer VALUES needs a host read (a device sync). It runs only in
the explicit validation mode ``validate_offsets=True`` — the default of the wrappers and of
``check_support`` — once per tensor version (the same unchanged tensor is not read again, as
cuDNN caches it), and never while the current CUDA stream is capturing a graph (values are then
trusted; the checks of shapes, dtypes, strides, devices and alignment still run). Pass
``validate_offsets=False`` in the hot path. Host metadata (shapes, strides, data pointers) is always
checked; it costs no sync.

Errors: every rule raises ``ValueError`` (bad argument) or ``RuntimeError`` (environment: no CUDA,
wrong capability, kernel or CuTe DSL not available, use before ``compile()``) with a message that
names the argument, before any output is written.

Nothing here imports CuTe DSL or queries the GPU at import time; the kernel module is imported
inside ``compile()``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .torch_ref import INPUT_ORDERS, grouped_wgrad_torch

__all__ = [
    "OUTPUT_DTYPES",
    "SM100_GROUP_ALIGN",
    "GroupedGemmWgradSm90",
    "GroupedGemmWgradSm100",
    "TupleDict",
    "WgradContract",
    "clear_grouped_wgrad_caches",
    "get_grouped_gemm_wgrad_workspace_size_sm100",
    "grouped_gemm_wgrad",
    "grouped_gemm_wgrad_wrapper_sm90",
    "grouped_gemm_wgrad_wrapper_sm100",
    "grouped_wgrad_fp32",
    "grouped_wgrad_into",
    "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
]

# ---------------------------------------------------------------------------------------------
# Tables of the contract (seed, "BF16 contract"), each with why.
# ---------------------------------------------------------------------------------------------

#: Output dtypes of the BF16 contract, with the names the kernel keys use.
OUTPUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: SM100 BF16 contract: every expert token count is a multiple of 256 (the kernel's fixed K pad).
SM100_GROUP_ALIGN = 256
#: TMA: global addresses and non-unit strides are multiples of 16 bytes (CUDA driver
#: cuTensorMapEncodeTiled); the seed's "16-byte-aligned output address per expert" is the same rule.
TMA_ALIGN_BYTES = 16
#: Offsets are int32 loaded by the scheduler: 4-byte aligned. The pointer array is int64: 8 bytes.
OFFSETS_ALIGN_BYTES = 4
POINTERS_ALIGN_BYTES = 8
#: Per-expert runtime TMA descriptors of cuDNN's block-scaled wgrad, 128 bytes each (CUtensorMap
#: size): A, B, SFA, SFB for every expert, plus the output's in discrete mode. cuDNN's test pins
#: ``get_grouped_gemm_wgrad_workspace_size_sm100(2) == 1024`` (dense, either input order) and a
#: discrete size that is a multiple of 128.
_TMA_DESCRIPTOR_BYTES = 128
_DESCRIPTORS_PER_EXPERT = {"dense": 4, "discrete": 5}
#: Operand dtype pairs that select the block-scaled backend in the seed (not built here).
_BLOCK_SCALED_DTYPES = tuple(
    d
    for d in (
        getattr(torch, "float4_e2m1fn_x2", None),
        torch.uint8,
        torch.float8_e5m2,
        torch.float8_e4m3fn,
    )
    if d is not None
)
#: SM100 tiling rules (CUTLASS Blackwell dense GEMM can_implement): tile M 128 (1-CTA) or 256
#: (2-CTA, cluster M even); tile N a multiple of 32 in [32, 256]; cluster dims powers of two, <= 16.
_SM100_TILE_M = (128, 256)
_SM100_TILE_N = tuple(range(32, 257, 32))
#: SM90 tiling rules (sm90_bf16.Sm90TileConfig): tile M 64 or 128 (one 64-row wgmma slab per
#: consumer warp group); tile N a multiple of 16 in [16, 256]; no clusters (1 x 1). The tile must
#: divide hidden and intermediate (no partial output tiles): checked by building Sm90WgradKey.
_SM90_TILE_M = (64, 128)
_SM90_TILE_N = tuple(range(16, 257, 16))
_SM90_CLUSTERS = ((1, 1),)

_OUTPUT_MODES = ("dense", "discrete")


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


# ---------------------------------------------------------------------------------------------
# Environment queries (module functions so tests can replace them)
# ---------------------------------------------------------------------------------------------


def _query_arch(device: torch.device, arg: str = "a_tensor") -> int:
    """Compute capability of ``device`` as ``10 * major + minor``.

    Raises:
        RuntimeError: CUDA is not available.
        ValueError: ``device`` is not a CUDA device (argument ``arg``).
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "grouped GEMM wgrad kernels need CUDA, and CUDA is not available "
            "(torch.cuda.is_available() is False); use grouped_gemm_wgrad(), which falls back to "
            "torch"
        )
    if device.type != "cuda":
        raise ValueError(f"{arg} must be on a CUDA device, got {device}")
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _capturing(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


@functools.cache
def _cutlass_dsl_missing() -> str | None:
    """Why the CuTe DSL cannot be used, or None."""
    if importlib.util.find_spec("cutlass") is None:
        return (
            "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1 "
            "apache-tvm-ffi==0.1.15.post2, or the package's [cuda] extra)"
        )
    return None


@functools.cache
def _sm100_module():
    """The SM100 BF16 kernel module if it is built, else None."""
    try:
        return importlib.import_module("cuda_kernels.grouped_wgrad.sm100_bf16")
    except ModuleNotFoundError:
        return None


def _sm90_key(contract: WgradContract):
    """The ``sm90_bf16.Sm90WgradKey`` of ``contract`` (tile from ``configs/cuda`` unless given).

    Imports ``sm90_bf16``, which imports CuTe DSL only inside its compile functions.

    Raises:
        ValueError: no tile fits hidden/intermediate (the SM90 kernel writes whole output tiles:
            hidden and intermediate must be multiples of the tile, 64 at least).
    """
    from . import sm90_bf16

    try:
        tile = sm90_bf16.select_sm90_tile_config(
            contract.hidden, contract.intermediate, contract.num_experts,
            mma_tiler_mn=contract.mma_tiler_mn,
        )
        return sm90_bf16.Sm90WgradKey(
            hidden=contract.hidden,
            intermediate=contract.intermediate,
            num_experts=contract.num_experts,
            a_major=contract.a_major,
            b_major=contract.b_major,
            out_dtype=contract.out_dtype,
            output_mode=contract.output_mode,
            accumulate=contract.accumulate,
            input_order=contract.input_order,
            tile=tile,
        )
    except ValueError as exc:
        raise ValueError(
            f"mma_tiler_mn={contract.mma_tiler_mn}: unsupported SM90 tiling for hidden="
            f"{contract.hidden}, intermediate={contract.intermediate}: {exc}"
        ) from exc


def _compile_sm90_kernel(contract: WgradContract) -> Callable:
    """Compile (or fetch from the kernel module's cache) the SM90 launcher for ``contract``."""
    missing = _cutlass_dsl_missing()
    if missing:
        raise RuntimeError(f"GroupedGemmWgradSm90.compile: {missing}")
    from . import sm90_bf16

    return sm90_bf16.compile_sm90_wgrad(_sm90_key(contract))


def _check_contract_fits(contract: WgradContract) -> None:
    """Arch-specific shape rules that need the whole static contract (unsupported tiling)."""
    if contract.arch == "sm90":
        _sm90_key(contract)
    elif contract.arch == "sm100":
        module = _sm100_module()
        if module is not None and hasattr(module, "sm100_key_from_contract"):
            try:
                module.sm100_key_from_contract(contract)
            except ValueError as exc:
                raise ValueError(
                    f"mma_tiler_mn={contract.mma_tiler_mn}: unsupported SM100 tiling for hidden="
                    f"{contract.hidden}, intermediate={contract.intermediate}: {exc}"
                ) from exc


def _compile_sm100_kernel(contract: WgradContract) -> Callable:
    """Compile the SM100 launcher (raises when ``sm100_bf16`` cannot be imported)."""
    module = _sm100_module()
    if module is None or not hasattr(module, "compile_sm100_wgrad"):
        raise RuntimeError(
            "GroupedGemmWgradSm100.compile: the SM100 BF16 grouped wgrad kernel is not built in "
            "this package yet (cuda_kernels.grouped_wgrad.sm100_bf16 is missing); use "
            "grouped_gemm_wgrad(), which falls back to torch on this device"
        )
    missing = _cutlass_dsl_missing()
    if missing:
        raise RuntimeError(f"GroupedGemmWgradSm100.compile: {missing}")
    return module.compile_sm100_wgrad(contract)


def _compile_kernel(contract: WgradContract) -> Callable:
    """Launcher for ``contract``, compiled once per process (cache keyed on the static contract)."""
    with _CACHE_LOCK:
        launcher = _LAUNCHER_CACHE.get(contract)
        if launcher is None:
            compiler = _compile_sm90_kernel if contract.arch == "sm90" else _compile_sm100_kernel
            launcher = compiler(contract)
            _LAUNCHER_CACHE[contract] = launcher
        return launcher


_CACHE_LOCK = threading.RLock()
_LAUNCHER_CACHE: dict[WgradContract, Callable] = {}
_OP_CACHE: dict[tuple, _GroupedGemmWgradBase] = {}


def clear_grouped_wgrad_caches() -> None:
    """Forget compiled launchers and cached wrapper operators (tests, or to free modules)."""
    with _CACHE_LOCK:
        _LAUNCHER_CACHE.clear()
        _OP_CACHE.clear()
        _INTO_CACHE.clear()
        _VALIDATED.clear()


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _a_majors(a: torch.Tensor, arg: str) -> tuple[str, ...]:
    """Majors ("k", "m") that A's strides express, in order of preference; several only when the
    layout is moot (size-1 dims or no elements)."""
    hidden, tokens = a.shape
    s0, s1 = a.stride()
    majors = []
    if (s1 == 1 or tokens == 1) and (s0 == tokens or hidden == 1):
        majors.append("k")
    if (s0 == 1 or hidden == 1) and (s1 == hidden or tokens == 1):
        majors.append("m")
    if not majors and a.numel() == 0:
        majors = ["k", "m"]
    if not majors:
        raise ValueError(
            f"{arg}: A (hidden={hidden}, tokens_sum={tokens}) must be K-major with strides "
            f"({tokens}, 1) or M-major with strides (1, {hidden}); got strides {(s0, s1)}"
        )
    return tuple(majors)


def _b_majors(b: torch.Tensor, arg: str) -> tuple[str, ...]:
    """Majors ("k", "n") that B's strides express (see ``_a_majors``)."""
    tokens, inter = b.shape
    s0, s1 = b.stride()
    majors = []
    if (s0 == 1 or tokens == 1) and (s1 == tokens or inter == 1):
        majors.append("k")
    if (s1 == 1 or inter == 1) and (s0 == inter or tokens == 1):
        majors.append("n")
    if not majors and b.numel() == 0:
        majors = ["k", "n"]
    if not majors:
        raise ValueError(
            f"{arg}: B (tokens_sum={tokens}, intermediate={inter}) must be K-major with strides "
            f"(1, {tokens}) or N-major with strides ({inter}, 1); got strides {(s0, s1)}"
        )
    return tuple(majors)


def _check_ptr(t: torch.Tensor, arg: str, align: int) -> None:
    if t.device.type == "meta" or t.numel() == 0:
        return
    if t.data_ptr() % align:
        raise ValueError(f"{arg}: data pointer {t.data_ptr():#x} must be {align}-byte aligned")


def _check_tiling(arch: str, mma_tiler_mn, cluster_shape_mn) -> tuple:
    """Validate the tiling arguments; returns (mma_tiler_mn, cluster_shape_mn) as tuples/None."""
    def as_pair(value, arg):
        if value is None:
            return None
        try:
            pair = tuple(int(v) for v in value)
        except TypeError:
            raise ValueError(f"{arg} must be a pair of ints, got {value!r}") from None
        if len(pair) != 2:
            raise ValueError(f"{arg} must be a pair of ints, got {value!r}")
        return pair

    tiler = as_pair(mma_tiler_mn, "mma_tiler_mn")
    cluster = as_pair(cluster_shape_mn, "cluster_shape_mn")
    if arch == "sm100":
        if tiler is None:
            raise ValueError("mma_tiler_mn is required on SM100 (default (256, 256))")
        if tiler[0] not in _SM100_TILE_M or tiler[1] not in _SM100_TILE_N:
            raise ValueError(
                f"mma_tiler_mn={tiler} unsupported on SM100: tile M in {_SM100_TILE_M}, tile N a "
                "multiple of 32 in [32, 256]"
            )
        if cluster is not None:
            cm, cn = cluster
            pow2 = all(c >= 1 and (c & (c - 1)) == 0 for c in cluster)
            if not pow2 or cm * cn > 16:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported on SM100: powers of two, at most 16 "
                    "CTAs"
                )
            if tiler[0] == 256 and cm % 2:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported with mma_tiler_mn M=256 (2-CTA MMA): "
                    "cluster M must be even"
                )
    elif arch == "sm90":
        if tiler is not None and (tiler[0] not in _SM90_TILE_M or tiler[1] not in _SM90_TILE_N):
            raise ValueError(
                f"mma_tiler_mn={tiler} unsupported on SM90: tile M in {_SM90_TILE_M}, tile N a "
                "multiple of 16 in [16, 256] (or None: chosen per shape from configs/cuda)"
            )
        if cluster is not None and cluster not in _SM90_CLUSTERS:
            raise ValueError(
                f"cluster_shape_mn={cluster} unsupported on SM90: one of {_SM90_CLUSTERS} or None"
            )
    return tiler, cluster


#: Tensors whose values passed a host-read check: key -> weak reference to the tensor checked.
#: A key is (check, device, data_ptr, _version, shape, check arguments); a hit needs the same live
#: tensor object, so a new tensor allocated at a freed address never inherits a verdict.
_VALIDATED: dict[tuple, Any] = {}
_VALIDATED_MAX = 1024


def _validated_once(t: torch.Tensor, key: tuple, check: Callable[[], None]) -> None:
    """Run ``check`` (a host read: one device sync) unless ``t`` passed it unchanged before.

    "Unchanged" is torch's version counter (``t._version``), which every in-place torch op on
    the tensor or a view of it bumps, as cuDNN caches its offsets validation; a write that
    bypasses torch (a custom kernel writing through ``data_ptr()``) is not seen, so callers that
    rewrite offsets that way must not rely on the cache (``clear_grouped_wgrad_caches()``).
    """
    import weakref

    full = (*key, t.device, t.data_ptr(), t._version, tuple(t.shape))
    with _CACHE_LOCK:
        ref = _VALIDATED.get(full)
        if ref is not None and ref() is t:
            return
    check()
    with _CACHE_LOCK:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        try:
            _VALIDATED[full] = weakref.ref(t)
        except TypeError:  # pragma: no cover - every torch.Tensor supports weak references
            pass


def _check_offsets_values(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str
) -> None:
    """Host read of the offsets: non-decreasing, >= 0, groups multiples of align, last == S.

    Once per tensor version (``_validated_once``): repeated calls with the same unchanged
    offsets tensor do not synchronise again.
    """
    _validated_once(
        offsets, ("offsets", tokens_sum, group_align, arg),
        lambda: _check_offsets_now(offsets, tokens_sum, group_align, arg),
    )


def _check_offsets_now(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str
) -> None:
    values = [int(v) for v in offsets.tolist()]
    prev = 0
    for e, end in enumerate(values):
        if end < prev:
            raise ValueError(
                f"{arg} must be a non-decreasing cumulative sum starting at >= 0; {arg}[{e}] = "
                f"{end} after {prev}"
            )
        if (end - prev) % group_align:
            raise ValueError(
                f"{arg}: expert {e} holds {end - prev} tokens; every expert token count must be a "
                f"multiple of {group_align} on this kernel"
            )
        prev = end
    if values and values[-1] != tokens_sum:
        raise ValueError(
            f"{arg}: last offset {values[-1]} must equal tokens_sum {tokens_sum} "
            "(A.shape[1] == B.shape[0])"
        )


def _check_pointer_values(
    ptrs: torch.Tensor, arg: str, stacked: torch.Tensor | None = None
) -> None:
    """Host read of the output addresses: non-null, 16-byte aligned and, when the caller passes
    the stacked ``wgrad_tensor`` too (cuDNN's discrete calls pass both), exactly its expert
    slabs, so the tensor returned is the memory written. Once per tensor version."""
    slabs = None
    if stacked is not None:
        step = stacked[0].numel() * stacked.element_size() if stacked.shape[0] else 0
        slabs = (stacked.data_ptr(), step)

    def check() -> None:
        values = [int(v) for v in ptrs.tolist()]
        for e, p in enumerate(values):
            if p == 0 or p % TMA_ALIGN_BYTES:
                raise ValueError(
                    f"{arg}[{e}] = {p:#x}: every output address must be non-null and "
                    f"{TMA_ALIGN_BYTES}-byte aligned"
                )
            if slabs is not None and p != slabs[0] + e * slabs[1]:
                raise ValueError(
                    f"{arg}[{e}] = {p:#x} is not expert {e}'s slab of wgrad_tensor "
                    f"({slabs[0] + e * slabs[1]:#x}): in discrete mode with both, the kernel "
                    "writes through wgrad_ptrs and returns wgrad_tensor, so the pointers must "
                    "address wgrad_tensor[e]"
                )

    _validated_once(ptrs, ("pointers", arg, slabs), check)


def _check_dtype_pair(a_dtype, b_dtype, a_arg: str, b_arg: str) -> None:
    if a_dtype == torch.bfloat16 and b_dtype == torch.bfloat16:
        return
    if a_dtype == b_dtype and a_dtype in _BLOCK_SCALED_DTYPES:
        raise RuntimeError(
            f"{a_arg}/{b_arg} dtype {a_dtype} selects the block-scaled (FP8/FP4) backend, which "
            "is not built in this package yet; only the BF16 backend is available"
        )
    bad = a_arg if a_dtype != torch.bfloat16 else b_arg
    raise ValueError(
        f"{bad}: the BF16 backend needs torch.bfloat16 A and B; got {a_arg} {a_dtype} and "
        f"{b_arg} {b_dtype}"
    )


def _check_scale_controls(controls: dict, sf_vec_size: int, acc_dtype) -> None:
    for name, value in controls.items():
        if value is not None:
            raise ValueError(
                f"{name} must be None: the BF16 grouped wgrad forbids scale-factor and global-scale "
                "controls (it never falls through to the block-scaled backend)"
            )
    if sf_vec_size != 16:
        raise ValueError(f"sf_vec_size must be 16 for BF16 (the seed's rule), got {sf_vec_size}")
    if acc_dtype != torch.float32:
        raise ValueError(f"acc_dtype must be torch.float32 (FP32 accumulation), got {acc_dtype}")


@dataclass(frozen=True)
class _Call:
    """One call's resolved output arguments after validation."""

    tokens_sum: int
    out: torch.Tensor  # dense (E, H, I) tensor or (E,) int64 pointers
    a: torch.Tensor  # A as launched (compact strides in tensor_ragged order)
    b: torch.Tensor


def _ragged_compact(
    a: torch.Tensor, b: torch.Tensor, names: tuple[str, str] = ("a_tensor", "b_tensor")
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_order="tensor_ragged"``: only each operand's unit-stride axis is meaningful (seed);
    return views with the compact strides of that major (same storage, no copy).

    Raises:
        ValueError: an operand has no unit-stride axis.
    """
    out = []
    for t, arg, k_axis in ((a, names[0], 1), (b, names[1], 0)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            out.append(t)  # reported by _validate_operands
            continue
        rows, cols = t.shape
        if t.stride(k_axis) == 1:  # K-major: per-expert K-contiguous blocks
            stride = (cols, 1) if k_axis == 1 else (1, rows)
        elif t.stride(1 - k_axis) == 1:  # M-/N-major: same memory as tensor2d
            stride = (1, rows) if k_axis == 1 else (cols, 1)
        elif t.numel() == 0:
            out.append(t)
            continue
        else:
            raise ValueError(
                f"{arg}: tensor_ragged needs a unit stride along tokens (K-major) or along "
                f"{'hidden' if k_axis == 1 else 'intermediate'}; got strides {tuple(t.stride())}"
            )
        out.append(t.as_strided(t.shape, stride, t.storage_offset()))
    return out[0], out[1]


def _validate_operands(
    arch: str,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    names: tuple[str, str, str],
) -> tuple[int, int, int, int, str, str]:
    """Ranks, shapes, dtypes, majors and alignment of A, B, offsets (host metadata only).

    Returns (hidden, tokens_sum, intermediate, num_experts, a_majors, b_majors); the majors are
    tuples of the layouts the strides express (several only when the layout is moot).
    """
    a_arg, b_arg, off_arg = names
    for t, arg in ((a, a_arg), (b, b_arg), (offsets, off_arg)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if a.dim() != 2:
        raise ValueError(f"{a_arg} must be rank-2 (hidden, tokens_sum), got shape {tuple(a.shape)}")
    if b.dim() != 2:
        raise ValueError(
            f"{b_arg} must be rank-2 (tokens_sum, intermediate), got shape {tuple(b.shape)}"
        )
    hidden, tokens_sum = a.shape
    if b.shape[0] != tokens_sum:
        raise ValueError(
            f"{a_arg} and {b_arg} token dimensions must match: {a_arg}.shape[1] = {tokens_sum}, "
            f"{b_arg}.shape[0] = {b.shape[0]}"
        )
    intermediate = b.shape[1]
    if hidden < 1 or intermediate < 1:
        raise ValueError(
            f"{a_arg}/{b_arg}: hidden and intermediate must be >= 1, got {hidden} and "
            f"{intermediate}"
        )
    _check_dtype_pair(a.dtype, b.dtype, a_arg, b_arg)
    if offsets.dim() != 1:
        raise ValueError(f"{off_arg} must be rank-1 (num_experts,), got {tuple(offsets.shape)}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"{off_arg} must be torch.int32, got {offsets.dtype}")
    num_experts = offsets.shape[0]
    if num_experts < 1:
        raise ValueError(f"{off_arg} must hold at least one expert, got shape {tuple(offsets.shape)}")
    if offsets.stride(0) != 1:
        raise ValueError(f"{off_arg} must be contiguous (stride (1,)), got {tuple(offsets.stride())}")
    a_majors = _a_majors(a, a_arg)
    b_majors = _b_majors(b, b_arg)
    a_major, b_major = a_majors[0], b_majors[0]
    if arch != "torch":
        elem = 2  # BF16 bytes
        need = TMA_ALIGN_BYTES // elem
        if a_major == "m" and hidden % need:
            raise ValueError(
                f"{a_arg}: M-major A needs hidden % {need} == 0 (16-byte TMA strides), got "
                f"hidden={hidden}"
            )
        if b_major == "n" and intermediate % need:
            raise ValueError(
                f"{b_arg}: N-major B needs intermediate % {need} == 0 (16-byte TMA strides), got "
                f"intermediate={intermediate}"
            )
        if "k" in (a_major, b_major) and tokens_sum % need:
            which = a_arg if a_major == "k" else b_arg
            raise ValueError(
                f"{which}: a K-major operand needs tokens_sum % {need} == 0 (16-byte TMA strides), "
                f"got tokens_sum={tokens_sum}"
            )
        _check_ptr(a, a_arg, TMA_ALIGN_BYTES)
        _check_ptr(b, b_arg, TMA_ALIGN_BYTES)
        _check_ptr(offsets, off_arg, OFFSETS_ALIGN_BYTES)
    return hidden, tokens_sum, intermediate, num_experts, a_majors, b_majors


def _check_dense_out(
    arch: str, out: torch.Tensor, shape: tuple[int, int, int], arg: str, out_dtype=None
) -> str:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(out).__name__}")  # noqa: TRY004
    if tuple(out.shape) != shape:
        raise ValueError(f"{arg} must have shape (num_experts, hidden, intermediate) = {shape}, "
                         f"got {tuple(out.shape)}")
    if out.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"{arg} dtype must be one of bfloat16/float16/float32, got {out.dtype}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"{arg} dtype {out.dtype} differs from the compiled wgrad_dtype "
                         f"{out_dtype}")
    _e, h, i = shape
    if out.numel() and tuple(out.stride()) != (h * i, i, 1):
        raise ValueError(
            f"{arg} must be contiguous with strides {(h * i, i, 1)}, got {tuple(out.stride())}"
        )
    if arch != "torch":
        need = TMA_ALIGN_BYTES // out.element_size()
        if i % need:
            raise ValueError(
                f"{arg}: intermediate % {need} == 0 needed for 16-byte TMA stores of "
                f"{out.dtype}, got intermediate={i}"
            )
        _check_ptr(out, arg, TMA_ALIGN_BYTES)
    return OUTPUT_DTYPES[out.dtype]


def _check_expert_out(arch: str, out: torch.Tensor, shape: tuple[int, int], dtype, arg: str):
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(out).__name__}")  # noqa: TRY004
    if tuple(out.shape) != shape:
        raise ValueError(f"{arg} must have shape (hidden, intermediate) = {shape}, "
                         f"got {tuple(out.shape)}")
    if tuple(out.stride()) != (shape[1], 1):
        raise ValueError(f"{arg} must be contiguous with strides {(shape[1], 1)}, got "
                         f"{tuple(out.stride())}")
    if out.dtype != dtype:
        raise ValueError(f"{arg} dtype {out.dtype} must equal wgrad_dtype {dtype}")
    if arch != "torch":
        _check_ptr(out, arg, TMA_ALIGN_BYTES)


def _check_ptrs_tensor(ptrs: torch.Tensor, num_experts: int, arg: str = "wgrad_ptrs") -> None:
    if not isinstance(ptrs, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(ptrs).__name__}")  # noqa: TRY004
    if ptrs.dtype != torch.int64:
        raise ValueError(f"{arg} must be torch.int64, got {ptrs.dtype}")
    if tuple(ptrs.shape) != (num_experts,):
        raise ValueError(f"{arg} must have shape (num_experts,) = ({num_experts},), got "
                         f"{tuple(ptrs.shape)}")
    if ptrs.stride(0) != 1:
        raise ValueError(f"{arg} must be contiguous (stride (1,)), got {tuple(ptrs.stride())}")
    _check_ptr(ptrs, arg, POINTERS_ALIGN_BYTES)


def _check_same_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"inputs, offsets and outputs must be on one device; got {listing}")
    return next(iter(devices))


def _check_input_order(input_order) -> str:
    value = getattr(input_order, "value", input_order)
    if value not in INPUT_ORDERS:
        raise ValueError(f"input_order must be one of {INPUT_ORDERS}, got {input_order!r}")
    return value


def _check_wgrad_dtype(wgrad_dtype, arg: str = "wgrad_dtype") -> str:
    if wgrad_dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"{arg} must be torch.bfloat16, torch.float16 or torch.float32, got {wgrad_dtype}"
        )
    return OUTPUT_DTYPES[wgrad_dtype]


_NAME_TO_DTYPE = {v: k for k, v in OUTPUT_DTYPES.items()}


# ---------------------------------------------------------------------------------------------
# The classes
# ---------------------------------------------------------------------------------------------


class _GroupedGemmWgradBase:
    """Shared lifecycle of the SM100 and SM90 classes (see their docstrings)."""

    _ARCH = ""
    _NAME = ""
    _GROUP_ALIGN = 1
    _DEFAULT_TILER: tuple[int, int] | None = None

    def __init__(
        self,
        sample_a: torch.Tensor,
        sample_b: torch.Tensor,
        sample_sfa: torch.Tensor | None,
        sample_sfb: torch.Tensor | None,
        sample_offsets: torch.Tensor,
        sample_wgrad: torch.Tensor | None = None,
        sample_wgrad_expert: torch.Tensor | None = None,
        num_experts: int | None = None,
        wgrad_shape: tuple[int, int] | None = None,
        wgrad_dtype: torch.dtype | None = None,
        sample_global_scale_a: torch.Tensor | None = None,
        sample_global_scale_b: torch.Tensor | None = None,
        acc_dtype: torch.dtype = torch.float32,
        mma_tiler_mn: tuple[int, int] | None = None,
        cluster_shape_mn: tuple[int, int] | None = None,
        sf_vec_size: int = 16,
        sf_fp8_dtype_override: str | None = None,
        accumulate_on_output: bool = False,
        input_order: str = "tensor2d",
        *,
        validate_offsets: bool = True,
    ) -> None:
        if sample_wgrad is not None and num_experts is None:
            self.output_mode = "dense"
        elif sample_wgrad is None and num_experts is not None:
            self.output_mode = "discrete"
            if wgrad_shape is None or wgrad_dtype is None:
                raise ValueError(
                    f"{self._NAME}: discrete output needs num_experts, wgrad_shape and wgrad_dtype"
                )
        else:
            raise ValueError(
                f"{self._NAME}: give sample_wgrad (dense output) or num_experts + wgrad_shape + "
                "wgrad_dtype (+ optional sample_wgrad_expert) for discrete output, not both"
            )
        if mma_tiler_mn is None:
            mma_tiler_mn = self._DEFAULT_TILER
        self._samples = {
            "a": sample_a, "b": sample_b, "offsets": sample_offsets, "wgrad": sample_wgrad,
            "wgrad_expert": sample_wgrad_expert,
        }
        self._scale_controls = {
            "sample_sfa": sample_sfa,
            "sample_sfb": sample_sfb,
            "sample_global_scale_a": sample_global_scale_a,
            "sample_global_scale_b": sample_global_scale_b,
            "sf_fp8_dtype_override": sf_fp8_dtype_override,
        }
        self._num_experts_arg = num_experts
        self._wgrad_shape_arg = wgrad_shape
        self._wgrad_dtype_arg = wgrad_dtype
        self.acc_dtype = acc_dtype
        self.mma_tiler_mn = mma_tiler_mn
        self.cluster_shape_mn = cluster_shape_mn
        self.sf_vec_size = sf_vec_size
        self.accumulate_on_output = bool(accumulate_on_output)
        self.input_order = input_order
        self.validate_offsets = bool(validate_offsets)
        self.contract: WgradContract | None = None
        self.device: torch.device | None = None
        self._is_supported = False
        self._launcher: Callable | None = None

    # -- check_support --------------------------------------------------------------------------

    def _static_contract(self) -> WgradContract:
        s = self._samples
        _check_scale_controls(self._scale_controls, self.sf_vec_size, self.acc_dtype)
        input_order = _check_input_order(self.input_order)
        tiler, cluster = _check_tiling(self._ARCH, self.mma_tiler_mn, self.cluster_shape_mn)
        sample_a, sample_b = s["a"], s["b"]
        if input_order == "tensor_ragged":
            sample_a, sample_b = _ragged_compact(sample_a, sample_b, ("sample_a", "sample_b"))
        hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
            self._ARCH, sample_a, sample_b, s["offsets"], ("sample_a", "sample_b", "sample_offsets")
        )
        if self.output_mode == "dense":
            out_dtype = _check_dense_out(
                self._ARCH, s["wgrad"], (num_experts, hidden, inter), "sample_wgrad"
            )
        else:
            if self._num_experts_arg != num_experts:
                raise ValueError(
                    f"num_experts={self._num_experts_arg} must equal sample_offsets.numel() = "
                    f"{num_experts}"
                )
            if tuple(self._wgrad_shape_arg) != (hidden, inter):
                raise ValueError(
                    f"wgrad_shape must be (hidden, intermediate) = {(hidden, inter)}, got "
                    f"{tuple(self._wgrad_shape_arg)}"
                )
            out_dtype = _check_wgrad_dtype(self._wgrad_dtype_arg)
            if self._ARCH != "torch" and inter % (TMA_ALIGN_BYTES // _elem_bytes(out_dtype)):
                raise ValueError(
                    f"wgrad_shape: intermediate % {TMA_ALIGN_BYTES // _elem_bytes(out_dtype)} == 0 "
                    f"needed for 16-byte TMA stores of {out_dtype}, got {inter}"
                )
            if s["wgrad_expert"] is not None:
                _check_expert_out(self._ARCH, s["wgrad_expert"], (hidden, inter),
                                  self._wgrad_dtype_arg, "sample_wgrad_expert")
        _check_same_device({
            "sample_a": s["a"], "sample_b": s["b"], "sample_offsets": s["offsets"],
            "sample_wgrad": s["wgrad"], "sample_wgrad_expert": s["wgrad_expert"],
        })
        if self.validate_offsets and not _capturing(s["offsets"].device):
            _check_offsets_values(s["offsets"], tokens_sum, self._GROUP_ALIGN, "sample_offsets")
        contract = WgradContract(
            arch=self._ARCH, hidden=hidden, intermediate=inter, num_experts=num_experts,
            a_major=a_majors[0], b_major=b_majors[0], out_dtype=out_dtype,
            output_mode=self.output_mode,
            accumulate=self.accumulate_on_output, input_order=input_order, mma_tiler_mn=tiler,
            cluster_shape_mn=cluster,
        )
        _check_contract_fits(contract)
        return contract

    def _check_arch(self, device: torch.device) -> None:
        raise NotImplementedError

    @classmethod
    def _from_contract(cls, contract: WgradContract, device: torch.device):
        """A supported operator for an already validated ``contract`` (used by the wrappers)."""
        op = cls.__new__(cls)
        op.output_mode = contract.output_mode
        op._samples = None
        op._scale_controls = {}
        op.acc_dtype = torch.float32
        op.mma_tiler_mn = contract.mma_tiler_mn
        op.cluster_shape_mn = contract.cluster_shape_mn
        op.sf_vec_size = 16
        op.accumulate_on_output = contract.accumulate
        op.input_order = contract.input_order
        op.validate_offsets = False
        op._launcher = None
        op._check_arch(device)
        op.contract = contract
        op.device = device
        op._is_supported = True
        return op

    def check_support(self) -> bool:
        """Validate the samples against the contract and the device; True or raises.

        Raises:
            ValueError: a sample, dtype, layout, tiling, scale control or offsets rule is broken
                (offsets values only with ``validate_offsets=True``, not while capturing).
            RuntimeError: no CUDA, or the device's compute capability is not supported.
        """
        if self._is_supported:
            return True
        contract = self._static_contract()
        device = self._samples["a"].device
        self._check_arch(device)
        self.contract = contract
        self.device = device
        self._is_supported = True
        self._samples = None  # do not keep the samples alive
        return True

    def compile(self) -> None:
        """Compile the kernel for the static contract (cached per process; new token splits reuse
        it). Runs ``check_support()`` first when it has not run.

        Raises:
            RuntimeError: the kernel or the CuTe DSL is not available; see ``check_support``.
        """
        if not self._is_supported:
            self.check_support()
        if self._launcher is None:
            self._launcher = _compile_kernel(self.contract)

    # -- execute --------------------------------------------------------------------------------

    def _validate_call(
        self,
        a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, wgrad_tensor, wgrad_ptrs,
        global_scale_a, global_scale_b, validate_offsets: bool, workspaces=(),
    ) -> _Call:
        c = self.contract
        _check_scale_controls(
            {"sfa_tensor": sfa_tensor, "sfb_tensor": sfb_tensor,
             "global_scale_a": global_scale_a, "global_scale_b": global_scale_b},
            16, torch.float32,
        )
        if c.input_order == "tensor_ragged":
            a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
        hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
            c.arch, a_tensor, b_tensor, offsets_tensor, ("a_tensor", "b_tensor", "offsets_tensor")
        )
        static = {"hidden": (hidden,), "intermediate": (inter,), "num_experts": (num_experts,),
                      "a_major": a_majors, "b_major": b_majors}
        for name, allowed in static.items():
            if getattr(c, name) not in allowed:
                raise ValueError(
                    f"{name} of this call ({allowed[0]}) differs from the compiled contract "
                    f"({getattr(c, name)}); build another operator for a new static contract"
                )
        out_dtype = _NAME_TO_DTYPE[c.out_dtype]
        if c.output_mode == "dense":
            if wgrad_ptrs is not None:
                raise ValueError("wgrad_ptrs must be None in dense output mode")
            if wgrad_tensor is None:
                raise ValueError("wgrad_tensor is required in dense output mode")
            _check_dense_out(c.arch, wgrad_tensor, (num_experts, hidden, inter), "wgrad_tensor",
                             out_dtype)
            out = wgrad_tensor
        else:
            if wgrad_tensor is None and wgrad_ptrs is None:
                raise ValueError(
                    "wgrad_ptrs is required in discrete output mode (or wgrad_tensor, the "
                    "stacked [E, H, I] output whose expert slabs the kernel then writes)"
                )
            if wgrad_tensor is not None:
                _check_dense_out(c.arch, wgrad_tensor, (num_experts, hidden, inter),
                                 "wgrad_tensor", out_dtype)
            if wgrad_ptrs is not None:
                _check_ptrs_tensor(wgrad_ptrs, num_experts)
                out = wgrad_ptrs
            else:
                out = _stacked_pointers(wgrad_tensor)
        device = _check_same_device({
            "a_tensor": a_tensor, "b_tensor": b_tensor, "offsets_tensor": offsets_tensor,
            "wgrad_tensor": wgrad_tensor, "wgrad_ptrs": wgrad_ptrs,
            **{name: ws for name, ws in workspaces if ws is not None},
        })
        if self.device is not None and device != self.device:
            raise ValueError(
                f"a_tensor is on {device} but this operator was compiled for {self.device}"
            )
        if validate_offsets and not _capturing(device):
            _check_offsets_values(offsets_tensor, tokens_sum, self._GROUP_ALIGN, "offsets_tensor")
            if wgrad_ptrs is not None:
                _check_pointer_values(wgrad_ptrs, "wgrad_ptrs", wgrad_tensor)
        return _Call(tokens_sum=tokens_sum, out=out, a=a_tensor, b=b_tensor)

    def execute(
        self,
        a_tensor: torch.Tensor,
        b_tensor: torch.Tensor,
        sfa_tensor: torch.Tensor | None,
        sfb_tensor: torch.Tensor | None,
        offsets_tensor: torch.Tensor,
        wgrad_tensor: torch.Tensor | None = None,
        wgrad_ptrs: torch.Tensor | None = None,
        global_scale_a: torch.Tensor | None = None,
        global_scale_b: torch.Tensor | None = None,
        current_stream: Any = None,
        *,
        descriptor_workspace: torch.Tensor | None = None,
        workspace: torch.Tensor | None = None,
        validate_offsets: bool | None = None,
    ) -> None:
        """Run the compiled kernel: ``wgrad[e] (+)= A[:, begin:end] @ B[begin:end, :]``.

        Args: as the seed (shapes in the module docstring), positional prefix as cuDNN's
        ``execute``. ``current_stream``: a ``torch.cuda.Stream``, a raw ``CUstream``/int handle,
        or None (torch's current stream).
        Discrete operators take ``wgrad_ptrs``, ``wgrad_tensor`` (the stacked [E, H, I] output:
        its expert slabs are written) or both, as cuDNN passes them: then the kernel writes
        through ``wgrad_ptrs``, and with validation on the pointers must be
        ``wgrad_tensor``'s expert slabs.
        ``descriptor_workspace`` / ``workspace`` (keywords, cuDNN's): caller-owned uint8
        buffers of at least ``get_grouped_gemm_wgrad_workspace_size_sm100(E, output_mode,
        input_order)`` bytes on the inputs' device; both given must be the same buffer. The BF16
        kernels build no runtime descriptors and leave them untouched.
        ``validate_offsets``: host-read offsets (and pointer) values, once per tensor version;
        default: the value given at construction. Skipped while the stream is capturing a CUDA
        graph.

        Raises:
            RuntimeError: ``compile()`` has not run.
            ValueError: a call argument breaks the contract or differs from the compiled one.
        """
        if self._launcher is None:
            raise RuntimeError(
                f"{self._NAME}.execute() before compile(): call check_support() and compile() "
                "first"
            )
        if validate_offsets is None:
            validate_offsets = self.validate_offsets
        c = self.contract
        ws = _check_workspace(
            descriptor_workspace, workspace, offsets_tensor.shape[0] if isinstance(
                offsets_tensor, torch.Tensor) and offsets_tensor.dim() == 1 else 1,
            c.output_mode, c.input_order,
        )
        call = self._validate_call(
            a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, wgrad_tensor, wgrad_ptrs,
            global_scale_a, global_scale_b, validate_offsets,
            workspaces=(("descriptor_workspace", ws),),
        )
        self._launch(call.a, call.b, offsets_tensor, call.out, current_stream,
                     pointers=call.out if c.output_mode == "discrete" else None)

    def _launch(self, a, b, offsets, out, current_stream, pointers=None) -> None:
        stream = current_stream
        if a.device.type == "cuda" and current_stream is not None:
            stream = _torch_stream(current_stream, a.device)
        if pointers is not None and pointers.device.type == "cuda":
            # The seed: the API records the pointer tensor on the launch stream.
            pointers.record_stream(_torch_stream(stream, pointers.device))
        self._launcher(a, b, offsets, out, stream=stream)


def _elem_bytes(dtype_name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype_name]


def _torch_stream(stream: Any, device: torch.device):
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(int(stream), device=device)


_CLASS_DOC = """{summary}

    Dimensions: H hidden, S tokens_sum (dynamic), I intermediate, E num_experts.

    Constructor (samples fix the static contract; ``sample_sfa``/``sample_sfb``/global scales must
    be None for BF16):
        sample_a: [H, S] torch.bfloat16, K-major strides (S, 1) or M-major strides (1, H).
        sample_b: [S, I] torch.bfloat16, K-major strides (1, S) or N-major strides (I, 1).
        sample_offsets: [E] torch.int32 contiguous, cumulative END of each expert's tokens.
        sample_wgrad: dense output [E, H, I] contiguous, BF16/FP16/FP32 (dense mode), or
        num_experts, wgrad_shape=(H, I), wgrad_dtype (+ optional sample_wgrad_expert [H, I]
        contiguous) for discrete mode (one int64 address per expert at execute).
        acc_dtype: torch.float32 only. sf_vec_size: 16 only (BF16).
        mma_tiler_mn, cluster_shape_mn: tiling ({tiling}).
        accumulate_on_output: add to the output instead of overwriting (empty experts then leave
            it untouched; overwrite writes zeros for them).
        input_order: "tensor2d" or "tensor_ragged" (per-expert K-contiguous blocks).
        validate_offsets (keyword): host-read offsets/pointer values in check_support and execute
            (one device sync each); never while a CUDA graph is being captured.

    Offsets rule: non-decreasing, {groups}, last == tokens_sum.
    Alignment: data pointers of A, B and outputs 16-byte aligned (offsets 4, pointer array 8);
    K-major operands need tokens_sum % 8 == 0, M-/N-major ones hidden/intermediate % 8 == 0,
    outputs intermediate * element size % 16 == 0 (16-byte TMA strides).

    Lifecycle: ``check_support()`` -> ``compile()`` -> ``execute(...)`` any number of times with new
    tokens_sum and splits (the token dimension is dynamic: no recompile).
"""


class GroupedGemmWgradSm100(_GroupedGemmWgradBase):
    _ARCH = "sm100"
    _NAME = "GroupedGemmWgradSm100"
    _GROUP_ALIGN = SM100_GROUP_ALIGN
    _DEFAULT_TILER = (256, 256)

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on SM100+ (the seed's class); refuses devices below SM100.\n\n"
        "    The SM100 BF16 kernel (sm100_bf16.py) is compiled offline for sm_100a but has never\n"
        "    run on hardware: ``execute()`` raises RuntimeError unless the environment sets\n"
        "    MOE_BWD_ENABLE_UNVERIFIED_SM100=1 (validation and support checks are complete).",
        tiling="default (256, 256); tile M 128 or 256, N a multiple of 32 up to 256; clusters of "
        "powers of two, <= 16 CTAs, M even for tile M 256",
        groups="every expert token count a multiple of 256",
    )

    def _check_arch(self, device: torch.device) -> None:
        cc = _query_arch(device, "sample_a")
        if cc < 100:
            raise RuntimeError(
                f"{self._NAME} requires SM100 or newer, found SM{cc} on {device}; use "
                "GroupedGemmWgradSm90 on Hopper or grouped_gemm_wgrad() for any device"
            )


class GroupedGemmWgradSm90(_GroupedGemmWgradBase):
    _ARCH = "sm90"
    _NAME = "GroupedGemmWgradSm90"
    _GROUP_ALIGN = 1
    _DEFAULT_TILER = None

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on Hopper (SM 9.x) with the CuTe DSL kernel of sm90_bf16.py.\n\n"
        "    Same surface and contract as GroupedGemmWgradSm100 except that expert token counts\n"
        "    may be any value >= 0. sm_90a code (wgmma) runs only on SM 9.x devices.",
        tiling="default None: per shape from configs/cuda; tile M in (64, 128, 192, 256), N a "
        "multiple of 16 up to 256; clusters (1, 1), (2, 1), (1, 2)",
        groups="any expert token count >= 0 (0 included)",
    )

    def _check_arch(self, device: torch.device) -> None:
        cc = _query_arch(device, "sample_a")
        if cc < 90:
            raise RuntimeError(
                f"{self._NAME} requires SM90 (Hopper), found SM{cc} on {device} (below SM90)"
            )
        if cc >= 100:
            raise RuntimeError(
                f"{self._NAME} runs sm_90a code (wgmma) only on SM 9.x, found SM{cc} on "
                f"{device}; use GroupedGemmWgradSm100 or grouped_gemm_wgrad()"
            )


# ---------------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------------


def get_grouped_gemm_wgrad_workspace_size_sm100(
    num_experts: int, output_mode: str = "dense", input_order: str = "tensor2d"
) -> int:
    """Bytes of the caller-owned ``descriptor_workspace``, cuDNN's size: per expert, 128-byte TMA
    descriptors (CUtensorMap) of A, B, SFA and SFB, plus the output's in discrete mode; the same
    for either ``input_order`` (1024 bytes for 2 dense experts, as cuDNN's test pins).

    The BF16 kernels here build no runtime descriptors: they accept such a buffer (so code sized
    the cuDNN way runs unchanged) and leave it untouched.

    Raises:
        ValueError: ``num_experts`` is not a positive int, or an unknown mode / order.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be positive (an int >= 1), got {num_experts!r}")
    if output_mode not in _OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    _check_input_order(input_order)
    return num_experts * _DESCRIPTORS_PER_EXPERT[output_mode] * _TMA_DESCRIPTOR_BYTES


def _check_workspace(
    descriptor_workspace, workspace, num_experts: int, output_mode: str, input_order: str
) -> torch.Tensor | None:
    """The caller's workspace (``descriptor_workspace``, or cuDNN's ``workspace`` alias), checked:
    uint8, contiguous, at least the size for ``num_experts``; both given must name one buffer."""
    if descriptor_workspace is not None and workspace is not None:
        same = (
            isinstance(descriptor_workspace, torch.Tensor) and isinstance(workspace, torch.Tensor)
            and descriptor_workspace.data_ptr() == workspace.data_ptr()
            and descriptor_workspace.numel() == workspace.numel()
        )
        if not same:
            raise ValueError(
                "workspace and descriptor_workspace must name the same buffer when both are given"
            )
    ws = descriptor_workspace if descriptor_workspace is not None else workspace
    if ws is None:
        return None
    need = get_grouped_gemm_wgrad_workspace_size_sm100(
        max(int(num_experts), 1), output_mode, input_order
    )
    if not isinstance(ws, torch.Tensor) or ws.dtype != torch.uint8:
        raise ValueError(
            f"descriptor_workspace must be a torch.uint8 tensor of at least {need} bytes "
            "(get_grouped_gemm_wgrad_workspace_size_sm100)"
        )
    if not ws.is_contiguous():
        raise ValueError("descriptor_workspace must be contiguous")
    if ws.numel() < need:
        raise ValueError(
            f"descriptor_workspace requires at least {need} bytes "
            f"(get_grouped_gemm_wgrad_workspace_size_sm100), got {ws.numel()}"
        )
    return ws


def _stacked_pointers(stacked: torch.Tensor) -> torch.Tensor:
    """int64 address of each expert's [H, I] slab of a contiguous [E, H, I] tensor (no sync)."""
    e = stacked.shape[0]
    step = stacked[0].numel() * stacked.element_size() if e else 0
    idx = torch.arange(e, dtype=torch.int64, device=stacked.device)
    return idx * step + stacked.data_ptr()


def _wrapper(
    cls,
    a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, output_mode, wgrad_tensor,
    wgrad_ptrs, global_scale_a, global_scale_b, acc_dtype, wgrad_dtype, mma_tiler_mn,
    cluster_shape_mn, sf_vec_size, accumulate_on_output, input_order, current_stream,
    validate_offsets, descriptor_workspace, _ops_out: list | None = None,
    sf_fp8_dtype_override: str | None = None,
) -> TupleDict:
    arch = cls._ARCH
    # 1. Every rule of the call, environment-free (CPU-testable), before any output is written.
    if output_mode not in _OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    _check_scale_controls(
        {"sfa_tensor": sfa_tensor, "sfb_tensor": sfb_tensor, "global_scale_a": global_scale_a,
         "global_scale_b": global_scale_b, "sf_fp8_dtype_override": sf_fp8_dtype_override},
        sf_vec_size, acc_dtype,
    )
    input_order = _check_input_order(input_order)
    tiler, cluster = _check_tiling(
        arch, cls._DEFAULT_TILER if mma_tiler_mn is None else mma_tiler_mn, cluster_shape_mn
    )
    if input_order == "tensor_ragged":
        a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
    hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
        arch, a_tensor, b_tensor, offsets_tensor, ("a_tensor", "b_tensor", "offsets_tensor")
    )
    out_name = _check_wgrad_dtype(wgrad_dtype)
    if output_mode == "dense" and wgrad_ptrs is not None:
        raise ValueError("wgrad_ptrs must be None in dense output mode (dense output forbids it)")
    if wgrad_tensor is not None:  # the given output's dtype wins over wgrad_dtype
        out_name = _check_dense_out(arch, wgrad_tensor, (num_experts, hidden, inter),
                                    "wgrad_tensor")
    elif inter % (TMA_ALIGN_BYTES // _elem_bytes(out_name)):
        raise ValueError(
            f"wgrad_dtype: intermediate % {TMA_ALIGN_BYTES // _elem_bytes(out_name)} == 0 needed "
            f"for 16-byte TMA stores of {out_name}, got intermediate={inter}"
        )
    if wgrad_ptrs is not None:
        _check_ptrs_tensor(wgrad_ptrs, num_experts)
    _check_workspace(descriptor_workspace, None, num_experts, output_mode, input_order)
    device = _check_same_device({
        "a_tensor": a_tensor, "b_tensor": b_tensor, "offsets_tensor": offsets_tensor,
        "wgrad_tensor": wgrad_tensor, "wgrad_ptrs": wgrad_ptrs,
        "descriptor_workspace": descriptor_workspace,
    })
    if validate_offsets and not _capturing(device):
        _check_offsets_values(offsets_tensor, tokens_sum, cls._GROUP_ALIGN, "offsets_tensor")
        if wgrad_ptrs is not None:
            _check_pointer_values(wgrad_ptrs, "wgrad_ptrs", wgrad_tensor)

    # 2. The operator of the static contract (tokens_sum is not in the key): environment checks
    #    (no CUDA, capability) and the compile happen once per key.
    contracts = [
        WgradContract(
            arch=arch, hidden=hidden, intermediate=inter, num_experts=num_experts, a_major=am,
            b_major=bm, out_dtype=out_name, output_mode=output_mode,
            accumulate=bool(accumulate_on_output), input_order=input_order, mma_tiler_mn=tiler,
            cluster_shape_mn=cluster,
        )
        for am in a_majors
        for bm in b_majors
    ]
    with _CACHE_LOCK:
        op = next(
            (_OP_CACHE[(c, str(device))] for c in contracts if (c, str(device)) in _OP_CACHE), None
        )
    if op is None:
        _check_contract_fits(contracts[0])
        op = cls._from_contract(contracts[0], device)
        op.compile()
        with _CACHE_LOCK:
            _OP_CACHE[(contracts[0], str(device))] = op

    # 3. Outputs (allocated on the launch stream), then the launch.
    alloc_ctx = (
        torch.cuda.stream(_torch_stream(current_stream, device))
        if current_stream is not None and device.type == "cuda"
        else contextlib.nullcontext()
    )
    with alloc_ctx:
        if wgrad_tensor is None and wgrad_ptrs is None:
            alloc = torch.zeros if accumulate_on_output else torch.empty
            wgrad_tensor = alloc(
                (num_experts, hidden, inter), dtype=_NAME_TO_DTYPE[out_name], device=device
            )
        if output_mode == "dense":
            out = wgrad_tensor
        elif wgrad_ptrs is not None:
            out = wgrad_ptrs
        else:
            out = _stacked_pointers(wgrad_tensor)
    op._launch(
        a_tensor, b_tensor, offsets_tensor, out, current_stream,
        pointers=out if output_mode == "discrete" else None,
    )
    if _ops_out is not None:
        _ops_out.append(op)
    # Discrete with wgrad_ptrs only: caller-owned memory, nothing to return (the seed); with both
    # (cuDNN's calls), the kernel wrote through the pointers and the given tensor is returned.
    return TupleDict(wgrad_tensor=wgrad_tensor)


def _wrapper_doc(name: str, cls_name: str, extra: str) -> str:
    return f"""Compile (once per static contract) and run the grouped wgrad: the seed's wrapper.

    ``result = {name}(a_tensor, b_tensor, None, None, offsets_tensor, output_mode="dense")``
    returns ``TupleDict(wgrad_tensor=...)``: ``result["wgrad_tensor"]`` or ``(w,) = result``.

    Args:
        a_tensor: [H, S] torch.bfloat16 (K-major or M-major), CUDA.
        b_tensor: [S, I] torch.bfloat16 (K-major or N-major), same device.
        sfa_tensor, sfb_tensor, global_scale_a, global_scale_b, sf_fp8_dtype_override: must be
            None (BF16). The positional order is cuDNN's (``sf_fp8_dtype_override`` between
            ``sf_vec_size`` and ``accumulate_on_output``; keywords after ``current_stream``).
        offsets_tensor: [E] torch.int32 contiguous cumulative ends; {extra}
        output_mode: "dense" (wgrad_tensor [E, H, I], allocated when omitted; wgrad_ptrs
            forbidden) or "discrete": wgrad_ptrs [E] int64 caller-owned addresses (then
            ``result["wgrad_tensor"] is None``); or wgrad_tensor, a stacked [E, H, I] output whose
            expert slabs are written through derived addresses; or both, as cuDNN's tests pass
            them: the kernel writes through ``wgrad_ptrs`` and ``result["wgrad_tensor"] is
            wgrad_tensor`` (with ``validate_offsets`` the pointers must be its expert slabs);
            or neither, then a stacked tensor is allocated.
        wgrad_dtype: torch.bfloat16 | torch.float16 | torch.float32 (allocated output's dtype).
        acc_dtype: torch.float32. sf_vec_size: 16. mma_tiler_mn, cluster_shape_mn: see
            ``{cls_name}``.
        accumulate_on_output: accumulate into the output (allocated outputs start at zero).
        input_order: "tensor2d" | "tensor_ragged".
        current_stream: torch.cuda.Stream, raw handle or None (current stream).
        validate_offsets (keyword): host-read the offsets and pointer values (one sync), once
            per tensor version (an unchanged offsets tensor is not re-read); default True;
            skipped while a CUDA graph is being captured. Pass False in the hot path.
        descriptor_workspace (keyword): accepted as cuDNN's block-scaled callers size it (uint8,
            contiguous, at least ``get_grouped_gemm_wgrad_workspace_size_sm100(E, output_mode,
            input_order)`` bytes, same device); unused by BF16 (cuDNN refuses it for BF16).

    Raises:
        ValueError: any contract rule (argument named in the message), before any output write.
        RuntimeError: no CUDA, unsupported device, kernel or CuTe DSL missing, FP8/FP4 operands
            (block-scaled backend not built).
    """


def grouped_gemm_wgrad_wrapper_sm100(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    sfa_tensor: torch.Tensor | None,
    sfb_tensor: torch.Tensor | None,
    offsets_tensor: torch.Tensor,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    mma_tiler_mn: tuple[int, int] = (256, 256),
    cluster_shape_mn: tuple[int, int] | None = None,
    sf_vec_size: int = 16,
    sf_fp8_dtype_override: str | None = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: torch.Tensor | None = None,
    validate_offsets: bool = True,
) -> TupleDict:
    return _wrapper(
        GroupedGemmWgradSm100, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
        output_mode, wgrad_tensor, wgrad_ptrs, global_scale_a, global_scale_b, acc_dtype,
        wgrad_dtype, mma_tiler_mn, cluster_shape_mn, sf_vec_size, accumulate_on_output,
        input_order, current_stream, validate_offsets, descriptor_workspace,
        sf_fp8_dtype_override=sf_fp8_dtype_override,
    )


def grouped_gemm_wgrad_wrapper_sm90(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    sfa_tensor: torch.Tensor | None,
    sfb_tensor: torch.Tensor | None,
    offsets_tensor: torch.Tensor,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    mma_tiler_mn: tuple[int, int] | None = None,
    cluster_shape_mn: tuple[int, int] | None = None,
    sf_vec_size: int = 16,
    sf_fp8_dtype_override: str | None = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: torch.Tensor | None = None,
    validate_offsets: bool = True,
) -> TupleDict:
    return _wrapper(
        GroupedGemmWgradSm90, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
        output_mode, wgrad_tensor, wgrad_ptrs, global_scale_a, global_scale_b, acc_dtype,
        wgrad_dtype, mma_tiler_mn, cluster_shape_mn, sf_vec_size, accumulate_on_output,
        input_order, current_stream, validate_offsets, descriptor_workspace,
        sf_fp8_dtype_override=sf_fp8_dtype_override,
    )


grouped_gemm_wgrad_wrapper_sm100.__doc__ = _wrapper_doc(
    "grouped_gemm_wgrad_wrapper_sm100", "GroupedGemmWgradSm100",
    "every expert token count a multiple of 256, non-decreasing, last == tokens_sum. Refuses "
    "devices below SM100.",
)
grouped_gemm_wgrad_wrapper_sm90.__doc__ = _wrapper_doc(
    "grouped_gemm_wgrad_wrapper_sm90", "GroupedGemmWgradSm90",
    "any expert token count >= 0, non-decreasing, last == tokens_sum. Refuses devices that are "
    "not SM 9.x.",
)


# ---------------------------------------------------------------------------------------------
# Device dispatch
# ---------------------------------------------------------------------------------------------

_BACKENDS = ("auto", "sm100", "sm90", "torch")


def select_grouped_wgrad_backend(device: torch.device | str) -> tuple[str, str]:
    """Which implementation ``grouped_gemm_wgrad(backend="auto")`` uses on ``device``.

    Returns:
        (name, reason): name in {"sm100", "sm90", "torch"}; reason says why torch was chosen.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "torch", f"device {device} is not a CUDA device"
    cc = _query_arch(device)
    if cc >= 100:
        module = _sm100_module()
        if module is None or not hasattr(module, "compile_sm100_wgrad"):
            return "torch", f"SM{cc}: the SM100 kernel is not built yet"
        unverified = getattr(module, "unverified_reason", lambda: None)()
        if unverified:  # compiled but never run on hardware: only with the explicit opt-in
            return "torch", f"SM{cc}: {unverified}"
        missing = _cutlass_dsl_missing()
        return ("torch", missing) if missing else ("sm100", "")
    if cc >= 90:
        missing = _cutlass_dsl_missing()
        return ("torch", missing) if missing else ("sm90", "")
    return "torch", f"SM{cc} is below SM90"


def grouped_gemm_wgrad(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    offsets_tensor: torch.Tensor,
    *,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    backend: str = "auto",
    validate_offsets: bool = True,
    current_stream: Any = None,
) -> TupleDict:
    """Grouped wgrad on any device: SM100 kernel on SM100+, SM90 kernel on Hopper, torch elsewhere.

    ``wgrad[e] (+)= A[:, begin:end] @ B[begin:end, :]``, fp32 accumulation.

    Args:
        a_tensor: [H, S] torch.bfloat16, K-major (S, 1) or M-major (1, H) strides.
        b_tensor: [S, I] torch.bfloat16, K-major (1, S) or N-major (I, 1) strides.
        offsets_tensor: [E] torch.int32 contiguous cumulative ends: non-decreasing, last == S;
            expert token counts multiples of 256 on the SM100 kernel, any count >= 0 otherwise.
        output_mode, wgrad_tensor, wgrad_ptrs, wgrad_dtype, accumulate_on_output, input_order,
            current_stream: as ``grouped_gemm_wgrad_wrapper_sm90``. The torch path cannot write
            through caller-owned ``wgrad_ptrs`` (ValueError there).
        backend: "auto" (by device, see ``select_grouped_wgrad_backend``), "sm100", "sm90" or
            "torch"; an explicit kernel that cannot run raises instead of falling back.
        validate_offsets: host-read offsets/pointer values (one sync); skipped during capture.

    Returns:
        TupleDict(wgrad_tensor=[E, H, I] tensor, or None for caller-owned ``wgrad_ptrs``).

    Raises:
        ValueError / RuntimeError: as the wrappers.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not isinstance(a_tensor, torch.Tensor):
            raise ValueError(f"a_tensor must be a torch.Tensor, got {type(a_tensor).__name__}")
        backend, _ = select_grouped_wgrad_backend(a_tensor.device)
    if backend in ("sm100", "sm90"):
        fn = grouped_gemm_wgrad_wrapper_sm100 if backend == "sm100" else (
            grouped_gemm_wgrad_wrapper_sm90
        )
        return fn(
            a_tensor, b_tensor, None, None, offsets_tensor, output_mode=output_mode,
            wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs, wgrad_dtype=wgrad_dtype,
            accumulate_on_output=accumulate_on_output, input_order=input_order,
            current_stream=current_stream, validate_offsets=validate_offsets,
        )
    return _torch_path(
        a_tensor, b_tensor, offsets_tensor, output_mode, wgrad_tensor, wgrad_ptrs, wgrad_dtype,
        accumulate_on_output, input_order, validate_offsets,
    )


def _torch_path(
    a_tensor, b_tensor, offsets_tensor, output_mode, wgrad_tensor, wgrad_ptrs, wgrad_dtype,
    accumulate_on_output, input_order, validate_offsets,
) -> TupleDict:
    if output_mode not in _OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    input_order = _check_input_order(input_order)
    if input_order == "tensor_ragged":
        a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
    hidden, tokens_sum, inter, num_experts, _, _ = _validate_operands(
        "torch", a_tensor, b_tensor, offsets_tensor, ("a_tensor", "b_tensor", "offsets_tensor")
    )
    _check_wgrad_dtype(wgrad_dtype)
    if wgrad_ptrs is not None:
        raise ValueError(
            "wgrad_ptrs: the torch fallback cannot write through caller-owned addresses; pass "
            "wgrad_tensor (or use a device with a grouped wgrad kernel)"
        )
    if wgrad_tensor is not None:
        _check_dense_out("torch", wgrad_tensor, (num_experts, hidden, inter), "wgrad_tensor")
    device = _check_same_device({
        "a_tensor": a_tensor, "b_tensor": b_tensor, "offsets_tensor": offsets_tensor,
        "wgrad_tensor": wgrad_tensor,
    })
    if validate_offsets and not _capturing(device):
        _check_offsets_values(offsets_tensor, tokens_sum, 1, "offsets_tensor")
    if wgrad_tensor is None:
        alloc = torch.zeros if accumulate_on_output else torch.empty
        wgrad_tensor = alloc((num_experts, hidden, inter), dtype=wgrad_dtype, device=device)
    grouped_wgrad_torch(
        a_tensor, b_tensor, offsets_tensor, out=wgrad_tensor, accumulate=accumulate_on_output,
        input_order=input_order,
    )
    return TupleDict(wgrad_tensor=wgrad_tensor)


def kernel_unsupported_reason(
    arch: str, a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor
) -> str | None:
    """Why the ``arch`` ("sm90" | "sm100") kernel's static contract does not cover this call.

    Checks host metadata only (dtypes, layouts, alignment, tile fit), never offsets values nor the
    device. Returns None when the call fits.
    """
    try:
        _, _, inter, num_experts, a_majors, b_majors = _validate_operands(
            arch, a_HS, b_SI, offsets_E, ("a_HS", "b_SI", "offsets_E")
        )
        _check_contract_fits(
            WgradContract(
                arch=arch, hidden=a_HS.shape[0], intermediate=inter, num_experts=num_experts,
                a_major=a_majors[0], b_major=b_majors[0], out_dtype="float32",
                output_mode="dense", accumulate=False, input_order="tensor2d",
                mma_tiler_mn=(256, 256) if arch == "sm100" else None, cluster_shape_mn=None,
            )
        )
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


_INTO_CACHE: dict[tuple, _GroupedGemmWgradBase] = {}


def _into_key(arch, a, b, offsets, out, accumulate) -> tuple:
    """Everything the validation of a dense tensor2d call depends on (metadata, never values):
    shapes, strides, dtypes, devices and the 16-byte alignment of each address."""
    return (
        arch, bool(accumulate), str(a.device),
        *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
          for t in (a, b, offsets, out)),
    )


def grouped_wgrad_into(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    out_EHI: torch.Tensor,
    *,
    accumulate: bool = False,
    backend: str = "sm90",
) -> None:
    """Hot path of a backward pass: ``out_EHI[e] (+)= a_HS[:, rows of e] @ b_SI[rows of e]``.

    The first call with a given metadata key (shapes, strides, dtypes, device, address alignment,
    ``accumulate``) goes through ``grouped_gemm_wgrad_wrapper_<backend>`` with every contract
    check; later calls with the same key launch the cached operator directly (validation costs
    ~100 us of host time per call otherwise). Offsets values are never host-read (no sync,
    CUDA-graph capturable), as ``validate_offsets=False``.

    Args:
        a_HS: [H, S] bf16.  b_SI: [S, I] bf16.  offsets_E: [E] int32 cumulative row ends.
        out_EHI: [E, H, I] contiguous bf16/fp16/fp32 output, written in place.
        accumulate: add into ``out_EHI`` instead of overwriting it.
        backend: "sm90" or "sm100".
    Raises:
        ValueError / RuntimeError: as the wrappers (first call of a key).
    """
    if backend not in ("sm90", "sm100"):
        raise ValueError(f"backend must be 'sm90' or 'sm100', got {backend!r}")
    key = _into_key(backend, a_HS, b_SI, offsets_E, out_EHI, accumulate)
    op = _INTO_CACHE.get(key)
    if op is not None:
        op._launch(a_HS, b_SI, offsets_E, out_EHI, None)
        return
    cls = GroupedGemmWgradSm90 if backend == "sm90" else GroupedGemmWgradSm100
    ops: list = []
    _wrapper(
        cls, a_HS, b_SI, None, None, offsets_E, "dense", out_EHI, None, None, None,
        torch.float32, out_EHI.dtype, None if backend == "sm90" else (256, 256), None, 16,
        accumulate, "tensor2d", None, False, None, _ops_out=ops,
    )
    with _CACHE_LOCK:
        _INTO_CACHE[key] = ops[0]


def _check_group_align(group_align) -> int:
    if isinstance(group_align, bool) or not isinstance(group_align, int) or group_align < 1:
        raise ValueError(f"group_align must be an int >= 1, got {group_align!r}")
    return group_align


def _fp32_route(
    backend: str, a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor,
    group_align: int = 1,
) -> tuple[str, str | None]:
    """The implementation :func:`grouped_wgrad_fp32` runs: ``(name, why not a kernel)``.

    ``name`` is "sm90", "sm100" or "torch"; the reason is None when a kernel runs. The SM100
    kernel is chosen only when the caller states ``group_align`` a multiple of
    :data:`SM100_GROUP_ALIGN` (its contract: every expert's rows a multiple of 256; it poisons
    experts that break it with NaN and cannot check offsets values without a host read), the
    SM90 kernel for any alignment. Host metadata only: no sync.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    group_align = _check_group_align(group_align)
    reason = "backend='torch' requested"
    if backend == "auto":
        backend, reason = select_grouped_wgrad_backend(a_HS.device)
    if backend == "torch":
        return "torch", reason
    reason = kernel_unsupported_reason(backend, a_HS, b_SI, offsets_E)
    if reason is None and backend == "sm100" and group_align % SM100_GROUP_ALIGN:
        reason = (
            f"the SM100 kernel needs every expert's rows in multiples of {SM100_GROUP_ALIGN}; "
            f"the caller guarantees group_align={group_align} (pass group_align="
            f"{SM100_GROUP_ALIGN} for a layout padded to {SM100_GROUP_ALIGN} rows)"
        )
    return ("torch", reason) if reason is not None else (backend, None)


def grouped_wgrad_fp32(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    backend: str = "auto",
    stats: dict | None = None,
    group_align: int = 1,
) -> torch.Tensor:
    """The dispatcher's ``grouped_wgrad(a_HS, b_SI, offsets_E) -> [E, H, I] fp32`` on any device.

    Runs the device's kernel (``select_grouped_wgrad_backend``) when the call fits its static
    contract (``kernel_unsupported_reason``) and, for the SM100 kernel, the caller's stated
    ``group_align`` (:func:`_fp32_route`), else ``grouped_wgrad_torch``. Offsets come from
    ``common.routing``'s grouped layout, so their values are not host-validated
    (``validate_offsets=False``: no sync, graph-capturable); that layout may end before S
    (``offsets_E[-1] <= S``), which the kernels allow since they read only each expert's rows.

    Args:
        a_HS: [H, S], b_SI: [S, I] (BF16 for the kernels), offsets_E: [E] int32/int64.
        backend: "auto" (by device), "sm90" or "sm100" (that kernel when the call fits its
            contract; the device is still checked by the wrapper), or "torch".
        stats: optional dict; counts ``"kernel"`` / ``"torch"`` calls and keeps the last
            ``"torch_reason"``.
        group_align: the row alignment the caller guarantees for every expert
            (``(offsets_E[e] - offsets_E[e - 1]) % group_align == 0``; not checked: no host
            read). The SM100 kernel runs only for a multiple of 256 (default 1: never; the
            grouped layout of ``common.torch_backward`` aligns to 16 rows).

    Returns:
        [E, H, I] float32.

    Raises:
        ValueError: unknown ``backend``, ``group_align`` not an int >= 1, or a contract rule.
    """
    offsets32 = offsets_E.to(torch.int32) if offsets_E.dtype != torch.int32 else offsets_E
    name, reason = _fp32_route(backend, a_HS, b_SI, offsets32, group_align)
    if name != "torch":
        wrapper = (
            grouped_gemm_wgrad_wrapper_sm90 if name == "sm90"
            else grouped_gemm_wgrad_wrapper_sm100
        )
        out = wrapper(
            a_HS, b_SI, None, None, offsets32, output_mode="dense", wgrad_dtype=torch.float32,
            validate_offsets=False,
        )["wgrad_tensor"]
        key = "kernel"
    else:
        out = grouped_wgrad_torch(a_HS, b_SI, offsets_E, out_dtype=torch.float32)
        key = "torch"
        if stats is not None:
            stats["torch_reason"] = reason
    if stats is not None:
        stats[key] = stats.get(key, 0) + 1
    return out
