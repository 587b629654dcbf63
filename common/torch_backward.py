"""The portable ``torch`` backend: the MoE expert-MLP backward on the grouped layout.

BF16 inputs, fp32 accumulation, any device. The math is REFERENCE §2 (see
:mod:`common.reference`, its float64 twin). Steps, on the grouped layout of the plan (rows sorted
by expert, each expert padded to ``ALIGN`` rows with zero rows, static row count so CUDA needs no
host read):

1. gather X, dY, the checkpoint and the affinities into grouped rows (padding rows are zero);
2. ``dh_raw = dY Wd^T`` (grouped GEMM rows x per-expert weights);
3. activation backward in fp32 with the strict clamp masks, ``dA`` per row: the problem's
   :class:`~common.problem.Activation` ``h = g sigmoid(alpha g) (u + c)``, s = sigmoid(alpha g),
   ``dg = dh (u + c) s (1 + alpha g (1 - s))``, ``du = dh g s`` (SwiGLU: alpha 1, c 0;
   gpt-oss: alpha 1.702, c 1);
4. ``dX = [dg, du] [Wg, Wu]^T`` (grouped GEMM), scatter-added over each token's experts;
5. weight gradients ``dW_gate_up[e] = X^T [dg, du]``, ``dW_down[e] = (a h)^T dY`` through
   ``grouped_wgrad`` (default: ``torch._grouped_mm``; a CUDA backend passes its own kernel);
6. bias gradients by segment sums.

GEMM operands are BF16 (rounded exactly where a training stack stores them: ``[dg, du]`` and
``a h``); every GEMM accumulates in fp32 and rounds its output to BF16 (``torch._grouped_mm``
offers no fp32 output for BF16 inputs), except the weight gradients when a ``grouped_wgrad``
kernel with fp32 output is given (the CUDA backends). The activation backward runs in fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.activation import activation_backward, activation_forward
from common.problem import Activation, ClampLimits, MoEBackwardProblem, MoEGrads
from common.routing import host_reads_free
from common.shapes import static_tokens_sum

__all__ = [
    "ALIGN",
    "SMALL_GEMM_MACS",
    "cpu_threads",
    "checkpoint_pairs",
    "LayerForward",
    "fits_grouped_mm",
    "gate_up_from_matrix",
    "gate_up_matrix",
    "grouped_layout",
    "grouped_mm_rows",
    "grouped_wgrad_default",
    "moe_backward_torch",
    "moe_forward_checkpoint_torch",
    "moe_forward_torch",
    "moe_layer_forward_torch",
]

ALIGN = 16
"""Row alignment of each expert's group: 16 rows keep every BF16/fp32 operand stride a
multiple of 16 bytes, which ``torch._grouped_mm`` requires."""

GroupedWgrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _segments(offsets_E: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets_E.to(torch.int64).tolist()  # host read: only on the loop fallback
    return list(zip([0] + ends[:-1], ends))


def fits_grouped_mm(dtype: torch.dtype, device: torch.device, *dims: int) -> bool:
    """Use torch._grouped_mm (BF16, strides of 16 bytes) on CUDA. On the CPU a per-expert loop
    of BLAS calls is faster (measured 2026-11-30, 2 cores: torch._grouped_mm copies transposed
    weights), and host reads of the offsets cost nothing there."""
    if not hasattr(torch, "_grouped_mm") or device.type == "cpu":
        return False
    if dtype != torch.bfloat16:
        return False
    return all(d % 8 == 0 and d > 0 for d in dims)


@functools.cache
def _cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies BF16 matrices natively (oneDNN's BF16 support: AVX512-BF16,
    AMX, ...). Without it torch's BF16 matmul is an emulation: measured 2026-12-03 on a 2-core
    AVX2 EPYC, a [128, 256] x [256, 256] BF16 product took 27 ms, the same in fp32 0.76 ms."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # unknown: keep torch's BF16 matmul


def _operands(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to the GEMM operand ``dtype``; on a CPU without native BF16 GEMMs, those
    BF16 values widened to fp32: every product of two BF16 values is exact in fp32 and the
    GEMM accumulates in fp32 either way, so the result is the same math, 35x faster there."""
    t = t.to(dtype)
    if dtype == torch.bfloat16 and t.device.type == "cpu" and not _cpu_has_fast_bf16():
        return t.float()
    return t


SMALL_GEMM_MACS = 1 << 26
"""Below this many multiply-adds in an expert's average GEMM (``R / E * H * 2I``), the
layer's CPU path runs on one intra-op thread (:func:`cpu_threads`)."""


@contextlib.contextmanager
def cpu_threads(device: torch.device, rows: int, experts: int, hidden: int, intermediate: int):
    """One intra-op thread for the body when ``device`` is the CPU and the expert GEMMs are
    small (:data:`SMALL_GEMM_MACS`); torch's setting otherwise, and restored afterwards.

    Why: without it a small layer step enters ~125 OpenMP parallel regions of every intra-op
    thread (counted: GOMP_parallel calls, T 512, H 256, I 128, E 8, top-2, 2 threads; with it
    none of two threads), and on a shared machine each region waits for its slowest,
    descheduled thread. Measured 2026-12-03 on 2 loaded cores: 58-138 ms per training step on
    one thread, 236-1500 ms on two. Large problems keep every thread."""
    n = torch.get_num_threads()
    small = rows * hidden * 2 * intermediate < SMALL_GEMM_MACS * max(experts, 1)
    if device.type != "cpu" or n == 1 or not small:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def gate_up_matrix(w_gate_up_EH2I: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(w_EHN [E, H, 2I], interleaved)``: the gate/up weight as the GEMM's [E, H, 2I] matrix,
    a VIEW wherever the memory allows one, and whether its columns are interleaved.

    Concatenated halves (the layer's own [E, H, 2, I], torchtitan's ``[w1; w3]``): gate i at
    column i, up i at column I + i. gpt-oss's interleaved ``gate_up_proj`` ([E, H, 2I] or
    [E, 2I, H] with gate at even, up at odd positions, seen through the [E, H, 2, I] view whose
    "2" stride is half its I stride) has no concatenated view: its own memory is the matrix,
    gate i at column 2i and up i at 2i + 1 (``interleaved`` True); the GEMM's output and the
    ``d_gate_up`` rows then use that order. Any other strides: a copy, concatenated."""
    E, H, _, I = w_gate_up_EH2I.shape
    s2, s3 = w_gate_up_EH2I.stride(2), w_gate_up_EH2I.stride(3)
    if I > 1 and s2 != 0 and s3 == 2 * s2:  # (an expanded weight, strides 0, is no layout)
        return w_gate_up_EH2I.transpose(2, 3).reshape(E, H, 2 * I), True
    return w_gate_up_EH2I.reshape(E, H, 2 * I), False


def gate_up_from_matrix(m_EHN: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of :func:`gate_up_matrix`: an [E, H, 2I] matrix (e.g. its weight gradient)
    as [E, H, 2, I], a view."""
    N = m_EHN.shape[2]
    if interleaved:
        return m_EHN.unflatten(2, (N // 2, 2)).transpose(2, 3)
    return m_EHN.unflatten(2, (2, N // 2))


def _real_rows(segments: list[tuple[int, int]], rows_E: torch.Tensor | None) -> list[int]:
    """The rows of each group that hold data: the first ``rows_E[e]`` (all of it for None)."""
    if rows_E is None:
        return [t - s for s, t in segments]
    return [max(0, min(n, t - s)) for n, (s, t) in zip(rows_E.tolist(), segments)]


def grouped_mm_rows(
    x_SK: torch.Tensor,
    w_EKN: torch.Tensor,
    offsets_E: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    rows_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of expert e times that expert's matrix: ``out[s] = x_SK[s] @ w_EKN[e(s)]``.

    Args:
        x_SK: [S, K] rows in grouped order.  w_EKN: [E, K, N] (any strides).
        offsets_E: [E] int32 cumulative ends.
        dtype: operand dtype of the GEMM (BF16: fp32 accumulation, product rounded to BF16;
            fp32: fp32 throughout).
        rows_E: optional [E] int, the rows at the start of each group that hold data (the
            plan's ``tokens_per_expert_E``); the rest of each group is zero padding. The CPU
            loop then multiplies only those rows and writes 0 to the padding rows (the same
            values for zero padding rows, without their GEMM work); elsewhere it is not read.
    Returns:
        [S, N] fp32.
    """
    S, K = x_SK.shape
    N = w_EKN.shape[2]
    dt = dtype
    if fits_grouped_mm(dt, x_SK.device, K, N) and S % ALIGN == 0:
        return torch._grouped_mm(x_SK.to(dt), w_EKN.to(dt), offs=offsets_E).float()
    # each product rounded to dt; with rows_E the padding rows stay 0 (one fill, no GEMM)
    out = (torch.empty if rows_E is None else torch.zeros)(S, N, dtype=dt, device=x_SK.device)
    segments = _segments(offsets_E)
    x_SK = _operands(x_SK, dt)
    for e, ((s, _), m) in enumerate(zip(segments, _real_rows(segments, rows_E))):
        if m:  # (weights widened per expert: no fp32 copy of all of them at once)
            w = _operands(w_EKN[e], dt)
            if w.dtype == dt:  # the product straight into its rows (no temporary)
                torch.mm(x_SK[s : s + m], w, out=out[s : s + m])
            else:
                out[s : s + m] = x_SK[s : s + m] @ w
    if rows_E is None:
        out[segments[-1][1] if segments else 0 :].zero_()  # rows past the last offset
    return out.float()


def grouped_wgrad_default(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    rows_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Wgrad[e] = a_HS[:, begin:end] @ b_SI[begin:end]`` with fp32 accumulation, [E, H, I] fp32.

    ``torch._grouped_mm`` where shapes allow, else a per-expert loop; BF16 operands, output
    rounded to BF16 then widened. Empty experts give zeros. ``rows_E``: optional [E] int, the
    rows at the start of each group that hold data, the rest zero padding rows of ``b_SI``
    (:func:`grouped_mm_rows`): the loop leaves those zero terms out of the sums.
    """
    H, S = a_HS.shape
    I = b_SI.shape[1]
    E = offsets_E.shape[0]
    dt = torch.bfloat16
    if fits_grouped_mm(dt, a_HS.device, H, I) and S % ALIGN == 0 and S > 0:
        out = torch._grouped_mm(a_HS.to(dt), b_SI.to(dt), offs=offsets_E)
        # An empty group's output must read 0 whatever the library leaves there (REFERENCE §7).
        ends = offsets_E.to(torch.int64)
        empty = ends == torch.cat([ends.new_zeros(1), ends[:-1]])
        if a_HS.device.type != "cpu" or bool(empty.any()):  # CPU: skip the pass when none is
            out.masked_fill_(empty[:, None, None], 0)
        return out.float()
    out = torch.empty(E, H, I, dtype=dt, device=a_HS.device)  # each product rounded to BF16
    a_HS, b_SI = _operands(a_HS, dt), _operands(b_SI, dt)
    segments = _segments(offsets_E)
    for e, ((s, _), m) in enumerate(zip(segments, _real_rows(segments, rows_E))):
        if not m:
            out[e].zero_()  # an empty expert's gradient is exactly 0 (REFERENCE §7)
        elif a_HS.dtype == dt:  # the product straight into its slice (no temporary)
            torch.mm(a_HS[:, s : s + m], b_SI[s : s + m], out=out[e])
        else:
            out[e] = a_HS[:, s : s + m] @ b_SI[s : s + m]
    return out.float()


def grouped_layout(plan, num_experts: int):
    """The plan's grouped layout as this module's GEMMs use it: groups aligned to
    :data:`ALIGN` rows and a static row count ``S`` (no host read on CUDA; surplus rows are
    padding of the last expert). Share it between a forward and its backward."""
    R = plan.pair_token_R.shape[0]
    return plan.grouped(align=ALIGN, max_tokens_sum=static_tokens_sum(R, num_experts, ALIGN))



def _row_expert_S(layout, plan, num_experts: int) -> torch.Tensor:
    """[S] expert of each grouped row (E-1 for padding rows, which carry zeros)."""
    r2p = layout.row_to_pair_S
    if plan.pair_token_R.shape[0] == 0:
        return torch.full_like(r2p, num_experts - 1)
    return torch.where(
        r2p >= 0, plan.pair_expert_R[r2p.clamp(min=0)], torch.full_like(r2p, num_experts - 1)
    )


def moe_forward_torch(
    hidden_states_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor | None,
    plan,
    *,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    with_output: bool = True,
    activation: Activation | None = None,
    layout=None,
    x_rows_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Gated expert-MLP forward on the grouped layout (REFERENCE §2, AFFINITY_ON_I).

    ``g = clamp_g(x Wg + bg)``, ``u = clamp_u(x Wu + bu)``, ``h = g sigmoid(alpha g) (u + c)``
    (SwiGLU: ``silu(g) u``), ``y[t] += a h Wd + a bd`` per routed pair: grouped GEMMs with
    ``compute_dtype`` operands and fp32 accumulation; bias, clamp and activation in fp32.

    Args:
        hidden_states_TH: [T, H].  w_gate_up_EH2I: [E, H, 2, I].  w_down_EIH: [E, I, H] (may be
            None with ``with_output=False``).  plan: the RoutingPlan.
        b_gate_up_E2I: optional [E, 2, I].  b_down_EH: optional [E, H].
        clamp_limits: optional ClampLimits.
        compute_dtype: GEMM operand and checkpoint dtype (BF16 as in training; fp32 for a
            full-precision forward).
        with_output: also compute y (else only the checkpoint; y is None).
        activation: the :class:`~common.problem.Activation` (alpha, up offset c); None = SwiGLU.
            It changes y only: the checkpoint holds pre-activations.
        layout: optional grouped layout of ``plan`` (:func:`grouped_layout`); built if None.
        x_rows_S: optional [S, H] ``compute_dtype`` X in ``layout``'s row order (padding rows
            0), e.g. to keep it for the fused backward; gathered here if None.
    Returns:
        ``(y_TH [T, H] fp32 or None, act_checkpoint_R2I [R, 2, I] compute_dtype)``: the
        checkpoint holds the clamped g, u of each pair in the plan's pair order (padding 0).
    Raises:
        ValueError: an ``activation`` that is not an Activation.
    """
    act_fn = Activation.resolve(activation)
    E, _, _, I = w_gate_up_EH2I.shape
    R = plan.pair_token_R.shape[0]
    cd = compute_dtype
    cl = clamp_limits or ClampLimits()
    if layout is None:
        layout = grouped_layout(plan, E)
    offs = layout.offsets_E
    row_valid = layout.row_to_pair_S >= 0
    row_expert = _row_expert_S(layout, plan, E)
    x_S = layout.gather_rows(hidden_states_TH.to(cd)) if x_rows_S is None else x_rows_S
    w_gu, interleaved = gate_up_matrix(w_gate_up_EH2I.to(cd))
    rows_E = plan.tokens_per_expert_E  # the data rows of each group (the rest: zero padding)
    gu_S = gate_up_from_matrix(grouped_mm_rows(x_S, w_gu, offs, cd, rows_E)[None], interleaved)[0]
    if b_gate_up_E2I is not None:
        gu_S = gu_S + b_gate_up_E2I.float()[row_expert]
    g = cl.clamp_gate(gu_S[:, 0])
    u = cl.clamp_up(gu_S[:, 1])
    act = torch.zeros(R + 1, 2, I, dtype=cd, device=hidden_states_TH.device)
    dest = torch.where(row_valid, layout.row_to_pair_S, torch.full_like(layout.row_to_pair_S, R))
    act.index_put_((dest,), torch.stack([g, u], 1).to(cd))
    if not with_output:
        return None, act[:R]
    alpha_S = layout.gather_pairs(plan.pair_affinity_R).float()[:, None]
    ah_S = (alpha_S * activation_forward(act_fn, g, u)).to(cd)
    out_S = grouped_mm_rows(ah_S, w_down_EIH.to(cd), offs, cd, rows_E)
    if b_down_EH is not None:
        out_S = out_S + alpha_S * b_down_EH.float()[row_expert]
    return layout.scatter_add_rows(out_S), act[:R]


def checkpoint_pairs(
    checkpoint: torch.Tensor, layout, *, gate_up_interleaved: bool = False
) -> torch.Tensor:
    """The activation checkpoint in the plan's pair order, [R, 2, I], from either form the
    layer's forward keeps (:class:`LayerForward`): ``checkpoint`` itself when it is already
    [R, 2, I]; for the grouped-row form [S, 2I] (row s: its pair's g, u in the gate/up weight
    matrix's column order, interleaved with ``gate_up_interleaved``) each row moved to its
    pair, pairs no row holds (past ``num_pairs``) 0. For comparisons and tools, not the
    training step (it allocates [R, 2, I]).

    Raises:
        ValueError: ``checkpoint`` is neither [R, 2, I] nor [S, 2I] of ``layout``.
    """
    R, S = layout.num_pair_rows, layout.tokens_sum
    if checkpoint.dim() == 3 and checkpoint.shape[:2] == (R, 2):
        return checkpoint
    if checkpoint.dim() != 2 or checkpoint.shape[0] != S or checkpoint.shape[1] % 2:
        raise ValueError(
            f"checkpoint must be [R={R}, 2, I] or [S={S}, 2I], got {list(checkpoint.shape)}"
        )
    I = checkpoint.shape[1] // 2
    rows = gate_up_from_matrix(checkpoint[None], gate_up_interleaved)[0]  # [S, 2, I]
    valid = layout.row_to_pair_S >= 0
    out = checkpoint.new_zeros(R + 1, 2, I)  # row R: where the padding rows go
    out.index_copy_(0, torch.where(valid, layout.row_to_pair_S, R), rows)
    return out[:R]


@dataclass(frozen=True)
class LayerForward:
    """What the layer's forward returns and its backward needs (a backend's ``forward`` hook,
    :class:`common.dispatch.Backend`).

    Attributes:
        y_TH: [T, H] in the input's dtype.
        checkpoint: the BF16 activation checkpoint (the clamped gate/up pre-activations g, u of
            every pair), in one of two forms that its rank tells apart: [R, 2, I] in the plan's
            pair order, or [S, 2I] in the layout's grouped row order (the gate/up GEMM's output
            rows, gate/up columns in the weight matrix's order: :func:`gate_up_matrix`), which
            a backend with ``Backend.checkpoint_rows`` keeps where there is no gate/up bias and
            no clamp. :meth:`checkpoint_pairs` gives the pair order either way.
        x_rows_S: [S, H] BF16 X in the layout's row order (padding rows 0), or None: the
            backend keeps none (``Backend.keeps_x_rows``: its backward's gate/up weight
            gradient reads X through ``layout.row_to_token_S`` itself).
        plan: the :class:`~common.routing.RoutingPlan`.
        layout: its grouped layout (:func:`grouped_layout`).
    """

    y_TH: torch.Tensor
    checkpoint: torch.Tensor
    x_rows_S: torch.Tensor | None
    plan: object
    layout: object

    def checkpoint_pairs(self, gate_up_interleaved: bool = False) -> torch.Tensor:
        """The checkpoint as [R, 2, I] in the plan's pair order (:func:`checkpoint_pairs`;
        ``gate_up_interleaved``: the weight's columns interleave gate and up)."""
        return checkpoint_pairs(self.checkpoint, self.layout,
                                gate_up_interleaved=gate_up_interleaved)


def moe_layer_forward_torch(
    hidden_states_TH: torch.Tensor,
    affinity_TK: torch.Tensor,
    expert_index_TK: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    *,
    clamp_limits: ClampLimits | None = None,
    activation: Activation | None = None,
    check_routing: bool = False,
    routing=None,
) -> LayerForward:
    """The portable layer forward: the routing plan and grouped layout in torch ops (no host
    read on CUDA), then :func:`moe_forward_torch` with BF16 operands. ``check_routing`` queues
    the device-side routing check (:func:`common.routing.assert_routing_async`). ``routing``:
    an already built ``(plan, layout)`` instead of ``affinity_TK`` / ``expert_index_TK`` (both
    may be None then); an identity layout (:func:`common.routing.presorted_routing`) is
    replaced by the plan's aligned one (:func:`grouped_layout`), whose GEMMs this path runs."""
    from common.routing import assert_routing_async, plan_routing, routing_error_code

    E = w_gate_up_EH2I.shape[0]
    if routing is not None:
        plan, layout = routing
        if layout.identity:
            layout = grouped_layout(plan, E)
    else:
        if check_routing:
            assert_routing_async(routing_error_code(expert_index_TK, affinity_TK, E))
        plan = plan_routing(expert_index_TK, affinity_TK.detach(), E, validate=False)
        layout = grouped_layout(plan, E)
    x_rows_S = layout.gather_rows(hidden_states_TH.to(torch.bfloat16))
    y_TH, act_R2I = moe_forward_torch(
        hidden_states_TH, w_gate_up_EH2I, w_down_EIH, plan,
        b_gate_up_E2I=b_gate_up_E2I, b_down_EH=b_down_EH, clamp_limits=clamp_limits,
        compute_dtype=torch.bfloat16, activation=activation, layout=layout, x_rows_S=x_rows_S,
    )
    return LayerForward(y_TH.to(hidden_states_TH.dtype), act_R2I, x_rows_S, plan, layout)


def moe_forward_checkpoint_torch(
    hidden_states_TH: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    plan,
    *,
    b_gate_up_E2I: torch.Tensor | None = None,
    clamp_limits: ClampLimits | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    activation: Activation | None = None,
) -> torch.Tensor:
    """The forward's activation checkpoint as a BF16 training forward stores it:
    :func:`moe_forward_torch` without the down projection. Returns act_checkpoint_R2I
    [R, 2, I] ``compute_dtype`` in the plan's pair order (padding 0). ``activation`` (None =
    SwiGLU) is checked but does not change the checkpoint: it holds the pre-activations."""
    return moe_forward_torch(
        hidden_states_TH,
        w_gate_up_EH2I,
        None,
        plan,
        b_gate_up_E2I=b_gate_up_E2I,
        clamp_limits=clamp_limits,
        compute_dtype=compute_dtype,
        with_output=False,
        activation=activation,
    )[1]


def moe_backward_torch(
    problem: MoEBackwardProblem,
    *,
    grouped_wgrad: GroupedWgrad | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> MoEGrads:
    """MoE expert-MLP backward in portable torch (BF16 operands, fp32 accumulation).

    Args:
        problem: the :class:`~common.problem.MoEBackwardProblem` (any device); its
            ``activation`` (SwiGLU or gpt-oss) selects the activation backward.
        grouped_wgrad: ``fn(a_HS, b_SI, offsets_E) -> [E, H, I] fp32`` for the two weight
            gradients; default :func:`grouped_wgrad_default`.
        compute_dtype: storage dtype of GEMM operands (BF16).
    Returns:
        :class:`~common.problem.MoEGrads` in fp32 on the problem's device.
    Raises:
        ValueError: from :meth:`MoEBackwardProblem.validate` (shapes, dtypes, devices, plan).
    """
    p = problem
    p.validate()
    plan = p.plan
    x_TH, dy_TH = p.hidden_states_TH, p.output_grad_TH
    T, H = x_TH.shape
    E, _, _, I = p.w_gate_up_EH2I.shape
    rows_E = plan.tokens_per_expert_E  # the data rows of each group (the rest: zero padding)
    wgrad = grouped_wgrad or functools.partial(grouped_wgrad_default, rows_E=rows_E)
    cd = compute_dtype
    dev = x_TH.device
    cl = p.clamp_limits or ClampLimits()
    act_fn = p.activation

    layout = grouped_layout(plan, E)
    offs = layout.offsets_E
    row_valid = layout.row_to_pair_S >= 0
    row_expert = _row_expert_S(layout, plan, E)

    x_S = layout.gather_rows(x_TH.to(cd))
    dy_S = layout.gather_rows(dy_TH.to(cd))
    act_S = layout.gather_pairs(p.act_checkpoint_R2I).float()
    alpha_S = layout.gather_pairs(plan.pair_affinity_R).float()[:, None]
    g, u = act_S[:, 0], act_S[:, 1]

    # 2. dh_raw = dY Wd^T
    dh_raw = grouped_mm_rows(dy_S, p.w_down_EIH.to(cd).transpose(1, 2), offs, rows_E=rows_E)
    # 3. activation backward (fp32; common.activation), padding rows 0: on the CPU by filling
    # those rows alone (a select over every element cost as much as the activation there)
    pad_S = torch.nonzero(~row_valid).squeeze(1) if host_reads_free(row_valid) else None
    dg, du, h = activation_backward(
        act_fn, g, u, alpha_S * dh_raw, cl, valid=row_valid[:, None] if pad_S is None else None
    )
    if pad_S is not None and pad_S.numel():
        dg.index_fill_(0, pad_S, 0.0)
        du.index_fill_(0, pad_S, 0.0)
    dA_S = (dh_raw * h).sum(-1)
    if p.b_down_EH is not None:
        dA_S = dA_S + (dy_S.float() * p.b_down_EH.float()[row_expert]).sum(-1)
    # [S, 2I] in the weight matrix's column order (gate_up_matrix)
    w_gu, interleaved = gate_up_matrix(p.w_gate_up_EH2I.to(cd))
    dgu_S = (torch.stack([dg, du], 2) if interleaved else torch.stack([dg, du], 1)).to(cd)
    dgu_S = dgu_S.reshape(-1, 2 * I)

    # 4. dX = [dg, du] [Wg, Wu]^T, scattered back to tokens
    dX_S = grouped_mm_rows(dgu_S, w_gu.transpose(1, 2), offs, rows_E=rows_E)
    dX = layout.scatter_add_rows(dX_S)

    # 5. weight gradients
    dWgu = gate_up_from_matrix(wgrad(x_S.t(), dgu_S, offs), interleaved)
    ah_S = (alpha_S * h).to(cd)
    dWd = wgrad(ah_S.t(), dy_S, offs)

    # dA dense [T, E]
    flat = torch.zeros(T * E + 1, dtype=torch.float32, device=dev)
    cell = torch.where(
        row_valid, layout.row_to_token_S * E + row_expert, torch.full_like(row_expert, T * E)
    )
    flat.index_put_((cell,), torch.where(row_valid, dA_S, 0.0))
    grads = MoEGrads(
        hidden_states_grad_TH=dX,
        affinity_grad_TE=flat[: T * E].reshape(T, E),
        w_gate_up_grad_EH2I=dWgu,
        w_down_grad_EIH=dWd,
    )
    if p.has_bias:
        dBd = torch.zeros(E, H, dtype=torch.float32, device=dev)
        dBd.index_add_(0, row_expert, alpha_S * dy_S.float())
        dBgu = torch.zeros(E, 2 * I, dtype=torch.float32, device=dev)
        dBgu.index_add_(0, row_expert, torch.cat([dg, du], 1))
        grads.b_gate_up_grad_E2I = dBgu.reshape(E, 2, I)
        grads.b_down_grad_EH = dBd
    return grads
