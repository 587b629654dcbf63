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
#   2. the tests of tests/test_grouped_mm_sm90.py and tests/test_grouped_mm.py but the offline
#      compiles (CI runs those), `-x -q`, in 4 processes of a quarter of the tests each (the
#      compiles are single-threaded CPU work), <= 180 s (TESTS=0 skips them: a benchmark-only
#      call, e.g. the tile sweep `--shapes qwen3-235b-a22b:16384,mixtral-8x7b:8192
#      --gemms gate_up,down_dgrad --impls ours,grouped_mm --tiles mainloop`);
#   (optional, SANITIZE=1: compute-sanitizer memcheck of a small gather case, a small gated
#      case and one case of each TMA-store epilogue (store, gated, dgated), <= 240 s,
#      $OUT/sanitizer.log; off by default to stay within 8 minutes)
#   3. the benchmark with --check (ours vs the torch twin in BF16 ulps; the fused epilogues: vs
#      the layer's GEMM-then-pass), <= 200 s; its JSON is rewritten after every shape.
# Logs: $OUT/{env,smoke}.log, $OUT/tests_{0..3}.log, $OUT/grouped_mm_bench.{md,json,err}.
set -u
set -f  # test ids hold brackets: no globbing
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

if [ "${TESTS:-1}" != 0 ]; then
  ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider "$T" tests/test_grouped_mm.py \
    -k "not offline" | grep '::')
  echo "$(echo "$ids" | wc -l) tests in 4 processes"
  for k in 0 1 2 3; do
    shard=$(echo "$ids" | awk -v k="$k" 'NR % 4 == k')
    # shellcheck disable=SC2086 # one argument per test id
    (timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -x -q -p no:cacheprovider -rs $shard \
      > "$OUT/tests_$k.log" 2>&1; echo "tests shard $k rc=$?") &
  done
  wait
  for k in 0 1 2 3; do echo "--- shard $k"; tail -6 "$OUT/tests_$k.log"; done
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider \
    "$T::test_grid_matches_twin[64-row-tiles-gather]" \
    "$T::test_gated_matches_twin_and_writes_everything[gpt-oss-pingpong-partial]" \
    "$T::test_epi_tma_store_is_the_register_store_bitwise[hot-expert-partial-n-gather]" \
    "$T::test_gated_epi_tma_is_the_register_epilogue_bitwise[gpt-oss-pingpong-128x128]" \
    "$T::test_dgated_epi_tma_is_the_register_epilogue_bitwise[gpt-oss-64-row]" \
    > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -3
fi

timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_grouped_mm.py --check \
  --json "$OUT/grouped_mm_bench.json" "$@" > "$OUT/grouped_mm_bench.md" \
  2> "$OUT/grouped_mm_bench.err"
echo "bench rc=$?"; cat "$OUT/grouped_mm_bench.md"; tail -5 "$OUT/grouped_mm_bench.err"
