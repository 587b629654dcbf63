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

The static rules are the torch entries' own (``jax_plan.check_jax_wgrad_call``: the JAX arrays'
C-contiguous layouts as shape-only torch tensors through ``pipeline.validate_call``, the one
validation pipeline); the tile rules and the SM100 token multiple are ``tiles.py``'s, the kernel
key ``bf16.contract_key``'s, the SM100 opt-in the registered family's gate. This module imports
the package's lower layers; ``jax.py`` (the facade's JAX users) imports it, never the reverse.

JAX and CuTe DSL are imported inside the functions: importing this module needs neither.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from . import bf16
from ._types import TMA_ALIGN_BYTES
from .jax_arrays import import_jax
from .jax_plan import (
    JaxWgradPlan,
    auto_arch,
    check_jax_wgrad_call,
    check_values,
    target_device,
)
from .jax_ref import (
    check_offsets_concrete,
    check_reference_call,
    grouped_wgrad_jax_reference,
    is_tracer,
)

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

#: A is (H, S) C-contiguous = K-major: its row stride S * 2 bytes must be a multiple of 16 (TMA);
#: the adapter declares S divisible by it (``validate.validate_operands`` checks the rule).
TOKENS_ALIGN = TMA_ALIGN_BYTES // 2
#: Version of the adapter's ABI; part of the compile key so an edited adapter never reuses a
#: stale object of the same process.
_ADAPTER_VERSION = 1


def _jax():
    return import_jax("the JAX grouped wgrad entries")


# ---------------------------------------------------------------------------------------------
# The adapter and its compile (CuTe DSL imported lazily)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _adapter():
    """The ``@cute.jit`` adapter ``(stream, a, b, offsets, counter, out)`` that the FFI buffers
    are handed to: rebuilds the kernel's operand layouts and calls the kernel class."""
    import cutlass
    from cutlass import cute

    from ..gemm import registry

    sm90_kernel_class = registry.provider("sm90", "bf16").load().kernel_class()
    sm100_kernel_class = registry.provider("sm100", "bf16").load().kernel_class()

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
            # the SM90 kernel takes the gather indexes (a_rows, b_rows) after the counter: None,
            # as the non-gather launch passes (the JAX keys never gather)
            sm90_kernel_class(key)(
                m_a, m_b, m_off, m_out, m_cnt, None, None, cutlass.Int32(num_ctas), stream
            )
        else:
            sm100_kernel_class(key)(m_a, m_b, m_off, m_out, m_cnt, cutlass.Int32(num_ctas), stream)

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

    from ..gemm.launch import cross_compile_kwargs, pinned_cute_arch

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
        check_values(plan, offsets, wgrad_ptrs)
    named = {"a": a, "b": b, "offsets": offsets, "wgrad_ptrs": wgrad_ptrs}
    device = target_device(arch, named)
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
        check_values(plan, offsets, None)
    named = {"a": a, "b": b, "offsets": offsets, "wgrad_init": wgrad_init}
    device = target_device(arch, named)
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
_SM100_ALIGN = bf16.TOKEN_ALIGN["sm100"]  # tiles.SM100_TILES.group_align
_SM100_FMT = {
    "s_rule": f", S % {_SM100_ALIGN} == 0",
    "count_rule": f", every count a multiple of {_SM100_ALIGN}",
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
    if validate_offsets and not is_tracer(offsets):
        counts = check_offsets_concrete(offsets, tokens_sum)
    arch = backend
    if backend == "auto":
        arch = auto_arch({"a": a, "b": b, "offsets": offsets})
        if group_align % bf16.TOKEN_ALIGN.get(arch, 1):
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
    align = bf16.TOKEN_ALIGN[arch]
    if counts is not None and (counts % align).any():
        raise ValueError(
            f"offsets: every expert token count must be a multiple of {align} on "
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

