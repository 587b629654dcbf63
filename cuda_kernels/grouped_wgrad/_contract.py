"""Host-side pieces shared by the SM90 and SM100 kernel families: the static-contract field
rules of their compile keys, the tile-rule YAML reader and the CuTe DSL architecture pin of a
compile. No CuTe DSL import at module level."""

from __future__ import annotations

import contextlib
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

OUT_DTYPES = ("bfloat16", "float16", "float32")


def check_key_fields(key: Any) -> None:
    """Validate the fields every grouped-wgrad compile key shares (sizes, majors, dtype, modes).

    Raises:
        ValueError: naming ``<KeyClass>.<field>`` and the rule.
    """
    cls = type(key).__name__
    for name in ("hidden", "intermediate", "num_experts"):
        value = getattr(key, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{cls}.{name} must be a positive int, got {value!r}")
    if key.a_major not in ("k", "m"):
        raise ValueError(f"{cls}.a_major must be 'k' or 'm', got {key.a_major!r}")
    if key.b_major not in ("k", "n"):
        raise ValueError(f"{cls}.b_major must be 'k' or 'n', got {key.b_major!r}")
    if key.out_dtype not in OUT_DTYPES:
        raise ValueError(f"{cls}.out_dtype must be one of {OUT_DTYPES}, got {key.out_dtype!r}")
    if key.output_mode not in ("dense", "discrete"):
        raise ValueError(
            f"{cls}.output_mode must be 'dense' or 'discrete', got {key.output_mode!r}"
        )
    if key.input_order not in ("tensor2d", "tensor_ragged"):
        raise ValueError(
            f"{cls}.input_order must be 'tensor2d' or 'tensor_ragged', got {key.input_order!r}"
        )


def load_tile_rules(path: pathlib.Path, config_cls: type, arch: str) -> tuple:
    """Rules of a ``configs/cuda/*_tiles.yaml`` as ``(name, conditions, config)`` in file order.

    Raises:
        RuntimeError: the file is missing or malformed.
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
        rules = []
        for rule in data["rules"]:
            cond = {k: v for k, v in rule.items() if k not in ("name", "config")}
            rules.append((rule["name"], cond, config_cls(**rule["config"])))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read {arch} tile configs from {path}: {exc}") from exc
    return tuple(rules)


#: One CuTe DSL compile at a time may pin the DSL's architecture (it is process-global state).
_ARCH_PIN_LOCK = threading.RLock()


@contextlib.contextmanager
def pinned_cute_arch(arch: str) -> Iterator[None]:
    """Make CuTe DSL compile for ``arch`` (e.g. ``"sm_100a"``) whatever GPU is present; restore after.

    CuTe DSL takes the target of its arch checks (``BaseDSL.get_arch_enum``: tcgen05 / wgmma /
    TMA atoms built while tracing) from ``compile_options.gpu_arch`` and, where that is unset or
    read outside a compile, from ``envar.arch``: ``CUTE_DSL_ARCH`` or, without it, the compute
    capability of the GPU it finds (``sm_100`` when none). The execution-target check of the
    compile backend compares ``envar.arch`` with the compile target as well. An offline compile
    for another architecture than the present GPU's (``sm_100a`` on an H200) therefore pins
    ``envar.arch`` for the duration of the compile, besides passing ``--gpu-arch``; the previous
    value (including "not yet detected") is restored on exit, errors included. Pair it with
    :func:`cross_compile_kwargs` so that no JIT engine is built for a target the present GPU
    cannot run.
    """
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    with _ARCH_PIN_LOCK:
        saved = envar.__dict__.get("_arch", _MISSING)
        envar.arch = arch
        try:
            yield
        finally:
            if saved is _MISSING:
                del envar.arch
            else:
                envar._arch = saved


_MISSING = object()


def present_cuda_arch() -> str | None:
    """The CuTe DSL arch name of the current CUDA device (``"sm_90a"``, ``"sm_100a"``), or None
    without CUDA. A compile for another target builds no JIT engine (``cross_compile_kwargs``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def cross_compile_kwargs(arch: str) -> dict:
    """``cute.compile`` keywords for a compile targeting ``arch``: ``no_jit_engine=True`` unless
    the present GPU is that arch, so that a binary the present GPU cannot run (sm_100a on an
    H200, anything on a machine without GPU) is only compiled, never loaded."""
    return {} if present_cuda_arch() == arch else {"no_jit_engine": True}
