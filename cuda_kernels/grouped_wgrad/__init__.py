"""Grouped GEMM weight gradient (MoE wgrad): the cuDNN-style API, its torch twin and JAX entries.

Importing this package imports neither CuTe DSL nor JAX and does not query the GPU.
"""

from .api import (
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
    grouped_wgrad_into,
    kernel_unsupported_reason,
    select_grouped_wgrad_backend,
)
from .torch_ref import grouped_wgrad_torch

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
    "grouped_wgrad_into",
    "grouped_wgrad_torch",
    "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
]
