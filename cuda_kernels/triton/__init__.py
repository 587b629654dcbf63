"""The Triton room: every Triton kernel of the MoE layer, with its launcher.

* :mod:`.launch` -- :class:`~.launch.TritonKernel` (compiled on CUDA tensors, interpreted on CPU
  tensors) and the BF16 cast that rounds alike in both.
* :mod:`.routing` -- router output -> RoutingPlan + GroupedLayout in four launches, and the
  device-side check of its error code.
* :mod:`.rows` -- row gathers into the grouped layout, per-token and per-expert sums out of it.
* :mod:`.activation` -- the gated activation's forward and its derivative.

Modules here import only :mod:`common` and each other (``tests/test_layering.py``); the MoE
pipelines (:mod:`cuda_kernels.moe`) and the grouped-GEMM APIs call them. Importing this package
imports nothing; each module needs ``triton`` and none queries the GPU.
"""
