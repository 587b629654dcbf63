"""Environment queries of the grouped-wgrad API: compute capability, CUDA-graph capture, CuTe DSL
presence, the import of a kernel family module. Module functions, called as ``env.<name>(...)``,
so that tests can replace them in one place. Nothing runs at import time.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch


def query_arch(device: torch.device, arg: str = "a_tensor") -> int:
    """Compute capability of ``device`` as ``10 * major + minor``.

    Raises:
        RuntimeError: CUDA is not available.
        ValueError: ``device`` is not a CUDA device (argument ``arg``).
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "grouped GEMM wgrad kernels need CUDA, and CUDA is not available "
            "(torch.cuda.is_available() is False); use grouped_gemm_wgrad(), which falls back to "
            "torch"
        )
    if device.type != "cuda":
        raise ValueError(f"{arg} must be on a CUDA device, got {device}")
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def kernel_arch(cc: int) -> str | None:
    """The kernel arch of a compute capability ``10 * major + minor``: "sm100" for SM100 and
    newer, "sm90" for SM 9.x, None below (no kernel). The one place a generation maps to an arch
    (``registry.KernelProvider.arch``)."""
    return "sm100" if cc >= 100 else "sm90" if cc >= 90 else None


def capturing(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


@functools.cache
def cutlass_dsl_missing() -> str | None:
    """Why the CuTe DSL cannot be used, or None."""
    if importlib.util.find_spec("cutlass") is None:
        return (
            "nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1 "
            "apache-tvm-ffi==0.1.15.post2, or the package's [cuda] extra)"
        )
    return None


@functools.cache
def family_module(name: str):
    """The kernel family module ``name`` (a module path, ``registry.KernelProvider.module``) if
    it is built, else None. Imported once; importing a family module imports no CuTe DSL."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None
