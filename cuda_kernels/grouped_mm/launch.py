"""Compile cache and offline compile of the varlen-M grouped GEMM family.

The wgrad family's layer (``grouped_wgrad/launch.py``, ``KernelFamily``) is shaped around the
wgrad's operands (A, B transposed, offsets, out, tile counter); this family's kernels take other
operands (a gathered source and its index, the epilogue's tensors), so it keeps its own small
cache and reuses only the wgrad layer's architecture pin of an offline compile
(``pinned_cute_arch``, ``cross_compile_kwargs``). No CuTe DSL import and no GPU query at import
time.
"""

from __future__ import annotations

import functools
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from ..grouped_wgrad.launch import cross_compile_kwargs, pinned_cute_arch

__all__ = ["GroupedMmFamily", "cute_dsl_missing", "num_sms"]


def cute_dsl_missing() -> str | None:
    """Why CuTe DSL cannot be used here, or None."""
    import importlib.util

    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl==4.8.1 is not installed (pip install '.[cuda]')"
    return None


class GroupedMmFamily:
    """A kernel family's host side: per-key compile cache, offline PTX compile.

    Args:
        name: names the family in messages and PTX dump directories.
        kernel: ``kernel(key)`` -> the CuTe DSL kernel object, called as
            ``kernel(*fake_operands(key), num_ctas, stream)``.
        fake_operands: ``key -> tuple`` of the kernel's tensor arguments for a compile.
        key_type: the key class (checked at every compile).
    """

    def __init__(
        self,
        name: str,
        kernel: Callable[[Any], Any],
        fake_operands: Callable[[Any], tuple],
        key_type: type,
    ) -> None:
        self.name = name
        self.kernel = kernel
        self.fake_operands = fake_operands
        self.key_type = key_type
        #: Real (uncached) compiles in this process.
        self.compile_count = 0
        self._compiled: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"GroupedMmFamily({self.name!r})"

    def _check(self, key: Any, who: str) -> None:
        if not isinstance(key, self.key_type):
            raise ValueError(f"{who}: want a {self.key_type.__name__}, got {key!r}")
        missing = cute_dsl_missing()
        if missing:
            raise RuntimeError(f"{who}: {missing}")

    def _compile(self, key: Any, arch: str | None, dump_dir: str | None = None):
        """``cute.compile`` of ``key``'s kernel on fake operands: for the present GPU when
        ``arch`` is None, else for ``arch`` with the DSL's arch pinned (PTX kept in
        ``dump_dir``)."""
        import cutlass
        from cutlass import cute

        kernel = self.kernel(key)
        args = tuple(self.fake_operands(key))
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        opts = "--enable-tvm-ffi"
        if arch is None:
            return cute.compile(kernel, *args, cutlass.Int32(1), stream, options=opts)
        opts += f" --gpu-arch {arch}"
        if dump_dir is not None:
            opts += f" --keep-ptx --dump-dir {dump_dir}"
        with pinned_cute_arch(arch):
            return cute.compile(
                kernel, *args, cutlass.Int32(1), stream, options=opts,
                **cross_compile_kwargs(arch),
            )

    def compiled(self, key: Any):
        """The compiled kernel of ``key`` for the present GPU, compiled once per process.

        Raises:
            ValueError: not a key of this family.
            RuntimeError: CuTe DSL is missing or the compile fails.
        """
        self._check(key, f"{self.name}.compiled")
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                fn = self._compile(key, None)
                self.compile_count += 1
                self._compiled[key] = fn
            return fn

    def offline_ptx(self, key: Any, arch: str = "sm_90a") -> str:
        """Compile ``key`` for ``arch`` without a GPU (nothing loaded); the PTX text.

        Raises:
            ValueError: not a key of this family.
            RuntimeError: CuTe DSL is missing or produced no PTX.
        """
        self._check(key, f"{self.name}.offline_ptx")
        with tempfile.TemporaryDirectory(prefix=f"{self.name}_ptx_") as tmp:
            ptx = self._compile(key, arch, dump_dir=tmp).__ptx__
        if not ptx:
            raise RuntimeError(f"CuTe DSL produced no PTX for {key} on {arch}")
        return ptx

    def cache_clear(self) -> None:
        """Forget the compiled kernels (tests)."""
        with self._lock:
            self._compiled.clear()


@functools.lru_cache(maxsize=16)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid: one CTA per SM)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
