"""Dispatcher plugin: registers the ``cuda-sm90`` and ``cuda-sm100`` backends with
``common.dispatch``.

Each backend runs the fused GPU forward of the layer (``cuda_kernels.moe.moe_forward_fused``) and
the fused GPU backward (``cuda_kernels.moe.moe_backward_fused``: grouped GEMMs, Triton kernels for
everything between them, and this package's grouped wgrad kernel through the public API
``cuda_kernels.grouped_wgrad.api``), the same on rows in expert order with separate gate and up
weights (``moe_forward_split_gate_up`` / ``moe_backward_split_gate_up``: torchtitan's seam), and
declares its layer option ``grouped_mm``
(``cuda_kernels.moe.grouped_mm_choice.GROUPED_MM_OPTION``) and its layer state (saved X rows
where ``keeps_x_rows`` says so, layout, gradient targets; the checkpoint in grouped row order
where ``checkpoint_in_rows`` says so). ``check()`` says what is missing: CUDA, the right
compute capability, Triton, the CuTe DSL package, or (SM100) the kernel itself.

Imported lazily by ``common.dispatch`` by module name; importing it imports neither triton nor
CuTe DSL and does not query the GPU (``check()`` does, when called), so the option declaration
is there (and ``MoEExperts(grouped_mm=...)`` checked) wherever the package imports.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from common.dispatch import Backend, register_backend
from common.problem import MoEBackwardProblem, MoEGrads

from .gemm import env, registry
from .grouped_wgrad import api
from .moe.grouped_mm_choice import GROUPED_MM_OPTION, checkpoint_in_rows, keeps_x_rows

__all__ = ["check_cuda_sm90", "check_cuda_sm100", "make_grouped_wgrad"]


def _device_reason(min_cc: int, max_cc: int | None, name: str) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    if cc < min_cc or (max_cc is not None and cc > max_cc):
        want = f"SM{min_cc // 10}.x" if max_cc is not None else f"SM{min_cc} or newer"
        return f"the current CUDA device is SM{cc}; {name} needs {want}"
    return None


def _triton_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton==3.6.0)"
    return None


def check_cuda_sm90() -> str | None:
    """None when the Hopper kernels can run here, else why not."""
    return _device_reason(90, 99, "cuda-sm90") or _triton_reason() or env.cutlass_dsl_missing()


_SM100_OPT_IN = "MOE_BWD_ENABLE_UNVERIFIED_SM100"


def check_cuda_sm100() -> str | None:
    """None when the SM100 kernel can run here, else why not. Without the opt-in variable the
    reason always says that the kernel is compiled but unverified, also where the device is what
    stops it (so that a user reading it on a CPU host learns the opt-in too)."""
    reason = _device_reason(100, None, "cuda-sm100")
    if reason:
        import os

        if os.environ.get(_SM100_OPT_IN) != "1":
            reason += (
                "; besides, the SM100 grouped wgrad kernel is compiled but unverified on "
                f"hardware: on a Blackwell GPU it needs {_SM100_OPT_IN}=1"
            )
        return reason
    family = registry.provider("sm100", "bf16")
    if family is None or family.load() is None:
        return "the SM100 grouped wgrad kernel module (gemm/sm100/wgrad_bf16.py) is missing"
    return family.gate() or _triton_reason() or env.cutlass_dsl_missing()


def make_grouped_wgrad(arch: str, stats: dict | None = None, group_align: int = 1):
    """``fn(a_HS, b_SI, offsets_E) -> [E, H, I] fp32`` running the ``arch`` kernel via the API.

    ``api.grouped_wgrad_fp32`` with ``backend=arch``: calls outside the kernel's static contract
    (``api.kernel_unsupported_reason``: e.g. hidden not a multiple of the tile, non-BF16
    operands) run ``grouped_wgrad_torch``; ``stats`` counts ``"kernel"`` / ``"torch"`` calls and
    keeps the last ``"torch_reason"``. Offsets values are not host-validated (they come from
    ``common.routing``; no sync), so the SM100 kernel (256-row groups or NaN) runs only where the
    caller states ``group_align`` a multiple of 256 (here or per call:
    ``fn(..., group_align=256)``); the backends' ``grouped_wgrad`` state none, and
    ``common.torch_backward`` aligns to 16 rows.
    """
    return functools.partial(
        api.grouped_wgrad_fp32, backend=arch, stats=stats, group_align=group_align
    )


def _forward_fused(*args, **kwargs):
    """The fused layer forward (``cuda_kernels.moe.moe_forward_fused``; ``kwargs`` are its
    keywords, ``grouped_mm`` from ``MoEExpertsOptions`` among them)."""
    from .moe.forward import moe_forward_fused  # imports triton: only when run

    return moe_forward_fused(*args, **kwargs)


def _checkpoint_rows(call: dict) -> bool:
    """``Backend.checkpoint_rows``: the fused forward keeps the gate/up GEMM's output rows as
    the checkpoint (:func:`cuda_kernels.moe.grouped_mm_choice.checkpoint_in_rows`)."""
    return checkpoint_in_rows(gate_up_bias=call["gate_up_bias"], clamp_limits=call["clamp_limits"])


def _keeps_x_rows(call: dict) -> bool:
    """``Backend.keeps_x_rows``: the fused forward keeps the gathered X rows unless the fused
    backward's gate/up wgrad reads X through the routing index
    (:func:`cuda_kernels.moe.grouped_mm_choice.keeps_x_rows`)."""
    return keeps_x_rows(
        call["device"], call["E"], call["H"], call["I"], grad_dtype=call["grad_dtype"],
        accumulate=call["accumulate"],
        wgrad_backend=call["backend_options"].get("wgrad_backend", "auto"),
    )


def _run_fused(problem: MoEBackwardProblem, **options) -> MoEGrads:
    """The fused backward; ``options`` are :func:`moe_backward_fused`'s keywords (``grouped_mm``
    from ``MoEExpertsOptions`` among them)."""
    from .moe.backward import moe_backward_fused  # imports triton: only when run

    return moe_backward_fused(problem, **options)


def _forward_split(*args, **kwargs):
    """The forward on separate gate and up weights (``cuda_kernels.moe.forward.
    moe_forward_split_gate_up``)."""
    from .moe.forward import moe_forward_split_gate_up

    return moe_forward_split_gate_up(*args, **kwargs)


def _run_split(*args, **kwargs):
    """Its backward (``cuda_kernels.moe.backward.moe_backward_split_gate_up``)."""
    from .moe.backward import moe_backward_split_gate_up

    return moe_backward_split_gate_up(*args, **kwargs)


register_backend(
    Backend(
        name="cuda-sm90",
        summary="Hopper: fused backward (cuBLAS grouped dgrad, Triton epilogues, CuTe DSL "
        "grouped wgrad with TMA + wgmma)",
        check=check_cuda_sm90,
        run=_run_fused,
        grouped_wgrad=make_grouped_wgrad("sm90"),
        forward=_forward_fused,
        options=(GROUPED_MM_OPTION,),
        layer_state=True,
        forward_split_gate_up=_forward_split,
        run_split_gate_up=_run_split,
        checkpoint_rows=_checkpoint_rows,
        keeps_x_rows=_keeps_x_rows,
    )
)
register_backend(
    Backend(
        name="cuda-sm100",
        # (the opt-in variable is in check_cuda_sm100's reason: said once per row)
        summary="Blackwell: fused backward with the SM100 grouped wgrad kernel (tcgen05)",
        check=check_cuda_sm100,
        run=_run_fused,
        grouped_wgrad=make_grouped_wgrad("sm100"),
        forward=_forward_fused,
        options=(GROUPED_MM_OPTION,),
        layer_state=True,
        forward_split_gate_up=_forward_split,
        run_split_gate_up=_run_split,
        checkpoint_rows=_checkpoint_rows,
        keeps_x_rows=_keeps_x_rows,
    )
)
