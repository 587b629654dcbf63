"""The GEMM engine of the CUDA backend: the CuTe DSL grouped GEMM kernels of both problems
(varlen-K: the grouped weight gradient, one output per expert; varlen-M: the gather GEMMs of the
forward and the dgrad, one weight per expert) and what they share.

- ``registry.py``: the one plug-in point, a row per (arch, problem, format) naming a family
  module; the API packages (``grouped_wgrad``, ``grouped_mm``) ask it and import no kernel;
- ``launch.py``: the one compile cache, offline PTX compile and launcher (``KernelFamily``);
- ``keys.py`` (the wgrad compile keys' shared fields), ``tiles.py`` (tile rules, the YAML
  tables), ``env.py`` (compute capability -> arch, CuTe DSL presence), ``tile_sched.py`` (the
  dynamic persistent tile scheduler);
- ``sm90/`` and ``sm100/``: the kernel families of one architecture each.

The engine imports neither API package. Importing it imports no CuTe DSL and queries no GPU.
"""
