"""What folding the top-k combine into the down GEMM could win (issue 33 item 4): an upper bound.

The layer's forward ends with ``out_S = ah_S @ W_down[e]`` (grouped rows, cuBLAS) and
``y[t] = sum_k out_S[slot_rows[t, k]]`` (``cuda_kernels.triton.rows.token_sum``; the affinity is
already folded into ``ah_S = a * h`` by the activation pass, so the combine is a plain sum). A
deterministic per-token sum cannot run inside a GEMM epilogue without atomics (a token's k rows
lie in k different experts' tiles); what a GEMM can do is a row-indexed store: write row ``r``
at its pair's slot of a ``[T, k, H]`` buffer, so the sum reads each token's k rows
contiguously. This script times the parts that decide whether that pays, per shape:

- ``down cuBLAS``: ``torch._grouped_mm`` of the down projection (what the layer runs);
- ``down ours``: our SM90 grouped GEMM with the plain store epilogue (``grouped_mm_gather``
  without an index: what a row-indexed store epilogue would be built on);
- ``sum grouped``: ``token_sum`` over the grouped rows through ``slot_rows`` (the layer's);
- ``sum contiguous``: ``token_sum`` over a ``[T * k, H]`` buffer in slot order (identity slot
  rows: what a free row-indexed store would leave to do).

The fold can win at most ``sum grouped - sum contiguous`` and costs at least
``down ours - down cuBLAS`` (ms; ``triton.testing.do_bench`` median).

Usage: ``python benchmarks/bench_combine.py [--shapes qwen3-30b-a3b:16384,...]``.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_grouped_mm import build_shape  # noqa: E402
from bench_moe_backward import DEFAULT_SHAPES, make_timer, parse_shapes  # noqa: E402

from cuda_kernels.grouped_mm import grouped_mm_gather  # noqa: E402
from cuda_kernels.triton.rows import token_sum  # noqa: E402


def _time_shape(model, T: int, dev: torch.device, bench) -> dict:
    """ms of the four parts (module docstring) on one shape's routing and operands."""
    d = build_shape(model, T, dev)
    slots = d["layout"].slot_to_row_TK
    k = slots.shape[1]
    ah, w_d, offs = d["ah"], d["w_d"], d["offsets"]
    out_S = torch._grouped_mm(ah, w_d, offs=offs)
    pair_rows = torch.randn(T * k, d["H"], device=dev).to(torch.bfloat16)
    ident = torch.arange(T * k, device=dev, dtype=torch.int64).view(T, k)
    t = {
        "cublas": bench(lambda: torch._grouped_mm(ah, w_d, offs=offs)),
        "ours": bench(lambda: grouped_mm_gather(ah, w_d, offs, backend="sm90")),
        "grouped": bench(lambda: token_sum(out_S, slots, torch.bfloat16)),
        "contig": bench(lambda: token_sum(pair_rows, ident, torch.bfloat16)),
    }
    return {key: v * 1e3 for key, v in t.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_combine: needs a CUDA GPU (SM90 for the 'down ours' column)")
        return 0
    dev = torch.device("cuda")
    bench = make_timer(dev, 20)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"# {stamp} · {torch.cuda.get_device_name()} · torch {torch.__version__}")
    print("| shape | down cuBLAS | down ours | sum grouped | sum contiguous | fold wins <= | "
          "fold costs >= |")
    print("|---|---|---|---|---|---|---|")
    for label, model, T in parse_shapes(args.shapes, None, 1):
        ms = _time_shape(model, T, dev, bench)
        print(f"| {label} | {ms['cublas']:.3f} | {ms['ours']:.3f} | {ms['grouped']:.3f} | "
              f"{ms['contig']:.3f} | {ms['grouped'] - ms['contig']:.3f} | "
              f"{ms['ours'] - ms['cublas']:.3f} |")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
