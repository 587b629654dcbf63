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

Importing this module imports neither triton nor CuTe DSL (the backend's option declaration reads
it): the kernels' API is imported on the first :func:`pick` that needs it.
"""

from __future__ import annotations

import functools

import torch

from common.config_files import config_path, load_yaml_file
from common.dispatch import BackendOption

__all__ = [
    "GROUPED_MM", "GROUPED_MM_OPTION", "IMPLS", "STEPS", "check_grouped_mm",
    "checkpoint_in_rows", "grouped_mm_table", "kernel_rows", "pick",
]

STEPS = ("forward_gate_up", "backward_down_dgrad")
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

    def steps(entry, label):
        out = {}
        for step in STEPS:
            v = entry.get(step)
            if v not in IMPLS:
                fail(f"{label}: {step} must be one of {IMPLS}, got {v!r}")
            out[step] = v
        return out

    if not isinstance(doc, dict) or set(doc) - {"default", "shapes"}:
        fail("the file must be a mapping with the keys 'default' and 'shapes'")
    default = doc.get("default")
    if not isinstance(default, dict) or set(default) != set(STEPS):
        fail(f"default must map exactly {STEPS} to one of {IMPLS}, got {default!r}")
    table = {"default": steps(default, "default")}
    shapes = doc.get("shapes") or []
    if not isinstance(shapes, list):
        fail("shapes must be a list of entries")
    for n, entry in enumerate(shapes):
        label = f"shapes[{n}]"
        if not isinstance(entry, dict):
            fail(f"{label} must be a mapping, got {entry!r}")
        unknown = set(entry) - {"model", "experts", "hidden", "intermediate", *STEPS}
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
        table[key] = steps(entry, f"{label} ({entry.get('model', key)})")
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


def table_choice(step: str, E: int, H: int, I: int) -> str:
    """The table's implementation of ``step`` for experts E, hidden H, intermediate I."""
    table = grouped_mm_table()
    row = table.get((E, H, I)) or table.get((None, H, I)) or table["default"]
    return row[step]


def checkpoint_in_rows(E: int, H: int, I: int, *, gate_up_bias: bool, clamp_limits,
                       grouped_mm: str) -> bool:
    """Whether the layer's forward keeps the gate/up GEMM's output rows ``gu_S`` [S, 2I] (BF16,
    grouped row order, the weight matrix's column order) as the activation checkpoint instead
    of writing a second copy ``act`` [R, 2, I] in the plan's pair order.

    True where the GEMM's output IS the checkpoint -- no gate/up bias, no active clamp -- and
    neither step runs the fused ``"ours"`` kernel (requested, or the table's choice under
    ``"auto"``): its gated epilogue writes ``act`` from the fp32 accumulator and its dgated
    epilogue reads ``act`` by pair. A function of the layer's shape and options only (never of
    the token count or the routing), so one layer's checkpoint has one form across calls: the
    layer's fake implementation gives its shape from this (``Backend.checkpoint_rows``).

    Raises:
        ValueError: ``grouped_mm`` is not one of :data:`GROUPED_MM`.
    """
    check_grouped_mm(grouped_mm)
    if gate_up_bias or (clamp_limits is not None and clamp_limits.is_active):
        return False
    if grouped_mm == "auto":
        return all(table_choice(step, E, H, I) != "ours" for step in STEPS)
    return grouped_mm != "ours"


# ----------------------------------------------------------------------------------- reasons
def kernel_rows(t: torch.Tensor) -> torch.Tensor:
    """An activation operand (X or dY, [T, H]) as the fused entries read it: ``t`` itself when
    it is BF16 with unit stride along its last dimension, else a contiguous BF16 copy."""
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
               "weight interleaves them (gpt-oss's gate_up_proj)")
    elif grouped_mm.weight_major(w) is None:
        name = "w_gate_up [E, H, 2I]" if step == "forward_gate_up" else "w_down^T [E, H, I]"
        why = (f"{name} has strides {w.stride()}: our kernel needs [E, K, N] or [E, N, K] "
               "contiguous memory")
    if why is None and impl == "ours" and act_R2I is not None and act_R2I.dim() == 2:
        why = ("the checkpoint is the gate/up GEMM's output in grouped row order [S, 2I] (no "
               "bias, no clamp: checkpoint_in_rows); the fused dgated epilogue reads it in the "
               "plan's pair order [R, 2, I]")
    elif why is None and impl == "ours" and act_R2I is not None and (
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
        act_R2I: the backward's checkpoint (its dtype and layout are a rule of the kernel:
            ``"ours"`` reads [R, 2, I] pair order, not the grouped-row [S, 2I] form).
        gate_up_interleaved: the gate/up columns are interleaved
            (:func:`common.torch_backward.gate_up_matrix`): ``"ours"`` cannot run then.

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
