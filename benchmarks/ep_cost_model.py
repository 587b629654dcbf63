"""Expert-parallel cost model of one MoE layer's training step (forward + backward), per GPU.

Prints the Markdown table of ``docs/expert-parallel.md`` (formulas there). Pure arithmetic, no
torch: ``python benchmarks/ep_cost_model.py [--tokens 8192] [--dispatch-bytes 2]``.
"""

from __future__ import annotations

import argparse

# Measured on one H200 (benchmarks/RESULTS.md, "Whole MoE expert-MLP backward", run 7,
# deepseek-v3-e32 T=2048, H7168 I2048 K8; TFLOP/s count 12 R H I):
BWD_TFLOPS_OURS = 507.2  # `ours (layer state)`: what MoEExperts runs in training
BWD_TFLOPS_BASELINE = 399.2  # `baseline+perm`: torchtitan-style autograd of torch._grouped_mm
# Not measured: the forward's three grouped GEMMs, taken at the baseline backward's GEMM rate
# without the permutation (`baseline`, 448.0 TFLOP/s) -- an assumption, stated in the doc.
FWD_TFLOPS = 448.0
NVLINK_GBPS = 450.0  # H200 NVLink 4: 900 GB/s bidirectional = 450 GB/s each way per GPU
IB_GBPS = 50.0  # one 400 Gb/s NIC per GPU = 50 GB/s each way
GPUS_PER_NODE = 8
MODELS = {  # name: (H, I, E, K), from configs/models/*.yaml
    "deepseek-v3": (7168, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
}
GPUS = (8, 16, 32, 64, 128, 256)


def ep_degree(gpus: int, experts: int) -> int:
    """The largest EP degree <= gpus dividing E (the rest of the GPUs replicate: DP)."""
    return max(d for d in range(1, gpus + 1) if experts % d == 0 and gpus % d == 0)


def layer_costs(H, I, E, K, gpus, tokens, dispatch_bytes, bwd_tflops=BWD_TFLOPS_OURS):
    """Times in ms of one layer's step on one GPU (balanced routing, uniform destinations)."""
    ep = ep_degree(gpus, E)
    R = tokens * K  # routed rows computed per GPU (balanced)
    t_fwd = 6 * R * H * I / (FWD_TFLOPS * 1e12) * 1e3
    t_dgrad = 6 * R * H * I / (bwd_tflops * 1e12) * 1e3  # half the backward's 12 R H I
    t_wgrad = t_dgrad
    # one exchange moves T*K rows of H elements; a fraction leaves the GPU, part of it the node
    row_bytes = tokens * K * H * dispatch_bytes
    local = min(ep, GPUS_PER_NODE)
    intra = row_bytes * (local - 1) / ep
    inter = row_bytes * (ep - local) / ep
    t_x = max(intra / (NVLINK_GBPS * 1e9), inter / (IB_GBPS * 1e9)) * 1e3
    t_a2a = 4 * t_x  # dispatch + combine in forward, their reverses in backward
    serial = t_fwd + t_dgrad + t_wgrad + t_a2a
    # deferred wgrad (Megatron backward_dw): the backward's two exchanges run under the wgrad
    deferred = t_fwd + 2 * t_x + t_dgrad + max(t_wgrad, 2 * t_x)
    return {
        "ep": ep, "experts_per_gpu": E // ep, "compute": t_fwd + t_dgrad + t_wgrad,
        "a2a": t_a2a, "serial": serial, "deferred": deferred,
    }


def table(tokens: int, dispatch_bytes: int) -> str:
    lines = [
        "| model | GPUs | EP | experts/GPU | compute ms | all-to-all ms | a2a / compute | "
        "step ms (serial) | step ms (deferred wgrad) | saved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (H, I, E, K) in MODELS.items():
        for g in GPUS:
            c = layer_costs(H, I, E, K, g, tokens, dispatch_bytes)
            lines.append(
                f"| {name} | {g} | {c['ep']} | {c['experts_per_gpu']} | {c['compute']:.1f} | "
                f"{c['a2a']:.1f} | {c['a2a'] / c['compute']:.2f} | {c['serial']:.1f} | "
                f"{c['deferred']:.1f} | {1 - c['deferred'] / c['serial']:.0%} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per layer (T)")
    ap.add_argument("--dispatch-bytes", type=int, default=2, help="bytes per element sent (2: BF16)")
    a = ap.parse_args(argv)
    print(f"T = {a.tokens} tokens per GPU, {a.dispatch_bytes}-byte elements, top-8, balanced\n")
    print(table(a.tokens, a.dispatch_bytes))


if __name__ == "__main__":
    main()
