#!/usr/bin/env bash
# One device call on a lent H200: the fused backward's GPU tests, then the whole-backward benchmark.
#   bash benchmarks/moe_backward_device_run.sh [tests|bench|all] [extra benchmark args]
# Logs under $OUT: gpu_tests.log, bench.md, bench.json. CuTe DSL must be importable (see
# ../shared/tools/stage-cute-dsl); the repo root is put on PYTHONPATH (no install needed).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
shift || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout ${TEST_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_fused_backward.py tests/test_layer.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-420} python benchmarks/bench_moe_backward.py --json "$OUT/bench.json" "$@" \
    > "$OUT/bench.md" 2> "$OUT/bench.err"
  echo "bench rc=$?"; cat "$OUT/bench.md"; tail -5 "$OUT/bench.err"
fi
