"""Benchmark of the SM90 MXFP8 grouped wgrad (cuda_kernels/gemm/sm90/wgrad_mxfp8.py) on the H200.

Rows: the BF16 shapes of ``bench_grouped_wgrad.py`` (not its fp32-accumulate rows), bf16 out. Columns, all in one process with ``triton.testing.do_bench`` (median):

- ``mx``: ours, MXFP8 operands given (quantized by ``quantize_wgrad_operand``), token layout
  ``auto`` (validated: no repack when every expert but the last holds k*128 tokens),
  ``direct`` (reads each expert at its first token; expert begins must be multiples of 16 tokens,
  else the row reports the error) and ``padded`` (repacks the operands so that every expert starts
  128-token aligned; the repack is timed with it);
- ``bf16``: our BF16 SM90 kernel on the BF16 token rows (A M-major, B N-major, as in
  ``bench_grouped_wgrad.py``) and the ratio ``bf16 / mx`` (target >= 0.6);
- ``deq+bf16``: dequantize both MX operands to BF16 (``blockscaled_ref.dequantize_wgrad_operand``,
  vectorized torch on the GPU) + our BF16 kernel:
  the end-to-end alternative that MXFP8 must beat.

Usage: ``python benchmarks/bench_grouped_wgrad_mxfp8.py [--quick] [--json out.json]``.

Sweep (``--sweep [--direct] [--all-shapes]``): the tiles of ``sm90_mxfp8.sweep_tile_configs``
(the default, the runner-up and the old default of the 2026-12-01 sweep; ``--variants`` names
restrict it; the removed variants' numbers are in ``benchmarks/RESULTS.md``), each in its own
subprocess (a sticky device error kills one variant, never the sweep), on the 128x2048x1536 even
and skewed shapes (``--all-shapes``: every non-accumulate shape). Per (shape, variant, layout) one
line::

    [sweep] <shape> <variant> <layout> us=<kernel us> tflops=<..> vs_bf16=<bf16 us / us>
            sqnr=<dB vs the twin> ok=<sqnr >= 60>

``us`` is the kernel alone (operands already in the layout: padded = repacked once before timing,
or the raw operands when every expert but the last holds a multiple of 128 tokens); the repack
cost is printed once per shape as ``[sweep] <shape> repack us=..``, our BF16 kernel as
``[sweep] <shape> bf16 us=.. tflops=..``. A failed variant prints ``ERROR <message>`` (or its exit
code) and the sweep goes on. ``--direct`` adds the direct layout (shapes whose expert begins are not multiples of 16 tokens
are skipped).
"""

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _dequant(data_RS, sf, rows, offsets):
    """BF16 [rows, S] K-major from an MX operand: the twin module's vectorized decoding (a few
    whole-tensor ops on the GPU, one host read of the offsets), what a user would write."""
    from cuda_kernels.grouped_wgrad.blockscaled_ref import dequantize_wgrad_operand

    return dequantize_wgrad_operand(data_RS, sf, offsets)


_SWEEP_SHAPES = ("128x2048x1536 even", "128x2048x1536 skewed")


def _sweep_shapes(all_shapes):
    import os

    from benchmarks.bench_grouped_wgrad import shapes

    only = os.environ.get("MX_SWEEP_SHAPE")  # substring filter, e.g. "even" (set by --shape)
    return [r for r in shapes(False)
            if not r[6] and (all_shapes or r[0] in _SWEEP_SHAPES) and (not only or only in r[0])]


def _sweep_operands(shape):
    from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand

    name, e, m, n, counts, _out_dtype, _acc = shape
    s = int(sum(counts))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(s, m, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(s, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    off = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a, sfa = quantize_wgrad_operand(x, off)
    bt, sfb = quantize_wgrad_operand(dy, off)
    return x, dy, off, a, sfa, bt.t(), sfb


def _bench_fn():
    import triton

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3

    return bench


def _sweep_child(variant_json, layout, all_shapes):
    """One (variant, layout) on the sweep shapes: kernel-only time and SQNR vs the twin."""
    import math

    from cuda_kernels.gemm.sm90 import wgrad_mxfp8 as mx
    from cuda_kernels.grouped_wgrad.blockscaled_ref import grouped_wgrad_blockscaled_torch

    cfg = mx.Sm90MxTileConfig(**json.loads(variant_json))
    bench = _bench_fn()
    for shape in _sweep_shapes(all_shapes):
        name, e, m, n, counts, _od, _acc = shape
        tag = f"[sweep] {name} {cfg.variant} {layout}"
        begins = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
        if layout == "direct" and any(b % 16 for b in begins):
            print(f"{tag} skipped (expert begins not multiples of 16 tokens)", flush=True)
            continue
        if m % cfg.tile_m or n % cfg.tile_n:
            print(f"{tag} skipped (tile does not divide)", flush=True)
            continue
        try:
            x, dy, off, a, sfa, b, sfb = _sweep_operands(shape)
            s = int(sum(counts))
            a_rs, b_rs = a.view(torch.uint8), b.t().view(torch.uint8)
            identity = all(c % 128 == 0 for c in counts[:-1])
            if layout == "padded" and not identity:
                a_rs = mx.pad_tokens_to_scale_layout(a_rs, off, sfa.shape[1])
                b_rs = mx.pad_tokens_to_scale_layout(b_rs, off, sfb.shape[1])
            key = mx.Sm90MxWgradKey(m, n, e, out_dtype="bfloat16", token_layout=layout, tile=cfg)
            launch = mx.compile_sm90_mxfp8_wgrad(key)
            sfa8, sfb8 = sfa.view(torch.uint8).view(-1, 256), sfb.view(torch.uint8).view(-1, 256)
            out = torch.full((e, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            launch(a_rs, b_rs, sfa8, sfb8, off, out)
            torch.cuda.synchronize()
            ref = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, off, out_dtype=torch.float32)
            ref = ref.to(torch.bfloat16).double()
            err = (out.double() - ref).pow(2).sum().item()
            sig = ref.pow(2).sum().item()
            sq = math.inf if err == 0 else 10 * math.log10(max(sig, 1e-300) / err)
            del ref
            us = bench(lambda f=launch, args=(a_rs, b_rs, sfa8, sfb8, off, out): f(*args))
            tf = 2.0 * m * n * s / us / 1e6
            print(f"{tag} us={us:.1f} tflops={tf:.1f} sqnr={sq:.1f} ok={sq >= 60.0}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a variant reports, never stops the sweep
            print(f"{tag} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            if "CUDA error" in str(exc) or "illegal" in str(exc):
                raise SystemExit(3) from exc


def _sweep(args):
    import dataclasses
    import os
    import re
    import subprocess

    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90_bf16
    from cuda_kernels.gemm.sm90 import wgrad_mxfp8 as mx

    bench = _bench_fn()
    shapes_ = _sweep_shapes(args.all_shapes)
    bf16_us = {}
    for shape in shapes_:
        name, e, m, n, counts, _od, _acc = shape
        x, dy, off, a, sfa, b, sfb = _sweep_operands(shape)
        s = int(sum(counts))
        out = torch.empty((e, m, n), dtype=torch.bfloat16, device="cuda")
        key = sm90_bf16.Sm90WgradKey(m, n, e, a_major="m", b_major="n",
                                     tile=sm90_bf16.select_sm90_tile_config(m, n, e))
        launch = sm90_bf16.compile_sm90_wgrad(key)
        xa = x.t()
        bf16_us[name] = bench(lambda f=launch, xa=xa, dy=dy, off=off, o=out: f(xa, dy, off, o))
        print(f"[sweep] {name} bf16 us={bf16_us[name]:.1f} "
              f"tflops={2.0 * m * n * s / bf16_us[name] / 1e6:.1f}", flush=True)
        a_rs, b_rs = a.view(torch.uint8), b.t().view(torch.uint8)
        rp = bench(lambda a_rs=a_rs, b_rs=b_rs, off=off, ca=sfa.shape[1], cb=sfb.shape[1]: (
            mx.pad_tokens_to_scale_layout(a_rs, off, ca),
            mx.pad_tokens_to_scale_layout(b_rs, off, cb)))
        print(f"[sweep] {name} repack us={rp:.1f} (padded layout without the 128-multiple "
              "shortcut; auto skips it when every expert but the last holds k*128 tokens)",
              flush=True)
    torch.cuda.empty_cache()
    m0, n0 = shapes_[0][2], shapes_[0][3]
    cfgs = mx.sweep_tile_configs(m0, n0)
    if args.variants:
        want = set(args.variants.split(","))
        cfgs = [c for c in cfgs if c.variant in want]
    layouts = ["padded"] + (["direct"] if args.direct else [])
    best = {}
    for cfg in cfgs:
        for layout in layouts:
            env = dict(os.environ)
            cmd = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(cfg)),
                   "--layout", layout] + (["--all-shapes"] if args.all_shapes else [])
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                txt, rc, err = r.stdout, r.returncode, r.stderr
            except subprocess.TimeoutExpired as exc:
                out_b = exc.stdout or b""
                txt = out_b.decode() if isinstance(out_b, bytes) else out_b
                rc, err = "timeout (900 s)", ""
            for line in txt.splitlines():
                mt = re.match(r"\[sweep\] (.+?) (\S+) (padded|direct) us=([\d.]+)", line)
                if mt and mt.group(1) in bf16_us:
                    ratio = bf16_us[mt.group(1)] / float(mt.group(4))
                    line = f"{line} vs_bf16={ratio:.2f}"
                    if "ok=True" in line:
                        k = mt.group(1)
                        if ratio > best.get(k, (0, ""))[0]:
                            best[k] = (ratio, f"{mt.group(2)} {mt.group(3)}")
                if line.startswith("[sweep]"):
                    print(line, flush=True)
            if rc != 0:
                tail = err[-600:].replace("\n", " | ")
                print(f"[sweep] {cfg.variant} {layout} ERROR exit={rc} {tail}", flush=True)
    for k, (ratio, what) in best.items():
        print(f"[sweep] BEST {k}: {what} vs_bf16={ratio:.2f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="tile-variant sweep (see the docstring)")
    p.add_argument("--direct", action="store_true", help="sweep the direct layout too")
    p.add_argument("--all-shapes", action="store_true", help="sweep every non-accumulate shape")
    p.add_argument("--variants", default=None, help="comma-separated variant names to sweep")
    p.add_argument("--shape", default=None, help="sweep only shapes whose name contains this")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="padded", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shape:
        import os

        os.environ["MX_SWEEP_SHAPE"] = args.shape  # inherited by the sweep's subprocesses
    if args.child:
        return _sweep_child(args.child, args.layout, args.all_shapes)
    if args.sweep:
        return _sweep(args)
    import triton

    from benchmarks.bench_grouped_wgrad import shapes
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90_bf16
    from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand
    from cuda_kernels.gemm.sm90.wgrad_mxfp8 import grouped_wgrad_mxfp8_sm90

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
        for layout in ("auto", "direct", "padded"):
            try:
                grouped_wgrad_mxfp8_sm90(a, sfa, b, sfb, off, out, token_layout=layout)
                # auto decides from the offsets read on the host (validate=True: one sync)
                t = bench(lambda layout=layout: grouped_wgrad_mxfp8_sm90(
                    a, sfa, b, sfb, off, out, token_layout=layout,
                    validate=layout == "auto"))
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
        best = min(row.get(f"mx_{lay}_us", float("inf")) for lay in ("auto", "direct", "padded"))
        row["mx_vs_bf16"] = row["bf16_us"] / best
        row["mx_vs_deq_bf16"] = row.get("deq_bf16_us", float("nan")) / best
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
