"""Compile cache and launch of the grouped-wgrad API: a static contract's kernel key, the check that
a contract fits its kernel's tiling, and the per-process launcher cache keyed on the contract.
The kernel modules are imported inside the functions (never at import time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import _env
from ._types import WgradContract


def _sm90_key(contract: WgradContract):
    """The ``sm90_bf16.Sm90WgradKey`` of ``contract`` (tile from ``configs/cuda`` unless given).

    Imports ``sm90_bf16``, which imports CuTe DSL only inside its compile functions.

    Raises:
        ValueError: no tile fits hidden/intermediate (the SM90 kernel writes whole output tiles:
            hidden and intermediate must be multiples of the tile, 64 at least).
    """
    from . import sm90_bf16

    try:
        tile = sm90_bf16.select_sm90_tile_config(
            contract.hidden,
            contract.intermediate,
            contract.num_experts,
            mma_tiler_mn=contract.mma_tiler_mn,
        )
        return sm90_bf16.Sm90WgradKey(
            hidden=contract.hidden,
            intermediate=contract.intermediate,
            num_experts=contract.num_experts,
            a_major=contract.a_major,
            b_major=contract.b_major,
            out_dtype=contract.out_dtype,
            output_mode=contract.output_mode,
            accumulate=contract.accumulate,
            input_order=contract.input_order,
            tile=tile,
        )
    except ValueError as exc:
        raise ValueError(
            f"mma_tiler_mn={contract.mma_tiler_mn}: unsupported SM90 tiling for hidden="
            f"{contract.hidden}, intermediate={contract.intermediate}: {exc}"
        ) from exc


def _compile_sm90_kernel(contract: WgradContract) -> Callable:
    """Compile (or fetch from the kernel module's cache) the SM90 launcher for ``contract``."""
    missing = _env.cutlass_dsl_missing()
    if missing:
        raise RuntimeError(f"GroupedGemmWgradSm90.compile: {missing}")
    from . import sm90_bf16

    return sm90_bf16.compile_sm90_wgrad(_sm90_key(contract))


def _check_contract_fits(contract: WgradContract) -> None:
    """Arch-specific shape rules that need the whole static contract (unsupported tiling)."""
    if contract.arch == "sm90":
        _sm90_key(contract)
    elif contract.arch == "sm100":
        module = _env.sm100_module()
        if module is not None and hasattr(module, "sm100_key_from_contract"):
            try:
                module.sm100_key_from_contract(contract)
            except ValueError as exc:
                raise ValueError(
                    f"mma_tiler_mn={contract.mma_tiler_mn}: unsupported SM100 tiling for hidden="
                    f"{contract.hidden}, intermediate={contract.intermediate}: {exc}"
                ) from exc


def _compile_sm100_kernel(contract: WgradContract) -> Callable:
    """Compile the SM100 launcher (raises when ``sm100_bf16`` cannot be imported)."""
    module = _env.sm100_module()
    if module is None or not hasattr(module, "compile_sm100_wgrad"):
        raise RuntimeError(
            "GroupedGemmWgradSm100.compile: the SM100 BF16 grouped wgrad kernel is not built in "
            "this package yet (cuda_kernels.grouped_wgrad.sm100_bf16 is missing); use "
            "grouped_gemm_wgrad(), which falls back to torch on this device"
        )
    missing = _env.cutlass_dsl_missing()
    if missing:
        raise RuntimeError(f"GroupedGemmWgradSm100.compile: {missing}")
    return module.compile_sm100_wgrad(contract)


def _compile_kernel(contract: WgradContract) -> Callable:
    """Launcher for ``contract``, compiled once per process (cache keyed on the static contract)."""
    with _CACHE_LOCK:
        launcher = _LAUNCHER_CACHE.get(contract)
        if launcher is None:
            compiler = _compile_sm90_kernel if contract.arch == "sm90" else _compile_sm100_kernel
            launcher = compiler(contract)
            _LAUNCHER_CACHE[contract] = launcher
        return launcher


_CACHE_LOCK = threading.RLock()
_LAUNCHER_CACHE: dict[WgradContract, Callable] = {}


def clear_launcher_cache() -> None:
    with _CACHE_LOCK:
        _LAUNCHER_CACHE.clear()
