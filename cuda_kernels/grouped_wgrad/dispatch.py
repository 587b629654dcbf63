"""Device dispatch of the grouped wgrad: which implementation runs on a device
(``select_grouped_wgrad_backend``, ``select_blockscaled_backend``), ``grouped_gemm_wgrad`` (any
device, torch fallback), ``kernel_unsupported_reason`` and the dispatcher's
``grouped_wgrad_fp32``.

Block-scaled (FP8 / FP4) calls: :func:`_blockscaled_kernel` is the one hook where a native
block-scaled kernel family (``sm100_blockscaled.py``, ``sm90_mxfp8.py``, each behind its opt-in)
plugs in; while it returns None every block-scaled call — through the classes, the wrappers or
``grouped_gemm_wgrad`` — runs the torch twin ``blockscaled_ref.grouped_wgrad_blockscaled_torch``
on the tensors' device (backend name "torch"), after the same validation.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import env, launch
from ._types import (
    BLOCKSCALED_TOKEN_ALIGN,
    NAME_TO_DTYPE,
    OUTPUT_MODES,
    SM100_GROUP_ALIGN,
    TupleDict,
    WgradContract,
)
from .blockscaled_ref import grouped_wgrad_blockscaled_torch
from .torch_ref import grouped_wgrad_torch, ragged_expert_views
from .validate import (
    _FORMAT_NAMES,
    _check_blockscaled_values,
    _check_dense_out,
    _check_input_order,
    _check_offsets_values,
    _check_ptrs_tensor,
    _check_same_device,
    _check_wgrad_dtype,
    _check_workspace,
    _is_blockscaled_pair,
    _ragged_compact,
    _validate_blockscaled,
    _validate_operands,
)
from .wrappers import (
    _outputs,
    grouped_gemm_wgrad_wrapper_sm90,
    grouped_gemm_wgrad_wrapper_sm100,
)

_BACKENDS = ("auto", "sm100", "sm90", "torch")


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
    if cc >= 100:
        module = env.family_module("sm100")
        if module is None or not hasattr(module, "compile_sm100_wgrad"):
            return "torch", f"SM{cc}: the SM100 kernel cannot be imported"
        unverified = getattr(module, "unverified_reason", lambda: None)()
        if unverified:  # compiled but never run on hardware: only with the explicit opt-in
            return "torch", f"SM{cc}: {unverified}"
        missing = env.cutlass_dsl_missing()
        return ("torch", missing) if missing else ("sm100", "")
    if cc >= 90:
        missing = env.cutlass_dsl_missing()
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
    "auto" runs the device's native block-scaled kernel when ``dispatch._blockscaled_kernel``
    has one for the contract, else the torch twin on the tensors' device (any device, CPU
    included); "sm100" / "sm90" go through that wrapper (its rules), "torch" runs the twin.
    ``sf_vec_size`` defaults from the scale dtype (E4M3 -> 16, E8M0 -> 32); ``stats`` (a dict)
    receives the block-scaled ``"backend"`` and ``"reason"``.

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
    if _is_blockscaled_pair(a_tensor, b_tensor) and backend in ("auto", "torch"):
        return _blockscaled_generic(
            a_tensor, b_tensor, offsets_tensor, sfa_tensor=sfa_tensor, sfb_tensor=sfb_tensor,
            global_scale_a=global_scale_a, global_scale_b=global_scale_b,
            sf_vec_size=sf_vec_size, sf_fp8_dtype_override=sf_fp8_dtype_override,
            output_mode=output_mode, wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs,
            wgrad_dtype=wgrad_dtype, accumulate_on_output=accumulate_on_output,
            input_order=input_order, validate_offsets=validate_offsets,
            current_stream=current_stream, descriptor_workspace=descriptor_workspace,
            stats=stats,
        )
    scale_args = {
        "sfa_tensor": sfa_tensor, "sfb_tensor": sfb_tensor, "global_scale_a": global_scale_a,
        "global_scale_b": global_scale_b, "sf_fp8_dtype_override": sf_fp8_dtype_override,
    }
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
        extra = {} if sf_vec_size is None else {"sf_vec_size": sf_vec_size}
        if _is_blockscaled_pair(a_tensor, b_tensor) and sf_vec_size is None:
            extra["sf_vec_size"] = 16 if getattr(sfa_tensor, "dtype", None) == (
                torch.float8_e4m3fn) else 32
        return fn(
            a_tensor,
            b_tensor,
            sfa_tensor,
            sfb_tensor,
            offsets_tensor,
            output_mode=output_mode,
            wgrad_tensor=wgrad_tensor,
            wgrad_ptrs=wgrad_ptrs,
            global_scale_a=global_scale_a,
            global_scale_b=global_scale_b,
            wgrad_dtype=wgrad_dtype,
            accumulate_on_output=accumulate_on_output,
            input_order=input_order,
            current_stream=current_stream,
            validate_offsets=validate_offsets,
            sf_fp8_dtype_override=sf_fp8_dtype_override,
            descriptor_workspace=descriptor_workspace,
            **extra,
        )
    for name, value in scale_args.items():
        if value is not None:
            raise ValueError(
                f"{name} must be None: BF16 operands forbid scale-factor and global-scale "
                "controls (only an FP8/FP4 operand pair selects the block-scaled backend)"
            )
    if sf_vec_size not in (None, 16):
        raise ValueError(f"sf_vec_size must be 16 (or None) for BF16, got {sf_vec_size}")
    if descriptor_workspace is not None and output_mode in OUTPUT_MODES:
        _check_workspace(
            descriptor_workspace, None,
            offsets_tensor.numel() if isinstance(offsets_tensor, torch.Tensor) else 1,
            output_mode, _check_input_order(input_order),
        )  # accepted (cuDNN-sized) and unused by the torch fallback
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
    if output_mode not in OUTPUT_MODES:
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
    if validate_offsets and not env.capturing(device):
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
    device. Returns None when the call fits. Block-scaled operands (an FP8 / FP4 pair, with the
    scale tensors): the reason names the twin while :func:`_blockscaled_kernel` has no native
    kernel for the contract (today: always).
    """
    if _is_blockscaled_pair(a_HS, b_SI):
        try:
            return _blockscaled_unsupported_reason(
                arch, a_HS, b_SI, offsets_E, sfa_tensor, sfb_tensor, global_scale_a,
                global_scale_b, sf_vec_size,
            )
        except (ValueError, RuntimeError) as exc:
            return str(exc)
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
                mma_tiler_mn=None,  # per shape from configs/cuda
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


# ---------------------------------------------------------------------------------------------
# Block-scaled (FP8 / FP4): the native-kernel hook and the twin that runs until one plugs in
# ---------------------------------------------------------------------------------------------

#: Signature of a block-scaled launcher (native kernel or the twin):
#: ``launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a, global_scale_b,
#: descriptor_workspace, stream) -> None`` with ``out`` the dense [E, H, I] tensor or, in
#: discrete mode, the [E] int64 output addresses; ``stream`` a torch.cuda.Stream or None.
BlockScaledLauncher = Callable[..., None]


def _blockscaled_kernel(contract: WgradContract) -> BlockScaledLauncher | None:
    """THE hook of the native block-scaled kernels: the launcher of ``contract``, or None.

    ``contract.block_scaled`` is set (format, dtypes, ``sf_vec_size``, the per-expert
    ``token_align`` the offsets obey: 128 / 64 from the ``_sm100`` surface, 1 (MXFP8) / 2 (FP4)
    from ``grouped_gemm_wgrad`` and the ``_sm90`` surface); ``contract.arch`` is "sm100" or
    "sm90" (the device's kernel arch). A family returns a launcher (signature
    :data:`BlockScaledLauncher`, compiled once per contract) only for contracts it supports —
    e.g. ``sm100_blockscaled`` for MXFP8 / MXFP4 / NVFP4 on "sm100", ``sm90_mxfp8`` for MXFP8 on
    "sm90" —
    and None otherwise; it receives the caller's ``descriptor_workspace`` (or None) at launch.

    Built today: ``sm90_mxfp8`` (MXFP8, both operands K-major along tokens, ``tensor2d``) on an
    SM90 GPU with CuTe DSL, while :func:`sm90_mxfp8.enabled` (verified on the H200, or
    ``MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1``); ``sm100_blockscaled`` (MXFP8 / MXFP4 / NVFP4,
    both operands K-major, ``tensor2d``, dense output or discrete through per-expert TMA
    descriptors in the caller's ``descriptor_workspace``, the ``_sm100`` token multiples 128 / 64:
    :func:`sm100_blockscaled.supports`) on "sm100" with CuTe DSL, gated exactly like the BF16
    SM100 kernel: only with ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1`` (compiled, never run on a
    B200); without it SM100 block-scaled calls run the twin.
    """
    spec = contract.block_scaled
    if contract.arch == "sm100" and spec is not None and env.cutlass_dsl_missing() is None:
        from . import sm100_bf16, sm100_blockscaled

        if sm100_bf16.unverified_reason() is None and sm100_blockscaled.supports(contract) is None:
            return _sm100_blockscaled_launcher(contract)
        return None
    if (
        contract.arch == "sm90"
        and spec is not None
        and spec.fmt == "mxfp8"
        and contract.a_major == "k"
        and contract.b_major == "k"
        and contract.input_order == "tensor2d"
        and env.cutlass_dsl_missing() is None
    ):
        from . import sm90_mxfp8

        if sm90_mxfp8.enabled():
            return _sm90_mxfp8_launcher(contract)
    return None


def _sm100_blockscaled_launcher(contract: WgradContract) -> BlockScaledLauncher:
    """The SM100 block-scaled kernel behind :data:`BlockScaledLauncher`'s signature, compiled on
    its first launch (cached per key by its ``KernelFamily``; the launch re-checks the opt-in)."""
    from .sm100_blockscaled import compile_sm100_blockscaled_wgrad

    def launcher(a, b, sfa, sfb, offsets, out, **kw):
        compile_sm100_blockscaled_wgrad(contract)(a, b, sfa, sfb, offsets, out, **kw)

    return launcher


def _sm90_mxfp8_launcher(contract: WgradContract) -> BlockScaledLauncher:
    """The SM90 MXFP8 kernel behind :data:`BlockScaledLauncher`'s signature (the API has checked
    every rule; no host read here, so the operands go through the padded token layout)."""
    from .sm90_mxfp8 import grouped_wgrad_mxfp8_sm90

    out_dtype = NAME_TO_DTYPE[contract.out_dtype]

    def launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a=None, global_scale_b=None,
                 descriptor_workspace=None, stream=None):
        del global_scale_a, global_scale_b, descriptor_workspace  # MXFP8: none; TMA: own
        grouped_wgrad_mxfp8_sm90(
            a, sfa, b, sfb, offsets, out, out_dtype=out_dtype, accumulate=contract.accumulate,
            output_mode=contract.output_mode, token_layout="padded", validate=False,
            stream=stream,
        )

    return launcher


def select_blockscaled_backend(contract: WgradContract) -> tuple[str, str]:
    """Which implementation runs the block-scaled ``contract``: ``(name, reason)``.

    ``name`` is ``contract.arch`` when :func:`_blockscaled_kernel` has a native launcher, else
    "torch" (the twin ``blockscaled_ref.grouped_wgrad_blockscaled_torch`` on the tensors'
    device), with the reason.
    """
    spec = contract.block_scaled
    if spec is None:
        raise ValueError("select_blockscaled_backend needs a block-scaled contract")
    if contract.arch in ("sm100", "sm90") and _blockscaled_kernel(contract) is not None:
        return contract.arch, ""
    where = contract.arch.upper() if contract.arch != "torch" else "this device"
    return "torch", (
        f"no native block-scaled {_FORMAT_NAMES[spec.fmt]} kernel is built for {where} yet "
        "(dispatch._blockscaled_kernel returned None): block-scaled calls run the torch twin "
        "blockscaled_ref.grouped_wgrad_blockscaled_torch on the tensors' device"
    )


def _blockscaled_launcher(contract: WgradContract) -> tuple[BlockScaledLauncher, str, str]:
    """(launcher, backend name, reason) of a block-scaled contract: the native kernel from the
    hook, else the twin."""
    name, reason = select_blockscaled_backend(contract)
    if name != "torch":
        return _blockscaled_kernel(contract), name, ""

    def launcher(a, b, sfa, sfb, offsets, out, **kw):
        _twin_launch(contract, a, b, sfa, sfb, offsets, out, **kw)

    return launcher, "torch", reason


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
    ctx = (
        torch.cuda.stream(stream)
        if stream is not None and a.device.type == "cuda"
        else _nullcontext()
    )
    with ctx:
        if contract.input_order == "tensor_ragged":
            a, b = _ragged_to_2d(a, b, [int(v) for v in offsets.tolist()], pack)
        kw = dict(
            sf_vec_size=spec.sf_vec_size, global_scale_a=global_scale_a,
            global_scale_b=global_scale_b, accumulate=contract.accumulate,
        )
        if contract.output_mode == "dense":
            grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offsets, out=out, **kw)
            return
        dtype = NAME_TO_DTYPE[contract.out_dtype]
        shape = (contract.hidden, contract.intermediate)
        addrs = [int(p) for p in out.tolist()]
        for e, p in enumerate(addrs):
            if p == 0 or p % 16:
                raise ValueError(
                    f"wgrad_ptrs[{e}] = {p:#x}: every output address must be non-null and "
                    "16-byte aligned"
                )
        views = [_tensor_at(p, shape, dtype, a.device) for p in addrs]
        tmp = (
            torch.stack(views) if contract.accumulate
            else torch.empty((len(views), *shape), dtype=dtype, device=a.device)
        )
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offsets, out=tmp, **kw)
        for v, r in zip(views, tmp):
            v.copy_(r)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _device_kernel_arch(device: torch.device) -> str | None:
    """"sm100" / "sm90" for a CUDA device of that generation, else None (no GPU query off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    cc = env.query_arch(device)
    return "sm100" if cc >= 100 else "sm90" if cc >= 90 else None


def _blockscaled_generic(
    a_tensor, b_tensor, offsets_tensor, *, sfa_tensor, sfb_tensor, global_scale_a,
    global_scale_b, sf_vec_size, sf_fp8_dtype_override, output_mode, wgrad_tensor, wgrad_ptrs,
    wgrad_dtype, accumulate_on_output, input_order, validate_offsets, current_stream,
    descriptor_workspace, stats,
) -> TupleDict:
    """``grouped_gemm_wgrad``'s block-scaled path: any per-expert token count for MXFP8 (0
    included), even counts for FP4; the native kernel of the device when the hook has one for
    this contract, else the twin."""
    if output_mode not in OUTPUT_MODES:
        raise ValueError(f'output_mode must be "dense" or "discrete", got {output_mode!r}')
    input_order = _check_input_order(input_order)
    if sf_vec_size is None:  # the scale dtype says it: E4M3 scales -> NVFP4 (16), else 32
        sf_vec_size = 16 if getattr(sfa_tensor, "dtype", None) == torch.float8_e4m3fn else 32
    if input_order == "tensor_ragged":
        a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
    ops = _validate_blockscaled(
        "torch", a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, global_scale_a,
        global_scale_b, sf_vec_size=sf_vec_size, sf_fp8_dtype_override=sf_fp8_dtype_override,
        acc_dtype=torch.float32,
    )
    e, h, i = ops.num_experts, ops.hidden, ops.intermediate
    out_name = _check_wgrad_dtype(wgrad_dtype)
    if output_mode == "dense" and wgrad_ptrs is not None:
        raise ValueError("wgrad_ptrs must be None in dense output mode (dense output forbids it)")
    if wgrad_tensor is not None:
        out_name = _check_dense_out("torch", wgrad_tensor, (e, h, i), "wgrad_tensor")
    if wgrad_ptrs is not None:
        _check_ptrs_tensor(wgrad_ptrs, e)
    _check_workspace(descriptor_workspace, None, e, output_mode, input_order)
    device = _check_same_device(
        {
            "a_tensor": a_tensor, "b_tensor": b_tensor, "sfa_tensor": sfa_tensor,
            "sfb_tensor": sfb_tensor, "offsets_tensor": offsets_tensor,
            "global_scale_a": global_scale_a, "global_scale_b": global_scale_b,
            "wgrad_tensor": wgrad_tensor, "wgrad_ptrs": wgrad_ptrs,
            "descriptor_workspace": descriptor_workspace,
        }
    )
    contract = WgradContract(
        arch=_device_kernel_arch(device) or "torch", hidden=h, intermediate=i, num_experts=e,
        a_major=ops.a_majors[0], b_major=ops.b_majors[0], out_dtype=out_name,
        output_mode=output_mode, accumulate=bool(accumulate_on_output), input_order=input_order,
        mma_tiler_mn=None, cluster_shape_mn=None, block_scaled=ops.spec,
    )
    launcher, name, reason = _blockscaled_launcher(contract)
    if name == "torch" or (validate_offsets and not env.capturing(device)):
        # The twin reads the offsets on the host anyway: check them (once per version) first.
        _check_blockscaled_values("torch", ops.spec, offsets_tensor, ops.tokens_sum, sfa_tensor,
                                  sfb_tensor)
    if stats is not None:
        stats["backend"], stats["reason"] = name, reason
    wgrad_tensor, out = _outputs(output_mode, wgrad_tensor, wgrad_ptrs, (e, h, i), out_name,
                                 accumulate_on_output, device)
    stream = None
    if current_stream is not None and device.type == "cuda":
        from .classes import _torch_stream

        stream = _torch_stream(current_stream, device)
    launcher(
        a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor, out,
        global_scale_a=global_scale_a, global_scale_b=global_scale_b,
        descriptor_workspace=descriptor_workspace, stream=stream,
    )
    return TupleDict(wgrad_tensor=wgrad_tensor)


def _blockscaled_unsupported_reason(arch, a, b, offsets, sfa, sfb, gsa, gsb, sf_vec_size):
    if sf_vec_size is None:
        sf_vec_size = 16 if getattr(sfa, "dtype", None) == torch.float8_e4m3fn else 32
    names = ("a_HS", "b_SI", "sfa_tensor", "sfb_tensor", "offsets_E", "global_scale_a",
             "global_scale_b")
    ops = _validate_blockscaled(
        arch, a, b, sfa, sfb, offsets, gsa, gsb, sf_vec_size=sf_vec_size,
        sf_fp8_dtype_override=None, acc_dtype=torch.float32, names=names,
    )
    spec = dataclasses.replace(ops.spec, token_align=BLOCKSCALED_TOKEN_ALIGN["torch"][ops.spec.fmt])
    contract = WgradContract(
        arch=arch, hidden=ops.hidden, intermediate=ops.intermediate, num_experts=ops.num_experts,
        a_major=ops.a_majors[0], b_major=ops.b_majors[0], out_dtype="float32",
        output_mode="dense", accumulate=False, input_order="tensor2d", mma_tiler_mn=None,
        cluster_shape_mn=None, block_scaled=spec,
    )
    name, reason = select_blockscaled_backend(contract)
    return None if name != "torch" else reason
