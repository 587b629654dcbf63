"""Tests of common/dispatch.py: device detection, env override, explicit names, registry."""

from __future__ import annotations

import pytest
import torch

from common import dispatch
from common.dispatch import (
    BACKEND_NAMES,
    ENV_VAR,
    Backend,
    detect_backend,
    register_backend,
    registered_backends,
    resolve_backend,
    run_backward,
)
from common.inputs import make_problem
from common.metrics import sqnr_db, sqnr_floor

@pytest.fixture
def no_cuda(monkeypatch):
    """A host without CUDA, also on a GPU machine (the tests of CPU-only behaviour run everywhere
    instead of assuming that auto means torch; issue 8 item 2)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


needs_no_cuda = pytest.mark.usefixtures("no_cuda")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def small_problem():
    return make_problem(24, 16, 8, 3, 2, seed=3)


def test_names():
    assert BACKEND_NAMES == (
        "reference", "torch", "nki", "nki-sim", "nki-twin", "cuda-sm90", "cuda-sm100"
    )
    assert ENV_VAR == "MOE_BWD_BACKEND"
    reg = registered_backends()
    assert {"reference", "torch"} <= set(reg)
    for name in ("reference", "torch"):
        assert reg[name].name == name
        assert reg[name].check() is None


def test_detect_backend_by_device():
    assert detect_backend("cpu") == "torch"
    assert detect_backend(torch.device("meta")) == "torch"
    assert detect_backend(torch.device("xla")) == "nki"


@needs_no_cuda
def test_detect_backend_default_device_on_cpu_host():
    assert detect_backend() == "torch"
    assert detect_backend(None) == "torch"


@needs_no_cuda
def test_auto_on_cpu_is_torch():
    for req in ("auto", None):
        b = resolve_backend(req, "cpu")
        assert b.name == "torch"
        assert b.fallback_reason is None


def test_auto_falls_back_to_torch_with_reason(monkeypatch):
    # An xla device asks for nki; where nki cannot run, auto gives torch and says why.
    reason = dispatch._unavailable_reason("nki")
    b = resolve_backend("auto", torch.device("xla"))
    if reason is None:
        assert b.name == "nki"
    else:
        assert b.name == "torch"
        assert "nki" in b.fallback_reason and reason in b.fallback_reason


@pytest.mark.parametrize("name", ["reference", "torch"])
def test_env_override(monkeypatch, name):
    monkeypatch.setenv(ENV_VAR, name)
    assert resolve_backend("auto", "cpu").name == name
    assert resolve_backend(None, "cpu").name == name


def test_env_override_blank_is_ignored(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "   ")
    assert resolve_backend("auto", "cpu").name == detect_backend("cpu")


def test_explicit_name_beats_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_backend("torch", "cpu").name == "torch"


def test_env_unknown_name_is_value_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "tpu-magic")
    with pytest.raises(ValueError, match=r"'tpu-magic'.*MOE_BWD_BACKEND"):
        resolve_backend("auto", "cpu")


@pytest.mark.parametrize("name", ["cuda", "Torch", "nki_sim", "", "sm90"])
def test_explicit_unknown_name_is_value_error(name):
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend(name, "cpu")


@needs_no_cuda
@pytest.mark.parametrize("name", ["cuda-sm90", "cuda-sm100"])
def test_explicit_cuda_on_cpu_host_names_what_is_missing(name, monkeypatch):
    with pytest.raises(RuntimeError) as exc:
        resolve_backend(name, "cpu")
    msg = str(exc.value)
    assert name in msg and "cannot run" in msg
    assert "CUDA" in msg
    monkeypatch.setenv(ENV_VAR, name)
    with pytest.raises(RuntimeError, match=ENV_VAR):
        resolve_backend("auto", "cpu")


def test_explicit_nki_without_neuron_names_what_is_missing():
    reason = dispatch._unavailable_reason("nki")
    if reason is None:
        pytest.skip("the Neuron nki package is installed here")
    with pytest.raises(RuntimeError) as exc:
        resolve_backend("nki", "cpu")
    msg = str(exc.value)
    assert "'nki'" in msg and "cannot run" in msg and "nki" in reason
    assert reason in msg


def test_unregistered_plugin_backend_says_why(monkeypatch):
    # A built-in name whose plugin is absent must raise RuntimeError, not KeyError.
    monkeypatch.setattr(dispatch, "_REGISTRY", {k: v for k, v in dispatch._REGISTRY.items()
                                                if k != "cuda-sm100"})
    monkeypatch.setattr(dispatch, "_PLUGIN_ERRORS",
                        {"cuda_kernels.backend": "cuda_kernels.backend failed to import: X"})
    with pytest.raises(RuntimeError, match="failed to import"):
        resolve_backend("cuda-sm100", "cpu")


def test_register_backend_and_run(monkeypatch, small_problem):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    seen = []

    def run(problem, **opts):
        seen.append(opts)
        return dispatch._REGISTRY["reference"].run(problem)

    register_backend(Backend("my-test", "test backend", lambda: None, run))
    grads = run_backward(small_problem, "my-test", flag=7)
    assert seen == [{"flag": 7}]
    assert grads.info["backend"] == "my-test"
    register_backend(Backend("down", "never", lambda: "no widget attached", run))
    with pytest.raises(RuntimeError, match="no widget attached"):
        resolve_backend("down", "cpu")
    with pytest.raises(ValueError, match="Backend"):
        register_backend(Backend("", "empty", lambda: None, run))
    with pytest.raises(ValueError, match="Backend"):
        register_backend("torch")


def test_run_backward_reference_and_torch_agree(small_problem):
    ref = run_backward(small_problem, "reference")
    tor = run_backward(small_problem, "torch")
    assert ref.info["backend"] == "reference" and tor.info["backend"] == "torch"
    assert ref.hidden_states_grad_TH.dtype == torch.float64
    assert tor.hidden_states_grad_TH.dtype == torch.float32
    for k, want in ref.named().items():
        assert sqnr_db(tor.named()[k], want) >= sqnr_floor("torch", k), k


@needs_no_cuda
def test_run_backward_auto_on_cpu(small_problem, monkeypatch):
    grads = run_backward(small_problem)
    assert grads.info["backend"] == "torch"
    assert "fallback_reason" not in grads.info
    monkeypatch.setenv(ENV_VAR, "reference")
    assert run_backward(small_problem).info["backend"] == "reference"
