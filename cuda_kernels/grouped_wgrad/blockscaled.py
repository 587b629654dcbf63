"""The block-scaled format of the grouped wgrad (MXFP8 / MXFP4 / NVFP4, the seed's legacy
surface): its contract, its validation steps and its launch.

Dimensions: H hidden, S tokens_sum, I intermediate, E num_experts (``common/shapes.py``).

``out[e] = deq(A)[:, begin:end] @ deq(B)[begin:end, :]`` (times ``gsa[e] * gsb[e]`` for NVFP4),
``deq`` the element times its group's scale. Selected only by a matching FP8 / FP4 A/B pair
(:func:`is_blockscaled_pair`); the formats (dtype x scale dtype x ``sf_vec_size``) are
``_types.BLOCKSCALED_FORMATS``. What is easy to get wrong about it:

- the scale tensors are cuDNN's 128x4-atom layout ``[round_up(rows, 128), cols]`` with each
  expert's scales starting at its own atom column (``common.mx_atoms``), so the columns a split
  needs depend on the offsets VALUES: checked with them, in the validation mode;
- the per-expert token multiple depends on the entry: 128 (MXFP8 / MXFP4) / 64 (NVFP4) on the
  ``_sm100`` surface (whole scale atoms per expert, cuDNN's rule), any MXFP8 count and even FP4
  counts on the ``_sm90`` surface and ``grouped_gemm_wgrad`` (``BLOCKSCALED_TOKEN_ALIGN``);
- a native kernel serves a contract only where a registered family says so
  (:func:`native_launcher`, ``registry.find_kernel``); every other call runs the twin
  ``blockscaled_ref.grouped_wgrad_blockscaled_torch`` on the tensors' device, after the same
  validation. The twin reads the offsets on the host: not CUDA-graph capturable.

The steps below are called by ``pipeline.validate_call`` in its one order; :func:`load_launcher`
returns the launcher of a contract. Launcher signature of the format (:data:`Launcher`):
``launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a=None, global_scale_b=None,
descriptor_workspace=None, stream=None)`` with ``out`` the dense ``[E, H, I]`` tensor or, in
discrete mode, the ``[E]`` int64 output addresses; ``stream`` a torch.cuda.Stream or None.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable

import torch

from common.mx_atoms import ATOM_COLS, ATOM_ROWS, grouped_scale_cols, round_up

from ..gemm import registry
from ._types import (
    BLOCK_SCALED_DTYPES,
    BLOCKSCALED_FORMATS,
    BLOCKSCALED_TOKEN_ALIGN,
    NAME_TO_DTYPE,
    SF_DTYPES,
    TMA_ALIGN_BYTES,
    BlockScaledSpec,
    Operands,
    WgradContract,
)
from .blockscaled_ref import grouped_wgrad_blockscaled_torch
from .torch_ref import ragged_expert_views
from .validate import (
    check_dtype_pair,
    check_offsets_values,
    check_ptr,
    validate_operands,
    validated_once,
)

__all__ = [
    "FORMAT_NAMES",
    "NAME",
    "Launcher",
    "blockscaled_spec",
    "check_blockscaled_values",
    "check_controls",
    "check_fits",
    "check_sf_fp8_dtype_override",
    "check_values",
    "default_sf_vec_size",
    "is_blockscaled_pair",
    "launch",
    "load_launcher",
    "native_launcher",
    "operands",
    "select_blockscaled_backend",
    "validate_blockscaled",
]

NAME = "blockscaled"
#: Launcher of a block-scaled contract (a native kernel's or the twin's), see the module
#: docstring.
Launcher = Callable[..., None]

# ---------------------------------------------------------------------------------------------
# The format's rules
# ---------------------------------------------------------------------------------------------

_ELEM_KIND = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_FORMAT_TEXT = (
    "float8_e4m3fn / float8_e5m2 operands + float8_e8m0fnu scales at sf_vec_size=32 (MXFP8), "
    "packed FP4 (uint8 / float4_e2m1fn_x2) + float8_e8m0fnu at 32 (MXFP4), packed FP4 + "
    "float8_e4m3fn at 16 with global_scale_a / global_scale_b (NVFP4)"
)
FORMAT_NAMES = {"mxfp8": "MXFP8", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}


def is_blockscaled_pair(a, b, a_arg: str = "a_tensor", b_arg: str = "b_tensor") -> bool:
    """True when A and B are one FP8 / FP4 dtype: the pair that selects the block-scaled backend
    (seed: only a supported matching FP4/FP8 operand pair selects it).

    Raises:
        ValueError: A and B are two different FP8 / FP4 dtypes (no backend takes the mix).
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype in BLOCK_SCALED_DTYPES and b.dtype in BLOCK_SCALED_DTYPES:
        if a.dtype != b.dtype:
            check_dtype_pair(a.dtype, b.dtype, a_arg, b_arg)
        return True
    return False


def check_sf_fp8_dtype_override(value) -> None:
    """cuDNN's ``sf_fp8_dtype_override`` (a Rubin-only FP8 scale dtype): only None here."""
    if value is not None:
        raise ValueError(
            f"sf_fp8_dtype_override must be None, got {value!r}: cuDNN's override of the FP8 "
            "scale-factor dtype applies to Rubin GPUs only, and this package has no Rubin kernel"
        )


def blockscaled_spec(
    arch: str, a, sfa, sfb, sf_vec_size, sf_fp8_dtype_override, acc_dtype, names
) -> BlockScaledSpec:
    """The format of a block-scaled call (dtype pair already matched): scale dtypes, vector size,
    override and accumulator rules."""
    a_arg, sfa_arg, sfb_arg = names
    for name, sf in ((sfa_arg, sfa), (sfb_arg, sfb)):
        if sf is None:
            raise ValueError(
                f"{name} is required: {a.dtype} operands select the block-scaled backend, which "
                "needs the scale factors of A and B (sfa / sfb)"
            )
        if not isinstance(sf, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(sf).__name__}")
        if sf.dtype not in SF_DTYPES:
            raise ValueError(
                f"{name} dtype must be torch.float8_e8m0fnu (MX) or torch.float8_e4m3fn (NVFP4), "
                f"got {sf.dtype}"
            )
    if sfa.dtype != sfb.dtype:
        raise ValueError(
            f"{sfa_arg} and {sfb_arg} need one dtype; got {sfa.dtype} and {sfb.dtype}"
        )
    if isinstance(sf_vec_size, bool) or not isinstance(sf_vec_size, int):
        raise ValueError(f"sf_vec_size must be an int (16 or 32), got {sf_vec_size!r}")
    kind = _ELEM_KIND.get(a.dtype, "e2m1")
    fmt = BLOCKSCALED_FORMATS.get((kind, sfa.dtype, sf_vec_size))
    if fmt is None:
        raise ValueError(
            f"{a_arg} {a.dtype} with {sfa_arg} {sfa.dtype} at sf_vec_size={sf_vec_size} is not a "
            f"supported block-scaled format; supported: {_FORMAT_TEXT}"
        )
    check_sf_fp8_dtype_override(sf_fp8_dtype_override)
    if acc_dtype != torch.float32:
        raise ValueError(f"acc_dtype must be torch.float32 (FP32 accumulation), got {acc_dtype}")
    return BlockScaledSpec(
        fmt=fmt,
        ab_dtype=str(a.dtype).removeprefix("torch."),
        sf_dtype=SF_DTYPES[sfa.dtype],
        sf_vec_size=sf_vec_size,
        token_align=BLOCKSCALED_TOKEN_ALIGN[arch][fmt],
        sf_fp8_dtype_override=sf_fp8_dtype_override,
    )


def _check_sf_tensor(arch: str, sf: torch.Tensor, rows: int, tokens_sum: int, sf_vec: int,
                     arg: str, rows_name: str) -> None:
    """Shape, layout and alignment of one scale tensor (host metadata only): cuDNN's
    ``[round_up(rows, 128), cols]`` 128x4-atom layout, ``cols`` a multiple of 4 and at least
    ``round_up(ceil(tokens_sum / sf_vec), 4)`` (what every split needs; the per-split need is
    checked with the offsets values)."""
    rp = round_up(rows, ATOM_ROWS)
    min_cols = round_up(-(-tokens_sum // sf_vec), ATOM_COLS)
    if sf.dim() != 2 or sf.shape[0] != rp:
        raise ValueError(
            f"{arg} must be rank-2 [round_up({rows_name}, 128), cols] = [{rp}, cols] (128x4 "
            f"scale atoms, cuDNN's layout), got shape {tuple(sf.shape)}"
        )
    if sf.shape[1] % ATOM_COLS or sf.shape[1] < min_cols:
        raise ValueError(
            f"{arg} needs a multiple of 4 columns, at least round_up(ceil(tokens_sum / "
            f"sf_vec_size), 4) = {min_cols} (tokens_sum={tokens_sum}, sf_vec_size={sf_vec}); "
            f"got {sf.shape[1]}"
        )
    if not sf.is_contiguous():
        raise ValueError(
            f"{arg} must be contiguous (the atom layout is a byte order), got strides "
            f"{tuple(sf.stride())}"
        )
    if arch != "torch":
        check_ptr(sf, arg, TMA_ALIGN_BYTES)


def _check_global_scale(g, num_experts: int, arg: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise ValueError(
            f"{arg} is required for NVFP4: a torch.float32 tensor of shape (num_experts,) = "
            f"({num_experts},) (per-expert global scale), got {type(g).__name__}"
        )
    if g.dtype != torch.float32 or tuple(g.shape) != (num_experts,) or g.stride(0) != 1:
        raise ValueError(
            f"{arg} must be a contiguous torch.float32 tensor of shape ({num_experts},) "
            f"(per-expert global scale), got {g.dtype} {tuple(g.shape)} strides {tuple(g.stride())}"
        )


def validate_blockscaled(
    arch: str,
    a: torch.Tensor,
    b: torch.Tensor,
    sfa,
    sfb,
    offsets: torch.Tensor,
    global_scale_a,
    global_scale_b,
    *,
    sf_vec_size,
    sf_fp8_dtype_override,
    acc_dtype,
    names: tuple[str, ...] = (
        "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "global_scale_a",
        "global_scale_b",
    ),
) -> Operands:
    """Every host-metadata rule of a block-scaled call (A / B one FP8 or FP4 dtype): format,
    scales, global scales, shapes, majors, alignment. No device read; see
    :func:`check_blockscaled_values` for the offsets values."""
    a_arg, b_arg, sfa_arg, sfb_arg, off_arg, gsa_arg, gsb_arg = names
    spec = blockscaled_spec(
        arch, a, sfa, sfb, sf_vec_size, sf_fp8_dtype_override, acc_dtype, (a_arg, sfa_arg, sfb_arg)
    )
    hidden, tokens_sum, inter, num_experts, a_majors, b_majors = validate_operands(
        arch, a, b, offsets, (a_arg, b_arg, off_arg), spec
    )
    _check_sf_tensor(arch, sfa, hidden, tokens_sum, spec.sf_vec_size, sfa_arg, "hidden")
    _check_sf_tensor(arch, sfb, inter, tokens_sum, spec.sf_vec_size, sfb_arg, "intermediate")
    if spec.fmt == "nvfp4":
        _check_global_scale(global_scale_a, num_experts, gsa_arg)
        _check_global_scale(global_scale_b, num_experts, gsb_arg)
    else:
        for arg, g in ((gsa_arg, global_scale_a), (gsb_arg, global_scale_b)):
            if g is not None:
                raise ValueError(
                    f"{arg} must be None for {FORMAT_NAMES[spec.fmt]}: per-expert global scales "
                    "belong to NVFP4 (FP4 with float8_e4m3fn scales at sf_vec_size=16)"
                )
    tensors = {sfa_arg: sfa, sfb_arg: sfb, gsa_arg: global_scale_a, gsb_arg: global_scale_b}
    return Operands(
        hidden, tokens_sum, inter, num_experts, tuple(a_majors), tuple(b_majors), spec, tensors
    )


def check_blockscaled_values(
    arch: str, spec: BlockScaledSpec, offsets: torch.Tensor, tokens_sum: int, sfa, sfb,
    off_arg: str = "offsets_tensor", sf_args: tuple[str, str] = ("sfa_tensor", "sfb_tensor"),
) -> None:
    """Host read of the offsets of a block-scaled call (once per tensor version): the offsets
    rule with the format's per-expert token multiple, and enough scale columns for the split
    (each expert's scales start at its own atom column: ``common.mx_atoms``)."""
    align = spec.token_align
    if align > 1:
        fmt = FORMAT_NAMES[spec.fmt]
        why = (
            f"for {fmt} on SM100 (cuDNN's rule: whole 128x4 scale atoms per expert; "
            "grouped_gemm_wgrad accepts any MXFP8 count)" if arch == "sm100"
            else f"for {fmt} (packed FP4: two tokens per byte)"
        )
    else:
        why = ""
    check_offsets_values(offsets, tokens_sum, align, off_arg, why)

    def check() -> None:
        need = grouped_scale_cols(offsets.tolist(), spec.sf_vec_size)[2]
        for arg, sf in zip(sf_args, (sfa, sfb)):
            if sf.shape[1] < need:
                raise ValueError(
                    f"{arg} has {sf.shape[1]} scale columns; this split of the experts' tokens "
                    f"needs {need} (each expert's round_up(ceil(tokens / sf_vec_size), 4) "
                    "columns; common.mx_atoms.grouped_scale_cols_bound sizes a buffer for any "
                    "split)"
                )

    validated_once(
        offsets, ("sf_cols", spec.sf_vec_size, sfa.shape[1], sfb.shape[1], off_arg), check
    )


def default_sf_vec_size(sfa) -> int:
    """``sf_vec_size`` as the scale dtype says it: E4M3 scales -> NVFP4 (16), else 32 (MX)."""
    return 16 if getattr(sfa, "dtype", None) == torch.float8_e4m3fn else 32


# ---------------------------------------------------------------------------------------------
# The format's steps of the validation pipeline
# ---------------------------------------------------------------------------------------------


def check_controls(call) -> None:
    """Nothing before the operands: the scale controls are this format's operands
    (:func:`operands`)."""
    del call


def operands(arch: str, call, a: torch.Tensor, b: torch.Tensor) -> Operands:
    """:func:`validate_blockscaled` of the call (``a`` / ``b`` as launched)."""
    n = call.names
    return validate_blockscaled(
        arch, a, b, call.sfa, call.sfb, call.offsets, call.global_scale_a, call.global_scale_b,
        sf_vec_size=call.sf_vec_size, sf_fp8_dtype_override=call.sf_fp8_dtype_override,
        acc_dtype=call.acc_dtype,
        names=(n.a, n.b, n.sfa, n.sfb, n.offsets, n.global_scale_a, n.global_scale_b),
    )


def check_values(arch: str, ops: Operands, call) -> None:
    """:func:`check_blockscaled_values` of the call (a host read, once per tensor version)."""
    n = call.names
    check_blockscaled_values(
        arch, ops.spec, call.offsets, ops.tokens_sum, call.sfa, call.sfb, n.offsets,
        (n.sfa, n.sfb),
    )


def check_fits(contract: WgradContract) -> None:
    """No whole-contract rule: a contract no native kernel serves runs the twin."""
    del contract


# ---------------------------------------------------------------------------------------------
# Launch: the native kernel a registered family has for the contract, else the twin
# ---------------------------------------------------------------------------------------------


def native_launcher(contract: WgradContract) -> Launcher | None:
    """The native kernel's launcher of the block-scaled ``contract``, or None.

    ``contract.block_scaled`` is set (format, dtypes, ``sf_vec_size``, the per-expert
    ``token_align`` the offsets obey); ``contract.arch`` is the device's kernel arch ("sm100" /
    "sm90"), or "torch" off those GPUs (never a kernel). The first registered family of the arch
    and format that is available and supports the contract (``registry.find_kernel``) gives the
    launcher; today ``sm100_blockscaled`` (MXFP8 / MXFP4 / NVFP4 on SM100, behind
    ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``) and ``sm90_mxfp8`` (MXFP8 on SM90, while
    ``sm90_mxfp8.enabled()``).
    """
    if contract.arch == "torch":
        return None
    family, _ = registry.find_kernel(contract)
    return None if family is None else family.launcher(contract)


def select_blockscaled_backend(contract: WgradContract) -> tuple[str, str]:
    """Which implementation runs the block-scaled ``contract``: ``(name, reason)``.

    ``name`` is ``contract.arch`` when a registered family serves it, else "torch" (the twin
    ``blockscaled_ref.grouped_wgrad_blockscaled_torch`` on the tensors' device), with why.
    """
    spec = contract.block_scaled
    if spec is None:
        raise ValueError("select_blockscaled_backend needs a block-scaled contract")
    if contract.arch == "torch":
        why = "the tensors are not on an SM90 / SM100 GPU"
    else:
        family, why = registry.find_kernel(contract)
        if family is not None:
            return contract.arch, ""
    where = contract.arch.upper() if contract.arch != "torch" else "this device"
    return "torch", (
        f"no native block-scaled {FORMAT_NAMES[spec.fmt]} kernel is built for {where} yet "
        f"({why}): block-scaled calls run the torch twin "
        "blockscaled_ref.grouped_wgrad_blockscaled_torch on the tensors' device"
    )


def load_launcher(contract: WgradContract, who: str) -> tuple[Launcher, str, str]:
    """``(launcher, backend, reason)`` of a block-scaled contract: the native kernel's launcher
    (:func:`native_launcher`), else the twin with the reason. ``who`` is unused (no compile
    error to name: the twin always runs)."""
    del who
    name, reason = select_blockscaled_backend(contract)
    if name != "torch":
        return native_launcher(contract), name, ""

    def launcher(a, b, sfa, sfb, offsets, out, **kw):
        _twin_launch(contract, a, b, sfa, sfb, offsets, out, **kw)

    return launcher, "torch", reason


def launch(launcher: Launcher, contract: WgradContract, a, b, offsets, out, *, scales,
           stream=None, workspace=None) -> None:
    """One launch of a compiled block-scaled contract; ``scales`` is ``(sfa, sfb,
    global_scale_a, global_scale_b)``; a native kernel gets ``workspace`` for its per-expert
    descriptors."""
    del contract
    sfa, sfb, gsa, gsb = scales
    launcher(
        a, b, sfa, sfb, offsets, out, global_scale_a=gsa, global_scale_b=gsb,
        descriptor_workspace=workspace, stream=stream,
    )


def _tensor_at(address: int, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor viewing the caller-owned output at an integer ``address`` on ``device``."""
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type == "cuda":

        class _Mem:  # __cuda_array_interface__ v3: one byte array
            __cuda_array_interface__ = {  # noqa: RUF012
                "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3,
                "strides": None,
            }

        raw = torch.as_tensor(_Mem(), device=device)
    else:
        raw = torch.frombuffer((ctypes.c_byte * nbytes).from_address(address), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _ragged_to_2d(a: torch.Tensor, b: torch.Tensor, ends: list[int], pack: int):
    """``input_order="tensor_ragged"`` operands as tensor2d ones (per-expert blocks gathered)."""
    if not ends or ends[-1] == 0:
        return a, b
    a_parts, b_parts, begin = [], [], 0
    for end in ends:
        a_e, b_e = ragged_expert_views(a, b, begin // pack, end // pack)
        a_parts.append(a_e)
        b_parts.append(b_e)
        begin = end
    return torch.cat(a_parts, 1), torch.cat(b_parts, 0)


def _twin_launch(
    contract: WgradContract,
    a, b, sfa, sfb, offsets, out, *,
    global_scale_a=None, global_scale_b=None, descriptor_workspace=None, stream=None,
) -> None:
    """Run the block-scaled twin as a launcher would: dense ``out`` or, in discrete mode, write
    through the int64 addresses ``out`` (host-read here: the twin reads offsets on the host too,
    so it is not CUDA-graph capturable). ``descriptor_workspace`` is unused (no descriptors)."""
    del descriptor_workspace
    spec = contract.block_scaled
    pack = 2 if spec.packed_fp4 else 1
    cuda = stream is not None and a.device.type == "cuda"
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        if contract.input_order == "tensor_ragged":
            a, b = _ragged_to_2d(a, b, [int(v) for v in offsets.tolist()], pack)
        kw = {
            "sf_vec_size": spec.sf_vec_size, "global_scale_a": global_scale_a,
            "global_scale_b": global_scale_b, "accumulate": contract.accumulate,
        }
        if contract.output_mode == "dense":
            grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offsets, out=out, **kw)
            return
        dtype = NAME_TO_DTYPE[contract.out_dtype]
        shape = (contract.hidden, contract.intermediate)
        addrs = [int(p) for p in out.tolist()]
        for e, p in enumerate(addrs):
            if p == 0 or p % TMA_ALIGN_BYTES:
                raise ValueError(
                    f"wgrad_ptrs[{e}] = {p:#x}: every output address must be non-null and "
                    f"{TMA_ALIGN_BYTES}-byte aligned"
                )
        views = [_tensor_at(p, shape, dtype, a.device) for p in addrs]
        tmp = (
            torch.stack(views) if contract.accumulate
            else torch.empty((len(views), *shape), dtype=dtype, device=a.device)
        )
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offsets, out=tmp, **kw)
        for v, r in zip(views, tmp):
            v.copy_(r)
