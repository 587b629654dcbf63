"""The epilogues of the SM90 varlen-M grouped GEMM (``grouped_mm.py``), one mixin each, composed
onto its mainloop: ``class Sm90GroupedMmKernel(StoreEpilogueSm90, GatedEpilogueSm90,
DgatedEpilogueSm90, GroupedMmSm90)``. The mainloop (schedule, producers, wgmma consumers)
calls the key's epilogue on the fp32 accumulators of a tile, and before its mainloop the
fused epilogues' prologue hooks (``row_slots``, ``load_chunk``, ``checkpoint_loads``,
``bias_loads``, ``bias_row``). What each epilogue computes: ``grouped_mm.py``'s docstring.

- :class:`RegisterEpilogueSm90`: what the epilogues share (wgmma accumulator fragment
  -> rows / columns, BF16 pair stores, the per-row tables of the fused ones, the activation's
  gate terms, and ``store_tile_tma``: one accumulator through the TMA-store sub-tiles);
- :class:`StoreEpilogueSm90` (``"store"``), :class:`GatedEpilogueSm90` (``"gated"``, the forward
  gate/up) and :class:`DgatedEpilogueSm90` (``"dgated"``, the backward down-dgrad); the fused
  ones also have a TMA-store form (``epilogue_gated_tma``, ``epilogue_dgated_tma``) for the
  tiles of an ``epi_tma`` key that lie wholly inside their expert.

Built once by :func:`epilogue_mixins` with CuTe DSL imported inside; nothing at import time.
"""

from __future__ import annotations

import functools
import types


@functools.cache
def epilogue_mixins() -> types.SimpleNamespace:
    """The epilogue mixin classes (``store``, ``gated``, ``dgated``), built once."""
    import cutlass
    from cutlass import cute

    class RegisterEpilogueSm90:
        """What the register epilogues share (on the mainloop's attributes: ``tile_m``,
        ``mma_n``, ``out_cols``, ``partial_n``, ...)."""

        @cute.jit
        def store_pair(self, v0, v1, addr, pair):
            """Round two fp32 values to BF16 (RNE) and store them as one 4-byte word at global
            address ``addr``."""
            pv = cute.make_rmem_tensor((2,), self.acc_dtype)
            pv[0] = v0
            pv[1] = v1
            pair.store(pv.load().to(self.out_dtype))
            dst = cute.make_tensor(
                cute.make_ptr(self.out_dtype, addr, cute.AddressSpace.gmem, assumed_align=4),
                cute.make_layout(2),
            )
            cute.autovec_copy(pair, dst)

        @cute.jit
        def store_tile_tma(self, tRS_acc, tma_store, tma, col, row0, epi_count):
            """The TMA-store epilogue of one accumulator (``tRS_acc``: retiled by
            ``epi.tiled_r2s``) into the ``(tile_m, mma_n)`` box of a row-major BF16 output at
            ``(row0, col)`` (``tma``: its store atom and tensor; ``tma_store``: the group's
            sub-tile buffers and store pipeline, ``(epi, sC, group, warp_idx, store_warp,
            barrier)``), sub-tile by sub-tile (``gemm.sm90.common``'s ``epi_store_subtiles``);
            every row of the box lies inside the tile's expert. Returns the advanced buffer
            counter."""
            epi, sC, group, warp_idx, store_warp, barrier = tma_store
            tma_atom, tma_t = tma
            gT = cute.local_tile(
                cute.domain_offset((row0, col), tma_t), (self.tile_m, self.mma_n), (0, 0)
            )
            bSG_sC, bSG_gC, n_sub, sub_layout = self.epi_partition(tma_atom, sC, gT)
            return self.epi_store_subtiles(
                epi, tRS_acc, tma_atom, bSG_sC, bSG_gC, n_sub, sub_layout, group, epi_count,
                warp_idx, store_warp, barrier,
            )

        @cute.jit
        def pick(self, cond, v):
            """``v`` where ``cond``, else +0.0 (a select, not a branch)."""
            return cutlass.Float32(cutlass.select_(cond, v, cutlass.Float32(0.0)))

        @cute.jit
        def row_slots(
            self, tCcC, n_mm: cutlass.Constexpr, row0, rows, mR2P, mAlpha, pair_s, alpha_s,
            in_s, tail_s, num_pairs, num_r, with_tail: cutlass.Constexpr,
        ):
            """Both fused epilogues' per-row tables of this thread's accumulator rows (slot
            ``2 mm + h``): the row's pair (-1 = padding or past the tile's rows), its affinity
            (0 there) and whether the row is inside the tile; ``with_tail`` (the gated one) also
            whether it is a checkpoint row past the pairs, ``num_pairs <= row < num_r``, that
            the epilogue zeroes (``tail_s``, ``num_pairs``, ``num_r`` unused otherwise)."""
            for mm in cutlass.range_constexpr(n_mm):
                for h in cutlass.range_constexpr(2):
                    i = mm * 2 + h
                    r = tCcC[((0, h, 0), mm, 0)][0]
                    if cutlass.const_expr(with_tail):
                        row = cutlass.Int64(row0 + r)
                    p = cutlass.Int64(-1)
                    a = cutlass.Float32(0.0)
                    inside = r < rows
                    if inside:
                        p = cutlass.Int64(mR2P[row0 + r])
                        if p >= 0:
                            a = cutlass.Float32(mAlpha[p])
                    pair_s[i] = p
                    alpha_s[i] = a
                    in_s[i] = inside
                    if cutlass.const_expr(with_tail):
                        tail_s[i] = inside and row >= num_pairs and row < num_r

        @cute.jit
        def first_col(self, tCcC, col0):
            """This thread's first accumulator column in the output: ``col0`` (the tile's)
            plus its column in the tile. The wgmma fragment's column groups (mode
            ``(2 cols, 2 row halves, mma_n / 8 groups)``) are 8 columns apart, so group ``q``
            starts at ``first_col + 8 q``: the fused epilogues' addresses and column checks
            rest on that."""
            return col0 + tCcC[((0, 0, 0), 0, 0)][1]

        @cute.jit
        def group_in_cols(self, c0, q: cutlass.Constexpr):
            """Column group ``q`` (from first column ``c0``) lies below ``out_cols``: always
            true unless the last N tile is partial."""
            in_n = cutlass.Boolean(True)
            if cutlass.const_expr(self.partial_n):
                in_n = c0 + 8 * q < self.out_cols
            return in_n

        @cute.jit
        def bf16_addr(self, base, row, row_len, col):
            """Byte address of element ``(row, col)`` of a row-major BF16 buffer at ``base``
            with ``row_len`` elements per row."""
            return base + (row * row_len + col) * 2

        def load_chunk(self, n_q: int, slots: int) -> int:
            """Column groups (``q``) per chunk of the fused epilogues' software-pipelined
            global loads: the largest of 8, 4, 2, 1 that divides ``n_q`` with ``c * slots <=
            8``. dgated (``slots`` = row slots): 16 4-byte checkpoint loads per thread and
            chunk; gated (``slots`` = 2, gate and up): 16 fp32 bias values. Two chunks live
            beside the accumulators; twice that spilled registers with the 128x256 tile
            (ptxas, offline). The caller sizes the buffers with it; the epilogues read the
            chunk size back from them."""
            return next(c for c in (8, 4, 2, 1) if n_q % c == 0 and c * slots <= 8)

        @cute.jit
        def gate_terms(self, g, u):
            """What the activation and its backward both need of one fp32 (g, u), the key's
            ``alpha`` and ``up_offset`` folded in where they are not 1 / 0: ``(alpha g,
            sigmoid(alpha g), u + up_offset)``."""
            ge = self.key.gated
            ag = g
            if cutlass.const_expr(ge.alpha != 1.0):
                ag = g * cutlass.Float32(ge.alpha)
            # rcp.approx.ftz (about 1 ulp; the argument is >= 1, and a sigmoid below 2^-126,
            # -alpha g > ~87, flushes to 0): an IEEE division was a branchy subroutine call
            # per element
            sig = cute.arch.rcp_approx(cutlass.Float32(1.0) + cute.math.exp(-ag, fastmath=True))
            up = u
            if cutlass.const_expr(ge.up_offset != 0.0):
                up = u + cutlass.Float32(ge.up_offset)
            return ag, sig, up

    class StoreEpilogueSm90(RegisterEpilogueSm90):
        """``"store"``: the accumulator rounded once to BF16, stored from registers."""

        @cute.jit
        def epilogue_store(self, acc, tCcC, mOut, n_idx, row0, rows):
            """Registers -> global: the accumulator rounded to BF16 in column pairs (4-byte
            stores), rows below ``rows`` (inside the expert) and columns below N. A padding row
            of a gathered A was zero-filled in shared memory, so its accumulator is exactly +0
            (for finite W): no select, and a padding row that were read would show."""
            n = self.key.n
            out_base = mOut.iterator.toint()
            col0 = n_idx * self.mma_n
            pair = cute.make_rmem_tensor((2,), self.out_dtype)
            # fragment ((2 cols, 2 row halves, tile_n / 8 column groups), MMA_M, MMA_N)
            for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for h in cutlass.range_constexpr(2):
                    r = tCcC[((0, h, 0), mm, 0)][0]
                    if r < rows:
                        row_addr = out_base + cutlass.Int64(row0 + r) * (n * 2)
                        for q in cutlass.range_constexpr(cute.size(acc, mode=[0]) // 4):
                            c = col0 + tCcC[((0, h, q), mm, 0)][1]
                            in_n = cutlass.Boolean(True)
                            if cutlass.const_expr(self.partial_n):
                                in_n = c < n
                            if in_n:
                                self.store_pair(
                                    acc[((0, h, q), mm, 0)], acc[((1, h, q), mm, 0)],
                                    row_addr + cutlass.Int64(c) * 2, pair,
                                )

    class GatedEpilogueSm90(RegisterEpilogueSm90):
        """``"gated"``: bias, clamp, activation, checkpoint and ``a * h`` (the forward gate/up)."""

        @cute.jit
        def clamp(self, g, u):
            """One fp32 (g, u) clamped to the key's limits (what the checkpoint holds)."""
            ge = self.key.gated
            if cutlass.const_expr(ge.gate_lo is not None):
                g = cutlass.max(g, cutlass.Float32(ge.gate_lo))
            if cutlass.const_expr(ge.gate_hi is not None):
                g = cutlass.min(g, cutlass.Float32(ge.gate_hi))
            if cutlass.const_expr(ge.up_lo is not None):
                u = cutlass.max(u, cutlass.Float32(ge.up_lo))
            if cutlass.const_expr(ge.up_hi is not None):
                u = cutlass.min(u, cutlass.Float32(ge.up_hi))
            return g, u

        @cute.jit
        def activate(self, g, u):
            """Clamp (the key's limits) and ``h = g * sigmoid(alpha g) * (u + up_offset)`` of
            one fp32 (g, u); returns (g, u, h) with g, u clamped (what the checkpoint holds)."""
            g, u = self.clamp(g, u)
            _, sig, up = self.gate_terms(g, u)
            return g, u, g * sig * up

        @cute.jit
        def bias_row(self, g):
            """The bias row of tile group ``g`` (the tiles of the rows past the last expert,
            ``g = E``, read any row: their outputs are zeros or unused)."""
            return cutlass.min(g, cutlass.Int32(self.num_e - 1))

        @cute.jit
        def bias_loads(self, buf, q0: cutlass.Constexpr, tCcC, col0, mBias, e_b):
            """The gated epilogue's bias of column groups ``[q0, q0 + ch)`` into ``buf``
            ((2 cols, gate/up, q) fp32 registers; 0 past I), issued a chunk ahead of its use
            (as :meth:`checkpoint_loads`)."""
            i_cols = self.out_cols
            buf.fill(0.0)
            for qq in cutlass.range_constexpr(cute.size(buf, mode=[2])):
                c = col0 + tCcC[((0, 0, q0 + qq), 0, 0)][1]
                in_n = cutlass.Boolean(True)
                if cutlass.const_expr(self.partial_n):
                    in_n = c < i_cols
                if in_n:
                    for gu in cutlass.range_constexpr(2):
                        for k in cutlass.range_constexpr(2):
                            buf[(k, gu, qq)] = cutlass.Float32(mBias[(e_b, gu * i_cols + c + k)])

        @cute.jit
        def epilogue_gated(
            self, acc_g, acc_u, tCcC, g, n_idx, row0, mAh, mBias, mAct, pair_s, alpha_s,
            in_s, tail_s, bufs,
        ):
            """The forward gate/up epilogue of one tile (columns ``[j, j + mma_n)`` of I, gate
            in ``acc_g``, up in ``acc_u``): per row s (pair p = ``mR2P[s]``, affinity a):
            bias (expert ``g``'s), clamp and activation in fp32 from the accumulators, then
            BF16 stores of
            ``a_h[s] = a * h`` (0 for a padding row: a select), of the checkpoint
            ``act[p] = [g, u]`` (real pairs only) and, for ``num_pairs <= s < R``, of zeros
            into checkpoint row s (so the rows past the pairs are 0, as the pass writes them);
            with ``checkpoint_rows`` the checkpoint is ``act[s] = [g, u]`` at the row itself
            (every row of the tile; 0 for a padding row: a select), no tail.
            Column pairs as 4-byte stores. The row tables (``row_slots``, with the tail flag)
            and the bias's first chunk (``bufs[0]``) were loaded before the mainloop; chunk
            k + 1 is issued before chunk k's math."""
            i_cols = self.out_cols
            col0 = n_idx * self.mma_n
            ah_base = mAh.iterator.toint()
            act_base = mAct.iterator.toint()
            e_b = self.bias_row(g)
            n_mm = cute.size(acc_g, mode=[1])
            n_q = cute.size(acc_g, mode=[0]) // 4
            ch = cute.size(bufs[0], mode=[2])  # column groups per load chunk
            has_bias = self.key.gated.has_bias
            ck_rows = self.key.gated.checkpoint_rows
            pair = cute.make_rmem_tensor((2,), self.out_dtype)
            # per row slot: byte addresses of its first column in a_h, in its pair's checkpoint
            # row and in its own checkpoint row (the tail; every row's checkpoint with
            # checkpoint_rows); column group q is 16 q bytes on
            c0 = self.first_col(tCcC, col0)
            ah_row = cute.make_rmem_tensor((2 * n_mm,), cutlass.Int64)
            act_pair = cute.make_rmem_tensor((2 * n_mm,), cutlass.Int64)
            act_tail = cute.make_rmem_tensor((2 * n_mm,), cutlass.Int64)
            for mm in cutlass.range_constexpr(n_mm):
                for h in cutlass.range_constexpr(2):
                    i = mm * 2 + h
                    row = cutlass.Int64(row0 + tCcC[((0, h, 0), mm, 0)][0])
                    ah_row[i] = self.bf16_addr(ah_base, row, i_cols, c0)
                    act_pair[i] = self.bf16_addr(act_base, pair_s[i], 2 * i_cols, c0)
                    act_tail[i] = self.bf16_addr(act_base, row, 2 * i_cols, c0)
            zero = cutlass.Float32(0.0)
            for k in cutlass.range_constexpr(n_q // ch):
                if cutlass.const_expr(has_bias and k + 1 < n_q // ch):
                    self.bias_loads(bufs[k + 1], (k + 1) * ch, tCcC, col0, mBias, e_b)
                for qq in cutlass.range_constexpr(ch):
                    q = k * ch + qq
                    if self.group_in_cols(c0, q):
                        bg0 = zero
                        bg1 = zero
                        bu0 = zero
                        bu1 = zero
                        if cutlass.const_expr(has_bias):
                            bg0 = bufs[k][(0, 0, qq)]
                            bg1 = bufs[k][(1, 0, qq)]
                            bu0 = bufs[k][(0, 1, qq)]
                            bu1 = bufs[k][(1, 1, qq)]
                        for mm in cutlass.range_constexpr(n_mm):
                            for h in cutlass.range_constexpr(2):
                                i = mm * 2 + h
                                g0, u0, h0 = self.activate(
                                    acc_g[((0, h, q), mm, 0)] + bg0,
                                    acc_u[((0, h, q), mm, 0)] + bu0,
                                )
                                g1, u1, h1 = self.activate(
                                    acc_g[((1, h, q), mm, 0)] + bg1,
                                    acc_u[((1, h, q), mm, 0)] + bu1,
                                )
                                real = pair_s[i] >= 0
                                if in_s[i]:
                                    self.store_pair(
                                        self.pick(real, alpha_s[i] * h0),
                                        self.pick(real, alpha_s[i] * h1),
                                        ah_row[i] + 16 * q, pair,
                                    )
                                    if cutlass.const_expr(ck_rows):
                                        dst = act_tail[i] + 16 * q  # row s's own checkpoint row
                                        self.store_pair(self.pick(real, g0),
                                                        self.pick(real, g1), dst, pair)
                                        self.store_pair(self.pick(real, u0),
                                                        self.pick(real, u1),
                                                        dst + i_cols * 2, pair)
                                if cutlass.const_expr(not ck_rows):
                                    if real:
                                        dst = act_pair[i] + 16 * q
                                        self.store_pair(g0, g1, dst, pair)
                                        self.store_pair(u0, u1, dst + i_cols * 2, pair)
                                    if tail_s[i]:
                                        dst = act_tail[i] + 16 * q
                                        self.store_pair(zero, zero, dst, pair)
                                        self.store_pair(zero, zero, dst + i_cols * 2, pair)

        @cute.jit
        def epilogue_gated_tma(
            self, acc_g, acc_u, tRS_accs, tCcC, g, n_idx, row0, mBias, pair_s, alpha_s, bufs,
            tma_store, tma_ah, tma_ck, epi_count,
        ):
            """The forward gate/up epilogue of a tile whose rows all lie inside its expert,
            with the checkpoint in row order, through TMA stores (``epi_tma``; the values of
            :meth:`epilogue_gated`, bit for bit, for a finite W): the bias and clamp applied in
            place where the key has them (a padding row's values +0; without them the
            accumulators are the checkpoint as they are, a padding row's +0 since its A row was
            zero-filled), the checkpoint's g and u stored from ``acc_g`` / ``acc_u`` to
            columns ``j`` and ``I + j`` of row s, then ``a * h`` from the same fp32 values in
            place in ``acc_g`` (+0 for a padding row) stored to ``a_h`` (:meth:`store_tile_tma`;
            ``tRS_accs``: the two accumulators retiled for it; ``tma_ah`` / ``tma_ck``: the
            atoms and tensors of ``a_h`` and the checkpoint). Returns the advanced buffer
            counter."""
            col0 = n_idx * self.mma_n
            e_b = self.bias_row(g)
            n_mm = cute.size(acc_g, mode=[1])
            n_q = cute.size(acc_g, mode=[0]) // 4
            ch = cute.size(bufs[0], mode=[2])  # column groups per load chunk
            ge = self.key.gated
            has_bias = ge.has_bias
            # without a bias or a clamp the checkpoint is the accumulator itself (a padding
            # row's is +0: its A row was zero-filled, as the store epilogue relies on)
            in_place = has_bias or any(
                v is not None for v in (ge.gate_lo, ge.gate_hi, ge.up_lo, ge.up_hi)
            )
            zero = cutlass.Float32(0.0)
            for k in cutlass.range_constexpr(n_q // ch if in_place else 0):
                if cutlass.const_expr(has_bias and k + 1 < n_q // ch):
                    self.bias_loads(bufs[k + 1], (k + 1) * ch, tCcC, col0, mBias, e_b)
                for qq in cutlass.range_constexpr(ch):
                    q = k * ch + qq
                    for mm in cutlass.range_constexpr(n_mm):
                        for h in cutlass.range_constexpr(2):
                            real = pair_s[mm * 2 + h] >= 0
                            for c in cutlass.range_constexpr(2):
                                bg = zero
                                bu = zero
                                if cutlass.const_expr(has_bias):
                                    bg = bufs[k][(c, 0, qq)]
                                    bu = bufs[k][(c, 1, qq)]
                                gv, uv = self.clamp(acc_g[((c, h, q), mm, 0)] + bg,
                                                    acc_u[((c, h, q), mm, 0)] + bu)
                                acc_g[((c, h, q), mm, 0)] = self.pick(real, gv)
                                acc_u[((c, h, q), mm, 0)] = self.pick(real, uv)
            epi_count = self.store_tile_tma(tRS_accs[0], tma_store, tma_ck, col0, row0, epi_count)
            epi_count = self.store_tile_tma(
                tRS_accs[1], tma_store, tma_ck, self.out_cols + col0, row0, epi_count
            )
            for q in cutlass.range_constexpr(n_q):
                for mm in cutlass.range_constexpr(n_mm):
                    for h in cutlass.range_constexpr(2):
                        i = mm * 2 + h
                        real = pair_s[i] >= 0
                        for c in cutlass.range_constexpr(2):
                            gv = acc_g[((c, h, q), mm, 0)]
                            _, sig, up = self.gate_terms(gv, acc_u[((c, h, q), mm, 0)])
                            h_v = gv * sig * up  # (activate's expression)
                            acc_g[((c, h, q), mm, 0)] = self.pick(real, alpha_s[i] * h_v)
            return self.store_tile_tma(tRS_accs[0], tma_store, tma_ah, col0, row0, epi_count)

    class DgatedEpilogueSm90(RegisterEpilogueSm90):
        """``"dgated"``: the activation backward, ``d_gate_up``, ``a * h`` and the per-N-tile
        partial row sums of ``dh_raw * h`` (the backward down-dgrad)."""

        @cute.jit
        def activate_backward(self, d, g, u, alpha):
            """One element of the activation backward (REFERENCE §2) from ``d = dh_raw`` and
            the stored (clamped) g, u: ``(dg, du, h)`` with ``dg = alpha d (u + c) s (1 + a g
            (1 - s)) mask_g``, ``du = alpha d g s mask_u``, ``s = sigmoid(a g)``; the strict
            clamp masks pass where the stored value lies strictly inside its limits."""
            ge = self.key.gated
            ag, sig, up = self.gate_terms(g, u)
            gs = g * sig
            h = gs * up
            dh = alpha * d
            dg = dh * up * sig * (cutlass.Float32(1.0) + ag * (cutlass.Float32(1.0) - sig))
            du = dh * gs
            zero = cutlass.Float32(0.0)
            if cutlass.const_expr(ge.gate_lo is not None):  # noqa: SIM102
                if not g > cutlass.Float32(ge.gate_lo):
                    dg = zero
            if cutlass.const_expr(ge.gate_hi is not None):  # noqa: SIM102
                if not g < cutlass.Float32(ge.gate_hi):
                    dg = zero
            if cutlass.const_expr(ge.up_lo is not None):  # noqa: SIM102
                if not u > cutlass.Float32(ge.up_lo):
                    du = zero
            if cutlass.const_expr(ge.up_hi is not None):  # noqa: SIM102
                if not u < cutlass.Float32(ge.up_hi):
                    du = zero
            return dg, du, h

        @cute.jit
        def checkpoint_loads(
            self, buf, q0: cutlass.Constexpr, tCcC, col0, row0, pair_s, act_base,
        ):
            """Issue the dgated epilogue's checkpoint loads of column groups ``[q0, q0 + ch)``
            into ``buf`` ((2 cols, gate/up, slot, q) BF16 registers): ``g, u`` of this
            thread's rows -- at their pair's checkpoint row, or at the row itself with
            ``checkpoint_rows`` -- as 4-byte loads; zeros for a padding row and a column past I.
            Issued a chunk ahead of their use, so their latency overlaps the previous chunk's
            math and stores (a load after a store to memory that may alias it cannot be
            hoisted by the compiler; written one per use, every load waited for its own
            round trip)."""
            i_cols = self.out_cols
            c0 = self.first_col(tCcC, col0)
            buf.fill(0.0)
            for i in cutlass.range_constexpr(cute.size(buf, mode=[2])):
                p = pair_s[i]
                ck_row = cutlass.Int64(p)
                if cutlass.const_expr(self.key.gated.checkpoint_rows):  # slot i = 2 mm + h
                    ck_row = cutlass.Int64(row0 + tCcC[((0, i % 2, 0), i // 2, 0)][0])
                src = self.bf16_addr(act_base, ck_row, 2 * i_cols, c0)
                for qq in cutlass.range_constexpr(cute.size(buf, mode=[3])):
                    in_n = self.group_in_cols(c0, q0 + qq)
                    if in_n and p >= 0:
                        for gu in cutlass.range_constexpr(2):
                            v = cute.make_tensor(
                                cute.make_ptr(
                                    self.out_dtype, src + (gu * i_cols + 8 * (q0 + qq)) * 2,
                                    cute.AddressSpace.gmem, assumed_align=4,
                                ),
                                cute.make_layout(2),
                            )
                            cute.autovec_copy(v, buf[(None, gu, i, qq)])

        @cute.jit
        def checkpoint_chunk(self, bufs, k: cutlass.Constexpr, tCcC, col0, row0, pair_s,
                             act_base):
            """Both dgated epilogues' checkpoint chunk ``k`` as fp32 ``(2 cols, gate/up, slot,
            q)``, after issuing chunk k + 1's loads (:meth:`checkpoint_loads`) so they land
            under chunk k's math and stores."""
            ch = cute.size(bufs[0], mode=[3])
            if cutlass.const_expr(k + 1 < len(bufs)):
                self.checkpoint_loads(bufs[k + 1], (k + 1) * ch, tCcC, col0, row0, pair_s,
                                      act_base)
            gu = cute.make_rmem_tensor((2, 2, cute.size(bufs[0], mode=[2]), ch),
                                       self.acc_dtype)
            gu.store(bufs[k].load().to(self.acc_dtype))
            return gu

        @cute.jit
        def dgated_slot(self, acc, gu, q: cutlass.Constexpr, qq: cutlass.Constexpr,
                        mm: cutlass.Constexpr, h: cutlass.Constexpr, pair_s, alpha_s):
            """Both dgated epilogues' math of one row slot's column pair (group ``q``, ``qq``
            in its checkpoint chunk ``gu``): ``(real, a, dg0, dg1, du0, du1, h0, h1, dh_h)``
            with ``real`` the row's pair >= 0, ``a`` its affinity and ``dh_h = d0 h0 + d1 h1``
            its share of the row's partial sum (one expression for both epilogues: their
            outputs agree bit for bit)."""
            i = mm * 2 + h
            d0 = acc[((0, h, q), mm, 0)]
            d1 = acc[((1, h, q), mm, 0)]
            a = alpha_s[i]
            dg0, du0, h0 = self.activate_backward(d0, gu[(0, 0, i, qq)], gu[(0, 1, i, qq)], a)
            dg1, du1, h1 = self.activate_backward(d1, gu[(1, 0, i, qq)], gu[(1, 1, i, qq)], a)
            return pair_s[i] >= 0, a, dg0, dg1, du0, du1, h0, h1, d0 * h0 + d1 * h1

        @cute.jit
        def epilogue_dgated(
            self, acc, tCcC, n_idx, row0, mAh, mDgu, mPart, mAct, pair_s, alpha_s, in_s, bufs,
        ):
            """The down-dgrad epilogue of one tile: the accumulator is ``dh_raw = dY_row @
            W_down[e]^T`` (columns ``[j, j + tile_n)`` of I); per row s of pair p (affinity a)
            with the checkpoint's g, u: ``d_gate_up[s] = [dg, du]`` and ``a_h[s] = a * h`` in
            BF16 (0 for padding rows: selects) and the row's partial ``sum_j dh_raw * h`` over
            this tile's columns into ``mPart[s, n_idx]`` (fp32; the 4 threads holding a row
            add theirs by shuffles, in a fixed order). The row tables (``row_slots``) and the
            checkpoint's first chunk (``bufs[0]``) were loaded before the mainloop; chunk k + 1
            is issued before chunk k's math and stores."""
            i_cols = self.out_cols
            col0 = n_idx * self.mma_n  # (= tile_n: one accumulator)
            ah_base = mAh.iterator.toint()
            dgu_base = mDgu.iterator.toint()
            act_base = mAct.iterator.toint()
            n_mm = cute.size(acc, mode=[1])
            slots = 2 * n_mm
            n_q = cute.size(acc, mode=[0]) // 4
            ch = cute.size(bufs[0], mode=[3])  # column groups per load chunk
            part_s = cute.make_rmem_tensor((slots,), cutlass.Float32)
            part_s.fill(0.0)
            pair = cute.make_rmem_tensor((2,), self.out_dtype)
            # per row slot: the byte address of its first column in d_gate_up and a_h (column
            # group q is 16 q bytes further: immediate offsets, no per-store address math)
            c0 = self.first_col(tCcC, col0)
            dgu_row = cute.make_rmem_tensor((slots,), cutlass.Int64)
            ah_row = cute.make_rmem_tensor((slots,), cutlass.Int64)
            for mm in cutlass.range_constexpr(n_mm):
                for h in cutlass.range_constexpr(2):
                    row = cutlass.Int64(row0 + tCcC[((0, h, 0), mm, 0)][0])
                    dgu_row[mm * 2 + h] = self.bf16_addr(dgu_base, row, 2 * i_cols, c0)
                    ah_row[mm * 2 + h] = self.bf16_addr(ah_base, row, i_cols, c0)
            for k in cutlass.range_constexpr(n_q // ch):
                gu = self.checkpoint_chunk(bufs, k, tCcC, col0, row0, pair_s, act_base)
                for qq in cutlass.range_constexpr(ch):
                    q = k * ch + qq
                    if self.group_in_cols(c0, q):
                        for mm in cutlass.range_constexpr(n_mm):
                            for h in cutlass.range_constexpr(2):
                                i = mm * 2 + h
                                # the math runs on every row (a padding row's zeros), its
                                # results selected (no branch around it); only the stores
                                # of rows inside the tile are predicated
                                real, a, dg0, dg1, du0, du1, h0, h1, dh_h = self.dgated_slot(
                                    acc, gu, q, qq, mm, h, pair_s, alpha_s
                                )
                                part_s[i] = part_s[i] + self.pick(real, dh_h)
                                if in_s[i]:
                                    dst = dgu_row[i] + 16 * q
                                    self.store_pair(
                                        self.pick(real, dg0), self.pick(real, dg1), dst, pair
                                    )
                                    self.store_pair(
                                        self.pick(real, du0), self.pick(real, du1),
                                        dst + i_cols * 2, pair,
                                    )
                                    self.store_pair(
                                        self.pick(real, a * h0), self.pick(real, a * h1),
                                        ah_row[i] + 16 * q, pair,
                                    )
            self.store_row_partials(part_s, tCcC, n_mm, row0, n_idx, mPart, in_s)

        @cute.jit
        def store_row_partials(self, part_s, tCcC, n_mm: cutlass.Constexpr, row0, n_idx, mPart,
                               in_s):
            """The 4 threads of a quad hold the same rows: add their partial row sums
            (``part_s``, per row slot; two butterfly shuffles, a fixed order) and the quad's
            first thread stores each row's inside the tile to ``mPart[row, n_idx]``."""
            lane = cute.arch.lane_idx()
            for i in cutlass.range_constexpr(2 * n_mm):
                v = part_s[i]
                v = v + cute.arch.shuffle_sync_bfly(v, 1)
                v = v + cute.arch.shuffle_sync_bfly(v, 2)
                part_s[i] = v
            if lane % 4 == 0:
                for mm in cutlass.range_constexpr(n_mm):
                    for h in cutlass.range_constexpr(2):
                        i = mm * 2 + h
                        if in_s[i]:
                            r = tCcC[((0, h, 0), mm, 0)][0]
                            mPart[(row0 + r, n_idx)] = part_s[i]

        @cute.jit
        def epilogue_dgated_tma(
            self, acc, tmps, tRS_accs, tCcC, n_idx, row0, mPart, mAct, pair_s, alpha_s, in_s,
            bufs, tma_store, tma_ah, tma_dgu, epi_count,
        ):
            """The down-dgrad epilogue of a tile whose rows all lie inside its expert, with the
            checkpoint in row order, through TMA stores (``epi_tma``; the values of
            :meth:`epilogue_dgated`, bit for bit): per (tile rows, 32)-column sub-tile -- one
            checkpoint load chunk -- the activation backward of its columns into ``acc`` (dg, in
            place), ``tmps`` (du, a * h) and the row partials, then the sub-tile's three TMA
            stores (dg and du to columns ``j`` and ``I + j`` of ``d_gate_up``, a * h to ``a_h``;
            ``tRS_accs``: ``acc`` and ``tmps`` retiled; ``tma_ah`` / ``tma_dgu``: the atoms and
            tensors). The partial row sums are stored from registers. Returns the advanced
            buffer counter."""
            i_cols = self.out_cols
            col0 = n_idx * self.mma_n
            act_base = mAct.iterator.toint()
            n_mm = cute.size(acc, mode=[1])
            slots = 2 * n_mm
            n_q = cute.size(acc, mode=[0]) // 4
            ch = cute.size(bufs[0], mode=[3])  # column groups per load chunk: 4, one sub-tile
            part_s = cute.make_rmem_tensor((slots,), cutlass.Float32)
            part_s.fill(0.0)
            epi, sC, group, warp_idx, store_warp, barrier = tma_store
            boxes = []
            for tma, col in ((tma_dgu, col0), (tma_dgu, i_cols + col0), (tma_ah, col0)):
                gT = cute.local_tile(cute.domain_offset((row0, col), tma[1]),
                                     (self.tile_m, self.mma_n), (0, 0))
                boxes.append((tma[0], *self.epi_partition(tma[0], sC, gT)))
            tmp_du, tmp_ah = tmps
            for k in cutlass.range_constexpr(n_q // ch):
                gu = self.checkpoint_chunk(bufs, k, tCcC, col0, row0, pair_s, act_base)
                for qq in cutlass.range_constexpr(ch):
                    q = k * ch + qq
                    for mm in cutlass.range_constexpr(n_mm):
                        for h in cutlass.range_constexpr(2):
                            i = mm * 2 + h
                            real, a, dg0, dg1, du0, du1, h0, h1, dh_h = self.dgated_slot(
                                acc, gu, q, qq, mm, h, pair_s, alpha_s
                            )
                            part_s[i] = part_s[i] + self.pick(real, dh_h)
                            acc[((0, h, q), mm, 0)] = self.pick(real, dg0)
                            acc[((1, h, q), mm, 0)] = self.pick(real, dg1)
                            tmp_du[((0, h, q), mm, 0)] = self.pick(real, du0)
                            tmp_du[((1, h, q), mm, 0)] = self.pick(real, du1)
                            tmp_ah[((0, h, q), mm, 0)] = self.pick(real, a * h0)
                            tmp_ah[((1, h, q), mm, 0)] = self.pick(real, a * h1)
                for b, tRS in enumerate(tRS_accs):
                    atom, bSG_sC, bSG_gC, _n_sub, sub_layout = boxes[b]
                    epi_count = self.epi_store_subtile(
                        epi, tRS, atom, bSG_sC, bSG_gC, k, sub_layout, group, epi_count,
                        warp_idx, store_warp, barrier,
                    )
            self.store_row_partials(part_s, tCcC, n_mm, row0, n_idx, mPart, in_s)
            return epi_count

    return types.SimpleNamespace(
        store=StoreEpilogueSm90, gated=GatedEpilogueSm90, dgated=DgatedEpilogueSm90
    )
