"""The one validation pipeline of the grouped wgrad, the format choice, and the compiled operator.

Every entry -- the wrappers, the classes' ``check_support`` (samples) and ``execute``,
``grouped_gemm_wgrad``, ``grouped_wgrad_into``, ``kernel_unsupported_reason`` and the JAX entries
-- describes its call as a ``_types.WgradCall`` and runs :func:`validate_call`, which checks it in
one order, before any output is written:

1. the output mode;
2. the format, picked ONCE by the operand dtypes (:func:`select_format`: one FP8 / FP4 dtype ->
   ``blockscaled.py``, else ``bf16.py``), and that format's controls (BF16: no scale controls);
3. the input order and the tiling arguments (``tiles.py``'s rules of the arch);
4. the operands: ranks, shapes, dtypes, majors, the kernel's alignment (the format's step;
   ``tensor_ragged`` operands as their compact views);
5. the outputs: dtype, the dense tensor or the pointer array, the 16-byte output rows (by mode:
   a call's optional outputs, a class's output samples, or ``execute``'s outputs of the compiled
   contract, whose static fields the call must match);
6. the descriptor workspace, then the one device of every tensor;
7. only in the validation mode (``validate_offsets``) and never while capturing a CUDA graph:
   the offsets VALUES (the format's rule) and the output pointers (a host read, once per tensor
   version).

It returns a :class:`ValidatedCall`: the static contract(s), the operands as launched, the
device. The tile fit (:meth:`ValidatedCall.check_fits`) needs the whole contract and runs once
per contract; :func:`compile_contract` gives the contract's :class:`CompiledWgrad` (the format's
launcher: a registered kernel family's, or a twin), which launches any number of times.

Nothing here reads device data outside step 7, imports CuTe DSL or queries the GPU at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..gemm import env
from . import bf16, blockscaled
from ._types import (
    CALL_NAMES,
    NAME_TO_DTYPE,
    ArgNames,
    Operands,
    WgradCall,
    WgradContract,
)
from .validate import (
    check_dense_out,
    check_expert_out,
    check_input_order,
    check_output_mode,
    check_output_rows,
    check_pointer_values,
    check_ptrs_tensor,
    check_same_device,
    check_tiling,
    check_wgrad_dtype,
    check_workspace,
    ragged_compact,
)

__all__ = [
    "MODES",
    "CompiledWgrad",
    "ValidatedCall",
    "allocate_outputs",
    "compile_contract",
    "select_format",
    "stacked_pointers",
    "torch_stream",
    "validate_call",
    "wgrad_expert_ptrs",
]

#: What :func:`validate_call` checks the outputs of: a wrapper's / ``grouped_gemm_wgrad``'s
#: call (outputs optional, allocated when missing), a class's samples (``sample_wgrad``, or
#: ``num_experts`` + ``wgrad_shape`` + ``wgrad_dtype``), an ``execute`` call of a compiled
#: contract (outputs given, static fields equal to the contract's).
MODES = ("call", "samples", "execute")


def select_format(a: Any, b: Any, names: ArgNames = CALL_NAMES):
    """The format module the operand dtypes select: ``blockscaled`` for one FP8 / FP4 dtype
    (``blockscaled.is_blockscaled_pair``), else ``bf16`` (whose rules then name a dtype that is
    not BF16).

    Raises:
        ValueError: A and B are two different FP8 / FP4 dtypes.
    """
    return blockscaled if blockscaled.is_blockscaled_pair(a, b, names.a, names.b) else bf16


def _format_of(contract: WgradContract):
    return bf16 if contract.block_scaled is None else blockscaled


@dataclasses.dataclass(frozen=True)
class ValidatedCall:
    """A call that passed :func:`validate_call`.

    Attributes:
        call: the call as given.
        format: its format module (``bf16`` / ``blockscaled``).
        arch: the arch whose rules were checked ("sm90" | "sm100" | "torch").
        operands: the format's :class:`_types.Operands`.
        contracts: the static contract of every layout the strides express (one unless a
            layout is moot); ``contract`` is the first.
        a, b: the operands as launched (``tensor_ragged``: compact views).
        device: the one device of every tensor.
        out_name: the output dtype's name.
        out: ``execute`` mode: what the launcher writes through (the dense tensor or the int64
            addresses); None otherwise (:func:`allocate_outputs`).
        workspace: the caller's descriptor workspace (or cuDNN's ``workspace`` alias), or None.
    """

    call: WgradCall
    format: Any
    arch: str
    operands: Operands
    contracts: tuple[WgradContract, ...]
    a: Any
    b: Any
    device: torch.device
    out_name: str
    out: Any = None
    workspace: Any = None

    @property
    def contract(self) -> WgradContract:
        return self.contracts[0]

    @property
    def scales(self) -> tuple | None:
        """``(sfa, sfb, global_scale_a, global_scale_b)`` of a block-scaled call, else None."""
        if self.format is bf16:
            return None
        c = self.call
        return c.sfa, c.sfb, c.global_scale_a, c.global_scale_b

    def check_fits(self) -> None:
        """The format's whole-contract rules (BF16: a tile of the kernel fits; ValueError)."""
        self.format.check_fits(self.contract)

    def check_values(self) -> None:
        """Host read of the offsets (the format's rule) and of the output pointers, once per
        tensor version (one device sync on CUDA)."""
        self.format.check_values(self.arch, self.operands, self.call)
        if self.call.wgrad_ptrs is not None:
            check_pointer_values(
                self.call.wgrad_ptrs, self.call.names.wgrad_ptrs, self.call.wgrad_tensor
            )


def validate_call(
    call: WgradCall,
    arch: str,
    *,
    mode: str = "call",
    compiled: WgradContract | None = None,
    device: torch.device | None = None,
    allow_pointers: bool = True,
) -> ValidatedCall:
    """Every rule of ``call`` against the rules of ``arch``, in the module docstring's order.

    Args:
        call: the arguments, by name (their message names in ``call.names``).
        arch: "sm90" / "sm100" (a kernel's alignment and tiling rules) or "torch" (a twin's:
            any strides, no alignment).
        mode: one of :data:`MODES`.
        compiled: ``execute`` mode: the compiled contract (its format, modes, order and static
            fields bind the call).
        device: ``execute`` mode: the device the operator was compiled for.
        allow_pointers: False where nothing can write through caller-owned addresses (the BF16
            torch path of ``grouped_gemm_wgrad``).

    Returns:
        The :class:`ValidatedCall`.

    Raises:
        ValueError: a rule, naming the argument (RuntimeError is the environment's, before).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = call.names
    # 1-2. output mode; the format (once, by the operand dtypes) and its controls
    output_mode = check_output_mode(compiled.output_mode if compiled else call.output_mode)
    if compiled is None:
        fmt = select_format(call.a, call.b, names)
    else:
        fmt = _format_of(compiled)
        if fmt is blockscaled and not blockscaled.is_blockscaled_pair(call.a, call.b):
            spec = compiled.block_scaled
            raise ValueError(
                f"{names.a}/{names.b}: this operator was compiled for block-scaled {spec.fmt} "
                f"operands ({spec.ab_dtype}); got {getattr(call.a, 'dtype', call.a)} and "
                f"{getattr(call.b, 'dtype', call.b)}; build another operator"
            )
    fmt.check_controls(call)
    # 3. input order, tiling
    input_order = check_input_order(compiled.input_order if compiled else call.input_order)
    if compiled is None:
        tiler, cluster = check_tiling(arch, call.mma_tiler_mn, call.cluster_shape_mn)
    else:
        tiler, cluster = compiled.mma_tiler_mn, compiled.cluster_shape_mn
    # 4. operands
    a, b = call.a, call.b
    if input_order == "tensor_ragged":
        a, b = ragged_compact(a, b, (names.a, names.b))
    ops = fmt.operands(arch, call, a, b)
    if compiled is not None:
        _check_matches(ops, compiled, names)
    # 5. outputs
    out_name, out = _check_outputs(mode, call, ops, arch, output_mode, compiled, allow_pointers)
    # 6. workspace, one device
    workspace = None
    if mode != "samples":
        workspace = check_workspace(
            call.descriptor_workspace, call.workspace, ops.num_experts, output_mode, input_order
        )
    tensors = {
        names.a: call.a, names.b: call.b, names.offsets: call.offsets,
        names.wgrad: call.wgrad_tensor, names.wgrad_ptrs: call.wgrad_ptrs,
        names.workspace: workspace, "sample_wgrad_expert": call.wgrad_expert, **ops.tensors,
    }
    on = check_same_device(tensors)
    if device is not None and on != device:
        raise ValueError(f"{names.a} is on {on} but this operator was compiled for {device}")
    contracts = tuple(
        WgradContract(
            arch=arch, hidden=ops.hidden, intermediate=ops.intermediate,
            num_experts=ops.num_experts, a_major=am, b_major=bm, out_dtype=out_name,
            output_mode=output_mode, accumulate=bool(call.accumulate_on_output),
            input_order=input_order, mma_tiler_mn=tiler, cluster_shape_mn=cluster,
            block_scaled=ops.spec,
        )
        for am in ops.a_majors
        for bm in ops.b_majors
    )
    if compiled is not None:
        contracts = (compiled,)
    validated = ValidatedCall(
        call=call, format=fmt, arch=arch, operands=ops, contracts=contracts, a=a, b=b,
        device=on, out_name=out_name, out=out, workspace=workspace,
    )
    # 7. values: only in the validation mode, never while a CUDA graph is being captured
    if call.validate_offsets and not env.capturing(on):
        validated.check_values()
    return validated


def _check_matches(ops: Operands, c: WgradContract, names: ArgNames) -> None:
    """An ``execute`` call's static fields (and block-scaled format) equal the compiled ones."""
    if ops.spec != c.block_scaled:
        got, want = ops.spec, c.block_scaled
        raise ValueError(
            f"{names.a}/{names.sfa}: the block-scaled format of this call ({got.fmt}, "
            f"{got.ab_dtype}, scales {got.sf_dtype}) differs from the compiled contract "
            f"({want.fmt}, {want.ab_dtype}, scales {want.sf_dtype}); build another operator for "
            "a new static contract"
        )
    static = {
        "hidden": (ops.hidden,),
        "intermediate": (ops.intermediate,),
        "num_experts": (ops.num_experts,),
        "a_major": ops.a_majors,
        "b_major": ops.b_majors,
    }
    for name, allowed in static.items():
        if getattr(c, name) not in allowed:
            raise ValueError(
                f"{name} of this call ({allowed[0]}) differs from the compiled contract "
                f"({getattr(c, name)}); build another operator for a new static contract"
            )


def _check_outputs(mode, call, ops, arch, output_mode, compiled, allow_pointers):
    """Step 5: ``(out_name, out)`` (``out`` only in ``execute`` mode)."""
    names = call.names
    e, h, i = ops.num_experts, ops.hidden, ops.intermediate
    wgrad, ptrs = call.wgrad_tensor, call.wgrad_ptrs
    if mode == "samples":
        if output_mode == "dense":
            return check_dense_out(arch, wgrad, (e, h, i), names.wgrad), None
        if call.num_experts != e:
            raise ValueError(
                f"num_experts={call.num_experts} must equal {names.offsets}.numel() = {e}"
            )
        if tuple(call.wgrad_shape) != (h, i):
            raise ValueError(
                f"wgrad_shape must be (hidden, intermediate) = {(h, i)}, got "
                f"{tuple(call.wgrad_shape)}"
            )
        out_name = check_wgrad_dtype(call.wgrad_dtype)
        if arch != "torch":
            check_output_rows(i, out_name, "wgrad_shape")
        if call.wgrad_expert is not None:
            check_expert_out(arch, call.wgrad_expert, (h, i), call.wgrad_dtype,
                             "sample_wgrad_expert")
        return out_name, None
    if mode == "execute":
        out_dtype = NAME_TO_DTYPE[compiled.out_dtype]
        if output_mode == "dense":
            if ptrs is not None:
                raise ValueError(f"{names.wgrad_ptrs} must be None in dense output mode")
            if wgrad is None:
                raise ValueError(f"{names.wgrad} is required in dense output mode")
            check_dense_out(arch, wgrad, (e, h, i), names.wgrad, out_dtype)
            return compiled.out_dtype, wgrad
        if wgrad is None and ptrs is None:
            raise ValueError(
                f"{names.wgrad_ptrs} is required in discrete output mode (or {names.wgrad}, the "
                "stacked [E, H, I] output whose expert slabs the kernel then writes)"
            )
        if wgrad is not None:
            check_dense_out(arch, wgrad, (e, h, i), names.wgrad, out_dtype)
        if ptrs is not None:
            check_ptrs_tensor(ptrs, e, names.wgrad_ptrs)
            return compiled.out_dtype, ptrs
        return compiled.out_dtype, stacked_pointers(wgrad)
    out_name = check_wgrad_dtype(call.wgrad_dtype)
    if ptrs is not None and not allow_pointers:
        raise ValueError(
            f"{names.wgrad_ptrs}: the torch fallback cannot write through caller-owned "
            "addresses; pass wgrad_tensor (or use a device with a grouped wgrad kernel)"
        )
    if output_mode == "dense" and ptrs is not None:
        raise ValueError(
            f"{names.wgrad_ptrs} must be None in dense output mode (dense output forbids it)"
        )
    if wgrad is not None:  # the given output's dtype wins over wgrad_dtype
        out_name = check_dense_out(arch, wgrad, (e, h, i), names.wgrad)
    elif arch != "torch":
        check_output_rows(i, out_name, "wgrad_dtype")
    if ptrs is not None:
        check_ptrs_tensor(ptrs, e, names.wgrad_ptrs)
    return out_name, None


# ---------------------------------------------------------------------------------------------
# Outputs and streams
# ---------------------------------------------------------------------------------------------


def torch_stream(stream: Any, device: torch.device):
    """``current_stream`` as a torch.cuda.Stream: torch's current stream for None, the stream
    itself, or an external stream of a raw ``CUstream`` / int handle."""
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(int(stream), device=device)


def _on_launch_stream(stream: Any, device: torch.device):
    if stream is not None and device.type == "cuda":
        return torch.cuda.stream(torch_stream(stream, device))
    return contextlib.nullcontext()


def stacked_pointers(stacked: torch.Tensor) -> torch.Tensor:
    """int64 address of each expert's [H, I] slab of a contiguous [E, H, I] tensor, computed on
    its device (no host list, no sync: capturable); :func:`wgrad_expert_ptrs` is the checked
    public form."""
    e = stacked.shape[0]
    step = stacked[0].numel() * stacked.element_size() if e else 0
    idx = torch.arange(e, dtype=torch.int64, device=stacked.device)
    return idx * step + stacked.data_ptr()


def allocate_outputs(v: ValidatedCall) -> tuple[Any, Any]:
    """``(wgrad_tensor, out)`` of a validated call: the dense output allocated on the launch
    stream when the caller gave neither output (zeros when accumulating), and what the launcher
    writes through: the dense tensor, the caller's pointers, or the stacked output's per-expert
    addresses (:func:`stacked_pointers`)."""
    call, c = v.call, v.contract
    wgrad, ptrs = call.wgrad_tensor, call.wgrad_ptrs
    with _on_launch_stream(call.current_stream, v.device):
        if wgrad is None and ptrs is None:
            alloc = torch.zeros if call.accumulate_on_output else torch.empty
            shape = (c.num_experts, c.hidden, c.intermediate)
            wgrad = alloc(shape, dtype=NAME_TO_DTYPE[v.out_name], device=v.device)
        if c.output_mode == "dense":
            return wgrad, wgrad
        if ptrs is not None:
            return wgrad, ptrs
        return wgrad, stacked_pointers(wgrad)


def wgrad_expert_ptrs(wgrad_tensor: Any, current_stream: Any = None) -> Any:
    """Per-expert output addresses of a stacked wgrad tensor: the ``wgrad_ptrs`` array of the
    discrete (pointer-array) output mode, cuDNN frontend's helper of the same name.

    Dimensions: E experts, H hidden, I intermediate.

    Args:
        wgrad_tensor: [E, H, I] bf16 / fp16 / fp32 (any dtype): a torch tensor on any device, or
            a JAX array (eager only). Each expert's [H, I] slab must be row-major contiguous
            (strides ``(*, I, 1)``; size-1 dims are moot) and the slabs must not overlap (expert
            stride >= H * I elements); the expert stride itself may be larger (a padded stack).
        current_stream: torch: the stream the address table is computed on (a torch.cuda.Stream,
            a raw handle, or None for the current stream); unused for CPU tensors and JAX.

    Returns:
        torch: [E] int64 on ``wgrad_tensor``'s device, ``ptrs[e] = data_ptr + e * expert stride
        bytes``, computed by one device op (no host list, no copy, no sync: CUDA-graph
        capturable). JAX: the packed little-endian uint8 [8 * E] form the JAX entries take
        (``jax_ffi.pack_pointers_uint8``), on the array's device. Derive it once per output
        buffer and reuse it across calls; it is valid while that buffer lives.

    Raises:
        ValueError: not rank 3, an expert slab not row-major contiguous, or overlapping slabs.
    """
    shape = tuple(int(d) for d in wgrad_tensor.shape)
    if len(shape) != 3:
        raise ValueError(
            f"wgrad_tensor must be rank-3 (num_experts, hidden, intermediate), got shape {shape}"
        )
    experts, hidden, inter = shape
    if isinstance(wgrad_tensor, torch.Tensor):
        strides, itemsize = tuple(wgrad_tensor.stride()), wgrad_tensor.element_size()
        base = wgrad_tensor.data_ptr()
    else:  # a JAX array: C-contiguous
        import numpy as np

        itemsize = np.dtype(wgrad_tensor.dtype).itemsize
        strides = (hidden * inter, inter, 1)
        base = wgrad_tensor.unsafe_buffer_pointer()
    if (hidden > 1 and strides[1] != inter) or (inter > 1 and strides[2] != 1):
        raise ValueError(
            "each wgrad expert slab must be a row-major contiguous (hidden, intermediate) block "
            f"(strides (*, {inter}, 1)); got shape {shape} strides {strides}"
        )
    step = strides[0] if experts > 1 else hidden * inter
    if experts > 1 and step < hidden * inter:
        raise ValueError(
            f"wgrad expert slabs must not overlap: expert stride {step} elements < hidden * "
            f"intermediate = {hidden * inter}"
        )
    step_bytes = step * itemsize
    if isinstance(wgrad_tensor, torch.Tensor):
        device = wgrad_tensor.device
        with _on_launch_stream(current_stream, device):
            idx = torch.arange(experts, dtype=torch.int64, device=device)
            return idx * step_bytes + base
    import jax
    import numpy as np

    values = np.arange(experts, dtype=np.int64) * np.int64(step_bytes) + np.int64(base)
    (device,) = wgrad_tensor.devices()
    return jax.device_put(values.astype("<i8").view(np.uint8), device)


# ---------------------------------------------------------------------------------------------
# The compiled operator of one static contract
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledWgrad:
    """One static contract, compiled: what the classes, the wrappers' operator cache,
    ``grouped_wgrad_into`` and ``grouped_gemm_wgrad`` launch.

    Attributes:
        contract: the static contract.
        format: its format module.
        launcher: the format's launcher (``bf16.Launcher`` / ``blockscaled.Launcher``).
        backend: what runs: "sm90" / "sm100" (a kernel) or "torch" (a twin).
        reason: why a twin runs ("" for a kernel).
    """

    contract: WgradContract
    format: Any
    launcher: Callable[..., None]
    backend: str
    reason: str = ""

    def launch(self, a, b, offsets, out, *, stream=None, scales=None, workspace=None) -> None:
        """One launch on validated tensors. ``stream``: ``current_stream`` (None: torch's
        current stream). A discrete output's pointer array is recorded on the launch stream
        (the seed: the API keeps it alive until the kernel has read it)."""
        if a.device.type == "cuda" and stream is not None:
            stream = torch_stream(stream, a.device)
        if self.contract.output_mode == "discrete" and out.device.type == "cuda":
            out.record_stream(torch_stream(stream, out.device))
        self.format.launch(
            self.launcher, self.contract, a, b, offsets, out, scales=scales, stream=stream,
            workspace=workspace,
        )


def compile_contract(contract: WgradContract, who: str) -> CompiledWgrad:
    """The :class:`CompiledWgrad` of ``contract`` (its format's ``load_launcher``: a BF16
    family's kernel compiled once per process, a block-scaled family's launcher or the twin).
    ``who`` names the entry in messages.

    Raises:
        RuntimeError: the kernel is not built, or CuTe DSL is missing.
    """
    fmt = _format_of(contract)
    launcher, backend, reason = fmt.load_launcher(contract, who)
    return CompiledWgrad(contract, fmt, launcher, backend, reason)
