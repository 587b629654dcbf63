"""Tests of the ``moe-bwd`` command line (common/cli.py), called in-process through ``main``."""

from __future__ import annotations

import re

import pytest
import torch

from common import cli
from common.metrics import SQNR_MIN_DB
from common.models import load_model, model_names

ALL_MODELS = [
    "deepseek-v3", "gpt-oss-120b", "gpt-oss-20b", "kimi-k2", "llama-4-scout", "mixtral-8x7b",
    "olmoe-1b-7b", "qwen3-235b-a22b", "qwen3-30b-a3b",
]


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich reads it: no wrapped table cells
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)
    # These tests read the torch backend's table: pin "auto" to the CPU whether or not a GPU is
    # present (the CLI's default device is cuda when torch sees one; issue 8 item 2).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def small_models(monkeypatch):
    """load_model as the CLI sees it, shrunk to H = I = 128 (same E, top_k, router, biases)."""

    def small(name):
        return load_model(name).scaled(hidden=128, intermediate=128)

    monkeypatch.setattr(cli, "load_model", small)


def _table_rows(out: str) -> dict[str, list[str]]:
    """gradient name -> cells of its row in the printed table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and re.match(r"^d[A-Z]", cells[0]) and len(cells) == 4:
            rows[cells[0]] = cells[1:]
    return rows


def test_models_lists_all_nine(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert sorted(model_names()) == ALL_MODELS
    for name in ALL_MODELS:
        assert re.search(rf"\b{re.escape(name)}\b", out), name
    # the numbers of one model are in its row
    row = next(line for line in out.splitlines() if "qwen3-30b-a3b" in line)
    for v in ("2048", "768", "128", "8"):
        assert re.search(rf"\b{v}\b", row), (v, row)


@pytest.mark.parametrize(
    "model,bias", [("olmoe-1b-7b", False), ("gpt-oss-20b", True)]
)
def test_run_prints_gradient_table(capsys, small_models, model, bias):
    rc = cli.main(["run", "--model", model, "--tokens", "64", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    m = load_model(model)
    assert f"T=64 H=128 I=128 E={m.experts} top_k={m.top_k}" in out
    assert "backend=torch" in out
    rows = _table_rows(out)
    want = ["dX [T,H]", "dA [T,E]", "dW_gate_up [E,H,2,I]", "dW_down [E,I,H]"]
    if bias:
        want += ["dB_gate_up [E,2,I]", "dB_down [E,H]"]
    assert list(rows) == want
    E = m.experts
    shapes = {
        "dX [T,H]": "64x128", "dA [T,E]": f"64x{E}", "dW_gate_up [E,H,2,I]": f"{E}x128x2x128",
        "dW_down [E,I,H]": f"{E}x128x128", "dB_gate_up [E,2,I]": f"{E}x2x128",
        "dB_down [E,H]": f"{E}x128",
    }
    for name, (shape, sqnr, rel) in rows.items():
        assert shape == shapes[name]
        assert float(sqnr) >= SQNR_MIN_DB[("torch", "default")], (name, sqnr)
        assert 0.0 <= float(rel) < 0.05, (name, rel)
    assert re.search(r"wall time: .*backend [0-9.]+ s", out)


def test_run_reference_backend_is_exact(capsys, small_models):
    rc = cli.main(["run", "--model", "qwen3-30b-a3b", "--tokens", "16", "--backend", "reference"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "backend=reference" in out
    rows = _table_rows(out)
    assert len(rows) == 4
    for _, sqnr, rel in rows.values():
        assert sqnr == "inf" and float(rel) == 0.0


@pytest.mark.parametrize("json_out", [False, True])
def test_run_nan_gradient_exits_1(capsys, small_models, monkeypatch, json_out):
    """A backend whose gradient holds NaN: exit 1 and the gradient marked, with the float64
    comparison (its SQNR is NaN) as without it."""
    import dataclasses

    from common import dispatch

    torch_backend = dispatch.resolve_backend("torch")

    def run_nan(problem, **options):
        grads = torch_backend.run(problem, **options)
        grads.w_down_grad_EIH.view(-1)[7] = float("nan")
        return grads

    nan_backend = dataclasses.replace(torch_backend, run=run_nan)
    monkeypatch.setattr(cli.dispatch, "resolve_backend", lambda *a, **k: nan_backend)
    for extra in ([], ["--no-reference"]):
        args = ["run", "--model", "olmoe-1b-7b", "--tokens", "16", *extra]
        rc = cli.main(args + (["--json"] if json_out else []))
        cap = capsys.readouterr()
        assert rc == 1, (extra, cap.out)
        if json_out:
            import json

            rows = {r["gradient"]: r for r in json.loads(cap.out)["gradients"]}
            assert not rows["dW_down [E,I,H]"]["finite"]
            assert all(r["finite"] for n, r in rows.items() if n != "dW_down [E,I,H]")
        else:
            assert "a gradient holds NaN or inf" in cap.err
            row = _table_rows(cap.out)["dW_down [E,I,H]"]
            assert row[1] == "nan" if not extra else row[2] == "NO", row


def test_run_bad_model_exits_2(capsys):
    rc = cli.main(["run", "--model", "no-such-model", "--tokens", "64"])
    cap = capsys.readouterr()
    assert rc == 2
    assert "error" in cap.err and "no-such-model" in cap.err and "qwen3-30b-a3b" in cap.err
    assert cap.out == ""  # errors go to stderr


def test_run_bad_tokens_exits_2(capsys, small_models):
    assert cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["run", "--model", "olmoe-1b-7b", "--tokens", "8"],
    ["compare", "torch", "reference", "--model", "olmoe-1b-7b", "--tokens", "8"],
])
def test_meta_device_exits_2_before_any_work(command, capsys, small_models):
    assert cli.main([*command, "--device", "meta"]) == 2
    assert "--device 'meta' holds no data" in capsys.readouterr().err


def test_run_bad_backend_exits_2(capsys, small_models):
    assert cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "8", "--backend", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_backend_refuses_shape_before_inputs(capsys, monkeypatch):
    """nki-sim needs H, I multiples of 128: gpt-oss-20b (H = I = 2880) fails at once."""
    import common.inputs

    def never(*a, **k):
        raise AssertionError("inputs were built")

    monkeypatch.setattr(common.inputs, "make_problem_for_model", never)
    rc = cli.main(["run", "--model", "gpt-oss-20b", "--tokens", "8", "--backend", "nki-sim"])
    err = capsys.readouterr().err
    assert rc == 2 and "H=2880 and I=2880 must be multiples of 128" in err, err
    assert "--shrink N rounds H and I to multiples of 128" in err  # the CLI's own advice


def test_run_shrunk_header_json_no_reference(capsys):
    rc = cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "16", "--shrink", "16"])
    out = capsys.readouterr().out
    assert rc == 0 and "shrunk: H, I divided by 16 and rounded" in out
    assert "I 1024/16 = 64 -> 128" in out
    assert re.search(r"wall time: inputs [0-9.]+ s, backend .* float64 reference [0-9.]+ s, "
                     r"comparison [0-9.]+ s; total [0-9.]+ s", out), out
    rc = cli.main(["run", "--model", "olmoe-1b-7b", "--tokens", "16", "--shrink", "16",
                   "--no-reference", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    import json

    res = json.loads(cap.out)
    assert res["shrink"] == 16 and res["dims"]["H"] == 128 and res["backend"] == "torch"
    assert "reference" not in res["wall_s"] and res["wall_s"]["backend"] > 0
    assert [r["gradient"] for r in res["gradients"]][:2] == ["dX [T,H]", "dA [T,E]"]
    assert all(r["finite"] and "sqnr_db" not in r for r in res["gradients"])
    # progress: plain numbered lines on stderr when stdout is not a terminal
    assert "[1/2] building inputs" in cap.err and "[2/2] backward on torch" in cap.err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert re.match(r"moe-bwd \S+", capsys.readouterr().out)


def test_missing_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--model", "olmoe-1b-7b"])
    assert exc.value.code == 2
    assert "--tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_backends_lists_all(capsys):
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "torch", "nki", "nki-sim", "cuda-sm90", "cuda-sm100"):
        assert re.search(rf"\b{re.escape(name)}\b", out), name


def test_shrink_banner_states_rounding(capsys, monkeypatch):
    """Issue: the banner said "divided by 8" but printed 384 for 2880/8 = 360."""
    full = load_model("gpt-oss-20b")
    note = cli.shrink_note(full, full.shrink(8), 8)
    assert note == ("H, I divided by 8 and rounded to the nearest multiple of 128 (at least 128): "
                    "H 2880/8 = 360 -> 384, I 2880/8 = 360 -> 384")
    olmoe = load_model("olmoe-1b-7b")  # H 2048 / 16 = 128 exact; I 1024 / 16 = 64 -> 128
    assert cli.shrink_note(olmoe, olmoe.shrink(16), 16) == (
        "H, I divided by 16 and rounded to the nearest multiple of 128 (at least 128): "
        "H 2048 -> 128, I 1024/16 = 64 -> 128")
    q = load_model("qwen3-235b-a22b")
    qs = q.scaled(hidden=q.hidden // 2, intermediate=q.intermediate // 2)
    assert cli.shrink_note(q, qs, 2) == (
        f"H, I divided by 2: H {q.hidden} -> {q.hidden // 2}, "
        f"I {q.intermediate} -> {q.intermediate // 2}")


def test_run_shrink_one_matches_api(capsys, monkeypatch):
    """--shrink 1 and load_model(..).shrink(1) agree: both keep the full H = I = 2880."""
    import common.inputs

    m = load_model("gpt-oss-20b")
    assert (m.shrink(1).hidden, m.shrink(1).intermediate) == (2880, 2880)
    seen = []

    def capture(model, *a, **k):
        seen.append(model)
        raise ValueError("stop here")

    monkeypatch.setattr(common.inputs, "make_problem_for_model", capture)
    monkeypatch.setattr(cli, "_memory_available", lambda device: None)
    for extra in ([], ["--shrink", "1"]):
        rc = cli.main(["run", "--model", "gpt-oss-20b", "--tokens", "4", "--backend", "torch",
                       *extra])
        assert rc == 2 and "stop here" in capsys.readouterr().err
    assert [(s.hidden, s.intermediate) for s in seen] == [(2880, 2880)] * 2


def test_run_help_defaults_description_and_usage(capsys, monkeypatch):
    """run --help: no "(default: None)" on required --model, --device's default once, a
    description; a missing --tokens prints the `run` usage, not the top-level one."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "(default: None)" not in flat and "(default: False)" not in flat
    assert flat.count("(default: cuda if present, else cpu)") == 1
    assert "Run one MoE layer's backward" in flat
    assert "--seed SEED seed of weights, inputs and router (default: 0)" in flat
    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in flat and "(default: reference)" in flat
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--model", "olmoe-1b-7b"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: moe-bwd run" in err and "moe-bwd run: error:" in err
    assert "--tokens (or --routing FILE)" in err


def _console80():
    import io

    from rich.console import Console

    return Console(width=80, file=io.StringIO(), color_system=None, highlight=False)


def test_models_table_fits_80_columns():
    """At 80 columns the activation column is not cut: swiglu vs swiglu_clamped stay apart."""
    con = _console80()
    assert cli._cmd_models(None, con) == 0
    out = con.file.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for m in (load_model(n) for n in model_names()):
        row = rows[m.name]
        assert m.activation in row and m.router in row, row
        assert str(m.hidden) in row and str(m.intermediate) in row and str(m.top_k) in row
    assert "swiglu_clamped" in rows["gpt-oss-20b"] and "swiglu" in rows["qwen3-30b-a3b"]


def test_compare_table_fits_80_columns():
    """At 80 columns max|err|, bit-identical and per-expert SQNR are printed in full."""
    hist = {"0": 5, "1": 3, "2": 2}
    m = {"sqnr_db": 123.4, "max_rel_err": 1.234e-05, "cosine": 0.999999, "bit_identical": 0.5,
         "ulp_hist": hist, "per_expert": {"min": -12.3, "median": 101.2, "max": 145.6}}
    pair = {name: dict(m) for name in ("hidden_states_grad_TH", "affinity_grad_TE",
                                       "w_gate_up_grad_EH2I", "w_down_grad_EIH",
                                       "b_gate_up_grad_E2I", "b_down_grad_EH")}
    del pair["hidden_states_grad_TH"]["per_expert"]
    comparison = {"baseline": "reference", "pairs": {"nki-twin": pair},
                  "spec": {"model": "gpt-oss-20b", "shrink": 1, "tokens": 8, "hidden": 2880,
                           "intermediate": 2880, "experts": 32, "top_k": 4}}
    con = _console80()
    cli._print_comparison(con, comparison)
    out = con.file.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    for label in ("dX", "dA", "dW_gate_up", "dW_down", "dB_gate_up", "dB_down"):
        line = next(x for x in out.splitlines() if x.startswith(label + " "))
        assert "1.23e-05" in line and "0.500" in line and "0.800" in line and "123.4" in line
        if label != "dX":
            assert "-12.3/101.2/145.6" in line, line
    flat = " ".join(out.split())
    assert "max err = max|err| / max|ref|" in flat and "bit-id = share of bit-identical" in flat


def test_backends_show_summary_and_sm100_opt_in(capsys, monkeypatch):
    """Rows that cannot run still say what the backend is; cuda-sm100 says it is compiled but
    unverified and needs the opt-in variable even where there is no CUDA device."""
    from common import dispatch
    from cuda_kernels.backend import check_cuda_sm100

    monkeypatch.delenv("MOE_BWD_ENABLE_UNVERIFIED_SM100", raising=False)
    reason = check_cuda_sm100()  # torch.cuda.is_available is False here (autouse fixture)
    assert "no CUDA device" in reason and "compiled but unverified" in reason
    assert "MOE_BWD_ENABLE_UNVERIFIED_SM100=1" in reason
    monkeypatch.setenv("MOE_BWD_ENABLE_UNVERIFIED_SM100", "1")
    assert "unverified" not in check_cuda_sm100()
    monkeypatch.delenv("MOE_BWD_ENABLE_UNVERIFIED_SM100")
    assert cli.main(["backends"]) == 0
    flat = " ".join(capsys.readouterr().out.replace("│", " ").split())
    backends = dispatch.registered_backends()
    for name, b in backends.items():
        assert " ".join(b.summary.split()) in flat, name
        why = b.check()
        if why is not None:
            assert "not here: " + " ".join(why.split()) in flat, name
    assert flat.count("MOE_BWD_ENABLE_UNVERIFIED_SM100=1") == 1  # said once, in the reason
    assert flat.count("compiled but unverified") == 1


def test_input_affinity_model_is_refused_with_the_reason(capsys):
    """llama-4-scout scales the expert INPUT by the affinity: run refuses it before any work
    (exit 2, the reason on stderr) instead of computing another function; models shows it."""
    assert cli.main(["run", "--model", "llama-4-scout", "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "llama-4-scout" in err and "expert input" in err
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama-4-scout: it scales the expert input (not computed here" in out
    from common.inputs import make_problem_for_model

    with pytest.raises(ValueError, match="affinity to the expert input"):
        make_problem_for_model(load_model("llama-4-scout").scaled(hidden=128, intermediate=128), 8)
