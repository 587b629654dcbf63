"""The MoE expert MLP as a training layer: an ``nn.Module`` whose forward and backward run
through :mod:`common.dispatch`, and a torchtitan adapter.

Dimensions (legend in :mod:`common.shapes`): T tokens, H hidden, I expert intermediate,
E experts, K top_k, R = T*K routed slots.

Math (REFERENCE §2), per routed (token t, expert e) with affinity a::

    g = clamp_gate(x Wg[e] + bg[e])      u = clamp_up(x Wu[e] + bu[e])
    h = g * sigmoid(alpha g) * (u + c)   # the Activation: SwiGLU alpha=1, c=0; gpt-oss 1.702, 1
    y[t] += a * (h Wd[e] + bd[e])

Public names:

* :class:`MoEExpertsOptions` -- the frozen non-tensor settings of one call.
* :func:`moe_experts` (functional) / :class:`MoEExperts` (``nn.Module``) run through
  ``torch.ops.moe_bwd.experts_forward`` (:mod:`common.layer_ops`: a ``torch.library`` custom
  op with a fake implementation and an autograd formula, so ``torch.compile(fullgraph=True)``
  traces the layer without graph breaks).
  The forward is the backend's (:mod:`common.dispatch`): on ``cuda-sm90`` / ``cuda-sm100`` the
  fused GPU forward (:mod:`cuda_kernels.moe`: routing, X gather, gate/up GEMM, one
  activation pass, down GEMM, deterministic per-token combine; BF16 in HBM), elsewhere
  :func:`common.torch_backward.moe_forward_torch` (grouped GEMMs, BF16 operands, fp32
  accumulation). It saves only x, the weights, the BF16 checkpoint ``act [R, 2, I]`` (on CUDA
  without a gate/up bias and a clamp: the gate/up GEMM's own output rows ``[S, 2I]``, no
  second copy), the routing plan and (CUDA) the BF16 X rows; the backward runs the backend's
  ``run``.
  First-order only: any backward with ``create_graph=True`` (double backward, Hessians)
  raises RuntimeError.
* :class:`MoEExpertsFunction` -- the same as a ``torch.autograd.Function``: what the layer uses
  for Megatron ``main_grad`` accumulation (below), which an opaque op cannot carry.
* :func:`gate_up_from_torchtitan`, :func:`down_from_torchtitan`,
  :func:`run_experts_grouped_mm` -- torchtitan's ``GroupedExperts`` weights and its grouped-mm
  seam on top of the layer.

Megatron ``main_grad``: with ``accumulate_main_grad=True`` a ``main_grad`` tensor must exist on
both weights (Megatron's DDP allocates one per parameter; RuntimeError in backward otherwise), and
the weight gradients are ADDED into those
buffers during the backward -- inside the wgrad kernel on the ``cuda-sm90`` / ``cuda-sm100``
backends when the buffers are fp32 and contiguous, by ``main_grad.add_(grad)`` otherwise -- and
the Function returns ``None`` for the two weights, so their ``.grad`` stays None (the optimizer
reads ``main_grad``). If a weight has an attribute ``grad_added_to_main_grad`` it is set True, as
Megatron's fused-accumulation layers do. Biases always get ordinary gradients. Note: a None
gradient does not run the parameter's AccumulateGrad node, so hooks registered on it (Megatron's
``overlap_grad_reduce``) do not fire for these weights.

``common`` imports no backend package: the backward reaches the CUDA / NKI backends only through
the dispatcher's registry.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from common import layer_ops
from common.dispatch import BACKEND_NAMES, layer_option, registered_backends, resolve_backend
from common.layer_ops import shape_text as _shape
from common.problem import SWIGLU, Activation, ClampLimits
from common.routing import _INT_DTYPES  # the one list of accepted id dtypes

__all__ = [
    "MoEExperts",
    "MoEExpertsFunction",
    "MoEExpertsOptions",
    "down_from_torchtitan",
    "first_order_only",
    "gate_up_from_torchtitan",
    "moe_experts",
    "run_experts_grouped_mm",
]

VALIDATE_ROUTING = ("device", "host", "off")
"""``validate_routing`` modes (:mod:`common.layer_ops`): a device-side check (default), a host
check raising ValueError, none. ``True`` means ``"host"`` and ``False`` ``"off"``."""

# ------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class MoEExpertsOptions:
    """Non-tensor settings of one :class:`MoEExpertsFunction` call (hashable, frozen).

    Attributes:
        clamp_limits: optional :class:`~common.problem.ClampLimits` of g (gate) and u (up).
        activation: the :class:`~common.problem.Activation` (default SwiGLU).
        backend: the backward's backend, a :mod:`common.dispatch` name or ``"auto"``.
        validate_routing: ``"device"`` (default: check expert ids lie in [-1, E) and routed
            affinities are finite and >= 0 without a host read; on a GPU a bad routing surfaces
            at the next synchronisation as a device-side assert, on the CPU as ValueError at
            once), ``"host"`` (read them on the host first: ValueError naming the rule, one
            synchronisation per call) or ``"off"`` (no check: every id outside [0, E), e.g.
            100 or -7 with E = 8, is silently a dropped slot -- it adds nothing to y and gets
            a zero affinity gradient -- on every backend, and a NaN, inf or negative routed
            affinity is used as it is; only for routers known to be correct: ``"device"`` is
            the safe default); ``True`` = ``"host"``, ``False`` = ``"off"``
            (:mod:`common.layer_ops`).
        accumulate_main_grad: add the weight gradients into the weights' ``main_grad`` buffers
            and return None for the weights (module docstring, "Megatron main_grad").
        backend_options: ``(name, value)`` pairs passed to the backend's run in backward (e.g.
            ``(("block_size", 256), ("run_with_lnc2", False))`` for ``nki``/``nki-sim``); an
            unknown name is the backend's ValueError, in backward.
        grouped_mm: a layer option the ``cuda-sm90`` / ``cuda-sm100`` backends declare
            (``cuda_kernels.moe.grouped_mm_choice.GROUPED_MM``: ``"auto"`` (default),
            ``"cublas"``, ``"ours"``, ``"ours-gemm"``): the fused grouped-GEMM kernel, its
            gathering GEMM alone or the cuBLAS path for the gate/up GEMM of the forward and the
            down dgrad of the backward (the other backends have one implementation and ignore
            it). Checked here by the declaring backend's check (where no backend that imports
            here declares it, the value is not checked: no backend reads it).

    Raises:
        ValueError: a field of the wrong type, an unknown backend name or a value a backend's
            option does not allow (naming the option and its values).
    """

    clamp_limits: ClampLimits | None = None
    activation: Activation = SWIGLU
    backend: str = "auto"
    validate_routing: str = "device"
    accumulate_main_grad: bool = False
    backend_options: tuple = ()
    grouped_mm: str = "auto"

    def __post_init__(self) -> None:
        if self.clamp_limits is not None and not isinstance(self.clamp_limits, ClampLimits):
            raise ValueError(
                "clamp_limits must be a common.problem.ClampLimits or None, got "
                f"{type(self.clamp_limits).__name__}"
            )
        if not isinstance(self.activation, Activation):
            raise ValueError(
                "activation must be a common.problem.Activation, got "
                f"{type(self.activation).__name__}"
            )
        if not isinstance(self.backend, str) or not _known_backend(self.backend):
            raise ValueError(
                f"backend {self.backend!r} is unknown: backend must be 'auto' or one of "
                f"{', '.join(BACKEND_NAMES)}"
            )
        mode = self.validate_routing
        if isinstance(mode, bool):
            object.__setattr__(self, "validate_routing", "host" if mode else "off")
        elif mode not in VALIDATE_ROUTING:
            raise ValueError(
                f"validate_routing must be one of {VALIDATE_ROUTING} (or a bool), got {mode!r}"
            )
        if not isinstance(self.accumulate_main_grad, bool):
            raise ValueError(
                f"accumulate_main_grad must be a bool, got {self.accumulate_main_grad!r}"
            )
        pairs = self.backend_options
        if not isinstance(pairs, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs
        ):
            raise ValueError(
                f"backend_options must be a tuple of (name, value) pairs, got {pairs!r}"
            )
        for name, _ in pairs:
            if layer_option(name) is not None:
                raise ValueError(
                    f"backend_options must not set {name}: use MoEExpertsOptions({name}=...), "
                    "which reaches the forward too"
                )
        option = layer_option("grouped_mm")  # declared by the backends that read it
        if option is not None:
            option.check(self.grouped_mm)
        try:  # the custom ops' key (common.layer_ops); unhashable options take the Function
            key = layer_ops.options_key(self)
        except TypeError:
            key = None
        object.__setattr__(self, "_op_key", key)

    def __reduce__(self):
        # Rebuilt from the fields (never the process-local op key) by pickle and deepcopy.
        return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    @property
    def uses_custom_op(self) -> bool:
        """True when calls go through ``torch.ops.moe_bwd.experts_forward`` (compilable): all
        options but ``accumulate_main_grad`` and unhashable ``backend_options``."""
        return self._op_key is not None and not self.accumulate_main_grad


# --------------------------------------------------------------------------------- validation
def _known_backend(name: str) -> bool:
    """``"auto"``, a built-in backend name, or one registered with
    :func:`common.dispatch.register_backend` (the registry is consulted only for other names)."""
    if name == "auto" or name in BACKEND_NAMES:
        return True
    return bool(name) and name in registered_backends()


def _check_inputs(
    hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
    expert_index_TK, options,
) -> None:
    """Shapes, dtypes and devices of one call; ValueError naming the first bad argument."""
    if not isinstance(options, MoEExpertsOptions):
        raise ValueError(f"options must be a MoEExpertsOptions, got {type(options).__name__}")
    layer_ops.check_inputs(
        hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
        expert_index_TK,
    )


def _main_grad_buffers(
    w_gate_up_EH2I: torch.Tensor, w_down_EIH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weights' ``main_grad`` tensors (``accumulate_main_grad=True``).

    Raises:
        RuntimeError: a weight has no ``main_grad`` (allocate fp32 buffers of the weights'
            shapes on both, as Megatron's DDP does, or turn accumulate_main_grad off).
        ValueError: a ``main_grad`` that is not a floating tensor of its weight's shape and device.
    """
    bufs = []
    for name, w in (("w_gate_up_EH2I", w_gate_up_EH2I), ("w_down_EIH", w_down_EIH)):
        mg = getattr(w, "main_grad", None)
        if mg is None:
            raise RuntimeError(
                f"accumulate_main_grad=True but {name} has no main_grad: allocate fp32 "
                "`param.main_grad` buffers of the weights' shapes on both weights (Megatron's DDP "
                "does), or use accumulate_main_grad=False"
            )
        if not isinstance(mg, torch.Tensor) or not mg.is_floating_point():
            raise ValueError(f"{name}.main_grad must be a floating tensor, got {_shape(mg)}")
        if mg.shape != w.shape or mg.device != w.device:
            raise ValueError(
                f"{name}.main_grad must match its weight ({list(w.shape)} on {w.device}), got "
                f"{list(mg.shape)} on {mg.device}"
            )
        bufs.append(mg)
    return bufs[0], bufs[1]


# ----------------------------------------------------------------------------- autograd Function
def first_order_only(backward):
    """Decorate an autograd Function's ``backward`` (above ``once_differentiable``): a backward
    run with grad mode on -- ``create_graph=True``, i.e. a double backward, a Hessian, a gradient
    penalty -- raises RuntimeError. ``once_differentiable`` alone raises only when an incoming
    gradient requires grad; otherwise the second-order result would silently be missing/zero."""

    @functools.wraps(backward)
    def checked(ctx, *grads):
        layer_ops.refuse_grad_mode(type(ctx).__name__.removesuffix("Backward"))
        return backward(ctx, *grads)

    return checked


class MoEExpertsFunction(torch.autograd.Function):
    """``y = MoE expert MLP(x)``; backward through :mod:`common.dispatch` (first order only).

    ``apply(hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
    expert_index_TK, options)``

    Args:
        hidden_states_TH: [T, H] float (BF16 in training), the tokens.
        affinity_TK: [T, K] float, router weight of each slot (may require grad; values of
            dropped slots are ignored).
        w_gate_up_EH2I: [E, H, 2, I] float, gate (index 0) and up (index 1) projections.
        w_down_EIH: [E, I, H] float, down projection.
        b_gate_up_E2I: optional [E, 2, I] float.  b_down_EH: optional [E, H] float.
        expert_index_TK: [T, K] int, expert of each slot, -1 = dropped; duplicates in one
            token's top-k are allowed (merged, each slot gets the merged affinity gradient).
        options: :class:`MoEExpertsOptions`.
    Returns:
        y [T, H] in ``hidden_states_TH.dtype`` (computed with BF16 GEMM operands, fp32
        accumulation; tokens whose slots are all dropped get 0).
    Gradients (backward):
        dX [T, H] in x's dtype; d_affinity [T, K] per slot in affinity's dtype (0 on dropped
        slots; None if affinity does not require grad); weight and bias grads in their dtypes;
        None for the weights when they were accumulated into ``main_grad`` (module docstring).
    Raises:
        ValueError: a bad argument (named), in forward; a problem the backend does not take
            (its ``check_shape``: e.g. H or I not multiples of 128, or gpt-oss's activation, on
            the NKI backends), in forward.
        RuntimeError: an explicitly requested backend that cannot run here (in forward); a
            double backward (``once_differentiable``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_states_TH: torch.Tensor,
        affinity_TK: torch.Tensor,
        w_gate_up_EH2I: torch.Tensor,
        w_down_EIH: torch.Tensor,
        b_gate_up_E2I: torch.Tensor | None,
        b_down_EH: torch.Tensor | None,
        expert_index_TK: torch.Tensor,
        options: MoEExpertsOptions,
    ) -> torch.Tensor:
        _check_inputs(
            hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
            expert_index_TK, options,
        )
        out, backend = layer_ops.layer_forward(
            hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
            expert_index_TK, options,
        )
        ctx.save_for_backward(
            hidden_states_TH, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH, out.checkpoint,
            out.x_rows_S,
        )
        layout, plan = out.layout, out.plan
        ctx.layout = layout
        ctx.plan = plan
        ctx.options = options
        ctx.backend = backend
        ctx.affinity_dtype = affinity_TK.dtype
        # The weight objects themselves, to read their `main_grad` at backward time (leaves:
        # no reference cycle through this node).
        ctx.main_grad_owners = (
            (w_gate_up_EH2I, w_down_EIH) if options.accumulate_main_grad else None
        )
        return out.y_TH

    @staticmethod
    @first_order_only
    @once_differentiable
    def backward(ctx: Any, grad_y_TH: torch.Tensor):
        x, wgu, wd, bgu, bd, act, x_rows_S = ctx.saved_tensors
        opts: MoEExpertsOptions = ctx.options
        need = ctx.needs_input_grad
        main = None
        if ctx.main_grad_owners is not None and need[2] and need[3]:
            main = _main_grad_buffers(*ctx.main_grad_owners)
        with layer_ops.layer_threads(x, wgu, wd, ctx.plan):  # the casts below too
            grads, accumulated = layer_ops.layer_backward(
                grad_y_TH, x, wgu, wd, bgu, bd, act, x_rows_S, ctx.plan, ctx.layout, opts,
                ctx.backend, main_grad=main,
            )
            if main is not None and not accumulated:
                main[0].add_(grads.w_gate_up_grad_EH2I.to(main[0].dtype))
                main[1].add_(grads.w_down_grad_EIH.to(main[1].dtype))
            if main is not None:
                for w in ctx.main_grad_owners:
                    if hasattr(w, "grad_added_to_main_grad"):
                        w.grad_added_to_main_grad = True

            dx = grads.hidden_states_grad_TH.to(x.dtype) if need[0] else None
            d_aff = (
                ctx.plan.slot_affinity_grad(grads.affinity_grad_TE).to(ctx.affinity_dtype)
                if need[1]
                else None
            )
            if main is None:
                dwgu = grads.w_gate_up_grad_EH2I.to(wgu.dtype) if need[2] else None
                dwd = grads.w_down_grad_EIH.to(wd.dtype) if need[3] else None
            else:
                dwgu = dwd = None
            dbgu = grads.b_gate_up_grad_E2I.to(bgu.dtype) if need[4] and bgu is not None else None
            dbd = grads.b_down_grad_EH.to(bd.dtype) if need[5] and bd is not None else None
            return dx, d_aff, dwgu, dwd, dbgu, dbd, None, None


def moe_experts(
    hidden_states_TH: torch.Tensor,
    expert_index_TK: torch.Tensor,
    affinity_TK: torch.Tensor,
    w_gate_up_EH2I: torch.Tensor,
    w_down_EIH: torch.Tensor,
    b_gate_up_E2I: torch.Tensor | None = None,
    b_down_EH: torch.Tensor | None = None,
    *,
    options: MoEExpertsOptions | None = None,
) -> torch.Tensor:
    """Functional MoE expert MLP: :class:`MoEExpertsFunction` with keyword-friendly arguments.

    Args: as :class:`MoEExpertsFunction` (``options`` default: ``MoEExpertsOptions()``).
    Returns:
        y [T, H] in ``hidden_states_TH.dtype``.
    Raises:
        ValueError: a bad argument, named.  RuntimeError: an unusable explicit backend.
    """
    opts = _DEFAULT_OPTIONS if options is None else options
    return _apply(
        hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
        expert_index_TK, opts,
    )


_DEFAULT_OPTIONS = MoEExpertsOptions()


def _apply(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options):
    """The layer through the compilable custom op (:mod:`common.layer_ops`) when the options
    allow it, else through :class:`MoEExpertsFunction`; the inputs are checked first either way."""
    if isinstance(options, MoEExpertsOptions) and options.uses_custom_op:
        # Under torch.compile the op's own implementation runs these checks when the compiled
        # graph runs: an exception raised while Dynamo traces becomes its `Unsupported` error
        # with fullgraph=True, so the caller would not see this ValueError.
        if not torch.compiler.is_compiling():
            _check_inputs(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options)
        return layer_ops.moe_experts_op(
            x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options
        )
    return MoEExpertsFunction.apply(
        x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options
    )


# ------------------------------------------------------------------------------------- module
def _check_runnable(device, backend: str) -> None:
    """RuntimeError naming ``device`` when torch cannot allocate there (e.g. ``"cuda"`` on a
    CPU-only torch), or naming ``backend`` when an explicitly requested backend cannot run here
    (:func:`common.dispatch.resolve_backend`'s reason: no SM90 GPU, no Neuron runtime, ...)."""
    try:
        device = torch.empty(0, device=device).device
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise RuntimeError(f"device {str(device)!r} cannot be used here: {exc}") from None
    if device.type != "meta":  # (a meta module is placed with .to_empty(), checked then)
        resolve_backend(backend, device)


class MoEExperts(nn.Module):
    """The routed experts of one MoE layer: ``y = sum_k a[t,k] * MLP_{e[t,k]}(x[t])``.

    Args:
        num_experts: E.  hidden: H.  intermediate: I (per expert).
        bias: give the experts gate/up ``[E, 2, I]`` and down ``[E, H]`` biases.
        clamp_limits: optional :class:`~common.problem.ClampLimits`.
        activation: :class:`~common.problem.Activation` (default SwiGLU).
        backend: the backward's backend (:mod:`common.dispatch` name or ``"auto"``).
        dtype: parameter dtype (default BF16).  device: parameter device.
        accumulate_main_grad: Megatron ``main_grad`` accumulation (module docstring).
        validate_routing: ``"device"`` (default, no host read: the safe choice), ``"host"``
            or ``"off"`` (no check: ids outside [0, E) silently act as dropped slots;
            :class:`MoEExpertsOptions`).
        grouped_mm: default ``"auto"`` (:attr:`MoEExpertsOptions.grouped_mm`).

    Parameters:
        w_gate_up: [E, H, 2, I] (gate at index 0, up at 1).  w_down: [E, I, H].
        b_gate_up: [E, 2, I] and b_down: [E, H] when ``bias``.

    Raises:
        ValueError: a non-positive size or a bad option, named.
        RuntimeError: ``device`` cannot be used here (e.g. ``"cuda"`` on a CPU-only torch), or
            an explicitly named ``backend`` cannot run here (e.g. ``"cuda-sm90"`` without an
            SM90 GPU, ``"nki"`` without a Neuron device), naming it and the reason; again when
            :meth:`to` (or ``.cuda()``, ``.to_empty()``) moves the module to such a device, and
            at the first forward on inputs of another device.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        bias: bool = False,
        clamp_limits: ClampLimits | None = None,
        activation: Activation = SWIGLU,
        backend: str = "auto",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        accumulate_main_grad: bool = False,
        validate_routing: str | bool = "device",
        grouped_mm: str = "auto",
    ) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden", hidden),
                        ("intermediate", intermediate)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be a bool, got {bias!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.options = MoEExpertsOptions(
            clamp_limits=clamp_limits,
            activation=activation,
            backend=backend,
            validate_routing=validate_routing,
            accumulate_main_grad=accumulate_main_grad,
            grouped_mm=grouped_mm,
        )
        _check_runnable(device, backend)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        E, H, I = num_experts, hidden, intermediate
        kw = {"dtype": dtype, "device": device}
        self.w_gate_up = nn.Parameter(torch.empty(E, H, 2, I, **kw))
        self.w_down = nn.Parameter(torch.empty(E, I, H, **kw))
        if bias:
            self.b_gate_up = nn.Parameter(torch.empty(E, 2, I, **kw))
            self.b_down = nn.Parameter(torch.empty(E, H, **kw))
        else:
            self.register_parameter("b_gate_up", None)
            self.register_parameter("b_down", None)
        self.reset_parameters()

    @property
    def bias(self) -> bool:
        return self.b_gate_up is not None

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .to_empty() / ...: the new device is checked as the constructor's.
        try:
            out = super()._apply(fn, recurse)
        except AssertionError as exc:  # torch's "Torch not compiled with CUDA enabled"
            raise RuntimeError(f"MoEExperts cannot move to that device: {exc}") from None
        _check_runnable(self.w_gate_up.device, self.options.backend)
        return out

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal weights, std ``H**-0.5`` (gate/up, contracted over H) and ``I**-0.5`` (down,
        contracted over I), drawn in that order from ``generator`` (default: torch's global RNG,
        so ``torch.manual_seed`` makes it reproducible); zero biases."""
        self.w_gate_up.normal_(0.0, self.hidden**-0.5, generator=generator)
        self.w_down.normal_(0.0, self.intermediate**-0.5, generator=generator)
        if self.b_gate_up is not None:
            self.b_gate_up.zero_()
            self.b_down.zero_()

    def forward(
        self,
        hidden_states_TH: torch.Tensor,
        expert_index_TK: torch.Tensor,
        affinity_TK: torch.Tensor,
    ) -> torch.Tensor:
        """Args: hidden_states_TH [T, H] float; expert_index_TK [T, K] int (-1 = dropped);
        affinity_TK [T, K] float (router weights, may require grad).
        Returns: y [T, H] in ``hidden_states_TH.dtype``.
        Raises: ValueError naming a bad argument (shape, dtype, device, expert id range)."""
        return _apply(
            hidden_states_TH, affinity_TK, self.w_gate_up, self.w_down, self.b_gate_up,
            self.b_down, expert_index_TK, self.options,
        )

    def extra_repr(self) -> str:
        o = self.options
        parts = [
            f"num_experts={self.num_experts}",
            f"hidden={self.hidden}",
            f"intermediate={self.intermediate}",
            f"bias={self.bias}",
            f"activation={o.activation.name}(alpha={o.activation.alpha}, "
            f"up_offset={o.activation.up_offset})",
        ]
        c = o.clamp_limits
        if c is not None and c.is_active:  # e.g. clamp_limits=(gate<=7.0, -7.0<=up<=7.0)
            sides = (("gate", c.non_linear_clamp_lower_limit, c.non_linear_clamp_upper_limit),
                     ("up", c.linear_clamp_lower_limit, c.linear_clamp_upper_limit))
            spans = [("" if lo is None else f"{lo}<=") + v + ("" if hi is None else f"<={hi}")
                     for v, lo, hi in sides if (lo, hi) != (None, None)]
            parts.append(f"clamp_limits=({', '.join(spans)})")
        parts.append(f"backend={o.backend!r}")
        if o.grouped_mm != "auto":
            parts.append(f"grouped_mm={o.grouped_mm!r}")
        if o.accumulate_main_grad:
            parts.append("accumulate_main_grad=True")
        return ", ".join(parts)

    @classmethod
    def from_model(cls, model_shape, **kwargs: Any) -> MoEExperts:
        """The routed experts of a published model (:class:`common.models.MoEModelShape`).

        E, H, I, bias, activation and clamp limits come from the shape: ``swiglu_clamped``
        (gpt-oss) -> ``Activation("gpt_oss", alpha=swiglu_alpha, up_offset=1.0)`` and
        ``ClampLimits(**model_shape.clamp_limits)``; ``swiglu`` -> SwiGLU, no clamp. ``kwargs``
        go to ``__init__`` and override those (e.g. ``dtype``, ``device="meta"``, ``backend``).
        Full-size models are large: ``model_shape.shrink(n)`` gives a test-sized copy.

        Raises:
            ValueError: ``model_shape`` is not a MoEModelShape, or the model applies the
                affinity to the expert input (Llama 4: ``affinity_on="input"``), which this
                layer does not compute.
        """
        from common.models import MoEModelShape

        if not isinstance(model_shape, MoEModelShape):
            raise ValueError(
                f"model_shape must be a common.models.MoEModelShape, got "
                f"{type(model_shape).__name__}"
            )
        if model_shape.affinity_on != "output":
            raise ValueError(
                f"model_shape {model_shape.name!r} has affinity_on={model_shape.affinity_on!r}: "
                "this layer scales the expert output by the affinity, not the input"
            )
        activation, clamp = model_shape.expert_activation()
        init = {"bias": model_shape.has_bias, "activation": activation, "clamp_limits": clamp}
        init.update(kwargs)
        return cls(model_shape.experts, model_shape.hidden, model_shape.intermediate, **init)


# ---------------------------------------------------------------------------------- torchtitan
def _non_overlapping(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """A sufficient test that no two indices of (size, stride) share a storage element: sorted
    by stride, each dimension's stride exceeds the span of all smaller ones."""
    span = 0
    for st, sz in sorted((st, sz) for st, sz in zip(stride, size) if sz > 1):
        if st <= span:
            return False
        span += st * (sz - 1)
    return True


def _pair_geometry(w1_EIH: torch.Tensor, w3_EIH: torch.Tensor):
    """``(size, stride, offset)`` of an [E, H, 2, I] view over the storage w1 and w3 share
    (gate = w1, up = w3), or None when no such view exists (and while torch.compile traces:
    storage identity is not traceable, so the compiled seam takes the copy)."""
    if w1_EIH.stride() != w3_EIH.stride() or torch.compiler.is_compiling():
        return None
    if w1_EIH.untyped_storage().data_ptr() != w3_EIH.untyped_storage().data_ptr():
        return None
    d = w3_EIH.storage_offset() - w1_EIH.storage_offset()
    if d <= 0:
        return None
    E, I, H = w1_EIH.shape
    s0, s1, s2 = w1_EIH.stride()
    size, stride = (E, H, 2, I), (s0, s2, d, s1)
    if not _non_overlapping(size, stride):
        return None
    return size, stride, w1_EIH.storage_offset()


def _check_pair(w1_EIH: Any, w3_EIH: Any) -> None:
    for name, t in (("w1", w1_EIH), ("w3", w3_EIH)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating 3-D [E, I, H] tensor, got {_shape(t)}")
    if w1_EIH.shape != w3_EIH.shape:
        raise ValueError(
            f"w3 must have w1's shape {list(w1_EIH.shape)} ([E, I, H]), got {list(w3_EIH.shape)}"
        )
    if w1_EIH.dtype != w3_EIH.dtype or w1_EIH.device != w3_EIH.device:
        raise ValueError(
            f"w3 ({w3_EIH.dtype} on {w3_EIH.device}) must match w1's dtype and device "
            f"({w1_EIH.dtype} on {w1_EIH.device})"
        )


def _gate_up_view(w1_EIH: torch.Tensor, w3_EIH: torch.Tensor) -> torch.Tensor | None:
    """The [E, H, 2, I] VIEW of :func:`gate_up_from_torchtitan` where one exists (shared
    storage, gradients reaching w1 and w3 when tracked), else None. Arguments already checked."""
    geo = _pair_geometry(w1_EIH, w3_EIH)
    if geo is None:
        return None
    tracked = torch.is_grad_enabled() and (w1_EIH.requires_grad or w3_EIH.requires_grad)
    if not tracked:
        return w1_EIH.as_strided(*geo)
    base = w1_EIH._base
    if (
        base is not None
        and base is w3_EIH._base
        and base.requires_grad
        and w1_EIH.requires_grad
        and w3_EIH.requires_grad
        and w1_EIH.grad_fn is not None
        and w3_EIH.grad_fn is not None
    ):
        return base.as_strided(*geo)
    return None


def gate_up_from_torchtitan(w1_EIH: torch.Tensor, w3_EIH: torch.Tensor) -> torch.Tensor:
    """torchtitan's gate ``w1`` and up ``w3`` ([E, I, H] each) as ``w_gate_up_EH2I`` [E, H, 2, I].

    ``w_gate_up[e, h, 0, i] = w1[e, i, h]`` and ``w_gate_up[e, h, 1, i] = w3[e, i, h]``.

    A VIEW (no copy, shares storage) when w1 and w3 lie in one storage with equal strides, w3
    after w1, without overlap -- e.g. the two halves ``W[:, :I]``, ``W[:, I:]`` of one fused
    ``W [E, 2I, H]``, or its interleaved rows ``W[:, 0::2]``, ``W[:, 1::2]`` -- and, when
    autograd must track them, both are differentiable views of one base (the view is then taken
    on that base, so gradients reach it). Otherwise (torchtitan's separate ``w1``/``w3``
    parameters, among others) a COPY ``torch.cat([w1, w3], dim=1)`` [E, 2I, H] (a plain copy,
    no transposition: torchtitan's own memory layout) returned as the [E, H, 2, I] view of it.
    Either way the result is differentiable: gradients flow back to w1 and w3; the fused CUDA
    backward writes the weight gradient in that same memory layout, so none is transposed.
    (:func:`run_experts_grouped_mm` takes this view where it exists and otherwise passes w1 and
    w3 to the layer as two operands: it never makes the copy.)

    Raises:
        ValueError: w1/w3 not floating 3-D tensors of one shape, dtype and device.
    """
    _check_pair(w1_EIH, w3_EIH)
    view = _gate_up_view(w1_EIH, w3_EIH)
    if view is not None:
        return view
    E, I, H = w1_EIH.shape
    return torch.cat([w1_EIH, w3_EIH], dim=1).view(E, 2, I, H).permute(0, 3, 1, 2)


def down_from_torchtitan(w2_EHI: torch.Tensor) -> torch.Tensor:
    """torchtitan's down projection ``w2`` [E, H, I] as ``w_down_EIH`` [E, I, H]: always the
    view ``w2.transpose(1, 2)`` (shares storage; gradients flow back to w2).

    Raises:
        ValueError: w2 not a floating 3-D tensor.
    """
    if not isinstance(w2_EHI, torch.Tensor) or w2_EHI.dim() != 3 or not w2_EHI.is_floating_point():
        raise ValueError(f"w2 must be a floating 3-D [E, H, I] tensor, got {_shape(w2_EHI)}")
    return w2_EHI.transpose(1, 2)


_TORCHTITAN_OPTIONS = MoEExpertsOptions(validate_routing="off")


def _check_counts_on_host(num_tokens_per_expert: torch.Tensor, rows: int) -> None:
    """Counts >= 0 summing to at most ``rows`` (reads the counts: CPU tensors only)."""
    n = num_tokens_per_expert.to(torch.int64)
    if n.numel() and int(n.min()) < 0:
        bad = [int(i) for i in torch.nonzero(n < 0).flatten()[:4]]
        raise ValueError(
            f"num_tokens_per_expert must be >= 0 (rows of each expert), got negative counts "
            f"at experts {bad}: {n.tolist() if n.numel() <= 16 else '...'}"
        )
    big = int(n.max()) if n.numel() else 0
    if big > rows:  # checked before the sum, which could overflow int64
        raise ValueError(
            f"num_tokens_per_expert must sum to at most the rows of x ({rows}), got a count "
            f"of {big}"
        )
    total = int(n.sum())
    if total > rows:
        raise ValueError(
            f"num_tokens_per_expert must sum to at most the rows of x ({rows}), got sum {total}"
        )


def run_experts_grouped_mm(
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """Drop-in for torchtitan's ``_run_experts_grouped_mm`` seam (same signature and result).

    torchtitan's ``GroupedExperts`` holds ``w1`` [E, I, H] (gate), ``w3`` [E, I, H] (up),
    ``w2`` [E, H, I] (down) and receives rows already permuted into expert order: the first
    ``num_tokens_per_expert[0]`` rows of ``x`` belong to expert 0, the next to expert 1, ...;
    rows past the total are padding. Per row of expert e it computes
    ``(silu(x W1[e]^T) * (x W3[e]^T)) W2[e]^T`` with BF16 GEMM operands and returns
    ``[rows, H]`` in ``x.dtype``. Here the rows keep their order: the layer runs on the
    identity routing of the counts (:func:`common.routing.presorted_routing`: each row its own
    token, top_k 1, affinity 1; no routing build, no sort) and compiles with
    ``torch.compile(fullgraph=True)`` (backend by ``common.dispatch`` "auto"). On the CUDA
    backends the GEMMs read ``x`` and ``dY`` in place and ``y`` / ``dx`` are the GEMMs'
    outputs: no gather, no per-token combine. Padding rows give 0 (as torchtitan's for-loop
    path). No host synchronisation on a device (CPU counts are read once, to check them).

    The weights are read as they are, never copied per call: where w1 and w3 are the halves (or
    interleaved rows) of one fused [E, 2I, H] storage, the layer reads that storage as its
    [E, H, 2, I] gate/up weight (:func:`gate_up_from_torchtitan`'s view; one gate/up GEMM,
    ``torch.ops.moe_bwd.experts_forward_presorted``); otherwise -- torchtitan's separate
    parameters, and always while ``torch.compile`` traces (storage identity is not traceable)
    -- w1 and w3 go to the layer as two operands (``torch.ops.moe_bwd.
    experts_forward_presorted_split``): on the CUDA backends two gate/up GEMMs and a
    two-pointer activation pass read them in place, and their gradients are written straight
    into [E, I, H] tensors (:func:`cuda_kernels.moe.forward.moe_forward_split_gate_up`); the
    portable CPU path concatenates them per call there (a copy, CPU only). ``w2`` is always
    read through its transposed view.

    Args:
        w1: [E, I, H] float.  w2: [E, H, I] float.  w3: [E, I, H] float.
        x: [rows, H] float, rows in expert order.
        num_tokens_per_expert: [E] int, rows of each expert: each >= 0, their sum <= rows.
            Checked on CPU tensors (ValueError). On a device they are not read back (no host
            synchronisation, CUDA-graph capturable) and bad counts cannot be refused: they are
            clamped instead, memory-safely -- a negative count counts as 0 and rows past
            ``rows`` are cut off -- so the result is then that of the clamped counts.
    Returns:
        [rows, H] in ``x.dtype``. Gradients flow to x, w1, w2 and w3, each in its tensor's
        dtype and memory layout.
    Raises:
        ValueError: a bad argument, named (on CPU tensors also a negative count or counts
            summing to more than ``rows``).

    Example: torchtitan before 0.3 had this seam as a module function
    (``torchtitan.models.moe.moe._run_experts_grouped_mm = run_experts_grouped_mm``); in
    torchtitan 0.3.0 it is ``GroupedExperts.forward`` (``torchtitan.models.common.moe``), which
    :func:`common.expert_parallel.use_moe_experts_in_torchtitan` replaces on a built model.
    """
    _check_pair(w1, w3)
    E, I, H = w1.shape
    if not isinstance(w2, torch.Tensor) or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must have shape [E={E}, H={H}, I={I}], got {_shape(w2)}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x must be a 2-D [rows, H={H}] tensor, got {_shape(x)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    n = num_tokens_per_expert
    if not isinstance(n, torch.Tensor) or tuple(n.shape) != (E,) or n.dtype not in _INT_DTYPES:
        raise ValueError(
            f"num_tokens_per_expert must be an integer [E={E}] tensor, got "
            f"{_shape(n) if not isinstance(n, torch.Tensor) else f'{list(n.shape)} {n.dtype}'}"
        )
    for name, t in (("w1", w1), ("w2", w2), ("w3", w3), ("num_tokens_per_expert", n)):
        if t.device != x.device:
            raise ValueError(f"{name} is on device {t.device} but x is on {x.device}")
    rows = x.shape[0]
    if n.device.type == "cpu" and not torch.compiler.is_compiling():
        # a host read costs nothing here: refuse bad counts by name (not while tracing: the
        # counts are data then, clamped below like device counts)
        _check_counts_on_host(n, rows)
    # The routing is the identity (common.routing.presorted_routing, inside the op: counts
    # clamped memory-safely on the device, nothing read back); no routing build, no gather.
    w_down = down_from_torchtitan(w2)
    w_gate_up = _gate_up_view(w1, w3)
    if w_gate_up is not None:  # one storage: one gate/up GEMM on it
        return layer_ops.presorted_op(x, w_gate_up, w_down, n, _TORCHTITAN_OPTIONS)
    return layer_ops.presorted_split_op(x, w1, w3, w_down, n, _TORCHTITAN_OPTIONS)

