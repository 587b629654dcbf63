"""Names a package exports without importing their modules until first use (PEP 562).

``__getattr__, __dir__ = lazy_exports(__name__, {"name": "package.module", ...}, globals())``
in a package's ``__init__``: ``package.name`` imports ``package.module`` on first access and
keeps the value in the package's namespace (resolved once). Used where a module's import is
heavy or optional (triton, JAX) and the package must stay cheap to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, table: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose ``namespace`` (its ``globals()``) gains
    each name of ``table`` (name -> module path) on first access. An unknown name is the usual
    AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value  # resolved once
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
