"""The package's layering, checked on the source (issue 21 item 4): an import contract that fails
on a new violation.

Layers (docs/ARCHITECTURE.md): ``common`` is the core and imports no backend (it reaches them
only by name, through ``common.dispatch``'s plugin table); the two backends ``nki_kernels`` and
``cuda_kernels`` import ``common`` but never each other; tests and benchmarks sit on top. Every
import counts, also those inside functions (a lazy import is still a dependency). The one import
circle left is listed below as known: the test fails when a new module joins a circle, and when a
known edge disappears (so the list shrinks with the code). ``cuda_kernels/grouped_wgrad`` has
none (issue 21 item 1 removed its api / classes / dispatch / wrappers / jax circle) and no
underscore-name import across its modules. Inside ``cuda_kernels`` the rooms (issue 31: backend,
MoE pipelines, public GEMM APIs, GEMM engine, Triton) import only along their arrows, the
pipelines only the APIs' public modules, no backend the training layer, and no module a private
name of another room.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "nki_kernels", "cuda_kernels")
FORBIDDEN = {
    "common": ("nki_kernels", "cuda_kernels"),
    "nki_kernels": ("cuda_kernels",),
    "cuda_kernels": ("nki_kernels",),
}
# Edges of today's import circles. The NKI one is a lazy import inside a function of the
# interpreter's runtime (the kernel-facing shim `_nki` re-exports the interpreter).
KNOWN_CYCLE_EDGES = {
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


#: The layers of ``cuda_kernels/grouped_wgrad`` (docs/ARCHITECTURE.md), lowest first: a module
#: imports only modules of lower rows. The kernel families live in the engine
#: (``cuda_kernels/gemm``, below: the formats reach them through its registry, by name); the JAX
#: entries sit above the facade. A new module gets a row here (a new format: beside ``bf16`` /
#: ``blockscaled``).
GW_LAYERS = [
    ("torch_ref", "jax_ref"),  # the twins
    ("_types",),  # contract types
    ("validate",),  # shared rules
    ("blockscaled_ref", "quantize"),
    ("bf16", "blockscaled", "jax_arrays"),  # one module per format; the JAX array bridge
    ("pipeline",),  # the one validation pipeline, the format choice, the compiled operator
    ("classes",),
    ("wrappers",),
    ("dispatch",),
    ("api",),  # the facade
    ("ops", "__init__", "jax_plan"),
    ("jax_ffi",),
    ("jax",),
]

#: The layers of the GEMM engine ``cuda_kernels/gemm`` (varlen-K and varlen-M kernel families,
#: per-arch folders), lowest first, the same rule. A module of a per-arch folder that no row
#: names is a family on top of the rest (:data:`ENGINE_FAMILY_ROW`: nothing imports a family,
#: the registry reaches it by name), so a new family needs no row here; a new shared piece of an
#: arch (a mainloop base, epilogue mixins) gets one.
ENGINE_LAYERS = [
    # tile rules, environment, key fields, the persistent kernel cache; the SM90 varlen-M
    # epilogue mixins
    ("tiles", "env", "keys", "kernel_cache", "__init__", "sm90", "sm100",
     "sm90.grouped_mm_epilogues"),
    # compile cache + launcher, the families' plug-in, what the SM90 kernels share, the BF16
    # kernels' tile scheduler
    ("launch", "registry", "sm90.common", "tile_sched"),
    ("sm90.wgrad_bf16", "sm100.wgrad_bf16", "sm90.grouped_mm"),  # families on the bases
    ("sm90.wgrad_mxfp8", "sm100.wgrad_blockscaled"),  # families on the BF16 families
    ("__main__",),  # python -m cuda_kernels.gemm: the kernel cache's command
]
ENGINE_FAMILY_ROW = len(ENGINE_LAYERS)

#: The API packages above the engine: the engine imports none of them.
ENGINE_CLIENTS = ("cuda_kernels.grouped_wgrad", "cuda_kernels.grouped_mm")


def _check_layers(pkg: str, rows: list[tuple[str, ...]], default=None) -> None:
    """``default(module) -> row | None``: the row of a module no row names."""
    layer = {}
    for i, row in enumerate(rows):
        for name in row:
            layer[pkg if name == "__init__" else f"{pkg}.{name}"] = i
    files = sorted((ROOT / pkg.replace(".", "/")).rglob("*.py"))
    for mod in (_module_name(p) for p in files if default is not None):
        if mod not in layer and default(mod) is not None:
            layer[mod] = default(mod)
    unplaced = [str(p.relative_to(ROOT)) for p in files if _module_name(p) not in layer]
    assert not unplaced, f"give these modules a row of the layers of {pkg}: {unplaced}"
    bad = [
        f"{mod} (row {layer[mod]}) imports {dep} (row {layer[dep]})"
        for mod in layer
        for dep in GRAPH.get(mod, ())
        if dep in layer and layer[dep] >= layer[mod]
    ]
    assert not bad, f"{pkg} layering broken:\n" + "\n".join(sorted(bad))


def test_grouped_wgrad_imports_only_lower_layers():
    _check_layers("cuda_kernels.grouped_wgrad", GW_LAYERS)


def test_engine_imports_only_lower_layers_and_no_api_package():
    arch_folder = re.compile(r"cuda_kernels\.gemm\.sm\d+\.\w+$")
    _check_layers("cuda_kernels.gemm", ENGINE_LAYERS,
                  default=lambda m: ENGINE_FAMILY_ROW if arch_folder.match(m) else None)
    up = [
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if mod.startswith("cuda_kernels.gemm")
        for dep in deps
        if dep.startswith(ENGINE_CLIENTS)
    ]
    assert not up, "the engine imports an API package:\n" + "\n".join(sorted(up))


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


PRIVATE_IMPORTS_MAX = 5
"""Today's count (79 before issue 21 item 1, 6 after, 5 after issue 31: none in cuda_kernels): a
ratchet, lower it as it falls."""


def test_private_name_imports_do_not_grow():
    found = _private_imports()
    assert len(found) <= PRIVATE_IMPORTS_MAX, (
        f"{len(found)} imports of underscore names across modules (at most "
        f"{PRIVATE_IMPORTS_MAX}); share a named, documented function instead:\n" + "\n".join(found)
    )


# ------------------------------------------------------------------- the rooms of cuda_kernels
#: The rooms of ``cuda_kernels`` (docs/ARCHITECTURE.md, issue 31), by module prefix (the longest
#: prefix wins); every module of the package belongs to one. ``cuda_kernels.gemm`` is the GEMM
#: engine room once it exists (today the engine lives inside ``grouped_wgrad``, an API package).
ROOMS = {
    "backend": ("cuda_kernels.backend",),
    "pipelines": ("cuda_kernels.moe",),
    "api": ("cuda_kernels", "cuda_kernels.grouped_mm", "cuda_kernels.grouped_wgrad"),
    "engine": ("cuda_kernels.gemm",),
    "triton": ("cuda_kernels.triton",),
}
#: The arrows: backend -> pipelines -> public APIs -> {engine, Triton} -> common core. A room
#: imports its own modules, the rooms listed here and ``common`` (the core), nothing else.
ARROWS = {
    "backend": ("pipelines", "api", "engine"),  # the engine: kernel availability (registry)
    "pipelines": ("api", "triton"),
    "api": ("engine", "triton"),
    "engine": (),
    "triton": (),
}
#: What a sibling room may share: the Triton launcher (an engine's Triton kernel uses it too).
SHARED = ("cuda_kernels.triton.launch",)
#: The API packages' public modules: all the pipelines may import of them.
API_PUBLIC = ("cuda_kernels.grouped_mm", "cuda_kernels.grouped_wgrad",
              "cuda_kernels.grouped_wgrad.api")
#: The training layer: above every backend (a backend reaches none of it).
TRAINING_LAYER = ("common.layer", "common.layer_ops", "common.nki_layer", "common.expert_parallel",
                  "common.integrations", "common.cli")


def _room(module: str) -> str | None:
    """The cuda_kernels room of ``module`` (None outside cuda_kernels)."""
    best, room = -1, None
    for name, prefixes in ROOMS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, room = len(p), name
    return room


def _owner(module: str) -> str:
    """A room of cuda_kernels, else the top-level package (``common``, ``nki_kernels``)."""
    return _room(module) or module.split(".")[0]


def test_every_cuda_module_has_a_room():
    cuda = [m for m in GRAPH if m.split(".")[0] == "cuda_kernels"]
    assert cuda and all(_room(m) for m in cuda), [m for m in cuda if not _room(m)]
    assert _room("cuda_kernels.gemm.sm90.mainloop") == "engine"  # the engine room, once it exists
    assert _room("cuda_kernels.moe.backward") == "pipelines"
    assert _room("cuda_kernels.grouped_wgrad.registry") == "api"


def test_cuda_rooms_import_along_the_arrows():
    bad = []
    for mod, deps in GRAPH.items():
        room = _room(mod)
        if room is None:
            continue
        for dep in deps:
            to = _room(dep)
            if to in (None, room) or to in ARROWS[room] or dep in SHARED:
                continue
            bad.append(f"{mod} ({room}) imports {dep} ({to})")
    assert not bad, "import against the rooms' arrows:\n" + "\n".join(sorted(bad))


def test_pipelines_import_only_the_public_api_modules():
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if _room(mod) == "pipelines"
        for dep in deps
        if _room(dep) == "api" and dep not in API_PUBLIC
    ]
    assert not bad, "the pipelines reach into an API package:\n" + "\n".join(sorted(bad))


def test_no_backend_imports_the_training_layer():
    bad = [
        f"{mod} imports {name}"
        for pkg in ("nki_kernels", "cuda_kernels")
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for mod in [_module_name(path)]
        for name in _imports(path)
        if any(name == t or name.startswith(t + ".") for t in TRAINING_LAYER)
    ]
    assert not bad, "a backend imports the training layer:\n" + "\n".join(sorted(bad))


def _private(module: str, names) -> list[str]:
    """The private (underscore, not dunder) parts of ``from module import names``."""
    parts = [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
    return parts + [n for n in names if n.startswith("_") and not n.startswith("__")]


def test_no_private_name_import_across_rooms():
    """``from X import _name`` (or a ``_module`` on the way) where X is in another room (a room
    of cuda_kernels, or ``common`` / ``nki_kernels``); ``common._version`` is the version
    string every package re-exports."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = _module_name(path)
            package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)]
                    src = ".".join(base + [node.module or ""]) if node.level else node.module
                    src = src.strip(".")
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    src, names = None, [a.name for a in node.names]
                else:
                    continue
                for s, ns in ([(src, names)] if src else [(n, []) for n in names]):
                    if s == "common._version" or _owner(s) == _owner(mod):
                        continue
                    if s.split(".")[0] not in PACKAGES:
                        continue
                    hidden = _private(s, ns)
                    if hidden:
                        bad.append(f"{path.relative_to(ROOT)}: {s} {hidden}")
    assert not bad, "private names imported across rooms:\n" + "\n".join(sorted(bad))
