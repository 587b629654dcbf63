"""JAX arrays through the torch wrappers (the seed's eager JAX support): the DLPack bridge.

``grouped_gemm_wgrad_wrapper_sm100`` / ``_sm90`` call :func:`call_wrapper_on_jax_arrays` when
they are given JAX arrays (:func:`has_jax_arrays`): it validates the JAX-side rules, views every
array as a torch tensor with DLPack (zero copy), runs the wrapper on the CUDA legacy default
stream and returns JAX arrays. Rules (seed): BF16 backend only -- A ``[H, S]`` and B ``[S, I]``
C-contiguous (JAX arrays are), i.e. A K-major and B N-major; dense ``[E, H, I]`` C-contiguous
output, or discrete output through caller-owned addresses (``wgrad_ptrs``: int64 ``[E]`` with
``jax_enable_x64``, or packed uint8 ``[8 * E]``). The block-scaled backend's layouts are not
expressible as JAX arrays: FP8/FP4 operands or scale tensors given as JAX arrays raise
``ValueError``. JAX arrays are immutable: an output array passed in (``wgrad_tensor``) is never
written; the result is a new array. Tracers (inside ``jax.jit``/``grad``/``vmap``) are refused:
the jit entries (``jax_ffi.py``) take them.

This module sits below the wrappers (it imports only ``_types``): the JAX entries of ``jax.py`` /
``jax_ffi.py`` sit above the facade. JAX is imported inside the functions; :func:`has_jax_arrays`
never imports it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from ._types import TupleDict

__all__ = ["call_wrapper_on_jax_arrays", "has_jax_arrays", "import_jax", "jax_arrays_to_torch"]

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


def import_jax(who: str = "grouped_gemm_wgrad_jax"):
    """``(jax, jax.numpy)``, imported now.

    Raises:
        RuntimeError: JAX is not installed (``who`` names the caller).
    """
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise RuntimeError(
            f"{who} needs JAX (pip install jax, or the package's [jax] extra)"
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
    jax, _ = import_jax("the eager JAX wrappers")
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


def call_wrapper_on_jax_arrays(wrapper: Any, **kwargs: Any) -> TupleDict:
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
    _, jnp = import_jax("the eager JAX wrappers")
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
    return TupleDict(wgrad_tensor=None if w is None else jnp.from_dlpack(w))
