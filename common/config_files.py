"""The one way the shipped YAML files (model shapes, tuned NKI configs, CUDA tiles) are found.

The repository keeps them in its top-level ``configs/`` folder (``models/``, ``nki/``, ``cuda/``);
an installed wheel carries them as package data of ``common``, in ``common/configs/``
(``pyproject.toml`` maps the folder there). ``configs`` is not an importable package, so neither
the current working directory nor another distribution named ``configs`` can change what is
read: the files are looked up only next to the ``common`` package that is imported,

1. in ``common/configs/`` (a wheel, through :func:`importlib.resources.files`), else
2. in ``configs/`` beside ``common/`` when that is a source checkout of this project (the folder
   above ``common`` holds ``pyproject.toml``): an editable install, or the repository root on
   ``sys.path`` (pytest's ``pythonpath``, ``PYTHONPATH=$PWD`` on a device machine).

:func:`config_path` locates a shipped file or folder, :func:`read_yaml` parses a shipped file and
:func:`load_yaml_file` parses any YAML file (every YAML the package reads goes through it).
"""

from __future__ import annotations

import functools
from importlib.resources import files
from pathlib import Path
from typing import Any

__all__ = ["config_path", "config_root", "load_yaml_file", "read_yaml"]


@functools.lru_cache(maxsize=1)
def config_root() -> Path:
    """The folder the shipped YAML files are read from (see the module docstring).

    Raises:
        FileNotFoundError: neither ``common/configs/`` (installed package data) nor a source
            checkout's ``configs/`` exists; the message names both places.
    """
    common_dir = Path(str(files("common")))
    installed = common_dir / "configs"
    if installed.is_dir():
        return installed
    checkout = common_dir.parent
    if _is_this_project(checkout) and (checkout / "configs").is_dir():
        return checkout / "configs"
    msg = (
        f"the shipped config files are missing: neither {installed} (package data of an "
        f"installed wheel) nor {checkout / 'configs'} (a source checkout) exists; reinstall "
        "moe-bwd-kernels (pip install moe-bwd-kernels, or pip install -e . in a checkout)"
    )
    raise FileNotFoundError(msg)


def _is_this_project(folder: Path) -> bool:
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return 'name = "moe-bwd-kernels"' in text


def config_path(*parts: str) -> Path:
    """The path of a shipped config file or folder, e.g. ``config_path("models")`` or
    ``config_path("cuda", "sm90_tiles.yaml")`` (parts relative to the repository's ``configs/``).

    Raises:
        ValueError: no parts, or a part that is not a plain name (empty, absolute, ``..``, or
            holding a path separator).
        FileNotFoundError: the config folder is missing (:func:`config_root`), or it holds no
            such file or folder (the message names the full path).
    """
    if not parts:
        raise ValueError("config_path: give at least one name, e.g. config_path('models')")
    for part in parts:
        if not isinstance(part, str) or part in ("", ".", "..") or "/" in part or "\\" in part:
            raise ValueError(
                f"config_path: each part must be a plain file or folder name, "
                f"got {part!r} in {parts!r}"
            )
    path = config_root().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"no shipped config {'/'.join(parts)!r}: {path} does not exist")
    return path


def load_yaml_file(path: str | Path) -> Any:
    """Parse one YAML file with ``yaml.safe_load`` (UTF-8): a shipped one or a caller's.

    Returns:
        The parsed document (None for an empty file).

    Raises:
        FileNotFoundError: no such file (other ``OSError`` for an unreadable one).
        ValueError: the text is not valid YAML; the message names the file.
    """
    import yaml

    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: cannot parse YAML: {exc}") from exc


def read_yaml(*parts: str) -> Any:
    """Parse a shipped YAML file, e.g. ``read_yaml("models", "qwen3-30b-a3b.yaml")``.

    Raises:
        ValueError: bad parts (:func:`config_path`) or invalid YAML (:func:`load_yaml_file`).
        FileNotFoundError: no such shipped file (:func:`config_path`).
    """
    return load_yaml_file(config_path(*parts))
