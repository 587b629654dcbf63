"""Environment queries of the grouped-wgrad API: compute capability, CUDA-graph capture, CuTe DSL
presence, the kernel family modules. Module functions, called as ``env.<name>(...)``, so that tests can
replace them in one place. Nothing runs at import time.
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


#: The kernel family module of each kernel arch. Each defines ``FAMILY``, a
#: ``launch.KernelFamily`` (its compile key and kernel); a new family (the block-scaled ones)
#: plugs in with a row here.
FAMILY_MODULES = {
    "sm90": "cuda_kernels.grouped_wgrad.sm90_bf16",
    "sm100": "cuda_kernels.grouped_wgrad.sm100_bf16",
}


@functools.cache
def family_module(arch: str):
    """The kernel family module of ``arch`` ("sm90" | "sm100") if it is built, else None."""
    try:
        return importlib.import_module(FAMILY_MODULES[arch])
    except ModuleNotFoundError:
        return None
