"""Offline (CPU, no CuTe DSL) bounds check of every TMA box the SM100 grouped-wgrad schedule
issues (issue 23 item 8; review: docs/sm100-tma-bounds.md).

The device-side coordinate math cannot be called from Python, so it is mirrored here:
``_tile_coords`` mirrors ``Sm100GroupedWgradKernel.tile_coords`` (sm100_bf16.py, the K range and
the ``bad`` rules), ``_boxes`` the TMA warp's K loop (``tma_warp``: ``k0_a = 0`` with a per-expert
descriptor, else ``k0``) and ``build_descriptors`` (per-expert ``(rows, K_e)`` at element offset
``begin * rows``). Tile sizes come from the kernel's own ``select_sm100_tile_config``.
"""

import pytest

from cuda_kernels.gemm.sm100.wgrad_bf16 import (
    Sm100WgradKey,
    _descriptor_slots,
    select_sm100_tile_config,
)
from cuda_kernels.grouped_wgrad.validate import check_offsets_now

M, N = 384, 320  # partial last M / N tiles for the 256 / 128 tiles
ALIGN = 256  # the SM100 BF16 contract: every expert a multiple of 256 tokens

SPLITS = {
    "empty_first": [0, 256, 512, 768],
    "empty_middle": [256, 256, 768, 1024],
    "empty_last": [512, 768, 1024, 1024],
    "all_empty_but_one": [0, 0, 0, 256],
    "one_tile_each": [256, 512, 768, 1024],
    "last_at_tile_edge": [1280, 2048, 2304, 4096],
}
#: Offsets that break the contract (only reachable when the host check is skipped).
BREACHES = {
    "tail_of_1_row": ([256, 257, 512, 768], 768),
    "end_past_tokens_sum": ([256, 512, 768, 1024], 768),
    "negative_begin": ([-256, 0, 256, 512], 512),
    "decreasing": ([512, 256, 512, 768], 768),
    "sum_beyond_last_offset": ([256, 512, 768, 768], 1024),
}


def _tile_coords(offsets, e, tile_k, tokens_sum):
    """Mirror of sm100_bf16.py ``tile_coords``: (first K tile, K tiles, bad) of expert ``e``.
    Division / remainder as PTX div.s32 / rem.s32 (truncated toward zero)."""
    k_end = offsets[e]
    k_begin = offsets[e - 1] if e > 0 else 0
    k_len = k_end - k_begin

    def rem(a, b):
        return a - b * int(a / b)

    bad = k_len < 0 or rem(k_begin, tile_k) != 0 or rem(k_len, tile_k) != 0
    bad = bad or k_begin < 0 or k_end > tokens_sum  # the range check (tokens_sum = A.shape[1])
    n_k = 0 if bad else int(k_len / tile_k)
    return int(k_begin / tile_k), n_k, bad


def _boxes(key, offsets, tokens_sum):
    """Every (operand, descriptor dims, base element offset, box start, box extent) the TMA warp
    issues for A and B: dims are (rows, K) of the descriptor the copy goes through."""
    t = key.tile
    rows = {"a": M, "b": N}
    box_rows = {"a": t.tile_m // (2 if t.tile_m == 256 else 1), "b": t.tile_n}
    ragged = set(_descriptor_slots(key)) & {"a", "b"}
    out = []
    for e in range(key.num_experts):
        k0, n_k, _bad = _tile_coords(offsets, e, t.tile_k, tokens_sum)
        for op in ("a", "b"):
            if op in ragged:  # build_descriptors: (rows, K_e) at begin * rows, k0_x = 0
                dims, base, kstart = (rows[op], n_k * t.tile_k), k0 * t.tile_k * rows[op], 0
            else:  # host descriptor of the whole (rows, S) operand
                dims, base, kstart = (rows[op], tokens_sum), 0, k0
            for r0 in range(0, rows[op], box_rows[op]):
                for kt in range(n_k):
                    out.append((op, dims, base, (r0, (kstart + kt) * t.tile_k),
                                (box_rows[op], t.tile_k)))
    return out


def _keys():
    for tile_mn in ((128, 128), (256, 256), (128, 64)):
        for order in ("tensor2d", "tensor_ragged"):
            tile = select_sm100_tile_config(M, N, 4, mma_tiler_mn=tile_mn)
            yield Sm100WgradKey(M, N, 4, a_major="k", b_major="k", input_order=order, tile=tile)


def _check(key, offsets, tokens_sum):
    alloc = {"a": M * tokens_sum, "b": N * tokens_sum}  # elements of the (rows, S) operand
    for op, dims, base, start, extent in _boxes(key, offsets, tokens_sum):
        # the declared extent never exceeds the allocation (the PR #201 fault class)
        assert 0 <= base and base + dims[0] * dims[1] <= alloc[op], (op, dims, base)
        # K: every box lies wholly inside the declared K extent (no zero-fill needed along K)
        assert 0 <= start[1] and start[1] + extent[1] <= dims[1], (op, dims, start)
        # rows: the box starts inside; a partial last tile is clipped by the declared rows
        assert 0 <= start[0] < dims[0]


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_every_box_inside_descriptor_and_allocation(name):
    offsets = SPLITS[name]
    check_offsets_now(_as_tensor(offsets), offsets[-1], ALIGN, "offsets")  # a valid split
    for key in _keys():
        assert key.tile.tile_k <= ALIGN and ALIGN % key.tile.tile_k == 0
        _check(key, offsets, offsets[-1])
        # every K token of every expert is loaded exactly once per row tile
        t = key.tile
        ks = {b[3][1] + b[2] // (M if b[0] == "a" else N) for b in _boxes(key, offsets,
              offsets[-1]) if b[0] == "a" and b[3][0] == 0}
        assert ks == set(range(0, offsets[-1], t.tile_k))


@pytest.mark.parametrize("name", sorted(BREACHES))
def test_contract_breaches_refused_on_host_and_issue_nothing_outside(name):
    offsets, tokens_sum = BREACHES[name]
    with pytest.raises(ValueError):
        check_offsets_now(_as_tensor(offsets), tokens_sum, ALIGN, "offsets")
    # host check skipped: the device's bad rule must still keep every box inside
    for key in _keys():
        _check(key, offsets, tokens_sum)


def test_range_check_is_what_keeps_ragged_descriptors_inside():
    """Without the begin >= 0 / end <= tokens_sum rule, a ragged descriptor of an expert whose
    range leaves the operand would declare memory past A (the hazard the rule closes)."""
    offsets, s = [256, 512, 768, 1024], 768
    k_begin, k_end = offsets[2], offsets[3]
    assert (k_begin % 128, (k_end - k_begin) % 128) == (0, 0)  # the old rules passed it
    assert k_begin * M + M * (k_end - k_begin) > M * s  # its descriptor would pass A's end
    assert _tile_coords(offsets, 3, 128, s)[2]  # now flagged bad: no descriptor, NaN output


def _as_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.int32)
