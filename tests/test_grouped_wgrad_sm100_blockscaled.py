"""Tests of the SM100 block-scaled (MXFP8 / NVFP4) grouped wgrad kernel (sm100_blockscaled.py).

The kernel has never run on a Blackwell GPU. CPU part (CI): key / tile validation, the contract ->
key conversion, offline compiles for ``sm_100a`` whose PTX must hold the block-scaled
``tcgen05.mma`` (kind::mxf8f6f4 .block_scale.block32 for MXFP8, kind::mxf4nvf4
.block_scale.block16 for NVFP4, kind::mxf4nvf4 .block_scale.block32 for MXFP4), ``tcgen05.cp``
of the scale factors into tensor memory, TMA loads of A / B / scales, and for discrete outputs
the BF16 kernel's per-expert descriptors (tensormap.replace, tensormap proxy fences, flags) and
TMA stores through them; ptxas assembly without spills; the launcher's descriptor workspace and
counter; the registry's routing decision (off by default, on with
``MOE_BWD_ENABLE_UNVERIFIED_SM100=1`` for SM100 contracts it supports, discrete included).

GPU part (``gpu`` + ``sm100``): the kernel against the twin at SQNR >= 60 dB; skipped without an
SM100 device AND the opt-in.
"""

import dataclasses
import importlib.util
import os
import re

import pytest
import torch
from _ptxas import assemble_without_spills

from cuda_kernels.grouped_wgrad import api, blockscaled
from cuda_kernels.gemm import env
from cuda_kernels.gemm import launch
from cuda_kernels.gemm.sm100 import wgrad_bf16 as sm100_bf16
from cuda_kernels.gemm.sm100 import wgrad_blockscaled as bs
from cuda_kernels.grouped_wgrad._types import BlockScaledSpec, WgradContract
from cuda_kernels.gemm.sm100.wgrad_blockscaled import Sm100BlockScaledKey, Sm100BsTileConfig

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
needs_cute = pytest.mark.skipif(
    not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed: no offline sm_100a compile"
)
HAS_SM100 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10

MX = BlockScaledSpec("mxfp8", "float8_e4m3fn", "float8_e8m0fnu", 32, 128)
NV = BlockScaledSpec("nvfp4", "uint8", "float8_e4m3fn", 16, 64)
MX4 = BlockScaledSpec("mxfp4", "uint8", "float8_e8m0fnu", 32, 128)
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
        ({"fmt": "mxfp6"}, "fmt"),
        ({"fmt": "mxfp4"}, "elem"),  # e4m3: MXFP4 is E2M1 only
        ({"elem": "e2m1"}, "elem"),
        ({"fmt": "nvfp4", "elem": "e4m3", "tile": NV_TILE}, "elem"),
        ({"a_major": "m"}, "K-major"),
        ({"b_major": "n"}, "K-major"),
        ({"input_order": "tensor_ragged"}, "input_order"),
        ({"output_mode": "discrete", "intermediate": 320}, "discrete"),  # no partial tiles
        ({"fmt": "mxfp4", "elem": "e2m1", "tile": NV_TILE}, "128 tokens"),
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
    # MXFP4: E2M1 data (packed), E8M0 scales at sf_vec 32, 128-token stages as MXFP8
    key = bs.sm100_blockscaled_key_from_contract(_contract(MX4))
    assert (key.fmt, key.elem, key.tile.tile_k, key.sf_vec, key.packed_fp4) == (
        "mxfp4", "e2m1", 128, 32, True
    )
    assert not bs.sm100_blockscaled_key_from_contract(_contract()).packed_fp4
    # discrete outputs: one per-expert descriptor (the output's), one flag per expert
    for spec in (MX, NV, MX4):
        key = bs.sm100_blockscaled_key_from_contract(_contract(spec, output_mode="discrete"))
        assert key.output_mode == "discrete"
        assert sm100_bf16.descriptors_per_expert(key) == 1
        assert sm100_bf16.descriptor_workspace_bytes(key) == 4 * 128
        assert bs.FAMILY.workspace_bytes(key) == 4 * 128 and bs.FAMILY.counter_len(key) == 5
        # within cuDNN's documented workspace size for discrete outputs
        assert 4 * 128 <= api.get_grouped_gemm_wgrad_workspace_size_sm100(4, "discrete")
    dense = bs.sm100_blockscaled_key_from_contract(_contract())
    assert bs.FAMILY.workspace_bytes(dense) == 0 and bs.FAMILY.counter_len(dense) == 1


@pytest.mark.parametrize("spec", [MX, NV, MX4, dataclasses.replace(MX, ab_dtype="float8_e5m2")])
@pytest.mark.parametrize("mode", ["dense", "discrete"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_supports_discrete_and_mxfp4(spec, mode, accumulate):
    assert bs.supports(_contract(spec, output_mode=mode, accumulate=accumulate)) is None


@pytest.mark.parametrize(
    ("contract", "word"),
    [
        (_contract(None), "not a block-scaled"),
        (_contract(arch="sm90"), "sm100"),
        (_contract(dataclasses.replace(MX, token_align=1)), "multiples of 128"),
        (_contract(dataclasses.replace(NV, token_align=2)), "multiples of 64"),
        (_contract(dataclasses.replace(MX4, sf_vec_size=16)), "sf_vec 32"),
        (_contract(dataclasses.replace(MX4, token_align=2)), "multiples of 128"),
        (_contract(dataclasses.replace(MX4, ab_dtype="float8_e4m3fn")), "not built for mxfp4"),
        (_contract(dataclasses.replace(MX, ab_dtype="uint8")), "not built for mxfp8"),
        (_contract(dataclasses.replace(MX, sf_fp8_dtype_override="float8_e4m3fn")), "override"),
        (_contract(a_major="m"), "K-major"),
        (_contract(input_order="tensor_ragged"), "tensor2d"),
        (_contract(output_mode="discrete", hidden=384, intermediate=320), "partial tiles"),
        (_contract(output_mode="discrete", intermediate=320), "multiples of the 128x128"),
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
    Sm100BlockScaledKey(384, 320, 3, fmt="mxfp4", elem="e2m1", out_dtype="bfloat16"),
    # discrete outputs: per-expert descriptors in the descriptor workspace
    Sm100BlockScaledKey(512, 384, 4, out_dtype="bfloat16", output_mode="discrete"),
    Sm100BlockScaledKey(
        256, 512, 5, fmt="nvfp4", elem="e2m1", out_dtype="float32", accumulate=True,
        output_mode="discrete", tile=NV_TILE,
    ),
    Sm100BlockScaledKey(
        512, 256, 4, fmt="mxfp4", elem="e2m1", out_dtype="float16", accumulate=True,
        output_mode="discrete",
    ),
]

_KINDS = {
    "mxfp8": "mxf8f6f4.block_scale.block32",
    "nvfp4": "mxf4nvf4.block_scale.block16",
    # CuTe DSL's MmaMXF4Op (E2M1 x E2M1, UE8M0 scales, sf_vec 32) lowers to the mxf4nvf4 kind
    # with block32 (scale_vec::2X) scales, which the PTX ISA defines for UE8M0 scales, i.e. MXFP4
    "mxfp4": "mxf4nvf4.block_scale.block32",
}


_PTX: dict = {}


def _ptx_of(key):
    if key not in _PTX:
        _PTX[key] = bs.compile_sm100_blockscaled_wgrad_offline(key, arch="sm_100a")
    return _PTX[key]


@needs_cute
@pytest.mark.parametrize(
    "key", _KEYS, ids=lambda k: f"{k.fmt}-{k.elem}-{k.out_dtype}-{k.output_mode}-{k.accumulate}"
)
def test_offline_compile_sm100a_blockscaled_mma(key):
    ptx = _ptx_of(key)
    assert ".target sm_100a" in ptx
    assert ".reqntid 192, 1, 1" in ptx  # the BF16 kernel's warp roles
    kind = _KINDS[key.fmt]
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
    if key.output_mode == "dense":
        # dense output through TMA: store, or reduce-add when accumulating
        if key.accumulate:
            assert _ops(ptx, "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add")
        else:
            assert _ops(ptx, "cp.async.bulk.tensor.3d.global.shared::cta")
        assert not _ops(ptx, "tensormap.replace") and "fence.proxy.tensormap" not in ptx
        assert not _ops(ptx, "atom.global.acq_rel.cas")  # no descriptor flags
    else:
        _assert_discrete_through_descriptors(ptx, key.accumulate)
    # the BF16 kernel's dynamic scheduler (a global atomic tile counter)
    assert _ops(ptx, "atom.global.add") == {"atom.global.add.u32"}
    # NVFP4: the epilogue reads the per-expert global-scale product (an fp32 load + multiply)
    if key.fmt == "nvfp4":
        assert "mul.f32" in ptx or "mul.rn.f32" in ptx


def _assert_discrete_through_descriptors(ptx: str, accumulate: bool) -> None:
    """Discrete outputs: the BF16 kernel's per-expert descriptor build (template copied,
    tensormap.replace of address / dims / strides, release fence, the expert's flag claimed /
    published / awaited), and every output store (or reduce-add) is a 2D TMA through a
    workspace descriptor acquired for the tensormap proxy; no stacked (M, N, E) store, no
    register store or read-modify-write of the output."""
    assert re.search(r"st\.global\.v4\.b64\s+\[%rd\d+\+32\]", ptx)  # the template's 64 bytes
    assert re.search(r"st\.global\.b64\s+\[%rd\d+\+120\], 0;", ptx)  # the rest zeroed
    replaced = " ".join(_ops(ptx, "tensormap.replace"))
    for field in ("global_address", "global_dim", "global_stride"):
        assert f"tensormap.replace.tile.{field}.global.b1024" in replaced, replaced
    assert "fence.proxy.tensormap::generic.release.gpu" in ptx
    assert _ops(ptx, "atom.global.acq_rel.cas") and _ops(ptx, "atom.global.release.exch")
    assert _ops(ptx, "ld.acquire.gpu.global")
    acquired = set(re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.gpu \[(%rd\d+)\], 128;", ptx))
    assert acquired
    op = r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add" if accumulate else (
        r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta"
    )
    stores = re.findall(op + r"\S* \[(%rd\d+), ", ptx)
    assert stores, "no 2D TMA store of the output"
    # every store's descriptor is the acquired workspace slot (a register), not a parameter
    assert set(stores) <= acquired, (stores, acquired)
    assert not _ops(ptx, "cp.async.bulk.tensor.3d.global")
    assert not _ops(ptx, "cp.reduce.async.bulk.tensor.3d")
    if accumulate:
        assert not _ops(ptx, "cp.async.bulk.tensor.2d.global")
    else:
        assert not _ops(ptx, "cp.reduce.async.bulk.tensor")
    assert _ops(ptx, "st.global") == {"st.global.v4.b64", "st.global.b64"}, _ops(ptx, "st.global")
    assert not any(o.startswith("ld.global.v") for o in _ops(ptx, "ld.global"))


@needs_cute
@pytest.mark.parametrize(
    "key", [_KEYS[0], _KEYS[2], _KEYS[4], _KEYS[5], _KEYS[6], _KEYS[7]],
    ids=lambda k: f"{k.fmt}-{k.output_mode}",
)
def test_ptx_assembles_for_sm100a_without_spills(tmp_path, key):
    ptx = _ptx_of(key)
    assemble_without_spills(ptx, tmp_path, "sm_100a", timeout=120)


@needs_cute
def test_bf16_kernel_untouched_by_the_subclass():
    """Building the block-scaled class must not alter the BF16 kernel class it subclasses."""
    base = sm100_bf16.kernel_class()
    sub = bs.kernel_class()
    assert issubclass(sub, base) and sub is not base
    shared = (
        "next_tile", "take_tile", "tile_coords", "expert_c",
        # the per-expert descriptor mechanism (discrete outputs), reused as it is
        "desc_ptr", "init_descriptor", "build_descriptors", "ensure_descriptors",
        "wait_descriptors",
        # the kernel body: one copy of each part, the subclass adds through the hooks below
        "_setup", "make_ab_load_atoms", "make_store_atom", "make_shared_storage",
        "launch_kernel", "make_pipelines", "sort_experts", "allocate_ab", "allocate_c",
        "partition_ab", "partition_c", "tma_partition", "mma_fragments", "tma_warp",
        "tma_tile_views", "mma_warp", "epilogue_warps",
    )
    for name in shared:
        assert getattr(sub, name) is getattr(base, name)
    hooks = (
        "make_tiled_mma", "extra_stage_bytes", "setup_extra_layouts", "tmem_alloc_cols",
        "tma_tile_extra", "tma_stage_extra", "mma_extra_setup", "mma_stage_extra",
        "mma_kblock_extra", "epi_tile_scale", "epi_scale",
    )
    for name in ("__call__", "kernel", *hooks):
        assert getattr(sub, name) is not getattr(base, name)


# ------------------------------------------------------------------------------------------------
# CPU: the registry routes block-scaled contracts to the family
# ------------------------------------------------------------------------------------------------


def test_hook_gated_like_the_bf16_sm100_kernel(monkeypatch):
    """SM100 contracts (the arch a faked SM100 device gives; no GPU here) reach the kernel only
    with MOE_BWD_ENABLE_UNVERIFIED_SM100=1, and only for what it builds."""
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: None)
    monkeypatch.delenv(sm100_bf16.ENABLE_ENV, raising=False)
    for spec in (MX, NV):
        assert blockscaled.native_launcher(_contract(spec)) is None
        assert blockscaled.select_blockscaled_backend(_contract(spec))[0] == "torch"
    monkeypatch.setenv(sm100_bf16.ENABLE_ENV, "0")
    assert blockscaled.native_launcher(_contract()) is None
    for spec in (MX4, dataclasses.replace(MX, token_align=1)):
        assert blockscaled.native_launcher(_contract(spec, output_mode="discrete")) is None
    monkeypatch.setenv(sm100_bf16.ENABLE_ENV, "1")
    for spec in (MX, NV, MX4):
        for mode in ("dense", "discrete"):  # discrete: per-expert descriptors in the workspace
            for acc in (False, True):
                c = _contract(spec, output_mode=mode, accumulate=acc)
                assert callable(blockscaled.native_launcher(c))  # lazy: no compile here
                assert blockscaled.select_blockscaled_backend(c) == ("sm100", "")
    # what the kernel does not build keeps the twin, even opted in
    for other in (
        _contract(dataclasses.replace(MX, token_align=1)),  # generic entry: any count
        _contract(dataclasses.replace(MX4, token_align=2), output_mode="discrete"),
        _contract(output_mode="discrete", intermediate=320),  # discrete: no partial tiles
        _contract(a_major="m"),
        _contract(input_order="tensor_ragged"),
    ):
        assert blockscaled.native_launcher(other) is None
    # without CuTe DSL: the twin
    monkeypatch.setattr(env, "cutlass_dsl_missing", lambda: "no cutlass")
    assert blockscaled.native_launcher(_contract()) is None


def test_launcher_refuses_without_opt_in(monkeypatch):
    monkeypatch.delenv(sm100_bf16.ENABLE_ENV, raising=False)
    key = _KEYS[0]
    x = torch.zeros(1)
    with pytest.raises(RuntimeError, match="MOE_BWD_ENABLE_UNVERIFIED_SM100"):
        bs.FAMILY._launch(key, None, x, x, x, x, x, x)


class _FakeCompiled:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def fake_compile(monkeypatch):
    """The family's compile replaced by a recorder (CPU tensors, no GPU): what the launcher
    passes to the kernel."""
    fake = _FakeCompiled()
    bs.FAMILY.cache_clear()
    monkeypatch.setattr(bs.FAMILY, "_compile", lambda key, arch, dump_dir=None: fake)
    monkeypatch.setattr(launch, "num_sms", lambda index: 148)
    monkeypatch.setenv(sm100_bf16.ENABLE_ENV, "1")
    yield fake
    bs.FAMILY.cache_clear()


def _bs_operands(key, counts):
    """CPU stand-ins in the launcher's layouts (values unread by the fake kernel)."""
    pack = 2 if key.packed_fp4 else 1
    dt = torch.uint8 if key.packed_fp4 else torch.float8_e4m3fn
    sf_dt = torch.float8_e4m3fn if key.fmt == "nvfp4" else torch.float8_e8m0fnu
    s = sum(counts)
    m, n = key.hidden, key.intermediate
    a = torch.zeros(m, s // pack, dtype=torch.uint8).view(dt)
    b = torch.zeros(n, s // pack, dtype=torch.uint8).view(dt).t()
    cols = -(-s // key.sf_vec // 4) * 4
    sfa = torch.zeros(-(-m // 128) * 128, cols, dtype=torch.uint8).view(sf_dt)
    sfb = torch.zeros(-(-n // 128) * 128, cols, dtype=torch.uint8).view(sf_dt)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    return a, b, sfa, sfb, off


def test_launcher_discrete_uses_the_callers_descriptor_workspace(fake_compile):
    """Discrete outputs: the kernel gets the caller's pointers, the caller's workspace (an int64
    view of the E x 128 bytes of per-expert output descriptors, within cuDNN's size) and a
    zeroed counter with one descriptor flag per expert; a workspace it cannot use is refused
    before anything runs. Dense keys take no workspace and a 1-word counter."""
    key = Sm100BlockScaledKey(256, 128, 2, output_mode="discrete", accumulate=True)
    launcher = bs.compile_sm100_blockscaled_wgrad(key)
    a, b, sfa, sfb, off = _bs_operands(key, (256, 128))
    ptrs = torch.tensor([4096, 8192], dtype=torch.int64)
    ws = torch.zeros(api.get_grouped_gemm_wgrad_workspace_size_sm100(2, "discrete") + 64,
                     dtype=torch.uint8)
    launcher(a, b, sfa, sfb, off, ptrs, descriptor_workspace=ws)
    ((ka, kb, ksfa, ksfb, gs, koff, kout, counter, grid, fws),) = fake_compile.calls
    assert kout is ptrs and koff is off and ksfa is sfa and ksfb is sfb
    assert kb.shape == (128, 384) and kb.stride() == (384, 1)  # B as the (N, S) K-major view
    assert torch.equal(gs, torch.ones(2))  # MXFP8: no global scales
    assert counter.dtype == torch.int32 and counter.tolist() == [0, 0, 0]
    assert fws.data_ptr() == ws.data_ptr() and fws.dtype == torch.int64
    assert fws.numel() * 8 == sm100_bf16.descriptor_workspace_bytes(key) == 2 * 128
    assert grid == key.num_tiles == 4  # no more CTAs than tiles
    for buf, word in [
        (ws[1:], "64-byte aligned"),
        (ws[:255], "need 256"),
        (ws.view(torch.int64), "uint8"),
    ]:
        with pytest.raises(ValueError, match=word):
            launcher(a, b, sfa, sfb, off, ptrs, descriptor_workspace=buf)
    # no workspace: one of exactly the kernel's size is allocated for the launch
    launcher(a, b, sfa, sfb, off, ptrs)
    assert len(fake_compile.calls) == 2
    fws2 = fake_compile.calls[-1][-1]
    assert fws2.dtype == torch.int64 and fws2.numel() * 8 == 256
    # dense: no workspace argument, the 1-word tile counter
    dense = dataclasses.replace(key, output_mode="dense")
    out = torch.zeros(2, 256, 128)
    bs.compile_sm100_blockscaled_wgrad(dense)(a, b, sfa, sfb, off, out, descriptor_workspace=ws)
    args = fake_compile.calls[-1]
    assert len(args) == 9 and args[6] is out and args[7].tolist() == [0]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_launcher_no_tokens_discrete_runs_on_zero_stand_ins(fake_compile, fmt):
    """tokens_sum = 0, discrete overwrite: the kernel still runs (it writes the zeros through the
    pointers, no host read of them) on one stage of zero operands and one atom column of zero
    scales, so that every TMA descriptor is valid; accumulate launches nothing."""
    elem = "e4m3" if fmt == "mxfp8" else "e2m1"
    tile = NV_TILE if fmt == "nvfp4" else Sm100BsTileConfig()
    key = Sm100BlockScaledKey(
        256, 128, 2, fmt=fmt, elem=elem, output_mode="discrete", tile=tile
    )
    a, b, sfa, sfb, off = _bs_operands(key, (0, 0))
    ptrs = torch.tensor([4096, 8192], dtype=torch.int64)
    gs = torch.ones(2)
    kw = {"global_scale_a": gs, "global_scale_b": gs} if fmt == "nvfp4" else {}
    bs.compile_sm100_blockscaled_wgrad(key)(a, b, sfa, sfb, off, ptrs, **kw)
    ((ka, kb, ksfa, ksfb, *_rest),) = fake_compile.calls
    cols = key.tile.tile_k // (2 if key.packed_fp4 else 1)
    assert ka.shape == (256, cols) and kb.shape == (128, cols)  # (rows, stage) K-major
    assert ka.stride() == (cols, 1) and kb.stride() == (cols, 1)
    if key.packed_fp4:
        assert ka.dtype == kb.dtype == torch.float4_e2m1fn_x2
    assert ksfa.shape == (256, 4) and ksfb.shape == (128, 4) and ksfa.dtype == sfa.dtype
    assert not ka.view(torch.uint8).any() and not ksfa.view(torch.uint8).any()
    acc = dataclasses.replace(key, accumulate=True)
    bs.compile_sm100_blockscaled_wgrad(acc)(a, b, sfa, sfb, off, ptrs, **kw)
    assert len(fake_compile.calls) == 1


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
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("mode", ["dense", "discrete"])
def test_kernel_matches_twin(fmt, accumulate, mode):
    from test_blockscaled_ref import _random_operands

    from cuda_kernels.grouped_wgrad.blockscaled_ref import grouped_wgrad_blockscaled_torch

    align = 64 if fmt == "nvfp4" else 128
    counts = [4 * align, 0, align, 7 * align, 2 * align]
    m, n = (384, 320) if mode == "dense" else (384, 256)  # discrete: whole 128x128 tiles
    a, b, sfa, sfb, gsa, gsb, *_ = _random_operands(fmt, m, n, counts, seed=3)
    if fmt in ("e4m3", "e5m2"):
        b = b.t().contiguous().t()  # K-major along tokens
    dev = torch.device("cuda")
    a, b, sfa, sfb = (t.to(dev) for t in (a, b, sfa, sfb))
    if gsa is not None:
        gsa, gsb = gsa.to(dev), gsb.to(dev)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    spec = {"nvfp4": NV, "mxfp4": MX4}.get(fmt) or dataclasses.replace(
        MX, ab_dtype="float8_e5m2" if fmt == "e5m2" else "float8_e4m3fn"
    )
    contract = _contract(
        spec, hidden=m, intermediate=n, num_experts=len(counts), accumulate=accumulate,
        output_mode=mode,
    )
    launcher = blockscaled.native_launcher(contract)
    assert launcher is not None
    init = torch.randn(len(counts), m, n, device=dev)
    out = init.clone() if accumulate else torch.full_like(init, float("nan"))
    target, kw = out, {}
    if mode == "discrete":  # per-expert addresses, descriptors in the caller's workspace
        target = torch.tensor([o.data_ptr() for o in out], dtype=torch.int64, device=dev)
        kw["descriptor_workspace"] = torch.zeros(
            api.get_grouped_gemm_wgrad_workspace_size_sm100(len(counts), "discrete"),
            dtype=torch.uint8, device=dev,
        )
    launcher(a, b, sfa, sfb, offsets, target, global_scale_a=gsa, global_scale_b=gsb, **kw)
    torch.cuda.synchronize()
    ref = init.clone() if accumulate else torch.empty_like(init)
    grouped_wgrad_blockscaled_torch(
        a, b, sfa, sfb, offsets, global_scale_a=gsa, global_scale_b=gsb, out=ref,
        accumulate=accumulate,
    )
    assert torch.isfinite(out).all()
    assert _sqnr_db(ref, out) >= 60.0
