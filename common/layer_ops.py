"""The MoE layer's forward and backward: one implementation, two autograd entries.

* :func:`layer_forward` / :func:`layer_backward` -- what one call of the layer does: resolve the
  backend (:mod:`common.dispatch`), validate the routing (``validate_routing``: ``"device"``,
  ``"host"`` or ``"off"``), run the backend's ``forward`` (the fused GPU forward on
  ``cuda-sm90`` / ``cuda-sm100``; :func:`common.torch_backward.moe_layer_forward_torch`
  elsewhere) and, in backward, its ``run``. What a backend takes beyond the common arguments it
  declares (``Backend.options``: layer options such as ``grouped_mm``, passed by name;
  ``Backend.layer_state``: the saved X rows, the layout and the gradient targets); no backend is
  named here.
* ``torch.ops.moe_bwd.experts_forward`` / ``experts_backward`` -- the same as ``torch.library``
  custom ops with fake (meta) implementations and a registered autograd formula: the entry
  :func:`moe_experts_op` that :class:`common.layer.MoEExperts` uses, so a module holding the
  layer compiles with ``torch.compile(fullgraph=True)`` without graph breaks, and a new routing
  (same T, K, E) does not recompile: every output shape is static given T, K, E.
  :class:`common.layer.MoEExpertsFunction` (``torch.autograd.Function``) remains for what an
  opaque op cannot carry (Megatron ``main_grad`` accumulation).
* ``torch.ops.moe_bwd.experts_forward_presorted`` (:func:`presorted_op`) and
  ``experts_forward_presorted_split`` (:func:`presorted_split_op`) -- rows already in expert
  order (torchtitan's grouped-experts seam, :func:`common.layer.run_experts_grouped_mm`), the
  gate/up weight as one [E, H, 2, I] tensor or as two [E, I, H] operands (torchtitan's separate
  ``w1`` / ``w3``, read in place where the backend has ``forward_split_gate_up``).

Options reach the ops as an interned integer key (:func:`options_key`); the options object itself
is frozen and hashable, so equal options share a key and a compiled graph holds a constant.
A backend's layer options (``MoEExpertsOptions.grouped_mm``) travel in it like every other
option; the fake implementations need not read them (outputs have the same shapes either way).

Routing validation (``MoEExpertsOptions.validate_routing``):

* ``"device"`` (default): no host read. CPU tensors are checked on the host (ValueError naming
  the argument, free there). On a GPU the check is queued on the device
  (:func:`common.routing.assert_routing_async`); bad ids or affinities surface at the latest at
  the next synchronisation as a device-side assert (RuntimeError; the CUDA context is unusable
  afterwards, so no gradient of that call is ever used). Passes
  ``torch.cuda.set_sync_debug_mode("error")`` and CUDA-graph capture.
* ``"host"``: reads ids and affinities on the host before any work (one synchronisation) and
  raises ValueError naming the argument and the rule.
* ``"off"``: no check. An id outside [0, E) (after widening to int64; e.g. 100 or -7 with
  E = 8) is then a dropped slot on every backend -- the portable routing plan
  (:func:`common.routing.plan_routing`) and the fused GPU routing both mask it, never index with
  it -- so it adds nothing to y and its affinity gradient is 0, silently; a NaN, inf or negative
  routed affinity is used as it is. ``"device"`` is the safe default.
"""

from __future__ import annotations

from typing import Any

import torch

from common.dispatch import resolve_backend
from common.problem import MoEBackwardProblem, shape_text
from common.routing import GroupedLayout, RoutingPlan, presorted_routing
from common.shapes import static_tokens_sum
from common.torch_backward import ALIGN, LayerForward, cpu_threads, moe_layer_forward_torch

__all__ = [
    "check_inputs",
    "checkpoint_shape",
    "check_routing_on_host",
    "keeps_x_rows",
    "layer_backward",
    "layer_forward",
    "layer_threads",
    "moe_experts_op",
    "options_key",
    "presorted_op",
    "presorted_split_op",
    "shape_text",
]

_GRAD_DTYPES = (torch.float32, torch.bfloat16)
"""Gradient dtypes a ``layer_state`` backend's run writes directly; others are written fp32 and
cast."""

# ------------------------------------------------------------------------------------- options
_OPTIONS: list = []
_OPTION_KEYS: dict = {}


def options_key(options) -> int:
    """The interned integer key of a hashable options object (equal options, equal key)."""
    key = _OPTION_KEYS.get(options)
    if key is None:
        key = _OPTION_KEYS[options] = len(_OPTIONS)
        _OPTIONS.append(options)
    return key


# ----------------------------------------------------------------------------------- checks
def check_routing_on_host(expert_index_TK: torch.Tensor, affinity_TK: torch.Tensor, E: int) -> None:
    """Expert ids in [-1, E), finite and non-negative routed affinities (one host read on a
    device). Raises ValueError naming the argument and the rule."""
    if expert_index_TK.numel() == 0:
        return
    ids = expert_index_TK.to(torch.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= E:
        raise ValueError(
            f"expert_index_TK values must lie in [-1, num_experts={E}) (-1 = dropped slot), "
            f"found range [{lo}, {hi}]"
        )
    routed = affinity_TK.detach()[ids >= 0]
    if not bool(torch.isfinite(routed).all()):
        raise ValueError("affinity_TK must be finite on routed slots (found NaN or inf)")
    if bool((routed < 0).any()):
        raise ValueError("affinity_TK must be >= 0 on routed slots (found a negative affinity)")


def check_inputs(
    hidden_states_TH, affinity_TK, w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH,
    expert_index_TK,
) -> None:
    """Shapes, dtypes and devices of one layer call; ValueError naming the first bad argument.

    Run before eager calls (:func:`common.layer._apply`) and again inside
    ``torch.ops.moe_bwd.experts_forward``: there, in the op, is where a ``torch.compile``-d
    caller sees the ValueError -- raised while Dynamo traces it would become Dynamo's own
    error; raised when the compiled graph runs it is the eager ValueError, text and all."""
    x = hidden_states_TH
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"hidden_states_TH must be a 2-D [T, H] tensor, got {shape_text(x)}")
    T, H = x.shape
    w = w_gate_up_EH2I
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[2] != 2:
        raise ValueError(f"w_gate_up_EH2I must be [E, H, 2, I], got {shape_text(w)}")
    if w.shape[1] != H:
        raise ValueError(
            f"hidden_states_TH has hidden size H={H} but the weights have H={w.shape[1]} "
            f"(w_gate_up_EH2I {shape_text(w)})"
        )
    E, _, _, I = w.shape
    if E < 1 or I < 1:
        raise ValueError(f"w_gate_up_EH2I must have E >= 1 and I >= 1, got {shape_text(w)}")
    idx = expert_index_TK
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"expert_index_TK must be a 2-D [T={T}, K] tensor, got {shape_text(idx)}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"expert_index_TK must have an integer dtype, got {idx.dtype}")
    if idx.shape[1] < 1:
        raise ValueError("expert_index_TK must have top_k >= 1 columns")
    K = idx.shape[1]
    want = {
        "affinity_TK": (affinity_TK, (T, K)),
        "w_down_EIH": (w_down_EIH, (E, I, H)),
        "b_gate_up_E2I": (b_gate_up_E2I, (E, 2, I)),
        "b_down_EH": (b_down_EH, (E, H)),
    }
    for name, (t, shape) in want.items():
        if t is None and name.startswith("b_"):
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {shape_text(t)}")
    floats = {"hidden_states_TH": x, "w_gate_up_EH2I": w}
    floats.update({k: v for k, (v, _) in want.items() if v is not None})
    for name, t in floats.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    for name, t in {**floats, "expert_index_TK": idx}.items():
        if t.device != x.device:
            raise ValueError(
                f"{name} is on device {t.device} but hidden_states_TH is on {x.device}"
            )


def _check_backend_shape(backend, T: int, H: int, I: int, E: int, K: int, activation) -> None:
    """The backend's ``check_shape`` on this problem, before any work (ValueError naming the
    backend, the dimensions and the rule)."""
    check = getattr(backend, "check_shape", None)
    if check is None:
        return
    why = check({"T": T, "H": H, "I": I, "E": E, "K": K, "activation": activation.name})
    if why is not None:
        raise ValueError(
            f"backend {backend.name!r} cannot run this layer (H={H}, I={I}, activation "
            f"{activation.name!r}): {why}"
        )


# -------------------------------------------------------------------------- forward, backward
def _declared_options(backend, options) -> dict[str, Any]:
    """The backend's declared layer options (``Backend.options``) with their values in
    ``options`` (a ``MoEExpertsOptions``), by name."""
    return {o.name: getattr(options, o.name) for o in backend.options}


def layer_forward(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options,
                  routing=None, *, backend=None, keep_x_rows=None):
    """One forward of the layer: ``(LayerForward, backend)``; ``x_rows_S`` is kept only for
    a ``layer_state`` backend's backward where :func:`keeps_x_rows` says so (else None).
    ``routing``: an already built ``(plan, layout)`` (:func:`common.routing.presorted_routing`),
    which replaces ``affinity`` and ``expert_index`` (both None then; no routing check).
    ``backend`` / ``keep_x_rows``: :func:`resolve_backend`'s and :func:`keeps_x_rows`' answers
    where the caller already has them (None: asked here; each asks the device and the backend's
    hooks, host time on every forward). Raises as :class:`common.layer.MoEExpertsFunction`.
    Small CPU problems run on one thread (:func:`common.torch_backward.cpu_threads`)."""
    slots = routing[0].pair_token_R.numel() if routing is not None else expert_index.numel()
    with cpu_threads(x.device, slots, w_gate_up.shape[0], x.shape[1], w_down.shape[1]):
        return _layer_forward(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index,
                              options, routing, backend, keep_x_rows)


def _layer_forward(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options,
                   routing, backend, keep_x_rows):
    E, H = w_gate_up.shape[0], x.shape[1]
    if backend is None:
        backend = resolve_backend(options.backend, x.device)
    if routing is not None:
        T, K = routing[0].num_tokens, routing[0].top_k
    else:
        T, K = expert_index.shape
    _check_backend_shape(backend, T, H, w_down.shape[1], E, K, options.activation)
    mode = options.validate_routing if routing is None else "off"
    on_host = mode == "host" or (mode == "device" and x.device.type == "cpu")
    if on_host:
        check_routing_on_host(expert_index, affinity, E)
    forward = getattr(backend, "forward", None)
    extra = {} if forward is None else _declared_options(backend, options)
    if forward is not None and backend.layer_state and backend.keeps_x_rows is not None:
        extra["keep_x_rows"] = (keeps_x_rows(options, x.device, w_gate_up, w_down, backend)
                                if keep_x_rows is None else keep_x_rows)
    if routing is not None:
        extra["routing"] = routing
    out = (forward or moe_layer_forward_torch)(
        x, None if affinity is None else affinity.detach(), expert_index, w_gate_up, w_down,
        b_gate_up, b_down, clamp_limits=options.clamp_limits, activation=options.activation,
        check_routing=mode == "device" and not on_host, **extra,
    )
    if not backend.layer_state and out.x_rows_S is not None:
        out = LayerForward(out.y_TH, out.checkpoint, None, out.plan, out.layout)
    return out, backend


def _run_grad_dtype(options, w_gate_up, w_down) -> torch.dtype:
    """The ``grad_dtype`` a ``layer_state`` backend's run is given: ``backend_options``' own,
    else the weights' common dtype where the run writes it directly, else fp32."""
    given = dict(options.backend_options).get("grad_dtype")
    if given is not None:
        return given
    same = w_gate_up.dtype == w_down.dtype and w_gate_up.dtype in _GRAD_DTYPES
    return w_gate_up.dtype if same else torch.float32


def keeps_x_rows(options, device, w_gate_up, w_down, backend=None) -> bool:
    """Whether the layer's forward keeps the gathered X rows [S, H] for the backward
    (``LayerForward.x_rows_S``; ``experts_forward``'s third output, else [0, H]): a
    ``layer_state`` backend's forward does, unless its ``Backend.keeps_x_rows`` says that its
    run reads X through the routing index (for these weights' sizes and dtypes and these
    options: never the token count). What the fake implementation gives, what the real op
    checks the forward against, and what the layer passes to the forward as
    ``keep_x_rows``. ``backend``: :func:`resolve_backend`'s answer for ``options.backend`` on
    ``device`` where the caller has it (None: resolved here)."""
    if backend is None:
        backend = resolve_backend(options.backend, device)
    if not backend.layer_state:
        return False
    hook = backend.keeps_x_rows if backend.forward else None
    if hook is None:
        return True
    call = {
        "device": torch.device(device), "E": int(w_gate_up.shape[0]),
        "H": int(w_gate_up.shape[1]), "I": int(w_gate_up.shape[3]),
        "grad_dtype": _run_grad_dtype(options, w_gate_up, w_down),
        "accumulate": bool(options.accumulate_main_grad),
        "backend_options": dict(options.backend_options),
        **_declared_options(backend, options),
    }
    return bool(hook(call))


def checkpoint_shape(options, device, *, E: int, H: int, I: int, R: int, S: int,
                     gate_up_bias: bool, backend=None) -> tuple[int, ...]:
    """The shape of the checkpoint the layer's forward keeps (``LayerForward.checkpoint``):
    ``(S, 2I)`` (grouped row order) where the backend's ``Backend.checkpoint_rows`` says so for
    these dimensions (E, H, I the weights') and options, else ``(R, 2, I)`` (pair order). What
    the fake implementations give, and what the real op checks the backend's forward
    against. ``backend``: as in :func:`keeps_x_rows`."""
    if backend is None:
        backend = resolve_backend(options.backend, device)
    hook = backend.checkpoint_rows if backend.layer_state and backend.forward else None
    if hook is None:
        return (R, 2, I)
    # (the weights' sizes, ints: a symbolic size, as opcheck traces, is specialised here)
    call = {"E": int(E), "H": int(H), "I": int(I), "gate_up_bias": gate_up_bias,
            "clamp_limits": options.clamp_limits, **_declared_options(backend, options)}
    return (S, 2 * I) if hook(call) else (R, 2, I)


def _check_checkpoint(out, want: tuple[int, ...]) -> None:
    """RuntimeError unless the forward's checkpoint has the shape :func:`checkpoint_shape`
    promised (a backend whose forward and ``checkpoint_rows`` disagree)."""
    got = tuple(out.checkpoint.shape)
    if got != want:
        raise RuntimeError(
            f"the backend's forward kept a checkpoint of shape {list(got)}, not {list(want)} "
            "(Backend.checkpoint_rows disagrees with its forward)"
        )


def layer_backward(
    grad_y, x, w_gate_up, w_down, b_gate_up, b_down, act, x_rows, plan, layout, options, backend,
    main_grad=None,
):
    """One backward: ``(MoEGrads, accumulated)``; ``accumulated`` says the weight gradients
    were added into ``main_grad`` (a pair of fp32 buffers) inside the wgrad kernel."""
    problem = MoEBackwardProblem(
        hidden_states_TH=x,
        output_grad_TH=grad_y.contiguous(),
        w_gate_up_EH2I=w_gate_up,
        w_down_EIH=w_down,
        plan=plan,
        act_checkpoint_R2I=act,
        b_gate_up_E2I=b_gate_up,
        b_down_EH=b_down,
        clamp_limits=options.clamp_limits,
        activation=options.activation,
    )
    run_opts: dict[str, Any] = dict(options.backend_options)
    run_opts.update(_declared_options(backend, options))
    accumulated = False
    threads = layer_threads(x, w_gate_up, w_down, plan)
    if backend.layer_state:
        run_opts["grad_dtype"] = _run_grad_dtype(options, w_gate_up, w_down)
        run_opts.update(layout=layout, x_rows_S=x_rows)
        if main_grad is not None and all(
            m.dtype == torch.float32 and m.is_contiguous() for m in main_grad
        ):
            run_opts["accumulate_into"] = main_grad
            accumulated = True
    with threads:
        return backend.run(problem, **run_opts), accumulated


def layer_threads(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, plan):
    """The layer's intra-op thread guard (:func:`common.torch_backward.cpu_threads`) for a
    call on ``x`` [T, H] with these weights and routing plan: one thread while a CPU problem's
    expert GEMMs are small, torch's setting otherwise (restored on exit; nested guards keep the
    outer one's setting)."""
    return cpu_threads(x.device, plan.pair_token_R.shape[0], w_gate_up.shape[0], x.shape[1],
                       w_down.shape[1])


def refuse_grad_mode(name: str) -> None:
    """RuntimeError when a backward runs with grad mode on (create_graph=True)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} is first-order only: its backward cannot be differentiated "
            "(create_graph=True, double backward, Hessians); compute those through a "
            "differentiable forward instead"
        )


# --------------------------------------------------------------------------------- custom ops
_PLAN = ("pair_token_R", "pair_expert_R", "pair_affinity_R", "slot_to_pair_TK",
         "tokens_per_expert_E", "num_pairs")
_LAYOUT = ("offsets_E", "row_to_token_S", "row_to_pair_S", "slot_to_row_TK")


def _flat_routing(plan, layout) -> list[torch.Tensor]:
    return [getattr(plan, f) for f in _PLAN] + [getattr(layout, f) for f in _LAYOUT]


def _routing_from_flat(tensors, T: int, E: int, K: int):
    p, lay = tensors[: len(_PLAN)], tensors[len(_PLAN):]
    plan = RoutingPlan(T, E, K, **dict(zip(_PLAN, p)))
    S = lay[1].shape[0]
    layout = GroupedLayout(**dict(zip(_LAYOUT, lay)), tokens_sum=S, align=ALIGN, num_tokens=T,
                           num_pair_rows=T * K)
    return plan, layout


@torch.library.custom_op("moe_bwd::experts_forward", mutates_args=())
def _experts_forward(
    x: torch.Tensor, affinity: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, expert_index: torch.Tensor,
    options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """``(y, act, x_rows, *plan, *layout)``: :func:`layer_forward` with flat outputs (act is
    the checkpoint in the form of :func:`checkpoint_shape`; x_rows is [0, H] where
    :func:`keeps_x_rows` is False: the backend does not keep them, or its backward reads X
    through the routing index). Checks the inputs first (ValueError)."""
    check_inputs(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index)
    opts = _OPTIONS[options]
    # (the backend and its answers asked once a forward: each asks the device, host time)
    backend = resolve_backend(opts.backend, x.device)
    keep = keeps_x_rows(opts, x.device, w_gate_up, w_down, backend)
    out, _ = layer_forward(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, opts,
                           backend=backend, keep_x_rows=keep)
    R, E = expert_index.numel(), w_gate_up.shape[0]
    S = static_tokens_sum(R, E, ALIGN)
    if out.layout.tokens_sum != S:
        raise RuntimeError(f"the backend's forward built {out.layout.tokens_sum} rows, not {S}")
    _check_checkpoint(out, checkpoint_shape(
        opts, x.device, E=E, H=w_gate_up.shape[1], I=w_gate_up.shape[3], R=R, S=S,
        gate_up_bias=b_gate_up is not None, backend=backend))
    rows = out.x_rows_S if out.x_rows_S is not None else x.new_empty(0, x.shape[1],
                                                                      dtype=torch.bfloat16)
    want = S if keep else 0
    if rows.shape[0] != want:
        raise RuntimeError(
            f"the backend's forward kept {rows.shape[0]} X rows, not {want} "
            "(Backend.keeps_x_rows disagrees with its forward)"
        )
    return (out.y_TH, out.checkpoint, rows, *_flat_routing(out.plan, out.layout))


@_experts_forward.register_fake
def _(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options):
    try:
        check_inputs(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index)
    except ValueError:
        # The real implementation raises this ValueError when the compiled graph runs: only the
        # tracing continues on these placeholders (y keeps x's shape for the caller's code).
        return (x.new_empty(x.shape), *(x.new_empty(0) for _ in range(12)))
    T, H = x.shape
    K = expert_index.shape[1]
    E, I = w_gate_up.shape[0], w_gate_up.shape[3]
    R = T * K
    S = static_tokens_sum(R, E, ALIGN)
    i64, bf16 = torch.int64, torch.bfloat16
    opts = _OPTIONS[options]
    rows = S if keeps_x_rows(opts, x.device, w_gate_up, w_down) else 0
    ck = checkpoint_shape(opts, x.device, E=E, H=w_gate_up.shape[1], I=I, R=R, S=S,
                          gate_up_bias=b_gate_up is not None)
    return (
        x.new_empty(T, H), x.new_empty(ck, dtype=bf16), x.new_empty(rows, H, dtype=bf16),
        x.new_empty(R, dtype=i64), x.new_empty(R, dtype=i64),
        x.new_empty(R, dtype=affinity.dtype), x.new_empty(T, K, dtype=i64),
        x.new_empty(E, dtype=i64), x.new_empty((), dtype=i64),
        x.new_empty(E, dtype=torch.int32), x.new_empty(S, dtype=i64), x.new_empty(S, dtype=i64),
        x.new_empty(T, K, dtype=i64),
    )


@torch.library.custom_op("moe_bwd::experts_backward", mutates_args=())
def _experts_backward(
    grad_y: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, act: torch.Tensor,
    x_rows: torch.Tensor, routing: list[torch.Tensor], top_k: int, options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, d_affinity [T, K], dW_gate_up, dW_down, dB_gate_up, dB_down)`` in the inputs'
    dtypes and memory layouts (contiguous where an input's strides are not dense; gradients of
    absent biases are empty [0] tensors)."""
    opts = _OPTIONS[options]
    T, E = x.shape[0], w_gate_up.shape[0]
    plan, layout = _routing_from_flat(routing, T, E, top_k)
    backend = resolve_backend(opts.backend, x.device)
    with layer_threads(x, w_gate_up, w_down, plan):  # the casts below too
        grads, _ = layer_backward(
            grad_y, x, w_gate_up, w_down, b_gate_up, b_down, act,
            x_rows if x_rows.shape[0] else None, plan, layout, opts, backend,
        )
        aff_dtype = plan.pair_affinity_R.dtype

        def bias(g, b):
            return _like(g, b) if b is not None else x.new_empty(0)

        return (
            _like(grads.hidden_states_grad_TH, x),
            plan.slot_affinity_grad(grads.affinity_grad_TE).to(aff_dtype).contiguous(),
            _like(grads.w_gate_up_grad_EH2I, w_gate_up),
            _like(grads.w_down_grad_EIH, w_down),
            bias(grads.b_gate_up_grad_E2I, b_gate_up),
            bias(grads.b_down_grad_EH, b_down),
        )


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides are a permutation of a contiguous tensor's."""
    expect = 1
    for st, sz in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if st != expect:
            return False
        expect *= sz
    return True


def _like(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The gradient ``g`` in ``t``'s dtype and memory layout (contiguous when ``t``'s strides
    are not dense): what the fake implementation promises."""
    g = g.to(t.dtype)
    if g.stride() == t.stride() or not _dense(t):
        return g if g.stride() == t.stride() else g.contiguous()
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=g.device).copy_(g)


def _fake_like(t, x):
    """What :func:`_like` returns for ``t``, as a fake tensor (``x``: any input, for its device)."""
    if t is None:
        return x.new_empty(0)
    if _dense(t):
        return x.new_empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return x.new_empty(t.shape, dtype=t.dtype)


@_experts_backward.register_fake
def _(grad_y, x, w_gate_up, w_down, b_gate_up, b_down, act, x_rows, routing, top_k, options):
    T = x.shape[0]
    return (_fake_like(x, x), x.new_empty(T, top_k, dtype=routing[2].dtype),
            _fake_like(w_gate_up, x), _fake_like(w_down, x), _fake_like(b_gate_up, x),
            _fake_like(b_down, x))


def _setup_context(ctx, inputs, output):
    x, _aff, w_gate_up, w_down, b_gate_up, b_down, expert_index, options = inputs
    _y, act, rows, *routing = output
    ctx.has_bias = (b_gate_up is not None, b_down is not None)
    ctx.top_k = expert_index.shape[1] if expert_index.dim() == 2 else 1  # (bad input: above)
    ctx.options = options
    ctx.save_for_backward(x, w_gate_up, w_down, b_gate_up, b_down, act, rows, *routing)
    ctx.mark_non_differentiable(act, rows, *routing)
    # autograd would otherwise hand the backward a zero-filled gradient for every other output:
    # a BF16 fill of the [S, H] rows (and the checkpoint) per step, 0.28 ms of an 8 ms step on
    # qwen3-30b-a3b (H200 profile, benchmarks/RESULTS.md); they are never read
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, *_unused):
    refuse_grad_mode("MoEExperts")
    if grad_y is None:  # (defensive: y received no gradient)
        return (None,) * 8
    x, wgu, wd, bgu, bd, act, rows, *routing = ctx.saved_tensors
    dx, da, dwgu, dwd, dbgu, dbd = _experts_backward(
        grad_y, x, wgu, wd, bgu, bd, act, rows, list(routing), ctx.top_k, ctx.options
    )
    has_bgu, has_bd = ctx.has_bias
    return dx, da, dwgu, dwd, dbgu if has_bgu else None, dbd if has_bd else None, None, None


_experts_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------- rows already in expert order
@torch.library.custom_op("moe_bwd::experts_forward_presorted", mutates_args=())
def _experts_forward_presorted(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    num_rows_per_expert: torch.Tensor, options: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, act)`` of rows already in expert order (:func:`presorted_op`); act is the
    checkpoint in the form of :func:`_presorted_checkpoint_shape`."""
    opts = _OPTIONS[options]
    backend = resolve_backend(opts.backend, x.device)
    ck = _presorted_checkpoint_shape(opts, x, w_gate_up, backend)
    if x.shape[0] == 0:  # nothing to compute (and no empty grouped GEMM to launch)
        return x.new_zeros(x.shape), x.new_zeros(ck, dtype=torch.bfloat16)
    plan, layout = presorted_routing(num_rows_per_expert, x.shape[0])
    out, _ = layer_forward(x, None, w_gate_up, w_down, None, None, None, opts,
                           routing=(plan, layout), backend=backend)
    _check_checkpoint(out, ck)
    return out.y_TH, out.checkpoint


def _presorted_checkpoint_shape(options, x, w_gate_up, backend=None) -> tuple[int, ...]:
    """:func:`checkpoint_shape` of the presorted layer (R = S = the row count, no bias)."""
    rows = x.shape[0]
    return checkpoint_shape(options, x.device, E=w_gate_up.shape[0], H=w_gate_up.shape[1],
                            I=w_gate_up.shape[3], R=rows, S=rows, gate_up_bias=False,
                            backend=backend)


@_experts_forward_presorted.register_fake
def _(x, w_gate_up, w_down, num_rows_per_expert, options):
    ck = _presorted_checkpoint_shape(_OPTIONS[options], x, w_gate_up)
    return x.new_empty(x.shape), x.new_empty(ck, dtype=torch.bfloat16)


@torch.library.custom_op("moe_bwd::experts_backward_presorted", mutates_args=())
def _experts_backward_presorted(
    grad_y: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    act: torch.Tensor, num_rows_per_expert: torch.Tensor, options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dW_gate_up, dW_down)`` in the inputs' dtypes and memory layouts; the routing is
    rebuilt from the counts (a few small launches, cheaper to redo than to keep)."""
    if x.shape[0] == 0:
        return tuple(_like(torch.zeros_like(t, memory_format=torch.contiguous_format), t)
                     for t in (x, w_gate_up, w_down))
    opts = _OPTIONS[options]
    plan, layout = presorted_routing(num_rows_per_expert, x.shape[0])
    backend = resolve_backend(opts.backend, x.device)
    with layer_threads(x, w_gate_up, w_down, plan):  # the casts below too
        grads, _ = layer_backward(grad_y, x, w_gate_up, w_down, None, None, act, None, plan,
                                  layout, opts, backend)
        return (_like(grads.hidden_states_grad_TH, x),
                _like(grads.w_gate_up_grad_EH2I, w_gate_up), _like(grads.w_down_grad_EIH, w_down))


@_experts_backward_presorted.register_fake
def _(grad_y, x, w_gate_up, w_down, act, num_rows_per_expert, options):
    return _fake_like(x, x), _fake_like(w_gate_up, x), _fake_like(w_down, x)


def _setup_context_presorted(ctx, inputs, output):
    """Both presorted ops' (one gate/up weight or two): inputs ``(x, *weights, counts,
    options)``; saves ``(x, *weights, act, counts)``."""
    *tensors, counts, options = inputs
    _y, act = output
    ctx.options = options
    ctx.save_for_backward(*tensors, act, counts)
    ctx.mark_non_differentiable(act)
    ctx.set_materialize_grads(False)


def _backward_presorted(ctx, grad_y, _unused):
    refuse_grad_mode("MoEExperts")
    if grad_y is None:
        return (None,) * 5
    x, wgu, wd, act, counts = ctx.saved_tensors
    dx, dwgu, dwd = _experts_backward_presorted(grad_y, x, wgu, wd, act, counts, ctx.options)
    return dx, dwgu, dwd, None, None


_experts_forward_presorted.register_autograd(
    _backward_presorted, setup_context=_setup_context_presorted
)


# ------------------------------------- rows already in expert order, gate and up weights apart
def _concat_gate_up(w_gate_EIH: torch.Tensor, w_up_EIH: torch.Tensor) -> torch.Tensor:
    """``[w_gate; w_up]`` [E, 2I, H] as the layer's [E, H, 2, I] (a COPY: the path of backends
    without ``forward_split_gate_up``, e.g. the portable one on the CPU)."""
    E, I, H = w_gate_EIH.shape
    return torch.cat([w_gate_EIH, w_up_EIH], dim=1).view(E, 2, I, H).permute(0, 3, 1, 2)


def _split_grad_dtype(*ws: torch.Tensor) -> torch.dtype:
    """The weights' common dtype where the fused backward writes it (fp32 / BF16), else fp32
    (as :func:`layer_backward` picks it)."""
    same = all(w.dtype == ws[0].dtype for w in ws) and ws[0].dtype in _GRAD_DTYPES
    return ws[0].dtype if same else torch.float32


@torch.library.custom_op("moe_bwd::experts_forward_presorted_split", mutates_args=())
def _experts_forward_presorted_split(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    num_rows_per_expert: torch.Tensor, options: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, act)`` of rows already in expert order with separate gate and up weights
    (:func:`presorted_split_op`)."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape), x.new_zeros(0, 2, w_gate.shape[1], dtype=torch.bfloat16)
    opts = _OPTIONS[options]
    routing = presorted_routing(num_rows_per_expert, x.shape[0])
    backend = resolve_backend(opts.backend, x.device)
    if backend.forward_split_gate_up is None:
        out, _ = layer_forward(x, None, _concat_gate_up(w_gate, w_up), w_down, None, None, None,
                               opts, routing=routing, backend=backend)
    else:
        out = backend.forward_split_gate_up(
            x, w_gate, w_up, w_down, routing, clamp_limits=opts.clamp_limits,
            activation=opts.activation, **_declared_options(backend, opts),
        )
    return out.y_TH, out.checkpoint


@_experts_forward_presorted_split.register_fake
def _(x, w_gate, w_up, w_down, num_rows_per_expert, options):
    rows, I = x.shape[0], w_gate.shape[1]
    return x.new_empty(x.shape), x.new_empty(rows, 2, I, dtype=torch.bfloat16)


@torch.library.custom_op("moe_bwd::experts_backward_presorted_split", mutates_args=())
def _experts_backward_presorted_split(
    grad_y: torch.Tensor, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
    w_down: torch.Tensor, act: torch.Tensor, num_rows_per_expert: torch.Tensor, options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dW_gate, dW_up, dW_down)`` in the inputs' dtypes and memory layouts."""
    ins = (x, w_gate, w_up, w_down)
    if x.shape[0] == 0:
        return tuple(_like(torch.zeros_like(t, memory_format=torch.contiguous_format), t)
                     for t in ins)
    opts = _OPTIONS[options]
    plan, layout = presorted_routing(num_rows_per_expert, x.shape[0])
    backend = resolve_backend(opts.backend, x.device)
    if backend.run_split_gate_up is None:
        grads, _ = layer_backward(grad_y, x, _concat_gate_up(w_gate, w_up), w_down, None, None,
                                  act, None, plan, layout, opts, backend)
        dwgu = grads.w_gate_up_grad_EH2I  # [E, H, 2, I]
        got = (grads.hidden_states_grad_TH, dwgu[:, :, 0].transpose(1, 2),
               dwgu[:, :, 1].transpose(1, 2), grads.w_down_grad_EIH)
    else:
        run_opts: dict[str, Any] = dict(opts.backend_options)
        run_opts.update(_declared_options(backend, opts))
        run_opts.setdefault("grad_dtype", _split_grad_dtype(w_gate, w_up, w_down))
        *got, _info = backend.run_split_gate_up(
            grad_y.contiguous(), x, w_gate, w_up, w_down, act, (plan, layout),
            clamp_limits=opts.clamp_limits, activation=opts.activation, **run_opts,
        )
    return tuple(_like(g, t) for g, t in zip(got, ins))


@_experts_backward_presorted_split.register_fake
def _(grad_y, x, w_gate, w_up, w_down, act, num_rows_per_expert, options):
    return tuple(_fake_like(t, x) for t in (x, w_gate, w_up, w_down))


def _backward_presorted_split(ctx, grad_y, _unused):
    refuse_grad_mode("MoEExperts")
    if grad_y is None:
        return (None,) * 6
    x, wg, wu, wd, act, counts = ctx.saved_tensors
    dx, dwg, dwu, dwd = _experts_backward_presorted_split(grad_y, x, wg, wu, wd, act, counts,
                                                          ctx.options)
    return dx, dwg, dwu, dwd, None, None


_experts_forward_presorted_split.register_autograd(
    _backward_presorted_split, setup_context=_setup_context_presorted
)


def presorted_split_op(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH, num_rows_per_expert_E, options):
    """y [S, H]: :func:`presorted_op` with the gate and up weights as two [E, I, H] operands
    (torchtitan's separate ``w1`` / ``w3``) through ``torch.ops.moe_bwd.
    experts_forward_presorted_split``. A backend with ``forward_split_gate_up`` (the CUDA ones:
    :func:`cuda_kernels.moe.forward.moe_forward_split_gate_up`) reads both in place and writes
    their gradients in their own layouts: no weight copy, concatenation or transposition per
    call. Any other backend (the portable CPU path) runs on ``cat([w_gate, w_up])``, a copy per
    call, and splits the gradient back. ``w_down_EIH``: [E, I, H] (torchtitan's ``w2``
    transposed, a view). Inputs already checked by the caller; ``options`` hashable."""
    return _experts_forward_presorted_split(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH,
                                            num_rows_per_expert_E, options_key(options))[0]


def presorted_op(x_SH, w_gate_up_EH2I, w_down_EIH, num_rows_per_expert_E, options):
    """y [S, H]: the layer on rows already in expert order (torchtitan's grouped experts seam,
    :func:`common.layer.run_experts_grouped_mm`) through ``torch.ops.moe_bwd.
    experts_forward_presorted``: row s of expert e computes ``h(x[s] W_gate_up[e]) W_down[e]``
    (affinity 1, no bias), rows past the counts' total give 0. The routing is
    :func:`common.routing.presorted_routing` of the counts (no sort, no gather index, no host
    read); on the CUDA backends the GEMMs read ``x`` and ``dY`` in place and ``y`` / ``dX`` are
    the GEMM outputs (no gather, no per-token combine). Inputs already checked by the caller;
    ``options`` hashable."""
    return _experts_forward_presorted(x_SH, w_gate_up_EH2I, w_down_EIH, num_rows_per_expert_E,
                                      options_key(options))[0]


def moe_experts_op(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index, options):
    """y [T, H]: the layer through ``torch.ops.moe_bwd.experts_forward`` (inputs already
    checked by :func:`common.layer._check_inputs`; ``options`` hashable)."""
    return _experts_forward(x, affinity, w_gate_up, w_down, b_gate_up, b_down, expert_index,
                            options_key(options))[0]
