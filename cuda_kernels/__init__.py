"""CUDA kernels of the MoE layer: grouped weight-gradient GEMMs (CuTe DSL, Hopper/Blackwell), and
the fused GPU forward and backward built on them (the pipelines ``moe``, with the Triton kernels
of ``triton``).

The public API (``cuda_kernels.GroupedGemmWgradSm100``, ``grouped_gemm_wgrad_wrapper_sm100``,
``GroupedGemmWgradSm90``, ``grouped_gemm_wgrad_wrapper_sm90``, ``grouped_gemm_wgrad``, ...) follows
the cuDNN frontend's grouped GEMM wgrad seed, and so do the ``jax.jit`` entries at the top level
(``cuda_kernels.grouped_gemm_wgrad_jax_sm100`` as ``cudnn.grouped_gemm_wgrad_jax_sm100``, and
its ``_sm90`` twin), resolved on first access. Importing it imports neither CuTe DSL nor JAX and
does not query the GPU; kernels compile on first use.
"""

from common._version import __version__ as __version__  # re-exported
from common.lazy import lazy_exports

from . import grouped_wgrad
from .grouped_wgrad import *  # noqa: F403 - the package re-exports the grouped wgrad API

#: The ``jax.jit`` entries cuDNN frontend exposes at its top level: names here, resolved from
#: ``grouped_wgrad.jax_ffi`` on first access (that module imports JAX only when called).
_LAZY = {
    "grouped_gemm_wgrad_jax_sm100": "cuda_kernels.grouped_wgrad.jax_ffi",
    "grouped_gemm_wgrad_jax_sm90": "cuda_kernels.grouped_wgrad.jax_ffi",
}

__all__ = list(grouped_wgrad.__all__) + list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
