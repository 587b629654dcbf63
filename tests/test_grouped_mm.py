"""CPU tests of the varlen-M grouped GEMM family (cuda_kernels/grouped_mm): the torch twin against
float64, the host entry's argument checks, the keys and tiles, and the kernel's tile schedule
(written in Python: every output tile exactly once, whatever the split).

The kernel itself: tests/test_grouped_mm_sm90.py (offline compiles here, GPU runs on an H200).
"""

import itertools

import pytest
import torch

from common.problem import Activation, ClampLimits
from common.routing import plan_routing
from cuda_kernels.grouped_mm import (
    down_dgrad_activation_torch,
    down_dgrad_backward,
    gate_up_activation_torch,
    gate_up_forward,
    grouped_mm_dgated,
    grouped_mm_gated,
    grouped_mm_gather,
    grouped_mm_gather_torch,
)
from cuda_kernels.grouped_mm.api import grouped_mm_key
from cuda_kernels.gemm.sm90.grouped_mm import (
    GatedEpilogue,
    Sm90GroupedMmKey,
    Sm90GroupedMmTile,
    epilogue_tile_reason,
    load_grouped_mm_tile_rules,
    select_grouped_mm_tile,
    tile_schedule,
)
from cuda_kernels.grouped_mm.torch_ref import expert_segments

BF16 = torch.bfloat16
# the test comparing with the Triton pass runs it compiled on a GPU, interpreted on the CPU
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layout(T, E, top_k, seed, align=16):
    """A real grouped layout (common.routing) of random top-k routing; every third expert
    empty."""
    gen = torch.Generator().manual_seed(seed)
    live = [e for e in range(E) if e % 3] or [0]
    pick = torch.stack([torch.randperm(len(live), generator=gen)[:top_k] for _ in range(T)])
    expert_index = torch.tensor(live)[pick]
    affinity = torch.rand(T, top_k, generator=gen)
    plan = plan_routing(expert_index, affinity, E)
    return plan.grouped(align=align)


def _operands(T, K, N, E, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(T, K, generator=gen).to(BF16)
    w = (torch.randn(E, K, N, generator=gen) / K**0.5).to(BF16)
    return a, w


# ------------------------------------------------------------------------------------------------
# the twin
# ------------------------------------------------------------------------------------------------


def test_twin_matches_float64_and_zeroes_padding_rows():
    T, K, N, E = 37, 64, 48, 7
    layout = _layout(T, E, 3, seed=0)
    a, w = _operands(T, K, N, E, seed=1)
    a[0] = float("nan")  # an unreferenced source row: token 0 routed nowhere below
    idx = layout.row_to_token_S.clone()
    idx[idx == 0] = -1  # token 0's rows become padding: its NaN must not reach them
    out = grouped_mm_gather_torch(a, w, layout.offsets_E, idx)
    ref = grouped_mm_gather_torch(a, w, layout.offsets_E, idx, acc_dtype=torch.float64,
                                  out_dtype=torch.float64)
    assert out.dtype == BF16 and out.shape == (layout.tokens_sum, N)
    assert torch.isfinite(out).all()
    pad = idx < 0
    assert pad.any() and (out[pad] == 0).all() and (ref[pad] == 0).all()
    # per row: the float64 product of the gathered row with its expert's matrix
    ends = layout.offsets_E.tolist()
    begin = 0
    for e, end in enumerate(ends):
        for r in range(begin, end):
            if idx[r] >= 0:
                want = a[idx[r]].double() @ w[e].double()
                torch.testing.assert_close(ref[r], want, rtol=1e-12, atol=1e-12)
        begin = end
    err = (out.double() - ref).abs()
    assert (err <= 2**-8 * ref.abs() + 1e-6).all()  # one BF16 rounding of an fp32 sum


def test_twin_without_index_and_rows_past_the_last_offset():
    K, N, E = 32, 16, 3
    counts = [16, 0, 32]
    S = sum(counts) + 16  # 16 rows past the last offset
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(S, K, generator=gen).to(BF16)
    w = torch.randn(E, K, N, generator=gen).to(BF16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = grouped_mm_gather_torch(a, w, offsets)
    assert (out[48:] == 0).all()
    torch.testing.assert_close(out[:16], (a[:16].float() @ w[0].float()).to(BF16))
    torch.testing.assert_close(out[16:48], (a[16:48].float() @ w[2].float()).to(BF16))


def test_host_entry_on_cpu_runs_the_twin_into_out():
    T, K, N, E = 20, 32, 24, 5
    layout = _layout(T, E, 2, seed=3)
    a, w = _operands(T, K, N, E, seed=4)
    out = torch.full((layout.tokens_sum, N), float("nan"), dtype=BF16)
    res = grouped_mm_gather(a, w, layout.offsets_E, layout.row_to_token_S, out)
    assert res is out
    assert torch.equal(out, grouped_mm_gather_torch(a, w, layout.offsets_E, layout.row_to_token_S))
    # K-major weights (memory [E, N, K]) and an int32 index give the same values
    wk = w.transpose(1, 2).contiguous().transpose(1, 2)
    res2 = grouped_mm_gather(a, wk, layout.offsets_E, layout.row_to_token_S.to(torch.int32))
    assert torch.equal(res2, out)


# ------------------------------------------------------------------------------------------------
# argument checks (named ValueErrors before any write)
# ------------------------------------------------------------------------------------------------


def _good():
    T, K, N, E = 8, 16, 16, 2
    a = torch.zeros(T, K, dtype=BF16)
    w = torch.zeros(E, K, N, dtype=BF16)
    offsets = torch.tensor([16, 32], dtype=torch.int32)
    idx = torch.full((32,), -1, dtype=torch.int64)
    return {"a": a, "w": w, "offsets_E": offsets, "row_index": idx}


_BAD = [
    ("a", lambda g: g["a"][None], "a must be 2-D"),
    ("w", lambda g: g["w"][0], "w must be 3-D"),
    ("offsets_E", lambda g: g["offsets_E"][None], "offsets_E must be 1-D"),
    ("a", lambda g: g["a"][:, :8], "columns but w has K"),
    ("offsets_E", lambda g: g["offsets_E"][:1], "entries but w has E"),
    ("a", lambda g: g["a"].float(), "must be torch.bfloat16"),
    ("w", lambda g: g["w"].half(), "must be torch.bfloat16"),
    ("offsets_E", lambda g: g["offsets_E"].long(), "offsets_E must be torch.int32"),
    ("row_index", lambda g: g["row_index"].float(), "row_index must be torch.int64 or"),
    ("row_index", lambda g: g["row_index"][None], "row_index must be 1-D"),
    ("row_index", lambda g: g["row_index"].to(torch.int32), None),  # fine
    ("w", lambda g: g["w"].permute(1, 0, 2).contiguous().permute(1, 0, 2), "w must be contig"),
    ("a", lambda g: g["a"].t().contiguous().t(), "unit stride along K"),
    ("row_index", lambda g: torch.zeros(64, dtype=torch.int64)[::2], "row_index must be contig"),
    ("a", lambda g: [1.0], "a must be a torch.Tensor"),
    ("out", lambda g: torch.zeros(31, 16, dtype=BF16), r"out must have shape \[32, 16\]"),
    ("out", lambda g: torch.zeros(32, 16), "out must be torch.bfloat16"),
    ("out", lambda g: torch.zeros(16, 32, dtype=BF16).t(), "out must be contiguous"),
]


@pytest.mark.parametrize("case", _BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(_BAD)])
def test_bad_arguments_raise_named_value_errors(case):
    name, bad, message = case
    args = _good()
    args["out"] = torch.full((32, 16), 7.0, dtype=BF16)
    sentinel = args["out"].clone()
    args[name] = bad(args)
    if message is None:
        grouped_mm_gather(**args)
        return
    with pytest.raises(ValueError, match=message):
        grouped_mm_gather(**args)
    if name != "out":
        assert torch.equal(args["out"], sentinel), "the output was written before the error"


def test_backend_argument():
    args = _good()
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_mm_gather(**args, backend="cublas")
    with pytest.raises(ValueError, match="backend='sm90' cannot run here"):
        grouped_mm_gather(**args, backend="sm90")  # CPU tensors
    assert grouped_mm_gather(**args, backend="torch").shape == (32, 16)


def test_device_mismatch_is_named():
    args = _good()
    args["offsets_E"] = args["offsets_E"].to("meta")
    with pytest.raises(ValueError, match="offsets_E is on meta but a is on cpu"):
        grouped_mm_gather(**args)


# ------------------------------------------------------------------------------------------------
# keys, tiles, the schedule
# ------------------------------------------------------------------------------------------------


def test_tile_and_key_validation():
    assert Sm90GroupedMmTile().consumer_warp_groups == 2
    assert Sm90GroupedMmTile(128, 128, 64, 6, pingpong=True).consumer_warp_groups == 2
    assert Sm90GroupedMmTile(64, 128, 64, 6).consumer_warp_groups == 1
    for kwargs, word in [
        ({"tile_m": 96}, "tile_m"),
        ({"tile_n": 260}, "tile_n"),
        ({"tile_k": 32}, "tile_k"),
        ({"stages": 5}, "overflow"),
        ({"pingpong": 1}, "must be a bool"),
        ({"epi_tma": 1}, "epi_tma must be a bool"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90GroupedMmTile(**kwargs)
    assert not Sm90GroupedMmTile().epi_tma
    assert Sm90GroupedMmTile(epi_tma=True).variant_name == "128x256s4-tma"
    key = Sm90GroupedMmKey(1536, 2048, 128)
    assert key == Sm90GroupedMmKey(1536, 2048, 128, tile=Sm90GroupedMmTile())
    assert hash(key) == hash(Sm90GroupedMmKey(1536, 2048, 128))
    assert (key.n_tiles, key.k_tiles) == (6, 32)
    for kwargs, word in [
        ({"n": 100}, "multiple of 8"),
        ({"k": 0}, "positive"),
        ({"index_dtype": "int16"}, "index_dtype"),
        ({"w_major": "m"}, "w_major"),
        ({"epilogue": "gelu"}, "epilogue"),
        ({"gather_a": 1}, "gather_a"),
        ({"tile": (128, 256)}, "tile"),
        ({"write_a_rows": 1}, "write_a_rows must be a bool"),
        ({"write_a_rows": True, "gather_a": False}, "write_a_rows needs gather_a"),
    ]:
        base = {"n": 64, "k": 64, "num_experts": 2}
        base.update(kwargs)
        with pytest.raises(ValueError, match=word):
            Sm90GroupedMmKey(**base)
    assert select_grouped_mm_tile(1536, 2048, 128).tile_n == 256
    assert select_grouped_mm_tile(128, 2048, 128).tile_n == 128
    w = torch.zeros(4, 64, 32, dtype=BF16)
    k = grouped_mm_key(w.transpose(1, 2).contiguous().transpose(1, 2), None)
    assert (k.w_major, k.gather_a, k.n, k.k) == ("k", False, 32, 64)
    k = grouped_mm_key(w, torch.zeros(3, dtype=torch.int32))
    assert (k.w_major, k.gather_a, k.index_dtype, k.write_a_rows) == ("n", True, "int32", False)
    kr = grouped_mm_key(w, torch.zeros(3, dtype=torch.int32), write_a_rows=True)
    assert kr.write_a_rows and kr != k  # a compile-cache key of its own



def test_tile_rules_file_as_shipped_and_its_errors(tmp_path, monkeypatch):
    """configs/cuda/sm90_grouped_mm_tiles.yaml: the measured rule (128x256 cooperative for
    N >= 256, else 128x128, both with the TMA-store epilogue), conditions read as lower bounds,
    and a malformed file named."""
    names = [name for name, _c, _t in load_grouped_mm_tile_rules()]
    assert names == ["wide", "narrow"]
    T = Sm90GroupedMmTile
    assert select_grouped_mm_tile(256, 64, 1) == T(128, 256, 64, 4, epi_tma=True)
    assert select_grouped_mm_tile(255, 8192, 384) == T(128, 128, 64, 6, epi_tma=True)
    with pytest.raises(ValueError, match="sizes must be positive"):
        select_grouped_mm_tile(0, 64, 1)
    import common.config_files as cf

    def use(text):
        f = tmp_path / "tiles.yaml"
        f.write_text(text)
        monkeypatch.setattr(cf, "config_path", lambda *parts: f)
        load_grouped_mm_tile_rules.cache_clear()

    try:
        use("rules:\n  - {name: big, min_k: 4096, config: {tile_m: 128, tile_n: 192}}\n")
        assert select_grouped_mm_tile(512, 4096, 8).tile_n == 192
        with pytest.raises(RuntimeError, match="no rule for n=512, k=2048"):
            select_grouped_mm_tile(512, 2048, 8)
        use("rules:\n  - {name: odd, max_n: 64, config: {tile_m: 128, tile_n: 128}}\n")
        with pytest.raises(RuntimeError, match=r"tiles.yaml: rule 'odd' has unknown conditions"):
            load_grouped_mm_tile_rules()
        use("rules:\n  - {name: bad, config: {tile_m: 96, tile_n: 128}}\n")
        with pytest.raises(RuntimeError, match=r"tile_m must be 64 or 128"):
            load_grouped_mm_tile_rules()
    finally:
        monkeypatch.undo()
        load_grouped_mm_tile_rules.cache_clear()
    assert select_grouped_mm_tile(1536, 2048, 128).tile_n == 256  # the shipped file again


def test_tile_n_192_in_the_key():
    """tile_n 192 (cooperative and pingpong: 96 / 192 fp32 accumulators per consumer thread) for
    the store and dgated epilogues; the gated epilogue and the side output refuse what they
    cannot run."""
    T = Sm90GroupedMmTile
    pp192 = T(128, 192, 64, 5, pingpong=True)
    assert pp192.variant_name == "128x192s5pp" and T(128, 192, 64, 5).variant_name == "128x192s5"
    key = Sm90GroupedMmKey(3072, 4096, 128, tile=pp192)
    assert (key.n_tiles, key.max_tiles(1000)) == (16, 136 * 16)
    assert key != Sm90GroupedMmKey(3072, 4096, 128, tile=T(128, 192, 64, 5))
    # the side output: a pingpong consumer keeps 216 registers, <= 176 accumulators
    Sm90GroupedMmKey(3072, 4096, 128, tile=T(128, 192, 64, 5), write_a_rows=True)
    Sm90GroupedMmKey(3072, 4096, 128, tile=T(128, 176, 64, 5, True), write_a_rows=True)
    with pytest.raises(ValueError, match="at most 176 fp32 accumulators a thread, the tile "
                                         "128x192s5pp has 192"):
        Sm90GroupedMmKey(3072, 4096, 128, tile=pp192, write_a_rows=True)
    Sm90GroupedMmKey(1536, 4096, 128, epilogue="dgated", gated=GatedEpilogue(),
                     tile=T(128, 192, 64, 5))
    with pytest.raises(ValueError, match="gated epilogue needs tile_n 128 or 256"):
        Sm90GroupedMmKey(3072, 4096, 8, epilogue="gated", gated=GatedEpilogue(),
                         tile=T(128, 192, 64, 5))
    assert epilogue_tile_reason("store", pp192) is None
    assert epilogue_tile_reason("store", pp192, write_a_rows=True) is not None
    assert epilogue_tile_reason("dgated", T(128, 192, 64, 5)) is None


def test_tile_rules_per_shape_and_per_epilogue(tmp_path, monkeypatch):
    """Exact (n, k, experts) and epilogue conditions pick one GEMM of one model; a rule without
    an epilogue condition whose tile a fused epilogue cannot take is skipped for it; rules that
    name an epilogue must be runnable by it, and size conditions are positive ints."""
    import common.config_files as cf

    def use(text):
        f = tmp_path / "tiles.yaml"
        f.write_text(text)
        monkeypatch.setattr(cf, "config_path", lambda *parts: f)
        load_grouped_mm_tile_rules.cache_clear()

    T = Sm90GroupedMmTile
    try:
        use(
            "rules:\n"
            "  - {name: q235-gate-up, n: 3072, k: 4096, experts: 128, epilogue: store,\n"
            "     config: {tile_m: 128, tile_n: 192, stages: 5, pingpong: true}}\n"
            "  - {name: mixtral, n: 28672, k: 4096, epilogue: [store, dgated],\n"
            "     config: {tile_m: 128, tile_n: 192, stages: 5}}\n"
            "  - {name: wide, min_n: 256, config: {tile_m: 128, tile_n: 256, stages: 4}}\n"
            "  - {name: any-192, config: {tile_m: 128, tile_n: 192, stages: 5}}\n"
            "  - {name: narrow, config: {tile_m: 128, tile_n: 128, stages: 6}}\n"
        )
        assert load_grouped_mm_tile_rules()[0][1]["epilogue"] == ("store",)
        assert select_grouped_mm_tile(3072, 4096, 128) == T(128, 192, 64, 5, True)
        assert select_grouped_mm_tile(3072, 4096, 128, "gated") == T(128, 256, 64, 4)
        # the side output cannot take the 128x192 pingpong tile: the next rule that holds
        assert select_grouped_mm_tile(3072, 4096, 128, write_a_rows=True) == T(128, 256, 64, 4)
        assert select_grouped_mm_tile(3072, 4096, 64) == T(128, 256, 64, 4)  # experts differ
        assert select_grouped_mm_tile(3072, 2048, 128) == T(128, 256, 64, 4)  # k differs
        assert select_grouped_mm_tile(28672, 4096, 8) == T(128, 192, 64, 5)
        assert select_grouped_mm_tile(28672, 4096, 4, "dgated") == T(128, 192, 64, 5)
        assert select_grouped_mm_tile(28672, 4096, 8, "gated") == T(128, 256, 64, 4)
        assert select_grouped_mm_tile(128, 64, 1) == T(128, 192, 64, 5)
        assert select_grouped_mm_tile(128, 64, 1, "gated") == T(128, 128, 64, 6)  # skips 192
        # a rule's epi_tma reaches every epilogue
        use("rules:\n  - {name: all, config: {tile_m: 128, tile_n: 256, stages: 4, "
            "epi_tma: true}}\n")
        for epilogue in ("store", "gated", "dgated"):
            assert select_grouped_mm_tile(768, 2048, 128, epilogue).epi_tma
        with pytest.raises(ValueError, match="epilogue must be one of"):
            select_grouped_mm_tile(128, 64, 1, "gelu")
        for text, word in [
            ("{name: a, epilogue: gated, config: {tile_m: 128, tile_n: 192}}",
             "rule 'a': the gated epilogue needs tile_n 128 or 256"),
            ("{name: c, epilogue: relu, config: {tile_m: 128, tile_n: 128}}",
             "rule 'c' has epilogue 'relu'"),
            ("{name: d, n: 0, config: {tile_m: 128, tile_n: 128}}", "rule 'd' has n: 0"),
            ("{name: e, experts: '8', config: {tile_m: 128, tile_n: 128}}",
             "rule 'e' has experts: '8'"),
        ]:
            use(f"rules:\n  - {text}\n")
            with pytest.raises(RuntimeError, match=word):
                load_grouped_mm_tile_rules()
        use("rules:\n  - {name: only-192, config: {tile_m: 128, tile_n: 192}}\n")
        with pytest.raises(RuntimeError, match="no rule for n=256, k=64, num_experts=1, "
                                               "epilogue='gated'"):
            select_grouped_mm_tile(256, 64, 1, "gated")
    finally:
        monkeypatch.undo()
        load_grouped_mm_tile_rules.cache_clear()
    assert select_grouped_mm_tile(3072, 4096, 128) == T(128, 256, 64, 4, epi_tma=True)  # shipped


def test_bench_tiles_parse_and_summary():
    """benchmarks/bench_grouped_mm.py ``--tiles``: both spellings, the named set, stages by
    default as many as fit, the row names parse back; the summary table's ratios."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_grouped_mm.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_mm", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_grouped_mm", bench)
    spec.loader.exec_module(bench)
    T = Sm90GroupedMmTile
    assert bench.parse_tile("128x192:pingpong") == T(128, 192, 64, 5, True)
    assert bench.parse_tile("128x256:cooperative") == T(128, 256, 64, 4)
    assert bench.parse_tile("128x128s6:pp") == T(128, 128, 64, 6, True)
    assert bench.parse_tile("default") is None
    assert bench.parse_tile("128x256-tma") == T(128, 256, 64, 4, epi_tma=True)
    assert bench.parse_tile("128x128s6-tma:pp") == T(128, 128, 64, 6, True, epi_tma=True)
    for t in (T(128, 192, 64, 5, True), T(128, 256, 64, 4), T(64, 256, 64, 5, True),
              T(128, 256, 64, 4, epi_tma=True), T(128, 192, 64, 5, True, epi_tma=True)):
        assert bench.parse_tile(t.variant_name) == t
    for bad in ("128x192:fast", "128by192", "128x192:c2", "128x192s5pp-c2", "96x128"):
        with pytest.raises(ValueError):
            bench.parse_tile(bad)
    tiles = bench.parse_tiles("mainloop,128x192:pingpong")
    assert tiles == [None, T(128, 192, 64, 5), T(128, 192, 64, 5, True)]
    assert bench.parse_tiles("") == [None]
    rows = [
        {"shape": "s", "gemm": "gate_up", "impl": "grouped_mm", "ms": 2.0},
        {"shape": "s", "gemm": "gate_up", "impl": "ours", "ms": 2.2, "tile": "128x256s4"},
        {"shape": "s", "gemm": "gate_up", "impl": "ours 128x192s5pp", "ms": 1.9},
    ]
    lines = bench.summary_table(rows, [None, T(128, 192, 64, 5, True)])
    assert "128x192s5pp" in lines[0] and len(lines) == 3
    assert "2.200 (1.100) 128x256s4" in lines[2] and "**1.900 (0.950)**" in lines[2]
    assert lines[2].endswith("| 0.950 |")


@pytest.mark.parametrize(
    "counts,extra_rows",
    [
        ([130, 0, 16, 0, 0, 257], 0),  # uneven, empty experts, partial last M tiles
        ([0, 0, 0, 0], 48),  # every expert empty: the rows past the last offset
        ([0, 1000, 0], 5),  # one hot expert
        ([], 0),
    ],
)
def test_tile_schedule_covers_every_output_tile_once(counts, extra_rows):
    E = max(len(counts), 1)
    counts = counts or [0]
    key = Sm90GroupedMmKey(200, 64, E, tile=Sm90GroupedMmTile(128, 128, 64, 6))  # partial N
    offsets = torch.tensor(counts).cumsum(0).tolist()
    S = offsets[-1] + extra_rows
    sched = tile_schedule(offsets, S, key)
    assert len(sched) <= key.max_tiles(S)
    covered = torch.zeros(S, key.n_tiles, dtype=torch.int64)
    groups = expert_segments(torch.tensor(offsets), S)
    groups.append((groups[-1][1], S))  # the rows past the last offset
    for g, n_idx, row0, rows in sched:
        assert 0 < rows <= 128 and 0 <= n_idx < key.n_tiles
        begin, end = groups[g]
        assert begin <= row0 and row0 + rows <= end  # a tile never crosses its group
        covered[row0 : row0 + rows, n_idx] += 1
    assert (covered == 1).all()
    # static dealing over any grid covers every tile id exactly once
    for grid in (1, 7, 132):
        ids = sorted(t for b in range(grid) for t in range(b, len(sched), grid))
        assert ids == list(range(len(sched)))


def test_tile_schedule_clamps_offsets_that_break_the_contract():
    key = Sm90GroupedMmKey(64, 64, 3, tile=Sm90GroupedMmTile(128, 128, 64, 6))
    sched = tile_schedule([50, 20, 400], 100, key)  # decreasing, and past S
    rows = sorted((r0, r0 + n) for _g, _n, r0, n in sched)
    assert rows[0][0] == 0 and rows[-1][1] == 100
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # each row once
    assert [g for g, *_ in sched] == [0, 2]  # expert 1 is empty
    assert expert_segments(torch.tensor([50, 20, 400]), 100) == [(0, 50), (50, 50), (50, 100)]


# ------------------------------------------------------------------------------------------------
# the gated (forward gate/up) epilogue: twin, against GEMM-then-pass, argument checks
# ------------------------------------------------------------------------------------------------

_ACTS = {
    "swiglu": (Activation("swiglu"), None, False),
    "gpt-oss": (Activation("gpt_oss", 1.702, 1.0),
                ClampLimits(linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
                            non_linear_clamp_upper_limit=7.0), True),
}


def _gated_problem(T, H, I, E, top_k, seed, *, integer=False, device="cpu"):
    """Routing (plan, layout) and gate/up operands (BF16 x, w [E, H, 2I]; fp32 bias [E, 2, I])
    on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    live = [e for e in range(E) if e % 3] or [0]
    pick = torch.stack([torch.randperm(len(live), generator=gen)[:top_k] for _ in range(T)])
    expert_index = torch.tensor(live)[pick]
    affinity = torch.rand(T, top_k, generator=gen)
    plan = plan_routing(expert_index.to(device), affinity.to(device), E)
    layout = plan.grouped(align=16)
    if integer:  # every accumulator an integer of at most 8 bits: exact in BF16
        x = torch.randint(-1, 2, (T, H), generator=gen).to(BF16)
        w = torch.randint(-1, 2, (E, H, 2 * I), generator=gen).to(BF16)
        b = torch.randint(-4, 5, (E, 2, I), generator=gen).float() / 2
    else:
        x = torch.randn(T, H, generator=gen).to(BF16)
        w = (torch.randn(E, H, 2 * I, generator=gen) * 2 / H**0.5).to(BF16)
        b = torch.randn(E, 2, I, generator=gen)
    return x.to(device), w.to(device), b.to(device), plan, layout


def _ulps(x, ref):
    """|x - ref| in BF16 ulps of |ref| (2^-8 relative: half of the spacing above |ref|)."""
    d = (x.float() - ref.float()).abs()
    return (d / (ref.float().abs() * 2**-8 + 1e-30)).nan_to_num(0.0)


@pytest.mark.parametrize("name", list(_ACTS))
def test_gated_twin_against_float64(name):
    act_fn, clamp, with_bias = _ACTS[name]
    x, w, b, plan, layout = _gated_problem(29, 64, 48, 6, 2, seed=7)
    bias = b if with_bias else None
    args = (x, w, layout.offsets_E, layout.row_to_token_S, layout.row_to_pair_S,
            plan.pair_affinity_R)
    kw = {"activation": act_fn, "clamp_limits": clamp, "bias_E2I": bias}
    act, ah = gate_up_activation_torch(*args, **kw)
    act64, ah64 = gate_up_activation_torch(*args, **kw, acc_dtype=torch.float64,
                                           out_dtype=torch.float64)
    assert act.shape == (plan.pair_token_R.shape[0], 2, 48) and ah.shape == (layout.tokens_sum, 48)
    pad = layout.row_to_pair_S < 0
    assert (ah[pad] == 0).all() and (ah64[pad] == 0).all()
    assert (_ulps(act, act64) <= 1.01).all() and (_ulps(ah, ah64) <= 1.01).all()
    if clamp is not None:
        assert act[:, 0].max() <= 7.0 and act[:, 1].abs().max() <= 7.0
        assert (act[:, 1] == 7.0).any() or (act[:, 1] == -7.0).any()  # the clamp was active


@pytest.mark.parametrize("name", list(_ACTS))
@pytest.mark.parametrize("integer", [True, False], ids=["exact", "random"])
def test_gated_twin_matches_gemm_then_pass(name, integer):
    """The current forward (grouped GEMM rounded to BF16, then activation_forward, Triton
    interpreted here) and the fused epilogue's twin (from the fp32 accumulator): identical
    checkpoints when the accumulators are exact in BF16; otherwise they differ only by the
    pass's extra rounding (<= 1 ulp in the checkpoint, about 1 in a*h)."""
    from common.torch_backward import grouped_mm_rows
    from cuda_kernels.triton.activation import activation_forward

    act_fn, clamp, with_bias = _ACTS[name]
    x, w, b, plan, layout = _gated_problem(33, 16 if integer else 64, 32, 5, 2, seed=8,
                                           integer=integer, device=DEV)
    bias = b if with_bias else None
    gu = grouped_mm_rows(layout.gather_rows(x), w, layout.offsets_E)
    act_p, ah_p = activation_forward(
        gu, layout.row_to_pair_S, plan, activation=act_fn,
        clamp_limits=clamp or ClampLimits(), b_gate_up_E2I=bias,
    )
    act_f, ah_f = gate_up_forward(x, w.reshape(5, -1, 2, 32), layout, plan, activation=act_fn,
                                  clamp_limits=clamp, b_gate_up_E2I=bias, backend="torch")
    if integer:
        assert torch.equal(act_f, act_p)
        assert (_ulps(ah_f, ah_p) <= 2.01).all()  # sigmoid/exp implementations may differ
    else:
        # the pass rounds the accumulator before adding the bias: half an ulp of |acc| more
        acc = grouped_mm_gather_torch(x, w, layout.offsets_E, layout.row_to_token_S,
                                      out_dtype=torch.float32)
        acc_R = torch.zeros(act_p.shape[0] + 1, 2 * 32, device=DEV)
        r2p = layout.row_to_pair_S
        acc_R[torch.where(r2p >= 0, r2p, act_p.shape[0])] = acc
        acc_R = acc_R[:-1].reshape(-1, 2, 32).abs()
        d = (act_f.float() - act_p.float()).abs()
        ulp = torch.ldexp(torch.ones_like(d), torch.frexp(act_p.float()).exponent - 8)
        assert (d <= 2**-8 * acc_R * 1.01 + ulp + 1e-6).all()  # half an ulp of acc + one flip
        rel = (ah_f.float() - ah_p.float()).norm() / ah_p.float().norm()
        assert rel < 5e-3
    assert torch.equal(ah_f[layout.row_to_pair_S < 0], ah_p[layout.row_to_pair_S < 0])


def _gated_good():
    x, w, _b, plan, layout = _gated_problem(10, 16, 16, 3, 2, seed=9)
    return {
        "a": x, "w_gate_up": w, "offsets_E": layout.offsets_E,
        "row_index": layout.row_to_token_S, "row_to_pair_S": layout.row_to_pair_S,
        "pair_affinity_R": plan.pair_affinity_R, "num_pairs": plan.num_pairs,
    }


_GATED_BAD = [
    ("w_gate_up", lambda g: g["w_gate_up"][:, :, :31].contiguous(), "even N"),
    ("w_gate_up", lambda g: g["w_gate_up"].reshape(3, 16, 4, 8), "needs 2 at dim 2"),
    ("row_to_pair_S", lambda g: g["row_to_pair_S"][:-1], "row_to_pair_S must be"),
    ("row_to_pair_S", lambda g: g["row_to_pair_S"].int(), "torch.int64"),
    ("pair_affinity_R", lambda g: g["pair_affinity_R"].long(), "1-D float"),
    ("pair_affinity_R", lambda g: torch.zeros(10_000), "more than the S"),
    ("num_pairs", lambda g: g["num_pairs"].int(), "num_pairs must be one torch.int64"),
    ("bias", lambda g: torch.zeros(3, 2, 15), "bias must be"),
    ("act_out", lambda g: torch.zeros(1, 2, 16, dtype=BF16), "act_out must be a tensor"),
    ("checkpoint_rows", lambda g: 1, "checkpoint_rows must be a bool"),
    ("ah_out", lambda g: torch.zeros(len(g["row_to_pair_S"]), 16), "ah_out must be a contig"),
    ("a", lambda g: g["a"].float(), "must be torch.bfloat16"),
]


@pytest.mark.parametrize("case", _GATED_BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(_GATED_BAD)])
def test_gated_bad_arguments(case):
    name, bad, message = case
    args = _gated_good()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=message):
        grouped_mm_gated(**args)


def test_gated_entry_on_cpu_writes_every_element_of_given_outputs():
    args = _gated_good()
    R, S = args["pair_affinity_R"].shape[0], args["row_to_pair_S"].shape[0]
    act = torch.full((R, 2, 16), float("nan"), dtype=BF16)
    ah = torch.full((S, 16), float("nan"), dtype=BF16)
    got = grouped_mm_gated(**args, act_out=act, ah_out=ah)
    assert got[0] is act and got[1] is ah
    assert torch.isfinite(act).all() and torch.isfinite(ah).all()
    assert (act[int(args["num_pairs"]):] == 0).all()


def test_gated_checkpoint_rows_on_cpu_is_the_pair_checkpoint_in_row_order():
    """``checkpoint_rows``: an [S, 2I] checkpoint whose row s is its pair's [g, u] (padding
    rows 0), ``a_h`` unchanged; a pair-shaped ``act_out`` is refused then."""
    args = _gated_good()
    S, r2p = args["row_to_pair_S"].shape[0], args["row_to_pair_S"]
    act_p, ah_p = grouped_mm_gated(**args)
    act_r = torch.full((S, 32), float("nan"), dtype=BF16)
    got = grouped_mm_gated(**args, act_out=act_r, checkpoint_rows=True)
    assert got[0] is act_r and torch.equal(got[1], ah_p)
    want = torch.where((r2p >= 0)[:, None], act_p[r2p.clamp(min=0)].reshape(S, -1), 0)
    assert torch.equal(act_r, want.to(BF16))
    with pytest.raises(ValueError, match=r"act_out must be a tensor of shape \[%d, 32\]" % S):
        grouped_mm_gated(**args, act_out=act_p, checkpoint_rows=True)


def test_gated_key_validation():
    ge = GatedEpilogue.of(Activation("gpt_oss", 1.702, 1.0), _ACTS["gpt-oss"][1], True)
    assert (ge.alpha, ge.up_offset, ge.gate_lo, ge.gate_hi, ge.up_lo, ge.up_hi, ge.has_bias) == (
        1.702, 1.0, None, 7.0, -7.0, 7.0, True)
    assert GatedEpilogue.of(Activation("swiglu"), None, False) == GatedEpilogue()
    for kwargs, word in [({"alpha": 0.0}, "alpha"), ({"up_offset": float("inf")}, "up_offset"),
                         ({"gate_lo": 2.0, "gate_hi": 1.0}, "must be <"),
                         ({"has_bias": 1}, "has_bias"),
                         ({"checkpoint_rows": "yes"}, "checkpoint_rows")]:
        with pytest.raises(ValueError, match=word):
            GatedEpilogue(**kwargs)
    key = Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated", gated=GatedEpilogue())
    assert (key.out_cols, key.n_tiles) == (768, 6)
    with pytest.raises(ValueError, match="exactly when"):
        Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated")
    with pytest.raises(ValueError, match="exactly when"):
        Sm90GroupedMmKey(1536, 2048, 128, gated=GatedEpilogue())
    with pytest.raises(ValueError, match="tile_n 128 or 256"):
        Sm90GroupedMmKey(1536, 2048, 128, epilogue="gated", gated=GatedEpilogue(),
                         tile=Sm90GroupedMmTile(128, 192, 64, 4))
    with pytest.raises(ValueError, match="I a multiple of 8"):
        Sm90GroupedMmKey(1544, 2048, 128, epilogue="gated", gated=GatedEpilogue())
    with pytest.raises(ValueError, match="at most 192"):
        Sm90GroupedMmKey(1536, 2048, 128, tile=Sm90GroupedMmTile(128, 256, 64, 4, True))


# ------------------------------------------------------------------------------------------------
# the dgated (backward down-dgrad) epilogue: twin, against GEMM-then-pass, argument checks
# ------------------------------------------------------------------------------------------------


def _dgated_problem(T, H, I, E, top_k, seed, name, device="cpu"):
    """A routing, dY [T, H], w_down [E, I, H] and the forward's checkpoint (the twin's, so its
    clamped values are what the masks see)."""
    act_fn, clamp, _ = _ACTS[name]
    x, w_gu, b, plan, layout = _gated_problem(T, H, I, E, top_k, seed, device=device)
    gen = torch.Generator().manual_seed(seed + 100)
    dy = torch.randn(T, H, generator=gen).to(BF16).to(device)
    w_d = (torch.randn(E, I, H, generator=gen) / I**0.5).to(BF16).to(device)
    act, _ = gate_up_forward(x, w_gu.reshape(E, H, 2, I), layout, plan, activation=act_fn,
                             clamp_limits=clamp, b_gate_up_E2I=b, backend="torch")
    return dy, w_d, act, plan, layout


@pytest.mark.parametrize("name", list(_ACTS))
def test_dgated_twin_against_float64(name):
    act_fn, clamp, _ = _ACTS[name]
    dy, w_d, act, plan, layout = _dgated_problem(31, 64, 48, 6, 2, 11, name)
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, layout.row_to_token_S,
            layout.row_to_pair_S, plan.pair_affinity_R, act)
    dgu, ah, da = down_dgrad_activation_torch(*args, activation=act_fn, clamp_limits=clamp)
    dgu64, ah64, da64 = down_dgrad_activation_torch(
        *args, activation=act_fn, clamp_limits=clamp, acc_dtype=torch.float64,
        out_dtype=torch.float64,
    )
    pad = layout.row_to_pair_S < 0
    assert (dgu[pad] == 0).all() and (ah[pad] == 0).all() and (da[pad] == 0).all()
    assert (_ulps(dgu, dgu64) <= 1.01).all() and (_ulps(ah, ah64) <= 1.01).all()
    torch.testing.assert_close(da.double(), da64, rtol=1e-5, atol=1e-5)
    if clamp is not None:  # the strict masks: a clamped (stored) value passes no gradient
        g, u = act[layout.row_to_pair_S.clamp(min=0)].float().unbind(1)
        assert (dgu[~pad][:, :48][g[~pad] >= 7.0] == 0).all()
        assert (dgu[~pad][:, 48:][u[~pad].abs() >= 7.0] == 0).all()


@pytest.mark.parametrize("name", list(_ACTS))
def test_dgated_twin_matches_gemm_then_pass(name):
    """The current backward (dY rows @ W_down^T rounded to BF16, then activation_backward,
    Triton interpreted here) and the fused epilogue's twin (from the fp32 ``dh_raw``): they
    differ by the pass's rounding of ``dh_raw`` only."""
    from common.torch_backward import grouped_mm_rows
    from cuda_kernels.triton.activation import activation_backward

    act_fn, clamp, _ = _ACTS[name]
    T, H, I, E = 37, 64, 32, 5
    dy, w_d, act, plan, layout = _dgated_problem(T, H, I, E, 2, 12, name, device=DEV)
    dh = grouped_mm_rows(layout.gather_rows(dy), w_d.transpose(1, 2), layout.offsets_E)
    dgu_p, ah_p, da_p = activation_backward(
        dh, act, layout.row_to_pair_S, plan, activation=act_fn,
        clamp_limits=clamp or ClampLimits(),
    )
    dgu_f, ah_f, da_f = down_dgrad_backward(dy, w_d, layout, plan, act, activation=act_fn,
                                            clamp_limits=clamp, backend="torch")
    assert torch.equal(ah_f, ah_p)  # a*h depends on the checkpoint only: no dh_raw in it
    rel = ((dgu_f.float() - dgu_p.float()).norm() / dgu_p.float().norm()).item()
    assert rel < 5e-3
    assert da_f.shape == (T, E)
    torch.testing.assert_close(da_f, da_p, rtol=2e-2, atol=2e-2 * da_p.abs().max().item())
    assert torch.equal(da_f == 0, da_p == 0)  # the same routed cells


def test_dgated_bias_term_and_dense_cells():
    T, H, I, E = 21, 32, 16, 4
    dy, w_d, act, plan, layout = _dgated_problem(T, H, I, E, 2, 13, "swiglu")
    bd = torch.randn(E, H)
    _, _, da0 = down_dgrad_backward(dy, w_d, layout, plan, act)
    _, _, da1 = down_dgrad_backward(dy, w_d, layout, plan, act, b_down_EH=bd)
    routed = plan.affinity_dense_TE() != 0
    want = torch.where(routed, dy.float() @ bd.t(), 0.0)
    torch.testing.assert_close(da1 - da0, want, rtol=1e-5, atol=1e-5)
    assert (da0[~routed] == 0).all()


_DGATED_BAD = [
    ("act_R2I", lambda g: g["act_R2I"][:, :, :8].contiguous(), r"act_R2I must be \[R, 2, I\]"),
    ("act_R2I", lambda g: g["act_R2I"].reshape(-1, 32)[1:], r"or \[S, 2I\]"),
    ("act_R2I", lambda g: g["act_R2I"].float(), "contiguous torch.bfloat16"),
    ("row_to_pair_S", lambda g: g["row_to_pair_S"][1:], "row_to_pair_S must be"),
    ("pair_affinity_R", lambda g: g["pair_affinity_R"][None], "1-D float"),
    ("w_down_t", lambda g: g["w_down_t"][:, :8], "columns but w has K"),
]


@pytest.mark.parametrize("case", _DGATED_BAD,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(_DGATED_BAD)])
def test_dgated_bad_arguments(case):
    name, bad, message = case
    dy, w_d, act, plan, layout = _dgated_problem(10, 16, 16, 3, 2, 14, "swiglu")
    args = {"a": dy, "w_down_t": w_d.transpose(1, 2), "offsets_E": layout.offsets_E,
            "row_index": layout.row_to_token_S, "row_to_pair_S": layout.row_to_pair_S,
            "pair_affinity_R": plan.pair_affinity_R, "act_R2I": act}
    args[name] = bad(args)
    with pytest.raises(ValueError, match=message):
        grouped_mm_dgated(**args)


def test_dgated_reads_a_row_order_checkpoint_on_cpu():
    """The twin behind the entry reads an [S, 2I] checkpoint at each row's own index: the same
    outputs as the pair-order checkpoint it was laid out from."""
    dy, w_d, act, plan, layout = _dgated_problem(40, 32, 16, 5, 2, 15, "swiglu")
    r2p = layout.row_to_pair_S
    rows = torch.where((r2p >= 0)[:, None], act[r2p.clamp(min=0)].reshape(r2p.shape[0], -1), 0)
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, layout.row_to_token_S, r2p,
            plan.pair_affinity_R)
    for p, r in zip(grouped_mm_dgated(*args, act), grouped_mm_dgated(*args, rows.to(BF16))):
        assert torch.equal(p, r)


def test_dgated_key_validation():
    ge = GatedEpilogue()
    key = Sm90GroupedMmKey(768, 2048, 128, w_major="k", epilogue="dgated", gated=ge)
    assert (key.out_cols, key.n_tiles) == (768, 3)
    with pytest.raises(ValueError, match="no bias"):
        Sm90GroupedMmKey(768, 2048, 128, epilogue="dgated", gated=GatedEpilogue(has_bias=True))
    with pytest.raises(ValueError, match="exactly when"):
        Sm90GroupedMmKey(768, 2048, 128, epilogue="dgated")


# ------------------------------------------------------------------------------------------------
# the gathered-rows side output (a_rows_out): the torch path writes gather_rows' output
# ------------------------------------------------------------------------------------------------


def _bits(t):
    """The bit patterns of a BF16 tensor (torch.equal would take -0.0 for +0.0)."""
    return t.contiguous().view(torch.int16)


def _rows_problem(extra=5, seed=60, H=64, I=32):
    """A real layout (uneven, empty experts, padding rows) extended by ``extra`` rows past
    ``offsets_E[-1]`` whose index is VALID (the contract still asks for gather_rows' output
    there), x and dY with NaN in a source row no index refers to."""
    x, w_gu, b, plan, layout = _gated_problem(23, H, I, 5, 2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    T = x.shape[0]
    x = torch.cat([x, torch.full((1, H), float("nan"), dtype=BF16)])  # row T: never read
    dy = torch.cat([torch.randn(T, H, generator=gen).to(BF16),
                    torch.full((1, H), float("nan"), dtype=BF16)])
    idx = torch.cat([layout.row_to_token_S, torch.randint(0, T, (extra,), generator=gen)])
    idx[-1] = -1  # and one padding row past the last expert
    r2p = torch.cat([layout.row_to_pair_S, torch.full((extra,), -1, dtype=torch.int64)])
    assert (layout.row_to_token_S < 0).any(), "the layout should have padding rows"
    w_d = (torch.randn(5, I, H, generator=gen) / I**0.5).to(BF16)
    act, _ = gate_up_forward(x[:T], w_gu.reshape(5, H, 2, I), layout, plan, backend="torch")
    return x, dy, w_gu, w_d, act, plan, layout, idx, r2p


def _poisoned(S, K):
    return torch.full((S, K), float("nan"), dtype=BF16)


def gather_rows(a, idx, dtype):
    """The Triton gather pass (``triton.rows.gather_rows``) of CPU ``a`` / ``idx``, as
    CPU tensors: run compiled on the GPU where there is one (Triton interprets CPU tensors only
    without a GPU), in the interpreter otherwise."""
    from cuda_kernels.triton.rows import gather_rows as triton_gather

    return triton_gather(a.to(DEV), idx.to(DEV), dtype).cpu()


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_plain_entry_torch_path_writes_gather_rows_bitwise(idx_dtype):
    x, _dy, w_gu, _w_d, _act, _plan, layout, idx, _r2p = _rows_problem()
    idx = idx.to(idx_dtype)
    S, K = idx.shape[0], x.shape[1]
    rows = _poisoned(S, K)
    out = grouped_mm_gather(x, w_gu, layout.offsets_E, idx, backend="torch", a_rows_out=rows)
    want = gather_rows(x, idx, torch.bfloat16)
    assert torch.equal(_bits(rows), _bits(want))
    assert (idx < 0).any() and (_bits(rows[idx < 0]) == 0).all()  # +0.0, not -0.0 or NaN
    assert S > int(layout.offsets_E[-1]) and (idx[int(layout.offsets_E[-1]):] >= 0).any()
    assert torch.equal(_bits(out), _bits(grouped_mm_gather(x, w_gu, layout.offsets_E, idx,
                                                           backend="torch")))


def test_gated_entries_torch_path_write_gather_rows_bitwise():
    x, _dy, w_gu, _w_d, _act, plan, layout, idx, r2p = _rows_problem()
    S, K = idx.shape[0], x.shape[1]
    args = (x, w_gu, layout.offsets_E, idx, r2p, plan.pair_affinity_R, plan.num_pairs)
    rows = _poisoned(S, K)
    got = grouped_mm_gated(*args, backend="torch", a_rows_out=rows)
    assert torch.equal(_bits(rows), _bits(gather_rows(x, idx, torch.bfloat16)))
    for g, r in zip(got, grouped_mm_gated(*args, backend="torch")):
        assert torch.equal(_bits(g), _bits(r))
    # the layer's wrapper: x_rows_out through row_to_token_S (x in float32: converted first)
    T = layout.num_tokens
    xf = x[:T].float()
    x_rows = _poisoned(layout.tokens_sum, K)
    gate_up_forward(xf, w_gu.reshape(5, K, 2, -1), layout, plan, backend="torch",
                    x_rows_out=x_rows)
    assert torch.equal(_bits(x_rows),
                       _bits(gather_rows(xf, layout.row_to_token_S, torch.bfloat16)))


def test_dgated_entries_torch_path_write_gather_rows_bitwise():
    _x, dy, _w_gu, w_d, act, plan, layout, idx, r2p = _rows_problem()
    S, K = idx.shape[0], dy.shape[1]
    args = (dy, w_d.transpose(1, 2), layout.offsets_E, idx, r2p, plan.pair_affinity_R, act)
    rows = _poisoned(S, K)
    got = grouped_mm_dgated(*args, backend="torch", a_rows_out=rows)
    assert torch.equal(_bits(rows), _bits(gather_rows(dy, idx, torch.bfloat16)))
    for g, r in zip(got, grouped_mm_dgated(*args, backend="torch")):
        assert torch.equal(g, r)
    T = layout.num_tokens
    dy_rows = _poisoned(layout.tokens_sum, K)
    got = down_dgrad_backward(dy[:T], w_d, layout, plan, act, backend="torch",
                              dy_rows_out=dy_rows)
    assert torch.equal(_bits(dy_rows),
                       _bits(gather_rows(dy[:T], layout.row_to_token_S, torch.bfloat16)))
    for g, r in zip(got, down_dgrad_backward(dy[:T], w_d, layout, plan, act, backend="torch")):
        assert torch.equal(g, r)


def test_auto_backend_on_cpu_writes_a_rows_out_too():
    x, _dy, w_gu, _w_d, _act, _plan, layout, idx, _r2p = _rows_problem(extra=0)
    rows = _poisoned(idx.shape[0], x.shape[1])
    grouped_mm_gather(x, w_gu, layout.offsets_E, idx, a_rows_out=rows)  # auto: the twin here
    assert torch.equal(_bits(rows), _bits(gather_rows(x, idx, torch.bfloat16)))


_ROWS_BAD = [
    # (what, a_rows_out from (S, K, a) or "no-index", message)
    ("no-index", None, "a_rows_out needs a row_index"),
    ("not-a-tensor", lambda S, K, a: [[0.0] * K] * S, "a_rows_out must be a torch.Tensor"),
    ("rows", lambda S, K, a: _poisoned(S - 1, K), r"a_rows_out must have shape \[S, K\]"),
    ("cols", lambda S, K, a: _poisoned(S, K + 8), r"a_rows_out must have shape \[S, K\]"),
    ("dtype", lambda S, K, a: torch.zeros(S, K), "a_rows_out must be torch.bfloat16"),
    ("device", lambda S, K, a: torch.empty(S, K, dtype=BF16, device="meta"),
     "a_rows_out is on meta"),
    ("strided", lambda S, K, a: _poisoned(K, S).t(), "a_rows_out must be contiguous"),
    ("overlaps-a", lambda S, K, a: a[:S] if a.shape[0] >= S else a.new_empty(0),
     "must not overlap a"),
]


def _rows_bad_call(entry, case):
    """Call ``entry`` ("plain", "gated", "dgated") with the bad ``a_rows_out`` of ``case``;
    returns (the call, the main output it was given: NaN, must stay NaN)."""
    what, make, _msg = case
    x, dy, w_gu, w_d, act, plan, layout, idx, r2p = _rows_problem(extra=0)
    S, K = idx.shape[0], x.shape[1]
    big = torch.cat([x] * (S // x.shape[0] + 1))  # a source with >= S rows (the overlap case)
    src = big if what == "overlaps-a" else (dy if entry == "dgated" else x)
    rows = None if make is None else make(S, K, src)
    index = None if what == "no-index" else idx
    if what == "no-index":
        rows = _poisoned(S, K)
        src = src[:S] if src.shape[0] >= S else big[:S]  # [S, K] rows in order
    if entry == "plain":
        out = torch.full((S, w_gu.shape[2]), float("nan"), dtype=BF16)
        return (lambda: grouped_mm_gather(src, w_gu, layout.offsets_E, index, out,
                                          backend="torch", a_rows_out=rows)), out
    if entry == "gated":
        ah = torch.full((S, w_gu.shape[2] // 2), float("nan"), dtype=BF16)
        return (lambda: grouped_mm_gated(src, w_gu, layout.offsets_E, index, r2p,
                                         plan.pair_affinity_R, plan.num_pairs, ah_out=ah,
                                         backend="torch", a_rows_out=rows)), ah
    return (lambda: grouped_mm_dgated(src, w_d.transpose(1, 2), layout.offsets_E, index, r2p,
                                      plan.pair_affinity_R, act, backend="torch",
                                      a_rows_out=rows)), None


@pytest.mark.parametrize("entry", ["plain", "gated", "dgated"])
@pytest.mark.parametrize("case", _ROWS_BAD, ids=[c[0] for c in _ROWS_BAD])
def test_a_rows_out_bad_arguments_raise_before_writing(entry, case):
    call, out = _rows_bad_call(entry, case)
    with pytest.raises(ValueError, match=case[2]):
        call()
    if out is not None:
        assert out.isnan().all(), "an output was written before the ValueError"


def test_a_rows_out_empty_layout():
    x, w = _operands(4, 16, 8, 2, seed=3)
    offsets = torch.zeros(2, dtype=torch.int32)
    idx = torch.empty(0, dtype=torch.int64)
    rows = torch.empty(0, 16, dtype=BF16)
    out = grouped_mm_gather(x, w, offsets, idx, backend="torch", a_rows_out=rows)
    assert out.shape == (0, 8)
