"""MoE layer shapes of published models, loaded from ``configs/models/*.yaml`` (the shipped YAML,
found by :mod:`common.config_files`).

Each YAML file describes one model's routed-expert layer (H, I, E, top_k, router, activation)
and cites the config.json it was read from. ``load_model("qwen3-30b-a3b")`` returns a frozen
:class:`MoEModelShape`; ``list_models()`` returns all of them sorted by name.

Dimensions (legend in ``common/shapes.py``): T tokens, H hidden, I expert intermediate,
E routed experts, K top_k.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config_files import config_path, load_yaml_file

__all__ = [
    "ACTIVATIONS",
    "AFFINITY_ON",
    "ROUTER_KINDS",
    "MoEModelShape",
    "list_models",
    "load_model",
    "load_model_file",
    "model_names",
]

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid")
ACTIVATIONS = ("swiglu", "swiglu_clamped")
AFFINITY_ON = ("output", "input")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")
# Granularity that shrink() keeps H and I at: one SBUF partition tile / one 128-wide MMA tile.
_SHRINK_MULTIPLE = 128


@dataclass(frozen=True)
class MoEModelShape:
    """Shape and routing of one model's routed-expert MoE layer.

    Attributes:
        name: lowercase id used on the CLI, e.g. ``"qwen3-30b-a3b"``.
        display_name: human name, e.g. ``"Qwen3-30B-A3B"``.
        hidden: H, model dimension.
        intermediate: I, per-expert intermediate size (``moe_intermediate_size``), full (no TP).
        experts: E, routed experts (shared experts not included).
        top_k: K, routed experts per token.
        shared_experts: number of always-active shared experts (their GEMMs are dense, not
            part of the routed backward).
        router: one of :data:`ROUTER_KINDS` (semantics in ``common/router_sim.py``).
        norm_topk_prob: top-k affinities renormalised to sum to 1.
        activation: ``"swiglu"`` (silu(g) * u) or ``"swiglu_clamped"`` (gpt-oss:
            ``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1)``).
        has_bias: experts carry gate/up and down biases.
        source_url: the config.json the numbers were read from.
        source_read: ISO date the source was read.
        routed_scaling_factor: multiplier on the routed affinities (DeepSeek-V3 2.5).
        n_group, topk_group: group-limited routing (DeepSeek-V3 8 / 4), 1 / 1 = none.
        shared_intermediate: total intermediate width of the shared experts (0 if none).
        swiglu_limit, swiglu_alpha: clamp limit and sigmoid slope of ``swiglu_clamped``.
        affinity_on: ``"output"`` (affinity scales the expert output; our kernels' math) or
            ``"input"`` (Llama 4 scales the expert input).
        yaml_path: file the shape was loaded from ("" for shapes built in code).
    """

    name: str
    display_name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    shared_experts: int
    router: str
    norm_topk_prob: bool
    activation: str
    has_bias: bool
    source_url: str
    source_read: str
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate: int = 0
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    affinity_on: str = "output"
    yaml_path: str = ""

    def __post_init__(self) -> None:
        _validate_shape(self, where=self.yaml_path or f"MoEModelShape({self.name!r})")

    # Letter aliases of the shape legend (common/shapes.py).
    @property
    def H(self) -> int:
        return self.hidden

    @property
    def I(self) -> int:
        return self.intermediate

    @property
    def E(self) -> int:
        return self.experts

    @property
    def K(self) -> int:
        return self.top_k

    def routed_rows(self, num_tokens: int) -> int:
        """R = T * K routed (token, expert) slots for T tokens."""
        _check_tokens(num_tokens)
        return num_tokens * self.top_k

    def flops_forward(self, num_tokens: int) -> int:
        """Routed-expert forward FLOPs, ``6 * T * K * H * I`` (REFERENCE §2: gate+up 4RHI,
        down 2RHI). Elementwise work and the router are not counted."""
        return 6 * self.routed_rows(num_tokens) * self.hidden * self.intermediate

    def flops_backward(self, num_tokens: int) -> int:
        """Routed-expert backward FLOPs, ``12 * T * K * H * I`` (REFERENCE §2: dgrad and wgrad
        of the three projections, 2RHI each)."""
        return 12 * self.routed_rows(num_tokens) * self.hidden * self.intermediate

    def flops_wgrad(self, num_tokens: int) -> int:
        """Weight-gradient share of the backward, ``6 * T * K * H * I`` (dW_gate, dW_up, dW_down)."""
        return 6 * self.routed_rows(num_tokens) * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """Parameters of the E routed experts: ``E * 3 * H * I`` (+ ``E * (2I + H)`` biases)."""
        n = self.experts * 3 * self.hidden * self.intermediate
        if self.has_bias:
            n += self.experts * (2 * self.intermediate + self.hidden)
        return n

    def weight_bytes(self, bytes_per_element: float = 2.0) -> int:
        """Bytes of the routed experts' weights at ``bytes_per_element`` (2 = BF16)."""
        if not (bytes_per_element > 0):
            raise ValueError(
                f"weight_bytes: bytes_per_element must be > 0, got {bytes_per_element}"
            )
        return math.ceil(self.expert_params * bytes_per_element)

    def is_aligned(self, multiple: int) -> bool:
        """True when both H and I are multiples of ``multiple`` (e.g. 32 for MX blocks, 128)."""
        if multiple < 1:
            raise ValueError(f"is_aligned: multiple must be >= 1, got {multiple}")
        return self.hidden % multiple == 0 and self.intermediate % multiple == 0

    def expert_activation(self):
        """``(Activation, ClampLimits | None)`` of this model's experts: the one mapping from the
        YAML's ``activation`` to :mod:`common.problem` (the layer, the CLI and the inputs all
        read it). ``swiglu_clamped`` (gpt-oss) -> ``Activation("gpt_oss", alpha=swiglu_alpha,
        up_offset=1.0)`` with :attr:`clamp_limits`; ``swiglu`` -> SwiGLU, no clamp."""
        from common.problem import SWIGLU, Activation, ClampLimits

        if self.activation == "swiglu_clamped":
            act = Activation("gpt_oss", alpha=self.swiglu_alpha, up_offset=1.0)
            return act, ClampLimits(**self.clamp_limits)
        return SWIGLU, None

    @property
    def clamp_limits(self) -> dict[str, float | None] | None:
        """Clamp limits in AWS's field names (``common.problem.ClampLimits``), or None.

        ``non_linear_*`` is the gate, ``linear_*`` the up projection. Only ``swiglu_clamped``
        clamps: gate above at ``swiglu_limit``, up to ``[-swiglu_limit, swiglu_limit]``. Note the
        clamped activation itself (alpha, +1 on up) is not the plain SiLU of the MXFP8 kernel.
        """
        if self.activation != "swiglu_clamped":
            return None
        return {
            "linear_clamp_upper_limit": self.swiglu_limit,
            "linear_clamp_lower_limit": -self.swiglu_limit,
            "non_linear_clamp_upper_limit": self.swiglu_limit,
            "non_linear_clamp_lower_limit": None,
        }

    def scaled(
        self, *, hidden: int | None = None, intermediate: int | None = None, name: str | None = None
    ) -> MoEModelShape:
        """Copy with another H and/or I (same E, top_k, router, activation), for tests.

        Raises:
            ValueError: non-positive sizes.
        """
        hidden = self.hidden if hidden is None else hidden
        intermediate = self.intermediate if intermediate is None else intermediate
        if name is None:
            name = f"{self.name}@h{hidden}-i{intermediate}"
        return dataclasses.replace(
            self, hidden=hidden, intermediate=intermediate, name=name, yaml_path=""
        )

    def shrink(self, factor: int) -> MoEModelShape:
        """Copy with H and I divided by ``factor``, rounded to the nearest multiple of 128 (at
        least 128); E, top_k and routing unchanged. For the NKI interpreter and CPU tests, where
        full H and I are too slow. ``shrink(1)`` is the identity (returns ``self`` unchanged, no
        rounding): the same as ``moe-bwd run`` without ``--shrink``.

        Raises:
            ValueError: ``factor`` not an int >= 1.
        """
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(f"shrink: factor must be an int >= 1, got {factor!r}")
        if factor == 1:
            return self

        def _round(n: int) -> int:
            m = _SHRINK_MULTIPLE
            return max(m, math.floor(n / factor / m + 0.5) * m)

        return self.scaled(
            hidden=_round(self.hidden),
            intermediate=_round(self.intermediate),
            name=f"{self.name}/{factor}",
        )


def _check_tokens(num_tokens: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _validate_shape(s: MoEModelShape, where: str) -> None:
    """Raise ValueError naming ``where`` and the field for any rule a shape breaks."""

    def bad(field: str, rule: str, value: Any) -> ValueError:
        return ValueError(f"{where}: field {field!r} {rule}, got {value!r}")

    if not isinstance(s.name, str) or not _NAME_RE.match(s.name.split("/")[0].split("@")[0]):
        raise bad("name", "must be a lowercase id of [a-z0-9.-]", s.name)
    if not isinstance(s.display_name, str) or not s.display_name:
        raise bad("display_name", "must be a non-empty string", s.display_name)
    for field in ("hidden", "intermediate", "experts", "top_k"):
        v = getattr(s, field)
        if not _is_int(v) or v < 1:
            raise bad(field, "must be an int >= 1", v)
    if s.top_k > s.experts:
        raise bad("top_k", f"must be <= experts ({s.experts})", s.top_k)
    for field in ("shared_experts", "shared_intermediate"):
        v = getattr(s, field)
        if not _is_int(v) or v < 0:
            raise bad(field, "must be an int >= 0", v)
    if (s.shared_experts == 0) != (s.shared_intermediate == 0):
        raise bad(
            "shared_intermediate",
            "must be > 0 exactly when shared_experts > 0",
            s.shared_intermediate,
        )
    if s.router not in ROUTER_KINDS:
        raise bad("router", f"must be one of {ROUTER_KINDS}", s.router)
    for field in ("norm_topk_prob", "has_bias"):
        if not isinstance(getattr(s, field), bool):
            raise bad(field, "must be true or false", getattr(s, field))
    if s.activation not in ACTIVATIONS:
        raise bad("activation", f"must be one of {ACTIVATIONS}", s.activation)
    if s.activation == "swiglu_clamped":
        for field in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(s, field)
            if not _is_real(v) or v <= 0:
                raise bad(field, "must be a number > 0 for activation swiglu_clamped", v)
    else:
        for field in ("swiglu_limit", "swiglu_alpha"):
            if getattr(s, field) is not None:
                raise bad(
                    field, "is only allowed with activation swiglu_clamped", getattr(s, field)
                )
    if not _is_real(s.routed_scaling_factor) or s.routed_scaling_factor <= 0:
        raise bad("routed_scaling_factor", "must be a number > 0", s.routed_scaling_factor)
    for field in ("n_group", "topk_group"):
        v = getattr(s, field)
        if not _is_int(v) or v < 1:
            raise bad(field, "must be an int >= 1", v)
    if s.experts % s.n_group != 0:
        raise bad("n_group", f"must divide experts ({s.experts})", s.n_group)
    if s.topk_group > s.n_group:
        raise bad("topk_group", f"must be <= n_group ({s.n_group})", s.topk_group)
    if s.router != "sigmoid_topk" and s.n_group != 1:
        raise bad("n_group", "must be 1 unless router is sigmoid_topk", s.n_group)
    if s.top_k > s.topk_group * (s.experts // s.n_group):
        raise bad("top_k", "must be <= topk_group * experts / n_group", s.top_k)
    if s.affinity_on not in AFFINITY_ON:
        raise bad("affinity_on", f"must be one of {AFFINITY_ON}", s.affinity_on)
    if not isinstance(s.source_url, str) or not s.source_url.startswith("https://"):
        raise bad("source.url", "must be an https:// URL", s.source_url)
    try:
        datetime.date.fromisoformat(s.source_read)
    except (TypeError, ValueError):
        raise bad("source.read", "must be an ISO date YYYY-MM-DD", s.source_read) from None


_REQUIRED = (
    "name",
    "display_name",
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "shared_experts",
    "router",
    "norm_topk_prob",
    "activation",
    "has_bias",
    "source",
)
_OPTIONAL = (
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "shared_intermediate",
    "swiglu_limit",
    "swiglu_alpha",
    "affinity_on",
)


def load_model_file(path: str | Path) -> MoEModelShape:
    """Load and validate one model YAML file.

    Args:
        path: a YAML file with the fields of :class:`MoEModelShape` (``source`` as a mapping
            with ``url`` and ``read``); its stem must equal its ``name``.

    Returns:
        The :class:`MoEModelShape`.

    Raises:
        ValueError: unreadable YAML, a missing / unknown / ill-typed field; the message names
            the file and the field.
    """
    path = Path(path)
    where = str(path)
    try:
        data = load_yaml_file(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: cannot read model YAML: {exc}") from exc
    return _shape_from_mapping(data, where, stem=path.stem)


def _shape_from_mapping(data: Any, where: str, stem: str | None = None) -> MoEModelShape:
    if not isinstance(data, dict):
        msg = f"{where}: model YAML must be a mapping of fields, got {type(data).__name__}"
        raise ValueError(msg)
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown}; allowed: {list(_REQUIRED) + list(_OPTIONAL)}"
        )
    source = data["source"]
    if not isinstance(source, dict) or set(source) != {"url", "read"}:
        raise ValueError(
            f"{where}: field 'source' must be a mapping with exactly 'url' and "
            f"'read', got {source!r}"
        )
    read = source["read"]
    if isinstance(read, datetime.date):
        read = read.isoformat()
    kwargs = {k: data[k] for k in _REQUIRED if k != "source"}
    kwargs.update({k: data[k] for k in _OPTIONAL if k in data})
    for k in ("routed_scaling_factor", "swiglu_limit", "swiglu_alpha"):
        if _is_int(kwargs.get(k)):
            kwargs[k] = float(kwargs[k])
    shape = MoEModelShape(
        **kwargs, source_url=source["url"], source_read=str(read), yaml_path=where
    )
    if stem is not None and shape.name != stem:
        raise ValueError(
            f"{where}: field 'name' ({shape.name!r}) must equal the file name stem ({stem!r})"
        )
    return shape


def _models_dir() -> Path:
    return config_path("models")


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, MoEModelShape]:
    shapes: dict[str, MoEModelShape] = {}
    for entry in sorted(_models_dir().iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yaml"):
            continue
        where = f"configs/models/{entry.name}"
        try:
            data = load_yaml_file(entry)
        except ValueError as exc:
            raise ValueError(f"{where}: cannot parse model YAML: {exc}") from exc
        shape = _shape_from_mapping(data, where, stem=entry.name[: -len(".yaml")])
        shapes[shape.name] = shape
    if not shapes:
        raise RuntimeError(
            f"no model YAML files found in {_models_dir()} (is the package installed with "
            "its package data?)"
        )
    return shapes


def model_names() -> list[str]:
    """Sorted names of the models shipped in ``configs/models/``."""
    return sorted(_registry())


def list_models() -> list[MoEModelShape]:
    """All shipped model shapes, sorted by name.

    Raises:
        ValueError: a shipped YAML file is malformed (names the file and field).
    """
    reg = _registry()
    return [reg[n] for n in sorted(reg)]


def load_model(name: str) -> MoEModelShape:
    """The shape of a shipped model by its CLI name (case-insensitive), e.g. ``"deepseek-v3"``.

    Raises:
        ValueError: unknown name (the message lists the known names), or a malformed YAML file.
    """
    if not isinstance(name, str):
        msg = f"load_model: name must be a str, got {type(name).__name__}"
        raise ValueError(msg)
    reg = _registry()
    key = name.strip().lower()
    if key not in reg:
        raise ValueError(f"load_model: unknown model {name!r}; known models: {sorted(reg)}")
    return reg[key]
