"""``moe-bwd``: the package's command line.

    moe-bwd run --model qwen3-30b-a3b --tokens 2048 [--backend auto|NAME] [--seed S] [--shrink N]
    moe-bwd models
    moe-bwd backends

``run`` builds one MoE layer's backward problem for a model's shape (seeded weights, a simulated
router, the forward checkpoint), runs the backward on the selected backend, runs the float64
reference on the same inputs, and prints one row per gradient: shape, SQNR (dB) and max
relative error against float64, plus wall times.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from common import dispatch
from common.metrics import compare
from common.models import list_models, load_model

__all__ = ["main"]


def _cmd_models(args, console: Console) -> int:
    table = Table(title="MoE model shapes (configs/models)")
    for col in ("name (--model)", "H", "I", "E", "top_k", "shared", "router", "activation", "bias"):
        table.add_column(
            col,
            justify="right" if col in ("H", "I", "E", "top_k", "shared") else "left",
            no_wrap=col.startswith("name"),  # what --model takes: never truncate it
        )
    for m in list_models():
        table.add_row(
            m.name,
            str(m.hidden),
            str(m.intermediate),
            str(m.experts),
            str(m.top_k),
            str(m.shared_experts),
            m.router,
            m.activation,
            "yes" if m.has_bias else "no",
        )
    console.print(table)
    return 0


def _cmd_backends(args, console: Console) -> int:
    table = Table(title=f"Backends (auto on this machine: {dispatch.auto_backend_name()})")
    table.add_column("name")
    table.add_column("available")
    table.add_column("summary / why not")
    for name, b in sorted(dispatch.registered_backends().items()):
        reason = b.check()
        table.add_row(
            name, "yes" if reason is None else "no", b.summary if reason is None else reason
        )
    console.print(table)
    return 0


def _cmd_run(args, console: Console) -> int:
    from common.inputs import make_problem_for_model
    from common.reference import reference_backward

    try:
        model = load_model(args.model)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    if args.tokens < 1:
        console.print(f"[red]error:[/red] --tokens must be >= 1, got {args.tokens}")
        return 2
    if args.shrink != 1:
        try:
            model = model.shrink(args.shrink)
        except ValueError as exc:
            console.print(f"[red]error:[/red] --shrink: {exc}")
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        console.print(f"[red]error:[/red] --device {device!r} cannot be used here: {exc}")
        return 2
    if not (args.skew >= 0 and args.skew != float("inf")):
        console.print(f"[red]error:[/red] --skew must be a finite number >= 0, got {args.skew}")
        return 2
    need = _bytes_needed(model, args.tokens)
    have = _memory_available(device)
    if have is not None and need > have:
        console.print(
            f"[red]error:[/red] {model.display_name} needs about {need / 2**30:.0f} GiB on "
            f"{device} "
            f"(weights, gradients and their float64 reference for E={model.experts} experts), "
            f"{have / 2**30:.0f} GiB are available; pass --shrink N to divide H and I by N"
        )
        return 2
    try:
        backend = dispatch.resolve_backend(args.backend, device)
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2

    times: dict[str, float] = {}
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("building inputs (weights, router, forward checkpoint)", total=3)
        t0 = time.perf_counter()
        problem = make_problem_for_model(
            model, args.tokens, seed=args.seed, device=device, skew=args.skew
        )
        times["inputs"] = time.perf_counter() - t0
        progress.update(task, advance=1, description=f"backward on {backend.name}")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            grads = backend.run(problem)
        except (ValueError, RuntimeError) as exc:
            progress.stop()
            console.print(f"[red]error:[/red] backend {backend.name}: {exc}")
            return 2
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times["backend"] = time.perf_counter() - t0
        progress.update(task, advance=1, description="float64 reference backward")
        t0 = time.perf_counter()
        ref = reference_backward(problem)
        times["reference"] = time.perf_counter() - t0
        progress.update(task, advance=1)

    d = problem.dims
    flops = 12 * d["T"] * d["K"] * d["H"] * d["I"]
    note = f" (auto fell back: {backend.fallback_reason})" if backend.fallback_reason else ""
    console.print(
        f"[bold]{model.display_name}[/bold]  T={d['T']} H={d['H']} I={d['I']} E={d['E']} "
        f"top_k={d['K']}  backend=[bold]{backend.name}[/bold]{note}  device={device}"
    )
    act = problem.activation
    console.print(
        f"activation: {act.name} (h = silu(g) * u)"
        if act.is_swiglu
        else f"activation: {act.name} (h = g * sigmoid({act.alpha:g} g) * (u + {act.up_offset:g}))"
    )
    table = Table(title="gradients vs float64 reference")
    for col in ("gradient", "shape", "SQNR (dB)", "max|err| / max|ref|"):
        table.add_column(col, justify="left" if col in ("gradient", "shape") else "right")
    worst = float("inf")
    for (name, out), (_, want) in zip(grads.named().items(), ref.named().items()):
        m = compare(out, want)
        worst = min(worst, m["sqnr_db"])
        table.add_row(
            name, "x".join(map(str, out.shape)), f"{m['sqnr_db']:.1f}", f"{m['max_rel_err']:.2e}"
        )
    console.print(table)
    console.print(
        f"wall time: backend {times['backend']:.2f} s "
        f"({flops / times['backend'] / 1e9:.3g} GFLOP/s "
        f"of {flops / 1e9:.3g} GFLOP), float64 reference {times['reference']:.2f} s, "
        f"inputs {times['inputs']:.2f} s"
    )
    phases = grads.info.get("nki_phases")
    if phases:
        pt = Table(title="NKI phases, modeled on Trainium3 (one NeuronCore)")
        for col in ("phase", "modeled time (us)", "TensorE utilization"):
            pt.add_column(col, justify="left" if col == "phase" else "right")
        for row in phases:
            pt.add_row(
                str(row["phase"]), f"{row['modeled_us']:.1f}", f"{100 * row['tensor_e_util']:.1f} %"
            )
        console.print(pt)
    if math.isnan(worst):  # NaN anywhere
        console.print("[red]a gradient holds NaN or inf[/red]")
        return 1
    return 0


def _bytes_needed(model, num_tokens: int) -> int:
    """Rough peak bytes of `run`: BF16 weights, fp32 grads, float64 reference grads and
    temporaries (14 bytes per weight element), plus per-row activations."""
    weights = model.experts * model.hidden * 3 * model.intermediate
    rows = num_tokens * model.top_k * (model.hidden + 3 * model.intermediate)
    return 14 * weights + 16 * rows


def _memory_available(device: str) -> int | None:
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-bwd", description="MoE expert-MLP backward kernels: run, compare, list."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run one MoE layer's backward and compare it with float64",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--model", required=True, help="model shape name (see `moe-bwd models`)")
    run.add_argument("--tokens", type=int, required=True, help="tokens T in the batch")
    run.add_argument(
        "--backend",
        default="auto",
        help=f"auto (by device; env {dispatch.ENV_VAR} overrides) or one of "
        f"{', '.join(dispatch.BACKEND_NAMES)}",
    )
    run.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and router")
    run.add_argument("--skew", type=float, default=1.0, help="router load skew (0 = uniform)")
    run.add_argument(
        "--device", default=None, help="torch device (default: cuda if present, else cpu)"
    )
    run.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide H and I by N (rounded to multiples of 128) to fit large models in memory",
    )
    run.set_defaults(func=_cmd_run)
    sub.add_parser("models", help="list the model shapes").set_defaults(func=_cmd_models)
    sub.add_parser("backends", help="list the backends and whether they run here").set_defaults(
        func=_cmd_backends
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args, Console())


if __name__ == "__main__":
    sys.exit(main())
