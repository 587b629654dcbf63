"""Launch one grouped-wgrad implementation a few times on one benchmark shape, for a profiler.

Meant to run under Nsight Compute, e.g. (the kernels of both implementations are CuTe DSL kernels
whose names contain ``cutlass``; the first launches are warm-up)::

    ncu --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python benchmarks/profile_grouped_wgrad.py --impl ours --shape "128x2048x1536 even"

``--impl ours`` runs our SM90 kernel with the YAML tile (or ``--tile``, the bench's tile spec);
``--impl quack`` runs quack's varlen-K GEMM with its default config (``tuned=False``) or
``--quack-config "tile_m,tile_n,pingpong,cluster_m,cluster_n"`` (no autotuning under the
profiler). Shapes are the rows of ``bench_grouped_wgrad.shapes()``; on FP32-accumulate rows quack
adds into the output (``add_to_output=True``).
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_grouped_wgrad as bgw  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("ours", "quack"), required=True)
    p.add_argument("--shape", default="128x2048x1536 even", help="a row name of the benchmark")
    p.add_argument("--tile", default=None, help="our tile, the bench's --tiles spec (one)")
    p.add_argument("--quack-config", default=None, help="tile_m,tile_n,pingpong,cluster_m,cluster_n")
    p.add_argument("--launches", type=int, default=4)
    args = p.parse_args(argv)

    rows = {r[0]: r for r in bgw.shapes()}
    args.shape = args.shape.replace("_", " ")  # (shell-friendly: "128x2048x1536_even")
    if args.shape not in rows:
        raise ValueError(f"--shape must be one of {sorted(rows)}, got {args.shape!r}")
    _name, e, m, n, counts, out_dtype, accumulate = rows[args.shape]
    dev = torch.device("cuda")
    s = int(sum(counts))
    gen = torch.Generator(device=dev).manual_seed(1)
    a = torch.randn(s, m, device=dev, dtype=torch.bfloat16, generator=gen).t()
    b = torch.randn(s, n, device=dev, dtype=torch.bfloat16, generator=gen)
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    out = torch.zeros(e, m, n, device=dev, dtype=getattr(torch, out_dtype))

    if args.impl == "ours":
        from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

        tile = (
            bgw.parse_tile(sm90, args.tile) if args.tile
            else sm90.select_sm90_tile_config(m, n, e, s, accumulate=accumulate)
        )
        key = sm90.Sm90WgradKey(
            m, n, e, a_major="m", b_major="n", out_dtype=out_dtype, accumulate=accumulate,
            tile=tile,
        )
        launcher = sm90.compile_sm90_wgrad(key)

        def fn():
            launcher(a, b, offsets, out)
    else:
        from quack import gemm_interface as qg
        from quack.gemm_config import GemmConfig

        cu = torch.cat([offsets.new_zeros(1), offsets])
        config = None
        if args.quack_config:
            tm, tn, pp, cm, cn = (int(v) for v in args.quack_config.split(","))
            config = GemmConfig(tile_m=tm, tile_n=tn, pingpong=bool(pp), cluster_m=cm,
                                cluster_n=cn, is_dynamic_persistent=False)
        kw = dict(cu_seqlens_k=cu, dynamic_scheduler=False)

        def fn():
            qg.gemm_tuned.fn(a, b, out, config=config, add_to_output=accumulate, **kw)
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{args.impl} {args.shape}: {args.launches} launches done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
