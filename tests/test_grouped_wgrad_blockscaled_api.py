"""Block-scaled (MXFP8 / MXFP4 / NVFP4) surface of the grouped wgrad API: the classes, the wrappers
and ``grouped_gemm_wgrad`` with FP8 / FP4 operands (seed, "Block-scaled contract").

On the CPU no native block-scaled kernel serves a call: every call runs the torch twin
(``blockscaled_ref.grouped_wgrad_blockscaled_torch``; ``blockscaled.native_launcher`` finds no
registered family for it), so results must equal the twin bit for bit and the float64 product of
the dequantized operands up to fp32 summation order; a fake family plugged into the registry
shows a native kernel taking over. CPU tests drive the
``_sm100`` / ``_sm90`` surfaces with the capability query faked; ``@pytest.mark.gpu`` variants run
the same on a CUDA device.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_blockscaled_ref import RTOL, _expected64, _random_operands

from common.mx_atoms import grouped_scale_cols_bound, pack_grouped_scales
from cuda_kernels.grouped_wgrad import api, blockscaled
from cuda_kernels.gemm import env
from cuda_kernels.gemm import registry
from cuda_kernels.grouped_wgrad._types import BlockScaledSpec
from cuda_kernels.grouped_wgrad.blockscaled_ref import grouped_wgrad_blockscaled_torch

FORMATS = ("e4m3", "e5m2", "mxfp4", "nvfp4")
#: Splits for the generic entry: uneven with empty experts, every expert empty, one expert.
SPLITS = {
    "uneven": [50, 0, 127, 1, 33, 96, 0],
    "all_empty": [0, 0, 0],
    "one": [77],
}
#: Splits that keep the _sm100 surface's rule (multiples of 128 MX / 64 NVFP4), an empty expert.
SM100_SPLITS = {"mx": [128, 0, 256, 128], "nvfp4": [64, 192, 0, 64]}
M, N = 40, 24
OUT_MODES = ("dense", "discrete_stacked", "discrete_ptrs")


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _counts_for(fmt, counts):
    return [c + c % 2 for c in counts] if fmt in ("mxfp4", "nvfp4") else list(counts)


def _sf_vec(fmt):
    return 16 if fmt == "nvfp4" else 32


def _poison_padding(sf, logical, rows):
    """``sf`` with every byte outside the experts' logical scales set to 255 (E8M0 NaN; E4M3
    0xFF is NaN too)."""
    real = pack_grouped_scales(
        [torch.ones_like(s.view(torch.uint8)) for s in logical], rows, sf.shape[1]
    )
    poisoned = torch.where(real.view(torch.uint8) == 1, sf.view(torch.uint8), 255)
    return poisoned.view(sf.dtype)


def _case(fmt, counts, seed=0, device="cpu", m=M, n=N):
    counts = _counts_for(fmt, counts)
    a, b, sfa, sfb, gsa, gsb, la, lb, sf_vec = _random_operands(fmt, m, n, counts, seed=seed)
    sfa, sfb = _poison_padding(sfa, la, m), _poison_padding(sfb, lb, n)
    offs = _offsets(counts)
    to = (lambda t: t.to(device) if t is not None else None)  # noqa: E731
    return dict(
        a=to(a), b=to(b), sfa=to(sfa), sfb=to(sfb), gsa=to(gsa), gsb=to(gsb), offs=to(offs),
        la=la, lb=lb, counts=counts, sf_vec=sf_vec,
    )


def _twin(c, out=None, accumulate=False):
    return grouped_wgrad_blockscaled_torch(
        c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], global_scale_a=c["gsa"],
        global_scale_b=c["gsb"], out=out, accumulate=accumulate,
    )


def _outputs(mode, e, dtype, device, accumulate, gen):
    """(kwargs for the call, stacked tensor to read back, initial values)."""
    shape = (e, M, N)
    init = (
        torch.randn(shape, generator=gen).to(dtype).to(device) if accumulate
        else torch.full(shape, float("nan"), dtype=dtype, device=device)  # poisoned
    )
    out = init.clone()
    if mode == "dense":
        return dict(output_mode="dense", wgrad_tensor=out), out, init
    if mode == "discrete_stacked":
        return dict(output_mode="discrete", wgrad_tensor=out), out, init
    ptrs = torch.tensor([out[i].data_ptr() for i in range(e)], dtype=torch.int64, device=device)
    # Pointer-only output: wgrad_dtype is the only description of the memory behind them.
    return dict(output_mode="discrete", wgrad_ptrs=ptrs, wgrad_dtype=dtype), out, init


@pytest.fixture(autouse=True)
def _clean_caches():
    api.clear_grouped_wgrad_caches()
    yield
    api.clear_grouped_wgrad_caches()


@pytest.fixture
def fake_cc(monkeypatch):
    """Pretend the CPU is a CUDA device of capability ``box[0]`` (no kernel is compiled)."""
    box = [100]
    monkeypatch.setattr(env, "query_arch", lambda device, arg="a_tensor": box[0])
    return box


# ------------------------------------------------------------------------------------------------
# grouped_gemm_wgrad: any token count, every format, output mode and accumulate
# ------------------------------------------------------------------------------------------------


def _assert_twin_or_kernel(backend, reason, out, want):
    """The twin's result bit for bit; a native kernel's (the SM90 MXFP8 kernel once enabled)
    up to fp32 summation order: SQNR of the difference >= 60 dB (issue 10)."""
    if backend == "torch":
        assert "no native block-scaled" in reason
        assert torch.equal(out, want)  # the twin, bit for bit
    else:
        from common.metrics import sqnr_db

        got, ref = out.double().cpu(), want.double().cpu()
        if bool(ref.abs().max() == 0):
            assert bool((got == 0).all()), backend
        else:
            assert sqnr_db(got, ref) >= 60, (backend, sqnr_db(got, ref))


def _check_generic(fmt, split, mode, accumulate, out_dtype, device):
    c = _case(fmt, SPLITS[split], device=device)
    e = len(c["counts"])
    gen = torch.Generator().manual_seed(5)
    kw, out, init = _outputs(mode, e, out_dtype, device, accumulate, gen)
    stats = {}
    res = api.grouped_gemm_wgrad(
        c["a"], c["b"], c["offs"], sfa_tensor=c["sfa"], sfb_tensor=c["sfb"],
        global_scale_a=c["gsa"], global_scale_b=c["gsb"], accumulate_on_output=accumulate,
        stats=stats, **kw,
    )
    if "wgrad_ptrs" in kw:
        assert res["wgrad_tensor"] is None
    else:
        assert res["wgrad_tensor"] is out
    want = _twin(c, out=init.clone(), accumulate=accumulate)
    _assert_twin_or_kernel(stats["backend"], stats["reason"], out, want)
    assert not bool(out.isnan().any())  # poisoned outputs and scale padding never leak
    for i, k in enumerate(c["counts"]):
        if k == 0:
            assert torch.equal(out[i], init[i] if accumulate else torch.zeros_like(out[i]))
    if out_dtype == torch.float32:
        ref, mag = _expected64(fmt, c["a"].cpu(), c["b"].cpu(), c["la"], c["lb"],
                               None if c["gsa"] is None else c["gsa"].cpu(),
                               None if c["gsb"] is None else c["gsb"].cpu(), c["counts"],
                               c["sf_vec"])
        if accumulate:
            ref = ref + init.cpu().double()
            mag = mag + init.cpu().double().abs()
        err = (out.cpu().double() - ref).abs()
        assert bool((err <= RTOL * mag + 1e-30).all())


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mode", OUT_MODES)
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_generic_any_count_grid(fmt, split, mode, accumulate):
    _check_generic(fmt, split, mode, accumulate, torch.float32, "cpu")


@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4"])
def test_generic_bf16_output(fmt):
    _check_generic(fmt, "uneven", "dense", False, torch.bfloat16, "cpu")


def test_generic_allocates_and_backend_torch_reason():
    c = _case("e4m3", SPLITS["uneven"] + [13], m=128, n=128)
    (w,) = api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], sfa_tensor=c["sfa"],
                                  sfb_tensor=c["sfb"], wgrad_dtype=torch.float32)
    assert torch.equal(w, _twin(c))
    reason = api.kernel_unsupported_reason("sm90", c["a"], c["b"], c["offs"],
                                           sfa_tensor=c["sfa"], sfb_tensor=c["sfb"])
    assert "no native block-scaled MXFP8 kernel" in reason and "twin" in reason


def test_generic_tensor_ragged_k_major():
    """K-major ragged order: expert e's [M, k_e] block contiguous at element M * begin."""
    c = _case("e4m3", SPLITS["uneven"])
    ends = [0, *c["offs"].tolist()]
    a_rag = torch.cat([c["a"][:, s:t].contiguous().reshape(-1) for s, t in zip(ends, ends[1:])])
    b_rag = torch.cat([c["b"][s:t].t().contiguous().reshape(-1) for s, t in zip(ends, ends[1:])])
    s_tot = ends[-1]
    a_r = a_rag.as_strided((M, s_tot), (s_tot, 1))
    b_r = b_rag.as_strided((s_tot, N), (1, s_tot))
    (w,) = api.grouped_gemm_wgrad(a_r, b_r, c["offs"], sfa_tensor=c["sfa"], sfb_tensor=c["sfb"],
                                  input_order="tensor_ragged", wgrad_dtype=torch.float32)
    assert torch.equal(w, _twin(c))


# ------------------------------------------------------------------------------------------------
# the _sm100 / _sm90 surfaces (capability faked): the seed's token rules, class lifecycle, hook
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", OUT_MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_sm100_wrapper_equals_twin(fmt, mode, fake_cc):
    fake_cc[0] = 100
    c = _case(fmt, SM100_SPLITS["nvfp4" if fmt == "nvfp4" else "mx"], m=128, n=128)
    e = len(c["counts"])
    out = torch.full((e, 128, 128), float("nan"), dtype=torch.float32)
    kw = {"wgrad_tensor": out}
    if mode == "discrete_ptrs":
        kw = {"wgrad_ptrs": torch.tensor([out[i].data_ptr() for i in range(e)]),
              "wgrad_dtype": torch.float32}
    ws = torch.zeros(api.get_grouped_gemm_wgrad_workspace_size_sm100(
        e, "dense" if mode == "dense" else "discrete"), dtype=torch.uint8)
    api.grouped_gemm_wgrad_wrapper_sm100(
        c["a"], c["b"], c["sfa"], c["sfb"], c["offs"],
        output_mode="dense" if mode == "dense" else "discrete", global_scale_a=c["gsa"],
        global_scale_b=c["gsb"], sf_vec_size=c["sf_vec"], descriptor_workspace=ws, **kw,
    )
    assert torch.equal(out, _twin(c))
    assert bool((ws == 0).all())  # the twin builds no descriptors


@pytest.mark.parametrize("fmt,counts,align", [
    ("e4m3", [128, 64, 64], 128), ("mxfp4", [96, 32], 128), ("nvfp4", [64, 32, 32], 64),
])
def test_sm100_keeps_the_seed_token_rule(fmt, counts, align, fake_cc):
    fake_cc[0] = 100
    c = _case(fmt, counts, m=128, n=128)
    out = torch.full((len(counts), 128, 128), 7.0)
    with pytest.raises(ValueError, match=f"offsets_tensor.*multiple of {align}.*SM100"):
        api.grouped_gemm_wgrad_wrapper_sm100(
            c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], wgrad_tensor=out,
            global_scale_a=c["gsa"], global_scale_b=c["gsb"], sf_vec_size=c["sf_vec"])
    assert bool((out == 7).all())
    # The same call through the generic entry: any count (MXFP8) / even count (FP4).
    api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], sfa_tensor=c["sfa"], sfb_tensor=c["sfb"],
                           global_scale_a=c["gsa"], global_scale_b=c["gsb"], wgrad_tensor=out)
    assert torch.equal(out, _twin(c))


def test_sm90_wrapper_any_count(fake_cc):
    fake_cc[0] = 90
    c = _case("e4m3", SPLITS["uneven"] + [13], m=128, n=128)  # tokens_sum % 16 == 0 (TMA)
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(
        c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], sf_vec_size=32,
        wgrad_dtype=torch.float32, accumulate_on_output=True)
    assert torch.equal(w, _twin(c))  # allocated with zeros when accumulating


@pytest.mark.parametrize("arch", ["sm100", "sm90"])
def test_class_lifecycle_new_split_no_recompile(arch, fake_cc):
    fake_cc[0] = 100 if arch == "sm100" else 90
    cls = api.GroupedGemmWgradSm100 if arch == "sm100" else api.GroupedGemmWgradSm90
    c = _case("e4m3", [128, 256, 0, 128], m=128, n=128)
    out = torch.full((4, 128, 128), float("nan"))
    op = cls(c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], sample_wgrad=out,
             sf_vec_size=32, accumulate_on_output=False)
    assert op.check_support()
    op.compile()
    assert op.backend == "torch" and "twin" in op.backend_reason
    assert op.contract.block_scaled == BlockScaledSpec(
        "mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 128 if arch == "sm100" else 1)
    compiled = op._compiled
    for seed, counts in ((1, [0, 128, 384, 0]), (2, [128, 128, 128, 128])):
        c2 = _case("e4m3", counts, seed=seed, m=128, n=128)
        op.execute(c2["a"], c2["b"], c2["sfa"], c2["sfb"], c2["offs"], wgrad_tensor=out)
        assert torch.equal(out, _twin(c2))
    assert op._compiled is compiled  # compiled once: new splits reuse it
    bf = torch.zeros(128, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compiled for block-scaled mxfp8"):
        op.execute(bf, bf.t(), None, None, c["offs"], wgrad_tensor=out)
    c5 = _case("e5m2", [128, 256, 0, 128], m=128, n=128)
    with pytest.raises(ValueError, match="differs from the compiled contract"):
        op.execute(c5["a"], c5["b"], c5["sfa"], c5["sfb"], c5["offs"], wgrad_tensor=out)


def test_class_discrete_nvfp4(fake_cc):
    c = _case("nvfp4", SM100_SPLITS["nvfp4"], m=128, n=128)
    e = len(c["counts"])
    outs = [torch.full((128, 128), float("nan"), dtype=torch.bfloat16) for _ in range(e)]
    op = api.GroupedGemmWgradSm100(
        c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], num_experts=e, wgrad_shape=(128, 128),
        wgrad_dtype=torch.bfloat16, sample_global_scale_a=c["gsa"],
        sample_global_scale_b=c["gsb"])
    op.compile()
    ptrs = torch.tensor([o.data_ptr() for o in outs])
    op.execute(c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], wgrad_ptrs=ptrs,
               global_scale_a=c["gsa"], global_scale_b=c["gsb"])
    want = _twin(c, out=torch.empty(e, 128, 128, dtype=torch.bfloat16))
    assert torch.equal(torch.stack(outs), want)


def _plug_family(monkeypatch, name, arch, formats, supports, contract_launcher):
    """Register a fake kernel family (a module with the protocol's ``supports`` and
    ``contract_launcher``) after the package's own, for this test only."""
    module = types.ModuleType(f"_fake_family_{name}")
    module.supports, module.contract_launcher = supports, contract_launcher
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "_PROVIDERS", list(registry._PROVIDERS))
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    return registry.register_family(registry.KernelProvider(name, module.__name__, arch, formats))


def test_registered_family_plugs_a_native_kernel(monkeypatch, fake_cc):
    """A family plugged into the registry runs instead of the twin (the SM100 block-scaled
    family before it is gated off without its opt-in), with the contract's block-scaled spec,
    the scales and the caller's descriptor workspace."""
    monkeypatch.delenv("MOE_BWD_ENABLE_UNVERIFIED_SM100", raising=False)
    calls = []

    def contract_launcher(contract):
        def launcher(a, b, sfa, sfb, offsets, out, *, global_scale_a, global_scale_b,
                     descriptor_workspace, stream):
            calls.append((contract, descriptor_workspace))
            out.fill_(1.0)

        return launcher

    _plug_family(monkeypatch, "fake_mxfp8", "sm100", ("mxfp8",), lambda contract: None,
                 contract_launcher)
    c = _case("e4m3", SM100_SPLITS["mx"], m=128, n=128)
    ws = torch.zeros(api.get_grouped_gemm_wgrad_workspace_size_sm100(4), dtype=torch.uint8)
    (w,) = api.grouped_gemm_wgrad_wrapper_sm100(c["a"], c["b"], c["sfa"], c["sfb"], c["offs"],
                                                sf_vec_size=32, descriptor_workspace=ws)
    assert bool((w == 1).all()) and calls[0][1] is ws
    assert calls[0][0].block_scaled.token_align == 128
    assert api.kernel_unsupported_reason("sm100", c["a"], c["b"], c["offs"], sfa_tensor=c["sfa"],
                                         sfb_tensor=c["sfb"]) is None


def test_sf_fp8_dtype_override_in_cache_key():
    spec = BlockScaledSpec("mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 1)
    assert spec != BlockScaledSpec("mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 1, "e8m0")
    with pytest.raises(ValueError, match="sf_fp8_dtype_override must be None.*Rubin"):
        blockscaled.check_sf_fp8_dtype_override("float8_e8m0fnu")


# ------------------------------------------------------------------------------------------------
# validation: every rule a ValueError naming the argument, before any write
# ------------------------------------------------------------------------------------------------


def _bad_cases():
    """(name, entry, mutate(kwargs), regex) — entry "sm100" (wrapper, faked SM100) or "generic"."""
    e8 = torch.float8_e8m0fnu

    def set_(**kw):
        return lambda k: {**k, **kw}

    yield "no sfa", "both", set_(sfa_tensor=None), "sfa_tensor is required"
    yield "sfb not tensor", "both", set_(sfb_tensor=3), "sfb_tensor must be a torch.Tensor"
    yield "sf dtype", "both", lambda k: {**k, "sfa_tensor": k["sfa_tensor"].view(torch.uint8)}, \
        "sfa_tensor dtype must be"
    yield "sf dtype mix", "both", lambda k: {
        **k, "sfb_tensor": k["sfb_tensor"].view(torch.float8_e4m3fn)}, "one dtype"
    yield "fp8 at 16", "both", set_(sf_vec_size=16), "not a supported block-scaled format"
    yield "mixed fp8", "both", lambda k: {
        **k, "b_tensor": k["b_tensor"].view(torch.float8_e5m2)}, "one dtype for A and B"
    yield "override", "both", set_(sf_fp8_dtype_override="float8_e8m0fnu"), \
        "sf_fp8_dtype_override must be None"
    yield "global on mx", "both", set_(global_scale_a=torch.ones(4)), \
        "global_scale_a must be None for MXFP8"
    yield "sfa rows", "both", lambda k: {
        **k, "sfa_tensor": torch.zeros(64, k["sfa_tensor"].shape[1], dtype=e8)}, \
        r"sfa_tensor must be rank-2 \[round_up\(hidden, 128\)"
    yield "sfb cols", "both", lambda k: {**k, "sfb_tensor": torch.zeros(128, 3, dtype=e8)}, \
        "sfb_tensor needs a multiple of 4 columns"
    yield "sfa noncontig", "both", lambda k: {
        **k, "sfa_tensor": torch.zeros(k["sfa_tensor"].shape[1], 128, dtype=e8).t()}, \
        "sfa_tensor must be contiguous"
    yield "offsets last", "both", lambda k: {
        **k, "offsets_tensor": torch.tensor([128, 128, 384, 384], dtype=torch.int32)}, \
        "last offset 384 must equal tokens_sum"
    yield "offsets decreasing", "both", lambda k: {
        **k, "offsets_tensor": torch.tensor([128, 0, 384, 512], dtype=torch.int32)}, \
        "non-decreasing"
    yield "workspace small", "both", set_(descriptor_workspace=torch.zeros(8, dtype=torch.uint8)), \
        "descriptor_workspace requires at least"
    yield "out shape", "both", set_(wgrad_tensor=torch.zeros(4, 128, 64)), "wgrad_tensor must"
    yield "ptrs dtype", "both", set_(output_mode="discrete", wgrad_ptrs=torch.zeros(4)), \
        "wgrad_ptrs must be torch.int64"
    yield "ptrs dense", "both", set_(wgrad_ptrs=torch.zeros(4, dtype=torch.int64)), \
        "wgrad_ptrs must be None in dense"
    yield "acc dtype", "sm100", set_(acc_dtype=torch.float16), "acc_dtype must be torch.float32"
    yield "sm100 count", "sm100", lambda k: {
        **k, "offsets_tensor": torch.tensor([100, 128, 384, 512], dtype=torch.int32)}, \
        "expert 0 holds 100 tokens.*multiple of 128"
    yield "a strides", "sm100", lambda k: {
        **k, "a_tensor": torch.zeros(128, 1024, dtype=torch.float8_e4m3fn)[:, ::2]}, \
        "a_tensor.*K-major"


def _valid_kwargs():
    c = _case("e4m3", SM100_SPLITS["mx"], m=128, n=128)
    return dict(a_tensor=c["a"], b_tensor=c["b"], sfa_tensor=c["sfa"], sfb_tensor=c["sfb"],
                offsets_tensor=c["offs"], sf_vec_size=32,
                wgrad_tensor=torch.full((4, 128, 128), 3.0))


@pytest.mark.parametrize("name,entry,mutate,regex", list(_bad_cases()),
                         ids=[c[0] for c in _bad_cases()])
def test_rejects_before_any_write(name, entry, mutate, regex, fake_cc):
    fake_cc[0] = 100
    for which in (("sm100", "generic") if entry == "both" else (entry,)):
        kw = mutate(_valid_kwargs())
        out = kw.get("wgrad_tensor")
        if which == "sm100":
            call = api.grouped_gemm_wgrad_wrapper_sm100
        else:
            if "acc_dtype" in kw:
                continue
            kw = {**kw}
            a, b, offs = kw.pop("a_tensor"), kw.pop("b_tensor"), kw.pop("offsets_tensor")
            kw = {"a": a, "b": b, "offs": offs, **kw}

            def call(a, b, offs, **rest):
                return api.grouped_gemm_wgrad(a, b, offs, **rest)

        with pytest.raises(ValueError, match=regex):
            call(**kw)
        if out is not None and out.shape == (4, 128, 128):
            assert bool((out == 3).all()), f"{which}: output written before the error"


def test_scale_columns_too_few_for_the_split():
    """Any-count splits need each expert's own atom columns: more than ceil(S / 32) rounded."""
    counts = [33, 33, 33, 33]  # S = 132: 8 columns overall, 4 experts x 4 = 16 needed
    c = _case("e4m3", counts)
    short = torch.zeros(128, 8, dtype=torch.float8_e8m0fnu)
    out = torch.full((4, M, N), 3.0)
    with pytest.raises(ValueError, match="sfa_tensor has 8 scale columns; .* needs 16"):
        api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], sfa_tensor=short, sfb_tensor=c["sfb"],
                               wgrad_tensor=out)
    assert bool((out == 3).all())
    assert grouped_scale_cols_bound(132, 4, 32) >= 16


def test_nvfp4_rules():
    c = _case("nvfp4", [32, 14, 0])
    out = torch.full((3, M, N), 3.0)
    base = dict(sfa_tensor=c["sfa"], sfb_tensor=c["sfb"], wgrad_tensor=out)
    with pytest.raises(ValueError, match="global_scale_a is required for NVFP4"):
        api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], **base)
    with pytest.raises(ValueError, match=r"global_scale_b must be a contiguous torch.float32"):
        api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], global_scale_a=c["gsa"],
                               global_scale_b=c["gsb"][:2], **base)
    with pytest.raises(ValueError, match="multiple of 2 for NVFP4"):
        api.grouped_gemm_wgrad(c["a"], c["b"], torch.tensor([31, 46, 46], dtype=torch.int32),
                               global_scale_a=c["gsa"], global_scale_b=c["gsb"], **base)
    with pytest.raises(ValueError, match="not a supported block-scaled format"):
        api.grouped_gemm_wgrad(c["a"], c["b"], c["offs"], global_scale_a=c["gsa"],
                               global_scale_b=c["gsb"], sf_vec_size=32, **base)
    assert bool((out == 3).all())


def test_fp4_must_be_k_major_on_the_kernel_surface(fake_cc):
    c = _case("nvfp4", SM100_SPLITS["nvfp4"], m=128, n=128)
    b_n = c["b"].contiguous()  # [S/2, N] N-major bytes
    with pytest.raises(ValueError, match="b_tensor: packed FP4 operands must be K-major"):
        api.grouped_gemm_wgrad_wrapper_sm100(c["a"], b_n, c["sfa"], c["sfb"], c["offs"],
                                             global_scale_a=c["gsa"], global_scale_b=c["gsb"])


def test_bf16_still_rejects_scale_controls():
    a = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sfa_tensor must be None"):
        api.grouped_gemm_wgrad(a, a.t(), torch.tensor([64], dtype=torch.int32),
                               sfa_tensor=torch.zeros(128, 4, dtype=torch.float8_e8m0fnu))


# ------------------------------------------------------------------------------------------------
# CUDA (the lead's H200 run): the same grid on the device
# ------------------------------------------------------------------------------------------------


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mode", OUT_MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_generic_grid(fmt, mode, accumulate):
    _need_cuda()
    for split in SPLITS:
        _check_generic(fmt, split, mode, accumulate, torch.float32, "cuda")


@pytest.mark.gpu
def test_gpu_sm90_class_on_hopper():
    _need_cuda()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an SM 9.x GPU")
    c = _case("e4m3", SPLITS["uneven"] + [13], device="cuda", m=128, n=128)
    out = torch.full((len(c["counts"]), 128, 128), float("nan"), device="cuda")
    op = api.GroupedGemmWgradSm90(c["a"], c["b"], c["sfa"], c["sfb"], c["offs"],
                                  sample_wgrad=out, sf_vec_size=32)
    op.compile()
    stream = torch.cuda.Stream()
    op.execute(c["a"], c["b"], c["sfa"], c["sfb"], c["offs"], wgrad_tensor=out,
               current_stream=stream)
    stream.synchronize()
    _assert_twin_or_kernel(op.backend, op.backend_reason, out, _twin(c))


def test_hook_routes_sm90_mxfp8_only_when_enabled(monkeypatch):
    """The registry picks the SM90 MXFP8 kernel for MXFP8, K-major, tensor2d contracts on SM90
    once the kernel is enabled (verified, or the opt-in variable); never for FP4 or SM100."""
    from cuda_kernels.gemm.sm90 import wgrad_mxfp8 as sm90_mxfp8
    from cuda_kernels.grouped_wgrad._types import WgradContract

    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    mx = BlockScaledSpec("mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 1)
    nv = BlockScaledSpec("nvfp4", "uint8", "float8_e4m3fn", 16, 2)

    def contract(arch="sm90", spec=mx, a="k", b="k", order="tensor2d"):
        return WgradContract(arch, 256, 256, 4, a, b, "float32", "dense", False, order, None,
                             None, block_scaled=spec)

    monkeypatch.setattr(sm90_mxfp8, "VERIFIED_ON_GPU", False)
    monkeypatch.delenv(sm90_mxfp8.ENABLE_ENV, raising=False)
    assert blockscaled.native_launcher(contract()) is None
    assert blockscaled.select_blockscaled_backend(contract())[0] == "torch"
    monkeypatch.setenv(sm90_mxfp8.ENABLE_ENV, "1")
    assert callable(blockscaled.native_launcher(contract()))
    assert blockscaled.select_blockscaled_backend(contract()) == ("sm90", "")
    for other in (contract(spec=nv), contract(arch="sm100"), contract(a="m"),
                  contract(order="tensor_ragged")):
        assert blockscaled.native_launcher(other) is None


def test_pitched_k_major_rows_as_the_quantizer_writes_them(fake_cc, monkeypatch):
    # quantize_wgrad_operand pads rows to 32 tokens (16-byte TMA strides): tokens_sum = 500 gives
    # data views with row stride 512; the generic entry and the _sm90 wrapper take them as they
    # are (results equal the compact operands'); a pitch that is not 16-byte aligned and the
    # SM100 surface (compact kernels) refuse them before any write
    from cuda_kernels.gemm.sm90 import wgrad_mxfp8 as sm90_mxfp8

    monkeypatch.setattr(sm90_mxfp8, "enabled", lambda: False)  # CPU tensors: the twin, always
    fake_cc[0] = 90
    c = _case("e4m3", [37, 0, 300, 163], m=128, n=128)
    s = sum(c["counts"])
    assert s == 500

    def pitched(t_rs, pitch):
        buf = torch.full((t_rs.shape[0], pitch), 0x7F, dtype=torch.uint8)  # NaN bytes beyond S
        buf[:, :s] = t_rs.view(torch.uint8)
        return buf.view(t_rs.dtype)[:, :s]

    a_p, b_p = pitched(c["a"], 512), pitched(c["b"].t(), 512).t()
    assert a_p.stride() == (512, 1) and b_p.stride() == (1, 512)
    want = _twin(c)
    (w,) = api.grouped_gemm_wgrad(a_p, b_p, c["offs"], sfa_tensor=c["sfa"], sfb_tensor=c["sfb"],
                                  wgrad_dtype=torch.float32)
    assert torch.equal(w, want)
    (w,) = api.grouped_gemm_wgrad_wrapper_sm90(
        a_p, b_p, c["sfa"], c["sfb"], c["offs"], sf_vec_size=32, wgrad_dtype=torch.float32)
    assert torch.equal(w, want)
    with pytest.raises(ValueError, match="row stride % 16"):
        api.grouped_gemm_wgrad_wrapper_sm90(pitched(c["a"], 504), b_p, c["sfa"], c["sfb"],
                                            c["offs"], sf_vec_size=32)
    fake_cc[0] = 100
    with pytest.raises(ValueError, match="K-major with strides"):
        api.grouped_gemm_wgrad_wrapper_sm100(a_p, b_p, c["sfa"], c["sfb"], c["offs"],
                                             sf_vec_size=32)
