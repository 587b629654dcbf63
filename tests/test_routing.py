"""Tests of common/routing.py against brute-force Python-loop constructions of REFERENCE §1.

Every expected layout here is built independently, slot by slot, from the router output with
plain Python lists (no torch sorting or scatter), then compared with the vectorized plan.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.routing import plan_routing
from common.shapes import static_num_blocks

# ----------------------------------------------------------------------------- brute force


def brute_pairs(expert_index: list[list[int]], affinity: list[list[float]], E: int):
    """{(token, expert): merged affinity} and tokens per expert, by a loop over slots."""
    merged: dict[tuple[int, int], float] = {}
    for t, (row_e, row_a) in enumerate(zip(expert_index, affinity)):
        for e, a in zip(row_e, row_a):
            if e < 0:
                continue
            merged[(t, e)] = merged.get((t, e), 0.0) + a
    tokens_of = {e: sorted(t for (t, ee) in merged if ee == e) for e in range(E)}
    return merged, tokens_of


def raw_static_n(T: int, K: int, E: int, B: int) -> int:
    """AWS's formula written out: ceil((T*K - (E-1)) / B) + E - 1."""
    return math.ceil((T * K - (E - 1)) / B) + E - 1


def brute_blockwise(expert_index, affinity, E, B, padding, N):
    """(token_position_to_id, block_to_expert, dense affinities [T(+1)][E]) by the §1.1 rules."""
    T = len(expert_index)
    merged, tokens_of = brute_pairs(expert_index, affinity, E)
    pad = -1 if padding == "skip" else T
    tpti: list[int] = []
    b2e: list[int] = []
    for e in range(E):
        toks = tokens_of[e]
        nblk = -(-len(toks) // B)
        for n in range(nblk):
            chunk = toks[n * B : (n + 1) * B]
            tpti.extend(chunk + [pad] * (B - len(chunk)))
            b2e.append(e)
    assert len(b2e) <= N
    while len(b2e) < N:  # unused trailing blocks: the last expert, all padding
        b2e.append(E - 1)
        tpti.extend([pad] * B)
    rows = T + (1 if padding == "zero_row" else 0)
    dense = [[merged.get((t, e), 0.0) for e in range(E)] for t in range(rows)]
    return tpti, b2e, dense


def brute_grouped(expert_index, affinity, E, align, S=None):
    """(offsets, row_to_token) of §1.2 by a loop."""
    _, tokens_of = brute_pairs(expert_index, affinity, E)
    offsets, rows, end = [], [], 0
    for e in range(E):
        toks = tokens_of[e]
        size = -(-len(toks) // align) * align
        rows.extend(toks + [-1] * (size - len(toks)))
        end += size
        offsets.append(end)
    if S is not None:
        rows.extend([-1] * (S - end))
        offsets[-1] = S
    return offsets, rows


def _tensors(expert_index, affinity, dtype=torch.float64):
    T = len(expert_index)
    K = len(expert_index[0]) if T else 1
    ei = torch.tensor(expert_index, dtype=torch.int64).reshape(T, K)
    af = torch.tensor(affinity, dtype=dtype).reshape(T, K)
    return ei, af


@st.composite
def routings(draw, max_t=12, max_k=4, max_e=6):
    T = draw(st.integers(0, max_t))
    K = draw(st.integers(1, max_k))
    E = draw(st.integers(1, max_e))
    ei = [[draw(st.integers(-1, E - 1)) for _ in range(K)] for _ in range(T)]
    # Affinities are multiples of 1/8 so that merged sums are exact in float64.
    af = [[draw(st.integers(1, 16)) / 8.0 for _ in range(K)] for _ in range(T)]
    return T, K, E, ei, af


def _check_blockwise(ei, af, T, K, E, B, padding, num_blocks=None):
    plan = plan_routing(*_tensors(ei, af), E)
    L = plan.blockwise(B, padding=padding, num_blocks=num_blocks)
    N = L.num_blocks
    if num_blocks is None:
        assert N == static_num_blocks(T, K, E, B)
        if T * K >= E - 1 and T * K > 0:
            assert N == raw_static_n(T, K, E, B)
    else:
        assert N == num_blocks
    tpti, b2e, dense = brute_blockwise(ei, af, E, B, padding, N)
    assert L.token_position_to_id.dtype == torch.int32
    assert L.block_to_expert.dtype == torch.int32
    assert tuple(L.token_position_to_id.shape) == (N * B,)
    assert tuple(L.block_to_expert.shape) == (N, 1)
    assert L.token_position_to_id.tolist() == tpti
    assert L.block_to_expert.flatten().tolist() == b2e
    rows = T + (1 if padding == "zero_row" else 0)
    assert tuple(L.expert_affinities_masked.shape) == (rows * E, 1)
    assert L.expert_affinities_masked.flatten().tolist() == [v for r in dense for v in r]
    return plan, L


# ------------------------------------------------------------------------ worked example


@pytest.mark.parametrize("padding,pad", [("skip", -1), ("zero_row", 6)])
def test_reference_worked_example_bit_for_bit(padding, pad):
    # REFERENCE §1.1: B=2, T=6, top_1, experts of tokens 0..5 = [0,1,0,2,0,1], E=3.
    ei = torch.tensor([[0], [1], [0], [2], [0], [1]], dtype=torch.int32)
    af = torch.tensor([[0.5], [0.25], [0.75], [1.0], [0.125], [0.375]])
    L = plan_routing(ei, af, 3).blockwise(2, padding=padding)
    assert L.num_blocks == 4
    assert L.block_to_expert.tolist() == [[0], [0], [1], [2]]
    assert L.token_position_to_id.tolist() == [0, 2, 4, pad, 1, 5, 3, pad]
    want = [0.5, 0, 0, 0, 0.25, 0, 0.75, 0, 0, 0, 0, 1.0, 0.125, 0, 0, 0, 0.375, 0]
    if padding == "zero_row":
        want += [0, 0, 0]
    assert L.expert_affinities_masked.flatten().tolist() == want
    assert L.expert_affinities_masked.dtype == af.dtype


# ------------------------------------------------------------------------ property tests


@settings(max_examples=50, deadline=None)
@given(r=routings(), B=st.integers(1, 5), padding=st.sampled_from(["skip", "zero_row"]))
def test_blockwise_matches_brute_force_and_properties(r, B, padding):
    T, K, E, ei, af = r
    plan, L = _check_blockwise(ei, af, T, K, E, B, padding)
    merged, tokens_of = brute_pairs(ei, af, E)
    N = L.num_blocks
    tpti = L.token_position_to_id.tolist()
    b2e = L.block_to_expert.flatten().tolist()
    pad = -1 if padding == "skip" else T
    # every routed (token, expert) pair exactly once; padding never a real token id
    seen = [(tpti[j], b2e[j // B]) for j in range(N * B) if tpti[j] != pad]
    assert sorted(seen) == sorted(merged)
    assert all(0 <= t < T for t, _ in seen)
    # blocks per expert = ceil(count / B) (+ trailing unused ones on E-1)
    used = sum(-(-len(tokens_of[e]) // B) for e in range(E))
    for e in range(E):
        want = -(-len(tokens_of[e]) // B) + (N - used if e == E - 1 else 0)
        assert b2e.count(e) == want
    # expert-contiguous, ascending expert
    assert b2e == sorted(b2e)
    # ascending tokens inside an expert, padding only at the end of an expert's last block
    for e in range(E):
        slots = [tpti[j] for j in range(N * B) if b2e[j // B] == e]
        real = [t for t in slots if t != pad]
        assert real == sorted(real)
        assert slots[: len(real)] == real
    # trailing unused blocks: all padding
    assert all(t == pad for t in tpti[used * B :])
    # position_to_pair agrees with the token map
    p2p = L.position_to_pair.tolist()
    for j in range(N * B):
        if p2p[j] < 0:
            assert tpti[j] == pad
        else:
            assert int(plan.pair_token_R[p2p[j]]) == tpti[j]
            assert int(plan.pair_expert_R[p2p[j]]) == b2e[j // B]


@settings(max_examples=50, deadline=None)
@given(r=routings(), align=st.sampled_from([1, 2, 3, 4, 8]))
def test_grouped_matches_brute_force_and_properties(r, align):
    T, _, E, ei, af = r
    plan = plan_routing(*_tensors(ei, af), E)
    G = plan.grouped(align=align)
    offsets, rows = brute_grouped(ei, af, E, align)
    assert G.offsets_E.dtype == torch.int32
    assert G.offsets_E.tolist() == offsets
    assert G.row_to_token_S.tolist() == rows
    assert G.tokens_sum == len(rows)
    off = [0] + offsets
    assert all(b >= a and (b - a) % align == 0 for a, b in itertools.pairwise(off))
    assert offsets[-1] == G.tokens_sum
    merged, _ = brute_pairs(ei, af, E)
    # every routed pair exactly once
    pairs = []
    for e in range(E):
        for s in range(off[e], off[e + 1]):
            if rows[s] >= 0:
                pairs.append((rows[s], e))
    assert sorted(pairs) == sorted(merged)
    # gather then scatter: each real row is its token's row; scatter sums a token's copies
    x = torch.randn(T, 3, dtype=torch.float64)
    g = G.gather_rows(x)
    assert tuple(g.shape) == (G.tokens_sum, 3)
    for s in range(G.tokens_sum):
        want = x[rows[s]] if rows[s] >= 0 else torch.zeros(3, dtype=torch.float64)
        assert torch.equal(g[s], want)
    copies = torch.tensor([sum(1 for (t, _) in merged if t == tt) for tt in range(T)],
                          dtype=torch.float64)
    back = G.scatter_add_rows(g)
    torch.testing.assert_close(back, x * copies[:, None], rtol=1e-15, atol=0)
    single = copies == 1
    assert torch.equal(back[single], x[single])


@settings(max_examples=50, deadline=None)
@given(r=routings())
def test_plan_fields_match_brute_force(r):
    T, K, E, ei, af = r
    plan = plan_routing(*_tensors(ei, af), E)
    merged, tokens_of = brute_pairs(ei, af, E)
    order = sorted(merged, key=lambda te: (te[1], te[0]))
    P = len(order)
    R = T * K
    assert int(plan.num_pairs) == P
    assert plan.pair_token_R.tolist() == [t for t, _ in order] + [-1] * (R - P)
    assert plan.pair_expert_R.tolist() == [e for _, e in order] + [E] * (R - P)
    assert plan.pair_affinity_R.tolist() == [merged[p] for p in order] + [0.0] * (R - P)
    assert plan.tokens_per_expert_E.tolist() == [len(tokens_of[e]) for e in range(E)]
    s2p = plan.slot_to_pair_TK.tolist()
    for t in range(T):
        for k in range(K):
            e = ei[t][k]
            assert s2p[t][k] == (-1 if e < 0 else order.index((t, e)))
    dense = plan.affinity_dense_TE()
    for t in range(T):
        for e in range(E):
            assert float(dense[t, e]) == merged.get((t, e), 0.0)


# ----------------------------------------------------------------- duplicates, dropped slots


def test_duplicate_experts_merged_and_slot_grads_equal():
    ei = [[1, 1, 3], [0, 2, -1]]
    af = [[0.2, 0.3, 0.5], [0.6, 0.4, 0.9]]
    plan = plan_routing(*_tensors(ei, af), 4)
    dense = plan.affinity_dense_TE()
    assert dense[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.5], abs=1e-15)
    assert float(dense[0, 1]) == 0.2 + 0.3
    assert int(plan.num_pairs) == 4  # (0,1) (0,3) (1,0) (1,2)
    assert plan.tokens_per_expert_E.tolist() == [1, 1, 1, 1]
    L = plan.blockwise(2)
    # expert 1 holds token 0 once, not twice
    tpti = L.token_position_to_id.tolist()
    b2e = L.block_to_expert.flatten().tolist()
    assert [tpti[j] for j in range(len(tpti)) if b2e[j // 2] == 1 and tpti[j] >= 0] == [0]
    d_TE = torch.tensor([[10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]], dtype=torch.float64)
    slot = plan.slot_affinity_grad(d_TE)
    assert slot.tolist() == [[11.0, 11.0, 13.0], [20.0, 22.0, 0.0]]


def test_dropped_slots_mixed_with_routed():
    ei = [[-1, 2], [0, -1], [-1, -1], [2, 0]]
    af = [[0.7, 0.25], [0.5, 0.9], [0.3, 0.3], [0.125, 0.875]]
    plan = plan_routing(*_tensors(ei, af), 3)
    assert plan.tokens_per_expert_E.tolist() == [2, 0, 2]
    assert plan.slot_to_pair_TK.tolist() == [[-1, 2], [0, -1], [-1, -1], [3, 1]]
    L = plan.blockwise(2, padding="skip")
    # N = ceil((8 - 2) / 2) + 2 = 5; expert 0 -> tokens [1, 3], expert 2 -> [0, 3]
    assert L.num_blocks == 5
    assert L.block_to_expert.flatten().tolist() == [0, 2, 2, 2, 2]
    assert L.token_position_to_id.tolist() == [1, 3, 0, 3, -1, -1, -1, -1, -1, -1]
    dense = plan.affinity_dense_TE().tolist()
    assert dense == [[0, 0, 0.25], [0.5, 0, 0], [0, 0, 0], [0.875, 0, 0.125]]
    G = plan.grouped(align=4)
    assert G.offsets_E.tolist() == [4, 4, 8]
    assert G.row_to_token_S.tolist() == [1, 3, -1, -1, 0, 3, -1, -1]


# ------------------------------------------------------------------------- empty experts


def _routing_from_counts(counts: list[int], E: int, perm_seed: int = 0):
    """top_1 routing with ``counts[e]`` tokens on expert e, tokens shuffled."""
    experts = [e for e in range(E) for _ in range(counts[e])]
    g = torch.Generator().manual_seed(perm_seed)
    perm = torch.randperm(len(experts), generator=g).tolist()
    ei = [[experts[p]] for p in perm]
    af = [[((i % 7) + 1) / 8.0] for i in range(len(experts))]
    return ei, af


@pytest.mark.parametrize("counts", [[0, 256, 256, 0, 512], [256, 256, 512, 0, 0]])
@pytest.mark.parametrize("padding", ["skip", "zero_row"])
def test_leading_consecutive_trailing_empty_experts(counts, padding):
    E, B = 5, 128
    ei, af = _routing_from_counts(counts, E)
    T = len(ei)
    plan, L = _check_blockwise(ei, af, T, 1, E, B, padding)
    assert plan.tokens_per_expert_E.tolist() == counts
    b2e = L.block_to_expert.flatten().tolist()
    used = sum(c // B for c in counts)
    want = [e for e in range(E) for _ in range(counts[e] // B)]
    want += [E - 1] * (L.num_blocks - used)
    assert b2e == want
    G = plan.grouped(align=256)
    ends = list(torch.tensor(counts).cumsum(0).tolist())
    assert G.offsets_E.tolist() == ends
    assert G.tokens_sum == T
    for e in range(E):
        begin = ends[e - 1] if e else 0
        toks = G.row_to_token_S[begin : ends[e]].tolist()
        assert toks == sorted(t for t in range(T) if ei[t][0] == e)


def test_every_expert_empty():
    ei = [[-1, -1]] * 5
    af = [[0.5, 0.5]] * 5
    plan = plan_routing(*_tensors(ei, af), 4)
    assert int(plan.num_pairs) == 0
    assert plan.tokens_per_expert_E.tolist() == [0, 0, 0, 0]
    for padding, pad in (("skip", -1), ("zero_row", 5)):
        L = plan.blockwise(4, padding=padding)
        # ceil((10 - 3) / 4) + 3 = 5 blocks, all padding, all on expert 3
        assert L.num_blocks == 5
        assert L.token_position_to_id.tolist() == [pad] * 20
        assert L.block_to_expert.flatten().tolist() == [3] * 5
        assert not L.expert_affinities_masked.any()
    G = plan.grouped(align=16)
    assert G.offsets_E.tolist() == [0, 0, 0, 0]
    assert G.tokens_sum == 0
    assert G.gather_rows(torch.ones(5, 2)).shape == (0, 2)
    assert torch.equal(G.scatter_add_rows(torch.ones(0, 2)), torch.zeros(5, 2))
    G = plan.grouped(align=16, max_tokens_sum=32)
    assert G.offsets_E.tolist() == [0, 0, 0, 32]
    assert G.row_to_token_S.tolist() == [-1] * 32


def test_zero_tokens():
    ei = torch.zeros(0, 3, dtype=torch.int64)
    af = torch.zeros(0, 3)
    plan = plan_routing(ei, af, 4)
    assert plan.num_tokens == 0 and int(plan.num_pairs) == 0
    assert plan.pair_token_R.numel() == 0
    assert plan.affinity_dense_TE().shape == (0, 4)
    assert plan.slot_affinity_grad(torch.zeros(0, 4)).shape == (0, 3)
    for padding, pad in (("skip", -1), ("zero_row", 0)):
        L = plan.blockwise(8, padding=padding)
        # T*K = 0 < E-1: at least the E-1 = 3 blocks of the bound, all padding on expert 3
        assert L.num_blocks == static_num_blocks(0, 3, 4, 8) == 3
        assert L.token_position_to_id.tolist() == [pad] * 24
        assert L.block_to_expert.flatten().tolist() == [3, 3, 3]
        assert L.expert_affinities_masked.shape == ((0 if padding == "skip" else 1) * 4, 1)
    G = plan.grouped(align=8)
    assert G.offsets_E.tolist() == [0, 0, 0, 0] and G.tokens_sum == 0
    assert G.scatter_add_rows(torch.zeros(0, 2)).shape == (0, 2)


# --------------------------------------------------------- num_blocks / max_tokens_sum options


def test_num_blocks_option():
    ei = [[0, 1], [1, 2], [0, 2], [1, -1]]
    af = [[0.5, 0.5]] * 4
    T, K, E, B = 4, 2, 3, 2
    n_static = raw_static_n(T, K, E, B)  # ceil(6/2) + 2 = 5
    assert n_static == 5
    # counts: e0 [0, 2], e1 [0, 1, 3], e2 [1, 2] -> blocks 1 + 2 + 1 = 4
    for n in (4, 5, 9):
        plan, L = _check_blockwise(ei, af, T, K, E, B, "skip", num_blocks=n)
        assert L.block_to_expert.flatten().tolist() == [0, 1, 1, 2] + [2] * (n - 4)
        assert L.token_position_to_id.tolist()[:8] == [0, 2, 0, 1, 3, -1, 1, 2]
    plan = plan_routing(*_tensors(ei, af), E)
    with pytest.raises(ValueError, match="num_blocks"):
        plan.blockwise(B, num_blocks=3)


def test_max_tokens_sum_option():
    ei = [[0], [2], [0], [2], [2]]
    af = [[0.5]] * 5
    plan = plan_routing(*_tensors(ei, af), 3)
    G = plan.grouped(align=4, max_tokens_sum=16)
    offsets, rows = brute_grouped(ei, af, 3, 4, S=16)
    assert offsets == [4, 4, 16]
    assert G.offsets_E.tolist() == offsets
    assert G.row_to_token_S.tolist() == rows
    assert G.tokens_sum == 16
    x = torch.arange(10.0).reshape(5, 2)
    g = G.gather_rows(x)
    assert not g[8:].any()
    g[8:] = float("nan")  # garbage past the real rows never reaches a token
    assert torch.equal(G.scatter_add_rows(g), x)
    assert plan.grouped(align=4, max_tokens_sum=8).offsets_E.tolist() == [4, 4, 8]
    with pytest.raises(ValueError, match="max_tokens_sum"):
        plan.grouped(align=4, max_tokens_sum=4)  # needs 8
    with pytest.raises(ValueError, match="max_tokens_sum"):
        plan.grouped(align=4, max_tokens_sum=14)  # not a multiple of 4


def test_padding_never_aliases_in_zero_row_mode():
    # Token T-1 is real; padding value T must never coincide with a real token id.
    ei = [[1], [1], [1]]
    af = [[1.0]] * 3
    L = plan_routing(*_tensors(ei, af), 2).blockwise(2, padding="zero_row")
    tpti = L.token_position_to_id.tolist()
    assert sorted(t for t in tpti if t != 3) == [0, 1, 2]
    assert tpti.count(3) == L.num_blocks * 2 - 3
    assert L.expert_affinities_masked.flatten().tolist()[-2:] == [0.0, 0.0]
    x = torch.ones(3, 4)
    assert torch.equal(L.pad_token_rows(x)[3], torch.zeros(4))
    assert torch.equal(L.pad_token_rows(x)[:3], x)


def test_checkpoint_from_pairs_layout_and_nan_padding():
    ei = [[0, 1], [1, -1], [0, 1]]
    af = [[0.5, 0.5]] * 3
    plan = plan_routing(*_tensors(ei, af), 2)
    L = plan.blockwise(2)
    P, R, I = int(plan.num_pairs), 6, 3
    act = torch.full((R, 2, I), float("nan"), dtype=torch.float64)
    act[:P] = torch.arange(P * 2 * I, dtype=torch.float64).reshape(P, 2, I)
    ck = L.checkpoint_from_pairs(act)
    N, B = L.num_blocks, 2
    assert tuple(ck.shape) == (N, 2, I, B)
    assert bool(torch.isfinite(ck).all())
    p2p = L.position_to_pair.tolist()
    for n in range(N):
        for j in range(B):
            p = p2p[n * B + j]
            want = act[p] if p >= 0 else torch.zeros(2, I, dtype=torch.float64)
            assert torch.equal(ck[n, :, :, j], want)
