"""The GPU MoE layer forward's building blocks (Triton).

:func:`build_routing` turns router output into the :class:`~common.routing.RoutingPlan` and
:class:`~common.routing.GroupedLayout` the expert GEMMs use, in three launches with no host
read; :func:`check_routing_async` asserts its error code on the device. Importing this package
imports Triton but does not query the GPU.
"""

from .routing import ERROR_MESSAGES, build_routing, check_routing_async, default_tokens_sum

__all__ = ["ERROR_MESSAGES", "build_routing", "check_routing_async", "default_tokens_sum"]
