"""Backend-neutral containers for one MoE expert-MLP backward problem and its gradients.

Every backend (float64 reference, portable torch, NKI, CUDA) takes a :class:`MoEBackwardProblem`
and returns :class:`MoEGrads`, so the command line and the tests compare them cell by cell.
Dimension letters: see :mod:`common.shapes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from common.routing import RoutingPlan

__all__ = [
    "GPT_OSS", "SWIGLU", "Activation", "ClampLimits", "MoEBackwardProblem", "MoEGrads",
    "shape_text",
]


def _clamp(v: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    return v if lo is None and hi is None else v.clamp(min=lo, max=hi)


def _strict_mask(v: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    m = torch.ones_like(v, dtype=torch.bool)
    if lo is not None:
        m &= v > lo
    if hi is not None:
        m &= v < hi
    return m


@dataclass(frozen=True)
class ClampLimits:
    """Clamp limits of the SwiGLU pre-activations, with AWS nki-library's field names.

    ``non_linear_*`` limits apply to the gate pre-activation g, ``linear_*`` limits to the up
    pre-activation u (REFERENCE §2). ``None`` means no limit on that side. The forward clamps
    the value; the backward masks the gradient to 0 where the stored (clamped) value is not
    strictly inside (lower, upper). Choose limits representable in the checkpoint's dtype (7.0
    is exact in BF16, 0.7 is not): the stored value of a clamped element is the limit rounded to
    that dtype, and the strict test against an unrepresentable limit would let its gradient pass
    (as it would on Trainium, which tests the stored value the same way).
    """

    linear_clamp_upper_limit: float | None = None
    linear_clamp_lower_limit: float | None = None
    non_linear_clamp_upper_limit: float | None = None
    non_linear_clamp_lower_limit: float | None = None

    def __post_init__(self) -> None:
        for side in ("linear", "non_linear"):
            lo = getattr(self, f"{side}_clamp_lower_limit")
            hi = getattr(self, f"{side}_clamp_upper_limit")
            for name, v in ((f"{side}_clamp_lower_limit", lo), (f"{side}_clamp_upper_limit", hi)):
                if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
                    raise ValueError(
                        f"ClampLimits.{name} must be a finite number or None, got {v!r}"
                    )
            if lo is not None and hi is not None and not lo < hi:
                raise ValueError(
                    f"ClampLimits: {side}_clamp_lower_limit ({lo}) must be < "
                    f"{side}_clamp_upper_limit ({hi})"
                )

    def clamp_gate(self, g: torch.Tensor) -> torch.Tensor:
        """The forward clamp of the gate pre-activation (``non_linear_*`` limits)."""
        return _clamp(g, self.non_linear_clamp_lower_limit, self.non_linear_clamp_upper_limit)

    def clamp_up(self, u: torch.Tensor) -> torch.Tensor:
        """The forward clamp of the up pre-activation (``linear_*`` limits)."""
        return _clamp(u, self.linear_clamp_lower_limit, self.linear_clamp_upper_limit)

    def gate_mask(self, g: torch.Tensor) -> torch.Tensor:
        """Bool mask, True where the stored gate lies strictly inside its limits (REFERENCE §2)."""
        return _strict_mask(g, self.non_linear_clamp_lower_limit, self.non_linear_clamp_upper_limit)

    def up_mask(self, u: torch.Tensor) -> torch.Tensor:
        """Bool mask, True where the stored up value lies strictly inside its limits."""
        return _strict_mask(u, self.linear_clamp_lower_limit, self.linear_clamp_upper_limit)

    @property
    def clamps_gate(self) -> bool:
        """Whether the gate has a limit (``non_linear_*``)."""
        return (self.non_linear_clamp_lower_limit, self.non_linear_clamp_upper_limit) != (
            None, None
        )

    @property
    def clamps_up(self) -> bool:
        """Whether the up value has a limit (``linear_*``)."""
        return (self.linear_clamp_lower_limit, self.linear_clamp_upper_limit) != (None, None)

    @property
    def is_active(self) -> bool:
        return any(
            v is not None
            for v in (
                self.linear_clamp_upper_limit,
                self.linear_clamp_lower_limit,
                self.non_linear_clamp_upper_limit,
                self.non_linear_clamp_lower_limit,
            )
        )

    def __repr__(self) -> str:  # AWS's compact repr, handy in test ids
        return (
            f"linear_{self.linear_clamp_lower_limit}_{self.linear_clamp_upper_limit}"
            f"_non_linear_{self.non_linear_clamp_lower_limit}_{self.non_linear_clamp_upper_limit}"
        )


@dataclass(frozen=True)
class Activation:
    """The gated activation of the expert MLP: ``h = g * sigmoid(alpha * g) * (u + up_offset)``.

    g and u are the (clamped) gate and up pre-activations. SwiGLU (``silu(g) * u``) is
    ``alpha=1, up_offset=0``; gpt-oss (openai/gpt-oss ``gpt_oss/torch/model.py``, ``swiglu``) is
    ``alpha=1.702, up_offset=1`` with its clamp limits given separately as :class:`ClampLimits`.
    Derivatives (s = sigmoid(alpha * g)): ``dh/dg = (u + up_offset) * s * (1 + alpha * g * (1 - s))``,
    ``dh/du = g * s``. Their one torch definition is :mod:`common.activation`.

    Attributes:
        name: ``"swiglu"`` or ``"gpt_oss"`` (display and YAML name).
        alpha: sigmoid slope (finite, > 0).
        up_offset: added to the clamped up value (finite).
    """

    name: str = "swiglu"
    alpha: float = 1.0
    up_offset: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Activation.name must be a non-empty str, got {self.name!r}")
        a = self.alpha
        if not (isinstance(a, (int, float)) and math.isfinite(a) and a > 0):
            raise ValueError(f"Activation.alpha must be a finite number > 0, got {a!r}")
        o = self.up_offset
        if not (isinstance(o, (int, float)) and math.isfinite(o)):
            raise ValueError(f"Activation.up_offset must be a finite number, got {o!r}")

    @property
    def is_swiglu(self) -> bool:
        """True for plain SwiGLU (alpha 1, no up offset): the only form the NKI kernel computes."""
        return self.alpha == 1.0 and self.up_offset == 0.0

    @staticmethod
    def resolve(activation: Activation | None) -> Activation:
        """``activation``, or SwiGLU for None.

        Raises:
            ValueError: anything else.
        """
        if activation is None:
            return SWIGLU
        if not isinstance(activation, Activation):
            raise ValueError(
                f"activation must be an Activation or None, got {type(activation).__name__}"
            )
        return activation



SWIGLU = Activation("swiglu")
GPT_OSS = Activation("gpt_oss", alpha=1.702, up_offset=1.0)


@dataclass
class MoEBackwardProblem:
    """Inputs of the expert-MLP backward for one MoE layer.

    Args:
        hidden_states_TH: [T, H] float (BF16 in training), the layer input X.
        output_grad_TH: [T, H] float, dY, the gradient of the layer output.
        w_gate_up_EH2I: [E, H, 2, I] float, gate (index 0) and up (index 1) projections.
        w_down_EIH: [E, I, H] float, down projection.
        plan: the :class:`~common.routing.RoutingPlan` of the router output.
        act_checkpoint_R2I: [R, 2, I] float, the forward's clamped gate/up pre-activations of each
            (token, expert) pair in the plan's PAIR order (``plan.pair_token_R`` /
            ``plan.pair_expert_R``: sorted by expert, then token), not in router-slot order; rows
            of padding pairs (index >= ``plan.num_pairs``) are arbitrary and may hold NaN.
            :func:`common.torch_backward.moe_forward_checkpoint_torch` and
            :func:`common.reference.reference_forward` produce it; to convert a slot-order
            ``act_TK2I`` use ``plan.pairs_from_slots(act_TK2I)``. The fused CUDA backward
            (:func:`cuda_kernels.moe.moe_backward_fused`, given the forward's grouped layout)
            also takes the checkpoint in that layout's grouped ROW order, ``[S, 2I]``: row s
            holds g, u of its own pair in the gate/up weight matrix's column order -- the gate/up
            GEMM's output, which the layer's CUDA forward keeps as the checkpoint where there is
            no gate/up bias and no clamp (:func:`common.torch_backward.checkpoint_pairs`
            converts it); every other backend raises ValueError on that form.
        b_gate_up_E2I: optional [E, 2, I] gate/up biases.
        b_down_EH: optional [E, H] down bias.
        clamp_limits: optional :class:`ClampLimits`.
        activation: the :class:`Activation` (default SwiGLU; gpt-oss models use ``GPT_OSS``).
    """

    hidden_states_TH: torch.Tensor
    output_grad_TH: torch.Tensor
    w_gate_up_EH2I: torch.Tensor
    w_down_EIH: torch.Tensor
    plan: RoutingPlan
    act_checkpoint_R2I: torch.Tensor
    b_gate_up_E2I: torch.Tensor | None = None
    b_down_EH: torch.Tensor | None = None
    clamp_limits: ClampLimits | None = None
    activation: Activation = SWIGLU

    @property
    def has_bias(self) -> bool:
        return self.b_gate_up_E2I is not None or self.b_down_EH is not None

    def validate(self, *, checkpoint_rows: bool = False) -> None:
        """Check shapes, dtypes, devices and the plan against each other. ``checkpoint_rows``:
        the caller also reads a grouped-row checkpoint ``[S, 2I]`` (S >= R; the caller checks S
        against its layout), else only ``[R, 2, I]`` passes.

        Raises:
            ValueError: naming the first argument that breaks a rule (rank, shape, dtype,
                device, or a plan of another T / E).
        """
        from common.routing import RoutingPlan

        if not isinstance(self.plan, RoutingPlan):
            raise ValueError(
                "plan must be a RoutingPlan (common.routing.plan_routing), got "
                f"{type(self.plan).__name__}"
            )
        if self.clamp_limits is not None and not isinstance(self.clamp_limits, ClampLimits):
            raise ValueError(
                "clamp_limits must be a ClampLimits or None, got "
                f"{type(self.clamp_limits).__name__}"
            )
        if not isinstance(self.activation, Activation):
            raise ValueError(
                f"activation must be an Activation, got {type(self.activation).__name__}"
            )
        x = self.hidden_states_TH
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"hidden_states_TH must be a 2-D [T, H] tensor, got {shape_text(x)}")
        T, H = x.shape
        w = self.w_gate_up_EH2I
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[1] != H or w.shape[2] != 2:
            raise ValueError(f"w_gate_up_EH2I must be [E, H={H}, 2, I], got {shape_text(w)}")
        E, _, _, I = w.shape
        if self.plan.num_tokens != T:
            raise ValueError(
                f"plan has T={self.plan.num_tokens} tokens, hidden_states_TH has {T} rows"
            )
        if self.plan.num_experts != E:
            raise ValueError(f"plan has E={self.plan.num_experts} experts, the weights have {E}")
        R = T * self.plan.top_k
        ck = self.act_checkpoint_R2I
        ck_shape = (R, 2, I)
        if isinstance(ck, torch.Tensor) and ck.dim() == 2:
            if not checkpoint_rows:
                raise ValueError(
                    f"act_checkpoint_R2I must have shape {[R, 2, I]} (pair order), got "
                    f"{shape_text(ck)}: a grouped-row checkpoint [S, 2I], which only the fused "
                    "CUDA backward reads (with the forward's layout)"
                )
            if ck.shape[0] >= R:
                ck_shape = (ck.shape[0], 2 * I)
        want = {
            "output_grad_TH": (self.output_grad_TH, (T, H)),
            "w_down_EIH": (self.w_down_EIH, (E, I, H)),
            "act_checkpoint_R2I": (ck, ck_shape),
            "b_gate_up_E2I": (self.b_gate_up_E2I, (E, 2, I)),
            "b_down_EH": (self.b_down_EH, (E, H)),
        }
        for name, (t, shape) in want.items():
            if t is None and name.startswith("b_"):
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}, got {shape_text(t)}")
        named = {"hidden_states_TH": x, "w_gate_up_EH2I": w}
        named.update({k: v for k, (v, _) in want.items() if v is not None})
        for name, t in named.items():
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
            if t.device != x.device:
                raise ValueError(
                    f"{name} is on device {t.device} but hidden_states_TH is on {x.device}"
                )
        if self.plan.device != x.device:
            raise ValueError(
                f"plan is on device {self.plan.device} but hidden_states_TH is on {x.device}"
            )

    @property
    def dims(self) -> dict[str, int]:
        """The dimension legend of this problem: T, H, I, E, K."""
        T, H = self.hidden_states_TH.shape
        E, I, _ = self.w_down_EIH.shape
        return {"T": T, "H": H, "I": I, "E": E, "K": self.plan.top_k}


def shape_text(t) -> str:
    """``[d0, d1, ...]`` of a tensor, else its type's name (for error messages)."""
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


@dataclass
class MoEGrads:
    """Gradients of one MoE expert-MLP backward.

    Attributes:
        hidden_states_grad_TH: [T, H] dX.
        affinity_grad_TE: [T, E] dA, dense (0 where a token is not routed to an expert); the
            NKI layout's ``[T*E, 1]`` is ``affinity_grad_TE.reshape(-1, 1)``. Includes the
            down-bias term ``<dY, b_down>`` when the problem has biases (REFERENCE §2).
        w_gate_up_grad_EH2I: [E, H, 2, I].
        w_down_grad_EIH: [E, I, H].
        b_gate_up_grad_E2I: [E, 2, I] or None.
        b_down_grad_EH: [E, H] or None.
        info: backend-specific extras (e.g. modeled Trainium time per phase).
    """

    hidden_states_grad_TH: torch.Tensor
    affinity_grad_TE: torch.Tensor
    w_gate_up_grad_EH2I: torch.Tensor
    w_down_grad_EIH: torch.Tensor
    b_gate_up_grad_E2I: torch.Tensor | None = None
    b_down_grad_EH: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def named(self) -> dict[str, torch.Tensor]:
        """The gradients present, by their display names, in a fixed order."""
        out = {
            "dX [T,H]": self.hidden_states_grad_TH,
            "dA [T,E]": self.affinity_grad_TE,
            "dW_gate_up [E,H,2,I]": self.w_gate_up_grad_EH2I,
            "dW_down [E,I,H]": self.w_down_grad_EIH,
        }
        if self.b_gate_up_grad_E2I is not None:
            out["dB_gate_up [E,2,I]"] = self.b_gate_up_grad_E2I
        if self.b_down_grad_EH is not None:
            out["dB_down [E,H]"] = self.b_down_grad_EH
        return out
