#!/usr/bin/env bash
# One device call on a lent SM90 GPU (issue 33 item 5): the wgrad kernel that reads X / dY
# through the routing index -- its GPU tests with the gather keys' gate open, its timing against
# the dense kernel on gathered copies, and the layer's step and peak memory with every shipped
# shape's `wgrad_gather` set true against set false.
#   bash benchmarks/wgrad_gather_device_run.sh [shapes, default qwen3-30b-a3b:16384,mixtral-8x7b:8192]
# (SKIP_TESTS=1 / SKIP_WGRAD=1 / SKIP_COMBINE=1 leave out the tests / the kernel bench / the
# combine bound)
# Needs CuTe DSL in .device/cute-dsl.tar.xz (../shared/tools/stage-cute-dsl). Logs under $OUT.
# After a change to the gather producer: its tests here before GATHER_VERIFIED_ON_GPU stays True
# (cuda_kernels/gemm/sm90/wgrad_bf16.py); `wgrad_gather: true` in
# configs/cuda/grouped_mm_choice.yaml where the layer's step wins or the memory is worth its time
# (qwen3-30b-a3b today: benchmarks/RESULTS.md, 2026-12-06T13:56Z-14:26Z). The layer runs on two
# copies of the tree, every shape's `wgrad_gather` false ("copies") and true ("gather").
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SHAPES=${1:-qwen3-30b-a3b:16384,mixtral-8x7b:8192}
mkdir -p /tmp/site-packages && tar -xJf .device/cute-dsl.tar.xz -C /tmp/site-packages
SITE="/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH="$PWD:$SITE"
export MOE_BWD_ENABLE_UNVERIFIED_SM90_WGRAD_GATHER=1 MOE_BWD_KERNEL_CACHE=$(mktemp -d)
# two copies of the tree: every shape's wgrad_gather false (copies) and true (gather)
for name in copies gather; do
  rm -rf /tmp/$name-tree && mkdir -p /tmp/$name-tree
  cp -r common cuda_kernels configs benchmarks nki_kernels tests pyproject.toml /tmp/$name-tree/
  y=/tmp/$name-tree/configs/cuda/grouped_mm_choice.yaml
  sed -i 's/, wgrad_gather: \(true\|false\)}/}/' "$y"
  [ $name = gather ] && sed -i 's/backward_down_dgrad: \([a-z-]*\)}/backward_down_dgrad: \1, wgrad_gather: true}/' "$y"
done
[ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu \
  tests/test_grouped_wgrad_gather.py tests/test_wgrad_gather_layer.py > "$OUT/gather_tests.log" 2>&1
echo "gather tests rc=$?"; tail -2 "$OUT/gather_tests.log"
[ -n "${SKIP_WGRAD:-}" ] || timeout 120 python3 benchmarks/bench_grouped_wgrad.py --gather --json "$OUT/wgrad_gather.json" \
  > "$OUT/wgrad_gather.log" 2>&1
echo "wgrad bench rc=$?"; grep -A12 "^shape " "$OUT/wgrad_gather.log"
for name in copies gather; do
  tree=/tmp/$name-tree
  (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 200 python3 benchmarks/bench_moe_layer.py \
     --impls ours,ours-fused --shapes "$SHAPES" --profile off --json "$OUT/layer_$name.json" \
     2> "$OUT/layer_$name.err" | grep "^| [a-z]" | sed "s/^/$name /" | cut -d'|' -f1-6,12)
done
[ -n "${SKIP_COMBINE:-}" ] || timeout 60 python3 benchmarks/bench_combine.py --shapes "$SHAPES" 2>&1 | tail -4
