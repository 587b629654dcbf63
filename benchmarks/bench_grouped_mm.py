"""Benchmark of the varlen-M grouped GEMMs of the MoE layer: our SM90 kernel
(``cuda_kernels.grouped_mm``, gather-A through the routing index) against cuBLAS's grouped GEMM.

Per shape (the five of ``benchmarks/bench_moe_layer.py`` by default), the routing of the model's
router (``common.router_sim.simulate_model_routing``, seed 0) in the layer's grouped layout
(``common.torch_backward.grouped_layout``: 16-row groups, static row count S), and four GEMMs
(``--gemms``):

- ``gate_up``   forward:  ``X[T, H]`` gathered @ ``W_gate_up[E, H, 2I]``  -> ``[S, 2I]``
- ``down``      forward:  ``ah[S, I]`` (rows in order) @ ``W_down[E, I, H]`` -> ``[S, H]``
- ``down_dgrad`` backward: ``dY[T, H]`` gathered @ ``W_down[e]^T`` (a K-major view) -> ``[S, I]``
- ``gate_up_dgrad`` backward: ``dgu[S, 2I]`` (rows) @ ``W_gate_up[e]^T`` (K-major) -> ``[S, H]``
- ``gate_up_act`` forward, the gate/up GEMM with its epilogue: bias (models with biases), clamp
  and the model's activation, writing the BF16 checkpoint ``[R, 2, I]`` and ``a * h [S, I]``
- ``down_dgrad_act`` backward, the down dgrad with the activation backward as its epilogue:
  ``d_gate_up [S, 2I]``, ``a * h [S, I]`` and the affinity gradient (a random checkpoint)

Rows per GEMM (``--impls``; for ``gate_up_act`` / ``down_dgrad_act`` the same keys mean:
``ours`` = ``gate_up_forward`` / ``down_dgrad_backward``, the epilogue fused into the gathering
kernel; ``grouped_mm`` = ``torch._grouped_mm`` on pre-gathered rows then
``triton.activation.activation_forward`` / ``activation_backward``;
``gather`` = the layer's path today, ``gather_rows`` + ``torch._grouped_mm`` + the pass;
``dense`` = the GEMM's FLOPs as one ``torch.mm``):

- ``ours`` [ours]: ``grouped_mm_gather`` (the gathered GEMMs read X / dY through the index
  inside the kernel; the row GEMMs read A by TMA), once per ``--tiles`` variant (default: the
  kernel's own choice, ``select_grouped_mm_tile``);
- ``grouped_mm`` [grouped_mm]: ``torch._grouped_mm`` on rows gathered before timing (the GEMM
  alone, what the layer's cuBLAS call costs);
- ``gather+grouped_mm`` [gather]: ``index_select`` of the rows then ``torch._grouped_mm`` (gathered
  GEMMs only: what replacing the gather by the kernel's must beat);
- ``dense mm`` [dense]: one ``[R, K] @ [K, N]`` BF16 ``torch.mm`` of the same useful FLOPs, no
  routing: the ceiling.

Columns: ms = median (``triton.testing.do_bench(return_mode="median")`` on CUDA); TFLOP/s counts
the useful ``2 R K N`` (R = routed rows, padding rows not counted, the same for every row);
``vs grouped_mm`` / ``vs dense`` = their time / this time (> 1: this row is faster). ``--check``
compares ``ours`` with the torch twin (fp32 accumulation, one BF16 rounding; max |diff| in BF16
ulps of the reference's magnitude). ``--json PATH`` writes every number.

Usage: ``python benchmarks/bench_grouped_mm.py [--shapes qwen3-30b-a3b:16384,...] [--tokens T]
[--shrink N] [--gemms gate_up,down,...] [--impls ours,grouped_mm,gather,dense]
[--tiles 128x256s4,128x128s6pp] [--side-output] [--check] [--json PATH]``. On the H200:
``bash benchmarks/grouped_mm_device_run.sh``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_moe_backward import (
    DEFAULT_SHAPES,
    _err,
    _f,
    _free,
    header,
    make_timer,
    parse_shapes,
)

from common.problem import ClampLimits
from common.router_sim import simulate_model_routing
from common.routing import plan_routing
from common.torch_backward import grouped_layout
from cuda_kernels.grouped_mm import grouped_mm_gather, grouped_mm_gather_torch
from cuda_kernels.gemm.sm90.grouped_mm import Sm90GroupedMmTile

GEMMS = ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "gate_up_act", "down_dgrad_act")
IMPLS = ("ours", "grouped_mm", "gather", "dense")
BF16 = torch.bfloat16


def parse_tile(spec: str) -> Sm90GroupedMmTile:
    """``MxNsS[pp]`` (e.g. ``128x256s4``, ``128x128s6pp``) -> a tile."""
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)(pp)?", spec.strip())
    if not m:
        raise ValueError(f"bad tile {spec!r} (want MxNsS[pp], e.g. 128x256s4)")
    return Sm90GroupedMmTile(int(m[1]), int(m[2]), 64, int(m[3]), pingpong=bool(m[4]))


def build_shape(model, T: int, device: torch.device, seed: int = 0) -> dict:
    """Routing, layout and operands of one shape (BF16, unit-variance GEMM outputs)."""
    E, H, I = model.experts, model.hidden, model.intermediate
    expert_index, affinity = simulate_model_routing(model, T, seed=seed)
    plan = plan_routing(expert_index.to(device), affinity.to(device), E)
    layout = grouped_layout(plan, E)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(BF16)

    S = layout.tokens_sum
    idx = layout.row_to_token_S
    R = int((idx >= 0).sum())
    activation, clamp = model.expert_activation()
    return {
        "E": E, "H": H, "I": I, "T": T, "S": S, "R": R, "plan": plan, "layout": layout,
        "activation": activation, "clamp": clamp,
        "b_gu": randn(E, 2, I, scale=0.1).float() if model.has_bias else None,
        "offsets": layout.offsets_E, "idx": idx, "idx_clamped": idx.clamp(min=0),
        "x": randn(T, H), "dy": randn(T, H),
        "w_gu": randn(E, H, 2 * I, scale=H**-0.5), "w_d": randn(E, I, H, scale=I**-0.5),
        "ah": randn(S, I), "dgu": randn(S, 2 * I),
        "act": randn(plan.pair_token_R.shape[0], 2, I),
    }


def gemm_operands(d: dict, gemm: str):
    """``(a, w [E, K, N], index or None)`` of one GEMM."""
    if gemm in ("gate_up", "gate_up_act"):
        return d["x"], d["w_gu"], d["idx"]
    if gemm == "down":
        return d["ah"], d["w_d"], None
    if gemm in ("down_dgrad", "down_dgrad_act"):
        return d["dy"], d["w_d"].transpose(1, 2), d["idx"]
    if gemm == "gate_up_dgrad":
        return d["dgu"], d["w_gu"].transpose(1, 2), None
    raise ValueError(f"unknown gemm {gemm!r} (choose from {GEMMS})")


def ulp_check(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in units of one BF16 ulp of |ref| (2^-7 relative; 1e-3 absolute floor)."""
    diff = (out.float() - ref.float()).abs()
    return float((diff / (2**-7 * ref.float().abs() + 1e-3)).max())


def _ours_name(tile) -> str:
    """The row name of ours with ``tile`` (None: the kernel's own choice)."""
    return "ours" + (f" {tile.variant_name}" if tile is not None else "")


def _fused_impls(args, tiles, then_pass, src, idx, ours) -> dict:
    """``{impl: fn}`` of a fused-epilogue GEMM: the layer's path (cuBLAS then the Triton pass) on
    rows of ``src`` gathered once ("grouped_mm") and with the gather timed ("gather+grouped_mm"),
    and ``ours(tile, rows_out)`` per tile, as ``--impls`` selects; with ``--side-output`` also
    ``ours <tile> +rows``: the same kernel writing the gathered rows into a preallocated
    ``[S, K]`` buffer (what the layer's ``grouped_mm="ours"`` runs)."""
    from cuda_kernels.triton.rows import gather_rows

    fns = {}
    rows_out = None
    if "ours" in args.impls and args.side_output:
        rows_out = torch.empty(idx.shape[0], src.shape[1], dtype=BF16, device=src.device)
    if "grouped_mm" in args.impls:
        rows = gather_rows(src, idx)
        fns["grouped_mm"] = lambda: then_pass(rows)
    if "gather" in args.impls:
        fns["gather+grouped_mm"] = lambda: then_pass(gather_rows(src, idx))
    if "ours" in args.impls:
        for tile in tiles:
            fns[_ours_name(tile)] = lambda t=tile: ours(t, None)
            if rows_out is not None:
                fns[_ours_name(tile) + " +rows"] = lambda t=tile: ours(t, rows_out)
    return fns


def gated_impls(d: dict, args, tiles) -> dict:
    """``{impl: fn}`` of ``gate_up_act`` (see the module docstring)."""
    from cuda_kernels.grouped_mm import gate_up_forward
    from cuda_kernels.triton.activation import activation_forward

    E, H, I = d["E"], d["H"], d["I"]
    plan, layout, offs = d["plan"], d["layout"], d["offsets"]
    kw = {"activation": d["activation"], "clamp_limits": d["clamp"]}
    w4 = d["w_gu"].reshape(E, H, 2, I)

    def cublas_then_pass(rows):
        gu = torch._grouped_mm(rows, d["w_gu"], offs=offs)
        return activation_forward(gu, layout.row_to_pair_S, plan, b_gate_up_E2I=d["b_gu"],
                                  activation=kw["activation"],
                                  clamp_limits=kw["clamp_limits"] or ClampLimits())

    return _fused_impls(
        args, tiles, cublas_then_pass, d["x"], d["idx"],
        lambda t, rows_out: gate_up_forward(
            d["x"], w4, layout, plan, b_gate_up_E2I=d["b_gu"], backend="sm90", tile=t,
            x_rows_out=rows_out, **kw
        ),
    )


def dgated_impls(d: dict, args, tiles) -> dict:
    """``{impl: fn}`` of ``down_dgrad_act`` (see the module docstring)."""
    from cuda_kernels.grouped_mm import down_dgrad_backward
    from cuda_kernels.triton.activation import activation_backward

    plan, layout, offs = d["plan"], d["layout"], d["offsets"]
    kw = {"activation": d["activation"], "clamp_limits": d["clamp"]}
    w_t = d["w_d"].transpose(1, 2)

    def cublas_then_pass(rows):
        dh = torch._grouped_mm(rows, w_t, offs=offs)
        return activation_backward(dh, d["act"], layout.row_to_pair_S, plan,
                                   activation=kw["activation"],
                                   clamp_limits=kw["clamp_limits"] or ClampLimits())

    return _fused_impls(
        args, tiles, cublas_then_pass, d["dy"], d["idx"],
        lambda t, rows_out: down_dgrad_backward(
            d["dy"], d["w_d"], layout, plan, d["act"], backend="sm90", tile=t,
            dy_rows_out=rows_out, **kw
        ),
    )


def run_gemm(label, gemm, d, args, bench, record, tiles) -> None:
    if gemm in ("gate_up_act", "down_dgrad_act"):
        return run_gated(label, gemm, d, args, bench, record, tiles)
    a, w, idx = gemm_operands(d, gemm)
    _, K, N = w.shape
    S, R = d["S"], d["R"]
    flops = 2.0 * R * K * N
    offs = d["offsets"]
    rows = {}

    def emit(impl, ms, extra=None):
        row = {"shape": label, "gemm": gemm, "impl": impl, "ms": ms,
               "tflops": flops / (ms * 1e-3) / 1e12}
        row.update(extra or {})
        rows[impl] = row

    a_rows = a if idx is None else a.index_select(0, d["idx_clamped"])
    if "grouped_mm" in args.impls:
        emit("grouped_mm", bench(lambda: torch._grouped_mm(a_rows, w, offs=offs)) * 1e3)
    if "gather" in args.impls and idx is not None:
        ic = d["idx_clamped"]
        emit("gather+grouped_mm",
             bench(lambda: torch._grouped_mm(a.index_select(0, ic), w, offs=offs)) * 1e3)
    if "dense" in args.impls:
        xa = torch.randn(R, K, device=a.device).to(BF16)
        xb = torch.randn(K, N, device=a.device).to(BF16)
        emit("dense mm", bench(lambda: torch.mm(xa, xb)) * 1e3)
        del xa, xb
    if "ours" in args.impls:
        out = torch.empty(S, N, dtype=BF16, device=a.device)
        for tile in tiles:
            name = _ours_name(tile)
            try:
                grouped_mm_gather(a, w, offs, idx, out, backend="sm90", tile=tile)  # compile
                ms = bench(lambda t=tile: grouped_mm_gather(
                    a, w, offs, idx, out, backend="sm90", tile=t)) * 1e3
                extra = {}
                if args.check:
                    extra["ulps"] = ulp_check(out, grouped_mm_gather_torch(a, w, offs, idx))
                emit(name, ms, extra)
            except Exception as exc:  # noqa: BLE001 - a variant that fails prints why
                rows[name] = {"shape": label, "gemm": gemm, "impl": name, "status": _err(exc)}
    finish_rows(rows, record)
    return None


def run_gated(label, gemm, d, args, bench, record, tiles) -> None:
    """The ``gate_up_act`` / ``down_dgrad_act`` rows; ``--check``: ours vs the layer's path
    (GEMM then pass) as the largest difference of the first output (the checkpoint /
    ``d_gate_up``) in BF16 ulps of the pass's values and the relative error of ``a * h``."""
    _, w, _ = gemm_operands(d, gemm)
    _, K, N = w.shape
    flops = 2.0 * d["R"] * K * N
    rows = {}
    fns = (gated_impls if gemm == "gate_up_act" else dgated_impls)(d, args, tiles)
    ref = fns["grouped_mm"]() if args.check and "grouped_mm" in fns else None
    for impl, fn in fns.items():
        try:
            got = fn()  # compile / warm up
            ms = bench(fn) * 1e3
            row = {"shape": label, "gemm": gemm, "impl": impl, "ms": ms,
                   "tflops": flops / (ms * 1e-3) / 1e12}
            if ref is not None and impl.startswith("ours"):
                row["ulps"] = ulp_check(got[0], ref[0])
                row["ah_rel"] = float((got[1].float() - ref[1].float()).norm()
                                      / ref[1].float().norm().clamp_min(1e-30))
            rows[impl] = row
        except Exception as exc:  # noqa: BLE001 - a variant that fails prints why
            rows[impl] = {"shape": label, "gemm": gemm, "impl": impl, "status": _err(exc)}
    if "dense" in args.impls:
        xa = torch.randn(d["R"], K, device=w.device).to(BF16)
        xb = torch.randn(K, N, device=w.device).to(BF16)
        ms = bench(lambda: torch.mm(xa, xb)) * 1e3
        rows["dense mm"] = {"shape": label, "gemm": gemm, "impl": "dense mm", "ms": ms,
                            "tflops": flops / (ms * 1e-3) / 1e12}
    finish_rows(rows, record)


def finish_rows(rows: dict, record: dict) -> None:
    """Ratios against the ``grouped_mm`` and ``dense mm`` rows, then print and record."""
    base = rows.get("grouped_mm", {}).get("ms")
    dense = rows.get("dense mm", {}).get("ms")
    for row in rows.values():
        if "ms" in row:
            row["vs_grouped_mm"] = base / row["ms"] if base else None
            row["vs_dense"] = dense / row["ms"] if dense else None
        print(table_row(row), flush=True)
        record["rows"].append(row)


def table_row(r: dict) -> str:
    if "ms" not in r:
        return f"| {r['shape']} | {r['gemm']} | {r['impl']} | {r.get('status', '?')} | | | | |"
    return (
        f"| {r['shape']} | {r['gemm']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
        f"{_f(r.get('vs_grouped_mm'), '.2f')} | {_f(r.get('vs_dense'), '.2f')} | "
        f"{_f(r.get('ulps'), '.2f')} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="name:T[:eN],... (%(default)s)")
    ap.add_argument("--tokens", type=int, default=None, help="T for every shape")
    ap.add_argument("--shrink", type=int, default=1, help="divide H, I (and E) by this")
    ap.add_argument("--gemms", default=",".join(GEMMS))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--tiles", default="", help="tile variants of ours (default: its choice)")
    ap.add_argument(
        "--side-output", action="store_true",
        help="gate_up_act / down_dgrad_act: also time ours writing the gathered rows (+rows)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10, help="timed runs without triton")
    ap.add_argument("--check", action="store_true", help="ours vs the torch twin (ulps)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    gemms = [s.strip() for s in args.gemms.split(",") if s.strip()]
    for name, got, allowed in (("--impls", args.impls, IMPLS), ("--gemms", gemms, GEMMS)):
        bad = [g for g in got if g not in allowed]
        if bad:
            ap.error(f"unknown {name} {bad}; choose from {list(allowed)}")
    tiles = [parse_tile(t) for t in args.tiles.split(",") if t.strip()] or [None]
    device = torch.device(args.device)
    if device.type != "cuda":
        ap.error("this benchmark needs a CUDA device (the kernel and torch._grouped_mm)")
    bench = make_timer(device, args.reps)
    record = {"header": header(device), "argv": sys.argv[1:], "rows": []}
    print(record["header"])
    print("\nTFLOP/s = 2 R K N / time (R routed rows); vs = their time / this time (> 1: faster)")
    cols = ("shape", "gemm", "impl", "ms", "TFLOP/s", "vs grouped_mm", "vs dense", "ulps")
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols), flush=True)
    for label, model, T in parse_shapes(args.shapes, args.tokens, args.shrink):
        try:
            d = build_shape(model, T, device)
        except Exception as exc:  # noqa: BLE001 - e.g. OOM
            print(f"| {label} | (all) | (all) | {_err(exc)} | | | | |", flush=True)
            record["rows"].append({"shape": label, "status": _err(exc)})
            continue
        label = f"{label} S={d['S']} R={d['R']}"
        for gemm in gemms:
            try:
                run_gemm(label, gemm, d, args, bench, record, tiles)
            except Exception as exc:  # noqa: BLE001
                print(f"| {label} | {gemm} | (all) | {_err(exc)} | | | | |", flush=True)
                record["rows"].append({"shape": label, "gemm": gemm, "status": _err(exc)})
            _free(device)
        del d
        _free(device)
        if args.json:  # after every shape: a run cut short by a timeout keeps what it measured
            Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
