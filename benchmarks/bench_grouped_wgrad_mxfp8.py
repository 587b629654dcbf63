"""Benchmark of the SM90 MXFP8 grouped wgrad (cuda_kernels/grouped_wgrad/sm90_mxfp8.py) on the H200.

Rows: the BF16 shapes of ``bench_grouped_wgrad.py`` (not its fp32-accumulate rows), bf16 out. Columns, all in one process with ``triton.testing.do_bench`` (median):

- ``mx``: ours, MXFP8 operands given (quantized by ``quantize_wgrad_operand``), token layout
  ``direct`` (reads each expert at its first token) and ``padded`` (repacks the operands so that
  every expert starts 128-token aligned; the repack is timed with it);
- ``bf16``: our BF16 SM90 kernel on the BF16 token rows (A M-major, B N-major, as in
  ``bench_grouped_wgrad.py``) and the ratio ``bf16 / mx`` (target >= 0.6);
- ``deq+bf16``: dequantize both MX operands to BF16 (torch, ``common/mx``) + our BF16 kernel:
  the end-to-end alternative that MXFP8 must beat.

Usage: ``python benchmarks/bench_grouped_wgrad_mxfp8.py [--quick] [--json out.json]``.
"""

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _dequant(data_RS, sf, rows, offsets):
    """BF16 [rows, S] K-major from an MX operand (per-expert common/mx dequantization)."""
    from common import mx
    from common.mx_atoms import unpack_grouped_scales

    ends = offsets.tolist()
    scales = unpack_grouped_scales(sf, rows, ends, 32)
    out = torch.empty(data_RS.shape, dtype=torch.bfloat16, device=data_RS.device)
    begin = 0
    for e, end in enumerate(ends):
        k = end - begin
        if k:
            c = scales[e].shape[1]
            pad = torch.zeros((rows, 32 * c), dtype=data_RS.dtype, device=data_RS.device)
            pad[:, :k] = data_RS[:, begin:end]
            deq = mx.dequantize_mx(pad, scales[e], elem="e4m3", block_size=32, axis=1)
            out[:, begin:end] = deq[:, :k].to(torch.bfloat16)
        begin = end
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import triton

    from benchmarks.bench_grouped_wgrad import shapes
    from cuda_kernels.grouped_wgrad import sm90_bf16
    from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand
    from cuda_kernels.grouped_wgrad.sm90_mxfp8 import grouped_wgrad_mxfp8_sm90

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3

    rows = []
    for name, e, m, n, counts, out_dtype, accumulate in shapes(args.quick):
        if accumulate:
            continue
        s = sum(counts)
        off = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
        x = torch.randn(s, m, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
        a, sfa = quantize_wgrad_operand(x, off)
        bt, sfb = quantize_wgrad_operand(dy, off)
        b = bt.t()
        out = torch.empty((e, m, n), dtype=torch.bfloat16, device="cuda")
        flops = 2.0 * m * n * s
        row = {"shape": name, "tokens": s}
        for layout in ("direct", "padded"):
            try:
                grouped_wgrad_mxfp8_sm90(a, sfa, b, sfb, off, out, token_layout=layout)
                t = bench(lambda layout=layout: grouped_wgrad_mxfp8_sm90(
                    a, sfa, b, sfb, off, out, token_layout=layout, validate=False))
                row[f"mx_{layout}_us"] = t
                row[f"mx_{layout}_tflops"] = flops / t / 1e6
            except Exception as exc:  # noqa: BLE001 - a row reports, never stops the bench
                row[f"mx_{layout}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        xa, yb = x.t(), dy  # (M, S) M-major, (S, N) N-major: token rows, as a MoE holds them
        key = sm90_bf16.Sm90WgradKey(
            m, n, e, a_major="m", b_major="n",
            tile=sm90_bf16.select_sm90_tile_config(m, n, e),
        )
        launch = sm90_bf16.compile_sm90_wgrad(key)
        row["bf16_us"] = bench(lambda: launch(xa, yb, off, out))
        row["bf16_tflops"] = flops / row["bf16_us"] / 1e6

        # dequantized operands are K-major (the MX layout); the BF16 kernel then needs tokens_sum
        # a multiple of 8 (TMA strides), else the row reports an error
        key_k = sm90_bf16.Sm90WgradKey(
            m, n, e, a_major="k", b_major="k",
            tile=sm90_bf16.select_sm90_tile_config(m, n, e),
        )

        def deq_bf16():
            a16 = _dequant(a, sfa, m, off)
            b16 = _dequant(bt, sfb, n, off).t()
            sm90_bf16.compile_sm90_wgrad(key_k)(a16, b16, off, out)

        try:
            row["deq_bf16_us"] = bench(deq_bf16)
        except Exception as exc:  # noqa: BLE001 - a row reports, never stops the bench
            row["deq_bf16_error"] = f"{type(exc).__name__}: {exc}"[:200]
        best = min(row.get("mx_direct_us", float("inf")), row.get("mx_padded_us", float("inf")))
        row["mx_vs_bf16"] = row["bf16_us"] / best
        row["mx_vs_deq_bf16"] = row.get("deq_bf16_us", float("nan")) / best
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
