"""Backend registry and device-based backend selection.

Backends register themselves by name with :func:`register_backend`. ``common`` imports no
backend package: the built-in plugin modules below are imported lazily, by name, the first time
the registry is consulted, and a plugin that fails to import only makes its backends unavailable.

Selection (:func:`resolve_backend`):

* ``"auto"`` (or ``None``): the ``MOE_BWD_BACKEND`` environment variable if set, else by device:
  a Neuron/XLA device -> ``nki``; CUDA capability >= 10.0 -> ``cuda-sm100``; 9.x ->
  ``cuda-sm90``; anything else -> ``torch``. An auto-selected backend that cannot run is skipped
  in favour of ``torch``, and the reason is kept in ``Backend.fallback_reason``.
* an explicit name: that backend, or a ``RuntimeError`` saying what is missing.

Names: ``reference`` (float64), ``torch`` (portable: BF16 inputs, fp32 accumulation),
``nki`` (real Neuron NKI), ``nki-sim`` (the NKI kernel on our CPU interpreter), ``nki-twin``
(the NKI kernel's MX-faithful torch twin, any device), ``cuda-sm90``,
``cuda-sm100``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.problem import MoEBackwardProblem, MoEGrads

__all__ = [
    "BACKEND_NAMES",
    "ENV_VAR",
    "Backend",
    "BackendOption",
    "auto_backend_name",
    "detect_backend",
    "device_grouped_wgrad",
    "layer_option",
    "register_backend",
    "registered_backends",
    "resolve_backend",
    "run_backward",
]

ENV_VAR = "MOE_BWD_BACKEND"
BACKEND_NAMES = ("reference", "torch", "nki", "nki-sim", "nki-twin", "cuda-sm90", "cuda-sm100")

# Built-in plugin modules, imported lazily so that `common` never imports a backend package.
_PLUGINS = {
    "nki": "nki_kernels.backend",
    "nki-sim": "nki_kernels.backend",
    "nki-twin": "nki_kernels.backend",
    "cuda-sm90": "cuda_kernels.backend",
    "cuda-sm100": "cuda_kernels.backend",
}


@dataclass(frozen=True)
class BackendOption:
    """A layer option a backend declares: a field of ``common.layer.MoEExpertsOptions`` of this
    name, which the layer passes to that backend's ``forward`` and ``run`` by keyword (the other
    backends ignore it).

    Attributes:
        name: the option's name (the ``MoEExpertsOptions`` field and the keyword).
        values: the allowed values.
        default: the value that changes nothing (one of ``values``).
        doc: what each value does, for docs and ``moe-bwd backends``.
    """

    name: str
    values: tuple[str, ...]
    default: str
    doc: str = ""

    def check(self, value) -> None:
        """The option's one check. Raises ValueError naming the option and its allowed values
        unless ``value`` is one of them."""
        if not isinstance(value, str) or value not in self.values:
            raise ValueError(f"{self.name} must be one of {self.values}, got {value!r}")


@dataclass(frozen=True)
class Backend:
    """One registered backend.

    Attributes:
        name: registry name (one of :data:`BACKEND_NAMES` for the built-ins).
        summary: one line for ``moe-bwd backends``.
        check: returns None when the backend can run here, else the reason it cannot.
        run: ``run(problem, **options) -> MoEGrads``.
        fallback_reason: set on the ``torch`` backend returned by auto-selection when the
            device's preferred backend could not run.
        grouped_wgrad: optional ``fn(a_HS, b_SI, offsets_E) -> [E, H, I] fp32``, the backend's
            grouped weight-gradient kernel; the ``torch`` backend uses it on that backend's
            devices (e.g. the SM90 kernel on a Hopper GPU).
        check_shape: optional ``fn(dims) -> None | reason``: whether the backend takes a
            problem of these dimensions before any input is built; ``dims`` has the ints
            ``T, H, I, E, K`` and ``activation`` (the :class:`~common.problem.Activation` name,
            ``"swiglu"`` or ``"gpt_oss"``). None = any shape.
        forward: optional layer forward ``fn(x_TH, affinity_TK, expert_index_TK, w_gate_up,
            w_down, b_gate_up, b_down, *, clamp_limits, activation, check_routing) ->
            common.torch_backward.LayerForward`` (routing plan, grouped layout with
            ``ALIGN``-row groups, y, BF16 checkpoint, X rows); None = the portable
            :func:`common.torch_backward.moe_layer_forward_torch`.
        options: the layer options (:class:`BackendOption`) its ``forward`` and ``run`` take
            by keyword; the layer checks their values when it builds its options.
        layer_state: True when ``forward`` returns the BF16 X rows (``LayerForward.x_rows_S``)
            and ``run`` takes the layer's saved state and gradient targets: ``layout``,
            ``x_rows_S``, ``grad_dtype`` and ``accumulate_into`` (the ``main_grad`` pair).
        forward_split_gate_up: optional ``fn(x_SH, w_gate_EIH, w_up_EIH, w_down_EIH, routing,
            *, clamp_limits, activation, **options) -> LayerForward``: the layer on rows already
            in expert order (``routing`` = ``(plan, identity layout)`` of
            :func:`common.routing.presorted_routing`) with separate gate and up weights
            [E, I, H] (torchtitan's ``w1`` / ``w3``) read in place; ``options`` are the
            declared layer options. None: the layer concatenates the two into one [E, H, 2, I]
            weight per call and runs ``forward`` (a copy; fine on the CPU).
        run_split_gate_up: optional ``fn(grad_y_SH, x_SH, w_gate_EIH, w_up_EIH, w_down_EIH,
            act_R2I, routing, *, clamp_limits, activation, grad_dtype, **options) ->
            (dX, dW_gate, dW_up, dW_down, info)``: its backward, each weight gradient in its
            weight's layout; ``options`` are the declared layer options and
            ``MoEExpertsOptions.backend_options``. Given together with
            ``forward_split_gate_up``.
        checkpoint_rows: optional ``fn(call) -> bool``, read only with ``layer_state`` and a
            ``forward`` (the portable forward keeps [R, 2, I]): True when
            ``forward`` keeps the checkpoint in the grouped row order [S, 2I]
            (``LayerForward.checkpoint``; ``run`` then reads it so) for a call described by
            ``call``: the ints ``E, H, I``, ``gate_up_bias`` (bool), ``clamp_limits`` (a
            ClampLimits or None) and the backend's declared options by name. It must depend on
            nothing else -- the layer's fake implementation gives the checkpoint's shape from
            it, so one layer keeps one form for every token count. None = always [R, 2, I].
        keeps_x_rows: optional ``fn(call) -> bool``, read only with ``layer_state`` and a
            ``forward``: whether ``forward`` keeps the gathered X rows for ``run``
            (``LayerForward.x_rows_S``); False where ``run`` reads X through the layout's
            row -> token index itself. The layer passes the answer to ``forward`` as
            ``keep_x_rows=``. ``call``: ``device`` (torch.device), the ints ``E, H, I``,
            ``grad_dtype`` (what ``run`` will be given), ``accumulate`` (the layer's
            ``accumulate_main_grad``), ``backend_options`` (a dict) and the declared options by
            name; like ``checkpoint_rows`` it must depend on nothing else (the fake
            implementation gives the saved rows' shape from it). None = always kept.
    """

    name: str
    summary: str
    check: Callable[[], str | None]
    run: Callable[..., MoEGrads]
    fallback_reason: str | None = None
    grouped_wgrad: Callable | None = None
    check_shape: Callable[[dict], str | None] | None = None
    forward: Callable | None = None
    options: tuple[BackendOption, ...] = ()
    layer_state: bool = False
    forward_split_gate_up: Callable | None = None
    run_split_gate_up: Callable | None = None
    checkpoint_rows: Callable[[dict], bool] | None = None
    keeps_x_rows: Callable[[dict], bool] | None = None


_REGISTRY: dict[str, Backend] = {}
_PLUGIN_ERRORS: dict[str, str] = {}


def register_backend(backend: Backend) -> None:
    """Add or replace a backend in the registry.

    Raises:
        ValueError: ``backend`` is not a :class:`Backend` or its name is empty.
    """
    if not isinstance(backend, Backend) or not backend.name:
        raise ValueError("register_backend needs a Backend with a non-empty name")
    _REGISTRY[backend.name] = backend


def _load_plugin(name: str) -> None:
    module = _PLUGINS.get(name)
    if module is None or name in _REGISTRY or module in _PLUGIN_ERRORS:
        return
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure only disables its backends
        _PLUGIN_ERRORS[module] = f"{module} failed to import: {type(exc).__name__}: {exc}"


def registered_backends() -> dict[str, Backend]:
    """All backends known after importing the built-in plugins (name -> Backend)."""
    for name in _PLUGINS:
        _load_plugin(name)
    return dict(_REGISTRY)


def layer_option(name: str) -> BackendOption | None:
    """The declaration of the layer option ``name`` by a registered backend (the built-in
    plugins imported first), or None when no backend that imports here declares it."""
    for backend in registered_backends().values():
        for option in backend.options:
            if option.name == name:
                return option
    return None


def _env_backend() -> str | None:
    """The backend named by ``MOE_BWD_BACKEND``; unset, empty or "auto" mean none."""
    value = os.environ.get(ENV_VAR, "").strip()
    return None if value in ("", "auto") else value


def auto_backend_name(device: torch.device | str | None = None) -> str:
    """What ``"auto"`` picks before availability checks: ``MOE_BWD_BACKEND`` if set, else
    :func:`detect_backend`."""
    return _env_backend() or detect_backend(device)


def detect_backend(device: torch.device | str | None = None) -> str:
    """The backend name the device calls for (no availability check).

    ``xla``/``neuron`` devices -> ``nki``; CUDA capability >= (10, 0) -> ``cuda-sm100``;
    (9, x) -> ``cuda-sm90``; otherwise ``torch``. ``device=None`` means the current CUDA device
    when CUDA is available, else the CPU.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type in ("xla", "neuron"):
        return "nki"
    if device.type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 10:
            return "cuda-sm100"
        if major == 9:
            return "cuda-sm90"
    return "torch"


def _unavailable_reason(name: str) -> str | None:
    _load_plugin(name)
    backend = _REGISTRY.get(name)
    if backend is None:
        module = _PLUGINS.get(name)
        why = _PLUGIN_ERRORS.get(module or "", "no such backend is registered")
        return why
    return backend.check()


def resolve_backend(
    requested: str | None = "auto", device: torch.device | str | None = None
) -> Backend:
    """Pick the backend to run.

    Args:
        requested: ``"auto"``/``None`` or a backend name. ``"auto"`` honours ``MOE_BWD_BACKEND``.
        device: the device the problem lives on (for auto-selection).
    Returns:
        The :class:`Backend`.
    Raises:
        ValueError: an unknown backend name.
        RuntimeError: an explicitly requested backend cannot run here (the message says why).
    """
    explicit = requested not in (None, "auto")
    name = requested if explicit else _env_backend()
    source = "requested" if explicit else f"set by {ENV_VAR}"
    if name is not None:
        known = set(BACKEND_NAMES) | set(_REGISTRY)
        if name not in known:
            raise ValueError(
                f"backend {name!r} ({source}) is unknown; choose one of {sorted(known)} or 'auto'"
            )
        reason = _unavailable_reason(name)
        if reason is not None:
            raise RuntimeError(f"backend {name!r} ({source}) cannot run here: {reason}")
        return _REGISTRY[name]
    preferred = detect_backend(device)
    reason = _unavailable_reason(preferred)
    if reason is None:
        return _REGISTRY[preferred]
    torch_backend = _REGISTRY["torch"]
    return replace(torch_backend, fallback_reason=f"{preferred} unavailable: {reason}")


def run_backward(problem: MoEBackwardProblem, backend: str | None = "auto", **options) -> MoEGrads:
    """Run the MoE expert-MLP backward on the selected backend (see :func:`resolve_backend`)."""
    chosen = resolve_backend(backend, problem.hidden_states_TH.device)
    grads = chosen.run(problem, **options)
    grads.info.setdefault("backend", chosen.name)
    if chosen.fallback_reason:
        grads.info.setdefault("fallback_reason", chosen.fallback_reason)
    return grads


def device_grouped_wgrad(device: torch.device | str) -> Callable | None:
    """The grouped wgrad kernel of the backend the device calls for, if it can run, else None."""
    name = detect_backend(device)
    if name == "torch" or _unavailable_reason(name) is not None:
        return None
    return _REGISTRY[name].grouped_wgrad


def _torch_run(problem: MoEBackwardProblem, **options) -> MoEGrads:
    from common.torch_backward import moe_backward_torch

    device = problem.hidden_states_TH.device
    if "grouped_wgrad" not in options and device.type == "cuda":
        kernel = device_grouped_wgrad(device)
        if kernel is not None:
            options["grouped_wgrad"] = kernel
    return moe_backward_torch(problem, **options)


def _register_builtins() -> None:
    from common.reference import reference_backward

    register_backend(
        Backend(
            name="reference",
            summary="float64 backward (common.reference) of the problem's inputs and BF16 "
            "forward checkpoint, any device; the BF16 checkpoint bounds it at ~47-52 dB "
            "against a float64 forward + backward (it is no float64 anchor)",
            check=lambda: None,
            run=lambda problem, **_: reference_backward(problem),
        )
    )
    register_backend(
        Backend(
            name="torch",
            summary="portable torch: BF16 operands, fp32 accumulation; on a GPU with a kernel "
            "of ours, wgrad runs on it",
            check=lambda: None,
            run=_torch_run,
        )
    )


_register_builtins()
