"""Seeded normal draws that are the same bits on every device: a counter-based generator.

Each element is a pure function of ``(seed, stream, element index)``: a hash of the index
(integer ops only) picks one of 65536 normal quantiles, scaled by ``std`` and rounded to the
dtype. A tensor is generated where it will live, in chunks, with no generator state: the 600M
weights of a large layer are a few hundred elementwise kernels on its GPU (not 600M CPU draws
copied over), and a CPU computes the same bits.

Three things about it that are easy to get wrong:

* The device runs integer ops and a table gather only. Every float operation (the quantiles,
  their scaling by ``std``, the rounding to ``dtype``) is done once, on the CPU, on the
  65536-entry table (:func:`normal_table`); the device copies table entries. No value depends on
  a device's ``log``, ``exp`` or fused multiply-add.
* The integer ops are exact: values are held in int64 below 2**32 and each multiplier is below
  2**31, so no product reaches 2**63 (no overflow, no wrap-around to rely on). A device whose
  int64 arithmetic is not known to be exact (anything but ``cpu`` and ``cuda``: an XLA / Neuron
  device may narrow int64 to int32) gets the CPU's tensor, copied.
* The map from element index to (hash counter, which 16 bits of the hash) is fixed by
  :data:`BLOCK`, whatever the chunk a device generates at a time: element ``i`` in block
  ``b = i // BLOCK`` at position ``p = i % BLOCK`` uses counter ``b * BLOCK/2 + p % (BLOCK/2)``;
  the first half of a block takes bits 16..31 of its counter's hash, the second half bits 0..15.

The hash of a counter ``c`` (its low 32 bits; key words ``k1, k2, k3`` from a sha256 of the
seed, the stream name and ``c >> 32``, computed in Python)::

    x = mix(c ^ k1, M1);  x = mix(x ^ k2, M2);  x = mix(x ^ k3, M3)
    mix(x, m) = (p ^ (p >> 32)) mod 2**32  with  p = x * m     (x < 2**32, m < 2**31 odd)

The distribution: the quantiles ``Phi^-1((j + 1/2) / 65536)``, ``j = 0..65535``, divided by
their root mean square, so every draw has mean 0 (the table is symmetric) and standard
deviation ``std`` (to float32 rounding); the tails stop at 4.325 ``std`` (where a normal draw
goes beyond once in 65536). The quantiles come from :class:`statistics.NormalDist` in float64,
rounded to float32: the platform's ``log``, but the same table for every device of a machine,
and the tests pin its digest, so a platform whose ``log`` moves a float32 value is caught.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import statistics

import torch

__all__ = ["BLOCK", "TABLE_SIZE", "hash_counters", "normal", "normal_table"]

TABLE_SIZE = 1 << 16
"""Entries of the quantile table: one 16-bit half of a hash picks one."""

BLOCK = 1 << 16
"""Elements per block of the index map (see the module docstring); half as many hashes."""

_HALF = BLOCK // 2
_MASK32 = 0xFFFFFFFF
_SEGMENT_BITS = 32  # counters of one key set: 2**32 (each chunk stays inside one segment)
_MULTIPLIERS = (0x7504F333, 0x5DB3D743, 0x5E3779B9)
# The top 31 bits of the fractions of sqrt(2) = 1.6A09E667..., sqrt(3) = 1.BB67AE85... and
# sqrt(5) = 2.3C6EF372... (hex) with bits 30 and 0 set: odd, in [2**30, 2**31), so that
# x * m < 2**63 for x < 2**32 and the high word p >> 32 has 30-31 bits.

_CHUNK_BLOCKS = {"cpu": 1, "cuda": 256}
# Blocks per chunk. CPU: 32768 hashes per op, at torch's grain size, so every op runs on one
# thread (no parallel region to stall when other processes hold the cores) on ~1 MiB buffers
# that stay in cache. CUDA: 16.7M elements per chunk, 3 x 64-128 MiB of buffers, ~40 chunks for
# a 600M-element weight.
_EXACT_INT64_DEVICES = ("cpu", "cuda")


def _check_chunk_blocks(chunk_blocks: int) -> int:
    if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, numbers.Integral):
        raise ValueError(f"chunk_blocks must be an int, got {type(chunk_blocks).__name__}")
    cb = int(chunk_blocks)
    top = _SEGMENT_BITS - (_HALF.bit_length() - 1)  # a chunk's counters fit one segment
    if cb < 1 or cb & (cb - 1) or cb > 1 << top:
        raise ValueError(f"chunk_blocks must be a power of two in [1, 2**{top}], got {cb}")
    return cb


@functools.cache
def _keys(seed: int, stream: str, segment: int) -> tuple[int, int, int]:
    """Three 32-bit key words of (seed, stream, counter segment): sha256, little-endian."""
    digest = hashlib.sha256(f"moe-bwd normal|{seed}|{stream}|{segment}".encode()).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(3))


@functools.cache
def _table_float32() -> torch.Tensor:
    n = TABLE_SIZE
    nd = statistics.NormalDist()
    upper = [-nd.inv_cdf((j + 0.5) / n) for j in range(n // 2 - 1, -1, -1)]  # ascending, > 0
    rms = math.sqrt(math.fsum(v * v for v in upper) / (n // 2))  # the table is symmetric
    upper = [v / rms for v in upper]
    return torch.tensor([-v for v in reversed(upper)] + upper, dtype=torch.float32)


def normal_table(std: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 65536 values a :func:`normal` draw takes, on the CPU: the float32 quantile table
    times ``std`` (a float32 product), rounded to ``dtype``.

    Returns:
        [TABLE_SIZE] tensor of ``dtype``, ascending, symmetric about 0.
    Raises:
        ValueError: ``std`` not a finite real number >= 0, or ``dtype`` not a floating dtype.
    """
    if isinstance(std, bool) or not isinstance(std, numbers.Real) or not (
        math.isfinite(std) and std >= 0
    ):
        raise ValueError(f"std must be a finite real number >= 0, got {std!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return (_table_float32() * float(std)).to(dtype)


def hash_counters(counters: torch.Tensor, seed: int, stream: str, segment: int = 0,
                  tmp: torch.Tensor | None = None) -> torch.Tensor:
    """The 32-bit hash of each counter (in place): see the module docstring.

    Args:
        counters: int64 tensor of counters in ``[0, 2**32)`` on any device; overwritten with
            their hashes (in ``[0, 2**32)``) and returned.
        seed, stream: the draw's seed and stream name.
        segment: the counters' 2**32-segment (counter ``c`` of a tensor is ``segment * 2**32
            + counters``).
        tmp: an int64 scratch tensor of the same shape and device (allocated when None).
    Raises:
        ValueError: ``counters`` not int64.
    """
    if counters.dtype != torch.int64:
        raise ValueError(f"counters must be int64, got {counters.dtype}")
    x = counters
    t = torch.empty_like(x) if tmp is None else tmp
    for key, mult in zip(_keys(int(seed), str(stream), int(segment)), _MULTIPLIERS):
        x.bitwise_xor_(key)
        x.mul_(mult)
        torch.bitwise_right_shift(x, 32, out=t)
        x.bitwise_xor_(t)
        x.bitwise_and_(_MASK32)
    return x


def normal(
    shape,
    *,
    seed: int,
    stream: str,
    std: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    chunk_blocks: int | None = None,
) -> torch.Tensor:
    """A seeded tensor of (table-)normal draws, the same bits on every device.

    Args:
        shape: the tensor's shape (ints >= 0).
        seed: any int; ``(seed, stream)`` names the draw.
        stream: the tensor's name within the seed (e.g. ``"hidden_states_TH"``): streams of one
            seed are independent.
        std: standard deviation (the table's values times ``std`` in float32).
        dtype: floating dtype of the result (values rounded once, from float32).
        device: where the tensor is generated and returned (``cpu`` and ``cuda`` generate in
            place; other devices get the CPU's tensor, copied).
        chunk_blocks: blocks of :data:`BLOCK` elements generated per step (a power of two up to
            2**17; default by device). Changes memory and speed, never a value.
    Returns:
        contiguous tensor of ``shape`` and ``dtype`` on ``device``.
    Raises:
        ValueError: a bad shape, ``seed`` not an int, ``stream`` not a str, a bad ``std``,
            ``dtype`` or ``chunk_blocks``.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(stream, str):
        raise ValueError(f"stream must be a str, got {type(stream).__name__}")
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0 for s in shape):
        raise ValueError(f"shape must be ints >= 0, got {shape}")
    table = normal_table(std, dtype)
    dev = torch.device(device)
    cb = _check_chunk_blocks(chunk_blocks) if chunk_blocks is not None else None
    if dev.type not in _EXACT_INT64_DEVICES:
        return _generate(shape, seed, stream, table, torch.device("cpu"), cb).to(dev)
    return _generate(shape, seed, stream, table, dev, cb)


def _generate(shape, seed, stream, table, dev, cb) -> torch.Tensor:
    n = math.prod(shape)
    out = torch.empty(n, dtype=table.dtype, device=dev)
    if n == 0:
        return out.view(shape)
    table = table.to(dev)
    num_blocks = -(-n // BLOCK)
    cb = cb if cb is not None else _CHUNK_BLOCKS[dev.type]
    cb = min(cb, 1 << (num_blocks - 1).bit_length())  # no larger than the tensor needs
    chunks = range(0, num_blocks, cb)  # each a multiple of cb: no chunk crosses a segment
    workers = min(len(chunks), torch.get_num_threads()) if dev.type == "cpu" else 1
    if workers <= 1:
        _fill(out, table, seed, stream, chunks, cb)
    else:  # a share of the chunks per thread; their ops are serial (no parallel region inside)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers, thread_name_prefix="counter_rng") as pool:
            list(pool.map(lambda w: _fill(out, table, seed, stream, chunks[w::workers], cb),
                          range(workers)))
    return out.view(shape)


def _fill(out: torch.Tensor, table: torch.Tensor, seed: int, stream: str, chunks: range,
          cb: int) -> None:
    """Write the draws of the chunks (first blocks ``chunks``, ``cb`` blocks each) into the
    flat ``out``; every buffer is this call's own."""
    n = out.numel()
    hashes = torch.empty(cb * _HALF, dtype=torch.int64, device=out.device)
    tmp = torch.empty_like(hashes)
    index = torch.empty(cb, 2, _HALF, dtype=torch.int64, device=out.device)
    h = hashes.view(cb, _HALF)
    for b0 in chunks:
        c0 = b0 * _HALF
        local = c0 & ((1 << _SEGMENT_BITS) - 1)
        torch.arange(local, local + cb * _HALF, out=hashes)
        hash_counters(hashes, seed, stream, c0 >> _SEGMENT_BITS, tmp)
        torch.bitwise_right_shift(h, 16, out=index[:, 0, :])
        torch.bitwise_and(h, 0xFFFF, out=index[:, 1, :])
        start = b0 * BLOCK
        m = min(cb * BLOCK, n - start)
        torch.index_select(table, 0, index.view(-1)[:m], out=out[start : start + m])
