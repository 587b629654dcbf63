"""`moe-bwd` resources: the memory estimate's terms, progress lines, the thread default."""

from __future__ import annotations

import torch

from common import cli, dispatch
from common.inputs import make_problem_for_model
from common.models import load_model
from common.reference import reference_backward


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_memory_estimate_terms_match_a_small_problem():
    model = load_model("qwen3-30b-a3b").shrink(16)
    T = 32
    p = make_problem_for_model(model, T, seed=0, device="cpu")
    grads = dispatch.resolve_backend("torch", "cpu").run(p)
    ref = reference_backward(p)
    parts = cli._memory_parts(model, T)
    assert parts["weights"] == _nbytes(p.w_gate_up_EH2I, p.w_down_EIH)
    assert parts["grads"] == _nbytes(grads.w_gate_up_grad_EH2I, grads.w_down_grad_EIH)
    assert parts["reference"] == _nbytes(ref.w_gate_up_grad_EH2I, ref.w_down_grad_EIH)
    H, I = model.hidden, model.intermediate
    assert parts["expert_f64"] == 3 * 8 * H * I
    assert parts["rows"] == 16 * T * model.top_k * (H + 3 * I)
    assert cli._bytes_needed(model, T) == sum(parts.values())
    no_ref = cli._memory_parts(model, T, reference=False)
    assert no_ref["reference"] == no_ref["expert_f64"] == 0
    # the README's main job: "about 9 GiB"
    assert 8.5 < cli._bytes_needed(load_model("qwen3-30b-a3b"), 2048) / 2**30 < 9.5


def test_run_announces_the_comparison_on_stderr(capsys):
    rc = cli.main(["run", "--model", "qwen3-30b-a3b", "--shrink", "16", "--tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "[3/4] float64 reference backward" in err
    assert "[4/4] comparing every gradient with float64" in err


def test_compare_announces_its_steps_on_stderr(capsys):
    rc = cli.main(["compare", "torch", "--model", "qwen3-30b-a3b", "--shrink", "16",
                   "--tokens", "16", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    assert "[1/4] building the problem's inputs" in cap.err
    assert "[2/4] backward on torch" in cap.err
    assert "[3/4] float64 reference backward" in cap.err  # the baseline
    assert "[4/4] comparing with reference" in cap.err
    assert cap.out.lstrip().startswith("{")  # --json stays clean


def test_thread_default_honours_omp_num_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert cli.set_default_threads() is None
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        n = cli.set_default_threads()
        assert n == cli.physical_cores_available() >= 1
        assert torch.get_num_threads() == n
        monkeypatch.setenv("MKL_NUM_THREADS", "1")
        assert cli.set_default_threads() is None
    finally:
        torch.set_num_threads(before)
