"""Which implementation the layer's two fusable steps run: today's ``"cublas"`` path, the
fused ``"ours"`` kernel of :mod:`cuda_kernels.grouped_mm` or ``"ours-gemm"``, its gathering GEMM
with the activation as a separate pass: the ``grouped_mm`` option the CUDA backends declare
(:data:`GROUPED_MM_OPTION`, ``common.layer.MoEExpertsOptions.grouped_mm``).

Steps (:data:`STEPS`):

* ``"forward_gate_up"`` (:func:`cuda_kernels.moe.moe_forward_fused`): ``"cublas"`` =
  ``gather_rows(X)`` + cuBLAS grouped GEMM + Triton ``activation_forward``; ``"ours"`` =
  :func:`cuda_kernels.grouped_mm.gate_up_forward` (gather, GEMM and activation in one kernel,
  the X rows side-written for the backward); ``"ours-gemm"`` =
  :func:`cuda_kernels.grouped_mm.grouped_mm_gather` (gather and GEMM in one kernel, the X rows
  side-written) + the Triton pass.
* ``"backward_down_dgrad"`` (:func:`cuda_kernels.moe.moe_backward_fused`):
  ``"cublas"`` = ``gather_rows(dY)`` + cuBLAS grouped dgrad + Triton ``activation_backward``;
  ``"ours"`` = :func:`cuda_kernels.grouped_mm.down_dgrad_backward`; ``"ours-gemm"`` =
  ``grouped_mm_gather`` (the dY rows side-written) + the Triton pass.

Requests (:data:`GROUPED_MM`): ``"cublas"`` always; ``"ours"`` / ``"ours-gemm"`` where
the kernel can run (RuntimeError naming the reason elsewhere); ``"auto"``: the per-shape table
``configs/cuda/grouped_mm_choice.yaml`` (:func:`grouped_mm_table`), ``"cublas"`` where the
kernel cannot run. On CPU tensors (the tests, Triton's interpreter) the kernels' torch twins
stand in for ``"ours"`` / ``"ours-gemm"``: only the operand rules that the twins share are
reasons there.

:func:`pick` is called every step: after the first call per operand metadata it is one dict
lookup (no device read, no host synchronisation); the request is checked on the first call
(:func:`check_grouped_mm`, the option's one check, which the layer also runs when it builds its
options).

The grouped weight gradients (:func:`wgrad_choice`) are chosen here too, because the forward
needs one answer of that choice: whether the backward's gate/up wgrad reads X through the
layout's row -> token index inside the kernel (:func:`wgrad_gathers`, :func:`keeps_x_rows`).
Where it does and the shape's ``wgrad_gather`` in the table is true (:func:`table_wgrad_gather`;
true for qwen3-30b-a3b, the memory / time trade measured in ``benchmarks/RESULTS.md``), the
forward keeps no gathered copy of X for the backward.

Importing this module imports neither triton nor CuTe DSL (the backend's option declaration reads
it): the kernels' APIs are imported on the first call that needs them.
"""

from __future__ import annotations

import functools

import torch

from common.config_files import config_path, load_yaml_file
from common.dispatch import BackendOption

__all__ = [
    "GROUPED_MM", "GROUPED_MM_OPTION", "IMPLS", "STEPS", "WGRAD_BACKENDS", "check_grouped_mm",
    "checkpoint_in_rows", "grouped_mm_table", "keeps_x_rows", "kernel_gathers", "kernel_rows",
    "pick", "table_wgrad_gather", "wgrad_choice", "wgrad_gathers",
]

STEPS = ("forward_gate_up", "backward_down_dgrad")
WGRAD_GATHER = "wgrad_gather"  # the table's optional per-shape bool (table_wgrad_gather)
IMPLS = ("cublas", "ours", "ours-gemm")

GROUPED_MM_OPTION = BackendOption(
    name="grouped_mm",
    values=("auto", *IMPLS),
    default="auto",
    doc="which implementation the cuda-sm90 / cuda-sm100 backends run for the forward's "
    "gather + gate/up GEMM + activation and the backward's gather + down dgrad + activation "
    "backward: 'cublas' (gather pass, cuBLAS grouped GEMM, Triton pass), 'ours' (the fused "
    "CuTe DSL kernel of cuda_kernels.grouped_mm; RuntimeError where it cannot run), "
    "'ours-gemm' (its gathering GEMM with the plain store, then the Triton pass; RuntimeError "
    "where it cannot run), 'auto' (the measured per-shape table "
    "configs/cuda/grouped_mm_choice.yaml, cuBLAS where the kernel cannot run)",
)
"""The ``grouped_mm`` layer option of the CUDA backends (``Backend.options``); the other backends
(``torch``, ``reference``, ``nki``) have one path and do not declare it."""
GROUPED_MM = GROUPED_MM_OPTION.values
check_grouped_mm = GROUPED_MM_OPTION.check
"""ValueError naming ``grouped_mm`` and :data:`GROUPED_MM` unless the value is one of them."""
_TABLE_FILE = ("cuda", "grouped_mm_choice.yaml")


# ------------------------------------------------------------------------------------- table
def _parse_table(doc, where: str) -> dict:
    """``{(E or None, H, I) | "default": {step: impl}}`` of the file's document; ValueError
    naming the file and the entry on any bad field."""

    def fail(msg):
        raise ValueError(f"{where}: {msg}")

    def steps(entry, label, gather_default=False):
        out = {}
        for step in STEPS:
            v = entry.get(step)
            if v not in IMPLS:
                fail(f"{label}: {step} must be one of {IMPLS}, got {v!r}")
            out[step] = v
        gather = entry.get(WGRAD_GATHER, gather_default)
        if not isinstance(gather, bool):
            fail(f"{label}: {WGRAD_GATHER} must be true or false, got {gather!r}")
        out[WGRAD_GATHER] = gather
        return out

    if not isinstance(doc, dict) or set(doc) - {"default", "shapes"}:
        fail("the file must be a mapping with the keys 'default' and 'shapes'")
    default = doc.get("default")
    if not isinstance(default, dict) or set(default) - {WGRAD_GATHER} != set(STEPS):
        fail(f"default must map exactly {STEPS} to one of {IMPLS} (and optionally "
             f"{WGRAD_GATHER} to a bool), got {default!r}")
    table = {"default": steps(default, "default")}
    gather_default = table["default"][WGRAD_GATHER]
    shapes = doc.get("shapes") or []
    if not isinstance(shapes, list):
        fail("shapes must be a list of entries")
    for n, entry in enumerate(shapes):
        label = f"shapes[{n}]"
        if not isinstance(entry, dict):
            fail(f"{label} must be a mapping, got {entry!r}")
        unknown = set(entry) - {"model", "experts", "hidden", "intermediate", WGRAD_GATHER,
                                *STEPS}
        if unknown:
            fail(f"{label} has unknown keys {sorted(unknown)}")
        dims = []
        for name in ("experts", "hidden", "intermediate"):
            v = entry.get(name)
            if v is None and name == "experts":
                dims.append(None)
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(f"{label}: {name} must be an int >= 1, got {v!r}")
            dims.append(v)
        key = tuple(dims)
        if key in table:
            fail(f"{label}: (experts, hidden, intermediate) = {key} is listed twice")
        table[key] = steps(entry, f"{label} ({entry.get('model', key)})", gather_default)
    return table


@functools.lru_cache(maxsize=1)
def grouped_mm_table() -> dict:
    """The parsed ``configs/cuda/grouped_mm_choice.yaml`` (read once):
    ``{(E or None, H, I): {step: impl}, "default": {step: impl}}``.

    Raises:
        ValueError: a malformed file (named, with the bad entry).
    """
    path = config_path(*_TABLE_FILE)
    return _parse_table(load_yaml_file(path), str(path))


def _table_row(E: int, H: int, I: int) -> dict:
    table = grouped_mm_table()
    return table.get((E, H, I)) or table.get((None, H, I)) or table["default"]


def table_choice(step: str, E: int, H: int, I: int) -> str:
    """The table's implementation of ``step`` for experts E, hidden H, intermediate I."""
    return _table_row(E, H, I)[step]


def table_wgrad_gather(E: int, H: int, I: int) -> bool:
    """The table's ``wgrad_gather`` for experts E, hidden H, intermediate I: whether the
    layer's weight gradients read X and dY through the routing index (where the wgrad kernel
    can: :func:`wgrad_gathers`) instead of from gathered [S, H] copies. A memory / time trade:
    the copies cost ``2 S H`` bytes each, the gathering kernel its slower operand load
    (``benchmarks/RESULTS.md``)."""
    return _table_row(E, H, I).get(WGRAD_GATHER, False)


def checkpoint_in_rows(*, gate_up_bias: bool, clamp_limits) -> bool:
    """Whether the layer's forward keeps the gate/up GEMM's output rows ``gu_S`` [S, 2I] (BF16,
    grouped row order, the weight matrix's column order) as the activation checkpoint instead
    of writing a second copy ``act`` [R, 2, I] in the plan's pair order.

    True where the GEMM's output IS the checkpoint: no gate/up bias, no active clamp. The fused
    ``"ours"`` kernels keep the same form (the gated epilogue writes row s's ``[g, u]`` at row
    s, the dgated one reads it there: ``GatedEpilogue.checkpoint_rows``), so every
    ``grouped_mm`` agrees. A function of the layer's options only (never of the token count or
    the routing), so one layer's checkpoint has one form across calls: the layer's fake
    implementation gives its shape from this (``Backend.checkpoint_rows``)."""
    return not (gate_up_bias or (clamp_limits is not None and clamp_limits.is_active))


# ----------------------------------------------------------------------------------- reasons
def kernel_rows(t: torch.Tensor) -> torch.Tensor:
    """A token-row operand ([T, K]: X, dY) as the kernels that read it through the routing
    index take it (the fused entries, the gathering GEMM, the wgrad's in-kernel gather): ``t``
    itself when it is BF16 with unit stride along its last dimension, else a contiguous BF16
    copy (a source those kernels still cannot read, e.g. a misaligned view, is gathered first
    by the API that receives it)."""
    if t.dtype == torch.bfloat16 and t.stride(-1) == 1:
        return t
    return t.to(torch.bfloat16).contiguous()


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """What :func:`kernel_rows` gives the kernel, for its rules without copying: ``t`` itself,
    or a two-row stand-in with the copy's strides and a fresh allocation's alignment."""
    if t.dtype == torch.bfloat16 and t.stride(-1) == 1:
        return t
    return torch.empty(2, t.shape[-1], dtype=torch.bfloat16, device=t.device)


def _reason(step, impl, a, w, row_index, act_R2I, interleaved=False) -> str | None:
    """Why the kernel of ``impl`` ("ours": the fused one, "ours-gemm": the plain gathering GEMM)
    cannot run ``step`` on these operands (``a`` [T, K] activation rows, ``w`` [E, K, N] BF16 as
    the entry reads it), or None. On CPU tensors only the rules of the torch twin (which then
    runs) count."""
    from .. import grouped_mm

    why = None
    if impl == "ours" and interleaved:
        why = ("the fused epilogue takes gate/up as the two halves of the GEMM's columns; this "
               "weight (or the row checkpoint it wrote) interleaves them (gpt-oss's "
               "gate_up_proj)")
    elif grouped_mm.weight_major(w) is None:
        name = "w_gate_up [E, H, 2I]" if step == "forward_gate_up" else "w_down^T [E, H, I]"
        why = (f"{name} has strides {w.stride()}: our kernel needs [E, K, N] or [E, N, K] "
               "contiguous memory")
    if why is None and impl == "ours" and act_R2I is not None and (
        act_R2I.dtype != torch.bfloat16 or not act_R2I.is_contiguous()
    ):
        why = (f"the checkpoint act_R2I must be contiguous torch.bfloat16 (the kernel reads it "
               f"so), got {act_R2I.dtype} with strides {act_R2I.stride()}")
    if why is not None or a.device.type != "cuda":
        return why
    epilogue = "store" if impl == "ours-gemm" else (
        "gated" if step == "forward_gate_up" else "dgated")
    return grouped_mm.kernel_unsupported_reason(_kernel_view(a), w, row_index, epilogue=epilogue)


_CHOICE: dict[tuple, tuple[str, str | None]] = {}


def pick(
    step: str,
    requested: str,
    a: torch.Tensor,
    w: torch.Tensor,
    row_index: torch.Tensor,
    *,
    act_R2I: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
) -> str:
    """``"cublas"``, ``"ours"`` or ``"ours-gemm"`` for one call of ``step`` (module docstring),
    decided once per operand metadata (shapes, strides, dtypes, 16-byte alignment, device) and
    cached.

    Args:
        step: one of :data:`STEPS`.
        requested: one of :data:`GROUPED_MM` (checked here on the first call).
        a: [T, H] the rows the step gathers (X or dY) as passed to the layer.
        w: [E, H, N] BF16 weight as the fused entry reads it (N = 2I forward, I backward).
        row_index: [S] the layout's row -> token index.
        act_R2I: the backward's checkpoint, [R, 2, I] or [S, 2I] (``"ours"`` reads it
            contiguous BF16).
        gate_up_interleaved: the gate/up columns (of the weight, or of a row checkpoint) are
            interleaved (:func:`common.torch_backward.gate_up_matrix`): ``"ours"`` cannot run
            then.

    Raises:
        ValueError: ``requested`` is not one of :data:`GROUPED_MM`.
        RuntimeError: ``requested="ours"`` / ``"ours-gemm"`` and its kernel cannot run this
            call.
    """
    E, H, N = w.shape
    I = N // 2 if step == "forward_gate_up" else N
    # the token count only as 0, 1 or more (the rules' cases), not itself: it varies per
    # batch, and the cache stays one entry per layer shape
    key = (step, requested, a.device, a.dtype, a.shape[1:], min(a.shape[0], 2), a.stride(),
           a.data_ptr() % 16,
           w.shape, w.stride(), w.data_ptr() % 16, row_index.dtype,
           None if act_R2I is None else (act_R2I.dtype, act_R2I.dim(), act_R2I.stride()),
           bool(gate_up_interleaved))
    got = _CHOICE.get(key)
    if got is None:
        got = _CHOICE[key] = _decide(step, requested, a, w, row_index, act_R2I, E, H, I,
                                     bool(gate_up_interleaved))
    impl, why = got
    if impl == "error":
        raise RuntimeError(f"grouped_mm={requested!r} cannot run the {step} step: {why}")
    return impl


def _decide(step, requested, a, w, row_index, act_R2I, E, H, I, interleaved
            ) -> tuple[str, str | None]:
    check_grouped_mm(requested)
    impl = table_choice(step, E, H, I) if requested == "auto" else requested
    if impl == "cublas":
        return "cublas", None
    why = _reason(step, impl, a, w, row_index, act_R2I, interleaved)
    if why is None:
        return impl, None
    return ("cublas", why) if requested == "auto" else ("error", why)


# ------------------------------------------------------------------------ weight gradients
WGRAD_BACKENDS = ("auto", "sm90", "sm100", "torch")
"""The ``wgrad_backend`` values of the fused backward."""

_WGRAD_ROW_ALIGN = 16
"""The fused layout's row alignment (``common.torch_backward.ALIGN``; not imported: that module
imports the activation twins, and this one stays light)."""


def wgrad_choice(
    device: torch.device, a_HS, b_SI, offsets_E, out_dtype, accumulate: bool, backend: str,
    group_align: int,
) -> tuple[str, str | None]:
    """``(implementation, why not our kernel)`` of one grouped wgrad ``out[e] (+)= a_HS[:, rows
    of e] @ b_SI[rows of e]`` on ``device``: ``"sm90"`` / ``"sm100"`` (our CuTe DSL kernel),
    ``"cublas"`` (``torch._grouped_mm``), ``"torch"`` (the portable twin), or ``"error"`` (an
    explicit ``backend`` that cannot run the call; the reason says why).

    Args:
        device: where the call runs (the operands may be meta stand-ins of the real ones:
            :func:`wgrad_gathers`).
        a_HS: [M, S], b_SI: [S, N]; offsets_E: [E] int32 (only their metadata is read).
        out_dtype: the gradient's dtype.  accumulate: added into an fp32 buffer.
        backend: one of :data:`WGRAD_BACKENDS`.
        group_align: the layout's row alignment of every expert (the SM100 kernel poisons
            experts whose rows break its 256-row contract, so it is chosen only for layouts
            aligned to that).
    """
    from ..grouped_wgrad import api

    name = backend
    if name == "auto":
        name, _ = api.select_grouped_wgrad_backend(device)
    reason = None
    if name != "torch":
        reason = api.kernel_unsupported_reason(name, a_HS, b_SI, offsets_E)
    if reason is None and name == "sm100" and group_align % api.SM100_GROUP_ALIGN:
        reason = (
            f"the SM100 kernel needs every expert's rows in multiples of "
            f"{api.SM100_GROUP_ALIGN}; this layout aligns them to {group_align}"
        )
    cublas = out_dtype == torch.bfloat16 and not accumulate and hasattr(torch, "_grouped_mm")
    if reason is not None:
        if backend != "auto":
            return "error", reason
        return ("cublas", reason) if cublas and device.type == "cuda" else ("torch", reason)
    M, N = a_HS.shape[0], b_SI.shape[1]
    if backend == "auto" and name == "sm90" and (M % 128 or N % 128) and cublas:
        # Sizes off the 128 grid (gpt-oss: 2880) put our SM90 kernel on its 64x64 tile, which
        # ran 2.2x slower than cuBLAS's grouped GEMM on gpt-oss-120b (H200, 2026-12-01). cuBLAS
        # writes BF16 only, so fp32 outputs and accumulation stay on our kernel.
        return "cublas", f"SM90 kernel uses its 64x64 tile for H={M}, I={N}"
    return name, None


_GATHERED_CHOICE: dict[tuple, tuple[str, str | None]] = {}


def gathered_wgrad_choice(
    device: torch.device, E: int, M: int, N: int, *, out_dtype, accumulate: bool, backend: str,
    group_align: int = _WGRAD_ROW_ALIGN,
) -> tuple[str, str | None]:
    """:func:`wgrad_choice` of an [E, M, N] wgrad one of whose operands is read through the
    layout's row -> token index: decided on the dense operands' metadata stand-ins (A [M, S]
    with unit stride along M, B [S, N] row-major: the gathered rows' own form, whichever
    operand is gathered), from the sizes, dtypes and options only -- never the token count, the
    data or a data pointer -- so the forward (:func:`keeps_x_rows`) and the backward give the
    same answer. Cached per argument tuple."""
    key = (str(device), E, M, N, out_dtype, bool(accumulate), backend, group_align)
    got = _GATHERED_CHOICE.get(key)
    if got is None:
        S = 256  # any row count: the static contract reads none (a multiple of every alignment)
        meta = torch.device("meta")
        a = torch.empty(S, M, dtype=torch.bfloat16, device=meta).t()
        b = torch.empty(S, N, dtype=torch.bfloat16, device=meta)
        offs = torch.empty(E, dtype=torch.int32, device=meta)
        got = _GATHERED_CHOICE[key] = wgrad_choice(
            torch.device(device), a, b, offs, out_dtype, accumulate, backend, group_align
        )
    return got


def wgrad_gathers(
    device: torch.device, E: int, M: int, N: int, *, out_dtype, accumulate: bool, backend: str,
    group_align: int = _WGRAD_ROW_ALIGN,
) -> bool:
    """Whether an [E, M, N] grouped wgrad with an operand read through the row -> token index
    runs on a kernel that gathers in its operand load (:func:`kernel_gathers`: a backend of
    ``api.WGRAD_GATHER_BACKENDS`` with its gather keys enabled): then no gathered [S, K] copy
    of that operand is needed.
    Elsewhere the backward gathers the operand first (one Triton pass) and runs as before.
    Arguments as :func:`gathered_wgrad_choice`; the choice is symmetric in M and N (the
    kernel's tile rules and the cuBLAS rule are), so one answer holds for both operand
    orientations of the fused backward."""
    name, _ = gathered_wgrad_choice(device, E, M, N, out_dtype=out_dtype,
                                    accumulate=accumulate, backend=backend,
                                    group_align=group_align)
    return kernel_gathers(name)


def kernel_gathers(name: str) -> bool:
    """Whether wgrad implementation ``name`` reads a gathered operand through its index in the
    kernel's operand load: a backend of ``api.WGRAD_GATHER_BACKENDS`` whose gather keys are
    enabled (SM90: verified on a GPU or opted in,
    ``api.wgrad_gather_enabled``). Not cached: the gate is read each call (an environment
    variable)."""
    from ..grouped_wgrad import api

    return api.wgrad_gather_enabled(name)


def keeps_x_rows(
    device: torch.device, E: int, H: int, I: int, *, grad_dtype=torch.float32,
    accumulate: bool = False, wgrad_backend: str = "auto",
) -> bool:
    """Whether the layer's forward keeps the gathered X rows [S, H] (``LayerForward.x_rows_S``)
    for the backward: False where the backward's gate/up wgrad (``[E, H, 2I]``, ``grad_dtype``,
    ``accumulate`` into ``main_grad``, ``wgrad_backend``) reads X through the routing index
    itself (:func:`wgrad_gathers`). A function of the device, the layer's shape and options
    only (never the token count), so one layer's saved tensors have one form across calls: the
    layer's fake implementation gives the X rows' shape from it (``Backend.keeps_x_rows``).
    Off CUDA (the portable twin) it is True, as before.

    Where the table says ``wgrad_gather: false`` (:func:`table_wgrad_gather`) the rows are
    kept whatever the kernel can do. An unknown ``wgrad_backend`` keeps them (the backward
    refuses it, naming the argument).
    """
    if wgrad_backend not in WGRAD_BACKENDS or not table_wgrad_gather(E, H, I):
        return True
    return not wgrad_gathers(torch.device(device), E, H, 2 * I, out_dtype=grad_dtype,
                             accumulate=accumulate, backend=wgrad_backend)
