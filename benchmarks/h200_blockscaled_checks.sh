#!/usr/bin/env bash
# One device call on a lent H200 after block-scaled / launch changes: the whole suite (in the
# background), every GPU case of the SM90 MXFP8 kernel in its own process (an illegal instruction is
# sticky and would poison a shared process), then (alone on the GPU) the MXFP8 wgrad benchmark, the MX quantizer against
# torchao's Triton cast (floor rule; torchao's gate lifted on SM90) and a quick BF16 wgrad benchmark.
# Logs under $OUT. Needs CuTe DSL and torchao on PYTHONPATH (see benchmarks/RESULTS.md).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX tests share the GPU with torch
PT="python3 -m pytest -q -p no:cacheprovider"
( timeout ${SUITE_TIMEOUT:-300} $PT -n 6 -rfE tests > "$OUT/suite.log" 2>&1; echo "suite rc=$?" >> "$OUT/suite.log" ) &
suite=$!
export MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1
ids=$(python3 -m pytest -p no:cacheprovider --collect-only -q -m gpu tests/test_grouped_wgrad_sm90_mxfp8.py 2>/dev/null | grep '::')
( timeout 200 $PT -rA -m gpu tests/test_grouped_wgrad_blockscaled_api.py > "$OUT/bsapi.log" 2>&1
  echo "block-scaled API, kernel enabled: rc=$?" >> "$OUT/bsapi.log" ) &
echo "$ids" | xargs -P 4 -I{} sh -c 'f=$(mktemp); timeout 150 python3 -m pytest -q -s -p no:cacheprovider "{}" > $f 2>&1; rc=$?; echo "rc=$rc {} $(grep -o "SQNR=[0-9.a-z-]* dB" $f | head -1) $(grep -m1 -oE "(CUDA|Cuda|cuda)[A-Za-z ]*[Ee]rror[^\n]{0,120}" $f)"' \
  | sort > "$OUT/mxfp8_cases.log"
echo "mxfp8 cases: $(grep -c '^rc=0' "$OUT/mxfp8_cases.log") ok of $(wc -l < "$OUT/mxfp8_cases.log")"
grep -v '^rc=0' "$OUT/mxfp8_cases.log" | head -30
wait $suite
tail -3 "$OUT/bsapi.log"
tail -4 "$OUT/suite.log"; grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -20
timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/bench_grouped_wgrad_mxfp8.py --quick > "$OUT/mxfp8_bench.log" 2>&1
echo "mxfp8 bench rc=$?"; tail -12 "$OUT/mxfp8_bench.log"
timeout 120 python3 benchmarks/bench_mx_quantize.py --rule ocp > "$OUT/mxq.log" 2>&1
echo "mxq rc=$?"; tail -16 "$OUT/mxq.log"
timeout 60 python3 benchmarks/bench_grouped_wgrad.py --quick --no-quack > "$OUT/wgrad.log" 2>&1
echo "wgrad rc=$?"; tail -4 "$OUT/wgrad.log"
