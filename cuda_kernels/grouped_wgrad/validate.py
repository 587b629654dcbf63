"""The rules every grouped-wgrad format shares: operand shapes, majors and alignment, tiling,
outputs, pointers, devices, workspaces (host metadata, no sync) and the offsets / pointer values
(a host read, once per tensor version); plus the MX operand quantizer's argument rules.

Each rule is a named function that raises ``ValueError`` naming the argument (its name passed
in: ``a_tensor`` for a call, ``sample_a`` for a sample, ``a`` for a JAX array), before any
output is written. The ORDER in which a call's rules run is ``pipeline.validate_call``'s (the
one pipeline every entry calls); a format's own rules are in ``bf16.py`` / ``blockscaled.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from common.mx_atoms import grouped_scale_cols, grouped_scale_cols_bound

from ..gemm.launch import host_offset_ends
from ..gemm.tiles import TILE_RULES
from ._types import (
    BLOCK_SCALED_DTYPES,
    DESCRIPTORS_PER_EXPERT,
    OFFSETS_ALIGN_BYTES,
    OUTPUT_DTYPES,
    OUTPUT_MODES,
    POINTERS_ALIGN_BYTES,
    TMA_ALIGN_BYTES,
    TMA_DESCRIPTOR_BYTES,
    BlockScaledSpec,
    elem_bytes,
)
from .torch_ref import INPUT_ORDERS


def _a_majors(a: torch.Tensor, arg: str, pitched: bool = False) -> tuple[str, ...]:
    """Majors ("k", "m") that A's strides express, in order of preference; several only when the
    layout is moot (size-1 dims or no elements). ``pitched``: a K-major row stride may exceed
    tokens_sum (rows padded, as ``quantize_wgrad_operand`` writes them)."""
    hidden, tokens = a.shape
    s0, s1 = a.stride()
    majors = []
    if (s1 == 1 or tokens == 1) and (s0 == tokens or hidden == 1 or (pitched and s0 > tokens)):
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


def _b_majors(b: torch.Tensor, arg: str, pitched: bool = False) -> tuple[str, ...]:
    """Majors ("k", "n") that B's strides express (see ``_a_majors``)."""
    tokens, inter = b.shape
    s0, s1 = b.stride()
    majors = []
    if (s0 == 1 or tokens == 1) and (s1 == tokens or inter == 1 or (pitched and s1 > tokens)):
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


def check_ptr(t: torch.Tensor, arg: str, align: int) -> None:
    if t.device.type == "meta" or t.numel() == 0:
        return
    if t.data_ptr() % align:
        raise ValueError(f"{arg}: data pointer {t.data_ptr():#x} must be {align}-byte aligned")


def check_tiling(arch: str, mma_tiler_mn, cluster_shape_mn) -> tuple:
    """Validate the tiling arguments against ``tiles.TILE_RULES[arch]`` (none for "torch");
    returns (mma_tiler_mn, cluster_shape_mn) as tuples / None. A kernel built for clusters
    (``max_cluster_ctas > 1``) takes any power-of-two cluster the API allows, else only the
    clusters its tiles run on."""

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
    if arch not in TILE_RULES:
        return tiler, cluster
    rules = TILE_RULES[arch]
    tiles_text = (
        f"tile M in {rules.tile_m}, tile N a multiple of {rules.tile_n_step} in "
        f"[{rules.tile_n_step}, {rules.tile_n_max}]"
    )
    if rules.max_cluster_ctas > 1:
        if tiler is not None and (tiler[0] not in rules.tile_m or tiler[1] not in rules.tile_n):
            raise ValueError(f"mma_tiler_mn={tiler} unsupported on {rules.arch}: {tiles_text}")
        if cluster is not None:
            cm, cn = cluster
            pow2 = all(c >= 1 and (c & (c - 1)) == 0 for c in cluster)
            if not pow2 or cm * cn > rules.max_cluster_ctas:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported on {rules.arch}: powers of two, at "
                    f"most {rules.max_cluster_ctas} CTAs"
                )
            if tiler is not None and tiler[0] == rules.two_cta_tile_m and cm % 2:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported with mma_tiler_mn "
                    f"M={rules.two_cta_tile_m} (2-CTA MMA): cluster M must be even"
                )
    else:
        if tiler is not None and (tiler[0] not in rules.tile_m or tiler[1] not in rules.tile_n):
            raise ValueError(
                f"mma_tiler_mn={tiler} unsupported on {rules.arch}: {tiles_text} (or None: chosen "
                "per shape from configs/cuda)"
            )
        clusters = tuple(sorted({rules.cluster_for(m) for m in rules.tile_m}))
        if cluster is not None and cluster not in clusters:
            raise ValueError(
                f"cluster_shape_mn={cluster} unsupported on {rules.arch}: one of {clusters} or None"
            )
    return tiler, cluster


#: Tensors whose values passed a host-read check: key -> weak reference to the tensor checked.
#: A key is (check, device, data_ptr, _version, shape, check arguments); a hit needs the same live
#: tensor object, so a new tensor allocated at a freed address never inherits a verdict.
_VALIDATED: dict[tuple, Any] = {}
_VALIDATED_MAX = 1024
_VALIDATED_LOCK = threading.RLock()


def validated_once(t: torch.Tensor, key: tuple, check: Callable[[], None]) -> None:
    """Run ``check`` (a host read: one device sync) unless ``t`` passed it unchanged before.

    "Unchanged" is torch's version counter (``t._version``), which every in-place torch op on
    the tensor or a view of it bumps, as cuDNN caches its offsets validation; a write that
    bypasses torch (a custom kernel writing through ``data_ptr()``) is not seen, so callers that
    rewrite offsets that way must not rely on the cache (``clear_grouped_wgrad_caches()``).
    """
    import weakref

    full = (*key, t.device, t.data_ptr(), t._version, tuple(t.shape))
    with _VALIDATED_LOCK:
        ref = _VALIDATED.get(full)
        if ref is not None and ref() is t:
            return
    check()
    with _VALIDATED_LOCK:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        try:
            _VALIDATED[full] = weakref.ref(t)
        except TypeError:  # pragma: no cover - every torch.Tensor supports weak references
            pass


def check_offsets_values(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str, why: str = "on this kernel"
) -> None:
    """Host read of the offsets: non-decreasing, >= 0, groups multiples of align, last == S.

    Once per tensor version (``validated_once``): repeated calls with the same unchanged
    offsets tensor do not synchronise again.
    """
    validated_once(
        offsets,
        ("offsets", tokens_sum, group_align, arg),
        lambda: check_offsets_now(offsets, tokens_sum, group_align, arg, why),
    )


def check_offsets_now(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str, why: str = "on this kernel"
) -> None:
    """The offsets rule on the values now (a host read; :func:`check_offsets_values` caches it
    per tensor version): non-decreasing from >= 0, every count a multiple of ``group_align``
    (``why`` ends that message), the last == ``tokens_sum``."""
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
                f"multiple of {group_align} {why}"
            )
        prev = end
    if values and values[-1] != tokens_sum:
        raise ValueError(
            f"{arg}: last offset {values[-1]} must equal tokens_sum {tokens_sum} "
            "(A.shape[1] == B.shape[0])"
        )


def check_pointer_values(
    ptrs: torch.Tensor, arg: str, stacked: torch.Tensor | None = None
) -> None:
    """Host read of the output addresses (:func:`check_pointers_now`), once per tensor version.
    ``stacked``: the stacked ``wgrad_tensor`` a discrete call passes too (cuDNN's calls pass
    both): the pointers must be exactly its expert slabs, so the tensor returned is the memory
    written."""
    slabs = None
    if stacked is not None:
        step = stacked[0].numel() * stacked.element_size() if stacked.shape[0] else 0
        slabs = (stacked.data_ptr(), step)
    validated_once(
        ptrs, ("pointers", arg, slabs), lambda: check_pointers_now(ptrs.tolist(), arg, slabs)
    )


def check_pointers_now(values, arg: str, slabs: tuple[int, int] | None = None) -> None:
    """Every output address non-null and 16-byte aligned; with ``slabs = (base, step)`` expert
    ``e``'s address is ``base + e * step``."""
    for e, p in enumerate(int(v) for v in values):
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


#: The MX wgrad operand quantizer's choices (``quantize.py`` and its torch twin
#: ``blockscaled_ref.quantize_wgrad_operand_torch``): element formats, scale rules, tokens per
#: scale group (MX: 32).
QUANT_ELEMS = ("e4m3", "e5m2", "e2m1")
QUANT_SCALE_RULES = ("ocp", "rceil")
QUANT_SF_VEC = 32


def check_quantize_args(
    x_SH: Any,
    offsets_E: Any,
    *,
    elem: str,
    scale_rule: str,
    scale_cols: int | None,
    validate: bool = True,
    fn: str = "quantize_wgrad_operand",
    layout_check: Callable[[], None] | None = None,
) -> int:
    """The input rules of the MX wgrad operand quantizer, shared by the Triton entry
    (``quantize.quantize_wgrad_operand``) and its torch twin
    (``blockscaled_ref.quantize_wgrad_operand_torch``), so the two cannot drift apart.

    Rules: ``elem`` in :data:`QUANT_ELEMS`, ``scale_rule`` in :data:`QUANT_SCALE_RULES`;
    ``x_SH`` a rank-2 bfloat16 tensor [S, H]; ``offsets_E`` a non-empty rank-1 int32 tensor on
    x's device; ``scale_cols`` a non-negative multiple of 4 (default
    ``grouped_scale_cols_bound(S, E, 32)``). With ``validate`` (one host read of the offsets):
    non-decreasing, >= 0, even for ``elem="e2m1"``, last == S, and ``scale_cols`` large enough
    for these offsets; without it only an even S for e2m1.

    Args:
        fn: the public function's name, the prefix of every message.
        layout_check: the caller's own static rules (the Triton kernel's layouts: unit stride
            along H, contiguous offsets), run after the shared static rules and before the host
            read of the offsets.

    Returns:
        The resolved ``scale_cols``.

    Raises:
        ValueError: ``"{fn}: ..."`` naming the argument and the rule.
    """
    def err(msg: str) -> ValueError:
        return ValueError(f"{fn}: {msg}")

    if elem not in QUANT_ELEMS:
        raise err(f"elem must be one of {QUANT_ELEMS}; got {elem!r}")
    if scale_rule not in QUANT_SCALE_RULES:
        raise err(f"scale_rule must be one of {QUANT_SCALE_RULES}; got {scale_rule!r}")
    if not isinstance(x_SH, torch.Tensor) or x_SH.dim() != 2 or x_SH.dtype != torch.bfloat16:
        got = (f"{tuple(x_SH.shape)} {x_SH.dtype}" if isinstance(x_SH, torch.Tensor)
               else type(x_SH).__name__)
        raise err(f"x_SH must be a rank-2 bfloat16 tensor [tokens_sum, H]; got {got}")
    if not isinstance(offsets_E, torch.Tensor) or offsets_E.dim() != 1 or \
            offsets_E.dtype != torch.int32 or offsets_E.numel() == 0:
        got = (f"{tuple(offsets_E.shape)} {offsets_E.dtype}"
               if isinstance(offsets_E, torch.Tensor) else type(offsets_E).__name__)
        raise err(f"offsets_E must be a non-empty rank-1 int32 tensor; got {got}")
    if offsets_E.device != x_SH.device:
        raise err(f"offsets_E is on {offsets_E.device} but x_SH is on {x_SH.device}")
    tokens_sum = x_SH.shape[0]
    num_experts = offsets_E.numel()
    fp4 = elem == "e2m1"
    if scale_cols is None:
        scale_cols = grouped_scale_cols_bound(tokens_sum, num_experts, QUANT_SF_VEC)
    if not isinstance(scale_cols, int) or isinstance(scale_cols, bool) or scale_cols < 0 or \
            scale_cols % 4:
        raise err(f"scale_cols must be a non-negative multiple of 4; got {scale_cols!r}")
    if layout_check is not None:
        layout_check()
    if validate:
        ends = host_offset_ends(offsets_E, tokens_sum, arg="offsets_E", err=err, even=fp4)
        need = grouped_scale_cols(ends, QUANT_SF_VEC)[2]
        if scale_cols < need:
            raise err(f"scale_cols={scale_cols} is too small: these offsets need {need}")
    elif fp4 and tokens_sum % 2:
        raise err(f"elem='e2m1' needs an even tokens_sum; got {tokens_sum}")
    return scale_cols


def check_dtype_pair(a_dtype, b_dtype, a_arg: str, b_arg: str) -> None:
    """The BF16 format's operand pair: A and B torch.bfloat16 (a block-scaled pair is named as
    such: it takes the scale tensors)."""
    if a_dtype == torch.bfloat16 and b_dtype == torch.bfloat16:
        return
    if a_dtype in BLOCK_SCALED_DTYPES and b_dtype in BLOCK_SCALED_DTYPES:
        if a_dtype != b_dtype:
            raise ValueError(
                f"{a_arg}/{b_arg}: block-scaled operands need one dtype for A and B (FP8 E4M3, "
                f"FP8 E5M2 or packed FP4); got {a_arg} {a_dtype} and {b_arg} {b_dtype}"
            )
        raise ValueError(
            f"{a_arg}/{b_arg} dtype {a_dtype} is a block-scaled (FP8/FP4) operand pair; this "
            "entry takes BF16 operands only (block-scaled calls go through the wrappers, the "
            "classes or grouped_gemm_wgrad with sfa_tensor and sfb_tensor)"
        )
    bad = a_arg if a_dtype != torch.bfloat16 else b_arg
    raise ValueError(
        f"{bad}: the BF16 backend needs torch.bfloat16 A and B; got {a_arg} {a_dtype} and "
        f"{b_arg} {b_dtype}"
    )


def ragged_compact(
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
            out.append(t)  # reported by validate_operands
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


def validate_operands(
    arch: str,
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    names: tuple[str, str, str],
    spec: BlockScaledSpec | None = None,
) -> tuple[int, int, int, int, str, str]:
    """Ranks, shapes, dtypes, majors and alignment of A, B, offsets (host metadata only).

    ``spec`` (block-scaled operands, dtypes already checked by :func:`_validate_blockscaled`):
    1-byte elements, and packed FP4 holds two tokens per byte along the token axis.

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
    hidden, k_len = a.shape
    pack = 2 if spec is not None and spec.packed_fp4 else 1
    tokens_sum = k_len * pack
    if b.shape[0] != k_len:
        raise ValueError(
            f"{a_arg} and {b_arg} token dimensions must match: {a_arg}.shape[1] = {k_len}, "
            f"{b_arg}.shape[0] = {b.shape[0]}"
            + (" (packed FP4: tokens_sum / 2 bytes each)" if pack == 2 else "")
        )
    intermediate = b.shape[1]
    if hidden < 1 or intermediate < 1:
        raise ValueError(
            f"{a_arg}/{b_arg}: hidden and intermediate must be >= 1, got {hidden} and "
            f"{intermediate}"
        )
    if spec is None:
        check_dtype_pair(a.dtype, b.dtype, a_arg, b_arg)
    if offsets.dim() != 1:
        raise ValueError(f"{off_arg} must be rank-1 (num_experts,), got {tuple(offsets.shape)}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"{off_arg} must be torch.int32, got {offsets.dtype}")
    num_experts = offsets.shape[0]
    if num_experts < 1:
        raise ValueError(
            f"{off_arg} must hold at least one expert, got shape {tuple(offsets.shape)}"
        )
    if offsets.stride(0) != 1:
        raise ValueError(
            f"{off_arg} must be contiguous (stride (1,)), got {tuple(offsets.stride())}"
        )
    # block-scaled K-major rows may be pitched (the quantizer pads rows to 32 tokens for 16-byte
    # TMA strides): the twin and the SM90 MXFP8 kernel read any row stride; the SM100 kernels
    # compile a compact layout, so they keep the compact rule
    pitched = spec is not None and arch in ("torch", "sm90")
    a_majors = _a_majors(a, a_arg, pitched)
    b_majors = _b_majors(b, b_arg, pitched)
    if arch != "torch" and spec is not None and spec.packed_fp4:
        for arg, majors, rule in ((a_arg, a_majors, f"({k_len}, 1)"), (b_arg, b_majors,
                                                                        f"(1, {k_len})")):
            if "k" not in majors:
                raise ValueError(
                    f"{arg}: packed FP4 operands must be K-major (two tokens per byte along "
                    f"tokens, the FP4 MMA reads K-major only): strides {rule}"
                )
        a_majors, b_majors = ("k",), ("k",)
    a_major, b_major = a_majors[0], b_majors[0]
    if arch != "torch":
        elem = 2 if spec is None else 1  # bytes per stored element (BF16 / FP8 / two FP4)
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
        k_ops = [(arg, t, d) for arg, t, d, mj in ((a_arg, a, 0, a_major), (b_arg, b, 1, b_major))
                 if mj == "k"]
        pitched_ops = {arg: t.stride(d) for arg, t, d in k_ops
                       if pitched and t.shape[d] > 1 and t.stride(d) != k_len}
        for arg, pitch in pitched_ops.items():
            if pitch % need:
                raise ValueError(
                    f"{arg}: a pitched K-major operand needs its row stride % {need} == 0 "
                    f"(16-byte TMA strides), got {pitch}")
        compact = [arg for arg, _, _ in k_ops if arg not in pitched_ops]
        if compact and k_len % need:
            raise ValueError(
                f"{compact[0]}: a K-major operand needs tokens_sum % {need * pack} == 0 (16-byte "
                f"TMA strides), got tokens_sum={tokens_sum}"
            )
        check_ptr(a, a_arg, TMA_ALIGN_BYTES)
        check_ptr(b, b_arg, TMA_ALIGN_BYTES)
        check_ptr(offsets, off_arg, OFFSETS_ALIGN_BYTES)
    return hidden, tokens_sum, intermediate, num_experts, a_majors, b_majors


def check_output_mode(output_mode) -> str:
    """``output_mode`` is "dense" or "discrete"."""
    if output_mode not in OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    return output_mode


def check_output_rows(intermediate: int, out_name: str, arg: str) -> None:
    """A kernel's output rows are TMA-stored: ``intermediate * element size`` a multiple of 16
    bytes for the output dtype ``out_name`` (the argument that chose it is ``arg``)."""
    need = TMA_ALIGN_BYTES // elem_bytes(out_name)
    if intermediate % need:
        raise ValueError(
            f"{arg}: intermediate % {need} == 0 needed for 16-byte TMA stores of {out_name}, "
            f"got intermediate={intermediate}"
        )


def check_dense_out(
    arch: str, out: torch.Tensor, shape: tuple[int, int, int], arg: str, out_dtype=None
) -> str:
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(out).__name__}")  # noqa: TRY004
    if tuple(out.shape) != shape:
        raise ValueError(
            f"{arg} must have shape (num_experts, hidden, intermediate) = {shape}, "
            f"got {tuple(out.shape)}"
        )
    if out.dtype not in OUTPUT_DTYPES:
        raise ValueError(f"{arg} dtype must be one of bfloat16/float16/float32, got {out.dtype}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(
            f"{arg} dtype {out.dtype} differs from the compiled wgrad_dtype {out_dtype}"
        )
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
        check_ptr(out, arg, TMA_ALIGN_BYTES)
    return OUTPUT_DTYPES[out.dtype]


def check_expert_out(arch: str, out: torch.Tensor, shape: tuple[int, int], dtype, arg: str):
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(out).__name__}")  # noqa: TRY004
    if tuple(out.shape) != shape:
        raise ValueError(
            f"{arg} must have shape (hidden, intermediate) = {shape}, got {tuple(out.shape)}"
        )
    if tuple(out.stride()) != (shape[1], 1):
        raise ValueError(
            f"{arg} must be contiguous with strides {(shape[1], 1)}, got {tuple(out.stride())}"
        )
    if out.dtype != dtype:
        raise ValueError(f"{arg} dtype {out.dtype} must equal wgrad_dtype {dtype}")
    if arch != "torch":
        check_ptr(out, arg, TMA_ALIGN_BYTES)


def check_ptrs_tensor(ptrs: torch.Tensor, num_experts: int, arg: str = "wgrad_ptrs") -> None:
    if not isinstance(ptrs, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(ptrs).__name__}")  # noqa: TRY004
    if ptrs.dtype != torch.int64:
        raise ValueError(f"{arg} must be torch.int64, got {ptrs.dtype}")
    if tuple(ptrs.shape) != (num_experts,):
        raise ValueError(
            f"{arg} must have shape (num_experts,) = ({num_experts},), got {tuple(ptrs.shape)}"
        )
    if ptrs.stride(0) != 1:
        raise ValueError(f"{arg} must be contiguous (stride (1,)), got {tuple(ptrs.stride())}")
    check_ptr(ptrs, arg, POINTERS_ALIGN_BYTES)


def check_same_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {v.device for v in present.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{k} on {v.device}" for k, v in present.items())
        raise ValueError(f"inputs, offsets and outputs must be on one device; got {listing}")
    return next(iter(devices))


def check_input_order(input_order) -> str:
    value = getattr(input_order, "value", input_order)
    if value not in INPUT_ORDERS:
        raise ValueError(f"input_order must be one of {INPUT_ORDERS}, got {input_order!r}")
    return value


def check_wgrad_dtype(wgrad_dtype, arg: str = "wgrad_dtype") -> str:
    if wgrad_dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"{arg} must be torch.bfloat16, torch.float16 or torch.float32, got {wgrad_dtype}"
        )
    return OUTPUT_DTYPES[wgrad_dtype]


def clear_validated() -> None:
    with _VALIDATED_LOCK:
        _VALIDATED.clear()


def get_grouped_gemm_wgrad_workspace_size_sm100(
    num_experts: int, output_mode: str = "dense", input_order: str = "tensor2d"
) -> int:
    """Bytes of the caller-owned ``descriptor_workspace``, cuDNN's size: per expert, 128-byte TMA
    descriptors (CUtensorMap) of A, B, SFA and SFB, plus the output's in discrete mode; the same
    for either ``input_order`` (1024 bytes for 2 dense experts, as cuDNN's test pins).

    The SM100 BF16 kernel builds per-expert TMA descriptors on the device in this buffer: the
    output's in discrete mode and each ``tensor_ragged`` K-major operand's, at most 3 per expert
    (``sm100_bf16.descriptors_per_expert``), so cuDNN's size (4 dense, 5 discrete per expert)
    always holds them and stays the documented size: no growth, and every buffer sized the cuDNN
    way is accepted. Without a buffer the launcher allocates one per launch (on the launch
    stream). The SM90 BF16 kernel builds no runtime descriptors and leaves the buffer untouched.
    A buffer the SM100 kernel writes must be 64-byte aligned (CUtensorMap), checked at launch.
    The kernel's per-expert "descriptor ready" flags are not kept here: they follow the tile
    counter in the int32 word buffer the launcher allocates and zeroes per launch.

    Raises:
        ValueError: ``num_experts`` is not a positive int, or an unknown mode / order.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be positive (an int >= 1), got {num_experts!r}")
    check_output_mode(output_mode)
    check_input_order(input_order)
    return num_experts * DESCRIPTORS_PER_EXPERT[output_mode] * TMA_DESCRIPTOR_BYTES


def check_workspace(
    descriptor_workspace, workspace, num_experts: int, output_mode: str, input_order: str
) -> torch.Tensor | None:
    """The caller's workspace (``descriptor_workspace``, or cuDNN's ``workspace`` alias), checked:
    uint8, contiguous, at least the size for ``num_experts``; both given must name one buffer."""
    if descriptor_workspace is not None and workspace is not None:
        same = (
            isinstance(descriptor_workspace, torch.Tensor)
            and isinstance(workspace, torch.Tensor)
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
