"""A router + :class:`common.layer.MoEExperts` training step on the CPU against a plain-PyTorch
loop of the same math in the same dtypes, quiet and beside a competing torch process.

Both steps: BF16 router logits -> fp32 softmax -> top-k; the experts' gated MLP (SwiGLU) with
BF16 GEMM operands; loss = mean(y^2) in fp32; backward to x, the router and every weight. The
plain loop is what a user would write without this package: per expert, gather its tokens,
``x_e @ W_gate_up[e]``, ``silu(g) * u``, ``@ W_down[e]``, scale by the affinity and
``index_add_`` into y; autograd does the backward. ``plain-f32gemm`` is that loop with its GEMMs
on the same BF16 values widened to fp32, as the layer runs them on a CPU without native BF16
matmul (AVX2): there torch's BF16 GEMM is an emulation ~35x slower, which would hide the
layer's own overhead; on an AVX512-BF16 / AMX CPU compare with ``plain``.

Each configuration alternates layer and plain steps in one process (shared machines drift), and
reports the median step time of each over ``--repeats`` rounds of ``--steps`` steps, then the
same beside a subprocess doing ``--noise-threads``-thread fp32 matmuls (the contention a shared
CI box or a data loader gives). Targets: layer / plain <= 2 quiet, and the layer's contended /
quiet slowdown no worse than plain's.

    python benchmarks/bench_cpu_layer.py            # T 512, H 256, I 128, E 8, top-2, BF16
    python benchmarks/bench_cpu_layer.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from common.layer import MoEExperts

_NOISE = (
    "import torch, sys\n"
    "torch.set_num_threads(int(sys.argv[1]))\n"
    "a = torch.randn(512, 512)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)


def _plain_experts(x_TH, idx_TK, aff_TK, w_gate_up_EH2I, w_down_EIH, gemm_dtype=None):
    """The same math as the layer, written the plain way (BF16 operands, fp32 activation);
    ``gemm_dtype=torch.float32`` runs the GEMMs on the same BF16 values widened to fp32 (what
    the layer does on a CPU without native BF16 matmul), the products rounded to BF16."""
    T, H = x_TH.shape
    E, _, _, I = w_gate_up_EH2I.shape
    bf16 = torch.bfloat16
    y = torch.zeros(T, H, dtype=torch.float32)
    for e in range(E):
        tok, slot = torch.nonzero(idx_TK == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe, wgu, wd = x_TH[tok], w_gate_up_EH2I[e].reshape(H, 2 * I), w_down_EIH[e]
        if gemm_dtype is not None:
            xe, wgu, wd = xe.to(gemm_dtype), wgu.to(gemm_dtype), wd.to(gemm_dtype)
        gu = (xe @ wgu).to(bf16).float().reshape(-1, 2, I)
        h = (torch.nn.functional.silu(gu[:, 0]) * gu[:, 1]).to(bf16)
        if gemm_dtype is not None:
            h = h.to(gemm_dtype)
        y_e = (h @ wd).to(bf16).float() * aff_TK[tok, slot, None].float()
        y = y.index_add(0, tok, y_e)
    return y.to(x_TH.dtype)


def _make(T, H, I, E, K, seed=0):
    torch.manual_seed(seed)
    router = torch.nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
    layer = MoEExperts(E, H, I, dtype=torch.bfloat16)
    w_gu = layer.w_gate_up.detach().clone().requires_grad_()
    w_d = layer.w_down.detach().clone().requires_grad_()
    x = torch.randn(T, H, dtype=torch.bfloat16)

    def route(x_TH):
        probs = torch.softmax(router(x_TH).float(), dim=-1)
        aff, idx = torch.topk(probs, K, dim=-1)
        return idx, aff

    def layer_step():
        xs = x.clone().requires_grad_()
        idx, aff = route(xs)
        y = layer(xs, idx, aff)
        y.float().square().mean().backward()

    def plain(gemm_dtype=None):
        def step():
            xs = x.clone().requires_grad_()
            idx, aff = route(xs)
            y = _plain_experts(xs, idx, aff, w_gu, w_d, gemm_dtype)
            y.float().square().mean().backward()

        return step

    return {"layer": layer_step, "plain": plain(), "plain-f32gemm": plain(torch.float32)}


def _time(fns: dict, steps: int, repeats: int) -> dict[str, list[float]]:
    """Per round, ``steps`` steps of each (alternating), seconds per step; warm-up first."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    out = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            out[name].append((time.perf_counter() - t0) / steps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per configuration")
    ap.add_argument("--noise-threads", type=int, default=2,
                    help="threads of the competing matmul process")
    ap.add_argument("--json", help="write the times here")
    args = ap.parse_args(argv)
    fns = _make(args.tokens, args.hidden, args.intermediate, args.experts, args.top_k)
    print(f"T={args.tokens} H={args.hidden} I={args.intermediate} E={args.experts} "
          f"K={args.top_k} BF16, torch threads {torch.get_num_threads()}")
    results = {"quiet": _time(fns, args.steps, args.repeats)}
    noise = subprocess.Popen([sys.executable, "-c", _NOISE, str(args.noise_threads)])
    try:
        time.sleep(1.0)
        results["contended"] = _time(fns, args.steps, args.repeats)
    finally:
        noise.kill()
        noise.wait()
    med = {c: {k: statistics.median(v) for k, v in r.items()} for c, r in results.items()}
    for c, r in results.items():
        print(f"{c}: " + ", ".join(f"{k} {med[c][k] * 1e3:.1f} ms" for k in r) + "; layer / "
              + ", ".join(f"{k} {med[c]['layer'] / med[c][k]:.2f}" for k in r if k != "layer"))
        print("  rounds (ms): " + "; ".join(f"{k} {[round(v * 1e3, 1) for v in r[k]]}" for k in r))
    slow = {k: med["contended"][k] / med["quiet"][k] for k in fns}
    print("contended / quiet: " + ", ".join(f"{k} {v:.2f}x" for k, v in slow.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seconds": results, "median": med,
                       "slowdown": slow}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
