"""What a ``jax.jit`` entry call compiles (``JaxWgradPlan``), checked: the static rules, the
concrete values, the device.

Dimensions: H hidden, S tokens_sum, I intermediate, E experts (``common/shapes.py``).

What the jit entries (``jax_ffi.py``) can and cannot check. Shapes, dtypes, layouts (JAX arrays
are C-contiguous: A is K-major, B N-major), tile fit and output alignment are static and checked
while tracing -- by the torch entries' own rules: :func:`check_jax_wgrad_call` describes the
arrays as shape-only (meta) torch tensors and runs ``pipeline.validate_call`` (the one
validation pipeline), after the JAX-only forms (arrays or tracers, the packed pointer array,
``wgrad_init``). The offsets VALUES and the pointer VALUES are data: under ``jax.jit`` they
cannot be host-validated; :func:`check_values` checks concrete ones (outside ``jax.jit``; one
device-to-host copy) with the torch rules, and raises for tracers.

Imports no JAX at module level (inside the functions), nor CuTe DSL.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..gemm import env, registry
from . import bf16
from ._types import NAME_TO_DTYPE, OUTPUT_DTYPES, ArgNames, WgradCall
from .jax_ref import dtype_name, is_tracer
from .pipeline import validate_call
from .validate import check_offsets_now, check_output_mode, check_pointers_now

__all__ = [
    "JAX_NAMES",
    "JaxWgradPlan",
    "auto_arch",
    "check_concrete_devices",
    "check_jax_wgrad_call",
    "check_values",
    "device_cc",
    "target_device",
]

#: Output dtypes of the BF16 contract (seed table), by JAX dtype name.
OUT_DTYPE_NAMES = tuple(OUTPUT_DTYPES.values())
#: Bytes of one packed address in the uint8 form of ``wgrad_ptrs`` (little-endian int64).
_PTR_BYTES = 8
#: The message names of a jit entry's arguments (the pipeline's messages name them so).
JAX_NAMES = ArgNames("a", "b", "offsets", wgrad="wgrad_init")


@dataclasses.dataclass(frozen=True)
class JaxWgradPlan:
    """What one jit-entry call compiles: the kernel key and the FFI buffer layout.

    Attributes:
        arch: "sm90" | "sm100".
        key: the kernel module's compile key (``Sm90WgradKey`` / ``Sm100WgradKey``).
        tokens_sum: S (static under ``jax.jit``: a JAX shape).
        ptr_dtype: "int64" | "uint8" for discrete outputs, None for dense outputs.
    """

    arch: str
    key: Any
    tokens_sum: int
    ptr_dtype: str | None


def _check_array(x: Any, arg: str) -> None:
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
            f"{arg} must be a JAX array (or a tracer of one), got {type(x).__name__}"
        )


def _out_dtype_name(wgrad_dtype: Any) -> str:
    import numpy as np

    try:
        name = np.dtype(wgrad_dtype).name
    except TypeError:
        name = None
    if name not in OUT_DTYPE_NAMES:
        raise ValueError(
            f"wgrad_dtype must be bfloat16, float16 or float32 (a jnp dtype or its name), got "
            f"{wgrad_dtype!r}"
        )
    return name


def check_jax_wgrad_call(
    arch: str,
    a: Any,
    b: Any,
    offsets: Any,
    *,
    wgrad_ptrs: Any = None,
    wgrad_init: Any = None,
    output_mode: str = "discrete",
    wgrad_dtype: Any = "bfloat16",
    accumulate_on_output: bool = False,
    mma_tiler_mn: tuple[int, int] | None = None,
    cluster_shape_mn: tuple[int, int] | None = None,
) -> JaxWgradPlan:
    """Validate what can be validated under tracing; return the compile plan.

    Args: as :func:`grouped_gemm_wgrad_jax_sm90` (``output_mode`` "discrete": ``wgrad_ptrs``
    required; "dense": ``wgrad_ptrs`` forbidden, optional ``wgrad_init`` [E, H, I]).

    Raises:
        ValueError: naming the argument: not an array, wrong rank/dtype/shape, tokens_sum or
            intermediate not aligned, a pointer array of the wrong length or dtype, an
            unsupported tiling.
    """
    if arch not in ("sm90", "sm100"):
        raise ValueError(f"arch must be 'sm90' or 'sm100', got {arch!r}")
    for x, arg in ((a, "a"), (b, "b"), (offsets, "offsets")):
        _check_array(x, arg)
    if len(a.shape) != 2 or dtype_name(a) != "bfloat16":
        raise ValueError(
            f"a must be a 2-D [hidden, tokens_sum] bfloat16 array (K-major: C-contiguous), got "
            f"shape {tuple(a.shape)} {dtype_name(a)}"
        )
    if len(b.shape) != 2 or dtype_name(b) != "bfloat16":
        raise ValueError(
            f"b must be a 2-D [tokens_sum, intermediate] bfloat16 array (N-major: C-contiguous), "
            f"got shape {tuple(b.shape)} {dtype_name(b)}"
        )
    hidden, tokens_sum = (int(d) for d in a.shape)
    if int(b.shape[0]) != tokens_sum:
        raise ValueError(
            f"b.shape[0] ({b.shape[0]}) must equal a.shape[1] = tokens_sum ({tokens_sum})"
        )
    inter = int(b.shape[1])
    if len(offsets.shape) != 1 or dtype_name(offsets) != "int32" or offsets.shape[0] < 1:
        raise ValueError(
            f"offsets must be a 1-D [num_experts >= 1] int32 array of cumulative expert ends, "
            f"got shape {tuple(offsets.shape)} {dtype_name(offsets)}"
        )
    num_experts = int(offsets.shape[0])
    if hidden < 1 or inter < 1:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be >= 1")
    if tokens_sum < 1:
        raise ValueError(
            "a: tokens_sum must be >= 1 in the jit entries (TMA has no empty boxes); with no "
            "tokens every expert's gradient is zero: skip the call"
        )
    align = bf16.TOKEN_ALIGN[arch]  # the kernel's per-expert multiple: tokens_sum's too
    if tokens_sum % align:
        raise ValueError(
            f"a: the {arch.upper()} kernel needs every expert's token count a multiple of "
            f"{align}, so tokens_sum too; got tokens_sum={tokens_sum}"
        )
    ptr_dtype = _check_jax_outputs(
        check_output_mode(output_mode), wgrad_ptrs, wgrad_init, wgrad_dtype, num_experts,
        (num_experts, hidden, inter),
    )
    out_name = _out_dtype_name(wgrad_dtype)
    # The rules of the torch entries, on the layouts JAX arrays have (C-contiguous: A K-major,
    # B N-major), through the one pipeline: alignment, output rows, tiling, and the kernel key.
    meta = functools.partial(torch.empty, device="meta")
    call = WgradCall(
        a=meta((hidden, tokens_sum), dtype=torch.bfloat16),
        b=meta((tokens_sum, inter), dtype=torch.bfloat16),
        offsets=meta((num_experts,), dtype=torch.int32), output_mode=output_mode,
        wgrad_ptrs=meta((num_experts,), dtype=torch.int64) if ptr_dtype else None,
        wgrad_dtype=NAME_TO_DTYPE[out_name],
        accumulate_on_output=bool(accumulate_on_output) or wgrad_init is not None,
        mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn, validate_offsets=False,
        names=JAX_NAMES,
    )
    contract = validate_call(call, arch).contract
    key = bf16.contract_key(contract)
    return JaxWgradPlan(arch=arch, key=key, tokens_sum=tokens_sum, ptr_dtype=ptr_dtype)


def _check_jax_outputs(output_mode, wgrad_ptrs, wgrad_init, wgrad_dtype, num_experts, shape):
    """The JAX forms of the outputs: the pointer array (int64 ``[E]`` or packed uint8
    ``[8 * E]``) of discrete outputs, ``wgrad_init`` of dense ones. Returns the pointer dtype
    name (None for dense outputs)."""
    if output_mode == "discrete":
        if wgrad_init is not None:
            raise ValueError("wgrad_init is for dense outputs; discrete outputs use wgrad_ptrs")
        if wgrad_ptrs is None:
            raise ValueError(
                f"wgrad_ptrs is required: [{num_experts}] int64 (jax_enable_x64) or "
                f"[{_PTR_BYTES * num_experts}] uint8 packed addresses of the caller's "
                "[hidden, intermediate] outputs"
            )
        _check_array(wgrad_ptrs, "wgrad_ptrs")
        ptr_dtype = dtype_name(wgrad_ptrs)
        want = {"int64": num_experts, "uint8": _PTR_BYTES * num_experts}
        if ptr_dtype not in want or len(wgrad_ptrs.shape) != 1:
            raise ValueError(
                f"wgrad_ptrs must be a 1-D int64 array of {num_experts} addresses (needs "
                f"jax_enable_x64) or a 1-D uint8 array of {_PTR_BYTES * num_experts} packed "
                f"little-endian addresses, got shape {tuple(wgrad_ptrs.shape)} {ptr_dtype}"
            )
        if int(wgrad_ptrs.shape[0]) != want[ptr_dtype]:
            raise ValueError(
                f"wgrad_ptrs has {wgrad_ptrs.shape[0]} {ptr_dtype} entries; one address per "
                f"expert needs {want[ptr_dtype]} (num_experts = offsets.shape[0] = "
                f"{num_experts})"
            )
        return ptr_dtype
    if wgrad_ptrs is not None:
        raise ValueError("wgrad_ptrs must be None for dense outputs (the result is the array)")
    out_name = _out_dtype_name(wgrad_dtype)
    if wgrad_init is not None:
        _check_array(wgrad_init, "wgrad_init")
        if tuple(wgrad_init.shape) != shape:
            raise ValueError(
                f"wgrad_init must be [num_experts, hidden, intermediate] = {shape}, got "
                f"{tuple(wgrad_init.shape)}"
            )
        init_name = dtype_name(wgrad_init)
        if init_name != out_name:
            raise ValueError(
                f"wgrad_init dtype ({init_name}) must equal wgrad_dtype ({out_name})"
            )
    return None


def check_concrete_devices(named: dict[str, Any]) -> Any:
    """The one device of the concrete arrays among ``named`` (tracers are skipped: XLA places
    them), or None when all are tracers.

    Raises:
        ValueError: an array spans several devices, or two arrays live on different devices.
    """
    device, first = None, None
    for arg, x in named.items():
        if x is None or is_tracer(x) or not hasattr(x, "devices"):
            continue
        devs = x.devices()
        if len(devs) != 1:
            raise ValueError(
                f"{arg} is sharded over {len(devs)} devices; the grouped wgrad entries take "
                "single-device arrays (call them per shard, e.g. inside shard_map)"
            )
        (d,) = devs
        if device is None:
            device, first = d, arg
        elif d != device:
            raise ValueError(f"{arg} is on {d} but {first} is on {device}: one device only")
    return device


def check_values(plan: JaxWgradPlan, offsets: Any, wgrad_ptrs: Any) -> None:
    """Host validation of concrete offsets and pointer values (one device-to-host copy), with
    the torch entries' rules (``validate.check_offsets_now`` / ``check_pointers_now``)."""
    import numpy as np

    for x, arg in ((offsets, "offsets"), (wgrad_ptrs, "wgrad_ptrs")):
        if x is not None and is_tracer(x):
            raise ValueError(
                f"validate_offsets=True needs a concrete {arg}: under jax.jit (or grad/vmap) "
                f"{arg} is a tracer whose values cannot be read on the host; validate outside "
                "jit, or pass validate_offsets=False"
            )
    ends = torch.from_numpy(np.asarray(offsets).astype(np.int64))
    check_offsets_now(ends, plan.tokens_sum, bf16.TOKEN_ALIGN[plan.arch], "offsets",
                      f"on {plan.arch.upper()}")
    if wgrad_ptrs is not None:
        ptrs = np.asarray(wgrad_ptrs)
        ptrs = ptrs.view(np.int64) if ptrs.dtype == np.uint8 else ptrs.astype(np.int64)
        check_pointers_now(ptrs.tolist(), "wgrad_ptrs")


# ---------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------


def device_cc(device: Any) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def target_device(arch: str, named: dict[str, Any]):
    """The GPU the call runs on (a concrete argument's, else JAX's default device), checked.

    Raises:
        ValueError: arrays on different devices (see :func:`check_concrete_devices`).
        RuntimeError: not a CUDA GPU, or the wrong compute capability for ``arch``; SM100 without
            the hardware-unverified opt-in.
    """
    import jax

    device = check_concrete_devices(named)
    if device is None:
        device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        raise RuntimeError(
            f"grouped_gemm_wgrad_jax_{arch} runs a CUDA kernel; the arrays' device is {device} "
            f"({device.platform}). Use grouped_wgrad_jax(backend='auto'), which runs the "
            "jax.numpy twin elsewhere"
        )
    cc = device_cc(device)
    if cc is None:
        raise RuntimeError(f"cannot read the compute capability of {device}")
    if arch == "sm90" and cc[0] != 9:
        raise RuntimeError(
            f"grouped_gemm_wgrad_jax_sm90 runs sm_90a code (wgmma) only on SM 9.x, found "
            f"SM{cc[0]}{cc[1]} on {device}"
        )
    if arch == "sm100":
        if cc[0] < 10:
            raise RuntimeError(
                f"grouped_gemm_wgrad_jax_sm100 requires SM100 or newer, found SM{cc[0]}{cc[1]} on "
                f"{device}; use grouped_gemm_wgrad_jax_sm90 on Hopper"
            )
        reason = _gate("sm100")
        if reason is not None:
            raise RuntimeError(reason)
    return device


def _gate(arch: str) -> str | None:
    """The BF16 family's gate of ``arch`` (``registry.KernelProvider.gate``: the SM100 kernel's
    hardware opt-in), or None."""
    family = registry.provider(arch, bf16.NAME)
    return family.gate() if family is not None else None


def auto_arch(named: dict[str, Any]) -> str | None:
    """The kernel family for the arrays' device (a concrete argument's, else JAX's default)."""
    import jax

    device = check_concrete_devices(named) or jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        return None
    cc = device_cc(device)
    if cc is None:
        return None
    arch = env.kernel_arch(10 * cc[0] + cc[1])
    return None if arch is None or _gate(arch) is not None else arch
