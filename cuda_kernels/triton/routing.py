"""The MoE layer's routing build on the GPU: router output -> RoutingPlan + GroupedLayout.

:func:`build_routing` replaces ``plan_routing(expert_index, affinity, E, validate=False)``
followed by ``plan.grouped(align, max_tokens_sum=S)`` (about 60 small torch ops, one of which
sorts) with four launches and no host read of a device value:

1. ``_count_kernel`` -- program ``b`` takes the ``BLOCK_S`` router slots ``[b*BLOCK_S,
   (b+1)*BLOCK_S)`` of the flattened ``[T*K]`` slots (token-major, so slot order is token
   order). A slot is *first* when its id lies in ``[0, E)`` and no earlier slot of the same token
   names the same expert. The program counts its first slots per expert (one-hot compare, looping
   over expert chunks) into column ``b + 1`` of ``counts [E, nb + 1]`` (column 0 is zero), writes
   each first slot's 1-based rank among the block's first slots of its expert (an inclusive
   cumsum of the one-hot along the slots) into ``rank [R]``, and its input-error bits into
   ``err_B [nb]``.
2. ``_scan_kernel`` -- one program per chunk of experts turns each row of ``counts`` into its
   inclusive cumsum in place: column ``b`` is then block ``b``'s exclusive prefix, column ``nb``
   the expert's total.
3. ``_starts_kernel`` -- one program: the exclusive scans of the totals over the experts (pair
   starts; row starts with each group rounded up to ``align``), the per-expert tables,
   ``num_pairs``, the row total and the error code (the bitwise OR of ``err_B``).
4. ``_place_kernel`` -- every slot's pair is ``pair_start[e] + prefix[e, b] + rank - 1`` and its
   row ``row_start[e] + prefix[e, b] + rank - 1`` (gathers of the tables, no one-hot); the
   program writes each pair (token, expert, affinity summed over the token's duplicate slots in
   slot order), each grouped row and the slot maps, and its static share of the padding entries
   (pairs past ``num_pairs``, the alignment rows of the experts ``e % nb == b``, the surplus rows
   past the last group), so every output entry is written exactly once.

It is a counting sort by expert (tokens ascend within an expert), so the layout matches
:func:`common.routing.plan_routing`'s stable sort bit for bit; no atomics, so every run is
bitwise identical; shapes depend only on ``T, K, E`` (and ``align``, ``tokens_sum``), so it is
CUDA-graph capturable. Index arithmetic is int32 inside the kernels (R and S below 2^31, checked
on the host); every index output is int64, as ``plan_routing``'s.

Bad input never raises on the host (that would need a host read): out-of-range ids are treated
as dropped slots (never used as an index) and the problem is reported in a device error code,
which :func:`check_routing_async` turns into a device-side assert that surfaces at the next
synchronisation.

Each kernel runs compiled on CUDA tensors and through Triton's interpreter on CPU tensors (the
CPU tests run the same kernel source with ``TRITON_INTERPRET=1``). Importing this module needs
``triton``; it does not query the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.routing import GroupedLayout, RoutingPlan, as_int, check_router_output
from common.shapes import static_tokens_sum

from .launch import TritonKernel, cast, interpreting, rne_bf16

__all__ = [
    "ERROR_MESSAGES",
    "ERR_AFFINITY_NEGATIVE",
    "ERR_AFFINITY_NONFINITE",
    "ERR_EXPERT_ID",
    "ERR_TOKENS_SUM",
    "build_routing",
    "check_routing_async",
    "default_tokens_sum",
]

ERR_EXPERT_ID = 1
"""Error bit 0: an expert id lies outside ``[-1, num_experts)`` (after widening to int64)."""
ERR_AFFINITY_NONFINITE = 2
"""Error bit 1: a routed slot (id in ``[0, num_experts)``) has a NaN or infinite affinity."""
ERR_AFFINITY_NEGATIVE = 4
"""Error bit 2: a routed slot has a negative affinity."""
ERR_TOKENS_SUM = 8
"""Error bit 3: a caller-chosen ``tokens_sum`` is below the rows the routing needs (rows past
``tokens_sum`` are not written; their slots get row -1)."""

ERROR_MESSAGES = {
    ERR_EXPERT_ID: "expert_index_TK: an expert id lies outside [-1, num_experts)",
    ERR_AFFINITY_NONFINITE: "affinity_TK: a routed slot's affinity is NaN or inf",
    ERR_AFFINITY_NEGATIVE: "affinity_TK: a routed slot's affinity is negative",
    ERR_TOKENS_SUM: "tokens_sum: the routing needs more grouped rows than tokens_sum",
}
"""The message of each error bit, as :func:`check_routing_async` asserts it."""

_BLOCK_S = 256  # router slots per program of the count and place kernels
_BLOCK_E = 16  # experts per chunk of the count kernel's one-hot (any E loops over chunks)
_SCAN_E = 8  # experts per program of the scan kernel
_SCAN_B = 256  # blocks per step of the scan kernel
_STARTS_E = 256  # experts per step of the starts kernel
_PAD_W = 16  # alignment rows written per step of the per-expert padding loop
_BLOCK_ERR = 1024  # err_B entries per step of the starts kernel's reduction
_NUM_WARPS = 8
_INT32_LIMIT = 2**31 - 1


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output buffer comes from here (``torch.empty``: each entry is written by a kernel;
    the tests patch this to poison the buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


default_tokens_sum = static_tokens_sum
"""The static row bound S (:func:`common.shapes.static_tokens_sum`, ``grouped_layout``'s bound for
``align = 16``): at least the rows any routing of R slots needs."""


# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _load_slots(ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, s, R, E, K: tl.constexpr):
    """The slots ``s`` [BLOCK_S] (flattened t*K + k, int32): token, id (widened to int64 and
    then, in range, int32), affinity, in-range flags. Ids outside [0, E) count as dropped."""
    live = s < R
    t = s // K
    k = s - t * K
    t64 = t.to(tl.int64)
    eid64 = tl.load(ids_ptr + t64 * s_id0 + k * s_id1, mask=live, other=0).to(tl.int64)
    aff = tl.load(aff_ptr + t64 * s_aff0 + k * s_aff1, mask=live, other=0.0)
    valid = live & (eid64 >= 0) & (eid64 < E)
    eid = tl.where(valid, eid64, 0).to(tl.int32)
    return t, k, eid, eid64, aff, valid


@triton.jit
def _first_and_sum(
    ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, t, k, eid, valid,
    K: tl.constexpr, COMPUTE: tl.constexpr, RNE_BF16: tl.constexpr, SUM: tl.constexpr,
):
    """``first``: no earlier slot of the token names the same expert; ``first_k``: the token's
    first slot naming the slot's expert (``k`` itself when ``first``). ``acc`` (with ``SUM``):
    the sum, in slot order and rounded to the affinity dtype after every add (as ``index_add_``
    sums the duplicates), of the token's slots naming the slot's expert."""
    out_ty = aff_ptr.dtype.element_ty
    t64 = t.to(tl.int64)
    found = tl.zeros(eid.shape, dtype=tl.int1)
    first_k = k
    acc = tl.zeros(eid.shape, dtype=out_ty)
    for j in tl.static_range(K):
        ej = tl.load(ids_ptr + t64 * s_id0 + j * s_id1, mask=valid, other=-1).to(tl.int64)
        same = valid & (ej == eid.to(tl.int64))
        first_k = tl.where(same & (~found), j, first_k)
        found = found | same
        if SUM:
            aj = tl.load(aff_ptr + t64 * s_aff0 + j * s_aff1, mask=valid, other=0.0)
            summed = cast(acc.to(COMPUTE) + aj.to(COMPUTE), out_ty, RNE_BF16)
            acc = tl.where(same, summed, acc)
    return valid & (first_k == k), first_k, acc


# ------------------------------------------------------------------------------ kernel 1
def _count_kernel(
    ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, counts_ptr, rank_ptr, err_ptr, R, E, NBP,
    K: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Per-block expert counts of first slots, in-block ranks and input-error bits.

    counts_ptr: [E, NBP = nb + 1] int32, block b's counts go to column b + 1, program 0 zeroes
    column 0. rank_ptr: [R] int32, a first slot's 1-based rank among the block's first slots of
    its expert (0 for other slots). err_ptr: [nb] int32, bit 0 bad id, bit 1 non-finite routed
    affinity, bit 2 negative one.
    """
    b = tl.program_id(0)
    s = b * BLOCK_S + tl.arange(0, BLOCK_S)
    t, k, eid, eid64, aff, valid = _load_slots(
        ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, s, R, E, K
    )
    first, _, _ = _first_and_sum(
        ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, t, k, eid, valid, K, COMPUTE, False, False
    )

    live = s < R
    bad_id = live & ((eid64 < -1) | (eid64 >= E))
    a = aff.to(COMPUTE)
    nonfinite = valid & ((a != a) | (tl.abs(a) == float("inf")))
    negative = valid & (a < 0)
    err = (tl.max(bad_id.to(tl.int32), axis=0) * 1
           | tl.max(nonfinite.to(tl.int32), axis=0) * 2
           | tl.max(negative.to(tl.int32), axis=0) * 4)
    tl.store(err_ptr + b, err)

    rank = tl.zeros([BLOCK_S], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        hit = (first[:, None] & (eid[:, None] == e[None, :])).to(tl.int32)
        run = tl.cumsum(hit, axis=0)
        rank += tl.sum(hit * run, axis=1)
        tl.store(counts_ptr + e * NBP + b + 1, tl.sum(hit, axis=0), mask=e < E)
        if b == 0:
            tl.store(counts_ptr + e * NBP, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e < E)
    tl.store(rank_ptr + s, rank, mask=live)


# ------------------------------------------------------------------------------ kernel 2
def _scan_kernel(counts_ptr, E, NBP, SCAN_E: tl.constexpr, SCAN_B: tl.constexpr):
    """Each expert row of ``counts [E, NBP]`` (int32) becomes its inclusive cumsum, in place."""
    e = tl.program_id(0) * SCAN_E + tl.arange(0, SCAN_E)
    carry = tl.zeros([SCAN_E], dtype=tl.int32)
    for c0 in range(0, NBP, SCAN_B):
        c = c0 + tl.arange(0, SCAN_B)
        m = (e[:, None] < E) & (c[None, :] < NBP)
        ptr = counts_ptr + e[:, None] * NBP + c[None, :]
        x = tl.load(ptr, mask=m, other=0)
        y = tl.cumsum(x, axis=1) + carry[:, None]
        tl.store(ptr, y, mask=m)
        carry += tl.sum(x, axis=1)


# ------------------------------------------------------------------------------ kernel 3
def _starts_kernel(
    prefix_ptr, err_ptr, pstart_ptr, rstart_ptr, tpe_ptr, offsets_ptr, num_pairs_ptr,
    rows_ptr, code_ptr, E, S, A, nb, NBP,
    STARTS_E: tl.constexpr, BLOCK_ERR: tl.constexpr,
):
    """One program: per-expert pair and row starts (int32 [E]), ``tokens_per_expert`` (int64),
    ``offsets`` (int32 cumulative row ends, the last one S), ``num_pairs`` (int64), the rows the
    groups need (int32 [1]) and the error code (int32)."""
    carry_p = tl.zeros([], dtype=tl.int32)
    carry_r = tl.zeros([], dtype=tl.int32)
    for e0 in range(0, E, STARTS_E):
        e = e0 + tl.arange(0, STARTS_E)
        in_e = e < E
        tot = tl.load(prefix_ptr + e * NBP + nb, mask=in_e, other=0)
        rnd = (tot + A - 1) // A * A
        p_start = carry_p + tl.cumsum(tot, axis=0) - tot
        r_start = carry_r + tl.cumsum(rnd, axis=0) - rnd
        end = tl.minimum(r_start + rnd, S)
        end = tl.where(e == E - 1, S, end)
        tl.store(pstart_ptr + e, p_start, mask=in_e)
        tl.store(rstart_ptr + e, r_start, mask=in_e)
        tl.store(tpe_ptr + e, tot.to(tl.int64), mask=in_e)
        tl.store(offsets_ptr + e, end, mask=in_e)
        carry_p += tl.sum(tot, axis=0)
        carry_r += tl.sum(rnd, axis=0)
    tl.store(num_pairs_ptr, carry_p.to(tl.int64))
    tl.store(rows_ptr, carry_r)
    code = tl.where(carry_r > S, 8, 0).to(tl.int32)
    for i0 in range(0, nb, BLOCK_ERR):
        i = i0 + tl.arange(0, BLOCK_ERR)
        w = tl.load(err_ptr + i, mask=i < nb, other=0)
        code = code | tl.max(w & 1, axis=0) | tl.max(w & 2, axis=0) | tl.max(w & 4, axis=0)
    tl.store(code_ptr, code)


# ------------------------------------------------------------------------------ kernel 4
def _place_kernel(
    ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, prefix_ptr, rank_ptr,
    pstart_ptr, rstart_ptr, num_pairs_ptr, rows_ptr,
    pair_token_ptr, pair_expert_ptr, pair_aff_ptr, slot_pair_ptr,
    r2t_ptr, r2p_ptr, slot_row_ptr,
    R, E, S, A, nb, NBP, rows_per_prog,
    K: tl.constexpr, COMPUTE: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_S: tl.constexpr, PAD_W: tl.constexpr,
):
    """Place every pair and grouped row, write the slot maps and this program's padding share.

    prefix_ptr: [E, NBP] int32, column b = block b's exclusive per-expert prefix (the scan of
    the count kernel's counts); pstart/rstart: [E] int32 (the starts kernel).
    """
    b = tl.program_id(0)
    s = b * BLOCK_S + tl.arange(0, BLOCK_S)
    t, k, eid, _, _, valid = _load_slots(
        ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, s, R, E, K
    )
    first, first_k, acc = _first_and_sum(
        ids_ptr, aff_ptr, s_id0, s_id1, s_aff0, s_aff1, t, k, eid, valid, K, COMPUTE, RNE_BF16,
        True,
    )
    live = s < R
    # a duplicate slot takes the pair of its token's first slot of the same expert, which lies
    # in this block or an earlier one: its rank and block prefix are read where they were made
    s_first = t * K + first_k
    rank = tl.load(rank_ptr + s_first, mask=valid, other=1)
    pre = tl.load(prefix_ptr + eid * NBP + s_first // BLOCK_S, mask=valid, other=0)
    pair = tl.load(pstart_ptr + eid, mask=valid, other=0) + pre + rank - 1
    row = tl.load(rstart_ptr + eid, mask=valid, other=0) + pre + rank - 1
    placed = first & (row < S)
    tl.store(slot_pair_ptr + s, tl.where(valid, pair, -1).to(tl.int64), mask=live)
    tl.store(slot_row_ptr + s, tl.where(placed, row, -1).to(tl.int64), mask=live)
    pair_c = tl.where(first, pair, 0)
    tl.store(pair_token_ptr + pair_c, t.to(tl.int64), mask=first)
    tl.store(pair_expert_ptr + pair_c, eid.to(tl.int64), mask=first)
    tl.store(pair_aff_ptr + pair_c, acc, mask=first)
    row_c = tl.where(placed, row, 0)
    tl.store(r2t_ptr + row_c, t.to(tl.int64), mask=placed)
    tl.store(r2p_ptr + row_c, pair.to(tl.int64), mask=placed)

    # padding pairs: this program's share [b*BLOCK_S, (b+1)*BLOCK_S) past num_pairs
    num_pairs = tl.load(num_pairs_ptr).to(tl.int32)
    pad_p = live & (s >= num_pairs)
    tl.store(pair_token_ptr + s, tl.full([BLOCK_S], -1, tl.int64), mask=pad_p)
    tl.store(pair_expert_ptr + s, tl.full([BLOCK_S], 0, tl.int64) + E, mask=pad_p)
    tl.store(pair_aff_ptr + s, tl.zeros([BLOCK_S], dtype=pair_aff_ptr.dtype.element_ty),
             mask=pad_p)

    # the alignment rows of this program's experts (e % nb == b) are padding
    for pe in range(b, E, nb):
        tot = tl.load(prefix_ptr + pe * NBP + nb)
        pad_start = tl.load(rstart_ptr + pe) + tot
        n_pad = (tot + A - 1) // A * A - tot
        for j0 in range(0, A, PAD_W):
            pad_row = pad_start + j0 + tl.arange(0, PAD_W)
            m = (j0 + tl.arange(0, PAD_W) < n_pad) & (pad_row < S)
            tl.store(r2t_ptr + pad_row, tl.full([PAD_W], -1, tl.int64), mask=m)
            tl.store(r2p_ptr + pad_row, tl.full([PAD_W], -1, tl.int64), mask=m)

    # surplus rows past the last group: this program's share of [0, S)
    rows = tl.load(rows_ptr)
    lo = b * rows_per_prog
    hi = tl.minimum(lo + rows_per_prog, S)
    for r0 in range(lo, hi, BLOCK_S):
        r = r0 + tl.arange(0, BLOCK_S)
        m = (r < hi) & (r >= rows)
        tl.store(r2t_ptr + r, tl.full([BLOCK_S], -1, tl.int64), mask=m)
        tl.store(r2p_ptr + r, tl.full([BLOCK_S], -1, tl.int64), mask=m)


_COUNT = TritonKernel(_count_kernel)
_SCAN = TritonKernel(_scan_kernel)
_STARTS = TritonKernel(_starts_kernel)
_PLACE = TritonKernel(_place_kernel)


def _compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check_args(expert_index_TK, affinity_TK, num_experts, align, tokens_sum):
    check_router_output(expert_index_TK, affinity_TK, names=("expert_index_TK", "affinity_TK"))

    E = as_int("num_experts", num_experts, 1)
    A = as_int("align", align, 1)
    T, K = expert_index_TK.shape
    if tokens_sum is None:
        S = default_tokens_sum(T * K, E, A)
    else:
        S = as_int("tokens_sum", tokens_sum, 0)
        if S % A:
            raise ValueError(f"tokens_sum={S} must be a multiple of align={A}")
    R = T * K
    if max(R, S, E * (-(-R // _BLOCK_S) + 1)) > _INT32_LIMIT:
        raise ValueError(
            f"build_routing indexes in int32: T*K={R} router slots, tokens_sum={S} rows and "
            f"num_experts={E} must keep every index below 2^31"
        )
    return E, A, S


def build_routing(
    expert_index_TK: torch.Tensor,
    affinity_TK: torch.Tensor,
    num_experts: int,
    *,
    align: int = 16,
    tokens_sum: int | None = None,
) -> tuple[RoutingPlan, GroupedLayout, torch.Tensor]:
    """Router output -> ``(plan, layout, error_code)`` in four launches, no host read.

    Dimensions: T tokens, K top_k, E experts, R = T*K, S = ``tokens_sum``.

    Every tensor of ``plan`` and ``layout`` is bit-identical (dtype and values) to
    ``plan = plan_routing(expert_index_TK, affinity_TK, E, validate=False)`` and
    ``layout = plan.grouped(align=align, max_tokens_sum=S)`` on valid input.

    Args:
        expert_index_TK: [T, K] integer tensor (any signed or unsigned dtype; read widened to
            int64, so uint64 ids >= 2^63 are negative), -1 = dropped slot, any strides.
        affinity_TK: [T, K] floating tensor on the same device, any strides; the values of
            dropped slots are ignored (they may be NaN or inf).
        num_experts: E >= 1.
        align: every expert's row count is padded up to a multiple of ``align`` (>= 1).
        tokens_sum: the static row count S, a multiple of ``align``; default
            :func:`default_tokens_sum` ``(R, E, align)``, which always suffices. The last
            expert owns the surplus rows (``offsets_E[-1] == S``).
    Returns:
        ``plan`` (:class:`~common.routing.RoutingPlan`: pair_token_R / pair_expert_R int64 [R],
        pair_affinity_R [R] affinity dtype, slot_to_pair_TK int64 [T, K], tokens_per_expert_E
        int64 [E], num_pairs 0-d int64), ``layout`` (:class:`~common.routing.GroupedLayout`:
        offsets_E int32 [E], row_to_token_S / row_to_pair_S int64 [S], slot_to_row_TK int64
        [T, K]), and ``error_code``: a 0-d int32 device tensor, 0 for valid input, else the OR
        of :data:`ERR_EXPERT_ID` (an id outside [-1, E)), :data:`ERR_AFFINITY_NONFINITE` (a
        routed slot's affinity is NaN or inf), :data:`ERR_AFFINITY_NEGATIVE` (a routed slot's
        affinity is negative; -inf sets this bit and the previous one),
        :data:`ERR_TOKENS_SUM` (``tokens_sum`` too small). The code is
        not read here (that would synchronise the host); pass it to
        :func:`check_routing_async`. On bad input the outputs are still well-formed: an
        out-of-range id is a dropped slot, every row and pair index is in range.
    Raises:
        ValueError: wrong types, ranks, dtypes, shapes or devices, bad ``num_experts``,
            ``align`` or ``tokens_sum``, or a problem whose indices reach 2^31 (T*K, S, or
            E * (ceil(T*K / 256) + 1)) (host-side checks of static properties only).
        RuntimeError: a non-CUDA device outside Triton's interpreter.
    """
    E, A, S = _check_args(expert_index_TK, affinity_TK, num_experts, align, tokens_sum)
    T, K = expert_index_TK.shape
    R = T * K
    dev = expert_index_TK.device
    i64 = torch.int64
    aff_dtype = affinity_TK.dtype

    pair_token = _alloc((R,), i64, dev)
    pair_expert = _alloc((R,), i64, dev)
    pair_aff = _alloc((R,), aff_dtype, dev)
    slot_pair = _alloc((T, K), i64, dev)
    r2t = _alloc((S,), i64, dev)
    r2p = _alloc((S,), i64, dev)
    slot_row = _alloc((T, K), i64, dev)
    tpe = _alloc((E,), i64, dev)
    offsets = _alloc((E,), torch.int32, dev)
    num_pairs = _alloc((), i64, dev)
    code = _alloc((), torch.int32, dev)

    if R == 0:  # T = 0: nothing routed, every row is padding (torch fills, no kernel)
        tpe.zero_()
        offsets.zero_()
        offsets[-1:].fill_(S)
        num_pairs.zero_()
        code.zero_()
        r2t.fill_(-1)
        r2p.fill_(-1)
    else:
        nb = triton.cdiv(R, _BLOCK_S)
        nbp = nb + 1
        i32 = torch.int32
        counts = _alloc((E, nbp), i32, dev)  # becomes the prefix table in place
        rank = _alloc((R,), i32, dev)
        err = _alloc((nb,), i32, dev)
        p_start = _alloc((E,), i32, dev)
        r_start = _alloc((E,), i32, dev)
        rows = _alloc((1,), i32, dev)
        ids, aff = expert_index_TK, affinity_TK
        strides = (ids.stride(0), ids.stride(1), aff.stride(0), aff.stride(1))
        compute = _compute_dtype(aff_dtype)
        _COUNT.launch(
            dev, (nb,), ids, aff, *strides, counts, rank, err, R, E, nbp,
            K=K, COMPUTE=compute, BLOCK_S=_BLOCK_S, BLOCK_E=_BLOCK_E, num_warps=_NUM_WARPS,
        )
        _SCAN.launch(dev, (triton.cdiv(E, _SCAN_E),), counts, E, nbp,
                     SCAN_E=_SCAN_E, SCAN_B=_SCAN_B, num_warps=_NUM_WARPS)
        _STARTS.launch(
            dev, (1,), counts, err, p_start, r_start, tpe, offsets, num_pairs, rows, code,
            E, S, A, nb, nbp, STARTS_E=_STARTS_E, BLOCK_ERR=_BLOCK_ERR, num_warps=_NUM_WARPS,
        )
        _PLACE.launch(
            dev, (nb,), ids, aff, *strides, counts, rank, p_start, r_start, num_pairs, rows,
            pair_token, pair_expert, pair_aff, slot_pair, r2t, r2p, slot_row,
            R, E, S, A, nb, nbp, triton.cdiv(S, nb),
            K=K, COMPUTE=compute, RNE_BF16=rne_bf16(aff_dtype),
            BLOCK_S=_BLOCK_S, PAD_W=_PAD_W, num_warps=_NUM_WARPS,
        )

    plan = RoutingPlan(
        num_tokens=T, num_experts=E, top_k=K,
        pair_token_R=pair_token, pair_expert_R=pair_expert, pair_affinity_R=pair_aff,
        slot_to_pair_TK=slot_pair, tokens_per_expert_E=tpe, num_pairs=num_pairs,
    )
    layout = GroupedLayout(
        offsets_E=offsets, row_to_token_S=r2t, row_to_pair_S=r2p, slot_to_row_TK=slot_row,
        tokens_sum=S, align=A, num_tokens=T, num_pair_rows=R,
    )
    return plan, layout, code


# ----------------------------------------------------------------------------- the check
def _check_kernel(code_ptr):
    code = tl.load(code_ptr)
    tl.device_assert(
        (code & 1) == 0, "expert_index_TK: an expert id lies outside [-1, num_experts)"
    )
    tl.device_assert((code & 2) == 0, "affinity_TK: a routed slot's affinity is NaN or inf")
    tl.device_assert((code & 4) == 0, "affinity_TK: a routed slot's affinity is negative")
    tl.device_assert(
        (code & 8) == 0, "tokens_sum: the routing needs more grouped rows than tokens_sum"
    )


# debug=True compiles the device_asserts in for this kernel only (Triton 3.6: JITFunction.run
# uses ``debug = kernel's debug or TRITON_DEBUG``); every other kernel stays assert-free.
_CHECK = TritonKernel(_check_kernel, debug=True)


def check_routing_async(error_code: torch.Tensor) -> None:
    """Assert on the device that :func:`build_routing`'s ``error_code`` (0-d int32) is 0.

    On CUDA this launches one tiny kernel and returns at once: it raises nothing on the host,
    because reading the code would synchronise the host with the GPU (and break CUDA-graph
    capture). A nonzero code fails a ``tl.device_assert`` whose printed message names the
    argument and the rule (:data:`ERROR_MESSAGES`); the failure surfaces at the next
    synchronisation as ``RuntimeError: CUDA error: device-side assert triggered`` (the message
    is printed on stderr by the device), after which the CUDA context is unusable, as for any
    device-side assert.

    On the CPU (Triton's interpreter, as in the tests) the kernel runs too, but Triton 3.6's
    interpreter ignores ``device_assert`` (its builder's options have ``debug=False`` whatever
    ``triton.jit(debug=...)`` or ``TRITON_DEBUG`` say), and a host read costs nothing there, so
    the code is then read and a nonzero one raises ValueError joining the messages of its bits.

    Raises:
        ValueError: ``error_code`` is not a 0-d int32 tensor; on the CPU only, a nonzero code.
        RuntimeError: a non-CUDA, non-CPU device, or a CPU tensor outside the interpreter.
    """
    if not isinstance(error_code, torch.Tensor) or error_code.dim() != 0 or (
        error_code.dtype != torch.int32
    ):
        raise ValueError(f"error_code must be a 0-d int32 tensor, got {error_code!r}")
    dev = error_code.device
    if dev.type == "cpu" and not interpreting():
        raise RuntimeError("check_routing_async needs a CUDA tensor or Triton's interpreter")
    _CHECK.launch(dev, (1,), error_code, num_warps=1)
    if dev.type == "cpu":
        code = int(error_code)
        msgs = [m for bit, m in ERROR_MESSAGES.items() if code & bit]
        if msgs:
            raise ValueError("; ".join(msgs))
