"""``nki_kernels._nki`` takes ``nki`` as AWS's NKI only when it has the real API (issue 11, item 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _probe(tmp_path: Path) -> str:
    code = textwrap.dedent(
        """
        import nki_kernels._nki as m
        from nki_kernels import interp
        print(m.HAVE_REAL_NKI, m.nki is interp, m.nl is interp.language)
        print(m.REAL_NKI_PROBLEM)
        """
    )
    env_path = f"{tmp_path}:{REPO}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, cwd=REPO,
                         check=True)
    return out.stdout


def _package(tmp_path: Path, init: str, isa: str = "", language: str = "") -> None:
    pkg = tmp_path / "nki"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init)
    if isa:
        (pkg / "isa.py").write_text(isa)
    if language:
        (pkg / "language.py").write_text(language)


def test_placeholder_package_leaves_the_interpreter_in_charge(tmp_path):
    _package(tmp_path, "# placeholder\n")
    out = _probe(tmp_path)
    assert out.splitlines()[0] == "False True True", out
    assert "nki.isa" in out or "lacks" in out or "import failed" in out, out


def test_partial_api_or_old_version_is_not_real(tmp_path):
    full_isa = "".join(f"def {n}(*a, **k): pass\n" for n in (
        "nc_matmul_mx", "quantize_mx", "dma_copy", "tensor_scalar", "register_load"))
    full_nl = ("class NKIObject: pass\n" + "".join(
        f"def {n}(*a, **k): pass\n" for n in ("ndarray", "fori_loop", "program_id"))
        + "shared_hbm = 'shared_hbm'\n")
    # the API without nc_matmul_mx
    _package(tmp_path, "def jit(f=None, **k): return f\n__version__ = '0.6.0'\n",
             isa=full_isa.replace("nc_matmul_mx", "nc_matmul"), language=full_nl)
    out = _probe(tmp_path)
    assert out.startswith("False True True") and "nc_matmul_mx" in out, out
    # the whole surface but an old version
    (tmp_path / "nki" / "isa.py").write_text(full_isa)
    (tmp_path / "nki" / "__init__.py").write_text("def jit(f=None, **k): return f\n"
                                                  "__version__ = '0.5.2'\n")
    out = _probe(tmp_path)
    assert out.startswith("False True True") and "0.5.2" in out, out


def test_full_surface_and_version_counts_as_real(tmp_path):
    full_isa = "".join(f"def {n}(*a, **k): pass\n" for n in (
        "nc_matmul_mx", "quantize_mx", "dma_copy", "tensor_scalar", "register_load"))
    full_nl = ("class NKIObject: pass\n" + "".join(
        f"def {n}(*a, **k): pass\n" for n in ("ndarray", "fori_loop", "program_id"))
        + "shared_hbm = 'shared_hbm'\n")
    _package(tmp_path, "def jit(f=None, **k): return f\n__version__ = '0.6.1'\n",
             isa=full_isa, language=full_nl)
    code = ("import nki_kernels._nki as m; print(m.HAVE_REAL_NKI, m.REAL_NKI_PROBLEM)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
                         cwd=REPO, check=True).stdout
    assert out.strip() == "True None", out


def test_this_machine_runs_the_interpreter():
    import nki_kernels._nki as m

    assert not m.HAVE_REAL_NKI and m.REAL_NKI_PROBLEM
