"""JAX entry points of the grouped wgrad (the seed's "JAX support"), eager, through DLPack.

Dimensions: H hidden, S tokens_sum, I intermediate, E experts.

``grouped_gemm_wgrad_jax`` takes JAX arrays, views them as torch tensors with DLPack (zero copy),
runs ``api.grouped_gemm_wgrad`` (the SM100 / SM90 kernel by device, torch elsewhere, CPU included)
and returns JAX arrays. As in the seed: BF16 only; A is ``[H, S]`` and B ``[S, I]`` C-contiguous
(JAX arrays always are), i.e. A K-major and B N-major; dense ``[E, H, I]`` output, or discrete
output through caller-owned addresses (``wgrad_ptrs``: int64 with ``jax_enable_x64``, or packed
uint8 of ``8 * E`` bytes). The wrapper is eager: on CUDA it waits for the inputs
(``block_until_ready``), launches on the legacy default stream and synchronizes it before it
returns.

JAX arrays are immutable: an output array passed in (``wgrad``) is never written; the result is a
new array (with ``accumulate_on_output=True`` it starts from ``wgrad``'s values).

Deferred: the ``jax.jit``-compatible XLA custom-call entry (the seed's
``grouped_gemm_wgrad_jax_sm100``) is not built yet; calling it raises ``RuntimeError``.

JAX is imported lazily (inside the functions); importing this module needs neither JAX nor CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import api

__all__ = ["grouped_gemm_wgrad_jax", "grouped_gemm_wgrad_jax_sm100"]

_JAX_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise RuntimeError(
            "grouped_gemm_wgrad_jax needs JAX (pip install jax, or the package's [jax] extra)"
        ) from exc
    return jax, jnp


def _to_torch(x: Any, arg: str) -> torch.Tensor:
    if not hasattr(x, "__dlpack__"):
        raise ValueError(f"{arg} must be a JAX array (DLPack-capable), got {type(x).__name__}")
    return torch.from_dlpack(x)


def _out_dtype(wgrad_dtype: Any) -> torch.dtype:
    name = getattr(wgrad_dtype, "name", None) or getattr(wgrad_dtype, "__name__", None)
    if isinstance(wgrad_dtype, torch.dtype):
        return wgrad_dtype
    if name is None and isinstance(wgrad_dtype, str):
        name = wgrad_dtype
    if name not in _JAX_DTYPES:
        raise ValueError(
            f"wgrad_dtype must be bfloat16, float16 or float32 (jnp or torch dtype, or name), "
            f"got {wgrad_dtype!r}"
        )
    return _JAX_DTYPES[name]


def grouped_gemm_wgrad_jax(
    a: Any,
    b: Any,
    offsets: Any,
    *,
    output_mode: str = "dense",
    wgrad: Any = None,
    wgrad_ptrs: Any = None,
    wgrad_dtype: Any = "bfloat16",
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    backend: str = "auto",
    validate_offsets: bool = True,
) -> api.TupleDict:
    """Eager grouped wgrad on JAX arrays: ``wgrad[e] (+)= a[:, begin:end] @ b[begin:end, :]``.

    Args:
        a: [H, S] jnp.bfloat16 (C-contiguous: K-major A).
        b: [S, I] jnp.bfloat16 (C-contiguous: N-major B).
        offsets: [E] jnp.int32 cumulative expert ends (non-decreasing, last == S; multiples of
            256 per expert on the SM100 kernel, any count >= 0 otherwise).
        output_mode: "dense" or "discrete".
        wgrad: optional [E, H, I] array: initial values when accumulating (never mutated); its
            dtype wins over ``wgrad_dtype``.
        wgrad_ptrs: discrete mode only: [E] int64 (x64 mode) or [8 * E] uint8 packed addresses of
            caller-owned [H, I] row-major outputs, 16-byte aligned (CUDA kernels only).
        wgrad_dtype: output dtype: bfloat16 | float16 | float32 (jnp/torch dtype or name).
        accumulate_on_output: add to ``wgrad`` (zeros when not given).
        input_order: "tensor2d" | "tensor_ragged".
        backend: "auto" | "sm100" | "sm90" | "torch" (see ``api.grouped_gemm_wgrad``).
        validate_offsets: host-read offsets values (default True).

    Returns:
        TupleDict(wgrad_tensor=[E, H, I] JAX array), or ``wgrad_tensor=None`` with ``wgrad_ptrs``.

    Raises:
        ValueError / RuntimeError: as ``api.grouped_gemm_wgrad``; RuntimeError without JAX.
    """
    jax, jnp = _jax()
    if wgrad_ptrs is not None and output_mode != "discrete":
        raise ValueError("wgrad_ptrs must be None in dense output mode (dense output forbids it)")
    jax.block_until_ready([x for x in (a, b, offsets, wgrad, wgrad_ptrs) if x is not None])
    a_t = _to_torch(a, "a")
    b_t = _to_torch(b, "b")
    off_t = _to_torch(offsets, "offsets")
    ptrs_t = None
    if wgrad_ptrs is not None:
        ptrs_t = _to_torch(wgrad_ptrs, "wgrad_ptrs")
        if ptrs_t.dtype == torch.uint8 and ptrs_t.dim() == 1 and ptrs_t.numel() % 8 == 0:
            ptrs_t = ptrs_t.view(torch.int64)
    out_t = None
    if wgrad is not None:
        w_in = _to_torch(wgrad, "wgrad")
        if accumulate_on_output:
            out_t = w_in.clone()  # JAX buffers are immutable: accumulate into a copy
        else:
            out_t = torch.empty_like(w_in)
    dtype = out_t.dtype if out_t is not None else _out_dtype(wgrad_dtype)
    stream = torch.cuda.default_stream(a_t.device) if a_t.device.type == "cuda" else None
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        res = api.grouped_gemm_wgrad(
            a_t, b_t, off_t, output_mode=output_mode, wgrad_tensor=out_t, wgrad_ptrs=ptrs_t,
            wgrad_dtype=dtype, accumulate_on_output=accumulate_on_output,
            input_order=input_order, backend=backend, validate_offsets=validate_offsets,
        )
    if stream is not None:
        stream.synchronize()
    w = res["wgrad_tensor"]
    return api.TupleDict(wgrad_tensor=None if w is None else jnp.from_dlpack(w))


def grouped_gemm_wgrad_jax_sm100(*args: Any, **kwargs: Any):
    """The seed's ``jax.jit``-compatible XLA custom-call entry: not built yet.

    Raises:
        RuntimeError: always; use the eager :func:`grouped_gemm_wgrad_jax` outside ``jax.jit``.
    """
    raise RuntimeError(
        "grouped_gemm_wgrad_jax_sm100 (the jax.jit / XLA custom-call entry) is not built in this "
        "package yet; call the eager grouped_gemm_wgrad_jax outside jax.jit"
    )
