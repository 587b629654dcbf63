#!/usr/bin/env bash
# One device call on a lent H200 after block-scaled / launch changes: the whole suite, the SM90
# MXFP8 kernel's GPU tests (verbose: per-case SQNR), the block-scaled API's GPU tests with the
# kernel enabled through dispatch's hook, then (alone on the GPU) the MXFP8 wgrad benchmark, the
# MX quantizer's launch sweep and a quick BF16 wgrad benchmark. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX tests share the GPU with torch
PT="python3 -m pytest -q -p no:cacheprovider"
( timeout ${SUITE_TIMEOUT:-300} $PT -n 6 -rfE tests > "$OUT/suite.log" 2>&1; echo "suite rc=$?" >> "$OUT/suite.log" ) &
suite=$!
timeout 240 $PT -s -rA -m gpu tests/test_grouped_wgrad_sm90_mxfp8.py > "$OUT/mxfp8_tests.log" 2>&1
echo "mxfp8 tests rc=$?"; grep -E "SQNR|passed|failed" "$OUT/mxfp8_tests.log" | tail -30
MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1 timeout 200 $PT -rA -m gpu \
  tests/test_grouped_wgrad_blockscaled_api.py > "$OUT/bsapi_tests.log" 2>&1
echo "block-scaled API (kernel enabled) rc=$?"; tail -3 "$OUT/bsapi_tests.log"
wait $suite
tail -4 "$OUT/suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -20
timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/bench_grouped_wgrad_mxfp8.py --quick > "$OUT/mxfp8_bench.log" 2>&1
echo "mxfp8 bench rc=$?"; tail -12 "$OUT/mxfp8_bench.log"
timeout 90 python3 benchmarks/bench_mx_quantize.py --sweep > "$OUT/mxq_sweep.log" 2>&1
echo "mxq sweep rc=$?"; tail -10 "$OUT/mxq_sweep.log"
timeout 60 python3 benchmarks/bench_grouped_wgrad.py --quick --no-quack > "$OUT/wgrad.log" 2>&1
echo "wgrad rc=$?"; tail -4 "$OUT/wgrad.log"
