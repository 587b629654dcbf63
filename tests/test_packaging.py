"""Packaging (issue 21 items 3 and 5): the shipped YAMLs are package data found in one way, the
current working directory never changes which YAML is read, one version for every package, and
the README's test command is the one `.ci/run` runs."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import common
import cuda_kernels
import nki_kernels
from common import config_files
from common.config_files import config_path, config_root, load_yaml_file, read_yaml
from common.models import load_model

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # CPython 3.11+
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------ the shipped YAMLs


def test_configs_is_data_not_a_package():
    """No __init__.py under configs/: `import configs` never finds ours, and a user's own
    `configs` package or PyPI's `configs` distribution cannot stand in for it."""
    assert not list((ROOT / "configs").rglob("__init__.py"))
    assert "configs" not in sys.modules


def test_setuptools_lists_every_package_and_maps_configs_into_common():
    """`packages` is an explicit list (find cannot map configs/ into common): it must name every
    folder with an __init__.py, and configs/ must install as common/configs/ with its YAMLs."""
    st = PYPROJECT["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("common", "cuda_kernels", "nki_kernels")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert set(st["packages"]) == found | {"common.configs"}
    assert st["package-dir"] == {"common.configs": "configs"}
    assert st["package-data"] == {"common.configs": ["**/*.yaml"]}


def test_every_shipped_yaml_is_found_through_config_path():
    shipped = sorted(p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*.yaml"))
    assert len(shipped) >= 12
    for rel in shipped:
        assert config_path(*rel.parts).read_bytes() == (ROOT / "configs" / rel).read_bytes()
    # from this source checkout (pytest's pythonpath): the repository's own configs/
    if Path(common.__file__).resolve().parent == ROOT / "common":
        assert config_root() == ROOT / "configs"


def test_readers_use_the_one_location():
    from cuda_kernels.gemm.tiles import SM90_TILES, SM100_TILES
    from nki_kernels.config import TUNED_CONFIG_DIR

    assert TUNED_CONFIG_DIR == config_path("nki")
    assert SM90_TILES.yaml == config_path("cuda", "sm90_tiles.yaml")
    assert SM100_TILES.yaml == config_path("cuda", "sm100_tiles.yaml")
    assert read_yaml("models", "qwen3-30b-a3b.yaml")["hidden"] == load_model("qwen3-30b-a3b").hidden


@pytest.mark.parametrize("parts", [(), ("..",), ("models/qwen3-30b-a3b.yaml",), ("",), ("/etc",)])
def test_config_path_refuses_what_is_not_a_plain_name(parts):
    with pytest.raises(ValueError, match="config_path"):
        config_path(*parts)


def test_config_path_and_load_yaml_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shipped config 'models/nope.yaml'"):
        config_path("models", "nope.yaml")
    with pytest.raises(FileNotFoundError):
        load_yaml_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.yaml: cannot parse YAML"):
        load_yaml_file(bad)
    (tmp_path / "empty.yaml").write_text("", encoding="utf-8")
    assert load_yaml_file(tmp_path / "empty.yaml") is None


def test_config_root_names_both_places_when_the_data_is_missing(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    monkeypatch.setattr(config_files, "files", lambda _pkg: tmp_path / "common")
    config_root.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match=r"common/configs \(package .*/configs \(a "):
            config_root()
    finally:
        config_root.cache_clear()


_PROBE = """
import json
from common.config_files import config_root
from common.models import load_model
from cuda_kernels.gemm.tiles import SM90_TILES
from nki_kernels.config import TUNED_CONFIG_DIR
s = load_model("qwen3-30b-a3b")
print(json.dumps({"shape": [s.hidden, s.intermediate, s.experts, s.top_k],
                  "paths": [str(config_root()), str(SM90_TILES.yaml), str(TUNED_CONFIG_DIR)]}))
"""


@pytest.mark.parametrize("as_package", [False, True], ids=["plain-folder", "configs-package"])
@pytest.mark.parametrize("how", ["script", "-c"])
def test_working_directory_cannot_change_the_yaml_read(tmp_path, as_package, how):
    """A script run from a folder with its own configs/ (the report of issue 21: load_model died
    with FileNotFoundError there) still reads the shipped YAMLs."""
    own = tmp_path / "configs"
    for sub in ("models", "nki", "cuda"):
        (own / sub).mkdir(parents=True)
    (own / "models" / "qwen3-30b-a3b.yaml").write_text(
        (ROOT / "configs" / "models" / "qwen3-30b-a3b.yaml")
        .read_text(encoding="utf-8")
        .replace("hidden: 2048", "hidden: 4096")
        .replace("experts: 128", "experts: 64"),
        encoding="utf-8",
    )
    if as_package:
        for folder in (own, own / "models", own / "nki", own / "cuda"):
            (folder / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "probe.py").write_text(_PROBE, encoding="utf-8")
    env = dict(os.environ)
    # the same `common` as this process (the checkout under pytest's pythonpath, or installed)
    env["PYTHONPATH"] = str(Path(common.__file__).resolve().parents[1])
    argv = [sys.executable, "probe.py"] if how == "script" else [sys.executable, "-c", _PROBE]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    s = load_model("qwen3-30b-a3b")
    assert out["shape"] == [s.hidden, s.intermediate, s.experts, s.top_k] == [2048, 768, 128, 8]
    assert out["paths"][0] == str(config_root())
    for path in out["paths"]:
        assert not Path(path).is_relative_to(tmp_path), path


# ------------------------------------------------------------------------------ the version


def test_one_version_for_every_package():
    """pyproject's version is read from common/_version.py; the packages re-export it."""
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "common._version.__version__"
    tree = ast.parse((ROOT / "common" / "_version.py").read_text(encoding="utf-8"))
    (literal,) = [n.value.value for n in tree.body if isinstance(n, ast.Assign)]
    assert re.fullmatch(r"\d+\.\d+\.\d+", literal)
    assert common.__version__ == nki_kernels.__version__ == cuda_kernels.__version__ == literal


def test_installed_metadata_agrees_when_installed_from_this_checkout():
    try:
        dist = metadata.distribution("moe-bwd-kernels")
    except metadata.PackageNotFoundError:
        pytest.skip("moe-bwd-kernels is not installed")
    origin = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    # an install from this checkout, or the egg-info an editable install leaves in it
    here = origin == ROOT.as_uri() or Path(str(dist.locate_file(""))).resolve() == ROOT
    if not here:
        pytest.skip(f"the moe-bwd-kernels found is not this checkout's ({origin or 'no url'})")
    assert dist.version == common.__version__


# --------------------------------------------------------------------- dependencies and CI


def test_runtime_requirements_are_ranges_and_ci_pins_them():
    """Runtime requirements are ranges; .ci/constraints.txt pins one tested version of each,
    inside its range (torch 2.13.0: the CPU wheel CI installs)."""
    from packaging.requirements import Requirement

    def key(name: str) -> str:
        return name.strip().lower().replace("_", "-")

    reqs = {key(Requirement(r).name): Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[key(name)] = version.strip()
    assert set(reqs) == {"torch", "numpy", "ml-dtypes", "pyyaml", "rich", "safetensors"}
    for name, req in reqs.items():
        assert not any(spec.operator == "==" for spec in req.specifier), req
        assert name in pins, f".ci/constraints.txt pins no {name}"
        assert req.specifier.contains(pins[name]), (name, pins[name], str(req.specifier))
    assert pins["torch"] == "2.13.0"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (ci_cmd,) = [ln for ln in ci.splitlines() if ln.startswith("python3 -m venv")]
    assert "-c .ci/constraints.txt" in ci_cmd
    assert f"```bash\n{ci_cmd}\n```" in readme
