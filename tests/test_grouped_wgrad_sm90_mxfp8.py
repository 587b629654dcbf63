"""Tests of the SM90 MXFP8 grouped wgrad kernel (grouped_wgrad/sm90_mxfp8.py).

CPU part (CI): tile / key validation, the python entry's argument checks, the padded token
layout's repack (on the CPU), and an offline compile for ``sm_90a`` whose PTX must hold FP8 wgmma
(``m64nNk32 ... e4m3`` / ``e5m2``), TMA bulk-tensor loads and the producer / consumer register split
(skipped without nvidia-cutlass-dsl).

GPU part (``gpu`` + ``sm90`` markers, skipped without an SM90 device): results against the twin
``grouped_wgrad_blockscaled_torch`` over a grid of (E, M, N, uneven splits with empty experts and
counts that are not multiples of 32, E4M3 / E5M2, fp32 / bf16 outputs, dense / discrete,
accumulate, direct / padded token layouts), outputs poisoned with NaN and every padding scale
byte poisoned with 255 (NaN) before the call; the SQNR of the difference is printed for every case
(run with ``-s``) and must be >= 60 dB; a NaN group in the next expert must not leak into the
previous expert's partial last group. Command::

    python -m pytest -q -s -m gpu tests/test_grouped_wgrad_sm90_mxfp8.py
"""

import importlib.util
import math
import os
import re

import pytest
import torch

from common.mx_atoms import ATOM_ROWS, grouped_scale_cols, round_up, to_atoms
from cuda_kernels.grouped_wgrad import sm90_mxfp8 as mx
from cuda_kernels.grouped_wgrad.sm90_mxfp8 import (
    Sm90MxTileConfig,
    Sm90MxWgradKey,
    grouped_wgrad_mxfp8_sm90,
    pad_tokens_to_scale_layout,
    select_sm90_mx_tile_config,
)

HAS_CUTE = importlib.util.find_spec("cutlass") is not None
HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# The kernel is gated until its GPU tests pass on an H200 (sm90_mxfp8.enabled()): on 2026-12-01
# one padded case passed (78 dB) and the direct layout hit an illegal instruction, which poisons
# the process; its GPU tests run only where the kernel is enabled.
_ENABLED = mx.enabled()
needs_cute = pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl (CuTe DSL) not installed")
gpu_sm90 = [
    pytest.mark.gpu,
    pytest.mark.sm90,
    pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE and _ENABLED), reason="needs an SM90 device, "
                       "CuTe DSL and MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1"),
]


# ------------------------------------------------------------------------------------------------
# CPU: tiles, keys, entry validation, repack, offline compile
# ------------------------------------------------------------------------------------------------


def test_tile_config_and_selection():
    assert select_sm90_mx_tile_config(256, 256) == Sm90MxTileConfig(128, 128, 128, 6)
    assert select_sm90_mx_tile_config(192, 64).tile_m == 64
    assert select_sm90_mx_tile_config(192, 64).tile_n == 64
    assert Sm90MxTileConfig().stage_bytes == 128 * 256 + 2 * 512
    with pytest.raises(ValueError, match="multiples of 64"):
        select_sm90_mx_tile_config(100, 128)
    with pytest.raises(ValueError, match="tile_n"):
        Sm90MxTileConfig(tile_n=256)
    with pytest.raises(ValueError, match="tile_k"):
        Sm90MxTileConfig(tile_k=64)
    with pytest.raises(ValueError, match="tile_m"):
        Sm90MxTileConfig(tile_m=96)
    with pytest.raises(ValueError, match="overflow"):
        Sm90MxTileConfig(stages=8)


def test_key_validation():
    key = Sm90MxWgradKey(256, 256, 4)
    assert key == Sm90MxWgradKey(256, 256, 4, tile=Sm90MxTileConfig())
    assert hash(key) == hash(Sm90MxWgradKey(256, 256, 4))
    assert key.num_tiles == 4 * 2 * 2 and key.a_major == key.b_major == "k"
    for kwargs, word in [
        ({"a_major": "m"}, "K-major"),
        ({"b_major": "n"}, "K-major"),
        ({"elem": "e2m1"}, "elem"),
        ({"token_layout": "ragged"}, "token_layout"),
        ({"input_order": "tensor_ragged"}, "input_order"),
        ({"out_dtype": "float64"}, "out_dtype"),
        ({"output_mode": "sparse"}, "output_mode"),
    ]:
        with pytest.raises(ValueError, match=word):
            Sm90MxWgradKey(256, 256, 4, **kwargs)
    with pytest.raises(ValueError, match="hidden"):
        Sm90MxWgradKey(192, 256, 4)
    with pytest.raises(ValueError, match="num_experts"):
        Sm90MxWgradKey(256, 256, 0)


def _cpu_operands(m=128, n=128, s=64, e=2):
    a = torch.zeros(m, s, dtype=torch.float8_e4m3fn)
    b = torch.zeros(n, s, dtype=torch.float8_e4m3fn).t()
    cols = 8
    sfa = torch.zeros(round_up(m, 128), cols, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sfb = torch.zeros(round_up(n, 128), cols, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    off = torch.tensor([s // 2, s][:e], dtype=torch.int32)
    return a, sfa, b, sfb, off


@pytest.mark.parametrize(
    ("change", "word"),
    [
        (lambda a, sfa, b, sfb, off: (a.view(torch.uint8), sfa, b, sfb, off), "FP8 dtype"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b.to(torch.float8_e5m2), sfb, off), "FP8 dtype"),
        (lambda a, sfa, b, sfb, off: (a.t().contiguous().t(), sfa, b, sfb, off), "K-major"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b.contiguous(), sfb, off), "K-major"),
        (lambda a, sfa, b, sfb, off: (a[:, :32], sfa, b, sfb, off), "token dims"),
        (lambda a, sfa, b, sfb, off: (a, sfa[:64], b, sfb, off), "a_scales must be"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b, sfb[:, :6], off), "b_scales must be"),
        (lambda a, sfa, b, sfb, off: (a, sfa.float(), b, sfb, off), "float8_e8m0fnu"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b, sfb, off.long()), "int32"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b, sfb, off), "CUDA device"),
        (lambda a, sfa, b, sfb, off: (a, sfa, b, sfb, None), "torch.Tensor"),
    ],
)
def test_entry_validation_on_cpu(change, word):
    args = change(*_cpu_operands())
    with pytest.raises(ValueError, match=word):
        grouped_wgrad_mxfp8_sm90(*args)


def test_entry_validation_modes():
    a, sfa, b, sfb, off = _cpu_operands()
    with pytest.raises(ValueError, match="token_layout"):
        grouped_wgrad_mxfp8_sm90(a, sfa, b, sfb, off, token_layout="x")
    with pytest.raises(ValueError, match="unit stride along tokens"):
        grouped_wgrad_mxfp8_sm90(a[:, ::2], sfa, b[::2], sfb, off)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_wgrad_mxfp8_sm90(a[:, 1:], sfa, b[1:], sfb, off)


def test_pad_tokens_to_scale_layout_cpu():
    counts = [0, 33, 128, 5]
    s = sum(counts)
    data = torch.arange(3 * s, dtype=torch.int32).remainder(250).add(1).to(torch.uint8)
    data = data.view(3, s)
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    _, starts, cols = grouped_scale_cols(off.tolist(), 32)
    padded = pad_tokens_to_scale_layout(data, off, cols)
    assert padded.shape == (3, 32 * cols)
    begin = 0
    expect = torch.zeros_like(padded)
    for c, s_e in zip(counts, starts):
        expect[:, 32 * s_e: 32 * s_e + c] = data[:, begin: begin + c]
        begin += c
    assert torch.equal(padded, expect)


@needs_cute
@pytest.mark.parametrize(
    ("kwargs", "n_wgmma"),
    [
        ({}, "m64n128k32.f32.e4m3.e4m3"),
        ({"elem": "e5m2", "out_dtype": "bfloat16", "token_layout": "padded"},
         "m64n128k32.f32.e5m2.e5m2"),
        ({"output_mode": "discrete", "accumulate": True, "tile": Sm90MxTileConfig(64, 64)},
         "m64n64k32.f32.e4m3.e4m3"),
    ],
)
def test_offline_compile_sm90a_has_fp8_wgmma_and_tma(kwargs, n_wgmma):
    key = Sm90MxWgradKey(256, 256, 4, **kwargs)
    ptx = mx.compile_sm90_mxfp8_wgrad_offline(key, arch="sm_90a")
    assert ".target sm_90a" in ptx
    wgmmas = re.findall(r"wgmma\.mma_async[\w.:]*", ptx)
    assert wgmmas and all(w.endswith(n_wgmma) for w in wgmmas), set(wgmmas)
    assert len(wgmmas) == 4  # one instruction per MX group, 4 groups per 128-token stage
    assert "cp.async.bulk.tensor.2d" in ptx  # TMA loads of data and scale atoms
    assert "mbarrier" in ptx
    assert "setmaxnreg" in ptx


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------


def _sqnr_db(out, ref):
    ref = ref.double()
    err = (out.double() - ref).pow(2).sum().item()
    sig = ref.pow(2).sum().item()
    if err == 0:
        return math.inf
    return 10 * math.log10(max(sig, 1e-300) / err)


def _poison_scale_padding(sf, rows, counts):
    """Every byte outside the experts' [rows, c_e] scale regions := 255 (NaN)."""
    ends = torch.tensor(counts).cumsum(0).tolist()
    c_e, _s_e, _ = grouped_scale_cols(ends, 32)
    valid = [torch.ones(rows, c, dtype=torch.uint8) for c in c_e]
    rp = round_up(rows, ATOM_ROWS)
    flat = torch.zeros(rp * sf.shape[1], dtype=torch.uint8)
    col = 0
    for v in valid:
        cp = round_up(v.shape[1], 4)
        if cp:
            flat[rp * col: rp * (col + cp)] = to_atoms(v).reshape(-1)
        col += cp
    mask = flat.view(rp, sf.shape[1]).to(sf.device) == 1
    u8 = sf.view(torch.uint8)
    u8[~mask] = 255
    return sf


def _operands(m, n, counts, elem, gen, nan_token=None):
    from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand

    s = int(sum(counts))
    x = torch.randn(s, m, generator=gen).to(torch.bfloat16)
    dy = torch.randn(s, n, generator=gen).to(torch.bfloat16)
    # a wide dynamic range across groups, so that wrong scale bookkeeping shows up
    x = x * torch.exp2(torch.randint(-6, 7, (s, 1), generator=gen)).to(torch.bfloat16)
    if nan_token is not None:
        x[nan_token, :] = float("nan")
    off = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a, sfa = quantize_wgrad_operand(x.cuda(), off, elem=elem)
    bt, sfb = quantize_wgrad_operand(dy.cuda(), off, elem=elem)
    sfa = _poison_scale_padding(sfa, m, counts)
    sfb = _poison_scale_padding(sfb, n, counts)
    return a, sfa, bt.t(), sfb, off


def _counts(e, gen, mean, aligned16):
    counts = torch.randint(1, 2 * mean + 1, (e,), generator=gen).tolist()
    for i in range(0, e, 3):
        counts[i] = 0  # every third expert empty
    counts = [c - c % 16 if aligned16 else c for c in counts]
    if aligned16:
        counts[-1] += 7  # the last expert's end is free; begins stay aligned
    else:
        counts = [c if c == 0 or c % 32 else c + 5 for c in counts]  # not multiples of 32
    if all(c == 0 for c in counts):
        counts[-1] = 37
    return counts


_GRID = [
    # (E, M, N, mean tokens, elem, out_dtype, output_mode, accumulate, token_layout)
    (4, 256, 256, 200, "e4m3", "float32", "dense", False, "padded"),
    (4, 256, 256, 200, "e4m3", "float32", "dense", False, "direct"),
    (4, 256, 256, 200, "e4m3", "float32", "dense", False, "direct-aligned"),
    (4, 128, 128, 333, "e5m2", "float32", "dense", False, "padded"),
    (4, 256, 128, 150, "e4m3", "bfloat16", "dense", False, "padded"),
    (4, 256, 128, 150, "e4m3", "bfloat16", "dense", False, "direct"),
    (6, 192, 320, 100, "e4m3", "float32", "discrete", False, "padded"),
    (4, 256, 256, 150, "e4m3", "float32", "dense", True, "padded"),
    (4, 256, 256, 150, "e4m3", "bfloat16", "discrete", True, "direct"),
    (1, 128, 128, 700, "e4m3", "float32", "dense", False, "padded"),
    (16, 512, 384, 90, "e4m3", "float32", "dense", False, "auto"),
    (64, 256, 256, 20, "e4m3", "float32", "dense", False, "padded"),
    (2, 1024, 2048, 1500, "e4m3", "bfloat16", "dense", False, "auto"),
]


_DIRECT_DISABLED = pytest.mark.skipif(
    os.environ.get("MOE_BWD_TEST_SM90_MXFP8_DIRECT", "0") != "1",
    reason="token_layout='direct' hit an illegal instruction on the H200 (2026-12-01); disabled "
           "(MOE_BWD_TEST_SM90_MXFP8_DIRECT=1 runs it, one case per process)")
_GRID = [pytest.param(*[c], marks=_DIRECT_DISABLED) if c[-1].startswith("direct") else c
         for c in _GRID]


def _run_case(case, gen, nan_token=None, counts=None):
    from cuda_kernels.grouped_wgrad.blockscaled_ref import grouped_wgrad_blockscaled_torch

    e, m, n, mean, elem, out_dtype, mode, accumulate, layout = case
    if counts is None:
        counts = _counts(e, gen, mean, aligned16=layout == "direct-aligned")
    layout = "direct" if layout == "direct-aligned" else layout
    a, sfa, b, sfb, off = _operands(m, n, counts, elem, gen, nan_token)
    dt = getattr(torch, out_dtype)
    init = torch.randn(e, m, n, generator=gen).to(dt).cuda() if accumulate else None
    ref = grouped_wgrad_blockscaled_torch(
        a, b, sfa, sfb, off, out=None if init is None else init.clone().float(),
        accumulate=accumulate, out_dtype=torch.float32,
    )
    out = init.clone() if accumulate else torch.full((e, m, n), float("nan"), dtype=dt,
                                                      device="cuda")
    if mode == "dense":
        grouped_wgrad_mxfp8_sm90(a, sfa, b, sfb, off, out, accumulate=accumulate,
                                 token_layout=layout)
    else:
        outs = [out[i].clone() for i in range(e)]
        ptrs = torch.tensor([t.data_ptr() for t in outs], dtype=torch.int64, device="cuda")
        grouped_wgrad_mxfp8_sm90(a, sfa, b, sfb, off, ptrs, out_dtype=dt, accumulate=accumulate,
                                 output_mode="discrete", token_layout=layout)
        torch.cuda.synchronize()
        out = torch.stack(outs)
    torch.cuda.synchronize()
    return counts, out, ref.to(dt).float() if dt != torch.float32 else ref, init


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE and _ENABLED), reason="needs an SM90 device, CuTe DSL "
                    "and the kernel enabled (MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1)")
@pytest.mark.parametrize("case", _GRID, ids=lambda c: "-".join(str(x) for x in c))
def test_grid_matches_twin(case):
    gen = torch.Generator().manual_seed(sum(ord(ch) for ch in str(case)))
    counts, out, ref, init = _run_case(case, gen)
    finite = ref.isfinite().all().item()
    sq = _sqnr_db(out.float(), ref) if finite else float("nan")
    print(f"\n[sm90_mxfp8] {case} counts={counts} SQNR={sq:.1f} dB "
          f"nan_out={out.isnan().sum().item()}")
    assert finite, "the twin has non-finite results (test bug)"
    assert not out.isnan().any(), f"NaN in the output (unwritten or poisoned padding): {case}"
    for i, c in enumerate(counts):
        if c == 0 and init is None:
            assert (out[i] == 0).all(), f"empty expert {i} must be zeros"
        if c == 0 and init is not None:
            assert torch.equal(out[i], init[i]), f"empty expert {i} must be untouched"
    assert sq >= 60.0, f"SQNR {sq:.1f} dB < 60 dB against the twin for {case}, counts={counts}"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not (HAS_SM90 and HAS_CUTE and _ENABLED), reason="needs an SM90 device, CuTe DSL "
                    "and the kernel enabled (MOE_BWD_ENABLE_UNVERIFIED_SM90_MXFP8=1)")
@pytest.mark.parametrize("layout", [pytest.param("direct", marks=_DIRECT_DISABLED), "padded"])
def test_nan_in_next_expert_does_not_leak(layout):
    # expert 0 ends inside a partial group (37 tokens); expert 1's first token is NaN (its
    # whole first group is NaN): expert 0 must be finite and equal the twin.
    gen = torch.Generator().manual_seed(7)
    counts = [37, 100, 0, 60]
    case = (4, 128, 128, 0, "e4m3", "float32", "dense", False, layout)
    counts, out, ref, _ = _run_case(case, gen, nan_token=37, counts=counts)
    sq0 = _sqnr_db(out[0], ref[0])
    print(f"\n[sm90_mxfp8] NaN leak test ({layout}): expert 0 SQNR={sq0:.1f} dB, "
          f"expert 1 NaN (twin: {ref[1].isnan().any().item()}, ours: "
          f"{out[1].isnan().any().item()})")
    assert out[0].isfinite().all(), "NaN leaked from the next expert into a partial group"
    assert sq0 >= 60.0
    assert sq0 == sq0 and _sqnr_db(out[3], ref[3]) >= 60.0
