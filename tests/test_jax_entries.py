"""CPU tests of the JAX entries (``cuda_kernels/grouped_wgrad/jax.py`` and ``jax_ffi.py``).

JAX's CPU backend: the static validation of the ``jax.jit`` entries (shapes, dtypes, layouts,
pointer-array lengths, tiles) eagerly and under tracing, the error contract (tracers where concrete
arrays are required, wrong dtypes, arrays on another device, the block-scaled error), the eager
DLPack conversion the wrappers call (zero copy, uint8 pointer view, immutable outputs), the
``jax.numpy`` twin against the torch twin, the ``jax.custom_vjp`` example of ``grouped_wgrad_jax``
under ``jax.jit(jax.grad(...))``, and offline compiles of the FFI adapter for sm_90a / sm_100a
(skipped without nvidia-cutlass-dsl). The kernels themselves run in ``tests/test_jax_gpu.py``.
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="JAX not installed (pip install '.[jax]' or '.[test]')")
jnp = pytest.importorskip("jax.numpy")

from cuda_kernels.grouped_wgrad import api  # noqa: E402
from cuda_kernels.grouped_wgrad import jax as wgrad_jax  # noqa: E402
from cuda_kernels.grouped_wgrad import jax_ffi  # noqa: E402
from cuda_kernels.grouped_wgrad.torch_ref import grouped_wgrad_torch  # noqa: E402

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed")
CPU = jax.devices("cpu")[0]

H, I, E = 128, 128, 4  # multiples of every SM90 / SM100 tile used by the defaults


def _arr(shape, dtype, value=0):
    return jax.device_put(jnp.full(shape, value, dtype=dtype), CPU)


def _ops(s=512, e=E, h=H, i=I, a_dtype=jnp.bfloat16, b_dtype=jnp.bfloat16, off_dtype=jnp.int32):
    return _arr((h, s), a_dtype), _arr((s, i), b_dtype), _arr((e,), off_dtype)


# ------------------------------------------------------------------------------------------------
# Static validation of the jit entries
# ------------------------------------------------------------------------------------------------

#: (case, overrides of the call, error pattern). One row per rule of ``check_jax_wgrad_call``.
_BAD_STATIC = [
    ("a float32", dict(a=("f32",)), "a must be a 2-D .* bfloat16"),
    ("a 3-D", dict(a=("3d",)), "a must be a 2-D"),
    ("b float16", dict(b=("f16",)), "b must be a 2-D .* bfloat16"),
    ("b rows != S", dict(b=("rows",)), r"b.shape\[0\] .* must equal a.shape\[1\]"),
    ("offsets int64-like", dict(offsets=("u32",)), "offsets must be a 1-D .* int32"),
    ("offsets 2-D", dict(offsets=("2d",)), "offsets must be a 1-D"),
    ("S not multiple of 8", dict(s=100), "tokens_sum % 8 == 0"),
    ("S zero", dict(s=0), "tokens_sum must be >= 1"),
    ("I not multiple of 8", dict(i=132), "intermediate % 8 == 0"),
    ("ptrs missing", dict(ptrs=None), "wgrad_ptrs is required"),
    ("ptrs short uint8", dict(ptrs=("u8", 8 * E - 8)), "wgrad_ptrs has 24 uint8 entries"),
    ("ptrs int32", dict(ptrs=("i32", E)), "wgrad_ptrs must be a 1-D int64"),
    ("ptrs 2-D", dict(ptrs=("u8_2d", E)), "wgrad_ptrs must be a 1-D int64"),
    ("wgrad_dtype int8", dict(wgrad_dtype="int8"), "wgrad_dtype must be bfloat16"),
    ("tile does not fit", dict(h=100), "unsupported SM90 tiling"),
    ("not an array", dict(a=("list",)), "a must be a JAX array"),
]


def _bad_call(arch, case):
    s = case.get("s", 512)
    h, i = case.get("h", H), case.get("i", I)
    a, b, off = _ops(s=s, h=h, i=i)
    kinds = {
        "f32": lambda x: x.astype(jnp.float32), "f16": lambda x: x.astype(jnp.float16),
        "3d": lambda x: x[None], "2d": lambda x: x[None], "u32": lambda x: x.astype(jnp.uint32),
        "rows": lambda x: x[:-8], "list": lambda x: [1, 2],
    }
    if "a" in case:
        a = kinds[case["a"][0]](a)
    if "b" in case:
        b = kinds[case["b"][0]](b)
    if "offsets" in case:
        off = kinds[case["offsets"][0]](off)
    ptrs = _arr((8 * E,), jnp.uint8)
    if "ptrs" in case:
        spec = case["ptrs"]
        if spec is None:
            ptrs = None
        else:
            kind, n = spec
            ptrs = {"u8": lambda: _arr((n,), jnp.uint8), "i32": lambda: _arr((n,), jnp.int32),
                    "u8_2d": lambda: _arr((n, 8), jnp.uint8)}[kind]()
    return a, b, off, ptrs, case.get("wgrad_dtype", "bfloat16")


@pytest.mark.parametrize("name,case,pattern", _BAD_STATIC, ids=[c[0] for c in _BAD_STATIC])
def test_static_rules_eager_and_under_jit(name, case, pattern):
    a, b, off, ptrs, wdt = _bad_call("sm90", case)
    with pytest.raises(ValueError, match=pattern):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, wgrad_ptrs=ptrs, wgrad_dtype=wdt)
    with pytest.raises(ValueError, match=pattern):  # the entry itself, eagerly
        wgrad_jax.grouped_gemm_wgrad_jax_sm90(a, b, off, ptrs, wgrad_dtype=wdt)
    if name == "not an array":
        return
    # the same rule while tracing: shapes and dtypes are all the entry needs
    fn = jax.jit(lambda a, b, off, p: wgrad_jax.grouped_gemm_wgrad_jax_sm90(
        a, b, off, p, wgrad_dtype=wdt))
    with pytest.raises(ValueError, match=pattern):
        fn.trace(a, b, off, ptrs)


def test_sm100_rules():
    a, b, off = _ops(s=512 + 8)
    ptrs = _arr((8 * E,), jnp.uint8)
    with pytest.raises(ValueError, match="multiple of 256, so tokens_sum too"):
        jax_ffi.check_jax_wgrad_call("sm100", a, b, off, wgrad_ptrs=ptrs)
    a, b, off = _ops(s=512)
    plan = jax_ffi.check_jax_wgrad_call("sm100", a, b, off, wgrad_ptrs=ptrs)
    assert plan.arch == "sm100" and plan.ptr_dtype == "uint8" and plan.tokens_sum == 512
    assert plan.key.output_mode == "discrete" and plan.key.a_major == "k"
    with pytest.raises(ValueError, match="arch must be"):
        jax_ffi.check_jax_wgrad_call("sm80", a, b, off, wgrad_ptrs=ptrs)


def test_dense_rules_and_plan():
    a, b, off = _ops()
    plan = jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense",
                                        wgrad_dtype=jnp.float32)
    assert (plan.key.out_dtype, plan.key.output_mode, plan.ptr_dtype) == ("float32", "dense", None)
    assert not plan.key.accumulate
    init = _arr((E, H, I), jnp.float32)
    plan = jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense",
                                        wgrad_dtype="float32", wgrad_init=init)
    assert plan.key.accumulate
    with pytest.raises(ValueError, match="wgrad_init must be"):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense",
                                     wgrad_dtype="float32", wgrad_init=init[:2])
    with pytest.raises(ValueError, match=r"wgrad_init dtype \(float32\) must equal"):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense",
                                     wgrad_dtype="bfloat16", wgrad_init=init)
    with pytest.raises(ValueError, match="wgrad_ptrs must be None for dense"):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense",
                                     wgrad_ptrs=_arr((8 * E,), jnp.uint8))
    with pytest.raises(ValueError, match="output_mode must be"):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="stacked")


def test_int64_pointer_array_with_x64():
    code = (
        "import jax; jax.config.update('jax_enable_x64', True)\n"
        "import jax.numpy as jnp\n"
        "from cuda_kernels.grouped_wgrad import jax_ffi\n"
        "a = jnp.zeros((128, 512), jnp.bfloat16); b = jnp.zeros((512, 128), jnp.bfloat16)\n"
        "off = jnp.zeros((4,), jnp.int32)\n"
        "p = jax_ffi.check_jax_wgrad_call('sm90', a, b, off, wgrad_ptrs=jnp.zeros(4, jnp.int64))\n"
        "print(p.ptr_dtype)\n"
        "try:\n"
        "    jax_ffi.check_jax_wgrad_call('sm90', a, b, off, wgrad_ptrs=jnp.zeros(3, jnp.int64))\n"
        "except ValueError as e:\n"
        "    print('needs 4' in str(e))\n"
    )
    out = _run(code)
    assert out.split() == ["int64", "True"]


def test_cpu_device_and_value_checks():
    a, b, off = _ops()
    ptrs = _arr((8 * E,), jnp.uint8)
    with pytest.raises(RuntimeError, match="runs a CUDA kernel.*cpu"):
        wgrad_jax.grouped_gemm_wgrad_jax_sm90(a, b, off, ptrs)
    with pytest.raises(RuntimeError, match="runs a CUDA kernel"):
        wgrad_jax.grouped_gemm_wgrad_dense_jax_sm100(a, b, off)
    # validate_offsets: concrete values are checked on the host (before the device check) ...
    bad = jax.device_put(jnp.asarray([128, 64, 512, 512], jnp.int32), CPU)
    with pytest.raises(ValueError, match="non-decreasing"):
        wgrad_jax.grouped_gemm_wgrad_jax_sm90(a, b, bad, ptrs, validate_offsets=True)
    short = jax.device_put(jnp.asarray([128, 256, 256, 384], jnp.int32), CPU)
    # the torch entries' offsets rule and message (one validation pipeline)
    with pytest.raises(ValueError, match="offsets: last offset 384 must equal tokens_sum 512"):
        wgrad_jax.grouped_gemm_wgrad_dense_jax_sm90(a, b, short, validate_offsets=True)
    odd = jax.device_put(jnp.asarray([128, 256, 256, 512], jnp.int32), CPU)
    with pytest.raises(ValueError, match="multiple of 256 on SM100"):
        wgrad_jax.grouped_gemm_wgrad_dense_jax_sm100(a, b, odd, validate_offsets=True)
    good = jax.device_put(jnp.asarray([128, 256, 256, 512], jnp.int32), CPU)
    null = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8([16, 32, 0, 48])), CPU)
    with pytest.raises(ValueError, match=r"wgrad_ptrs\[2\] = 0x0"):
        wgrad_jax.grouped_gemm_wgrad_jax_sm90(a, b, good, null, validate_offsets=True)
    # ... and a tracer cannot be: a clear error, not a silent skip
    fn = jax.jit(lambda a, b, off, p: wgrad_jax.grouped_gemm_wgrad_jax_sm90(
        a, b, off, p, validate_offsets=True))
    with pytest.raises(ValueError, match="needs a concrete offsets.*tracer"):
        fn.trace(a, b, good, ptrs)


def test_arrays_on_another_device():
    """Two CPU devices (XLA host platform split): an operand on the other device is refused by
    the jit entry and by the eager conversion, before any launch."""
    code = (
        "import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
        "import jax, jax.numpy as jnp\n"
        "from cuda_kernels.grouped_wgrad import jax as wj\n"
        "d0, d1 = jax.devices('cpu')[:2]\n"
        "a = jax.device_put(jnp.zeros((128, 512), jnp.bfloat16), d0)\n"
        "b = jax.device_put(jnp.zeros((512, 128), jnp.bfloat16), d1)\n"
        "off = jax.device_put(jnp.zeros((4,), jnp.int32), d0)\n"
        "p = jax.device_put(jnp.zeros((32,), jnp.uint8), d0)\n"
        "for f in (lambda: wj.grouped_gemm_wgrad_jax_sm90(a, b, off, p),\n"
        "          lambda: wj.jax_arrays_to_torch(dict(a_tensor=a, b_tensor=b,\n"
        "                                              offsets_tensor=off))):\n"
        "    try:\n"
        "        f(); print('no error')\n"
        "    except ValueError as e:\n"
        "        print('one device only' in str(e) and 'b' in str(e))\n"
    )
    assert _run(code).split() == ["True", "True"]


def _run(code: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ------------------------------------------------------------------------------------------------
# Eager: the conversion the wrappers call
# ------------------------------------------------------------------------------------------------


def test_has_jax_arrays_never_imports_jax():
    code = (
        "import sys\n"
        "from cuda_kernels.grouped_wgrad import jax as wj\n"
        "import torch\n"
        "print(wj.has_jax_arrays(torch.zeros(2), None, 3), 'jax' in sys.modules)\n"
    )
    assert _run(code).split() == ["False", "False"]
    assert wgrad_jax.has_jax_arrays(None, _arr((2,), jnp.float32))
    assert not wgrad_jax.has_jax_arrays(torch.zeros(2), np.zeros(2))


def test_conversion_zero_copy_pointer_view_and_output_copy():
    a, b, off = _ops()
    ptrs = jax.device_put(jnp.asarray(jax_ffi.pack_pointers_uint8([256, 512, 1024, 4096])), CPU)
    w0 = _arr((E, H, I), jnp.float32, 1.0)
    t = wgrad_jax.jax_arrays_to_torch(
        dict(a_tensor=a, b_tensor=b, sfa_tensor=None, offsets_tensor=off, wgrad_tensor=w0,
             wgrad_ptrs=ptrs, output_mode="discrete", accumulate_on_output=True),
        require_cuda=False,
    )
    assert t["a_tensor"].data_ptr() == a.unsafe_buffer_pointer()  # DLPack: zero copy
    assert t["a_tensor"].dtype == torch.bfloat16 and t["a_tensor"].stride() == (512, 1)
    assert t["b_tensor"].stride() == (I, 1)  # N-major B
    assert t["wgrad_ptrs"].dtype == torch.int64
    assert t["wgrad_ptrs"].tolist() == [256, 512, 1024, 4096]
    # the output is a copy (JAX arrays are immutable), starting from w0 when accumulating
    assert t["wgrad_tensor"].data_ptr() != w0.unsafe_buffer_pointer()
    assert float(t["wgrad_tensor"].sum()) == E * H * I
    assert t["output_mode"] == "discrete" and t["sfa_tensor"] is None


def test_conversion_errors():
    a, b, off = _ops()
    base = dict(a_tensor=a, b_tensor=b, offsets_tensor=off)
    with pytest.raises(ValueError, match="a_tensor is on .*cpu.*CUDA device"):
        wgrad_jax.jax_arrays_to_torch(base)
    with pytest.raises(ValueError, match="a_tensor is on .*CUDA device"):  # the wrapper hook
        wgrad_jax.call_wrapper_on_jax_arrays(api.grouped_gemm_wgrad_wrapper_sm90, **base)
    for wrapper in (api.grouped_gemm_wgrad_wrapper_sm90, api.grouped_gemm_wgrad_wrapper_sm100):
        with pytest.raises(ValueError, match="a_tensor is on .*CUDA device"):  # JAX arrays in
            wrapper(sfa_tensor=None, sfb_tensor=None, **base)
    for arg in ("sfa_tensor", "global_scale_b"):
        with pytest.raises(ValueError, match=f"{arg}: the block-scaled .* not expressible"):
            wgrad_jax.jax_arrays_to_torch({**base, arg: _arr((4,), jnp.float32)})
    fp8 = _arr((H, 512), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn: the block-scaled"):
        wgrad_jax.jax_arrays_to_torch({**base, "a_tensor": fp8})
    with pytest.raises(ValueError, match="b_tensor must be bfloat16"):
        wgrad_jax.jax_arrays_to_torch({**base, "b_tensor": b.astype(jnp.float32)})
    with pytest.raises(ValueError, match="offsets_tensor is a Tensor while other"):
        wgrad_jax.jax_arrays_to_torch({**base, "offsets_tensor": torch.zeros(4, dtype=torch.int32)})
    with pytest.raises(ValueError, match="current_stream must be None with JAX arrays"):
        wgrad_jax.jax_arrays_to_torch({**base, "current_stream": 0}, require_cuda=False)
    with pytest.raises(ValueError, match="wgrad_ptrs must be a 1-D int64"):
        wgrad_jax.jax_arrays_to_torch({**base, "wgrad_ptrs": _arr((30,), jnp.uint8)},
                                      require_cuda=False)

    @jax.jit
    def traced(a, b, off):
        wgrad_jax.jax_arrays_to_torch(dict(a_tensor=a, b_tensor=b, offsets_tensor=off))
        return a

    with pytest.raises(ValueError, match="a_tensor is a JAX tracer.*use grouped_gemm_wgrad_jax_sm100"):
        traced(a, b, off)


# ------------------------------------------------------------------------------------------------
# The jax.numpy twin and the custom_vjp example (run anywhere)
# ------------------------------------------------------------------------------------------------

_SPLITS = {
    "uneven with empty": [64, 0, 192, 256],
    "one expert takes all": [0, 512, 0, 0],
    "every expert empty": [0, 0, 0, 0],
    "many small experts": [1, 7, 0, 33, 200, 3, 0, 268],
}


@pytest.mark.parametrize("split", list(_SPLITS), ids=list(_SPLITS))
def test_reference_twin_matches_torch_twin(split):
    counts = _SPLITS[split]
    g = torch.Generator().manual_seed(7)
    s = sum(counts)  # last offset == S (every expert empty: no tokens)
    a_t = torch.randn(H, s, generator=g).to(torch.bfloat16)
    b_t = torch.randn(s, I, generator=g).to(torch.bfloat16)
    off_t = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    e_count = len(counts)
    ref = torch.zeros(e_count, H, I)
    for e in range(e_count):
        lo = 0 if e == 0 else int(off_t[e - 1])
        ref[e] = a_t[:, lo:int(off_t[e])].double().mm(b_t[lo:int(off_t[e])].double()).float()
    a = jnp.asarray(a_t.float().numpy(), jnp.bfloat16)
    b = jnp.asarray(b_t.float().numpy(), jnp.bfloat16)
    off = jnp.asarray(off_t.numpy())
    got = jax.jit(wgrad_jax.grouped_wgrad_jax_reference)(a, b, off)
    assert got.shape == (e_count, H, I) and got.dtype == jnp.float32
    torch.testing.assert_close(torch.from_numpy(np.array(got)), ref, rtol=1e-5, atol=1e-4)
    tw = grouped_wgrad_torch(a_t, b_t, off_t, out_dtype=torch.float32)
    torch.testing.assert_close(torch.from_numpy(np.array(got)), tw, rtol=1e-5, atol=1e-3)
    eager = wgrad_jax.grouped_wgrad_jax_reference(a, b, off)
    torch.testing.assert_close(torch.from_numpy(np.array(eager)), tw, rtol=1e-5, atol=1e-3)


def test_grouped_wgrad_jax_backends_on_cpu():
    a, b, _ = _ops()
    off = jax.device_put(jnp.asarray([128, 256, 384, 512], jnp.int32), CPU)  # all on the CPU
    out = wgrad_jax.grouped_wgrad_jax(a, b, off, wgrad_dtype=jnp.bfloat16)  # auto: the twin
    assert out.shape == (E, H, I) and out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="backend must be"):
        wgrad_jax.grouped_wgrad_jax(a, b, off, backend="cuda")
    with pytest.raises(RuntimeError, match="runs a CUDA kernel"):
        wgrad_jax.grouped_wgrad_jax(a, b, off, backend="sm90")


def _ref_ops(s=64, h=8, i=8):
    g = np.random.default_rng(1)
    return (jnp.asarray(g.standard_normal((h, s)), jnp.bfloat16),
            jnp.asarray(g.standard_normal((s, i)), jnp.bfloat16))


#: Offsets values the torch ``grouped_gemm_wgrad`` rejects: (case, offsets for S = 64, message).
_BAD_VALUES = [
    ("last < S", [16, 32, 48, 60], r"offsets\[-1\] \(60\) must equal tokens_sum"),
    ("last > S", [16, 32, 48, 70], r"offsets\[-1\] \(70\) must equal tokens_sum"),
    ("decreasing", [16, 40, 32, 64], "offsets must be non-decreasing"),
    ("negative first", [-4, 32, 48, 64], "offsets must be non-decreasing"),
]
_ENTRIES = {
    "reference": lambda a, b, o, **kw: wgrad_jax.grouped_wgrad_jax_reference(a, b, o, **kw),
    "grouped_wgrad_jax": lambda a, b, o, **kw: wgrad_jax.grouped_wgrad_jax(a, b, o, **kw),
}


@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("case,offsets,pattern", _BAD_VALUES, ids=[c[0] for c in _BAD_VALUES])
def test_reference_rejects_bad_offsets_values_eagerly(entry, case, offsets, pattern):
    """Concrete offsets are checked as the torch entry checks them (no silent zeroed tail, no
    silently wrong split); ``validate_offsets=False`` skips the host read."""
    a, b = _ref_ops()
    off = jnp.asarray(offsets, jnp.int32)
    with pytest.raises(ValueError, match=pattern):
        _ENTRIES[entry](a, b, off)
    out = _ENTRIES[entry](a, b, off, validate_offsets=False)  # opt-out: the caller's contract
    assert out.shape == (4, 8, 8)


#: Static rules of the jnp twin (dtype / shape / type): checked eagerly AND under jit.
_BAD_STATIC_REF = [
    ("int16 offsets", dict(off_dtype=jnp.int16), "offsets must be a 1-D .* int32"),
    ("int64-like offsets", dict(off_dtype=jnp.uint32), "offsets must be a 1-D .* int32"),
    ("2-D offsets", dict(off_2d=True), "offsets must be a 1-D"),
    ("no experts", dict(no_experts=True), "num_experts >= 1"),
    ("S mismatch", dict(b_rows=56), r"b.shape\[0\] \(56\) must equal a.shape\[1\]"),
    ("a 3-D", dict(a_3d=True), "a must be a 2-D"),
    ("int a", dict(a_int=True), "a must be a 2-D .* floating"),
    ("int wgrad_dtype", dict(wgrad_dtype="int8"), "wgrad_dtype must be a floating"),
]


@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("case,change,pattern", _BAD_STATIC_REF,
                         ids=[c[0] for c in _BAD_STATIC_REF])
def test_reference_static_rules_eager_and_under_jit(entry, case, change, pattern):
    a, b = _ref_ops()
    off = jnp.asarray([16, 32, 48, 64], change.get("off_dtype", jnp.int32))
    if change.get("off_2d"):
        off = off[None]
    if change.get("no_experts"):
        off = off[:0]
    if "b_rows" in change:
        b = b[: change["b_rows"]]
    if change.get("a_3d"):
        a = a[None]
    if change.get("a_int"):
        a = a.astype(jnp.int32)
    kw = {"wgrad_dtype": change["wgrad_dtype"]} if "wgrad_dtype" in change else {}
    fn = _ENTRIES[entry]
    with pytest.raises(ValueError, match=pattern):
        fn(a, b, off, **kw)
    with pytest.raises(ValueError, match=pattern):
        jax.jit(lambda a, b, o: fn(a, b, o, **kw)).trace(a, b, off)


@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("arg", ["a", "b", "offsets"])
def test_reference_torch_tensor_is_a_clear_error(entry, arg):
    """A torch tensor passed in: a ValueError naming the argument (was an AttributeError
    ``'Tensor' object has no attribute 'astype'``)."""
    a, b = _ref_ops()
    args = {"a": a, "b": b, "offsets": jnp.asarray([16, 32, 48, 64], jnp.int32)}
    args[arg] = torch.from_numpy(np.array(args[arg]).astype(np.float32 if arg != "offsets"
                                                              else np.int32))
    with pytest.raises(ValueError, match=f"{arg} must be a JAX array .* got Tensor"):
        _ENTRIES[entry](args["a"], args["b"], args["offsets"])


def test_reference_under_jit_values_are_data():
    """Under jit the offsets are tracers: static rules only (documented); new offsets values
    neither retrace nor recompile and give the right split."""
    a, b = _ref_ops(s=96, h=16, i=24)
    traces = []

    def f(a, b, o):
        traces.append(1)
        return wgrad_jax.grouped_wgrad_jax_reference(a, b, o)

    fn = jax.jit(f)
    a_t = torch.from_numpy(np.array(a.astype(jnp.float32)))
    b_t = torch.from_numpy(np.array(b.astype(jnp.float32)))
    for counts in ([96, 0, 0], [1, 94, 1], [0, 0, 96], [40, 17, 39]):
        off = jnp.asarray(np.cumsum(counts), jnp.int32)
        got = torch.from_numpy(np.array(fn(a, b, off)))
        want = grouped_wgrad_torch(a_t.to(torch.bfloat16), b_t.to(torch.bfloat16),
                                   torch.tensor(np.cumsum(counts), dtype=torch.int32),
                                   out_dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert len(traces) == 1
    assert "cannot be checked" in wgrad_jax.grouped_wgrad_jax_reference.__doc__


def _largest_intermediate(jaxpr) -> int:
    """Elements of the largest value any equation of ``jaxpr`` (sub-jaxprs included) makes."""
    from jax.extend import core as jcore

    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            shape = getattr(v.aval, "shape", ())
            best = max(best, int(np.prod(shape)) if shape else 1)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jcore.Jaxpr):
                    best = max(best, _largest_intermediate(inner))
    return best


def test_reference_has_no_expert_times_tokens_blowup():
    """The twin's work and memory do not grow as E x the dense product: no [S, E, ...] one-hot
    intermediate (the former einsum formed [S, E] and E x the FLOPs). With S >> H, I the
    largest value made is the [E, H, I] result or the padded operands, not E * S * I."""
    s, h, i, e = 2048, 16, 16, 32
    a, b = _ref_ops(s=s, h=h, i=i)
    off = jnp.asarray(np.linspace(0, s, e + 1)[1:].astype(np.int32))
    jaxpr = jax.make_jaxpr(wgrad_jax.grouped_wgrad_jax_reference)(a, b, off).jaxpr
    bound = 2 * max(e * h * i, (h + i) * (s + 256))
    assert _largest_intermediate(jaxpr) <= bound


@pytest.mark.parametrize("s,e", [(1, 1), (300, 3), (1000, 64), (37, 100), (2048, 2)])
def test_reference_random_splits_and_grad(s, e):
    """Random splits across chunk boundaries (S not a multiple of the chunk, E > S, experts
    spanning many chunks) against float64 numpy, jitted; the twin stays differentiable: its
    gradient equals the per-expert products' (d/da sum(w * out) = sum_e w_e b_e^T)."""
    g = np.random.default_rng(s + e)
    h, i = 12, 20
    a64, b64 = g.standard_normal((h, s)), g.standard_normal((s, i))
    ends = np.append(np.sort(g.integers(0, s + 1, e - 1)), s).astype(np.int32)
    begins = np.concatenate([[0], ends[:-1]])
    want = np.stack([a64[:, lo:hi] @ b64[lo:hi] for lo, hi in zip(begins, ends)])
    a, b, off = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32), jnp.asarray(ends)
    got = jax.jit(wgrad_jax.grouped_wgrad_jax_reference)(a, b, off)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    w = jnp.asarray(g.standard_normal(want.shape), jnp.float32)
    da = jax.grad(lambda a: (wgrad_jax.grouped_wgrad_jax_reference(a, b, off) * w).sum())(a)
    want_da = np.zeros((h, s))
    for k, (lo, hi) in enumerate(zip(begins, ends)):
        want_da[:, lo:hi] = np.asarray(w[k], np.float64) @ b64[lo:hi].T
    np.testing.assert_allclose(np.asarray(da), want_da, rtol=1e-5, atol=1e-4)


def test_custom_vjp_example_matches_autodiff():
    """The docstring example of ``grouped_wgrad_jax``: the weight gradient of a ragged expert
    projection through the grouped wgrad equals JAX's own autodiff of ``ragged_dot``."""
    grouped_wgrad_jax = wgrad_jax.grouped_wgrad_jax

    @jax.custom_vjp
    def expert_linear(x_SH, w_EHI, group_sizes_E):
        return jax.lax.ragged_dot(x_SH, w_EHI, group_sizes_E)

    def fwd(x_SH, w_EHI, group_sizes_E):
        return expert_linear(x_SH, w_EHI, group_sizes_E), (x_SH, w_EHI, group_sizes_E)

    def bwd(res, dy_SI):
        x_SH, w_EHI, group_sizes_E = res
        dx_SH = jax.lax.ragged_dot(dy_SI, jnp.swapaxes(w_EHI, 1, 2), group_sizes_E)
        offsets_E = jnp.cumsum(group_sizes_E).astype(jnp.int32)
        dw_EHI = grouped_wgrad_jax(x_SH.T, dy_SI, offsets_E, wgrad_dtype=w_EHI.dtype)
        return dx_SH, dw_EHI, None

    expert_linear.defvjp(fwd, bwd)
    s, h, i = 64, 16, 24
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (s, h), jnp.float32)
    w = jax.random.normal(kw, (E, h, i), jnp.float32)
    sizes = jnp.asarray([16, 0, 40, 8], jnp.int32)

    def loss(f, x, w):
        return (f(x, w, sizes) ** 2).sum()

    # fp32 products at full precision: on a GPU, JAX's default fp32 matmul precision is TF32-like
    # (the H200 run differed by 1e-4 relative without this)
    with jax.default_matmul_precision("highest"):
        dx, dw = jax.jit(jax.grad(lambda x, w: loss(expert_linear, x, w), argnums=(0, 1)))(x, w)
        rx, rw = jax.grad(lambda x, w: loss(jax.lax.ragged_dot, x, w), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(rw), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rx), rtol=1e-4, atol=1e-3)


def test_pack_pointers_uint8():
    p = jax_ffi.pack_pointers_uint8([0x10, 0x7F0000001000])
    assert p.dtype == np.uint8 and p.shape == (16,)
    assert p.view("<u8").tolist() == [0x10, 0x7F0000001000]
    with pytest.raises(ValueError, match="not a 64-bit device address"):
        jax_ffi.pack_pointers_uint8([-1])


# ------------------------------------------------------------------------------------------------
# The FFI adapter compiles offline (no GPU) against the pinned CuTe DSL
# ------------------------------------------------------------------------------------------------


@needs_cute
def test_cutlass_jax_surface_we_depend_on():
    """The pinned nvidia-cutlass-dsl's JAX bridge: the names jax_ffi uses, and its runtime
    library (the compiled XLA FFI handler) next to the DSL."""
    import cutlass.jax as cj
    from cutlass.jax import compile as cjc

    assert cj.is_available()
    assert cj.find_cute_dsl_runtime_library() is not None
    for name in ("build_function_spec", "get_or_compile_kernel", "jit_wrapper"):
        assert callable(getattr(cjc, name))
    assert cj.get_cutlass_call_ffi_version() in (1, 2)
    assert cj.get_cutlass_call_ffi_name(True, 2) == "CuteDSLRT_NvJaxCutlassCall_v2"


_OFFLINE = [
    ("sm90", "discrete", "sm_90a", "wgmma"),
    ("sm90", "dense_init", "sm_90a", "wgmma"),
    ("sm100", "dense", "sm_100a", "tcgen05"),
    # the adapter passes no descriptor workspace: SM100 discrete outputs from registers
    ("sm100", "discrete", "sm_100a", "tcgen05"),
]


@needs_cute
@pytest.mark.parametrize("arch,mode,gpu_arch,marker", _OFFLINE, ids=[c[1] + "-" + c[0] for c in _OFFLINE])
def test_adapter_compiles_offline(arch, mode, gpu_arch, marker, tmp_path):
    a, b, off = _ops(s=1024, h=256, i=256)
    cnt = _arr((1,), jnp.int32)
    if mode == "discrete":
        ptrs = _arr((8 * E,), jnp.uint8)
        plan = jax_ffi.check_jax_wgrad_call(arch, a, b, off, wgrad_ptrs=ptrs)
        io = ([a, b, off, cnt, ptrs], [jax.ShapeDtypeStruct((1,), jnp.int32)], {3: 0})
    elif mode == "dense_init":
        init = _arr((E, 256, 256), jnp.float32)
        plan = jax_ffi.check_jax_wgrad_call(arch, a, b, off, output_mode="dense",
                                            wgrad_dtype="float32", wgrad_init=init)
        io = ([a, b, off, cnt, init], [jax.ShapeDtypeStruct((1,), jnp.int32),
                                       jax.ShapeDtypeStruct((E, 256, 256), jnp.float32)],
              {3: 0, 4: 1})
    else:
        plan = jax_ffi.check_jax_wgrad_call(arch, a, b, off, output_mode="dense",
                                            wgrad_dtype="bfloat16")
        io = ([a, b, off, cnt], [jax.ShapeDtypeStruct((E, 256, 256), jnp.bfloat16),
                                 jax.ShapeDtypeStruct((1,), jnp.int32)], {3: 1})
    fn = jax_ffi.compile_adapter_offline(plan, *io, gpu_arch, dump_dir=str(tmp_path))
    ptx = fn.__ptx__
    assert ptx and ptx.count(".entry") == 1 and marker in ptx
    if arch == "sm100" and mode == "discrete":  # no workspace: no per-expert descriptors
        assert "tensormap.replace" not in ptx and "st.global.v4.b32" in ptx
