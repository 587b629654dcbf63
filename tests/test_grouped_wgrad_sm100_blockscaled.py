"""Tests of the SM100 block-scaled (MXFP8 / NVFP4) grouped wgrad kernel (sm100_blockscaled.py).

The kernel has never run on a Blackwell GPU. CPU part (CI): key / tile validation, the contract ->
key conversion, offline compiles for ``sm_100a`` whose PTX must hold the block-scaled
``tcgen05.mma`` (kind::mxf8f6f4 .block_scale.block32 for MXFP8, kind::mxf4nvf4
.block_scale.block16 for NVFP4), ``tcgen05.cp`` of the scale factors into tensor memory, TMA
loads of A / B / scales and ptxas assembly without spills; the dispatch hook's decision (off by
default, on with ``MOE_BWD_ENABLE_UNVERIFIED_SM100=1`` for SM100 contracts it supports).

GPU part (``gpu`` + ``sm100``): the kernel against the twin at SQNR >= 60 dB; skipped without an
SM100 device AND the opt-in.
"""

import dataclasses
import importlib.util
import os
import re
import subprocess

import pytest
import torch
from _ptxas import ptxas_for as _ptxas_for

from cuda_kernels.grouped_wgrad import _env, dispatch, sm100_bf16
from cuda_kernels.grouped_wgrad import sm100_blockscaled as bs
from cuda_kernels.grouped_wgrad._types import BlockScaledSpec, WgradContract
from cuda_kernels.grouped_wgrad.sm100_blockscaled import Sm100BlockScaledKey, Sm100BsTileConfig

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(
    not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed: no offline sm_100a compile"
)
HAS_SM100 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10

MX = BlockScaledSpec("mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 128)
NV = BlockScaledSpec("nvfp4", "uint8", "float8_e4m3fn", 16, 64)
NV_TILE = Sm100BsTileConfig(128, 128, 64, 8)


def _contract(spec=MX, **kw):
    base = WgradContract(
        "sm100", 512, 384, 4, "k", "k", "float32", "dense", False, "tensor2d", (256, 256),
        None, block_scaled=spec,
    )
    return dataclasses.replace(base, **kw)


# ------------------------------------------------------------------------------------------------
# CPU: keys
# ------------------------------------------------------------------------------------------------


def test_tile_config_validation():
    Sm100BsTileConfig()
    for kwargs, word in [
        ({"tile_m": 256}, "tile_m"),
        ({"tile_n": 256}, "tile_n"),
        ({"tile_k": 32}, "tile_k"),
        ({"stages": 1}, "stages"),
        ({"stages": 9}, "stages"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm100BsTileConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"fmt": "mxfp4"}, "fmt"),
        ({"elem": "e2m1"}, "elem"),
        ({"fmt": "nvfp4", "elem": "e4m3", "tile": NV_TILE}, "elem"),
        ({"a_major": "m"}, "K-major"),
        ({"b_major": "n"}, "K-major"),
        ({"input_order": "tensor_ragged"}, "input_order"),
        ({"output_mode": "discrete"}, "dense"),
        ({"fmt": "nvfp4", "elem": "e2m1"}, "64 tokens"),  # the MXFP8 tile on NVFP4
        ({"tile": NV_TILE}, "128 tokens"),
        ({"hidden": 0}, "hidden"),
        ({"out_dtype": "int8"}, "out_dtype"),
    ],
)
def test_key_validation(kwargs, word):
    args = {"hidden": 512, "intermediate": 384, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=word):
        Sm100BlockScaledKey(**args)


def test_key_from_contract():
    key = bs.sm100_blockscaled_key_from_contract(_contract())
    assert (key.fmt, key.elem, key.tile.tile_k, key.sf_vec) == ("mxfp8", "e4m3", 128, 32)
    e5 = dataclasses.replace(MX, ab_dtype="float8_e5m2")
    assert bs.sm100_blockscaled_key_from_contract(_contract(e5)).elem == "e5m2"
    key = bs.sm100_blockscaled_key_from_contract(_contract(NV, out_dtype="bfloat16"))
    assert (key.fmt, key.elem, key.tile.tile_k, key.sf_vec) == ("nvfp4", "e2m1", 64, 16)
    # keys are hashable cache keys; format and element are part of them
    assert len({key, dataclasses.replace(key, accumulate=True)}) == 2


@pytest.mark.parametrize(
    ("contract", "word"),
    [
        (_contract(None), "not a block-scaled"),
        (_contract(arch="sm90"), "sm100"),
        (_contract(dataclasses.replace(MX, token_align=1)), "multiples of 128"),
        (_contract(dataclasses.replace(NV, token_align=2)), "multiples of 64"),
        (_contract(BlockScaledSpec("mxfp4", "uint8", "float8_e8m0fnu", 32, 128)), "mxfp4"),
        (_contract(dataclasses.replace(MX, sf_fp8_dtype_override="float8_e4m3fn")), "override"),
        (_contract(a_major="m"), "K-major"),
        (_contract(input_order="tensor_ragged"), "tensor2d"),
        (_contract(output_mode="discrete"), "dense"),
    ],
)
def test_supports_names_what_is_not_built(contract, word):
    why = bs.supports(contract)
    assert why is not None and word in why, why
    with pytest.raises(ValueError, match="sm100_blockscaled"):
        bs.sm100_blockscaled_key_from_contract(contract)


def test_compile_refuses_non_keys():
    with pytest.raises(ValueError, match="Sm100BlockScaledKey"):
        bs.compile_sm100_blockscaled_wgrad_offline((128, 128))


# ------------------------------------------------------------------------------------------------
# CPU: offline compile for sm_100a
# ------------------------------------------------------------------------------------------------


def _ops(ptx: str, prefix: str) -> set[str]:
    return set(re.findall(re.escape(prefix) + r"[\w.:]*", ptx))


_KEYS = [
    Sm100BlockScaledKey(512, 512, 4, out_dtype="float32"),
    Sm100BlockScaledKey(384, 320, 3, elem="e5m2", out_dtype="bfloat16", accumulate=True),
    Sm100BlockScaledKey(512, 384, 4, fmt="nvfp4", elem="e2m1", tile=NV_TILE),
    Sm100BlockScaledKey(
        256, 256, 8, fmt="nvfp4", elem="e2m1", out_dtype="float16", accumulate=True, tile=NV_TILE
    ),
]


_PTX: dict = {}


def _ptx_of(key):
    if key not in _PTX:
        _PTX[key] = bs.compile_sm100_blockscaled_wgrad_offline(key, arch="sm_100a")
    return _PTX[key]


@needs_cute
@pytest.mark.parametrize("key", _KEYS, ids=lambda k: f"{k.fmt}-{k.elem}-{k.out_dtype}")
def test_offline_compile_sm100a_blockscaled_mma(key):
    ptx = _ptx_of(key)
    assert ".target sm_100a" in ptx
    assert ".reqntid 192, 1, 1" in ptx  # the BF16 kernel's warp roles
    kind = "mxf8f6f4.block_scale.block32" if key.fmt == "mxfp8" else "mxf4nvf4.block_scale.block16"
    mma = _ops(ptx, "tcgen05.mma")
    assert mma == {f"tcgen05.mma.cta_group::1.kind::{kind}.collector::a::discard"}, mma
    # scale factors: shared memory -> tensor memory, 32 lanes x 128 bit broadcast to 4 warps
    assert _ops(ptx, "tcgen05.cp") == {"tcgen05.cp.cta_group::1.32x128b.warpx4"}
    assert _ops(ptx, "tcgen05.alloc") and _ops(ptx, "tcgen05.dealloc")
    assert _ops(ptx, "tcgen05.commit") and _ops(ptx, "tcgen05.ld.sync.aligned")
    # TMA loads of A / B (2d) and of the scale atoms (3d: rows, atom columns, L), on mbarriers
    loads = _ops(ptx, "cp.async.bulk.tensor")
    loads = {op for op in loads if ".shared::cta.global" in op}
    assert {op.split(".")[4] for op in loads} >= {"2d", "3d"}, loads
    assert all("mbarrier::complete_tx::bytes" in op for op in loads)
    # dense output through TMA: store, or reduce-add when accumulating
    if key.accumulate:
        assert _ops(ptx, "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add")
    else:
        assert _ops(ptx, "cp.async.bulk.tensor.3d.global.shared::cta")
    # the BF16 kernel's dynamic scheduler (a global atomic tile counter)
    assert _ops(ptx, "atom.global.add") == {"atom.global.add.u32"}
    # NVFP4: the epilogue reads the per-expert global-scale product (an fp32 load + multiply)
    if key.fmt == "nvfp4":
        assert "mul.f32" in ptx or "mul.rn.f32" in ptx


@needs_cute
@pytest.mark.parametrize("key", [_KEYS[0], _KEYS[2]], ids=lambda k: k.fmt)
def test_ptx_assembles_for_sm100a_without_spills(tmp_path, key):
    ptx = _ptx_of(key)
    ptxas = _ptxas_for(ptx, tmp_path)
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(ptx)
    res = subprocess.run(
        [ptxas, "-arch=sm_100a", "-v", str(ptx_file), "-o", str(tmp_path / "k.cubin")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr


@needs_cute
def test_bf16_kernel_untouched_by_the_subclass():
    """Building the block-scaled class must not alter the BF16 kernel class it subclasses."""
    base = sm100_bf16._kernel_class()
    sub = bs._kernel_class()
    assert issubclass(sub, base) and sub is not base
    for name in ("next_tile", "take_tile", "tile_coords", "expert_c"):
        assert getattr(sub, name) is getattr(base, name)
    for name in ("_setup", "__call__", "kernel"):
        assert getattr(sub, name) is not getattr(base, name)


# ------------------------------------------------------------------------------------------------
# CPU: the dispatch hook
# ------------------------------------------------------------------------------------------------


def test_hook_gated_like_the_bf16_sm100_kernel(monkeypatch):
    """SM100 contracts (the arch a faked SM100 device gives; no GPU here) reach the kernel only
    with MOE_BWD_ENABLE_UNVERIFIED_SM100=1, and only for what it builds."""
    monkeypatch.setattr(_env, "cutlass_dsl_missing", lambda: None)
    monkeypatch.delenv(sm100_bf16.ENABLE_ENV, raising=False)
    for spec in (MX, NV):
        assert dispatch._blockscaled_kernel(_contract(spec)) is None
        assert dispatch.select_blockscaled_backend(_contract(spec))[0] == "torch"
    monkeypatch.setenv(sm100_bf16.ENABLE_ENV, "0")
    assert dispatch._blockscaled_kernel(_contract()) is None
    monkeypatch.setenv(sm100_bf16.ENABLE_ENV, "1")
    for spec in (MX, NV):
        assert callable(dispatch._blockscaled_kernel(_contract(spec)))  # lazy: no compile here
        assert dispatch.select_blockscaled_backend(_contract(spec)) == ("sm100", "")
    # what the kernel does not build keeps the twin, even opted in
    for other in (
        _contract(dataclasses.replace(MX, token_align=1)),  # generic entry: any count
        _contract(output_mode="discrete"),
        _contract(a_major="m"),
        _contract(input_order="tensor_ragged"),
        _contract(BlockScaledSpec("mxfp4", "uint8", "float8_e8m0fnu", 32, 128)),
    ):
        assert dispatch._blockscaled_kernel(other) is None
    # without CuTe DSL: the twin
    monkeypatch.setattr(_env, "cutlass_dsl_missing", lambda: "no cutlass")
    assert dispatch._blockscaled_kernel(_contract()) is None


def test_launcher_refuses_without_opt_in(monkeypatch):
    monkeypatch.delenv(sm100_bf16.ENABLE_ENV, raising=False)
    key = _KEYS[0]
    x = torch.zeros(1)
    with pytest.raises(RuntimeError, match="MOE_BWD_ENABLE_UNVERIFIED_SM100"):
        bs.FAMILY._launch(key, None, x, x, x, x, x, x)


# ------------------------------------------------------------------------------------------------
# GPU (SM100 + opt-in): against the twin
# ------------------------------------------------------------------------------------------------


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(ref.pow(2).sum() / noise).item()


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.skipif(
    not (HAS_SM100 and HAS_CUTE and os.environ.get(sm100_bf16.ENABLE_ENV) == "1"),
    reason="needs an SM100 GPU, CuTe DSL and MOE_BWD_ENABLE_UNVERIFIED_SM100=1",
)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_kernel_matches_twin(fmt, accumulate):
    from test_blockscaled_ref import _random_operands

    from cuda_kernels.grouped_wgrad.blockscaled_ref import grouped_wgrad_blockscaled_torch

    align = 64 if fmt == "nvfp4" else 128
    counts = [4 * align, 0, align, 7 * align, 2 * align]
    m, n = 384, 320
    a, b, sfa, sfb, gsa, gsb, *_ = _random_operands(fmt, m, n, counts, seed=3)
    if fmt != "nvfp4":
        b = b.t().contiguous().t()  # K-major along tokens
    dev = torch.device("cuda")
    a, b, sfa, sfb = (t.to(dev) for t in (a, b, sfa, sfb))
    if gsa is not None:
        gsa, gsb = gsa.to(dev), gsb.to(dev)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    spec = NV if fmt == "nvfp4" else dataclasses.replace(
        MX, ab_dtype="float8_e5m2" if fmt == "e5m2" else "float8_e4m3fn"
    )
    contract = _contract(
        spec, hidden=m, intermediate=n, num_experts=len(counts), accumulate=accumulate
    )
    launcher = dispatch._blockscaled_kernel(contract)
    assert launcher is not None
    init = torch.randn(len(counts), m, n, device=dev)
    out = init.clone() if accumulate else torch.full_like(init, float("nan"))
    launcher(a, b, sfa, sfb, offsets, out, global_scale_a=gsa, global_scale_b=gsb)
    torch.cuda.synchronize()
    ref = init.clone() if accumulate else torch.empty_like(init)
    grouped_wgrad_blockscaled_torch(
        a, b, sfa, sfb, offsets, global_scale_a=gsa, global_scale_b=gsb, out=ref,
        accumulate=accumulate,
    )
    assert torch.isfinite(out).all()
    assert _sqnr_db(ref, out) >= 60.0
