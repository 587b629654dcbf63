"""Host-side pieces shared by the SM90 and SM100 kernel families: the static-contract field
rules of their compile keys and the tile-rule YAML reader (the architecture pin of a compile is
``launch.pinned_cute_arch``). No CuTe DSL import at module level."""

from __future__ import annotations

import pathlib
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
