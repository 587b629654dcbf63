"""The persistent CuTe DSL kernel cache (:mod:`cuda_kernels.gemm.kernel_cache`): where it lives, and
an offline-compiled kernel stored in one process and loaded back instead of compiled."""

from __future__ import annotations

import pathlib

import pytest

from cuda_kernels.gemm import kernel_cache


def test_location_rules(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "moe-bwd" / "cute-dsl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernel_cache.cache_dir() == pathlib.Path.home() / ".cache" / "moe-bwd" / "cute-dsl"
    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path / "k"))
    assert kernel_cache.cache_dir() == tmp_path / "k"
    a = kernel_cache.entry_path("sm90", ("key", 1), "sm_90a")
    assert a.parent == tmp_path / "k" and a.name.startswith("sm90-") and a.suffix == ".o"
    assert a != kernel_cache.entry_path("sm90", ("key", 2), "sm_90a")
    assert a != kernel_cache.entry_path("sm90", ("key", 1), "sm_100a")
    monkeypatch.setenv(kernel_cache.ENV_VAR, "off")
    assert kernel_cache.cache_dir() is None
    assert kernel_cache.load_or_compile("sm90", 1, None, lambda: "compiled") == "compiled"


def test_offline_kernel_stored_then_loaded(monkeypatch, tmp_path, capsys):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (the cuda extra)")
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path))
    key = sm90.FAMILY.as_key(sm90.Sm90WgradKey(256, 256, 4))
    compiled = kernel_cache.load_or_compile("sm90", key, "sm_90a",
                                            lambda: sm90.FAMILY._compile(key, "sm_90a"))
    path = kernel_cache.entry_path("sm90", key, "sm_90a")
    assert path.is_file() and path.stat().st_size > 10_000
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind

    def must_not_compile():
        raise AssertionError("compiled although the cache holds the kernel")

    loaded = kernel_cache.load_or_compile("sm90", key, "sm_90a", must_not_compile)
    assert type(loaded).__name__ == "Function" and loaded is not compiled  # a tvm_ffi.Function
    assert kernel_cache.main([]) == 0 and "1 kernels" in capsys.readouterr().out
    assert kernel_cache.main(["--clear"]) == 0 and not path.exists()
    path.write_bytes(b"not an object file")  # a damaged entry: compiled again and replaced
    with pytest.warns(RuntimeWarning, match="did not load"):
        kernel_cache.load_or_compile("sm90", key, "sm_90a",
                                     lambda: sm90.FAMILY._compile(key, "sm_90a"))
    assert path.stat().st_size > 10_000
