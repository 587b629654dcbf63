"""Benchmark of the whole MoE expert-MLP backward (dX, dA, dW_gate_up, dW_down[, dB]) on one device.

Everything runs in one process on the same inputs: ``common.inputs.make_problem_for_model``
(seed 0) per shape. Rows per shape (``--impls`` keys in brackets):

- ``ours <backend>`` [torch, cuda-sm90, cuda-sm100]: ``common.dispatch.resolve_backend(name,
  device).run(problem)``. The ``torch`` row is the portable path (on CUDA it is given
  ``grouped_wgrad_default``, i.e. ``torch._grouped_mm``, so it does not silently pick up our
  SM90 wgrad kernel and duplicate the ``cuda-sm90`` row). A backend that cannot run prints why.
- ``ours (bf16 grads)`` [bf16]: ``cuda_kernels.moe.moe_backward_fused(problem,
  grad_dtype=torch.bfloat16)`` when importable (CUDA only).
- ``ours (layer state)`` [state]: the same fused call given what ``common.layer``'s forward
  saves for its backward (the grouped layout and the forward's BF16 X rows), so it skips the
  layout build and the X gather -- the state the baseline's autograd graph also holds.
- ``baseline`` [baseline]: torchtitan-style experts, the backward of two ``torch._grouped_mm``
  through autograd over rows already in expert order (X and dY gathered before timing; see
  ``benchmarks/_moe_baselines.py``). Timed: ``torch.autograd.grad(y_S, leaves, dY_S)``.
- ``baseline+perm`` [baseline+perm]: the same with the token gather/scatter inside autograd
  (leaf X [T, H], output ``index_add`` back to [T, H]).
- ``sonicmoe`` [sonicmoe]: SonicMoE's expert layer (``benchmarks/_moe_baselines.build_sonicmoe``),
  its autograd backward timed; SwiGLU problems only (no clamp, biases or gpt-oss activation), and
  a row says why it was skipped otherwise or when the package does not import.
- ``liger`` [liger]: optional peer, no adapter written: a row says why it was skipped.
- ``dense mm`` [dense]: one ``[R, H] @ [H, 6I]`` bf16 ``torch.mm``, the backward's FLOPs with no
  routing at all: the ceiling.

Columns: ms = median (``triton.testing.do_bench(return_mode="median")`` on CUDA with triton, else
a warm-up plus ``--reps`` timed runs); TFLOP/s counts ``12 * R * H * I`` (R = T * top_k);
``vs baseline`` / ``vs dense`` = their time / this time (> 1: this row is faster); ``peak extra
GiB`` = peak CUDA memory of one call above what was allocated before it. A second table breaks
one profiled call (after warm-up) into GEMM kernels (names matching :data:`GEMM_PATTERNS`) and the
rest; ``--profile-detail`` lists the top kernels. ``--check`` compares every row's gradients with
``common.reference.reference_backward`` (float64; SQNR, small shapes only). ``--json PATH`` writes
every number.

Usage: ``python benchmarks/bench_moe_backward.py [--shapes qwen3-30b-a3b:16384,deepseek-v3:2048:e32]
[--tokens T] [--shrink N] [--impls torch,baseline,...] [--device cuda|cpu] [--check]
[--profile auto|on|off] [--profile-detail] [--json PATH]``;
CPU smoke run: ``--device cpu --shrink 16 --tokens 64``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):  # _moe_baselines, and the repo root when not pip-installed
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _moe_baselines import build_autograd_baseline, build_sonicmoe  # noqa: E402

from common import dispatch  # noqa: E402
from common.inputs import make_problem_for_model  # noqa: E402
from common.models import load_model  # noqa: E402
from common.torch_backward import grouped_wgrad_default  # noqa: E402

DEFAULT_SHAPES = (
    "qwen3-30b-a3b:16384,qwen3-235b-a22b:16384,deepseek-v3:2048:e32,mixtral-8x7b:8192,"
    "gpt-oss-120b:16384"
)
IMPLS = (
    "torch", "cuda-sm90", "cuda-sm100", "bf16", "state", "baseline", "baseline+perm", "sonicmoe", "liger",
    "dense",
)  # fmt: skip
LABEL = {"bf16": "ours (bf16 grads)", "state": "ours (layer state)", "dense": "dense mm"}
LABEL.update({b: f"ours {b}" for b in ("torch", "cuda-sm90", "cuda-sm100")})

# Substrings that mark a profiled kernel as a GEMM: cuBLAS (sm90_xmma_gemm_*, nvjet_* on Hopper,
# *gemm*, splitK reduce), CUTLASS (torch._grouped_mm on SM90 is a cutlass::device_kernel<...>),
# CuTe DSL kernels (our wgrad kernel: names start with "kernel_cutlass_" / contain "cute"), and
# the aten GEMM ops seen by the CPU profiler. Kernel names are not known in advance: run with
# --profile-detail once on the GPU and extend this tuple if a GEMM lands in "non-GEMM".
GEMM_PATTERNS = (
    "gemm", "Gemm", "GEMM", "gemv", "wgmma", "cutlass", "sm90_xmma", "nvjet", "grouped",
    "kernel_cutlass", "cute", "splitK", "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm",
)  # fmt: skip


def parse_shapes(spec: str, tokens: int | None, shrink: int):
    """``name:T[:eN]`` items -> [(label, model, T)]; ``eN`` replaces E (the router then uses it)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, *rest = item.split(":")
        model = load_model(name)
        T = tokens if tokens is not None else int(rest[0]) if rest else 2048
        for opt in rest[1:]:
            if not opt.startswith("e"):
                raise ValueError(f"bad shape option {opt!r} in {item!r} (want eN)")
            E = int(opt[1:])
            model = dataclasses.replace(model, experts=E, name=f"{model.name}-e{E}", yaml_path="")
        if shrink != 1:
            model = model.shrink(shrink)
        label = (
            f"{model.name} T={T} (H{model.hidden} I{model.intermediate} E{model.experts} "
            f"K{model.top_k})"
        )
        out.append((label, model, T))
    return out


def make_timer(device: torch.device, reps: int):
    if device.type == "cuda":
        try:
            import triton.testing

            return lambda fn: triton.testing.do_bench(fn, return_mode="median") * 1e-3
        except ImportError:
            pass

    def bench(fn):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return bench


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_gib(fn, device: torch.device) -> float | None:
    """Peak memory of one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    del res
    return (peak - base) / 2**30


def profile_once(fn, device: torch.device, top: int = 12) -> dict:
    """One profiled call: kernel time (CUDA) or op self time (CPU) summed as GEMM vs the rest,
    and the ``top`` largest kernels (ops)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    times: dict[str, float] = {}
    if device.type == "cuda":
        for ev in prof.events():
            if ev.device_type == DeviceType.CUDA:
                times[ev.name] = times.get(ev.name, 0.0) + ev.time_range.elapsed_us() / 1e3
    else:
        for ev in prof.key_averages():
            times[ev.key] = times.get(ev.key, 0.0) + ev.self_cpu_time_total / 1e3
    gemm = sum(t for n, t in times.items() if any(p in n for p in GEMM_PATTERNS))
    total = sum(times.values())
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"total_ms": total, "gemm_ms": gemm, "other_ms": total - gemm, "top": ranked}


def peer_unavailable(impl: str) -> str:
    """Why an optional peer row is skipped (no adapter is written for an untested API)."""
    mod = {"sonicmoe": "sonicmoe", "liger": "liger_kernel.ops.fused_moe"}[impl]
    try:
        __import__(mod)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        return f"skipped: {mod} not installed ({type(exc).__name__})"
    return f"skipped: {mod} imports, but no adapter to this problem's layout is written yet"


def build_impl(impl: str, p, model, T: int, device: torch.device):
    """``(fn, to_grads or None)`` for one row; raises ``_Skip`` with the reason to print."""
    if impl in ("torch", "cuda-sm90", "cuda-sm100"):
        if impl != "torch" and device.type != "cuda":
            raise _Skip(f"skipped: needs a CUDA device (device is {device.type})")
        why = dispatch._unavailable_reason(impl)
        if why is not None:
            raise _Skip(f"skipped: {why}")
        backend = dispatch.resolve_backend(impl, device)
        opts = {"grouped_wgrad": grouped_wgrad_default} if impl == "torch" else {}
        return (lambda: backend.run(p, **opts)), (lambda g: g.named())
    if impl in ("bf16", "state"):
        if device.type != "cuda":
            raise _Skip("skipped: needs a CUDA device")
        try:
            from cuda_kernels.moe import moe_backward_fused
        except ImportError as exc:
            raise _Skip(f"skipped: {type(exc).__name__}: {exc}") from None
        kw = {"grad_dtype": torch.bfloat16}
        if impl == "state":
            from common.torch_backward import grouped_layout

            kw["layout"] = grouped_layout(p.plan, p.w_gate_up_EH2I.shape[0])
            kw["x_rows_S"] = kw["layout"].gather_rows(p.hidden_states_TH.bfloat16())
        return (lambda: moe_backward_fused(p, **kw)), (lambda g: g.named())
    if impl in ("baseline", "baseline+perm"):
        if device.type == "cuda" and not hasattr(torch, "_grouped_mm"):
            raise _Skip(f"skipped: torch {torch.__version__} has no torch._grouped_mm")
        return build_autograd_baseline(p, with_perm=impl == "baseline+perm")
    if impl == "sonicmoe":
        if device.type != "cuda":
            raise _Skip("skipped: needs a CUDA device")
        try:
            return build_sonicmoe(p)
        except ImportError as exc:
            raise _Skip(f"skipped: sonicmoe not installed ({type(exc).__name__}: {exc})") from None
        except NotImplementedError as exc:
            raise _Skip(f"skipped: {exc}") from None
    if impl == "liger":
        raise _Skip(peer_unavailable(impl))
    if impl == "dense":
        R, H, I = T * model.top_k, model.hidden, model.intermediate
        x = torch.randn(R, H, device=device, dtype=torch.bfloat16)
        w = torch.randn(H, 6 * I, device=device, dtype=torch.bfloat16)
        return (lambda: torch.mm(x, w)), None
    raise ValueError(f"unknown impl {impl!r}; choose from {IMPLS}")


class _Skip(Exception):
    pass


def _err(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"error: {type(exc).__name__}: {msg[:160]}".replace("|", "/")


def _extra(row: dict, key: str, compute, device: torch.device):
    """``row[key] = compute()``; on an exception, note it in ``row["errors"]`` and return None."""
    try:
        row[key] = compute()
        return row[key]
    except Exception as exc:  # noqa: BLE001 - an extra must not lose the row's timing
        row.setdefault("errors", {})[key] = _err(exc)
        print(f"<!-- {row['shape']} · {row['impl']} · {key}: {_err(exc)} -->", flush=True)
        _free(device)
        return None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_grads(got: dict, ref: dict) -> dict[str, float]:
    from common.metrics import sqnr_db

    return {k: sqnr_db(got[k], ref[k]) for k in ref if k in got}


def run_shape(label, model, T, args, device, bench, record) -> None:
    """Time (and optionally measure, profile, check) every selected row of one shape."""
    p = make_problem_for_model(model, T, seed=0, device=device)
    R, H, I = T * model.top_k, model.hidden, model.intermediate
    flops = 12 * R * H * I
    ref = None
    if args.check:
        from common.reference import reference_backward

        ref = reference_backward(p).named()
    rows = []
    for impl in args.impls:
        row = {"shape": label, "impl": LABEL.get(impl, impl), "key": impl}
        rows.append(row)
        fn = to_grads = None
        try:
            fn, to_grads = build_impl(impl, p, model, T, device)
            row["ms"] = bench(fn) * 1e3
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
            # Extras: a failure here keeps the timing and is noted in the row's JSON.
            _extra(row, "peak_extra_gib", lambda: peak_extra_gib(fn, device), device)
            if impl != "dense" and (
                args.profile == "on" or (args.profile == "auto" and device.type == "cuda")
            ):
                prof = _extra(row, "profile", lambda: profile_once(fn, device), device)
                if prof is not None:
                    record["profile"].append({"shape": label, "impl": row["impl"], **prof})
            if ref is not None and to_grads is not None:
                _extra(row, "sqnr_db", lambda: check_grads(to_grads(fn()), ref), device)
        except _Skip as why:
            row["status"] = str(why)
        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
            row["status"] = _err(exc)
        finally:
            fn = to_grads = None  # drop this row's graph / tensors before the next row
            _free(device)
    base = next((r["ms"] for r in rows if r["key"] == "baseline" and "ms" in r), None)
    dense = next((r["ms"] for r in rows if r["key"] == "dense" and "ms" in r), None)
    for r in rows:
        if "ms" in r:
            r["vs_baseline"] = base / r["ms"] if base else None
            r["vs_dense"] = dense / r["ms"] if dense else None
        print(_table_row(r), flush=True)
    record["rows"].extend(rows)


def _f(v, fmt: str) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _table_row(r: dict) -> str:
    if "ms" not in r:
        return f"| {r['shape']} | {r['impl']} | {r.get('status', '?')} | | | | |"
    tf = ".1f" if r["tflops"] >= 1 else ".4f"
    return (
        f"| {r['shape']} | {r['impl']} | {r['ms']:.3f} | {_f(r['tflops'], tf)} | "
        f"{_f(r.get('vs_baseline'), '.2f')} | {_f(r.get('vs_dense'), '.2f')} | "
        f"{_f(r.get('peak_extra_gib'), '.2f')} |"
    )


def header(device: torch.device) -> str:
    if device.type == "cuda":
        dev = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        dev = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "not installed"
    now = datetime.datetime.now(datetime.timezone.utc)
    return f"# {now:%Y-%m-%dT%H:%M:%SZ} · {dev} · torch {torch.__version__} · triton {tri}"


def print_profile(record: dict, device: torch.device, detail: bool) -> None:
    if not record["profile"]:
        return
    unit = "GPU kernel" if device.type == "cuda" else "CPU op self"
    print(f"\n| shape | impl | {unit} ms total | GEMM ms | non-GEMM ms | non-GEMM % |")
    print("|---|---|---|---|---|---|")
    for e in record["profile"]:
        pct = 100 * e["other_ms"] / e["total_ms"] if e["total_ms"] else float("nan")
        print(
            f"| {e['shape']} | {e['impl']} | {e['total_ms']:.3f} | {e['gemm_ms']:.3f} | "
            f"{e['other_ms']:.3f} | {_f(pct, '.1f')} |"
        )
    if detail:
        for e in record["profile"]:
            print(f"\nTop kernels, {e['shape']} · {e['impl']}:")
            for name, ms in e["top"]:
                kind = "GEMM" if any(p in name for p in GEMM_PATTERNS) else "other"
                print(f"- {ms:9.3f} ms  {kind:5s}  {name[:200]}")


def print_check(record: dict) -> bool:
    """Print the SQNR table; True when every gradient of every row is above 30 dB."""
    ok = True
    rows = [r for r in record["rows"] if "sqnr_db" in r]
    if rows:
        print("\n| shape | impl | SQNR dB vs float64 reference (per gradient) | ≥ 30 dB |")
        print("|---|---|---|---|")
    for r in rows:
        good = all(v > 30 for v in r["sqnr_db"].values())
        ok &= good
        cells = ", ".join(f"{k.split()[0]} {v:.1f}" for k, v in r["sqnr_db"].items())
        print(f"| {r['shape']} | {r['impl']} | {cells} | {'yes' if good else 'NO'} |")
    return ok


def bench_parser(doc: str, impls, profile_help: str) -> argparse.ArgumentParser:
    """The arguments both MoE benchmarks take (shapes, tokens, shrink, impls, device, reps,
    profile, check, json); a script adds its own before :func:`parse_bench_args`."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="name:T[:eN],... (default: %(default)s)"
    )
    ap.add_argument("--tokens", type=int, default=None, help="override T of every shape")
    ap.add_argument("--shrink", type=int, default=1, help="divide H and I (MoEModelShape.shrink)")
    ap.add_argument("--impls", default=",".join(impls), help="rows to run (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5, help="timed runs of the fallback timer")
    ap.add_argument("--profile", choices=("auto", "on", "off"), default="auto", help=profile_help)
    ap.add_argument("--profile-detail", action="store_true", help="print the top 12 kernels")
    ap.add_argument("--check", action="store_true", help="SQNR vs the float64 reference")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    return ap


def parse_bench_args(ap: argparse.ArgumentParser, argv, impls):
    """``(args, device, shapes, timer)``; ``args.impls`` a list, unknown ones an argparse error."""
    args = ap.parse_args(argv)
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in args.impls if i not in impls]
    if bad:
        ap.error(f"unknown --impls {bad}; choose from {list(impls)}")
    device = torch.device(args.device)
    return args, device, parse_shapes(args.shapes, args.tokens, args.shrink), make_timer(
        device, args.reps
    )


def main(argv=None) -> int:
    ap = bench_parser(__doc__, IMPLS, "profiler breakdown (auto: on CUDA only)")
    args, device, shapes, bench = parse_bench_args(ap, argv, IMPLS)
    record = {"header": header(device), "argv": sys.argv[1:], "rows": [], "profile": []}
    print(record["header"])
    columns = ("shape", "impl", "ms", "TFLOP/s", "vs baseline", "vs dense", "peak extra GiB")
    return run_all(shapes, run_shape, columns, args, device, bench, record)


def run_all(shapes, run_shape, columns, args, device, bench, record) -> int:
    """Print the table head, run every shape (a shape that fails prints one row saying why and
    the run goes on), the profile and ``--check`` tables, write ``--json``; the exit code."""
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns), flush=True)
    for label, model, T in shapes:
        try:
            run_shape(label, model, T, args, device, bench, record)
            _free(device)  # the shape's problem is gone with run_shape's frame
        except Exception as exc:  # noqa: BLE001 - e.g. OOM building the problem
            print(f"| {label} | (all) | {_err(exc)} |" + " |" * (len(columns) - 3), flush=True)
            record["rows"].append({"shape": label, "impl": "(all)", "status": _err(exc)})
            _free(device)
    print_profile(record, device, args.profile_detail)
    ok = print_check(record) if args.check else True
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
