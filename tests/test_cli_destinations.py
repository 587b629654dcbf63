"""A fresh user's findings on the command line and the loaders' messages: output destinations
(``run --save``, ``compare --report``) checked before any work, ``--force`` for a bundle of
another problem, no temporary names in messages, one option prefix per message, ``--layer``
without ``--weights``, a non-finite ``--min-sqnr``, labels of two CPU bundles, and the loaders'
words for a garbage ``.pt``, a missing ``--weights`` path and another family's tensor names.

Small shapes (Mixtral's E=8, top_2 at H = I = 128): the file runs in seconds."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from common import bundle as bundle_mod
from common import cli
from common import inputs as inputs_mod
from common.bundle import (
    ProblemSpec,
    build_problem,
    check_bundle_destination,
    collect_metadata,
    read_manifest,
    save_bundle,
)
from common.dispatch import run_backward
from common.loaders import load_expert_weights, load_routing
from common.models import load_model

RUN = ["run", "--model", "mixtral-8x7b", "--tokens", "8", "--backend", "torch"]
CMP = ["compare", "torch", "--model", "mixtral-8x7b", "--tokens", "8"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        cli, "load_model", lambda name: load_model(name).scaled(hidden=128, intermediate=128)
    )


@pytest.fixture
def no_work(monkeypatch):
    """Building any input fails the test: the command must have refused before."""

    def boom(*a, **k):
        raise AssertionError("inputs were built before the argument was refused")

    monkeypatch.setattr(bundle_mod, "build_problem", boom)
    monkeypatch.setattr(inputs_mod, "make_problem_for_model", boom)


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())  # rich may wrap long lines


# ------------------------------------------------------------------ --save / --report targets
def test_save_to_a_file_refused_before_any_work(tmp_path, capsys, no_work):
    f = tmp_path / "afile"
    f.write_text("keep me")
    assert cli.main(RUN + ["--save", str(f)]) == 2
    err = _err(capsys)
    assert f"error: --save {f}: exists and is not a directory" in err
    assert err.count("--save") == 1 and f.read_text() == "keep me"
    assert cli.main(RUN + ["--save", str(f / "sub")]) == 2  # a file as a parent
    assert f"--save {f / 'sub'}: {f} is not a directory" in _err(capsys)


def test_save_into_a_directory_of_other_files_refused_before_any_work(tmp_path, capsys, no_work):
    (tmp_path / "notes.txt").write_text("x")
    assert cli.main(RUN + ["--save", str(tmp_path)]) == 2
    err = _err(capsys)
    assert "holds other files than a bundle's" in err and err.count("--save") == 1


def test_unwritable_destination_names_no_temporary_file(tmp_path, capsys, no_work, monkeypatch):
    """A place that cannot be written is refused before the work, naming the path the user
    gave -- never the temporary sibling (``/proc/.nope.3ffg6l86``)."""

    def denied(prefix="", dir=None, **_):
        raise PermissionError(13, "Permission denied", f"{dir}/{prefix}3ffg6l86")

    monkeypatch.setattr(bundle_mod.tempfile, "mkdtemp", denied)
    target = tmp_path / "nope"
    assert cli.main(RUN + ["--save", str(target)]) == 2
    err = _err(capsys)
    assert f"--save {target}: cannot create a directory in {tmp_path} (Permission denied)" in err
    assert "3ffg6l86" not in err and ".nope." not in err
    import tempfile

    monkeypatch.setattr(tempfile, "mkdtemp", denied)  # the --report probe uses the module
    assert cli.main(CMP + ["--report", str(target)]) == 2
    err = _err(capsys)
    assert f"--report {target}: cannot create a directory" in err and "3ffg6l86" not in err


def test_save_bundle_write_error_names_the_destination(tmp_path, monkeypatch):
    spec = ProblemSpec.for_model(load_model("mixtral-8x7b").scaled(hidden=128, intermediate=128),
                                 8)
    problem = build_problem(spec)
    grads = run_backward(problem, "torch")

    def full(tensors, filename, *a, **k):
        raise OSError(28, "No space left on device", filename)

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    dest = tmp_path / "b"
    with pytest.raises(ValueError) as exc:
        save_bundle(dest, spec, problem, grads, collect_metadata("torch", "cpu"))
    msg = str(exc.value)
    assert msg == f"{dest}: cannot write the bundle (No space left on device)"
    assert not dest.exists() and list(tmp_path.iterdir()) == []


def test_report_to_a_file_refused_before_any_work(tmp_path, capsys, no_work):
    f = tmp_path / "afile"
    f.write_text("keep me")
    assert cli.main(CMP + ["--report", str(f)]) == 2
    err = _err(capsys)
    assert f"error: --report {f}: exists and is not a directory" in err
    assert err.count("--report") == 1 and f.read_text() == "keep me"


def test_save_over_a_bundle_of_another_problem_needs_force(tmp_path, capsys):
    d = tmp_path / "b"
    assert cli.main(RUN + ["--seed", "1", "--save", str(d)]) == 0
    first = read_manifest(d)["spec"]
    assert cli.main(RUN + ["--seed", "1", "--save", str(d)]) == 0  # same problem: replaced
    capsys.readouterr()
    assert cli.main(RUN + ["--seed", "2", "--save", str(d)]) == 2
    err = _err(capsys)
    assert f"--save {d}: holds a bundle of another problem (seed 1 -> 2)" in err
    assert "--force replaces it" in err and err.count("--save") == 1
    assert read_manifest(d)["spec"] == first  # untouched
    assert cli.main(RUN + ["--seed", "2", "--save", str(d), "--force"]) == 0
    assert read_manifest(d)["spec"].seed == 2


def test_other_problem_refused_before_building_inputs(tmp_path, capsys, monkeypatch):
    d = tmp_path / "b"
    assert cli.main(RUN + ["--seed", "1", "--save", str(d)]) == 0
    capsys.readouterr()

    def boom(*a, **k):
        raise AssertionError("inputs were built before the argument was refused")

    monkeypatch.setattr(bundle_mod, "build_problem", boom)
    assert cli.main(RUN + ["--tokens", "16", "--save", str(d)]) == 2
    assert "holds a bundle of another problem" in _err(capsys)


def test_library_save_bundle_refuses_another_problem_unless_force(tmp_path):
    small = load_model("mixtral-8x7b").scaled(hidden=128, intermediate=128)
    a, b = ProblemSpec.for_model(small, 8, seed=1), ProblemSpec.for_model(small, 8, seed=2)
    pa, pb = build_problem(a), build_problem(b)
    meta = collect_metadata("torch", "cpu")
    save_bundle(tmp_path / "x", a, pa, run_backward(pa, "torch"), meta)
    with pytest.raises(ValueError, match=r"another problem \(seed 1 -> 2\).*force=True"):
        save_bundle(tmp_path / "x", b, pb, run_backward(pb, "torch"), meta)
    save_bundle(tmp_path / "x", b, pb, run_backward(pb, "torch"), meta, force=True)
    assert read_manifest(tmp_path / "x")["spec"] == b
    check_bundle_destination(tmp_path / "x", b)  # the same problem: fine
    check_bundle_destination(tmp_path / "new" / "deeper", b)  # parents are created later
    assert not (tmp_path / "new").exists()


def test_force_flag_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--force" in out and "same problem" in out


# --------------------------------------------------------------------------- small CLI fixes
def test_layer_without_weights_refused_in_run(capsys, no_work):
    assert cli.main(RUN + ["--layer", "3"]) == 2
    assert "error: --layer is only used with --weights PATH" in _err(capsys)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_min_sqnr_must_be_finite(capsys, no_work, value):
    assert cli.main(CMP + [f"--min-sqnr={value}"]) == 2
    assert f"error: --min-sqnr must be a finite number (dB), got {value}" in _err(capsys)


@pytest.mark.parametrize("argv", [RUN, CMP], ids=["run", "compare"])
def test_shrink_error_has_one_prefix(capsys, no_work, argv):
    assert cli.main(argv + ["--shrink", "0"]) == 2
    err = _err(capsys)
    assert "error: --shrink must be an int >= 1, got 0" in err and "shrink: factor" not in err


def test_two_cpu_bundles_are_told_apart_in_compare(tmp_path, capsys):
    a, b = tmp_path / "torch-a", tmp_path / "torch-b"
    for d in (a, b):
        assert cli.main(RUN + ["--save", str(d)]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(b), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    labels = sorted(res["pairs"])
    assert len(labels) == 2 and not any("#2" in lab for lab in labels)
    assert any("(torch-a)" in lab for lab in labels) and any("(torch-b)" in lab for lab in labels)
    assert all(lab.startswith("torch@") for lab in labels)


# ------------------------------------------------------------------------- loaders' messages
def test_garbage_pt_routing_says_what_went_wrong(tmp_path, capsys, no_work):
    g = tmp_path / "router.pt"
    g.write_text("hello, not a torch file")
    with pytest.raises(ValueError) as exc:
        load_routing(g, num_experts=8, top_k=2)
    msg = str(exc.value)
    assert str(g) in msg and "neither a torch.save zip archive nor a pickle" in msg
    assert not msg.rstrip().endswith(": 101")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty or ends too early"):
        load_routing(tmp_path / "empty.pt", num_experts=8, top_k=2)
    assert cli.main(RUN + ["--routing", str(g)]) == 2
    assert "neither a torch.save zip archive nor a pickle" in _err(capsys)


def test_random_bytes_routing_is_not_a_readable_router_dump(tmp_path, capsys, no_work):
    """Random bytes said "holds Python objects other than tensors" (the weights-only unpickler
    stops at a byte that is no pickle opcode): they are not a router dump, and the message names
    the file and the formats read; a real pickle of a Python object still says so."""
    import datetime
    import random

    want = "not a readable router dump (.pt / .safetensors / .npz)"
    for seed in range(8):
        g = tmp_path / f"random-{seed}.pt"
        rng = random.Random(seed)
        g.write_bytes(bytes(rng.getrandbits(8) for _ in range(4096)))
        with pytest.raises(ValueError) as exc:
            load_routing(g, num_experts=8, top_k=2)
        msg = str(exc.value)
        assert msg.startswith(f"{g}: {want}: as a torch file, its bytes are neither"), msg
        assert "Python objects" not in msg
    assert cli.main(RUN + ["--routing", str(g)]) == 2
    err = " ".join(_err(capsys).split())
    assert f"{g}: {want}" in err and "Python objects" not in err
    for suffix in (".safetensors", ".npz"):
        (tmp_path / f"random{suffix}").write_bytes(g.read_bytes())
        with pytest.raises(ValueError, match=rf"random{suffix}: {re.escape(want)}: as a"):
            load_routing(tmp_path / f"random{suffix}", num_experts=8, top_k=2)
    obj = tmp_path / "object.pt"
    torch.save({"expert_index": datetime.date(2020, 1, 1)}, obj)
    with pytest.raises(ValueError, match=r"Python objects other than tensors.*datetime\.date"):
        load_routing(obj, num_experts=8, top_k=2)


def test_missing_weights_path_wording(tmp_path):
    model = load_model("mixtral-8x7b").scaled(hidden=128, intermediate=128)
    with pytest.raises(ValueError) as exc:
        load_expert_weights(tmp_path / "absent", model)
    msg = str(exc.value)
    assert "--weights path does not exist" in msg and "directory" in msg
    assert "is not a file" not in msg


def test_weights_of_another_family_say_so(tmp_path):
    """Mixtral's tensor names read as a Qwen3 model: the message names the family found."""
    H, I = 16, 8
    small = load_model("mixtral-8x7b").scaled(hidden=H, intermediate=I)
    t = {}
    for e in range(small.experts):
        for n, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t[f"model.layers.0.block_sparse_moe.experts.{e}.{n}.weight"] = torch.randn(*shape)
    p = tmp_path / "mixtral.safetensors"
    save_file(t, str(p))
    for name, fam in (("qwen3-30b-a3b", "qwen3_moe"), ("gpt-oss-20b", "gpt_oss"),
                      ("llama-4-scout", "llama4")):
        with pytest.raises(ValueError) as exc:
            load_expert_weights(p, load_model(name).scaled(hidden=H, intermediate=I))
        msg = str(exc.value)
        assert "follow the mixtral (mixtral-8x7b) layout" in msg and f"not the {fam}" in msg
        assert "another shard" not in msg
    # the right model still loads
    assert load_expert_weights(p, small).w_gate_up_EH2I.shape == (small.experts, H, 2, I)
