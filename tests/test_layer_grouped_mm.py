"""The layer's ``grouped_mm`` option (``MoEExpertsOptions.grouped_mm``: ``"auto"`` | ``"cublas"`` |
``"ours"`` | ``"ours-gemm"``): the fused grouped-GEMM kernels of ``cuda_kernels.grouped_mm``
(gather + gate/up GEMM + activation in the forward, gather + down dgrad + activation backward in
the backward) and their gathering GEMM alone (the activation passes after it) against today's
cuBLAS path, the option's plumbing from the module to the fused forward and backward
(eager, ``opcheck``, ``torch.compile(fullgraph=True)``), its errors, and the ``"auto"`` table
``configs/cuda/grouped_mm_choice.yaml``.

Without a GPU the Triton passes run in Triton's interpreter on CPU tensors (tests/conftest.py)
and the fused kernel's torch twin stands in for it; with an SM90 GPU both paths run their
kernels. The two paths round the same BF16 operands; the fused one skips the BF16 rounding of
the gate/up pre-activation (forward) and of ``dh_raw`` (backward), so they agree to the
fused-vs-twin bar of tests/test_fused_backward.py (45 dB), and each reaches the SQNR table's
floor against float64.
"""

from __future__ import annotations

import dataclasses

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_layer_forward import _layer_args  # the layer op's seeded arguments
from test_torch_backward import routing  # the same seeded router as the twin's tests

from common import dispatch
from common.inputs import make_problem
from common.layer import MoEExperts, MoEExpertsOptions
from common.metrics import sqnr_db, sqnr_floor
from common.problem import GPT_OSS, ClampLimits
from common.reference import reference_backward, reference_forward

choice = pytest.importorskip("cuda_kernels.moe.grouped_mm_choice")
from cuda_kernels import grouped_mm as gmm  # noqa: E402
from cuda_kernels.moe import moe_backward_fused  # noqa: E402
from cuda_kernels.moe import moe_forward_fused  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parent.parent
TWIN_MIN_DB = 45.0  # tests/test_fused_backward.py's fused-vs-twin bar
CLAMP = ClampLimits(
    linear_clamp_upper_limit=1.0, linear_clamp_lower_limit=-1.0, non_linear_clamp_upper_limit=1.0
)
CASES = {
    # name: (T, H, I, E, K, routing kwargs, bias, clamp, activation); sizes multiples of 8 (the
    # kernel's rule), expert 1 empty, every expert's rows padded to the layout's 16-row groups
    "swiglu": (40, 64, 32, 4, 2, {"empty": (1,), "drop_frac": 0.1}, False, None, None),
    "gpt_oss": (32, 64, 48, 4, 2, {"empty": (2,), "dup_token": 0}, True, CLAMP, GPT_OSS),
}


def _problem(name, seed=0, device=DEV):
    """``(problem, (expert_index_TK, affinity_TK))``: the case's MoEBackwardProblem and the
    router output it was planned from (duplicate ids and dropped slots), for the forward."""
    T, H, I, E, K, rkw, bias, clamp, act = CASES[name]
    ei, af = routing(T, K, E, seed + 5, **rkw)
    p = make_problem(T, H, I, E, K, seed=seed, bias=bias, clamp_limits=clamp,
                     expert_index=ei, affinity=af, device=device, activation=act)
    return p, (ei.to(device), af.to(device))


def _forward_args(p, rt):
    ei, af = rt
    return (p.hidden_states_TH, af, ei, p.w_gate_up_EH2I, p.w_down_EIH, p.b_gate_up_E2I,
            p.b_down_EH)


def _kw(p):
    return {"clamp_limits": p.clamp_limits, "activation": p.activation}


@pytest.fixture
def table(monkeypatch):
    """Replace the "auto" table: ``table(rows)`` with ``rows`` {(E|None, H, I): {step: impl}};
    the pick cache is emptied (and restored afterwards)."""

    def use(rows):
        parsed = {"default": dict.fromkeys(choice.STEPS, "cublas"), **rows}
        monkeypatch.setattr(choice, "grouped_mm_table", lambda: parsed)
        monkeypatch.setattr(choice, "_CHOICE", {})

    monkeypatch.setattr(choice, "_CHOICE", {})
    return use


# ------------------------------------------------------------- fused entries: ours vs cublas
OURS = ("ours", "ours-gemm")  # the grouped_mm values that run our kernels


@pytest.mark.parametrize("impl", OURS)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_ours_matches_cublas(name, impl):
    """Same layout, bitwise the same X rows (the side-written x_S is gather_rows' output), y and
    the checkpoint within one BF16 rounding of the pre-activation; both at the float64 floors."""
    p, rt = _problem(name)
    args = _forward_args(p, rt)
    want = moe_forward_fused(*args, **_kw(p), grouped_mm="cublas")
    got = moe_forward_fused(*args, **_kw(p), grouped_mm=impl)
    lay = got.layout
    assert bool((lay.row_to_pair_S < 0).any()), "the case must have padding rows"
    assert bool((torch.diff(lay.offsets_E, prepend=lay.offsets_E.new_zeros(1)) == 0).any())
    for f in ("offsets_E", "row_to_token_S", "row_to_pair_S", "slot_to_row_TK"):
        assert torch.equal(getattr(lay, f), getattr(want.layout, f)), f
    assert torch.equal(got.x_rows_S, want.x_rows_S)
    assert not bool(got.x_rows_S[lay.row_to_pair_S < 0].any())  # padding rows exactly 0
    assert got.y_TH.dtype == want.y_TH.dtype
    assert sqnr_db(got.y_TH.double().cpu(), want.y_TH.double().cpu()) >= TWIN_MIN_DB
    got_ck, want_ck = (o.checkpoint_pairs().double().cpu() for o in (got, want))
    assert sqnr_db(got_ck, want_ck) >= TWIN_MIN_DB
    n = int(p.plan.num_pairs)
    assert not bool(got.checkpoint_pairs()[n:].any())
    f64 = {k: (v.double().cpu() if v is not None else None) for k, v in (
        ("x", p.hidden_states_TH), ("wgu", p.w_gate_up_EH2I), ("wd", p.w_down_EIH),
        ("bgu", p.b_gate_up_E2I), ("bd", p.b_down_EH))}
    cpu_plan = dataclasses.replace(p.plan, **{
        f.name: getattr(p.plan, f.name).cpu() for f in dataclasses.fields(p.plan)
        if isinstance(getattr(p.plan, f.name), torch.Tensor)})
    y_ref, _ = reference_forward(f64["x"], f64["wgu"], f64["wd"], cpu_plan,
                                 b_gate_up_E2I=f64["bgu"], b_down_EH=f64["bd"], **_kw(p))
    for out in (got, want):
        assert sqnr_db(out.y_TH.double().cpu(), y_ref) >= sqnr_floor("fused", "y")


@pytest.mark.parametrize("impl", OURS)
@pytest.mark.parametrize("name", list(CASES))
def test_backward_ours_matches_cublas(name, impl):
    """Every gradient (dA and the bias grads included) within the fused-vs-twin bar of today's
    path, and at the float64 floor; the down-bias grad (a column sum of the dY rows, which the
    side output makes bitwise gather_rows') comes out identical, and on CPU dW_down too (a*h
    of the twin and of the Triton pass agree bit for bit there)."""
    p, rt = _problem(name)
    want = moe_backward_fused(p, grouped_mm="cublas")
    got = moe_backward_fused(p, grouped_mm=impl)
    assert want.info["grouped_mm"] == "cublas" and got.info["grouped_mm"] == impl
    ref = reference_backward(_cpu(p))
    for key, out in got.named().items():
        w = want.named()[key]
        assert out.dtype == w.dtype and out.shape == w.shape, key
        assert sqnr_db(out.double().cpu(), w.double().cpu()) >= TWIN_MIN_DB, key
        assert sqnr_db(out.cpu(), ref.named()[key]) >= sqnr_floor("fused", key), key
    if DEV == "cpu":  # the twin's a*h is the Triton pass's bit for bit; the kernel's may not be
        assert torch.equal(got.w_down_grad_EIH, want.w_down_grad_EIH)
    if p.has_bias:
        assert torch.equal(got.b_down_grad_EH, want.b_down_grad_EH)
    # dA: a dense [T, E] cell per pair, 0 where a token is not routed to the expert
    dA = got.affinity_grad_TE
    routed = torch.zeros_like(dA, dtype=torch.bool)
    n = int(p.plan.num_pairs)
    routed[p.plan.pair_token_R[:n], p.plan.pair_expert_R[:n]] = True
    assert not bool(dA[~routed].any()) and not bool(want.affinity_grad_TE[~routed].any())


def _cpu(p):
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    out = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    out["plan"] = dataclasses.replace(p.plan, **{
        f.name: getattr(p.plan, f.name).cpu() for f in dataclasses.fields(p.plan)
        if isinstance(getattr(p.plan, f.name), torch.Tensor)})
    return dataclasses.replace(p, **out)


@pytest.mark.parametrize("impl", OURS)
def test_backward_ours_with_the_forward_rows_and_fp32_dy(impl):
    """The layer's use: the forward's layout and X rows reused, dY in fp32 (an fp32 layer):
    the bias term of dA reads the BF16 dY rows on both paths, as the wgrads do."""
    p, rt = _problem("gpt_oss")
    fwd = moe_forward_fused(*_forward_args(p, rt), **_kw(p), grouped_mm=impl)
    q = dataclasses.replace(p, output_grad_TH=p.output_grad_TH.float() * 1.3)
    kw = {"layout": fwd.layout, "x_rows_S": fwd.x_rows_S}
    want = moe_backward_fused(q, grouped_mm="cublas", **kw)
    got = moe_backward_fused(q, grouped_mm=impl, **kw)
    for key, out in got.named().items():
        assert sqnr_db(out.double().cpu(), want.named()[key].double().cpu()) >= TWIN_MIN_DB, key
    assert torch.equal(got.b_down_grad_EH, want.b_down_grad_EH)


# ----------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", ["fast", "Ours", "", None, 1])
def test_grouped_mm_option_value_error(bad):
    with pytest.raises(ValueError, match="grouped_mm must be one of"):
        MoEExpertsOptions(grouped_mm=bad)
    with pytest.raises(ValueError, match="grouped_mm must be one of"):
        MoEExperts(2, 16, 8, grouped_mm=bad)
    p, rt = _problem("swiglu")
    with pytest.raises(ValueError, match="grouped_mm must be one of"):
        moe_forward_fused(*_forward_args(p, rt), grouped_mm=bad)
    with pytest.raises(ValueError, match="grouped_mm must be one of"):
        moe_backward_fused(p, grouped_mm=bad)


def test_grouped_mm_option_checked_where_no_kernel_can_load():
    """The option's declaration imports neither triton nor CuTe DSL: in a process where neither
    can be imported, a bad value still fails when the options are built."""
    code = (
        "import sys; sys.modules['triton'] = sys.modules['cutlass'] = None\n"
        "from common.layer import MoEExperts\n"
        "try:\n    MoEExperts(2, 16, 8, grouped_mm='fast')\n"
        "except ValueError as e:\n    print(e)\n"
        "MoEExperts(2, 16, 8, grouped_mm='ours')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cuda_kernels.moe.', 'triton'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.splitlines()
    assert out == [
        "grouped_mm must be one of ('auto', 'cublas', 'ours', 'ours-gemm'), got 'fast'",
        "['cuda_kernels.moe.grouped_mm_choice', 'triton']",  # (sys.modules['triton'] = None)
    ]


def test_grouped_mm_option_values_and_backend_options():
    GROUPED_MM = choice.GROUPED_MM
    assert GROUPED_MM == ("auto", "cublas", "ours", "ours-gemm")
    assert choice.IMPLS == GROUPED_MM[1:]
    # the CUDA backends declare the option; the layer finds it through the dispatcher
    assert dispatch.layer_option("grouped_mm") is choice.GROUPED_MM_OPTION
    assert choice.GROUPED_MM_OPTION.default == "auto"
    backends = dispatch.registered_backends()
    for name in ("cuda-sm90", "cuda-sm100"):
        assert backends[name].options == (choice.GROUPED_MM_OPTION,) and backends[name].layer_state
    for name in ("torch", "reference"):
        assert backends[name].options == () and not backends[name].layer_state
    for v in GROUPED_MM:
        assert MoEExpertsOptions(grouped_mm=v).grouped_mm == v
    assert MoEExpertsOptions(grouped_mm="ours") != MoEExpertsOptions()
    assert "grouped_mm='ours'" in repr(MoEExperts(2, 16, 8, grouped_mm="ours"))
    assert "grouped_mm" not in repr(MoEExperts(2, 16, 8))
    with pytest.raises(ValueError, match=r"backend_options must not set grouped_mm"):
        MoEExpertsOptions(backend_options=(("grouped_mm", "ours"),))


def _sliced_w_gate_up(p):
    """w_gate_up as the first H rows of an [E, H + 8, 2, I] tensor: after the [E, H, 2I] view
    neither N- nor K-major (the fused kernel's two weight layouts); cuBLAS's path takes it."""
    E, H, _, I = p.w_gate_up_EH2I.shape
    big = torch.zeros(E, H + 8, 2, I, dtype=p.w_gate_up_EH2I.dtype, device=DEV)
    big[:, :H] = p.w_gate_up_EH2I
    return big[:, :H]


def test_ours_where_the_kernel_cannot_run_is_a_runtime_error_and_auto_falls_back(table):
    p, rt = _problem("swiglu")
    E, H, _, I = p.w_gate_up_EH2I.shape
    table({(E, H, I): dict.fromkeys(choice.STEPS, "ours")})
    args = list(_forward_args(p, rt))
    args[3] = _sliced_w_gate_up(p)
    for impl in OURS:
        with pytest.raises(RuntimeError, match=rf"grouped_mm='{impl}' cannot run the "
                           r"forward_gate_up step: w_gate_up \[E, H, 2I\] has strides"):
            moe_forward_fused(*args, grouped_mm=impl)
    want = moe_forward_fused(*_forward_args(p, rt), grouped_mm="cublas")
    got = moe_forward_fused(*args, grouped_mm="auto")  # the table says ours: cuBLAS instead
    assert torch.equal(got.y_TH, want.y_TH)
    assert torch.equal(got.checkpoint_pairs(), want.checkpoint_pairs())
    table({(E, H, I): dict.fromkeys(choice.STEPS, "ours-gemm")})
    got = moe_forward_fused(*args, grouped_mm="auto")  # likewise for the gathering GEMM
    assert torch.equal(got.y_TH, want.y_TH)
    assert torch.equal(got.checkpoint_pairs(), want.checkpoint_pairs())
    table({(E, H, I): dict.fromkeys(choice.STEPS, "ours")})
    # the backward's kernel reads a contiguous BF16 checkpoint
    q = dataclasses.replace(p, act_checkpoint_R2I=p.act_checkpoint_R2I.float())
    with pytest.raises(RuntimeError, match=r"backward_down_dgrad step: the checkpoint act_R2I "
                                           r"must be contiguous torch.bfloat16"):
        moe_backward_fused(q, grouped_mm="ours")
    g = moe_backward_fused(q, grouped_mm="auto")
    assert g.info["grouped_mm"] == "cublas"
    # the gathering GEMM alone does not read the checkpoint: it takes any float one
    assert moe_backward_fused(q, grouped_mm="ours-gemm").info["grouped_mm"] == "ours-gemm"


@gpu
@needs_cuda
def test_gpu_ours_refused_off_the_kernel_and_auto_takes_cublas(table):
    """On a GPU the kernel's own rules count: I not a multiple of 8 (and any non-SM90 GPU); the
    gathering GEMM alone needs only its N (2I forward, I backward) a multiple of 8."""
    T, H, I, E, K = 32, 64, 20, 4, 2
    ei, af = routing(T, K, E, 3)
    p = make_problem(T, H, I, E, K, seed=1, expert_index=ei, affinity=af, device="cuda")
    rt = (ei.cuda(), af.cuda())
    table({(E, H, I): dict.fromkeys(choice.STEPS, "ours")})
    major, _ = torch.cuda.get_device_capability()
    why = "multiples? of 8" if major == 9 else "not an SM90 GPU"
    with pytest.raises(RuntimeError, match=f"forward_gate_up step: .*{why}"):
        moe_forward_fused(*_forward_args(p, rt), grouped_mm="ours")
    for impl in OURS:
        with pytest.raises(RuntimeError, match=f"backward_down_dgrad step: .*{why}"):
            moe_backward_fused(p, grouped_mm=impl)
    want = moe_forward_fused(*_forward_args(p, rt), grouped_mm="cublas")
    got = moe_forward_fused(*_forward_args(p, rt), grouped_mm="auto")
    assert torch.equal(got.y_TH, want.y_TH)
    if major == 9:  # the plain GEMM's rule is on N = 2I = 40 (a multiple of 8): it runs
        got = moe_forward_fused(*_forward_args(p, rt), grouped_mm="ours-gemm")
        assert sqnr_db(got.y_TH.double().cpu(), want.y_TH.double().cpu()) >= TWIN_MIN_DB
    assert moe_backward_fused(p, grouped_mm="auto").info["grouped_mm"] == "cublas"


# ------------------------------------------------------------------------------ auto table
def test_shipped_table_parses_and_lists_every_shipped_model():
    from common.models import list_models

    t = choice.grouped_mm_table()
    fields = {*choice.STEPS, choice.WGRAD_GATHER}
    assert set(t["default"]) == fields
    for key, row in t.items():
        assert set(row) == fields, key
        assert {row[s] for s in choice.STEPS} <= set(choice.IMPLS), key
        assert isinstance(row[choice.WGRAD_GATHER], bool), key
    assert t["default"][choice.WGRAD_GATHER] is False  # a shape gathers where it measured a win
    for m in list_models():
        assert (m.experts, m.hidden, m.intermediate) in t, m.name


def test_table_wgrad_gather_is_parsed_and_checked():
    rows = {"default": {"forward_gate_up": "cublas", "backward_down_dgrad": "cublas",
                        "wgrad_gather": True},
            "shapes": [{"experts": 4, "hidden": 64, "intermediate": 32,
                        "forward_gate_up": "cublas", "backward_down_dgrad": "cublas"},
                       {"experts": 8, "hidden": 64, "intermediate": 32, "wgrad_gather": False,
                        "forward_gate_up": "cublas", "backward_down_dgrad": "cublas"}]}
    t = choice._parse_table(rows, "t.yaml")
    assert t[(4, 64, 32)][choice.WGRAD_GATHER] is True  # the default's
    assert t[(8, 64, 32)][choice.WGRAD_GATHER] is False
    bad = {**rows, "default": {**rows["default"], "wgrad_gather": "yes"}}
    with pytest.raises(ValueError, match="t.yaml: default: wgrad_gather must be true or false"):
        choice._parse_table(bad, "t.yaml")


def test_auto_reads_the_table(table, monkeypatch):
    p, rt = _problem("gpt_oss")
    E, H, _, I = p.w_gate_up_EH2I.shape
    calls = []
    for entry in ("gate_up_forward", "down_dgrad_backward", "grouped_mm_gather"):
        real = getattr(gmm, entry)

        def spy(*a, _real=real, _name=entry, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(gmm, entry, spy)

    table({})  # the default row: cublas
    moe_forward_fused(*_forward_args(p, rt), **_kw(p))
    assert moe_backward_fused(p).info["grouped_mm"] == "cublas" and calls == []
    table({(E, H, I): {"forward_gate_up": "ours", "backward_down_dgrad": "cublas"}})
    moe_forward_fused(*_forward_args(p, rt), **_kw(p))
    assert moe_backward_fused(p).info["grouped_mm"] == "cublas"
    assert calls == ["gate_up_forward"]
    table({(None, H, I): {"forward_gate_up": "cublas", "backward_down_dgrad": "ours"}})
    moe_forward_fused(*_forward_args(p, rt), **_kw(p))
    assert moe_backward_fused(p).info["grouped_mm"] == "ours"
    assert calls == ["gate_up_forward", "down_dgrad_backward"]
    table({(E, H, I): dict.fromkeys(choice.STEPS, "ours-gemm")})
    moe_forward_fused(*_forward_args(p, rt), **_kw(p))
    assert moe_backward_fused(p).info["grouped_mm"] == "ours-gemm"
    assert calls[2:] == ["grouped_mm_gather"] * 2
    # an explicit choice ignores the table
    assert moe_backward_fused(p, grouped_mm="cublas").info["grouped_mm"] == "cublas"


def test_table_lookup_order_and_cache(table):
    ours, cub = dict.fromkeys(choice.STEPS, "ours"), dict.fromkeys(choice.STEPS, "cublas")
    table({(8, 64, 32): cub, (None, 64, 32): ours})
    assert choice.table_choice("forward_gate_up", 8, 64, 32) == "cublas"  # exact E first
    assert choice.table_choice("forward_gate_up", 4, 64, 32) == "ours"  # then any E
    assert choice.table_choice("forward_gate_up", 4, 64, 48) == "cublas"  # then the default
    p, rt = _problem("swiglu")
    args = _forward_args(p, rt)
    moe_forward_fused(*args, grouped_mm="auto")
    n = len(choice._CHOICE)
    assert n == 1
    moe_forward_fused(*args, grouped_mm="auto")  # same operands: the cached pick
    assert len(choice._CHOICE) == n


@pytest.mark.parametrize(
    "doc, match",
    [
        ([], "must be a mapping"),
        ({"default": {"forward_gate_up": "cublas"}}, "default must map exactly"),
        ({"default": {"forward_gate_up": "cublas", "backward_down_dgrad": "fast"}},
         r"default: backward_down_dgrad must be one of \('cublas', 'ours', 'ours-gemm'\), "
         r"got 'fast'"),
        ({"default": dict.fromkeys(choice.STEPS, "cublas"),
          "shapes": [{"hidden": 64, "intermediate": 0, **dict.fromkeys(choice.STEPS, "ours")}]},
         r"shapes\[0\]: intermediate must be an int >= 1"),
        ({"default": dict.fromkeys(choice.STEPS, "cublas"),
          "shapes": [{"model": "m", "hidden": 64, "intermediate": 32, "forward_gate_up": "ours"}]},
         r"shapes\[0\] \(m\): backward_down_dgrad must be one of"),
        ({"default": dict.fromkeys(choice.STEPS, "cublas"),
          "shapes": [{"hidden": 64, "intermediate": 32, "tokens": 4,
                      **dict.fromkeys(choice.STEPS, "ours")}]}, r"unknown keys \['tokens'\]"),
        ({"default": dict.fromkeys(choice.STEPS, "cublas"),
          "shapes": [{"experts": 4, "hidden": 64, "intermediate": 32,
                      **dict.fromkeys(choice.STEPS, "ours")}] * 2}, "listed twice"),
    ],
)
def test_table_errors_name_the_file_and_entry(doc, match):
    with pytest.raises(ValueError, match=match) as err:
        choice._parse_table(doc, "the.yaml")
    assert str(err.value).startswith("the.yaml: ")


# ----------------------------------------------------- the layer: module -> forward/backward
@pytest.fixture
def cuda_backend(monkeypatch):
    """A stand-in ``cuda-sm90`` backend running the fused forward and backward here (the CPU
    under Triton's interpreter, or the GPU); records the ``grouped_mm`` each received."""
    dispatch.registered_backends()
    seen = {"forward": [], "run": []}

    def forward(*args, **kwargs):
        seen["forward"].append(kwargs["grouped_mm"])
        return moe_forward_fused(*args, **kwargs)

    def run(problem, **options):
        seen["run"].append(options["grouped_mm"])
        grads = moe_backward_fused(problem, **options)
        seen["run"].append(grads.info["grouped_mm"])
        return grads

    fake = dataclasses.replace(dispatch.registered_backends()["cuda-sm90"], check=lambda: None,
                               run=run, forward=forward)
    monkeypatch.setitem(dispatch._REGISTRY, "cuda-sm90", fake)
    return seen


def _layer_step(m, x, idx, aff, dy):
    """test_layer_forward's step (forward + backward, grads cleared first), its outputs named."""
    from test_layer_forward import _step

    y, dx, da, *grads = _step(m, x, idx, aff, dy)
    return {"y": y, "dX": dx, "dA": da, **dict(zip(dict(m.named_parameters()), grads))}


def _clamp_flips(p, rt, impl):
    """Where the two paths' forward checkpoints lie on different sides of a clamp limit (the
    values differ by one BF16 ulp at most, but there the derivative mask flips 0 <-> 1): the
    dX rows (tokens) and the (expert, column) pairs of dW_gate_up / dB_gate_up such a flip
    reaches. ``(token mask [T], expert-column mask [E, I], flips, checked elements)``."""
    x, aff, idx, wgu, wd, bgu, bd = _forward_args(p, rt)
    fwd = {gm: moe_forward_fused(x, aff, idx, wgu, wd, bgu, bd, grouped_mm=gm, **_kw(p))
           for gm in ("cublas", impl)}
    a, b = fwd["cublas"].checkpoint_pairs(), fwd[impl].checkpoint_pairs()
    cl = p.clamp_limits
    flip_RI = (cl.gate_mask(a[:, 0]) != cl.gate_mask(b[:, 0])) | (
        cl.up_mask(a[:, 1]) != cl.up_mask(b[:, 1]))
    plan = fwd["cublas"].plan
    flip_RI &= plan.pair_valid_R[:, None]
    T, E, I = x.shape[0], wgu.shape[0], wgu.shape[-1]
    tokens_T = torch.zeros(T, dtype=torch.bool, device=x.device)
    cols_EI = torch.zeros(E, I, dtype=torch.bool, device=x.device)
    r, i = flip_RI.nonzero(as_tuple=True)
    tokens_T[plan.pair_token_R[r]] = True
    cols_EI[plan.pair_expert_R[r], i] = True
    return tokens_T, cols_EI, int(flip_RI.sum()), int(plan.pair_valid_R.sum()) * I


@pytest.mark.parametrize("impl", OURS)
@pytest.mark.parametrize("name", list(CASES))
def test_layer_grouped_mm_ours_matches_cublas(name, impl, cuda_backend):
    """The whole step through MoEExperts (BF16 parameters, so BF16 gradients): the option
    reaches both fused entries. Forward and backward chained, the checkpoint's BF16 differences
    reach the gradients, so the bar is the layer's single one (``sqnr_floor("fused",
    "default")``). Where one path's checkpoint value rounds onto a clamp limit and the other's
    does not, the strict clamp mask flips and that element's derivative is 0 on one path only:
    one such flip costs ~33 dB of dX, dW_gate_up and dB_gate_up at this size (seeds 0-5 of the
    gpt_oss case: 20-43 dB with every element, on either input generator). So the bar holds
    there on what no flip reaches (the other tokens' dX rows, the other (expert, column) pairs:
    46-49 dB on those seeds), and the flips must be few (1-7 of ~2500 checkpoint (row, column)
    pairs there)."""
    p, rt = _problem(name)
    x, aff, idx, wgu, wd, bgu, bd = _forward_args(p, rt)
    E, H, _, I = wgu.shape
    out = {}
    for gm in ("cublas", impl):
        m = MoEExperts(E, H, I, bias=bgu is not None, clamp_limits=p.clamp_limits,
                       activation=p.activation, backend="cuda-sm90", device=DEV, grouped_mm=gm)
        with torch.no_grad():
            for prm, src in zip(m.parameters(), (wgu, wd, bgu, bd)):
                prm.copy_(src)
        out[gm] = _layer_step(m, x, idx, aff, p.output_grad_TH)
        assert cuda_backend["forward"][-1] == gm and cuda_backend["run"][-2:] == [gm, gm]
    keep = {}
    if p.clamp_limits is not None:
        tokens_T, cols_EI, flips, checked = _clamp_flips(p, rt, impl)
        assert flips <= 0.01 * checked, (flips, checked)
        keep = {"dX": ~tokens_T, "w_gate_up": ~cols_EI[:, None, None, :].expand(E, H, 2, I),
                "b_gate_up": ~cols_EI[:, None, :].expand(E, 2, I)}
    floor = sqnr_floor("fused", "default")
    for key, got in out[impl].items():
        want = out["cublas"][key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if key in keep:
            got, want = got[keep[key]], want[keep[key]]
        assert sqnr_db(got.double().cpu(), want.double().cpu()) >= floor, key


@pytest.mark.parametrize("impl", OURS)
def test_layer_compiles_fullgraph_with_grouped_mm_ours(impl, cuda_backend):
    """The option travels in the custom ops' options key: one graph for two routings, loss and
    gradients equal to eager's, and the chosen path ran in both directions."""
    from test_layer_forward import assert_compiles_once_like_eager

    T, H, I, E, K = 16, 32, 16, 4, 2
    torch.manual_seed(0)
    layer = MoEExperts(E, H, I, bias=True, backend="cuda-sm90", dtype=torch.float32,
                       grouped_mm=impl, device=DEV)
    assert layer.options.uses_custom_op

    def block(x, idx, aff):
        return layer(x, idx, aff).square().sum()

    assert_compiles_once_like_eager(block, layer, T, H, E, K, routings=2, device=DEV)
    assert set(cuda_backend["forward"]) == {impl} and set(cuda_backend["run"]) == {impl}


def test_opcheck_experts_forward_with_grouped_mm_ours(cuda_backend):
    from common import layer_ops

    g = torch.Generator().manual_seed(1)
    T, H, I, E, K = 16, 32, 16, 4, 2
    args = [
        torch.randn(T, H, generator=g).requires_grad_(),
        (torch.rand(T, K, generator=g) + 0.1).requires_grad_(),
        (torch.randn(E, H, 2, I, generator=g) * H**-0.5).requires_grad_(),
        (torch.randn(E, I, H, generator=g) * I**-0.5).requires_grad_(),
        (0.2 * torch.randn(E, 2, I, generator=g)).requires_grad_(),
        (0.2 * torch.randn(E, H, generator=g)).requires_grad_(),
        torch.randint(-1, E, (T, K), generator=g),
    ]
    key = layer_ops.options_key(MoEExpertsOptions(backend="cuda-sm90", grouped_mm="ours"))
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward,
                          (*[a.to(DEV) for a in args], key))
    assert "ours" in cuda_backend["forward"]


# ------------------------------------------- the checkpoint in grouped row order (no bias, clamp)
def test_checkpoint_in_rows_only_without_bias_and_clamp():
    """The checkpoint is in grouped row order exactly without a gate/up bias and an active
    clamp, whatever grouped_mm (the fused kernels write / read that form too); neither the
    shape nor the token count is an argument."""
    assert choice.checkpoint_in_rows(gate_up_bias=False, clamp_limits=None)
    assert choice.checkpoint_in_rows(gate_up_bias=False, clamp_limits=ClampLimits())
    assert not choice.checkpoint_in_rows(gate_up_bias=True, clamp_limits=None)
    assert not choice.checkpoint_in_rows(gate_up_bias=False, clamp_limits=CLAMP)


@pytest.mark.parametrize("impl", ["auto", "ours-gemm"])
def test_layer_op_keeps_the_gemm_rows_as_checkpoint(impl, cuda_backend):
    """Through the custom op on the fused path, without bias and clamp: the saved checkpoint
    is [S, 2I] (the fake implementation says so too: opcheck), and with a gate/up bias it is
    [R, 2, I] again."""
    from common import layer_ops
    from common.shapes import static_tokens_sum

    T, H, I, E, K = 16, 32, 16, 4, 2
    args = _layer_args(False, 3, DEV, T=T, H=H, I=I, E=E, K=K)
    key = layer_ops.options_key(MoEExpertsOptions(backend="cuda-sm90", grouped_mm=impl))
    out = torch.ops.moe_bwd.experts_forward(*args, key)
    S = static_tokens_sum(T * K, E, 16)
    assert tuple(out[1].shape) == (S, 2 * I) and out[1].dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.moe_bwd.experts_forward, (*args, key))
    args[4] = torch.zeros(E, 2, I, device=DEV)
    assert tuple(torch.ops.moe_bwd.experts_forward(*args, key)[1].shape) == (T * K, 2, I)
    assert set(cuda_backend["forward"]) == {impl}


def test_layer_with_row_checkpoint_compiles_once_over_token_counts(cuda_backend):
    """``torch.compile(fullgraph=True, dynamic=True)`` of a block holding the bias-free layer
    on the fused path: no compile after the first call over three token counts and routings
    (the checkpoint's form is one per layer), loss and gradients bitwise eager's. (With
    ``dynamic=True`` Dynamo restarts its first analysis of this frame once, whatever the
    checkpoint: two backend calls at the first call, none after.)"""
    import torch._dynamo.testing

    H, I, E, K = 32, 16, 4, 2
    torch.manual_seed(0)
    layer = MoEExperts(E, H, I, backend="cuda-sm90", dtype=torch.float32, device=DEV)

    def block(x, idx, aff):
        return layer(x, idx, aff).square().sum()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter, dynamic=True)
    compiles = []
    for T in (16, 24, 40):
        x, aff, *_, idx = _layer_args(False, T, DEV, T=T, H=H, I=I, E=E, K=K)
        outs = []
        for fn in (compiled, block):
            xl, al = x.detach().clone().requires_grad_(), aff.detach().clone().requires_grad_()
            loss = fn(xl, idx, al)
            outs.append((loss.detach(), *torch.autograd.grad(
                loss, [xl, al, layer.w_gate_up, layer.w_down])))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        compiles.append(counter.frame_count)
    assert compiles[0] >= 1 and compiles[1:] == compiles[:1] * 2
    assert set(cuda_backend["run"]) == {"auto", "cublas"}


def test_presorted_op_keeps_the_gemm_rows_as_checkpoint(cuda_backend):
    """The torchtitan seam's op on the fused path (identity layout, no bias): the checkpoint
    is the GEMM's [rows, 2I] output, fake and real alike (opcheck), zero rows included."""
    from common import layer_ops

    H, I, E = 32, 16, 4
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, H, generator=g).to(DEV).requires_grad_()
    wgu = (torch.randn(E, H, 2, I, generator=g) * H**-0.5).to(DEV).requires_grad_()
    wd = (torch.randn(E, I, H, generator=g) * I**-0.5).to(DEV).requires_grad_()
    counts = torch.tensor([3, 0, 5, 2], device=DEV)
    key = layer_ops.options_key(MoEExpertsOptions(backend="cuda-sm90", validate_routing="off"))
    op = torch.ops.moe_bwd.experts_forward_presorted
    assert tuple(op(x, wgu, wd, counts, key)[1].shape) == (13, 2 * I)
    assert tuple(op(x[:0], wgu, wd, counts, key)[1].shape) == (0, 2 * I)
    torch.library.opcheck(op, (x, wgu, wd, counts, key))
