#!/usr/bin/env bash
# Device-side checks of the JAX entries (cuda_kernels/grouped_wgrad/jax.py, jax_ffi.py) on a lent
# H200, for one call. Logs under $OUT:
#   env.log          python / jax / jaxlib / torch / CuTe DSL versions, JAX devices, the DSL runtime
#   gpu_tests.log    tests/test_jax_gpu.py (-m gpu): the kernels under jax.jit vs the torch twin,
#                    re-run with new offsets (no recompile), back-to-back jitted calls, the token
#                    entry through caller-owned pointers, the eager wrapper hook on JAX arrays
#   cpu_tests.log    tests/test_jax_entries.py + the JAX tests of test_grouped_wgrad_api.py
# Usage (repository root, CuTe DSL unpacked and on PYTHONPATH):
#   bash benchmarks/jax_device_checks.sh [pytest -k expression]
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
K=${1:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # torch and JAX share the GPU in one process
{
  python3 --version
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices()); d = jax.devices()[0]; print('cc', getattr(d, 'compute_capability', None), 'sms', getattr(d, 'core_count', None))"
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  python3 -c "import importlib.metadata as m; print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))" 2>&1
  python3 -c "import cutlass.jax as cj; print('cutlass.jax', cj.is_available(), cj.find_cute_dsl_runtime_library(), 'ffi v', cj.get_cutlass_call_ffi_version())" 2>&1
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_jax_gpu.py ${K:+-k "$K"} \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -15 "$OUT/gpu_tests.log"
if [ -z "$K" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_jax_entries.py \
    tests/test_grouped_wgrad_api.py -k "jax" > "$OUT/cpu_tests.log" 2>&1
  echo "cpu tests rc=$?"; tail -3 "$OUT/cpu_tests.log"
fi
