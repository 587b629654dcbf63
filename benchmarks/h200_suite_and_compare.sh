#!/usr/bin/env bash
# One device call on a lent H200: the whole test suite (pytest without -m) and the cross-hardware
# comparison example of docs/compare-h200 (issue 9).
#   bash benchmarks/h200_suite_and_compare.sh [suite|compare|wgrad|all]
# (wgrad: benchmarks/bench_grouped_wgrad.py with the quack columns; needs quack-kernels importable)
# CuTe DSL must be importable (../shared/tools/stage-cute-dsl); the repo root goes on PYTHONPATH.
# Logs under $OUT: suite.log (+ suite_failures.log), compare.log, compare.json, compare-h200.tar.gz,
# wgrad.log/.json.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
moe_bwd() { python3 -m common.cli "$@"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

suite_pid=
if [ "$what" = suite ] || [ "$what" = all ]; then
  # -n 6: CPU-bound tests spread over cores; GPU tests share the one H200 (correctness only).
  ( timeout ${SUITE_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -n 6 -rfEs tests \
      > "$OUT/suite.log" 2>&1; echo "suite rc=$?" >> "$OUT/suite.log" ) &
  suite_pid=$!
fi

if [ "$what" = compare ] || [ "$what" = all ]; then
  P="--model qwen3-30b-a3b --tokens 512 --shrink 4"
  B=/tmp/bundles; rm -rf "$B"; mkdir -p "$B"
  {
    for be in torch cuda-sm90 nki-twin; do
      moe_bwd run $P --backend $be --device cuda --save "$B/$be-h200" || echo "run $be rc=$?"
    done
    moe_bwd run $P --backend nki-sim --device cpu --save "$B/nki-sim-cpu" || echo "run nki-sim rc=$?"
    R=/tmp/compare-h200; rm -rf "$R"
    moe_bwd compare "$B"/* --report "$R" || echo "compare rc=$?"
    moe_bwd compare "$B"/* --json > "$OUT/compare.json" || echo "compare json rc=$?"
    # Trainium numerics on the GPU: the twin (CUDA) against the kernel on the interpreter (CPU)
    moe_bwd compare "$B/nki-twin-h200" --baseline "$B/nki-sim-cpu" --report "$R/twin-vs-nki-sim" \
      || echo "compare twin rc=$?"
    # our fused CUDA backward against the plain torch backward on the same GPU
    moe_bwd compare "$B/cuda-sm90-h200" --baseline "$B/torch-h200" --report "$R/sm90-vs-torch" \
      || echo "compare sm90 rc=$?"
    python3 -m pytest -q -p no:cacheprovider tests/test_nki_twin.py tests/test_bundle.py || echo "twin tests rc=$?"
  } > "$OUT/compare.log" 2>&1
  tar -czf "$OUT/compare-h200.tar.gz" -C /tmp compare-h200 2>/dev/null
  tail -40 "$OUT/compare.log"
fi

if [ "$what" = wgrad ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_grouped_wgrad.py --json "$OUT/wgrad.json" \
    > "$OUT/wgrad.log" 2> "$OUT/wgrad.err"
  echo "wgrad bench rc=$?"; tail -16 "$OUT/wgrad.log"; tail -5 "$OUT/wgrad.err"
fi

if [ -n "$suite_pid" ]; then
  wait $suite_pid
  grep -E "^(FAILED|ERROR)" "$OUT/suite.log" > "$OUT/suite_failures.log"
  tail -25 "$OUT/suite.log"
fi
