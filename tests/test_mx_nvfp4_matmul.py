"""Tests of common/mx.py: NVFP4 against torchao, the reference MX matmul, FP4 packing, properties."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.mx import (
    ELEMENT_FORMATS,
    dequantize_mx,
    dequantize_nvfp4,
    mx_matmul,
    quantize_mx,
    quantize_nvfp4,
)

# torchao is the oracle (the `test` extra installs it); where it is absent only its tests skip.
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
except ImportError:
    NVFP4Tensor = None

needs_torchao = pytest.mark.skipif(NVFP4Tensor is None, reason="torchao (the oracle) is not installed")


def _random(shape, magnitude, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 2.0)
    return (x * magnitude).to(dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
@needs_torchao
def test_nvfp4_matches_torchao_two_level(dtype, magnitude):
    x = _random((32, 128), magnitude, dtype, int(magnitude * 7) % 97)
    g_ref = per_tensor_amax_to_scale(x.abs().amax())
    s_ref, d_ref = nvfp4_quantize(x, 16, g_ref)
    data, scale, g = quantize_nvfp4(x)
    assert g.dtype == torch.float32 and torch.equal(g, g_ref)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (32, 8)
    assert torch.equal(scale.view(torch.uint8), s_ref.view(torch.uint8))
    assert data.dtype == torch.uint8 and torch.equal(data, d_ref.view(torch.uint8))
    y_ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g_ref).dequantize(torch.float32)
    assert torch.equal(dequantize_nvfp4(data, scale, g), y_ref)


@needs_torchao
def test_nvfp4_global_one_is_torchao_single_level():
    x = _random((8, 64), 0.5, torch.float32, 3)
    s_ref, d_ref = nvfp4_quantize(x, 16, None)
    data, scale, g = quantize_nvfp4(x, global_scale=1.0)
    assert g.item() == 1.0
    assert torch.equal(scale.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(data, d_ref.view(torch.uint8))


def test_nvfp4_axis0_zero_and_errors():
    x = _random((64, 3), 1.0, torch.float32, 5)
    d0, s0, g0 = quantize_nvfp4(x, axis=0)
    d1, s1, g1 = quantize_nvfp4(x.t().contiguous())
    assert d0.shape == (32, 3) and s0.shape == (4, 3)
    assert torch.equal(d0.t(), d1) and torch.equal(s0.t().view(torch.uint8), s1.view(torch.uint8))
    assert torch.equal(g0, g1)
    y = dequantize_nvfp4(d0, s0, g0, axis=0)
    assert ((y - x).abs() <= x.abs().amax() * 0.25).all()
    # all-zero tensor: global 1.0, everything decodes to 0
    dz, sz, gz = quantize_nvfp4(torch.zeros(2, 32))
    assert gz.item() == 1.0 and (dz == 0).all()
    assert (dequantize_nvfp4(dz, sz, gz) == 0).all()
    with pytest.raises(ValueError, match="multiple of block_size"):
        quantize_nvfp4(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(x, axis=0, global_scale=0.0)
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(x, axis=0, global_scale=float("nan"))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_nvfp4(d0, s0[:1], g0, axis=0)


# ----------------------------------------------------------------------------------------------
# FP4 packing
# ----------------------------------------------------------------------------------------------


def test_e2m1_packing_order():
    """Even element in the low nibble; codes are ml_dtypes float4_e2m1fn bit patterns."""
    vals = torch.tensor([0.5, -6.0, 1.5, 3.0, 0.0, -0.5, 4.0, 2.0] * 4)  # amax 6 → ocp X = 1
    data, scale = quantize_mx(vals.view(1, 32), elem="e2m1")
    assert scale.view(torch.uint8).item() == 127
    codes = vals.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    expected = codes[0::2] | (codes[1::2] << 4)
    assert data.flatten().tolist() == expected.tolist()
    assert torch.equal(dequantize_mx(data, scale, elem="e2m1").flatten(), vals)


# ----------------------------------------------------------------------------------------------
# reference MX matmul
# ----------------------------------------------------------------------------------------------


def test_mx_matmul_exact_on_representable_inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (16, 64), generator=g).float() * 0.25
    b = torch.randint(-8, 9, (64, 24), generator=g).float() * 4.0
    for rule in ("ocp", "rceil", "trainium"):
        out = mx_matmul(a, b, scale_rule=rule)
        assert out.dtype == torch.float32 and torch.equal(out, a @ b)
    out = mx_matmul(a[:, : 128 // 2].repeat(1, 2), b.repeat(2, 1), layout="wrapx")
    assert torch.equal(out, a.repeat(1, 2) @ b.repeat(2, 1))


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1"])
def test_mx_matmul_matches_dequantized_product(elem):
    a = _random((8, 256), 1.0, torch.bfloat16, 1)
    b = _random((256, 12), 1.0, torch.bfloat16, 2)
    out = mx_matmul(a, b, elem=elem, scale_rule="rceil")
    qa = quantize_mx(a, elem=elem, scale_rule="rceil", axis=1)
    qb = quantize_mx(b, elem=elem, scale_rule="rceil", axis=0)
    ref = (
        dequantize_mx(*qa, elem=elem, axis=1).double()
        @ dequantize_mx(*qb, elem=elem, axis=0).double()
    )
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = a.double() @ b.double()
    rel = {"e4m3": 0.1, "e5m2": 0.2, "e2m1": 0.5}[elem]
    assert (out.double() - exact).norm() / exact.norm() < rel
    with pytest.raises(ValueError, match="K mismatch"):
        mx_matmul(a, b[:128])


# ----------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------

_finite = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
)


@settings(max_examples=60, deadline=None)
@given(
    vals=st.lists(_finite, min_size=64, max_size=64),
    elem=st.sampled_from(["e4m3", "e5m2", "e2m1"]),
    rule=st.sampled_from(["ocp", "rceil", "trainium"]),
)
def test_property_round_trip_within_half_ulp(vals, elem, rule):
    """Every non-saturated element decodes to within half an element ULP at its magnitude."""
    x = torch.tensor(vals, dtype=torch.float32).view(2, 32)
    data, scale = quantize_mx(x, elem=elem, scale_rule=rule)
    y = dequantize_mx(data, scale, elem=elem, dtype=torch.float64)
    fmt = ELEMENT_FORMATS[elem]
    byte = scale.view(torch.uint8).double()
    X = torch.exp2(byte - 127).repeat_interleave(32, dim=1)
    m = x.double().abs() / X
    min_exp = 1 - (2 ** (fmt.ebits - 1) - 1)  # smallest normal exponent of the element format
    ulp = torch.exp2(torch.floor(torch.log2(m.clamp(min=2.0**min_exp))) - fmt.mbits)
    err = (y - x.double()).abs()
    ok = err <= 0.5 * ulp * X
    saturated = m > fmt.max
    assert (ok | saturated).all()
    if rule != "ocp":
        assert not saturated.any()
    # saturated elements decode to ±max·X
    assert torch.equal(y[saturated].abs(), (fmt.max * X)[saturated])


@settings(max_examples=40, deadline=None)
@given(
    a=st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
    b=st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
    shift=st.integers(min_value=-20, max_value=20),
    rule=st.sampled_from(["ocp", "rceil", "trainium"]),
)
def test_property_scale_monotonic_and_shift_equivariant(a, b, shift, rule):
    lo, hi = sorted((a, b))
    x = torch.zeros(2, 32)
    x[0, 3], x[1, 3] = lo, hi
    _, s = quantize_mx(x, scale_rule=rule)
    sb = s.view(torch.uint8).flatten().tolist()
    assert sb[0] <= sb[1]
    # multiplying by 2^shift moves the byte by shift and keeps the element bits
    d1, s1 = quantize_mx(x, scale_rule=rule)
    d2, s2 = quantize_mx(x * 2.0**shift, scale_rule=rule)
    b1 = s1.view(torch.uint8).int()
    b2 = s2.view(torch.uint8).int()
    inside = (b1 + shift > 0) & (b1 + shift < 255) & (b1 > 0)
    assert torch.equal(b2[inside], b1[inside] + shift)
    rows = inside.flatten()
    assert torch.equal(d2.view(torch.uint8)[rows], d1.view(torch.uint8)[rows])
