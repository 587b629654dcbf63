"""Trainium NKI blockwise MXFP8 MoE backward, runnable on CPU through our NKI interpreter.

Public names:

- :func:`blockwise_mm_bwd_mxfp8`: the kernel, with the signature of AWS's seed
  (``nkilib.experimental.moe_mxfp8.bwd``) plus ``accumulation_dtype``; imported lazily so that
  this package imports without the kernel module or the interpreter being loaded.
- :class:`MatmulMxfp8KernelConfig`, :class:`SkipMode`, :class:`ClampLimits`,
  :class:`ShardOption`, :class:`AffinityOption`, :class:`ActFnType`, :class:`QuantScheme`,
  :func:`default_phase_configs`, :func:`load_tuned_phase_configs` (:mod:`nki_kernels.config`).
- :func:`validate_blockwise_mm_bwd_args` (:mod:`nki_kernels.validation`).

Backends ``nki`` and ``nki-sim`` live in :mod:`nki_kernels.backend`, imported by
:mod:`common.dispatch` on demand. The training layer with the NKI backward's defaults,
``moe_expert_mlp``, is :mod:`common.nki_layer`'s (a backend imports no training layer).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from common._version import __version__ as __version__  # re-exported
from nki_kernels.config import (
    ActFnType,
    AffinityOption,
    ClampLimits,
    MatmulMxfp8KernelConfig,
    QuantScheme,
    ShardOption,
    SkipMode,
    default_phase_configs,
    load_tuned_phase_configs,
)
from nki_kernels.validation import validate_blockwise_mm_bwd_args

__all__ = [
    "ActFnType",
    "AffinityOption",
    "ClampLimits",
    "MatmulMxfp8KernelConfig",
    "QuantScheme",
    "ShardOption",
    "SkipMode",
    "blockwise_mm_bwd_mxfp8",
    "default_phase_configs",
    "load_tuned_phase_configs",
    "validate_blockwise_mm_bwd_args",
]

_LAZY = {
    "blockwise_mm_bwd_mxfp8": ("nki_kernels.blockwise_mm_bwd_mxfp8", "blockwise_mm_bwd_mxfp8"),
}


class _Package(types.ModuleType):
    """``nki_kernels.blockwise_mm_bwd_mxfp8`` names both the kernel module and its function.

    Importing the submodule makes Python ``setattr`` the module object on this package; this
    hook stores the function instead, so ``from nki_kernels import blockwise_mm_bwd_mxfp8`` is
    the kernel function whatever was imported first. For the module itself use
    ``importlib.import_module("nki_kernels.blockwise_mm_bwd_mxfp8")`` or ``from
    nki_kernels.blockwise_mm_bwd_mxfp8 import ...`` (``import nki_kernels.blockwise_mm_bwd_mxfp8
    as m`` gives the function).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "blockwise_mm_bwd_mxfp8" and isinstance(value, types.ModuleType):
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    # PEP 562 lazy attributes: the kernel loads on first use.
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nki_kernels' has no attribute {name!r}")
