"""Host entry of the varlen-M grouped GEMM: argument checks, key, launch (or the torch twin).

The layer reaches :func:`gate_up_forward` and :func:`down_dgrad_backward` (``"ours"``) and
:func:`grouped_mm_gather` with the gathered rows side-written (``"ours-gemm"``) through its
``grouped_mm`` option (``cuda_kernels.moe.grouped_mm_choice``; ``"auto"``: the per-shape
table, which picks ``"ours-gemm"`` on qwen3-30b-a3b, qwen3-235b-a22b, gpt-oss-120b and the
32-expert deepseek-v3 shape and cuBLAS's grouped GEMM on gathered rows elsewhere:
``cuda_kernels.moe.forward`` / ``moe.backward``).
"""

from __future__ import annotations

import torch

from ..gemm import env, registry
from . import torch_ref

__all__ = [
    "BACKENDS",
    "down_dgrad_backward",
    "gate_up_forward",
    "grouped_mm_dgated",
    "grouped_mm_gated",
    "grouped_mm_gather",
    "grouped_mm_key",
    "kernel_unsupported_reason",
    "weight_major",
]

_KERNEL_ARCHS = tuple(dict.fromkeys(p.arch for p in registry.providers(problem="varlen_m")))

BACKENDS = ("auto", *_KERNEL_ARCHS, "torch")
"""An arch of a registered varlen-M family (the CuTe DSL kernel, on a GPU of that arch);
``"torch"``: the twin; ``"auto"``: the kernel where it can run, else the twin."""

_INDEX_DTYPES = {torch.int64: "int64", torch.int32: "int32"}


def _fail(msg: str) -> None:
    raise ValueError(f"grouped_mm_gather: {msg}")


def weight_major(w: torch.Tensor) -> str | None:
    """"n" when ``w`` [E, K, N] is contiguous, "k" when its memory is [E, N, K] contiguous
    (``w.transpose(1, 2)`` contiguous), else None. A dimension of size 1 makes both true:
    "n" wins."""
    if w.is_contiguous():
        return "n"
    if w.transpose(1, 2).is_contiguous():
        return "k"
    return None


def _check(a, w, offsets_E, row_index, out) -> tuple[int, int, int, int, str]:
    """Every rule of :func:`grouped_mm_gather` that needs no device read; returns
    ``(S, K, N, E, w_major)``."""
    for name, t in (("a", a), ("w", w), ("offsets_E", offsets_E)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        _fail(f"a must be 2-D [T, K] (or [S, K] without row_index), got shape {list(a.shape)}")
    if w.dim() != 3:
        _fail(f"w must be 3-D [E, K, N], got shape {list(w.shape)}")
    if offsets_E.dim() != 1:
        _fail(f"offsets_E must be 1-D [E], got shape {list(offsets_E.shape)}")
    E, K, N = w.shape
    if a.shape[1] != K:
        _fail(f"a has {a.shape[1]} columns but w has K={K} rows per expert")
    if offsets_E.shape[0] != E:
        _fail(f"offsets_E has {offsets_E.shape[0]} entries but w has E={E} experts")
    if E < 1 or K < 1 or N < 1:
        _fail(f"w must have E, K, N >= 1, got {list(w.shape)}")
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        _fail(f"a and w must be torch.bfloat16, got {a.dtype} and {w.dtype}")
    if offsets_E.dtype != torch.int32:
        _fail(f"offsets_E must be torch.int32, got {offsets_E.dtype}")
    dev = a.device
    tensors = [("w", w), ("offsets_E", offsets_E)]
    if row_index is not None:
        if not isinstance(row_index, torch.Tensor):
            _fail(f"row_index must be a torch.Tensor or None, got {type(row_index).__name__}")
        if row_index.dim() != 1:
            _fail(f"row_index must be 1-D [S], got shape {list(row_index.shape)}")
        if row_index.dtype not in _INDEX_DTYPES:
            _fail(f"row_index must be torch.int64 or torch.int32, got {row_index.dtype}")
        tensors.append(("row_index", row_index))
    S = row_index.shape[0] if row_index is not None else a.shape[0]
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != (S, N):
            _fail(f"out must have shape [{S}, {N}], got {list(out.shape)}")
        if out.dtype != torch.bfloat16:
            _fail(f"out must be torch.bfloat16, got {out.dtype}")
        if not out.is_contiguous():
            _fail("out must be contiguous")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != dev:
            _fail(f"{name} is on {t.device} but a is on {dev}")
    w_major = weight_major(w)
    if w_major is None:
        _fail(
            f"w must be contiguous [E, K, N] or have [E, N, K] contiguous memory, got strides "
            f"{w.stride()}"
        )
    if a.shape[0] > 0 and a.stride(1) != 1 and K > 1:
        _fail(f"a must have unit stride along K, got strides {a.stride()}")
    if row_index is not None and row_index.shape[0] > 1 and row_index.stride(0) != 1:
        _fail("row_index must be contiguous")
    if offsets_E.stride(0) != 1 and E > 1:
        _fail("offsets_E must be contiguous")
    return S, K, N, E, w_major


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes a (non-empty) tensor's elements can touch."""
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _check_rows_out(fail, a, row_index, S: int, K: int, a_rows_out, name: str = "a_rows_out"):
    """The rules of the gathered-rows side output (``name`` in the messages): None, or an
    [S, K] torch.bfloat16 contiguous tensor on ``a``'s device that does not overlap ``a``, and
    only with a ``row_index``; ``fail`` raises the entry's ValueError."""
    if a_rows_out is None:
        return
    if row_index is None:
        fail(f"{name} needs a row_index (without one the rows are already a: nothing to gather)")
    if not isinstance(a_rows_out, torch.Tensor):
        fail(f"{name} must be a torch.Tensor or None, got {type(a_rows_out).__name__}")
    if tuple(a_rows_out.shape) != (S, K):
        fail(f"{name} must have shape [S, K] = [{S}, {K}], got {list(a_rows_out.shape)}")
    if a_rows_out.dtype != torch.bfloat16:
        fail(f"{name} must be torch.bfloat16, got {a_rows_out.dtype}")
    if a_rows_out.device != a.device:
        fail(f"{name} is on {a_rows_out.device} but a is on {a.device}")
    if not a_rows_out.is_contiguous():
        fail(f"{name} must be contiguous")
    if a_rows_out.numel() and a.numel():
        (b0, b1), (c0, c1) = _byte_span(a_rows_out), _byte_span(a)
        if b0 < c1 and c0 < b1:
            fail(f"{name} must not overlap a (a is read while {name} is written)")


def _rows_out_unsupported(reason: str | None, a_rows_out) -> str | None:
    """``reason`` (why the kernel cannot run), or why it cannot write ``a_rows_out`` (its
    16-byte stores need a 16-byte aligned start), or None."""
    if reason is None and a_rows_out is not None and a_rows_out.numel():
        if a_rows_out.data_ptr() % 16:
            return f"a_rows_out must be 16-byte aligned, got {a_rows_out.data_ptr():#x}"
    return reason


def _write_rows_twin(a, row_index, a_rows_out) -> None:
    """The torch twin of the side output: ``gather_rows(a, row_index, torch.bfloat16)``."""
    if a_rows_out is not None:
        a_rows_out.copy_(torch_ref.gathered_rows(a, row_index, torch.bfloat16))


def _provider(device: torch.device) -> registry.KernelProvider | None:
    """The varlen-M family the registry names for ``device``'s arch (any device that is not
    CUDA: the first registered one, whose key a CPU caller builds), or None."""
    arch = env.kernel_arch(env.query_arch(device)) if device.type == "cuda" else None
    rows = registry.providers(arch=arch, fmt="bf16", problem="varlen_m")
    return rows[0] if rows else None


def _family(device: torch.device):
    """The ``KernelFamily`` of ``device``'s varlen-M kernel (its key type, launcher)."""
    return _provider(device).load().FAMILY


def kernel_unsupported_reason(a, w, row_index=None, *, epilogue: str = "store") -> str | None:
    """Why the kernel cannot run these (already checked) operands, or None; ``epilogue``
    ``"gated"`` adds the gate/up epilogue's rule (I = N / 2 a multiple of 8)."""
    archs = " / ".join(arch.upper() for arch in _KERNEL_ARCHS)
    if a.device.type != "cuda":
        return f"operands on {a.device} (the kernel needs an {archs} CUDA device)"
    row = _provider(a.device)
    if row is None:
        return f"{torch.cuda.get_device_name(a.device)} is not an {archs} GPU"
    missing = row.unavailable()
    if missing:
        return missing
    _, K, N = w.shape
    if K % 8 or N % 8:
        return f"K={K} and N={N} must be multiples of 8 (16-byte rows for TMA / cp.async)"
    if a.shape[0] > 1 and a.stride(0) % 8:
        return f"a's row stride {a.stride(0)} must be a multiple of 8 elements (16 bytes)"
    for name, t in (("a", a), ("w", w)):
        if t.numel() and t.data_ptr() % 16:
            return f"{name} must be 16-byte aligned (TMA / cp.async), got {t.data_ptr():#x}"
    if epilogue == "gated" and (N // 2) % 8:
        return f"I={N // 2} must be a multiple of 8 (the gate/up epilogue's column pairs)"
    return None


def grouped_mm_key(w: torch.Tensor, row_index, tile=None, gated=None, epilogue=None,
                   write_a_rows: bool = False):
    """The compile key (``Sm90GroupedMmKey`` on SM90) of (checked) operands, for the varlen-M
    family of ``w``'s device (the registry's row of its arch); ``tile`` None: the family's
    ``select_grouped_mm_tile``; ``gated``: a ``GatedEpilogue`` for the gate/up epilogue (or,
    with ``epilogue="dgated"``, the down-dgrad one); ``write_a_rows``: the kernel writes the
    gathered rows (an ``a_rows_out`` was given)."""
    family = _provider(w.device).load()
    E, K, N = w.shape
    if epilogue is None:
        epilogue = "store" if gated is None else "gated"
    if tile is None:
        tile = family.select_grouped_mm_tile(N, K, E, epilogue, write_a_rows)
    return family.FAMILY.key_type(
        N, K, E,
        gather_a=row_index is not None,
        index_dtype=_INDEX_DTYPES[row_index.dtype] if row_index is not None else "int64",
        w_major=weight_major(w),
        epilogue=epilogue,
        tile=tile,
        gated=gated,
        write_a_rows=write_a_rows,
    )


def grouped_mm_gather(
    a: torch.Tensor,
    w: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    tile=None,
    a_rows_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen-M grouped GEMM with gather-A: ``out[r] = a[row_index[r]] @ w[e]`` for the rows r of
    expert e, BF16 operands, fp32 accumulation, one RNE rounding to BF16.

    Dimensions: T source rows (tokens), S output rows (the grouped layout), K contraction,
    N output columns, E experts.

    Args:
        a: [T, K] torch.bfloat16 source rows (the layer's X in token order) read through
            ``row_index``; or, with ``row_index`` None, [S, K] rows already in the grouped order.
            Unit stride along K; for the kernel a row stride that is a multiple of 8 elements and
            a 16-byte aligned start.
        w: [E, K, N] torch.bfloat16 expert matrices, contiguous (N fastest: the layer's
            ``w_gate_up`` reshaped [E, H, 2I] and ``w_down`` [E, I, H]) or with [E, N, K]
            contiguous memory (K fastest, e.g. torchtitan's weights behind a transposed view).
        offsets_E: [E] torch.int32 cumulative row END of each expert
            (``common.routing.GroupedLayout.offsets_E``); expert e owns rows
            ``[offsets_E[e-1], offsets_E[e])``. Read on the device only; values outside
            ``[0, S]`` are clamped there (memory-safe, but the result is then not a GEMM of the
            layout: offsets must be non-decreasing and end at most at S).
        row_index: optional [S] torch.int64 or torch.int32 source row of each output row
            (``GroupedLayout.row_to_token_S``), -1 = padding row; values must lie in
            ``[-1, T)`` (the routing builds them so; not checked).
        out: optional [S, N] torch.bfloat16 contiguous output (else allocated).
        backend: one of :data:`BACKENDS`.
        tile: optional tile of the device's kernel (``Sm90GroupedMmTile`` on SM90; kernel
            only).
        a_rows_out: optional [S, K] torch.bfloat16 contiguous tensor on ``a``'s device (only
            with a ``row_index``; it must not overlap ``a``): the gathered rows are written into
            it as a side output, EVERY row s of it: ``a[row_index[s]]`` where
            ``row_index[s] >= 0`` and exactly +0.0 where it is < 0, rows past
            ``offsets_E[-1]`` included -- bitwise what
            ``triton.rows.gather_rows(a, row_index, torch.bfloat16)`` returns (a
            copy), so a caller that needs the gathered rows again (the backward's weight
            gradients) skips its own gather pass. The kernel writes them from its producer
            warp group, each row once (a ``write_a_rows`` key: a compile of its own; a
            16-byte aligned start, else ``"auto"`` takes the twin); the torch path with the
            twin. The main output is the same with or without it.

    Returns:
        ``out`` [S, N] torch.bfloat16. Padding rows (``row_index < 0``) are exactly 0 for a
        finite ``w``, and ``a`` is not read for them (a NaN in ``a``'s unreferenced rows never
        reaches the result); rows past ``offsets_E[-1]`` are 0; without ``row_index`` every row
        inside an expert is computed from ``a``'s row. Bitwise deterministic (each element is
        one CTA's fixed-order sum); no host read of device values on the kernel path
        (CUDA-graph capturable).

    Raises:
        ValueError: a bad shape, dtype, device, stride or ``backend``, a kernel ``backend``
            where the kernel cannot run, or an ``a_rows_out`` without ``row_index`` or of a
            bad shape, dtype, device or layout (named); raised before anything is written.
        RuntimeError: the kernel fails to compile.
    """
    if backend not in BACKENDS:
        _fail(f"backend must be one of {BACKENDS}, got {backend!r}")
    S, K, N, _, _ = _check(a, w, offsets_E, row_index, out)
    _check_rows_out(_fail, a, row_index, S, K, a_rows_out)
    reason = _rows_out_unsupported(kernel_unsupported_reason(a, w, row_index), a_rows_out)
    if backend in _KERNEL_ARCHS and reason is not None:
        _fail(f"backend={backend!r} cannot run here: {reason}")
    use_kernel = backend != "torch" and reason is None
    key = None
    if use_kernel:
        key = grouped_mm_key(w, row_index, tile, write_a_rows=a_rows_out is not None)
    if out is None:
        out = torch.empty(S, N, dtype=torch.bfloat16, device=a.device)
    if not use_kernel:
        out.copy_(torch_ref.grouped_mm_gather_torch(a, w, offsets_E, row_index))
        _write_rows_twin(a, row_index, a_rows_out)
        return out
    if S == 0:
        return out
    launch = _family(a.device).launcher(key)
    idx = row_index if row_index is not None else offsets_E  # (a placeholder without gather)
    launch(a, idx, w.permute(2, 1, 0), offsets_E, out, *(offsets_E,) * 5, a_rows_out)
    return out


def _check_pair_tables(fail, dev, S, row_to_pair_S, pair_affinity_R, **others) -> int:
    """The plan tables both fused epilogues read: ``row_to_pair_S`` [S] int64 and
    ``pair_affinity_R`` [R] float, plus ``others`` (tensors on the same device); ``fail`` raises
    the entry's named ValueError. Returns R."""
    tables = {"row_to_pair_S": row_to_pair_S, "pair_affinity_R": pair_affinity_R, **others}
    for name, t in tables.items():
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != dev:
            fail(f"{name} is on {t.device} but a is on {dev}")
    if row_to_pair_S.dim() != 1 or row_to_pair_S.shape[0] != S:
        fail(f"row_to_pair_S must be [S={S}], got {list(row_to_pair_S.shape)}")
    if row_to_pair_S.dtype != torch.int64:
        fail(f"row_to_pair_S must be torch.int64, got {row_to_pair_S.dtype}")
    if pair_affinity_R.dim() != 1 or not pair_affinity_R.is_floating_point():
        fail(f"pair_affinity_R must be a 1-D float tensor [R], got {pair_affinity_R.dtype} "
             f"{list(pair_affinity_R.shape)}")
    return pair_affinity_R.shape[0]


def _fail_gated(msg: str) -> None:
    raise ValueError(f"grouped_mm_gated: {msg}")


def grouped_mm_gated(
    a: torch.Tensor,
    w_gate_up: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None,
    row_to_pair_S: torch.Tensor,
    pair_affinity_R: torch.Tensor,
    num_pairs: torch.Tensor,
    *,
    activation=None,
    clamp_limits=None,
    bias: torch.Tensor | None = None,
    act_out: torch.Tensor | None = None,
    ah_out: torch.Tensor | None = None,
    backend: str = "auto",
    tile=None,
    a_rows_out: torch.Tensor | None = None,
    checkpoint_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward gate/up GEMM with its epilogue fused: ``acc = a[row_index] @ w_gate_up[e]``
    (fp32), then bias, clamp and the gated activation from the fp32 accumulator, writing the
    BF16 checkpoint and ``a * h`` -- the outputs of ``triton.activation.activation_forward``
    on the GEMM's output, without the ``[S, 2I]`` pre-activation going through HBM.

    Per row s of pair p (expert e, affinity alpha_p)::

        g = clamp_gate(acc[s, :I] + bias[e, :I])     u = clamp_up(acc[s, I:] + bias[e, I:])
        h = g * sigmoid(act.alpha * g) * (u + act.up_offset)
        a_h[s] = alpha_p * h   (0 for padding rows)    act[p] = [g, u]   (BF16, RNE)

    Numerics vs GEMM-then-pass: the pass reads the GEMM's BF16-rounded output; here g and u
    come from the fp32 accumulator (one rounding less), so a checkpoint value may differ by one
    BF16 ulp where the pass's double rounding differs, and ``a_h`` by about one ulp.

    Args:
        a, offsets_E, row_index: as :func:`grouped_mm_gather` (``row_index`` None: ``a`` is the
            [S, H] rows already in order).
        w_gate_up: [E, H, 2I] (or [E, H, 2, I]) torch.bfloat16, gate columns first, contiguous
            (or K-major memory [E, 2I, H]).
        row_to_pair_S: [S] torch.int64 plan pair of each row, -1 = padding
            (``GroupedLayout.row_to_pair_S``).
        pair_affinity_R: [R] float affinity of each pair (``RoutingPlan.pair_affinity_R``; used
            in fp32).
        num_pairs: 0-d or [1] torch.int64 count of real pairs on the device
            (``RoutingPlan.num_pairs``); checkpoint rows ``[num_pairs, R)`` are written 0.
        activation: ``common.problem.Activation`` (None: SwiGLU). clamp_limits: ``ClampLimits``
            or None.
        bias: optional [E, 2, I] or [E, 2I] float gate/up bias (used in fp32).
        act_out, ah_out: optional contiguous torch.bfloat16 outputs [R, 2, I] (or [S, 2I]
            with ``checkpoint_rows``) and [S, I] (else allocated); every element of both is
            written.
        backend, tile: as :func:`grouped_mm_gather` (tile_n 128 or 256: gate + up columns).
        a_rows_out: optional [S, H] torch.bfloat16 side output of the gathered rows, as
            :func:`grouped_mm_gather`'s (every row: ``gather_rows(a, row_index)`` bitwise; only
            with a ``row_index``): the layer's ``x_S`` for the backward's weight gradients.
        checkpoint_rows: write the checkpoint in grouped row order, ``act[s] = [g, u]`` [S, 2I]
            (0 for padding rows), not by pair: the layer's checkpoint form without bias or
            clamp (``cuda_kernels.moe.grouped_mm_choice.checkpoint_in_rows``), which
            :func:`grouped_mm_dgated` reads as well.

    Returns:
        ``(act [R, 2, I] or [S, 2I], a_h_SI [S, I])`` torch.bfloat16.

    Raises:
        ValueError: a bad shape, dtype, device or stride (named, ``a_rows_out`` included),
            before anything is written.
        RuntimeError: the kernel fails to compile.
    """
    from common.problem import Activation

    act_fn = Activation.resolve(activation)
    if isinstance(w_gate_up, torch.Tensor) and w_gate_up.dim() == 4:
        E4, H4, two, I4 = w_gate_up.shape
        if two != 2:
            _fail_gated(f"w_gate_up [E, H, 2, I] needs 2 at dim 2, got {list(w_gate_up.shape)}")
        w_gate_up = w_gate_up.reshape(E4, H4, 2 * I4)
    if backend not in BACKENDS:
        _fail(f"backend must be one of {BACKENDS}, got {backend!r}")
    S, K, N, E, _ = _check(a, w_gate_up, offsets_E, row_index, None)
    _check_rows_out(_fail_gated, a, row_index, S, K, a_rows_out)
    if N % 2:
        _fail_gated(f"w_gate_up must have an even N = 2I, got {N}")
    I = N // 2
    dev = a.device
    R = _check_pair_tables(_fail_gated, dev, S, row_to_pair_S, pair_affinity_R,
                           num_pairs=num_pairs)
    if R > S:
        _fail_gated(f"pair_affinity_R has R={R} pairs, more than the S={S} rows")
    if num_pairs.numel() != 1 or num_pairs.dtype != torch.int64:
        _fail_gated(f"num_pairs must be one torch.int64 value, got {num_pairs.dtype} "
                    f"{list(num_pairs.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            _fail_gated("bias must be a float tensor [E, 2, I] or [E, 2I] or None")
        if bias.numel() != E * N or bias.shape[0] != E:
            _fail_gated(f"bias must be [E, 2, I] = [{E}, 2, {I}], got {list(bias.shape)}")
        if bias.device != dev:
            _fail_gated(f"bias is on {bias.device} but a is on {dev}")
    if not isinstance(checkpoint_rows, bool):
        _fail_gated(f"checkpoint_rows must be a bool, got {checkpoint_rows!r}")
    act_shape = (S, N) if checkpoint_rows else (R, 2, I)
    for name, t, shape in (("act_out", act_out, act_shape), ("ah_out", ah_out, (S, I))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            _fail_gated(f"{name} must be a tensor of shape {list(shape)}, got "
                        f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device != dev:
            _fail_gated(f"{name} must be a contiguous torch.bfloat16 tensor on {dev}")
    reason = _rows_out_unsupported(
        kernel_unsupported_reason(a, w_gate_up, row_index, epilogue="gated"), a_rows_out
    )
    if backend in _KERNEL_ARCHS and reason is not None:
        _fail_gated(f"backend={backend!r} cannot run here: {reason}")
    ah = torch.empty(S, I, dtype=torch.bfloat16, device=dev) if ah_out is None else ah_out
    act = torch.empty(act_shape, dtype=torch.bfloat16, device=dev) if act_out is None else act_out
    if backend == "torch" or reason is not None:
        act_t, ah_t = torch_ref.gate_up_activation_torch(
            a, w_gate_up, offsets_E, row_index, row_to_pair_S, pair_affinity_R,
            activation=act_fn, clamp_limits=clamp_limits, bias_E2I=bias,
            checkpoint_rows=checkpoint_rows,
        )
        act.copy_(act_t)
        ah.copy_(ah_t)
        _write_rows_twin(a, row_index, a_rows_out)
        return act, ah
    family = _provider(dev).load()
    if tile is None:
        tile = family.select_grouped_mm_tile(N, a.shape[1], E, "gated", a_rows_out is not None)
    gated = family.GatedEpilogue.of(act_fn, clamp_limits, bias is not None, checkpoint_rows)
    key = grouped_mm_key(w_gate_up, row_index, tile, gated, write_a_rows=a_rows_out is not None)
    if S == 0:
        return act.zero_(), ah
    launch = _family(dev).launcher(key)
    idx = row_index if row_index is not None else offsets_E
    b = bias.reshape(E, N).float().contiguous() if bias is not None else offsets_E
    alpha = pair_affinity_R.float().contiguous()
    launch(a, idx, w_gate_up.permute(2, 1, 0), offsets_E, ah, b, row_to_pair_S.contiguous(),
           alpha, num_pairs.reshape(1), act.view(-1, N), a_rows_out)
    return act, ah


def gate_up_forward(
    x_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    layout,
    plan,
    *,
    activation=None,
    clamp_limits=None,
    b_gate_up_E2I: torch.Tensor | None = None,
    backend: str = "auto",
    tile=None,
    x_rows_out: torch.Tensor | None = None,
    checkpoint_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's gate/up half of the forward in one kernel: what ``moe.forward`` does
    with ``gather_rows`` + grouped GEMM + ``activation_forward``, from a
    :class:`~common.routing.GroupedLayout` and its :class:`~common.routing.RoutingPlan`
    (:func:`grouped_mm_gated` with ``row_to_token_S``, ``row_to_pair_S``,
    ``pair_affinity_R`` and ``num_pairs``). ``w_gate_up_EH2I`` [E, H, 2, I] in any float dtype
    (converted to BF16 when it is not). Returns ``(act_R2I [R, 2, I], a_h_SI [S, I])`` BF16
    (the checkpoint ``[S, 2I]`` in row order with ``checkpoint_rows``).
    ``x_rows_out``: optional [S, H] torch.bfloat16 contiguous tensor that receives the gathered
    rows ``x_S`` (``gather_rows(x_TH, row_to_token_S, torch.bfloat16)`` bitwise, every row; the
    ``a_rows_out`` of :func:`grouped_mm_gated`), for the backward's weight gradients.

    Raises:
        ValueError: as :func:`grouped_mm_gated`.
    """
    _check_rows_out(_fail_gated, x_TH, layout.row_to_token_S, layout.row_to_token_S.shape[0],
                    x_TH.shape[-1], x_rows_out, name="x_rows_out")
    w = w_gate_up_EH2I if w_gate_up_EH2I.dtype == torch.bfloat16 else w_gate_up_EH2I.to(
        torch.bfloat16
    )
    x = x_TH if x_TH.dtype == torch.bfloat16 else x_TH.to(torch.bfloat16)
    return grouped_mm_gated(
        x, w, layout.offsets_E, layout.row_to_token_S, layout.row_to_pair_S,
        plan.pair_affinity_R, plan.num_pairs, activation=activation,
        clamp_limits=clamp_limits, bias=b_gate_up_E2I, backend=backend, tile=tile,
        a_rows_out=x_rows_out, checkpoint_rows=checkpoint_rows,
    )


def _fail_dgated(msg: str) -> None:
    raise ValueError(f"grouped_mm_dgated: {msg}")


def grouped_mm_dgated(
    a: torch.Tensor,
    w_down_t: torch.Tensor,
    offsets_E: torch.Tensor,
    row_index: torch.Tensor | None,
    row_to_pair_S: torch.Tensor,
    pair_affinity_R: torch.Tensor,
    act_R2I: torch.Tensor,
    *,
    activation=None,
    clamp_limits=None,
    backend: str = "auto",
    tile=None,
    a_rows_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward down-dgrad GEMM with the activation backward fused into its epilogue:
    ``dh_raw = a[row_index] @ w_down_t[e]`` (fp32 accumulators, never stored), then per row s
    of pair p (affinity alpha_p) with the checkpoint's g, u (``act_R2I[p]``), as
    ``triton.activation.activation_backward`` computes them from a BF16 ``dh_raw``::

        dA_row[s]    = sum_j dh_raw[s, j] * h[j]        h = g sigmoid(act.alpha g) (u + c)
        d_gate_up[s] = [dg, du]  (strict clamp masks)    a_h[s] = alpha_p * h

    ``dA_row`` is summed per N tile in the kernel (fp32, fixed order) and over the tiles here
    (``sum(1)`` of an [S, n_tiles] buffer): deterministic, no atomics. Numerics vs GEMM-then-pass:
    the pass reads ``dh_raw`` rounded to BF16; here it is the fp32 accumulator.

    Args:
        a: [T, H] torch.bfloat16 dY in token order read through ``row_index`` (or [S, H] rows).
        w_down_t: [E, H, I] torch.bfloat16: ``w_down_EIH.transpose(1, 2)`` (K-major), or
            contiguous.
        offsets_E, row_index: as :func:`grouped_mm_gather`.
        row_to_pair_S: [S] torch.int64 plan pair of each row (-1 = padding).
        pair_affinity_R: [R] float pair affinities (used in fp32).
        act_R2I: [R, 2, I] torch.bfloat16 checkpoint (contiguous), the forward's clamped g, u
            in the plan's pair order; or [S, 2I], row s's own g, u in grouped row order
            (:func:`grouped_mm_gated` with ``checkpoint_rows``).
        activation, clamp_limits: the forward's (``common.problem.Activation``, ``ClampLimits``).
        backend, tile: as :func:`grouped_mm_gather`.
        a_rows_out: optional [S, H] torch.bfloat16 side output of the gathered dY rows, as
            :func:`grouped_mm_gather`'s (every row: ``gather_rows(a, row_index)`` bitwise; only
            with a ``row_index``): the layer's ``dy_S`` for the backward's weight gradients.

    Returns:
        ``(d_gate_up_S2I [S, 2I] bf16, a_h_SI [S, I] bf16, dA_row_S [S] fp32)``: padding rows 0.
        The affinity gradient of a pair is ``dA_row`` of its row, without the down bias term
        (:func:`down_dgrad_backward` adds it).

    Raises:
        ValueError: a bad shape, dtype, device or stride (named, ``a_rows_out`` included),
            before anything is written.
        RuntimeError: the kernel fails to compile.
    """
    from common.problem import Activation

    act_fn = Activation.resolve(activation)
    if backend not in BACKENDS:
        _fail(f"backend must be one of {BACKENDS}, got {backend!r}")
    S, K, I, E, _ = _check(a, w_down_t, offsets_E, row_index, None)
    _check_rows_out(_fail_dgated, a, row_index, S, K, a_rows_out)
    dev = a.device
    R = _check_pair_tables(_fail_dgated, dev, S, row_to_pair_S, pair_affinity_R, act_R2I=act_R2I)
    ck_rows = act_R2I.dim() == 2
    if tuple(act_R2I.shape) not in ((R, 2, I), (S, 2 * I)):
        _fail_dgated(f"act_R2I must be [R, 2, I] = [{R}, 2, {I}] (pair order) or [S, 2I] = "
                     f"[{S}, {2 * I}] (row order), got {list(act_R2I.shape)}")
    if act_R2I.dtype != torch.bfloat16 or not act_R2I.is_contiguous():
        _fail_dgated(f"act_R2I must be a contiguous torch.bfloat16 tensor, got {act_R2I.dtype}")
    reason = _rows_out_unsupported(kernel_unsupported_reason(a, w_down_t, row_index), a_rows_out)
    if backend in _KERNEL_ARCHS and reason is not None:
        _fail_dgated(f"backend={backend!r} cannot run here: {reason}")
    if backend == "torch" or reason is not None:
        res = torch_ref.down_dgrad_activation_torch(
            a, w_down_t, offsets_E, row_index, row_to_pair_S, pair_affinity_R, act_R2I,
            activation=act_fn, clamp_limits=clamp_limits,
        )
        _write_rows_twin(a, row_index, a_rows_out)
        return res
    family = _provider(dev).load()
    if tile is None:
        tile = family.select_grouped_mm_tile(I, K, E, "dgated", a_rows_out is not None)
    gated = family.GatedEpilogue.of(act_fn, clamp_limits, False, ck_rows)
    key = grouped_mm_key(w_down_t, row_index, tile, gated,
                         epilogue="dgated", write_a_rows=a_rows_out is not None)
    dgu = torch.empty(S, 2 * I, dtype=torch.bfloat16, device=dev)
    ah = torch.empty(S, I, dtype=torch.bfloat16, device=dev)
    part = torch.empty(S, key.n_tiles, dtype=torch.float32, device=dev)
    if S == 0:
        return dgu, ah, part.sum(1)
    launch = _family(dev).launcher(key)
    idx = row_index if row_index is not None else offsets_E
    launch(a, idx, w_down_t.permute(2, 1, 0), offsets_E, ah, dgu, row_to_pair_S.contiguous(),
           pair_affinity_R.float().contiguous(), part, act_R2I.view(-1, 2 * I), a_rows_out)
    return dgu, ah, part.sum(1)


def down_dgrad_backward(
    dy_TH: torch.Tensor,
    w_down_EIH: torch.Tensor,
    layout,
    plan,
    act_R2I: torch.Tensor,
    *,
    activation=None,
    clamp_limits=None,
    b_down_EH: torch.Tensor | None = None,
    backend: str = "auto",
    tile=None,
    dy_rows_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer backward's first GEMM and its activation backward in one kernel: what
    ``moe.backward`` does with ``gather_rows(dY)`` + grouped GEMM + ``activation_backward``,
    from a :class:`~common.routing.GroupedLayout` and its :class:`~common.routing.RoutingPlan`
    (:func:`grouped_mm_dgated` on ``dy_TH`` through ``row_to_token_S`` and
    ``w_down_EIH.transpose(1, 2)``). Returns ``(d_gate_up_S2I, a_h_SI, dA_TE [T, E] fp32)``:
    dA in its dense cell per pair (0 where a token is not routed), ``+ <dY, b_down[e]>`` with a
    down bias (one ``[T, H] @ [H, E]`` product in float64, TF32-proof, then the pairs' cells).
    ``dy_rows_out``: optional [S, H] torch.bfloat16 contiguous tensor that receives the gathered
    rows ``dy_S`` (``gather_rows(dy_TH, row_to_token_S, torch.bfloat16)`` bitwise, every row;
    the ``a_rows_out`` of :func:`grouped_mm_dgated`), for the backward's weight gradients.

    Raises:
        ValueError: as :func:`grouped_mm_dgated`.
    """
    _check_rows_out(_fail_dgated, dy_TH, layout.row_to_token_S, layout.row_to_token_S.shape[0],
                    dy_TH.shape[-1], dy_rows_out, name="dy_rows_out")
    bf16 = torch.bfloat16
    dy = dy_TH if dy_TH.dtype == bf16 else dy_TH.to(bf16)
    w = (w_down_EIH if w_down_EIH.dtype == bf16 else w_down_EIH.to(bf16)).transpose(1, 2)
    dgu, ah, da_S = grouped_mm_dgated(
        dy, w, layout.offsets_E, layout.row_to_token_S, layout.row_to_pair_S,
        plan.pair_affinity_R, act_R2I, activation=activation, clamp_limits=clamp_limits,
        backend=backend, tile=tile, a_rows_out=dy_rows_out,
    )
    T, E = plan.num_tokens, plan.num_experts
    r2p = layout.row_to_pair_S
    valid = r2p >= 0
    p = r2p.clamp(min=0)
    if plan.pair_token_R.shape[0]:
        tok, exp = plan.pair_token_R[p], plan.pair_expert_R[p]
    else:
        tok = exp = torch.zeros_like(p)
    if b_down_EH is not None:
        # float64: the term keeps full fp32 accuracy whatever torch's TF32 setting (an fp32
        # matmul may run in TF32 when a user allows it; the Triton pass sums in fp32 FMAs), in
        # token chunks of at most 256 MiB of float64 rows
        bias_TE = torch.empty(T, E, dtype=torch.float32, device=dy_TH.device)
        b_HE = b_down_EH.double().t()
        chunk = max(1, (1 << 25) // max(1, dy_TH.shape[1]))
        for t0 in range(0, T, chunk):
            bias_TE[t0:t0 + chunk] = dy_TH[t0:t0 + chunk].double() @ b_HE
        da_S = da_S + bias_TE[tok.clamp(min=0), exp.clamp(max=E - 1)]
    flat = torch.zeros(T * E + 1, dtype=torch.float32, device=dy_TH.device)
    cell = torch.where(valid, tok * E + exp, torch.full_like(tok, T * E))
    flat.index_put_((cell,), torch.where(valid, da_S, 0.0))
    return dgu, ah, flat[: T * E].reshape(T, E)
