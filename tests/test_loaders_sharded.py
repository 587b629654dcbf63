"""Sharded Hugging Face checkpoints and gpt-oss MXFP4 expert weights (issue 9 item 4).

Every file is built here in tmp_path in the checkpoint's layout; nothing is downloaded:

* a sharded checkpoint: shards plus ``model.safetensors.index.json`` (``{"metadata": ...,
  "weight_map": {tensor name: shard file}}``), read through the index or its directory, with
  only the shards that hold the requested layer opened;
* gpt-oss MXFP4: known weights quantized with :mod:`common.mx` and written as
  ``*_blocks`` uint8 [E, out, in/32, 16] / ``*_scales`` uint8 [E, out, in/32] (transformers
  ``Mxfp4GptOssExperts``), loaded and compared exactly with their dequantized values, and with
  a decoder that follows transformers' ``convert_moe_packed_tensors`` convention on its own;
* bad input: each a ValueError naming the file and the rule, with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common import cli, loaders
from common.loaders import INDEX_NAME, load_expert_weights
from common.models import load_model
from common.mx import dequantize_mx, quantize_mx

H, I = 8, 4  # tiny BF16 shapes (E stays the model's)
MX_H, MX_I = 64, 32  # MXFP4 needs H and I multiples of 32 (one scale per 32 input elements)
QWEN = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
        "mlp.experts.{e}.down_proj.weight")


def _tiny(name: str, hidden: int = H, intermediate: int = I):
    return load_model(name).scaled(hidden=hidden, intermediate=intermediate)


def _qwen_layer(E: int, layer: int, seed: int, hidden: int = H, inter: int = I
                ) -> dict[str, torch.Tensor]:
    """Qwen3-MoE / OLMoE per-expert Linear weights of one layer (HF [out, in] order)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        pre = f"model.layers.{layer}."
        out[pre + QWEN[0].format(e=e)] = torch.randn(inter, hidden, generator=g)
        out[pre + QWEN[1].format(e=e)] = torch.randn(inter, hidden, generator=g)
        out[pre + QWEN[2].format(e=e)] = torch.randn(hidden, inter, generator=g)
    return out


def _write_sharded(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Write ``{file name: tensors}`` and the index transformers writes next to them."""
    folder.mkdir(parents=True, exist_ok=True)
    wmap, total = {}, 0
    for fname, tensors in shards.items():
        save_file(tensors, str(folder / fname))
        for k, t in tensors.items():
            wmap[k] = fname
            total += t.numel() * t.element_size()
    index = folder / INDEX_NAME
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    return index


@pytest.fixture
def opened(monkeypatch):
    """The shard files each load opens (the loader's one safe_open call site)."""
    seen: list[Path] = []
    real = loaders._open_safetensors

    def spy(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(loaders, "_open_safetensors", spy)
    return seen


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


# ------------------------------------------------------------------------------ sharded
def test_index_opens_only_the_shard_of_the_layer(tmp_path, opened):
    model = _tiny("qwen3-30b-a3b")
    E = model.experts
    layer0, layer1 = _qwen_layer(E, 0, seed=1), _qwen_layer(E, 1, seed=2)
    index = _write_sharded(tmp_path / "ckpt", {
        "model-00001-of-00002.safetensors": {**layer0, "model.embed_tokens.weight":
                                             torch.randn(10, H)},
        "model-00002-of-00002.safetensors": layer1,
    })
    shard1 = index.parent / "model-00002-of-00002.safetensors"
    w = load_expert_weights(index, model, layer=1, dtype=torch.float32)
    assert opened == [shard1]
    assert w.files == (str(index), str(shard1))
    for e in (0, E - 1):
        pre = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(w.w_gate_up_EH2I[e, :, 0, :], layer1[pre + "gate_proj.weight"].T)
        assert torch.equal(w.w_gate_up_EH2I[e, :, 1, :], layer1[pre + "up_proj.weight"].T)
        assert torch.equal(w.w_down_EIH[e], layer1[pre + "down_proj.weight"].T)

    # the other shard is not needed at all: delete it, load through the directory
    (index.parent / "model-00001-of-00002.safetensors").unlink()
    opened.clear()
    w2 = load_expert_weights(index.parent, model, layer=1, dtype=torch.float32)
    assert opened == [shard1]
    assert torch.equal(w2.w_gate_up_EH2I, w.w_gate_up_EH2I)
    assert torch.equal(w2.w_down_EIH, w.w_down_EIH)


def test_layer_split_across_shards(tmp_path, opened):
    """One layer's experts in two shards (save_pretrained cuts by size): both are read."""
    model = _tiny("mixtral-8x7b")
    E = model.experts
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(E):
        for n, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            tensors[f"model.layers.4.block_sparse_moe.experts.{e}.{n}.weight"] = torch.randn(
                *shape, generator=g)
    keys = sorted(tensors)
    a, b = keys[: len(keys) // 2], keys[len(keys) // 2:]
    index = _write_sharded(tmp_path, {
        "a.safetensors": {k: tensors[k] for k in a},
        "b.safetensors": {k: tensors[k] for k in b},
        "c.safetensors": _qwen_layer(E, 9, seed=4),  # another layer: never opened
    })
    w = load_expert_weights(index, model, layer=4, dtype=torch.float32)
    assert sorted(p.name for p in opened) == ["a.safetensors", "b.safetensors"]
    for e in range(E):
        pre = f"model.layers.4.block_sparse_moe.experts.{e}."
        assert torch.equal(w.w_gate_up_EH2I[e, :, 0, :], tensors[pre + "w1.weight"].T)
        assert torch.equal(w.w_gate_up_EH2I[e, :, 1, :], tensors[pre + "w3.weight"].T)
        assert torch.equal(w.w_down_EIH[e], tensors[pre + "w2.weight"].T)


def test_directory_forms(tmp_path):
    model = _tiny("qwen3-30b-a3b")
    E = model.experts
    layer = _qwen_layer(E, 0, seed=5)
    want = load_expert_weights(_single(tmp_path / "ref", layer), model, dtype=torch.float32)

    # a directory with one consolidated file and no index
    d1 = tmp_path / "one"
    _single(d1, layer)
    got = load_expert_weights(d1, model, dtype=torch.float32)
    assert torch.equal(got.w_down_EIH, want.w_down_EIH)
    assert got.files == (str(d1 / "model.safetensors"),)

    # an index under another name (e.g. a PEFT / custom export) is found when it is the only one
    d2 = tmp_path / "other-index"
    index = _write_sharded(d2, {"x.safetensors": layer})
    index.rename(d2 / "experts.safetensors.index.json")
    got = load_expert_weights(d2, model, dtype=torch.float32)
    assert torch.equal(got.w_gate_up_EH2I, want.w_gate_up_EH2I)

    # an index file of any name ending in .json
    got = load_expert_weights(d2 / "experts.safetensors.index.json", model, dtype=torch.float32)
    assert torch.equal(got.w_gate_up_EH2I, want.w_gate_up_EH2I)

    # ambiguous or empty directories
    (d2 / "second.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="several safetensors indexes"):
        load_expert_weights(d2, model)
    d3 = tmp_path / "two-shards"
    d3.mkdir()
    save_file(layer, str(d3 / "a.safetensors"))
    save_file(layer, str(d3 / "b.safetensors"))
    with pytest.raises(ValueError) as exc:
        load_expert_weights(d3, model)
    assert str(d3) in str(exc.value) and INDEX_NAME in str(exc.value)
    assert "2 .safetensors files" in str(exc.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="0 .safetensors files"):
        load_expert_weights(tmp_path / "empty", model)


def _single(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "model.safetensors"
    save_file(tensors, str(p))
    return p


# ------------------------------------------------------------------------------ MXFP4 gpt-oss
# transformers' FP4 table (integrations/mxfp4.py FP4_VALUES): code -> value, written out here
# so the test checks common.mx against HF's convention rather than against itself.
_HF_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _hf_convention_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 blocks + [..., G] E8M0 bytes -> [..., G * 32] fp32, HF's convention:
    low nibble = even element, high nibble = odd element, value = FP4 * 2^(scale - 127)."""
    lo = _HF_FP4[(blocks & 0x0F).long()]
    hi = _HF_FP4[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return vals.flatten(-2)


def _mxfp4_pack(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize [E, out, in] with common.mx: (blocks [E, out, in/32, 16], scales uint8
    [E, out, in/32], dequantized fp32 [E, out, in])."""
    E, out, k = w_out_in.shape
    data, scale = quantize_mx(w_out_in, elem="e2m1", block_size=32, scale_rule="ocp", axis=-1)
    deq = dequantize_mx(data, scale, elem="e2m1", block_size=32, axis=-1)
    return data.reshape(E, out, k // 32, 16).contiguous(), scale.view(torch.uint8), deq


def _gpt_oss_mxfp4_tensors(E: int, seed: int = 0, layer: int = 0):
    g = torch.Generator().manual_seed(seed)
    # [E, out, in] (nn.Linear order, the order MXFP4 tensors are stored in); magnitudes spread
    # over several binades so the scales differ from group to group
    gu = torch.randn(E, 2 * MX_I, MX_H, generator=g) * torch.exp2(
        torch.randint(-4, 4, (E, 2 * MX_I, 1), generator=g).float())
    dn = torch.randn(E, MX_H, MX_I, generator=g) * 0.1
    gu_b, gu_s, gu_deq = _mxfp4_pack(gu)
    dn_b, dn_s, dn_deq = _mxfp4_pack(dn)
    pre = f"model.layers.{layer}.mlp.experts."
    tensors = {
        pre + "gate_up_proj_blocks": gu_b, pre + "gate_up_proj_scales": gu_s,
        pre + "down_proj_blocks": dn_b, pre + "down_proj_scales": dn_s,
        pre + "gate_up_proj_bias": torch.randn(E, 2 * MX_I, generator=g).bfloat16(),
        pre + "down_proj_bias": torch.randn(E, MX_H, generator=g).bfloat16(),
    }
    return tensors, gu_deq, dn_deq


def test_gpt_oss_mxfp4_round_trip(tmp_path, opened):
    model = _tiny("gpt-oss-20b", MX_H, MX_I)
    E = model.experts
    tensors, gu_deq, dn_deq = _gpt_oss_mxfp4_tensors(E, layer=2)
    pre = "model.layers.2.mlp.experts."
    # common.mx's packing is HF's: the same bytes decode to the same values both ways
    assert torch.equal(_hf_convention_decode(tensors[pre + "gate_up_proj_blocks"],
                                             tensors[pre + "gate_up_proj_scales"]), gu_deq)
    assert torch.equal(_hf_convention_decode(tensors[pre + "down_proj_blocks"],
                                             tensors[pre + "down_proj_scales"]), dn_deq)
    assert tensors[pre + "gate_up_proj_scales"].unique().numel() > 3  # many scales in play

    index = _write_sharded(tmp_path / "gpt-oss", {
        "model-00000-of-00002.safetensors": {
            "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(E, MX_H)},
        "model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if "gate_up" in k},
        "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items()
                                             if "gate_up" not in k},
    })
    w = load_expert_weights(index.parent, model, layer=2, dtype=torch.float32)
    assert sorted(p.name for p in opened) == ["model-00001-of-00002.safetensors",
                                              "model-00002-of-00002.safetensors"]
    # parameter layout (transformers GptOssExperts): gate_up_proj [E, H, 2I] = blocks'
    # [E, 2I, H] transposed, gate/up interleaved along 2I; down_proj [E, I, H]
    gu_param = gu_deq.transpose(1, 2)
    assert torch.equal(w.w_gate_up_EH2I[:, :, 0, :], gu_param[..., ::2])
    assert torch.equal(w.w_gate_up_EH2I[:, :, 1, :], gu_param[..., 1::2])
    assert torch.equal(w.w_down_EIH, dn_deq.transpose(1, 2))
    bgu = tensors[pre + "gate_up_proj_bias"].float()
    assert torch.equal(w.b_gate_up_E2I[:, 0], bgu[:, ::2])
    assert torch.equal(w.b_gate_up_E2I[:, 1], bgu[:, 1::2])
    assert torch.equal(w.b_down_EH, tensors[pre + "down_proj_bias"].float())

    # BF16 (the problem dtype) holds every MXFP4 value exactly
    wb = load_expert_weights(index, model, layer=2)
    assert wb.w_gate_up_EH2I.dtype == torch.bfloat16
    assert torch.equal(wb.w_gate_up_EH2I.float(), w.w_gate_up_EH2I)
    assert torch.equal(wb.w_down_EIH.float(), w.w_down_EIH)

    # GptOssExperts.forward's pre-activations and output before the activation's clamp
    x = torch.randn(5, MX_H)
    for e in (0, E - 1):
        gate_up = x @ gu_param[e] + bgu[e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        torch.testing.assert_close(x @ w.w_gate_up_EH2I[e, :, 0, :] + w.b_gate_up_E2I[e, 0], gate)
        torch.testing.assert_close(x @ w.w_gate_up_EH2I[e, :, 1, :] + w.b_gate_up_E2I[e, 1], up)


def test_gpt_oss_mxfp4_single_shard_and_e8m0_dtype(tmp_path):
    model = _tiny("gpt-oss-20b", MX_H, MX_I)
    """A single file, scales stored with safetensors' E8M0 dtype instead of U8."""
    tensors, gu_deq, dn_deq = _gpt_oss_mxfp4_tensors(model.experts, seed=1)
    for k in [k for k in tensors if k.endswith("_scales")]:
        tensors[k] = tensors[k].view(torch.float8_e8m0fnu)
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p))
    w = load_expert_weights(p, model, dtype=torch.float32)
    assert torch.equal(w.w_gate_up_EH2I[:, :, 0, :], gu_deq.transpose(1, 2)[..., ::2])
    assert torch.equal(w.w_gate_up_EH2I[:, :, 1, :], gu_deq.transpose(1, 2)[..., 1::2])
    assert torch.equal(w.w_down_EIH, dn_deq.transpose(1, 2))


# ------------------------------------------------------------------------------ bad input
def _qwen_index(tmp_path: Path):
    model = _tiny("qwen3-30b-a3b")
    layer = _qwen_layer(model.experts, 0, seed=6)
    keys = sorted(layer)
    index = _write_sharded(tmp_path / "ckpt", {
        "s1.safetensors": {k: layer[k] for k in keys[::2]},
        "s2.safetensors": {k: layer[k] for k in keys[1::2]},
    })
    return model, index, layer


def _edit_index(index: Path, fn) -> None:
    data = json.loads(index.read_text())
    fn(data["weight_map"])
    index.write_text(json.dumps(data))


_KEY = "model.layers.0.mlp.experts.3.up_proj.weight"


def _bad_sharded_cases():
    def missing_shard(index, model, layer):
        (index.parent / "s2.safetensors").unlink()
        return index, [str(index), "'s2.safetensors'", "not a file"]

    def unlisted_tensor(index, model, layer):
        _edit_index(index, lambda m: m.pop(_KEY))
        return index, [str(index), "layers.0.mlp.experts.3.up_proj.weight", "is missing"]

    def tensor_not_in_its_shard(index, model, layer):
        shard = index.parent / _edit_shard(index, lambda t: t.pop(_KEY))
        return index, [str(shard), _KEY, "not in this shard", str(index)]

    def wrong_shape(index, model, layer):
        def transpose(t):
            t[_KEY] = t[_KEY].T.contiguous()
        shard = index.parent / _edit_shard(index, transpose)
        return index.parent, [str(shard), _KEY, f"shape [{H}, {I}], expected [{I}, {H}]"]

    def not_json(index, model, layer):
        index.write_text('{"weight_map": {"a": "s1.safetensors",')
        return index, [str(index), "not valid JSON"]

    def not_an_object(index, model, layer):
        index.write_text("[1, 2]")
        return index, [str(index), "'weight_map' maps tensor names to shard files"]

    def no_weight_map(index, model, layer):
        index.write_text(json.dumps({"metadata": {}, "weights": {}}))
        return index.parent, [str(index), "'weight_map'"]

    def shard_not_a_name(index, model, layer):
        _edit_index(index, lambda m: m.__setitem__(_KEY, 17))
        return index, [str(index), "plain .safetensors file names"]

    def shard_outside(index, model, layer):
        _edit_index(index, lambda m: m.__setitem__(_KEY, "../other/s1.safetensors"))
        return index, [str(index), "'../other/s1.safetensors'", "plain .safetensors file names"]

    def truncated_shard(index, model, layer):
        s = index.parent / "s1.safetensors"
        s.write_bytes(s.read_bytes()[:100])
        return index, [str(s), "not a readable safetensors file"]

    return {f.__name__: f for f in (missing_shard, unlisted_tensor, tensor_not_in_its_shard,
                                     wrong_shape, not_json, not_an_object, no_weight_map,
                                     shard_not_a_name, shard_outside, truncated_shard)}


def _edit_shard(index: Path, fn) -> str:
    from safetensors.torch import load_file

    fname = json.loads(index.read_text())["weight_map"][_KEY]
    tensors = load_file(str(index.parent / fname))
    fn(tensors)
    save_file(tensors, str(index.parent / fname))
    return fname


@pytest.mark.parametrize("case", list(_bad_sharded_cases()))
def test_sharded_bad_input(tmp_path, case):
    model, index, layer = _qwen_index(tmp_path)
    target, expect = _bad_sharded_cases()[case](index, model, layer)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError) as exc:
        load_expert_weights(target, model)
    for part in expect:
        assert part in str(exc.value), (part, str(exc.value))
    assert _snapshot(tmp_path) == before  # nothing written, nothing removed


def _bad_mxfp4_cases():
    pre = "model.layers.0.mlp.experts."

    def blocks_shape(t, E):  # the packed axis is H/32 x 16 bytes; here H/16 x 8
        t[pre + "gate_up_proj_blocks"] = t[pre + "gate_up_proj_blocks"].reshape(
            E, 2 * MX_I, MX_H // 16, 8).contiguous()
        return [pre + "gate_up_proj_blocks", f"expected [{E}, {2 * MX_I}, {MX_H // 32}, 16]"]

    def scales_transposed(t, E):  # [E, H/32, 2I] instead of [E, 2I, H/32]
        t[pre + "gate_up_proj_scales"] = t[pre + "gate_up_proj_scales"].transpose(
            1, 2).contiguous()
        return [pre + "gate_up_proj_scales", "shape"]

    def blocks_not_uint8(t, E):
        t[pre + "down_proj_blocks"] = t[pre + "down_proj_blocks"].to(torch.int16)
        return [pre + "down_proj_blocks", "must be uint8"]

    def scales_float(t, E):
        t[pre + "down_proj_scales"] = t[pre + "down_proj_scales"].float()
        return [pre + "down_proj_scales", "uint8 E8M0"]

    def nan_scale(t, E):
        t[pre + "down_proj_scales"][1, 2, 0] = 255
        return [pre + "down_proj_scales", "E8M0 NaN"]

    def scales_missing(t, E):
        del t[pre + "down_proj_scales"]
        return ["layers.0.mlp.experts.down_proj_scales", "is missing"]

    def both_forms(t, E):
        t[pre + "down_proj"] = torch.zeros(E, MX_I, MX_H)
        return ["both", "down_proj_blocks"]

    def neither_form(t, E):
        del t[pre + "down_proj_scales"], t[pre + "down_proj_blocks"]
        return ["down_proj", "neither", "MXFP4"]

    return {f.__name__: f for f in (blocks_shape, scales_transposed, blocks_not_uint8,
                                     scales_float, nan_scale, scales_missing, both_forms,
                                     neither_form)}


@pytest.mark.parametrize("case", list(_bad_mxfp4_cases()))
def test_mxfp4_bad_input(tmp_path, case):
    model = _tiny("gpt-oss-20b", MX_H, MX_I)
    tensors, _, _ = _gpt_oss_mxfp4_tensors(model.experts)
    expect = _bad_mxfp4_cases()[case](tensors, model.experts)
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p))
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError) as exc:
        load_expert_weights(p, model)
    assert str(p) in str(exc.value)
    for part in expect:
        assert part in str(exc.value), (part, str(exc.value))
    assert _snapshot(tmp_path) == before


def test_mxfp4_needs_k_multiple_of_32(tmp_path):
    model = _tiny("gpt-oss-20b", MX_H, MX_I)
    tensors, _, _ = _gpt_oss_mxfp4_tensors(model.experts)
    p = tmp_path / "model.safetensors"
    save_file(tensors, str(p))
    with pytest.raises(ValueError, match="input size 48 is not a multiple of 32"):
        load_expert_weights(p, _tiny("gpt-oss-20b", 48, MX_I))


# ------------------------------------------------------------------------------ CLI
def test_cli_run_with_sharded_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)
    model = load_model("olmoe-1b-7b").shrink(16)
    E, Hh, Ii = model.experts, model.hidden, model.intermediate
    layer = {k: (v * 0.05).bfloat16() for k, v in _qwen_layer(E, 1, 8, Hh, Ii).items()}
    keys = sorted(layer)
    index = _write_sharded(tmp_path / "olmoe", {
        "model-00001-of-00002.safetensors": {k: layer[k] for k in keys[: len(keys) // 3]},
        "model-00002-of-00002.safetensors": {k: layer[k] for k in keys[len(keys) // 3:]},
    })
    rc = cli.main(["run", "--model", "olmoe-1b-7b", "--shrink", "16", "--tokens", "16",
                   "--backend", "torch", "--weights", str(index.parent), "--layer", "1",
                   "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    assert out["weights_file"] == str(index.parent) and out["layer"] == 1
    (index.parent / "model-00002-of-00002.safetensors").unlink()
    rc = cli.main(["run", "--model", "olmoe-1b-7b", "--shrink", "16", "--tokens", "16",
                   "--backend", "torch", "--weights", str(index), "--layer", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(index) in err and "model-00002-of-00002.safetensors" in err


def test_cli_save_with_sharded_directory_digests_the_shards(tmp_path, capsys, monkeypatch):
    """A bundle made from a checkpoint directory records a digest over the index and the shards
    of the layer; compare rebuilds the problem from the directory, and a changed shard is
    refused with the file named."""
    monkeypatch.setenv("COLUMNS", "400")
    model = load_model("olmoe-1b-7b").shrink(16)
    E, Hh, Ii = model.experts, model.hidden, model.intermediate
    layer = {k: (v * 0.05).bfloat16() for k, v in _qwen_layer(E, 1, 8, Hh, Ii).items()}
    keys = sorted(layer)
    index = _write_sharded(tmp_path / "olmoe", {
        "model-00001-of-00002.safetensors": {k: layer[k] for k in keys[: len(keys) // 2]},
        "model-00002-of-00002.safetensors": {k: layer[k] for k in keys[len(keys) // 2:]},
    })
    common = ["--model", "olmoe-1b-7b", "--shrink", "16", "--tokens", "16"]
    bundle = tmp_path / "b"
    rc = cli.main(["run", *common, "--backend", "torch", "--weights", str(index.parent),
                   "--layer", "1", "--save", str(bundle), "--no-reference"])
    assert rc == 0, capsys.readouterr().err
    rc = cli.main(["compare", str(bundle), "torch", "--device", "cpu", "--weights",
                   str(index.parent), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    shard = index.parent / "model-00002-of-00002.safetensors"
    changed = {k: layer[k] * 2 for k in keys[len(keys) // 2:]}
    save_file(changed, shard)
    rc = cli.main(["compare", str(bundle), "torch", "--device", "cpu", "--weights",
                   str(index.parent)])
    assert rc == 2
    assert "sha256" in capsys.readouterr().err
