"""Varlen-M grouped GEMMs (the MoE forward / dgrad family): ``out[rows of e] = A[rows] @ W[e]``,
A's rows optionally gathered through the routing's row -> token index (``api.grouped_mm_gather``;
the SM90 CuTe DSL kernel in ``sm90``, its torch twin in ``torch_ref``).

Importing this package imports neither CuTe DSL nor triton and does not query the GPU.
"""

from .api import BACKENDS, grouped_mm_gather, grouped_mm_key, kernel_unsupported_reason
from .torch_ref import grouped_mm_gather_torch

__all__ = [
    "BACKENDS",
    "grouped_mm_gather",
    "grouped_mm_gather_torch",
    "grouped_mm_key",
    "kernel_unsupported_reason",
]
