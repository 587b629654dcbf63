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
  kernel's own choice, ``select_grouped_mm_tile``; see "Tiles" below);
- ``grouped_mm`` [grouped_mm]: ``torch._grouped_mm`` on rows gathered before timing (the GEMM
  alone, what the layer's cuBLAS call costs);
- ``gather+grouped_mm`` [gather]: ``index_select`` of the rows then ``torch._grouped_mm`` (gathered
  GEMMs only: what replacing the gather by the kernel's must beat);
- ``dense mm`` [dense]: one ``[R, K] @ [K, N]`` BF16 ``torch.mm`` of the same useful FLOPs, no
  routing: the ceiling.

For ``gate_up_act`` / ``down_dgrad_act``, ``ours`` also times ``ours <tile> gemm+pass``: our
gathering GEMM with the plain store epilogue, then the Triton pass (the layer's ``"ours-gemm"``).
``--checkpoint-rows``: the checkpoint in grouped row order ``[S, 2I]``, the layer's form without
bias or clamp (``gate_up_act``: ours with ``checkpoint_rows``, the pass keeping the GEMM's rows;
``down_dgrad_act``: every row reads the row-order checkpoint).

Columns: ms = median (``triton.testing.do_bench(return_mode="median")`` on CUDA); TFLOP/s counts
the useful ``2 R K N`` (R = routed rows, padding rows not counted, the same for every row);
``vs grouped_mm`` / ``vs dense`` = their time / this time (> 1: this row is faster). ``--check``
compares ``ours`` with the torch twin (fp32 accumulation, one BF16 rounding; max |diff| in BF16
ulps of the reference's magnitude). ``--json PATH`` writes every number.

Tiles (``--tiles``, comma-separated; each a compile per GEMM and shape): ``MxN`` with optional
``sS`` (pipeline stages; default: as many as shared memory holds), then ``:pingpong`` /
``:cooperative`` (default cooperative; ``pp`` / ``coop`` too), e.g. ``128x192:pingpong``; the row
names (``Sm90GroupedMmTile.variant_name``, e.g. ``128x192s5pp``) parse back. ``default`` is the
kernel's own choice; :data:`TILE_SETS` names sets (``mainloop``: the long-K / wide-N sweep of
issue 33). With more than one tile, a summary table follows: per shape and GEMM, cuBLAS and each
tile in ms (their time / cuBLAS's in brackets: > 1 is slower), the fastest marked.

Usage: ``python benchmarks/bench_grouped_mm.py [--shapes qwen3-30b-a3b:16384,...] [--tokens T]
[--shrink N] [--gemms gate_up,down,...] [--impls ours,grouped_mm,gather,dense]
[--tiles default,128x192:pingpong | mainloop] [--side-output] [--check]
[--json PATH]``. On the H200: ``bash benchmarks/grouped_mm_device_run.sh [args]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
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
from cuda_kernels.gemm.sm90 import grouped_mm as sm90_grouped_mm
from cuda_kernels.gemm.sm90.grouped_mm import Sm90GroupedMmTile
from cuda_kernels.gemm.tiles import SM90_TILES

GEMMS = ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "gate_up_act", "down_dgrad_act")
IMPLS = ("ours", "grouped_mm", "gather", "dense")
BF16 = torch.bfloat16


#: Named tile sets of ``--tiles``. ``mainloop`` (issue 33: mainloop parity with cuBLAS on long K
#: / wide N): the shipped default (128x256 cooperative), 128x192 cooperative and pingpong (quack's
#: Hopper default tile).
TILE_SETS = {
    "mainloop": ("default", "128x192:cooperative", "128x192:pingpong"),
}
_MODES = {"pingpong": True, "pp": True, "cooperative": False, "coop": False}


def parse_tile(spec: str) -> Sm90GroupedMmTile | None:
    """One ``--tiles`` item -> a tile (None for ``default``: the kernel's own choice).

    ``MxN[sS][pp][-tma]`` (``Sm90GroupedMmTile.variant_name``: ``128x256s4``,
    ``128x192s5pp``; ``-tma``: the TMA-store epilogue, ``epi_tma``) or
    ``MxN[sS][-tma]:pingpong|cooperative`` (``128x192:pingpong``); stages default to as
    many as shared memory holds (``SM90_TILES.stages_for``; the kernel lowers them further if
    its schedule tables need the room).

    Raises:
        ValueError: a spec of neither form, or a tile the kernel does not accept.
    """
    spec = spec.strip()
    if spec == "default":
        return None
    head, *opts = spec.split(":")
    m = re.fullmatch(r"(\d+)x(\d+)(?:s(\d+))?(pp)?(-tma)?", head)
    if not m:
        raise ValueError(
            f"bad tile {spec!r} (want MxN[sS][pp][-tma] or MxN[sS][-tma]:pingpong|cooperative, "
            "e.g. 128x192:pingpong, or default)"
        )
    tile_m, tile_n = int(m[1]), int(m[2])
    pingpong = bool(m[4])
    for opt in opts:
        if opt not in _MODES:
            raise ValueError(
                f"bad tile option {opt!r} in {spec!r} (want one of {sorted(_MODES)})"
            )
        pingpong = _MODES[opt]
    tile_k = SM90_TILES.tile_k[0]
    stages = int(m[3]) if m[3] else SM90_TILES.stages_for(tile_m, tile_n, tile_k)
    return Sm90GroupedMmTile(tile_m, tile_n, tile_k, stages, pingpong=pingpong,
                             epi_tma=bool(m[5]))


def parse_tiles(text: str) -> list:
    """``--tiles`` -> tiles (None = the kernel's own choice), duplicates dropped, in order; an
    empty text is ``[None]``; a :data:`TILE_SETS` name expands to its tiles."""
    specs = []
    for item in (t.strip() for t in text.split(",")):
        if item:
            specs.extend(TILE_SETS.get(item, (item,)))
    return list(dict.fromkeys(parse_tile(t) for t in specs)) or [None]


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
    ck_rows = args.checkpoint_rows
    if ck_rows and (d["b_gu"] is not None or d["clamp"] is not None):
        raise ValueError("--checkpoint-rows: the row-order checkpoint is the layer's form "
                         "without a bias and a clamp only")

    def then_pass(gu):  # the checkpoint: the GEMM's rows themselves with --checkpoint-rows
        act, ah = activation_forward(gu, layout.row_to_pair_S, plan, b_gate_up_E2I=d["b_gu"],
                                     activation=kw["activation"],
                                     clamp_limits=kw["clamp_limits"] or ClampLimits(),
                                     pair_checkpoint=not ck_rows)
        return (gu if ck_rows else act), ah

    def cublas_then_pass(rows):
        return then_pass(torch._grouped_mm(rows, d["w_gu"], offs=offs))

    fns = _fused_impls(
        args, tiles, cublas_then_pass, d["x"], d["idx"],
        lambda t, rows_out: gate_up_forward(
            d["x"], w4, layout, plan, b_gate_up_E2I=d["b_gu"], backend="sm90", tile=t,
            x_rows_out=rows_out, checkpoint_rows=ck_rows, **kw
        ),
    )
    if "ours" in args.impls:  # our gathering GEMM (plain store) then the pass: the layer's
        gu = torch.empty(d["S"], 2 * I, dtype=BF16, device=d["x"].device)  # ours-gemm path
        for tile in tiles:
            fns[_ours_name(tile) + " gemm+pass"] = lambda t=tile: then_pass(grouped_mm_gather(
                d["x"], d["w_gu"], offs, d["idx"], gu, backend="sm90", tile=t))
    return fns


def dgated_impls(d: dict, args, tiles) -> dict:
    """``{impl: fn}`` of ``down_dgrad_act`` (see the module docstring)."""
    from cuda_kernels.grouped_mm import down_dgrad_backward
    from cuda_kernels.triton.activation import activation_backward

    plan, layout, offs = d["plan"], d["layout"], d["offsets"]
    kw = {"activation": d["activation"], "clamp_limits": d["clamp"]}
    w_t = d["w_d"].transpose(1, 2)
    act = d["act"]
    if args.checkpoint_rows:  # the same checkpoint in grouped row order [S, 2I]
        r2p = layout.row_to_pair_S
        act = act[r2p.clamp(min=0)].reshape(r2p.shape[0], -1)
        act = torch.where((r2p >= 0)[:, None], act, torch.zeros_like(act))

    def then_pass(dh):
        return activation_backward(dh, act, layout.row_to_pair_S, plan,
                                   activation=kw["activation"],
                                   clamp_limits=kw["clamp_limits"] or ClampLimits())

    def cublas_then_pass(rows):
        return then_pass(torch._grouped_mm(rows, w_t, offs=offs))

    fns = _fused_impls(
        args, tiles, cublas_then_pass, d["dy"], d["idx"],
        lambda t, rows_out: down_dgrad_backward(
            d["dy"], d["w_d"], layout, plan, act, backend="sm90", tile=t,
            dy_rows_out=rows_out, **kw
        ),
    )
    if "ours" in args.impls:  # our gathering GEMM (plain store) then the pass: the layer's
        dh = torch.empty(d["S"], d["I"], dtype=BF16, device=d["dy"].device)  # ours-gemm
        for tile in tiles:
            fns[_ours_name(tile) + " gemm+pass"] = lambda t=tile: then_pass(grouped_mm_gather(
                d["dy"], w_t, offs, d["idx"], dh, backend="sm90", tile=t))
    return fns


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
        ref = None  # the torch twin's result (--check), computed once for every tile
        for tile in tiles:
            name = _ours_name(tile)
            try:
                extra = {"tile": (tile or sm90_grouped_mm.select_grouped_mm_tile(
                    N, K, d["E"])).variant_name}
                out.fill_(float("nan"))  # --check: rows a tile leaves unwritten show as NaN
                extra.update(timed_compile(
                    lambda t=tile: grouped_mm_gather(a, w, offs, idx, out, backend="sm90", tile=t)
                ))
                ms = bench(lambda t=tile: grouped_mm_gather(
                    a, w, offs, idx, out, backend="sm90", tile=t)) * 1e3
                if args.check:
                    if ref is None:
                        ref = grouped_mm_gather_torch(a, w, offs, idx)
                    extra["ulps"] = ulp_check(out, ref)
                emit(name, ms, extra)
            except Exception as exc:  # noqa: BLE001 - a variant that fails prints why
                rows[name] = {"shape": label, "gemm": gemm, "impl": name, "status": _err(exc)}
    finish_rows(rows, record)
    return None


def plain_keys(d: dict, gemms, tiles) -> list:
    """The compile keys of ``ours`` on the plain GEMMs of one shape (``grouped_mm_gather``'s key
    of each GEMM and tile; a tile the key refuses is left to the timed loop, which reports it)."""
    from cuda_kernels.grouped_mm.api import grouped_mm_key

    keys = []
    for gemm in gemms:
        if gemm in ("gate_up_act", "down_dgrad_act"):
            continue
        a, w, idx = gemm_operands(d, gemm)
        for tile in tiles:
            try:
                keys.append(grouped_mm_key(w, idx, tile))
            except ValueError:
                pass
    return list(dict.fromkeys(keys))


def _compile_worker(key) -> tuple[int, str | None]:
    """A ``--compile-jobs`` process: compile ``key`` for the present GPU into the persistent
    kernel cache (``FAMILY.compiled``); ``(real compiles, error or None)``."""
    before = sm90_grouped_mm.FAMILY.compile_count  # (a worker takes several keys)
    try:
        sm90_grouped_mm.FAMILY.compiled(key)
        return sm90_grouped_mm.FAMILY.compile_count - before, None
    except Exception as exc:  # noqa: BLE001 - the timed loop compiles it again and reports
        return 0, _err(exc)


def precompile(keys: list, jobs: int) -> dict:
    """Compile the ``keys`` not yet in the persistent kernel cache (``cuda_kernels.gemm
    .kernel_cache``) in ``jobs`` spawned processes, so that the timed loop loads them instead of
    compiling one after another (a compile is single-threaded CPU work). Nothing happens with
    fewer than two keys to compile, ``jobs`` < 2 or the cache off; a failure only leaves the
    compile to the timed loop. Returns ``{"keys", "compiled", "seconds", "errors"}``."""
    import multiprocessing

    from cuda_kernels.gemm import kernel_cache

    name = sm90_grouped_mm.FAMILY.name
    todo = [k for k in keys if (p := kernel_cache.entry_path(name, k, None)) is not None
            and not p.is_file()]
    info = {"keys": len(todo), "compiled": 0, "seconds": 0.0, "errors": []}
    if jobs < 2 or len(todo) < 2:
        return info
    t0 = time.perf_counter()
    try:
        ctx = multiprocessing.get_context("spawn")  # CUDA in the children: no fork
        with ctx.Pool(min(jobs, len(todo))) as pool:
            for count, err in pool.imap_unordered(_compile_worker, todo):
                info["compiled"] += count
                if err:
                    info["errors"].append(err)
    except Exception as exc:  # noqa: BLE001 - fall back to the timed loop's compiles
        info["errors"].append(_err(exc))
    info["seconds"] = time.perf_counter() - t0
    return info


def timed_compile(first_call) -> dict:
    """Run ``first_call`` (the first launch of a tile: its compile, or a load from the kernel
    cache) to completion; ``{"compiled": real compiles, "first_s": seconds}``."""
    before = sm90_grouped_mm.FAMILY.compile_count
    t0 = time.perf_counter()
    first_call()
    torch.cuda.synchronize()
    return {"compiled": sm90_grouped_mm.FAMILY.compile_count - before,
            "first_s": time.perf_counter() - t0}


def summary_table(rows: list[dict], tiles: list) -> list[str]:
    """The pivot of the ``ours`` tiles against cuBLAS: one line per (shape, GEMM), ms of
    ``grouped_mm`` and of each tile with its time over cuBLAS's in brackets (> 1: slower than
    cuBLAS), the fastest of ours in bold."""
    names = [_ours_name(t) for t in tiles]
    heads = ["default" if t is None else t.variant_name for t in tiles]
    by_key: dict[tuple, dict] = {}
    for r in rows:
        if "gemm" in r and "impl" in r:
            by_key.setdefault((r["shape"], r["gemm"]), {})[r["impl"]] = r
    lines = ["| shape | GEMM | cuBLAS grouped_mm | " + " | ".join(heads) + " | best / cuBLAS |",
             "|" + "---|" * (len(heads) + 4)]
    for (shape, gemm), got in by_key.items():
        base = got.get("grouped_mm", {}).get("ms")
        ms = [got.get(n, {}).get("ms") for n in names]
        best = min((v for v in ms if v is not None), default=None)
        cells = []
        for n, v in zip(names, ms):
            if v is None:
                cells.append(got.get(n, {}).get("status", "–")[:40])
                continue
            cell = f"{v:.3f}" + (f" ({v / base:.3f})" if base else "")
            if n == "ours" and got[n].get("tile"):
                cell += f" {got[n]['tile']}"
            cells.append(f"**{cell}**" if v == best and len(ms) > 1 else cell)
        ratio = f"{best / base:.3f}" if best and base else "–"
        lines.append(f"| {shape} | {gemm} | {_f(base, '.3f')} | " + " | ".join(cells)
                     + f" | {ratio} |")
    return lines


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
    ap.add_argument(
        "--tiles", default="",
        help="tiles of ours: default (its choice), MxN[sS]:pingpong|cooperative, or a set "
             f"of {sorted(TILE_SETS)} (see the module docstring; default: its choice)",
    )
    ap.add_argument(
        "--side-output", action="store_true",
        help="gate_up_act / down_dgrad_act: also time ours writing the gathered rows (+rows)",
    )
    ap.add_argument(
        "--checkpoint-rows", action="store_true",
        help="gate_up_act / down_dgrad_act: the checkpoint in row order (gate_up_act: ours "
             "with checkpoint_rows, the pass keeping the GEMM's rows, pair_checkpoint=False; "
             "down_dgrad_act: both read an [S, 2I] checkpoint), the layer's form without bias "
             "or clamp",
    )
    ap.add_argument(
        "--compile-jobs", type=int, default=8,
        help="compile the plain GEMMs' kernels of a shape in this many processes first (into "
             "the persistent kernel cache; < 2: one after another in the timed loop)",
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
    try:
        tiles = parse_tiles(args.tiles)
    except ValueError as exc:
        ap.error(str(exc))
    device = torch.device(args.device)
    if device.type != "cuda":
        ap.error("this benchmark needs a CUDA device (the kernel and torch._grouped_mm)")
    bench = make_timer(device, args.reps)
    t_start = time.perf_counter()
    record = {"header": header(device), "argv": sys.argv[1:], "rows": [], "precompile": []}
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
        if "ours" in args.impls and args.compile_jobs > 1:
            info = precompile(plain_keys(d, gemms, tiles), args.compile_jobs)
            record["precompile"].append({"shape": label, **info})
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
    record["compiles"] = sm90_grouped_mm.FAMILY.compile_count + sum(
        p["compiled"] for p in record["precompile"])
    record["seconds"] = time.perf_counter() - t_start
    if len(tiles) > 1 and "ours" in args.impls:
        print("\nSummary: ms (time / cuBLAS's: > 1 is slower); fastest of ours in bold")
        print("\n".join(summary_table(record["rows"], tiles)))
    for p in record["precompile"]:
        if p["keys"] > 1:
            print(f"\n{p['shape']}: {p['compiled']} of {p['keys']} plain GEMM kernels compiled "
                  f"in {args.compile_jobs} processes in {p['seconds']:.0f} s"
                  + (f"; errors: {p['errors'][:3]}" if p["errors"] else ""))
    print(f"\n{record['compiles']} kernel compiles in all (the rest loaded from the kernel "
          f"cache); {record['seconds']:.0f} s in all", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
