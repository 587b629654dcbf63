"""ptxas lookup for the offline-compile tests: the first binary that assembles the PTX ISA version
the CuTe DSL emitted (a GPU machine's CUDA toolkit may be older than the DSL's PTX)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest


def ptxas_candidates() -> list[str]:
    """ptxas binaries to try, in order: PATH, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda, the
    ones Triton bundles (``ptxas-blackwell`` knows newer PTX ISAs than its plain ``ptxas``)."""
    found = [shutil.which("ptxas")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found.append(str(pathlib.Path(os.environ[env]) / "bin" / "ptxas"))
    found.append("/usr/local/cuda/bin/ptxas")
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        bin_dir = pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin"
        found += [str(bin_dir / "ptxas-blackwell"), str(bin_dir / "ptxas")]
    out = []
    for p in found:
        if p and os.path.isfile(p) and os.access(p, os.X_OK) and p not in out:
            out.append(p)
    return out


def ptxas_for(ptx: str, tmp_path, arch: str = "sm_100a") -> str:
    """A ptxas that assembles the PTX ISA version ``ptx`` declares for ``arch``, or skip saying
    which versions were tried (an older CUDA toolkit rejects a newer ``.version``)."""
    version = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
    assert version, "the PTX declares no .version"
    probe = tmp_path / "probe.ptx"
    probe.write_text(f".version {version.group(1)}\n.target {arch}\n.address_size 64\n")
    tried = []
    for exe in ptxas_candidates():
        res = subprocess.run(
            [exe, f"-arch={arch}", str(probe), "-o", str(tmp_path / "probe.cubin")],
            capture_output=True, text=True, timeout=60, check=False,
        )
        if res.returncode == 0:
            return exe
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
        tried.append(f"{exe} ({ver.stdout.strip().splitlines()[-1] if ver.stdout else '?'})")
    pytest.skip(
        f"no ptxas here assembles PTX ISA {version.group(1)} for {arch} (tried: "
        f"{'; '.join(tried) or 'none found'}); install a CUDA toolkit that knows it"
    )


def assemble_without_spills(ptx: str, tmp_path, arch: str, timeout: float = 300) -> str:
    """Assemble ``ptx`` for ``arch`` with ``ptxas -v`` into ``tmp_path / "k.cubin"``
    (:func:`ptxas_for`: skips without one that knows its PTX ISA; ``timeout`` in seconds) and
    assert it assembles with no register spills; returns ptxas's report (stderr)."""
    exe = ptxas_for(ptx, tmp_path, arch=arch)
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([exe, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr[-2000:]
    return res.stderr
