"""Benchmark of the MoE expert layer's whole training step (forward + backward) on one device.

Everything runs in one process on the same inputs: ``common.inputs.make_problem_for_model``
(seed 0) per shape. Rows per shape (``--impls`` keys in brackets):

- ``ours`` [ours]: the layer as the README tells a user to call it:
  ``layer = MoEExperts.from_model(shape, device=...)`` (E, H, I, biases, activation and clamp of
  the shape; default options: ``validate_routing="device"``, backend "auto"), the problem's
  weights copied in; ``y = layer(x, expert_index_TK, affinity_TK)`` with ``x`` [T, H] BF16 and
  ``affinity_TK`` [T, K] fp32 leaves requiring grad, then ``y.backward(dy)``. Explicitly
  ``grouped_mm="auto"`` (the default): the forward's gate/up and the backward's down dgrad run
  cuBLAS, our fused kernel or our gathering GEMM as ``configs/cuda/grouped_mm_choice.yaml`` says
  for the shape.
- ``ours (fused gather-GEMM)`` [ours-fused]: the same layer with ``grouped_mm="ours"``: the
  gather + gate/up GEMM + activation of the forward and the gather + down dgrad + activation
  backward of the backward each one CuTe DSL kernel (``cuda_kernels.grouped_mm``), whatever the
  table says (the row says why where the kernel cannot run).
- ``ours (gather-GEMM + pass)`` [ours-gemm]: the same layer with ``grouped_mm="ours-gemm"``: our
  gathering GEMM (``cuda_kernels.grouped_mm.grouped_mm_gather``, the gathered rows side-written
  for the weight gradients) for the forward's gate/up GEMM and the backward's down dgrad, the
  activation and its backward as the Triton passes of the cuBLAS path. The step times of these
  two rows against ``ours``'s (with the table at cuBLAS) are what fill the table. On the CPU the
  layer's backend is ``torch``, which has one path: there both rows equal ``ours`` (a smoke run
  of the option only).
- ``ours (seam)`` [seam]: ``common.layer.run_experts_grouped_mm(w1, w2, w3, x_rows, counts)``
  on torchtitan's pre-sorted rows (the plan's pairs in expert order, no padding between experts,
  the gather not timed); ``w1``/``w3`` [E, I, H] and ``w2`` [E, H, I] separate BF16 leaves as
  torchtitan's ``GroupedExperts`` holds them. Plain SwiGLU, no affinity, no biases (torchtitan's
  expert math, whatever the shape's activation).
- ``torchtitan experts`` [torchtitan]: torchtitan 0.3.0's own ``GroupedExperts``
  (``torchtitan.models.common.moe``; 0.3.0 has no ``use_grouped_mm`` flag: its forward is always
  three ``torch._grouped_mm``) on the same rows, counts and weights; skipped when not importable.
- ``recipe+perm`` [recipe+perm]: the torchtitan-style autograd recipe with the token
  permutation inside autograd (``index_select`` gather by expert, two ``torch._grouped_mm``,
  activation, ``index_add`` back to [T, H]); ``recipe`` [recipe]: the same on pre-sorted rows
  (``benchmarks/_moe_baselines.build_autograd_recipe``).
- ``sonicmoe`` [sonicmoe]: SonicMoE (``_moe_baselines.build_sonicmoe_step``) through autograd,
  as installed: SonicMoE calls quack's GEMMs without ``tuned``, so quack's autotuner runs (it
  compiles ~100 s per shape and again per token count: run it in its own process, e.g. one shape
  per call). ``--sonic-untuned`` passes ``tuned=False`` to those GEMMs instead; with quack 0.6.5
  on CuTe DSL 4.8.1 that path fails to compile (``TypeError: epilogue fn depends on
  <ContextVar _LOC_TRANSFORMS>``, H200, 2026-12-01), and the row then says so. SwiGLU problems
  only (no clamp, biases or gpt-oss activation: the row says why it is skipped, or that the
  package does not import).
- ``dense mm`` [dense]: the ceiling, dense BF16 ``torch.mm`` with no routing: forward ``[R, H] @
  [H, 3I]`` (6 R H I FLOPs), backward ``[R, H] @ [H, 6I]`` (12 R H I), step ``[R, H] @ [H, 9I]``
  (18 R H I), each timed directly.

Timing (R = T * top_k): each column is its own measurement, a median
(``triton.testing.do_bench(return_mode="median")`` on CUDA with triton, else a warm-up plus
``--reps`` timed runs). ``fwd`` = the forward with autograd recording (as in training; the graph
is dropped after each call). ``bwd`` = the backward alone, ``torch.autograd.grad(y, leaves, dy,
retain_graph=True)`` on one recorded graph. ``step`` = forward + ``y.backward(dy)`` (leaves'
``.grad`` set to None first, as ``zero_grad()`` does), the number that matters; ``fwd + bwd``
differs from it by launch overlap. TFLOP/s counts 6 / 12 / 18 * R * H * I. ``vs recipe+perm`` /
``vs sonicmoe`` = their step time / this row's (> 1: this row is faster). ``peak GiB`` = peak
CUDA memory of one step above what was allocated before it (grads cleared). A second table
profiles ONE forward and ONE step of ``ours``, ``ours-fused`` and ``ours-gemm`` (torch.profiler;
on by default on CUDA only): GEMM kernels (names matching ``bench_moe_backward.GEMM_PATTERNS``)
vs the rest; ``--profile-detail`` lists the top 24 kernels of each. ``--check`` compares y and every
gradient of the ours rows, ``recipe`` and ``recipe+perm`` with the float64 reference
(``common.reference``; SQNR, small shapes only; exit 1 below 30 dB).
``--json PATH`` writes every number.

Usage: ``python benchmarks/bench_moe_layer.py [--shapes qwen3-30b-a3b:16384,deepseek-v3:2048:e32]
[--tokens T] [--shrink N]
[--impls ours,ours-fused,ours-gemm,seam,torchtitan,recipe+perm,recipe,sonicmoe,dense]
[--device cuda|cpu] [--sonic-untuned] [--check] [--profile auto|on|off] [--profile-detail]
[--json PATH]``; CPU smoke run: ``--device cpu --shrink 16 --tokens 64``. On the H200:
``bash benchmarks/moe_layer_device_run.sh bench [args]``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):  # the sibling scripts, and the repo root when not installed
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _moe_baselines import build_autograd_recipe, build_sonicmoe_step  # noqa: E402
from bench_moe_backward import (  # noqa: E402
    _err,
    _extra,
    _f,
    _free,
    _Skip,
    bench_parser,
    check_grads,
    header,
    parse_bench_args,
    peak_extra_gib,
    profile_once,
    run_all,
)

from common.inputs import make_problem_for_model  # noqa: E402
from common.layer import MoEExperts, run_experts_grouped_mm  # noqa: E402

IMPLS = ("ours", "ours-fused", "ours-gemm", "seam", "torchtitan", "recipe+perm", "recipe",
         "sonicmoe", "dense")
LABEL = {"ours-fused": "ours (fused gather-GEMM)", "ours-gemm": "ours (gather-GEMM + pass)",
         "seam": "ours (seam)", "torchtitan": "torchtitan experts", "dense": "dense mm"}
# the layer's grouped_mm option per row
GROUPED_MM = {"ours": "auto", "ours-fused": "ours", "ours-gemm": "ours-gemm"}
PEERS = ("sonic-moe", "quack-kernels", "torchtitan")  # versions printed in the header


class Step:
    """One row's training step: ``forward()`` -> y (autograd recording), its ``leaves``, ``dy``;
    optional ``to_check(y)`` -> ``{name: tensor}`` for ``--check`` (y and gradients read from the
    leaves' ``.grad`` after one ``step()``)."""

    def __init__(self, forward, leaves, dy, to_check=None):
        self.forward, self.leaves, self.dy, self.to_check = forward, leaves, dy, to_check

    def clear(self) -> None:
        for t in self.leaves:
            t.grad = None

    def fwd(self):
        return self.forward()

    def step(self):
        self.clear()
        y = self.forward()
        y.backward(self.dy)
        return y

    def bwd_fn(self):
        y = self.forward()  # one graph, reused by every timed backward
        return lambda: torch.autograd.grad(y, self.leaves, self.dy, retain_graph=True)


# ------------------------------------------------------------------------------------- rows
def _routing_TK(p):
    """The problem's router output back as [T, K] (expert ids, -1 = dropped; fp32 affinities)."""
    plan = p.plan
    s2p = plan.slot_to_pair_TK
    idx = s2p.clamp(min=0)
    expert_TK = torch.where(s2p >= 0, plan.pair_expert_R[idx], -1)
    affinity_TK = torch.where(s2p >= 0, plan.pair_affinity_R[idx], 0.0).float()
    return expert_TK, affinity_TK


def _presorted(p):
    """torchtitan's input to ``GroupedExperts``: BF16 rows in expert order (the plan's pairs,
    then zero rows for its padding entries), their dY rows, and the per-expert counts."""
    plan = p.plan
    T, H = p.hidden_states_TH.shape
    tok = torch.where(plan.pair_token_R >= 0, plan.pair_token_R, T)

    def rows(t):
        t = t.to(torch.bfloat16)
        return torch.cat([t, t.new_zeros(1, H)]).index_select(0, tok)

    return rows(p.hidden_states_TH), rows(p.output_grad_TH), plan.tokens_per_expert_E


def _torchtitan_weights(p):
    """w1, w3 [E, I, H] and w2 [E, H, I], BF16 contiguous (torchtitan's parameter layout)."""
    wgu = p.w_gate_up_EH2I.to(torch.bfloat16)
    w1 = wgu[:, :, 0, :].transpose(1, 2).contiguous()
    w3 = wgu[:, :, 1, :].transpose(1, 2).contiguous()
    w2 = p.w_down_EIH.to(torch.bfloat16).transpose(1, 2).contiguous()
    return w1, w2, w3


def build_ours(p, model, device, grouped_mm: str = "auto") -> Step:
    layer = MoEExperts.from_model(model, device=device, grouped_mm=grouped_mm)
    with torch.no_grad():
        layer.w_gate_up.copy_(p.w_gate_up_EH2I)
        layer.w_down.copy_(p.w_down_EIH)
        if layer.bias:
            layer.b_gate_up.copy_(p.b_gate_up_E2I)
            layer.b_down.copy_(p.b_down_EH)
    x = p.hidden_states_TH.to(torch.bfloat16).detach().requires_grad_()
    expert_TK, aff = _routing_TK(p)
    aff.requires_grad_()
    dy = p.output_grad_TH.to(torch.bfloat16)
    T, E = x.shape[0], model.experts

    def to_check(y):
        valid = expert_TK >= 0
        cell = torch.where(valid, torch.arange(T, device=x.device)[:, None] * E + expert_TK, T * E)
        dA = aff.grad.float().new_zeros(T * E + 1)
        dA.index_put_((cell.flatten(),), torch.where(valid, aff.grad.float(), 0.0).flatten())
        out = {
            "y [T,H]": y.float(), "dX [T,H]": x.grad.float(), "dA [T,E]": dA[: T * E].view(T, E),
            "dW_gate_up [E,H,2,I]": layer.w_gate_up.grad.float(),
            "dW_down [E,I,H]": layer.w_down.grad.float(),
        }
        if layer.bias:
            out["dB_gate_up [E,2,I]"] = layer.b_gate_up.grad.float()
            out["dB_down [E,H]"] = layer.b_down.grad.float()
        return out

    return Step(lambda: layer(x, expert_TK, aff), [x, aff, *layer.parameters()], dy, to_check)


def build_seam(p) -> Step:
    x_rows, dy_rows, counts = _presorted(p)
    x_rows.requires_grad_()
    w1, w2, w3 = (w.requires_grad_() for w in _torchtitan_weights(p))
    return Step(lambda: run_experts_grouped_mm(w1, w2, w3, x_rows, counts),
                [x_rows, w1, w2, w3], dy_rows)  # fmt: skip


def build_torchtitan(p, device) -> Step:
    try:
        from torchtitan.models.common.moe import GroupedExperts
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        raise _Skip(f"skipped: torchtitan not importable ({type(exc).__name__}: {exc})") from None
    E, H, _, I = p.w_gate_up_EH2I.shape
    ge = GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=E).build()
    w1, w2, w3 = _torchtitan_weights(p)
    with torch.no_grad():
        for name, w in (("w1_EFD", w1), ("w2_EDF", w2), ("w3_EFD", w3)):
            setattr(ge, name, torch.nn.Parameter(w.clone()))
    ge.to(device)
    x_rows, dy_rows, counts = _presorted(p)
    x_rows.requires_grad_()
    return Step(lambda: ge(x_rows, counts), [x_rows, *ge.parameters()], dy_rows)


def build_recipe(p, with_perm: bool) -> Step:
    r = build_autograd_recipe(p, with_perm=with_perm)

    def to_check(y):
        return {"y [T,H]": r.to_y(y.detach()).float(),
                **r.to_grads(tuple(t.grad for t in r.leaves))}  # fmt: skip

    return Step(r.forward, r.leaves, r.dY, to_check)


def build_sonic(p, tuned: bool | None) -> Step:
    try:
        forward, leaves, dy = build_sonicmoe_step(p, tuned=tuned)
    except ImportError as exc:
        raise _Skip(f"skipped: sonicmoe not installed ({type(exc).__name__}: {exc})") from None
    except NotImplementedError as exc:
        raise _Skip(f"skipped: {exc}") from None
    return Step(forward, leaves, dy)


def build_dense(model, T: int, device):
    """``{column: fn}`` of the dense ceiling (module docstring)."""
    R, H, I = T * model.top_k, model.hidden, model.intermediate
    x = torch.randn(R, H, device=device, dtype=torch.bfloat16)
    ws = {k: torch.randn(H, n * I, device=device, dtype=torch.bfloat16)
          for k, n in (("fwd", 3), ("bwd", 6), ("step", 9))}  # fmt: skip
    return {k: (lambda w=w: torch.mm(x, w)) for k, w in ws.items()}


def build_row(impl: str, p, model, T: int, device: torch.device, args):
    """A :class:`Step`, or for ``dense`` a dict of callables; raises ``_Skip`` with the reason."""
    needs_gmm = impl in ("seam", "torchtitan", "recipe", "recipe+perm", *GROUPED_MM)
    if needs_gmm and device.type == "cuda" and not hasattr(torch, "_grouped_mm"):
        raise _Skip(f"skipped: torch {torch.__version__} has no torch._grouped_mm")
    if impl in GROUPED_MM:
        return build_ours(p, model, device, GROUPED_MM[impl])
    if impl == "seam":
        return build_seam(p)
    if impl == "torchtitan":
        return build_torchtitan(p, device)
    if impl in ("recipe", "recipe+perm"):
        return build_recipe(p, with_perm=impl == "recipe+perm")
    if impl == "sonicmoe":
        if device.type != "cuda":
            raise _Skip("skipped: needs a CUDA device")
        return build_sonic(p, tuned=False if args.sonic_untuned else None)
    if impl == "dense":
        return build_dense(model, T, device)
    raise ValueError(f"unknown impl {impl!r}; choose from {IMPLS}")


# ---------------------------------------------------------------------------------- running
def _label(impl: str, args) -> str:
    if impl == "sonicmoe":
        return "sonicmoe (untuned)" if args.sonic_untuned else "sonicmoe"
    return LABEL.get(impl, impl)


def _profile_wanted(args, device) -> bool:
    return args.profile == "on" or (args.profile == "auto" and device.type == "cuda")


def run_shape(label, model, T, args, device, bench, record) -> None:
    """Time (and optionally measure, profile, check) every selected row of one shape."""
    p = make_problem_for_model(model, T, seed=0, device=device)
    R, H, I = T * model.top_k, model.hidden, model.intermediate
    flops = {"fwd": 6 * R * H * I, "bwd": 12 * R * H * I, "step": 18 * R * H * I}
    ref = None
    if args.check:
        ref = _reference(p)
    rows = []
    for impl in args.impls:
        row = {"shape": label, "impl": _label(impl, args), "key": impl, "flops": dict(flops)}
        rows.append(row)
        built = None
        try:
            built = build_row(impl, p, model, T, device, args)
            if isinstance(built, dict):  # dense: three direct mms
                fns = built
            else:
                fns = {"fwd": built.fwd, "bwd": built.bwd_fn(), "step": built.step}
            for col in ("fwd", "bwd", "step"):
                row[f"{col}_ms"] = bench(fns[col]) * 1e3
                row[f"{col}_tflops"] = flops[col] / (row[f"{col}_ms"] * 1e-3) / 1e12
            fns = None  # drops the backward's retained graph
            # Extras: a failure here keeps the timing and is noted in the row's JSON.
            if isinstance(built, Step):
                built.clear()
                _free(device)
                _extra(row, "peak_extra_gib", lambda: peak_extra_gib(built.step, device), device)
                if impl in GROUPED_MM and _profile_wanted(args, device):
                    for what, fn in (("one forward", built.fwd), ("one step", built.step)):
                        prof = _extra(row, f"profile ({what})",
                                      lambda fn=fn: profile_once(fn, device, 24), device)
                        built.clear()
                        if prof is not None:
                            record["profile"].append(
                                {"shape": label, "impl": f"{row['impl']} ({what})", **prof}
                            )
                if ref is not None and built.to_check is not None:
                    _extra(row, "sqnr_db", lambda: _check(built, ref), device)
            else:
                _extra(row, "peak_extra_gib", lambda: peak_extra_gib(built["step"], device),
                       device)  # fmt: skip
        except _Skip as why:
            row["status"] = str(why)
        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
            row["status"] = _err(exc)
        finally:
            built = fns = None  # drop this row's graph / tensors before the next row
            _free(device)
    base = {k: next((r["step_ms"] for r in rows if r["key"] == k and "step_ms" in r), None)
            for k in ("recipe+perm", "sonicmoe")}  # fmt: skip
    for r in rows:
        if "step_ms" in r:
            for k, col in (("recipe+perm", "vs_recipe_perm"), ("sonicmoe", "vs_sonicmoe")):
                r[col] = base[k] / r["step_ms"] if base[k] else None
        print(_table_row(r), flush=True)
    record["rows"].extend(rows)


def _reference(p) -> dict:
    from common.reference import reference_backward, reference_forward

    f64 = torch.float64

    def d(t):
        return None if t is None else t.to(f64)

    y, _ = reference_forward(
        d(p.hidden_states_TH), d(p.w_gate_up_EH2I), d(p.w_down_EIH), p.plan,
        b_gate_up_E2I=d(p.b_gate_up_E2I), b_down_EH=d(p.b_down_EH),
        clamp_limits=p.clamp_limits, activation=p.activation,
    )  # fmt: skip
    return {"y [T,H]": y, **reference_backward(p).named()}


def _check(built: Step, ref: dict) -> dict:
    built.clear()
    y = built.step()
    got = built.to_check(y.detach())
    built.clear()
    return check_grads(got, ref)


def _table_row(r: dict) -> str:
    if "step_ms" not in r:
        return f"| {r['shape']} | {r['impl']} | {r.get('status', '?')} | | | | | | | | |"

    def tf(v):
        return _f(v, ".1f" if v is not None and v >= 1 else ".4f")

    return (
        f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
        f"{r['step_ms']:.3f} | {tf(r['fwd_tflops'])} | {tf(r['bwd_tflops'])} | "
        f"{tf(r['step_tflops'])} | {_f(r.get('vs_recipe_perm'), '.2f')} | "
        f"{_f(r.get('vs_sonicmoe'), '.2f')} | {_f(r.get('peak_extra_gib'), '.2f')} |"
    )


def _versions() -> str:
    out = []
    for dist in PEERS:
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return " · ".join(out)


def main(argv=None) -> int:
    ap = bench_parser(
        __doc__, IMPLS, "profile one forward and one step of the ours rows (auto: CUDA only)"
    )
    ap.add_argument("--sonic-untuned", action="store_true",
                    help="SonicMoE's GEMMs with tuned=False (default: as installed, autotuned)")
    args, device, shapes, bench = parse_bench_args(ap, argv, IMPLS)
    head = f"{header(device)} · {_versions()}"
    record = {"header": head, "argv": list(sys.argv[1:] if argv is None else argv),
              "rows": [], "profile": []}  # fmt: skip
    print(head)
    columns = ("shape", "impl", "fwd ms", "bwd ms", "step ms", "fwd TFLOP/s", "bwd TFLOP/s",
               "step TFLOP/s", "vs recipe+perm", "vs sonicmoe", "peak GiB")
    return run_all(shapes, run_shape, columns, args, device, bench, record)


if __name__ == "__main__":
    raise SystemExit(main())
