#!/usr/bin/env bash
# One device call on a lent SM90 GPU (issue 33 item 1): the varlen-M kernel's TMA-store
# epilogue (Sm90GroupedMmTile.epi_tma, opt-in until this has run) -- its GPU tests with the
# dgated path's gate open, the fused and plain GEMMs with and without it, and the layer on two
# copies of the tree: the tile rules as shipped ("reg") and with `epi_tma: true` on every rule
# ("tma"), each as ours (the choice table), ours-gemm and ours-fused.
#   bash benchmarks/epi_tma_device_run.sh [shapes, default qwen3-30b-a3b:16384]
# (SKIP_TESTS=1 / SKIP_KERNELS=1 / SKIP_LAYER=1 leave out a step; about 8 minutes in all)
# Needs CuTe DSL in .device/cute-dsl.tar.xz (../shared/tools/stage-cute-dsl). Logs under $OUT.
# After it: DGATED_TMA_VERIFIED_ON_GPU = True (cuda_kernels/gemm/sm90/grouped_mm.py) if the
# dgated tests passed; `epi_tma: true` in configs/cuda/sm90_grouped_mm_tiles.yaml if the "tma"
# layer rows win, then the whole GPU suite; the choice table (grouped_mm_choice.yaml) per shape
# from the ours-gemm / ours-fused rows of the "tma" copy.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SHAPES=${1:-qwen3-30b-a3b:16384}
mkdir -p /tmp/site-packages && tar -xJf .device/cute-dsl.tar.xz -C /tmp/site-packages
SITE="/tmp/site-packages:/tmp/site-packages/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH="$PWD:$SITE"
export MOE_BWD_ENABLE_UNVERIFIED_SM90_DGATED_TMA=1 MOE_BWD_KERNEL_CACHE=$(mktemp -d)
for name in reg tma; do
  rm -rf /tmp/$name-tree && mkdir -p /tmp/$name-tree
  cp -r common cuda_kernels configs benchmarks nki_kernels tests pyproject.toml /tmp/$name-tree/
done
sed -i 's/stages: \([0-9]*\)}/stages: \1, epi_tma: true}/' \
  /tmp/tma-tree/configs/cuda/sm90_grouped_mm_tiles.yaml
grep -c "epi_tma: true" /tmp/tma-tree/configs/cuda/sm90_grouped_mm_tiles.yaml
[ -n "${SKIP_TESTS:-}" ] || { timeout 150 python3 -m pytest -q -p no:cacheprovider -n 12 -m gpu \
  tests/test_grouped_mm_sm90.py > "$OUT/grouped_mm_tests.log" 2>&1
  echo "grouped_mm tests rc=$?"; tail -2 "$OUT/grouped_mm_tests.log"; }
[ -n "${SKIP_KERNELS:-}" ] || { timeout 150 python3 benchmarks/bench_grouped_mm.py \
  --impls ours,grouped_mm --checkpoint-rows --shapes "$SHAPES" \
  --gemms gate_up,down_dgrad,gate_up_act,down_dgrad_act --tiles 128x256s4,128x256s4-tma \
  --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; grep "^| " "$OUT/kernels.log" | grep -v "^| shape" | cut -d'|' -f3-6; }
if [ -z "${SKIP_LAYER:-}" ]; then
  for name in reg tma; do
    tree=/tmp/$name-tree
    (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 120 python3 benchmarks/bench_moe_layer.py \
       --impls ours,ours-gemm,ours-fused --shapes "$SHAPES" --profile off \
       --json "$OUT/layer_$name.json" 2> "$OUT/layer_$name.err" \
       | grep "^| [a-z]" | sed "s/^/$name /" | cut -d'|' -f1-6,12)
  done
fi
