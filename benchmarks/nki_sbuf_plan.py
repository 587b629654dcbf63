"""SBUF plan of the NKI MXFP8 backward per phase, scale packing off and on, at the model shapes.

For every distinct (H, I) of ``configs/models`` that the kernel accepts (H, I multiples of 128;
I = the full intermediate, TP = 1), each block size of ``--block-sizes`` (default 1024 and 4096)
and ``use_scale_packing`` False and True, runs one full block of B live slots of one expert under
LNC2 on our interpreter (:func:`benchmarks.nki_modeled_profile.profile_block`, ``--fast``: the MX
arithmetic skipped, every instruction, rule and SBUF/PSUM budget check kept) and prints per phase
the SBUF peak while in it (bytes per partition, max over the two cores; ``Profile.memory``) and
the interpreter's MODELED Trainium3 time (``nki_kernels/interp/profile.py``). Nothing here ran on
Trainium. Each run is its own process (``--jobs`` at a time).

Usage::

    python benchmarks/nki_sbuf_plan.py [--block-sizes 1024,4096] [--models a,b] [--jobs 2]
        [--json out.json] [--markdown]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROFILE = REPO_ROOT / "benchmarks" / "nki_modeled_profile.py"
REGIONS = ("phase1", "phase2", "phase3", "phase4", "total")
ALIGN = 128


def shapes(model_filter: set[str] | None) -> list[tuple[int, int, list[str]]]:
    """Distinct (H, I, model names) of configs/models the kernel accepts, smallest first."""
    from common.models import list_models

    out: dict[tuple[int, int], list[str]] = {}
    for m in list_models():
        if model_filter is not None and m.name not in model_filter:
            continue
        if m.hidden % ALIGN or m.intermediate % ALIGN:
            continue
        out.setdefault((m.hidden, m.intermediate), []).append(m.name)
    ordered = sorted(out.items(), key=lambda kv: kv[0][0] * kv[0][1])
    return [(H, I, names) for (H, I), names in ordered]


def run_one(H: int, I: int, B: int, pack: bool) -> dict:
    """One profile run in a child process; its ``--json`` result (or ``{"error": ...}``)."""
    cmd = [sys.executable, str(PROFILE), "--shape", f"{H},{I}", "--block-size", str(B),
           "--fast", "--json"]
    if not pack:
        cmd.append("--no-scale-packing")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"H": H, "I": I, "B": B, "scale_packing": pack, "error": tail[0]}
    return json.loads(lines[-1])


def markdown(results: list[dict], names: dict) -> str:
    """Two tables: SBUF peak per phase (off -> on) and modeled time per phase (off -> on)."""
    by = {(r["H"], r["I"], r["B"], r["scale_packing"]): r for r in results}
    keys = sorted({(r["H"], r["I"], r["B"]) for r in results}, key=lambda k: (k[2], k[0] * k[1]))
    lines = ["| model (H, I) | B | " + " | ".join(f"{p} SBUF B/partition off -> on"
                                                 for p in REGIONS[:4]) + " | peak off -> on |",
             "|---|---|" + "---|" * 5]
    tl = ["| model (H, I) | B | " + " | ".join(f"{p} modeled us off -> on" for p in REGIONS)
          + " | TensorE util off -> on |", "|---|---|" + "---|" * 6]
    for H, I, B in keys:
        off, on = by.get((H, I, B, False)), by.get((H, I, B, True))
        label = f"{','.join(names[(H, I)])} ({H}, {I})"
        if not off or not on or "error" in off or "error" in on:
            err = (off or {}).get("error") or (on or {}).get("error")
            lines.append(f"| {label} | {B} | {err} |")
            continue
        ro = {r["region"]: r for r in off["rows"]}
        rn = {r["region"]: r for r in on["rows"]}
        cells = [f"{ro[p]['sbuf_peak_bytes']} -> {rn[p]['sbuf_peak_bytes']}" for p in REGIONS]
        lines.append(f"| {label} | {B} | " + " | ".join(cells) + " |")
        cells = [f"{ro[p]['modeled_us']:.1f} -> {rn[p]['modeled_us']:.1f}" for p in REGIONS]
        util = (f"{100 * ro['total']['tensor_e_util']:.1f} % -> "
                f"{100 * rn['total']['tensor_e_util']:.1f} %")
        tl.append(f"| {label} | {B} | " + " | ".join(cells) + f" | {util} |")
    return "\n".join(lines) + "\n\n" + "\n".join(tl) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default="1024,4096")
    ap.add_argument("--models", help="comma-separated configs/models names (default: all)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.block_sizes.split(",")]
    todo = []
    table = shapes(set(args.models.split(",")) if args.models else None)
    names = {(H, I): n for H, I, n in table}
    for H, I, _ in table:
        for B in blocks:
            for pack in (False, True):
                todo.append((H, I, B, pack))
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futs = [pool.submit(run_one, *t) for t in todo]
        for f in concurrent.futures.as_completed(futs):
            r = f.result()
            results.append(r)
            state = r.get("error") or f"{r['wall_s']:.0f} s"
            print(f"H={r['H']} I={r['I']} B={r['B']} pack={r['scale_packing']}: {state}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(markdown(results, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
