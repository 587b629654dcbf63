"""Grouped GEMM weight-gradient API (the cuDNN frontend's seed): the public facade.

Dimensions: H hidden (the GEMM's M), I intermediate (N), S tokens_sum (K, grouped by expert),
E num_experts. Legend in ``common/shapes.py``.

Operation (seed ``shared/seeds/grouped_gemm_wgrad_sm100.md``): for expert ``e`` with
``begin = offsets[e - 1]`` (0 for ``e = 0``) and ``end = offsets[e]``::

    Wgrad[e] = A[:, begin:end] @ B[begin:end, :]            (fp32 accumulation)

Public names:
    ``GroupedGemmWgradSm100`` / ``grouped_gemm_wgrad_wrapper_sm100`` — the seed's surface; refuse
        devices below SM100. The SM100 kernel (``sm100_bf16.py``, tcgen05) is built and compiled
        offline for ``sm_100a`` but has never run on a Blackwell GPU: its launcher raises
        ``RuntimeError`` unless ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``, and ``auto`` dispatch
        never picks it without that opt-in.
    ``GroupedGemmWgradSm90`` / ``grouped_gemm_wgrad_wrapper_sm90`` — the same surface and contract
        on Hopper (the CuTe DSL kernel of ``sm90_bf16.py``), except that expert token counts may
        be any value >= 0. Refuse devices that are not SM 9.x (sm_90a code does not run elsewhere).
    ``grouped_gemm_wgrad`` — picks the SM100 or SM90 kernel by device and falls back to the torch
        implementation (``torch_ref.grouped_wgrad_torch``) elsewhere, CPU included.
    ``grouped_wgrad_into`` — the backward's hot path (cached operator per metadata key); with
        ``a_rows_S`` / ``b_rows_S`` it reads A's columns / B's rows through a row index (the
        routing index: no gathered copy of X or dY). ``WGRAD_GATHER_BACKENDS``: the backends
        whose kernel gathers in its operand load ("sm90"); the others gather first;
        ``wgrad_gather_enabled(backend)``: whether it does now (the SM90 gather keys' gate:
        open since they passed their GPU tests, 2026-12-06).

Block-scaled (MXFP8 / MXFP4 / NVFP4, the seed's legacy surface) in the same classes, wrappers and
``grouped_gemm_wgrad`` (which takes any MXFP8 token count per expert): the operand dtypes pick
the format once (``pipeline.select_format``). Native block-scaled kernels are registered
families (``registry.py``): ``sm90_mxfp8`` (MXFP8 on SM90) and ``sm100_blockscaled`` (MXFP8 /
MXFP4 / NVFP4 on SM100), each behind an opt-in until verified on a GPU; every other call runs
the torch twin (``blockscaled_ref``) on the tensors' device.
    ``get_grouped_gemm_wgrad_workspace_size_sm100``, ``TupleDict``, ``WgradContract``.
    ``wgrad_expert_ptrs`` -- cuDNN frontend's helper: the per-expert output addresses of a stacked
        [E, H, I] tensor, the ``wgrad_ptrs`` of the discrete output mode (on the device, no sync).

Validation of offsets VALUES and pointer VALUES needs a host read (a device sync). It runs only in
the explicit validation mode ``validate_offsets=True`` — the default of the wrappers and of
``check_support`` — once per tensor version (the same unchanged tensor is not read again, as
cuDNN caches it), and never while the current CUDA stream is capturing a graph (values are then
trusted; the checks of shapes, dtypes, strides, devices and alignment still run). Pass
``validate_offsets=False`` in the hot path. Host metadata (shapes, strides, data pointers) is always
checked; it costs no sync.

Errors: every rule raises ``ValueError`` (bad argument) or ``RuntimeError`` (environment: no CUDA,
wrong capability, kernel or CuTe DSL not available, use before ``compile()``) with a message that
names the argument, before any output is written.

Nothing here imports CuTe DSL or queries the GPU at import time; the kernel module is imported
inside ``compile()``.

Modules (this one re-exports the public names; import paths stay ``...grouped_wgrad.api``), each
importing only those below it:
    ``classes``     ``GroupedGemmWgradSm100`` / ``GroupedGemmWgradSm90`` (cuDNN's class lifecycle)
    ``wrappers``    ``grouped_gemm_wgrad_wrapper_sm100`` / ``_sm90``, ``grouped_wgrad_into``
    ``dispatch``    ``select_grouped_wgrad_backend``, ``grouped_gemm_wgrad``,
                    ``kernel_unsupported_reason``, ``grouped_wgrad_fp32``
    ``pipeline``    the one validation pipeline, the format choice, the compiled operator
    ``bf16`` / ``blockscaled``   one module per format: its contract, validation steps, launch
    ``validate``    the rules the formats share; ``registry`` the kernel families' plug-in point
    ``launch``      ``KernelFamily``: the compile cache and launcher every family uses
    ``_types``, ``tiles``, ``env``   contract types and tables, tile rules, environment queries
    JAX (above this facade): ``jax`` (eager), ``jax_ffi`` (``jax.jit``), ``jax_ref`` (the twin);
    ``jax_arrays`` (below the wrappers) converts JAX arrays for them.
"""

from ._types import OUTPUT_DTYPES, SM100_GROUP_ALIGN, TupleDict, WgradContract
from .classes import GroupedGemmWgradSm90, GroupedGemmWgradSm100
from .dispatch import (
    grouped_gemm_wgrad,
    grouped_wgrad_fp32,
    kernel_unsupported_reason,
    select_grouped_wgrad_backend,
)
from .pipeline import wgrad_expert_ptrs
from .validate import get_grouped_gemm_wgrad_workspace_size_sm100
from .wrappers import (
    WGRAD_GATHER_BACKENDS,
    clear_grouped_wgrad_caches,
    grouped_gemm_wgrad_wrapper_sm90,
    grouped_gemm_wgrad_wrapper_sm100,
    grouped_wgrad_into,
    wgrad_gather_enabled,
)

__all__ = [
    "OUTPUT_DTYPES",
    "SM100_GROUP_ALIGN",
    "WGRAD_GATHER_BACKENDS",
    "wgrad_gather_enabled",
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
    "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
    "wgrad_expert_ptrs",
]
