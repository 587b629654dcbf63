"""The one torch definition of the gated activation (:class:`~common.problem.Activation`) and its
derivative, which the float64 reference, the portable path and the kernels' torch twins call.
Kernels (Triton, CuTe DSL, NKI) write the same expressions in their own languages.

Per element, with g, u the clamped gate and up pre-activations, ``alpha`` and ``c =
up_offset`` of the activation (SwiGLU: 1, 0; gpt-oss: 1.702, 1)::

    s  = sigmoid(alpha g)      gs = g s            up = u + c         h = gs up
    dh/du = gs                 dh/dg = up s (1 + alpha g (1 - s))

and in backward, from ``dh`` (the gradient of h, affinity-scaled by the caller) and the strict
clamp masks of the stored values (REFERENCE §2)::

    dg = dh up s (1 + alpha g (1 - s)) mask_g        du = dh gs mask_u

Two things that are easy to get wrong:

* Every tensor here is computed in its inputs' dtype (float64 in the reference, fp32 on the
  portable path and in the twins): the caller casts first.
* The order of the operations is part of the definition: the twins equal their kernels bit for
  bit only with it. ``alpha g`` is ``g`` itself for alpha 1, and ``up`` is ``u`` itself for
  c = 0 (no extra rounding, no pass); :func:`activation_forward` computes SwiGLU as torch's
  fused ``silu(g) * u`` (the portable forward's numerics); the kernels and their twins compute
  ``h = gs * up`` (:attr:`GatedTerms.h`). A caller whose kernel multiplies in another order (the
  NKI twin: ``dh * up * dgate``) builds its products from :class:`GatedTerms`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from common.problem import Activation, ClampLimits

__all__ = ["GatedTerms", "activation_backward", "activation_forward", "gated_terms"]


class GatedTerms(NamedTuple):
    """The terms of ``h = g sigmoid(alpha g) (u + c)`` both passes share (shapes of g, u)."""

    ag: torch.Tensor
    """``alpha * g`` (g itself for alpha 1)."""
    s: torch.Tensor
    """``sigmoid(alpha * g)``."""
    gs: torch.Tensor
    """``g * s``: dh/du (``silu(g)`` for SwiGLU)."""
    up: torch.Tensor
    """``u + c`` (u itself for c = 0)."""

    @property
    def h(self) -> torch.Tensor:
        """``gs * up``: the activation, in the kernels' order."""
        return self.gs * self.up

    @property
    def dgate(self) -> torch.Tensor:
        """``s * (1 + alpha g (1 - s))``: d(g s)/dg (dsilu for SwiGLU)."""
        return self.s * (1 + self.ag * (1 - self.s))


def gated_terms(
    activation: Activation,
    g: torch.Tensor,
    u: torch.Tensor,
    *,
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> GatedTerms:
    """The :class:`GatedTerms` of ``activation`` at the stored (clamped) g and u.

    Args:
        activation: the :class:`~common.problem.Activation`.
        g, u: gate and up values, same shape and float dtype (the compute dtype).
        sigmoid: the sigmoid to use (the NKI twin passes the one its hardware model computes).
    """
    ag = g if activation.alpha == 1.0 else activation.alpha * g
    s = sigmoid(ag)
    up = u if activation.up_offset == 0.0 else u + activation.up_offset
    return GatedTerms(ag, s, g * s, up)


def activation_forward(activation: Activation, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``h = g sigmoid(alpha g) (u + c)`` in the dtype of g and u: torch's ``silu(g) * u`` for
    SwiGLU, ``(g s) up`` otherwise (the float64 reference's and the portable forward's
    numerics)."""
    if activation.is_swiglu:
        return torch.nn.functional.silu(g) * u
    return gated_terms(activation, g, u).h


def activation_backward(
    activation: Activation,
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    clamp_limits: ClampLimits | None = None,
    *,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dg, du, h)``: the derivative of the activation at the stored g, u, times ``dh``.

    Args:
        activation: the :class:`~common.problem.Activation`.
        g, u: [..., I] the stored (clamped) gate and up values, the compute dtype.
        dh: [..., I] the gradient of h (affinity-scaled by the caller), the same dtype.
        clamp_limits: the forward's clamps: dg (du) is 0 where g (u) is not strictly inside
            its limits. None = no clamp.
        valid: optional bool mask broadcastable to g: dg and du are 0 where it is False
            (padding rows).
    Returns:
        ``dg = dh up s (1 + alpha g (1 - s))``, ``du = dh gs`` (masked) and ``h = gs up``, in
        the dtype of the inputs.
    """
    t = gated_terms(activation, g, u)
    dg = dh * t.up * t.s * (1 + t.ag * (1 - t.s))
    du = dh * t.gs
    cl = clamp_limits  # a side without limits needs no mask (no all-True select pass)
    mask_g = cl.gate_mask(g) if cl is not None and cl.clamps_gate else None
    mask_u = cl.up_mask(u) if cl is not None and cl.clamps_up else None
    if valid is not None:
        mask_g = valid if mask_g is None else mask_g & valid
        mask_u = valid if mask_u is None else mask_u & valid
    if mask_g is not None:
        dg = torch.where(mask_g, dg, 0.0)
    if mask_u is not None:
        du = torch.where(mask_u, du, 0.0)
    return dg, du, t.h
