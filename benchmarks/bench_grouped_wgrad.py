"""Benchmark of the grouped weight gradient ``Wgrad[e] = A[:, begin:end] @ B[begin:end, :]``.

Rows (REFERENCE §6 shapes, a skewed split with empty experts, FP32-accumulate cases), all measured
in one process with ``triton.testing.do_bench`` (median, ms -> µs):

- ours: the SM90 CuTe DSL kernel (cuda_kernels/gemm/sm90/wgrad_bf16.py) through its launcher;
- torch._grouped_mm with the same offsets (K-grouped 2-D x 2-D form);
- the per-expert loop of torch.mm into the output slices (host offsets precomputed);
- a dense torch.mm of the same FLOPs, ``(M, S) @ (S, N)``.

TFLOP/s counts ``2 * M * N * tokens_sum``. For FP32-accumulate rows the floor is
``max(FLOPs / dense rate, bytes / copy bandwidth)`` with bytes = A + B read + out read and written,
and the copy bandwidth measured here by a device-to-device copy (bytes read + written).

Layouts: A M-major and B N-major (A = X_sorted^T, B = dY_sorted, both row-major token rows: what a
MoE backward holds), out bf16 unless the row says fp32.

Usage: ``python benchmarks/bench_grouped_wgrad.py [--quick] [--json out.json]``.

``--gather``: the gathered operands of a MoE backward (issue 33 item 5) through
``grouped_wgrad_into``: per shape (a routed top-k split of T tokens, each expert padded to
``--gather-align`` rows with -1 rows), the dense kernel on gathered copies, the gather pass that
builds those copies (``index_select`` + zero select), and the kernel reading the rows through the
index (``a_rows_S`` / ``b_rows_S``), checked bit-exact against the dense kernel first. Rows:
gate/up wgrad (A = X^T gathered), down wgrad (B = dY gathered), both gathered.

``--variants``: the speed variants of the SM90 kernel (``Sm90TileConfig`` fields: the L2-prefetch
reduce-add epilogue for accumulating rows, epilogue sub-tile width, the swizzled tile order; and
the tile shapes 128x192 pingpong, 128x256, 128x128 pingpong) on
the quick shapes (one of them FP32-accumulate) and a small odd-M-tile correctness row, in one
process: each variant is checked against an fp32 reference over ALL experts (accumulating rows from
a random old output) before and after timing, then timed; torch._grouped_mm and quack (autotuned)
once per shape; a failing variant prints its error and the sweep goes on; each variant's name is printed before it runs (a hang names itself).
``--variant-filter a,b,-c`` keeps the variants whose name contains a or b and not c (the default
tile always runs).
"""

import argparse
import dataclasses
import datetime
import functools
import json
import sys

import torch


def _counts_even(e, per):
    return [per] * e


def _counts_skewed(e, total, gen):
    # Zipf-like weights with a quarter of the experts empty, summing to total
    w = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.1
    w = w[torch.randperm(e, generator=gen)]
    w[torch.randperm(e, generator=gen)[: e // 4]] = 0
    c = torch.floor(w / w.sum() * total).to(torch.int64)
    c[int(torch.argmax(w))] += total - int(c.sum())
    return c.tolist()


def _counts_uneven_one_empty(e, total, gen):
    w = torch.rand(e, generator=gen, dtype=torch.float64) + 0.2
    w[3] = 0
    c = torch.floor(w / w.sum() * total).to(torch.int64)
    c[0] += total - int(c.sum())
    return c.tolist()


def shapes(quick=False):
    gen = torch.Generator().manual_seed(0)
    rows = [
        ("8x4096x28672 even", 8, 4096, 28672, _counts_even(8, 4096), "bfloat16", False),
        ("32x7168x4096 even", 32, 7168, 4096, _counts_even(32, 2048), "bfloat16", False),
        ("32x2048x7168 even", 32, 2048, 7168, _counts_even(32, 2048), "bfloat16", False),
        ("128x2048x1536 even", 128, 2048, 1536, _counts_even(128, 512), "bfloat16", False),
        ("128x768x2048 even", 128, 768, 2048, _counts_even(128, 512), "bfloat16", False),
        (
            "128x2048x1536 skewed",
            128, 2048, 1536, _counts_skewed(128, 49408, gen), "bfloat16", False,
        ),
        (
            "16x4096x2048 uneven",
            16, 4096, 2048, _counts_uneven_one_empty(16, 24829, gen), "bfloat16", False,
        ),
        ("128x2048x1536 fp32-acc", 128, 2048, 1536, _counts_even(128, 512), "float32", True),
        ("32x7168x4096 fp32-acc", 32, 7168, 4096, _counts_even(32, 2048), "float32", True),
    ]
    return rows[3:4] + rows[7:8] if quick else rows


def _ceilings(bench, dev):
    """Device-to-device copy bandwidth (bytes/s, read + write) and 8192^3 bf16 mm rate (FLOP/s)."""
    src = torch.randn(1024**3 // 2, device=dev).to(torch.bfloat16)  # 1 GiB of random bf16
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 2 / (t_copy * 1e-6)
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t_mm = bench(lambda: torch.mm(x, y))
    return copy_bw, 2 * 8192**3 / (t_mm * 1e-6)


def parse_tile(sm90, spec):
    """``"M,N,K,stages,pingpong[,field=value...]"`` -> ``Sm90TileConfig`` (extra fields: the speed
    variants, e.g. ``acc_epilogue=l2prefetch``, ``epi_n=64``, ``swizzle=8``)."""
    parts = spec.split(",")
    tm, tn, tk, st, pp = (int(v) for v in parts[:5])
    extra = {}
    for kv in parts[5:]:
        k, v = kv.split("=")
        extra[k] = v if k == "acc_epilogue" else int(v)
    return sm90.Sm90TileConfig(tm, tn, tk, st, bool(pp), **extra)


def _run_row(args, bench, sm90, dev, copy_bw, shape):
    """Time one benchmark shape: ours (each tile variant), grouped_mm, loop, dense mm."""
    name, e, m, n, counts, out_dtype, accumulate = shape
    s = int(sum(counts))
    gen = torch.Generator(device=dev).manual_seed(1)
    x_SM = torch.randn(s, m, device=dev, dtype=torch.bfloat16, generator=gen)
    dy_SN = torch.randn(s, n, device=dev, dtype=torch.bfloat16, generator=gen)
    a = x_SM.t()  # (M, S), M-major
    b = dy_SN  # (S, N), N-major
    offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    odt = getattr(torch, out_dtype)
    out = torch.zeros(e, m, n, device=dev, dtype=odt)
    flops = 2.0 * m * n * s
    row = {"shape": name, "E": e, "M": m, "N": n, "tokens_sum": s, "out": out_dtype,
           "accumulate": accumulate}
    if args.tiles:
        tiles = []
        for spec in args.tiles.split(";"):
            tiles.append(parse_tile(sm90, spec))
    else:
        tiles = [sm90.select_sm90_tile_config(m, n, e, s, accumulate=accumulate)]
    begins = [0] + offsets.tolist()[:-1]
    t_ours = float("inf")
    for tile in tiles:  # dense outputs: a tile that does not divide M / N ends in partial tiles
        key = sm90.Sm90WgradKey(
            m, n, e, a_major="m", b_major="n", out_dtype=out_dtype, accumulate=accumulate,
            tile=tile,
        )
        name_t = tile.variant_name
        launcher = sm90.compile_sm90_wgrad(key)
        # correctness spot check against torch on the largest and the smallest expert
        launcher(a, b, offsets, out.zero_())
        torch.cuda.synchronize()
        ours_once = out.float()  # one product from zero: what the quack columns are checked against
        chk = []
        for i in (max(range(e), key=lambda j: counts[j]), min(range(e), key=lambda j: counts[j])):
            r = a[:, begins[i] : begins[i] + counts[i]].float() @ b[
                begins[i] : begins[i] + counts[i]
            ].float()
            d = (out[i].float() - r).norm() / r.norm().clamp_min(1e-30)
            chk.append(float(d) if counts[i] else float(out[i].abs().max()))
        t = bench(functools.partial(launcher, a, b, offsets, out))
        row.setdefault("variants", {})[name_t] = {"us": t, "check_rel_err": max(chk)}
        if t < t_ours:
            t_ours, row["tile"], row["check_rel_err"] = t, name_t, max(chk)
    row["ours_us"] = t_ours
    row["ours_TFLOPs"] = flops / (t_ours * 1e-6) / 1e12

    if not args.no_quack:
        _quack_columns(row, bench, a, b, offsets, ours_once, accumulate, flops, t_ours)

    # torch._grouped_mm (K-grouped); output fp32 accumulate is not offered -> out-of-place
    gm = None
    for aa, bb, tag in ((a, b, "M-major/N-major"), (a.contiguous(), b, "K-major A")):
        try:
            torch._grouped_mm(aa, bb, offs=offsets)
            torch.cuda.synchronize()
            gm = (aa, bb, tag)
            break
        except Exception as exc:  # noqa: BLE001 - record and try the next layout
            row.setdefault("grouped_mm_errors", []).append(f"{tag}: {exc}"[:160])
    if gm is not None:
        aa, bb, tag = gm
        if accumulate:
            t_g = bench(lambda: out.add_(torch._grouped_mm(aa, bb, offs=offsets)))
        else:
            t_g = bench(lambda: torch._grouped_mm(aa, bb, offs=offsets))
        row["grouped_mm_layout"] = tag
        row["grouped_mm_us"] = t_g
        row["grouped_mm_TFLOPs"] = flops / (t_g * 1e-6) / 1e12
        row["ours_over_grouped_mm"] = t_g / t_ours

    # per-expert loop
    bl = list(zip(begins, counts))
    out_bf = torch.empty(e, m, n, device=dev, dtype=torch.bfloat16 if not accumulate else odt)

    def loop():
        for i, (b0, c) in enumerate(bl):
            if c:
                if accumulate:
                    out_bf[i].addmm_(a[:, b0 : b0 + c], b[b0 : b0 + c])
                else:
                    torch.mm(a[:, b0 : b0 + c], b[b0 : b0 + c], out=out_bf[i])
            elif not accumulate:
                out_bf[i].zero_()

    if accumulate:
        # addmm_ needs matching dtypes: fp32 operands for an fp32 output
        a32, b32 = a.float(), b.float()

        def loop():
            for i, (b0, c) in enumerate(bl):
                if c:
                    out_bf[i].addmm_(a32[:, b0 : b0 + c], b32[b0 : b0 + c])

    t_l = bench(loop)
    row["loop_us"] = t_l
    row["loop_TFLOPs"] = flops / (t_l * 1e-6) / 1e12
    row["ours_over_loop"] = t_l / t_ours

    # dense torch.mm of the same FLOPs
    t_d = bench(lambda: torch.mm(a, b))
    row["dense_us"] = t_d
    row["dense_TFLOPs"] = flops / (t_d * 1e-6) / 1e12
    row["ours_over_dense"] = t_d / t_ours
    if accumulate:
        nbytes = 2 * (m + n) * s + 2 * e * m * n * odt.itemsize
        floor_us = max(flops / (row["dense_TFLOPs"] * 1e12), nbytes / copy_bw) * 1e6
        row["floor_us"] = floor_us
        row["ours_over_floor"] = floor_us / t_ours
    return row

def _quack_columns(row, bench, a, b, offsets, ours_once, accumulate, flops, t_ours):
    """quack 0.6.5's varlen-K GEMM (``quack.gemm_interface``, the strongest Hopper peer) on the
    same operands: autotuned (``tuned=True``) and its default config (``tuned=False``); bf16 rows
    through ``gemm(..., out=)``, fp32-accumulate rows through ``gemm_add_inplace``. Its first
    result (from a zero output) is checked against ours (relative Frobenius difference)."""
    try:
        from quack import gemm_interface as qg
    except Exception as exc:  # noqa: BLE001 - optional peer (the `bench` extra)
        row["quack_error"] = f"import: {exc}"[:160]
        return
    cu = torch.cat([offsets.new_zeros(1), offsets])
    norm = ours_once.norm().clamp_min(1e-30)
    for tuned, tag in ((True, "quack_tuned"), (False, "quack_default")):
        q_out = torch.zeros(ours_once.shape, device=a.device,
                            dtype=torch.float32 if accumulate else torch.bfloat16)
        if accumulate:
            def fn(q_out=q_out, tuned=tuned):
                qg.gemm_add_inplace(a, b, q_out, cu_seqlens_k=cu, tuned=tuned)
        else:
            def fn(q_out=q_out, tuned=tuned):
                qg.gemm(a, b, out=q_out, cu_seqlens_k=cu, tuned=tuned)
        try:
            fn()
            torch.cuda.synchronize()
            diff = float((q_out.float() - ours_once).norm() / norm)
            t = bench(fn)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other columns
            row[f"{tag}_error"] = f"{exc}"[:200]
            continue
        row[f"{tag}_us"] = t
        row[f"{tag}_TFLOPs"] = flops / (t * 1e-6) / 1e12
        row[f"ours_over_{tag}"] = t / t_ours
        row[f"{tag}_vs_ours_rel_diff"] = diff
        if tuned:  # the autotuner's pick for this shape (tile, pingpong, cluster, swap_ab)
            best = getattr(qg.gemm_tuned, "best_config", None)
            row["quack_tuned_config"] = str(best) if best is not None else None


def _variants(configs):
    """The configs in order without repeats; ``(cfg, fields)`` pairs are ``replace``d, and those
    whose fields do not fit the tile (``ValueError``) are dropped."""
    seen, keep = set(), []
    for item in configs:
        cfg, fields = item if isinstance(item, tuple) else (item, {})
        try:
            cfg = dataclasses.replace(cfg, **fields)
        except ValueError:
            continue
        if cfg not in seen:
            seen.add(cfg)
            keep.append(cfg)
    return keep


def variant_tiles(m, n, e, accumulate):
    """The SM90 tile variants swept by ``--variants`` for one shape, the YAML default first: the
    tile shapes (128x192 pingpong, 128x256, 128x128 pingpong) plain and with the swizzled tile
    order, the epilogue sub-tile width, then (accumulating rows) the L2-prefetch reduce-add.
    Variants that do not fit the tile are dropped."""
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

    T = sm90.Sm90TileConfig
    base = sm90.select_sm90_tile_config(m, n, e, accumulate=accumulate)
    tiles = [T(128, 192, 64, 5, True), T(128, 256, 64, 4, False), T(128, 128, 64, 6, True)]
    out = [base, (base, {"swizzle": 0}), (base, {"swizzle": 4}), (base, {"swizzle": 8})]
    for cfg in tiles:
        out += [cfg, (cfg, {"swizzle": 8})]
    for cfg in (base, T(128, 128, 64, 6, True), T(128, 192, 64, 5, True)):
        out.append((cfg, {"epi_n": 64}))
    if accumulate:
        for cfg in (base, T(128, 128, 64, 6, True), T(128, 192, 64, 5, True),
                    T(128, 256, 64, 4, False)):
            for fields in ({"acc_epilogue": "reduce"}, {"acc_epilogue": "l2prefetch"},
                           {"acc_epilogue": "l2prefetch", "epi_n": 64}):
                out.append((cfg, fields))
    return _variants(out)


def _variant_shapes():
    """Quick shapes (one bf16, one FP32-accumulate) and a small correctness row: 64-row tiles
    over hidden 192 (3 M tiles; a partial one for 128-row tiles), skewed experts with empty ones,
    FP32 accumulate."""
    rows = list(shapes(quick=True))
    rows.append(
        ("6x192x256 odd-M fp32-acc", 6, 192, 256, [300, 0, 77, 1000, 5, 0], "float32", True)
    )
    return rows


def _small_tiles(m, n, e):
    """Variants of the small odd-M row: 64x128 tiles (3 M tiles), every switch, and the other
    tile shapes (partial M tiles for 128 rows)."""
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

    T = sm90.Sm90TileConfig
    t = T(64, 128, 64, 8, False)
    return _variants([
        t,
        (t, {"epi_n": 64}),
        (t, {"acc_epilogue": "l2prefetch"}),
        (t, {"swizzle": 2}),
        T(64, 128, 64, 8, True),
        T(128, 128, 64, 6, True),
        T(128, 128, 64, 6, True, acc_epilogue="l2prefetch", epi_n=64),
        T(128, 192, 64, 5, True, swizzle=8),
    ])


def run_variants(args, bench, dev, copy_bw):
    """``--variants``: see the module docstring. Returns the rows (one per shape and variant)."""
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

    filters = [f for f in (args.variant_filter or "").split(",") if f]
    rows = []
    for name, e, m, n, counts, out_dtype, accumulate in _variant_shapes():
        s = int(sum(counts))
        gen = torch.Generator(device=dev).manual_seed(1)
        x_SM = torch.randn(s, m, device=dev, dtype=torch.bfloat16, generator=gen)
        dy_SN = torch.randn(s, n, device=dev, dtype=torch.bfloat16, generator=gen)
        a, b = x_SM.t(), dy_SN
        offsets = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        odt = getattr(torch, out_dtype)
        flops = 2.0 * m * n * s
        begins = [0] + offsets.tolist()[:-1]
        ref = torch.zeros(e, m, n, device=dev, dtype=torch.float32)
        for i, (b0, c) in enumerate(zip(begins, counts)):
            if c:
                ref[i] = a[:, b0 : b0 + c].float() @ b[b0 : b0 + c].float()
        old = (
            torch.randn(e, m, n, device=dev, generator=gen).to(odt)
            if accumulate
            else torch.zeros(e, m, n, device=dev, dtype=odt)
        )
        want = ref + old.float() if accumulate else ref
        want_norm = ref.norm().clamp_min(1e-30)
        out = torch.empty(e, m, n, device=dev, dtype=odt)

        def check(launcher, out=out, old=old, want=want, want_norm=want_norm, a=a, b=b,
                  offsets=offsets):
            out.copy_(old) if accumulate else out.fill_(float("nan"))
            launcher(a, b, offsets, out)
            torch.cuda.synchronize()
            return float((out.float() - want).norm() / want_norm)

        shape_row = {"shape": name, "E": e, "M": m, "N": n, "tokens_sum": s, "out": out_dtype,
                     "accumulate": accumulate}
        # peers, once per shape
        if name.startswith("6x"):
            tiles = _small_tiles(m, n, e)
        else:
            tiles = variant_tiles(m, n, e, accumulate)
            try:
                if accumulate:
                    t_g = bench(lambda: out.add_(torch._grouped_mm(a, b, offs=offsets)))
                else:
                    t_g = bench(lambda: torch._grouped_mm(a, b, offs=offsets))
                shape_row["grouped_mm_us"] = t_g
            except Exception as exc:  # noqa: BLE001
                shape_row["grouped_mm_error"] = f"{exc}"[:160]
            if not args.no_quack:
                _quack_columns(shape_row, bench, a, b, offsets, ref, accumulate, flops, 1.0)
            if accumulate:  # the floor of the main table: dense torch.mm of the same FLOPs
                nbytes = 2 * (m + n) * s + 2 * e * m * n * odt.itemsize
                t_d = bench(lambda: torch.mm(a, b))
                shape_row["floor_us"] = max(t_d, nbytes / copy_bw * 1e6)
        print(json.dumps({"variants_shape": shape_row}), flush=True)
        t_default = None
        for tile in tiles:
            vname = tile.variant_name
            keep = [f for f in filters if not f.startswith("-")]
            drop = [f[1:] for f in filters if f.startswith("-")]
            if tile != tiles[0] and (
                (keep and not any(f in vname for f in keep)) or any(f in vname for f in drop)
            ):
                continue
            row = dict(shape=name, variant=vname, tile=dataclasses.asdict(tile))
            print(f"# {name}: {vname} ...", flush=True)
            try:
                key = sm90.Sm90WgradKey(
                    m, n, e, a_major="m", b_major="n", out_dtype=out_dtype,
                    accumulate=accumulate, tile=tile,
                )
                kernel = sm90.kernel_class()(key)  # effective pipeline / store stages
                row["stages_eff"], row["epi_stages_eff"] = kernel.stages, kernel.epi_stages
                launcher = sm90.compile_sm90_wgrad(key)
                row["err_before"] = check(launcher)
                t = bench(functools.partial(launcher, a, b, offsets, out))
                row["err_after"] = check(launcher)
                row["us"] = t
                row["TFLOPs"] = flops / (t * 1e-6) / 1e12
                if t_default is None:
                    t_default = t
                row["over_default"] = t_default / t
                if "grouped_mm_us" in shape_row:
                    row["over_grouped_mm"] = shape_row["grouped_mm_us"] / t
                if "quack_tuned_us" in shape_row:
                    row["over_quack_tuned"] = shape_row["quack_tuned_us"] / t
                if "floor_us" in shape_row:
                    row["over_floor"] = shape_row["floor_us"] / t
                tol = 2e-2 if out_dtype != "float32" else 1e-3
                row["ok"] = max(row["err_before"], row["err_after"]) < tol
            except Exception as exc:  # noqa: BLE001 - print and go on with the next variant
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["ok"] = False
            rows.append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    print()
    print(f"{'shape':26s} {'variant':36s} {'st/es':>5s} {'TFLOP/s':>7s} {'us':>8s} {'/dflt':>6s} "
          f"{'/gmm':>5s} {'/qk':>5s} {'/floor':>6s} {'err':>8s} ok")
    nan = float("nan")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:26s} {r['variant']:36s} FAILED {r['error'][:120]}")
            continue
        print(
            f"{r['shape']:26s} {r['variant']:36s} "
            f"{str(r['stages_eff']) + '/' + str(r['epi_stages_eff']):>5s} "
            f"{r['TFLOPs']:7.0f} {r['us']:8.1f} "
            f"{r['over_default']:6.3f} {r.get('over_grouped_mm', nan):5.2f} "
            f"{r.get('over_quack_tuned', nan):5.2f} {r.get('over_floor', nan):6.2f} "
            f"{max(r['err_before'], r['err_after']):8.1e} {'ok' if r['ok'] else 'WRONG'}"
        )
    return rows


#: --gather shapes: (name, E, top_k, H, I, T tokens)
_GATHER_SHAPES = [
    ("qwen3-30b-a3b 16k", 128, 8, 2048, 768, 16384),
    ("qwen3-235b-a22b 16k", 128, 8, 4096, 1536, 16384),
    ("mixtral-8x7b 8k", 8, 2, 4096, 14336, 8192),
]


def _routed_rows(e, top_k, tokens, align, gen, dev):
    """A routed split: each token to ``top_k`` distinct random experts, rows grouped by expert,
    each expert's rows padded to a multiple of ``align`` with -1 rows. Returns (rows_S int64,
    offsets_E int32, counts)."""
    choice = torch.rand(tokens, e, generator=gen).argsort(dim=1)[:, :top_k]
    token = torch.arange(tokens).repeat_interleave(top_k)
    expert = choice.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token, expert = token[order], expert[order]
    counts = torch.bincount(expert, minlength=e)
    padded = (counts + align - 1) // align * align
    rows = torch.full((int(padded.sum()),), -1, dtype=torch.int64)
    starts = torch.cumsum(padded, 0) - padded
    first_slot = torch.cumsum(counts, 0) - counts  # each expert's first slot in sorted order
    pos = starts[expert] + (torch.arange(expert.numel()) - first_slot[expert])
    rows[pos] = token
    offsets = torch.cumsum(padded, 0).to(torch.int32)
    return rows.to(dev), offsets.to(dev), padded.tolist()


def run_gather(args, bench, dev):
    """``--gather``: dense kernel on gathered copies vs the gather kernel (module docstring)."""
    from cuda_kernels.grouped_wgrad.api import grouped_wgrad_into
    from cuda_kernels.grouped_wgrad.torch_ref import gather_operands

    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for name, e, top_k, h, i, t in _GATHER_SHAPES:
        if args.gather_only and not any(w in name for w in args.gather_only.split(",")):
            continue
        rows, offsets, counts = _routed_rows(e, top_k, t, args.gather_align, gen, dev)
        s = rows.numel()
        x_TH = torch.randn(t, h, device=dev).to(torch.bfloat16)
        dy_TH = torch.randn(t, h, device=dev).to(torch.bfloat16)
        dgu_S2I = torch.randn(s, 2 * i, device=dev).to(torch.bfloat16)
        ah_SI = torch.randn(s, i, device=dev).to(torch.bfloat16)
        x_src = torch.randn(t, 2 * i, device=dev).to(torch.bfloat16)  # "both": a [2I, T] source
        cases = [
            # (case, a source, b source, a_rows?, b_rows?, M, N)
            ("gate_up (A=X gathered)", x_TH.t(), dgu_S2I, True, False, h, 2 * i),
            ("down (B=dY gathered)", ah_SI.t(), dy_TH, False, True, i, h),
            ("both gathered", x_src.t(), dy_TH, True, True, 2 * i, h),
        ]
        for case, a_src, b_src, ga, gb, m, n in cases:
            a_rows = rows if ga else None
            b_rows = rows if gb else None
            flops = 2.0 * m * n * s
            out_d = torch.full((e, m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            out_g = out_d.clone()

            def copies(a_src=a_src, b_src=b_src, a_rows=a_rows, b_rows=b_rows):
                return gather_operands(a_src, b_src, a_rows, b_rows)

            a_d, b_d = copies()
            grouped_wgrad_into(a_d, b_d, offsets, out_d)
            grouped_wgrad_into(a_src, b_src, offsets, out_g, a_rows_S=a_rows, b_rows_S=b_rows)
            torch.cuda.synchronize()
            exact = bool(torch.equal(out_d, out_g))
            t_dense = bench(lambda a_d=a_d, b_d=b_d, o=out_d: grouped_wgrad_into(a_d, b_d,
                                                                                   offsets, o))
            t_copy = bench(copies)
            t_gather = bench(lambda a=a_src, b=b_src, o=out_g, ar=a_rows, br=b_rows:
                             grouped_wgrad_into(a, b, offsets, o, a_rows_S=ar, b_rows_S=br))
            gathered_bytes = 2 * s * ((m if ga else 0) + (n if gb else 0))
            row = {
                "shape": name, "case": case, "E": e, "M": m, "N": n, "T": t, "S": s,
                "bitexact": exact, "dense_us": t_dense, "gather_pass_us": t_copy,
                "gather_kernel_us": t_gather,
                "dense_TFLOPs": flops / (t_dense * 1e-6) / 1e12,
                "gather_TFLOPs": flops / (t_gather * 1e-6) / 1e12,
                "gather_over_dense": t_gather / t_dense,
                "gather_over_pass_plus_dense": t_gather / (t_copy + t_dense),
                "copy_MiB_saved": gathered_bytes / 2**20,
            }
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            del a_d, b_d, out_d, out_g
            torch.cuda.empty_cache()
    print()
    print(f"{'shape':22s} {'case':24s} {'exact':>5s} {'dense':>7s} {'pass':>7s} {'gather':>7s} "
          f"{'g/d':>5s} {'g/(p+d)':>7s} {'MiB':>6s}")
    for r in rows_out:
        print(f"{r['shape']:22s} {r['case']:24s} {str(r['bitexact']):>5s} {r['dense_us']:7.0f} "
              f"{r['gather_pass_us']:7.0f} {r['gather_kernel_us']:7.0f} "
              f"{r['gather_over_dense']:5.2f} {r['gather_over_pass_plus_dense']:7.2f} "
              f"{r['copy_MiB_saved']:6.0f}")
    return rows_out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes only")
    p.add_argument("--json", default=None, help="write all rows as JSON here")
    p.add_argument(
        "--tiles",
        default=None,
        help="tile variants to time, 'M,N,K,stages,pingpong[,field=value...];...' (default: the YAML "
        "choice; fields: see parse_tile)",
    )
    p.add_argument("--only", default=None, help="comma-separated row indices to run")
    p.add_argument("--no-quack", action="store_true", help="skip the quack columns")
    p.add_argument(
        "--variants",
        action="store_true",
        help="sweep the SM90 speed variants on the quick shapes (+ a small odd-M row)",
    )
    p.add_argument(
        "--variant-filter",
        default=None,
        help="with --variants: comma-separated name substrings to keep; '-x' drops names "
        "containing x (the default tile always runs)",
    )
    p.add_argument("--gather", action="store_true",
                   help="gathered operands: dense kernel on copies vs the gather kernel")
    p.add_argument("--gather-only", default=None,
                   help="with --gather: comma-separated substrings of the shape names to run")
    p.add_argument("--gather-align", type=int, default=16,
                   help="with --gather: rows of each expert padded to this multiple (-1 rows)")
    args = p.parse_args(argv)

    import triton.testing

    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3  # µs

    copy_bw, mm_rate = _ceilings(bench, dev)
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "copy_TBps": copy_bw / 1e12,
        "mm8192_TFLOPs": mm_rate / 1e12,
    }
    print(json.dumps(header), flush=True)

    if args.gather:
        grows = run_gather(args, bench, dev)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "gather": grows}, f, indent=1)
        return 0

    if args.variants:
        vrows = run_variants(args, bench, dev, copy_bw)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "variants": vrows}, f, indent=1)
        return 0

    results = []
    only = None if args.only is None else {int(v) for v in args.only.split(",")}
    for idx, shape in enumerate(shapes(args.quick)):
        if only is not None and idx not in only:
            continue
        row = _run_row(args, bench, sm90, dev, copy_bw, shape)
        results.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()

    print()
    print(f"{header['date']}  {header['gpu']}  copy {header['copy_TBps']:.2f} TB/s  "
          f"mm8192 {header['mm8192_TFLOPs']:.0f} TFLOP/s")
    print(f"{'shape':26s} {'tile':12s} {'ours':>6s} {'gmm':>6s} {'loop':>6s} {'dense':>6s} "
          f"{'/gmm':>5s} {'/dense':>6s} {'/floor':>6s} {'err':>8s} {'quack':>6s} {'/qk':>5s} "
          f"{'/qkdef':>6s}")
    for r in results:
        print(
            f"{r['shape']:26s} {r['tile']:12s} {r['ours_TFLOPs']:6.0f} "
            f"{r.get('grouped_mm_TFLOPs', float('nan')):6.0f} {r['loop_TFLOPs']:6.0f} "
            f"{r['dense_TFLOPs']:6.0f} {r.get('ours_over_grouped_mm', float('nan')):5.2f} "
            f"{r['ours_over_dense']:6.2f} {r.get('ours_over_floor', float('nan')):6.2f} "
            f"{r['check_rel_err']:8.1e} {r.get('quack_tuned_TFLOPs', float('nan')):6.0f} "
            f"{r.get('ours_over_quack_tuned', float('nan')):5.2f} "
            f"{r.get('ours_over_quack_default', float('nan')):6.2f}"
        )
    for r in results:
        if len(r.get("variants", {})) > 1 or "quack_tuned_config" in r:
            times = "  ".join(f"{k} {v['us']:.0f}" for k, v in r.get("variants", {}).items())
            print(f"{r['shape']:26s} µs: {times}  | quack tuned {r.get('quack_tuned_us', 0):.0f} "
                  f"default {r.get('quack_default_us', 0):.0f} {r.get('quack_tuned_config', '')}")
    ratios = [r["ours_over_quack_tuned"] for r in results if "ours_over_quack_tuned" in r]
    if ratios:
        geo = float(torch.tensor(ratios, dtype=torch.float64).log().mean().exp())
        print(f"ours / quack (autotuned): min {min(ratios):.2f}, geometric mean {geo:.2f} "
              f"over {len(ratios)} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
