"""JAX entry points of the grouped wgrad (the seed's "JAX support").

Dimensions: H hidden, S tokens_sum, I intermediate, E experts.

Two forms, as in the seed:

1. **Eager, JAX arrays through the wrappers.** :func:`call_wrapper_on_jax_arrays` is what
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

JAX is imported lazily (inside the functions); importing this module needs neither JAX nor CUDA.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from . import api
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
#: Tensor arguments of the wrappers, in their order, with what a JAX array there must be.
_TENSOR_ARGS = (
    "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "wgrad_tensor",
    "wgrad_ptrs", "global_scale_a", "global_scale_b", "descriptor_workspace",
)
#: Scale controls of the block-scaled backend: never JAX arrays (seed).
_BLOCK_SCALED_ARGS = ("sfa_tensor", "sfb_tensor", "global_scale_a", "global_scale_b")
_BLOCK_SCALED_ERROR = (
    "the block-scaled (FP8/FP4) backend's layouts (packed FP4 operands, swizzled scale-factor "
    "atoms) are not expressible as JAX arrays; JAX arrays are supported on the BF16 backend only "
    "(A [H, S] and B [S, I] bfloat16, C-contiguous)"
)


def _jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise RuntimeError(
            "grouped_gemm_wgrad_jax needs JAX (pip install jax, or the package's [jax] extra)"
        ) from exc
    return jax, jnp


def has_jax_arrays(*values: Any) -> bool:
    """True when any value is a JAX array (or tracer). Never imports JAX: without ``jax`` in
    ``sys.modules`` nothing can be a JAX array. Cheap enough for every wrapper call."""
    jax = sys.modules.get("jax")
    if jax is None or not hasattr(jax, "Array"):
        return False
    return any(isinstance(v, jax.Array) for v in values if v is not None)


def _dtype_name(x: Any) -> str:
    import numpy as np

    return np.dtype(x.dtype).name


def _check_concrete(x: Any, arg: str) -> None:
    import jax

    if isinstance(x, jax.core.Tracer):
        raise ValueError(
            f"{arg} is a JAX tracer (inside jax.jit, grad or vmap): the eager wrapper needs "
            "concrete arrays; inside jax.jit use grouped_gemm_wgrad_jax_sm100 / _sm90 (discrete "
            "pointers, token) or grouped_wgrad_jax (dense result)"
        )


def _to_torch(x: Any, arg: str) -> torch.Tensor:
    if not hasattr(x, "__dlpack__"):
        raise ValueError(f"{arg} must be a JAX array (DLPack-capable), got {type(x).__name__}")
    return torch.from_dlpack(x)


def _device_of(x: Any, arg: str):
    devs = x.devices()
    if len(devs) != 1:
        raise ValueError(
            f"{arg} is sharded over {len(devs)} devices; the eager wrapper takes single-device "
            "arrays"
        )
    return next(iter(devs))


def jax_arrays_to_torch(args: dict[str, Any], *, require_cuda: bool = True) -> dict[str, Any]:
    """The wrapper arguments ``args`` with every JAX array replaced by a zero-copy torch view.

    Validates the seed's JAX rules first (the wrapper then validates the contract as for torch):
    all tensor arguments JAX arrays (or None), concrete (no tracers), on one device — a CUDA GPU
    when ``require_cuda`` —, A/B bfloat16 (FP8/FP4 operands and scale tensors: the block-scaled
    error), ``wgrad_ptrs`` int64 ``[E]`` or uint8 ``[8 * E]`` (viewed as int64), no
    ``current_stream`` (the legacy default stream is used). ``wgrad_tensor`` is copied (JAX
    arrays are immutable); its dtype is kept. Waits for the input arrays
    (``jax.block_until_ready``).

    Returns:
        A new dict: torch tensors in place of the JAX arrays, everything else unchanged.

    Raises:
        ValueError: naming the argument.
    """
    jax, _ = _jax()
    out = dict(args)
    given = {k: args.get(k) for k in _TENSOR_ARGS if args.get(k) is not None}
    for arg in _BLOCK_SCALED_ARGS:
        if has_jax_arrays(given.get(arg)):
            raise ValueError(f"{arg}: {_BLOCK_SCALED_ERROR}")
    for arg, x in given.items():
        if not has_jax_arrays(x):
            raise ValueError(
                f"{arg} is a {type(x).__name__} while other arguments are JAX arrays: pass all "
                "tensor arguments as JAX arrays (or all as torch tensors)"
            )
        _check_concrete(x, arg)
    for arg in ("a_tensor", "b_tensor"):
        x = given.get(arg)
        if x is not None and _dtype_name(x) != "bfloat16":
            if _dtype_name(x).startswith(("float8", "float4", "uint8", "int8")):
                raise ValueError(f"{arg} is {_dtype_name(x)}: {_BLOCK_SCALED_ERROR}")
            raise ValueError(f"{arg} must be bfloat16 (BF16 backend), got {_dtype_name(x)}")
    if args.get("current_stream") is not None:
        raise ValueError(
            "current_stream must be None with JAX arrays: the eager wrapper runs on the CUDA "
            "legacy default stream and synchronizes it before returning"
        )
    device, first = None, None
    for arg, x in given.items():
        d = _device_of(x, arg)
        if device is None:
            device, first = d, arg
        elif d != device:
            raise ValueError(f"{arg} is on {d} but {first} is on {device}: one device only")
    if require_cuda and device is not None and device.platform not in ("gpu", "cuda"):
        raise ValueError(
            f"{first} is on {device} ({device.platform}); the grouped wgrad wrappers run on a "
            "CUDA device: jax.device_put the arrays onto the GPU (or use grouped_gemm_wgrad_jax, "
            "which falls back to torch)"
        )
    ptrs = given.get("wgrad_ptrs")
    if ptrs is not None:
        name = _dtype_name(ptrs)
        if len(ptrs.shape) != 1 or name not in ("int64", "uint8") or (
            name == "uint8" and ptrs.shape[0] % 8
        ):
            raise ValueError(
                "wgrad_ptrs must be a 1-D int64 array (jax_enable_x64) of one address per expert "
                "or a 1-D uint8 array of 8 packed little-endian bytes per expert, got shape "
                f"{tuple(ptrs.shape)} {name}"
            )
    jax.block_until_ready(list(given.values()))
    for arg, x in given.items():
        t = _to_torch(x, arg)
        if arg == "wgrad_ptrs" and t.dtype == torch.uint8:
            t = t.view(torch.int64)
        if arg == "wgrad_tensor":
            # JAX buffers are immutable: write into a copy (accumulating starts from its values)
            t = t.clone() if args.get("accumulate_on_output") else torch.empty_like(t)
        out[arg] = t
    return out


def call_wrapper_on_jax_arrays(wrapper: Any, **kwargs: Any) -> api.TupleDict:
    """Run ``wrapper`` (``grouped_gemm_wgrad_wrapper_sm100`` / ``_sm90``) on JAX arrays: the hook
    the wrappers call when :func:`has_jax_arrays` is true for their tensor arguments.

    ``kwargs`` are the wrapper's own arguments by name (``**locals()`` at the top of the wrapper
    body). Eager: inputs waited for, launch on the CUDA legacy default stream, that stream
    synchronized before returning.

    Returns:
        ``TupleDict(wgrad_tensor=[E, H, I] JAX array)``, or ``wgrad_tensor=None`` for
        caller-owned ``wgrad_ptrs`` only (the outputs behind them are written when this returns).

    Raises:
        ValueError: a JAX-side rule (:func:`jax_arrays_to_torch`) or the wrapper's contract.
        RuntimeError: as the wrapper; JAX missing.
    """
    _, jnp = _jax()
    targs = jax_arrays_to_torch(kwargs)
    a_t = targs["a_tensor"]
    stream = None
    if isinstance(a_t, torch.Tensor) and a_t.device.type == "cuda":
        # torch's default stream is the CUDA legacy default stream (handle 0) unless torch was
        # built with per-thread default streams.
        stream = torch.cuda.default_stream(a_t.device)
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        res = wrapper(**targs)
    if stream is not None:
        stream.synchronize()
    w = res["wgrad_tensor"]  # None for pointer-only output (caller-owned memory, the seed)
    return api.TupleDict(wgrad_tensor=None if w is None else jnp.from_dlpack(w))


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
    _, jnp = _jax()
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
