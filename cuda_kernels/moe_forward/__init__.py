"""The fused GPU MoE expert-MLP forward (:func:`moe_forward_fused`) and its Triton kernels."""

from .fused import moe_forward_fused

__all__ = ["moe_forward_fused"]
