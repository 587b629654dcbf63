#!/usr/bin/env bash
# One device call on a lent H200: the varlen-M grouped GEMM (cuda_kernels/grouped_mm) -- its GPU
# tests, then its benchmark (benchmarks/bench_grouped_mm.py).
#   bash benchmarks/grouped_mm_device_run.sh [benchmark args]
# Without arguments the benchmark runs its five default shapes and all six GEMMs with the
# kernel's own tile choice (about 30 compiles); arguments are passed on, e.g. a tile sweep on one
# shape: --shapes qwen3-30b-a3b:16384 --tiles 128x256s4,128x128s6pp,128x128s6
# Needs .device/cute-dsl.tar.xz (CuTe DSL, unpacked under /tmp/site-packages as
# moe_layer_device_run.sh does). Steps, each under `timeout` (about 8 minutes at most in all):
#   1. smoke: one small gather case (a hang or a crash of the kernel shows here, in <= 75 s,
#      and the later steps are skipped);
#   2. every test of tests/test_grouped_mm_sm90.py and tests/test_grouped_mm.py, `-x -q`
#      (<= 150 s);
#   3. the benchmark with --check (ours vs the torch twin in BF16 ulps; gate_up_act: vs the
#      layer's GEMM-then-pass), <= 230 s; its JSON is rewritten after every shape.
# Logs: $OUT/{env,smoke,tests}.log, $OUT/grouped_mm_bench.{md,json,err}.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
mkdir -p /tmp/site-packages && tar -xJf .device/cute-dsl.tar.xz -C /tmp/site-packages
export PYTHONPATH="$PWD:/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages"
python3 -c "import torch, triton, cutlass; print(torch.__version__, triton.__version__, \
  torch.cuda.get_device_name())" 2>&1 | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
  >> "$OUT/env.log" 2>&1

T=tests/test_grouped_mm_sm90.py
timeout "${SMOKE_TIMEOUT:-75}" python3 -m pytest -x -q -p no:cacheprovider \
  "$T::test_grid_matches_twin[uneven-128x256-gather]" > "$OUT/smoke.log" 2>&1
rc=$?
echo "smoke rc=$rc"; tail -15 "$OUT/smoke.log"
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "smoke timed out (a hang?): skipping the tests and the benchmark"; exit 1
fi

timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -x -q -p no:cacheprovider -rs \
  "$T" tests/test_grouped_mm.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -25 "$OUT/tests.log"

timeout "${BENCH_TIMEOUT:-230}" python3 benchmarks/bench_grouped_mm.py --check \
  --json "$OUT/grouped_mm_bench.json" "$@" > "$OUT/grouped_mm_bench.md" \
  2> "$OUT/grouped_mm_bench.err"
echo "bench rc=$?"; cat "$OUT/grouped_mm_bench.md"; tail -5 "$OUT/grouped_mm_bench.err"
