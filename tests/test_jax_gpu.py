"""GPU tests of the JAX entries: the CuTe DSL kernels under ``jax.jit`` as XLA FFI custom calls.

Marked ``gpu`` (+ ``sm90`` / ``sm100``); skipped unless JAX sees a CUDA GPU of that family and
nvidia-cutlass-dsl is installed (SM100 also needs ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1``). Each
result is compared with the torch twin (``torch_ref.grouped_wgrad_torch``, fp32) on the same
operands. Covered: the dense functional form (BF16 / FP32 outputs, uneven splits with empty
experts, accumulation into ``wgrad_init``), the seed's token entry writing through caller-owned
pointers (uint8-packed, and int64 under x64), a re-run with new offsets values that neither
retraces nor recompiles, two jitted calls back to back without a sync between them, the token
entry with its token unused (``has_side_effect``), and the eager wrapper hook on JAX arrays.
"""

import importlib.util
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

jax = pytest.importorskip("jax", reason="JAX not installed")
jnp = pytest.importorskip("jax.numpy")

from cuda_kernels.grouped_wgrad import api  # noqa: E402
from cuda_kernels.grouped_wgrad import jax as wgrad_jax  # noqa: E402
from cuda_kernels.grouped_wgrad import jax_ffi, jax_plan  # noqa: E402
from cuda_kernels.grouped_wgrad.torch_ref import grouped_wgrad_torch  # noqa: E402


def _gpu_cc():
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    return jax_plan.device_cc(dev)


CC = _gpu_cc()
HAS_CUTE = importlib.util.find_spec("cutlass") is not None
SM90 = CC is not None and CC[0] == 9 and HAS_CUTE
SM100 = (CC is not None and CC[0] >= 10 and HAS_CUTE
         and os.environ.get("MOE_BWD_ENABLE_UNVERIFIED_SM100") == "1")
ARCHS = [
    pytest.param("sm90", marks=[pytest.mark.gpu, pytest.mark.sm90, pytest.mark.skipif(
        not SM90, reason="needs JAX on an SM 9.x GPU and nvidia-cutlass-dsl")]),
    pytest.param("sm100", marks=[pytest.mark.gpu, pytest.mark.sm100, pytest.mark.skipif(
        not SM100, reason="needs JAX on an SM100+ GPU, nvidia-cutlass-dsl and "
        "MOE_BWD_ENABLE_UNVERIFIED_SM100=1")]),
]
ALIGN = {"sm90": 8, "sm100": 256}  # expert token-count granularity each test split uses
H, I, E = 256, 256, 4
#: fp32 accumulation of BF16 products in both; only the output rounding differs.
TOL = {"float32": dict(rtol=2e-3, atol=2e-2), "bfloat16": dict(rtol=1.6e-2, atol=1e-1)}


def _operands(arch, counts, seed=0, s=None):
    counts = [c * ALIGN[arch] // 8 for c in counts]
    s = sum(counts) if s is None else s
    g = torch.Generator().manual_seed(seed)
    a_t = torch.randn(H, s, generator=g).to(torch.bfloat16)
    b_t = torch.randn(s, I, generator=g).to(torch.bfloat16)
    off_t = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    gpu = jax.devices("gpu")[0]
    a = jax.device_put(jnp.asarray(a_t.float().numpy(), jnp.bfloat16), gpu)
    b = jax.device_put(jnp.asarray(b_t.float().numpy(), jnp.bfloat16), gpu)
    off = jax.device_put(jnp.asarray(off_t.numpy()), gpu)
    return (a, b, off), (a_t, b_t, off_t)


def _ref(a_t, b_t, off_t):
    return grouped_wgrad_torch(a_t, b_t, off_t, out_dtype=torch.float32)


def _check(got, ref, dtype_name):
    got_t = torch.from_numpy(np.asarray(jnp.asarray(got, jnp.float32)))
    torch.testing.assert_close(got_t, ref, **TOL[dtype_name])


def _dense(arch):
    return (wgrad_jax.grouped_gemm_wgrad_dense_jax_sm90 if arch == "sm90"
            else wgrad_jax.grouped_gemm_wgrad_dense_jax_sm100)


def _token(arch):
    return (wgrad_jax.grouped_gemm_wgrad_jax_sm90 if arch == "sm90"
            else wgrad_jax.grouped_gemm_wgrad_jax_sm100)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_dense_under_jit_matches_torch_twin(arch, dtype_name):
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [64, 0, 192, 256])
    fn = jax.jit(lambda a, b, off: _dense(arch)(a, b, off, wgrad_dtype=dtype_name))
    w = fn(a, b, off)
    assert w.shape == (E, H, I) and w.dtype == jnp.dtype(dtype_name)
    _check(w, _ref(a_t, b_t, off_t), dtype_name)
    assert float(jnp.abs(w[1].astype(jnp.float32)).max()) == 0.0  # the empty expert is zero


@pytest.mark.parametrize("arch", ARCHS)
def test_new_offsets_rerun_without_recompiling(arch):
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [64, 0, 192, 256], seed=1)
    fn = jax.jit(lambda a, b, off: _dense(arch)(a, b, off))
    _check(fn(a, b, off), _ref(a_t, b_t, off_t), "float32")
    compiles, traces = jax_ffi.COMPILE_COUNT, fn._cache_size()
    for counts in ([512, 0, 0, 0], [128, 128, 128, 128], [0, 0, 0, 512]):
        new_t = torch.tensor(np.cumsum([c * ALIGN[arch] // 8 for c in counts]), dtype=torch.int32)
        new = jax.device_put(jnp.asarray(new_t.numpy()), jax.devices("gpu")[0])
        _check(fn(a, b, new), _ref(a_t, b_t, new_t), "float32")
    assert jax_ffi.COMPILE_COUNT == compiles, "new offsets values must not recompile the kernel"
    assert fn._cache_size() == traces, "new offsets values must not retrace"


@pytest.mark.parametrize("arch", ARCHS)
def test_accumulate_into_wgrad_init(arch):
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [64, 64, 0, 384], seed=2)
    init = jnp.full((E, H, I), 1.5, jnp.float32)
    w = jax.jit(lambda a, b, off, w0: _dense(arch)(a, b, off, wgrad_init=w0))(a, b, off, init)
    _check(w, _ref(a_t, b_t, off_t) + 1.5, "float32")
    assert float(init[0, 0, 0]) == 1.5  # functional: the input array is unchanged


def _caller_buffers(dtype):
    gpu = jax.devices("gpu")[0]
    outs = [jax.device_put(jnp.full((H, I), np.nan, dtype), gpu) for _ in range(E)]
    jax.block_until_ready(outs)
    addrs = [o.unsafe_buffer_pointer() for o in outs]
    return outs, addrs


def _read(outs):
    # the kernel wrote the buffers behind XLA's back: read fresh copies of the device memory
    return torch.stack([torch.from_numpy(np.array(o, dtype=np.float32)) for o in outs])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_token_entry_writes_caller_buffers(arch, dtype_name):
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [128, 0, 64, 320], seed=3)
    outs, addrs = _caller_buffers(dtype_name)
    ptrs = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8(addrs)), jax.devices("gpu")[0])
    fn = jax.jit(lambda a, b, off, p: _token(arch)(a, b, off, p, wgrad_dtype=dtype_name))
    token = fn(a, b, off, ptrs)
    assert token.shape == (1,) and token.dtype == jnp.int32
    jax.block_until_ready(token)
    _check(_read(outs), _ref(a_t, b_t, off_t), dtype_name)
    # validate_offsets outside jit: concrete values and pointers pass the host checks
    jax.block_until_ready(_token(arch)(a, b, off, ptrs, wgrad_dtype=dtype_name,
                                       validate_offsets=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_token_entry_int64_pointers_with_x64(arch):
    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:
        from jax.experimental import enable_x64
    with enable_x64(True):
        (a, b, off), (a_t, b_t, off_t) = _operands(arch, [256, 64, 64, 128], seed=4)
        outs, addrs = _caller_buffers("float32")
        ptrs = jax.device_put(jnp.asarray(addrs, jnp.int64), jax.devices("gpu")[0])
        token = jax.jit(lambda a, b, off, p: _token(arch)(a, b, off, p, wgrad_dtype="float32"))(
            a, b, off, ptrs)
        jax.block_until_ready(token)
    _check(_read(outs), _ref(a_t, b_t, off_t), "float32")


@pytest.mark.parametrize("arch", ARCHS)
def test_two_jitted_calls_back_to_back(arch):
    """Two different jitted programs dispatched without a sync between them (XLA's stream
    orders them); then both results are checked."""
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [64, 0, 192, 256], seed=5)
    (a2, b2, off2), (a2_t, b2_t, off2_t) = _operands(arch, [0, 512, 0, 0], seed=6)
    dense = jax.jit(lambda a, b, off: _dense(arch)(a, b, off, wgrad_dtype="bfloat16"))
    outs, addrs = _caller_buffers("float32")
    ptrs = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8(addrs)), jax.devices("gpu")[0])
    token_fn = jax.jit(lambda a, b, off, p: _token(arch)(a, b, off, p, wgrad_dtype="float32"))
    w1 = dense(a, b, off)
    token = token_fn(a2, b2, off2, ptrs)
    w2 = dense(a2, b2, off2)
    jax.block_until_ready((w1, token, w2))
    _check(w1, _ref(a_t, b_t, off_t), "bfloat16")
    _check(_read(outs), _ref(a2_t, b2_t, off2_t), "float32")
    _check(w2, _ref(a2_t, b2_t, off2_t), "bfloat16")


@pytest.mark.parametrize("arch", ARCHS)
def test_unused_token_still_launches(arch):
    """``has_side_effect``: a jitted program that drops the token still runs the kernel."""
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [128, 128, 128, 128], seed=7)
    outs, addrs = _caller_buffers("float32")
    ptrs = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8(addrs)), jax.devices("gpu")[0])

    @jax.jit
    def step(a, b, off, p):
        _token(arch)(a, b, off, p, wgrad_dtype="float32")  # token dropped
        return off + 1

    jax.block_until_ready(step(a, b, off, ptrs))
    _check(_read(outs), _ref(a_t, b_t, off_t), "float32")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["dense", "discrete_uint8", "discrete_stacked"])
def test_eager_wrapper_hook_on_jax_arrays(arch, mode):
    """The wrappers take JAX arrays (the seed's eager JAX support, through
    ``call_wrapper_on_jax_arrays``): the real kernel on the CUDA legacy default stream, JAX
    arrays back."""
    (a, b, off), (a_t, b_t, off_t) = _operands(arch, [64, 0, 192, 256], seed=8)
    wrapper = (api.grouped_gemm_wgrad_wrapper_sm90 if arch == "sm90"
               else api.grouped_gemm_wgrad_wrapper_sm100)
    ref = _ref(a_t, b_t, off_t)
    kw = dict(a_tensor=a, b_tensor=b, sfa_tensor=None, sfb_tensor=None, offsets_tensor=off,
              wgrad_dtype=torch.float32)
    if mode == "dense":
        (w,) = wrapper(output_mode="dense", **kw)
        _check(w, ref, "float32")
    elif mode == "discrete_stacked":
        w0 = jnp.zeros((E, H, I), jnp.float32)
        (w,) = wrapper(output_mode="discrete", wgrad_tensor=w0, **kw)
        _check(w, ref, "float32")
        assert float(jnp.abs(w0).max()) == 0.0  # the JAX input array is never written
    else:
        outs, addrs = _caller_buffers("float32")
        ptrs = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8(addrs)),
                              jax.devices("gpu")[0])
        res = wrapper(output_mode="discrete", wgrad_ptrs=ptrs, **kw)
        assert res["wgrad_tensor"] is None
        _check(_read(outs), ref, "float32")
