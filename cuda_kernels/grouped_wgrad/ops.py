"""``torch.library`` registration of the grouped weight gradient, for ``torch.compile`` users.

``torch.ops.moe_bwd.grouped_wgrad(a_HS, b_SI, offsets_E, group_align=1) -> [E, H, I] fp32`` is
:func:`~cuda_kernels.grouped_wgrad.api.grouped_wgrad_fp32` as an opaque custom op: the device's
kernel where the call fits its static contract (SM90 / SM100), the torch twin elsewhere. Its fake
(meta) implementation gives the output shape from ``offsets_E``'s length, so a graph that calls it
traces with ``torch.compile(fullgraph=True)`` and never reads offsets values on the host.

Importing this module registers the op (idempotent within a process); it imports no CuTe DSL.
"""

from __future__ import annotations

import torch

from .api import grouped_wgrad_fp32

__all__ = ["grouped_wgrad_op"]


@torch.library.custom_op("moe_bwd::grouped_wgrad", mutates_args=())
def grouped_wgrad_op(
    a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor, group_align: int = 1
) -> torch.Tensor:
    """``out[e] = a_HS[:, begin:end] @ b_SI[begin:end, :]`` in fp32, [E, H, I].

    Args:
        a_HS: [H, S] (BF16 for the kernels; any float on the torch path).
        b_SI: [S, I], same dtype and device.
        offsets_E: [E] int32 cumulative ends, non-decreasing, ``offsets_E[-1] <= S``.
        group_align: the row alignment the caller guarantees for every expert (not checked:
            no host read). The SM100 kernel runs only for a multiple of 256 (its contract); the
            default 1 keeps SM100 devices on the torch path. The SM90 kernel takes any.
    Returns:
        [E, H, I] float32 on the inputs' device; empty experts are zeros.
    Raises:
        ValueError: from the API's validation (dtypes, shapes, devices, group_align >= 1).
    """
    return grouped_wgrad_fp32(a_HS, b_SI, offsets_E, group_align=group_align)


@grouped_wgrad_op.register_fake
def _(
    a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor, group_align: int = 1
) -> torch.Tensor:
    torch._check(a_HS.dim() == 2 and b_SI.dim() == 2 and offsets_E.dim() == 1)
    torch._check(a_HS.shape[1] == b_SI.shape[0])
    return a_HS.new_empty((offsets_E.shape[0], a_HS.shape[0], b_SI.shape[1]), dtype=torch.float32)
