"""The package's layering, checked on the source (issue 21 item 4): an import contract that fails
on a new violation.

Layers (docs/ARCHITECTURE.md): ``common`` is the core and imports no backend (it reaches them
only by name, through ``common.dispatch``'s plugin table); the two backends ``nki_kernels`` and
``cuda_kernels`` import ``common`` but never each other; tests and benchmarks sit on top. Every
import counts, also those inside functions (a lazy import is still a dependency). Within
``cuda_kernels/grouped_wgrad`` the import circle that issue 21 item 1 removes is listed below as
known: the test fails when a new module joins a circle, and when a known edge disappears (so the
list shrinks with the code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "nki_kernels", "cuda_kernels")
FORBIDDEN = {
    "common": ("nki_kernels", "cuda_kernels"),
    "nki_kernels": ("cuda_kernels",),
    "cuda_kernels": ("nki_kernels",),
}
# Edges of today's import circles (2026-12-01). grouped_wgrad's (api / classes / dispatch /
# wrappers / jax) is what issue 21 item 1 removes; the NKI one is a lazy import inside a function
# of the interpreter's runtime (the kernel-facing shim `_nki` re-exports the interpreter).
_GW = "cuda_kernels.grouped_wgrad."
KNOWN_CYCLE_EDGES = {
    (_GW + "api", _GW + "classes"),
    (_GW + "api", _GW + "dispatch"),
    (_GW + "api", _GW + "wrappers"),
    (_GW + "classes", _GW + "dispatch"),
    (_GW + "dispatch", _GW + "classes"),
    (_GW + "dispatch", _GW + "wrappers"),
    (_GW + "jax", _GW + "api"),
    (_GW + "wrappers", _GW + "classes"),
    (_GW + "wrappers", _GW + "jax"),
    ("nki_kernels._nki", "nki_kernels.interp"),
    ("nki_kernels.interp", "nki_kernels.interp.runtime"),
    ("nki_kernels.interp.runtime", "nki_kernels._nki"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    mods = {_module_name(p): p for p in files}
    graph = {}
    for m, p in mods.items():
        # a module importing a package it lives in only names that package (Python imports it
        # anyway, before the module): not an edge of the graph
        graph[m] = {i for i in _imports(p) if i in mods and i != m and not m.startswith(i + ".")}
    return graph


GRAPH = _graph()


@pytest.mark.parametrize("package", PACKAGES)
def test_backends_and_core_import_only_down(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def _cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges a -> b where b reaches a again (edges on some import circle)."""
    reach = {}

    def reachable(start):
        if start not in reach:
            seen, stack = set(), [start]
            while stack:
                for nxt in graph.get(stack.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            reach[start] = seen
        return reach[start]

    return {(a, b) for a, outs in graph.items() for b in outs if a in reachable(b)}


def test_no_new_import_circles():
    cycles = _cycle_edges(GRAPH)
    new = sorted(cycles - KNOWN_CYCLE_EDGES)
    gone = sorted(KNOWN_CYCLE_EDGES - cycles)
    assert not new, "new import circle edges:\n" + "\n".join(f"{a} -> {b}" for a, b in new)
    assert not gone, (
        "these known circle edges are gone: remove them from KNOWN_CYCLE_EDGES:\n"
        + "\n".join(f"{a} -> {b}" for a, b in gone)
    )


def _private_imports() -> list[str]:
    """``from X import _name`` across modules of the packages (a name private to X used
    elsewhere), excluding the kernel-facing ``nki_kernels._nki`` shim module itself."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    for a in node.names:
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            out.append(f"{path.relative_to(ROOT)}: {node.module} {a.name}")
    return out


PRIVATE_IMPORTS_MAX = 79
"""Today's count (2026-12-01; issue 21 item 1 brings it down): a ratchet, lower it as it falls."""


def test_private_name_imports_do_not_grow():
    found = _private_imports()
    assert len(found) <= PRIVATE_IMPORTS_MAX, (
        f"{len(found)} imports of underscore names across modules (at most "
        f"{PRIVATE_IMPORTS_MAX}); share a named, documented function instead:\n" + "\n".join(found)
    )
