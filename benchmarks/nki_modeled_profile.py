"""Modeled per-phase time and TensorE utilization of the NKI MXFP8 backward on one full block.

Runs :func:`nki_kernels.blockwise_mm_bwd_mxfp8.blockwise_mm_bwd_mxfp8` on our CPU interpreter for
one block of B tokens of one expert (every slot live, top-1 routing, dX read-add-write as for
top-k > 1) at a model's expert shape (``configs/models``, I = the full intermediate, TP = 1) and
prints, per region, the interpreter's MODELED Trainium3 time (``nki_kernels/interp/profile.py``),
the modeled TensorE utilization, the per-engine busy times and where DMA bytes go by chunk size.
Nothing here ran on Trainium.

``--fast`` keeps every instruction, rule and cost of the interpreter but skips the MX
arithmetic (quantize_mx writes zeros, nc_matmul_mx dequantizes zeros), as the SBUF-plan tests
of ``tests/test_nki_block_stream.py`` do: the modeled time depends only on the instruction
stream, not on values, so it is identical; full-model shapes at B = 4096 need it on a 2-core
machine.

Usage::

    python benchmarks/nki_modeled_profile.py --model qwen3-235b-a22b --block-size 4096 --fast
    python benchmarks/nki_modeled_profile.py --shape 512,256 --block-size 128 --lnc 1 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def fast_arithmetic() -> None:
    """Drop the MX arithmetic of the interpreter (values only; instructions and costs stay)."""
    import numpy as np

    from nki_kernels.interp import isa, mxops

    isa._dequant_operand = lambda instr, arg, data, scale, P, C, prec: np.zeros((P * 4, C), prec)
    isa.MATMUL_PRECISION["value"] = "float32"
    mxops.quantize_groups = lambda src, elem, impl=None: (
        np.zeros((src.shape[0], src.shape[1] // 4), np.uint32),
        np.zeros((src.shape[0] // 8, src.shape[1] // 4), np.uint8))


def profile_block(H: int, I: int, B: int, lnc: int, tokens: int | None = None, seed: int = 0,
                  use_scale_packing: bool = True):
    """One block of ``tokens`` (default B) live slots of expert 0; returns the interpreter's
    :class:`~nki_kernels.interp.profile.Profile` (``memory[core]["sbuf_peak_by_region"]``: the
    SBUF peak per region, bytes per partition)."""
    import torch

    from nki_kernels._nki import simulate
    from nki_kernels.blockwise_mm_bwd_mxfp8 import blockwise_mm_bwd_mxfp8
    from nki_kernels.config import SkipMode

    T = B if tokens is None else tokens
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).bfloat16()
    dy = (torch.randn(T, H, generator=gen) * 0.1).bfloat16()
    wgu = (torch.randn(1, H, 2, I, generator=gen) * H**-0.5).bfloat16()
    wd = (torch.randn(1, I, H, generator=gen) * I**-0.5).bfloat16()
    tpti = torch.full((B,), -1, dtype=torch.int32)
    tpti[:T] = torch.arange(T, dtype=torch.int32)
    ck = torch.randn(1, 2, I, B, generator=gen).bfloat16()
    ea = torch.rand(T, 1, generator=gen).bfloat16()
    k = simulate(blockwise_mm_bwd_mxfp8, lnc=lnc)
    k(x, ea, wgu, wd, tpti, torch.zeros(1, 1, dtype=torch.int32), dy, B,
      gate_up_proj_act_checkpoint_T=ck, skip_dma=SkipMode(skip_token=True),
      run_with_lnc2=lnc == 2, use_scale_packing=use_scale_packing)
    return k.last_profile


def rows_of(prof) -> list[dict]:
    """One dict per region (+ "total"): modeled time, utilization, engine busy, DMA, and the SBUF
    peak while in the region (bytes per partition, max over cores)."""
    peaks: dict = {}
    for mem in prof.memory.values():
        for reg, v in mem.get("sbuf_peak_by_region", {}).items():
            peaks[reg] = max(peaks.get(reg, 0), v)
    out = []
    for r in prof.summary():
        out.append({
            "region": r["region"], "modeled_us": r["modeled_us"],
            "sbuf_peak_bytes": peaks.get(r["region"], 0),
            "tensor_e_util": r["tensor_e_util"], "engine_us": r["engine_us"],
            "dma_MB": r["dma_bytes"] / 1e6, "dma_count": r["dma_count"],
            "dma_MB_chunk_le_256B": sum(v for c, v in r["dma_bytes_by_chunk"].items()
                                        if c <= 256) / 1e6,
        })
    out.append({"region": "total", "modeled_us": prof.modeled_time_us(),
                "tensor_e_util": prof.tensor_e_utilization(),
                "engine_us": prof.engine_time_us(),
                "dma_MB": prof.counters().dma_bytes / 1e6,
                "dma_count": prof.counters().dma_count,
                "sbuf_peak_bytes": max((m["sbuf_peak_bytes"] for m in prof.memory.values()),
                                       default=0)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a configs/models name (H, I from it)")
    ap.add_argument("--shape", help="H,I instead of --model")
    ap.add_argument("--block-size", type=int, default=4096)
    ap.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    ap.add_argument("--tokens", type=int, help="live slots (default: the whole block)")
    ap.add_argument("--fast", action="store_true", help="skip the MX arithmetic (same model)")
    ap.add_argument("--no-scale-packing", action="store_true",
                    help="use_scale_packing=False (default: True, the seed's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.shape):
        ap.error("give exactly one of --model / --shape")
    if args.model:
        from common.models import load_model

        m = load_model(args.model)
        H, I = m.hidden, m.intermediate
    else:
        H, I = (int(v) for v in args.shape.split(","))
    import torch

    torch.set_num_threads(1)
    if args.fast:
        fast_arithmetic()
    t0 = time.perf_counter()
    prof = profile_block(H, I, args.block_size, args.lnc, args.tokens,
                         use_scale_packing=not args.no_scale_packing)
    wall = time.perf_counter() - t0
    rows = rows_of(prof)
    if args.json:
        print(json.dumps({"H": H, "I": I, "B": args.block_size, "lnc": args.lnc,
                          "scale_packing": not args.no_scale_packing, "wall_s": wall,
                          "rows": rows}))
        return 0
    print(f"H={H} I={I} B={args.block_size} LNC{args.lnc} (modeled Trainium3; wall {wall:.0f} s)")
    print(f"{'region':<10} {'modeled us':>11} {'TensorE':>8} {'DMA MB':>8} {'<=256B MB':>9} "
          f"{'SBUF B/p':>8}  engine busy us (tensor/vector/scalar/gpsimd/dma)")
    for r in rows:
        e = r["engine_us"]
        print(f"{r['region']:<10} {r['modeled_us']:>11.1f} {100 * r['tensor_e_util']:>7.1f}% "
              f"{r['dma_MB']:>8.2f} {r.get('dma_MB_chunk_le_256B', 0):>9.2f} "
              f"{r['sbuf_peak_bytes']:>8}  "
              + "/".join(f"{e[k]:.0f}" for k in ("tensor", "vector", "scalar", "gpsimd", "dma")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
