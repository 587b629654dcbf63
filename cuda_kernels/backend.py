"""Dispatcher plugin: registers the ``cuda-sm90`` and ``cuda-sm100`` backends with ``common.dispatch``.

Each backend runs the portable torch backward (``common.torch_backward.moe_backward_torch``) with
its two weight gradients computed by this package's grouped wgrad kernel through the public API
(``cuda_kernels.grouped_wgrad.api``). ``check()`` says what is missing: CUDA, the right compute
capability, the CuTe DSL package, or (SM100) the kernel itself.

Imported lazily by ``common.dispatch`` by module name; importing it imports no CuTe DSL and does not
query the GPU (``check()`` does, when called).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from common.dispatch import Backend, register_backend
from common.problem import MoEBackwardProblem, MoEGrads
from common.torch_backward import moe_backward_torch

from .grouped_wgrad import api

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


def _cutlass_reason() -> str | None:
    if importlib.util.find_spec("cutlass") is None:
        return (
            "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1 "
            "apache-tvm-ffi==0.1.15.post2)"
        )
    return None


def check_cuda_sm90() -> str | None:
    """None when the Hopper kernel can run here, else why not."""
    return _device_reason(90, 99, "cuda-sm90") or _cutlass_reason()


def check_cuda_sm100() -> str | None:
    """None when the SM100 kernel can run here, else why not."""
    reason = _device_reason(100, None, "cuda-sm100")
    if reason:
        return reason
    module = api._sm100_module()
    if module is None or not hasattr(module, "compile_sm100_wgrad"):
        return "the SM100 grouped wgrad kernel is not built in this package yet"
    return module.unverified_reason() or _cutlass_reason()


def make_grouped_wgrad(arch: str, stats: dict | None = None):
    """``fn(a_HS, b_SI, offsets_E) -> [E, H, I] fp32`` running the ``arch`` kernel via the API.

    ``api.grouped_wgrad_fp32`` with ``backend=arch``: calls outside the kernel's static contract
    (``api.kernel_unsupported_reason``: e.g. hidden not a multiple of the tile, non-BF16
    operands) run ``grouped_wgrad_torch``; ``stats`` counts ``"kernel"`` / ``"torch"`` calls and
    keeps the last ``"torch_reason"``. Offsets values are not host-validated (they come from
    ``common.routing``; no sync).
    """
    return functools.partial(api.grouped_wgrad_fp32, backend=arch, stats=stats)


def _runner(arch: str):
    def run(problem: MoEBackwardProblem, **options) -> MoEGrads:
        stats: dict = {}
        grads = moe_backward_torch(
            problem, grouped_wgrad=make_grouped_wgrad(arch, stats), **options
        )
        grads.info.setdefault("wgrad_calls", stats)
        return grads

    return run


register_backend(
    Backend(
        name="cuda-sm90",
        summary="Hopper: torch backward with the CuTe DSL grouped wgrad kernel (TMA + wgmma)",
        check=check_cuda_sm90,
        run=_runner("sm90"),
        grouped_wgrad=make_grouped_wgrad("sm90"),
    )
)
register_backend(
    Backend(
        name="cuda-sm100",
        summary="Blackwell: torch backward with the SM100 grouped wgrad kernel (tcgen05; "
        "compiled offline, not yet verified on hardware: opt in with "
        "MOE_BWD_ENABLE_UNVERIFIED_SM100=1)",
        check=check_cuda_sm100,
        run=_runner("sm100"),
        grouped_wgrad=make_grouped_wgrad("sm100"),
    )
)
