"""The BF16 format of the grouped wgrad: its contract, its validation steps and its launch.

Dimensions: H hidden, S tokens_sum, I intermediate, E num_experts (``common/shapes.py``).

``Wgrad[e] = A[:, begin:end] @ B[begin:end, :]`` with A ``[H, S]`` and B ``[S, I]`` torch.bfloat16,
fp32 accumulation, a BF16 / FP16 / FP32 output. What is easy to get wrong about it:

- the format is chosen by the OPERAND DTYPES alone (``pipeline.select_format``): a BF16 pair is
  this format even when a scale tensor is passed -- which is then an error (cuDNN's "BF16
  forbids scale control <name>"), never a silent fall-through to the block-scaled backend;
- the per-expert token rule depends on the kernel: every count a multiple of 256 on SM100 (its
  K tiles never straddle two experts; ``tiles.SM100_TILES.group_align``), any count >= 0 on SM90
  and on the torch twin. The offsets VALUES are data: checked only in the validation mode;
- the tile fit needs the whole static contract, so it is checked once per contract
  (:func:`contract_key`), not per call.

The steps below are called by ``pipeline.validate_call`` in its one order (controls, operands,
values; the fit and the compile by the entries); :func:`load_launcher` returns the launcher of a
contract -- the registered kernel family of its arch that serves it (``registry.providers``) or,
for arch "torch", the twin ``torch_ref.grouped_wgrad_torch``.

Launcher signature of the format (:data:`Launcher`): ``launcher(a, b, offsets, out, stream=None,
descriptor_workspace=None)``, ``out`` the dense ``[E, H, I]`` tensor or the ``[E]`` int64 output
addresses; what ``launch.KernelFamily.launcher`` returns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from ..gemm import env, registry
from ..gemm.tiles import TILE_RULES
from ._types import Operands, WgradContract
from .torch_ref import grouped_wgrad_torch
from .validate import check_offsets_values, validate_operands

__all__ = [
    "CUDNN_FORBIDS",
    "NAME",
    "TOKEN_ALIGN",
    "Launcher",
    "check_controls",
    "check_fits",
    "check_values",
    "clear_launcher_cache",
    "compile_launcher",
    "contract_key",
    "launch",
    "load_launcher",
    "operands",
]

NAME = "bf16"
#: Launcher of a BF16 contract: ``launcher(a, b, offsets, out, stream=None,
#: descriptor_workspace=None)``.
Launcher = Callable[..., None]
#: Every expert's token count is a multiple of this, per kernel arch (the tile rules' own
#: ``group_align``: the SM100 kernel's 256-token K pad; SM90 and the twin take any count).
TOKEN_ALIGN = {**{arch: rules.group_align for arch, rules in TILE_RULES.items()}, "torch": 1}
#: The block-scaled controls a BF16 call must leave None: (WgradCall field, ArgNames field).
_SCALE_CONTROLS = (
    ("sfa", "sfa"), ("sfb", "sfb"), ("global_scale_a", "global_scale_a"),
    ("global_scale_b", "global_scale_b"),
)


#: cuDNN frontend's words for a scale control on BF16 operands; its users match on them
#: (``pytest.raises(ValueError, match="BF16 forbids scale control sf_fp8_dtype_override")``).
CUDNN_FORBIDS = "BF16 forbids scale control"


def _forbidden(name: str) -> ValueError:
    return ValueError(
        f"{CUDNN_FORBIDS} {name}: {name} must be None (the BF16 grouped wgrad takes no "
        "scale-factor or global-scale controls; only an FP8 / FP4 A/B pair selects the "
        "block-scaled backend, and a BF16 call never falls through to it)"
    )


def check_controls(call) -> None:
    """The block-scaled controls of a BF16 call are None: scale tensors, global scales,
    ``sf_fp8_dtype_override``; ``sf_vec_size`` 16 (the seed's rule); ``acc_dtype`` fp32.

    Raises:
        ValueError: ``"BF16 forbids scale control <name>: <name> must be None ..."`` (cuDNN
            frontend's text, then ours), or the ``sf_vec_size`` / ``acc_dtype`` rule.
    """
    for attr, name_attr in _SCALE_CONTROLS:
        if getattr(call, attr) is not None:
            raise _forbidden(getattr(call.names, name_attr))
    if call.sf_fp8_dtype_override is not None:
        raise _forbidden("sf_fp8_dtype_override")
    if call.sf_vec_size != 16:
        raise ValueError(
            f"sf_vec_size must be 16 for BF16 (the seed's rule), got {call.sf_vec_size}"
        )
    if call.acc_dtype != torch.float32:
        raise ValueError(
            f"acc_dtype must be torch.float32 (FP32 accumulation), got {call.acc_dtype}"
        )


def operands(arch: str, call, a: torch.Tensor, b: torch.Tensor) -> Operands:
    """Ranks, shapes, BF16 dtypes, majors and the kernel's alignment rules of A, B and the
    offsets (``validate.validate_operands``; ``a`` / ``b`` as launched: compact views of a
    ``tensor_ragged`` call)."""
    names = call.names
    hidden, tokens_sum, inter, num_experts, a_majors, b_majors = validate_operands(
        arch, a, b, call.offsets, (names.a, names.b, names.offsets)
    )
    return Operands(hidden, tokens_sum, inter, num_experts, tuple(a_majors), tuple(b_majors))


def check_values(arch: str, ops: Operands, call) -> None:
    """Host read of the offsets (once per tensor version): non-decreasing, last == S, every
    count a multiple of :data:`TOKEN_ALIGN` of ``arch``."""
    check_offsets_values(call.offsets, ops.tokens_sum, TOKEN_ALIGN[arch], call.names.offsets)


def _family(contract: WgradContract):
    """(provider, module) of the BF16 family that serves ``contract``: the first registered for
    its arch whose module is built and that supports it (the first built one when none does: its
    refusal names the tiling); module None when none is built. No gate here: a gated family
    still compiles, and its launcher refuses to run."""
    rows = registry.providers(arch=contract.arch, fmt=NAME)
    built = [(p, p.load()) for p in rows if p.load() is not None]
    if len(built) > 1:
        for p, module in built:
            if p.supports(contract) is None:
                return p, module
    if built:
        return built[0]
    return (rows[0] if rows else None), None


def contract_key(contract: WgradContract):
    """The kernel key of a BF16 ``contract`` (its family's ``FAMILY.key_from_contract``: the tile
    from ``mma_tiler_mn`` or ``configs/cuda``), or None for arch "torch" or a family that is not
    built (its compile says so).

    Raises:
        ValueError: no tile of the family fits the contract (``unsupported ... tiling``).
    """
    if contract.arch == "torch":
        return None
    _, module = _family(contract)
    if module is None:
        return None
    try:
        return module.FAMILY.key_from_contract(contract)
    except ValueError as exc:
        raise ValueError(
            f"mma_tiler_mn={contract.mma_tiler_mn}: unsupported {contract.arch.upper()} tiling "
            f"for hidden={contract.hidden}, intermediate={contract.intermediate}: {exc}"
        ) from exc


def check_fits(contract: WgradContract) -> None:
    """The static rules that need the whole contract: the tile fit (:func:`contract_key`)."""
    contract_key(contract)


def compile_launcher(contract: WgradContract, who: str) -> Launcher:
    """The launcher of ``contract``, uncached (:func:`load_launcher` caches it; tests replace it):
    the twin for arch "torch", else the registered family's (compiled once per kernel key).
    ``who`` names the entry in messages.

    Raises:
        RuntimeError: the family is not built, or CuTe DSL is missing.
    """
    if contract.arch == "torch":
        return _twin_launcher(contract)
    p, module = _family(contract)
    if module is None:
        where = p.module if p is not None else f"no {contract.arch} bf16 family is registered"
        raise RuntimeError(
            f"{who}.compile: the {contract.arch.upper()} BF16 grouped wgrad kernel is not built in "
            f"this package yet ({where} is missing); use grouped_gemm_wgrad(), which falls back "
            "to torch on this device"
        )
    missing = env.cutlass_dsl_missing()
    if missing:
        raise RuntimeError(f"{who}.compile: {missing}")
    return p.launcher(contract)


_CACHE_LOCK = threading.RLock()
_LAUNCHERS: dict[WgradContract, Launcher] = {}


def load_launcher(contract: WgradContract, who: str) -> tuple[Launcher, str, str]:
    """``(launcher, backend, reason)`` of ``contract``: its launcher, compiled once per process
    (cached per static contract), the backend that runs (the contract's arch) and no reason."""
    with _CACHE_LOCK:
        launcher = _LAUNCHERS.get(contract)
        if launcher is None:
            launcher = compile_launcher(contract, who)
            _LAUNCHERS[contract] = launcher
    return launcher, contract.arch, ""


def clear_launcher_cache() -> None:
    """Forget the per-contract launchers (the families keep their compiled kernels)."""
    with _CACHE_LOCK:
        _LAUNCHERS.clear()


def launch(launcher: Launcher, contract: WgradContract, a, b, offsets, out, *, scales=None,
           stream=None, workspace=None) -> None:
    """One launch of a compiled BF16 contract (``scales`` is None for BF16). The SM100 kernel
    builds its per-expert TMA descriptors (discrete outputs, ``tensor_ragged`` K-major operands)
    in ``workspace``, or in one of its own when None."""
    del contract, scales
    launcher(a, b, offsets, out, stream=stream, descriptor_workspace=workspace)


def _twin_launcher(contract: WgradContract) -> Launcher:
    """The torch twin behind :data:`Launcher`'s signature (arch "torch": a device without a
    kernel). It writes a dense output (``grouped_gemm_wgrad`` gives it the stacked tensor)."""

    def launcher(a, b, offsets, out, stream=None, descriptor_workspace=None):
        del descriptor_workspace  # no descriptors
        cuda = stream is not None and a.device.type == "cuda"
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            grouped_wgrad_torch(
                a, b, offsets, out=out, accumulate=contract.accumulate,
                input_order=contract.input_order,
            )

    return launcher
