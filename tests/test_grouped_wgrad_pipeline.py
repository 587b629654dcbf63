"""The grouped wgrad's one validation pipeline and its one plug-in point (issue 21 item 1).

- One pipeline: the same rule gives the same message (naming each entry's own argument) through
  the wrappers, the class's samples and ``execute``, ``kernel_unsupported_reason`` and the JAX
  jit entries -- they all run ``pipeline.validate_call``; the format is chosen once, by the
  operand dtypes.
- One plug-in point: every kernel family is a ``registry.KernelProvider`` row; registering one
  (a new family, a varlen-M one) is one call, and the API routes to it by arch and format.

CPU only (the capability query is faked; no kernel is compiled).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from cuda_kernels.gemm import env, registry
from cuda_kernels.grouped_wgrad import (
    api,
    bf16,
    blockscaled,
    dispatch,
    pipeline,
)
from cuda_kernels.grouped_wgrad._types import WgradCall, WgradContract

HAS_JAX = importlib.util.find_spec("jax") is not None
RULE = "a K-major operand needs tokens_sum % 8 == 0"


@pytest.fixture(autouse=True)
def _clean():
    api.clear_grouped_wgrad_caches()
    yield
    api.clear_grouped_wgrad_caches()


@pytest.fixture
def sm90(monkeypatch):
    """A faked SM90 device whose kernel must not compile (the twin still runs)."""
    real = bf16.compile_launcher

    def compile_launcher(contract, who):
        assert contract.arch == "torch", "a kernel compiled"
        return real(contract, who)

    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": 90)
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    monkeypatch.setattr(bf16, "compile_launcher", compile_launcher)


def _operands(tokens, hidden=128, inter=128, k_major_a=True):
    a = torch.zeros(hidden, tokens, dtype=torch.bfloat16)  # K-major: strides (S, 1)
    if not k_major_a:
        a = a.t().contiguous().t()
    b = torch.zeros(tokens, inter, dtype=torch.bfloat16)  # N-major
    return a, b, torch.tensor([tokens // 2, tokens], dtype=torch.int32)


def test_one_rule_one_message_through_every_entry(sm90):
    a, b, off = _operands(100)
    with pytest.raises(ValueError, match=f"a_tensor: {RULE}"):
        api.grouped_gemm_wgrad_wrapper_sm90(a, b, None, None, off)
    with pytest.raises(ValueError, match=f"a_tensor: {RULE}"):
        api.grouped_gemm_wgrad(a, b, off, backend="sm90")
    w = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"sample_a: {RULE}"):
        api.GroupedGemmWgradSm90(a, b, None, None, off, sample_wgrad=w).check_support()
    reason = api.kernel_unsupported_reason("sm90", a, b, off)
    assert reason.startswith(f"a_HS: {RULE}")
    # execute: an operator of an aligned sample refuses the call by the same rule
    a8, b8, off8 = _operands(104)
    op = api.GroupedGemmWgradSm90(a8, b8, None, None, off8, sample_wgrad=w)
    op.check_support()
    op._compiled = pipeline.CompiledWgrad(op.contract, bf16, lambda *a, **k: None, "sm90")
    with pytest.raises(ValueError, match=f"a_tensor: {RULE}"):
        op.execute(a, b, None, None, off, wgrad_tensor=w)
    # the twins' rules (arch "torch") have no TMA alignment: the same call runs there
    (out,) = api.grouped_gemm_wgrad(a, b, off, backend="torch")
    assert out.shape == (2, 128, 128)


@pytest.mark.skipif(not HAS_JAX, reason="JAX not installed")
def test_the_jit_entries_run_the_same_pipeline():
    import jax
    import jax.numpy as jnp

    from cuda_kernels.grouped_wgrad import jax_ffi

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.zeros((128, 100), jnp.bfloat16), cpu)
    b = jax.device_put(jnp.zeros((100, 128), jnp.bfloat16), cpu)
    off = jax.device_put(jnp.asarray([50, 100], jnp.int32), cpu)
    with pytest.raises(ValueError, match=f"a: {RULE}"):
        jax_ffi.check_jax_wgrad_call("sm90", a, b, off, output_mode="dense")
    # the SM100 token multiple is the tile rules' (tiles.SM100_TILES.group_align)
    a = jax.device_put(jnp.zeros((128, 128), jnp.bfloat16), cpu)
    b = jax.device_put(jnp.zeros((128, 128), jnp.bfloat16), cpu)
    with pytest.raises(ValueError, match=f"multiple of {bf16.TOKEN_ALIGN['sm100']}"):
        jax_ffi.check_jax_wgrad_call("sm100", a, b, off, output_mode="dense")


def test_the_format_is_chosen_once_by_the_operand_dtypes():
    a, b, off = _operands(64)
    assert pipeline.select_format(a, b) is bf16
    fp8 = torch.float8_e4m3fn
    assert pipeline.select_format(a.to(fp8), b.to(fp8)) is blockscaled
    with pytest.raises(ValueError, match="one dtype for A and B"):
        pipeline.select_format(a.to(fp8), b.to(torch.float8_e5m2))
    # a BF16 pair with a scale tensor is the BF16 format, refused by its controls
    call = WgradCall(a, b, off, sfa=torch.zeros(1))
    with pytest.raises(ValueError, match="sfa_tensor must be None"):
        pipeline.validate_call(call, "torch")


def test_validate_call_returns_the_contract_of_every_moot_layout():
    # one token: A's strides express both K- and M-major; B's both K- and N-major
    a, b = torch.zeros(128, 1, dtype=torch.bfloat16), torch.zeros(1, 64, dtype=torch.bfloat16)
    v = pipeline.validate_call(WgradCall(a, b, torch.tensor([1], dtype=torch.int32)), "torch")
    assert {(c.a_major, c.b_major) for c in v.contracts} == {
        ("k", "k"), ("k", "n"), ("m", "k"), ("m", "n")}
    assert v.contract == v.contracts[0] and v.format is bf16 and v.out is None


def test_every_family_of_the_package_is_one_registry_row():
    """Every module of the engine's per-arch folders that defines a ``FAMILY`` is exactly one
    registry row of its folder's arch (read from the tree: a new family is its module and its
    row, no list here to extend), and every row loads its module."""
    rows = registry.providers() + registry.providers(problem="varlen_m")
    by_module = {p.module: p for p in rows}
    assert len(by_module) == len(rows) == len({p.name for p in rows})
    engine = Path(registry.__file__).parent
    families = {
        f"cuda_kernels.gemm.{path.parent.name}.{path.stem}": path.parent.name
        for path in engine.glob("sm*/*.py")
        if "\nFAMILY = " in path.read_text()
    }
    assert {m: p.arch for m, p in by_module.items()} == families
    for p in rows:
        module = p.load()
        assert module is not None and hasattr(module, "FAMILY"), p.name
    assert registry.provider("sm90", "bf16", "varlen_m").name == "sm90_grouped_mm"
    assert registry.provider("sm90", "bf16").name == "sm90_bf16"
    assert registry.provider("sm100", "nvfp4").name == "sm100_blockscaled"
    assert registry.provider("sm90", "nvfp4") is None


def _fake_family(monkeypatch, name, **attrs):
    module = types.ModuleType(f"_fake_family_{name}")
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "_PROVIDERS", list(registry._PROVIDERS))
    return module


def _contract(arch="sm90", **kw):
    base = {"arch": arch, "hidden": 128, "intermediate": 128, "num_experts": 2, "a_major": "k",
            "b_major": "n", "out_dtype": "float32", "output_mode": "dense", "accumulate": False,
            "input_order": "tensor2d", "mma_tiler_mn": None, "cluster_shape_mn": None}
    return WgradContract(**{**base, **kw})


def test_registering_a_family_is_one_call(monkeypatch):
    """A family is its module (``FAMILY`` or the three protocol functions) plus one row; the
    registry answers unavailable / supports / launcher, first registered first."""
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    launched = []
    module = _fake_family(
        monkeypatch, "varlen_m",
        unavailable_reason=lambda: None,
        supports=lambda c: None if c.hidden % 128 == 0 else "hidden must be a multiple of 128",
        contract_launcher=lambda c: lambda *args, **kw: launched.append(c),
    )
    family = registry.register_family(
        registry.KernelProvider("fake_varlen_m", module.__name__, "sm_fake", ("bf16",),
                                problem="varlen_m")
    )
    assert registry.providers(arch="sm_fake", problem="varlen_m") == (family,)
    assert registry.provider("sm_fake", "bf16") is None  # a varlen-M row is no wgrad row
    found, why = registry.find_kernel(_contract("sm_fake"), problem="varlen_m")
    assert found is family and why == ""
    found, why = registry.find_kernel(_contract("sm_fake", hidden=96), problem="varlen_m")
    assert found is None and why == "fake_varlen_m: hidden must be a multiple of 128"
    family.launcher(_contract("sm_fake"))()
    assert launched == [_contract("sm_fake")]
    # the same name again replaces the row in place
    again = registry.register_family(
        registry.KernelProvider("fake_varlen_m", module.__name__, "sm_fake", ("bf16",),
                                problem="varlen_m")
    )
    assert registry.providers(arch="sm_fake", problem="varlen_m") == (again,)
    with pytest.raises(ValueError, match="problem must be one of"):
        registry.register_family(registry.KernelProvider("x", "m", "sm90", ("bf16",), "dgrad"))
    assert "no bf16 varlen_m kernel family is registered for sm_fake2" in registry.find_kernel(
        _contract(arch="sm_fake2"), problem="varlen_m")[1]


def test_a_family_module_with_only_FAMILY_uses_the_defaults(monkeypatch):
    """Without the optional functions: no gate, ``supports`` = the key's ValueError,
    ``launcher`` = ``FAMILY.launcher(FAMILY.key_from_contract(c))``."""

    class Family:
        def key_from_contract(self, c):
            if c.intermediate % 64:
                raise ValueError("no tile fits")
            return ("key", c.hidden)

        def launcher(self, key):
            return ("launcher of", key)

    module = _fake_family(monkeypatch, "defaults", FAMILY=Family())
    p = registry.KernelProvider("defaults", module.__name__, "sm90", ("bf16",))
    assert p.gate() is None
    assert p.supports(_contract()) is None
    assert p.supports(_contract(intermediate=96)) == "no tile fits"
    assert p.launcher(_contract()) == ("launcher of", ("key", 128))
    missing = registry.KernelProvider("missing", "_no_such_module_", "sm90", ("bf16",))
    assert "cannot be imported" in missing.unavailable()


def test_device_selection_asks_the_registry(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": 90)
    assert dispatch.select_grouped_wgrad_backend("cuda") == ("sm90", "")
    monkeypatch.setattr(registry, "_PROVIDERS", [p for p in registry._PROVIDERS
                                                 if p.name != "sm90_bf16"])
    name, reason = dispatch.select_grouped_wgrad_backend("cuda")
    assert name == "torch" and "cannot be imported" in reason
