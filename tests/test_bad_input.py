"""Bad input to the foundation layer's public functions: a ValueError naming the argument.

Each case is (callable, regex the message must match). The regex names the offending argument
(and, where it matters, the rule). Cases marked ``xfail(strict=True, reason="BUG: ...")`` are
bugs in ``common/`` reported to its owner: they must start passing when it is fixed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.inputs import make_problem
from common.problem import ClampLimits
from common.reference import (
    grouped_wgrad_reference,
    moe_backward_reference,
    moe_forward_reference,
    reference_backward,
    reference_forward,
)
from common.routing import plan_routing
from common.torch_backward import moe_backward_torch

T, H, I, E, K = 12, 16, 8, 3, 2
NAN, INF = float("nan"), float("inf")


def bug(reason: str):  # kept for future findings
    return pytest.mark.xfail(strict=True, reason="BUG: " + reason)


@pytest.fixture(scope="module")
def P():
    return make_problem(T, H, I, E, K, seed=0, bias=True)


@pytest.fixture(scope="module")
def BW(P):
    """Blockwise arguments of the problem (block_size 4, skip padding)."""
    L = P.plan.blockwise(4)
    return {
        "x": P.hidden_states_TH.double(), "dy": P.output_grad_TH.double(),
        "wgu": P.w_gate_up_EH2I.double(), "wd": P.w_down_EIH.double(),
        "ck": L.checkpoint_from_pairs(P.act_checkpoint_R2I.double()),
        "tpti": L.token_position_to_id, "b2e": L.block_to_expert,
        "aff": L.expert_affinities_masked.double(), "B": 4, "layout": L,
    }


def bwd(bw, **over):
    a = {**bw, **over}
    kw = {k: a[k] for k in ("b_gate_up", "b_down", "padding", "affinity_option") if k in a}
    return moe_backward_reference(
        a["x"], a["dy"], a["wgu"], a["wd"], a["ck"], a["tpti"], a["b2e"], a["aff"], a["B"], **kw
    )


def fwd(bw, **over):
    a = {**bw, **over}
    return moe_forward_reference(a["x"], a["wgu"], a["wd"], a["tpti"], a["b2e"], a["aff"], a["B"])


def torch_bwd(p, **over):
    return moe_backward_torch(dataclasses.replace(p, **over))


def ref_bwd(p, **over):
    return reference_backward(dataclasses.replace(p, **over))


EI = torch.tensor([[0, 1], [1, 2], [2, -1]])
AF = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0]])


def _plan():
    return plan_routing(EI, AF, 3)


# ----------------------------------------------------------------- 1. plan_routing: ranks
RANKS = {
    "expert_index 1-D": (lambda: plan_routing(EI[0], AF[0], 3), r"expert_index.*2-D"),
    "expert_index 3-D": (lambda: plan_routing(EI[None], AF[None], 3), r"expert_index.*2-D"),
    "affinity shape": (lambda: plan_routing(EI, AF[:, :1], 3), r"affinity shape"),
    "top_k = 0": (
        lambda: plan_routing(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0), 3),
        r"expert_index.*top_k",
    ),
    "not a tensor": (lambda: plan_routing(EI.tolist(), AF, 3), r"expert_index.*torch.Tensor"),
    "affinity not a tensor": (lambda: plan_routing(EI, AF.tolist(), 3), r"affinity.*torch.Tensor"),
}
# ----------------------------------------------------------------- 2. plan_routing: dtypes
DTYPES = {
    "float expert_index": (lambda: plan_routing(EI.float(), AF, 3), r"expert_index.*integer"),
    "bool expert_index": (lambda: plan_routing(EI > 0, AF, 3), r"expert_index.*integer"),
    "int affinity": (lambda: plan_routing(EI, AF.long(), 3), r"affinity.*floating"),
    "complex affinity": (
        lambda: plan_routing(EI, AF.to(torch.complex64), 3), r"affinity.*floating"
    ),
}
# ------------------------------------------------------- 3. plan_routing: devices (meta device)
DEVICES = {
    "expert_index on meta": (
        lambda: plan_routing(EI.to("meta"), AF, 3), r"expert_index.*affinity.*one device"
    ),
    "affinity on meta": (
        lambda: plan_routing(EI, AF.to("meta"), 3), r"expert_index.*affinity.*one device"
    ),
}
# ------------------------------------------------------- 4. ids out of range, num_experts
IDS = {
    "id == E": (lambda: plan_routing(torch.tensor([[0, 3]]), AF[:1], 3), r"expert_index.*\[-1"),
    "id < -1": (lambda: plan_routing(torch.tensor([[-2, 0]]), AF[:1], 3), r"expert_index.*\[-1"),
    "num_experts 0": (lambda: plan_routing(EI, AF, 0), r"num_experts"),
    "num_experts float": (lambda: plan_routing(EI, AF, 3.0), r"num_experts"),
    "num_experts bool": (lambda: plan_routing(EI, AF, True), r"num_experts"),
}
# ------------------------------------------------------------- 5. non-finite affinities
NONFINITE = {
    f"affinity {v}": (
        (lambda v=v: plan_routing(EI, torch.tensor([[0.5, v], [0.2, 0.3], [1.0, 0.0]]), 3)),
        r"affinity.*finite",
    )
    for v in (NAN, INF, -INF)
}
# ------------------------------------------------------------- 6. block sizes / padding
BLOCKS = {
    f"block_size {b!r}": ((lambda b=b: _plan().blockwise(b)), r"block_size")
    for b in (0, -2, 1.5, True, None)
}
BLOCKS["padding"] = (lambda: _plan().blockwise(2, padding="zero"), r"padding")
# ------------------------------------------------------------- 7. alignments
ALIGNS = {
    f"align {a!r}": ((lambda a=a: _plan().grouped(align=a)), r"align") for a in (0, -16, 2.0, False)
}
# ------------------------------------------------- 8. num_blocks / max_tokens_sum options
OPTIONS = {
    "num_blocks 0": (lambda: _plan().blockwise(2, num_blocks=0), r"num_blocks"),
    "num_blocks too small": (lambda: _plan().blockwise(1, num_blocks=4), r"num_blocks=4.*too small"),
    "num_blocks float": (lambda: _plan().blockwise(2, num_blocks=6.0), r"num_blocks"),
    "max_tokens_sum not a multiple": (
        lambda: _plan().grouped(align=4, max_tokens_sum=18), r"max_tokens_sum.*multiple"
    ),
    "max_tokens_sum too small": (
        lambda: _plan().grouped(align=4, max_tokens_sum=8), r"max_tokens_sum.*too small"
    ),
    "max_tokens_sum negative": (lambda: _plan().grouped(align=4, max_tokens_sum=-4),
                                r"max_tokens_sum"),
}
# ----------------------------------------------- 9. grouped_wgrad_reference offsets
_A, _B = torch.randn(4, 10), torch.randn(10, 3)
OFFSETS = {
    "decreasing": (
        lambda: grouped_wgrad_reference(_A, _B, torch.tensor([4, 2, 10])), r"offsets.*non-decreasing"
    ),
    "negative": (
        lambda: grouped_wgrad_reference(_A, _B, torch.tensor([-1, 2, 10])), r"offsets"
    ),
    "last > tokens_sum": (
        lambda: grouped_wgrad_reference(_A, _B, torch.tensor([4, 6, 12])), r"offsets\[-1\]"
    ),
    "float offsets": (
        lambda: grouped_wgrad_reference(_A, _B, torch.tensor([4.0, 6.0, 10.0])), r"offsets.*int"
    ),
    "2-D offsets": (
        lambda: grouped_wgrad_reference(_A, _B, torch.tensor([[4, 6, 10]])), r"offsets.*1-D"
    ),
    "a 3-D": (lambda: grouped_wgrad_reference(_A[None], _B, torch.tensor([10])), r"a must be"),
    "S mismatch": (lambda: grouped_wgrad_reference(_A, _B[:9], torch.tensor([9])), r"S=10.*S=9"),
}
# ---------------------------------------------------- 10. layout helpers' shapes
HELPERS = {
    "gather_rows rows": (lambda: _plan().grouped(4).gather_rows(torch.zeros(4, 2)), r"x_TH"),
    "scatter_add_rows rows": (
        lambda: _plan().grouped(4).scatter_add_rows(torch.zeros(3, 2)), r"rows_S"
    ),
    "pad_token_rows rows": (
        lambda: _plan().blockwise(2, "zero_row").pad_token_rows(torch.zeros(2, 2)), r"x_TH"
    ),
    "checkpoint_from_pairs rank": (
        lambda: _plan().blockwise(2).checkpoint_from_pairs(torch.zeros(6, 2)), r"act_R2I"
    ),
    "checkpoint_from_pairs rows": (
        lambda: _plan().blockwise(2).checkpoint_from_pairs(torch.zeros(2, 2, 4)), r"act_R2I"
    ),
    "slot_affinity_grad shape": (
        lambda: _plan().slot_affinity_grad(torch.zeros(3, 4)), r"\[T, E\] = \[3, 3\]"
    ),
}
# ---------------------------------------------------------- 11. clamp limits
CLAMPS = {
    "lower >= upper": (
        lambda: ClampLimits(linear_clamp_lower_limit=1.0, linear_clamp_upper_limit=1.0),
        r"linear_clamp_lower_limit.*must be <.*linear_clamp_upper_limit",
    ),
    "NaN limit": (
        lambda: ClampLimits(non_linear_clamp_upper_limit=NAN), r"non_linear_clamp_upper_limit"
    ),
    "inf limit": (
        lambda: ClampLimits(non_linear_clamp_lower_limit=-INF), r"non_linear_clamp_lower_limit"
    ),
    "string limit": (lambda: ClampLimits(linear_clamp_upper_limit="7"), r"linear_clamp_upper_limit"),
}

ALL = {}
for group, cases in (
    ("ranks", RANKS), ("dtypes", DTYPES), ("devices", DEVICES), ("ids", IDS),
    ("nonfinite", NONFINITE), ("blocks", BLOCKS), ("aligns", ALIGNS), ("options", OPTIONS),
    ("offsets", OFFSETS), ("helpers", HELPERS), ("clamps", CLAMPS),
):
    for name, case in cases.items():
        ALL[f"{group}: {name}"] = case


@pytest.mark.parametrize("name", list(ALL))
def test_value_error_names_argument(name):
    fn, pattern = ALL[name]
    with pytest.raises(ValueError, match=pattern):
        fn()


# ------------------------------------- 12. reference: checkpoint and weight shapes, options


@pytest.mark.parametrize(
    "over,pattern",
    [
        ({"ck": "drop_last_block"}, r"gate_up_proj_act_checkpoint_T.*\[N, 2, I, B\]"),
        ({"ck": "swap_IB"}, r"gate_up_proj_act_checkpoint_T"),
        ({"wgu": "H-1"}, r"w_gate_up.*\[E, H=16, 2, I\]"),
        ({"wgu": "three"}, r"w_gate_up"),
        ({"wd": "E-1"}, r"w_down.*\[E, I, H\]"),
        ({"b_gate_up": "bad"}, r"b_gate_up.*\[E, 2, I\]"),
        ({"b_down": "bad"}, r"b_down.*\[E, H\]"),
        ({"x": "1-D"}, r"hidden_states.*\[T, H\]"),
        ({"x": "int"}, r"hidden_states.*floating"),
        ({"dy": "short"}, r"output_hidden_states_grad shape"),
        ({"aff": "short"}, r"expert_affinities_masked"),
        ({"b2e": "out of range"}, r"block_to_expert.*\[0, E=3\)"),
        ({"b2e": "short"}, r"block_to_expert.*N="),
        ({"tpti": "not multiple"}, r"token_position_to_id.*multiple of block_size"),
        ({"padding": "zero"}, r"padding"),
        ({"affinity_option": "on_x"}, r"affinity_option"),
        ({"B": 0}, r"block_size"),
        ({"B": 4.0}, r"block_size"),
        ({"B": -4}, r"block_size"),
        ({"tpti": "id > T"}, r"token_position_to_id"),
        ({"tpti": "id < -1"}, r"token_position_to_id"),
        ({"tpti": "float"}, r"token_position_to_id"),
        ({"aff": "int"}, r"expert_affinities_masked"),
        ({"wgu": "meta"}, r"device"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_blockwise_reference_bad_input(BW, over, pattern):
    (key, how), = over.items()
    bw = dict(BW)
    v = bw.get(key)
    if key == "ck":
        v = v[:-1] if how == "drop_last_block" else v.transpose(2, 3)
    elif key == "wgu":
        v = {"H-1": lambda: v[:, :-1], "three": lambda: torch.cat([v, v[:, :, :1]], 2),
             "meta": lambda: v.to("meta")}[how]()
    elif key == "wd":
        v = v[:-1]
    elif key == "b_gate_up":
        v = torch.zeros(E, 2, I + 1, dtype=torch.float64)
    elif key == "b_down":
        v = torch.zeros(E, H - 1, dtype=torch.float64)
    elif key == "x":
        v = v[0] if how == "1-D" else v.long()
        bw["dy"] = bw["dy"][0] if how == "1-D" else bw["dy"]
    elif key == "dy":
        v = v[:-1]
    elif key == "aff":
        v = v[:-1] if how == "short" else v.long()
    elif key == "b2e":
        v = v.clone()
        if how == "short":
            v = v[:-1]
        else:
            v[0] = E
    elif key == "tpti":
        v = v.clone()
        if how == "not multiple":
            v = v[:-1]
        elif how == "float":
            v = v.float()
        else:
            v[v == 0] = 99 if how == "id > T" else -5
    elif key in ("padding", "affinity_option", "B"):
        v = how
    bw[key] = v
    with pytest.raises(ValueError, match=pattern):
        bwd(bw)


@pytest.mark.parametrize(
    "B",
    [
        0,
        -1,
    ],
)
def test_forward_reference_block_size(BW, B):
    with pytest.raises(ValueError, match="block_size"):
        fwd(BW, B=B)


def test_forward_reference_token_positions(BW):
    with pytest.raises(ValueError, match=r"token_position_to_id.*multiple of block_size"):
        fwd(BW, tpti=BW["tpti"][:-1])
    with pytest.raises(ValueError, match=r"block_to_expert.*\[0, E=3\)"):
        fwd(BW, b2e=torch.full_like(BW["b2e"], -1))


# ------------------------------------------------ 13. plan-based reference / torch backend


def _tamper(p, how):
    if how == "ckpt rows":
        return {"act_checkpoint_R2I": p.act_checkpoint_R2I[:-1]}
    if how == "dy rows":
        return {"output_grad_TH": p.output_grad_TH[:-1]}
    if how == "w_down":
        return {"w_down_EIH": p.w_down_EIH[:, :-1]}
    if how == "w_gate_up H":
        return {"w_gate_up_EH2I": p.w_gate_up_EH2I[:, :-1]}
    if how == "b_gate_up":
        return {"b_gate_up_E2I": torch.zeros(E, 2, I - 1)}
    if how == "b_down":
        return {"b_down_EH": torch.zeros(E, H + 1)}
    if how == "plan experts":
        return {
            "w_gate_up_EH2I": torch.cat([p.w_gate_up_EH2I, p.w_gate_up_EH2I[:1]]),
            "w_down_EIH": torch.cat([p.w_down_EIH, p.w_down_EIH[:1]]),
            "b_gate_up_E2I": None, "b_down_EH": None,
        }
    if how == "plan tokens":
        return {"hidden_states_TH": p.hidden_states_TH[:-1], "output_grad_TH": p.output_grad_TH[:-1]}
    if how == "w_down meta":
        return {"w_down_EIH": p.w_down_EIH.to("meta")}
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how,pattern",
    [
        ("ckpt rows", r"act_checkpoint_R2I"),
        ("dy rows", r"output_grad_TH"),
        ("w_down", r"w_down"),
        ("w_gate_up H", r"w_gate_up"),
        ("b_gate_up", r"b_gate_up"),
        ("b_down", r"b_down"),
        ("plan experts", r"plan has E=3.*4"),
        ("plan tokens", r"plan has T=12"),
        ("w_down meta", r"device"),
    ],
)
def test_reference_backward_bad_problem(P, how, pattern):
    with pytest.raises(ValueError, match=pattern):
        ref_bwd(P, **_tamper(P, how))


@pytest.mark.parametrize(
    "how,pattern",
    [
        ("ckpt rows", r"act_checkpoint_R2I"),
        ("dy rows", r"output_grad_TH"),
        ("w_down", r"w_down"),
        ("w_gate_up H", r"w_gate_up"),
        ("b_gate_up", r"b_gate_up"),
        ("b_down", r"b_down"),
        ("plan experts", r"plan has E=3.*4"),
        ("plan tokens", r"plan has T=12"),
        ("w_down meta", r"device"),
    ],
)
def test_torch_backward_bad_problem(P, how, pattern):
    with pytest.raises(ValueError, match=pattern):
        torch_bwd(P, **_tamper(P, how))


def test_reference_forward_checks_plan(P):
    with pytest.raises(ValueError, match=r"plan has T=12"):
        reference_forward(P.hidden_states_TH[:-1], P.w_gate_up_EH2I, P.w_down_EIH, P.plan)
    with pytest.raises(ValueError, match=r"affinity_option"):
        reference_forward(
            P.hidden_states_TH, P.w_gate_up_EH2I, P.w_down_EIH, P.plan, affinity_option="x"
        )


# ------------------------------------------------------------ 14. nothing is written


def test_failed_calls_leave_inputs_untouched(BW):
    ei = torch.tensor([[0, 5], [1, 2]])
    af = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    ei0, af0 = ei.clone(), af.clone()
    with pytest.raises(ValueError):
        plan_routing(ei, af, 3)
    assert torch.equal(ei, ei0) and torch.equal(af, af0)
    a, b = torch.randn(4, 10), torch.randn(10, 3)
    offs = torch.tensor([4, 2, 10])
    snap = (a.clone(), b.clone(), offs.clone())
    with pytest.raises(ValueError):
        grouped_wgrad_reference(a, b, offs)
    assert all(torch.equal(x, y) for x, y in zip((a, b, offs), snap))
    ck = BW["ck"].clone()
    with pytest.raises(ValueError):
        bwd(BW, ck=BW["ck"][:-1])
    assert torch.equal(BW["ck"], ck)
