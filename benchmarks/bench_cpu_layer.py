"""A router + :class:`common.layer.MoEExperts` training step on the CPU against a plain-PyTorch
loop of the same math in the same dtypes, quiet and beside a competing torch process.

Both steps: BF16 router logits -> fp32 softmax -> top-k; the experts' gated MLP (SwiGLU) with
BF16 GEMM operands; loss = mean(y^2) in fp32; backward to x, the router and every weight. The
plain loop is what a user would write without this package: per expert, gather its tokens,
``x_e @ W_gate_up[e]``, ``silu(g) * u``, ``@ W_down[e]``, scale by the affinity and
``index_add`` into y; autograd does the backward. ``plain-f32gemm`` is that loop with its GEMMs
on the same BF16 values widened to fp32, as the layer runs them on a CPU without native BF16
matmul (AVX2): there torch's BF16 GEMM is an emulation ~35x slower, which would hide the
layer's own overhead; on an AVX512-BF16 / AMX CPU compare with ``plain``. The header line says
which the CPU has, and the targets line uses that baseline.

Timing: each configuration (quiet, then beside a subprocess doing ``--noise-threads``-thread
fp32 matmuls: the contention a shared CI box or a data loader gives) runs ``--repeats`` rounds
(fewer, but at least 3, once it has used half of ``--max-seconds``); a round times ``--steps``
steps of each step function in turn (shared machines drift, so the functions alternate).
Reported per function: the median step time over the rounds and its spread [min - max]; per round the ratio layer / other of that round (paired), its median and
spread. Targets: layer / plain <= 2 quiet, and the layer's contended / quiet slowdown no worse
than plain's.

Pinning: ``--cpus 0,1`` pins this process and the noise process to those CPUs (every thread,
sched_setaffinity; Linux) and gives torch that many intra-op threads: the same as starting it
under ``taskset -c 0,1``, which works too (torch then takes its thread count from the mask).

``--count``: deterministic proxies instead of timing (one step of each, no noise): aten ops
per step (outermost, views and allocations not counted; the layer's custom ops counted by what
they run), GEMM multiply-adds, and the megabytes the other ops read and write.

    python benchmarks/bench_cpu_layer.py                  # T 512, H 256, I 128, E 8, top-2
    python benchmarks/bench_cpu_layer.py --cpus 0,1       # pinned to 2 cores of a bigger box
    python benchmarks/bench_cpu_layer.py --count          # op counts, no timing
    python benchmarks/bench_cpu_layer.py --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # the repository's package when not installed
    sys.path.insert(0, str(_ROOT))

from common.layer import MoEExperts  # noqa: E402

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


def _time(fns: dict, steps: int, repeats: int, budget_s: float) -> dict[str, list[float]]:
    """Per round, ``steps`` steps of each (alternating), seconds per step; warm-up first.
    Stops after the round that passes ``budget_s`` seconds, once 3 rounds are in."""
    t_start = time.perf_counter()
    for _ in range(2):
        for fn in fns.values():
            fn()
    out = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            out[name].append((time.perf_counter() - t0) / steps)
        if r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return out


# ------------------------------------------------------------------------------------ pinning
def _pin(cpus: list[int]) -> None:
    """Every thread of this process onto ``cpus`` (children inherit it), torch's intra-op
    threads to their number. Raises SystemExit naming a CPU this process may not use."""
    allowed = os.sched_getaffinity(0)
    bad = sorted(set(cpus) - allowed)
    if bad:
        raise SystemExit(f"--cpus {bad} not available to this process (allowed {sorted(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)
    torch.set_num_threads(len(cpus))


def _native_bf16() -> bool:
    """Whether torch multiplies BF16 matrices natively on this CPU (oneDNN: AVX512-BF16, AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------------- counting
# Ops that move no data (views, metadata, allocations) are not counted.
_FREE_OPS = frozenset((
    "view", "_unsafe_view", "as_strided", "alias", "detach", "t", "transpose", "permute",
    "expand", "slice", "select", "unsqueeze", "squeeze", "unflatten", "reshape",
    "_reshape_alias", "split", "split_with_sizes", "unbind", "narrow", "diagonal", "lift_fresh",
    "empty", "empty_strided", "new_empty", "new_empty_strided", "resize_", "as_strided_",
    "_local_scalar_dense", "resolve_conj", "resolve_neg", "is_nonzero", "item",
))
_GEMM_OPS = frozenset(("mm", "addmm", "bmm", "matmul"))


def _count(fn) -> dict:
    """One call of ``fn`` under a dispatch mode: ``{"ops", "gemm_macs", "other_mb",
    "by_op"}`` (aten ops that do work, outermost: a custom op's own ops are counted, not the
    op; GEMM multiply-adds; MB read + written by the non-GEMM ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    try:  # to step into the layer's torch.library custom ops (their Python implementations)
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - older/newer torch: counted as one op each
        OPDEFS = {}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.by_op = collections.Counter()
            self.macs = 0
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            opdef = OPDEFS.get(func._schema.name) if func.namespace != "aten" else None
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name in _FREE_OPS:
                return out
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not func._schema.is_mutable and outs and all(  # returned an input: a no-op
                any(o is i or (o.data_ptr() == i.data_ptr() and o.shape == i.shape
                               and o.dtype == i.dtype) for i in ins) for o in outs):
                return out
            self.by_op[name] += 1
            if name in _GEMM_OPS:
                a, b = args[1:3] if name == "addmm" else args[:2]
                batch = a.shape[0] if a.dim() == 3 else 1
                self.macs += batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            else:
                self.bytes += sum(t.numel() * t.element_size() for t in ins + outs)
            return out

    mode = Count()
    with mode:
        fn()
    return {"ops": sum(mode.by_op.values()), "gemm_macs": mode.macs,
            "other_mb": mode.bytes / 1e6, "by_op": dict(mode.by_op.most_common())}


def _spread(values: list[float]) -> str:
    return f"[{min(values):.2f}-{max(values):.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds per configuration")
    ap.add_argument("--max-seconds", type=float, default=90.0,
                    help="time budget of the two configurations together: fewer rounds (at "
                         "least 3 each) where the steps are slow")
    ap.add_argument("--noise-threads", type=int, default=2,
                    help="threads of the competing matmul process")
    ap.add_argument("--cpus", help="pin to these CPUs, e.g. 0,1 (as taskset -c 0,1)")
    ap.add_argument("--count", action="store_true",
                    help="print op counts, GEMM MACs and MB per step instead of timing")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.cpus:
        try:
            cpus = sorted({int(c) for c in args.cpus.split(",")})
        except ValueError:
            raise SystemExit(f"--cpus must be a comma-separated list of CPU ids, got {args.cpus!r}")
        _pin(cpus)
    fns = _make(args.tokens, args.hidden, args.intermediate, args.experts, args.top_k)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    native = _native_bf16()
    base = "plain" if native else "plain-f32gemm"  # the fair baseline (module docstring)
    print(f"T={args.tokens} H={args.hidden} I={args.intermediate} E={args.experts} "
          f"K={args.top_k} BF16; {_cpu_name()} ({'native' if native else 'no native'} BF16 "
          f"matmul: targets against {base}); CPUs {affinity}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads")
    if args.count:
        for fn in fns.values():  # warm-up (lazy initialisation is no step's work)
            fn()
        counts = {name: _count(fn) for name, fn in fns.items()}
        for name, c in counts.items():
            print(f"{name}: {c['ops']} ops, {c['gemm_macs'] / 1e6:.1f} M GEMM MACs, "
                  f"{c['other_mb']:.1f} MB by the other ops per step")
            print("  " + ", ".join(f"{k} {v}" for k, v in c["by_op"].items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "counts": counts}, f, indent=1)
        return 0

    t_start = time.perf_counter()
    budget = args.max_seconds / 2
    results = {"quiet": _time(fns, args.steps, args.repeats, budget)}
    noise = subprocess.Popen([sys.executable, "-c", _NOISE, str(args.noise_threads)])
    try:
        time.sleep(1.0)
        results["contended"] = _time(fns, args.steps, args.repeats, budget)
    finally:
        noise.kill()
        noise.wait()
    med = {c: {k: statistics.median(v) for k, v in r.items()} for c, r in results.items()}
    ratio = {c: {k: [a / b for a, b in zip(r["layer"], r[k])] for k in r if k != "layer"}
             for c, r in results.items()}
    for c, r in results.items():
        print(f"{c} (median [min-max] of {len(r['layer'])} rounds of {args.steps} steps, ms): "
              + ", ".join(f"{k} {med[c][k] * 1e3:.2f} "
                          f"{_spread([v * 1e3 for v in r[k]])}" for k in r))
        print("  layer / other, per round: " + ", ".join(
            f"{k} {statistics.median(v):.2f} {_spread(v)}" for k, v in ratio[c].items()))
    slow = {k: med["contended"][k] / med["quiet"][k] for k in fns}
    print("contended / quiet (medians): " + ", ".join(f"{k} {v:.2f}x" for k, v in slow.items()))
    q = statistics.median(ratio["quiet"][base])
    print(f"targets: quiet layer / {base} {q:.2f} (<= 2: {'met' if q <= 2 else 'NOT met'}); "
          f"slowdown layer {slow['layer']:.2f}x vs {base} {slow[base]:.2f}x "
          f"({'met' if slow['layer'] <= slow[base] else 'NOT met'}); "
          f"{time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpus": affinity, "native_bf16": native,
                       "baseline": base, "seconds": results, "median": med,
                       "ratio_per_round": ratio, "slowdown": slow}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
