"""Framework entry points beside the layer: each takes the framework's expert weights in their
own memory layout (views and strides, no per-step copy) and runs them on
:func:`common.layer.moe_experts`.

* :mod:`common.integrations.transformers` -- Hugging Face transformers' ``ExpertsInterface``
  backend ``"moe_bwd"`` (``register()``).
* torchtitan: :func:`common.layer.run_experts_grouped_mm` and
  :func:`common.expert_parallel.use_moe_experts_in_torchtitan`.

Importing this package imports no framework: ``register()`` imports transformers when called.
"""
