"""The fused GPU MoE expert-MLP backward (the ``cuda-sm90`` backend's run).

:func:`moe_backward_fused` chains grouped GEMMs (cuBLAS dgrad, our CuTe DSL wgrad) with Triton
kernels that fuse everything between them (:mod:`.kernels`). Its twin is the portable
:func:`common.torch_backward.moe_backward_torch`. Importing this package imports Triton (needed)
but neither CuTe DSL nor the GPU.
"""

from .fused import GRAD_DTYPES, moe_backward_fused

__all__ = ["GRAD_DTYPES", "moe_backward_fused"]
