"""``moe-bwd``: the package's command line.

    moe-bwd run --model qwen3-30b-a3b --tokens 2048 [--backend auto|NAME] [--seed S] [--shrink N]
                [--save DIR] [--routing FILE] [--weights PATH [--layer N]]
    moe-bwd compare A B ... [--baseline reference] [--min-sqnr DB] [--json] [--report DIR]
                [--routing FILE] [--weights PATH [--layer N]]
    moe-bwd models
    moe-bwd backends

``run`` builds one MoE layer's backward problem for a model's shape (seeded weights, a simulated
router, the forward checkpoint), runs the backward on the selected backend, runs the float64
reference on the same inputs, and prints one row per gradient: shape, SQNR (dB) and max
relative error against float64, plus wall times. ``--save DIR`` builds the inputs on the CPU
(bit-identical on every machine) and writes a gradient bundle (:mod:`common.bundle`).
``--routing FILE`` replaces the router simulation by a router dump and ``--weights PATH``
(``--layer N``) the seeded expert weights by one layer of a Hugging Face checkpoint (a file, an
index or its directory; :mod:`common.loaders`); a bundle records their sha256, and ``compare``
needs the same files again to re-create its problem.

``compare`` takes bundle directories and/or backend names (run here on the same problem: the
bundles' problem, or ``--model``/``--tokens``/``--seed``/``--skew``/``--shrink``) and reports every
operand against the baseline (default the float64 reference): SQNR, max |err| / max |ref|,
cosine, bit-identical fraction, BF16 ULP histogram, per-expert SQNR (:mod:`common.compare`);
``--report DIR`` adds Markdown + PNG plots (:mod:`common.report`); ``--min-sqnr DB`` exits 1
when any gradient of any operand falls below the floor.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from common import dispatch
from common.metrics import all_finite, compare
from common.models import list_models, load_model

__all__ = ["main"]


def _compact_table(title: str) -> Table:
    """A table that fits 80 columns: no outer edge, one space of padding between cells."""
    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 collapse_padding=True)


def _cmd_models(args, console: Console) -> int:
    table = _compact_table("MoE model shapes (configs/models)")
    for col in ("name (--model)", "H", "I", "E", "K", "shr", "router", "activation", "bias"):
        table.add_column(
            col,
            justify="right" if col in ("H", "I", "E", "K", "shr") else "left",
            no_wrap=True,  # never truncate: swiglu and swiglu_clamped must stay apart
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
    console.print(
        "H hidden, I expert intermediate, E routed experts, K = top_k (experts per token), "
        "shr shared experts; swiglu_clamped = gpt-oss's clamped SwiGLU. The router weight "
        "scales each expert's output, except:",
        highlight=False,
    )
    for m in list_models():
        if m.affinity_on != "output":
            console.print(
                f"  {m.name}: it scales the expert {m.affinity_on} (not computed here; "
                "`moe-bwd run` refuses it)",
                highlight=False,
            )
    return 0


def _cmd_backends(args, console: Console) -> int:
    table = Table(title=f"Backends (auto on this machine: {dispatch.auto_backend_name()})")
    table.add_column("name", no_wrap=True)
    table.add_column("runs here", no_wrap=True)
    table.add_column("what it is / why it cannot run here")
    for name, b in sorted(dispatch.registered_backends().items()):
        reason = b.check()
        text = Text(b.summary)  # every row says what the backend is
        if reason is not None:
            text.append("\nnot here: ", style="bold")
            text.append(reason)
        table.add_row(name, "yes" if reason is None else "no", text)
    console.print(table)
    return 0


class _Failed(Exception):
    """A user error: printed to stderr as ``error: ...``, exit code 2."""


def _usable_device(name: str | None) -> str:
    """``--device`` (default: cuda if present, else cpu), checked: _Failed naming it when torch
    cannot allocate there or when it holds no data (``meta``: every value the job reads back
    would be missing)."""
    device = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.empty(0, device=device).device.type
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise _Failed(f"--device {device!r} cannot be used here: {exc}") from None
    if kind == "meta":
        raise _Failed(f"--device {device!r} holds no data (shapes only): use cpu or cuda")
    return device


def _error(msg: str) -> int:
    from rich.markup import escape  # a message's own brackets ('[report]', '[T, K]') stay text

    Console(stderr=True, highlight=False).print(f"[red]error:[/red] {escape(msg)}")
    return 2


class _Steps:
    """Progress of a command: a rich spinner on a terminal, else plain lines on stderr (so that
    logs and pipes see progress and ``--json`` output stays clean)."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.progress = None
        self.task = None
        self.err = Console(stderr=True, highlight=False)

    def __enter__(self) -> _Steps:
        if self.console.is_terminal:
            self.progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                console=self.console, transient=True,
            )
            self.progress.__enter__()
            self.task = self.progress.add_task("", total=self.total)
        return self

    def step(self, description: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done - 1, description=description)
        else:
            self.err.print(f"[{self.done}/{self.total}] {description}", markup=False)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:  # once: a command may close it before printing results
            self.progress.__exit__(*exc)
            self.progress = None


def shrink_note(full, small, factor: int) -> str:
    """What ``--shrink factor`` did to H and I, exactly: e.g. ``"H, I divided by 8 and rounded
    to the nearest multiple of 128 (at least 128): H 2880/8 = 360 -> 384, I 2880/8 = 360 -> 384"``
    (``"H, I divided by 16: H 2048 -> 128, ..."`` when no dimension needed rounding)."""
    parts, rounded = [], False
    for sym, n, m in (("H", full.hidden, small.hidden), ("I", full.intermediate,
                                                         small.intermediate)):
        if m * factor == n:
            parts.append(f"{sym} {n} -> {m}")
        else:
            rounded = True
            parts.append(f"{sym} {n}/{factor} = {n / factor:g} -> {m}")
    how = f"H, I divided by {factor}"
    if rounded:
        how += " and rounded to the nearest multiple of 128 (at least 128)"
    return f"{how}: {', '.join(parts)}"


def _activation_name(model) -> str:
    return model.expert_activation()[0].name


def _cmd_run(args, console: Console) -> int:
    try:
        return _run(args, console)
    except _Failed as exc:
        return _error(str(exc))


def _run(args, console: Console) -> int:
    import json

    from common.bundle import ProblemSpec, build_problem, collect_metadata, save_bundle
    from common.inputs import make_problem_for_model
    from common.reference import reference_backward

    try:
        model = load_model(args.model)
    except ValueError as exc:
        raise _Failed(str(exc)) from None
    if model.affinity_on != "output":  # before any work (make_problem_for_model refuses too)
        raise _Failed(
            f"--model {model.name}: the model applies the router affinity to the expert input "
            f"(affinity_on={model.affinity_on!r}); this package computes output-scaled experts "
            "only, so its gradients would be of another function"
        )
    if args.tokens is not None and args.tokens < 1:
        raise _Failed(f"--tokens must be >= 1, got {args.tokens}")
    if args.shrink < 1:
        raise _Failed(f"--shrink must be an int >= 1, got {args.shrink}")
    if args.layer is not None and args.weights is None:
        raise _Failed("--layer is only used with --weights PATH")
    layer = args.layer if args.layer is not None else 0  # the layer --weights reads
    if args.save is not None:  # before any work: the cheap checks (file, other files, access)
        _check_save_target(args.save, None, args.force)
    full_model = model
    try:
        model = model.shrink(args.shrink)  # shrink(1) is the identity, as in the API
    except ValueError as exc:
        raise _Failed(str(exc)) from None
    try:
        routing = _load_routing_arg(args, model)
    except ValueError as exc:
        raise _Failed(str(exc)) from None
    if routing is not None and args.tokens is None:
        args.tokens = int(routing[0].shape[0])
    device = _usable_device(args.device)
    if not (args.skew >= 0 and args.skew != float("inf")):
        raise _Failed(f"--skew must be a finite number >= 0, got {args.skew}")
    try:
        backend = dispatch.resolve_backend(args.backend, device)
    except (ValueError, RuntimeError) as exc:
        raise _Failed(str(exc)) from None
    dims = {"T": args.tokens, "H": model.hidden, "I": model.intermediate, "E": model.experts,
            "K": model.top_k, "activation": _activation_name(model)}
    why = backend.check_shape(dims) if backend.check_shape is not None else None
    if why is not None:  # before any input is built
        hint = "; --shrink N rounds H and I to multiples of 128" if "multiples of" in why else ""
        raise _Failed(f"backend {backend.name} cannot run {model.display_name}: {why}{hint}")

    need = _bytes_needed(model, args.tokens, reference=not args.no_reference)
    have = _memory_available(device)
    if have is not None and need > have:
        raise _Failed(
            f"{model.display_name} needs about {need / 2**30:.0f} GiB on {device} "
            f"(weights, gradients and their float64 reference for E={model.experts} experts), "
            f"{have / 2**30:.0f} GiB are available; pass --shrink N to divide H and I by N"
        )
    spec = None
    if args.save is not None:  # the problem's spec, then whether --save may hold its bundle
        try:
            spec = ProblemSpec.for_model(
                model, args.tokens, seed=args.seed, skew=args.skew, shrink=args.shrink,
                **_file_digests(args, model),
            )
        except (ValueError, OSError) as exc:
            raise _Failed(str(exc)) from None
        _check_save_target(args.save, spec, args.force)
    times: dict[str, float] = {}
    run_start = time.perf_counter()
    n_steps = 2 + (0 if args.no_reference else 2) + (args.save is not None)
    with _Steps(console, n_steps) as steps:
        steps.step("building inputs (weights, router, forward checkpoint)")
        t0 = time.perf_counter()
        try:
            if spec is not None:  # --save: on the CPU, the same bits on every machine
                problem = build_problem(spec, device, routing_file=args.routing,
                                        weights_file=args.weights)
            else:
                weights = None
                if args.weights is not None:
                    from common.loaders import load_expert_weights

                    weights = load_expert_weights(args.weights, model, layer=layer)
                problem = make_problem_for_model(
                    model, args.tokens, seed=args.seed, device=device, skew=args.skew,
                    routing=routing, weights=weights,
                )
        except (ValueError, OSError) as exc:
            raise _Failed(str(exc)) from None
        times["inputs"] = time.perf_counter() - t0
        steps.step(f"backward on {backend.name}")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            grads = backend.run(problem)
        except (ValueError, RuntimeError) as exc:
            msg = str(exc)  # a backend's own message may already name it
            named = msg.startswith((f"backend {backend.name}", f"backend {backend.name!r}"))
            raise _Failed(msg if named else f"backend {backend.name}: {msg}") from None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times["backend"] = time.perf_counter() - t0
        ref = None
        if not args.no_reference:
            steps.step("float64 reference backward")
            t0 = time.perf_counter()
            ref = reference_backward(problem)
            times["reference"] = time.perf_counter() - t0
            steps.step("comparing every gradient with float64 (SQNR, max error)")

        t0 = time.perf_counter()
        rows = []
        worst = float("inf")
        for name, out in grads.named().items():
            row = {"gradient": name, "shape": list(out.shape)}
            if ref is not None:  # compare's sums tell finiteness (SQNR NaN): no extra pass
                m = compare(out, ref.named()[name])
                row.update(finite=not math.isnan(m["sqnr_db"]), sqnr_db=m["sqnr_db"],
                           max_rel_err=m["max_rel_err"])
                worst = min(worst, m["sqnr_db"])  # (min keeps worst when the SQNR is NaN)
            else:
                row["finite"] = all_finite(out)
                lo, hi = torch.aminmax(out) if out.numel() else (0.0, 0.0)  # no |out| copy
                row["max_abs"] = max(float(hi), -float(lo))
            if not row["finite"]:
                worst = math.nan
            rows.append(row)
        times["comparison"] = time.perf_counter() - t0
        saved = None
        if args.save is not None:
            steps.step(f"saving the bundle to {args.save}")
            t0 = time.perf_counter()
            try:
                saved = save_bundle(
                    args.save, spec, problem, grads,
                    collect_metadata(backend.name, device, times, grads.info), force=args.force,
                )
            except (ValueError, OSError) as exc:
                raise _Failed(f"--save {exc}") from None  # the message starts with the path
            times["save"] = time.perf_counter() - t0
    times["total"] = time.perf_counter() - run_start

    d = problem.dims
    flops = 12 * d["T"] * d["K"] * d["H"] * d["I"]
    if args.json:
        result = {
            "model": model.name, "display_name": model.display_name, "shrink": args.shrink,
            "dims": d, "backend": backend.name, "fallback_reason": backend.fallback_reason,
            "device": device, "activation": problem.activation.name, "gradients": rows,
            "wall_s": times, "backend_gflops": flops / times["backend"] / 1e9 if times[
                "backend"] > 0 else None,
            "nki_phases": grads.info.get("nki_phases"),
            "bundle": str(saved) if saved is not None else None,
            "routing_file": args.routing, "weights_file": args.weights,
            "layer": layer if args.weights is not None else None,
        }
        print(json.dumps(result, indent=2, allow_nan=True))
        return 1 if math.isnan(worst) else 0

    note = f" (auto fell back: {backend.fallback_reason})" if backend.fallback_reason else ""
    shrunk = (
        f" [yellow](shrunk: {shrink_note(full_model, model, args.shrink)})[/yellow]"
        if args.shrink != 1 else ""
    )
    console.print(
        f"[bold]{model.display_name}[/bold]{shrunk}  T={d['T']} H={d['H']} I={d['I']} "
        f"E={d['E']} top_k={d['K']}  backend=[bold]{backend.name}[/bold]{note}  device={device}"
    )
    if args.routing is not None or args.weights is not None:
        console.print(
            f"inputs: routing {args.routing or 'simulated'}; weights "
            + (f"{args.weights} (layer {layer})" if args.weights else "seeded"),
            markup=False, highlight=False,
        )
    act = problem.activation
    console.print(
        f"activation: {act.name} (h = silu(g) * u)"
        if act.is_swiglu
        else f"activation: {act.name} (h = g * sigmoid({act.alpha:g} g) * (u + {act.up_offset:g}))"
    )
    if ref is not None:
        table = Table(title="gradients vs float64 reference")
        cols = ("gradient", "shape", "SQNR (dB)", "max|err| / max|ref|")
    else:
        table = Table(title="gradients (--no-reference: no float64 comparison)")
        cols = ("gradient", "shape", "max|g|", "finite")
    for col in cols:
        table.add_column(col, justify="left" if col in ("gradient", "shape") else "right")
    for row in rows:
        shape = "x".join(map(str, row["shape"]))
        if ref is not None:
            table.add_row(row["gradient"], shape, f"{row['sqnr_db']:.1f}",
                          f"{row['max_rel_err']:.2e}")
        else:
            table.add_row(row["gradient"], shape, f"{row['max_abs']:.3e}",
                          "yes" if row["finite"] else "NO")
    console.print(table)
    parts = [f"inputs {times['inputs']:.2f} s",
             f"backend {times['backend']:.2f} s ({flops / max(times['backend'], 1e-12) / 1e9:.3g}"
             f" GFLOP/s of {flops / 1e9:.3g} GFLOP)"]
    if "reference" in times:
        parts.append(f"float64 reference {times['reference']:.2f} s")
    parts.append(f"comparison {times['comparison']:.2f} s")
    if "save" in times:
        parts.append(f"save {times['save']:.2f} s")
    console.print(f"wall time: {', '.join(parts)}; total {times['total']:.2f} s")
    if saved is not None:
        console.print(f"bundle saved: {saved}")
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
        Console(stderr=True).print("[red]a gradient holds NaN or inf[/red]")
        return 1
    return 0


def _check_save_target(path: str, spec, force: bool) -> None:
    """``--save DIR`` can hold this problem's bundle (:func:`common.bundle.check_bundle_destination`):
    _Failed (exit 2) naming the option once, before any work."""
    from common.bundle import check_bundle_destination

    try:
        check_bundle_destination(path, spec, force=force, force_hint="--force")
    except ValueError as exc:
        raise _Failed(f"--save {exc}") from None  # the message starts with the path


def _check_report_target(path: str) -> None:
    """``--report DIR`` is a directory, or can become one, that we can write into: _Failed
    (exit 2) before any work, as is a missing matplotlib (the ``report`` extra). Nothing stays
    behind (:func:`common.bundle.check_creatable_dir`)."""
    import importlib.util

    from common.bundle import check_creatable_dir

    if importlib.util.find_spec("matplotlib") is None:
        raise _Failed(
            "--report draws its plots with matplotlib, which is not installed: "
            "pip install 'moe-bwd-kernels[report]' (or matplotlib==3.11.2)"
        )
    try:
        check_creatable_dir(path)
    except ValueError as exc:
        raise _Failed(f"--report {exc}") from None  # the message starts with the path


def _load_routing_arg(args, model):
    """``(expert_index, affinity)`` of ``--routing`` (checked against the model and
    ``--tokens``), or None."""
    if getattr(args, "routing", None) is None:
        return None
    from common.loaders import load_routing

    return load_routing(args.routing, num_experts=model.experts, top_k=model.top_k,
                        num_tokens=args.tokens)


def _file_digests(args, model) -> dict:
    """Spec fields of ``--routing`` / ``--weights`` (sha256, layer); empty when neither."""
    from common.loaders import file_sha256, weights_sha256

    out = {}
    if getattr(args, "routing", None) is not None:
        out["routing_sha256"] = file_sha256(args.routing)
    if getattr(args, "weights", None) is not None:
        out["layer"] = args.layer if args.layer is not None else 0
        out["weights_sha256"] = weights_sha256(args.weights, model, out["layer"])
    return out


def _add_real_input_args(p, *, compare: bool = False) -> None:
    p.add_argument(
        "--routing", default=None, metavar="FILE",
        help="router dump (.pt / .safetensors / .npz with expert_index and affinity [T, K]) "
        "instead of the router simulation" + ("; T sets --tokens when that is not given"
                                              if not compare else ""),
    )
    p.add_argument(
        "--weights", default=None, metavar="PATH",
        help="one MoE layer's routed experts from a Hugging Face checkpoint instead of seeded "
        "weights: a .safetensors file, a sharded checkpoint's index .json or its directory "
        "(only the layer's shards are read; H and I must match the model, after --shrink)",
    )
    p.add_argument("--layer", type=int, default=None, metavar="N",
                   help="decoder layer read from --weights" + ("" if compare else " (default 0)"))


def _memory_parts(model, num_tokens: int, reference: bool = True) -> dict[str, int]:
    """The terms of :func:`_bytes_needed`, in bytes (W = E H 3I weight elements).

    * ``base``: the interpreter, torch and the libraries, 0.3 GiB;
    * ``weights``: the BF16 expert weights, 2 W;
    * ``grads``: the backend's fp32 weight gradients, 4 W;
    * ``reference``: the float64 reference's weight gradients, 8 W (0 with --no-reference);
    * ``expert_f64``: the reference's per-expert temporaries: one float64 weight matrix and one
      float64 GEMM result of H x I, plus one of slack, 3 * 8 H I (0 with --no-reference);
    * ``rows``: per routed row (T K of them) activations, checkpoint and their gradients,
      16 (H + 3I) bytes.

    The peak is at the end of the reference, when all of these are alive; the comparison works
    in float64 chunks of 32 MiB and adds nothing measurable.
    """
    E, H, I = model.experts, model.hidden, model.intermediate
    W = E * H * 3 * I
    return {
        "base": int(0.3 * 2**30),
        "weights": 2 * W,
        "grads": 4 * W,
        "reference": 8 * W if reference else 0,
        "expert_f64": 3 * 8 * H * I if reference else 0,
        "rows": 16 * num_tokens * model.top_k * (H + 3 * I),
    }


def _bytes_needed(model, num_tokens: int, reference: bool = True) -> int:
    """Estimated peak resident bytes of `run` on the CPU: the sum of :func:`_memory_parts`.

    Measured (``/usr/bin/time -v``, torch backend on the CPU): qwen3-30b-a3b --tokens 2048
    8.58 GiB (estimate 9.27), gpt-oss-20b --tokens 64 11.08 GiB (estimate 10.91), mixtral-8x7b
    --tokens 64 19.25 GiB (estimate 20.08; 2026-12-02, 2-core CPU machine, 63 s).
    """
    return sum(_memory_parts(model, num_tokens, reference).values())


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


def _compare_problem(args, bundle_paths: list[str]):
    """(spec, CPU problem) of a compare: the bundles' spec or the command line's."""
    from common.bundle import ProblemSpec, build_problem, read_manifest

    if bundle_paths:
        specs = [(p, read_manifest(p)["spec"]) for p in bundle_paths]
        first_path, spec = specs[0]
        for p, other in specs[1:]:
            if other != spec:
                raise ValueError(
                    f"bundles {first_path} and {p} are of different problems: "
                    f"{spec.differences(other)}"
                )
        given = [f"--{k}" for k in ("model", "tokens") if getattr(args, k) is not None]
        if given:
            raise ValueError(
                f"the problem comes from the bundle(s); drop {' and '.join(given)}"
            )
        if args.layer is not None and args.layer != spec.layer:
            raise ValueError(
                f"--layer {args.layer}: the bundle(s) were made from layer {spec.layer}"
            )
    else:
        if args.model is None or (args.tokens is None and args.routing is None):
            raise ValueError(
                "no bundle among the operands: give the problem with --model and --tokens "
                "(or --routing FILE)"
            )
        model = load_model(args.model)
        if args.tokens is not None and args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
        if args.shrink < 1:
            raise ValueError(f"--shrink must be an int >= 1, got {args.shrink}")
        model = model.shrink(args.shrink)  # shrink(1) is the identity
        routing = _load_routing_arg(args, model)  # checks it before any work
        tokens = args.tokens if args.tokens is not None else int(routing[0].shape[0])
        if args.layer is not None and args.weights is None:
            raise ValueError("--layer is only used with --weights PATH")
        spec = ProblemSpec.for_model(
            model, tokens, seed=args.seed, skew=args.skew, shrink=args.shrink,
            **_file_digests(args, model),
        )
    return spec, build_problem(spec, "cpu", routing_file=args.routing,
                               weights_file=args.weights)


def _cmd_compare(args, console: Console) -> int:
    from common.bundle import is_bundle

    if args.min_sqnr is not None and not math.isfinite(args.min_sqnr):
        return _error(f"--min-sqnr must be a finite number (dB), got {args.min_sqnr}")
    if args.report is not None:
        try:
            _check_report_target(args.report)
        except _Failed as exc:
            return _error(str(exc))
    operands = list(args.operands)
    baseline = args.baseline
    names = set(dispatch.BACKEND_NAMES) | set(dispatch.registered_backends())
    kinds = {}
    for op in operands + [baseline]:
        if is_bundle(op):
            kinds[op] = "bundle"
        elif op in names:
            kinds[op] = "backend"
        else:
            return _error(
                f"{op!r} is neither a bundle directory (with bundle.json) nor "
                f"a backend ({', '.join(sorted(names))})"
            )
    try:
        device = _usable_device(args.device)
    except _Failed as exc:
        return _error(str(exc))
    times: dict[str, float] = {}
    unique = list(dict.fromkeys(operands + [baseline]))
    steps = _Steps(console, 2 + len(unique) + (args.report is not None))
    steps.__enter__()
    try:
        return _compare_steps(args, console, steps, kinds, operands, baseline, unique, device,
                              times)
    finally:
        steps.__exit__(None, None, None)


def _compare_steps(args, console, steps, kinds, operands, baseline, unique, device, times):
    """The body of ``compare`` after its checks, announcing each step on ``steps``."""
    import json

    from common.bundle import (
        check_digests,
        collect_metadata,
        input_digests,
        is_bundle,
        load_bundle,
        problem_to,
    )
    from common.compare import GRAD_LABELS, compare_grads, routed_mask_TE

    try:
        steps.step("building the problem's inputs")
        t0 = time.perf_counter()
        spec, problem = _compare_problem(args, [op for op in kinds if kinds[op] == "bundle"])
        times["inputs"] = time.perf_counter() - t0
        digests = input_digests(problem)
        results: dict[str, tuple] = {}  # operand -> (label, grads, metadata)
        on_device = None
        for op in unique:
            steps.step(f"loading bundle {op}" if kinds[op] == "bundle" else
                       "float64 reference backward" if op == "reference" else f"backward on {op}")
            t0 = time.perf_counter()
            if kinds[op] == "bundle":
                b = load_bundle(op, check_inputs=False)
                check_digests(b.inputs_sha256, digests, where=str(b.path / "bundle.json"))
                # backend@device plus the directory: two CPU bundles stay apart
                results[op] = (f"{b.label} ({b.path.resolve().name})", b.grads, b.metadata)
            else:
                backend = dispatch.resolve_backend(op, device)
                dims = {"T": spec.tokens, "H": spec.hidden, "I": spec.intermediate,
                        "E": spec.experts, "K": spec.top_k,
                        "activation": problem.activation.name}
                why = backend.check_shape(dims) if backend.check_shape is not None else None
                if why is not None:
                    raise ValueError(f"backend {backend.name} cannot run this problem: {why}")
                if on_device is None:
                    on_device = problem_to(problem, device)
                w0 = time.perf_counter()
                grads = backend.run(on_device)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                meta = collect_metadata(
                    backend.name, device, {"backend": time.perf_counter() - w0}, grads.info
                )
                results[op] = (backend.name, grads, meta)
            times[f"load/run {op}"] = time.perf_counter() - t0
    except (ValueError, RuntimeError) as exc:
        return _error(str(exc))

    labels: dict[str, str] = {}
    for op, (label, _, _) in results.items():
        lab, i = label, 2
        while lab in labels.values():
            lab, i = f"{label}#{i}", i + 1
        labels[op] = lab
    base_label = labels[baseline]
    base_grads = results[baseline][1]
    steps.step(f"comparing with {base_label} (SQNR, cosine, ULP histogram, per expert)")
    t0 = time.perf_counter()
    routed = routed_mask_TE(problem.plan)  # dA: bit-identical / ULP over routed cells only
    pairs = {
        labels[op]: compare_grads(results[op][1], base_grads, routed_TE=routed)
        for op in dict.fromkeys(operands)
        if op != baseline
    }
    times["comparison"] = time.perf_counter() - t0
    comparison = {
        "baseline": base_label,
        "spec": spec.to_json(),
        "operands": {labels[op]: results[op][2] for op in results},
        "tokens_per_expert": problem.plan.tokens_per_expert_E.tolist(),
        "pairs": pairs,
        "wall_s": times,
    }
    # Non-finite gradients fail the comparison whatever --min-sqnr says (as `run` fails).
    non_finite = [
        f"{labels[op]} {GRAD_LABELS[name].split()[0]}"
        for op in results
        for name in GRAD_LABELS
        if getattr(results[op][1], name, None) is not None
        and not all_finite(getattr(results[op][1], name))
    ]
    comparison["non_finite"] = non_finite
    failing = []
    if args.min_sqnr is not None:
        for lab, pair in pairs.items():
            for name, m in pair.items():
                if not m["sqnr_db"] >= args.min_sqnr:  # NaN fails too
                    failing.append(f"{lab} {GRAD_LABELS[name]} {m['sqnr_db']:.1f} dB")
        comparison["min_sqnr_db"] = args.min_sqnr
        comparison["below_min_sqnr"] = failing
    if args.report is not None:
        from common.report import write_report

        steps.step(f"writing the report (Markdown, PNG plots) to {args.report}")
        try:
            md = write_report(
                args.report, comparison, {labels[op]: results[op][1] for op in operands
                                          if op != baseline}, base_grads,
            )
        except OSError as exc:  # checked before any work; a race or a full disk
            return _error(f"--report {args.report}: cannot write the report ({exc.strerror or exc})")
        comparison["report"] = str(md)
    steps.__exit__(None, None, None)  # the spinner goes before the results are printed
    if args.json:
        print(json.dumps(comparison, indent=2, allow_nan=True))
    else:
        _print_comparison(console, comparison)
    if non_finite:
        from rich.markup import escape

        Console(stderr=True, highlight=False).print(
            "[red]NaN or inf in the gradients of:[/red] " + escape("; ".join(non_finite))
        )
    if failing and not args.json:
        console.print(
            f"[red]below --min-sqnr {args.min_sqnr:g} dB:[/red] " + "; ".join(failing)
        )
    return 1 if failing or non_finite else 0


def _print_comparison(console: Console, comparison: dict) -> None:
    from common.compare import GRAD_LABELS

    spec = comparison["spec"]
    shrunk = ""
    if spec["shrink"] != 1:
        try:
            full = load_model(spec["model"])
            small = full.scaled(hidden=spec["hidden"], intermediate=spec["intermediate"])
            shrunk = f" [yellow](shrunk: {shrink_note(full, small, spec['shrink'])})[/yellow]"
        except ValueError:
            shrunk = f" [yellow](shrunk: H, I divided by {spec['shrink']})[/yellow]"
    console.print(
        f"[bold]{spec['model']}[/bold]{shrunk}  T={spec['tokens']} H={spec['hidden']} "
        f"I={spec['intermediate']} E={spec['experts']} top_k={spec['top_k']}  "
        f"baseline=[bold]{comparison['baseline']}[/bold]"
    )
    for label, pair in comparison["pairs"].items():
        table = _compact_table(f"{label} vs {comparison['baseline']}")
        for col in ("gradient", "SQNR dB", "max err", "cosine", "bit-id", "ULP<=1",
                    "expert dB min/med/max"):
            table.add_column(col, justify="left" if col == "gradient" else "right", no_wrap=True)
        for name, m in pair.items():
            h = m["ulp_hist"]
            total = sum(h.values()) or 1
            pe = m.get("per_expert")
            per = "/".join(f"{pe[k]:.1f}" for k in ("min", "median", "max")) if pe else ""
            table.add_row(
                GRAD_LABELS[name].split()[0], f"{m['sqnr_db']:.1f}", f"{m['max_rel_err']:.2e}",
                f"{m['cosine']:.6f}", f"{m['bit_identical']:.3f}",
                f"{(h['0'] + h['1']) / total:.3f}", per,
            )
        console.print(table)
    console.print(
        "max err = max|err| / max|ref|; bit-id = share of bit-identical elements; ULP<=1 = "
        "share within 1 BF16 ULP (for dA both over the routed (token, expert) cells only, not "
        "the structural zeros); expert dB = per-expert SQNR min/median/max; shapes and full "
        "histograms: --json",
        highlight=False,
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` only where it says something: not for required options, options
    without a default (None), flags (False), or help that already names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.required or action.default is None or action.default is False
                or "default" in text):
            return text
        return super()._get_help_string(action)


def _add_compare_parser(sub) -> None:
    cmp = sub.add_parser(
        "compare",
        help="compare bundles and/or backends on one problem, per gradient and per expert",
        description="Compare gradient bundles and/or backends run here on one problem, against "
        "a baseline (default the float64 reference): per gradient and per expert.",
        formatter_class=_HelpFormatter,
    )
    cmp.add_argument(
        "operands", nargs="+", metavar="OPERAND",
        help="a bundle directory (moe-bwd run --save) or a backend name run here",
    )
    cmp.add_argument(
        "--baseline", default="reference",
        help="what every operand is compared against: a backend name or a bundle directory",
    )
    cmp.add_argument("--model", default=None, help="model (when no operand is a bundle)")
    cmp.add_argument("--tokens", type=int, default=None, help="tokens T (when no bundle)")
    cmp.add_argument("--seed", type=int, default=0, help="seed (when no bundle)")
    cmp.add_argument("--skew", type=float, default=1.0, help="router load skew (when no bundle)")
    cmp.add_argument("--shrink", type=int, default=1,
                     help="divide H and I by N, rounded to the nearest multiple of 128 "
                     "(when no bundle)")
    cmp.add_argument("--device", default=None, help="device of backend operands (default: cuda if present, else cpu)")
    _add_real_input_args(cmp, compare=True)
    cmp.add_argument(
        "--min-sqnr", type=float, default=None, metavar="DB",
        help="exit 1 when any gradient of any operand has an SQNR below DB",
    )
    cmp.add_argument("--json", action="store_true", help="print the comparison as JSON")
    cmp.add_argument("--report", default=None, metavar="DIR",
                     help="write report.md and PNG plots to DIR")
    cmp.set_defaults(func=_cmd_compare)


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("moe-bwd-kernels")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-bwd", description="MoE expert-MLP backward kernels: run, compare, list."
    )
    parser.add_argument("--version", action="version", version=f"moe-bwd {_package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run one MoE layer's backward and compare it with float64",
        description="Run one MoE layer's backward for a model's shape on a backend and compare "
        "every gradient with the float64 reference. Threads: torch uses one per physical core "
        "available to the process (CPU affinity, cgroup quota) unless OMP_NUM_THREADS or "
        "MKL_NUM_THREADS is set; on a machine shared with other jobs, OMP_NUM_THREADS=1 can be "
        "several times faster.",
        formatter_class=_HelpFormatter,
    )
    run.add_argument("--model", required=True, help="model shape name (see `moe-bwd models`)")
    run.add_argument("--tokens", type=int, default=None,
                     help="tokens T in the batch (required unless --routing gives it)")
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
        help="divide H and I by N, rounded to the nearest multiple of 128 (at least 128), to "
        "fit large models in memory; 1 = full size, unchanged",
    )
    run.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write a gradient bundle (spec, input digests, gradients, metadata) to DIR; "
        "inputs are then built on the CPU. DIR may be new, empty, or hold a bundle of the same "
        "problem (replaced); checked before any work",
    )
    run.add_argument(
        "--force", action="store_true",
        help="let --save replace a bundle of another problem",
    )
    run.add_argument(
        "--no-reference", action="store_true",
        help="skip the float64 reference (print gradient magnitudes instead of errors)",
    )
    run.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    _add_real_input_args(run)
    run.set_defaults(func=_cmd_run, subparser=run)
    _add_compare_parser(sub)
    sub.add_parser(
        "models", help="list the model shapes",
        description="List the MoE model shapes of configs/models (what --model takes).",
    ).set_defaults(func=_cmd_models)
    sub.add_parser(
        "backends", help="list the backends and whether they run here",
        description="List the backends, whether each runs on this machine, and what each is.",
    ).set_defaults(func=_cmd_backends)
    return parser


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def physical_cores_available() -> int:
    """Physical cores among the CPUs this process may run on (``os.sched_getaffinity``; SMT
    siblings count once, from ``/sys/devices/system/cpu/cpu*/topology``), capped by a cgroup
    v2 CPU quota (``/sys/fs/cgroup/cpu.max``) when there is one; at least 1."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        topo = f"/sys/devices/system/cpu/cpu{c}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        except OSError:
            cores.add(("cpu", str(c)))  # no topology: count the logical CPU
    n = len(cores) or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def set_default_threads() -> int | None:
    """Set torch's intra-op threads to :func:`physical_cores_available` unless the user chose
    (``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` set): more threads than cores, or threads on SMT
    siblings, oversubscribe a small machine (a loaded 2-core machine ran 10-40x slower).
    Returns the number set, or None when the environment decides."""
    import os

    if any(os.environ.get(v) for v in _THREAD_ENV):
        return None
    n = physical_cores_available()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    set_default_threads()
    if args.command == "run" and args.tokens is None and args.routing is None:
        args.subparser.error(  # the `run` usage, not the top-level one
            "the following arguments are required: --tokens (or --routing FILE)"
        )
    return args.func(args, Console())


if __name__ == "__main__":
    sys.exit(main())
