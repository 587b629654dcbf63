"""Device dispatch of the grouped wgrad: which implementation runs on a device
(``select_grouped_wgrad_backend``), ``grouped_gemm_wgrad`` (any device, torch fallback),
``kernel_unsupported_reason`` and the dispatcher's ``grouped_wgrad_fp32``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _env, launch
from ._types import _OUTPUT_MODES, SM100_GROUP_ALIGN, TupleDict, WgradContract
from .torch_ref import grouped_wgrad_torch
from .validate import (
    _check_dense_out,
    _check_input_order,
    _check_offsets_values,
    _check_same_device,
    _check_wgrad_dtype,
    _ragged_compact,
    _validate_operands,
)
from .wrappers import grouped_gemm_wgrad_wrapper_sm90, grouped_gemm_wgrad_wrapper_sm100

_BACKENDS = ("auto", "sm100", "sm90", "torch")


def select_grouped_wgrad_backend(device: torch.device | str) -> tuple[str, str]:
    """Which implementation ``grouped_gemm_wgrad(backend="auto")`` uses on ``device``.

    Returns:
        (name, reason): name in {"sm100", "sm90", "torch"}; reason says why torch was chosen.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "torch", f"device {device} is not a CUDA device"
    cc = _env.query_arch(device)
    if cc >= 100:
        module = _env.family_module("sm100")
        if module is None or not hasattr(module, "compile_sm100_wgrad"):
            return "torch", f"SM{cc}: the SM100 kernel is not built yet"
        unverified = getattr(module, "unverified_reason", lambda: None)()
        if unverified:  # compiled but never run on hardware: only with the explicit opt-in
            return "torch", f"SM{cc}: {unverified}"
        missing = _env.cutlass_dsl_missing()
        return ("torch", missing) if missing else ("sm100", "")
    if cc >= 90:
        missing = _env.cutlass_dsl_missing()
        return ("torch", missing) if missing else ("sm90", "")
    return "torch", f"SM{cc} is below SM90"


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
) -> TupleDict:
    """Grouped wgrad on any device: SM100 kernel on SM100+, SM90 kernel on Hopper, torch elsewhere.

    ``wgrad[e] (+)= A[:, begin:end] @ B[begin:end, :]``, fp32 accumulation.

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
    if backend == "auto":
        if not isinstance(a_tensor, torch.Tensor):
            raise ValueError(f"a_tensor must be a torch.Tensor, got {type(a_tensor).__name__}")
        backend, _ = select_grouped_wgrad_backend(a_tensor.device)
    if backend in ("sm100", "sm90"):
        fn = (
            grouped_gemm_wgrad_wrapper_sm100
            if backend == "sm100"
            else (grouped_gemm_wgrad_wrapper_sm90)
        )
        return fn(
            a_tensor,
            b_tensor,
            None,
            None,
            offsets_tensor,
            output_mode=output_mode,
            wgrad_tensor=wgrad_tensor,
            wgrad_ptrs=wgrad_ptrs,
            wgrad_dtype=wgrad_dtype,
            accumulate_on_output=accumulate_on_output,
            input_order=input_order,
            current_stream=current_stream,
            validate_offsets=validate_offsets,
        )
    return _torch_path(
        a_tensor,
        b_tensor,
        offsets_tensor,
        output_mode,
        wgrad_tensor,
        wgrad_ptrs,
        wgrad_dtype,
        accumulate_on_output,
        input_order,
        validate_offsets,
    )


def _torch_path(
    a_tensor,
    b_tensor,
    offsets_tensor,
    output_mode,
    wgrad_tensor,
    wgrad_ptrs,
    wgrad_dtype,
    accumulate_on_output,
    input_order,
    validate_offsets,
) -> TupleDict:
    if output_mode not in _OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    input_order = _check_input_order(input_order)
    if input_order == "tensor_ragged":
        a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
    hidden, tokens_sum, inter, num_experts, _, _ = _validate_operands(
        "torch", a_tensor, b_tensor, offsets_tensor, ("a_tensor", "b_tensor", "offsets_tensor")
    )
    _check_wgrad_dtype(wgrad_dtype)
    if wgrad_ptrs is not None:
        raise ValueError(
            "wgrad_ptrs: the torch fallback cannot write through caller-owned addresses; pass "
            "wgrad_tensor (or use a device with a grouped wgrad kernel)"
        )
    if wgrad_tensor is not None:
        _check_dense_out("torch", wgrad_tensor, (num_experts, hidden, inter), "wgrad_tensor")
    device = _check_same_device(
        {
            "a_tensor": a_tensor,
            "b_tensor": b_tensor,
            "offsets_tensor": offsets_tensor,
            "wgrad_tensor": wgrad_tensor,
        }
    )
    if validate_offsets and not _env.capturing(device):
        _check_offsets_values(offsets_tensor, tokens_sum, 1, "offsets_tensor")
    if wgrad_tensor is None:
        alloc = torch.zeros if accumulate_on_output else torch.empty
        wgrad_tensor = alloc((num_experts, hidden, inter), dtype=wgrad_dtype, device=device)
    grouped_wgrad_torch(
        a_tensor,
        b_tensor,
        offsets_tensor,
        out=wgrad_tensor,
        accumulate=accumulate_on_output,
        input_order=input_order,
    )
    return TupleDict(wgrad_tensor=wgrad_tensor)


def kernel_unsupported_reason(
    arch: str, a_HS: torch.Tensor, b_SI: torch.Tensor, offsets_E: torch.Tensor
) -> str | None:
    """Why the ``arch`` ("sm90" | "sm100") kernel's static contract does not cover this call.

    Checks host metadata only (dtypes, layouts, alignment, tile fit), never offsets values nor the
    device. Returns None when the call fits.
    """
    try:
        _, _, inter, num_experts, a_majors, b_majors = _validate_operands(
            arch, a_HS, b_SI, offsets_E, ("a_HS", "b_SI", "offsets_E")
        )
        launch._check_contract_fits(
            WgradContract(
                arch=arch,
                hidden=a_HS.shape[0],
                intermediate=inter,
                num_experts=num_experts,
                a_major=a_majors[0],
                b_major=b_majors[0],
                out_dtype="float32",
                output_mode="dense",
                accumulate=False,
                input_order="tensor2d",
                mma_tiler_mn=(256, 256) if arch == "sm100" else None,
                cluster_shape_mn=None,
            )
        )
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
    :data:`SM100_GROUP_ALIGN` (its contract: every expert's rows a multiple of 256; it poisons
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
    if reason is None and backend == "sm100" and group_align % SM100_GROUP_ALIGN:
        reason = (
            f"the SM100 kernel needs every expert's rows in multiples of {SM100_GROUP_ALIGN}; "
            f"the caller guarantees group_align={group_align} (pass group_align="
            f"{SM100_GROUP_ALIGN} for a layout padded to {SM100_GROUP_ALIGN} rows)"
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
        wrapper = (
            grouped_gemm_wgrad_wrapper_sm90 if name == "sm90" else grouped_gemm_wgrad_wrapper_sm100
        )
        out = wrapper(
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
