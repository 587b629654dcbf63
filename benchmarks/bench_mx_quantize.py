"""Benchmark of the grouped-wgrad MX operand quantizer against torchao's MXFP8 quantization.

Operand: token-major BF16 rows ``[S, H]`` (X or dY of the grouped layout) and the per-expert offsets
→ FP8 E4M3 data K-major along tokens + E8M0 scales in the K-grouped 128×4 atom layout (what the
block-scaled wgrad reads). Rows (MoE shapes: tokens 8192-65536, H 2048-7168, E 8-128), measured in
one process with ``triton.testing.do_bench`` (median):

- ours: ``cuda_kernels.grouped_wgrad.quantize.quantize_wgrad_operand`` (one kernel), rounding
  "native" (hardware FP8 conversion) and "integer" (integer-op RNE);
- torchao (optional import; the same operand as torchao's own MXFP8 MoE wgrad builds it):
  ``triton_to_mxfp8_dim1`` (Triton dim-1 cast: data K-major + plain scales) followed by
  ``triton_mx_block_rearrange_2d_K_groups`` (scales into the per-group blocked layout), timed alone
  and together. torchao's Triton cast needs every count a multiple of 128 (its masking rule), so
  the torchao rows use even splits; ours also runs an uneven split with empty experts.

GB/s counts bytes moved by the full operation: ``2·S·H`` read + ``S·H`` data written + the scale
bytes written (``S·H/32`` for torchao's plain scales; the blocked tensor for ours). Ratio = ours /
torchao (µs of torchao / µs of ours) for the same scale rule.

Usage: ``python benchmarks/bench_mx_quantize.py [--quick] [--rule ocp|rceil] [--json out.json]``.
torchao is not on the H200 image: without it only our rows are printed (install its wheel to
compare: ``pip install torchao==0.18.0 --no-deps``). torchao gates its Triton MX kernels to SM100;
on SM90 the bench lifts that gate before importing them (``--rule ocp``: the floor-rule cast is
portable Triton; the rceil cast uses an SM100-only PTX conversion).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings

import torch

# (name, tokens S, hidden H, experts E): DeepSeek-V3 (H 7168, E 256 → 128 per rank shown),
# Qwen3-30B-A3B (H 2048, E 128), Mixtral-8x7B (H 4096, E 8), gpt-oss-120b (H 2880, E 128),
# Llama-4-Scout-like (H 5120, E 16).
SHAPES = [
    ("mixtral-8x7b", 16384, 4096, 8),
    ("qwen3-30b-a3b", 32768, 2048, 128),
    ("gpt-oss-120b", 32768, 2880, 128),
    ("llama4-scout", 65536, 5120, 16),
    ("deepseek-v3", 65536, 7168, 128),
    ("deepseek-v3-small", 8192, 7168, 64),
]
QUICK = ["mixtral-8x7b", "qwen3-30b-a3b"]


def _even(total, e):
    base = (total // e) // 128 * 128
    counts = [base] * e
    counts[-1] += total - base * e
    return counts


def _uneven(total, e, gen):
    w = torch.rand(e, generator=gen, dtype=torch.float64) ** 3
    w[torch.randperm(e, generator=gen)[: max(e // 8, 1)]] = 0
    c = torch.floor(w / w.sum() * total).to(torch.int64)
    c[int(torch.argmax(w))] += total - int(c.sum())
    return c.tolist()


def _torchao():
    """torchao's dim-1 cast + K-group scale rearrange, or None where torchao is not importable.

    torchao defines its Triton MX kernels only where ``is_sm_at_least_100()`` holds; on SM90 this
    turns that gate on before the import (the floor-rule cast is portable Triton; the rceil one
    emits an SM100-only ``cvt ... ue8m0x2`` and is reported as not running)."""
    try:
        import torchao.utils as ao_utils

        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
            ao_utils.is_sm_at_least_100 = lambda: True
            print("# torchao's Triton MX kernels force-enabled on SM90 (torchao gates them to SM100)")
    except Exception:  # noqa: BLE001 - torchao missing: reported below
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.moe_training.kernels.mxfp8.quant import (
                triton_mx_block_rearrange_2d_K_groups,
            )
            from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim1
        return triton_to_mxfp8_dim1, triton_mx_block_rearrange_2d_K_groups
    except Exception as exc:  # ImportError, or a torchao without these kernels
        print(f"# torchao unavailable ({type(exc).__name__}: {exc}); printing ours alone")
        return None


#: --sweep candidates: rows per program x warps x atom table (1) or in-kernel lookup (0); keys of
#: quantize.LAUNCH (256 rows on 4 warps is left out: it spills registers on sm_90). A third
#: variant, 16-byte vector stores for aligned columns, was 8-15 % slower in every setting on the
#: H200 (2026-12-01) and was removed from the kernel.
SWEEP = [dict(block_h=bh, num_warps=nw, table=tb)
         for bh, nw in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8))
         for tb in (1, 0)]


def _cfg_name(c):
    return f"{c['block_h']}r/{c['num_warps']}w/t{c['table']}"


def _sweep(args, bench, quantize, dev, peer) -> int:
    """Ours under each launch configuration of ``quantize.LAUNCH`` (``SWEEP``) on every (quick)
    shape, even split, native rounding; each configuration's bytes must equal the default's (on
    the even split and on an uneven split with empty experts and unaligned expert starts). One
    row per configuration, sorted by total µs; then the best, and per-shape ratios to torchao
    when it runs."""
    from cuda_kernels.grouped_wgrad import quantize as qmod

    mode = {"ocp": "floor", "rceil": "rceil"}[args.rule]
    default = dict(qmod.LAUNCH)
    gen = torch.Generator().manual_seed(1)
    shapes = [sh for sh in SHAPES if not args.quick or sh[0] in QUICK]
    times = {_cfg_name(c): {} for c in SWEEP}
    bad = set()
    ao = {}
    for name, s, h, e in shapes:
        x = torch.randn(s, h, device=dev).to(torch.bfloat16)
        kw = dict(elem="e4m3", scale_rule=args.rule, validate=False, rounding="native")
        offs = torch.tensor(_even(s, e), dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        offs_u = torch.tensor(_uneven(s, e, gen), dtype=torch.int64).cumsum(0).to(torch.int32)
        offs_u = offs_u.to(dev)
        qmod.LAUNCH.update(default)
        refs = [quantize(x, o, **kw) for o in (offs, offs_u)]
        for c in SWEEP:
            qmod.LAUNCH.update(c)
            for o, (rd, rs) in zip((offs, offs_u), refs):
                d, sc = quantize(x, o, **kw)
                if not (torch.equal(d.view(torch.uint8), rd.view(torch.uint8))
                        and torch.equal(sc.view(torch.uint8), rs.view(torch.uint8))):
                    bad.add(_cfg_name(c))
                    print(f"# {name}: {_cfg_name(c)} wrote other bytes than the default")
                del d, sc
            times[_cfg_name(c)][name] = bench(lambda: quantize(x, offs, **kw))
        qmod.LAUNCH.update(default)
        if peer is not None and s % 128 == 0 and h % 128 == 0:
            cast, swz = peer
            try:
                ao[name] = bench(lambda: swz(cast(x, 32, scaling_mode=mode)[1], offs // 32))
            except Exception as exc:  # noqa: BLE001 - e.g. torchao gates the kernel to SM100
                print(f"# torchao did not run ({type(exc).__name__}: {exc})")
                peer = None
    names = [sh[0] for sh in shapes]
    print(f"{'config (rows/warps/table)':<26}" + "".join(f"{n[:14]:>15}" for n in names)
          + f"{'total µs':>10}")
    if ao:
        print(f"{'torchao cast+swizzle':<26}" + "".join(f"{ao.get(n, float('nan')):>15.1f}"
                                                      for n in names)
              + f"{sum(ao.values()):>10.0f}")
    order = sorted(times, key=lambda k: sum(times[k].values()))
    for k in order:
        mark = "!" if k in bad else ""
        print(f"{k + mark:<26}" + "".join(f"{times[k][n]:>15.1f}" for n in names)
              + f"{sum(times[k].values()):>10.0f}")
    dname = _cfg_name({**qmod._LAUNCH_DEFAULTS, **default})
    good = [k for k in order if k not in bad]
    best = good[0] if good else order[0]
    dtot = f"{sum(times[dname].values()):.0f} µs" if dname in times else "not swept"
    print(f"# best (lowest total, same bytes): {best} ({sum(times[best].values()):.0f} µs) vs "
          f"default {dname} ({dtot})")
    if ao:
        print("# ratio torchao µs / ours µs, best config: " + ", ".join(
            f"{n} {ao[n] / times[best][n]:.2f}" for n in names if n in ao))
        # the fastest same-bytes config per shape
        print("# best per shape: " + ", ".join(
            f"{n} {min(good, key=lambda k: times[k][n])}" for n in names))
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes only")
    p.add_argument("--rule", default="rceil", choices=("ocp", "rceil"),
                   help="scale rule for both sides (torchao: ocp = 'floor')")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--sweep", action="store_true",
                   help="time every launch configuration of ours (SWEEP: rows per program x "
                        "warps x atom table), check each writes the default's "
                        "bytes, print them sorted with torchao's time, and the best")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mx_quantize: needs a CUDA device")
        return 1
    import triton

    from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand

    peer = _torchao()
    mode = {"ocp": "floor", "rceil": "rceil"}[args.rule]
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"# {torch.cuda.get_device_name()} {datetime.date.today()} rule={args.rule}")
    hdr = (f"{'shape':<20}{'split':<8}{'S':>7}{'H':>6}{'E':>5} | {'ours native µs':>14}"
           f"{'GB/s':>7} | {'ours int µs':>11}{'GB/s':>7} | {'ao cast µs':>10}"
           f"{'ao +swz µs':>11}{'GB/s':>7} | {'ratio':>6}")

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    if args.sweep:
        return _sweep(args, bench, quantize_wgrad_operand, dev, peer)
    print(hdr)

    for name, s, h, e in SHAPES:
        if args.quick and name not in QUICK:
            continue
        x = torch.randn(s, h, device=dev).to(torch.bfloat16)
        for split in ("even", "uneven"):
            counts = _even(s, e) if split == "even" else _uneven(s, e, gen)
            offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
            kw = dict(elem="e4m3", scale_rule=args.rule, validate=False)
            d, sc = quantize_wgrad_operand(x, offs, rounding="native", **kw)
            ours_bytes = 2 * s * h + s * h + sc.numel()
            t_nat = bench(lambda: quantize_wgrad_operand(x, offs, rounding="native", **kw))
            t_int = bench(lambda: quantize_wgrad_operand(x, offs, rounding="integer", **kw))
            row = dict(shape=name, split=split, S=s, H=h, E=e, ours_native_us=t_nat,
                       ours_native_gbs=ours_bytes / t_nat / 1e3, ours_integer_us=t_int,
                       ours_integer_gbs=ours_bytes / t_int / 1e3)
            ao = ""
            if peer is not None and split == "even" and s % 128 == 0 and h % 128 == 0:
                cast, swz = peer
                offs_sc = offs // 32
                try:
                    t_cast = bench(lambda: cast(x, 32, scaling_mode=mode))
                    t_all = bench(lambda: swz(cast(x, 32, scaling_mode=mode)[1], offs_sc))
                except Exception as exc:  # noqa: BLE001 - e.g. torchao gates the kernel to SM100
                    print(f"# torchao's kernel did not run here ({type(exc).__name__}: {exc}); "
                          "printing ours alone")
                    peer = None
            if peer is not None and split == "even" and s % 128 == 0 and h % 128 == 0:
                ao_bytes = 3 * s * h + s * h // 32
                row.update(torchao_cast_us=t_cast, torchao_total_us=t_all,
                           torchao_gbs=ao_bytes / t_all / 1e3, ratio=t_all / t_nat)
                ao = (f"{t_cast:>10.1f}{t_all:>11.1f}{row['torchao_gbs']:>7.0f} | "
                      f"{row['ratio']:>6.2f}")
            else:
                ao = f"{'-':>10}{'-':>11}{'-':>7} | {'-':>6}"
            rows.append(row)
            print(f"{name:<20}{split:<8}{s:>7}{h:>6}{e:>5} | {t_nat:>14.1f}"
                  f"{row['ours_native_gbs']:>7.0f} | {t_int:>11.1f}{row['ours_integer_gbs']:>7.0f}"
                  f" | {ao}")
            del d, sc
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "rule": args.rule, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
