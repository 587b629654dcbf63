"""The cuDNN-style wrapper functions ``grouped_gemm_wgrad_wrapper_sm100`` / ``_sm90`` (compile once
per static contract, then launch), the hot-path ``grouped_wgrad_into`` and the operator caches.

A wrapper call is one ``_types.WgradCall``: the device rule of its class first
(``classes.require_device``), then ``pipeline.validate_call`` (every rule, in the pipeline's
order), the cached ``pipeline.CompiledWgrad`` of the static contract (the tile fit and the compile
once per contract), the outputs, the launch. JAX arrays are converted by ``jax_arrays`` (DLPack)
before any of that.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import bf16, jax_arrays
from ._types import OFFSETS_ALIGN_BYTES, TMA_ALIGN_BYTES, ArgNames, TupleDict, WgradCall
from .classes import ARCH_CLASSES, GroupedGemmWgradSm90, GroupedGemmWgradSm100, require_device
from .pipeline import CompiledWgrad, allocate_outputs, compile_contract, validate_call
from .torch_ref import check_row_indexes, gather_operands
from .validate import check_ptr, check_same_device, clear_validated

__all__ = [
    "WGRAD_GATHER_BACKENDS",
    "wgrad_gather_enabled",
    "WRAPPERS",
    "clear_grouped_wgrad_caches",
    "grouped_gemm_wgrad_wrapper_sm90",
    "grouped_gemm_wgrad_wrapper_sm100",
    "grouped_wgrad_into",
    "run_wrapper",
]

_CACHE_LOCK = threading.RLock()
#: (static contract, device) -> its compiled operator (every wrapper call of the contract).
_OP_CACHE: dict[tuple, CompiledWgrad] = {}
#: grouped_wgrad_into's metadata key -> the compiled operator (no validation on a hit); a
#: gathered call's key -> its launch function.
_INTO_CACHE: dict[tuple, Any] = {}


def clear_grouped_wgrad_caches() -> None:
    """Forget compiled launchers and cached wrapper operators (tests, or to free modules)."""
    with _CACHE_LOCK:
        _OP_CACHE.clear()
        _INTO_CACHE.clear()
    bf16.clear_launcher_cache()
    clear_validated()


def run_wrapper(cls: type, call: WgradCall) -> tuple[TupleDict, CompiledWgrad]:
    """The body of both seed wrappers (and of ``grouped_wgrad_into``'s first call of a key):
    ``cls`` is ``GroupedGemmWgradSm100`` / ``GroupedGemmWgradSm90`` (its arch, name and device
    rule). Returns the result and the compiled operator that ran.

    Raises:
        ValueError / RuntimeError: see the wrappers.
    """
    arch = cls._ARCH
    # 0. The device rule first (CUDA available, the compute capability), as check_support(): a
    #    call that cannot run here says so before any rule on its data (a few µs per call).
    if isinstance(call.a, torch.Tensor):
        require_device(cls, call.a.device, call.names.a)
    # 1. Every rule of the call (CPU-testable with a faked env.query_arch), before any output is
    #    written.
    v = validate_call(call, arch)
    # 2. The operator of the static contract (tokens_sum is not in the key): the tile fit and
    #    the compile happen once per contract.
    with _CACHE_LOCK:
        op = next(
            (_OP_CACHE[(c, str(v.device))] for c in v.contracts if (c, str(v.device)) in _OP_CACHE),
            None,
        )
    if op is None:
        v.check_fits()
        op = compile_contract(v.contract, cls._NAME)
        with _CACHE_LOCK:
            _OP_CACHE[(v.contract, str(v.device))] = op
    # 3. Outputs (allocated on the launch stream), then the launch.
    wgrad_tensor, out = allocate_outputs(v)
    op.launch(
        v.a, v.b, call.offsets, out, stream=call.current_stream, scales=v.scales,
        workspace=v.workspace,
    )
    # Discrete with wgrad_ptrs only: caller-owned memory, nothing to return (the seed); with both
    # (cuDNN's calls), the kernel wrote through the pointers and the given tensor is returned.
    return TupleDict(wgrad_tensor=wgrad_tensor), op


def _seed_wrapper(cls, wrapper, args: dict) -> TupleDict:
    """The body of both seed wrappers (``args``: the wrapper's own arguments, by name): JAX arrays
    go through :func:`jax_arrays.call_wrapper_on_jax_arrays` (the seed's eager JAX support),
    everything else through :func:`run_wrapper` with ``cls``."""
    if jax_arrays.has_jax_arrays(*args.values()):
        return jax_arrays.call_wrapper_on_jax_arrays(wrapper, **args)
    call = WgradCall(
        a=args["a_tensor"], b=args["b_tensor"], offsets=args["offsets_tensor"],
        sfa=args["sfa_tensor"], sfb=args["sfb_tensor"], global_scale_a=args["global_scale_a"],
        global_scale_b=args["global_scale_b"], output_mode=args["output_mode"],
        wgrad_tensor=args["wgrad_tensor"], wgrad_ptrs=args["wgrad_ptrs"],
        wgrad_dtype=args["wgrad_dtype"], acc_dtype=args["acc_dtype"],
        mma_tiler_mn=args["mma_tiler_mn"], cluster_shape_mn=args["cluster_shape_mn"],
        sf_vec_size=args["sf_vec_size"], sf_fp8_dtype_override=args["sf_fp8_dtype_override"],
        accumulate_on_output=bool(args["accumulate_on_output"]),
        input_order=args["input_order"], current_stream=args["current_stream"],
        descriptor_workspace=args["descriptor_workspace"],
        validate_offsets=args["validate_offsets"],
    )
    return run_wrapper(cls, call)[0]


def _wrapper_doc(name: str, cls_name: str, extra: str) -> str:
    return f"""Compile (once per static contract) and run the grouped wgrad: the seed's wrapper.

    ``result = {name}(a_tensor, b_tensor, None, None, offsets_tensor, output_mode="dense")``
    returns ``TupleDict(wgrad_tensor=...)``: ``result["wgrad_tensor"]`` or ``(w,) = result``.

    Args:
        a_tensor: [H, S] torch.bfloat16 (K-major or M-major), CUDA.
        b_tensor: [S, I] torch.bfloat16 (K-major or N-major), same device.
        sfa_tensor, sfb_tensor, global_scale_a, global_scale_b, sf_fp8_dtype_override: must be
            None (BF16). The positional order is cuDNN's (``sf_fp8_dtype_override`` between
            ``sf_vec_size`` and ``accumulate_on_output``; keywords after ``current_stream``).

    Block-scaled (the seed's legacy surface, selected only by a matching FP8 / FP4 A/B pair):
        a_tensor / b_tensor: float8_e4m3fn or float8_e5m2 [H, S] / [S, I] (majors as BF16), or
            packed FP4 (uint8 / float4_e2m1fn_x2, two tokens per byte, even token in the low
            nibble) [H, S/2] / [S/2, I], K-major.
        sfa_tensor / sfb_tensor: [round_up(H,128), cols] / [round_up(I,128), cols] contiguous,
            cuDNN's 128x4-atom layout (per expert round_up(ceil(k_e / sf_vec_size), 4) columns,
            concatenated; cols = round_up(ceil(S / sf_vec_size), 4) for aligned counts):
            float8_e8m0fnu with sf_vec_size=32 (MXFP8, MXFP4) or float8_e4m3fn with
            sf_vec_size=16 (NVFP4; then global_scale_a / global_scale_b [E] float32 are
            required, the epilogue multiplies by global_scale_a[e] * global_scale_b[e]).
        sf_fp8_dtype_override: None only (cuDNN's Rubin-only override); part of the cache key.
        descriptor_workspace: as below; a native kernel gets it for its per-expert descriptors.
        Execution: the native kernel of a registered family when one serves the contract
        (``blockscaled.native_launcher``), else the torch twin
        ``blockscaled_ref.grouped_wgrad_blockscaled_torch`` on the tensors' device (it reads
        offsets on the host, so it is not graph-capturable).
        offsets_tensor: [E] torch.int32 contiguous cumulative ends; {extra}
        output_mode: "dense" (wgrad_tensor [E, H, I], allocated when omitted; wgrad_ptrs
            forbidden) or "discrete": wgrad_ptrs [E] int64 caller-owned addresses (then
            ``result["wgrad_tensor"] is None``); or wgrad_tensor, a stacked [E, H, I] output whose
            expert slabs are written through derived addresses; or both, as cuDNN's tests pass
            them: the kernel writes through ``wgrad_ptrs`` and ``result["wgrad_tensor"] is
            wgrad_tensor`` (with ``validate_offsets`` the pointers must be its expert slabs);
            or neither, then a stacked tensor is allocated.
        wgrad_dtype: torch.bfloat16 | torch.float16 | torch.float32 (allocated output's dtype).
        acc_dtype: torch.float32. sf_vec_size: 16. mma_tiler_mn, cluster_shape_mn: see
            ``{cls_name}``.
        accumulate_on_output: accumulate into the output (allocated outputs start at zero).
        input_order: "tensor2d" | "tensor_ragged".
        current_stream: torch.cuda.Stream, raw handle or None (current stream).
        validate_offsets (keyword): host-read the offsets and pointer values (one sync), once
            per tensor version (an unchanged offsets tensor is not re-read); default True;
            skipped while a CUDA graph is being captured. Pass False in the hot path.
        descriptor_workspace (keyword): accepted as cuDNN's block-scaled callers size it (uint8,
            contiguous, at least ``get_grouped_gemm_wgrad_workspace_size_sm100(E, output_mode,
            input_order)`` bytes, same device). BF16: the SM100 kernel writes its per-expert TMA
            descriptors there (discrete outputs, tensor_ragged K-major operands; at most 3 x 128
            bytes per expert, within that size; the buffer must then be 64-byte aligned) and
            allocates its own per launch when it is omitted; the SM90 kernel leaves it untouched
            (cuDNN refuses it for BF16; accepting it lets code sized the cuDNN way run).

    Raises:
        ValueError: any contract rule (argument named in the message), before any output write.
        RuntimeError: no CUDA, unsupported device, kernel or CuTe DSL missing.
    """


def grouped_gemm_wgrad_wrapper_sm100(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    sfa_tensor: torch.Tensor | None,
    sfb_tensor: torch.Tensor | None,
    offsets_tensor: torch.Tensor,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    mma_tiler_mn: tuple[int, int] = (256, 256),
    cluster_shape_mn: tuple[int, int] | None = None,
    sf_vec_size: int = 16,
    sf_fp8_dtype_override: str | None = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: torch.Tensor | None = None,
    validate_offsets: bool = True,
) -> TupleDict:
    return _seed_wrapper(GroupedGemmWgradSm100, grouped_gemm_wgrad_wrapper_sm100, locals())


def grouped_gemm_wgrad_wrapper_sm90(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    sfa_tensor: torch.Tensor | None,
    sfb_tensor: torch.Tensor | None,
    offsets_tensor: torch.Tensor,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    mma_tiler_mn: tuple[int, int] | None = None,
    cluster_shape_mn: tuple[int, int] | None = None,
    sf_vec_size: int = 16,
    sf_fp8_dtype_override: str | None = None,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    current_stream: Any = None,
    *,
    descriptor_workspace: torch.Tensor | None = None,
    validate_offsets: bool = True,
) -> TupleDict:
    return _seed_wrapper(GroupedGemmWgradSm90, grouped_gemm_wgrad_wrapper_sm90, locals())


grouped_gemm_wgrad_wrapper_sm100.__doc__ = _wrapper_doc(
    "grouped_gemm_wgrad_wrapper_sm100",
    "GroupedGemmWgradSm100",
    "every expert token count a multiple of 256 (BF16), 128 (MXFP8 / MXFP4) or 64 (NVFP4), "
    "non-decreasing, last == tokens_sum. Refuses devices below SM100.",
)
grouped_gemm_wgrad_wrapper_sm90.__doc__ = _wrapper_doc(
    "grouped_gemm_wgrad_wrapper_sm90",
    "GroupedGemmWgradSm90",
    "any expert token count >= 0 (even for FP4), non-decreasing, last == tokens_sum. Refuses "
    "devices that are not SM 9.x.",
)


#: The seed wrapper of each kernel arch (``grouped_gemm_wgrad`` / ``grouped_wgrad_fp32`` route by
#: arch).
WRAPPERS = {"sm100": grouped_gemm_wgrad_wrapper_sm100, "sm90": grouped_gemm_wgrad_wrapper_sm90}


def _into_key(arch, a, b, offsets, out, accumulate) -> tuple:
    """Everything the validation of a dense tensor2d call depends on (metadata, never values):
    shapes, strides, dtypes, devices and the 16-byte alignment of each address."""
    return (
        arch,
        bool(accumulate),
        str(a.device),
        *(
            (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
            for t in (a, b, offsets, out)
        ),
    )


#: The backends whose kernel reads a gathered operand through its row index in the operand
#: load (``grouped_wgrad_into``'s ``a_rows_S`` / ``b_rows_S``: no gathered copy); the others
#: gather first (``torch_ref.gather_operands``), then run their dense kernel.
WGRAD_GATHER_BACKENDS = ("sm90",)


def grouped_wgrad_into(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    out_EHI: torch.Tensor,
    *,
    accumulate: bool = False,
    backend: str = "sm90",
    a_rows_S: torch.Tensor | None = None,
    b_rows_S: torch.Tensor | None = None,
) -> None:
    """Hot path of a backward pass: ``out_EHI[e] (+)= a_HS[:, rows of e] @ b_SI[rows of e]``.

    The first call with a given metadata key (shapes, strides, dtypes, device, address alignment,
    ``accumulate``, the indexes' metadata) goes through every contract check (the rules of
    ``grouped_gemm_wgrad_wrapper_<backend>``); later calls with the same key launch the cached
    operator directly (validation costs ~100 us of host time per call otherwise). Offsets and
    index values are never host-read (no sync, CUDA-graph capturable), as
    ``validate_offsets=False``.

    Gathered operands (the routing index of a MoE layer: no gathered copy of X or dY):
    with ``a_rows_S``, column ``s`` of A is ``a_HS[:, a_rows_S[s]]`` (zeros where
    ``a_rows_S[s] < 0``, a padding row); with ``b_rows_S``, row ``s`` of B is
    ``b_SI[b_rows_S[s]]``. On a backend of :data:`WGRAD_GATHER_BACKENDS` ("sm90") the kernel
    reads the rows through the index in its operand load (while its gate is open:
    ``cuda_kernels.gemm.sm90.wgrad_bf16.gather_enabled``, open since the GPU tests passed with
    this source, else ``MOE_BWD_ENABLE_UNVERIFIED_SM90_WGRAD_GATHER=1``) when the source is
    MN-major (A: an ``[H, T]`` view with strides ``(1, ld)``, e.g. ``X.t()`` of a row-major
    ``[T, H]`` X; B: a ``[T, I]`` tensor with strides ``(ld, 1)``; ``ld`` a multiple of 8,
    16-byte aligned addresses); other backends ("sm100") and other source layouts gather first
    (``torch_ref.gather_operands``: an ``[S, H]`` / ``[S, I]`` copy), then run the dense path.
    Source rows that no index names are never read.

    Args:
        a_HS: [H, S] bf16, or with ``a_rows_S`` the [H, T] source (T may differ from S).
        b_SI: [S, I] bf16, or with ``b_rows_S`` the [T, I] source.
        offsets_E: [E] int32 cumulative row ends (``offsets_E[-1] <= S``).
        out_EHI: [E, H, I] contiguous bf16/fp16/fp32 output, written in place.
        accumulate: add into ``out_EHI`` instead of overwriting it.
        backend: "sm90" or "sm100".
        a_rows_S, b_rows_S: None, or [S] int32 / int64 row indexes on the operands' device,
            every value < T (negative: a padding row, read as zeros). S is the index length;
            with both, the same S (their dtypes may differ: b_rows_S is then converted on the
            device).
    Raises:
        ValueError: an index that is not a rank-1 int32 / int64 [S] tensor on the operands'
            device, S that differs between the indexes and the other operand, a source that is
            not bf16, or (first call of a key) any rule of the wrappers; before any output is
            written.
        RuntimeError: as the wrappers (no CUDA, wrong device, CuTe DSL missing).
    """
    if backend not in ARCH_CLASSES:
        raise ValueError(f"backend must be 'sm90' or 'sm100', got {backend!r}")
    if a_rows_S is not None or b_rows_S is not None:
        _gathered_into(a_HS, b_SI, offsets_E, out_EHI, accumulate, backend, a_rows_S, b_rows_S)
        return
    key = _into_key(backend, a_HS, b_SI, offsets_E, out_EHI, accumulate)
    op = _INTO_CACHE.get(key)
    if op is not None:
        op.launch(a_HS, b_SI, offsets_E, out_EHI)
        return
    call = WgradCall(
        a=a_HS, b=b_SI, offsets=offsets_E, wgrad_tensor=out_EHI, wgrad_dtype=out_EHI.dtype,
        accumulate_on_output=accumulate, validate_offsets=False,  # tiles: per shape, configs/cuda
    )
    _, op = run_wrapper(ARCH_CLASSES[backend], call)
    with _CACHE_LOCK:
        _INTO_CACHE[key] = op


# ---------------------------------------------------------------------------------------------
# grouped_wgrad_into with row indexes
# ---------------------------------------------------------------------------------------------


def _kernel_gathers(a_src: torch.Tensor, b_src: torch.Tensor, gather_a: bool,
                    gather_b: bool) -> bool:
    """Whether the SM90 kernel can read the gathered source(s) in place: MN-major (A ``[H, T]``
    strides ``(1, ld)``; B ``[T, I]`` strides ``(ld, 1)``), ``ld`` and the row length multiples
    of 8 elements, 16-byte aligned address (its 16-byte cp.async chunks)."""
    for gathered, t, unit, pitch in ((gather_a, a_src, 0, 1), (gather_b, b_src, 1, 0)):
        if not gathered:
            continue
        rows, tokens = t.shape[unit], t.shape[pitch]
        if rows % 8 or (rows > 1 and t.stride(unit) != 1):
            return False
        if tokens > 1 and (t.stride(pitch) % 8 or t.stride(pitch) < rows):
            return False
        if t.numel() and t.data_ptr() % TMA_ALIGN_BYTES:
            return False
    return True


def wgrad_gather_enabled(backend: str) -> bool:
    """Whether ``grouped_wgrad_into`` on ``backend`` reads a gathered operand through its index
    in the kernel's operand load: a backend of :data:`WGRAD_GATHER_BACKENDS` whose gather keys
    are enabled (SM90: verified on a GPU, or ``MOE_BWD_ENABLE_UNVERIFIED_SM90_WGRAD_GATHER=1``:
    ``cuda_kernels.gemm.sm90.wgrad_bf16.gather_enabled``). Elsewhere the call gathers first.
    Reads the environment on each call."""
    if backend not in WGRAD_GATHER_BACKENDS:
        return False
    from ..gemm.sm90 import wgrad_bf16

    return backend != "sm90" or wgrad_bf16.gather_enabled()


def _meta_like(t: torch.Tensor, shape=None, stride=None) -> torch.Tensor:
    """A storage-less stand-in of ``t`` (``shape`` / ``stride`` or its own) on the meta device."""
    return torch.empty_strided(
        tuple(t.shape) if shape is None else shape,
        tuple(t.stride()) if stride is None else stride,
        dtype=t.dtype, device="meta",
    )


def _gather_key(backend, a, b, offsets, out, accumulate, a_rows, b_rows) -> tuple:
    """The ``_INTO_CACHE`` key of a gathered call: the dense key's metadata and the indexes'."""
    rows_meta = tuple(
        None if r is None else (r.shape, r.stride(), r.dtype, r.device) for r in (a_rows, b_rows)
    )
    return ("gather", *_into_key(backend, a, b, offsets, out, accumulate), rows_meta)


#: The argument names of ``grouped_wgrad_into`` in the messages of its gathered calls.
_INTO_NAMES = ArgNames("a_HS", "b_SI", "offsets_E", wgrad="out_EHI")


def _compile_gathered(backend, a, b, offsets, out, accumulate, a_rows, b_rows,
                      tokens_sum) -> Callable[..., None]:
    """First call of a gathered key on a kernel backend: every rule of the dense call, checked on
    storage-less stand-ins of the operands the kernel sees (the gathered one as its ``[H, S]``
    M-major / ``[S, I]`` row-major image), the real devices and addresses, the tile fit; then
    the kernel of the contract's key with the gather fields. Returns the launch."""
    cls = ARCH_CLASSES[backend]
    require_device(cls, a.device, "a_HS")
    ga, gb = a_rows is not None, b_rows is not None
    hidden, inter = a.shape[0], b.shape[1]
    a_std = _meta_like(a, (hidden, tokens_sum), (1, hidden)) if ga else _meta_like(a)
    b_std = _meta_like(b, (tokens_sum, inter), (inter, 1)) if gb else _meta_like(b)
    call = WgradCall(
        a=a_std, b=b_std, offsets=_meta_like(offsets), wgrad_tensor=_meta_like(out),
        wgrad_dtype=out.dtype, accumulate_on_output=accumulate, validate_offsets=False,
        names=_INTO_NAMES,
    )
    v = validate_call(call, backend)  # shapes, dtypes, majors, output, tiling (meta: no values)
    check_same_device({"a_HS": a, "b_SI": b, "offsets_E": offsets, "out_EHI": out,
                       "a_rows_S": a_rows, "b_rows_S": b_rows})
    for t, arg, align in ((a, "a_HS", TMA_ALIGN_BYTES), (b, "b_SI", TMA_ALIGN_BYTES),
                          (offsets, "offsets_E", OFFSETS_ALIGN_BYTES),
                          (out, "out_EHI", TMA_ALIGN_BYTES)):
        check_ptr(t, arg, align)
    contract = next(
        (c for c in v.contracts
         if (not ga or c.a_major == "m") and (not gb or c.b_major == "n")),
        None,
    )
    if contract is None:
        raise ValueError(
            "grouped_wgrad_into: a gathered operand must be MN-major (a_rows_S: a_HS with unit "
            "stride along H; b_rows_S: b_SI with unit stride along I); no contract of this "
            "call has that layout"
        )
    bf16.check_fits(contract)
    _, module = bf16._family(contract)  # noqa: SLF001 - the format's family lookup
    if module is None:
        bf16.compile_launcher(contract, "grouped_wgrad_into")  # raises: not built
    index_dtype = "int64" if (a_rows if ga else b_rows).dtype == torch.int64 else "int32"
    key = dataclasses.replace(
        module.FAMILY.key_from_contract(contract), gather_a=ga, gather_b=gb,
        index_dtype=index_dtype,
    )
    launcher = module.FAMILY.launcher(key)

    def launch(a, b, offsets, out, a_rows, b_rows):
        launcher(a, b, offsets, out, a_rows=a_rows, b_rows=b_rows)

    return launch


def _gathered_into(a_HS, b_SI, offsets_E, out_EHI, accumulate, backend, a_rows_S, b_rows_S):
    """``grouped_wgrad_into`` with ``a_rows_S`` / ``b_rows_S`` (see there)."""
    tokens_sum = check_row_indexes(a_HS, b_SI, a_rows_S, b_rows_S, "grouped_wgrad_into")
    for t, arg in ((a_HS, "a_HS"), (b_SI, "b_SI")):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"grouped_wgrad_into: {arg} must be torch.bfloat16, got {t.dtype}")
    rows = [r if r is None else r.contiguous() for r in (a_rows_S, b_rows_S)]
    if rows[0] is not None and rows[1] is not None and rows[1].dtype != rows[0].dtype:
        rows[1] = rows[1].to(rows[0].dtype)  # one index dtype per kernel key
    a_rows, b_rows = rows
    if wgrad_gather_enabled(backend) and _kernel_gathers(
        a_HS, b_SI, a_rows is not None, b_rows is not None
    ):
        key = _gather_key(backend, a_HS, b_SI, offsets_E, out_EHI, accumulate, a_rows, b_rows)
        op = _INTO_CACHE.get(key)
        if op is None:
            op = _compile_gathered(backend, a_HS, b_SI, offsets_E, out_EHI, bool(accumulate),
                                   a_rows, b_rows, tokens_sum)
            with _CACHE_LOCK:
                _INTO_CACHE[key] = op
        op(a_HS, b_SI, offsets_E, out_EHI, a_rows, b_rows)
        return
    # no in-kernel gather here: gather first (device ops, no host read), then the dense path
    a, b = gather_operands(a_HS, b_SI, a_rows, b_rows)
    grouped_wgrad_into(a, b, offsets_E, out_EHI, accumulate=accumulate, backend=backend)
