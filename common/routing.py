"""Router output -> the blocked layouts the MoE backward kernels consume.

The router gives, per token ``t`` and slot ``k < top_k``, an expert id ``expert_index[t, k]``
(``-1`` = dropped slot) and an affinity ``affinity[t, k]``. :func:`plan_routing` turns that into a
:class:`RoutingPlan`: the routed (token, expert) *pairs* sorted by expert, then token. Two views of
the plan feed the two kernel families:

* :meth:`RoutingPlan.blockwise` -- AWS NKI's blockwise layout (REFERENCE §1.1):
  ``token_position_to_id`` [N*B], ``block_to_expert`` [N, 1], ``expert_affinities_masked``
  [T*E, 1]. Blocks are expert-contiguous in ascending expert order, tokens ascend inside an
  expert, unused trailing blocks belong to the last expert and hold only padding.
* :meth:`RoutingPlan.grouped` -- the cuDNN-style grouped layout (REFERENCE §1.2): ``offsets``
  [E] (cumulative ends, each group a multiple of ``align``) and a row -> token gather index.

Everything is vectorized torch on the input's device: no Python loop over tokens or experts.

Host synchronisation on CUDA (the only points; each documented where it happens):

* ``plan_routing(..., validate=True)`` reads the min/max expert id and checks affinities are
  finite. Pass ``validate=False`` to skip (CUDA-graph capturable).
* ``grouped(max_tokens_sum=None)`` reads the total row count to size the layout; pass an upper
  bound ``max_tokens_sum`` (a multiple of ``align``) to avoid it. The extra rows are zero padding
  owned by the last expert, as the blockwise layout's trailing blocks are.
* ``blockwise(num_blocks=n)`` with ``n`` below the static bound reads the block count once to
  check that ``n`` suffices; the default static ``N`` needs no read.

Duplicate experts in one token's top-k are merged into one pair whose affinity is the sum
(exact for the forward pass); ``slot_to_pair_TK`` keeps the slot -> pair map so per-slot affinity
gradients can be returned (each duplicate slot gets the merged pair's gradient).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from common.shapes import static_num_blocks

__all__ = [
    "PADDING_MODES",
    "ROUTING_ERRORS",
    "BlockwiseLayout",
    "GroupedLayout",
    "RoutingPlan",
    "as_int",
    "assert_routing_async",
    "check_router_output",
    "host_reads_free",
    "plan_routing",
    "presorted_routing",
    "routing_error_code",
]

PADDING_MODES = ("skip", "zero_row")
"""Blockwise padding conventions: ``skip`` marks padding slots -1 (the kernel skips them by
out-of-bounds DMA); ``zero_row`` marks them T and the inputs get one extra all-zero row T."""


def _round_up(x: torch.Tensor | int, m: int):
    return (x + m - 1) // m * m


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def as_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int (numpy integers accepted) >= ``minimum``, else ValueError."""
    if isinstance(value, (bool, float, torch.Tensor)):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v}")
    return v


def _check_positive_int(name: str, value) -> int:
    return as_int(name, value, 1)


@dataclass(frozen=True)
class BlockwiseLayout:
    """AWS NKI's blockwise layout of a routing plan (REFERENCE §1.1).

    Attributes:
        token_position_to_id: [N*B] int32, token id of slot j of block n at ``n*B + j``; padding
            slots hold -1 (``padding="skip"``) or T (``padding="zero_row"``).
        block_to_expert: [N, 1] int32, expert of each block; unused trailing blocks -> E-1.
        expert_affinities_masked: [T*E, 1] (skip) or [(T+1)*E, 1] (zero_row), the dense
            affinity matrix flattened token-major (element (t, e) at ``t*E + e``), affinity dtype.
        position_to_pair: [N*B] int64, the plan's pair index of each slot, -1 for padding.
        num_blocks: N.  block_size: B.  padding: "skip" or "zero_row".  num_tokens: T.
        num_pair_rows: R, the row count of per-pair tensors (``T * top_k``).
    """

    token_position_to_id: torch.Tensor
    block_to_expert: torch.Tensor
    expert_affinities_masked: torch.Tensor
    position_to_pair: torch.Tensor
    num_blocks: int
    block_size: int
    padding: str
    num_tokens: int
    num_pair_rows: int

    def pad_token_rows(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Append the all-zero row T for ``padding="zero_row"``; return ``x_TH`` unchanged for
        ``"skip"``. x_TH: [T, ...] -> [T+1, ...] or [T, ...]."""
        if x_TH.shape[0] != self.num_tokens:
            raise ValueError(
                f"pad_token_rows: x_TH has {x_TH.shape[0]} rows, the layout has T={self.num_tokens}"
            )
        if self.padding == "skip":
            return x_TH
        return torch.cat([x_TH, x_TH.new_zeros((1,) + tuple(x_TH.shape[1:]))], 0)

    def checkpoint_from_pairs(self, act_R2I: torch.Tensor) -> torch.Tensor:
        """Arrange per-pair activations into the kernel's checkpoint ``[N, 2, I, B]``.

        Args:
            act_R2I: [R, 2, I], row p = pair p of the plan (gate, up); padding pairs may hold NaN.
        Returns:
            [N, 2, I, B] contiguous, same dtype; padding slots are exactly 0 (selected, so NaN
            in unused rows never leaks).
        """
        R = self.num_pair_rows
        if act_R2I.dim() != 3 or act_R2I.shape[0] != R or act_R2I.shape[1] != 2:
            raise ValueError(f"act_R2I must be [R={R}, 2, I], got {tuple(act_R2I.shape)}")
        N, B = self.num_blocks, self.block_size
        I = act_R2I.shape[2]
        valid = self.position_to_pair >= 0
        if R == 0:
            rows = act_R2I.new_zeros((N * B, 2, I))
        else:
            rows = act_R2I[self.position_to_pair.clamp(min=0)]
            rows = torch.where(valid[:, None, None], rows, rows.new_zeros(()))
        return rows.reshape(N, B, 2, I).permute(0, 2, 3, 1).contiguous()


@dataclass(frozen=True)
class GroupedLayout:
    """The cuDNN-style grouped layout of a routing plan (REFERENCE §1.2).

    Attributes:
        offsets_E: [E] int32, cumulative END row of each expert; every group size is a multiple
            of ``align``; ``offsets_E[-1] == tokens_sum``; empty experts repeat the offset.
        row_to_token_S: [S] int64, token id of each row, -1 for padding rows.
        row_to_pair_S: [S] int64, plan pair index of each row, -1 for padding rows.
        slot_to_row_TK: [T, K] int64, the row of each router slot; -1 for dropped slots and for
            every slot but the first of a merged duplicate (token, expert) pair, so summing a
            token's rows through it counts each pair once (dX without a scatter or atomics).
        tokens_sum: S.  align: the group alignment.  num_tokens: T.
        num_pair_rows: R, the row count of per-pair tensors (``T * top_k``).
        identity: the rows ARE the tokens (:func:`presorted_routing`: S = T = R, top_k 1, row s
            holds token s or is padding): nothing to gather or combine. Its groups are not
            padded (``align`` 1) and ``offsets_E[-1]`` may lie below S: the rows past it belong
            to no expert.
    """

    offsets_E: torch.Tensor
    row_to_token_S: torch.Tensor
    row_to_pair_S: torch.Tensor
    slot_to_row_TK: torch.Tensor
    tokens_sum: int
    align: int
    num_tokens: int
    num_pair_rows: int
    identity: bool = False

    def gather_rows(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Rows of ``x_TH`` [T, ...] in grouped order: [S, ...], padding rows exactly 0."""
        if x_TH.shape[0] != self.num_tokens:
            raise ValueError(
                f"gather_rows: x_TH has {x_TH.shape[0]} rows, the layout has T={self.num_tokens}"
            )
        return _gather_masked(x_TH, self.row_to_token_S, self.tokens_sum)

    def gather_pairs(self, per_pair_R: torch.Tensor) -> torch.Tensor:
        """Per-pair rows [R, ...] in grouped order: [S, ...], padding rows exactly 0."""
        if per_pair_R.shape[0] != self.num_pair_rows:
            raise ValueError(
                f"gather_pairs: per_pair_R has {per_pair_R.shape[0]} rows, the plan has "
                f"R={self.num_pair_rows}"
            )
        return _gather_masked(per_pair_R, self.row_to_pair_S, self.tokens_sum)

    def scatter_add_rows(self, rows_S: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """Sum grouped rows [S, ...] back onto their tokens: [T, ...] (``num_tokens``, if given,
        must equal the layout's T).

        Padding rows are added into a dump row past the tokens, so NaN or garbage in them never
        reaches the result.
        """
        T = self.num_tokens
        if num_tokens is not None and num_tokens != T:
            raise ValueError(
                f"scatter_add_rows: num_tokens={num_tokens!r} but the layout has T={T}"
            )
        if rows_S.shape[0] != self.tokens_sum:
            raise ValueError(
                f"scatter_add_rows: rows_S has {rows_S.shape[0]} rows, "
                f"layout has S={self.tokens_sum}"
            )
        valid = self.row_to_token_S >= 0
        dest = torch.where(valid, self.row_to_token_S, torch.full_like(self.row_to_token_S, T))
        out = rows_S.new_zeros((T + 1,) + tuple(rows_S.shape[1:]))
        out.index_add_(0, dest, rows_S)  # padding rows into the dump row T (no select pass)
        return out[:T]


def host_reads_free(t: torch.Tensor) -> bool:
    """True for a CPU tensor outside ``torch.compile`` tracing: reading its values on the host
    costs no device synchronisation and a data-dependent shape is fine there."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _gather_masked(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``out[s] = src[index[s]]``, rows where ``index[s] < 0`` exactly 0 (never read)."""
    tail = tuple(src.shape[1:])
    if src.shape[0] == 0 or n == 0:
        return src.new_zeros((n,) + tail)
    if host_reads_free(index):
        # A row gather (index_select copies whole rows), then only the padding rows zeroed:
        # advanced indexing plus a select over every element took ~15x as long on the CPU
        # (530 us against 36 us for [1152, 256] BF16 rows, one thread).
        rows = src.index_select(0, index.clamp(min=0))
        pad = torch.nonzero(index < 0).squeeze(1)
        if pad.numel():
            rows.index_fill_(0, pad, 0)
        return rows
    valid = index >= 0
    rows = src[index.clamp(min=0)]
    return torch.where(valid.view(-1, *((1,) * len(tail))), rows, rows.new_zeros(()))


@dataclass(frozen=True)
class RoutingPlan:
    """Routed (token, expert) pairs, sorted by expert then token. Built by :func:`plan_routing`.

    Attributes (R = T * top_k):
        num_tokens: T.  num_experts: E.  top_k: K.
        pair_token_R: [R] int64, token of each pair; -1 for the padding entries past the pairs.
        pair_expert_R: [R] int64, expert of each pair; E for padding entries.
        pair_affinity_R: [R] affinity dtype, merged affinity (duplicate slots summed); 0 for
            padding.
        slot_to_pair_TK: [T, K] int64, pair index of each router slot, -1 for dropped slots.
        tokens_per_expert_E: [E] int64, pairs routed to each expert.
        num_pairs: 0-d int64 tensor, the number of real pairs (stays on the device).
    """

    num_tokens: int
    num_experts: int
    top_k: int
    pair_token_R: torch.Tensor
    pair_expert_R: torch.Tensor
    pair_affinity_R: torch.Tensor
    slot_to_pair_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    num_pairs: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.pair_token_R.device

    @property
    def pair_valid_R(self) -> torch.Tensor:
        """[R] bool, True for real pairs."""
        return self.pair_token_R >= 0

    def _expert_start_E(self) -> torch.Tensor:
        return _exclusive_cumsum(self.tokens_per_expert_E)

    def _pair_rank_R(self) -> torch.Tensor:
        """Position of each pair inside its expert (0 for padding entries)."""
        R = self.pair_token_R.shape[0]
        p = torch.arange(R, device=self.device)
        start = self._expert_start_E()
        e = self.pair_expert_R.clamp(max=self.num_experts - 1)
        return torch.where(self.pair_valid_R, p - start[e], torch.zeros_like(p))

    def affinity_dense_TE(self) -> torch.Tensor:
        """[T, E] dense affinity matrix (merged duplicates; 0 where not routed)."""
        T, E = self.num_tokens, self.num_experts
        flat = self.pair_affinity_R.new_zeros(T * E + 1)
        idx = torch.where(
            self.pair_valid_R,
            self.pair_token_R * E + self.pair_expert_R,
            torch.full_like(self.pair_token_R, T * E),
        )
        flat.index_put_((idx,), torch.where(self.pair_valid_R, self.pair_affinity_R, 0.0))
        return flat[: T * E].reshape(T, E)

    def pair_values_from_dense(self, dense_TE: torch.Tensor) -> torch.Tensor:
        """[R] the (token, expert) cell of ``dense_TE`` [T, E] for each pair (0 for padding)."""
        if tuple(dense_TE.shape) != (self.num_tokens, self.num_experts):
            raise ValueError(
                f"dense_TE must be [T, E] = [{self.num_tokens}, {self.num_experts}], "
                f"got {tuple(dense_TE.shape)}"
            )
        if self.num_tokens == 0:
            return dense_TE.new_zeros(self.pair_token_R.shape[0])
        vals = dense_TE[
            self.pair_token_R.clamp(min=0), self.pair_expert_R.clamp(max=self.num_experts - 1)
        ]
        return torch.where(self.pair_valid_R, vals, vals.new_zeros(()))

    def pairs_from_slots(self, per_slot_TK: torch.Tensor) -> torch.Tensor:
        """Per-router-slot rows [T, K, ...] -> per-pair rows [R, ...] in the plan's pair order.

        Duplicate slots of one (token, expert) carry the same activations; the pair takes one
        of them. Padding pairs get 0.
        """
        T, K = self.num_tokens, self.top_k
        if per_slot_TK.dim() < 2 or tuple(per_slot_TK.shape[:2]) != (T, K):
            raise ValueError(
                f"per_slot_TK must be [T={T}, K={K}, ...], got {tuple(per_slot_TK.shape)}"
            )
        R = T * K
        tail = tuple(per_slot_TK.shape[2:])
        flat = per_slot_TK.reshape((R,) + tail)
        s2p = self.slot_to_pair_TK.reshape(-1)
        out = flat.new_zeros((R + 1,) + tail)
        dest = torch.where(s2p >= 0, s2p, torch.full_like(s2p, R))
        out.index_put_((dest,), flat)
        return out[:R]

    def slot_affinity_grad(self, d_affinity_TE: torch.Tensor) -> torch.Tensor:
        """Per-router-slot affinity gradient [T, K] from the dense [T, E] gradient.

        Each duplicate slot of a merged pair gets the merged cell's gradient (the forward is
        linear in the summed affinity); dropped slots get 0.
        """
        per_pair = self.pair_values_from_dense(d_affinity_TE)
        s2p = self.slot_to_pair_TK
        if per_pair.numel() == 0:
            return per_pair.new_zeros(s2p.shape)
        vals = per_pair[s2p.clamp(min=0)]
        return torch.where(s2p >= 0, vals, vals.new_zeros(()))

    def _slot_rows(self, pair_row_R: torch.Tensor) -> torch.Tensor:
        """[T, K] row of each slot (via its pair); -1 for dropped slots and repeated duplicates."""
        s2p = self.slot_to_pair_TK
        if pair_row_R.numel() == 0:
            return torch.full_like(s2p, -1)
        rows = torch.where(s2p >= 0, pair_row_R[s2p.clamp(min=0)], torch.full_like(s2p, -1))
        K = self.top_k
        if K > 1:  # a later slot naming an earlier slot's pair adds nothing
            same = s2p[:, :, None] == s2p[:, None, :]
            earlier = torch.ones(K, K, dtype=torch.bool, device=s2p.device).tril(-1)
            rows = torch.where((same & earlier).any(-1), torch.full_like(rows, -1), rows)
        return rows.contiguous()

    # ---------------------------------------------------------------------------------- views
    def blockwise(
        self, block_size: int, padding: str = "skip", num_blocks: int | None = None
    ) -> BlockwiseLayout:
        """The NKI blockwise layout (REFERENCE §1.1) for block size B.

        Args:
            block_size: B, token slots per block (any int >= 1; the NKI kernel itself accepts
                128 to 4096, powers of two).
            padding: "skip" (padding slots -1) or "zero_row" (padding slots T, affinities get
                an extra zero row T).
            num_blocks: N, default the static bound ``ceil((T*K - (E-1)) / B) + E - 1``. A
                smaller N is accepted after a host read confirms the blocks fit.
        Returns:
            :class:`BlockwiseLayout`.
        Raises:
            ValueError: bad ``block_size``/``padding``/``num_blocks``, or ``num_blocks`` too small.
        """
        B = _check_positive_int("block_size", block_size)
        if padding not in PADDING_MODES:
            raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
        T, E, K = self.num_tokens, self.num_experts, self.top_k
        n_static = static_num_blocks(T, K, E, B)
        blocks_E = (self.tokens_per_expert_E + B - 1) // B
        if num_blocks is None:
            N = n_static
        else:
            N = _check_positive_int("num_blocks", num_blocks)
            if N < n_static:
                needed = int(blocks_E.sum())  # host read: only for a caller-chosen smaller N
                if N < needed:
                    raise ValueError(
                        f"num_blocks={N} is too small: the routing needs {needed} blocks of "
                        f"block_size={B}"
                    )
        dev = self.device
        block_end_E = torch.cumsum(blocks_E, 0)
        block_start_E = block_end_E - blocks_E
        R = self.pair_token_R.shape[0]
        e = self.pair_expert_R.clamp(max=E - 1)
        rank = self._pair_rank_R()
        pos = block_start_E[e] * B + rank
        dump = N * B
        pos = torch.where(self.pair_valid_R, pos, torch.full_like(pos, dump))

        pad_value = -1 if padding == "skip" else T
        tpti = torch.full((N * B + 1,), pad_value, dtype=torch.int64, device=dev)
        tpti.index_put_((pos,), self.pair_token_R)
        pos_to_pair = torch.full((N * B + 1,), -1, dtype=torch.int64, device=dev)
        pos_to_pair.index_put_((pos,), torch.arange(R, device=dev))
        pos_to_pair = pos_to_pair[:dump]
        tpti = torch.where(pos_to_pair >= 0, tpti[:dump], torch.full_like(tpti[:dump], pad_value))

        n = torch.arange(N, device=dev)
        b2e = torch.searchsorted(block_end_E, n, right=True).clamp(max=E - 1)

        aff = self.affinity_dense_TE()
        if padding == "zero_row":
            aff = torch.cat([aff, aff.new_zeros(1, E)], 0)
        return BlockwiseLayout(
            token_position_to_id=tpti.to(torch.int32),
            block_to_expert=b2e.to(torch.int32).reshape(N, 1),
            expert_affinities_masked=aff.reshape(-1, 1).contiguous(),
            position_to_pair=pos_to_pair,
            num_blocks=N,
            block_size=B,
            padding=padding,
            num_tokens=T,
            num_pair_rows=R,
        )

    def grouped(self, align: int = 256, max_tokens_sum: int | None = None) -> GroupedLayout:
        """The grouped (cuDNN-style) layout (REFERENCE §1.2).

        Args:
            align: every expert's row count is padded up to a multiple of ``align`` (256 for
                the SM100 BF16 contract; 1 = no padding).
            max_tokens_sum: optional static row count S (a multiple of ``align``, at least the
                padded total). Avoids the host read of the total on CUDA; the surplus rows are
                zero padding owned by the last expert. Checked on the host only on CPU.
        Returns:
            :class:`GroupedLayout`.
        Raises:
            ValueError: bad ``align`` or ``max_tokens_sum``.
        """
        A = _check_positive_int("align", align)
        E, T = self.num_experts, self.num_tokens
        rows_E = _round_up(self.tokens_per_expert_E, A)
        offsets = torch.cumsum(rows_E, 0)
        if max_tokens_sum is None:
            S = int(offsets[-1])  # host read (documented in the module docstring)
        else:
            max_tokens_sum = as_int("max_tokens_sum", max_tokens_sum, 0)
            if max_tokens_sum % A:
                raise ValueError(f"max_tokens_sum={max_tokens_sum} must be a multiple of align={A}")
            S = max_tokens_sum
            if self.device.type == "cpu" and int(offsets[-1]) > S:
                raise ValueError(
                    f"max_tokens_sum={S} is too small: the routing needs {int(offsets[-1])} rows"
                )
            # the last expert owns the surplus rows (no host scalar write: capturable, no sync)
            offsets = torch.cat([offsets[:-1], offsets.new_full((1,), S)])
        row_start_E = _exclusive_cumsum(rows_E)
        R = self.pair_token_R.shape[0]
        dev = self.device
        e = self.pair_expert_R.clamp(max=E - 1)
        row = row_start_E[e] + self._pair_rank_R()
        row = torch.where(self.pair_valid_R, row, torch.full_like(row, S))
        r2t = torch.full((S + 1,), -1, dtype=torch.int64, device=dev)
        r2t.index_put_((row,), self.pair_token_R)
        r2p = torch.full((S + 1,), -1, dtype=torch.int64, device=dev)
        r2p.index_put_((row,), torch.arange(R, device=dev))
        pair_row_R = torch.where(self.pair_valid_R, row, torch.full_like(row, -1))
        r2p = r2p[:S]
        r2t = torch.where(r2p >= 0, r2t[:S], torch.full_like(r2p, -1))
        return GroupedLayout(
            offsets_E=offsets.to(torch.int32),
            row_to_token_S=r2t,
            row_to_pair_S=r2p,
            slot_to_row_TK=self._slot_rows(pair_row_R),
            tokens_sum=S,
            align=A,
            num_tokens=T,
            num_pair_rows=R,
        )


_SIGNED_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
# torch's unsigned dtypes: uint8 everywhere; uint16/32/64 exist (torch >= 2.3) with few kernels
# (no min/max), so ids are widened to int64 before any arithmetic.
_UNSIGNED_INT_DTYPES = (torch.uint8,) + tuple(
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
)
_INT_DTYPES = _SIGNED_INT_DTYPES + _UNSIGNED_INT_DTYPES


def check_router_output(
    expert_index: torch.Tensor, affinity: torch.Tensor, names=("expert_index", "affinity")
) -> None:
    """The router output's static contract (no value is read): two tensors, ``expert_index``
    [T, K >= 1] of an integer dtype, ``affinity`` of a floating dtype with the same shape, on
    one device. ``names``: how the messages call the two arguments.

    Raises:
        ValueError: the first broken rule, naming the argument.
    """
    ni, na = names
    for name, x in ((ni, expert_index), (na, affinity)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if expert_index.dim() != 2:
        raise ValueError(f"{ni} must be 2-D [T, top_k], got shape {tuple(expert_index.shape)}")
    if expert_index.dtype not in _INT_DTYPES:
        dtypes = ", ".join(str(d).replace("torch.", "") for d in _INT_DTYPES)
        raise ValueError(f"{ni} must have an integer dtype ({dtypes}), got {expert_index.dtype}")
    if not affinity.is_floating_point():
        raise ValueError(f"{na} must have a floating dtype, got {affinity.dtype}")
    if affinity.shape != expert_index.shape:
        raise ValueError(
            f"{na} shape {tuple(affinity.shape)} must equal {ni} shape "
            f"{tuple(expert_index.shape)}"
        )
    if affinity.device != expert_index.device:
        raise ValueError(
            f"{ni} ({expert_index.device}) and {na} ({affinity.device}) must be on one device"
        )
    if expert_index.shape[1] < 1:
        raise ValueError(f"{ni} must have top_k >= 1 columns")


def plan_routing(
    expert_index: torch.Tensor,
    affinity: torch.Tensor,
    num_experts: int,
    *,
    validate: bool = True,
) -> RoutingPlan:
    """Sort router output into (token, expert) pairs, merging duplicate experts of a token.

    Dimensions: T tokens, K top_k, E experts, R = T*K.

    Args:
        expert_index: [T, K] integer tensor, expert id of each slot, -1 = dropped slot. Any
            signed (int8/16/32/64) or unsigned (uint8/16/32/64) integer dtype; the same ids
            give the same plan whatever the dtype. Unsigned dtypes cannot mark a dropped slot.
        affinity: [T, K] floating tensor on the same device, the slot's router weight; the
            values of dropped slots are ignored (they may be NaN or -inf, as masked routers give).
        num_experts: E >= 1.
        validate: check id range and finite affinities (a host read on CUDA; pass False inside
            CUDA-graph capture: then ids outside [0, E) are dropped slots, as -1).
    Returns:
        :class:`RoutingPlan`.
    Raises:
        ValueError: non-tensor input, wrong rank or dtype, mismatched shapes or devices,
            ``num_experts`` < 1, an id outside [-1, E), a non-finite affinity.
    """
    check_router_output(expert_index, affinity)
    E = _check_positive_int("num_experts", num_experts)
    T, K = expert_index.shape
    # Widen first: uint16/32/64 have no min/max kernels, and every dtype must plan alike.
    # uint64 ids >= 2^63 wrap to negative int64 values and are caught below.
    ids_TK = expert_index.to(torch.int64)
    unsigned = expert_index.dtype in _UNSIGNED_INT_DTYPES
    if validate and expert_index.numel():
        lo, hi = int(ids_TK.min()), int(ids_TK.max())
        if unsigned and lo < 0:
            raise ValueError(
                f"expert_index ({str(expert_index.dtype).replace('torch.', '')}) holds an id "
                f">= 2^63, outside [0, num_experts={E})"
            )
        if lo < -1 or hi >= E:
            raise ValueError(
                f"expert_index ({str(expert_index.dtype).replace('torch.', '')}) values must "
                f"lie in [-1, num_experts={E}), found range [{lo}, {hi}]"
            )
        if not bool(torch.isfinite(affinity[ids_TK >= 0]).all()):
            raise ValueError("affinity must be finite on routed slots (found NaN or inf)")

    dev = expert_index.device
    R = T * K
    flat_e = ids_TK.reshape(-1)
    flat_a = affinity.reshape(-1)
    token = torch.arange(R, device=dev) // K
    valid = (flat_e >= 0) & (flat_e < E)  # unvalidated ids outside [0, E): dropped slots
    sentinel = E * T
    key = torch.where(valid, flat_e * T + token, torch.full_like(flat_e, sentinel))
    sorted_key, order = torch.sort(key, stable=True)
    sorted_valid = sorted_key < sentinel
    is_first = sorted_valid.clone()
    if R > 1:
        is_first[1:] &= sorted_key[1:] != sorted_key[:-1]
    pid = torch.cumsum(is_first.to(torch.int64), 0) - 1
    dest = torch.where(sorted_valid, pid, torch.full_like(pid, R))

    pair_token = torch.full((R + 1,), -1, dtype=torch.int64, device=dev)
    pair_expert = torch.full((R + 1,), E, dtype=torch.int64, device=dev)
    pair_token.index_put_((dest,), torch.where(sorted_valid, sorted_key % max(T, 1), -1))
    pair_expert.index_put_((dest,), torch.where(sorted_valid, sorted_key // max(T, 1), E))
    pair_aff = flat_a.new_zeros(R + 1)
    pair_aff.index_add_(0, dest, torch.where(sorted_valid, flat_a[order], flat_a.new_zeros(())))
    # The dump slot R collected all padding writes; slots past num_pairs were never written
    # except as padding, so they already hold the padding values.
    pair_token, pair_expert, pair_aff = pair_token[:R], pair_expert[:R], pair_aff[:R]

    slot_to_pair = torch.full((R,), -1, dtype=torch.int64, device=dev)
    slot_to_pair[order] = torch.where(sorted_valid, pid, torch.full_like(pid, -1))

    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, pair_expert, torch.ones_like(pair_expert))
    return RoutingPlan(
        num_tokens=T,
        num_experts=E,
        top_k=K,
        pair_token_R=pair_token,
        pair_expert_R=pair_expert,
        pair_affinity_R=pair_aff,
        slot_to_pair_TK=slot_to_pair.reshape(T, K),
        tokens_per_expert_E=counts[:E],
        num_pairs=is_first.sum(),
    )


def presorted_routing(
    num_rows_per_expert_E: torch.Tensor, rows: int
) -> tuple[RoutingPlan, GroupedLayout]:
    """The plan and the identity layout of ``rows`` rows already in expert order (torchtitan's
    grouped-experts input): the first ``num_rows_per_expert_E[0]`` rows belong to expert 0, the
    next to expert 1, ...; rows past the total are padding. Each row is its own token, routed to
    its expert with top_k 1 and affinity 1: what :func:`plan_routing` gives for those ids, built
    without a sort or a gather index (a cumsum and a ``searchsorted``; no host read, CUDA-graph
    capturable, shapes depend on ``rows`` and E only).

    Dimensions: E experts, T = R = S = ``rows``.

    Args:
        num_rows_per_expert_E: [E] integer tensor, rows of each expert. Not read on the host:
            bad counts are clamped, memory-safely -- a negative count counts as 0 and rows past
            ``rows`` are cut off.
        rows: the row count (an int >= 0).
    Returns:
        ``(plan, layout)``: :class:`RoutingPlan` (T = ``rows``, K = 1, fp32 affinities 1 on real
        rows) and its :class:`GroupedLayout` with ``identity=True`` (``offsets_E`` the clamped
        cumulative counts, int32; row/pair/token maps the row itself, -1 on padding rows).
    Raises:
        ValueError: ``num_rows_per_expert_E`` not a non-empty 1-D integer tensor, or a bad
            ``rows``.
    """
    n = num_rows_per_expert_E
    if (not isinstance(n, torch.Tensor) or n.dim() != 1 or n.numel() < 1
            or n.dtype not in _INT_DTYPES):
        raise ValueError(
            f"num_rows_per_expert_E must be a 1-D integer [E >= 1] tensor, got "
            f"{list(n.shape) if isinstance(n, torch.Tensor) else type(n).__name__}"
        )
    rows = as_int("rows", rows, 0)
    E, dev = n.shape[0], n.device
    ends = torch.cumsum(n.to(torch.int64).clamp(0, rows), 0).clamp(max=rows)
    r = torch.arange(rows, device=dev)
    num_pairs = ends[-1]
    valid = r < num_pairs

    def row():  # each map its own tensor (custom ops return no aliases)
        return torch.where(valid, r, -1)

    plan = RoutingPlan(
        num_tokens=rows,
        num_experts=E,
        top_k=1,
        pair_token_R=row(),
        pair_expert_R=torch.searchsorted(ends, r, right=True),  # E past the last expert
        pair_affinity_R=valid.to(torch.float32),
        slot_to_pair_TK=row().reshape(rows, 1),
        tokens_per_expert_E=torch.diff(ends, prepend=ends.new_zeros(1)),
        num_pairs=num_pairs,
    )
    layout = GroupedLayout(
        offsets_E=ends.to(torch.int32),
        row_to_token_S=row(),
        row_to_pair_S=row(),
        slot_to_row_TK=row().reshape(rows, 1),
        tokens_sum=rows,
        align=1,
        num_tokens=rows,
        num_pair_rows=rows,
        identity=True,
    )
    return plan, layout


ROUTING_ERRORS = (
    (1, "expert_index_TK", "an expert id lies outside [-1, num_experts)"),
    (2, "affinity_TK", "a routed slot's affinity is NaN or inf"),
    (4, "affinity_TK", "a routed slot's affinity is negative"),
)
"""``(bit, argument, rule)`` of the routing error code (:func:`routing_error_code`)."""


def routing_error_code(
    expert_index_TK: torch.Tensor, affinity_TK: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The routing's error code on its device, without a host read: a 0-d int32 tensor, 0 for
    valid routing, else the OR of the :data:`ROUTING_ERRORS` bits (ids outside [-1, E);
    non-finite or negative affinities on routed slots; dropped slots' affinities are ignored).

    Args: expert_index_TK [T, K] integer; affinity_TK [T, K] float; num_experts E.
    """
    ids = expert_index_TK.to(torch.int64)
    routed = (ids >= 0) & (ids < num_experts)
    aff = affinity_TK.detach()
    bits = (
        ((ids < -1) | (ids >= num_experts)).any(),
        (routed & ~torch.isfinite(aff)).any(),
        (routed & (aff < 0)).any(),
    )
    code = bits[0].to(torch.int32)
    for (bit, _, _), flag in zip(ROUTING_ERRORS[1:], bits[1:]):
        code = code | (flag.to(torch.int32) * bit)
    return code


def assert_routing_async(error_code: torch.Tensor) -> None:
    """Queue a device-side assert that ``error_code`` (:func:`routing_error_code`) is 0.

    No host read: on CUDA a bad routing surfaces at the next synchronisation as a device-side
    assert (a RuntimeError; the CUDA context cannot be used afterwards, as with any device
    assert). On the CPU it raises RuntimeError at once. The message names the arguments and the
    rules of :data:`ROUTING_ERRORS`; pass ``validate_routing="host"`` to the layer for a
    ValueError naming the exact rule before any work.
    """
    rules = "; ".join(f"{arg}: {rule}" for _, arg, rule in ROUTING_ERRORS)
    torch._assert_async(error_code == 0, f"MoE routing is invalid ({rules})")
