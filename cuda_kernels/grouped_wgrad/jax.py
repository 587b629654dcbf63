"""JAX entry points of the grouped wgrad (the seed's "JAX support").

Dimensions: H hidden, S tokens_sum, I intermediate, E experts.

Two forms, as in the seed:

1. **Eager, JAX arrays through the wrappers.** :func:`call_wrapper_on_jax_arrays` (in
   ``jax_arrays.py``, below the wrappers; re-exported here) is what
   ``grouped_gemm_wgrad_wrapper_sm100`` / ``_sm90`` call when they are given JAX arrays
   (:func:`has_jax_arrays`): it validates the JAX-side rules, views every array as a torch tensor
   with DLPack (zero copy), runs the wrapper on the CUDA legacy default stream and returns JAX
   arrays. Rules (seed): BF16 backend only — A ``[H, S]`` and B ``[S, I]`` C-contiguous (JAX
   arrays are), i.e. A K-major and B N-major; dense ``[E, H, I]`` C-contiguous output, or discrete
   output through caller-owned addresses (``wgrad_ptrs``: int64 ``[E]`` with ``jax_enable_x64``,
   or packed uint8 ``[8 * E]``). The block-scaled backend's layouts are not expressible as JAX
   arrays: FP8/FP4 operands or scale tensors given as JAX arrays raise ``ValueError``. Eager: the
   inputs are waited for (``block_until_ready``), the launch goes to the legacy default stream and
   that stream is synchronized before the call returns. JAX arrays are immutable: an output array
   passed in (``wgrad_tensor``) is never written; the result is a new array (with
   ``accumulate_on_output=True`` it starts from ``wgrad_tensor``'s values). Tracers (inside
   ``jax.jit``/``grad``/``vmap``) are refused: use the jit entries there.
   :func:`grouped_gemm_wgrad_jax` is the same on any device (the torch twin where no kernel runs).

2. **``jax.jit``: XLA FFI custom calls** (``jax_ffi.py``): the seed's
   ``grouped_gemm_wgrad_jax_sm100`` (and ``_sm90``) with discrete output pointers and a completion
   token, the dense functional forms and :func:`grouped_wgrad_jax` for ``jax.custom_vjp`` code.
   Re-exported here.

This module imports the facade (``api``), never the reverse. JAX is imported lazily (inside the
functions); importing this module needs neither JAX nor CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import api
from .jax_arrays import call_wrapper_on_jax_arrays, has_jax_arrays, import_jax, jax_arrays_to_torch
from .jax_ffi import (
    check_jax_wgrad_call,
    grouped_gemm_wgrad_dense_jax_sm90,
    grouped_gemm_wgrad_dense_jax_sm100,
    grouped_gemm_wgrad_jax_sm90,
    grouped_gemm_wgrad_jax_sm100,
    grouped_wgrad_jax,
    grouped_wgrad_jax_reference,
    pack_pointers_uint8,
)

__all__ = [
    "call_wrapper_on_jax_arrays",
    "check_jax_wgrad_call",
    "grouped_gemm_wgrad_dense_jax_sm90",
    "grouped_gemm_wgrad_dense_jax_sm100",
    "grouped_gemm_wgrad_jax",
    "grouped_gemm_wgrad_jax_sm90",
    "grouped_gemm_wgrad_jax_sm100",
    "grouped_wgrad_jax",
    "grouped_wgrad_jax_reference",
    "has_jax_arrays",
    "jax_arrays_to_torch",
    "pack_pointers_uint8",
]

_JAX_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _out_dtype(wgrad_dtype: Any) -> torch.dtype:
    if isinstance(wgrad_dtype, torch.dtype):
        return wgrad_dtype
    name = getattr(wgrad_dtype, "name", None) or getattr(wgrad_dtype, "__name__", None)
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
    """Eager grouped wgrad on JAX arrays on any device: ``wgrad[e] (+)= a[:, begin:end] @
    b[begin:end, :]`` through ``api.grouped_gemm_wgrad`` (SM100 / SM90 kernel by device, torch
    elsewhere, CPU included), with the JAX rules of :func:`jax_arrays_to_torch`.

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
    _, jnp = import_jax()
    if wgrad_ptrs is not None and output_mode != "discrete":
        raise ValueError("wgrad_ptrs must be None in dense output mode (dense output forbids it)")
    for x, arg in ((a, "a"), (b, "b"), (offsets, "offsets")):
        if not has_jax_arrays(x):
            raise ValueError(f"{arg} must be a JAX array (DLPack-capable), got {type(x).__name__}")
    targs = jax_arrays_to_torch(
        {"a_tensor": a, "b_tensor": b, "offsets_tensor": offsets, "wgrad_tensor": wgrad,
         "wgrad_ptrs": wgrad_ptrs, "accumulate_on_output": accumulate_on_output},
        require_cuda=False,
    )
    out_t = targs["wgrad_tensor"]
    dtype = out_t.dtype if out_t is not None else _out_dtype(wgrad_dtype)
    a_t = targs["a_tensor"]
    stream = torch.cuda.default_stream(a_t.device) if a_t.device.type == "cuda" else None
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        res = api.grouped_gemm_wgrad(
            a_t, targs["b_tensor"], targs["offsets_tensor"], output_mode=output_mode,
            wgrad_tensor=out_t, wgrad_ptrs=targs["wgrad_ptrs"], wgrad_dtype=dtype,
            accumulate_on_output=accumulate_on_output, input_order=input_order, backend=backend,
            validate_offsets=validate_offsets,
        )
    if stream is not None:
        stream.synchronize()
    w = res["wgrad_tensor"]
    return api.TupleDict(wgrad_tensor=None if w is None else jnp.from_dlpack(w))
