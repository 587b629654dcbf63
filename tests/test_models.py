"""Tests of the model shape registry (common/models.py) and the router simulation
(common/router_sim.py)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from common.models import MoEModelShape, list_models, load_model, load_model_file, model_names
from common.router_sim import (
    ROUTER_KINDS,
    load_stats,
    route_logits,
    simulate_model_routing,
    simulate_router,
)

# The published values, typed in from each model's config.json (URLs in configs/models/*.yaml):
# name: (hidden, moe_intermediate, routed experts, top_k, shared experts, router,
#        norm_topk_prob, activation, has_bias, routed_scaling_factor, n_group, topk_group)
PUBLISHED = {
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, "topk_softmax", True, "swiglu", False, 1.0, 1, 1),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, "softmax_topk", True, "swiglu", False, 1.0, 1, 1),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0, "softmax_topk", True, "swiglu", False, 1.0, 1, 1),
    "deepseek-v3": (7168, 2048, 256, 8, 1, "sigmoid_topk", True, "swiglu", False, 2.5, 8, 4),
    "kimi-k2": (7168, 2048, 384, 8, 1, "sigmoid_topk", True, "swiglu", False, 2.827, 1, 1),
    "gpt-oss-20b": (2880, 2880, 32, 4, 0, "topk_softmax", True, "swiglu_clamped", True, 1.0, 1, 1),
    "gpt-oss-120b": (
        2880,
        2880,
        128,
        4,
        0,
        "topk_softmax",
        True,
        "swiglu_clamped",
        True,
        1.0,
        1,
        1,
    ),
    "llama-4-scout": (5120, 8192, 16, 1, 1, "topk_sigmoid", False, "swiglu", False, 1.0, 1, 1),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 0, "softmax_topk", False, "swiglu", False, 1.0, 1, 1),
}
FIELDS = (
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "shared_experts",
    "router",
    "norm_topk_prob",
    "activation",
    "has_bias",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
)

# A valid YAML body used to build malformed variants.
GOOD_YAML = """\
name: tiny
display_name: Tiny
hidden: 256
intermediate: 128
experts: 4
top_k: 2
shared_experts: 0
router: softmax_topk
norm_topk_prob: true
activation: swiglu
has_bias: false
source:
  url: https://example.org/config.json
  read: 2026-11-30
"""


# ----------------------------------------------------------------------------- model registry


def test_registry_holds_exactly_the_published_models():
    assert model_names() == sorted(PUBLISHED)
    assert [m.name for m in list_models()] == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_numbers_match_published_config(name):
    shape = load_model(name)
    assert tuple(getattr(shape, f) for f in FIELDS) == PUBLISHED[name]
    assert (shape.H, shape.I, shape.E, shape.K) == PUBLISHED[name][:4]
    assert shape.source_url.startswith("https://huggingface.co/")
    assert shape.source_read == "2026-11-30"
    assert shape.yaml_path.endswith(f"{name}.yaml")
    # Shared experts carry their width; routed-only models have none.
    assert (shape.shared_intermediate > 0) == (shape.shared_experts > 0)


def test_model_specific_details():
    oss = load_model("gpt-oss-20b")
    assert (oss.swiglu_limit, oss.swiglu_alpha) == (7.0, 1.702)
    assert oss.clamp_limits == {
        "linear_clamp_upper_limit": 7.0,
        "linear_clamp_lower_limit": -7.0,
        "non_linear_clamp_upper_limit": 7.0,
        "non_linear_clamp_lower_limit": None,
    }
    assert load_model("qwen3-30b-a3b").clamp_limits is None
    assert load_model("llama-4-scout").affinity_on == "input"
    assert load_model("deepseek-v3").affinity_on == "output"
    assert load_model("deepseek-v3").shared_intermediate == 2048
    assert load_model("llama-4-scout").shared_intermediate == 8192
    # H = I = 2880 fits MX blocks of 32 but not 128-wide tiles.
    assert oss.is_aligned(32) and not oss.is_aligned(128)
    assert all(m.is_aligned(128) for m in list_models() if not m.name.startswith("gpt-oss"))


def test_load_model_is_case_insensitive_and_cached():
    assert load_model("Qwen3-30B-A3B") is load_model("qwen3-30b-a3b")
    assert load_model("  DeepSeek-V3 ") is load_model("deepseek-v3")


def test_unknown_model_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'qwen4'") as info:
        load_model("qwen4")
    for name in PUBLISHED:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="name must be a str"):
        load_model(3)


def test_flops_and_params():
    q = load_model("qwen3-30b-a3b")
    # 12 * T * K * H * I (REFERENCE §2), typed out for T = 4096.
    assert q.flops_backward(4096) == 12 * 4096 * 8 * 2048 * 768 == 618_475_290_624
    assert q.flops_forward(4096) == 309_237_645_312
    assert q.flops_wgrad(4096) * 2 == q.flops_backward(4096)
    assert q.routed_rows(4096) == 32768
    assert q.flops_backward(0) == 0
    assert q.expert_params == 128 * 3 * 2048 * 768
    assert q.weight_bytes() == 2 * q.expert_params
    oss = load_model("gpt-oss-20b")
    assert oss.expert_params == 32 * 3 * 2880 * 2880 + 32 * (2 * 2880 + 2880)
    assert oss.weight_bytes(0.5 + 1 / 32) == math.ceil(oss.expert_params * (0.5 + 1 / 32))
    with pytest.raises(ValueError, match="num_tokens"):
        q.flops_backward(-1)
    with pytest.raises(ValueError, match="bytes_per_element"):
        q.weight_bytes(0)


def test_shapes_are_frozen():
    q = load_model("qwen3-30b-a3b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.hidden = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "factor", "expected_hi"),
    [
        ("qwen3-30b-a3b", 8, (256, 128)),  # 2048/8 = 256; 768/8 = 96 -> 128 (the minimum)
        ("gpt-oss-20b", 8, (384, 384)),  # 2880/8 = 360 -> nearest multiple 384
        ("deepseek-v3", 16, (512, 128)),  # 7168/16 = 448 = 3.5 * 128 -> half up -> 512
        ("mixtral-8x7b", 1, (4096, 14336)),
        ("gpt-oss-120b", 1, (2880, 2880)),  # shrink(1) is the identity: no rounding
    ],
)
def test_shrink_keeps_routing_and_128_multiples(name, factor, expected_hi):
    full = load_model(name)
    small = full.shrink(factor)
    assert (small.hidden, small.intermediate) == expected_hi
    if factor != 1:
        assert small.hidden % 128 == 0 and small.intermediate % 128 == 0
    for field in (
        "experts",
        "top_k",
        "router",
        "norm_topk_prob",
        "activation",
        "has_bias",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "shared_experts",
    ):
        assert getattr(small, field) == getattr(full, field)
    assert small.name == (name if factor == 1 else f"{name}/{factor}")
    with pytest.raises(ValueError, match="factor"):
        full.shrink(0)


def test_shrink_one_is_identity():
    """``shrink(1)`` changes nothing (like ``moe-bwd run`` without ``--shrink``)."""
    for name in ("gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b"):
        full = load_model(name)
        assert full.shrink(1) is full
    oss = load_model("gpt-oss-20b").shrink(1)
    assert (oss.hidden, oss.intermediate) == (2880, 2880)


def test_scaled_validates():
    q = load_model("qwen3-30b-a3b")
    s = q.scaled(hidden=128, intermediate=256)
    assert (s.H, s.I, s.E, s.K) == (128, 256, 128, 8)
    with pytest.raises(ValueError, match="'hidden'"):
        q.scaled(hidden=0)


def _write(tmp_path: Path, text: str, stem: str = "tiny") -> Path:
    p = tmp_path / f"{stem}.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_load_model_file_accepts_good_yaml(tmp_path):
    shape = load_model_file(_write(tmp_path, GOOD_YAML))
    assert (shape.name, shape.H, shape.I, shape.E, shape.K) == ("tiny", 256, 128, 4, 2)
    assert shape.source_read == "2026-11-30"


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("hidden: 256\n", "", "hidden"),  # missing
        ("hidden: 256\n", "hidden: '256'\n", "hidden"),  # string, not int
        ("hidden: 256\n", "hidden: 256.0\n", "hidden"),  # float, not int
        ("hidden: 256\n", "hidden: 0\n", "hidden"),
        ("top_k: 2\n", "top_k: 5\n", "top_k"),  # > experts
        ("router: softmax_topk\n", "router: softmax\n", "router"),
        ("norm_topk_prob: true\n", "norm_topk_prob: 1\n", "norm_topk_prob"),
        ("activation: swiglu\n", "activation: swiglu_clamped\n", "swiglu_limit"),
        ("activation: swiglu\n", "activation: gelu\n", "activation"),
        ("shared_experts: 0\n", "shared_experts: 1\n", "shared_intermediate"),
        ("has_bias: false\n", "has_bias: false\nbias: true\n", "bias"),  # unknown field
        ("has_bias: false\n", "has_bias: false\nn_group: 2\n", "n_group"),  # not sigmoid
        ("  url: https://example.org/config.json\n", "  url: example.org\n", "source.url"),
        ("  read: 2026-11-30\n", "  read: yesterday\n", "source.read"),
        ("name: tiny\n", "name: Tiny\n", "name"),
        ("name: tiny\n", "name: other\n", "name"),  # stem mismatch
    ],
)
def test_malformed_yaml_names_file_and_field(tmp_path, old, new, field):
    assert old in GOOD_YAML
    path = _write(tmp_path, GOOD_YAML.replace(old, new))
    with pytest.raises(ValueError) as info:
        load_model_file(path)
    msg = str(info.value)
    assert str(path) in msg
    assert field in msg


def test_unparsable_or_non_mapping_yaml(tmp_path):
    with pytest.raises(ValueError, match="cannot read model YAML"):
        load_model_file(_write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(ValueError, match="mapping"):
        load_model_file(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ValueError, match="cannot read"):
        load_model_file(tmp_path / "missing.yaml")


def test_shape_built_in_code_is_validated():
    good = load_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="'top_k'"):
        dataclasses.replace(good, top_k=129)
    with pytest.raises(ValueError, match="'n_group'"):
        dataclasses.replace(good, router="sigmoid_topk", n_group=3)
    with pytest.raises(ValueError, match="'affinity_on'"):
        dataclasses.replace(good, affinity_on="both")
    assert isinstance(dataclasses.replace(good, top_k=128), MoEModelShape)


# ----------------------------------------------------------------------------- router simulation


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_simulate_router_is_deterministic_for_a_seed(kind):
    a = simulate_router(300, 32, 4, seed=7, kind=kind)
    b = simulate_router(300, 32, 4, seed=7, kind=kind)
    c = simulate_router(300, 32, 4, seed=8, kind=kind)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("kind", ROUTER_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_shapes_dtypes_ranges_distinct(kind, dtype):
    T, E, K = 257, 24, 6
    idx, aff = simulate_router(T, E, K, seed=1, kind=kind, dtype=dtype)
    assert idx.shape == (T, K) and aff.shape == (T, K)
    assert idx.dtype == torch.int64 and aff.dtype == dtype
    assert idx.is_contiguous() and aff.is_contiguous()
    assert int(idx.min()) >= 0 and int(idx.max()) < E
    srt = idx.sort(dim=1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "experts must be distinct per token"
    assert bool((aff > 0).all())
    # Slots come in descending affinity order (all four functions are monotone in the logit).
    assert bool((aff.float()[:, 1:] <= aff.float()[:, :-1]).all())


@pytest.mark.parametrize(
    ("kind", "norm", "scale", "expected_sum"),
    [
        ("softmax_topk", True, 1.0, 1.0),
        ("topk_softmax", False, 1.0, 1.0),  # always sums to 1
        ("sigmoid_topk", True, 2.5, 2.5),  # DeepSeek-V3: renormalised, times 2.5
        ("softmax_topk", True, 2.0, 2.0),
    ],
)
def test_affinity_sums_when_normalised(kind, norm, scale, expected_sum):
    _, aff = simulate_router(
        500, 64, 8, seed=3, kind=kind, norm_topk_prob=norm, routed_scaling_factor=scale
    )
    torch.testing.assert_close(
        aff.sum(dim=1), torch.full((500,), expected_sum), rtol=1e-5, atol=1e-5
    )


def test_affinities_without_normalisation():
    _, aff = simulate_router(500, 64, 8, seed=3, kind="softmax_topk", norm_topk_prob=False)
    s = aff.sum(dim=1)
    assert bool((s > 0).all()) and bool((s < 1).all())
    _, aff = simulate_router(500, 16, 1, seed=3, kind="topk_sigmoid")
    assert bool((aff > 0).all()) and bool((aff < 1).all())
    _, aff = simulate_router(500, 64, 8, seed=3, kind="sigmoid_topk", norm_topk_prob=False)
    assert bool((aff < 1).all()) and bool((aff.sum(dim=1) > 1).all())  # 8 sigmoids ~0.5+


def test_route_logits_matches_hf_style_formulas():
    g = torch.Generator().manual_seed(0)
    logit = torch.randn(64, 8, generator=g, dtype=torch.float64)
    # Mixtral (HF): softmax over all experts, top-k, renormalise == top-k then softmax.
    p = torch.softmax(logit, dim=-1)
    w, i = p.topk(2, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    idx, aff = route_logits(logit, 2, kind="topk_softmax")
    assert torch.equal(idx, i)
    torch.testing.assert_close(aff, w.float(), rtol=1e-6, atol=1e-7)
    # OLMoE: softmax, top-k, no renormalisation.
    w, i = p.topk(4, dim=-1)
    idx, aff = route_logits(logit, 4, kind="softmax_topk", norm_topk_prob=False)
    assert torch.equal(idx, i)
    torch.testing.assert_close(aff, w.float(), rtol=1e-6, atol=1e-7)
    # Llama 4: top-1 logit, sigmoid.
    idx, aff = route_logits(logit, 1, kind="topk_sigmoid")
    assert torch.equal(idx[:, 0], logit.argmax(dim=-1))
    torch.testing.assert_close(aff[:, 0], torch.sigmoid(logit.max(dim=-1).values).float())


def test_group_limited_sigmoid_matches_per_token_reference():
    """DeepSeek-V3 noaux_tc selection (without correction bias), written out token by token."""
    T, E, K, G, TG, scale = 40, 32, 4, 8, 3, 2.5
    g = torch.Generator().manual_seed(5)
    logit = torch.randn(T, E, generator=g)
    idx, aff = route_logits(
        logit, K, kind="sigmoid_topk", routed_scaling_factor=scale, n_group=G, topk_group=TG
    )
    per = E // G
    for t in range(T):
        s = torch.sigmoid(logit[t]).tolist()
        group_score = [
            sum(sorted(s[gi * per : (gi + 1) * per], reverse=True)[:2]) for gi in range(G)
        ]
        groups = sorted(range(G), key=lambda gi: -group_score[gi])[:TG]
        eligible = [e for e in range(E) if e // per in groups]
        chosen = sorted(eligible, key=lambda e: -s[e])[:K]
        assert idx[t].tolist() == chosen
        total = sum(s[e] for e in chosen)
        expected = [scale * s[e] / total for e in chosen]
        assert aff[t].tolist() == pytest.approx(expected, rel=1e-5)
        assert {e // per for e in idx[t].tolist()} <= set(groups)


def _ratio(skew, seed=0, T=16384, E=64, K=8):
    idx, _ = simulate_router(T, E, K, seed=seed, skew=skew)
    return load_stats(idx, E)["max_over_mean"]


def test_skew_increases_load_imbalance():
    ratios = [_ratio(s) for s in (0.0, 0.5, 1.0, 2.0)]
    assert ratios == sorted(ratios), ratios
    assert ratios[0] < 1.2  # uniform expected load: only sampling noise (~1.04 measured)
    assert 1.5 <= ratios[2] <= 3.0  # default skew: typical trained router (~2.1 measured)
    assert ratios[3] > 3.0  # ~3.6 measured


def test_same_seed_same_hot_experts_for_any_token_count():
    # The expert bias is drawn first, so the hot set does not depend on T.
    a, _ = simulate_router(8192, 16, 2, seed=11, skew=3.0)
    b, _ = simulate_router(16384, 16, 2, seed=11, skew=3.0)
    hot_a = torch.bincount(a.flatten(), minlength=16).argmax()
    hot_b = torch.bincount(b.flatten(), minlength=16).argmax()
    assert int(hot_a) == int(hot_b)


def test_logit_scale_changes_affinities_not_selection():
    i1, a1 = simulate_router(200, 32, 4, seed=2, logit_scale=1.0)
    i2, a2 = simulate_router(200, 32, 4, seed=2, logit_scale=4.0)
    assert torch.equal(i1, i2)
    assert float(a2[:, 0].mean()) > float(a1[:, 0].mean())


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 1.0])
def test_drop_fraction_marks_exact_slot_count(fraction):
    T, E, K = 100, 16, 4
    idx, aff = simulate_router(T, E, K, seed=4, drop_fraction=fraction)
    dropped = idx == -1
    assert int(dropped.sum()) == round(fraction * T * K)
    assert bool((aff[dropped] == 0).all())
    assert bool((aff[~dropped] > 0).all())
    kept = idx[~dropped]
    assert kept.numel() == 0 or (int(kept.min()) >= 0 and int(kept.max()) < E)
    # Kept slots are the undropped routing, unchanged.
    full, _ = simulate_router(T, E, K, seed=4)
    assert torch.equal(idx[~dropped], full[~dropped])


def test_edge_cases_zero_tokens_and_k_equals_e():
    idx, aff = simulate_router(0, 8, 2, seed=0)
    assert idx.shape == (0, 2) and aff.shape == (0, 2)
    idx, aff = simulate_router(0, 8, 2, seed=0, kind="sigmoid_topk", n_group=4, topk_group=2)
    assert idx.shape == (0, 2)
    idx, aff = simulate_router(10, 6, 6, seed=0)
    assert torch.equal(idx.sort(dim=1).values, torch.arange(6).expand(10, 6))
    torch.testing.assert_close(aff.sum(dim=1), torch.ones(10))
    idx, _ = simulate_router(5, 1, 1, seed=0)
    assert torch.equal(idx, torch.zeros(5, 1, dtype=torch.int64))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": 2.0}, "num_tokens"),
        ({"num_experts": 0}, "num_experts"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 9}, "top_k"),  # > num_experts = 8
        ({"seed": -1}, "seed"),
        ({"seed": None}, "seed"),
        ({"skew": -0.1}, "skew"),
        ({"skew": float("nan")}, "skew"),
        ({"kind": "softmax"}, "kind"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
        ({"logit_scale": -1.0}, "logit_scale"),
        ({"drop_fraction": 1.5}, "drop_fraction"),
        ({"n_group": 2, "topk_group": 1}, "n_group"),  # softmax_topk has no groups
        ({"kind": "sigmoid_topk", "n_group": 3}, "n_group"),  # 3 does not divide 8
        ({"kind": "sigmoid_topk", "n_group": 4, "topk_group": 5}, "topk_group"),
        (
            {"kind": "sigmoid_topk", "n_group": 4, "topk_group": 1, "top_k": 3},
            "top_k",
        ),  # 2 eligible
        ({"dtype": torch.int64}, "dtype"),
    ],
)
def test_bad_input_names_the_argument(kwargs, argument):
    args = {"num_tokens": 16, "num_experts": 8, "top_k": 2, "seed": 0}
    args.update(kwargs)
    num_tokens, num_experts, top_k = (
        args.pop("num_tokens"),
        args.pop("num_experts"),
        args.pop("top_k"),
    )
    with pytest.raises(ValueError, match=argument):
        simulate_router(num_tokens, num_experts, top_k, **args)


def test_route_logits_rejects_bad_logits():
    with pytest.raises(ValueError, match="logit_TE"):
        route_logits(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="logit_TE"):
        route_logits(torch.zeros(4, 4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="top_k"):
        route_logits(torch.zeros(4, 4), 5)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_simulate_model_routing_for_every_model(name):
    m = load_model(name)
    idx, aff = simulate_model_routing(m, 64, seed=0)
    assert idx.shape == (64, m.top_k) and aff.shape == (64, m.top_k)
    assert int(idx.min()) >= 0 and int(idx.max()) < m.experts
    if m.norm_topk_prob:
        torch.testing.assert_close(aff.sum(dim=1), torch.full((64,), m.routed_scaling_factor))
    if m.n_group > 1:
        per = m.experts // m.n_group
        groups_used = (idx // per).sort(dim=1).values
        n_distinct = 1 + (groups_used[:, 1:] != groups_used[:, :-1]).sum(dim=1)
        assert int(n_distinct.max()) <= m.topk_group


def test_load_stats_values():
    idx = torch.tensor([[0, 1], [0, 2], [0, -1]])
    st = load_stats(idx, 4)
    assert st == {"max": 3.0, "mean": 1.25, "min": 0.0, "max_over_mean": 2.4, "empty_experts": 1.0}
    assert load_stats(torch.full((2, 2), -1), 3)["max_over_mean"] == 0.0
    with pytest.raises(ValueError, match="expert_index_TK"):
        load_stats(torch.tensor([[4]]), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_simulate_router_on_cuda():
    a = simulate_router(
        1000,
        64,
        8,
        seed=0,
        device="cuda",
        kind="sigmoid_topk",
        n_group=8,
        topk_group=4,
        dtype=torch.bfloat16,
    )
    b = simulate_router(
        1000,
        64,
        8,
        seed=0,
        device="cuda",
        kind="sigmoid_topk",
        n_group=8,
        topk_group=4,
        dtype=torch.bfloat16,
    )
    assert a[0].device.type == "cuda" and a[1].dtype == torch.bfloat16
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    srt = a[0].sort(dim=1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all())
