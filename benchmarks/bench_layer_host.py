"""How much of the layer's forward time is the host's: host enqueue time per forward, eager
``do_bench`` time and CUDA-graph replay time of the same forward, per ``grouped_mm`` choice.

The layer and inputs are ``bench_moe_layer.py``'s (``build_ours``: ``MoEExperts.from_model``, the
problem's weights, ``layer(x, expert_index_TK, affinity_TK)``). Per implementation:

- host: wall time per forward of 20 forwards queued behind a ~0.15 s ``torch.cuda._sleep``, so
  the GPU never waits for the host and the time is the host's alone (Python, checks, launches);
- eager: ``triton.testing.do_bench(forward, return_mode="median")`` (ms; an L2 flush before each),
  with autograd recording (``grad on``) and under ``torch.no_grad()``;
- graph: the ``no_grad`` forward captured once in a CUDA graph, ``do_bench(graph.replay)``.

Eager minus graph is what launch gaps and host time cost the forward where the host does not
keep ahead of the GPU.

Usage (CUDA only): ``python benchmarks/bench_layer_host.py qwen3-30b-a3b:16384
ours-gemm,ours-fused,cublas`` (shape as ``bench_moe_layer.py --shapes``; implementations:
``ours``, ``ours-gemm``, ``ours-fused``, a ``grouped_mm`` value such as ``cublas``, or the peer
``sonicmoe``, built and tuned as in ``bench_moe_layer.py``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_layer as layer_bench  # noqa: E402
from bench_moe_backward import header, parse_shapes  # noqa: E402


def host_ms(fn, n: int = 20) -> float:
    """Host wall time per call of ``fn`` (ms) with the GPU kept busy ahead of it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(300_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return host


def main(argv=None) -> int:
    from triton.testing import do_bench

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python benchmarks/bench_layer_host.py SHAPE[:T] IMPL[,IMPL...]")
        return 2
    if not torch.cuda.is_available():
        print("bench_layer_host.py needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    (label, model, T), = parse_shapes(argv[0], None, 1)
    p = layer_bench.make_problem_for_model(model, T, seed=0, device=dev)
    print(header(dev))
    for impl in argv[1].split(","):
        if impl == "sonicmoe":  # the peer, tuned as in bench_moe_layer.py (its cached choices)
            try:
                fwd = layer_bench.build_sonic(p, tuned=None).fwd
            except layer_bench._Skip as why:
                print(f"{label} {impl}: {why}", flush=True)
                continue
        else:
            fwd = layer_bench.build_ours(p, model, dev, layer_bench.GROUPED_MM.get(impl, impl)).fwd
        for _ in range(3):
            fwd()
        host_grad, eager_grad = host_ms(fwd), do_bench(fwd, return_mode="median")
        with torch.no_grad():
            host, eager = host_ms(fwd), do_bench(fwd, return_mode="median")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fwd()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    fwd()
                replay = f"{do_bench(graph.replay, return_mode='median'):.3f}"
            except RuntimeError as exc:  # e.g. a host sync inside the forward
                replay = f"n/a ({str(exc).splitlines()[0][:80]})"
        print(f"{label} {impl}: grad on: host {host_grad:.3f} ms, eager {eager_grad:.3f} ms | "
              f"no_grad: host {host:.3f}, eager {eager:.3f}, graph replay {replay}", flush=True)
        del graph
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
