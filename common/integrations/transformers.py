"""Hugging Face transformers' experts modules on our layer: the ``ExpertsInterface`` backend
``"moe_bwd"``.

transformers >= 5 dispatches every ``@use_experts_implementation`` experts module (Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, gpt-oss, ...) to the function registered under
``config._experts_implementation``. :func:`register` adds ours::

    from common.integrations.transformers import register
    register()                                   # once per process, imports transformers
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_bwd")
    # or model.set_experts_implementation("moe_bwd")

Each call runs :func:`common.layer.moe_experts` (forward and backward by
:mod:`common.dispatch`, backend "auto": the fused SM90/SM100 path on a Hopper/Blackwell GPU, the
portable torch path on the CPU) on the module's own parameters, as strided VIEWS (never a
copy made here; gradients flow back through the views into the parameters' own layout):

* ``gate_up_proj`` [E, 2I, H] gate/up halves (Qwen, Mixtral, OLMoE, DeepSeek, ...):
  ``.view(E, 2, I, H).permute(0, 3, 1, 2)``; ``down_proj`` [E, H, I]: ``.transpose(1, 2)``;
* ``is_transposed`` [E, H, 2I] halves: ``.view(E, H, 2, I)``; ``down_proj`` [E, I, H] as is;
* ``is_transposed`` [E, H, 2I] interleaved (gpt-oss): ``.view(E, H, I, 2).transpose(2, 3)``.

Biases ``gate_up_proj_bias`` [E, 2I] / ``down_proj_bias`` [E, H] the same way. Which of these
views reach the GPU kernels without a copy: ``docs/huggingface.md``.

Routing: ``top_k_index`` [T, K] (ids >= E are expert-parallel sentinels: they become dropped
slots, -1, and contribute nothing), ``top_k_weights`` [T, K] or dense [T, E] (DeepSeek-V2
style; gathered at the ids). The activation comes from the module (:func:`experts_spec`):
``act_fn(gate) * up`` with a SiLU ``act_fn`` is SwiGLU; the ``_apply_gate`` overrides of
:data:`GATES` map to our clamped SwiGLU / gpt-oss activation. Anything else (non-gated experts,
another activation, an unknown ``_apply_gate``) raises ValueError naming the module class, the
model family and what is unsupported, before any work. There is no silent fallback to
transformers' own implementation: choose ``"grouped_mm"`` for such models.

Llama 4's experts are outside transformers' interface: :func:`use_for_llama4`.

Importing this module does not import transformers; :func:`register` does.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from common.layer import MoEExpertsOptions, moe_experts
from common.problem import SWIGLU, Activation, ClampLimits

__all__ = ["EXPERTS_IMPLEMENTATION", "GATES", "ExpertsSpec", "experts_forward", "experts_spec",
           "layer_weights", "register", "use_for_llama4"]

EXPERTS_IMPLEMENTATION = "moe_bwd"
"""The name :func:`register` registers by default (``experts_implementation="moe_bwd"``)."""

GATES = {
    # defining class's ``_apply_gate`` -> (form, alpha attribute, clamp-limit attribute)
    "GptOssExperts": ("gpt_oss", "alpha", "limit"),
    "OpenAIPrivacyFilterExperts": ("gpt_oss", "alpha", "limit"),
    "MiniMaxM3VLExperts": ("gpt_oss", "swiglu_alpha", "swiglu_limit"),
    "DeepseekV4Experts": ("silu_clamped", None, "limit"),
    "HYV4Experts": ("silu_clamped", None, "swiglu_limit"),
    "Glm5NextTextExperts": ("silu_clamped", None, "swiglu_limit"),
}
"""transformers' ``_apply_gate`` overrides we compute, by the name of the class defining it:
``"gpt_oss"`` = ``(clamp(up, -L, L) + 1) * g * sigmoid(alpha g)`` with ``g = clamp(gate,
max=L)`` (our ``Activation("gpt_oss", alpha, 1)``); ``"silu_clamped"`` = ``act_fn(clamp(gate,
max=L)) * clamp(up, -L, L)`` with a SiLU ``act_fn``. Overrides not listed (e.g. Step-3.7's,
which clamps after the activation) raise ValueError."""


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
    """What :func:`experts_spec` reads off one experts module: the weights' layout flags and
    the activation the layer computes for it."""

    transposed: bool
    interleaved: bool
    bias: bool
    activation: Activation
    clamp_limits: ClampLimits | None


def _silu_classes() -> tuple[type, ...]:
    from transformers.activations import SiLUActivation

    return (torch.nn.SiLU, SiLUActivation)


def _unsupported(module, what: str) -> ValueError:
    family = getattr(getattr(module, "config", None), "model_type", "unknown")
    return ValueError(
        f"experts_implementation={EXPERTS_IMPLEMENTATION!r} cannot run {type(module).__name__} "
        f"(model family {family!r}): {what}. Use experts_implementation='grouped_mm' (or "
        "'eager') for this model."
    )


def _is_silu(act_fn) -> bool:
    return isinstance(act_fn, _silu_classes())


def _gate_owner(cls: type) -> str | None:
    """Name of the class whose ``_apply_gate`` the experts class runs; None for transformers'
    default ``act_fn(gate) * up`` (``integrations.moe._default_apply_gate``)."""
    for klass in cls.__mro__:
        if "_apply_gate" in vars(klass):
            fn = vars(klass)["_apply_gate"]
            return None if getattr(fn, "__name__", "") == "_default_apply_gate" else klass.__name__
    return None


def _clamped_activation(alpha: float | None, limit: float | None):
    """``(Activation, ClampLimits | None)`` of a :data:`GATES` form: gpt-oss's with ``alpha``,
    else SwiGLU; the gate clamped above and up to [-limit, limit]."""
    act = SWIGLU if alpha is None else Activation("gpt_oss", alpha=alpha, up_offset=1.0)
    if limit is None:
        return act, None
    return act, ClampLimits(linear_clamp_upper_limit=limit, linear_clamp_lower_limit=-limit,
                            non_linear_clamp_upper_limit=limit)


def experts_spec(module) -> ExpertsSpec:
    """The layout and activation of a transformers experts module, or ValueError.

    Raises:
        ValueError: naming the module class, the model family (``config.model_type``) and the
            reason: non-gated experts (``has_gate=False``), an ``act_fn`` that is not SiLU, an
            ``_apply_gate`` we do not compute (not in :data:`GATES`), a default gate on an
            interleaved layout, or missing weights.
    """
    if not getattr(module, "has_gate", True):
        raise _unsupported(module, "non-gated experts (has_gate=False, up_proj only) are not "
                                   "computed by this layer, which is a gated (GLU) expert MLP")
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise _unsupported(module, f"it has no 3-D {name} tensor")
    interleaved = not getattr(module, "is_concatenated", True)
    owner = _gate_owner(type(module))
    clamp = None
    if owner is None:
        act_fn = getattr(module, "act_fn", None)
        if not _is_silu(act_fn):
            hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
            raise _unsupported(module, f"activation {type(act_fn).__name__} (config.hidden_act "
                                       f"{hidden_act!r}): only SiLU-gated experts (SwiGLU) are "
                                       "computed")
        if interleaved:
            raise _unsupported(module, "an interleaved gate/up layout with the default "
                                       "(halves-splitting) _apply_gate")
        activation = SWIGLU
    elif owner in GATES:
        form, alpha_attr, limit_attr = GATES[owner]
        if form != "gpt_oss":
            act_fn = getattr(module, "act_fn", None)  # None: F.silu in the gate (HY-V4, GLM-5)
            if act_fn is not None and not _is_silu(act_fn):
                raise _unsupported(module, f"activation {type(act_fn).__name__}: only SiLU")
        alpha = float(getattr(module, alpha_attr)) if form == "gpt_oss" else None
        limit = getattr(module, limit_attr, None)
        activation, clamp = _clamped_activation(alpha, None if limit is None else float(limit))
    else:
        raise _unsupported(module, f"its gate {owner}._apply_gate is not one this layer computes "
                                   f"(computed: the default SiLU gate and {sorted(GATES)})")
    return ExpertsSpec(bool(getattr(module, "is_transposed", False)), interleaved,
                       bool(getattr(module, "has_bias", False)), activation, clamp)


def layer_weights(module, spec: ExpertsSpec | None = None):
    """``(w_gate_up_EH2I, w_down_EIH, b_gate_up_E2I, b_down_EH)``: the module's parameters as
    the layer's [E, H, 2, I], [E, I, H], [E, 2, I], [E, H] VIEWS (no copy; writing into them
    writes the parameters; biases None without ``has_bias``). ``spec`` default
    :func:`experts_spec` (ValueError for a module we cannot compute)."""
    spec = experts_spec(module) if spec is None else spec
    gu, down = module.gate_up_proj, module.down_proj
    E = gu.shape[0]
    if spec.transposed:  # [E, H, 2I], [E, I, H]
        H, I = gu.shape[1], gu.shape[2] // 2
        w_gu = gu.view(E, H, I, 2).transpose(2, 3) if spec.interleaved else gu.view(E, H, 2, I)
        w_down = down
    else:  # [E, 2I, H], [E, H, I]
        H, I = gu.shape[2], gu.shape[1] // 2
        w_gu = (gu.view(E, I, 2, H).permute(0, 3, 2, 1) if spec.interleaved
                else gu.view(E, 2, I, H).permute(0, 3, 1, 2))
        w_down = down.transpose(1, 2)
    b_gu = b_down = None
    if spec.bias:
        b = module.gate_up_proj_bias
        b_gu = b.view(E, I, 2).transpose(1, 2) if spec.interleaved else b.view(E, 2, I)
        b_down = module.down_proj_bias
    return w_gu, w_down, b_gu, b_down


_BASES: list = [MoEExpertsOptions()]
"""The layer settings :func:`register` was given (index 0: the defaults)."""
_SETUPS: list = []
"""``(ExpertsSpec, MoEExpertsOptions)`` per (module spec, settings), built once."""
_SETUP_INDEX: dict = {}


@torch.compiler.assume_constant_result
def _setup_index(module, base_index: int) -> int:
    """Index into :data:`_SETUPS` of the module's spec and the layer's options. Evaluated
    eagerly while torch.compile traces (its result a constant): the spec reads module
    attributes (floats a dynamic-shape trace would make symbolic) and the options register
    their op key, neither traceable. The module's flags are not guarded: set them before
    compiling."""
    spec = experts_spec(module)
    key = (spec, base_index)
    index = _SETUP_INDEX.get(key)
    if index is None:
        opts = dataclasses.replace(_BASES[base_index], activation=spec.activation,
                                   clamp_limits=spec.clamp_limits)
        index = _SETUP_INDEX[key] = len(_SETUPS)
        _SETUPS.append((spec, opts))
    return index


def _base_index(base: MoEExpertsOptions) -> int:
    if base not in _BASES:
        _BASES.append(base)
    return _BASES.index(base)


def experts_forward(
    module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    base_options: MoEExpertsOptions | None = None,
) -> torch.Tensor:
    """One experts module's forward on our layer (what ``"moe_bwd"`` runs).

    Dimensions: T tokens, H hidden, E experts (``module.num_experts`` or the weights'), K top_k.

    Args:
        module: a transformers ``@use_experts_implementation`` experts module.
        hidden_states: [..., H] float (flattened to [T, H]).
        top_k_index: [T, K] int, expert id per slot; ids >= E (expert-parallel sentinels) and
            -1 are dropped slots.
        top_k_weights: [T, K] float routing weights, or [T, E] dense ones (gathered at the ids).
        base_options: the layer's settings (backend, grouped_mm, validate_routing); the
            activation and clamp limits come from the module. Default ``MoEExpertsOptions()``.
    Returns:
        [..., H] in ``hidden_states.dtype``.
    Raises:
        ValueError: a module we cannot compute (:func:`experts_spec`) or a bad argument of the
            layer (named), before any work.
    """
    base = 0 if base_options is None else _base_index(base_options)
    return _experts_forward(module, hidden_states, top_k_index, top_k_weights, base_index=base)


def _experts_forward(module, hidden_states, top_k_index, top_k_weights, *, base_index: int = 0):
    spec, opts = _SETUPS[_setup_index(module, base_index)]
    w_gu, w_down, b_gu, b_down = layer_weights(module, spec)
    E = w_gu.shape[0]
    x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
    idx_TK = top_k_index.reshape(-1, top_k_index.shape[-1])
    weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
    if weights.shape[1] != idx_TK.shape[1] and weights.shape[1] == E:  # dense [T, E]
        weights = weights.gather(1, idx_TK.clamp(0, E - 1))
    idx_TK = torch.where(idx_TK >= E, -1, idx_TK)  # expert-parallel sentinels: dropped
    y_TH = moe_experts(x_TH, idx_TK, weights, w_gu, w_down, b_gu, b_down, options=opts)
    return y_TH.view(hidden_states.shape)


# ------------------------------------------------------------------------------------ Llama 4
def use_for_llama4(model, *, base_options: MoEExpertsOptions | None = None) -> int:
    """Run the routed experts of every ``Llama4TextMoe`` block of ``model`` on our layer.

    transformers' Llama 4 experts are not an ``@use_experts_implementation`` module (5.17): the
    ``experts_implementation`` setting does not reach them. This replaces each block's forward
    (on the instance; the router and the shared expert run unchanged). Llama 4 scales the
    expert INPUT by its sigmoid router score, ``sum_k MLP_e(a_k x)``; the layer takes those K
    scaled rows as [T*K, H] tokens routed to one expert each with affinity 1 (top_k is 1 in the
    published models, so no row is added), which is exact: the experts have no bias.

    Returns:
        the number of blocks switched.
    Raises:
        ValueError: an experts ``act_fn`` that is not SiLU (named), before any block changes.
    """
    import types

    blocks = [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"]
    for block in blocks:
        if not _is_silu(block.experts.act_fn):
            raise _unsupported(block.experts, f"activation {type(block.experts.act_fn).__name__}"
                                              ": only SiLU-gated experts (SwiGLU) are computed")
    for block in blocks:
        base = _BASES[0] if base_options is None else base_options
        block._moe_bwd_options = dataclasses.replace(base, activation=SWIGLU, clamp_limits=None)
        block.forward = types.MethodType(_llama4_moe_forward, block)
    return len(blocks)


_LLAMA4_SPEC = ExpertsSpec(transposed=True, interleaved=False, bias=False, activation=SWIGLU,
                           clamp_limits=None)


def _llama4_moe_forward(self, hidden_states):
    x_TH = hidden_states.reshape(-1, self.hidden_dim)
    scores_TE, logits_TE = self.router(x_TH)
    idx_TK = torch.topk(logits_TE, self.top_k, dim=1).indices  # the router's own choice
    a_TK = scores_TE.gather(1, idx_TK).to(x_TH.dtype)
    T, K = idx_TK.shape
    x_RH = (x_TH[:, None, :] * a_TK[..., None]).reshape(T * K, -1)
    w_gu, w_down, _, _ = layer_weights(self.experts, _LLAMA4_SPEC)
    ones_R1 = x_RH.new_ones(T * K, 1)
    y_RH = moe_experts(x_RH, idx_TK.reshape(T * K, 1), ones_R1, w_gu, w_down,
                       options=self._moe_bwd_options)
    out = self.shared_expert(x_TH) + y_RH.view(T, K, -1).sum(1)
    return out, logits_TE


def register(
    name: str = EXPERTS_IMPLEMENTATION,
    *,
    backend: str = "auto",
    grouped_mm: str = "auto",
    validate_routing: str | bool = "device",
) -> None:
    """Register our layer in transformers' ``ExpertsInterface`` under ``name``.

    After it, ``from_pretrained(..., experts_implementation=name)``, ``from_config(...,
    experts_implementation=name)`` and ``model.set_experts_implementation(name)`` run every
    experts module of the model on :func:`experts_forward`. Calling it again replaces the
    settings. Imports transformers (>= 5).

    Args:
        name: the implementation name (default ``"moe_bwd"``).
        backend, grouped_mm, validate_routing: as :class:`common.layer.MoEExpertsOptions`.
    Raises:
        ValueError: a bad setting, or ``name`` is one of transformers' own implementations
            (``"eager"``, ``"grouped_mm"``, ...: replacing one would make a comparison against
            it compare ours with ours).  ImportError: transformers (with ``ExpertsInterface``)
            is not installed.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    base = MoEExpertsOptions(backend=backend, grouped_mm=grouped_mm,
                             validate_routing=validate_routing)
    from transformers.integrations.moe import ExpertsInterface

    mapping = getattr(ExpertsInterface, "_global_mapping", {})
    theirs = sorted({"eager"} | {k for k, f in mapping.items()
                                 if getattr(f, "func", None) is not _experts_forward})
    if name in theirs:
        raise ValueError(
            f"name={name!r} is already an experts implementation of transformers ({theirs}); "
            f"register ours under another name (default {EXPERTS_IMPLEMENTATION!r})"
        )

    _silu_classes()  # imported now, not while torch.compile traces a forward
    # the settings as an int bound now: nothing to look up while torch.compile traces
    fn = functools.partial(_experts_forward, base_index=_base_index(base))
    ExpertsInterface.register(name, fn)
