"""Re-tune the NKI blockwise MXFP8 backward's per-phase configs for the model shapes.

For every distinct (H, I) of ``configs/models/*.yaml`` (I = the full expert intermediate size,
TP = 1) that the kernel accepts (H and I multiples of 128), for B in {128, 512}, under LNC2 (and
LNC1 for qwen3-30b-a3b), runs :func:`nki_kernels.backend.tune_phase_configs` -- one full block
on ``nki-sim``, each phase's candidate overrides, lowest modeled Trainium3 time per phase -- and
prints per shape and phase the modeled time of AWS's defaults, the tuned time and the overrides.
Shapes the kernel rejects (``NkiCapacityError`` / ``ValueError``) or that run past ``--timeout``
are skipped with the reason printed.

Times are the interpreter's modeled per-block Trainium3 times in microseconds (the time model of
``nki_kernels/interp/profile.py``: sourced engine rates, per-DMA fixed cost and chunk-dependent
DMA bandwidth, DMA exposed at segment heads/tails; constants and sources in
``profile.CONSTANTS`` and the interpreter README), NOT measurements on Trainium hardware.

With ``--write`` the table goes to ``configs/nki/blockwise_mm_bwd_mxfp8.yaml`` (read by
:func:`nki_kernels.config.load_tuned_phase_configs`): an entry per shape where some phase beats
the defaults, listing only the phases (and fields) that do, under a comment with the modeled
times default -> tuned.

Every run has scale packing on (the seed's ``use_scale_packing=True``); a tuned phase's entry
carries ``enable_scale_packing: true``, since ``MatmulMxfp8KernelConfig``'s own default is AWS's
False and a loaded config decides its phase's packing.

Each shape runs in its own process (``--jobs`` at a time, one torch thread each), so a shape past
``--timeout`` seconds is stopped and skipped. The runs skip the MX arithmetic (``--fast``, the
default; ``benchmarks/nki_modeled_profile.fast_arithmetic``): the modeled time depends only on
the instruction stream, which no value changes, so it is the same; ``--full-arithmetic`` runs
the MX arithmetic as well.

Usage::

    python3 benchmarks/tune_nki_configs.py [--jobs 2] [--timeout 420] [--models a,b] [--write]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

BLOCK_SIZES = (128, 512)
LNC1_MODELS = ("qwen3-30b-a3b",)  # also tuned on one NeuronCore
ALIGN = 128  # H and I must be multiples of one partition tile (the kernel's K tiles)
YAML_PATH = REPO_ROOT / "configs" / "nki" / "blockwise_mm_bwd_mxfp8.yaml"
PHASES = ("phase1", "phase2", "phase3", "phase4")

HEADER = """\
# Per-phase MatmulMxfp8KernelConfig overrides for nki_kernels.blockwise_mm_bwd_mxfp8, keyed by
# shape: "H{{hidden}}_I{{intermediate per TP shard}}_B{{block_size}}_lnc{{1|2}}"
# (nki_kernels.config.tuned_config_key). Read by nki_kernels.config.load_tuned_phase_configs;
# the nki / nki-sim backends use them when the caller passes no phase configs.
#
# Each phase lists only the fields it overrides; M, K, N are never stored (the kernel derives
# them from the shape); phases not listed use AWS's defaults (default_phase_configs). Phase
# shapes (M, K, N) with S = 2 under LNC2: phase1 (B, H, I/S), phase2 (B, 2I, H/S),
# phase3 (I, B, H/S), phase4 (H/S, B, I).
#
# Generated {today} by `python3 benchmarks/tune_nki_configs.py --write`, from
# nki_kernels.backend.tune_phase_configs: one full block (B tokens, one expert) under nki-sim,
# the candidates of candidate_phase_overrides per phase, lowest modeled Trainium3 time per phase
# (ties keep AWS's defaults). Modeled = our CPU interpreter's time model (REFERENCE §5 numbers
# and its per-instruction cost assumptions), NOT measured on Trainium hardware. The comment
# above each entry gives the modeled per-block time, AWS defaults -> tuned, in us.
# Shapes: configs/models (I = full intermediate, TP = 1), B in {{128, 512}}, LNC2, and LNC1 for
# qwen3-30b-a3b. Scale packing on (use_scale_packing=True, the seed's default): every tuned phase
# stores enable_scale_packing: true (the config field's own default is AWS's False).
"""


@dataclass
class Job:
    """One tuning run: shape (H, I), block_size B, LNC2 or not, and the models sharing it."""

    H: int
    I: int
    B: int
    lnc2: bool
    models: list[str] = field(default_factory=list)
    # filled by the run
    default_us: dict[str, float] = field(default_factory=dict)
    tuned_us: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, dict] = field(default_factory=dict)
    skipped: str | None = None
    wall_s: float = 0.0

    @property
    def key(self) -> str:
        from nki_kernels.config import tuned_config_key

        return tuned_config_key(self.H, self.I, self.B, self.lnc2)


def plan_jobs(model_filter: set[str] | None) -> tuple[list[Job], list[str]]:
    """The tuning jobs from ``configs/models`` and the printed reasons for models left out.

    Returns:
        ``(jobs, skipped)``: one :class:`Job` per distinct (H, I, B, lnc2), models sharing a shape
        merged; ``skipped`` = "model: reason" lines.

    Raises:
        ValueError: ``model_filter`` names a model that ``configs/models`` does not have.
    """
    from common.models import list_models

    models = list_models()
    if model_filter is not None:
        unknown = model_filter - {m.name for m in models}
        if unknown:
            raise ValueError(
                f"--models: unknown model names {sorted(unknown)}; known: "
                f"{sorted(m.name for m in models)}"
            )
        models = [m for m in models if m.name in model_filter]
    jobs: dict[tuple, Job] = {}
    skipped: list[str] = []
    for m in models:
        H, I = m.hidden, m.intermediate
        if H % ALIGN or I % ALIGN:
            skipped.append(
                f"{m.name}: H={H}, I={I} not multiples of {ALIGN} (the kernel's WRAPX K tiles "
                "need H and I in 128-partition tiles)"
            )
            continue
        for lnc2 in (True, False) if m.name in LNC1_MODELS else (True,):
            for B in BLOCK_SIZES:
                job = jobs.setdefault((H, I, B, lnc2), Job(H, I, B, lnc2))
                job.models.append(m.name)
    order = sorted(jobs.values(), key=lambda j: (j.H * j.I, j.H, j.I, not j.lnc2, j.B))
    return order, skipped


def tune_one(H: int, I: int, B: int, lnc2: bool, fast: bool = True) -> dict:
    """Run :func:`tune_phase_configs` for one shape in this process; a JSON-able result.

    Returns:
        ``{"default_us": {phase: us}, "tuned_us": {...}, "overrides": {phase: dict}}`` (phases
        whose best candidate is AWS's default have ``{}``), or ``{"skipped": reason}`` when the
        kernel rejects the shape (NkiCapacityError / ValueError).
    """
    import torch

    torch.set_num_threads(1)
    from nki_kernels.backend import tune_phase_configs
    from nki_kernels.interp import NkiCapacityError

    if fast:
        from benchmarks.nki_modeled_profile import fast_arithmetic

        fast_arithmetic()

    try:
        best, rows = tune_phase_configs(H, I, B, lnc2)
    except (NkiCapacityError, ValueError) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    default_us = {r["phase"]: r["modeled_us"] for r in rows if r["run"] == 0}
    tuned_us: dict[str, float] = {}
    for r in rows:
        if r["phase"] not in tuned_us or r["modeled_us"] < tuned_us[r["phase"]]:
            tuned_us[r["phase"]] = r["modeled_us"]
    return {"default_us": default_us, "tuned_us": tuned_us, "overrides": best}


def _run_in_child(job: Job, timeout_s: float, fast: bool = True) -> Job:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        f"{job.H},{job.I},{job.B},{int(job.lnc2)},{int(fast)}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        job.skipped = f"ran past --timeout {timeout_s:.0f} s on the interpreter (too slow here)"
        job.wall_s = time.perf_counter() - start
        return job
    job.wall_s = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        job.skipped = f"tuning process failed (exit {proc.returncode}): {tail[0]}"
        return job
    result = json.loads(lines[-1])
    if "skipped" in result:
        job.skipped = result["skipped"]
        return job
    job.default_us = result["default_us"]
    job.tuned_us = result["tuned_us"]
    job.overrides = result["overrides"]
    return job


def _fmt_overrides(o: dict) -> str:
    if not o:
        return "(defaults)"
    return (
        "{"
        + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in o.items())
        + "}"
    )


def print_table(jobs: list[Job], skipped_models: list[str]) -> None:
    """Print one row per (shape, phase): default and tuned modeled us and the overrides."""
    head = (
        f"{'shape':<22} {'models':<26} {'phase':<7} {'default us':>10} {'tuned us':>9}  overrides"
    )
    print(head)
    print("-" * len(head))
    for job in jobs:
        models = ",".join(job.models)
        if job.skipped:
            print(f"{job.key:<22} {models:<26} skipped: {job.skipped}")
            continue
        for p in PHASES:
            if p not in job.default_us:
                continue
            print(
                f"{job.key:<22} {models:<26} {p:<7} {job.default_us[p]:>10.2f} "
                f"{job.tuned_us[p]:>9.2f}  {_fmt_overrides(job.overrides.get(p, {}))}"
            )
        tot_d = sum(job.default_us.values())
        tot_t = sum(job.tuned_us.values())
        print(
            f"{job.key:<22} {models:<26} {'total':<7} {tot_d:>10.2f} {tot_t:>9.2f}  "
            f"(wall {job.wall_s:.0f} s)"
        )
    for line in skipped_models:
        print(f"skipped {line}")


def _changed_phases(job: Job) -> list[str]:
    return [p for p in PHASES if job.overrides.get(p)]


def _comment(text: str, indent: str = "# ", cont: str = "# ") -> list[str]:
    """``text`` as YAML comment lines of at most 100 characters."""
    return textwrap.wrap(
        text, width=100, initial_indent=indent, subsequent_indent=cont, break_on_hyphens=False
    )


def render_yaml(jobs: list[Job], skipped_models: list[str], today: str) -> str:
    """The text of ``configs/nki/blockwise_mm_bwd_mxfp8.yaml`` for this run's results."""
    tuned = [j for j in jobs if not j.skipped and _changed_phases(j)]
    at_default = [j for j in jobs if not j.skipped and not _changed_phases(j)]
    not_run = [j for j in jobs if j.skipped]
    out = HEADER.format(today=today).splitlines()
    if at_default:
        text = "Defaults already best (no entry): " + ", ".join(j.key for j in at_default) + "."
        out += _comment(text)
    if not_run or skipped_models:
        out.append("# Not tuned:")
        for line in skipped_models:
            out += _comment(line, indent="#   ", cont="#     ")
        for j in not_run:
            reason = j.skipped.splitlines()[0]
            out += _comment(f"{j.key} ({','.join(j.models)}): {reason}", "#   ", "#     ")
    out.append("configs:" if tuned else "configs: {}")
    for j in tuned:
        changed = _changed_phases(j)
        same = [p for p in PHASES if p not in changed and p in j.default_us]
        parts = [f"{p} {j.default_us[p]:.2f} -> {j.tuned_us[p]:.2f}" for p in changed]
        comment = f"{','.join(j.models)}: " + ", ".join(parts)
        if same:
            comment += " (" + ", ".join(f"{p} {j.default_us[p]:.2f}" for p in same)
            comment += " unchanged)"
        out += _comment(comment, indent="  # ", cont="  # ")
        out.append(f"  {j.key}:")
        for p in changed:
            out.append(f"    {p}: {_fmt_overrides(j.overrides[p])}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit status (0, or 2 for a bad argument)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="shapes tuned in parallel (processes)")
    ap.add_argument(
        "--timeout", type=float, default=420.0, help="seconds per shape before it is skipped"
    )
    ap.add_argument("--models", help="comma-separated model names (default: all); no --write")
    ap.add_argument("--write", action="store_true", help=f"regenerate {YAML_PATH.name}")
    ap.add_argument("--full-arithmetic", action="store_true",
                    help="run the MX arithmetic too (same modeled times, much slower)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "H,I,B,lnc2,fast" here
    args = ap.parse_args(argv)

    if args.one:
        H, I, B, lnc2, fast = (int(v) for v in args.one.split(","))
        print(json.dumps(tune_one(H, I, B, bool(lnc2), bool(fast))))
        return 0
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be > 0, got {args.timeout}")
    if args.models and args.write:
        ap.error("--write regenerates the whole file; run it without --models")
    model_filter = set(args.models.split(",")) if args.models else None
    try:
        jobs, skipped_models = plan_jobs(model_filter)
    except ValueError as exc:
        ap.error(str(exc))
    for line in skipped_models:
        print(f"skip {line}", flush=True)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_run_in_child, j, args.timeout, not args.full_arithmetic): j
                   for j in jobs}
        for fut in concurrent.futures.as_completed(futures):
            j = fut.result()
            state = f"skipped: {j.skipped}" if j.skipped else "done"
            print(
                f"[{time.perf_counter() - start:6.0f} s] {j.key} ({j.wall_s:.0f} s) {state}",
                flush=True,
            )
    print()
    print_table(jobs, skipped_models)
    if args.write:
        today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        YAML_PATH.write_text(render_yaml(jobs, skipped_models, today), encoding="utf-8")
        print(f"\nwrote {YAML_PATH.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
