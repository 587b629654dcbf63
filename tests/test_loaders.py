"""Real inputs (issue 9 item 4): router dumps and Hugging Face expert-weight shards.

Every file is built here in tmp_path in the layout of its family; nothing is downloaded. The
mapping is checked against the layout's semantics: the HF-style expert forward computed from the
shard's tensors equals the forward computed from our [E, H, 2, I] / [E, I, H] tensors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from common import cli
from common.bundle import ProblemSpec, build_problem, input_digests, load_bundle
from common.inputs import make_problem_for_model
from common.loaders import (
    FAMILIES,
    family_of_model,
    file_sha256,
    load_expert_weights,
    load_routing,
)
from common.models import load_model

H, I = 8, 4  # tiny expert shapes for the mapping tests (E stays the model's)


def _tiny(name: str, hidden: int = H, intermediate: int = I):
    return load_model(name).scaled(hidden=hidden, intermediate=intermediate)


def _routing(T: int, E: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    aff = torch.rand(T, K, generator=g).softmax(-1)
    return ids, aff


# ------------------------------------------------------------------------------ routing
@pytest.mark.parametrize("ext", [".pt", ".safetensors", ".npz"])
def test_routing_formats_load_alike(tmp_path, ext):
    ids, aff = _routing(12, 64, 8)
    ids[3, 5] = -1  # a dropped slot, its affinity may be NaN
    aff[3, 5] = float("nan")
    p = tmp_path / f"r{ext}"
    if ext == ".pt":
        torch.save({"expert_index": ids.to(torch.int32), "affinity": aff, "extra": 1}, p)
    elif ext == ".safetensors":
        save_file({"expert_index": ids.to(torch.int16), "affinity": aff.bfloat16()}, str(p))
    else:
        np.savez(p, expert_index=ids.numpy(), affinity=aff.double().numpy())
    got_ids, got_aff = load_routing(p, num_experts=64, top_k=8, num_tokens=12)
    assert got_ids.dtype == torch.int64 and got_aff.dtype == torch.float32
    assert torch.equal(got_ids, ids)
    want = aff.bfloat16().float() if ext == ".safetensors" else aff
    routed = ids >= 0
    assert torch.equal(got_aff[routed], want[routed])
    # T taken from the file when not given
    assert load_routing(p, num_experts=64, top_k=8)[0].shape == (12, 8)


def test_routing_unsigned_npz(tmp_path):
    ids, aff = _routing(4, 8, 2)
    p = tmp_path / "r.npz"
    np.savez(p, expert_index=ids.numpy().astype(np.uint32), affinity=aff.numpy())
    assert torch.equal(load_routing(p, num_experts=8, top_k=2)[0], ids)


def _bad_routing_cases():
    ids, aff = _routing(6, 16, 4)
    nan = aff.clone()
    nan[2, 1] = float("nan")
    big = ids.clone()
    big[1, 0] = 16
    neg = ids.clone()
    neg[0, 0] = -2
    dup = ids.clone()
    dup[4, 1] = dup[4, 0]
    return {
        "missing key": ({"expert_index": ids}, "must hold 'affinity'"),
        "float ids": ({"expert_index": ids.float(), "affinity": aff}, "integer dtype"),
        "int affinity": ({"expert_index": ids, "affinity": ids.clone()}, "floating dtype"),
        "1-D": ({"expert_index": ids[:, 0], "affinity": aff[:, 0]}, "must be 2-D"),
        "shapes differ": ({"expert_index": ids, "affinity": aff[:5]}, "must equal"),
        "wrong K": ({"expert_index": ids[:, :3], "affinity": aff[:, :3]}, "top_k is 4"),
        "wrong T": ({"expert_index": ids[:5], "affinity": aff[:5]}, "--tokens is 6"),
        "id >= E": ({"expert_index": big, "affinity": aff}, "[-1, 16)"),
        "id < -1": ({"expert_index": neg, "affinity": aff}, "[-1, 16)"),
        "NaN affinity": ({"expert_index": ids, "affinity": nan}, "finite on routed slots"),
        "duplicate": ({"expert_index": dup, "affinity": aff}, "one expert twice"),
    }


@pytest.mark.parametrize("case", list(_bad_routing_cases()))
def test_routing_bad_input(tmp_path, case):
    data, rule = _bad_routing_cases()[case]
    p = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in data.items()}, str(p))
    with pytest.raises(ValueError) as exc:
        load_routing(p, num_experts=16, top_k=4, num_tokens=6)
    assert str(p) in str(exc.value) and rule in str(exc.value)


def test_routing_bad_files(tmp_path):
    pt = tmp_path / "list.pt"
    torch.save([torch.zeros(2, 2)], pt)
    with pytest.raises(ValueError, match="must hold a dict"):
        load_routing(pt, num_experts=4, top_k=2)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not a safetensors file")
    with pytest.raises(ValueError, match="not a readable router dump .* as a safetensors file"):
        load_routing(junk, num_experts=4, top_k=2)
    truncated = tmp_path / "t.npz"
    ids, aff = _routing(4, 8, 2)
    np.savez(truncated, expert_index=ids.numpy(), affinity=aff.numpy())
    truncated.write_bytes(truncated.read_bytes()[:40])
    with pytest.raises(ValueError, match=str(truncated)):
        load_routing(truncated, num_experts=8, top_k=2)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="unknown routing file type"):
        load_routing(tmp_path / "x.json", num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="does not exist"):
        load_routing(tmp_path / "absent.pt", num_experts=4, top_k=2)


# ------------------------------------------------------------------------------ weights
def _linear_shard(prefix: str, names: tuple[str, str, str], E: int, layer: int = 0,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    gate_n, up_n, down_n = names
    for e in range(E):
        base = f"{prefix}layers.{layer}.{{}}".format
        out[base(gate_n.format(e=e))] = torch.randn(I, H, generator=g)
        out[base(up_n.format(e=e))] = torch.randn(I, H, generator=g)
        out[base(down_n.format(e=e))] = torch.randn(H, I, generator=g)
    out[f"{prefix}layers.{layer}.self_attn.q_proj.weight"] = torch.randn(H, H, generator=g)
    return out


def _ours_forward(w, x, e, act=torch.nn.functional.silu):
    g = x @ w.w_gate_up_EH2I[e, :, 0, :]
    u = x @ w.w_gate_up_EH2I[e, :, 1, :]
    return (act(g) * u) @ w.w_down_EIH[e]


_PER_EXPERT = {
    "qwen3-30b-a3b": ("model.", "mlp.experts.{e}.gate_proj.weight",
                      "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "olmoe-1b-7b": ("model.", "mlp.experts.{e}.gate_proj.weight",
                    "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "mixtral-8x7b": ("model.", "block_sparse_moe.experts.{e}.w1.weight",
                     "block_sparse_moe.experts.{e}.w3.weight",
                     "block_sparse_moe.experts.{e}.w2.weight"),
    "deepseek-v3": ("model.", "mlp.experts.{e}.gate_proj.weight",
                    "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "kimi-k2": ("model.", "mlp.experts.{e}.gate_proj.weight",
                "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
}


@pytest.mark.parametrize("name", list(_PER_EXPERT))
def test_per_expert_linear_layouts(tmp_path, name):
    model = _tiny(name)
    prefix, *names = _PER_EXPERT[name]
    layer = 3
    tensors = _linear_shard(prefix, tuple(names), model.experts, layer=layer)
    p = tmp_path / "model-00001-of-00002.safetensors"
    save_file(tensors, str(p))
    w = load_expert_weights(p, model, layer=layer, dtype=torch.float32)
    assert w.w_gate_up_EH2I.shape == (model.experts, H, 2, I)
    assert w.w_down_EIH.shape == (model.experts, I, H)
    x = torch.randn(5, H)
    for e in (0, model.experts - 1):
        gate = tensors[f"{prefix}layers.{layer}." + names[0].format(e=e)]
        up = tensors[f"{prefix}layers.{layer}." + names[1].format(e=e)]
        down = tensors[f"{prefix}layers.{layer}." + names[2].format(e=e)]
        assert torch.equal(w.w_gate_up_EH2I[e, :, 0, :], gate.T)  # gate_proj.weight is [I, H]
        assert torch.equal(w.w_gate_up_EH2I[e, :, 1, :], up.T)
        assert torch.equal(w.w_down_EIH[e], down.T)
        # HF MLP: down(silu(gate(x)) * up(x)) with Linear(x) = x @ W.T
        hf = torch.nn.functional.linear(
            torch.nn.functional.silu(torch.nn.functional.linear(x, gate))
            * torch.nn.functional.linear(x, up), down)
        torch.testing.assert_close(_ours_forward(w, x, e), hf)
    # default dtype is the problem's BF16
    assert load_expert_weights(p, model, layer=layer).w_down_EIH.dtype == torch.bfloat16


def test_llama4_fused_layout_not_interleaved(tmp_path):
    model = _tiny("llama-4-scout")
    E = model.experts
    gu = torch.randn(E, H, 2 * I)
    dn = torch.randn(E, I, H)
    p = tmp_path / "llama4.safetensors"
    pre = "language_model.model.layers.0.feed_forward.experts."
    save_file({pre + "gate_up_proj": gu, pre + "down_proj": dn}, str(p))
    w = load_expert_weights(p, model, dtype=torch.float32)
    assert torch.equal(w.w_gate_up_EH2I[:, :, 0, :], gu[..., :I])  # gate = first half
    assert torch.equal(w.w_gate_up_EH2I[:, :, 1, :], gu[..., I:])
    assert torch.equal(w.w_down_EIH, dn)
    x = torch.randn(3, H)
    for e in range(E):
        gate, up = (x @ gu[e]).chunk(2, dim=-1)  # Llama4TextExperts.forward
        hf = (up * torch.nn.functional.silu(gate)) @ dn[e]
        torch.testing.assert_close(_ours_forward(w, x, e), hf)


def test_gpt_oss_interleaved_layout_with_biases(tmp_path):
    model = _tiny("gpt-oss-20b")
    E = model.experts
    gu, bgu = torch.randn(E, H, 2 * I), torch.randn(E, 2 * I)
    dn, bdn = torch.randn(E, I, H), torch.randn(E, H)
    p = tmp_path / "gpt-oss.safetensors"
    pre = "model.layers.0.mlp.experts."
    save_file({pre + "gate_up_proj": gu, pre + "gate_up_proj_bias": bgu,
               pre + "down_proj": dn, pre + "down_proj_bias": bdn}, str(p))
    w = load_expert_weights(p, model, dtype=torch.float32)
    assert w.family == "gpt_oss"
    assert torch.equal(w.w_gate_up_EH2I[:, :, 0, :], gu[..., ::2])  # gate = even columns
    assert torch.equal(w.w_gate_up_EH2I[:, :, 1, :], gu[..., 1::2])
    assert torch.equal(w.b_gate_up_E2I[:, 0, :], bgu[:, ::2])
    assert torch.equal(w.b_gate_up_E2I[:, 1, :], bgu[:, 1::2])
    assert torch.equal(w.w_down_EIH, dn) and torch.equal(w.b_down_EH, bdn)
    x = torch.randn(4, H)
    for e in (0, E - 1):
        # GptOssExperts.forward (pre-clamp pre-activations)
        gate_up = x @ gu[e] + bgu[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        g = x @ w.w_gate_up_EH2I[e, :, 0, :] + w.b_gate_up_E2I[e, 0]
        u = x @ w.w_gate_up_EH2I[e, :, 1, :] + w.b_gate_up_E2I[e, 1]
        torch.testing.assert_close(g, gate)
        torch.testing.assert_close(u, up)


def test_deepseek_fp8_block_scales_dequantized(tmp_path):
    model = _tiny("deepseek-v3", hidden=8, intermediate=136)  # I = 136: two row blocks
    E, Ii = model.experts, model.intermediate
    g = torch.Generator().manual_seed(1)
    tensors, want = {}, {}
    for e in range(E):
        for n, shape in (("gate_proj", (Ii, 8)), ("up_proj", (Ii, 8)), ("down_proj", (8, Ii))):
            w8 = torch.randn(*shape, generator=g).to(torch.float8_e4m3fn)
            nb = (-(-shape[0] // 128), -(-shape[1] // 128))
            s = torch.rand(*nb, generator=g) + 0.5
            key = f"model.layers.0.mlp.experts.{e}.{n}.weight"
            tensors[key], tensors[key + "_scale_inv"] = w8, s
            full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
            want[(e, n)] = w8.float() * full
    p = tmp_path / "ds.safetensors"
    save_file(tensors, str(p))
    w = load_expert_weights(p, model, dtype=torch.float32)
    for e in (0, E - 1):
        assert torch.equal(w.w_gate_up_EH2I[e, :, 0, :], want[(e, "gate_proj")].T)
        assert torch.equal(w.w_down_EIH[e], want[(e, "down_proj")].T)
    # a row of the second block carries the second block's scale
    s = tensors["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"]
    assert s.shape == (2, 1)
    del tensors["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"]
    save_file(tensors, str(p))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        load_expert_weights(p, model)


def test_every_model_has_a_family():
    from common.models import model_names

    for name in model_names():
        assert family_of_model(name) in FAMILIES
    with pytest.raises(ValueError, match="no Hugging Face weight layout"):
        family_of_model("not-a-model")


def test_weights_bad_input(tmp_path):
    model = _tiny("qwen3-30b-a3b")
    names = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
             "mlp.experts.{e}.down_proj.weight")
    tensors = _linear_shard("model.", names, model.experts)
    p = tmp_path / "shard.safetensors"
    missing = dict(tensors)
    del missing["model.layers.0.mlp.experts.7.up_proj.weight"]
    save_file(missing, str(p))
    with pytest.raises(ValueError) as exc:
        load_expert_weights(p, model)
    assert str(p) in str(exc.value) and "layers.0.mlp.experts.7.up_proj.weight" in str(exc.value)
    assert "missing" in str(exc.value)

    wrong = dict(tensors)
    wrong["model.layers.0.mlp.experts.5.down_proj.weight"] = torch.randn(I, H)  # transposed
    save_file(wrong, str(p))
    with pytest.raises(ValueError) as exc:
        load_expert_weights(p, model)
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in str(exc.value)
    assert f"shape [{I}, {H}], expected [{H}, {I}]" in str(exc.value)

    save_file(tensors, str(p))
    with pytest.raises(ValueError, match=r"layers\.2\..*missing.*holds layers \[0\]"):
        load_expert_weights(p, model, layer=2)
    with pytest.raises(ValueError, match="shape"):  # a model of another H
        load_expert_weights(p, _tiny("qwen3-30b-a3b", hidden=16))
    with pytest.raises(ValueError, match="--layer"):
        load_expert_weights(p, model, layer=-1)

    nan = dict(tensors)
    nan["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.full((I, H), float("nan"))
    save_file(nan, str(p))
    with pytest.raises(ValueError, match="NaN or inf"):
        load_expert_weights(p, model)

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_expert_weights(junk, model)
    (tmp_path / "x.pt").write_bytes(b"0")
    with pytest.raises(ValueError, match=".safetensors shard"):
        load_expert_weights(tmp_path / "x.pt", model)

    gpt = _tiny("gpt-oss-20b")
    mx = tmp_path / "mxfp4.safetensors"
    pre = "model.layers.0.mlp.experts."
    save_file({pre + "gate_up_proj_blocks": torch.zeros(2, dtype=torch.uint8),
               pre + "gate_up_proj_bias": torch.zeros(gpt.experts, 2 * I),
               pre + "down_proj_bias": torch.zeros(gpt.experts, H)}, str(mx))
    with pytest.raises(ValueError, match="gate_up_proj_scales' is missing"):  # MXFP4 half
        load_expert_weights(mx, gpt)
    nobias = tmp_path / "nobias.safetensors"
    save_file({pre + "gate_up_proj": torch.randn(gpt.experts, H, 2 * I),
               pre + "down_proj": torch.randn(gpt.experts, I, H)}, str(nobias))
    with pytest.raises(ValueError, match="gate_up_proj_bias"):
        load_expert_weights(nobias, gpt)


def test_problem_uses_loaded_inputs(tmp_path):
    model = _tiny("gpt-oss-20b", hidden=32, intermediate=16)
    E, Hh, Ii = model.experts, model.hidden, model.intermediate
    pre = "model.layers.0.mlp.experts."
    p = tmp_path / "w.safetensors"
    save_file({pre + "gate_up_proj": torch.randn(E, Hh, 2 * Ii) * 0.1,
               pre + "gate_up_proj_bias": torch.randn(E, 2 * Ii) * 0.1,
               pre + "down_proj": torch.randn(E, Ii, Hh) * 0.1,
               pre + "down_proj_bias": torch.randn(E, Hh) * 0.1}, str(p))
    w = load_expert_weights(p, model)
    routing = _routing(10, E, model.top_k)
    prob = make_problem_for_model(model, 10, seed=3, routing=routing, weights=w)
    sim = make_problem_for_model(model, 10, seed=3)
    assert torch.equal(prob.w_gate_up_EH2I, w.w_gate_up_EH2I)
    assert torch.equal(prob.b_down_EH, w.b_down_EH)
    assert torch.equal(prob.hidden_states_TH, sim.hidden_states_TH)  # same seeded x
    assert torch.equal(prob.plan.pair_expert_R.sort().values,
                       routing[0].flatten().sort().values)


# ------------------------------------------------------------------------------ bundle spec
def test_spec_records_digests_and_old_specs_load(tmp_path):
    old = {"model": "olmoe-1b-7b", "hidden": 128, "intermediate": 128, "experts": 64,
           "top_k": 8, "tokens": 16, "seed": 0, "skew": 1.0, "shrink": 16, "dtype": "bfloat16"}
    spec = ProblemSpec.from_json(old)
    assert spec.routing_sha256 is None and not spec.real_inputs
    assert spec.to_json() == old  # simulated specs serialise as before
    real = ProblemSpec.from_json({**old, "routing_sha256": "a" * 64, "weights_sha256": "b" * 64,
                                  "layer": 2})
    assert real.real_inputs and ProblemSpec.from_json(real.to_json()) == real
    for bad in ({"routing_sha256": "xyz"}, {"weights_sha256": "b" * 64},
                {"layer": 1}, {"layer": -1, "weights_sha256": "b" * 64}):
        with pytest.raises(ValueError, match="spec field"):
            ProblemSpec.from_json({**old, **bad}, where="b.json")

    model = load_model("olmoe-1b-7b").shrink(16)
    rp = tmp_path / "r.npz"
    ids, aff = _routing(16, 64, 8)
    np.savez(rp, expert_index=ids.numpy(), affinity=aff.numpy())
    spec = ProblemSpec.for_model(model, 16, shrink=16, routing_sha256=file_sha256(rp))
    with pytest.raises(ValueError, match="pass it again with --routing"):
        build_problem(spec)
    other = tmp_path / "other.npz"
    np.savez(other, expert_index=ids.numpy(), affinity=(aff * 0.5).numpy())
    with pytest.raises(ValueError, match="differs from the problem's"):
        build_problem(spec, routing_file=other)
    with pytest.raises(ValueError, match="made without one"):
        build_problem(ProblemSpec.for_model(model, 16, shrink=16), routing_file=rp)
    a = input_digests(build_problem(spec, routing_file=rp))
    b = input_digests(build_problem(spec, routing_file=rp))
    assert a == b


# ------------------------------------------------------------------------------ CLI
@pytest.fixture
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich reads it: error lines are not wrapped
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)


def _olmoe_files(tmp_path, layer=1):
    """A routing dump and a Qwen3/OLMoE-layout shard (decoder layer ``layer``) for olmoe-1b-7b
    --shrink 16 (H = I = 128)."""
    model = load_model("olmoe-1b-7b").shrink(16)
    E, Hh, Ii = model.experts, model.hidden, model.intermediate
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for e in range(E):
        pre = f"model.layers.{layer}.mlp.experts.{e}."
        tensors[pre + "gate_proj.weight"] = (torch.randn(Ii, Hh, generator=g) * Hh**-0.5).bfloat16()
        tensors[pre + "up_proj.weight"] = (torch.randn(Ii, Hh, generator=g) * Hh**-0.5).bfloat16()
        tensors[pre + "down_proj.weight"] = (torch.randn(Hh, Ii, generator=g) * Ii**-0.5).bfloat16()
    wp = tmp_path / "model-00001-of-00003.safetensors"
    save_file(tensors, str(wp))
    ids, aff = _routing(16, E, model.top_k, seed=2)
    rp = tmp_path / "router.pt"
    torch.save({"expert_index": ids, "affinity": aff}, rp)
    return model, wp, rp, tensors


def test_cli_run_and_compare_with_real_inputs(tmp_path, capsys, wide_console):
    model, wp, rp, tensors = _olmoe_files(tmp_path)
    bundle = tmp_path / "bundle"
    rc = cli.main(["run", "--model", "olmoe-1b-7b", "--shrink", "16", "--backend", "torch",
                   "--routing", str(rp), "--weights", str(wp), "--layer", "1",
                   "--save", str(bundle), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["dims"]["T"] == 16  # T from the routing file
    assert out["routing_file"] == str(rp) and out["layer"] == 1
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["spec"]["routing_sha256"] == file_sha256(rp)
    assert manifest["spec"]["weights_sha256"] == file_sha256(wp)
    assert manifest["spec"]["layer"] == 1

    # the bundle's problem really used the files
    b = load_bundle(bundle, routing_file=rp, weights_file=wp)
    prob = build_problem(b.spec, routing_file=rp, weights_file=wp)
    gate0 = tensors["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert torch.equal(prob.w_gate_up_EH2I[0, :, 0, :], gate0.T)
    with pytest.raises(ValueError, match="--weights"):
        load_bundle(bundle, routing_file=rp)

    rc = cli.main(["compare", str(bundle), "torch", "--routing", str(rp), "--weights", str(wp),
                   "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    cmp = json.loads(captured.out)
    assert cmp["spec"]["weights_sha256"] == file_sha256(wp)
    assert cmp["pairs"]["torch"]["hidden_states_grad_TH"]["sqnr_db"] > 30
    # without the files the bundle's problem cannot be re-created
    assert cli.main(["compare", str(bundle), "torch"]) == 2
    assert "pass it again with --routing" in capsys.readouterr().err
    # backends only, problem from the command line and the files
    rc = cli.main(["compare", "torch", "--model", "olmoe-1b-7b", "--shrink", "16",
                   "--routing", str(rp), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["spec"]["tokens"] == 16


def test_cli_weights_without_layer_report_layer_0(tmp_path, capsys, wide_console):
    """--weights without --layer reads layer 0 and says so (it printed "(layer None)")."""
    _, wp, _, _ = _olmoe_files(tmp_path, layer=0)
    base = ["run", "--model", "olmoe-1b-7b", "--shrink", "16", "--backend", "torch",
            "--tokens", "16", "--weights", str(wp), "--no-reference"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert f"weights {wp} (layer 0)" in out and "layer None" not in out
    assert cli.main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layer"] == 0


def test_cli_real_input_errors(tmp_path, capsys, wide_console):
    model, wp, rp, _ = _olmoe_files(tmp_path)
    base = ["run", "--model", "olmoe-1b-7b", "--shrink", "16", "--backend", "torch"]
    assert cli.main(base + ["--routing", str(rp), "--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert str(rp) in err and "--tokens is 8" in err
    assert cli.main(base + ["--tokens", "16", "--weights", str(wp)]) == 2  # layer 0 absent
    err = capsys.readouterr().err
    assert "layers.0.mlp.experts.0.gate_proj.weight" in err and "missing" in err
    assert cli.main(["run", "--model", "olmoe-1b-7b", "--backend", "torch", "--routing", str(rp),
                     "--weights", str(wp), "--layer", "1"]) == 2  # full size: shapes differ
    assert "expected" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--model", "olmoe-1b-7b"])
    assert exc.value.code == 2 and "--tokens" in capsys.readouterr().err
