"""The fused GPU MoE expert-MLP forward of the layer (:func:`moe_forward_fused`) and its Triton
building blocks: :func:`build_routing` turns router output into the
:class:`~common.routing.RoutingPlan` and :class:`~common.routing.GroupedLayout` the expert GEMMs
use, in four launches with no host read; :func:`check_routing_async` asserts its error code on
the device; :mod:`.kernels` holds the activation epilogue. Importing this package imports Triton
but does not query the GPU.
"""

from .fused import moe_forward_fused
from .routing import ERROR_MESSAGES, build_routing, check_routing_async, default_tokens_sum

__all__ = [
    "ERROR_MESSAGES", "build_routing", "check_routing_async", "default_tokens_sum",
    "moe_forward_fused",
]
