#!/usr/bin/env bash
# One device call on a lent H200: the MoE layer's training-step benchmark (bench_moe_layer.py).
#   bash benchmarks/moe_layer_device_run.sh [bench] [extra benchmark args]
# Installs the wheels carried in .device/whl (sonic-moe, quack-kernels, torchtitan, ...) into
# /tmp/site-packages and unpacks CuTe DSL from .device/cute-dsl.tar.xz there too; the path must
# contain /site-packages/ (quack's epilogue fusions and SonicMoE fail elsewhere).
# Logs: $OUT/layer_bench.{md,json,err}.
# SonicMoE (as installed, quack autotunes) compiles ~100 s per shape: one shape per call.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-bench}
shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site-packages/ .device/whl/*.whl
# CuTe DSL under the same /site-packages/ path: from elsewhere every SonicMoE call failed
# (TypeError: epilogue fn depends on <ContextVar _LOC_TRANSFORMS>, H200, 2026-12-01)
mkdir -p /tmp/site-packages && tar -xJf .device/cute-dsl.tar.xz -C /tmp/site-packages
export PYTHONPATH="$PWD:/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, \
  torch.cuda.get_device_name())"
if [ "$what" = bench ]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_moe_layer.py \
    --json "$OUT/layer_bench.json" "$@" > "$OUT/layer_bench.md" 2> "$OUT/layer_bench.err"
  echo "bench rc=$?"; cat "$OUT/layer_bench.md"; tail -5 "$OUT/layer_bench.err"
else
  echo "unknown mode $what (want: bench)"; exit 2
fi
