"""CPU smoke test of ``benchmarks/bench_moe_layer.py`` (the layer's training-step benchmark): one
shrunk shape, every CPU row, the JSON it writes, the profiler split and ``--check``."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_moe_layer.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe_layer", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_moe_layer", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchtitan's imports, if installed
def test_bench_moe_layer_cpu_smoke(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "layer.json"
    impls = ["ours", "ours-fused", "ours-gemm", "seam", "torchtitan", "recipe", "recipe+perm",
             "sonicmoe", "dense"]
    rc = bench.main([
        "--device", "cpu", "--shrink", "16", "--tokens", "64", "--reps", "1",
        "--shapes", "qwen3-30b-a3b:64:e8", "--impls", ",".join(impls), "--profile", "on",
        "--check", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["header"].startswith("# ") and "torch" in rec["header"]
    rows = {r["key"]: r for r in rec["rows"]}
    assert set(rows) == set(impls)
    R, H, I = 64 * 8, 128, 128  # T * top_k; H and I shrunk to 128
    for key, r in rows.items():
        if key == "sonicmoe" or (key == "torchtitan" and "status" in r):
            assert r["status"].startswith("skipped: "), r  # no CUDA / torchtitan missing
            continue
        assert "status" not in r, r
        for col in ("fwd", "bwd", "step"):
            assert r[f"{col}_ms"] > 0 and r[f"{col}_tflops"] > 0, (key, col, r)
        assert r["flops"] == {"fwd": 6 * R * H * I, "bwd": 12 * R * H * I, "step": 18 * R * H * I}
        assert r["step_tflops"] == pytest.approx(r["flops"]["step"] / (r["step_ms"] * 1e9))
    assert rows["recipe+perm"]["vs_recipe_perm"] == pytest.approx(1.0)
    assert rows["ours"]["vs_sonicmoe"] is None  # SonicMoE did not run
    assert rows["ours-fused"]["impl"] == "ours (fused gather-GEMM)"
    assert rows["ours-gemm"]["impl"] == "ours (gather-GEMM + pass)"
    # --check: y and every gradient of ours (every grouped_mm row) and the recipes vs float64
    for key in ("ours", "ours-fused", "ours-gemm", "recipe", "recipe+perm"):
        sq = rows[key]["sqnr_db"]
        assert {"y [T,H]", "dX [T,H]", "dA [T,E]", "dW_gate_up [E,H,2,I]"} <= set(sq)
        assert min(sq.values()) > 30, (key, sq)
    # the profiler split of one forward and one step of the ours rows (CPU op self times here)
    profs = {p["impl"]: p for p in rec["profile"]}
    assert set(profs) == {f"{rows[k]['impl']} ({what})" for k in ("ours", "ours-fused", "ours-gemm")
                          for what in ("one forward", "one step")}
    for prof in profs.values():
        assert prof["total_ms"] > 0 and 0 <= prof["gemm_ms"] <= prof["total_ms"]
        assert 0 < len(prof["top"]) <= 24


def test_bench_moe_layer_rejects_unknown_impl():
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--impls", "ours,nope"])
