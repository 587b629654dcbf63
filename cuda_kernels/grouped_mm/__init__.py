"""Varlen-M grouped GEMMs (the MoE forward / dgrad family): ``out[rows of e] = A[rows] @ W[e]``,
A's rows optionally gathered through the routing's row -> token index (``api.grouped_mm_gather``),
optionally with the forward gate/up epilogue fused (``api.grouped_mm_gated`` /
``api.gate_up_forward``: bias, clamp, activation, checkpoint and ``a * h``) or the backward
down-dgrad one (``api.grouped_mm_dgated`` / ``api.down_dgrad_backward``: activation backward,
``d_gate_up``, ``a * h`` and the affinity gradient). The API asks the engine's registry
(``cuda_kernels.gemm.registry``, ``problem="varlen_m"``) for the kernel of the device's arch (the
SM90 CuTe DSL kernel: ``cuda_kernels/gemm/sm90/grouped_mm.py``); the torch twins are in
``torch_ref``.

Importing this package imports neither CuTe DSL nor triton and does not query the GPU.
"""

from .api import (
    BACKENDS,
    down_dgrad_backward,
    gate_up_forward,
    grouped_mm_dgated,
    grouped_mm_gated,
    grouped_mm_gather,
    grouped_mm_key,
    kernel_unsupported_reason,
    weight_major,
)
from .torch_ref import (
    down_dgrad_activation_torch,
    gate_up_activation_torch,
    grouped_mm_gather_torch,
)

__all__ = [
    "BACKENDS",
    "down_dgrad_activation_torch",
    "down_dgrad_backward",
    "gate_up_activation_torch",
    "gate_up_forward",
    "grouped_mm_dgated",
    "grouped_mm_gated",
    "grouped_mm_gather",
    "grouped_mm_gather_torch",
    "grouped_mm_key",
    "kernel_unsupported_reason",
    "weight_major",
]
