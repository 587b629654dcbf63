"""Device dispatch of the grouped wgrad: which implementation runs on a device
(``select_grouped_wgrad_backend``), the generic entry ``grouped_gemm_wgrad`` (any device, torch
fallback), ``kernel_unsupported_reason`` and the dispatcher's ``grouped_wgrad_fp32``.

``grouped_gemm_wgrad`` picks the format by the operand dtypes (``pipeline.select_format``): a
kernel arch ("sm100" / "sm90", by device or named) goes through that wrapper and its rules; the
rest runs ``pipeline.validate_call`` with the twins' rules (arch "torch") and the format's
launcher: for block-scaled operands the native kernel a registered family has for the contract
(``blockscaled.native_launcher``), else the twin
``blockscaled_ref.grouped_wgrad_blockscaled_torch``; for BF16 operands the twin
``torch_ref.grouped_wgrad_torch``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..gemm import env, registry
from . import bf16, blockscaled
from ._types import BLOCKSCALED_TOKEN_ALIGN, FP32_NAMES, TupleDict, WgradCall
from .pipeline import allocate_outputs, compile_contract, select_format, validate_call
from .torch_ref import grouped_wgrad_torch
from .wrappers import WRAPPERS

__all__ = [
    "grouped_gemm_wgrad",
    "grouped_wgrad_fp32",
    "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
]

_BACKENDS = ("auto", *WRAPPERS, "torch")


_DEVICE_RULE = (
    "device must be a torch.device, a device string (\"cuda\", \"cuda:1\", \"cpu\") or a CUDA "
    "device index (int)"
)


def _as_device(device: Any) -> torch.device:
    """``device`` as a torch.device, or ValueError naming the argument and what it accepts."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"{_DEVICE_RULE}; got the negative index {device}")
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"{_DEVICE_RULE}; got {device!r} ({exc})") from None
    hint = " (for a tensor pass tensor.device)" if isinstance(device, torch.Tensor) else ""
    raise ValueError(f"{_DEVICE_RULE}; got {type(device).__name__}{hint}")


def _device_kernel_arch(device: torch.device) -> str | None:
    """"sm100" / "sm90" for a CUDA device of that generation, else None (no GPU query off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return env.kernel_arch(env.query_arch(device))


def select_grouped_wgrad_backend(device: torch.device | str | int) -> tuple[str, str]:
    """Which implementation ``grouped_gemm_wgrad(backend="auto")`` uses on ``device``.

    Args:
        device: a torch.device, a device string ("cuda", "cuda:1", "cpu", ...) or a CUDA
            device index.

    Returns:
        (name, reason): name in {"sm100", "sm90", "torch"}; reason says why torch was chosen
        ("device cpu is not a CUDA device", "CUDA is not available ...", the SM rule, ...).

    Raises:
        ValueError: ``device`` is none of those (a tensor, None, an unknown device string).
    """
    device = _as_device(device)
    if device.type != "cuda":
        return "torch", f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "torch", (f"CUDA is not available (torch.cuda.is_available() is False), so "
                         f"device {device} cannot run a kernel")
    if device.index is not None and device.index >= torch.cuda.device_count():
        return "torch", (f"device {device} does not exist ({torch.cuda.device_count()} CUDA "
                         "device(s) visible)")
    cc = env.query_arch(device)
    arch = env.kernel_arch(cc)
    if arch is None:
        return "torch", f"SM{cc} is below SM90"
    family = registry.provider(arch, bf16.NAME)
    if family is None or family.load() is None:
        return "torch", f"SM{cc}: the {arch.upper()} kernel cannot be imported"
    gate = family.gate()  # e.g. compiled but never run on hardware: only with the opt-in
    if gate:
        return "torch", f"SM{cc}: {gate}"
    missing = env.cutlass_dsl_missing()
    return ("torch", missing) if missing else (arch, "")


def grouped_gemm_wgrad(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    offsets_tensor: torch.Tensor,
    *,
    output_mode: str = "dense",
    wgrad_tensor: torch.Tensor | None = None,
    wgrad_ptrs: torch.Tensor | None = None,
    wgrad_dtype: torch.dtype = torch.bfloat16,
    accumulate_on_output: bool = False,
    input_order: str = "tensor2d",
    backend: str = "auto",
    validate_offsets: bool = True,
    current_stream: Any = None,
    sfa_tensor: torch.Tensor | None = None,
    sfb_tensor: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    sf_vec_size: int | None = None,
    sf_fp8_dtype_override: str | None = None,
    descriptor_workspace: torch.Tensor | None = None,
    stats: dict | None = None,
) -> TupleDict:
    """Grouped wgrad on any device: SM100 kernel on SM100+, SM90 kernel on Hopper, torch elsewhere.

    ``wgrad[e] (+)= A[:, begin:end] @ B[begin:end, :]``, fp32 accumulation.

    Block-scaled operands (A and B one FP8 E4M3 / E5M2 or packed FP4 dtype, with ``sfa_tensor``
    / ``sfb_tensor``; the seed's block-scaled contract, see ``grouped_gemm_wgrad_wrapper_sm100``)
    take ANY per-expert token count here (0 included) for MXFP8 and any even count for FP4 —
    beyond the ``_sm100`` surface's multiples of 128 / 64: each expert's partial last scale group
    stands for a zero-padded one and its scales start at its own atom column
    (``common.mx_atoms``; size the scale tensors with ``grouped_scale_cols_bound``). ``backend``
    "auto" runs the device's native block-scaled kernel when a registered family serves the
    contract (``blockscaled.native_launcher``), else the torch twin on the tensors' device (any
    device, CPU included); "sm100" / "sm90" go through that wrapper (its rules), "torch" runs
    the twin. ``sf_vec_size`` defaults from the scale dtype (E4M3 -> 16, E8M0 -> 32);
    ``stats`` (a dict) receives the block-scaled ``"backend"`` and ``"reason"``.

    Args:
        a_tensor: [H, S] torch.bfloat16, K-major (S, 1) or M-major (1, H) strides.
        b_tensor: [S, I] torch.bfloat16, K-major (1, S) or N-major (I, 1) strides.
        offsets_tensor: [E] torch.int32 contiguous cumulative ends: non-decreasing, last == S;
            expert token counts multiples of 256 on the SM100 kernel, any count >= 0 otherwise.
        output_mode, wgrad_tensor, wgrad_ptrs, wgrad_dtype, accumulate_on_output, input_order,
            current_stream: as ``grouped_gemm_wgrad_wrapper_sm90``. The torch path cannot write
            through caller-owned ``wgrad_ptrs`` (ValueError there).
        backend: "auto" (by device, see ``select_grouped_wgrad_backend``), "sm100", "sm90" or
            "torch"; an explicit kernel that cannot run raises instead of falling back.
        validate_offsets: host-read offsets/pointer values (one sync); skipped during capture.

    Returns:
        TupleDict(wgrad_tensor=[E, H, I] tensor, or None for caller-owned ``wgrad_ptrs``).

    Raises:
        ValueError / RuntimeError: as the wrappers.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    fmt = select_format(a_tensor, b_tensor)
    if fmt is blockscaled and sf_vec_size is None:  # the scale dtype says it
        sf_vec_size = blockscaled.default_sf_vec_size(sfa_tensor)
    call = WgradCall(
        a=a_tensor, b=b_tensor, offsets=offsets_tensor, sfa=sfa_tensor, sfb=sfb_tensor,
        global_scale_a=global_scale_a, global_scale_b=global_scale_b, output_mode=output_mode,
        wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs, wgrad_dtype=wgrad_dtype,
        sf_vec_size=16 if sf_vec_size is None else sf_vec_size,
        sf_fp8_dtype_override=sf_fp8_dtype_override,
        accumulate_on_output=bool(accumulate_on_output), input_order=input_order,
        current_stream=current_stream, descriptor_workspace=descriptor_workspace,
        validate_offsets=validate_offsets,
    )
    if not (fmt is blockscaled and backend in ("auto", "torch")):
        if backend == "auto":
            if not isinstance(a_tensor, torch.Tensor):
                raise ValueError(f"a_tensor must be a torch.Tensor, got {type(a_tensor).__name__}")
            backend, _ = select_grouped_wgrad_backend(a_tensor.device)
        if backend in WRAPPERS:
            return WRAPPERS[backend](
                a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
                output_mode=output_mode, wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs,
                global_scale_a=global_scale_a, global_scale_b=global_scale_b,
                wgrad_dtype=wgrad_dtype, sf_vec_size=call.sf_vec_size,
                sf_fp8_dtype_override=sf_fp8_dtype_override,
                accumulate_on_output=accumulate_on_output, input_order=input_order,
                current_stream=current_stream, validate_offsets=validate_offsets,
                descriptor_workspace=descriptor_workspace,
            )
    return _twin_path(fmt, call, stats)


def _twin_path(fmt, call: WgradCall, stats: dict | None) -> TupleDict:
    """``grouped_gemm_wgrad`` off the kernel wrappers: the one pipeline with the twins' rules
    (arch "torch": any strides, any MXFP8 count, even FP4 counts), then the format's launcher.

    Block-scaled: the contract's arch is the device's kernel arch, so a registered native family
    may serve it; the twin reads the offsets on the host, so their values are checked whenever
    it runs. BF16: the torch twin writes the stacked tensor (never caller-owned pointers).
    """
    validate = call.validate_offsets
    call.validate_offsets = False  # checked below, where the implementation that runs needs it
    v = validate_call(call, "torch", allow_pointers=fmt is blockscaled)
    if fmt is blockscaled:
        contract = dataclasses.replace(v.contract, arch=_device_kernel_arch(v.device) or "torch")
    else:  # the twin writes the dense (stacked) output in either mode
        contract = dataclasses.replace(v.contract, output_mode="dense")
        v = dataclasses.replace(v, contracts=(contract,))
    op = compile_contract(contract, "grouped_gemm_wgrad")
    if (fmt is blockscaled and op.backend == "torch") or (validate and not env.capturing(v.device)):
        v.check_values()
    if stats is not None and fmt is blockscaled:
        stats["backend"], stats["reason"] = op.backend, op.reason
    wgrad_tensor, out = allocate_outputs(v)
    op.launch(v.a, v.b, call.offsets, out, stream=call.current_stream, scales=v.scales,
              workspace=v.workspace)
    return TupleDict(wgrad_tensor=wgrad_tensor)


def kernel_unsupported_reason(
    arch: str,
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    sfa_tensor: torch.Tensor | None = None,
    sfb_tensor: torch.Tensor | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    sf_vec_size: int | None = None,
) -> str | None:
    """Why the ``arch`` ("sm90" | "sm100") kernel's static contract does not cover this call.

    Checks host metadata only (dtypes, layouts, alignment, tile fit), never offsets values nor the
    device: ``pipeline.validate_call`` of a dense fp32 call with the arch's rules, then the tile
    fit. Returns None when the call fits. Block-scaled operands (an FP8 / FP4 pair, with the
    scale tensors): the reason names the twin while no registered family serves the contract
    (``blockscaled.select_blockscaled_backend``; ``grouped_gemm_wgrad``'s token rule).
    """
    fmt = select_format(a_HS, b_SI, FP32_NAMES) if isinstance(a_HS, torch.Tensor) else bf16
    if sf_vec_size is None:
        sf_vec_size = blockscaled.default_sf_vec_size(sfa_tensor) if fmt is blockscaled else 16
    call = WgradCall(
        a=a_HS, b=b_SI, offsets=offsets_E, sfa=sfa_tensor, sfb=sfb_tensor,
        global_scale_a=global_scale_a, global_scale_b=global_scale_b, wgrad_dtype=torch.float32,
        sf_vec_size=sf_vec_size, validate_offsets=False, names=FP32_NAMES,
    )
    try:
        v = validate_call(call, arch)
        if fmt is blockscaled:
            spec = v.contract.block_scaled
            spec = dataclasses.replace(spec, token_align=BLOCKSCALED_TOKEN_ALIGN["torch"][spec.fmt])
            name, reason = blockscaled.select_blockscaled_backend(
                dataclasses.replace(v.contract, block_scaled=spec)
            )
            return None if name != "torch" else reason
        v.check_fits()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def _check_group_align(group_align) -> int:
    if isinstance(group_align, bool) or not isinstance(group_align, int) or group_align < 1:
        raise ValueError(f"group_align must be an int >= 1, got {group_align!r}")
    return group_align


def _fp32_route(
    backend: str,
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    group_align: int = 1,
) -> tuple[str, str | None]:
    """The implementation :func:`grouped_wgrad_fp32` runs: ``(name, why not a kernel)``.

    ``name`` is "sm90", "sm100" or "torch"; the reason is None when a kernel runs. The SM100
    kernel is chosen only when the caller states ``group_align`` a multiple of
    ``bf16.TOKEN_ALIGN["sm100"]`` (its contract: every expert's rows a multiple of 256; it poisons
    experts that break it with NaN and cannot check offsets values without a host read), the
    SM90 kernel for any alignment. Host metadata only: no sync.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    group_align = _check_group_align(group_align)
    reason = "backend='torch' requested"
    if backend == "auto":
        backend, reason = select_grouped_wgrad_backend(a_HS.device)
    if backend == "torch":
        return "torch", reason
    reason = kernel_unsupported_reason(backend, a_HS, b_SI, offsets_E)
    align = bf16.TOKEN_ALIGN.get(backend, 1)
    if reason is None and group_align % align:
        reason = (
            f"the {backend.upper()} kernel needs every expert's rows in multiples of {align}; "
            f"the caller guarantees group_align={group_align} (pass group_align={align} for a "
            f"layout padded to {align} rows)"
        )
    return ("torch", reason) if reason is not None else (backend, None)


def grouped_wgrad_fp32(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    backend: str = "auto",
    stats: dict | None = None,
    group_align: int = 1,
) -> torch.Tensor:
    """The dispatcher's ``grouped_wgrad(a_HS, b_SI, offsets_E) -> [E, H, I] fp32`` on any device.

    Runs the device's kernel (``select_grouped_wgrad_backend``) when the call fits its static
    contract (``kernel_unsupported_reason``) and, for the SM100 kernel, the caller's stated
    ``group_align`` (:func:`_fp32_route`), else ``grouped_wgrad_torch``. Offsets come from
    ``common.routing``'s grouped layout, so their values are not host-validated
    (``validate_offsets=False``: no sync, graph-capturable); that layout may end before S
    (``offsets_E[-1] <= S``), which the kernels allow since they read only each expert's rows.

    Args:
        a_HS: [H, S], b_SI: [S, I] (BF16 for the kernels), offsets_E: [E] int32/int64.
        backend: "auto" (by device), "sm90" or "sm100" (that kernel when the call fits its
            contract; the device is still checked by the wrapper), or "torch".
        stats: optional dict; counts ``"kernel"`` / ``"torch"`` calls and keeps the last
            ``"torch_reason"``.
        group_align: the row alignment the caller guarantees for every expert
            (``(offsets_E[e] - offsets_E[e - 1]) % group_align == 0``; not checked: no host
            read). The SM100 kernel runs only for a multiple of 256 (default 1: never; the
            grouped layout of ``common.torch_backward`` aligns to 16 rows).

    Returns:
        [E, H, I] float32.

    Raises:
        ValueError: unknown ``backend``, ``group_align`` not an int >= 1, or a contract rule.
    """
    offsets32 = offsets_E.to(torch.int32) if offsets_E.dtype != torch.int32 else offsets_E
    name, reason = _fp32_route(backend, a_HS, b_SI, offsets32, group_align)
    if name != "torch":
        out = WRAPPERS[name](
            a_HS,
            b_SI,
            None,
            None,
            offsets32,
            output_mode="dense",
            wgrad_dtype=torch.float32,
            validate_offsets=False,
        )["wgrad_tensor"]
        key = "kernel"
    else:
        out = grouped_wgrad_torch(a_HS, b_SI, offsets_E, out_dtype=torch.float32)
        key = "torch"
        if stats is not None:
            stats["torch_reason"] = reason
    if stats is not None:
        stats[key] = stats.get(key, 0) + 1
    return out
