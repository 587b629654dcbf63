"""Grouped GEMM weight gradient (MoE wgrad): the cuDNN-style API, its torch twin and JAX entries.

The public names are the facade's (``api.py``: the classes, the wrappers, the generic entry and
their tables) and the torch twin ``grouped_wgrad_torch``. The package is cut by format, as cuDNN
frontend cuts its grouped GEMMs: ``bf16.py`` and ``blockscaled.py`` each hold a format's contract,
validation steps and launch; ``pipeline.py`` is the one validation pipeline every entry calls;
the kernel families (``sm90_bf16``, ``sm100_bf16``, ``sm90_mxfp8``, ``sm100_blockscaled``) live in
the GEMM engine ``cuda_kernels/gemm``, reached through its registry; the JAX entries
(``jax.py``, ``jax_ffi.py``) sit above the facade. ``docs/ARCHITECTURE.md`` has the module table.

Importing this package imports neither CuTe DSL nor JAX and does not query the GPU.
"""

from . import api
from .api import *  # the facade's public names
from .torch_ref import grouped_wgrad_torch

__all__ = api.__all__ + ["grouped_wgrad_torch"]
