"""The MoE pipelines room: the fused GPU forward and backward of the layer (the ``cuda-sm90`` /
``cuda-sm100`` backends' ``forward`` and ``run``), the steps they share and the per-shape choice
of the grouped-GEMM implementation.

* :func:`moe_forward_fused` (:mod:`.forward`) -- routing build, X gather, gate/up GEMM,
  activation, down GEMM, per-token combine.
* :func:`moe_backward_fused` (:mod:`.backward`) -- grouped GEMMs (cuBLAS dgrad, our grouped
  wgrad) with Triton passes between them; its twin is
  :func:`common.torch_backward.moe_backward_torch`.
* :mod:`.steps` -- the grouped GEMMs on grouped / gathered rows both use.
* :mod:`.grouped_mm_choice` -- the ``grouped_mm`` option (its values and its one check) and the
  per-shape table ``configs/cuda/grouped_mm_choice.yaml``.

The pipelines import only public names of the grouped-GEMM APIs (:mod:`cuda_kernels.grouped_mm`,
:mod:`cuda_kernels.grouped_wgrad.api`) and the Triton room (:mod:`cuda_kernels.triton`).
Importing this package imports neither triton nor CuTe DSL (the backend's option declaration
reads :mod:`.grouped_mm_choice`): the two pipelines load on first access.
"""

from common.lazy import lazy_exports

_LAZY = {
    "GRAD_DTYPES": "cuda_kernels.moe.backward",
    "moe_backward_fused": "cuda_kernels.moe.backward",
    "moe_forward_fused": "cuda_kernels.moe.forward",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
