"""The steps the fused forward and the fused backward share: grouped GEMMs on grouped rows.

* :func:`rows_times_experts` -- ``x_S[s] @ w[e(s)]`` on rows already in the grouped layout.
* :func:`gathered_times_experts` -- the same on rows gathered from ``[T, K]`` through the
  layout's row -> token index (the forward's X, the backward's dY), by the implementation
  :func:`cuda_kernels.moe.grouped_mm_choice.pick` chose.
* :func:`check_split_gate_up` -- the argument check of the pipelines on separate gate and up
  weights (``moe_forward_split_gate_up`` / ``moe_backward_split_gate_up``).

The row gathers, the per-token sums and the activation passes around them are Triton kernels
(:mod:`cuda_kernels.triton`).
"""

from __future__ import annotations

import torch

from common.problem import shape_text
from common.torch_backward import fits_grouped_mm, grouped_mm_rows

from .. import grouped_mm as gmm
from ..triton.rows import gather_rows
from .grouped_mm_choice import kernel_rows

__all__ = [
    "check_split_gate_up",
    "covering_offsets",
    "gathered_times_experts",
    "identity_rows",
    "rows_times_experts",
]


def check_split_gate_up(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH, layout, *, grad_y_SH=None,
                        act_R2I=None) -> None:
    """ValueError naming the first bad argument of a pipeline on separate gate and up weights:
    ``x_SH`` [S, H] float; ``w_gate_EIH``, ``w_up_EIH``, ``w_down_EIH`` [E, I, H] float; the
    same device; ``layout`` an identity layout (rows in expert order) of S rows and E experts;
    optionally ``grad_y_SH`` [S, H] float and ``act_R2I`` [S, 2, I] float."""
    if not isinstance(x_SH, torch.Tensor) or x_SH.dim() != 2 or not x_SH.is_floating_point():
        raise ValueError(f"x_SH must be a floating 2-D [S, H] tensor, got {shape_text(x_SH)}")
    S, H = x_SH.shape
    w = w_gate_EIH
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point() or (
            w.shape[2] != H):
        raise ValueError(f"w_gate_EIH must be a floating [E, I, H={H}] tensor, got {shape_text(w)}")
    E, I, _ = w.shape
    for name, t in (("w_up_EIH", w_up_EIH), ("w_down_EIH", w_down_EIH)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (E, I, H) or (
                not t.is_floating_point()):
            raise ValueError(f"{name} must be a floating [E={E}, I={I}, H={H}] tensor, got "
                             f"{shape_text(t)}")
    extra = []
    if grad_y_SH is not None:
        extra.append(("grad_y_SH", grad_y_SH, (S, H)))
    if act_R2I is not None:
        extra.append(("act_R2I", act_R2I, (S, 2, I)))
    for name, t, shape in extra:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or (
                not t.is_floating_point()):
            raise ValueError(f"{name} must be a floating {list(shape)} tensor, got {shape_text(t)}")
    for name, t in (("w_gate_EIH", w), ("w_up_EIH", w_up_EIH), ("w_down_EIH", w_down_EIH),
                    *((n, t) for n, t, _ in extra)):
        if t.device != x_SH.device:
            raise ValueError(f"{name} is on {t.device} but x_SH is on {x_SH.device}")
    if not getattr(layout, "identity", False) or layout.tokens_sum != S or (
            layout.offsets_E.shape[0] != E):
        raise ValueError(
            f"routing must be the identity layout of S={S} rows in expert order and E={E} "
            "experts (common.routing.presorted_routing), got "
            f"{'identity' if getattr(layout, 'identity', False) else 'a gathered'} layout of "
            f"{getattr(layout, 'tokens_sum', '?')} rows"
        )


def identity_rows(t: torch.Tensor) -> torch.Tensor:
    """An [S, K] operand of an identity layout (``GroupedLayout.identity``: the rows are
    already in expert order) as the GEMMs read it in place: ``t`` itself when it is contiguous
    BF16, else a contiguous BF16 copy."""
    if t.dtype == torch.bfloat16 and t.is_contiguous():
        return t
    return t.to(torch.bfloat16).contiguous()


def covering_offsets(layout) -> torch.Tensor:
    """``layout.offsets_E`` with the last expert's end moved to S: a GEMM whose input rows are
    exactly 0 past the real rows (the activation passes write padding rows as 0) then writes
    every output row, 0 on padding rows, so an identity layout's output needs no combine pass
    (the layout's own offsets, which end at the real rows, leave the rows past them unwritten
    on cuBLAS)."""
    offs = layout.offsets_E
    return torch.cat([offs[:-1], offs.new_full((1,), layout.tokens_sum)])


def rows_times_experts(x_SK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor):
    """``x_SK[s] @ w_EKN[e(s)]``: BF16 out of ``torch._grouped_mm`` on CUDA where its stride
    rules allow (no fp32 copy), the portable path elsewhere."""
    if x_SK.is_cuda and fits_grouped_mm(x_SK.dtype, x_SK.device, *w_EKN.shape[1:]):
        return torch._grouped_mm(x_SK, w_EKN, offs=offsets_E)
    return grouped_mm_rows(x_SK, w_EKN, offsets_E)


def gathered_times_experts(impl: str, a_TK: torch.Tensor, w_EKN: torch.Tensor, layout, *,
                           keep_rows: bool = True):
    """``(a_S, out_S)``: the [S, K] BF16 rows ``a_TK[row_to_token_S]`` (padding rows 0) and
    ``a_S[s] @ w_EKN[e(s)]`` [S, N] BF16, the operand and output of a gathered grouped GEMM.
    ``impl`` (:func:`.grouped_mm_choice.pick`): ``"cublas"`` = the Triton gather
    pass then :func:`rows_times_experts`; ``"ours-gemm"`` = our gathering GEMM
    (:func:`cuda_kernels.grouped_mm.grouped_mm_gather`, its torch twin on CPU tensors), which
    side-writes the same rows bit for bit. An identity layout (rows already in expert order)
    gathers nothing: ``a_S`` is :func:`identity_rows` of ``a_TK``. ``keep_rows`` False (a
    gathered layout whose rows nothing reads after the GEMM: the wgrads read ``a_TK`` through
    the index): ``a_S`` is None -- the gathering GEMM writes no side output, the cuBLAS path's
    gathered rows are freed when the GEMM is queued."""
    idx = layout.row_to_token_S
    if layout.identity:  # rows already in expert order: no gather, the GEMM reads a_TK itself
        a_S = identity_rows(a_TK)
        if impl == "cublas":
            return a_S, rows_times_experts(a_S, w_EKN, layout.offsets_E)
        return a_S, gmm.grouped_mm_gather(a_S, w_EKN, layout.offsets_E, None, backend="auto")
    if impl == "cublas":
        a_S = gather_rows(a_TK, idx, torch.bfloat16)
        out = rows_times_experts(a_S, w_EKN, layout.offsets_E)
        return (a_S if keep_rows else None), out
    a_S = (torch.empty(layout.tokens_sum, a_TK.shape[1], dtype=torch.bfloat16,
                       device=a_TK.device) if keep_rows else None)
    # "auto": the device's registered kernel (pick() found it can run), the twin on CPU tensors
    out = gmm.grouped_mm_gather(kernel_rows(a_TK), w_EKN, layout.offsets_E, idx,
                                backend="auto", a_rows_out=a_S)
    return a_S, out
