"""Benchmark of Hugging Face transformers' MoE on our layer (``experts_implementation="moe_bwd"``,
``common.integrations.transformers``) against transformers' own implementations, one device,
one process.

Per shape (``common.inputs.make_problem_for_model``, seed 0: the same weights and routing for
every experts-module row; the shape's transformers family: Qwen3-MoE, Mixtral or gpt-oss), rows
(``--impls`` keys in brackets):

- ``module moe_bwd`` [moe_bwd], ``module grouped_mm`` [grouped_mm], ``module eager`` [eager]:
  transformers' experts module (``Qwen3MoeExperts`` / ``MixtralExperts`` / ``GptOssExperts``,
  BF16, the problem's weights written into its own layout) called as its MoE block calls it,
  ``experts(x [T, H] BF16, top_k_index [T, K], top_k_weights [T, K] fp32)``, with that
  ``experts_implementation``; x and the weights require grad (as after a router).
- ``MoEExperts`` [layer]: our own ``MoEExperts`` on the same weights and routing
  (``bench_moe_layer.build_ours``): the adapter's cost is ``module moe_bwd`` against it
  (``vs MoEExperts``; target >= 0.97).
- ``sonicmoe`` [sonicmoe]: SonicMoE through its own package (``bench_moe_layer.build_sonic``:
  autotuned as installed, ~100 s of compiles per shape), SwiGLU shapes only; a row says why it
  is skipped.
- ``decoder moe_bwd`` [decoder-moe_bwd], ``decoder grouped_mm`` [decoder-grouped_mm],
  ``decoder eager`` [decoder-eager]: a whole transformers decoder layer (attention, router,
  experts; random init, BF16) on ``T / --seq`` sequences of ``--seq`` tokens.

Columns: ``fwd`` / ``bwd`` / ``step`` ms as ``bench_moe_layer.py`` times them (medians of
``triton.testing.do_bench`` on CUDA; fwd with autograd recording, bwd on one recorded graph,
step = fwd + backward with the grads cleared); ``vs grouped_mm`` = the ``grouped_mm`` row's step
/ this row's (module rows against the module's, decoder rows against the decoder's);
``vs MoEExperts`` and ``vs sonicmoe`` likewise (> 1: this row is faster); ``peak GiB`` = peak
CUDA memory of one step above what was allocated before it.

Usage: ``python benchmarks/bench_hf_experts.py [--shapes qwen3-30b-a3b:16384,...] [--quick]
[--impls ...] [--seq 4096] [--tokens T] [--shrink N] [--device cuda|cpu] [--json PATH]``.
``--quick`` (< 5 min on the H200) leaves out the eager and SonicMoE rows. CPU smoke run:
``--device cpu --shrink 16 --tokens 64 --seq 32 --shapes qwen3-30b-a3b``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):  # the sibling scripts, and the repo root when not installed
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench_moe_backward import (  # noqa: E402
    _err,
    _extra,
    _f,
    _free,
    _Skip,
    bench_parser,
    header,
    parse_bench_args,
    peak_extra_gib,
    run_all,
)
from bench_moe_layer import Step, _routing_TK, build_ours, build_sonic  # noqa: E402

from common.inputs import make_problem_for_model  # noqa: E402
from common.integrations import transformers as hf  # noqa: E402

DEFAULT_SHAPES = "qwen3-30b-a3b:16384,qwen3-235b-a22b:16384,mixtral-8x7b:16384,gpt-oss-120b:16384"
IMPLS = ("moe_bwd", "grouped_mm", "eager", "layer", "sonicmoe", "decoder-moe_bwd",
         "decoder-grouped_mm", "decoder-eager")
QUICK = ("moe_bwd", "grouped_mm", "layer", "decoder-moe_bwd", "decoder-grouped_mm")
LABEL = {"moe_bwd": "module moe_bwd", "grouped_mm": "module grouped_mm", "eager": "module eager",
         "layer": "MoEExperts", **{f"decoder-{i}": f"decoder {i}" for i in
                                   ("moe_bwd", "grouped_mm", "eager")}}
# shape name prefix -> (transformers config class, attention heads, kv heads, head_dim) as in
# the models' config.json (heads divided by --shrink)
FAMILY = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", 32, 4, 128),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", 64, 4, 128),
    "mixtral-8x7b": ("MixtralConfig", 32, 8, 128),
    "gpt-oss": ("GptOssConfig", 64, 8, 64),
}


def hf_config(model, shrink: int, seq: int):
    """The transformers config of one decoder layer of ``model`` (a MoEModelShape)."""
    import transformers

    key = next((k for k in FAMILY if model.name.startswith(k)), None)
    if key is None:
        raise _Skip(f"skipped: no transformers family mapped for {model.name}")
    cls, heads, kv, head_dim = FAMILY[key]
    heads = max(1, heads // shrink)
    kv = max(1, min(kv // shrink, heads))
    E, I = model.experts, model.intermediate
    experts = ({"num_experts": E, "moe_intermediate_size": I, "norm_topk_prob": True}
               if cls == "Qwen3MoeConfig" else {"num_local_experts": E})
    return getattr(transformers, cls)(
        vocab_size=256, hidden_size=model.hidden, intermediate_size=I, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        num_experts_per_tok=model.top_k, max_position_embeddings=max(seq, 4096), **experts,
    )


def _build_model(model, shrink, seq, device):
    import transformers

    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(
            hf_config(model, shrink, seq), experts_implementation="grouped_mm",
            dtype=torch.bfloat16,
        )
    return m


def build_module(p, hf_model, impl: str) -> Step:
    """The model's experts module with the problem's weights in its own layout."""
    hf_model.set_experts_implementation(impl)
    module = next(m for m in hf_model.modules() if hasattr(m, "gate_up_proj"))
    spec = hf.experts_spec(module)
    with torch.no_grad():
        views = hf.layer_weights(module, spec)
        for view, w in zip(views, (p.w_gate_up_EH2I, p.w_down_EIH, p.b_gate_up_E2I, p.b_down_EH)):
            if view is not None:
                view.copy_(w)
    expert_TK, aff = _routing_TK(p)
    ids = torch.where(expert_TK >= 0, expert_TK, module.num_experts)  # HF's dropped: sentinel
    aff.requires_grad_()
    x = p.hidden_states_TH.to(torch.bfloat16).detach().requires_grad_()
    dy = p.output_grad_TH.to(torch.bfloat16)
    return Step(lambda: module(x, ids, aff), [x, aff, *module.parameters()], dy)


def build_decoder(hf_model, impl: str, T: int, seq: int, device) -> Step:
    hf_model.set_experts_implementation(impl)
    layer, rope = hf_model.model.layers[0], hf_model.model.rotary_emb
    seq = min(seq, T)
    g = torch.Generator(device=device).manual_seed(0)
    H = hf_model.config.hidden_size
    h = torch.randn(T // seq, seq, H, generator=g, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        pe = rope(h, torch.arange(seq, device=device)[None])
    h.requires_grad_()
    dy = torch.randn_like(h)

    def forward():
        out = layer(h, position_embeddings=pe, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    return Step(forward, [h, *layer.parameters()], dy)


def build_row(impl, p, model, T, device, args, hf_model):
    if impl == "layer":
        return build_ours(p, model, device)
    if impl == "sonicmoe":
        if device.type != "cuda":
            raise _Skip("skipped: needs a CUDA device")
        return build_sonic(p, tuned=None)
    if impl.startswith("decoder-"):
        return build_decoder(hf_model, impl.removeprefix("decoder-"), T, args.seq, device)
    return build_module(p, hf_model, impl)


def run_shape(label, model, T, args, device, bench, record) -> None:
    p = make_problem_for_model(model, T, seed=0, device=device)
    rows = []
    hf_model = None
    try:
        hf_model = _build_model(model, args.shrink, args.seq, device)
    except Exception as exc:  # noqa: BLE001 - the MoEExperts / SonicMoE rows still run
        why = exc if isinstance(exc, _Skip) else _err(exc)
        print(f"<!-- {label}: no transformers model ({why}) -->", flush=True)
    for impl in args.impls:
        row = {"shape": label, "impl": LABEL.get(impl, impl), "key": impl}
        rows.append(row)
        built = fns = None
        try:
            if hf_model is None and impl not in ("layer", "sonicmoe"):
                raise _Skip("skipped: no transformers model for this shape")
            built = build_row(impl, p, model, T, device, args, hf_model)
            fns = {"fwd": built.fwd, "bwd": built.bwd_fn(), "step": built.step}
            for col in ("fwd", "bwd", "step"):
                row[f"{col}_ms"] = bench(fns[col]) * 1e3
            fns = None  # drops the backward's retained graph
            built.clear()
            _free(device)
            _extra(row, "peak_extra_gib", lambda: peak_extra_gib(built.step, device), device)
        except _Skip as why:
            row["status"] = str(why)
        except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
            row["status"] = _err(exc)
        finally:
            built = fns = None
            _free(device)
    step = {r["key"]: r["step_ms"] for r in rows if "step_ms" in r}
    for r in rows:
        if "step_ms" not in r:
            print(f"| {r['shape']} | {r['impl']} | {r.get('status', '?')} | | | | | | |")
            continue
        gmm = "decoder-grouped_mm" if r["key"].startswith("decoder-") else "grouped_mm"
        module_row = not r["key"].startswith("decoder-")
        for col, base in (("vs_grouped_mm", gmm), ("vs_moe_experts", "layer"),
                          ("vs_sonicmoe", "sonicmoe")):
            r[col] = step[base] / r["step_ms"] if base in step and (
                module_row or base == gmm) else None
        print(
            f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
            f"{r['step_ms']:.3f} | {_f(r['vs_grouped_mm'], '.2f')} | "
            f"{_f(r['vs_moe_experts'], '.3f')} | {_f(r['vs_sonicmoe'], '.2f')} | "
            f"{_f(r.get('peak_extra_gib'), '.2f')} |", flush=True,
        )
    record["rows"].extend(rows)


def main(argv=None) -> int:
    ap = bench_parser(__doc__, IMPLS, "(not used here)")
    ap.set_defaults(shapes=DEFAULT_SHAPES, profile="off")
    ap.add_argument("--quick", action="store_true",
                    help=f"only the rows {', '.join(QUICK)} (< 5 min on the H200)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence, decoder rows")
    args, device, shapes, bench = parse_bench_args(ap, argv, IMPLS)
    if args.quick:
        args.impls = [i for i in args.impls if i in QUICK]
    import transformers

    hf.register()
    head = f"{header(device)} · transformers {transformers.__version__}"
    record = {"header": head, "argv": list(sys.argv[1:] if argv is None else argv),
              "rows": [], "profile": []}
    print(head)
    columns = ("shape", "impl", "fwd ms", "bwd ms", "step ms", "vs grouped_mm", "vs MoEExperts",
               "vs sonicmoe", "peak GiB")
    return run_all(shapes, run_shape, columns, args, device, bench, record)


if __name__ == "__main__":
    raise SystemExit(main())
