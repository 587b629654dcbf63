"""CUDA kernels of the MoE layer: grouped weight-gradient GEMMs (CuTe DSL, Hopper/Blackwell), and
the fused GPU forward and backward built on them (``moe_forward``, ``moe_backward``: Triton).

The public API (``cuda_kernels.GroupedGemmWgradSm100``, ``grouped_gemm_wgrad_wrapper_sm100``,
``GroupedGemmWgradSm90``, ``grouped_gemm_wgrad_wrapper_sm90``, ``grouped_gemm_wgrad``, ...) follows
the cuDNN frontend's grouped GEMM wgrad seed. Importing it imports neither CuTe DSL nor JAX and
does not query the GPU; kernels compile on first use.
"""

from common._version import __version__ as __version__  # re-exported

from . import grouped_wgrad
from .grouped_wgrad import *  # noqa: F403 - the package re-exports the grouped wgrad API

__all__ = list(grouped_wgrad.__all__)
