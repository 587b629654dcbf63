"""The fused GPU MoE expert-MLP backward: grouped GEMMs with every other step fused into one pass.

Per call (rows in the grouped layout of the plan, REFERENCE §1.2; math REFERENCE §2)::

    x_S, dY_S   = gather_rows(X, dY)                    # one pass each, BF16 (Triton); x_S may
                                                        # come from the forward instead
    dh_raw_S    = dY_S @ W_down[e]^T                    # grouped GEMM, BF16 out (cuBLAS)
    dgu_S, ah_S, dA = activation_backward(dh_raw_S, checkpoint, ...)   # one pass (Triton): the
                                                        # checkpoint by pair [R, 2, I] or, as
                                                        # the forward kept it, by row [S, 2I]
    dB_*        = segment_colsum(...)                   # only with biases (Triton)
    dW_down     = ah_S^T dY_S                           # our grouped wgrad kernel (SM90)
    dX_S        = dgu_S @ W_gate_up[e]^T                # grouped GEMM (cuBLAS)
    dX          = token_sum(dX_S)                       # each token sums its rows (Triton)
    dW_gate_up  = x_S^T dgu_S                           # our grouped wgrad kernel (SM90)

Where the per-shape table says ``wgrad_gather: true``
(:func:`.grouped_mm_choice.table_wgrad_gather`; true for qwen3-30b-a3b: peak -0.50 GiB for +2 %
step time, ``benchmarks/RESULTS.md``) and the wgrad's implementation gathers in its operand load
(:func:`.grouped_mm_choice.wgrad_gathers`, ``api.WGRAD_GATHER_BACKENDS``), the two weight
gradients read X and dY through the layout's row -> token index instead (``dW_gate_up =
X[row_to_token_S]^T dgu_S``, ``dW_down = ah_S^T dY[row_to_token_S]``): no gathered [S, H] copy
of X is kept from the forward, and dY's gathered rows are freed after the down dgrad (kept only
where the bias gradients read them).

With ``grouped_mm="ours"`` (or ``"auto"`` where ``configs/cuda/grouped_mm_choice.yaml`` says so:
:mod:`cuda_kernels.moe.grouped_mm_choice`) the dY gather, the down dgrad and the activation backward
are one kernel, :func:`cuda_kernels.grouped_mm.down_dgrad_backward` (``dy_rows_out`` side-writes
``dY_S`` where something reads it), which reads ``dh_raw`` from its fp32 accumulator (one BF16
rounding fewer); with ``"ours-gemm"`` the dY gather and the down dgrad are one kernel
(:func:`cuda_kernels.grouped_mm.grouped_mm_gather`, ``dY_S`` side-written where read) and the
activation backward stays a pass.

:func:`moe_backward_split_gate_up` is the same backward on rows already in expert order (an
identity layout) with the gate and up weights as two operands (torchtitan's ``w1`` / ``w3``
[E, I, H], read in place; their gradients written straight in that layout)::

    dh_raw_S    = dY @ W_down[e]^T                      # as above (no gather)
    dg, du, ah  = activation_backward(..., gate_up_apart=True)   # dg, du: two dense [S, I]
    dW_down     = (ah)^T dY
    dX          = dg @ W_gate[e] + du @ W_up[e]         # two grouped GEMMs and one add
    dW_gate     = dg^T x;   dW_up = du^T x              # two wgrads, [E, I, H] each

No fp32 intermediate goes through HBM; every step is deterministic (no atomics), reads no
device value on the host (CUDA-graph capturable) and allocates only its outputs and the BF16
operands, each freed after its last GEMM. Sizes off the 128 grid with BF16 outputs (gpt-oss) run
the wgrad on cuBLAS's grouped GEMM instead, which was faster there (see ``_choose_wgrad``). On
CPU tensors the Triton kernels run in Triton's interpreter and the GEMMs in torch: that is how CPU
CI tests this path against its twin, :func:`common.torch_backward.moe_backward_torch`.
"""

from __future__ import annotations

import torch

from common.problem import Activation, ClampLimits, MoEBackwardProblem, MoEGrads
from common.torch_backward import ALIGN, gate_up_from_matrix, gate_up_matrix, grouped_layout

from .. import grouped_mm as gmm
from ..grouped_wgrad import api
from ..triton.activation import activation_backward
from ..triton.rows import gather_rows, segment_colsum, token_sum, zero_empty_groups
from .grouped_mm_choice import (
    check_grouped_mm,
    gathered_wgrad_choice,
    kernel_gathers,
    kernel_rows,
    pick,
    table_wgrad_gather,
    wgrad_choice,
    wgrad_gathers,
)
from .steps import (
    check_split_gate_up,
    covering_offsets,
    gathered_times_experts,
    identity_rows,
    rows_times_experts,
)

__all__ = ["GRAD_DTYPES", "moe_backward_fused", "moe_backward_split_gate_up"]

GRAD_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes the fused backward writes its gradients in (dA is always fp32)."""


def _memory_is(w: torch.Tensor, order: tuple[int, ...]) -> bool:
    """True when ``w`` is not contiguous but ``w.permute(order)`` is: its memory holds that
    permutation (torchtitan's ``w1``/``w3``/``w2`` behind the layer's views). The weight gradient
    is then computed straight into that memory layout (the wgrad's operands swapped), so neither
    the backward nor autograd transposes a gradient."""
    return not w.is_contiguous() and w.permute(order).is_contiguous()


def _check_options(problem, grad_dtype, accumulate_into, wgrad_backend):
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype!r}")
    if wgrad_backend not in ("auto", "sm90", "sm100", "torch"):
        raise ValueError(
            f"wgrad_backend must be 'auto', 'sm90', 'sm100' or 'torch', got {wgrad_backend!r}"
        )
    if accumulate_into is None:
        return None
    if not isinstance(accumulate_into, (tuple, list)) or len(accumulate_into) != 2:
        raise ValueError(
            "accumulate_into must be a pair (dW_gate_up [E, H, 2, I], dW_down [E, I, H]) of "
            f"fp32 tensors, got {type(accumulate_into).__name__}"
        )
    shapes = (tuple(problem.w_gate_up_EH2I.shape), tuple(problem.w_down_EIH.shape))
    dev = problem.hidden_states_TH.device
    for name, buf, shape in zip(("dW_gate_up", "dW_down"), accumulate_into, shapes):
        arg = f"accumulate_into[{name}]"
        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"{arg} must be a torch.Tensor, got {type(buf).__name__}")
        if tuple(buf.shape) != shape:
            raise ValueError(f"{arg} must have shape {list(shape)}, got {list(buf.shape)}")
        if buf.dtype != torch.float32:
            raise ValueError(f"{arg} must be torch.float32 (a main_grad buffer), got {buf.dtype}")
        if buf.device != dev:
            raise ValueError(f"{arg} is on {buf.device} but the problem is on {dev}")
        if not buf.is_contiguous():
            raise ValueError(f"{arg} must be contiguous")
        if buf.requires_grad:
            raise ValueError(f"{arg} must not require grad")
    return tuple(accumulate_into)


_WGRAD_CHOICE: dict[tuple, tuple[str, str | None]] = {}


def _choose_wgrad(
    a_HS, b_SI, offsets_E, out_dtype, accumulate, backend, group_align
) -> tuple[str, str | None]:
    """(implementation, why not our kernel) of a wgrad on these operands
    (:func:`.grouped_mm_choice.wgrad_choice`): "sm90" / "sm100" (our CuTe DSL kernel),
    "cublas" (``torch._grouped_mm``) or "torch" (the portable twin). RuntimeError where an
    explicit ``backend`` cannot run the call."""
    name, reason = wgrad_choice(a_HS.device, a_HS, b_SI, offsets_E, out_dtype, accumulate,
                                backend, group_align)
    _refuse_error(name, reason, backend)
    return name, reason


def _refuse_error(name: str, reason: str | None, backend) -> None:
    """RuntimeError when a wgrad choice is ``"error"`` (an explicit ``backend`` that cannot
    run the call), naming the backend and the reason."""
    if name == "error":
        raise RuntimeError(f"wgrad_backend={backend!r} cannot run this call: {reason}")


def _wgrad(
    a_HS, b_SI, offsets_E, out, accumulate, out_dtype, backend, group_align, stats, *,
    a_rows=None, b_rows=None,
) -> torch.Tensor:
    """``[E, H, I]``: ``out[e] (+)= A[:, rows of e] @ B[rows of e]`` (``out`` None: a new
    tensor of ``out_dtype``), A = ``a_HS`` and B = ``b_SI``, or read through a row index:

    * ``a_rows`` [S] (the layout's row -> token index): ``a_HS`` is an [H, T] source (any float
      dtype) and A's column s is ``a_HS[:, a_rows[s]]``, 0 where ``a_rows[s] < 0``;
    * ``b_rows`` [S]: ``b_SI`` is a [T, I] source and B's row s is ``b_SI[b_rows[s]]``.

    Where the implementation (:func:`.grouped_mm_choice.gathered_wgrad_choice`, the same answer
    the forward read) gathers in its operand load (``api.WGRAD_GATHER_BACKENDS``) the index
    goes to :func:`~cuda_kernels.grouped_wgrad.api.grouped_wgrad_into`; elsewhere (cuBLAS, the
    torch twin, SM100, or an API without it) the operand is gathered first (one Triton pass,
    BF16) and the call runs as without an index. The implementation is chosen once per
    operand metadata (host time matters: this runs twice per backward)."""
    if a_rows is not None or b_rows is not None:
        E = offsets_E.shape[0]
        name, reason = gathered_wgrad_choice(
            a_HS.device, E, a_HS.shape[0], b_SI.shape[1], out_dtype=out_dtype,
            accumulate=accumulate, backend=backend, group_align=group_align,
        )
        if kernel_gathers(name):
            stats.setdefault("wgrad_backend", name)
            stats["wgrad_gather"] = stats.get("wgrad_gather", 0) + 1
            if a_rows is not None:
                a_HS = kernel_rows(a_HS.t()).t()
            if b_rows is not None:
                b_SI = kernel_rows(b_SI)
            if out is None:
                out = torch.empty(E, a_HS.shape[0], b_SI.shape[1], dtype=out_dtype,
                                  device=a_HS.device)
            api.grouped_wgrad_into(a_HS, b_SI, offsets_E, out, accumulate=accumulate,
                                   backend=name, a_rows_S=a_rows, b_rows_S=b_rows)
            return out
        _refuse_error(name, reason, backend)
        # no gathering kernel here: the gathered operand first, then the call as it was
        if a_rows is not None:
            a_HS = gather_rows(a_HS.t(), a_rows, torch.bfloat16).t()
        if b_rows is not None:
            b_SI = gather_rows(b_SI, b_rows, torch.bfloat16)
    key = (backend, str(a_HS.device), a_HS.shape, a_HS.stride(), b_SI.shape, b_SI.stride(),
           a_HS.dtype, b_SI.dtype, out_dtype, bool(accumulate), group_align)
    choice = _WGRAD_CHOICE.get(key)
    if choice is None:
        choice = _WGRAD_CHOICE[key] = _choose_wgrad(
            a_HS, b_SI, offsets_E, out_dtype, accumulate, backend, group_align
        )
    name, reason = choice
    stats.setdefault("wgrad_backend", name)
    if reason:
        stats["wgrad_reason"] = reason
    if name == "cublas":
        return zero_empty_groups(torch._grouped_mm(a_HS, b_SI, offs=offsets_E), offsets_E)
    if out is None:
        E = offsets_E.shape[0]
        out = torch.empty(E, a_HS.shape[0], b_SI.shape[1], dtype=out_dtype, device=a_HS.device)
    if name == "torch":
        api.grouped_gemm_wgrad(
            a_HS, b_SI, offsets_E, wgrad_tensor=out, accumulate_on_output=accumulate,
            backend="torch", validate_offsets=False,
        )
    else:
        api.grouped_wgrad_into(a_HS, b_SI, offsets_E, out, accumulate=accumulate, backend=name)
    return out


def moe_backward_fused(
    problem: MoEBackwardProblem,
    *,
    grad_dtype: torch.dtype = torch.float32,
    accumulate_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    wgrad_backend: str = "auto",
    layout=None,
    x_rows_S: torch.Tensor | None = None,
    grouped_mm: str = "auto",
) -> MoEGrads:
    """MoE expert-MLP backward, fused: BF16 GEMM operands, fp32 accumulation, no fp32 glue.

    Dimensions: T tokens, H hidden, I intermediate, E experts, K top_k, S grouped rows.

    Args:
        problem: :class:`~common.problem.MoEBackwardProblem` on a CUDA device (or the CPU with
            ``TRITON_INTERPRET=1`` set before Triton is imported, where the Triton kernels run
            interpreted: for tests; RuntimeError otherwise). Any float input dtype; GEMM operands
            are BF16. Its checkpoint may be [R, 2, I] (pair order) or the fused forward's
            grouped rows [S, 2I] (``LayerForward.checkpoint``; needs ``layout``).
        grad_dtype: torch.float32 (default) or torch.bfloat16: dtype of dX, the weight and the
            bias gradients. dA is fp32.
        accumulate_into: optional ``(dW_gate_up [E, H, 2, I], dW_down [E, I, H])`` fp32 buffers
            (Megatron ``main_grad`` style): the weight gradients are ADDED into them in fp32
            inside the wgrad kernel, and the returned grads hold these same tensors. Without
            it, a weight whose memory is torchtitan's (``w_gate_up`` a view of [E, 2I, H],
            ``w_down`` of [E, H, I]) gets its gradient in that same memory layout.
        wgrad_backend: "auto" (our kernel when the device and the call allow; cuBLAS's grouped
            GEMM for BF16 outputs off the 128 grid, where it is faster, and for layouts off the
            SM100 kernel's 256-row contract; else the torch twin), "sm90" / "sm100" (that kernel
            or RuntimeError), "torch". ``info["wgrad_backend"]`` / ``["wgrad_reason"]`` say
            which ran and why.
        layout: optional :class:`~common.routing.GroupedLayout` of the plan with ``align`` a
            multiple of 16 (the forward's, to skip rebuilding it: ~20 small kernels and their
            host time), or its identity layout (:func:`common.routing.presorted_routing`: X and
            dY are read in place, dX is the dgrad's output, no gather or per-token sum);
            default ``plan.grouped`` with a static row count.
        x_rows_S: optional [S, H] BF16 X already in ``layout``'s row order, as the forward
            gathered it for its first GEMM (padding rows must be finite: the gather writes 0);
            the gate/up wgrad reads it instead of X through the index. Needs ``layout``.
            The layer's forward keeps it unless the shape's ``wgrad_gather`` is true and that
            wgrad gathers (:func:`.grouped_mm_choice.keeps_x_rows`; not kept for
            qwen3-30b-a3b's shape).
        grouped_mm: ``"cublas"`` (dY gather, cuBLAS dgrad, activation-backward pass),
            ``"ours"`` (the fused :func:`cuda_kernels.grouped_mm.down_dgrad_backward`; needs
            a contiguous BF16 checkpoint, either form, with gate and up as column halves),
            ``"ours-gemm"`` (our gathering down dgrad, then the activation-backward pass) or
            ``"auto"`` (default: the per-shape table, cuBLAS where our kernel cannot run;
            :mod:`cuda_kernels.moe.grouped_mm_choice`).
            ``info["grouped_mm"]`` says which ran.
    Returns:
        :class:`~common.problem.MoEGrads`; ``info["wgrad_backend"]`` names the wgrad used,
        ``info["grouped_mm"]`` the down-dgrad implementation, ``info["wgrad_gather"]`` (where
        present) how many of the two wgrads read their X / dY operand through the index.
    Raises:
        ValueError: the problem (:meth:`MoEBackwardProblem.validate`) or an option breaks a
            rule; raised before any output is written.
        RuntimeError: an explicit ``wgrad_backend`` cannot run here; ``grouped_mm="ours"`` /
            ``"ours-gemm"`` where its kernel cannot run this call; CPU tensors without the
            Triton interpreter.
    """
    p = problem
    p.validate(checkpoint_rows=True)
    acc = _check_options(p, grad_dtype, accumulate_into, wgrad_backend)
    plan = p.plan
    x_TH, dy_TH = p.hidden_states_TH, p.output_grad_TH
    E, H, _, I = p.w_gate_up_EH2I.shape
    dev = x_TH.device
    bf16 = torch.bfloat16
    passed_layout = layout
    if layout is None:
        layout = grouped_layout(plan, E)
    elif (layout.align % ALIGN and not layout.identity) or layout.num_tokens != plan.num_tokens:
        raise ValueError(
            f"layout must be a grouped layout of this plan with align a multiple of {ALIGN} "
            f"(or an identity layout), got align={layout.align}, T={layout.num_tokens}"
        )
    S = layout.tokens_sum
    if x_rows_S is not None:
        if not isinstance(x_rows_S, torch.Tensor) or tuple(x_rows_S.shape) != (S, H):
            raise ValueError(f"x_rows_S must be a [S={S}, H={H}] tensor in the layout's row order")
        if x_rows_S.dtype != bf16 or x_rows_S.device != dev or x_rows_S.stride(1) != 1:
            raise ValueError(
                f"x_rows_S must be torch.bfloat16 on {dev} with unit stride along H, got "
                f"{x_rows_S.dtype} on {x_rows_S.device}, strides {x_rows_S.stride()}"
            )
        if passed_layout is None:
            raise ValueError("x_rows_S needs the layout it was gathered with (layout=...)")
    ck = p.act_checkpoint_R2I
    if ck.dim() == 2:  # the forward's gate/up GEMM output rows (validate: [S' >= R, 2I])
        if passed_layout is None:
            raise ValueError(
                "act_checkpoint_R2I in grouped row order [S, 2I] needs the layout it was "
                "written in (layout=...)"
            )
        if ck.shape[0] != S:
            raise ValueError(
                f"act_checkpoint_R2I in grouped row order must have the layout's S={S} rows, "
                f"got {list(ck.shape)}"
            )
    offs = layout.offsets_E
    r2p = layout.row_to_pair_S
    stats: dict = {}

    # X: the identity layout's rows are X itself; elsewhere the forward's rows where it kept
    # them, else read through the row -> token index by the gate/up wgrad (x_S None: no
    # gathered copy, or one gathered right before that wgrad where its kernel cannot gather)
    x_S = x_rows_S
    r2t = layout.row_to_token_S
    # the per-shape trade (grouped_mm_choice.yaml) and whether the wgrad kernel can gather:
    # the forward's keeps_x_rows asked the same two questions
    table_gathers = table_wgrad_gather(E, H, I) and not layout.identity
    x_in_wgrad = table_gathers and wgrad_gathers(
        dev, E, H, 2 * I, out_dtype=grad_dtype, accumulate=acc is not None,
        backend=wgrad_backend, group_align=layout.align,
    )
    if x_S is None and layout.identity:
        x_S = identity_rows(x_TH)
    elif x_S is None and not x_in_wgrad:
        x_S = gather_rows(x_TH, r2t, bf16)
    w_down_EHI = p.w_down_EIH.to(bf16).transpose(1, 2)
    # the gate/up matrix: a view (gpt-oss's interleaved memory included) unless the gradient
    # is accumulated into a main_grad buffer, whose memory is the concatenated [E, H, 2, I]
    w_gu, interleaved = gate_up_matrix(p.w_gate_up_EH2I.to(bf16))
    ck_interleaved = interleaved  # a row checkpoint's columns: the forward GEMM's, this order
    if interleaved and acc is not None:
        w_gu, interleaved = p.w_gate_up_EH2I.to(bf16).reshape(E, H, 2 * I), False
    # (the fused dgated epilogue reads a row checkpoint's g, u as its two column halves: not
    # one with gpt-oss's interleaved columns, even where main_grad makes d_gate_up concatenated)
    impl = pick("backward_down_dgrad", grouped_mm, dy_TH, w_down_EHI, r2t, act_R2I=ck,
                gate_up_interleaved=interleaved or (ck.dim() == 2 and ck_interleaved))
    stats["grouped_mm"] = impl
    # dY rows [S, H] are written only where something reads them: the bias gradients (and the
    # activation backward's dA term of the down bias), or a dW_down that cannot read dY
    # through the index (the table's wgrad_gather and wgrad_gathers: the choice _wgrad makes)
    dy_in_wgrad = table_gathers and wgrad_gathers(
        dev, E, I, H, out_dtype=grad_dtype, accumulate=acc is not None, backend=wgrad_backend,
        group_align=layout.align,
    )
    keep_dy = not dy_in_wgrad or p.has_bias
    dy_src = dy_TH  # the wgrad's source rows where dY is read through the index
    if impl == "ours":
        dy_src = kernel_rows(dy_TH)
        # (an identity layout's rows are dY itself: the kernel reads them, no side output)
        dy_S = (torch.empty(S, H, dtype=bf16, device=dev)
                if keep_dy and not layout.identity else None)
        dgu_S, ah_S, dA_TE = gmm.down_dgrad_backward(
            dy_src, w_down_EHI.transpose(1, 2), layout, plan, ck,
            activation=p.activation, clamp_limits=p.clamp_limits, b_down_EH=p.b_down_EH,
            backend="auto", dy_rows_out=dy_S,
        )
        if layout.identity:
            dy_S = identity_rows(dy_TH)
    else:
        # (the cuBLAS path's gathered dY is freed after its GEMM unless kept)
        dy_S, dh_raw = gathered_times_experts(impl, dy_TH, w_down_EHI, layout,
                                              keep_rows=keep_dy)
        dgu_S, ah_S, dA_TE = activation_backward(
            dh_raw, ck, r2p, plan,
            activation=p.activation, clamp_limits=p.clamp_limits or ClampLimits(),
            dy_SH=dy_S, b_down_EH=p.b_down_EH, gate_up_interleaved=interleaved,
            checkpoint_interleaved=ck_interleaved,
        )
        del dh_raw
    # Operands are freed as soon as their last GEMM is queued: dY rows and a*h after dW_down,
    # the dX rows after their token sum, X rows and d_gate_up after dW_gate_up.
    acc_gu, acc_d = acc if acc is not None else (None, None)
    if p.has_bias:
        dBgu = segment_colsum(dgu_S, offs, r2p)
        dBd = segment_colsum(dy_S, offs, r2p, plan.pair_affinity_R)
    align = layout.align
    dy_rows = None
    if dy_S is None:  # dY read through the index (dy_S is dY's [T, H] source)
        dy_S, dy_rows = dy_src, r2t
    if acc is None and _memory_is(p.w_down_EIH, (0, 2, 1)):  # w2 [E, H, I] (torchtitan)
        dWd = _wgrad(dy_S.t(), ah_S, offs, None, False, grad_dtype, wgrad_backend, align,
                     stats, a_rows=dy_rows).transpose(1, 2)
    else:
        dWd = _wgrad(
            ah_S.t(), dy_S, offs, acc_d, acc is not None, grad_dtype, wgrad_backend, align, stats,
            b_rows=dy_rows,
        )
    del ah_S, dy_S, dy_src
    w_gu_E2IH = w_gu.transpose(1, 2)
    if layout.identity:  # each row is its own token (d_gate_up is 0 on padding rows)
        dX = rows_times_experts(dgu_S, w_gu_E2IH, covering_offsets(layout)).to(grad_dtype)
    else:
        dX_S = rows_times_experts(dgu_S, w_gu_E2IH, offs)
        dX = token_sum(dX_S, layout.slot_to_row_TK, grad_dtype)
        del dX_S
    x_rows = None
    if x_S is None:  # X read through the index
        x_S, x_rows = x_TH, r2t
    if acc is None and _memory_is(w_gu, (0, 2, 1)):  # [E, 2I, H]: [w1; w3], gpt-oss [E, 2I, H]
        dWgu = _wgrad(dgu_S.t(), x_S, offs, None, False, grad_dtype, wgrad_backend, align,
                      stats, b_rows=x_rows).transpose(1, 2)
    else:
        dWgu = _wgrad(
            x_S.t(), dgu_S, offs, None if acc_gu is None else acc_gu.view(E, H, 2 * I),
            acc is not None, grad_dtype, wgrad_backend, align, stats, a_rows=x_rows,
        )
    dWgu = gate_up_from_matrix(dWgu, interleaved)  # in the weight's own memory layout
    grads = MoEGrads(
        hidden_states_grad_TH=dX,
        affinity_grad_TE=dA_TE,
        w_gate_up_grad_EH2I=acc_gu if acc_gu is not None else dWgu,
        w_down_grad_EIH=dWd,
        info=stats,
    )
    if p.has_bias:
        grads.b_gate_up_grad_E2I = gate_up_from_matrix(dBgu[:, None], interleaved)[:, 0].to(
            grad_dtype)
        grads.b_down_grad_EH = dBd.to(grad_dtype)
    return grads


def _wgrad_like(w_EIH, a_SI, x_SH, offsets_E, grad_dtype, wgrad_backend, group_align, stats):
    """``dW[e] = a_SI[rows of e]^T x_SH[rows of e]`` [E, I, H] written in ``w_EIH``'s memory
    layout: [E, I, H] itself, or [E, H, I] seen transposed (the wgrad's operands swapped), so
    that no gradient is transposed afterwards."""
    if _memory_is(w_EIH, (0, 2, 1)):
        return _wgrad(x_SH.t(), a_SI, offsets_E, None, False, grad_dtype, wgrad_backend,
                      group_align, stats).transpose(1, 2)
    return _wgrad(a_SI.t(), x_SH, offsets_E, None, False, grad_dtype, wgrad_backend, group_align,
                  stats)


def moe_backward_split_gate_up(
    grad_y_SH: torch.Tensor,
    x_SH: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EIH: torch.Tensor,
    act_R2I: torch.Tensor,
    routing,
    *,
    clamp_limits: ClampLimits | None = None,
    activation=None,
    grad_dtype: torch.dtype = torch.float32,
    wgrad_backend: str = "auto",
    grouped_mm: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The backward of :func:`cuda_kernels.moe.forward.moe_forward_split_gate_up`: rows already
    in expert order, separate gate and up weights (torchtitan's ``w1`` / ``w3``) read in place.

    Dimensions: S rows (= T = R), H hidden, I intermediate, E experts.

    ``dh_raw = dY W_down[e]^T`` (grouped GEMM), the activation backward in one Triton pass
    writing dg and du as two dense [S, I] operands (padding rows 0), then
    ``dW_down[e] = h^T dY``, ``dX = dg W_gate[e] + du W_up[e]`` (two grouped GEMMs, BF16 out,
    and one add), ``dW_gate[e] = dg^T x`` and ``dW_up[e] = du^T x`` (two grouped wgrads, each
    written in its weight's memory layout: torchtitan's [E, I, H] as it is). No weight or
    weight gradient is copied, concatenated or transposed. Same math as
    :func:`moe_backward_fused` on ``[w_gate; w_up]``; dX differs by the BF16 rounding of the two
    GEMM outputs before their sum (one GEMM over K = 2I rounds once).

    Args:
        grad_y_SH: [S, H] float, dL/dy (read in place when BF16 and contiguous).
        x_SH: [S, H] float, the forward's rows.
        w_gate_EIH, w_up_EIH, w_down_EIH: [E, I, H] float, as the forward took them.
        act_R2I: [S, 2, I] the forward's BF16 checkpoint.
        routing: ``(plan, layout)`` of :func:`common.routing.presorted_routing`.
        clamp_limits, activation: the forward's.
        grad_dtype: torch.float32 (default) or torch.bfloat16: dtype of every gradient.
        wgrad_backend: as :func:`moe_backward_fused` (``info["wgrad_backend"]`` says which ran).
        grouped_mm: the down dgrad's implementation as in :func:`moe_backward_fused`
            (``info["grouped_mm"]``) except that the fused ``"ours"`` (which writes gate/up
            concatenated) is refused, and the ``"auto"`` table's ``"ours"`` runs ``"cublas"``.
    Returns:
        ``(dX [S, H], dW_gate [E, I, H], dW_up [E, I, H], dW_down [E, I, H], info)`` in
        ``grad_dtype``; each weight gradient has its weight's memory layout where that is
        [E, I, H] or [E, H, I] (a transposed view then), and dX is 0 on padding rows.
    Raises:
        ValueError: bad shapes or devices (named), not an identity layout, a bad
            ``grad_dtype`` / ``wgrad_backend`` / ``grouped_mm``.
        RuntimeError: ``grouped_mm="ours"``; an explicit ``wgrad_backend`` that cannot run
            here; CPU tensors without the Triton interpreter.
    """
    plan, layout = routing
    check_split_gate_up(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH, layout, grad_y_SH=grad_y_SH,
                        act_R2I=act_R2I)
    _check_options(None, grad_dtype, None, wgrad_backend)  # (no main_grad pair here)
    check_grouped_mm(grouped_mm)
    if grouped_mm == "ours":
        raise RuntimeError(
            "grouped_mm='ours' cannot run with separate gate and up weights: the fused "
            "epilogue writes d_gate_up as one [S, 2I] row; use 'auto', 'cublas' or 'ours-gemm'"
        )
    bf16 = torch.bfloat16
    act_fn = Activation.resolve(activation)
    offs, align = layout.offsets_E, layout.align
    stats: dict = {}
    w_down_EHI = w_down_EIH.to(bf16).transpose(1, 2)
    impl = pick("backward_down_dgrad", grouped_mm, grad_y_SH, w_down_EHI, layout.row_to_token_S,
                act_R2I=act_R2I)
    if impl == "ours":  # (only from the "auto" table: the fused epilogue writes [S, 2I])
        impl = "cublas"
    stats["grouped_mm"] = impl
    dy_S, dh_raw = gathered_times_experts(impl, grad_y_SH, w_down_EHI, layout)
    dgu_2SI, ah_S, _ = activation_backward(
        dh_raw, act_R2I, layout.row_to_pair_S, plan, activation=act_fn,
        clamp_limits=clamp_limits or ClampLimits(), gate_up_apart=True,
    )
    del dh_raw
    dg_S, du_S = dgu_2SI[0], dgu_2SI[1]
    dWd = _wgrad_like(w_down_EIH, ah_S, dy_S, offs, grad_dtype, wgrad_backend, align, stats)
    del ah_S, dy_S
    # dX = dg W_gate + du W_up: every row written (covering offsets; dg, du are 0 on padding)
    cover = covering_offsets(layout)
    dX = rows_times_experts(dg_S, w_gate_EIH.to(bf16), cover)
    dX = dX.add_(rows_times_experts(du_S, w_up_EIH.to(bf16), cover)).to(grad_dtype)
    x_S = identity_rows(x_SH)  # (x itself when BF16 and contiguous, as the forward read it)
    dWg = _wgrad_like(w_gate_EIH, dg_S, x_S, offs, grad_dtype, wgrad_backend, align, stats)
    dWu = _wgrad_like(w_up_EIH, du_S, x_S, offs, grad_dtype, wgrad_backend, align, stats)
    return dX, dWg, dWu, dWd, stats
