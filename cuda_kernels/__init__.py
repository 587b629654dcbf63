"""CUDA kernels of the MoE backward: grouped weight-gradient GEMMs (CuTe DSL, Hopper/Blackwell).

The public API (``cuda_kernels.GroupedGemmWgradSm100``, ``grouped_gemm_wgrad_wrapper_sm100``,
``GroupedGemmWgradSm90``, ``grouped_gemm_wgrad_wrapper_sm90``, ``grouped_gemm_wgrad``, ...) follows
the cuDNN frontend's grouped GEMM wgrad seed. Importing it imports neither CuTe DSL nor JAX and
does not query the GPU; kernels compile on first use.
"""

from .grouped_wgrad import (
    OUTPUT_DTYPES,
    SM100_GROUP_ALIGN,
    GroupedGemmWgradSm90,
    GroupedGemmWgradSm100,
    TupleDict,
    WgradContract,
    clear_grouped_wgrad_caches,
    get_grouped_gemm_wgrad_workspace_size_sm100,
    grouped_gemm_wgrad,
    grouped_gemm_wgrad_wrapper_sm90,
    grouped_gemm_wgrad_wrapper_sm100,
    grouped_wgrad_fp32,
    grouped_wgrad_torch,
    kernel_unsupported_reason,
    select_grouped_wgrad_backend,
)

__all__ = [
    "OUTPUT_DTYPES",
    "SM100_GROUP_ALIGN",
    "GroupedGemmWgradSm90",
    "GroupedGemmWgradSm100",
    "TupleDict",
    "WgradContract",
    "clear_grouped_wgrad_caches",
    "get_grouped_gemm_wgrad_workspace_size_sm100",
    "grouped_gemm_wgrad",
    "grouped_gemm_wgrad_wrapper_sm90",
    "grouped_gemm_wgrad_wrapper_sm100",
    "grouped_wgrad_fp32",
    "grouped_wgrad_torch",
    "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
]
