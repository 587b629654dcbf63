#!/usr/bin/env bash
# Device-side checks of the SM90 grouped wgrad kernel, for one call on a lent H200:
#   1. every GPU test of tests/test_grouped_wgrad_sm90.py in its own process (4 at a time), so a
#      sticky CUDA error in one test cannot fail the others; results in $OUT/tests_summary.log
#   2. compute-sanitizer memcheck on a small case ($SANITIZE_TEST), $OUT/sanitizer.log
# Usage: bash benchmarks/sm90_device_checks.sh [pytest -k expression]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
K=${1:-}
ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_grouped_wgrad_sm90.py ${K:+-k "$K"} | grep '::')
export CUDA_LAUNCH_BLOCKING=${CUDA_LAUNCH_BLOCKING:-0}
echo "$ids" | xargs -P 4 -I{} sh -c 'timeout 150 python3 -m pytest -q -p no:cacheprovider "{}" > /tmp/t_$$.log 2>&1; rc=$?; echo "rc=$rc {}"; if [ $rc -ne 0 ]; then (echo "=== {}"; grep -E "^E |Error|error:" /tmp/t_$$.log | head -8) >> '"$OUT"'/tests_failures.log; fi' | sort | tee "$OUT/tests_summary.log"
if [ -n "${SANITIZE_TEST:-}" ]; then
  timeout 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider "$SANITIZE_TEST" > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -3
fi
