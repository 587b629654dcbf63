"""Hopper (SM90) kernel families: ``common.py`` (what the wgmma kernels share), ``wgrad_bf16.py``
and ``wgrad_mxfp8.py`` (varlen-K), ``grouped_mm.py`` (varlen-M). Reached through
``cuda_kernels.gemm.registry``."""
