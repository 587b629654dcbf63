"""CPU tests of the grouped wgrad API (cuda_kernels.grouped_wgrad.api), its torch twin and backends.

Every validation path of the seed's contract (``shared/seeds/grouped_gemm_wgrad_sm100.md``) is
exercised with CPU tensors: the API checks every rule of a call before it looks at the device, so
each rule's error (naming the argument) is reachable without a GPU. Device-dependent paths (below
SM100 / SM90, compile, execute, the compile cache) run with the capability query and the kernel
compiler replaced by fakes whose launcher computes with the torch twin (dense outputs, or writes
through the int64 output addresses of discrete mode), so values are asserted end to end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util

import pytest
import torch

import cuda_kernels
from cuda_kernels.gemm import env
from cuda_kernels.grouped_wgrad import (
    _types,
    api,
    bf16,
    dispatch,
    pipeline,
    validate,
    wrappers,
)
from cuda_kernels.grouped_wgrad.torch_ref import grouped_wgrad_torch

try:
    from common.reference import grouped_wgrad_reference
except ImportError:  # pragma: no cover - common.reference lands with the lead's layer
    grouped_wgrad_reference = None

H, I = 128, 64  # multiples of 64: every SM90 tile rule fits

# Tolerances vs the float64 reference (relative to max |ref|), per output dtype: one rounding of
# the fp32 result (BF16: 8 bits of mantissa, FP16: 11), fp32 accumulation over <= 1024 terms.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _ref64(a, b, offsets):
    """Float64 twin: common.reference when present, else a per-expert float64 loop."""
    if grouped_wgrad_reference is not None:
        return grouped_wgrad_reference(a, b, offsets)
    ends = [int(v) for v in offsets.tolist()]
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=torch.float64)
    begin = 0
    for e, end in enumerate(ends):
        out[e] = a[:, begin:end].double() @ b[begin:end].double()
        begin = end
    return out


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _operands(counts, a_major="m", b_major="n", seed=0, hidden=H, inter=I):
    """A [H, S] and B [S, I] bf16 with the requested majors, and the offsets of ``counts``."""
    g = torch.Generator().manual_seed(seed)
    s = sum(counts)
    x_SH = torch.randn(s, hidden, generator=g).to(torch.bfloat16)
    y_SI = torch.randn(s, inter, generator=g).to(torch.bfloat16)
    a = x_SH.t() if a_major == "m" else x_SH.t().contiguous()
    b = y_SI if b_major == "n" else y_SI.t().contiguous().t()
    return a, b, _offsets(counts)


def _assert_close(out, ref, dtype):
    scale = max(ref.abs().max().item(), 1.0)
    err = (out.double() - ref).abs().max().item() / scale
    assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.1e}"


def _tensor_at(address, shape, dtype):
    """A CPU tensor viewing ``numel * itemsize`` bytes at an integer address (fake kernel)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    buf = (ctypes.c_byte * nbytes).from_address(address)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class FakeKernels:
    """Replaces the capability query and the kernel compilers; counts compiles."""

    def __init__(self):
        self.compiles = []
        self.launches = 0
        self.workspaces = []  # descriptor_workspace of each launch

    def compile(self, contract):
        self.compiles.append(contract)

        def launcher(a, b, offsets, out, stream=None, descriptor_workspace=None):
            self.launches += 1
            self.workspaces.append(descriptor_workspace)
            dtype = _types.NAME_TO_DTYPE[contract.out_dtype]
            shape = (contract.hidden, contract.intermediate)
            if contract.output_mode == "discrete":
                views = [_tensor_at(int(p), shape, dtype) for p in out.tolist()]
                tmp = torch.stack(views) if contract.accumulate else None
                res = grouped_wgrad_torch(
                    a, b, offsets, out=tmp, accumulate=contract.accumulate, out_dtype=dtype,
                    input_order=contract.input_order,
                )
                for v, r in zip(views, res):
                    v.copy_(r)
            else:
                grouped_wgrad_torch(
                    a, b, offsets, out=out, accumulate=contract.accumulate,
                    input_order=contract.input_order,
                )

        return launcher


@pytest.fixture(autouse=True)
def _clean_caches():
    api.clear_grouped_wgrad_caches()
    yield
    api.clear_grouped_wgrad_caches()


@pytest.fixture
def fake_device(monkeypatch):
    """Pretend the CPU is a CUDA device of capability ``fake.cc`` with CuTe DSL kernels."""
    fake = FakeKernels()
    fake.cc = 90
    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": fake.cc)
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    monkeypatch.setattr(bf16, "compile_launcher", lambda contract, who: fake.compile(contract))
    return fake


WRAPPERS = {
    "sm100": api.grouped_gemm_wgrad_wrapper_sm100,
    "sm90": api.grouped_gemm_wgrad_wrapper_sm90,
}
CLASSES = {"sm100": api.GroupedGemmWgradSm100, "sm90": api.GroupedGemmWgradSm90}


# ------------------------------------------------------------------------------------------------
# TupleDict, workspace size, import hygiene
# ------------------------------------------------------------------------------------------------


def test_tuple_dict_keyed_access_and_unpacking():
    w = torch.zeros(2)
    r = api.TupleDict(wgrad_tensor=w)
    assert r["wgrad_tensor"] is w and r[0] is w
    (only,) = r
    assert only is w
    assert len(r) == 1 and list(r.keys()) == ["wgrad_tensor"] and "wgrad_tensor" in r
    assert list(r.items()) == [("wgrad_tensor", w)]
    with pytest.raises(KeyError):
        r["sfa"]


def test_workspace_size():
    # cuDNN's size (issue 8 item 3; its test_grouped_gemm_wgrad_workspace_size): 1024 bytes for
    # 2 dense experts in either input order, a multiple of 128 in discrete mode.
    size = api.get_grouped_gemm_wgrad_workspace_size_sm100
    assert size(2) == 1024
    assert size(2, input_order="tensor_ragged") == 1024
    assert size(1, output_mode="discrete") % 128 == 0
    assert size(1, output_mode="discrete") > size(1)  # + the output descriptor
    assert size(128) == 64 * 1024
    with pytest.raises(ValueError, match="num_experts must be positive"):
        size(0)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="num_experts"):
            size(bad)
    with pytest.raises(ValueError, match="output_mode"):
        size(2, output_mode="packed")
    with pytest.raises(ValueError, match="input_order"):
        size(2, input_order="ragged")


def test_public_names_and_no_heavy_imports():
    import subprocess
    import sys

    code = (
        "import sys, cuda_kernels, cuda_kernels.grouped_wgrad.api;"
        "print('cutlass' in sys.modules, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    for name in (
        "GroupedGemmWgradSm100", "grouped_gemm_wgrad_wrapper_sm100", "TupleDict",
        "get_grouped_gemm_wgrad_workspace_size_sm100", "GroupedGemmWgradSm90",
        "grouped_gemm_wgrad_wrapper_sm90", "grouped_gemm_wgrad",
    ):
        assert hasattr(cuda_kernels, name)


# ------------------------------------------------------------------------------------------------
# Every validation rule, through both wrappers (errors come before any device query)
# ------------------------------------------------------------------------------------------------

COUNTS = [256, 0, 512]  # valid for SM100 (multiples of 256) and SM90


def _base_call():
    a, b, off = _operands(COUNTS)
    return {
        "a_tensor": a, "b_tensor": b, "sfa_tensor": None, "sfb_tensor": None, "offsets_tensor": off,
        "output_mode": "dense",
    }


def _unaligned(shape, dtype, strides_like=None):
    n = 1
    for d in shape:
        n *= d
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


def _case_table():
    """(name, mutate(kwargs) -> kwargs, exception, regex naming the argument, archs)."""
    e = len(COUNTS)
    s = sum(COUNTS)

    def set_(**kw):
        return lambda c: {**c, **kw}

    def with_offsets(values):
        return lambda c: {**c, "offsets_tensor": torch.tensor(values, dtype=torch.int32)}

    both = ("sm100", "sm90")
    return [
        ("a rank", lambda c: {**c, "a_tensor": c["a_tensor"][None]}, ValueError, "a_tensor",
         both),
        ("b rank", lambda c: {**c, "b_tensor": c["b_tensor"][:, 0]}, ValueError, "b_tensor",
         both),
        ("token dims", lambda c: {**c, "b_tensor": c["b_tensor"][:-8]}, ValueError,
         "token dimensions", both),
        ("a dtype", lambda c: {**c, "a_tensor": c["a_tensor"].half()}, ValueError,
         "a_tensor.*bfloat16", both),
        ("b dtype", lambda c: {**c, "b_tensor": c["b_tensor"].float()}, ValueError,
         "b_tensor.*bfloat16", both),
        ("fp8 pair", lambda c: {
            **c, "a_tensor": c["a_tensor"].to(torch.float8_e4m3fn),
            "b_tensor": c["b_tensor"].to(torch.float8_e4m3fn)}, ValueError,
         "sfa_tensor is required.*block-scaled", both),
        ("offsets dtype", lambda c: {**c, "offsets_tensor": c["offsets_tensor"].long()},
         ValueError, "offsets_tensor.*int32", both),
        ("offsets rank", lambda c: {**c, "offsets_tensor": c["offsets_tensor"][None]},
         ValueError, "offsets_tensor.*rank-1", both),
        ("offsets stride", lambda c: {
            **c, "offsets_tensor": torch.stack([c["offsets_tensor"]] * 2, 1)[:, 0]},
         ValueError, "offsets_tensor.*contiguous", both),
        ("a strides", lambda c: {
            **c, "a_tensor": torch.zeros(H, 2 * s, dtype=torch.bfloat16)[:, ::2]}, ValueError,
         "a_tensor.*K-major.*M-major", both),
        ("b strides", lambda c: {
            **c, "b_tensor": torch.zeros(s, 2 * I, dtype=torch.bfloat16)[:, ::2]}, ValueError,
         "b_tensor.*K-major.*N-major", both),
        ("sfa", set_(sfa_tensor=torch.zeros(1)), ValueError, "sfa_tensor must be None", both),
        ("sfb", set_(sfb_tensor=torch.zeros(1)), ValueError, "sfb_tensor must be None", both),
        ("global a", set_(global_scale_a=torch.ones(1)), ValueError,
         "global_scale_a must be None", both),
        ("global b", set_(global_scale_b=torch.ones(1)), ValueError,
         "global_scale_b must be None", both),
        ("sf_vec_size", set_(sf_vec_size=32), ValueError, "sf_vec_size", both),
        ("acc_dtype", set_(acc_dtype=torch.bfloat16), ValueError, "acc_dtype", both),
        ("output_mode", set_(output_mode="sparse"), ValueError, "output_mode", both),
        ("input_order", set_(input_order="ragged"), ValueError, "input_order", both),
        ("dense forbids ptrs", set_(wgrad_ptrs=torch.full((e,), 256, dtype=torch.int64)),
         ValueError, "wgrad_ptrs must be None in dense", both),
        # both outputs are accepted (cuDNN passes both; issue 8 item 3), but the pointers must
        # then be the tensor's expert slabs: the tensor returned is the memory written
        ("both outputs elsewhere", set_(
            output_mode="discrete", wgrad_tensor=torch.zeros(e, H, I, dtype=torch.bfloat16),
            wgrad_ptrs=torch.full((e,), 256, dtype=torch.int64)), ValueError,
         r"wgrad_ptrs\[0\] = 0x100 is not expert 0's slab of wgrad_tensor", both),
        ("out shape", set_(wgrad_tensor=torch.zeros(e, H, I + 8, dtype=torch.bfloat16)),
         ValueError, "wgrad_tensor must have shape", both),
        ("out strides", set_(
            wgrad_tensor=torch.zeros(e, I, H, dtype=torch.bfloat16).transpose(1, 2)),
         ValueError, "wgrad_tensor must be contiguous", both),
        ("out dtype", set_(wgrad_tensor=torch.zeros(e, H, I, dtype=torch.float64)), ValueError,
         "wgrad_tensor dtype", both),
        ("wgrad_dtype", set_(wgrad_dtype=torch.float64), ValueError, "wgrad_dtype", both),
        ("ptrs dtype", set_(output_mode="discrete", wgrad_ptrs=torch.zeros(e, dtype=torch.int32)),
         ValueError, "wgrad_ptrs must be torch.int64", both),
        ("ptrs shape", set_(output_mode="discrete",
                            wgrad_ptrs=torch.full((e + 1,), 256, dtype=torch.int64)),
         ValueError, "wgrad_ptrs must have shape", both),
        ("null ptr", set_(output_mode="discrete",
                          wgrad_ptrs=torch.tensor([256, 0, 512], dtype=torch.int64)),
         ValueError, r"wgrad_ptrs\[1\].*non-null", both),
        ("unaligned ptr", set_(output_mode="discrete",
                               wgrad_ptrs=torch.tensor([256, 264, 512], dtype=torch.int64)),
         ValueError, r"wgrad_ptrs\[1\].*16-byte", both),
        ("decreasing", with_offsets([512, 256, 768]), ValueError,
         r"offsets_tensor must be a non-decreasing.*offsets_tensor\[1\]", both),
        ("negative", with_offsets([-256, 256, 768]), ValueError, "non-decreasing", both),
        ("last != tokens_sum", with_offsets([256, 256, 512]), ValueError,
         "last offset 512 must equal tokens_sum 768", both),
        ("group % 256", with_offsets([100, 256, 768]), ValueError, "multiple of 256",
         ("sm100",)),
        ("a unaligned", lambda c: {**c, "a_tensor": _unaligned((H, s), torch.bfloat16)},
         ValueError, "a_tensor: data pointer.*16-byte", both),
        ("out unaligned", set_(wgrad_tensor=_unaligned((e, H, I), torch.bfloat16)), ValueError,
         "wgrad_tensor: data pointer.*16-byte", both),
        ("K-major tokens % 8", lambda c: {
            **c, "a_tensor": torch.zeros(H, 772, dtype=torch.bfloat16),
            "b_tensor": torch.zeros(772, I, dtype=torch.bfloat16),
            "offsets_tensor": torch.tensor([256, 256, 772], dtype=torch.int32)},
         ValueError, "a_tensor: a K-major operand needs tokens_sum % 8", ("sm90",)),
        ("M-major hidden % 8", lambda c: {
            **c, "a_tensor": torch.zeros(s, 12, dtype=torch.bfloat16).t()},
         ValueError, "a_tensor: M-major A needs hidden % 8", both),
        ("fp32 out N % 4", lambda c: {
            **c, "b_tensor": torch.zeros(s, 2, dtype=torch.bfloat16).t().contiguous().t(),
            "wgrad_dtype": torch.float32},
         ValueError, "wgrad_dtype: intermediate % 4", both),
        ("mixed devices", lambda c: {**c, "b_tensor": c["b_tensor"].to("meta")}, ValueError,
         "one device.*b_tensor on meta", both),
        ("workspace", set_(descriptor_workspace=torch.zeros(10, dtype=torch.uint8)), ValueError,
         "descriptor_workspace", both),
        ("sm100 tile", set_(mma_tiler_mn=(96, 256)), ValueError, "mma_tiler_mn", ("sm100",)),
        ("sm100 cluster", set_(cluster_shape_mn=(3, 1)), ValueError, "cluster_shape_mn",
         ("sm100",)),
        ("sm100 2cta cluster", set_(mma_tiler_mn=(256, 128), cluster_shape_mn=(1, 1)),
         ValueError, "cluster M must be even", ("sm100",)),
        ("sm90 tile", set_(mma_tiler_mn=(256, 128)), ValueError, "mma_tiler_mn", ("sm90",)),
        ("sm90 cluster", set_(cluster_shape_mn=(2, 1)), ValueError, "cluster_shape_mn",
         ("sm90",)),
        ("tiler pair", set_(mma_tiler_mn=(128,)), ValueError, "mma_tiler_mn", both),
    ]


_CASES = [
    pytest.param(arch, mutate, exc, regex, id=f"{arch}-{name}")
    for name, mutate, exc, regex, archs in _case_table()
    for arch in archs
]


@pytest.mark.parametrize("arch,mutate,exc,regex", _CASES)
def test_wrapper_rejects(arch, mutate, exc, regex, fake_device):
    fake_device.cc = 100 if arch == "sm100" else 90
    kwargs = mutate(_base_call())
    with pytest.raises(exc, match=regex):
        WRAPPERS[arch](**kwargs)
    assert fake_device.launches == 0 and not fake_device.compiles


def test_sm90_tile_must_divide_shape(fake_device):
    a, b, off = _operands([8, 0, 16], hidden=96)  # 96: no SM90 tile (64 or 128 rows) fits
    with pytest.raises(ValueError, match="unsupported SM90 tiling.*hidden=96"):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
    a, b, off = _operands([8, 0, 16])
    with pytest.raises(ValueError, match="mma_tiler_mn"):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, mma_tiler_mn=(128, 48))
    assert not fake_device.compiles


def test_sm90_accepts_any_group_size_sm100_refuses(fake_device):
    a, b, off = _operands([3, 0, 5, 0])
    fake_device.cc = 100
    with pytest.raises(ValueError, match="expert 0 holds 3 tokens.*multiple of 256"):
        api.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, off)
    fake_device.cc = 90
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
    _assert_close(w, _ref64(a, b, off), torch.bfloat16)


def test_offsets_values_skipped_without_validation(fake_device):
    """validate_offsets=False trusts the values (no host read); statics are still checked."""
    a, b, _off = _operands([256, 256])
    bad = torch.tensor([256, 256], dtype=torch.int32)  # last != tokens_sum: not looked at
    fake_device.cc = 100
    api.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, bad, validate_offsets=False)
    assert fake_device.launches == 1
    with pytest.raises(ValueError, match="last offset"):
        api.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, bad)
    with pytest.raises(ValueError, match="offsets_tensor.*int32"):
        api.grouped_gemm_wgrad_wrapper_sm100(a, b, None, None, bad.long(), validate_offsets=False)


# ------------------------------------------------------------------------------------------------
# Environment: no CUDA, capability, compile before execute, SM100 kernel not built
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_no_cuda(arch):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        WRAPPERS[arch](**_base_call())
    a, b, off = _operands(COUNTS)
    op = CLASSES[arch](a, b, None, None, off, sample_wgrad=torch.empty(3, H, I))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        op.check_support()


@pytest.mark.parametrize(
    "arch,cc,regex",
    [
        ("sm100", 90, "requires SM100 or newer, found SM90"),
        ("sm100", 80, "requires SM100 or newer, found SM80"),
        ("sm90", 80, "requires SM90.*below SM90"),
        ("sm90", 100, "only on SM 9.x, found SM100"),
    ],
)
def test_capability_refused(arch, cc, regex, fake_device):
    fake_device.cc = cc
    with pytest.raises(RuntimeError, match=regex):
        WRAPPERS[arch](**_base_call())
    a, b, off = _operands(COUNTS)
    op = CLASSES[arch](a, b, None, None, off, sample_wgrad=torch.empty(3, H, I))
    with pytest.raises(RuntimeError, match=regex):
        op.check_support()
    assert not fake_device.compiles


def test_sm100_compile_says_kernel_not_built(monkeypatch):
    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": 100)
    monkeypatch.setattr(env, "family_module", lambda arch: None)
    a, b, off = _operands(COUNTS)
    op = api.GroupedGemmWgradSm100(a, b, None, None, off, sample_wgrad=torch.empty(3, H, I))
    assert op.check_support() is True
    with pytest.raises(RuntimeError, match="SM100 BF16 grouped wgrad kernel is not built"):
        op.compile()
    with pytest.raises(RuntimeError, match="not built"):
        api.grouped_gemm_wgrad_wrapper_sm100(**_base_call())


def test_sm90_compile_without_cutlass(monkeypatch):
    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": 90)
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: "nvidia-cutlass-dsl is not installed")
    a, b, off = _operands(COUNTS)
    op = api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=torch.empty(3, H, I))
    with pytest.raises(RuntimeError, match="nvidia-cutlass-dsl is not installed"):
        op.compile()


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_execute_before_compile(arch, fake_device):
    fake_device.cc = 100 if arch == "sm100" else 90
    a, b, off = _operands(COUNTS)
    w = torch.empty(3, H, I, dtype=torch.bfloat16)
    op = CLASSES[arch](a, b, None, None, off, sample_wgrad=w)
    with pytest.raises(RuntimeError, match=r"execute\(\) before compile\(\)"):
        op.execute(a, b, None, None, off, wgrad_tensor=w)
    assert op.check_support() is True
    with pytest.raises(RuntimeError, match=r"before compile\(\)"):
        op.execute(a, b, None, None, off, wgrad_tensor=w)
    op.compile()
    op.execute(a, b, None, None, off, wgrad_tensor=w)
    _assert_close(w, _ref64(a, b, off), torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Class lifecycle: constructor and check_support rules, execute against the compiled contract
# ------------------------------------------------------------------------------------------------


def test_class_constructor_rules(fake_device):
    a, b, off = _operands(COUNTS)
    w = torch.empty(3, H, I, dtype=torch.bfloat16)
    cls = api.GroupedGemmWgradSm90
    with pytest.raises(ValueError, match="not both"):
        cls(a, b, None, None, off, sample_wgrad=w, num_experts=3)
    with pytest.raises(ValueError, match="no output sample"):
        cls(a, b, None, None, off)
    with pytest.raises(ValueError, match="wgrad_shape and wgrad_dtype"):
        cls(a, b, None, None, off, num_experts=3)
    bad = [
        ({"num_experts": 4, "wgrad_shape": (H, I), "wgrad_dtype": torch.bfloat16}, "num_experts=4"),
        ({"num_experts": 3, "wgrad_shape": (H, I + 8), "wgrad_dtype": torch.bfloat16}, "wgrad_shape"),
        ({"num_experts": 3, "wgrad_shape": (H, I), "wgrad_dtype": torch.int8}, "wgrad_dtype"),
        ({"num_experts": 3, "wgrad_shape": (H, I), "wgrad_dtype": torch.bfloat16,
              "sample_wgrad_expert": torch.empty(H, I + 8, dtype=torch.bfloat16)},
         "sample_wgrad_expert must have shape"),
        ({"num_experts": 3, "wgrad_shape": (H, I), "wgrad_dtype": torch.bfloat16,
              "sample_wgrad_expert": torch.empty(H, I, dtype=torch.float32)},
         "sample_wgrad_expert dtype"),
        ({"sample_wgrad": w, "sample_sfa": torch.ones(1)}, "sample_sfa must be None"),
        ({"sample_wgrad": w, "sample_global_scale_b": torch.ones(1)},
         "sample_global_scale_b must be None"),
        ({"sample_wgrad": w[:, :, :32]}, "sample_wgrad must have shape"),
        ({"sample_wgrad": w, "input_order": "x"}, "input_order"),
    ]
    for kwargs, regex in bad:
        sfa = kwargs.pop("sample_sfa", None)
        op = cls(a, b, sfa, None, off, **kwargs)
        with pytest.raises(ValueError, match=regex):
            op.check_support()
    op = cls(a, b, None, None, torch.tensor([256, 0, 768], dtype=torch.int32), sample_wgrad=w)
    with pytest.raises(ValueError, match="sample_offsets must be a non-decreasing"):
        op.check_support()
    # validate_offsets=False: the sample values are not read, statics still are
    op = cls(a, b, None, None, torch.tensor([256, 0, 768], dtype=torch.int32), sample_wgrad=w,
             validate_offsets=False)
    assert op.check_support()


def test_execute_checks_call_against_contract(fake_device):
    a, b, off = _operands(COUNTS)
    w = torch.empty(3, H, I, dtype=torch.bfloat16)
    op = api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=w)
    op.compile()
    a2, b2, off2 = _operands([64, 64, 64], a_major="k")
    with pytest.raises(ValueError, match="a_major of this call"):
        op.execute(a2, b2, None, None, off2, wgrad_tensor=w)
    a3, b3, off3 = _operands([8, 8, 8], hidden=64)
    with pytest.raises(ValueError, match="hidden of this call"):
        op.execute(a3, b3, None, None, off3, wgrad_tensor=torch.empty(3, 64, I))
    with pytest.raises(ValueError, match="differs from the compiled wgrad_dtype"):
        op.execute(a, b, None, None, off, wgrad_tensor=w.float())
    with pytest.raises(ValueError, match="wgrad_tensor is required"):
        op.execute(a, b, None, None, off)
    with pytest.raises(ValueError, match="sfa_tensor must be None"):
        op.execute(a, b, torch.ones(1), None, off, wgrad_tensor=w)
    with pytest.raises(ValueError, match="last offset"):
        op.execute(a, b, None, None, torch.tensor([1, 2, 3], dtype=torch.int32), wgrad_tensor=w)
    assert fake_device.launches == 0


# ------------------------------------------------------------------------------------------------
# Compile cache: the key holds the static contract only; new splits never recompile
# ------------------------------------------------------------------------------------------------


def test_contract_excludes_tokens():
    names = {f.name for f in dataclasses.fields(api.WgradContract)}
    assert not names & {"tokens_sum", "offsets", "splits", "tokens_hint"}
    assert {"hidden", "intermediate", "num_experts", "a_major", "b_major", "out_dtype",
            "output_mode", "accumulate", "input_order"} <= names


def test_wrapper_compiles_once_per_static_contract(fake_device):
    splits = [[8, 0, 16], [0, 0, 0], [100, 3, 0], [1, 1, 1000], [0, 256, 0]]
    for counts in splits:
        a, b, off = _operands(counts, seed=sum(counts))
        (w,) = api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
        _assert_close(w, _ref64(a, b, off), torch.bfloat16)
    assert len(fake_device.compiles) == 1
    assert fake_device.launches == len(splits)
    a, b, off = _operands([8, 0, 16])
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, wgrad_dtype=torch.float32)
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, accumulate_on_output=True)
    a, b, off = _operands([8, 0, 16], a_major="k", b_major="k")
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, output_mode="discrete")
    keys = fake_device.compiles
    assert len(keys) == 5 and len(set(keys)) == 5


def test_class_instances_share_the_compiled_kernel(fake_device):
    a, b, off = _operands([8, 0, 16])
    w = torch.empty(3, H, I, dtype=torch.bfloat16)
    op1 = api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=w)
    op1.compile()
    a2, b2, off2 = _operands([500, 7, 0], seed=3)
    op2 = api.GroupedGemmWgradSm90(a2, b2, None, None, off2, sample_wgrad=w)
    op2.compile()
    assert len(fake_device.compiles) == 1
    for counts in ([0, 0, 40], [13, 27, 0]):
        a3, b3, off3 = _operands(counts, seed=5)
        op1.execute(a3, b3, None, None, off3, wgrad_tensor=w)
        _assert_close(w, _ref64(a3, b3, off3), torch.bfloat16)
    assert len(fake_device.compiles) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("yaml") is None, reason="sm90_bf16 tile configs need pyyaml"
)
def test_sm90_key_is_static():
    """The Sm90WgradKey built for the kernel (no CuTe DSL import) ignores the split."""
    c = api.WgradContract(
        arch="sm90", hidden=256, intermediate=512, num_experts=8, a_major="m", b_major="n",
        out_dtype="float32", output_mode="dense", accumulate=True, input_order="tensor2d",
        mma_tiler_mn=None, cluster_shape_mn=None,
    )
    key = bf16.contract_key(c)
    assert key == bf16.contract_key(dataclasses.replace(c))
    assert (key.hidden, key.intermediate, key.num_experts) == (256, 512, 8)
    assert key.out_dtype == "float32" and key.accumulate is True
    key2 = bf16.contract_key(dataclasses.replace(c, mma_tiler_mn=(64, 128)))
    assert (key2.tile.tile_m, key2.tile.tile_n) == (64, 128)


# ------------------------------------------------------------------------------------------------
# Values through the wrappers (fake launcher = torch twin): dense, discrete, accumulate
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("majors", [("m", "n"), ("k", "k"), ("k", "n"), ("m", "k")])
def test_wrapper_dense_values(out_dtype, majors, fake_device):
    a, b, off = _operands([40, 0, 88, 0, 8], *majors)
    w = torch.full((5, H, I), float("nan"), dtype=out_dtype)
    r = api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, wgrad_tensor=w)
    assert len(r) == 1 and r["wgrad_tensor"] is w
    _assert_close(w, _ref64(a, b, off), out_dtype)
    assert torch.all(w[1] == 0) and torch.all(w[3] == 0)


def test_wrapper_discrete_values(fake_device):
    a, b, off = _operands([16, 0, 48])
    ref = _ref64(a, b, off)
    # wrapper-allocated stacked output, passed to the kernel as per-expert addresses
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(
        a, b, None, None, off, output_mode="discrete", wgrad_dtype=torch.float32
    )
    assert w.shape == (3, H, I) and w.dtype == torch.float32
    _assert_close(w, ref, torch.float32)
    # caller-owned outputs behind wgrad_ptrs: the result holds None
    outs = [torch.full((H, I), float("nan"), dtype=torch.bfloat16) for _ in range(3)]
    ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64)
    r = api.grouped_gemm_wgrad_wrapper_sm90(
        a, b, None, None, off, output_mode="discrete", wgrad_ptrs=ptrs
    )
    assert r["wgrad_tensor"] is None and len(r) == 1
    _assert_close(torch.stack(outs), ref, torch.bfloat16)
    assert torch.all(outs[1] == 0)
    # the class with discrete descriptors
    op = api.GroupedGemmWgradSm90(
        a, b, None, None, off, num_experts=3, wgrad_shape=(H, I), wgrad_dtype=torch.bfloat16,
        sample_wgrad_expert=outs[0],
    )
    op.compile()
    with pytest.raises(ValueError, match="wgrad_ptrs is required"):
        op.execute(a, b, None, None, off)
    for o in outs:
        o.fill_(float("nan"))
    op.execute(a, b, None, None, off, wgrad_ptrs=ptrs)
    _assert_close(torch.stack(outs), ref, torch.bfloat16)
    # a discrete operator also takes the stacked tensor (its expert slabs are written; this
    # raised before issue 8 item 3), or both as cuDNN passes them (written through the pointers)
    stacked = torch.full((3, H, I), float("nan"), dtype=torch.bfloat16)
    op.execute(a, b, None, None, off, wgrad_tensor=stacked)
    _assert_close(stacked, ref, torch.bfloat16)
    stacked.fill_(float("nan"))
    op.execute(a, b, None, None, off, wgrad_tensor=stacked,
               wgrad_ptrs=pipeline.stacked_pointers(stacked))
    _assert_close(stacked, ref, torch.bfloat16)
    with pytest.raises(ValueError, match="not expert 0's slab"):
        op.execute(a, b, None, None, off, wgrad_tensor=stacked, wgrad_ptrs=ptrs)


def test_wrapper_accumulate_256_plus_1(fake_device):
    """FP32 accumulation into the output: 256 + 1 == 257 (a BF16 round trip would give 256)."""
    a = torch.ones(H, 8, dtype=torch.bfloat16)
    b = torch.zeros(8, I, dtype=torch.bfloat16)
    b[0] = 1.0  # one token, product 1 everywhere for expert 0
    off = torch.tensor([8, 8], dtype=torch.int32)  # expert 1 empty
    w = torch.full((2, H, I), 256.0, dtype=torch.float32)
    api.grouped_gemm_wgrad_wrapper_sm90(
        a, b, None, None, off, wgrad_tensor=w, accumulate_on_output=True
    )
    assert torch.all(w[0] == 257.0) and torch.all(w[1] == 256.0)  # empty expert untouched
    # wrapper-allocated outputs start at zero when accumulating
    (w2,) = api.grouped_gemm_wgrad_wrapper_sm90(
        a, b, None, None, off, accumulate_on_output=True, wgrad_dtype=torch.float32
    )
    assert torch.all(w2[0] == 1.0) and torch.all(w2[1] == 0.0)


# ------------------------------------------------------------------------------------------------
# Device dispatch and the torch fallback (CPU)
# ------------------------------------------------------------------------------------------------


def test_dispatch_picks_torch_on_cpu():
    name, reason = api.select_grouped_wgrad_backend("cpu")
    assert name == "torch" and "not a CUDA device" in reason


@pytest.mark.parametrize(
    "counts",
    [[5, 0, 17, 0, 0, 300], [0, 0, 0, 64], [64, 0, 0, 0], [1] * 8, [0, 0, 0], [256, 512]],
    ids=["uneven", "leading-empty", "trailing-empty", "ones", "all-empty", "aligned"],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_wgrad_torch_fallback(counts, out_dtype):
    a, b, off = _operands(counts, "k" if sum(counts) % 2 else "m", "n")
    w = torch.full((len(counts), H, I), float("nan"), dtype=out_dtype)
    r = cuda_kernels.grouped_gemm_wgrad(a, b, off, wgrad_tensor=w)
    assert r["wgrad_tensor"] is w
    ref = _ref64(a, b, off)
    _assert_close(w, ref, out_dtype)
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.all(w[e] == 0)


def test_grouped_gemm_wgrad_rules_on_cpu():
    a, b, off = _operands([3, 5])
    with pytest.raises(ValueError, match="backend must be one of"):
        cuda_kernels.grouped_gemm_wgrad(a, b, off, backend="cuda")
    with pytest.raises(ValueError, match="last offset"):
        cuda_kernels.grouped_gemm_wgrad(a, b, torch.tensor([3, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="wgrad_ptrs: the torch fallback"):
        cuda_kernels.grouped_gemm_wgrad(
            a, b, off, output_mode="discrete", wgrad_ptrs=torch.zeros(2, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match="a_tensor.*bfloat16"):
        cuda_kernels.grouped_gemm_wgrad(a.float(), b, off)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            cuda_kernels.grouped_gemm_wgrad(a, b, off, backend="sm90")
    (w,) = cuda_kernels.grouped_gemm_wgrad(a, b, off, output_mode="discrete")
    _assert_close(w, _ref64(a, b, off), torch.bfloat16)


def test_grouped_gemm_wgrad_fallback_accumulate():
    a, b, off = _operands([4, 0, 12])
    w0 = torch.randn(3, H, I)
    w = w0.clone()
    cuda_kernels.grouped_gemm_wgrad(a, b, off, wgrad_tensor=w, accumulate_on_output=True)
    _assert_close(w, _ref64(a, b, off) + w0.double(), torch.float32)
    assert torch.equal(w[1], w0[1])


# ------------------------------------------------------------------------------------------------
# The torch twin itself
# ------------------------------------------------------------------------------------------------


def test_torch_twin_never_reads_past_last_offset():
    a, b, off = _operands([3, 0, 9])
    a_pad = torch.full((H, 24), float("nan"), dtype=torch.bfloat16)
    b_pad = torch.full((24, I), float("nan"), dtype=torch.bfloat16)
    a_pad[:, :12] = a
    b_pad[:12] = b
    out = grouped_wgrad_torch(a_pad, b_pad, off, use_grouped_mm=False, out_dtype=torch.bfloat16)
    assert not out.isnan().any()
    _assert_close(out, _ref64(a, b, off), torch.bfloat16)
    # torch._grouped_mm's CPU kernel over-reads the last group (torch 2.13): refused off CUDA
    with pytest.raises(ValueError, match="use_grouped_mm=True needs CUDA tensors"):
        grouped_wgrad_torch(a_pad, b_pad, off, use_grouped_mm=True, out_dtype=torch.bfloat16)
    out = grouped_wgrad_torch(a_pad, b_pad, off)  # default: fp32 output
    assert out.dtype == torch.float32
    _assert_close(out, _ref64(a, b, off), torch.float32)


def test_torch_twin_all_empty_and_accumulate():
    a = torch.empty(H, 0, dtype=torch.bfloat16)
    b = torch.empty(0, I, dtype=torch.bfloat16)
    off = torch.zeros(4, dtype=torch.int32)
    out = grouped_wgrad_torch(a, b, off, out=torch.full((4, H, I), float("nan")))
    assert torch.all(out == 0)
    keep = torch.full((4, H, I), 3.0)
    grouped_wgrad_torch(a, b, off, out=keep, accumulate=True)
    assert torch.all(keep == 3.0)
    # 256 + 1 == 257 in fp32, and a BF16 output rounds the fp32 sum once
    a1 = torch.ones(H, 1, dtype=torch.bfloat16)
    b1 = torch.ones(1, I, dtype=torch.bfloat16)
    off1 = torch.tensor([1], dtype=torch.int32)
    acc = torch.full((1, H, I), 256.0)
    grouped_wgrad_torch(a1, b1, off1, out=acc, accumulate=True)
    assert torch.all(acc == 257.0)


def test_torch_twin_ragged_order():
    """tensor_ragged: K-major operands stored as per-expert contiguous blocks."""
    counts = [3, 0, 5, 2]
    s = sum(counts)
    g = torch.Generator().manual_seed(1)
    blocks_a = [torch.randn(H, n, generator=g).to(torch.bfloat16) for n in counts]
    blocks_b = [torch.randn(I, n, generator=g).to(torch.bfloat16) for n in counts]
    flat_a = torch.cat([x.reshape(-1) for x in blocks_a])
    flat_b = torch.cat([x.reshape(-1) for x in blocks_b])
    a_ragged = flat_a.as_strided((H, s), (s, 1))  # declared K-major; only unit stride matters
    b_ragged = flat_b.as_strided((s, I), (1, s))
    off = _offsets(counts)
    a2d = torch.cat(blocks_a, 1)
    b2d = torch.cat(blocks_b, 1).t()
    out = grouped_wgrad_torch(a_ragged, b_ragged, off, input_order="tensor_ragged")
    _assert_close(out, _ref64(a2d, b2d, off), torch.float32)
    (w,) = cuda_kernels.grouped_gemm_wgrad(
        a_ragged, b_ragged, off, input_order="tensor_ragged", wgrad_dtype=torch.float32
    )
    _assert_close(w, _ref64(a2d, b2d, off), torch.float32)


def test_ragged_order_ignores_non_unit_strides(fake_device):
    """tensor_ragged: only the unit-stride axis is meaningful; other host strides are ignored."""
    counts = [8, 0, 16, 8]
    s = sum(counts)
    g = torch.Generator().manual_seed(2)
    blocks_a = [torch.randn(H, n, generator=g).to(torch.bfloat16) for n in counts]
    flat_a = torch.cat([x.reshape(-1) for x in blocks_a])
    a_odd = flat_a.as_strided((H, s), (7, 1))  # declared stride 7: ignored, K-major blocks
    y_SI = torch.randn(s, I, generator=g).to(torch.bfloat16)
    buf_b = torch.zeros(s * (I + 8), dtype=torch.bfloat16)
    buf_b[: s * I] = y_SI.reshape(-1)
    b_odd = buf_b.as_strided((s, I), (I + 8, 1))  # N-major, row stride I + 8: ignored
    off = _offsets(counts)
    ref = _ref64(torch.cat(blocks_a, 1), y_SI, off)
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(
        a_odd, b_odd, None, None, off, input_order="tensor_ragged", wgrad_dtype=torch.float32
    )
    _assert_close(w, ref, torch.float32)
    (w2,) = cuda_kernels.grouped_gemm_wgrad(
        a_odd, b_odd, off, input_order="tensor_ragged", wgrad_dtype=torch.float32
    )
    _assert_close(w2, ref, torch.float32)
    with pytest.raises(ValueError, match="a_tensor: tensor_ragged needs a unit stride"):
        api.grouped_gemm_wgrad_wrapper_sm90(
            flat_a.as_strided((H, s), (2, 3)), b_odd, None, None, off,
            input_order="tensor_ragged",
        )
    with pytest.raises(ValueError, match="a_tensor.*K-major.*M-major"):  # tensor2d: strides count
        api.grouped_gemm_wgrad_wrapper_sm90(a_odd, b_odd, None, None, off)


def test_torch_twin_errors():
    a, b, off = _operands([4, 4])
    with pytest.raises(ValueError, match="accumulate=True needs"):
        grouped_wgrad_torch(a, b, off, accumulate=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_wgrad_torch(a, b, torch.tensor([6, 2]))
    with pytest.raises(ValueError, match="exceeds tokens_sum"):
        grouped_wgrad_torch(a, b, torch.tensor([4, 9]))
    with pytest.raises(ValueError, match="token dims"):
        grouped_wgrad_torch(a, b[:-1], off)
    with pytest.raises(ValueError, match="out must have shape"):
        grouped_wgrad_torch(a, b, off, out=torch.zeros(3, H, I))
    with pytest.raises(ValueError, match="input_order"):
        grouped_wgrad_torch(a, b, off, input_order="ragged")


# ------------------------------------------------------------------------------------------------
# Dispatcher backends
# ------------------------------------------------------------------------------------------------


def test_backends_registered_with_reasons():
    dispatch = pytest.importorskip("common.dispatch")
    import cuda_kernels.backend as backend_mod

    reg = dispatch.registered_backends()
    assert {"cuda-sm90", "cuda-sm100"} <= set(reg)
    if not torch.cuda.is_available():
        assert "no CUDA device" in reg["cuda-sm90"].check()
        assert "no CUDA device" in reg["cuda-sm100"].check()
        with pytest.raises(RuntimeError, match="cuda-sm90.*no CUDA device"):
            dispatch.resolve_backend("cuda-sm90", "cpu")
    assert backend_mod.check_cuda_sm90 is reg["cuda-sm90"].check


def test_backend_run_uses_kernel_path(fake_device):
    """cuda-sm90's run = the fused backward with its wgrad through the API (fake kernel on CPU)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        # conftest interprets Triton only on machines without CUDA; there the GPU tests of
        # tests/test_fused_backward.py run this path with the real kernel
        pytest.skip("CPU tensors through the fused backward need TRITON_INTERPRET (no-CUDA runs)")
    inputs = pytest.importorskip("common.inputs")
    from common.dispatch import registered_backends

    problem = inputs.make_problem(48, 128, 64, 4, 2, seed=3)
    reg = registered_backends()
    grads = reg["cuda-sm90"].run(problem, wgrad_backend="sm90")
    ref = reg["torch"].run(problem)
    assert grads.info["wgrad_backend"] == "sm90"
    for name in ("w_gate_up_grad_EH2I", "w_down_grad_EIH", "hidden_states_grad_TH"):
        got, want = getattr(grads, name), getattr(ref, name)
        scale = max(want.abs().max().item(), 1e-6)
        assert (got - want).abs().max().item() / scale < 2e-2, name
    # a shape outside the SM90 tile rules: an explicit kernel request says why it cannot run,
    # "auto" runs the torch twin and keeps the reason
    small = inputs.make_problem(16, 32, 16, 2, 1, seed=4)
    with pytest.raises(RuntimeError, match="tiling"):
        reg["cuda-sm90"].run(small, wgrad_backend="sm90")
    fake_device.cc = 90
    g2 = reg["cuda-sm90"].run(small)
    assert g2.info["wgrad_backend"] == "torch"


def test_grouped_wgrad_fp32_on_cpu():
    a, b, off = _operands([7, 0, 9])
    stats = {}
    out = api.grouped_wgrad_fp32(a, b, off.long(), stats=stats)
    assert out.dtype == torch.float32 and stats["torch"] == 1
    _assert_close(out, _ref64(a, b, off), torch.float32)


# ------------------------------------------------------------------------------------------------
# JAX entry (eager, DLPack); skipped without JAX
# ------------------------------------------------------------------------------------------------


def test_jax_eager_entry():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from cuda_kernels.grouped_wgrad import jax as wgrad_jax

    # The eager entry's CPU path (the torch fallback): pin the arrays to JAX's CPU device so the
    # test means the same on a GPU machine, where JAX would otherwise place them on the GPU.
    cpu = jax.devices("cpu")[0]
    a_t, b_t, off_t = _operands([8, 0, 16], a_major="k", b_major="n")
    a = jax.device_put(jnp.asarray(a_t.float().numpy(), dtype=jnp.bfloat16), cpu)
    b = jax.device_put(jnp.asarray(b_t.float().numpy(), dtype=jnp.bfloat16), cpu)
    off = jax.device_put(jnp.asarray(off_t.numpy()), cpu)
    ref = _ref64(a_t, b_t, off_t)
    r = wgrad_jax.grouped_gemm_wgrad_jax(a, b, off, wgrad_dtype=jnp.float32)
    (w,) = r
    assert len(r) == 1 and w.dtype == jnp.float32 and w.shape == (3, H, I)
    _assert_close(torch.from_dlpack(w), ref, torch.float32)
    # accumulate starts from wgrad's values and never mutates the input array
    w0 = jax.device_put(jnp.ones((3, H, I), dtype=jnp.float32), cpu)
    (w2,) = wgrad_jax.grouped_gemm_wgrad_jax(a, b, off, wgrad=w0, accumulate_on_output=True)
    got = torch.from_dlpack(w2)
    _assert_close(got, ref + 1.0, torch.float32)
    assert float(w0.sum()) == 3 * H * I
    with pytest.raises(ValueError, match="offsets_tensor.*last offset"):
        wgrad_jax.grouped_gemm_wgrad_jax(
            a, b, jax.device_put(jnp.asarray([8, 8, 8], dtype=jnp.int32), cpu)
        )
    with pytest.raises(ValueError, match="wgrad_dtype"):
        wgrad_jax.grouped_gemm_wgrad_jax(a, b, off, wgrad_dtype="int8")
    with pytest.raises(ValueError, match="a must be a JAX array"):
        wgrad_jax.grouped_gemm_wgrad_jax([1], b, off)
    with pytest.raises(ValueError, match="multiple of 256"):  # the jit entry validates statically
        wgrad_jax.grouped_gemm_wgrad_jax_sm100(a, b, off, None)


def test_jax_module_imports_without_jax():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['jax'] = None\n"
        "import cuda_kernels.grouped_wgrad.jax as m\n"
        "try:\n    m.grouped_gemm_wgrad_jax(None, None, None)\n"
        "except RuntimeError as e:\n    print('needs JAX' in str(e))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")
def test_api_contract_compiles_offline_for_sm90a():
    """Integration: the key the API builds compiles with the SM90 kernel for sm_90a (no GPU)."""
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90_bf16

    c = api.WgradContract(
        arch="sm90", hidden=256, intermediate=128, num_experts=4, a_major="k", b_major="k",
        out_dtype="float32", output_mode="discrete", accumulate=True,
        input_order="tensor2d", mma_tiler_mn=None, cluster_shape_mn=None,
    )
    ptx = sm90_bf16.compile_sm90_wgrad_offline(bf16.contract_key(c), arch="sm_90a")
    assert "wgmma.mma_async" in ptx


# ------------------------------------------------------------------------------------------------
# GPU (gpu marker; skipped without CUDA): the API end to end on the real SM90 kernel
# ------------------------------------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()
HAS_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
HAS_CUTE = importlib.util.find_spec("cutlass") is not None
needs_sm90 = pytest.mark.skipif(
    not (HAS_SM90 and HAS_CUTE), reason="needs an SM90 device and nvidia-cutlass-dsl"
)


def _cuda_operands(counts, hidden=256, inter=512, seed=0):
    a, b, off = _operands(counts, "m", "n", seed=seed, hidden=hidden, inter=inter)
    return a.cuda(), b.cuda(), off.cuda()


def _close_gpu(out, a, b, off, dtype):
    _assert_close(out.cpu(), _ref64(a.cpu(), b.cpu(), off.cpu()), dtype)


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_sm90_wrapper_dense_discrete_and_dispatch(out_dtype):
    counts = [0, 300, 17, 0, 1000, 64]
    a, b, off = _cuda_operands(counts)
    e = len(counts)
    assert api.select_grouped_wgrad_backend(a.device)[0] == "sm90"
    w = torch.full((e, 256, 512), float("nan"), dtype=out_dtype, device="cuda")
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, wgrad_tensor=w)
    torch.cuda.synchronize()
    _close_gpu(w, a, b, off, out_dtype)
    assert torch.all(w[0] == 0) and torch.all(w[3] == 0)
    outs = [torch.full((256, 512), float("nan"), dtype=out_dtype, device="cuda") for _ in counts]
    ptrs = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device="cuda")
    r = cuda_kernels.grouped_gemm_wgrad(
        a, b, off, output_mode="discrete", wgrad_ptrs=ptrs, wgrad_dtype=out_dtype
    )
    torch.cuda.synchronize()
    assert r["wgrad_tensor"] is None
    _close_gpu(torch.stack(outs), a, b, off, out_dtype)


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
def test_gpu_sm90_graph_capture_replays_new_offsets():
    """validate_offsets stays on (the default) but is skipped while capturing; no recompile."""
    counts = [128, 0, 384, 512]
    a, b, off = _cuda_operands(counts, seed=1)
    out = torch.empty(4, 256, 512, dtype=torch.float32, device="cuda")
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, wgrad_tensor=out)  # compile
    n_ops = len(wrappers._OP_CACHE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, wgrad_tensor=out)
    for new in ([0, 0, 1024, 0], [1, 2, 3, 1018], [256, 256, 256, 256]):
        off.copy_(_offsets(new).cuda())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _close_gpu(out, a, b, off, torch.float32)
    assert len(wrappers._OP_CACHE) == n_ops


#: Token splits of one tokens_sum (1024) the captured plan replays: zero-token experts first,
#: in the middle and last, one expert holding every token, unaligned expert begins.
_REPLAY_SPLITS = ([0, 512, 0, 512], [384, 0, 640, 0], [0, 0, 1024, 0], [1, 0, 7, 1016],
                  [256, 256, 256, 256])


@pytest.mark.gpu
@pytest.mark.sm90
@needs_sm90
@pytest.mark.parametrize("layout", [("m", "n"), ("k", "k")], ids=["MN", "KK"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_sm90_plan_replayed_in_a_cuda_graph(layout, accumulate, out_dtype):
    """cuDNN frontend's newest wgrad test, for our SM90 BF16 kernel: one compiled plan
    (``GroupedGemmWgradSm90``) captured in a CUDA graph, replayed with new offsets AND new
    operand values, zero-token experts included, accumulating into the output (or overwriting
    a NaN-poisoned one). Each replay against the torch twin (``grouped_wgrad_torch`` on the same
    device, the same accumulate rule) within the SM90 tests' tolerance; an empty expert's output
    is bit-identical to what it was (accumulate) or exactly zero (overwrite)."""
    from test_grouped_wgrad_sm90 import _TOL, _rel_err

    hidden, inter, e, s = 256, 512, 4, 1024
    gen = torch.Generator().manual_seed(7)

    def operands():
        x_SH = torch.randn(s, hidden, generator=gen).to(torch.bfloat16)
        y_SI = torch.randn(s, inter, generator=gen).to(torch.bfloat16)
        a = x_SH.t() if layout[0] == "m" else x_SH.t().contiguous()
        b = y_SI if layout[1] == "n" else y_SI.t().contiguous().t()
        return a.cuda(), b.cuda()

    a, b = operands()
    off = _offsets(_REPLAY_SPLITS[0]).cuda()
    out = torch.zeros(e, hidden, inter, dtype=out_dtype, device="cuda")
    op = api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=out,
                                  accumulate_on_output=accumulate)
    op.check_support()
    op.compile()
    assert op.backend == "sm90" and op.contract.accumulate is accumulate
    op.execute(a, b, None, None, off, wgrad_tensor=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        op.execute(a, b, None, None, off, wgrad_tensor=out)  # validation skipped: capturing
    torch.cuda.synchronize()
    for counts in _REPLAY_SPLITS:
        new_a, new_b = operands()
        a.copy_(new_a)
        b.copy_(new_b)
        off.copy_(_offsets(counts).cuda())
        if accumulate:  # the output accumulated into: random values, kept where experts are empty
            out.copy_(torch.randn(e, hidden, inter, generator=gen).to(out_dtype))
        else:
            out.fill_(float("nan"))  # poisoned: every expert must be written
        before = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        twin = grouped_wgrad_torch(a, b, off, out=before.clone() if accumulate else None,
                                   accumulate=accumulate, out_dtype=out_dtype)
        name = str(out_dtype).removeprefix("torch.")
        assert _rel_err(out, twin) < _TOL[name], counts
        assert bool(torch.isfinite(out).all()), counts
        for expert, c in enumerate(counts):
            if c == 0:
                want = before[expert] if accumulate else torch.zeros_like(out[expert])
                assert torch.equal(out[expert], want), (counts, expert)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_torch_twin_on_cuda():
    counts = [64, 0, 128, 0]
    a, b, off = _cuda_operands(counts, seed=2)
    for dtype in (torch.bfloat16, torch.float32):
        out = grouped_wgrad_torch(a, b, off, out_dtype=dtype)
        torch.cuda.synchronize()
        _close_gpu(out, a, b, off, dtype)
        assert torch.all(out[1] == 0) and torch.all(out[3] == 0)


def test_grouped_wgrad_fp32_backend_choice(fake_device):
    a, b, off = _operands([7, 0, 9])
    with pytest.raises(ValueError, match="backend must be one of"):
        api.grouped_wgrad_fp32(a, b, off, backend="cuda")
    stats = {}
    out = api.grouped_wgrad_fp32(a, b, off.long(), backend="sm90", stats=stats)
    assert stats == {"kernel": 1} and out.dtype == torch.float32
    _assert_close(out, _ref64(a, b, off), torch.float32)
    out = api.grouped_wgrad_fp32(a.float(), b.float(), off, backend="sm90", stats=stats)
    assert stats["torch"] == 1 and "bfloat16" in stats["torch_reason"]
    _assert_close(out, _ref64(a, b, off), torch.float32)


# ------------------------------------------------------------------------------------------------
# Issue 8 item 1: grouped_wgrad_fp32 / the cuda-sm100 backend's grouped_wgrad / the torch op never
# hand the SM100 kernel offsets off its 256-row contract unless the caller states the alignment.
# The routing below is the real decision (dispatch._fp32_route, kernel_unsupported_reason); only the
# capability query and the compiled launcher are faked (fake_device), never the choice.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[16, 0, 48], [256, 0, 512]])
def test_fp32_sm100_needs_stated_256_row_groups(fake_device, counts):
    fake_device.cc = 100
    a, b, off = _operands(counts, hidden=256, inter=256)
    ref = _ref64(a, b, off)
    for align in (1, 16, 128):  # default, common.torch_backward's ALIGN, a half-tile
        stats = {}
        out = api.grouped_wgrad_fp32(a, b, off, backend="sm100", stats=stats, group_align=align)
        assert stats == {"torch": 1, "torch_reason": stats["torch_reason"]}
        assert "multiples of 256" in stats["torch_reason"] and f"={align}" in stats["torch_reason"]
        assert fake_device.launches == 0 and fake_device.compiles == []
        _assert_close(out, ref, torch.float32)
    assert dispatch._fp32_route("sm100", a, b, off, 512) == ("sm100", None)
    stats = {}
    out = api.grouped_wgrad_fp32(a, b, off, backend="sm100", stats=stats, group_align=256)
    assert stats == {"kernel": 1} and fake_device.launches == 1
    assert fake_device.compiles[0].arch == "sm100"
    if counts[0] == 256:  # only then is the stated alignment true: the (fake) kernel is right
        _assert_close(out, ref, torch.float32)


def test_fp32_sm90_takes_any_alignment(fake_device):
    a, b, off = _operands([16, 0, 48], hidden=128, inter=128)
    assert dispatch._fp32_route("sm90", a, b, off) == ("sm90", None)
    assert dispatch._fp32_route("torch", a, b, off, 256) == ("torch", "backend='torch' requested")
    assert dispatch._fp32_route("auto", a, b, off, 256)[0] == "torch"  # a CPU tensor
    for bad in (0, -256, 1.5, True, None):
        with pytest.raises(ValueError, match="group_align"):
            api.grouped_wgrad_fp32(a, b, off, backend="sm90", group_align=bad)


def test_cuda_sm100_backend_grouped_wgrad_falls_back_off_contract(fake_device):
    from common.dispatch import registered_backends

    fake_device.cc = 100
    fn = registered_backends()["cuda-sm100"].grouped_wgrad
    a, b, off = _operands([16, 32, 0, 80], hidden=256, inter=256)  # common.torch_backward's layout
    stats = {}
    out = fn(a, b, off, stats=stats)
    assert stats["torch"] == 1 and "multiples of 256" in stats["torch_reason"]
    assert fake_device.launches == 0
    _assert_close(out, _ref64(a, b, off), torch.float32)
    a, b, off = _operands([256, 0, 256], hidden=256, inter=256)
    stats = {}
    fn(a, b, off, stats=stats, group_align=256)
    assert stats == {"kernel": 1} and fake_device.launches == 1


def test_torch_op_takes_group_align():
    from cuda_kernels.grouped_wgrad.ops import grouped_wgrad_op

    a, b, off = _operands([16, 0, 48], hidden=64, inter=32)
    schema = str(torch.ops.moe_bwd.grouped_wgrad.default._schema)
    assert "group_align=1" in schema
    out = torch.ops.moe_bwd.grouped_wgrad(a, b, off, 256)
    _assert_close(out, _ref64(a, b, off), torch.float32)
    torch.library.opcheck(grouped_wgrad_op, (a, b, off, 16))
    with pytest.raises(ValueError, match="group_align"):
        torch.ops.moe_bwd.grouped_wgrad(a, b, off, 0)


# ------------------------------------------------------------------------------------------------
# Issue 8 item 3: cuDNN interface parity (signatures, both discrete outputs, workspaces, offsets
# validation once per tensor version)
# ------------------------------------------------------------------------------------------------

_CUDNN_EXECUTE_PREFIX = (
    "self", "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "wgrad_tensor",
    "wgrad_ptrs", "global_scale_a", "global_scale_b", "current_stream",
)
_CUDNN_WRAPPER_PREFIX = (
    "a_tensor", "b_tensor", "sfa_tensor", "sfb_tensor", "offsets_tensor", "output_mode",
    "wgrad_tensor", "wgrad_ptrs", "global_scale_a", "global_scale_b", "acc_dtype", "wgrad_dtype",
    "mma_tiler_mn", "cluster_shape_mn", "sf_vec_size", "sf_fp8_dtype_override",
    "accumulate_on_output", "input_order", "current_stream",
)


@pytest.mark.parametrize(
    ("fn", "prefix"),
    [
        (api.GroupedGemmWgradSm100.execute, _CUDNN_EXECUTE_PREFIX),
        (api.GroupedGemmWgradSm90.execute, _CUDNN_EXECUTE_PREFIX),
        (api.grouped_gemm_wgrad_wrapper_sm100, _CUDNN_WRAPPER_PREFIX),
        (api.grouped_gemm_wgrad_wrapper_sm90, _CUDNN_WRAPPER_PREFIX),
    ],
)
def test_cudnn_positional_prefix_and_keywords(fn, prefix):
    """cuDNN's test_grouped_gemm_wgrad_preserves_legacy_positional_prefix, on our surface."""
    import inspect

    sig = inspect.signature(fn)
    positional = tuple(
        n for n, p in sig.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    assert positional == prefix
    ws = sig.parameters["descriptor_workspace"]
    assert ws.kind is inspect.Parameter.KEYWORD_ONLY and ws.default is None
    sentinels = [object() for _ in prefix]
    assert "descriptor_workspace" not in sig.bind(*sentinels).arguments
    with pytest.raises(TypeError):
        sig.bind(*sentinels, object())


def test_class_takes_sf_fp8_dtype_override(fake_device):
    a, b, off = _operands(COUNTS)
    w = torch.empty(3, H, I, dtype=torch.bfloat16)
    op = api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=w,
                                  sf_fp8_dtype_override=None)
    assert op.check_support()
    with pytest.raises(ValueError, match="sf_fp8_dtype_override must be None"):
        api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=w,
                                 sf_fp8_dtype_override="e5m3").check_support()
    with pytest.raises(ValueError, match="sf_fp8_dtype_override must be None"):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off, sf_fp8_dtype_override="e5m3")


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_bf16_rejects_sf_fp8_dtype_override_with_cudnns_text(arch, fake_device):
    """cuDNN frontend's test_grouped_gemm_wgrad_bf16_rejects_sf_fp8_dtype_override: None is
    accepted and runs BF16; "e5m3" raises with cuDNN's exact words (ours follow them), through
    the wrapper, the class and the generic entry alike (one validation pipeline)."""
    fake_device.cc = 100 if arch == "sm100" else 90
    a, b, off = _operands(COUNTS)
    kwargs = {"a_tensor": a, "b_tensor": b, "sfa_tensor": None, "sfb_tensor": None,
              "offsets_tensor": off, "output_mode": "dense", "wgrad_dtype": torch.float32}
    ref = _ref64(a, b, off)
    (w,) = WRAPPERS[arch](**kwargs, sf_fp8_dtype_override=None)
    _assert_close(w, ref, torch.float32)
    cudnn = "BF16 forbids scale control sf_fp8_dtype_override"
    with pytest.raises(ValueError, match=cudnn) as err:
        WRAPPERS[arch](**kwargs, sf_fp8_dtype_override="e5m3")
    assert str(err.value).startswith(f"{cudnn}: sf_fp8_dtype_override must be None")
    with pytest.raises(ValueError, match=cudnn):
        CLASSES[arch](a, b, None, None, off, sample_wgrad=w,
                      sf_fp8_dtype_override="e5m3").check_support()
    with pytest.raises(ValueError, match=cudnn):
        api.grouped_gemm_wgrad(a, b, off, backend="torch", sf_fp8_dtype_override="e5m3")
    # every scale control of a BF16 call says it the same way
    with pytest.raises(ValueError, match="BF16 forbids scale control sfa_tensor"):
        WRAPPERS[arch](**{**kwargs, "sfa_tensor": torch.zeros(1)})


def test_wgrad_expert_ptrs_as_cudnns_helper():
    """cuDNN frontend's ``wgrad_expert_ptrs``: the [E] int64 addresses of a stacked output's
    expert slabs, computed on the tensor's device; a padded expert stride is kept, a slab that is
    not row-major contiguous or slabs that overlap are refused."""
    w = torch.zeros(3, 8, 16, dtype=torch.float32)
    ptrs = api.wgrad_expert_ptrs(w)
    assert ptrs.dtype == torch.int64 and ptrs.shape == (3,) and ptrs.device == w.device
    assert ptrs.tolist() == [w[e].data_ptr() for e in range(3)]
    assert torch.equal(ptrs, pipeline.stacked_pointers(w))
    padded = torch.zeros(3, 9, 16, dtype=torch.bfloat16)[:, :8]  # expert stride 144 > 128
    assert api.wgrad_expert_ptrs(padded).tolist() == [padded[e].data_ptr() for e in range(3)]
    assert api.wgrad_expert_ptrs(w[:0]).shape == (0,)
    one = torch.zeros(1, 8, 16)
    assert api.wgrad_expert_ptrs(one).tolist() == [one.data_ptr()]
    with pytest.raises(ValueError, match="rank-3"):
        api.wgrad_expert_ptrs(w[0])
    with pytest.raises(ValueError, match="row-major contiguous"):
        api.wgrad_expert_ptrs(w.transpose(1, 2))
    with pytest.raises(ValueError, match="must not overlap"):
        api.wgrad_expert_ptrs(torch.zeros(400).as_strided((3, 8, 16), (64, 16, 1)))
    assert api.wgrad_expert_ptrs is cuda_kernels.wgrad_expert_ptrs


def test_wgrad_expert_ptrs_of_a_jax_array():
    """JAX (eager): the packed little-endian uint8 [8 * E] form the jit entries take."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from cuda_kernels.grouped_wgrad.jax_ffi import pack_pointers_uint8

    w = jax.device_put(jnp.zeros((3, 8, 16), jnp.float32), jax.devices("cpu")[0])
    ptrs = api.wgrad_expert_ptrs(w)
    base = w.unsafe_buffer_pointer()
    assert ptrs.dtype == jnp.uint8 and ptrs.shape == (24,)
    want = pack_pointers_uint8([base + e * 8 * 16 * 4 for e in range(3)])
    assert (np.asarray(ptrs) == want).all()


def test_wgrad_expert_ptrs_feed_the_discrete_mode(fake_device):
    """The table is what discrete calls take: with the stacked tensor too (cuDNN's calls pass
    both), the pointer-values check finds exactly its slabs, and the kernel writes them."""
    a, b, off = _operands([16, 0, 48])
    w = torch.full((3, H, I), float("nan"), dtype=torch.float32)
    (out,) = api.grouped_gemm_wgrad_wrapper_sm90(
        a, b, None, None, off, output_mode="discrete", wgrad_tensor=w,
        wgrad_ptrs=api.wgrad_expert_ptrs(w), wgrad_dtype=torch.float32,
    )
    assert out is w
    _assert_close(w, _ref64(a, b, off), torch.float32)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_discrete_both_outputs_as_cudnn_passes_them(arch, fake_device):
    fake_device.cc = 100 if arch == "sm100" else 90
    counts = [256, 0, 512] if arch == "sm100" else [16, 0, 48]
    a, b, off = _operands(counts, hidden=256, inter=256)
    ref = _ref64(a, b, off)
    out = torch.full((3, 256, 256), float("nan"), dtype=torch.float32)
    ptrs = pipeline.stacked_pointers(out)
    r = WRAPPERS[arch](
        a, b, None, None, off, output_mode="discrete", wgrad_tensor=out, wgrad_ptrs=ptrs,
        wgrad_dtype=torch.float32,
    )
    assert r["wgrad_tensor"] is out  # cuDNN's BF16 test: result["wgrad_tensor"] is the output
    _assert_close(out, ref, torch.float32)
    assert fake_device.compiles[-1].output_mode == "discrete"
    # without validation the pointers are trusted (no host read): still written through them
    out.fill_(float("nan"))
    WRAPPERS[arch](
        a, b, None, None, off, output_mode="discrete", wgrad_tensor=out, wgrad_ptrs=ptrs,
        validate_offsets=False,
    )
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_cudnn_sized_workspace_is_accepted(arch, fake_device):
    fake_device.cc = 100 if arch == "sm100" else 90
    counts = [256, 0, 512] if arch == "sm100" else [16, 0, 48]
    a, b, off = _operands(counts, hidden=256, inter=256)
    for mode in ("dense", "discrete"):
        n = api.get_grouped_gemm_wgrad_workspace_size_sm100(3, output_mode=mode)
        ws = torch.zeros(n, dtype=torch.uint8)
        WRAPPERS[arch](a, b, None, None, off, output_mode=mode, descriptor_workspace=ws)
        # the caller's buffer reaches the launcher (the SM100 kernel builds its per-expert
        # descriptors there; the fake launcher, like the SM90 kernel, leaves it untouched)
        assert fake_device.workspaces[-1] is ws and not ws.any()
        with pytest.raises(ValueError, match=f"at least {n} bytes"):
            WRAPPERS[arch](a, b, None, None, off, output_mode=mode,
                           descriptor_workspace=ws[: n - 128])
    w = torch.empty(3, 256, 256, dtype=torch.bfloat16)
    op = CLASSES[arch](a, b, None, None, off, sample_wgrad=w)
    op.compile()
    ws = torch.zeros(api.get_grouped_gemm_wgrad_workspace_size_sm100(3), dtype=torch.uint8)
    op.execute(a, b, None, None, off, wgrad_tensor=w, descriptor_workspace=ws)
    op.execute(a, b, None, None, off, wgrad_tensor=w, workspace=ws)
    op.execute(a, b, None, None, off, wgrad_tensor=w, workspace=ws, descriptor_workspace=ws)
    _assert_close(w, _ref64(a, b, off), torch.bfloat16)
    with pytest.raises(ValueError, match="name the same buffer"):
        op.execute(a, b, None, None, off, wgrad_tensor=w, workspace=ws,
                   descriptor_workspace=ws.clone())
    with pytest.raises(ValueError, match="contiguous"):
        op.execute(a, b, None, None, off, wgrad_tensor=w,
                   descriptor_workspace=torch.zeros(2 * ws.numel(), dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="torch.uint8"):
        op.execute(a, b, None, None, off, wgrad_tensor=w, descriptor_workspace=ws.view(-1, 4)
                   .view(torch.int32).flatten())
    with pytest.raises(ValueError, match="one device"):
        op.execute(a, b, None, None, off, wgrad_tensor=w,
                   descriptor_workspace=torch.zeros(ws.numel(), dtype=torch.uint8,
                                                    device="meta"))


def test_offsets_validated_once_per_tensor_version(fake_device, monkeypatch):
    reads = []
    real = validate.check_offsets_now
    monkeypatch.setattr(
        validate, "check_offsets_now", lambda *args: reads.append(args[0]) or real(*args)
    )
    a, b, off = _operands([16, 0, 48])
    run = functools.partial(api.grouped_gemm_wgrad_wrapper_sm90, a, b, None, None)
    run(off)
    run(off)
    assert len(reads) == 1  # the same unchanged tensor: no second host read (sync)
    off2 = off.clone()  # equal values, another tensor: read once
    run(off2)
    assert len(reads) == 2
    off2.add_(0)  # an in-place op bumps the version: read again
    run(off2)
    assert len(reads) == 3
    off2[1] = 100  # a bad value written in place is caught
    with pytest.raises(ValueError, match="non-decreasing"):
        run(off2)
    # a tensor that failed is not cached as good
    with pytest.raises(ValueError, match="non-decreasing"):
        run(off2)
    # a view written through shares the version counter
    base = off.clone()
    view = base[:]
    run(view)
    base[2] = 80
    with pytest.raises(ValueError, match="last offset 80 must equal tokens_sum 64"):
        run(view)
    api.clear_grouped_wgrad_caches()
    n = len(reads)
    run(off)
    assert len(reads) == n + 1


def test_validation_cache_never_trusts_a_new_tensor_at_a_freed_address(fake_device):
    a, b, off = _operands([16, 0, 48])
    api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
    key = next(iter(validate._VALIDATED))
    # forge the entry for a different live tensor object: the weak reference does not match
    other = torch.tensor([64, 0, 64], dtype=torch.int32)
    validate._VALIDATED[(*key[:-4], other.device, other.data_ptr(), other._version,
                    tuple(other.shape))] = validate._VALIDATED[key]
    with pytest.raises(ValueError, match="non-decreasing"):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, other)


# ------------------------------------------------------------------------------------------------
# One tile-rule source (issue 8 item 4): the API, the kernels' configs and the docs agree
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_tile_rules_have_one_source(arch):
    from cuda_kernels.gemm.sm90 import wgrad_bf16 as sm90_bf16
    from cuda_kernels.gemm.sm100 import wgrad_bf16 as sm100_bf16
    from cuda_kernels.gemm import tiles

    rules = {"sm90": tiles.SM90_TILES, "sm100": tiles.SM100_TILES}[arch]
    config_cls = {"sm90": sm90_bf16.Sm90TileConfig, "sm100": sm100_bf16.Sm100TileConfig}[arch]
    for tile_m in (32, 64, 96, 128, 192, 256, 512):
        for tile_n in range(8, 289, 8):
            try:
                validate.check_tiling(arch, (tile_m, tile_n), None)
                api_ok = True
            except ValueError:
                api_ok = False
            try:
                pp = {"pingpong": True} if arch == "sm90" and tile_m == 192 else {}
                config_cls(tile_m, tile_n, 64, 2, **pp)  # (SM90 tile M 192: pingpong only)
                kernel_ok = True
            except ValueError:
                kernel_ok = False
            assert api_ok == kernel_ok, (tile_m, tile_n)
            assert api_ok == (tile_m in rules.tile_m and tile_n in rules.tile_n)
    for tile_m in rules.tile_m:  # the API's cluster for the kernel's tile is accepted
        validate.check_tiling(arch, (tile_m, rules.tile_n[-1]), rules.cluster_for(tile_m))
    doc = " ".join(CLASSES[arch].__doc__.split())
    assert " ".join(rules.describe("").split()[2:]) in doc  # the docs are generated from it
    for _name, _cond, config in {"sm90": sm90_bf16.load_sm90_tile_rules,
                                 "sm100": sm100_bf16.load_sm100_tile_rules}[arch]():
        assert config.tile_m in rules.tile_m and config.tile_n in rules.tile_n


def test_dispatch_reason_without_cuda(monkeypatch):
    """A CUDA device where CUDA is unavailable: the reason says so (not "is not a CUDA
    device")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:0", torch.device("cuda", 1)):
        name, reason = api.select_grouped_wgrad_backend(dev)
        assert name == "torch" and reason.startswith("CUDA is not available"), reason
    assert "not a CUDA device" in api.select_grouped_wgrad_backend("meta")[1]


@pytest.mark.parametrize("bad", [torch.zeros(2), None, 1.5, "nodevice", ["cpu"]],
                         ids=["tensor", "none", "float", "bad-string", "list"])
def test_dispatch_rejects_non_devices(bad):
    """Anything but a device, a device string or a CUDA ordinal: ValueError naming ``device``
    and what it accepts (was a raw TypeError / RuntimeError from torch.device)."""
    with pytest.raises(ValueError, match=r"device must be a torch\.device, a device string"):
        api.select_grouped_wgrad_backend(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_device_rule_comes_first(arch):
    """CPU tensors with offsets that break the SM100 256 rule (then int64 offsets, a static
    rule): both wrappers and both classes say they need CUDA first, not a data rule
    that does not matter until there is a device to run on."""
    a, b, off = _operands([100, 0, 156])
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        WRAPPERS[arch](a, b, None, None, off)
    off = off.long()  # a static rule broken too (int64 offsets)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        WRAPPERS[arch](a, b, None, None, off)
    op = CLASSES[arch](a, b, None, None, off, sample_wgrad=torch.empty(3, H, I))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        op.check_support()


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_class_output_sample_neither_and_both(arch):
    """Neither output sample: a message for that case (it said "..., not both"); both: the
    "not both" message."""
    a, b, off = _operands(COUNTS)
    with pytest.raises(ValueError, match="no output sample: give sample_wgrad"):
        CLASSES[arch](a, b, None, None, off)
    with pytest.raises(ValueError, match="not both"):
        CLASSES[arch](a, b, None, None, off, sample_wgrad=torch.empty(3, H, I), num_experts=3,
                      wgrad_shape=(H, I), wgrad_dtype=torch.bfloat16)
