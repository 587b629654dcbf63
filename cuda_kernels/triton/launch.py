"""What every Triton kernel of this package shares: a launcher that runs compiled on CUDA tensors
and interpreted on CPU tensors, and a BF16 cast that rounds alike in both.

* :class:`TritonKernel` -- ``TritonKernel(fn).launch(device, grid, *args, **meta)``; CUDA tensors
  run the compiled kernel, CPU tensors run Triton's interpreter when the process set
  ``TRITON_INTERPRET=1`` before importing Triton (as ``tests/conftest.py`` does without a GPU),
  anything else is a RuntimeError naming the device.
* :func:`cast` -- ``x.to(dtype)`` inside a kernel; with ``RNE_BF16`` the fp32 -> BF16 rounding is
  done by integer ops (round to nearest even), because Triton 3.6's interpreter truncates where
  the GPU rounds. :func:`rne_bf16` says when a launch needs it.

Importing this module needs ``triton``; it does not query the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["TritonKernel", "cast", "interpreting", "rne_bf16"]


def interpreting() -> bool:
    """True when this process runs Triton's interpreter (``TRITON_INTERPRET`` set, not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonKernel:
    """A Triton kernel that runs compiled on CUDA tensors and, when the process runs Triton's
    interpreter (``TRITON_INTERPRET=1`` set before Triton is imported, as the CPU tests do), on
    CPU tensors. ``jit_options`` go to ``triton.jit`` (e.g. ``debug=True``)."""

    def __init__(self, fn, **jit_options):
        self._fn = triton.jit(fn, **jit_options)

    def launch(self, device: torch.device, grid, *args, **kwargs) -> None:
        """Launch on ``grid``. Raises RuntimeError for a non-CUDA device outside the
        interpreter."""
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"the MoE layer's Triton kernels need CUDA tensors, got {device}; run the "
                "portable 'torch' backend there (or set TRITON_INTERPRET=1 before importing "
                "triton to interpret the kernels on the CPU, as the tests do)"
            )
        self._fn[grid](*args, **kwargs)


@triton.jit
def cast(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """``x.to(dtype)``; with ``RNE_BF16`` the fp32 -> BF16 rounding is done by integer ops
    (round to nearest even), because Triton's interpreter truncates where the GPU rounds."""
    if RNE_BF16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


def rne_bf16(dtype: torch.dtype) -> bool:
    """RNE_BF16 for a store of ``dtype``: only under the interpreter (the GPU rounds itself)."""
    return dtype == torch.bfloat16 and interpreting()
