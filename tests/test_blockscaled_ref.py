"""Tests of the block-scaled grouped wgrad twin (cuda_kernels/grouped_wgrad/blockscaled_ref.py) and
of the 128×4 atom / K-grouped scale layout (common/mx_atoms.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from common import mx
from common.mx_atoms import (
    from_atoms,
    grouped_scale_cols,
    grouped_scale_cols_bound,
    pack_grouped_scales,
    round_up,
    to_atoms,
    unpack_grouped_scales,
)
from cuda_kernels.grouped_wgrad.blockscaled_ref import (
    dequantize_wgrad_operand,
    grouped_wgrad_blockscaled_torch,
    quantize_wgrad_operand_torch,
)

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.moe_training.kernels.mxfp8.quant import (
            torch_to_blocked_2d_K_groups,
        )
        from torchao.prototype.moe_training.mxfp8_grouped_mm import (
            _emulated_mxfp8_scaled_grouped_mm_2d_2d,
        )
        from torchao.prototype.mx_formats.utils import to_blocked
except ImportError:  # the H200 image has no torchao: only the oracle comparisons skip
    to_blocked = None

# Expert splits (token counts per expert): cuDNN-aligned, uneven, empty experts, all empty.
SPLITS = {
    "aligned": [128, 256, 0, 128],
    "uneven": [50, 0, 127, 1, 33, 96],
    "one_expert": [77],
    "all_empty": [0, 0, 0],
}
# |twin - float64 on the dequantized operands| <= RTOL * (|A_e| @ |B_e|): fp32 summation order only.
RTOL = 1e-5


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def _logical_scales(rows, counts, sf_vec, kind, gen):
    """Random per-expert logical scales [rows, c_e] in a safe range (no overflow)."""
    out = []
    for k in counts:
        c = -(-k // sf_vec)
        if kind == "e8m0":
            b = torch.randint(120, 135, (rows, c), generator=gen, dtype=torch.uint8)
            out.append(b.view(torch.float8_e8m0fnu))
        else:
            v = torch.rand((rows, c), generator=gen) * 4 + 0.05
            out.append(v.to(torch.float8_e4m3fn))
    return out


def _random_operands(fmt, m, n, counts, seed=0):
    """(a [M,S], b [S,N], sfa, sfb, gsa, gsb, logical scales) of random block-scaled operands."""
    gen = torch.Generator().manual_seed(seed)
    s = sum(counts)
    if fmt in ("e4m3", "e5m2"):
        dt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
        a = (torch.randn(m, s, generator=gen) * 8).to(dt)
        b = (torch.randn(s, n, generator=gen) * 8).to(dt)
        sf_vec, kind = 32, "e8m0"
    else:
        a = torch.randint(0, 256, (m, s // 2), generator=gen, dtype=torch.uint8)
        b = torch.randint(0, 256, (n, s // 2), generator=gen, dtype=torch.uint8).t()
        sf_vec, kind = (16, "e4m3") if fmt == "nvfp4" else (32, "e8m0")
    la = _logical_scales(m, counts, sf_vec, kind, gen)
    lb = _logical_scales(n, counts, sf_vec, kind, gen)
    cols = grouped_scale_cols_bound(s, len(counts), sf_vec)
    sfa, sfb = pack_grouped_scales(la, m, cols), pack_grouped_scales(lb, n, cols)
    gsa = gsb = None
    if fmt == "nvfp4":
        gsa = torch.rand(len(counts), generator=gen) + 0.5
        gsb = torch.rand(len(counts), generator=gen) + 0.5
    return a, b, sfa, sfb, gsa, gsb, la, lb, sf_vec


def _deq64(data_RK, scale, fmt, sf_vec):
    """float64 dequantization of one expert's rows (the k tokens; padded to whole groups)."""
    pack = 2 if fmt in ("mxfp4", "nvfp4") else 1
    k = data_RK.shape[1] * pack
    width = scale.shape[1] * sf_vec // pack
    pad = torch.zeros((data_RK.shape[0], width), dtype=data_RK.dtype)
    pad[:, : data_RK.shape[1]] = data_RK
    if fmt == "nvfp4":
        d = mx.dequantize_nvfp4(pad, scale, 1.0, axis=1, dtype=torch.float64)
    else:
        elem = "e2m1" if fmt == "mxfp4" else fmt
        d = mx.dequantize_mx(pad, scale, elem=elem, block_size=sf_vec, axis=1, dtype=torch.float64)
    return d[:, :k]


def _expected64(fmt, a, b, la, lb, gsa, gsb, counts, sf_vec):
    pack = 2 if fmt in ("mxfp4", "nvfp4") else 1
    res, mag, begin = [], [], 0
    for e, k in enumerate(counts):
        end = begin + k
        ad = _deq64(a[:, begin // pack: end // pack], la[e], fmt, sf_vec)
        bd = _deq64(b[begin // pack: end // pack].t(), lb[e], fmt, sf_vec)
        g = float(gsa[e]) * float(gsb[e]) if gsa is not None else 1.0
        res.append(g * (ad @ bd.t()))
        mag.append(abs(g) * (ad.abs() @ bd.abs().t()))
        begin = end
    return torch.stack(res), torch.stack(mag)


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (200, 9), (300, 17)])
def test_atoms_round_trip_and_torchao(rows, cols):
    s = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    at = to_atoms(s)
    assert at.shape == (round_up(rows, 128), round_up(cols, 4))
    assert torch.equal(from_atoms(at, rows, cols), s)
    if to_blocked is None:
        pytest.skip("torchao (the layout oracle) is not installed")
    assert torch.equal(at.reshape(-1), to_blocked(s).reshape(-1))


def test_atom_byte_position_rule():
    """REFERENCE §4 / CUTLASS tile_atom_to_shape_SF: (r, c) → (r%32)*16 + (r//32%4)*4 + c%4 in
    atom (r//128, c//4), atoms K-first."""
    s = torch.zeros((256, 8), dtype=torch.uint8)
    s[161, 6] = 7  # row block 1, col atom 1: atom index 1*2+1 = 3
    flat = to_atoms(s).reshape(-1)
    assert int(flat.nonzero()) == 3 * 512 + (161 % 32) * 16 + (161 % 128 // 32) * 4 + 2


def test_grouped_cols_and_bound():
    groups, starts, total = grouped_scale_cols([50, 50, 177, 300], 32)
    assert groups == [2, 0, 4, 4] and starts == [0, 4, 4, 8] and total == 12
    # cuDNN-aligned counts: the per-expert start equals begin / sf_vec, the total tokens_sum / 32
    _, starts, total = grouped_scale_cols([128, 384, 384, 512], 32)
    assert starts == [0, 4, 12, 12] and total == 16 == round_up(512 // 32, 4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        e = int(torch.randint(1, 9, (1,), generator=gen))
        counts = torch.randint(0, 100, (e,), generator=gen)
        total = grouped_scale_cols(counts.cumsum(0), 32)[2]
        assert total <= grouped_scale_cols_bound(int(counts.sum()), e, 32)


@pytest.mark.parametrize("counts", [[64, 0, 32, 160], [32, 96]])
def test_grouped_layout_matches_torchao_k_groups(counts):
    if to_blocked is None:
        pytest.skip("torchao (the layout oracle) is not installed")
    rows = 130
    scales = torch.randint(0, 256, (rows, sum(counts) // 32), dtype=torch.uint8)
    ends = _offsets(counts)
    ref, starts = torch_to_blocked_2d_K_groups(scales, ends // 32)
    per = list(torch.split(scales, [c // 32 for c in counts], dim=1))
    ours = pack_grouped_scales(per, rows, ref.shape[1])
    assert torch.equal(ours.reshape(-1), ref.reshape(-1))
    assert all(torch.equal(u, p) for u, p in
               zip(unpack_grouped_scales(ours, rows, ends, 32), per))


# ----------------------------------------------------------------------------------------------
# twin against float64
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_twin_matches_float64(fmt, split):
    counts = SPLITS[split]
    if fmt in ("mxfp4", "nvfp4"):
        counts = [c + c % 2 for c in counts]
    m, n = 40, 24
    a, b, sfa, sfb, gsa, gsb, la, lb, sf_vec = _random_operands(fmt, m, n, counts)
    got = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, _offsets(counts),
                                          global_scale_a=gsa, global_scale_b=gsb)
    want, mag = _expected64(fmt, a, b, la, lb, gsa, gsb, counts, sf_vec)
    assert got.dtype == torch.float32 and got.shape == (len(counts), m, n)
    assert bool(((got.double() - want).abs() <= RTOL * mag + 1e-30).all())
    for e, k in enumerate(counts):
        if k == 0:
            assert bool((got[e] == 0).all())


def test_poisoned_padding_never_changes_results():
    """Scale bytes outside each expert's [M, c_e] region (row pad, column pad, trailing columns)
    and partial groups: NaN (byte 255) or garbage there leaves every bit of the result alone."""
    counts = SPLITS["uneven"]
    m, n = 40, 24
    a, b, sfa, sfb, _, _, la, lb, _ = _random_operands("e4m3", m, n, counts)
    offs = _offsets(counts)
    clean = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs)
    for fill in (255, 0x55):
        pa = torch.full_like(sfa.view(torch.uint8), fill)
        pb = torch.full_like(sfb.view(torch.uint8), fill)
        cols = sfa.shape[1]
        real_a = pack_grouped_scales([torch.full_like(s.view(torch.uint8), 1) for s in la], m, cols)
        real_b = pack_grouped_scales([torch.full_like(s.view(torch.uint8), 1) for s in lb], n, cols)
        pa = torch.where(real_a.view(torch.uint8) == 1, sfa.view(torch.uint8), pa)
        pb = torch.where(real_b.view(torch.uint8) == 1, sfb.view(torch.uint8), pb)
        got = grouped_wgrad_blockscaled_torch(a, b, pa.view(sfa.dtype), pb.view(sfb.dtype), offs)
        assert torch.equal(got, clean)


def test_nan_scale_of_a_real_group_gives_nan():
    counts = [40]
    a, b, sfa, sfb, _, _, la, lb, _ = _random_operands("e4m3", 8, 8, counts)
    la[0].view(torch.uint8)[3, 1] = 255  # the partial second group of row 3
    sfa = pack_grouped_scales(la, 8, sfa.shape[1])
    got = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, _offsets(counts))
    assert bool(got[0, 3].isnan().all()) and not bool(got[0, :3].isnan().any())


def test_accumulate_and_out_dtypes():
    counts = [64, 0, 30]
    a, b, sfa, sfb, _, _, _, _, _ = _random_operands("e4m3", 16, 8, counts)
    offs = _offsets(counts)
    ref = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs)
    init = torch.randn(3, 16, 8)
    out = init.clone()
    grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs, out=out, accumulate=True)
    assert torch.equal(out[1], init[1])  # empty expert untouched
    assert torch.allclose(out, init + ref, rtol=1e-6, atol=1e-6)
    bf = torch.full((3, 16, 8), float("nan"), dtype=torch.bfloat16)
    grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs, out=bf)
    assert torch.equal(bf, ref.to(torch.bfloat16))
    # fp32 accumulation: 256 + 1 stays 257 in an fp32 output
    o = torch.full((3, 16, 8), 256.0)
    z = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs) * 0 + 1
    assert bool(((o + z) == 257).all())


def test_matches_torchao_emulated_grouped_mm():
    """torchao's emulated MXFP8 2d-2d grouped mm (dequantize to BF16 + torch._grouped_mm) on
    logical scales, groups multiple of 32 (its rule), BF16 output."""
    if to_blocked is None:
        pytest.skip("torchao (the oracle) is not installed")
    counts = [64, 32, 96]
    m, n = 32, 48
    a, b, sfa, sfb, _, _, la, lb, _ = _random_operands("e4m3", m, n, counts)
    offs = _offsets(counts)
    try:
        ref = _emulated_mxfp8_scaled_grouped_mm_2d_2d(
            a, torch.cat(la, 1), b.t().contiguous(), torch.cat(lb, 1), offs,
            out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._grouped_mm does not run here: {exc}")
    ours = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs)
    assert ref.shape == ours.shape
    assert torch.allclose(ours, ref.float(), rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


def test_scaled_grouped_mm_on_this_device():
    """torch._scaled_grouped_mm (MXFP8 2d-2d, SM100 only); skipped where it does not run."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("torch._scaled_grouped_mm MXFP8 needs an SM100 GPU; CPU/SM90 have no kernel")
    counts = [128, 256, 128]
    a, b, sfa, sfb, _, _, _, _, _ = _random_operands("e4m3", 128, 128, counts)
    offs = _offsets(counts)
    dev = "cuda"
    try:
        ref = torch._scaled_grouped_mm(a.to(dev), b.to(dev), sfa.to(dev).reshape(-1),
                                       sfb.to(dev).reshape(-1), offs=offs.to(dev),
                                       out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        pytest.skip(f"torch._scaled_grouped_mm refused MXFP8 2d-2d here: {exc}")
    ours = grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs)
    assert torch.allclose(ref.float().cpu(), ours, rtol=2e-2, atol=1e-2 * float(ours.abs().max()))


def test_twin_on_quantizer_twin_operands():
    """End to end: BF16 rows → quantizer twin → wgrad twin ≈ the BF16 product (MXFP8 SQNR)."""
    gen = torch.Generator().manual_seed(3)
    counts = [50, 0, 127, 123]
    x = torch.randn(300, 40, generator=gen).to(torch.bfloat16)
    dy = torch.randn(300, 24, generator=gen).to(torch.bfloat16)
    offs = _offsets(counts)
    a, sfa = quantize_wgrad_operand_torch(x, offs)
    bt, sfb = quantize_wgrad_operand_torch(dy, offs)
    got = grouped_wgrad_blockscaled_torch(a, bt.t(), sfa, sfb, offs)
    ends = [0, *offs.tolist()]
    ref = torch.stack([x[s:e].double().t() @ dy[s:e].double() for s, e in zip(ends, ends[1:])])
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (got.double() - ref).pow(2).sum())
    assert sqnr > 24  # torchao's bar for MXFP8 weight grads (ARCHITECTURE.md)
    assert bool((got[1] == 0).all())


# ----------------------------------------------------------------------------------------------
# validation: every rule a ValueError before any write
# ----------------------------------------------------------------------------------------------


def _base():
    counts = [64, 0, 40]
    a, b, sfa, sfb, _, _, _, _, _ = _random_operands("e4m3", 16, 8, counts)
    return dict(a_tensor=a, b_tensor=b, sfa_tensor=sfa, sfb_tensor=sfb,
                offsets_tensor=_offsets(counts))


def _bad_cases():
    s = 104
    e8 = torch.float8_e8m0fnu
    yield "b dtype", dict(b_tensor=torch.zeros(s, 8, dtype=torch.float8_e5m2)), "one element"
    yield "bf16 a", dict(a_tensor=torch.zeros(16, s, dtype=torch.bfloat16)), "float8_e4m3fn"
    yield "no sfa", dict(sfa_tensor=None), "sfa_tensor is required"
    yield "sf dtype mix", dict(sfb_tensor=torch.zeros(128, 12, dtype=torch.float8_e4m3fn)), \
        "one dtype"
    yield "fp8 at 16", dict(sf_vec_size=16), "unsupported combination"
    yield "token mismatch", dict(b_tensor=torch.zeros(s + 1, 8, dtype=torch.float8_e4m3fn)), \
        "token dims"
    yield "offs dtype", dict(offsets_tensor=torch.tensor([64, 64, s])), "int32"
    yield "offs decreasing", dict(offsets_tensor=torch.tensor([64, 60, s], dtype=torch.int32)), \
        "non-decreasing"
    yield "offs last", dict(offsets_tensor=torch.tensor([64, 64, s - 1], dtype=torch.int32)), \
        "must equal tokens_sum"
    yield "offs empty", dict(offsets_tensor=torch.zeros(0, dtype=torch.int32)), "at least one"
    yield "sfa rows", dict(sfa_tensor=torch.zeros(16, 12, dtype=e8)), "round_up"
    yield "sfa cols", dict(sfa_tensor=torch.zeros(128, 4, dtype=e8)), ">= 8"
    yield "sfa noncontig", dict(sfa_tensor=torch.zeros(12, 128, dtype=torch.uint8).t().view(e8)), \
        "contiguous"
    yield "global on mx", dict(global_scale_a=torch.ones(3), global_scale_b=torch.ones(3)), \
        "NVFP4 only"
    yield "out shape", dict(out=torch.zeros(3, 8, 16)), "out must have shape"
    yield "out dtype", dict(out=torch.zeros(3, 16, 8, dtype=torch.float64)), "out dtype"
    yield "accumulate", dict(accumulate=True), "accumulate=True"


@pytest.mark.parametrize("name,change,msg", list(_bad_cases()), ids=[c[0] for c in _bad_cases()])
def test_validation(name, change, msg):
    kwargs = _base()
    kwargs.update(change)
    with pytest.raises(ValueError, match=msg):
        grouped_wgrad_blockscaled_torch(**kwargs)


def test_validation_nvfp4_rules():
    counts = [32, 14]
    a, b, sfa, sfb, gsa, gsb, _, _, _ = _random_operands("nvfp4", 16, 8, counts)
    offs = _offsets(counts)
    with pytest.raises(ValueError, match="NVFP4 needs global_scale_a"):
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs)
    with pytest.raises(ValueError, match="global_scale_b"):
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs, global_scale_a=gsa,
                                        global_scale_b=gsb.double())
    with pytest.raises(ValueError, match="even"):
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, torch.tensor([31, 46], dtype=torch.int32),
                                        global_scale_a=gsa, global_scale_b=gsb)
    out = torch.full((2, 16, 8), 3.0)
    with pytest.raises(ValueError):
        grouped_wgrad_blockscaled_torch(a, b, sfa, sfb, offs, global_scale_a=gsa,
                                        global_scale_b=gsb[:1], out=out)
    assert bool((out == 3).all())  # nothing written before the error


@pytest.mark.parametrize("counts", [[37, 0, 100, 300, 1], [128, 256], [0, 0, 64]])
def test_vectorized_dequantize_equals_per_expert_decoding(counts):
    # dequantize_wgrad_operand (whole-tensor ops) == common.mx per expert, element for element in
    # fp32; a NaN scale (byte 255) of a real group gives NaN only in that group's tokens
    gen = torch.Generator().manual_seed(len(counts))
    s, h = sum(counts), 200
    x = torch.randn(s, h, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (s, 1), generator=gen).float())
    off = torch.tensor(counts).cumsum(0).to(torch.int32)
    data, sf = quantize_wgrad_operand_torch(x.to(torch.bfloat16), off)
    sf_u8 = sf.view(torch.uint8).clone()
    sf_u8.view(-1)[16 * 5] = 255  # row 5's first group of the first expert with tokens
    got = dequantize_wgrad_operand(data, sf_u8.view(sf.dtype), off, out_dtype=torch.float32)
    scales = unpack_grouped_scales(sf_u8.view(sf.dtype), h, off.tolist(), 32)
    begin = 0
    for e, end in enumerate(off.tolist()):
        if end > begin:
            c = scales[e].shape[1]
            pad = torch.zeros((h, 32 * c), dtype=data.dtype)
            pad[:, : end - begin] = data[:, begin:end]
            ref = mx.dequantize_mx(pad, scales[e], elem="e4m3", block_size=32, axis=1)
            torch.testing.assert_close(got[:, begin:end], ref[:, : end - begin], rtol=0, atol=0,
                                       equal_nan=True)
        begin = end
    assert got.isnan().any()
    with pytest.raises(ValueError, match="offsets_E"):
        dequantize_wgrad_operand(data, sf, off - 1)
