"""Compiled CuTe DSL kernels kept on disk, so that a new process loads them instead of compiling.

Why: CuTe DSL 4.8.1 has a file cache, but ``cute.compile`` never uses it
(``cutlass.base_dsl.compiler`` passes ``no_cache=True`` for every ``cute.compile`` call), so each
process compiled each kernel again: most of the 8.6 s of backend time of the GPU main job
(``moe-bwd run --model qwen3-30b-a3b --tokens 8192 --device cuda``, H200). What the DSL does
offer for ``--enable-tvm-ffi`` compiles is ``compiled.export_to_c(path.o, function_name=...)``
(the host launcher and the cubin in one object file) and
``cute.runtime.load_module(path.o, enable_tvm_ffi=True)``, which gives back a ``tvm_ffi.Function``
taking the same runtime arguments. :func:`load_or_compile` keeps those object files.

Where: ``$MOE_BWD_KERNEL_CACHE`` if set (``off`` disables the cache), else
``$XDG_CACHE_HOME/moe-bwd/cute-dsl``, else ``~/.cache/moe-bwd/cute-dsl``. Clear it with ``python -m
cuda_kernels.gemm --clear`` (or delete the directory); ``python -m
cuda_kernels.gemm`` prints where it is and what it holds.

What an entry's name covers: a sha256 of the family name, the kernel key's ``repr`` (its
tile included, so an edited ``configs/cuda/*_tiles.yaml`` row names another entry), the target
arch, the CuTe DSL and apache-tvm-ffi versions, torch's CUDA version, the ``CUTE_DSL_*``
environment settings and the text of every ``.py`` file of the engine (``cuda_kernels/gemm/``,
where every CuTe DSL kernel lives: an edited kernel or an upgraded DSL compiles anew). Entries
are written to a temporary file and renamed, so concurrent processes never read a partial one;
an entry that fails to load is compiled again and replaced. An entry is native code that the
process runs: keep the cache directory private to its user (the default under ``~/.cache``
is).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["ENV_VAR", "cache_dir", "entry_path", "load_or_compile"]

ENV_VAR = "MOE_BWD_KERNEL_CACHE"
_EXPORT_NAME = "moe_bwd_kernel"  # the symbol every entry exports (one kernel per file)


def cache_dir() -> pathlib.Path | None:
    """The cache directory (not created here), or None when ``MOE_BWD_KERNEL_CACHE=off``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return None if env.lower() == "off" else pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "moe-bwd" / "cute-dsl"


@functools.cache
def _build_fingerprint() -> str:
    """sha256 of what builds and loads an entry besides its key: the CuTe DSL and apache-tvm-ffi
    versions (the compiler and the loader's ABI), torch's CUDA version, the ``CUTE_DSL_*``
    settings of the environment, and every ``.py`` source of the engine (``cuda_kernels/gemm/``)."""
    import torch

    h = hashlib.sha256()
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            h.update(f"{dist} {importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"no {dist}".encode())
    h.update(f"cuda {torch.version.cuda}".encode())
    for name in sorted(k for k in os.environ if k.startswith("CUTE_DSL_")):
        h.update(f"{name}={os.environ[name]}".encode())
    root = pathlib.Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _present_arch() -> str:
    """The present GPU's arch (``sm_90a``, ``sm_100a``, ...), "none" without one: what a
    compile for "the present GPU" targets, so a cache shared by machines keeps them apart."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def entry_path(family: str, key: Any, arch: str | None) -> pathlib.Path | None:
    """The object file of ``key``'s kernel of ``family`` compiled for ``arch`` (None: the
    present GPU's), or None when the cache is off."""
    root = cache_dir()
    if root is None:
        return None
    arch = arch or _present_arch()
    h = hashlib.sha256("\0".join([family, repr(key), str(arch), _build_fingerprint()]).encode())
    return root / f"{family}-{h.hexdigest()[:32]}.o"


def load_or_compile(family: str, key: Any, arch: str | None, compile_fn: Callable[[], Any]):
    """``key``'s compiled kernel: loaded from the cache when an entry exists, else
    ``compile_fn()`` (a ``cute.compile(..., options="--enable-tvm-ffi ...")`` result), stored
    for the next process and returned as compiled.

    Args:
        family: the kernel family's name (part of the entry's name).
        key: the frozen compile key (its ``repr`` names the kernel).
        arch: the target arch, or None for the present GPU's.
        compile_fn: compiles the kernel when there is no usable entry.
    Returns:
        a callable taking the kernel's runtime arguments (a ``tvm_ffi.Function`` when loaded).
    Raises:
        what ``compile_fn`` raises. Cache I/O problems only warn (the compile result is used).
    """
    path = entry_path(family, key, arch)
    if path is not None and path.is_file():
        try:
            from cutlass import cute

            return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), _EXPORT_NAME)
        except Exception as exc:  # a damaged or foreign entry: compile anew, replace it
            warnings.warn(f"kernel cache entry {path} did not load ({exc}); compiling again",
                          RuntimeWarning, stacklevel=2)
    fn = compile_fn()
    if path is not None:
        _store(fn, path)
    return fn


def _store(fn: Any, path: pathlib.Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=path.parent)
        os.close(fd)
        try:
            fn.export_to_c(tmp, function_name=_EXPORT_NAME)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception as exc:  # read-only home, a full disk, a function that cannot export
        warnings.warn(f"kernel cache: could not store {path} ({exc})", RuntimeWarning,
                      stacklevel=3)


def main(argv: list[str] | None = None) -> int:
    """``python -m cuda_kernels.gemm [--clear]``: where the cache is, what it holds."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m cuda_kernels.gemm",
        description="Where the persistent CuTe DSL kernel cache is and what it holds.")
    parser.add_argument("--clear", action="store_true", help="delete every cached kernel")
    clear = parser.parse_args(argv).clear  # an unknown argument: usage error, exit 2
    root = cache_dir()
    if root is None:
        print(f"kernel cache off ({ENV_VAR}=off)")
        return 0
    files = sorted(root.glob("*.o")) if root.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    print(f"kernel cache: {root} ({len(files)} kernels, {size / 2**20:.1f} MiB)")
    if clear:
        for f in files:  # only the entries: the directory may be the user's own
            f.unlink(missing_ok=True)
        print(f"cleared {len(files)} kernels")
    return 0
