"""Benchmark of the whole MoE expert-MLP backward (dX, dA, dW_gate_up, dW_down) per backend.

Rows per model shape, all measured in one process on one device:

- ours: ``common.dispatch`` backends (``torch``; on a GPU also ``cuda-sm90`` / ``cuda-sm100``
  where they can run), the same :class:`~common.problem.MoEBackwardProblem` for each;
- loop: a per-expert Python loop of BF16 ``torch.mm`` calls doing the same math (the naive MoE
  backward many training codes start from);
- dense: one ``torch.mm`` of ``[R, H] @ [H, 6I]`` -- exactly the backward's FLOPs
  (``12 * R * H * I``, R = routed rows), with no routing at all: the ceiling.

TFLOP/s counts ``12 * R * H * I``. Times are medians: ``triton.testing.do_bench`` on CUDA when
triton is installed, else CUDA events / ``time.perf_counter`` over ``--reps`` runs after a warm-up.

Usage: ``python benchmarks/bench_moe_backward.py [--models qwen3-30b-a3b,olmoe-1b-7b]
[--tokens 2048] [--device cpu|cuda] [--shrink N] [--reps 5]``
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from common import dispatch
from common.inputs import make_problem_for_model
from common.models import load_model


def _timer(device: torch.device, reps: int):
    if device.type == "cuda":
        try:
            import triton.testing

            return lambda fn: triton.testing.do_bench(fn, return_mode="median") * 1e-3
        except ImportError:
            pass

    def bench(fn):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return bench


def loop_backward(p):
    """Per-expert loop in BF16: the naive twin of the torch backend (host reads the counts)."""
    plan = p.plan
    x, dy = p.hidden_states_TH.bfloat16(), p.output_grad_TH.bfloat16()
    E, H, _, I = p.w_gate_up_EH2I.shape
    dX = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    dWgu = torch.empty(E, H, 2 * I, dtype=torch.bfloat16, device=x.device)
    dWd = torch.empty(E, I, H, dtype=torch.bfloat16, device=x.device)
    start = 0
    for e, n in enumerate(plan.tokens_per_expert_E.tolist()):
        sl = slice(start, start + n)
        start += n
        tok = plan.pair_token_R[sl]
        xe, dye = x[tok], dy[tok]
        a = plan.pair_affinity_R[sl].float()[:, None]
        g, u = p.act_checkpoint_R2I[sl, 0].float(), p.act_checkpoint_R2I[sl, 1].float()
        dh_raw = (dye @ p.w_down_EIH[e].bfloat16().t()).float()
        s = torch.sigmoid(g)
        h = g * s * u
        dh = a * dh_raw
        dgu = torch.cat([dh * u * s * (1 + g * (1 - s)), dh * g * s], 1).bfloat16()
        dX.index_add_(0, tok, (dgu @ p.w_gate_up_EH2I[e].bfloat16().reshape(H, 2 * I).t()).float())
        dWgu[e] = xe.t() @ dgu
        dWd[e] = (a * h).bfloat16().t() @ dye
        _ = (dh_raw * h).sum(-1)  # dA
    return dX, dWgu, dWd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,olmoe-1b-7b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shrink", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    bench = _timer(device, args.reps)
    backends = [
        name
        for name in ("torch", "cuda-sm90", "cuda-sm100")
        if dispatch._unavailable_reason(name) is None and (name == "torch" or device.type == "cuda")
    ]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} · {gpu or 'cpu'} · "
        f"torch {torch.__version__} · {torch.get_num_threads()} threads · T={args.tokens}"
    )
    head = "| shape (model: T, H, I, E, top_k) | impl | ms | TFLOP/s | vs loop | vs dense |"
    print(head)
    print("|" + "---|" * 6)
    for name in args.models.split(","):
        model = load_model(name)
        if args.shrink != 1:
            model = model.shrink(args.shrink)
        p = make_problem_for_model(model, args.tokens, seed=0, device=device)
        R = args.tokens * model.top_k
        flops = 12 * R * model.hidden * model.intermediate
        x = torch.randn(R, model.hidden, device=device).bfloat16()
        w = torch.randn(model.hidden, 6 * model.intermediate, device=device).bfloat16()
        t_dense = bench(lambda x=x, w=w: torch.mm(x, w))
        t_loop = bench(lambda p=p: loop_backward(p))
        rows = [
            (b, bench(lambda b=b, p=p: dispatch.resolve_backend(b, device).run(p)))
            for b in backends
        ]
        rows += [("loop", t_loop), ("dense mm", t_dense)]
        shape = (
            f"{name}: {args.tokens}, {model.hidden}, {model.intermediate}, {model.experts}, "
            f"{model.top_k}"
        )
        for impl, t in rows:
            print(
                f"| {shape} | {impl} | {t * 1e3:.1f} | {flops / t / 1e12:.3f} | "
                f"{t_loop / t:.2f} | {t_dense / t:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
