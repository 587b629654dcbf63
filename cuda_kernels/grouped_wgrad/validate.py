"""Validation of grouped-wgrad calls: shapes, dtypes, majors, alignment, tiling, outputs, devices,
workspaces (host metadata, no sync) and the offsets / pointer values (a host read, once per
tensor version). Every rule raises ``ValueError`` (or ``RuntimeError`` for the environment)
naming the argument, before any output is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.mx_atoms import (
    ATOM_COLS,
    ATOM_ROWS,
    grouped_scale_cols,
    grouped_scale_cols_bound,
    round_up,
)

from ._types import (
    BLOCK_SCALED_DTYPES,
    BLOCKSCALED_FORMATS,
    BLOCKSCALED_TOKEN_ALIGN,
    SF_DTYPES,
    BlockScaledSpec,
    DESCRIPTORS_PER_EXPERT,
    OUTPUT_MODES,
    TMA_DESCRIPTOR_BYTES,
    OFFSETS_ALIGN_BYTES,
    OUTPUT_DTYPES,
    POINTERS_ALIGN_BYTES,
    TMA_ALIGN_BYTES,
)
from .tiles import SM90_TILES, SM100_TILES
from .torch_ref import INPUT_ORDERS

#: The tile rules the API checks a caller's ``mma_tiler_mn`` / ``cluster_shape_mn`` against.
_TILE_RULES = {"sm90": SM90_TILES, "sm100": SM100_TILES}


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
    if arch not in _TILE_RULES:
        return tiler, cluster
    rules = _TILE_RULES[arch]
    tiles_text = (
        f"tile M in {rules.tile_m}, tile N a multiple of {rules.tile_n_step} in "
        f"[{rules.tile_n_step}, {rules.tile_n_max}]"
    )
    if arch == "sm100":
        if tiler is not None and (tiler[0] not in rules.tile_m or tiler[1] not in rules.tile_n):
            raise ValueError(f"mma_tiler_mn={tiler} unsupported on SM100: {tiles_text}")
        if cluster is not None:
            cm, cn = cluster
            pow2 = all(c >= 1 and (c & (c - 1)) == 0 for c in cluster)
            if not pow2 or cm * cn > rules.max_cluster_ctas:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported on SM100: powers of two, at most "
                    f"{rules.max_cluster_ctas} CTAs"
                )
            if tiler is not None and tiler[0] == rules.two_cta_tile_m and cm % 2:
                raise ValueError(
                    f"cluster_shape_mn={cluster} unsupported with mma_tiler_mn "
                    f"M={rules.two_cta_tile_m} (2-CTA MMA): cluster M must be even"
                )
    else:
        if tiler is not None and (tiler[0] not in rules.tile_m or tiler[1] not in rules.tile_n):
            raise ValueError(
                f"mma_tiler_mn={tiler} unsupported on SM90: {tiles_text} (or None: chosen per "
                "shape from configs/cuda)"
            )
        clusters = tuple(sorted({rules.cluster_for(m) for m in rules.tile_m}))
        if cluster is not None and cluster not in clusters:
            raise ValueError(
                f"cluster_shape_mn={cluster} unsupported on SM90: one of {clusters} or None"
            )
    return tiler, cluster


#: Tensors whose values passed a host-read check: key -> weak reference to the tensor checked.
#: A key is (check, device, data_ptr, _version, shape, check arguments); a hit needs the same live
#: tensor object, so a new tensor allocated at a freed address never inherits a verdict.
_VALIDATED: dict[tuple, Any] = {}
_VALIDATED_MAX = 1024
_VALIDATED_LOCK = threading.RLock()


def _validated_once(t: torch.Tensor, key: tuple, check: Callable[[], None]) -> None:
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


def _check_offsets_values(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str, why: str = "on this kernel"
) -> None:
    """Host read of the offsets: non-decreasing, >= 0, groups multiples of align, last == S.

    Once per tensor version (``_validated_once``): repeated calls with the same unchanged
    offsets tensor do not synchronise again.
    """
    _validated_once(
        offsets,
        ("offsets", tokens_sum, group_align, arg),
        lambda: _check_offsets_now(offsets, tokens_sum, group_align, arg, why),
    )


def _check_offsets_now(
    offsets: torch.Tensor, tokens_sum: int, group_align: int, arg: str, why: str = "on this kernel"
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
                f"multiple of {group_align} {why}"
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


#: The MX wgrad operand quantizer's choices (``quantize.py`` and its torch twin
#: ``blockscaled_ref.quantize_wgrad_operand_torch``): element formats, scale rules, tokens per
#: scale group (MX: 32).
QUANT_ELEMS = ("e4m3", "e5m2", "e2m1")
QUANT_SCALE_RULES = ("ocp", "rceil")
QUANT_SF_VEC = 32


def host_offset_ends(
    offsets: torch.Tensor, tokens_sum: int, *, arg: str, err: Callable[[str], Exception],
    even: bool = False,
) -> list[int]:
    """Read cumulative expert ends on the host (one device sync on CUDA) and check them:
    non-decreasing from >= 0, even where FP4 packs token pairs (``even``), the last equal to
    ``tokens_sum``. Shared by the quantizer entries, the block-scaled twin and the SM90 MXFP8
    entry; ``err(message)`` makes the caller's exception.

    Returns:
        The ends as Python ints.
    """
    ends = [int(v) for v in offsets.tolist()]
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise err(f"{arg} must be non-decreasing and >= 0; {arg}[{e}] = {end} after {prev}")
        if even and end % 2:
            raise err(f"FP4 packs token pairs, so every offset must be even; {arg}[{e}] = {end}")
        prev = end
    if ends and ends[-1] != tokens_sum:
        raise err(f"{arg}[-1] = {ends[-1]} must equal tokens_sum = {tokens_sum}")
    return ends


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


def _check_dtype_pair(a_dtype, b_dtype, a_arg: str, b_arg: str) -> None:
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
    scales: tuple | None = None  # block-scaled: (sfa, sfb, global_scale_a, global_scale_b)


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
        _check_dtype_pair(a.dtype, b.dtype, a_arg, b_arg)
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
        _check_ptr(out, arg, TMA_ALIGN_BYTES)
    return OUTPUT_DTYPES[out.dtype]


def _check_expert_out(arch: str, out: torch.Tensor, shape: tuple[int, int], dtype, arg: str):
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
        _check_ptr(out, arg, TMA_ALIGN_BYTES)


def _check_ptrs_tensor(ptrs: torch.Tensor, num_experts: int, arg: str = "wgrad_ptrs") -> None:
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
    if output_mode not in OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    _check_input_order(input_order)
    return num_experts * DESCRIPTORS_PER_EXPERT[output_mode] * TMA_DESCRIPTOR_BYTES


def _check_workspace(
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


# ---------------------------------------------------------------------------------------------
# The block-scaled (FP8 / FP4) contract
# ---------------------------------------------------------------------------------------------

_ELEM_KIND = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FORMAT_TEXT = (
    "float8_e4m3fn / float8_e5m2 operands + float8_e8m0fnu scales at sf_vec_size=32 (MXFP8), "
    "packed FP4 (uint8 / float4_e2m1fn_x2) + float8_e8m0fnu at 32 (MXFP4), packed FP4 + "
    "float8_e4m3fn at 16 with global_scale_a / global_scale_b (NVFP4)"
)
_FORMAT_NAMES = {"mxfp8": "MXFP8", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


def _is_blockscaled_pair(a, b, a_arg: str = "a_tensor", b_arg: str = "b_tensor") -> bool:
    """True when A and B are one FP8 / FP4 dtype: the pair that selects the block-scaled backend
    (seed: only a supported matching FP4/FP8 operand pair selects it).

    Raises:
        ValueError: A and B are two different FP8 / FP4 dtypes (no backend takes the mix).
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype in BLOCK_SCALED_DTYPES and b.dtype in BLOCK_SCALED_DTYPES:
        if a.dtype != b.dtype:
            _check_dtype_pair(a.dtype, b.dtype, a_arg, b_arg)
        return True
    return False


def _check_sf_fp8_dtype_override(value) -> None:
    if value is not None:
        raise ValueError(
            f"sf_fp8_dtype_override must be None, got {value!r}: cuDNN's override of the FP8 "
            "scale-factor dtype applies to Rubin GPUs only, and this package has no Rubin kernel"
        )


def _blockscaled_spec(
    arch: str, a, sfa, sfb, sf_vec_size, sf_fp8_dtype_override, acc_dtype, names
) -> BlockScaledSpec:
    """The format of a block-scaled call (dtype pair already matched): scale dtypes, vector size,
    override and accumulator rules."""
    a_arg, sfa_arg, sfb_arg = names
    for name, sf in ((sfa_arg, sfa), (sfb_arg, sfb)):
        if sf is None:
            raise ValueError(
                f"{name} is required: {a.dtype} operands select the block-scaled backend, which "
                "needs the scale factors of A and B (sfa / sfb)"
            )
        if not isinstance(sf, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(sf).__name__}")  # noqa: TRY004
        if sf.dtype not in SF_DTYPES:
            raise ValueError(
                f"{name} dtype must be torch.float8_e8m0fnu (MX) or torch.float8_e4m3fn (NVFP4), "
                f"got {sf.dtype}"
            )
    if sfa.dtype != sfb.dtype:
        raise ValueError(
            f"{sfa_arg} and {sfb_arg} need one dtype; got {sfa.dtype} and {sfb.dtype}"
        )
    if isinstance(sf_vec_size, bool) or not isinstance(sf_vec_size, int):
        raise ValueError(f"sf_vec_size must be an int (16 or 32), got {sf_vec_size!r}")
    kind = _ELEM_KIND.get(a.dtype, "e2m1")
    fmt = BLOCKSCALED_FORMATS.get((kind, sfa.dtype, sf_vec_size))
    if fmt is None:
        raise ValueError(
            f"{a_arg} {a.dtype} with {sfa_arg} {sfa.dtype} at sf_vec_size={sf_vec_size} is not a "
            f"supported block-scaled format; supported: {_FORMAT_TEXT}"
        )
    _check_sf_fp8_dtype_override(sf_fp8_dtype_override)
    if acc_dtype != torch.float32:
        raise ValueError(f"acc_dtype must be torch.float32 (FP32 accumulation), got {acc_dtype}")
    return BlockScaledSpec(
        fmt=fmt,
        ab_dtype=str(a.dtype).removeprefix("torch."),
        sf_dtype=SF_DTYPES[sfa.dtype],
        sf_vec_size=sf_vec_size,
        token_align=BLOCKSCALED_TOKEN_ALIGN[arch][fmt],
        sf_fp8_dtype_override=sf_fp8_dtype_override,
    )


def _check_sf_tensor(arch: str, sf: torch.Tensor, rows: int, tokens_sum: int, sf_vec: int,
                     arg: str, rows_name: str) -> None:
    """Shape, layout and alignment of one scale tensor (host metadata only): cuDNN's
    ``[round_up(rows, 128), cols]`` 128x4-atom layout, ``cols`` a multiple of 4 and at least
    ``round_up(ceil(tokens_sum / sf_vec), 4)`` (what every split needs; the per-split need is
    checked with the offsets values)."""
    rp = round_up(rows, ATOM_ROWS)
    min_cols = round_up(-(-tokens_sum // sf_vec), ATOM_COLS)
    if sf.dim() != 2 or sf.shape[0] != rp:
        raise ValueError(
            f"{arg} must be rank-2 [round_up({rows_name}, 128), cols] = [{rp}, cols] (128x4 "
            f"scale atoms, cuDNN's layout), got shape {tuple(sf.shape)}"
        )
    if sf.shape[1] % ATOM_COLS or sf.shape[1] < min_cols:
        raise ValueError(
            f"{arg} needs a multiple of 4 columns, at least round_up(ceil(tokens_sum / "
            f"sf_vec_size), 4) = {min_cols} (tokens_sum={tokens_sum}, sf_vec_size={sf_vec}); "
            f"got {sf.shape[1]}"
        )
    if not sf.is_contiguous():
        raise ValueError(
            f"{arg} must be contiguous (the atom layout is a byte order), got strides "
            f"{tuple(sf.stride())}"
        )
    if arch != "torch":
        _check_ptr(sf, arg, TMA_ALIGN_BYTES)


def _check_global_scale(g, num_experts: int, arg: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise ValueError(
            f"{arg} is required for NVFP4: a torch.float32 tensor of shape (num_experts,) = "
            f"({num_experts},) (per-expert global scale), got {type(g).__name__}"
        )
    if g.dtype != torch.float32 or tuple(g.shape) != (num_experts,) or g.stride(0) != 1:
        raise ValueError(
            f"{arg} must be a contiguous torch.float32 tensor of shape ({num_experts},) "
            f"(per-expert global scale), got {g.dtype} {tuple(g.shape)} strides {tuple(g.stride())}"
        )


@dataclass(frozen=True)
class _BlockScaledOperands:
    """Host metadata of a validated block-scaled call."""

    hidden: int
    tokens_sum: int
    intermediate: int
    num_experts: int
    a_majors: tuple[str, ...]
    b_majors: tuple[str, ...]
    spec: BlockScaledSpec


def _validate_blockscaled(
    arch: str,
    a: torch.Tensor,
    b: torch.Tensor,
    sfa,
    sfb,
    offsets: torch.Tensor,
    global_scale_a,
    global_scale_b,
    *,
    sf_vec_size,
    sf_fp8_dtype_override,
    acc_dtype,
    names: tuple[str, ...] = (
        "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "global_scale_a",
        "global_scale_b",
    ),
) -> _BlockScaledOperands:
    """Every host-metadata rule of a block-scaled call (A / B one FP8 or FP4 dtype): format,
    scales, global scales, shapes, majors, alignment. No device read; see
    :func:`_check_blockscaled_values` for the offsets values."""
    a_arg, b_arg, sfa_arg, sfb_arg, off_arg, gsa_arg, gsb_arg = names
    spec = _blockscaled_spec(
        arch, a, sfa, sfb, sf_vec_size, sf_fp8_dtype_override, acc_dtype, (a_arg, sfa_arg, sfb_arg)
    )
    hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
        arch, a, b, offsets, (a_arg, b_arg, off_arg), spec
    )
    _check_sf_tensor(arch, sfa, hidden, tokens_sum, spec.sf_vec_size, sfa_arg, "hidden")
    _check_sf_tensor(arch, sfb, inter, tokens_sum, spec.sf_vec_size, sfb_arg, "intermediate")
    if spec.fmt == "nvfp4":
        _check_global_scale(global_scale_a, num_experts, gsa_arg)
        _check_global_scale(global_scale_b, num_experts, gsb_arg)
    else:
        for arg, g in ((gsa_arg, global_scale_a), (gsb_arg, global_scale_b)):
            if g is not None:
                raise ValueError(
                    f"{arg} must be None for {_FORMAT_NAMES[spec.fmt]}: per-expert global scales "
                    "belong to NVFP4 (FP4 with float8_e4m3fn scales at sf_vec_size=16)"
                )
    return _BlockScaledOperands(
        hidden, tokens_sum, inter, num_experts, tuple(a_majors), tuple(b_majors), spec
    )


def _check_blockscaled_values(
    arch: str, spec: BlockScaledSpec, offsets: torch.Tensor, tokens_sum: int, sfa, sfb,
    off_arg: str = "offsets_tensor", sf_args: tuple[str, str] = ("sfa_tensor", "sfb_tensor"),
) -> None:
    """Host read of the offsets of a block-scaled call (once per tensor version): the offsets
    rule with the format's per-expert token multiple, and enough scale columns for the split
    (each expert's scales start at its own atom column: ``common.mx_atoms``)."""
    align = spec.token_align
    if align > 1:
        fmt = _FORMAT_NAMES[spec.fmt]
        why = (
            f"for {fmt} on SM100 (cuDNN's rule: whole 128x4 scale atoms per expert; "
            "grouped_gemm_wgrad accepts any MXFP8 count)" if arch == "sm100"
            else f"for {fmt} (packed FP4: two tokens per byte)"
        )
    else:
        why = ""
    _check_offsets_values(offsets, tokens_sum, align, off_arg, why)

    def check() -> None:
        need = grouped_scale_cols(offsets.tolist(), spec.sf_vec_size)[2]
        for arg, sf in zip(sf_args, (sfa, sfb)):
            if sf.shape[1] < need:
                raise ValueError(
                    f"{arg} has {sf.shape[1]} scale columns; this split of the experts' tokens "
                    f"needs {need} (each expert's round_up(ceil(tokens / sf_vec_size), 4) "
                    "columns; common.mx_atoms.grouped_scale_cols_bound sizes a buffer for any "
                    "split)"
                )

    _validated_once(
        offsets, ("sf_cols", spec.sf_vec_size, sfa.shape[1], sfb.shape[1], off_arg), check
    )
