"""CPU tests of the varlen-M grouped GEMM family (cuda_kernels/grouped_mm): the torch twin against
float64, the host entry's argument checks, the keys and tiles, and the kernel's tile schedule
(written in Python: every output tile exactly once, whatever the split).

The kernel itself: tests/test_grouped_mm_sm90.py (offline compiles here, GPU runs on an H200).
"""

import itertools

import pytest
import torch

from common.routing import plan_routing
from cuda_kernels.grouped_mm import grouped_mm_gather, grouped_mm_gather_torch
from cuda_kernels.grouped_mm.api import grouped_mm_key
from cuda_kernels.grouped_mm.sm90 import (
    Sm90GroupedMmKey,
    Sm90GroupedMmTile,
    select_grouped_mm_tile,
    tile_schedule,
)
from cuda_kernels.grouped_mm.torch_ref import expert_segments

BF16 = torch.bfloat16


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
        ({"pingpong": 1}, "bools"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90GroupedMmTile(**kwargs)
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
    assert (k.w_major, k.gather_a, k.index_dtype) == ("n", True, "int32")


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
