"""Blackwell (SM100) kernel families: ``wgrad_bf16.py`` and ``wgrad_blockscaled.py``
(varlen-K). Reached through ``cuda_kernels.gemm.registry``."""
