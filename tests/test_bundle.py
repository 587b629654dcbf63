"""Gradient bundles, pairwise comparison, the report and ``moe-bwd run --save`` / ``compare``
(issue 9 items 1 and 2). Small shapes (Mixtral's E=8, top_2 at H = I = 128): the file runs in
seconds."""

from __future__ import annotations

import json
import math
import re
import struct

import pytest
import torch

from common import cli
from common.bundle import (
    GRADIENTS,
    MANIFEST,
    ProblemSpec,
    build_problem,
    collect_metadata,
    input_digests,
    load_bundle,
    save_bundle,
)
from common.compare import (
    ULP_BINS,
    bf16_ulp_distance,
    compare_grads,
    compare_tensor,
    routed_mask_TE,
)
from common.dispatch import run_backward
from common.metrics import sqnr_db
from common.models import load_model
from common.problem import MoEGrads
from common.report import PLOTS, png_size, write_report

SPEC = ProblemSpec.for_model(
    load_model("mixtral-8x7b").scaled(hidden=128, intermediate=128), 24, seed=3
)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)
    # The CLI runs here compare against torch on the CPU: pin "auto" to the CPU whether or not a
    # GPU is present (the CLI's default device is cuda when torch sees one; issue 8 item 2).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def problem():
    return build_problem(SPEC)


@pytest.fixture(scope="module")
def torch_grads(problem):
    return run_backward(problem, "torch")


def _save(path, problem, grads, backend="torch"):
    return save_bundle(path, SPEC, problem, grads, collect_metadata(backend, "cpu", {"x": 1.0}))


# ---------------------------------------------------------------------------- bundles
def test_round_trip(tmp_path, problem, torch_grads):
    d = _save(tmp_path / "b", problem, torch_grads)
    assert sorted(p.name for p in d.iterdir()) == [MANIFEST, GRADIENTS]
    b = load_bundle(d)
    assert b.spec == SPEC and b.backend == "torch"
    assert b.inputs_sha256 == input_digests(problem)
    for name in ("hidden_states_grad_TH", "affinity_grad_TE", "w_gate_up_grad_EH2I",
                 "w_down_grad_EIH"):
        assert torch.equal(getattr(b.grads, name), getattr(torch_grads, name)), name
    meta = b.metadata
    assert meta["backend"] == "torch" and meta["versions"]["torch"] == torch.__version__
    assert re.match(r"\d{4}-\d\d-\d\dT", meta["date_utc"]) and meta["wall_s"] == {"x": 1.0}
    # re-saving over a bundle replaces it; a non-bundle directory is refused
    _save(d, problem, torch_grads)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="other files"):
        _save(other, problem, torch_grads)
    assert (other / "notes.txt").read_text() == "mine"


def test_inputs_rebuilt_bit_identically():
    assert input_digests(build_problem(SPEC)) == input_digests(build_problem(SPEC))


def test_digest_mismatch_refused(tmp_path, problem, torch_grads):
    d = _save(tmp_path / "b", problem, torch_grads)
    m = json.loads((d / MANIFEST).read_text())
    m["inputs_sha256"]["w_down_EIH"] = "0" * 64
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"bundle\.json: input digests differ .*'w_down_EIH'"):
        load_bundle(d)


def test_bundle_of_another_problem_refused(tmp_path, problem, torch_grads):
    d = _save(tmp_path / "b", problem, torch_grads)
    m = json.loads((d / MANIFEST).read_text())
    m["spec"]["seed"] = 4  # same shapes, other inputs
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"bundle\.json: input digests differ"):
        load_bundle(d)


@pytest.mark.parametrize("version,reason", [
    (1, r"version 1, this package reads version 2 \(its seeded inputs were drawn by torch's CPU "
        r"generator.*--save`\)"),
    (3, r"version 3, this package reads version 2$"),
    ([2], r"version \[2\], this package reads version 2$"),
])
def test_other_bundle_versions_refused_with_the_reason(tmp_path, problem, torch_grads, version,
                                                       reason):
    """A version-1 bundle's inputs came from torch's CPU generator: refused, saying so (not as
    a digest mismatch after re-creating the problem)."""
    d = _save(tmp_path / "b", problem, torch_grads)
    m = json.loads((d / MANIFEST).read_text())
    assert m["version"] == 2
    m["version"] = version
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"bundle\.json: bundle " + reason):
        load_bundle(d)


def test_truncated_and_corrupt_files_refused(tmp_path, problem, torch_grads):
    d = _save(tmp_path / "b", problem, torch_grads)
    g = d / GRADIENTS
    data = g.read_bytes()
    g.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{GRADIENTS}: sha256 .* differs"):
        load_bundle(d)
    # garbage whose digest matches the manifest: the safetensors reader refuses it
    g.write_bytes(b"\x00" * 64)
    m = json.loads((d / MANIFEST).read_text())
    import hashlib

    m["gradients"]["sha256"] = hashlib.sha256(b"\x00" * 64).hexdigest()
    (d / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=rf"{GRADIENTS}: not a readable safetensors"):
        load_bundle(d)
    text = json.dumps(m)
    (d / MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"bundle\.json: not valid JSON"):
        load_bundle(d)
    (d / MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"bundle\.json: cannot read"):
        load_bundle(d)


def test_loading_executes_no_pickle(tmp_path, problem, torch_grads, monkeypatch):
    d = _save(tmp_path / "b", problem, torch_grads)
    import pickle

    def boom(*a, **k):
        raise AssertionError("a bundle must not be unpickled")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    load_bundle(d, problem=problem)


# --------------------------------------------------------------------------- compare numbers
def test_compare_tensor_numbers():
    ref = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, 8.0], dtype=torch.float64)
    out = ref.clone()
    out[1] = -2.015625  # one BF16 ulp below -2 (ulp 2^-6 in [2, 4))
    out[3] = 3.0 + 3 * 2.0**-6  # three ulps above 3
    out[5] = 8.0 + 2.0**-20  # not identical, 0 BF16 ulps (rounds back to 8)
    m = compare_tensor(out.float(), ref)
    noise = (out - ref).pow(2).sum()
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(float(ref.pow(2).sum() / noise)))
    assert m["max_rel_err"] == pytest.approx(3 * 2.0**-6 / 8.0)
    cos = float(out @ ref / (out.norm() * ref.norm()))
    assert m["cosine"] == pytest.approx(cos, abs=1e-12)
    assert m["bit_identical"] == pytest.approx(3 / 6)
    assert m["ulp_hist"]["0"] == 4 and m["ulp_hist"]["1"] == 1 and m["ulp_hist"]["3-4"] == 1
    assert sum(m["ulp_hist"].values()) == 6 and set(m["ulp_hist"]) == {b[0] for b in ULP_BINS} | {
        "nan"}


def test_bf16_ulp_distance_across_zero_and_nan():
    tiny = 2.0**-133  # the smallest BF16 subnormal
    d = bf16_ulp_distance(torch.tensor([tiny, 0.0, 1.0, float("nan")]),
                          torch.tensor([-tiny, -0.0, 1.0, 1.0]))
    assert d.tolist() == [2, 0, 0, -1]


def test_compare_grads_per_expert(problem, torch_grads):
    ref = run_backward(problem, "reference")
    res = compare_grads(torch_grads, ref)
    assert list(res) == ["hidden_states_grad_TH", "affinity_grad_TE", "w_gate_up_grad_EH2I",
                         "w_down_grad_EIH"]
    for name, axis in (("w_down_grad_EIH", 0), ("affinity_grad_TE", 1)):
        want = [sqnr_db(getattr(torch_grads, name).select(axis, e), getattr(ref, name).select(
            axis, e)) for e in range(8)]
        assert res[name]["per_expert_sqnr_db"] == pytest.approx(want)
        assert res[name]["per_expert"]["min"] == pytest.approx(min(want))
    assert "per_expert" not in res["hidden_states_grad_TH"]
    assert res["w_down_grad_EIH"]["sqnr_db"] == pytest.approx(
        sqnr_db(torch_grads.w_down_grad_EIH, ref.w_down_grad_EIH))


# --------------------------------------------------------------------------------- report
def _png_dims(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_report_writes_plots_and_the_numbers(tmp_path, problem, torch_grads):
    ref = run_backward(problem, "reference")
    other = MoEGrads(**{k: getattr(torch_grads, k) * 1.001 for k in (
        "hidden_states_grad_TH", "affinity_grad_TE", "w_gate_up_grad_EH2I", "w_down_grad_EIH")})
    pairs = {"torch": compare_grads(torch_grads, ref), "scaled": compare_grads(other, ref)}
    comparison = {"baseline": "reference", "spec": SPEC.to_json(), "operands": {},
                  "tokens_per_expert": problem.plan.tokens_per_expert_E.tolist(), "pairs": pairs}
    md = write_report(tmp_path / "rep", comparison, {"torch": torch_grads, "scaled": other}, ref)
    for name in PLOTS:
        p = tmp_path / "rep" / name
        assert p.is_file() and p.stat().st_size > 10_000, name
        assert _png_dims(p) == png_size(), name
    text = md.read_text()
    for label, pair in pairs.items():
        m = pair["w_gate_up_grad_EH2I"]
        pe = m["per_expert"]
        row = (f"| {label} | {m['sqnr_db']:.2f} | {m['max_rel_err']:.3e} | {m['cosine']:.8f} | "
               f"{m['bit_identical']:.4f} | {pe['min']:.2f} / {pe['median']:.2f} / "
               f"{pe['max']:.2f} |")
        assert row in text, row
    for name in PLOTS:
        assert f"]({name})" in text


def test_report_of_bit_identical_operands(tmp_path, problem, torch_grads):
    """An operand equal to its baseline (nki-twin on CUDA vs nki-sim; it crashed the log-scaled
    scatter on the H200): the plots render, the SQNR is inf and the report says bit-identical."""
    pairs = {"same": compare_grads(torch_grads, torch_grads)}
    comparison = {"baseline": "torch", "spec": SPEC.to_json(), "operands": {},
                  "tokens_per_expert": problem.plan.tokens_per_expert_E.tolist(), "pairs": pairs}
    md = write_report(tmp_path / "rep", comparison, {"same": torch_grads}, torch_grads)
    for name in PLOTS:
        p = tmp_path / "rep" / name
        assert p.is_file() and p.stat().st_size > 10_000 and _png_dims(p) == png_size(), name
    m = pairs["same"]["w_down_grad_EIH"]
    assert m["sqnr_db"] == float("inf") and m["bit_identical"] == 1.0
    assert "| same | inf |" in md.read_text()


# ------------------------------------------------------------------------------------- CLI
@pytest.fixture
def small_models(monkeypatch):
    monkeypatch.setattr(
        cli, "load_model", lambda name: load_model(name).scaled(hidden=128, intermediate=128)
    )


def test_cli_save_then_compare_json(tmp_path, capsys, small_models):
    d = tmp_path / "torch-cpu"
    rc = cli.main(["run", "--model", "mixtral-8x7b", "--tokens", "24", "--seed", "3",
                   "--save", str(d)])
    assert rc == 0, capsys.readouterr()
    capsys.readouterr()
    rc = cli.main(["compare", str(d), "reference", "--baseline", "torch", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out)
    assert res["baseline"] == "torch" and res["spec"] == SPEC.to_json()
    problem = build_problem(SPEC)
    want_t = run_backward(problem, "torch")
    want = compare_grads(run_backward(problem, "reference"), want_t,
                         routed_TE=routed_mask_TE(problem.plan))
    got = res["pairs"]["reference"]
    for name, m in want.items():
        assert got[name]["sqnr_db"] == pytest.approx(m["sqnr_db"]), name
        assert got[name]["ulp_hist"] == m["ulp_hist"], name
    # the bundle against the torch run here: the same bits
    label = next(k for k in res["pairs"] if k.startswith("torch"))
    for m in res["pairs"][label].values():
        assert m["bit_identical"] == 1.0 and m["sqnr_db"] == math.inf


def test_cli_compare_min_sqnr_exit_code(tmp_path, capsys, small_models):
    args = ["compare", "torch", "--model", "mixtral-8x7b", "--tokens", "16"]
    assert cli.main(args + ["--min-sqnr", "20"]) == 0
    capsys.readouterr()
    assert cli.main(args + ["--min-sqnr", "200"]) == 1
    assert "below --min-sqnr 200" in capsys.readouterr().out
    assert cli.main(args + ["--report", str(tmp_path / "r")]) == 0
    assert all((tmp_path / "r" / p).stat().st_size > 0 for p in PLOTS)


def test_cli_compare_bad_operands(tmp_path, capsys, small_models):
    assert cli.main(["compare", "no-such-thing", "--model", "mixtral-8x7b", "--tokens", "8"]) == 2
    assert "neither a bundle" in capsys.readouterr().err
    assert cli.main(["compare", "torch"]) == 2  # no bundle and no --model
    assert "--model and --tokens" in capsys.readouterr().err
    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, "1"), (b, "2")):
        assert cli.main(["run", "--model", "mixtral-8x7b", "--tokens", "8", "--seed", seed,
                         "--save", str(d)]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(b)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the long line (long tmp paths)
    # the differing field with its two values, not two dicts (item 6e of issue 23)
    assert f"bundles {a} and {b} are of different problems: seed 1 -> 2" in err, err
    assert "{" not in err and "hidden" not in err
    c = tmp_path / "c"
    assert cli.main(["run", "--model", "mixtral-8x7b", "--tokens", "16", "--seed", "1",
                     "--skew", "2", "--save", str(c)]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(c)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps the long line
    assert "different problems: tokens 8 -> 16, skew 1.0 -> 2.0" in err, err


# ----------------------------------------------------------- first-user issues (items 4, 6)
def test_dA_bit_identical_and_ulp_over_routed_cells(problem, torch_grads):
    """dA's structural zeros no longer count as bit-identical (they gave 1 - K/E for anyone)."""
    ref = run_backward(problem, "reference")
    mask = routed_mask_TE(problem.plan)
    T, E = problem.dims["T"], problem.dims["E"]
    assert mask.shape == (T, E) and 0 < int(mask.sum()) <= T * problem.dims["K"]
    dense = problem.plan.affinity_dense_TE().cpu() != 0
    assert bool((mask | ~dense).all())  # every nonzero affinity is a routed cell
    # a gradient that differs from the reference on every routed cell, exact zeros elsewhere
    off = torch_grads.affinity_grad_TE.clone()
    off[mask] = ref.affinity_grad_TE[mask].to(off.dtype) * 1.5 + 1.0
    off[~mask] = 0.0
    other = MoEGrads(**{**{k: getattr(torch_grads, k) for k in (
        "hidden_states_grad_TH", "w_gate_up_grad_EH2I", "w_down_grad_EIH")},
        "affinity_grad_TE": off})
    plain = compare_grads(other, ref)["affinity_grad_TE"]
    routed = compare_grads(other, ref, routed_TE=mask)["affinity_grad_TE"]
    assert plain["bit_identical"] == pytest.approx(1 - int(mask.sum()) / (T * E))
    assert routed["bit_identical"] == 0.0 and routed["routed_only"] is True
    assert routed["routed_cells"] == int(mask.sum())
    assert routed["bit_identical_all_cells"] == plain["bit_identical"]
    assert sum(routed["ulp_hist"].values()) == int(mask.sum()) and routed["ulp_hist"]["0"] == 0
    assert routed["sqnr_db"] == plain["sqnr_db"]  # the other metrics keep all cells
    # the other gradients are unaffected by the mask
    assert "routed_only" not in compare_grads(other, ref, routed_TE=mask)["w_down_grad_EIH"]
    with pytest.raises(ValueError, match="routed_TE"):
        compare_grads(other, ref, routed_TE=mask[:-1])


def test_cli_compare_dA_routed_only_in_json_and_legend(capsys, small_models):
    args = ["compare", "torch", "--model", "mixtral-8x7b", "--tokens", "16"]
    assert cli.main(args + ["--json"]) == 0
    dA = json.loads(capsys.readouterr().out)["pairs"]["torch"]["affinity_grad_TE"]
    assert dA["routed_only"] and dA["routed_cells"] <= 16 * 2
    assert sum(dA["ulp_hist"].values()) == dA["routed_cells"]
    assert cli.main(args) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "for dA both over the routed (token, expert) cells only" in flat


def test_report_states_floor_and_verdict(tmp_path, capsys, small_models):
    args = ["compare", "torch", "--model", "mixtral-8x7b", "--tokens", "16"]
    assert cli.main(args + ["--min-sqnr", "20", "--report", str(tmp_path / "ok")]) == 0
    text = (tmp_path / "ok" / "report.md").read_text()
    assert "SQNR floor (--min-sqnr): **20 dB**. **PASS**: all 4 gradients" in text
    assert "bit-identical (routed cells)" in text and "routed (token, expert) cells only" in text
    assert cli.main(args + ["--min-sqnr", "200", "--report", str(tmp_path / "bad")]) == 1
    text = (tmp_path / "bad" / "report.md").read_text()
    assert "SQNR floor (--min-sqnr): **200 dB**. **FAIL**: 4 of 4 gradients" in text
    assert "- torch dX [T,H]" in text
    assert cli.main(args + ["--report", str(tmp_path / "none")]) == 0
    assert "SQNR floor" not in (tmp_path / "none" / "report.md").read_text()


def test_per_expert_plot_keeps_identical_series_visible(problem, torch_grads):
    """nki-twin identical to nki-sim: a different marker, line style and size for each."""
    from common import report

    ref = run_backward(problem, "reference")
    same = compare_grads(torch_grads, ref)
    comparison = {"baseline": "reference", "pairs": {"nki-sim": same, "nki-twin": same}}
    plt, fig = report._per_expert_figure(
        comparison, problem.plan.tokens_per_expert_E.tolist())
    try:
        ax = fig.axes[0]
        lines = [ln for ln in ax.get_lines() if ln.get_label() in ("nki-sim", "nki-twin")]
        assert [ln.get_label() for ln in lines] == ["nki-sim", "nki-twin"]
        a, b = lines
        assert list(a.get_ydata()) == list(b.get_ydata())
        assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
        assert a.get_markersize() > b.get_markersize() and b.get_zorder() > a.get_zorder()
        assert a.get_markerfacecolor() == "none"
    finally:
        plt.close(fig)
    styles = [report.series_style(i) for i in range(6)]
    assert len({(s["marker"], str(s["linestyle"])) for s in styles}) == 6


def test_scatter_plot_names_identical_series_and_legend_clears_panels(problem, torch_grads):
    """nki-twin identical to nki-sim hid under it in the scatter plot, and the panels' legends
    covered their neighbours: each drawn operand has its own hollow marker; an operand identical
    to an earlier one is not drawn but named "identical to" it; one figure legend lies below
    every panel."""
    from common import report

    ref = run_backward(problem, "reference")
    other = MoEGrads(**{k: getattr(torch_grads, k) * 1.001 for k in (
        "hidden_states_grad_TH", "affinity_grad_TE", "w_gate_up_grad_EH2I", "w_down_grad_EIH")})
    grads = {"nki-sim": torch_grads, "nki-twin": torch_grads, "torch": other}
    plt, fig = report._scatter_figure({"baseline": "reference"}, grads, ref)
    try:
        fig.tight_layout(rect=(0.0, 0.035 * fig._legend_rows + 0.01, 1.0, 1.0))
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert len(axes) == 4
        twin = "nki-twin: identical to nki-sim"
        for ax in axes:
            cols = {c.get_label(): c for c in ax.collections}
            assert list(cols) == ["nki-sim", twin, "torch"]
            assert len(cols[twin].get_offsets()) == 0 and len(cols["nki-sim"].get_offsets())
            va, vb = (cols[k].get_paths()[0].vertices for k in ("nki-sim", "torch"))
            assert va.shape != vb.shape or not (va == vb).all()  # other markers
            assert len(cols["nki-sim"].get_facecolors()) == 0  # hollow
            assert ax.get_legend() is None
        (legend,) = fig.legends
        assert [t.get_text() for t in legend.get_texts()] == ["nki-sim", twin, "torch"]
        top = legend.get_window_extent(renderer).y1
        assert all(top <= ax.xaxis.get_tightbbox(renderer).y0 for ax in axes)
    finally:
        plt.close(fig)
    styles = [report.scatter_style(i) for i in range(6)]
    assert len({s["marker"] for s in styles}) == 6


def test_cli_compare_fails_on_nan_gradients(tmp_path, capsys, problem, torch_grads):
    """A bundle whose dX holds a NaN makes compare exit 1 naming the bundle and the gradient
    (as `run` does), with or without --min-sqnr."""
    import dataclasses

    dx = torch_grads.hidden_states_grad_TH.clone()
    dx[0, 0] = float("nan")
    d = tmp_path / "nan-bundle"
    _save(d, problem, dataclasses.replace(torch_grads, hidden_states_grad_TH=dx))
    for extra in ([], ["--json"]):
        assert cli.main(["compare", str(d), "--baseline", "torch", *extra]) == 1
        err = capsys.readouterr().err
        assert "NaN or inf" in err and "nan-bundle" in err and "dX" in err, err


def test_cli_compare_report_without_matplotlib_fails_before_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(cli, "_compare_problem", lambda *a: pytest.fail("work started"))
    out = tmp_path / "report"
    assert cli.main(["compare", "torch", "--model", "mixtral-8x7b", "--tokens", "8",
                     "--report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "[report]" in err and not out.exists()
