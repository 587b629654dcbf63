"""transformers' experts modules on our layer (``experts_implementation="moe_bwd"``,
:mod:`common.integrations.transformers`) against transformers' own ``"eager"`` and
``"grouped_mm"``: per model family (tiny configs, random init, no hub access) the loss and every
parameter gradient, a float64 run, 20 optimizer steps, expert-parallel sentinel ids, dense
[T, E] routing weights, the errors for what we cannot compute, no weight copy, and
``torch.compile(fullgraph=True)`` of a decoder layer without a recompile per token count."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

tf = pytest.importorskip("transformers")

from common.integrations import transformers as hf  # noqa: E402
from common.layer import MoEExpertsOptions, moe_experts  # noqa: E402

hf.register()

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, n_shared_experts=1, first_k_dense_replace=0)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, intermediate_size=128,
                                         moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(head_dim=16, intermediate_size=32, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                  eos_token_id=None, pad_token_id=None)),
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=8, num_experts_per_tok=2, **MLA)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                             topk_group=1, **MLA)),
    # interleaved [E, H, 2I] gate/up, biases, alpha 1.702, up + 1, clamp 7
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, intermediate_size=32, num_local_experts=4,
                                     num_experts_per_tok=2)),
}
# Families whose model-level gradients include noise-level ones (1e-11: DeepSeek-V4's router)
# or whose model is not a causal LM: their experts module alone against grouped_mm.
MODULE_FAMILIES = {
    # SwiGLU with the gate and up clamped (their _apply_gate overrides)
    "deepseek_v4": ("DeepseekV4Config", dict(head_dim=16, intermediate_size=32,
                                             num_local_experts=4, num_experts_per_tok=2)),
    "hy_v4": ("HYV4Config", dict(head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                                 num_local_experts=4, num_experts_per_tok=2, pad_token_id=None,
                                 bos_token_id=None, eos_token_id=None)),
    # [E, H, 2I] halves (is_transposed), biases, gpt-oss's activation; a token classifier
    "openai_privacy_filter": ("OpenAIPrivacyFilterConfig", dict(
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        pad_token_id=None, eos_token_id=None)),
}
# Relative L2 error of the loss / a gradient (fp32 model, BF16 GEMM operands in our layer) to
# transformers' fp32 result: BF16 has 8 mantissa bits (rel. rounding 2^-9 = 0.2 %); measured
# <= 0.8 % over these families; 3 % leaves room for other seeds and machines.
BF16_REL = 3e-2
# Against a float64 run, our error stays within this factor of transformers' own BF16 model's.
F64_FACTOR = 3.0


def _model(family, dtype=torch.float32, seed=0, **over):
    cls_name, kw = FAMILIES[family]
    cfg = getattr(tf, cls_name)(**{**TINY, **kw, **over})
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(dtype)


def _ids(T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (2, T), generator=g)


def _loss_and_grads(model, impl, ids):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                    if p.grad is not None}


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def _experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def _module_inputs(module, T=10, K=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    E, H = module.num_experts, hf.layer_weights(module)[0].shape[1]
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, idx, w


# --------------------------------------------------------------------------- every family
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_every_gradient_match_transformers(family):
    """Loss and every parameter gradient of ``"moe_bwd"`` against ``"eager"`` and
    ``"grouped_mm"`` (fp32 model), and against a float64 ``"eager"`` run no worse than
    transformers' own BF16 model (each within :data:`F64_FACTOR`)."""
    model = _model(family)
    assert _experts(model), "the family has no experts module"
    ids = _ids()
    ours = _loss_and_grads(model, "moe_bwd", ids)
    for impl in ("eager", "grouped_mm"):
        ref = _loss_and_grads(model, impl, ids)
        assert _rel(ours[0], ref[0]) < BF16_REL, impl
        assert ours[1].keys() == ref[1].keys()
        for name, g in ref[1].items():
            assert _rel(ours[1][name], g) < BF16_REL, (impl, name)
    # float64 truth; transformers' BF16 model as the yardstick of BF16 error
    exact = _loss_and_grads(copy.deepcopy(model).double(), "eager", ids)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    theirs, ours16 = (_loss_and_grads(bf16, impl, ids) for impl in ("eager", "moe_bwd"))
    for name in ("loss", *exact[1]):
        e, t, o = ((r[0] if name == "loss" else r[1][name]) for r in (exact, theirs, ours16))
        assert _rel(o, e) <= F64_FACTOR * _rel(t, e) + 1e-3, name


def test_twenty_adamw_steps_follow_grouped_mm():
    """20 AdamW steps from the same weights and batches: the same loss curve (BF16 tolerance),
    and the loss goes down."""
    curves = {}
    for impl in ("grouped_mm", "moe_bwd"):
        model = _model("qwen3_moe")
        model.set_experts_implementation(impl)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for step in range(20):
            ids = _ids(seed=step % 4)
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves[impl] = torch.tensor(curve)
    assert torch.allclose(curves["moe_bwd"], curves["grouped_mm"], rtol=BF16_REL, atol=0)
    assert curves["moe_bwd"][-4:].mean() < curves["moe_bwd"][:4].mean() - 0.5


@pytest.mark.parametrize("family", sorted(MODULE_FAMILIES))
def test_experts_module_matches_grouped_mm(family):
    """The experts module of :data:`MODULE_FAMILIES`: output and every parameter gradient of
    ``"moe_bwd"`` against transformers' grouped_mm (their clamp limits and layouts)."""
    cls_name, kw = MODULE_FAMILIES[family]
    torch.manual_seed(0)
    module = _experts(tf.AutoModel.from_config(getattr(tf, cls_name)(**{**TINY, **kw})))[0]
    limit = hf.experts_spec(module).clamp_limits.linear_clamp_upper_limit
    from transformers.integrations.moe import grouped_mm_experts_forward

    x, idx, w = _module_inputs(module)
    # pre-activations past the clamp limit on 4-66 % of the elements (3.6 % for HY-V4). Larger
    # scales put many elements within a BF16 step of the limit, where our strict mask on the
    # stored value and torch.clamp's inclusive one differ (ClampLimits): BF16 noise of both
    x = x * 100
    gate_up = torch.einsum("th,ehci->etci", x, hf.layer_weights(module)[0].detach())
    assert float((gate_up.abs() > limit).float().mean()) > 0.03
    outs = []
    for fn in (hf.experts_forward, grouped_mm_experts_forward):
        module.zero_grad()
        y = fn(module, x, idx, w)
        y.square().sum().backward()
        outs.append([y.detach()] + [p.grad.clone() for p in module.parameters()])
    for a, b in zip(*outs):
        assert _rel(a.double(), b.double()) < BF16_REL


# --------------------------------------------------------------------------- routing inputs
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sentinel_ids_contribute_nothing(family):
    """Ids >= E (transformers' expert-parallel sentinels) are dropped slots: the same output
    and gradients as -1 there, whatever their weight, and transformers' grouped_mm agrees
    (with the zero weight its router gives them)."""
    module = _experts(_model(family))[0]
    E = module.num_experts
    x, idx, w = _module_inputs(module)
    sent = idx.clone()
    sent[::3, 0] = E
    dropped = torch.where(sent >= E, -1, sent)
    outs = []
    for ids in (sent, dropped):
        xr = x.clone().requires_grad_()
        y = hf.experts_forward(module, xr, ids, w)
        gx, gw = torch.autograd.grad(y.square().sum(), [xr, module.gate_up_proj])
        outs.append((y, gx, gw))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    from transformers.integrations.moe import grouped_mm_experts_forward

    theirs = grouped_mm_experts_forward(module, x, sent, torch.where(sent >= E, 0.0, w))
    assert _rel(outs[0][0].double(), theirs.double()) < BF16_REL


def test_dense_routing_weights_are_gathered_at_the_ids():
    """[T, E] routing weights (DeepSeek-V2 style) give the result of the [T, K] ones."""
    module = _experts(_model("qwen3_moe"))[0]
    x, idx, w = _module_inputs(module)
    dense = torch.zeros(x.shape[0], module.num_experts).scatter(1, idx, w)
    assert torch.equal(hf.experts_forward(module, x, idx, dense),
                       hf.experts_forward(module, x, idx, w))


# --------------------------------------------------------------------------- what raises
def _forbid_the_layer(monkeypatch):
    def layer(*_a, **_k):
        raise AssertionError("the layer ran before the module was refused")

    monkeypatch.setattr(hf, "moe_experts", layer)


def test_non_gated_experts_raise_before_any_work(monkeypatch):
    module = _experts(_model("qwen3_moe"))[0]
    module.has_gate = False
    _forbid_the_layer(monkeypatch)
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts.*'qwen3_moe'.*non-gated"):
        hf.experts_forward(module, *_module_inputs(module))


def test_unknown_activation_raises_naming_module_family_and_activation(monkeypatch):
    model = _model("mixtral", hidden_act="gelu")
    _forbid_the_layer(monkeypatch)
    model.set_experts_implementation("moe_bwd")
    with pytest.raises(ValueError, match=r"MixtralExperts.*'mixtral'.*'gelu'"):
        model(_ids())


def test_unknown_gate_override_raises(monkeypatch):
    module = _experts(_model("qwen3_moe"))[0]

    class CustomExperts(type(module)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.relu(gate) * up

    module.__class__ = CustomExperts
    _forbid_the_layer(monkeypatch)
    with pytest.raises(ValueError, match=r"CustomExperts.*_apply_gate is not one"):
        hf.experts_forward(module, *_module_inputs(module))


@pytest.mark.parametrize("name", ["eager", "grouped_mm", "batched_mm"])
def test_register_refuses_transformers_own_names(name):
    from transformers.integrations.moe import ExpertsInterface

    before = dict(ExpertsInterface._global_mapping)
    with pytest.raises(ValueError, match=rf"name='{name}' is already an experts implementation"):
        hf.register(name)
    assert ExpertsInterface._global_mapping == before  # nothing replaced
    hf.register()  # ours, again: allowed (replaces our settings)


def test_register_does_not_import_transformers_at_package_import():
    code = ("import sys, common, common.integrations, common.integrations.transformers, "
            "common.layer; assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- no weight copy
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_gemms_read_the_parameters_own_storage(family, monkeypatch):
    """On the portable path every grouped GEMM of the forward and the backward reads the
    experts' weights from the parameters' own storage (views, no copy; gpt-oss's interleaved
    gate/up included), and the gradients land in the parameters in their own layout."""
    import common.torch_backward as tb

    model = _model(family, dtype=torch.bfloat16)
    module = _experts(model)[0]
    owned = {module.gate_up_proj.untyped_storage().data_ptr(),
             module.down_proj.untyped_storage().data_ptr()}
    seen = []
    inner = tb.grouped_mm_rows

    def spy(x, w, offs, *a, **k):
        seen.append(w.untyped_storage().data_ptr())
        return inner(x, w, offs, *a, **k)

    monkeypatch.setattr(tb, "grouped_mm_rows", spy)
    x, idx, w = _module_inputs(module)
    y = hf.experts_forward(module, x.bfloat16().requires_grad_(), idx, w,
                           base_options=MoEExpertsOptions(backend="torch"))
    y.float().square().sum().backward()
    assert len(seen) == 4 and set(seen) == owned  # gate/up, down; down^T, gate/up^T
    for p in (module.gate_up_proj, module.down_proj):
        assert p.grad.shape == p.shape and p.grad.stride() == p.stride()


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_compiles_fullgraph_without_recompiling_per_token_count(family):
    """``torch.compile(fullgraph=True, dynamic=True)`` over three token counts and fresh
    routings: no graph break, one compile, the eager result. Qwen3-MoE: a whole decoder layer
    (attention + the MoE block on ``"moe_bwd"``). gpt-oss: its MoE block (router + experts;
    interleaved views, biases, clamp): its whole decoder layer recompiles once at the second
    length under transformers 5.17 with ``"grouped_mm"`` as well (its attention, not ours)."""
    import torch._dynamo.testing

    model = _model(family)
    model.set_experts_implementation("moe_bwd")
    layer, rope = model.model.layers[0], model.model.rotary_emb

    def block(h, pe):
        if family == "gpt_oss":
            return layer.mlp(h)
        return layer(h, position_embeddings=pe, attention_mask=None)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter, dynamic=True)
    for T in (8, 12, 20):
        h = torch.randn(1, T, TINY["hidden_size"], generator=torch.Generator().manual_seed(T))
        pe = rope(h, torch.arange(T)[None])
        got, want = compiled(h, pe), block(h, pe)
        got, want = (o[0] if isinstance(o, tuple) else o for o in (got, want))
        assert torch.equal(got, want)
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- the benchmark
def test_bench_hf_experts_cpu_smoke(tmp_path):
    """``benchmarks/bench_hf_experts.py`` on a tiny shape on the CPU: every selected row times
    (SonicMoE says why it is skipped), the ratios are filled, the JSON is written."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_hf_experts.py"
    spec = importlib.util.spec_from_file_location("bench_hf_experts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "hf.json"
    impls = ["moe_bwd", "grouped_mm", "layer", "sonicmoe", "decoder-moe_bwd", "decoder-grouped_mm"]
    rc = bench.main(["--device", "cpu", "--shrink", "16", "--tokens", "32", "--seq", "16",
                     "--reps", "1", "--shapes", "qwen3-30b-a3b:32:e8", "--impls", ",".join(impls),
                     "--json", str(out)])
    assert rc == 0
    rows = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(impls)
    assert rows["sonicmoe"]["status"].startswith("skipped: ")
    for key in set(impls) - {"sonicmoe"}:
        assert "status" not in rows[key], rows[key]
        assert all(rows[key][f"{c}_ms"] > 0 for c in ("fwd", "bwd", "step"))
    assert rows["grouped_mm"]["vs_grouped_mm"] == pytest.approx(1.0)
    assert rows["moe_bwd"]["vs_moe_experts"] > 0
    assert rows["decoder-moe_bwd"]["vs_grouped_mm"] > 0
    assert rows["decoder-moe_bwd"]["vs_moe_experts"] is None


def _llama4(seed=0):
    cfg = tf.Llama4TextConfig(**TINY, head_dim=16, intermediate_size=32, intermediate_size_mlp=64,
                              num_local_experts=4, num_experts_per_tok=1,
                              interleave_moe_layer_step=1)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def test_llama4_experts_on_our_layer_match_transformers(monkeypatch):
    """Llama 4's experts are outside transformers' interface: ``experts_implementation`` does
    not reach them (our function is never called), ``use_for_llama4`` does: the loss and every
    gradient against transformers' own block (router and shared expert untouched)."""
    model = _llama4()
    ids = _ids()
    calls = []
    monkeypatch.setattr(hf, "moe_experts", lambda *a, **k: calls.append(1) or moe_experts(*a, **k))
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    ref = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert not calls
    assert hf.use_for_llama4(model) == TINY["num_hidden_layers"]
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert len(calls) == TINY["num_hidden_layers"]
    assert _rel(loss.double(), ref[0].double()) < BF16_REL
    for name, p in model.named_parameters():
        assert _rel(p.grad.double(), ref[1][name].double()) < BF16_REL, name


# --------------------------------------------------------------------------- on the GPU
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# H, I on the kernels' 128 grid; a few experts
GPU_SHAPE = dict(hidden_size=256, head_dim=64)
GPU_EXPERTS = {"qwen3_moe": dict(moe_intermediate_size=128), "mixtral": dict(intermediate_size=128),
               "gpt_oss": dict(intermediate_size=128)}
_COPY_OPS = ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::cat", "aten::contiguous")


def _gpu_model(family):
    return _model(family, dtype=torch.bfloat16, **GPU_SHAPE, **GPU_EXPERTS[family]).cuda()


@gpu
@needs_cuda
@pytest.mark.parametrize("family", sorted(GPU_EXPERTS))
def test_gpu_model_matches_grouped_mm(family):
    """The fused GPU path (backend "auto") under a BF16 model: loss and every gradient against
    transformers' grouped_mm, and both against a float64 eager run (as on the CPU)."""
    model = _gpu_model(family)
    ids = _ids(T=64).cuda()
    ours, theirs = (_loss_and_grads(model, impl, ids) for impl in ("moe_bwd", "grouped_mm"))
    exact = _loss_and_grads(copy.deepcopy(model).double(), "eager", ids)
    for name in ("loss", *exact[1]):
        e, t, o = ((r[0] if name == "loss" else r[1][name]) for r in (exact, theirs, ours))
        assert _rel(o, e) <= F64_FACTOR * _rel(t, e) + 1e-3, name


def _weight_sized_copies(module, step) -> list[str]:
    """Copy-like ops of one ``step()`` whose input has a weight's number of elements."""
    sizes = {module.gate_up_proj.numel(), module.down_proj.numel()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        if ev.name in _COPY_OPS:
            for shape in ev.input_shapes:
                if shape and torch.Size(shape).numel() in sizes:
                    out.append(f"{ev.name}{shape}")
    return out


@gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_gpu_step_copies_no_weight(family):
    """One training step of the experts module on the fused GPU path: no copy, clone, cast or
    concatenation of a weight-sized tensor (neither the weights nor their gradients'
    re-layout): the kernels read transformers' parameters in place."""
    module = _experts(_gpu_model(family))[0]
    x, idx, w = (t.cuda() for t in _module_inputs(module, T=64))
    x = x.bfloat16().requires_grad_()

    def step():
        module.zero_grad(set_to_none=True)
        hf.experts_forward(module, x, idx, w).float().square().sum().backward()

    step()  # compiles the kernels
    assert _weight_sized_copies(module, step) == []
