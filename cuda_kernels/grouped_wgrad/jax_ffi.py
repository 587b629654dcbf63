"""``jax.jit`` entries of the grouped wgrad: our CuTe DSL kernels as XLA FFI custom calls.

Dimensions: H hidden, S tokens_sum, I intermediate, E experts (legend in ``common/shapes.py``).

``Wgrad[e] = A[:, begin:end] @ B[begin:end, :]`` with ``begin = offsets[e - 1]`` (0 for ``e = 0``)
and ``end = offsets[e]``, fp32 accumulation.

Public names:
    ``grouped_gemm_wgrad_jax_sm100`` / ``grouped_gemm_wgrad_jax_sm90`` — the seed's entry: BF16,
        discrete output pointers to caller-owned buffers, returns a completion token.
    ``grouped_gemm_wgrad_dense_jax_sm100`` / ``grouped_gemm_wgrad_dense_jax_sm90`` — the
        functional form: returns the stacked ``[E, H, I]`` gradient as a JAX array (XLA owns it).
    ``grouped_wgrad_jax`` — the functional form on any JAX backend: the device's kernel, or
        ``grouped_wgrad_jax_reference`` (pure ``jax.numpy``, the twin) elsewhere, CPU included.
    ``check_jax_wgrad_call`` — the static validation alone (shapes, dtypes, layouts, tiles).
    ``pack_pointers_uint8`` — caller addresses as the packed ``uint8 [8 * E]`` pointer array.

Mechanism (why). Every entry is one XLA FFI custom call whose handler is the compiled C handler
that ships in the pinned CuTe DSL's runtime library (``libcute_dsl_runtime.so`` of
nvidia-cutlass-dsl 4.8.1, targets ``CuteDSLRT_NvJaxCutlassCall*_v1/_v2``, registered with
``jax.ffi.register_ffi_target`` by ``cutlass.jax.register_ffi``). At trace time this module
validates the call, compiles a small ``@cute.jit`` adapter around our kernel class
(``sm90_bf16`` / ``sm100_bf16``, unchanged) to a relocatable object through ``cutlass.jax``'s
export path, and emits ``jax.ffi.ffi_call(target, ..., module=<object bytes>, key=<sha256>)``.
At run time XLA calls the handler with its own CUDA stream and the operand/result buffers; the
handler loads the object once per executable and launches on that stream. The adapter rebuilds
the operand layouts the kernel was written for (A ``(H, S)`` K-major, B viewed as ``(I, S)``
N-major, static ``H, I, E``, dynamic ``S`` assumed divisible by 8), exactly as the torch path's
compile (``fake_wgrad_operands``) declares them.

Rejected alternatives: a ctypes (Python) FFI handler runs Python — and takes the GIL — on XLA's
execution thread at every launch, re-declares the XLA FFI C structs by hand (they change between
jaxlib releases) and cannot be captured in XLA's CUDA graphs; a compiled C++ handler of our own
needs a build step (jaxlib's FFI headers, a toolchain) in a pure-Python package and still has to
call a kernel that only exists after a run-time CuTe DSL compile — which is precisely what the
DSL runtime's handler does (load the exported object, launch on XLA's stream), version-matched
with the DSL that produced the object. What is ours: the adapter, the static validation, the
token, the zero-initialized scheduler counter (an aliased input, so XLA allocates and zeroes it
per execution), the side-effect marking and the error contract.

What the jit entry can and cannot check. Shapes, dtypes, layouts (JAX arrays are C-contiguous:
A is K-major, B N-major), tile fit and output alignment are static and checked while tracing.
The offsets VALUES (non-decreasing, last == S, multiples of 256 per expert on SM100) and the
pointer VALUES are data: under ``jax.jit`` they cannot be host-validated. ``validate_offsets=True``
checks them when the arrays are concrete (outside ``jax.jit``; one device-to-host copy) and raises
for tracers. Out-of-contract offsets give undefined results (the SM90 kernel reads only each
expert's rows; the SM100 kernel poisons experts that break the 256 rule with NaN).

Discrete outputs (the seed's entry): the buffers behind ``wgrad_ptrs`` are caller-owned memory the
kernel writes through; XLA does not know them. The custom call is marked ``has_side_effect`` (XLA
never drops or reorders it away, even when the token is unused), and returns a token:
``jax.block_until_ready(token)`` before reading the buffers; zero them yourself between runs
unless accumulating. The buffers must stay alive and unmoved across every execution of the traced
computation (never donate them to another jitted call).

Recompiles: the CuTe object is cached per static contract AND per shape (``cutlass.jax``'s cache
key includes the shapes); new offsets values never recompile, a new ``tokens_sum`` is a new JAX
shape, hence a new trace and one more CuTe compile (seconds).

JAX and CuTe DSL are imported inside the functions: importing this module needs neither.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

__all__ = [
    "JaxWgradPlan",
    "check_jax_wgrad_call",
    "grouped_gemm_wgrad_dense_jax_sm90",
    "grouped_gemm_wgrad_dense_jax_sm100",
    "grouped_gemm_wgrad_jax_sm90",
    "grouped_gemm_wgrad_jax_sm100",
    "grouped_wgrad_jax",
    "grouped_wgrad_jax_reference",
    "pack_pointers_uint8",
]

#: Output dtypes of the BF16 contract (seed table), by JAX dtype name.
OUT_DTYPE_NAMES = ("bfloat16", "float16", "float32")
#: Bytes per output element, for the 16-byte TMA row-stride rule of the outputs.
_OUT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: A is (H, S) C-contiguous = K-major: its row stride S * 2 bytes must be a multiple of 16 (TMA).
TOKENS_ALIGN = 8
#: SM100 contract: every expert token count a multiple of 256, hence tokens_sum as well.
SM100_GROUP_ALIGN = 256
#: B is (S, I) C-contiguous = N-major: its row stride I * 2 bytes must be a multiple of 16 (TMA).
INTERMEDIATE_ALIGN = 8
#: Bytes of one packed address in the uint8 form of ``wgrad_ptrs`` (little-endian int64).
_PTR_BYTES = 8
#: Version of the adapter's ABI; part of the compile key so an edited adapter never reuses a
#: stale object of the same process.
_ADAPTER_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Imports (lazy)
# ---------------------------------------------------------------------------------------------


def _jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise RuntimeError(
            "the JAX grouped wgrad entries need JAX (pip install 'moe-bwd-kernels[jax]')"
        ) from exc
    return jax, jnp


def _is_tracer(x: Any) -> bool:
    import jax

    return isinstance(x, jax.core.Tracer)


# ---------------------------------------------------------------------------------------------
# Static validation (shapes, dtypes, layouts: valid for tracers and concrete arrays alike)
# ---------------------------------------------------------------------------------------------


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


def _dtype_name(x: Any) -> str:
    import numpy as np

    return np.dtype(x.dtype).name


def _check_array(x: Any, arg: str) -> None:
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
            f"{arg} must be a JAX array (or a tracer of one), got {type(x).__name__}"
        )


def _check_jax_array(x: Any, arg: str) -> None:
    """``x`` is a JAX array, a tracer of one, or a numpy array; else a ValueError naming ``arg``
    (a torch tensor has ``shape`` and ``dtype`` too, but jnp code fails on it far inside)."""
    import jax
    import numpy as np

    if not isinstance(x, (jax.Array, np.ndarray)):
        hint = ""
        if isinstance(x, _torch_tensor_type()):
            hint = ("; convert a torch tensor with jax.dlpack.from_dlpack(t) (zero copy) or "
                    "jnp.asarray(t.cpu().numpy()), or call the torch entry grouped_gemm_wgrad")
        raise ValueError(
            f"{arg} must be a JAX array (jax.Array, a tracer of one, or a numpy array), got "
            f"{type(x).__name__}{hint}"
        )


def _torch_tensor_type() -> type:
    """torch.Tensor when torch is imported (never imports it), else a type nothing matches."""
    import sys

    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else type("_NoTorch", (), {})


def check_reference_call(a: Any, b: Any, offsets: Any, wgrad_dtype: Any) -> tuple[int, int]:
    """Static rules of :func:`grouped_wgrad_jax_reference` / :func:`grouped_wgrad_jax` (valid
    for tracers and concrete arrays alike): JAX arrays; ``a`` [H, S] and ``b`` [S, I] floating,
    rank 2, one S; ``offsets`` [E >= 1] int32 (the torch entry's rule); ``wgrad_dtype`` floating.

    Returns:
        (tokens_sum, num_experts).

    Raises:
        ValueError: naming the argument and the rule.
    """
    import jax.numpy as jnp

    for x, arg in ((a, "a"), (b, "b"), (offsets, "offsets")):
        _check_jax_array(x, arg)
    for x, arg, dims in ((a, "a", "[hidden, tokens_sum]"), (b, "b", "[tokens_sum, intermediate]")):
        if len(x.shape) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{arg} must be a 2-D {dims} floating array (bfloat16, float16, float32, "
                f"float64), got shape {tuple(x.shape)} {_dtype_name(x)}"
            )
    tokens_sum = int(a.shape[1])
    if int(b.shape[0]) != tokens_sum:
        raise ValueError(
            f"b.shape[0] ({b.shape[0]}) must equal a.shape[1] = tokens_sum ({tokens_sum})"
        )
    if len(offsets.shape) != 1 or _dtype_name(offsets) != "int32" or offsets.shape[0] < 1:
        raise ValueError(
            f"offsets must be a 1-D [num_experts >= 1] int32 array of cumulative expert ends, "
            f"got shape {tuple(offsets.shape)} {_dtype_name(offsets)}"
        )
    try:
        floating = jnp.issubdtype(jnp.dtype(wgrad_dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(
            f"wgrad_dtype must be a floating dtype (a jnp dtype or its name), got {wgrad_dtype!r}"
        )
    return tokens_sum, int(offsets.shape[0])


def _check_offsets_concrete(offsets: Any, tokens_sum: int) -> Any:
    """Host check of concrete offsets values (one device-to-host copy): non-decreasing from 0,
    last == tokens_sum. Returns the per-expert counts (int64 numpy)."""
    import numpy as np

    off = np.asarray(offsets).astype(np.int64)
    counts = np.diff(np.concatenate([[0], off]))
    if (counts < 0).any():
        raise ValueError(
            f"offsets must be non-decreasing cumulative ends starting at >= 0, got {off.tolist()}"
        )
    if off[-1] != tokens_sum:
        raise ValueError(
            f"offsets[-1] ({off[-1]}) must equal tokens_sum = a.shape[1] ({tokens_sum})"
        )
    return counts


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


def _kernel_key(arch: str, hidden: int, inter: int, num_experts: int, out_name: str,
                output_mode: str, accumulate: bool, mma_tiler_mn, cluster_shape_mn):
    """The kernel module's key (tile from ``configs/cuda`` unless given); ValueError naming the
    tiling rule when the shape does not fit it."""
    try:
        if arch == "sm90":
            from . import sm90_bf16 as mod

            tile = mod.select_sm90_tile_config(
                hidden, inter, num_experts, mma_tiler_mn=mma_tiler_mn, output_mode=output_mode,
                accumulate=accumulate,
            )
            key_cls = mod.Sm90WgradKey
        else:
            from . import sm100_bf16 as mod

            tile = mod.select_sm100_tile_config(
                hidden, inter, num_experts, mma_tiler_mn=mma_tiler_mn,
                cluster_shape_mn=cluster_shape_mn,
            )
            key_cls = mod.Sm100WgradKey
        return key_cls(
            hidden=hidden, intermediate=inter, num_experts=num_experts, a_major="k",
            b_major="n", out_dtype=out_name, output_mode=output_mode, accumulate=accumulate,
            input_order="tensor2d", tile=tile,
        )
    except ValueError as exc:
        raise ValueError(
            f"mma_tiler_mn={mma_tiler_mn}: unsupported {arch.upper()} tiling for hidden={hidden}, "
            f"intermediate={inter}: {exc}"
        ) from exc


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
    if len(a.shape) != 2 or _dtype_name(a) != "bfloat16":
        raise ValueError(
            f"a must be a 2-D [hidden, tokens_sum] bfloat16 array (K-major: C-contiguous), got "
            f"shape {tuple(a.shape)} {_dtype_name(a)}"
        )
    if len(b.shape) != 2 or _dtype_name(b) != "bfloat16":
        raise ValueError(
            f"b must be a 2-D [tokens_sum, intermediate] bfloat16 array (N-major: C-contiguous), "
            f"got shape {tuple(b.shape)} {_dtype_name(b)}"
        )
    hidden, tokens_sum = (int(d) for d in a.shape)
    if int(b.shape[0]) != tokens_sum:
        raise ValueError(
            f"b.shape[0] ({b.shape[0]}) must equal a.shape[1] = tokens_sum ({tokens_sum})"
        )
    inter = int(b.shape[1])
    if len(offsets.shape) != 1 or _dtype_name(offsets) != "int32" or offsets.shape[0] < 1:
        raise ValueError(
            f"offsets must be a 1-D [num_experts >= 1] int32 array of cumulative expert ends, "
            f"got shape {tuple(offsets.shape)} {_dtype_name(offsets)}"
        )
    num_experts = int(offsets.shape[0])
    if hidden < 1 or inter < 1:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) must be >= 1")
    if tokens_sum < 1:
        raise ValueError(
            "a: tokens_sum must be >= 1 in the jit entries (TMA has no empty boxes); with no "
            "tokens every expert's gradient is zero: skip the call"
        )
    if tokens_sum % TOKENS_ALIGN:
        raise ValueError(
            f"a: tokens_sum % {TOKENS_ALIGN} == 0 needed (A is K-major: 16-byte TMA row "
            f"strides), got tokens_sum={tokens_sum}; pad the token dimension with zero rows"
        )
    if arch == "sm100" and tokens_sum % SM100_GROUP_ALIGN:
        raise ValueError(
            f"a: the SM100 kernel needs every expert's token count a multiple of "
            f"{SM100_GROUP_ALIGN}, so tokens_sum too; got tokens_sum={tokens_sum}"
        )
    if inter % INTERMEDIATE_ALIGN:
        raise ValueError(
            f"b: intermediate % {INTERMEDIATE_ALIGN} == 0 needed (B is N-major: 16-byte TMA row "
            f"strides), got intermediate={inter}"
        )
    if output_mode not in ("dense", "discrete"):
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    ptr_dtype = None
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
        ptr_dtype = _dtype_name(wgrad_ptrs)
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
        out_name = _out_dtype_name(wgrad_dtype)
    else:
        if wgrad_ptrs is not None:
            raise ValueError("wgrad_ptrs must be None for dense outputs (the result is the array)")
        out_name = _out_dtype_name(wgrad_dtype)
        if wgrad_init is not None:
            _check_array(wgrad_init, "wgrad_init")
            if tuple(wgrad_init.shape) != (num_experts, hidden, inter):
                raise ValueError(
                    f"wgrad_init must be [num_experts, hidden, intermediate] = "
                    f"{(num_experts, hidden, inter)}, got {tuple(wgrad_init.shape)}"
                )
            init_name = _dtype_name(wgrad_init)
            if init_name != out_name:
                raise ValueError(
                    f"wgrad_init dtype ({init_name}) must equal wgrad_dtype ({out_name})"
                )
    if (inter * _OUT_BYTES[out_name]) % 16:
        raise ValueError(
            f"wgrad_dtype: intermediate * {_OUT_BYTES[out_name]} bytes must be a multiple of 16 "
            f"(16-byte TMA output rows of {out_name}), got intermediate={inter}"
        )
    accumulate = bool(accumulate_on_output) or wgrad_init is not None
    key = _kernel_key(arch, hidden, inter, num_experts, out_name, output_mode, accumulate,
                      mma_tiler_mn, cluster_shape_mn)
    return JaxWgradPlan(arch=arch, key=key, tokens_sum=tokens_sum, ptr_dtype=ptr_dtype)


def _check_concrete_devices(named: dict[str, Any]) -> Any:
    """The one device of the concrete arrays among ``named`` (tracers are skipped: XLA places
    them), or None when all are tracers.

    Raises:
        ValueError: an array spans several devices, or two arrays live on different devices.
    """
    device, first = None, None
    for arg, x in named.items():
        if x is None or _is_tracer(x) or not hasattr(x, "devices"):
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


def _check_values(plan: JaxWgradPlan, offsets: Any, wgrad_ptrs: Any) -> None:
    """Host validation of offsets and pointer values (concrete arrays only; one D2H copy)."""
    import numpy as np

    for x, arg in ((offsets, "offsets"), (wgrad_ptrs, "wgrad_ptrs")):
        if x is not None and _is_tracer(x):
            raise ValueError(
                f"validate_offsets=True needs a concrete {arg}: under jax.jit (or grad/vmap) "
                f"{arg} is a tracer whose values cannot be read on the host; validate outside "
                "jit, or pass validate_offsets=False"
            )
    counts = _check_offsets_concrete(offsets, plan.tokens_sum)
    if plan.arch == "sm100" and (counts % SM100_GROUP_ALIGN).any():
        raise ValueError(
            f"offsets: every expert token count must be a multiple of {SM100_GROUP_ALIGN} on "
            f"SM100, got counts {counts.tolist()}"
        )
    if wgrad_ptrs is not None:
        ptrs = np.asarray(wgrad_ptrs)
        ptrs = ptrs.view(np.int64) if ptrs.dtype == np.uint8 else ptrs.astype(np.int64)
        for e, p in enumerate(ptrs.tolist()):
            if p == 0 or p % 16:
                raise ValueError(
                    f"wgrad_ptrs[{e}] = {p:#x}: every output address must be non-null and "
                    "16-byte aligned"
                )


# ---------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------


def _device_cc(device: Any) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def _target_device(arch: str, named: dict[str, Any]):
    """The GPU the call runs on (a concrete argument's, else JAX's default device), checked.

    Raises:
        ValueError: arrays on different devices (see ``_check_concrete_devices``).
        RuntimeError: not a CUDA GPU, or the wrong compute capability for ``arch``; SM100 without
            the hardware-unverified opt-in.
    """
    import jax

    device = _check_concrete_devices(named)
    if device is None:
        device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        raise RuntimeError(
            f"grouped_gemm_wgrad_jax_{arch} runs a CUDA kernel; the arrays' device is {device} "
            f"({device.platform}). Use grouped_wgrad_jax(backend='auto'), which runs the "
            "jax.numpy twin elsewhere"
        )
    cc = _device_cc(device)
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
        from .sm100_bf16 import unverified_reason

        reason = unverified_reason()
        if reason is not None:
            raise RuntimeError(reason)
    return device


# ---------------------------------------------------------------------------------------------
# The adapter and its compile (CuTe DSL imported lazily)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _adapter():
    """The ``@cute.jit`` adapter ``(stream, a, b, offsets, counter, out)`` that the FFI buffers
    are handed to: rebuilds the kernel's operand layouts and calls the kernel class."""
    import cutlass
    from cutlass import cute

    from . import sm90_bf16, sm100_bf16

    sm90_kernel_class = sm90_bf16.kernel_class()
    sm100_kernel_class = sm100_bf16.kernel_class()

    @cute.jit
    def grouped_wgrad_xla_adapter(
        stream,
        a: cute.Tensor,  # (H, S) bf16 row-major (K-major A)
        b: cute.Tensor,  # (S, I) bf16 row-major (N-major B)
        offsets: cute.Tensor,  # (E,) int32
        counter: cute.Tensor,  # (1,) int32, zeroed by XLA (aliased input)
        out: cute.Tensor,  # (E, H, I) dense output, or (E,) int64 / (8E,) uint8 pointers
        *,
        arch: cutlass.Constexpr,
        key: cutlass.Constexpr,
        num_ctas: cutlass.Constexpr,
    ):
        m, n, e = key.hidden, key.intermediate, key.num_experts
        s = cute.assume(a.shape[1], divby=TOKENS_ALIGN)
        m_a = cute.make_tensor(a.iterator, cute.make_layout((m, s), stride=(s, 1)))
        m_b = cute.make_tensor(b.iterator, cute.make_layout((n, s), stride=(1, n)))
        m_off = cute.make_tensor(offsets.iterator, cute.make_layout((e,)))
        if cutlass.const_expr(key.output_mode == "dense"):
            m_out = cute.make_tensor(
                out.iterator, cute.make_layout((e, m, n), stride=(m * n, n, 1))
            )
        else:
            ptrs = cute.recast_ptr(out.iterator, dtype=cutlass.Int64)
            m_out = cute.make_tensor(ptrs, cute.make_layout((e,)))
        # both kernels take the zeroed tile counter of their dynamic scheduler
        m_cnt = cute.make_tensor(counter.iterator, cute.make_layout((1,)))
        if cutlass.const_expr(arch == "sm90"):
            kernel = sm90_kernel_class(key)
        else:
            kernel = sm100_kernel_class(key)
        kernel(m_a, m_b, m_off, m_out, m_cnt, cutlass.Int32(num_ctas), stream)

    return grouped_wgrad_xla_adapter


def _num_ctas(plan: JaxWgradPlan, device: Any) -> int:
    """Persistent grid: one CTA per SM (SM90) or one cluster per ``cluster_m`` SMs (SM100),
    never more than the tiles; a compile-time constant of the adapter."""
    sms = getattr(device, "core_count", None)
    if not sms:
        import torch

        sms = torch.cuda.get_device_properties(getattr(device, "local_hardware_id", 0) or 0)
        sms = sms.multi_processor_count
    if plan.arch == "sm100":
        cluster_m = plan.key.tile.cluster_shape_mn[0]
        return max(1, min(plan.key.num_tiles, int(sms) // cluster_m))
    return max(1, min(plan.key.num_tiles, int(sms)))


def _tensor_spec(x: Any, divisibility=None):
    from cutlass.jax import TensorSpec

    nd = len(x.shape)
    return TensorSpec(
        layout=tuple(reversed(range(nd))), mode=tuple(range(nd)), divisibility=divisibility
    )


def build_spec(plan: JaxWgradPlan, inputs: list, outputs: list, aliases: dict[int, int],
               num_ctas: int, compile_options: str | None = None):
    """``cutlass.jax``'s FunctionSpec of one call: row-major buffers, S divisible by 8, the
    adapter's compile-time keywords. ``inputs`` are arrays/tracers, ``outputs`` ShapeDtypeStructs.
    """
    import jax
    from cutlass.jax import compile as cjc

    in_specs = []
    for i, x in enumerate(inputs):
        div = None
        if i == 0:
            div = (None, TOKENS_ALIGN)  # a: (H, S)
        elif i == 1:
            div = (TOKENS_ALIGN, None)  # b: (S, I)
        in_specs.append(_tensor_spec(x, div))
    out_specs = [_tensor_spec(x) for x in outputs]
    ins_flat, in_tree = jax.tree.flatten(tuple(inputs))
    outs_flat, out_tree = jax.tree.flatten(tuple(outputs))
    return cjc.build_function_spec(
        ins_flat, in_tree, outs_flat, out_tree, tuple(in_specs), tuple(out_specs), aliases,
        compile_options, False,
        {"arch": plan.arch, "key": plan.key, "num_ctas": int(num_ctas)},
    )


_COMPILE_LOCK = threading.Lock()
#: Number of real CuTe compiles done by this module in this process (tests: no recompile).
COMPILE_COUNT = 0


def _compile(plan: JaxWgradPlan, spec) -> Any:
    """The exported object of the adapter for ``spec`` (cutlass.jax's cache: per spec + env)."""
    global COMPILE_COUNT
    from cutlass.jax import compile as cjc

    compile_key = ("moe_bwd.grouped_wgrad.jax_ffi", _ADAPTER_VERSION, plan.arch, plan.key)
    with _COMPILE_LOCK:
        before = len(cjc._CUTLASS_COMPILE_CACHE)
        result = cjc.get_or_compile_kernel(_adapter(), spec, compile_key=compile_key)
        if len(cjc._CUTLASS_COMPILE_CACHE) != before:
            COMPILE_COUNT += 1
    return result


def compile_adapter_offline(plan: JaxWgradPlan, inputs: list, outputs: list,
                            aliases: dict[int, int], gpu_arch: str, num_ctas: int = 132,
                            dump_dir: str | None = None):
    """Trace and compile the adapter of ``plan`` for ``gpu_arch`` ("sm_90a", "sm_100a") without a
    GPU (CI): the same ``cutlass.jax`` wrapper and buffer specs as a jit call, no object export
    and no JIT engine. Returns the compiled function; with ``dump_dir`` its ``__ptx__`` holds the
    PTX.

    Raises:
        RuntimeError / CuTe DSL errors: the adapter or the kernel does not compile.
    """
    import cuda.bindings.driver as cuda
    from cutlass import cute
    from cutlass.jax import compile as cjc

    from .launch import cross_compile_kwargs, pinned_cute_arch

    spec = build_spec(plan, inputs, outputs, aliases, num_ctas)
    options = f"--gpu-arch {gpu_arch}"
    if dump_dir is not None:
        options += f" --keep-ptx --dump-dir {dump_dir}"
    with _COMPILE_LOCK, pinned_cute_arch(gpu_arch):
        return cute.compile(
            cjc.jit_wrapper, cuda.CUstream(0), *spec.get_compile_args(), wrapped_fn=_adapter(),
            spec=spec, options=options, **cross_compile_kwargs(gpu_arch),
        )


def _ffi_target(allow_cuda_graph: bool) -> str:
    import cutlass.jax as cj

    version = cj.get_cutlass_call_ffi_version()
    cj.register_ffi(version)
    name = cj.get_cutlass_call_ffi_name(allow_cuda_graph, version)
    if not cj.is_ffi_registered(name=name):
        raise RuntimeError(
            "the CuTe DSL runtime's XLA FFI handler could not be registered (libcute_dsl_runtime "
            "not found next to nvidia-cutlass-dsl); reinstall nvidia-cutlass-dsl==4.8.1"
        )
    return name


def _ffi_launch(plan: JaxWgradPlan, device: Any, inputs: list, outputs: list,
                aliases: dict[int, int], *, has_side_effect: bool, allow_cuda_graph: bool):
    import jax

    spec = build_spec(plan, inputs, outputs, aliases, _num_ctas(plan, device))
    kernel = _compile(plan, spec)
    call = jax.ffi.ffi_call(
        _ffi_target(allow_cuda_graph),
        tuple(outputs),
        has_side_effect=has_side_effect,
        input_output_aliases=dict(aliases),
        input_layouts=[tuple(range(len(x.shape))) for x in inputs],
        output_layouts=[tuple(range(len(x.shape))) for x in outputs],
    )
    return call(*inputs, module=kernel.module, key=kernel.fingerprint)


# ---------------------------------------------------------------------------------------------
# Public entries
# ---------------------------------------------------------------------------------------------


def _token_entry(arch, a, b, offsets, wgrad_ptrs, wgrad_dtype, accumulate_on_output,
                 validate_offsets, mma_tiler_mn, cluster_shape_mn, allow_cuda_graph):
    jax, jnp = _jax()
    plan = check_jax_wgrad_call(
        arch, a, b, offsets, wgrad_ptrs=wgrad_ptrs, output_mode="discrete",
        wgrad_dtype=wgrad_dtype, accumulate_on_output=accumulate_on_output,
        mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
    )
    if validate_offsets:
        _check_values(plan, offsets, wgrad_ptrs)
    named = {"a": a, "b": b, "offsets": offsets, "wgrad_ptrs": wgrad_ptrs}
    device = _target_device(arch, named)
    counter = jnp.zeros((1,), jnp.int32)
    (token,) = _ffi_launch(
        plan, device, [a, b, offsets, counter, wgrad_ptrs],
        [jax.ShapeDtypeStruct((1,), jnp.int32)], {3: 0},
        has_side_effect=True, allow_cuda_graph=allow_cuda_graph,
    )
    return token


def _dense_entry(arch, a, b, offsets, wgrad_dtype, wgrad_init, validate_offsets, mma_tiler_mn,
                 cluster_shape_mn, allow_cuda_graph):
    jax, jnp = _jax()
    plan = check_jax_wgrad_call(
        arch, a, b, offsets, wgrad_init=wgrad_init, output_mode="dense",
        wgrad_dtype=wgrad_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
    )
    if validate_offsets:
        _check_values(plan, offsets, None)
    named = {"a": a, "b": b, "offsets": offsets, "wgrad_init": wgrad_init}
    device = _target_device(arch, named)
    key = plan.key
    out_sd = jax.ShapeDtypeStruct((key.num_experts, key.hidden, key.intermediate),
                                  jnp.dtype(key.out_dtype))
    cnt_sd = jax.ShapeDtypeStruct((1,), jnp.int32)
    counter = jnp.zeros((1,), jnp.int32)
    if wgrad_init is None:
        inputs, outputs, aliases = [a, b, offsets, counter], [out_sd, cnt_sd], {3: 1}
    else:  # accumulate: the kernel adds into a buffer XLA initialises with wgrad_init (aliased)
        inputs, outputs, aliases = [a, b, offsets, counter, wgrad_init], [cnt_sd, out_sd], {
            3: 0, 4: 1}
    results = _ffi_launch(plan, device, inputs, outputs, aliases, has_side_effect=False,
                          allow_cuda_graph=allow_cuda_graph)
    return results[0] if wgrad_init is None else results[1]


_TOKEN_DOC = """The seed's ``jax.jit`` entry on {what}: ``wgrad[e] (+)= a[:, begin:end] @ b[begin:end]``
    written through caller-owned addresses; returns a completion token.

    Usable inside and outside ``jax.jit``. One XLA FFI custom call (see the module docstring)
    launched on XLA's stream, marked ``has_side_effect`` (never dropped, even with the token
    unused).

    Dimensions: H hidden, S tokens_sum, I intermediate, E experts.

    Args:
        a: [H, S] jnp.bfloat16, C-contiguous (K-major A); S >= 1, S % 8 == 0{s_rule}.
        b: [S, I] jnp.bfloat16, C-contiguous (N-major B); I % 8 == 0.
        offsets: [E] jnp.int32 cumulative expert ends: non-decreasing, last == S{count_rule}.
            Values are data: not checked under ``jax.jit`` (see ``validate_offsets``).
        wgrad_ptrs: [E] jnp.int64 (``jax_enable_x64``) or [8 * E] jnp.uint8 (little-endian
            packed, :func:`pack_pointers_uint8`) device addresses of the caller's [H, I]
            row-major outputs of ``wgrad_dtype``, non-null, 16-byte aligned. They must stay
            alive and unmoved across every execution of the traced computation.
        wgrad_dtype: jnp.bfloat16 | jnp.float16 | jnp.float32 (I * bytes % 16 == 0).
        accumulate_on_output: add into the outputs instead of overwriting them.
        validate_offsets: host-check offsets and pointer values (concrete arrays only: raises
            ValueError for tracers); default False.
        mma_tiler_mn{cluster_arg}: tiling (default: from ``configs/cuda``).
        allow_cuda_graph: let XLA capture the launch in its CUDA graphs (default True).

    Returns:
        token: [1] jnp.int32 produced by the custom call (its value is meaningless):
        ``jax.block_until_ready(token)`` before reading the outputs.

    Raises:
        ValueError: a static rule (shape, dtype, layout, pointer-array length, tiling), arrays
            on different devices, or ``validate_offsets=True`` with tracers / bad values.
        RuntimeError: no CUDA GPU or the wrong one{sm100_extra}; JAX or CuTe DSL missing.
    """

_DENSE_DOC = """The functional form on {what}: returns ``wgrad`` [E, H, I] as a JAX array.

    ``wgrad[e] = a[:, begin:end] @ b[begin:end]`` (fp32 accumulation), ``+ wgrad_init[e]`` when
    given. XLA owns the output (no external pointers, no token); usable inside ``jax.jit`` and
    in a ``jax.custom_vjp`` backward (see :func:`grouped_wgrad_jax`). Empty experts give zeros.

    Args:
        a, b, offsets, validate_offsets, mma_tiler_mn{cluster_arg}, allow_cuda_graph: as
            :func:`grouped_gemm_wgrad_jax_{arch}`.
        wgrad_dtype: output dtype, jnp.bfloat16 | jnp.float16 | jnp.float32 (default float32).
        wgrad_init: optional [E, H, I] array of ``wgrad_dtype`` to accumulate into (functional:
            a new array is returned; XLA aliases the buffer when it can).

    Returns:
        [E, H, I] array of ``wgrad_dtype`` on the inputs' device.

    Raises:
        As :func:`grouped_gemm_wgrad_jax_{arch}`.
    """


def grouped_gemm_wgrad_jax_sm90(
    a: Any,
    b: Any,
    offsets: Any,
    wgrad_ptrs: Any,
    *,
    wgrad_dtype: Any = "bfloat16",
    accumulate_on_output: bool = False,
    validate_offsets: bool = False,
    mma_tiler_mn: tuple[int, int] | None = None,
    allow_cuda_graph: bool = True,
):
    return _token_entry("sm90", a, b, offsets, wgrad_ptrs, wgrad_dtype, accumulate_on_output,
                        validate_offsets, mma_tiler_mn, None, allow_cuda_graph)


def grouped_gemm_wgrad_jax_sm100(
    a: Any,
    b: Any,
    offsets: Any,
    wgrad_ptrs: Any,
    *,
    wgrad_dtype: Any = "bfloat16",
    accumulate_on_output: bool = False,
    validate_offsets: bool = False,
    mma_tiler_mn: tuple[int, int] | None = (256, 256),
    cluster_shape_mn: tuple[int, int] | None = None,
    allow_cuda_graph: bool = True,
):
    return _token_entry("sm100", a, b, offsets, wgrad_ptrs, wgrad_dtype, accumulate_on_output,
                        validate_offsets, mma_tiler_mn, cluster_shape_mn, allow_cuda_graph)


def grouped_gemm_wgrad_dense_jax_sm90(
    a: Any,
    b: Any,
    offsets: Any,
    *,
    wgrad_dtype: Any = "float32",
    wgrad_init: Any = None,
    validate_offsets: bool = False,
    mma_tiler_mn: tuple[int, int] | None = None,
    allow_cuda_graph: bool = True,
):
    return _dense_entry("sm90", a, b, offsets, wgrad_dtype, wgrad_init, validate_offsets,
                        mma_tiler_mn, None, allow_cuda_graph)


def grouped_gemm_wgrad_dense_jax_sm100(
    a: Any,
    b: Any,
    offsets: Any,
    *,
    wgrad_dtype: Any = "float32",
    wgrad_init: Any = None,
    validate_offsets: bool = False,
    mma_tiler_mn: tuple[int, int] | None = (256, 256),
    cluster_shape_mn: tuple[int, int] | None = None,
    allow_cuda_graph: bool = True,
):
    return _dense_entry("sm100", a, b, offsets, wgrad_dtype, wgrad_init, validate_offsets,
                        mma_tiler_mn, cluster_shape_mn, allow_cuda_graph)


_SM90_FMT = {
    "s_rule": "", "count_rule": " (any count >= 0)", "cluster_arg": "",
    "sm100_extra": " (SM 9.x needed)",
}
_SM100_FMT = {
    "s_rule": ", S % 256 == 0", "count_rule": ", every count a multiple of 256",
    "cluster_arg": ", cluster_shape_mn",
    "sm100_extra": " (SM100+ needed; the kernel is hardware-unverified: set "
    "MOE_BWD_ENABLE_UNVERIFIED_SM100=1)",
}
grouped_gemm_wgrad_jax_sm90.__doc__ = _TOKEN_DOC.format(what="Hopper (SM 9.x)", **_SM90_FMT)
grouped_gemm_wgrad_jax_sm100.__doc__ = _TOKEN_DOC.format(what="SM100+", **_SM100_FMT)
grouped_gemm_wgrad_dense_jax_sm90.__doc__ = _DENSE_DOC.format(
    what="Hopper (SM 9.x)", arch="sm90", **_SM90_FMT)
grouped_gemm_wgrad_dense_jax_sm100.__doc__ = _DENSE_DOC.format(
    what="SM100+", arch="sm100", **_SM100_FMT)


def grouped_wgrad_jax_reference(a: Any, b: Any, offsets: Any, *, wgrad_dtype: Any = "float32",
                                validate_offsets: bool = True):
    """The ``jax.numpy`` twin: ``wgrad[e] = a[:, begin:end] @ b[begin:end]`` in fp32, [E, H, I].

    Any JAX backend, any floating dtype, any shapes (no alignment rules). A reference, not a
    fast path, but without an E-fold blow-up: at most (S + E·T)·H·I multiply-adds with T the
    token chunk (64..256), fp32 sums chunk by chunk (equal to the torch twin up to fp32
    summation order); ``_ragged_wgrad_chunked`` says why not ``jax.lax.ragged_dot_general``.

    Args:
        a: [H, S] floating JAX array. b: [S, I] floating JAX array.
        offsets: [E] int32 cumulative expert ends: non-decreasing, last == S (the torch entry's
            rules; any count per expert, 0 included).
        wgrad_dtype: floating dtype of the result (default float32).
        validate_offsets: check the offsets VALUES when they are concrete (one device-to-host
            copy): non-decreasing from 0, last == S. Under ``jax.jit`` / ``grad`` / ``vmap`` the
            offsets are tracers whose values cannot be checked: only the static rules (types,
            ranks, dtypes, shapes) are, and out-of-contract offsets give unspecified results.
    Returns:
        [E, H, I] array of ``wgrad_dtype``.
    Raises:
        ValueError: naming the argument: not a JAX array (a torch tensor included), wrong rank
            or dtype, ``b.shape[0] != a.shape[1]``, offsets not [E >= 1] int32, a non-floating
            ``wgrad_dtype``; with concrete offsets, their values.
    """
    check_reference_call(a, b, offsets, wgrad_dtype)
    if validate_offsets and not _is_tracer(offsets):
        _check_offsets_concrete(offsets, int(a.shape[1]))
    return _ragged_wgrad_chunked(a, b, offsets).astype(wgrad_dtype)


#: Tokens per chunk of the jnp twin: bounds (H·T + T·I) live operand bytes per step and the
#: masked work to E·T tokens beyond S. T ≈ S / E (the masked waste then at most ~S, i.e. ≤ ~2x a
#: dense product), at least 64 (fewer, smaller steps cost more in loop overhead: 64 was the best
#: of 32..256 at S=4096, H=1024, I=512, E=128 on the CPU) and at most 256 (waste E·256 ≪ S once
#: S/E is large).
_TWIN_CHUNK_MIN, _TWIN_CHUNK_MAX = 64, 256


def _twin_chunk(tokens_sum: int, num_experts: int) -> int:
    per = max(1, -(-tokens_sum // num_experts))
    return min(_TWIN_CHUNK_MAX, max(_TWIN_CHUNK_MIN, 1 << (per - 1).bit_length()))


def _ragged_wgrad_chunked(a: Any, b: Any, offsets: Any) -> Any:
    """fp32 [E, H, I] = per-expert ``a[:, begin:end] @ b[begin:end]`` without an E-fold blow-up.

    Why not ``jax.lax.ragged_dot_general`` (ragged contracting dims, the tgmm form; same API in
    JAX 0.10.2): off TPU its lowering is ``_ragged_dot_general_impl``, which masks both operands
    to dense [E, H, S] and [E, S, I] copies and contracts all of them: E x the FLOPs and memory,
    as slow as the one-hot einsum it would replace (measured 14.8 s vs 15.7 s on the CPU at
    S=4096, H=1024, I=512, E=128). Instead: tokens in static chunks of T; the (chunk, expert)
    pairs that overlap number at most ``ceil(S/T) + E - 1`` (each expert boundary adds one), a
    static trip count; step p finds its pair from the offsets (dynamic: no retrace for new
    values), masks the chunk's tokens outside the expert, and adds the [H, T] @ [T, I] product
    into ``out[e]``. Work: (S + E·T)·H·I multiply-adds at most; memory: the [E, H, I] result and
    one chunk. Steps past the real pairs add zeros. ``fori_loop`` with static bounds lowers to a
    scan, so the twin stays reverse-differentiable, vmappable and jit-compatible.
    """
    _, jnp = _jax()
    from jax import lax

    hidden, tokens_sum = (int(d) for d in a.shape)
    inter = int(b.shape[1])
    num_experts = int(offsets.shape[0])
    tile = _twin_chunk(tokens_sum, num_experts)
    n_chunks = max(1, -(-tokens_sum // tile))
    pad = n_chunks * tile - tokens_sum
    a_HS = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad)))
    b_SI = jnp.pad(b.astype(jnp.float32), ((0, pad), (0, 0)))
    # The barrier keeps XLA from treating offsets known at trace time (a closed-over constant) as
    # constants: jax 0.11.2's GPU compiler sank them into the loop body and then failed to
    # evaluate the dynamic-slice offsets ("Failed to evaluate instruction ... depends on
    # parameters", H200, 2026-12-01). Data offsets, the usual case, are unaffected.
    ends_E = lax.optimization_barrier(offsets.astype(jnp.int32))
    begins_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E[:-1]])
    first_chunk_E = begins_E // tile
    pairs_E = jnp.where(ends_E > begins_E, (ends_E - 1) // tile - first_chunk_E + 1, 0)
    pairs_end_E = jnp.cumsum(pairs_E)
    pairs_begin_E = pairs_end_E - pairs_E
    tok_T = jnp.arange(tile, dtype=jnp.int32)

    def step(p, out_EHI):
        e = jnp.minimum(jnp.searchsorted(pairs_end_E, p, side="right"), num_experts - 1)
        chunk = jnp.clip(first_chunk_E[e] + p - pairs_begin_E[e], 0, n_chunks - 1)
        t0 = chunk * tile
        a_HT = lax.dynamic_slice_in_dim(a_HS, t0, tile, axis=1)
        b_TI = lax.dynamic_slice_in_dim(b_SI, t0, tile, axis=0)
        tok = t0 + tok_T
        live = (tok >= begins_E[e]) & (tok < ends_E[e]) & (p < pairs_end_E[-1])
        part_HI = jnp.dot(jnp.where(live[None, :], a_HT, 0.0), b_TI,
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return lax.dynamic_update_index_in_dim(out_EHI, out_EHI[e] + part_HI, e, 0)

    out = jnp.zeros((num_experts, hidden, inter), jnp.float32)
    return lax.fori_loop(0, n_chunks + num_experts - 1, step, out)


def _auto_arch(named: dict[str, Any]) -> str | None:
    """The kernel family for the arrays' device (a concrete argument's, else JAX's default)."""
    import jax

    device = _check_concrete_devices(named) or jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        return None
    cc = _device_cc(device)
    if cc is None:
        return None
    if cc[0] == 9:
        return "sm90"
    if cc[0] >= 10:
        from .sm100_bf16 import unverified_reason

        return "sm100" if unverified_reason() is None else None
    return None


def grouped_wgrad_jax(
    a: Any,
    b: Any,
    offsets: Any,
    *,
    wgrad_dtype: Any = "float32",
    backend: str = "auto",
    group_align: int = 1,
    validate_offsets: bool = True,
):
    """Grouped wgrad for ``jax.jit`` code on any backend: [E, H, I] = per-expert ``a_e @ b_e``.

    ``backend="auto"``: the SM90 kernel on SM 9.x, the SM100 kernel on SM100+ (only with the
    hardware-unverified opt-in and ``group_align`` a multiple of 256), when the call fits the
    kernel's static contract (:func:`check_jax_wgrad_call`); else :func:`grouped_wgrad_jax_reference`
    (CPU included). "sm90" / "sm100" force the kernel (errors instead of falling back), "xla"
    forces the twin.

    Example (a MoE expert projection whose weight gradient runs on the kernel)::

        import functools, jax, jax.numpy as jnp
        from cuda_kernels.grouped_wgrad.jax_ffi import grouped_wgrad_jax

        @jax.custom_vjp
        def expert_linear(x_SH, w_EHI, group_sizes_E):
            return jax.lax.ragged_dot(x_SH, w_EHI, group_sizes_E)          # [S, I]

        def fwd(x_SH, w_EHI, group_sizes_E):
            return expert_linear(x_SH, w_EHI, group_sizes_E), (x_SH, w_EHI, group_sizes_E)

        def bwd(res, dy_SI):
            x_SH, w_EHI, group_sizes_E = res
            dx_SH = jax.lax.ragged_dot(dy_SI, jnp.swapaxes(w_EHI, 1, 2), group_sizes_E)
            offsets_E = jnp.cumsum(group_sizes_E).astype(jnp.int32)
            dw_EHI = grouped_wgrad_jax(x_SH.T, dy_SI, offsets_E, wgrad_dtype=w_EHI.dtype)
            return dx_SH, dw_EHI, None

        expert_linear.defvjp(fwd, bwd)
        loss = lambda x, w, g: expert_linear(x, w, g).astype(jnp.float32).sum()
        dw = jax.jit(jax.grad(loss, argnums=1))(x_SH, w_EHI, group_sizes_E)

    Args:
        a: [H, S]. b: [S, I]. offsets: [E] int32 cumulative ends.
        wgrad_dtype: result dtype (bfloat16 | float16 | float32 for the kernels).
        backend: "auto" | "sm90" | "sm100" | "xla".
        group_align: the row alignment the caller guarantees for every expert (not checked);
            the SM100 kernel is chosen by "auto" only for a multiple of 256.
        validate_offsets: check the offsets VALUES when they are concrete (outside ``jax.jit``;
            one device-to-host copy): non-decreasing from 0, last == S, and on the SM100 kernel
            every count a multiple of 256. Under ``jax.jit`` (the usual case, e.g. a
            ``custom_vjp`` backward) the offsets are tracers: their values cannot be checked —
            only the static rules are — and out-of-contract offsets give unspecified results.
    Returns:
        [E, H, I] array of ``wgrad_dtype``.
    Raises:
        ValueError: unknown backend; a rule of :func:`grouped_wgrad_jax_reference` (types,
            ranks, dtypes, shapes; concrete offsets values); with a forced kernel backend, as
            its entry.
    """
    if backend not in ("auto", "sm90", "sm100", "xla"):
        raise ValueError(f"backend must be 'auto', 'sm90', 'sm100' or 'xla', got {backend!r}")
    tokens_sum, _ = check_reference_call(a, b, offsets, wgrad_dtype)
    counts = None
    if validate_offsets and not _is_tracer(offsets):
        counts = _check_offsets_concrete(offsets, tokens_sum)
    arch = backend
    if backend == "auto":
        arch = _auto_arch({"a": a, "b": b, "offsets": offsets})
        if arch == "sm100" and group_align % SM100_GROUP_ALIGN:
            arch = None
        if arch is not None:
            try:
                check_jax_wgrad_call(arch, a, b, offsets, output_mode="dense",
                                     wgrad_dtype=wgrad_dtype)
            except ValueError:
                arch = None
    if arch in (None, "xla"):
        return grouped_wgrad_jax_reference(a, b, offsets, wgrad_dtype=wgrad_dtype,
                                           validate_offsets=False)  # checked above
    if arch == "sm100" and counts is not None and (counts % SM100_GROUP_ALIGN).any():
        raise ValueError(
            f"offsets: every expert token count must be a multiple of {SM100_GROUP_ALIGN} on "
            f"SM100, got counts {counts.tolist()}"
        )
    entry = (grouped_gemm_wgrad_dense_jax_sm90 if arch == "sm90"
             else grouped_gemm_wgrad_dense_jax_sm100)
    return entry(a, b, offsets, wgrad_dtype=wgrad_dtype)


def pack_pointers_uint8(addresses) -> Any:
    """Device addresses (ints, e.g. ``x.unsafe_buffer_pointer()`` of caller-owned JAX arrays) as
    the packed little-endian ``uint8 [8 * E]`` form of ``wgrad_ptrs`` (no ``jax_enable_x64``).

    Returns:
        numpy uint8 array; ``jax.device_put`` it onto the GPU.
    Raises:
        ValueError: an address is negative or does not fit in 64 bits.
    """
    import numpy as np

    values = [int(p) for p in addresses]
    for e, p in enumerate(values):
        if p < 0 or p >= 1 << 64:
            raise ValueError(f"addresses[{e}] = {p} is not a 64-bit device address")
    return np.asarray(values, dtype=np.uint64).astype("<u8").view(np.uint8)

