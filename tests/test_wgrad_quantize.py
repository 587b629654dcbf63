"""Tests of the grouped-wgrad operand quantizer (cuda_kernels/grouped_wgrad/quantize.py).

On CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no CUDA); every byte must equal the torch twin (common/mx on zero-padded groups).
The ``gpu`` tests run the compiled kernel on CUDA against the same twin.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.mx_atoms import grouped_scale_cols_bound, round_up
from cuda_kernels.grouped_wgrad import quantize as qmod
from cuda_kernels.grouped_wgrad.blockscaled_ref import quantize_wgrad_operand_torch
from cuda_kernels.grouped_wgrad.quantize import quantize_wgrad_operand

# Token counts per expert: uneven with empty experts, cuDNN-aligned, one expert, all empty.
SPLITS = {
    "uneven": [50, 0, 127, 1, 33, 0],
    "aligned": [128, 0, 256],
    "single": [70],
    "all_empty": [0, 0],
}
CPU = torch.device("cpu")
# CPU tensors reach the kernel only through Triton's interpreter (set by conftest without CUDA)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="CPU-tensor kernel runs need TRITON_INTERPRET=1 (Triton runs compiled here)")


def _offsets(counts, device=CPU):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def _rows(s, h, seed=0, device=CPU):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, h, generator=g) * torch.exp(torch.randn(s, h, generator=g) * 2.0)
    return x.to(torch.bfloat16).to(device)


def _full(data):
    """The whole data buffer (padding columns included) behind the returned view, as bytes."""
    u = data.view(torch.uint8)
    if u.numel() == 0:
        return u
    return torch.as_strided(u, (u.shape[0], u.stride(0)), (u.stride(0), 1))


@pytest.fixture
def poisoned(monkeypatch):
    """Every output byte starts as 0xFF (a NaN in FP8 and E8M0): all must be written."""
    def alloc(shape, device):
        return torch.full(shape, 0xFF, dtype=torch.uint8, device=device)

    monkeypatch.setattr(qmod, "_alloc", alloc)


def _check(x, offs, elem, rule, **kw):
    d, s = quantize_wgrad_operand(x, offs, elem=elem, scale_rule=rule, **kw)
    dr, sr = quantize_wgrad_operand_torch(x.cpu(), offs.cpu(), elem=elem, scale_rule=rule,
                                          scale_cols=s.shape[1])
    assert d.shape == dr.shape and d.dtype == dr.dtype and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(_full(d).cpu(), _full(dr))
    assert torch.equal(s.view(torch.uint8).cpu(), sr.view(torch.uint8))
    return d, s


# every split with E4M3/OCP; the other formats on the uneven split only (interpreter time)
INTERP_CASES = [(sp, "e4m3", "ocp") for sp in SPLITS] + [
    ("uneven", "e4m3", "rceil"), ("uneven", "e5m2", "ocp"), ("uneven", "e5m2", "rceil"),
    ("uneven", "e2m1", "ocp"), ("uneven", "e2m1", "rceil")]


@interpreted
@pytest.mark.parametrize("split,elem,rule", INTERP_CASES)
def test_interpreter_matches_twin(poisoned, split, elem, rule):
    counts = SPLITS[split]
    if elem == "e2m1":
        counts = [c + c % 2 for c in counts]
    x = _rows(sum(counts), 40)
    d, s = _check(x, _offsets(counts), elem, rule)
    assert s.shape == (128, grouped_scale_cols_bound(sum(counts), len(counts), 32))


#: launch variants of quantize.LAUNCH the benchmark's sweep may pick (each must write the twin's
#: bytes): rows per program x warps x atom table or in-kernel lookup
LAUNCH_VARIANTS = [
    dict(block_h=32, num_warps=4, table=0),
    dict(block_h=64, num_warps=8, table=1),
    dict(block_h=128, num_warps=4, table=0),
    dict(block_h=256, num_warps=8, table=1),
]


@interpreted
@pytest.mark.parametrize("cfg", LAUNCH_VARIANTS, ids=str)
@pytest.mark.parametrize("split", ["uneven", "aligned"])
def test_launch_configs_give_the_same_bytes(poisoned, monkeypatch, cfg, split):
    """Every launch configuration the benchmark may pick writes the twin's bytes; H = 200 leaves
    a partial row block, on an uneven split and an aligned one."""
    for k, v in cfg.items():
        monkeypatch.setitem(qmod.LAUNCH, k, v)
    counts = SPLITS[split]
    _check(_rows(sum(counts), 200, seed=3), _offsets(counts), "e4m3", "ocp")
    fp4 = [c + c % 2 for c in counts]
    _check(_rows(sum(fp4), 72, seed=4), _offsets(fp4), "e2m1", "rceil")


@interpreted
def test_special_values_and_cudnn_shape(poisoned):
    """NaN / Inf groups, zero groups, subnormal and saturating amax, signed zeros; cuDNN's exact
    scale shape for aligned counts."""
    counts = [128, 128]
    x = _rows(256, 33, seed=5).float()
    x[0:32, 0] = 0.0
    x[32:64, 1] = -0.0
    x[5, 2] = float("nan")
    x[40, 3] = float("inf")
    x[70, 4] = -float("inf")
    x[0:32, 5] = torch.linspace(-1, 1, 32) * 2.0**-130  # subnormal amax → byte 0
    x[0:32, 6] = 500.0  # saturates in E4M3 under the OCP rule
    x[32:64, 6] = -1e-40
    x[128:160, 7] = 2.0**127 * 1.5
    x = x.to(torch.bfloat16)
    cols = round_up(256 // 32, 4)
    for elem, rule in (("e4m3", "ocp"), ("e4m3", "rceil"), ("e5m2", "rceil")):
        d, s = _check(x, _offsets(counts), elem, rule, scale_cols=cols)
        assert s.shape == (128, cols)


def test_validation():
    x = _rows(64, 8)
    offs = _offsets([32, 32])
    cases = [
        (dict(x_SH=x.float()), "bfloat16"),
        (dict(x_SH=x.t()), "rank-2|unit stride"),
        (dict(offsets_E=offs.long()), "int32"),
        (dict(offsets_E=offs[:0]), "non-empty"),
        (dict(offsets_E=torch.tensor([40, 30], dtype=torch.int32)), "non-decreasing"),
        (dict(offsets_E=torch.tensor([32, 60], dtype=torch.int32)), "must equal tokens_sum"),
        (dict(elem="e3m2"), "elem"),
        (dict(scale_rule="trainium"), "scale_rule"),
        (dict(scale_cols=6), "multiple of 4"),
        (dict(scale_cols=0), "too small"),
        (dict(rounding="fast"), "rounding"),
        (dict(elem="e2m1", offsets_E=torch.tensor([31, 64], dtype=torch.int32)), "even"),
    ]
    for change, msg in cases:
        kw = dict(x_SH=x, offsets_E=offs)
        kw.update(change)
        with pytest.raises(ValueError, match=msg):
            quantize_wgrad_operand(kw.pop("x_SH"), kw.pop("offsets_E"), **kw)


#: Input rules both quantizer entries share (``validate.check_quantize_args``): (change, message).
_SHARED_RULES = [
    ("fp32 rows", dict(x_SH="f32"), "x_SH must be a rank-2 bfloat16"),
    ("rank-1 rows", dict(x_SH="1d"), "x_SH must be a rank-2 bfloat16"),
    ("int64 offsets", dict(offsets_E=[32, 64], off_dtype=torch.int64), "int32"),
    ("no experts", dict(offsets_E=[]), "non-empty"),
    ("decreasing", dict(offsets_E=[40, 30]), "non-decreasing"),
    ("negative", dict(offsets_E=[-2, 64]), "non-decreasing and >= 0"),
    ("last < S", dict(offsets_E=[32, 60]), r"offsets_E\[-1\] = 60 must equal tokens_sum = 64"),
    ("last > S", dict(offsets_E=[32, 70]), r"offsets_E\[-1\] = 70 must equal tokens_sum"),
    ("odd offset e2m1", dict(elem="e2m1", offsets_E=[31, 64]), "must be even"),
    ("unknown elem", dict(elem="e3m2"), "elem must be one of"),
    ("unknown rule", dict(scale_rule="trainium"), "scale_rule must be one of"),
    ("scale_cols not /4", dict(scale_cols=6), "multiple of 4"),
    ("scale_cols small", dict(scale_cols=0), "too small"),
]


@pytest.mark.parametrize("entry", ["triton", "torch twin"])
@pytest.mark.parametrize("change,msg", [r[1:] for r in _SHARED_RULES],
                         ids=[r[0] for r in _SHARED_RULES])
def test_shared_input_rules(entry, change, msg):
    """The Triton quantizer and its torch twin reject the same inputs with the same
    ``ValueError`` (one validation function), before anything is written: a short last offset
    is not silently dropped tokens, a decreasing one not a raw torch error, fp32 not accepted
    by the twin alone."""
    change = dict(change)
    x = _rows(64, 8)
    if change.get("x_SH") == "f32":
        x = x.float()
    elif change.get("x_SH") == "1d":
        x = x[:, 0]
    change.pop("x_SH", None)
    off_dtype = change.pop("off_dtype", torch.int32)
    offs = torch.tensor(change.pop("offsets_E", [32, 64]), dtype=off_dtype)
    fn = quantize_wgrad_operand if entry == "triton" else quantize_wgrad_operand_torch
    with pytest.raises(ValueError, match=msg):
        fn(x, offs, **change)


def test_twin_shares_the_validation_code(monkeypatch):
    """One function validates both entries (no copy that can drift)."""
    from cuda_kernels.grouped_wgrad import blockscaled_ref, validate

    calls = []
    real = validate.check_quantize_args

    def spy(*args, **kw):
        calls.append(kw.get("fn"))
        return real(*args, **kw)

    monkeypatch.setattr(validate, "check_quantize_args", spy)
    x, offs = _rows(64, 8), _offsets([32, 32])
    blockscaled_ref.quantize_wgrad_operand_torch(x, offs)
    with pytest.raises(ValueError):
        quantize_wgrad_operand(x, offs, elem="bad")
    assert calls == ["quantize_wgrad_operand_torch", "quantize_wgrad_operand"]


@interpreted
def test_unvalidated_bad_offsets_stay_in_bounds(poisoned):
    """validate=False with out-of-contract offsets: unspecified bytes, no out-of-bounds access."""
    x = _rows(64, 8)
    d, s = quantize_wgrad_operand(x, torch.tensor([500, -3], dtype=torch.int32), validate=False,
                                  scale_cols=4)
    assert d.shape == (8, 64) and s.shape == (128, 4)


# ----------------------------------------------------------------------------------------------
# CUDA: the compiled kernel, bit for bit
# ----------------------------------------------------------------------------------------------

GPU_SPLITS = [
    [512, 0, 1000, 1, 31, 33, 2047, 0],
    [1024] * 8,
    [0] * 7 + [4096],
]


@pytest.mark.gpu
@pytest.mark.parametrize("counts", GPU_SPLITS)
@pytest.mark.parametrize("elem,rule", [("e4m3", "ocp"), ("e4m3", "rceil"), ("e5m2", "ocp"),
                                       ("e5m2", "rceil"), ("e2m1", "ocp")])
@pytest.mark.parametrize("rounding", ["integer", "native"])
def test_cuda_matches_twin(poisoned, counts, elem, rule, rounding):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if elem == "e2m1":
        if rounding == "native":
            pytest.skip("FP4 always rounds with integer ops")
        counts = [c + c % 2 for c in counts]
    dev = torch.device("cuda")
    x = _rows(sum(counts), 200, seed=7, device=dev)
    _check(x, _offsets(counts, dev), elem, rule, rounding=rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", LAUNCH_VARIANTS, ids=str)
@pytest.mark.parametrize("counts", [GPU_SPLITS[0], [16, 48, 0, 4000, 32, 96]])
def test_cuda_launch_variants(poisoned, monkeypatch, cfg, counts):
    """Every launch variant on the GPU, unaligned expert starts (byte stores) and 16-aligned ones
    whose ends are not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for k, v in cfg.items():
        monkeypatch.setitem(qmod.LAUNCH, k, v)
    dev = torch.device("cuda")
    for elem, rule, rounding in (("e4m3", "ocp", "native"), ("e5m2", "rceil", "integer"),
                                 ("e2m1", "ocp", "integer")):
        cs = [c + c % 2 for c in counts] if elem == "e2m1" else counts  # FP4: even counts
        x = _rows(sum(cs), 200, seed=11, device=dev)
        _check(x, _offsets(cs, dev), elem, rule, rounding=rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("rounding", ["integer", "native"])
def test_cuda_special_values(poisoned, rounding):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    x = _rows(256, 160, seed=9).float()
    x[5, 2] = float("nan")
    x[40, 3] = float("inf")
    x[0:32, 5] = torch.linspace(-1, 1, 32) * 2.0**-130
    x[0:32, 6] = 500.0
    x[32:64, 6] = -1e-40
    x[64:96, 7] = torch.linspace(-1, 1, 32) * 2.0**-120  # subnormal elements after scaling
    x = x.to(torch.bfloat16).to(dev)
    for elem, rule in (("e4m3", "ocp"), ("e4m3", "rceil"), ("e5m2", "ocp")):
        _check(x, _offsets([100, 156], dev), elem, rule, rounding=rounding)
