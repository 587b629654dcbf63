"""The layer's CPU path at small shapes: one intra-op thread while the expert GEMMs are small
(restored afterwards), BF16 GEMMs as fp32 GEMMs of the same BF16 values where the CPU has no
native BF16 matmul -- the same products, rounded to BF16 as before -- and no work on padding
rows: row gathers that zero only the padding rows, GEMMs over the data rows alone, no select pass
over every element; the same values as the device-agnostic code (bitwise)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import routing
from common import torch_backward as tb
from common.activation import activation_backward
from common.inputs import make_problem
from common.problem import SWIGLU, ClampLimits


def test_cpu_threads_one_thread_for_small_problems_and_restored():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with tb.cpu_threads(torch.device("cpu"), 1024, 8, 256, 128):  # 8 experts of 128 rows
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with tb.cpu_threads(torch.device("cpu"), 16384, 8, 4096, 2048):  # large: untouched
            assert torch.get_num_threads() == 2
        with tb.cpu_threads(torch.device("meta"), 1024, 8, 256, 128):  # not the CPU
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_grouped_gemms_equal_bf16_products_whatever_the_cpu(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x_SK = torch.randn(48, 64, generator=g)
    w_EKN = torch.randn(3, 64, 32, generator=g)
    offsets_E = torch.tensor([16, 16, 48], dtype=torch.int32)
    want = torch.cat([x_SK[:16].bfloat16() @ w_EKN[0].bfloat16(),
                      x_SK[16:].bfloat16() @ w_EKN[2].bfloat16()]).float()
    for fast in (True, False):
        monkeypatch.setattr(tb, "_cpu_has_fast_bf16", lambda fast=fast: fast)
        got = tb.grouped_mm_rows(x_SK, w_EKN, offsets_E)
        assert got.dtype == torch.float32
        assert torch.equal(got, got.bfloat16().float())  # products rounded to BF16
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)  # BF16 rounding apart
        dw = tb.grouped_wgrad_default(x_SK.t(), torch.randn(48, 32, generator=g), offsets_E)
        assert torch.equal(dw[1], torch.zeros(64, 32))  # the empty expert: exactly 0


def _grouped(T=24, K=2, E=5, align=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[ids == 2] = 3  # expert 2 empty
    ids[::5, 1] = -1  # dropped slots
    plan = routing.plan_routing(ids, torch.rand(T, K, generator=g), E)
    return plan, plan.grouped(align=align, max_tokens_sum=T * K + E * align)


def test_cpu_row_gather_equals_the_select_path_and_never_reads_padding(monkeypatch):
    plan, layout = _grouped()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g).bfloat16()
    act = torch.randn(48, 2, 3, generator=g)
    x[0] = float("nan")  # padding rows clamp their index to 0: they must not read it
    act[0] = float("nan")
    cpu = [layout.gather_rows(x), layout.gather_pairs(act), layout.gather_pairs(act[:, 0, 0])]
    monkeypatch.setattr(routing, "host_reads_free", lambda t: False)  # the device path
    dev = [layout.gather_rows(x), layout.gather_pairs(act), layout.gather_pairs(act[:, 0, 0])]
    pad = layout.row_to_token_S < 0
    assert pad.any()
    for a, b in zip(cpu, dev):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert not a[pad].any() and not a[pad].isnan().any()  # padding rows exactly 0


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_gemms_over_data_rows_only_give_the_same_values(monkeypatch, fast_bf16):
    monkeypatch.setattr(tb, "_cpu_has_fast_bf16", lambda: fast_bf16)
    plan, layout = _grouped()
    g = torch.Generator().manual_seed(2)
    x_S = layout.gather_rows(torch.randn(24, 32, generator=g))  # padding rows 0
    w_EKN = torch.randn(5, 32, 16, generator=g)
    offs, rows_E = layout.offsets_E, plan.tokens_per_expert_E
    want = tb.grouped_mm_rows(x_S, w_EKN, offs)
    assert torch.equal(tb.grouped_mm_rows(x_S, w_EKN, offs, rows_E=rows_E), want)
    b_S = layout.gather_rows(torch.randn(24, 16, generator=g))
    want = tb.grouped_wgrad_default(x_S.t(), b_S, offs)
    got = tb.grouped_wgrad_default(x_S.t(), b_S, offs, rows_E=rows_E)
    assert torch.equal(got, want) and not got[2].any()  # the empty expert: exactly 0
    w_EKN[:, 0, 0] = float("inf")  # padding rows are written 0, never multiplied
    out = tb.grouped_mm_rows(x_S, w_EKN, offs, rows_E=rows_E)
    assert not out[layout.row_to_pair_S < 0].any()


class _GemmMacs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "mm":
            a, b = args[:2]
            self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def test_cpu_layer_multiplies_data_rows_only():
    """Forward + backward GEMM work is 9 R H I multiply-adds for R routed pairs: the padding
    rows of the grouped layout (up to ALIGN - 1 per expert, and the static layout's surplus)
    cost no GEMM work."""
    T, H, I, E, K = 40, 32, 16, 6, 2
    g = torch.Generator().manual_seed(4)
    ids, aff = torch.randint(0, E, (T, K), generator=g), torch.rand(T, K, generator=g)
    p = make_problem(T, H, I, E, K, seed=3, expert_index=ids, affinity=aff)
    R = int(p.plan.num_pairs)
    mode = _GemmMacs()
    with mode:
        fwd = tb.moe_layer_forward_torch(p.hidden_states_TH, aff, ids, p.w_gate_up_EH2I,
                                         p.w_down_EIH)
        assert mode.macs == 3 * R * H * I
        tb.moe_backward_torch(p)
    assert mode.macs == 9 * R * H * I
    assert fwd.layout.tokens_sum > R  # there were padding rows to skip


@pytest.mark.parametrize("limits", [ClampLimits(), ClampLimits(linear_clamp_upper_limit=0.5),
                                    ClampLimits(non_linear_clamp_lower_limit=-0.5)])
def test_activation_backward_masks_only_clamped_sides(limits):
    g = torch.Generator().manual_seed(5)
    gate, up, dh = (torch.randn(7, 4, generator=g) for _ in range(3))
    dg, du, _ = activation_backward(SWIGLU, gate, up, dh, limits)
    dg0, du0, _ = activation_backward(SWIGLU, gate, up, dh, None)
    assert limits.clamps_gate == (limits.non_linear_clamp_lower_limit is not None)
    assert limits.clamps_up == (limits.linear_clamp_upper_limit is not None)
    assert torch.equal(dg, torch.where(limits.gate_mask(gate), dg0, 0.0))
    assert torch.equal(du, torch.where(limits.up_mask(up), du0, 0.0))


BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cpu_layer.py"


def test_bench_cpu_layer_counts(tmp_path, capsys):
    """``bench_cpu_layer.py --count`` (no timing): the layer's step does the plain loop's GEMM
    work (no padding rows)."""
    import json

    spec = importlib.util.spec_from_file_location("bench_cpu_layer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_cpu_layer", bench)
    spec.loader.exec_module(bench)
    out = tmp_path / "counts.json"
    n = torch.get_num_threads()
    try:
        assert bench.main(["--count", "--tokens", "64", "--hidden", "32", "--intermediate",
                           "16", "--experts", "4", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    counts = json.loads(out.read_text())["counts"]
    assert "layer:" in capsys.readouterr().out
    assert counts["layer"]["gemm_macs"] == counts["plain"]["gemm_macs"] > 0
    assert counts["layer"]["ops"] > 0 and counts["layer"]["other_mb"] > 0


def test_layer_casts_its_gradients_on_the_guards_thread(monkeypatch):
    """The backward's casts into the inputs' dtypes and layouts (``layer_ops._like``) run inside
    the one-thread guard too: outside it each is a parallel region of every thread."""
    from common import layer_ops
    from common.layer import MoEExperts

    seen = []
    inner = layer_ops._like

    def spy(g, t):
        seen.append(torch.get_num_threads())
        return inner(g, t)

    monkeypatch.setattr(layer_ops, "_like", spy)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        layer = MoEExperts(4, 32, 16)
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(6))
        layer(x, ids, torch.rand(16, 2)).float().sum().backward()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)
    assert seen == [1, 1, 1]  # dX, dW_gate_up, dW_down
    assert x.grad is not None and layer.w_gate_up.grad is not None
