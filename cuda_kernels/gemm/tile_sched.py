"""The dynamic persistent tile scheduler the BF16 grouped wgrad kernels share: the SM90 wgmma
kernel (``sm90_bf16``, and ``sm90_mxfp8`` through its class) and the SM100 tcgen05 kernel
(``sm100_bf16``, and ``sm100_blockscaled`` through its class).

Both kernels are CTA-persistent: one warp of each CTA (SM90: the producer warp; SM100: the
scheduling (TMA) warp) takes output tile ids from a global atomic counter and publishes each
into a small shared-memory ring of tile ids (an mbarrier pipeline, ``sched_pipe``), from which
the CTA's other warps (SM90: the consumer warp groups; SM100: the MMA and epilogue warps) read
it. Ids run over the experts sorted by size, largest first, so taking them greedily is LPT list
scheduling (uneven experts balance); an id >= the kernel's tile count tells every warp to stop.

- :func:`scheduler_base`: the class holding ``claim_tile`` (the atomic take and the shuffle),
  ``next_tile`` (take and publish) and ``take_tile`` (read back), built once on first use
  (CuTe DSL is imported inside that cached builder only, as ``sm90.common.kernel_base()``
  does); the kernel classes derive from it. Arch-neutral: a global atomic, a warp shuffle and
  a ``pipeline`` ring, nothing of wgmma or tcgen05. (The SM100 2-CTA cluster's
  ``publish_tile``, which takes the id with ``claim_tile`` and writes it into both CTAs' rings,
  stays in ``sm100_bf16``.)

No CuTe DSL, torch or GPU query at import time.
"""

from __future__ import annotations

import functools

__all__ = ["scheduler_base"]


@functools.cache
def scheduler_base() -> type:
    """The base class with the dynamic tile scheduler's device methods (built once; CuTe DSL
    is imported here). It reads no kernel field: the counter, the ring and its states are
    arguments."""
    import cutlass
    from cutlass import cute

    class TileScheduler:
        """The dynamic persistent tile scheduler (see the module docstring)."""

        @cute.jit
        def claim_tile(self, mCounter, lane):
            """The scheduling warp: lane 0 takes the next tile id from the global counter
            ``mCounter`` (an atomic add of 1), a shuffle hands it to every lane. Returns the
            id (publishing it is the caller's: :meth:`next_tile`, SM100's ``publish_tile``)."""
            t = cutlass.Int32(0)
            if lane == 0:
                t = cute.arch.atomic_add(mCounter.iterator, cutlass.Int32(1))
            return cute.arch.shuffle_sync(t, 0)

        @cute.jit
        def next_tile(self, mCounter, lane, sched_pipe, sched_state, sSched):
            """The scheduling warp (SM90: the producer warp; SM100: the scheduling (TMA) warp):
            take the next tile id from the global counter ``mCounter`` (lane 0, broadcast to
            the warp by a shuffle) and publish it into slot ``sched_state`` of the tile-id ring
            ``sSched`` for the other warps (SM90: the consumers; SM100: the MMA and epilogue
            warps), which read it with :meth:`take_tile`. Ids run over experts sorted by size,
            largest first, so taking them greedily is LPT list scheduling (uneven experts
            balance); an id >= num_tiles tells every warp to stop. Returns the id."""
            t = self.claim_tile(mCounter, lane)
            sched_pipe.producer_acquire(sched_state)
            if lane == 0:
                sSched[sched_state.index] = t
            sched_pipe.producer_commit(sched_state)
            return t

        @cute.jit
        def take_tile(self, sched_pipe, sched_cstate, sSched):
            """The warps that read the ring (SM90: the consumers; SM100: the MMA and epilogue
            warps, and the scheduling warp itself on the 2-CTA cluster): the next tile id the
            scheduling warp published (:meth:`next_tile`, or SM100's ``publish_tile``), taken
            from the tile-id ring. The caller advances ``sched_cstate`` (a state advanced
            inside a helper would not be carried out of the caller's loops)."""
            sched_pipe.consumer_wait(sched_cstate)
            tile = sSched[sched_cstate.index]
            sched_pipe.consumer_release(sched_cstate)
            return tile

    return TileScheduler
