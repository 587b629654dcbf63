"""Unit tests of the CPU NKI interpreter (nki_kernels/interp): each instruction against NumPy,
the memory rules, LNC2 and the profile. Every test asserts values; the file runs in seconds."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest

from nki_kernels import interp
from nki_kernels._nki import HAVE_REAL_NKI, nisa, nki, nl, region
from nki_kernels.interp import NkiCapacityError, NkiError, NkiOOBError, mxops

BF16 = ml_dtypes.bfloat16
pytestmark = pytest.mark.skipif(HAVE_REAL_NKI, reason="interpreter tests (real NKI installed)")


@pytest.fixture(autouse=True)
def _fresh_context():
    """Each test runs in its own default trn3 LNC1 program instance."""
    ctx = interp.ProgramContext()
    prev = interp.core.set_current(ctx)
    yield ctx
    interp.core.set_current(prev)


def rng(seed=0):
    return np.random.default_rng(seed)


def sbuf_from(a: np.ndarray, dtype=None):
    """An SBUF tile holding ``a`` (written directly, no instruction)."""
    dtype = dtype or interp.dtypes.normalize(a.dtype)
    t = nl.ndarray(a.shape, dtype)
    t._np()[...] = a
    return t


def hbm_from(a: np.ndarray):
    return interp.core.wrap_array(np.ascontiguousarray(a), interp.dtypes.normalize(a.dtype))


# ------------------------------------------------------------------------------------------------
# shim, dtypes, views


def test_shim_exports_interpreter():
    assert HAVE_REAL_NKI is False
    assert nl.bfloat16 == "bfloat16" and isinstance(nl.float8_e4m3fn_x4, str)
    assert nki.language is nl and nki.isa is nisa
    assert nki.dtype.float8_e4m3fn_x4 == "float8_e4m3fn_x4"
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_bank_fmax == 512
    assert nl.tile_size.total_available_sbuf_size == 256 * 1024 - 16384 - 8 - 256


def test_new_buffers_hold_sentinels():
    f = nl.ndarray((4, 8), nl.bfloat16)
    i = nl.ndarray((4, 8), nl.int32)
    x4 = nl.ndarray((4, 8), nl.float8_e4m3fn_x4, buffer=nl.hbm)
    assert np.isnan(f.numpy().astype(np.float32)).all()
    assert (i.numpy() == 4).all()
    lanes = x4.view(nl.float8_e4m3fn).numpy().astype(np.float32)
    assert np.isnan(lanes).all()


def test_indexing_rules_onchip_and_hbm():
    t = nl.ndarray((64, 64, 64), nl.float32)
    assert t[:, 0, 10].shape == (64, 1)
    assert t[0, 0, 10].shape == (1, 1)
    assert t[3].shape == (1, 64, 64)
    assert t[nl.ds(8, 16), 2:6, ::2].shape == (16, 4, 32)
    h = nl.ndarray((5, 6, 7), nl.float32, buffer=nl.hbm)
    assert h[1].shape == (6, 7) and h[1, 2, 3].shape == (1,)
    with pytest.raises(IndexError, match="out of bounds"):
        t[:, 0:65]
    v = t[nl.ds(2, 4), 1, nl.ds(5, 3)]
    assert v.offset == 2 * 64 * 64 + 64 + 5
    assert v.strides == (4096, 1)


def test_views_share_storage_and_reinterpret_bit_exactly():
    a = rng().integers(0, 2**32, size=(8, 16), dtype=np.uint32)
    t = sbuf_from(a)
    as_fp8 = t.view(nl.float8_e4m3fn)
    assert as_fp8.shape == (8, 64)
    np.testing.assert_array_equal(as_fp8.numpy().view(np.uint8).reshape(8, 16, 4).copy()
                                  .view(np.uint32)[..., 0], a)
    back = as_fp8.view(nl.float8_e4m3fn_x4)
    np.testing.assert_array_equal(back.numpy(), a)
    r = t.reshape((8, 4, 4))
    np.testing.assert_array_equal(r.numpy(), a.reshape(8, 4, 4))
    e8 = nl.ndarray((4, 4), nl.float8_e8m0fnu)
    e8.view(nl.uint8)._np()[...] = np.arange(16, dtype=np.uint8).reshape(4, 4) + 120
    np.testing.assert_array_equal(e8.view(nl.uint8).numpy().ravel(), np.arange(120, 136))
    with pytest.raises(NkiError, match="not contiguous"):
        t[:, ::2].reshape((8, 8))


def test_ap_pattern_and_offset():
    a = np.arange(128 * 6, dtype=np.int32).reshape(128, 6)
    t = sbuf_from(a)
    col = t.ap([[6, 128], [1, 1]], offset=4)
    np.testing.assert_array_equal(col.numpy().ravel(), a[:, 4])
    h = hbm_from(np.arange(40, dtype=np.float32).reshape(8, 5))
    v = h[2:6, :].ap([[5, 2], [1, 3]], offset=1)
    np.testing.assert_array_equal(v.numpy(), np.arange(40).reshape(8, 5)[2:4, 1:4])
    with pytest.raises(NkiError, match="partition step"):
        t.ap([[3, 128], [1, 1]])


# ------------------------------------------------------------------------------------------------
# rules: partitions, capacity


def test_partition_dim_limit():
    with pytest.raises(NkiError, match=r"partition dim 129"):
        nl.ndarray((129, 4), nl.float32)


def test_sbuf_capacity_and_free_on_release(_fresh_context):
    cap = nl.tile_size.total_available_sbuf_size
    big = nl.ndarray((128, cap // 4 - 16), nl.float32)
    with pytest.raises(NkiCapacityError, match="SBUF capacity"):
        nl.ndarray((128, 64), nl.float32)
    del big
    t = nl.ndarray((128, 64), nl.float32)  # freed storage is available again
    assert _fresh_context.sbuf_used == 256
    del t


def test_sbuf_capacity_trn2_smaller():
    ctx = interp.ProgramContext(target="trn2")
    prev = interp.core.set_current(ctx)
    try:
        assert nl.tile_size.total_available_sbuf_size == 224 * 1024 - 16384 - 8 - 520
        with pytest.raises(NkiCapacityError):
            nl.ndarray((128, 210 * 1024), nl.uint8)
        # trn2: one matmul writes one PSUM bank
        ps = nl.ndarray((16, 1024), nl.float32, buffer=nl.psum)
        a = sbuf_from(np.ones((32, 16), BF16))
        nisa.nc_matmul(ps[:, 512:1024], a, sbuf_from(np.ones((32, 512), BF16)))
        assert (ps.numpy()[:, 512:] == 32).all()
        with pytest.raises(NkiError, match="only multiply and add"):
            nisa.tensor_scalar(a, a, nl.maximum, 0.0, engine=nisa.engine.scalar)
        with pytest.raises(NkiError, match="crosses the 2 KiB PSUM bank"):
            nisa.nc_matmul(ps[:, 256:512], a, sbuf_from(np.ones((32, 256), BF16)))
            nisa.nc_matmul(ps[:, 384:640], a, sbuf_from(np.ones((32, 256), BF16)))
    finally:
        interp.core.set_current(prev)


def test_psum_eight_banks():
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(8)]
    with pytest.raises(NkiCapacityError, match="PSUM capacity"):
        nl.ndarray((128, 16), nl.float32, buffer=nl.psum)
    tiles.pop()
    small = nl.ndarray((128, 16), nl.float32, buffer=nl.psum)
    assert small.shape == (128, 16)


# ------------------------------------------------------------------------------------------------
# DMA


def test_dma_copy_plain_and_cast():
    x = rng().standard_normal((128, 32)).astype(np.float32)
    h = hbm_from(x)
    s = nl.ndarray((128, 32), nl.bfloat16)
    nisa.dma_copy(s, h)
    np.testing.assert_array_equal(s.numpy(), x.astype(BF16))
    with pytest.raises(NkiError, match="HWDGE"):
        nisa.dma_copy(s, h, dge_mode=nisa.dge_mode.hwdge)
    with pytest.raises(NkiError, match="element counts"):
        nisa.dma_copy(s[:, 0:16], h)


def test_dma_gather_scatter_with_oob_skip():
    T, H = 10, 8
    x = rng().standard_normal((T, H)).astype(np.float32)
    h = hbm_from(x)
    ids = np.array([3, -1, 9, 10, 0, 2, -1, 7], dtype=np.int32).reshape(8, 1)
    idx = sbuf_from(ids)
    g = nl.ndarray((8, H), nl.float32)
    nisa.memset(g, 0.0)
    nisa.dma_copy(g, h.ap([[H, 8], [1, H]], offset=0, vector_offset=idx, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    valid = (ids[:, 0] >= 0) & (ids[:, 0] < T)
    exp = np.where(valid[:, None], x[np.clip(ids[:, 0], 0, T - 1)], 0)
    np.testing.assert_array_equal(g.numpy(), exp)
    with pytest.raises(NkiOOBError, match="out of bounds"):
        nisa.dma_copy(g, h.ap([[H, 8], [1, H]], offset=0, vector_offset=idx, indirect_dim=0))
    # scatter: rows with bad ids are dropped, dst rows not addressed keep their values
    out = hbm_from(np.full((T, H), -5.0, np.float32))
    nisa.dma_copy(out.ap([[H, 8], [1, H]], offset=0, vector_offset=idx, indirect_dim=0), g,
                  oob_mode=nisa.oob_mode.skip)
    o = out.numpy()
    for r in range(8):
        if valid[r]:
            np.testing.assert_array_equal(o[ids[r, 0]], exp[r])
    untouched = sorted(set(range(T)) - {int(i) for i in ids[valid, 0]})
    assert (o[untouched] == -5.0).all()


def test_dma_scalar_offset_expert_slice():
    E, R, C = 3, 4, 6
    w = np.arange(E * R * C, dtype=np.float32).reshape(E, R, C)
    h = hbm_from(w)
    e = sbuf_from(np.array([[2]], dtype=np.int32))
    d = nl.ndarray((R, 3), nl.float32)
    nisa.dma_copy(d, h.ap([[C, R], [1, 3]], offset=2, scalar_offset=e, indirect_dim=0))
    np.testing.assert_array_equal(d.numpy(), w[2, :, 2:5])


def test_dma_transpose_plain_and_indirect():
    a = rng().standard_normal((16, 32)).astype(BF16)
    h = hbm_from(a)
    d = nl.ndarray((32, 16), nl.bfloat16)
    nisa.dma_transpose(d, h)
    np.testing.assert_array_equal(d.numpy(), a.T)
    src = hbm_from(rng().standard_normal((20, 8)).astype(BF16))
    ind = sbuf_from(np.array([[5], [0], [19], [3]] * 4, dtype=np.uint32).reshape(16, 1))
    d2 = nl.ndarray((8, 16), nl.bfloat16)
    nisa.dma_transpose(d2, src.ap([[8, 16], [1, 8]], vector_offset=ind, indirect_dim=0))
    rows = np.array([5, 0, 19, 3] * 4)
    np.testing.assert_array_equal(d2.numpy(), src.numpy()[rows].T)


def test_dma_compute_scatter_add():
    out = hbm_from(np.ones((6, 4), np.float32))
    src = sbuf_from(np.full((3, 4), 2.0, np.float32))
    idx = sbuf_from(np.array([[1], [4], [-1]], np.int32))
    ap = out.ap([[4, 3], [1, 4]], vector_offset=idx, indirect_dim=0)
    nisa.dma_compute(ap, [ap, src], nl.add, oob_mode=nisa.oob_mode.skip)
    exp = np.ones((6, 4), np.float32)
    exp[[1, 4]] = 3.0
    np.testing.assert_array_equal(out.numpy(), exp)


# ------------------------------------------------------------------------------------------------
# Vector / Scalar / GpSimd


def test_tensor_copy_cast_and_exact():
    x = rng().standard_normal((32, 64)).astype(np.float32) * 1000
    s = sbuf_from(x)
    b = nl.ndarray((32, 64), nl.bfloat16)
    nisa.tensor_copy(b, s)
    np.testing.assert_array_equal(b.numpy(), x.astype(BF16))
    i = nl.ndarray((32, 64), nl.int32)
    nisa.tensor_copy(i, s)
    np.testing.assert_array_equal(i.numpy(), np.rint(x).astype(np.int32))
    u = nl.ndarray((32, 64), nl.uint32)
    nisa.tensor_copy(u, sbuf_from(np.full((32, 64), -1, np.int32)))
    assert (u.numpy() == 0).all()  # fp32 -> uint32 saturates
    c = nl.ndarray((32, 2, 32), nl.bfloat16)
    nisa.tensor_copy(c, b)
    np.testing.assert_array_equal(c.numpy().reshape(32, 64).view(np.uint16),
                                  b.numpy().view(np.uint16))
    p = nl.ndarray((32, 64), nl.bfloat16, buffer=nl.psum)
    with pytest.raises(NkiError, match="4-byte"):
        nisa.tensor_copy(p, b)
    with pytest.raises(NkiError, match="GpSimd cannot access PSUM"):
        nisa.tensor_copy(s, nl.ndarray((32, 64), nl.float32, buffer=nl.psum),
                         engine=nisa.engine.gpsimd)


def test_memset_and_iota():
    t = nl.ndarray((8, 5), nl.bfloat16)
    nisa.memset(t, 1.5)
    assert (t.numpy().astype(np.float32) == 1.5).all()
    q = nl.ndarray((8, 5), nl.float8_e4m3fn_x4)
    with pytest.raises(NkiError, match="only value=0"):
        nisa.memset(q, 1)
    nisa.memset(q, 0)
    assert (q.numpy() == 0).all()
    with pytest.raises(NkiError, match="int value"):
        nisa.memset(nl.ndarray((8, 5), nl.int32), 1.5)
    v = nl.ndarray((128, 1), nl.int32)
    nisa.iota(v, [[0, 1]], offset=0, channel_multiplier=1)
    np.testing.assert_array_equal(v.numpy().ravel(), np.arange(128))
    w = nl.ndarray((4, 2, 3), nl.float32)
    nisa.iota(w, [[10, 2], [1, 3]], offset=7, channel_multiplier=100)
    p, a, b = np.meshgrid(np.arange(4), np.arange(2), np.arange(3), indexing="ij")
    np.testing.assert_array_equal(w.numpy(), 7 + 100 * p + 10 * a + b)


@pytest.mark.parametrize("op,ref", [
    ("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
    ("maximum", np.maximum), ("minimum", np.minimum),
    ("less", lambda a, b: (a < b).astype(np.float32)),
    ("greater", lambda a, b: (a > b).astype(np.float32)),
    ("logical_and", lambda a, b: ((a != 0) & (b != 0)).astype(np.float32)),
])
def test_tensor_tensor_float(op, ref):
    a = rng(1).standard_normal((64, 48)).astype(BF16)
    b = rng(2).standard_normal((64, 48)).astype(BF16)
    b[0, :4] = 0
    d = nl.ndarray((64, 48), nl.bfloat16)
    nisa.tensor_tensor(d, sbuf_from(a), sbuf_from(b), getattr(nl, op))
    exp = ref(a.astype(np.float32), b.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(d.numpy().view(np.uint16), exp.view(np.uint16))


def test_tensor_tensor_int_exact_and_bitvec():
    a = np.array([[2**30 + 1, 7]], np.int32)
    b = np.array([[2**30 - 3, 3]], np.int32)
    d = nl.ndarray((1, 2), nl.int32)
    nisa.tensor_tensor(d, sbuf_from(a), sbuf_from(b), nl.add)
    np.testing.assert_array_equal(d.numpy(), (a.astype(np.int64) + b).astype(np.int32))
    nisa.tensor_tensor(d, sbuf_from(a), sbuf_from(b), nl.bitwise_and)
    np.testing.assert_array_equal(d.numpy(), a & b)
    with pytest.raises(NkiError, match="integer"):
        nisa.tensor_tensor(nl.ndarray((1, 2), nl.float32), sbuf_from(a.astype(np.float32)),
                           sbuf_from(b.astype(np.float32)), nl.bitwise_or)
    p1 = nl.ndarray((1, 2), nl.float32, buffer=nl.psum)
    p2 = nl.ndarray((1, 2), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiError, match="at most one"):
        nisa.tensor_tensor(d, p1, p2, nl.add)


def test_tensor_scalar_tile_and_reverse():
    x = rng().standard_normal((16, 10)).astype(np.float32)
    col = rng(3).standard_normal((16, 1)).astype(np.float32)
    d = nl.ndarray((16, 10), nl.float32)
    nisa.tensor_scalar(d, sbuf_from(x), nl.multiply, sbuf_from(col), op1=nl.add, operand1=2.0)
    np.testing.assert_array_equal(d.numpy(), (x * col + np.float32(2)).astype(np.float32))
    nisa.tensor_scalar(d, sbuf_from(x), nl.subtract, 1.0, reverse0=True)
    np.testing.assert_array_equal(d.numpy(), np.float32(1) - x)
    ids = np.array([[3], [-1], [5]], np.int32)
    o = nl.ndarray((3, 1), nl.int32)
    nisa.tensor_scalar(o, sbuf_from(ids), nl.multiply, 8, op1=nl.add, operand1=2)
    nisa.tensor_scalar(o, o, nl.maximum, -1)
    np.testing.assert_array_equal(o.numpy().ravel(), np.maximum(ids.ravel() * 8 + 2, -1))


def test_tensor_reduce():
    x = rng().standard_normal((8, 4, 16)).astype(np.float32)
    d = nl.ndarray((8, 4), nl.float32)
    nisa.tensor_reduce(d, nl.add, sbuf_from(x), axis=2)
    np.testing.assert_allclose(d.numpy(), x.sum(-1), rtol=1e-6)
    d1 = nl.ndarray((8, 1), nl.float32)
    nisa.tensor_reduce(d1, nl.maximum, sbuf_from(x), axis=(1, 2), negate=True)
    np.testing.assert_array_equal(d1.numpy().ravel(), -x.reshape(8, -1).max(-1))
    with pytest.raises(NkiError, match="partition axis"):
        nisa.tensor_reduce(d1, nl.add, sbuf_from(x), axis=0)


@pytest.mark.parametrize("op", ["silu", "silu_dx", "sigmoid", "exp", "copy", "tanh"])
def test_activation_against_formula(op):
    x = (rng().standard_normal((32, 40)) * 4).astype(BF16)
    d = nl.ndarray((32, 40), nl.bfloat16)
    nisa.activation(d, getattr(nl, op), sbuf_from(x), scale=0.5)
    z = x.astype(np.float64) * 0.5
    s = 1 / (1 + np.exp(-z))
    ref = {"silu": z * s, "silu_dx": s * (1 + z * (1 - s)), "sigmoid": s, "exp": np.exp(z),
           "copy": z, "tanh": np.tanh(z)}[op]
    np.testing.assert_allclose(d.numpy().astype(np.float64), ref, rtol=2 ** -7, atol=1e-30)


def test_activation_bias_and_reduce():
    x = rng().standard_normal((16, 8)).astype(np.float32)
    b = rng(1).standard_normal((16, 1)).astype(np.float32)
    d = nl.ndarray((16, 8), nl.float32)
    r = nl.ndarray((16, 1), nl.float32)
    nisa.activation_reduce(d, nl.copy, sbuf_from(x), nl.add, r, bias=sbuf_from(b))
    np.testing.assert_allclose(d.numpy(), x + b, rtol=1e-6)
    np.testing.assert_allclose(r.numpy(), (x + b).sum(1, keepdims=True), rtol=1e-5)


def test_nc_transpose_pe_and_vector():
    a = rng().standard_normal((96, 128)).astype(BF16)
    p = nl.ndarray((128, 96), nl.bfloat16, buffer=nl.psum)
    nisa.nc_transpose(p, sbuf_from(a))
    np.testing.assert_array_equal(p.numpy(), a.T)
    v = nl.ndarray((16, 32), nl.int32)
    src = np.arange(512, dtype=np.int32).reshape(32, 16)
    nisa.nc_transpose(v, sbuf_from(src))
    np.testing.assert_array_equal(v.numpy(), src.T)
    with pytest.raises(NkiError, match=r"\[32, 32\]"):
        nisa.nc_transpose(nl.ndarray((64, 32), nl.int32), sbuf_from(np.zeros((32, 64), np.int32)))


def test_nc_stream_shuffle_broadcast():
    src = sbuf_from(np.arange(4, dtype=np.float32).reshape(1, 4))
    dst = nl.ndarray((32, 4), nl.float32)
    nisa.nc_stream_shuffle(dst, src, [0] * 32)
    np.testing.assert_array_equal(dst.numpy(), np.tile(np.arange(4), (32, 1)))
    s2 = sbuf_from(np.arange(64, dtype=np.float32).reshape(64, 1))
    d2 = sbuf_from(np.full((64, 1), -1, np.float32))
    mask = [31 - i for i in range(16)] + [255] * 16
    nisa.nc_stream_shuffle(d2, s2, mask)
    exp = np.full(64, -1.0)
    for q in range(2):
        for i in range(16):
            exp[32 * q + i] = 32 * q + 31 - i
    np.testing.assert_array_equal(d2.numpy().ravel(), exp)


# ------------------------------------------------------------------------------------------------
# TensorE and MX


def test_nc_matmul_bf16_and_psum_auto_accumulate():
    a = rng(1).standard_normal((128, 64)).astype(BF16)
    b = rng(2).standard_normal((128, 256)).astype(BF16)
    p = nl.ndarray((64, 256), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(p, sbuf_from(a), sbuf_from(b))
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(p, sbuf_from(a), sbuf_from(b))  # second write adds (accumulate=None)
    np.testing.assert_allclose(p.numpy(), 2 * ref, rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(p, sbuf_from(a), sbuf_from(b), accumulate=False)
    np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5, atol=1e-4)
    fresh = nl.ndarray((64, 256), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiError, match="uninitialized"):
        nisa.nc_matmul(fresh, sbuf_from(a), sbuf_from(b), accumulate=True)
    with pytest.raises(NkiError, match="PSUM"):
        nisa.nc_matmul(nl.ndarray((64, 256), nl.float32), sbuf_from(a), sbuf_from(b))


def _trainium_quant_ref(x_PF: np.ndarray):
    """Independent quantizer: Trainium rule on 8-partition x 4-lane groups (float64 math)."""
    P, F = x_PF.shape
    data = np.zeros((P, F), np.uint8)
    scales = np.zeros((P // 8, F // 4), np.uint8)
    for g in range(P // 8):
        for j in range(F // 4):
            blk = x_PF[8 * g:8 * g + 8, 4 * j:4 * j + 4].astype(np.float64)
            amax = np.abs(blk).max()
            if amax == 0:
                e = -127
            else:
                e = int(np.floor(np.log2(amax))) - 7
            scales[g, j] = e + 127
            q = (blk / 2.0 ** e).astype(ml_dtypes.float8_e4m3fn)
            data[8 * g:8 * g + 8, 4 * j:4 * j + 4] = q.view(np.uint8)
    return data, scales


def test_quantize_mx_groups_scales_and_packing():
    x = rng().standard_normal((64, 32)).astype(np.float32)
    x[8:16, 4:8] = 0  # an all-zero group -> scale byte 0
    x[0, 0] = 1000.0  # large amax: no saturation with the Trainium rule
    xb = x.astype(BF16)
    dq = nl.ndarray((64, 8), nl.float8_e4m3fn_x4)
    sc = nl.ndarray((64, 8), nl.uint8)
    nisa.memset(sc, 0)
    nisa.quantize_mx(dq, sbuf_from(xb), sc)
    data, scales = _trainium_quant_ref(xb.astype(np.float32))
    np.testing.assert_array_equal(dq.numpy().view(np.uint8).reshape(64, 32), data)
    rows = [32 * (r // 4) + r % 4 for r in range(8)]
    np.testing.assert_array_equal(sc.numpy()[rows], scales)
    assert sc.numpy()[1, 1] == 0 and scales[1, 1] == 0
    unused = np.setdiff1d(np.arange(64), rows)
    assert (sc.numpy()[unused] == 0).all()  # untouched


def test_quantize_mx_rules():
    src = sbuf_from(np.zeros((48, 8), BF16))
    with pytest.raises(NkiError, match="multiple of 32"):
        nisa.quantize_mx(nl.ndarray((48, 2), nl.float8_e4m3fn_x4), src,
                         nl.ndarray((48, 2), nl.uint8))
    src = sbuf_from(np.zeros((32, 6), BF16))
    with pytest.raises(NkiError, match="multiple of 4"):
        nisa.quantize_mx(nl.ndarray((32, 1), nl.float8_e4m3fn_x4), src,
                         nl.ndarray((32, 1), nl.uint8))
    ctx = interp.ProgramContext(target="trn2")
    prev = interp.core.set_current(ctx)
    try:
        with pytest.raises(NkiError, match="only on trn3"):
            nisa.quantize_mx(nl.ndarray((32, 2), nl.float8_e4m3fn_x4),
                             sbuf_from(np.zeros((32, 8), BF16)), nl.ndarray((32, 2), nl.uint8))
    finally:
        interp.core.set_current(prev)


def _edge_tile():
    """[128, 64] bf16-valued tile: random magnitudes plus zero, subnormal, huge, NaN, Inf groups."""
    x = rng().standard_normal((128, 64)) * np.exp(rng(1).standard_normal((128, 64)) * 6)
    x[0:8, 0:4] = 0.0
    x[8:16, 0:4] = 1e-40  # bf16 subnormal: exponent below -127 -> byte 0
    x[16:24, 0:4] = 3e38
    x[24:32, 4:8] = 2.0 ** -130
    x[32, 8] = np.nan
    x[40, 12] = np.inf
    x[48, 16] = -np.inf
    x[56:64, 20:24] = -448.0 * 2.0 ** 100
    return x.astype(BF16).astype(np.float32)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_quantize_fast_path_is_bit_identical_to_common_mx(elem):
    pytest.importorskip("common.mx")
    x = _edge_tile()
    w_common, s_common = mxops.quantize_groups(x, elem, impl="common")
    for impl in ("fast", "numpy"):
        w, s = mxops.quantize_groups(x, elem, impl=impl)
        np.testing.assert_array_equal(s, s_common, err_msg=impl)
        np.testing.assert_array_equal(w, w_common, err_msg=impl)
    assert s_common[0, 0] == 0 and s_common[1, 0] == 0 and s_common[4, 2] == 255


def test_nc_matmul_mx_against_dequantized_reference():
    P, M, N = 128, 64, 256
    x = rng(1).standard_normal((P, 4 * M)).astype(BF16)
    y = rng(2).standard_normal((P, 4 * N)).astype(BF16)
    xq = nl.ndarray((P, M), nl.float8_e4m3fn_x4)
    yq = nl.ndarray((P, N), nl.float8_e4m3fn_x4)
    xs = nl.ndarray((P, M), nl.uint8)
    ys = nl.ndarray((128, N), nl.float8_e8m0fnu)
    nisa.quantize_mx(xq, sbuf_from(x), xs)
    nisa.quantize_mx(yq, sbuf_from(y), ys[4:, :])  # scale packing slot 4
    out = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(out, xq, yq, xs, ys[4:, :])
    # independent dequantization
    xd, xsc = _trainium_quant_ref(x.astype(np.float32))
    yd, ysc = _trainium_quant_ref(y.astype(np.float32))
    xv = xd.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.repeat(
        np.repeat(2.0 ** (xsc.astype(np.float64) - 127), 8, 0), 4, 1)
    yv = yd.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * np.repeat(
        np.repeat(2.0 ** (ysc.astype(np.float64) - 127), 8, 0), 4, 1)
    ref = np.einsum("pmi,pni->mn", xv.reshape(P, M, 4), yv.reshape(P, N, 4))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
    exact = np.einsum("pmi,pni->mn", x.astype(np.float64).reshape(P, M, 4),
                      y.astype(np.float64).reshape(P, N, 4))
    sqnr = 10 * np.log10((exact ** 2).sum() / ((out.numpy() - exact) ** 2).sum())
    assert sqnr > 25  # MXFP8 E4M3 both sides


def _packed_operands(P=128, M=32, N=64):
    x = rng(3).standard_normal((P, 4 * M)).astype(BF16)
    y = (rng(4).standard_normal((P, 4 * N)) * 1000).astype(BF16)  # other scales than x's
    return (nl.ndarray((P, M), nl.float8_e4m3fn_x4), sbuf_from(x),
            nl.ndarray((P, N), nl.float8_e4m3fn_x4), sbuf_from(y))


def test_scale_packing_four_operands_share_one_tile():
    """Scale packing (NKI_API.md §4.5): four operands' scales in one [128, F] tile at offsets
    0/4/8/12 give the same bits as four separate scale tiles."""
    P, M, N = 128, 32, 64
    xq, x, yq, y = _packed_operands(P, M, N)
    xq2, x2, yq2, y2 = _packed_operands(P, M, N)
    shared = nl.ndarray((P, N), nl.uint8)
    views = [shared[off:, 0:F] for off, F in ((0, M), (4, N), (8, M), (12, N))]
    for q, src, v in zip((xq, yq, xq2, yq2), (x, y, x2, y2), views):
        nisa.quantize_mx(q, src, v)
    out = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(out, xq, yq, views[0], views[1])
    out2 = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(out2, xq2, yq2, views[2], views[3])
    xs, ys = nl.ndarray((P, M), nl.uint8), nl.ndarray((P, N), nl.uint8)
    xr, yr = nl.ndarray((P, M), nl.float8_e4m3fn_x4), nl.ndarray((P, N), nl.float8_e4m3fn_x4)
    nisa.quantize_mx(xr, x, xs)
    nisa.quantize_mx(yr, y, ys)
    ref = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(ref, xr, yr, xs, ys)
    np.testing.assert_array_equal(out.numpy(), ref.numpy())
    np.testing.assert_array_equal(out2.numpy(), ref.numpy())


@pytest.mark.parametrize("off", [1, 2, 3, 5, 16, 20, 28])
def test_scale_view_offset_rule(off):
    """A scale view at an offset other than 0/4/8/12 inside its quadrant is rejected by both
    quantize_mx and nc_matmul_mx."""
    xq, x, yq, y = _packed_operands(32)
    sc = nl.ndarray((64, 64), nl.uint8)
    with pytest.raises(NkiError, match="offset 0, 4, 8 or 12"):
        nisa.quantize_mx(xq, x, sc[off:, 0:32])
    nisa.quantize_mx(xq, x, sc[0:, 0:32])
    nisa.quantize_mx(yq, y, sc[4:, 0:64])
    bad = nl.ndarray((64, 32), nl.uint8)
    nisa.tensor_copy(dst=bad, src=sc[0:, 0:32])
    out = nl.ndarray((32, 64), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiError, match="offset 0, 4, 8 or 12"):
        nisa.nc_matmul_mx(out, xq, yq, bad[off:, :], sc[4:, 0:64])


def test_scale_packing_overlap_is_caught():
    """A kernel that packs wrongly fails: two operands quantized into the same slot (the second
    overwrites the first's scales), or a matmul reading another operand's slot."""
    xq, x, yq, y = _packed_operands()
    shared = nl.ndarray((128, 64), nl.uint8)
    nisa.quantize_mx(xq, x, shared[0:, 0:32])
    nisa.quantize_mx(yq, y, shared[0:, 0:64])  # same slot 0: overlaps x's scales
    out = nl.ndarray((32, 64), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiError, match="stationary_scale does not hold the scales"):
        nisa.nc_matmul_mx(out, xq, yq, shared[0:, 0:32], shared[0:, 0:64])
    # disjoint slots, but the matmul reads y's slot for x
    xq, x, yq, y = _packed_operands()
    shared = nl.ndarray((128, 64), nl.uint8)
    nisa.quantize_mx(xq, x, shared[0:, 0:32])
    nisa.quantize_mx(yq, y, shared[4:, 0:64])
    with pytest.raises(NkiError, match="moving_scale does not hold the scales"):
        nisa.nc_matmul_mx(out, xq, yq, shared[0:, 0:32], shared[0:, 0:64])
    nisa.nc_matmul_mx(out, xq, yq, shared[0:, 0:32], shared[4:, 0:64])  # the right slots


def test_nc_matmul_mx_shape_rules():
    q = nl.ndarray((128, 127), nl.float8_e4m3fn_x4)
    s = nl.ndarray((128, 127), nl.uint8)
    m = nl.ndarray((128, 8), nl.float8_e4m3fn_x4)
    ms = nl.ndarray((128, 8), nl.uint8)
    with pytest.raises(NkiError, match="even and <= 128"):
        nisa.nc_matmul_mx(nl.ndarray((127, 8), nl.float32, buffer=nl.psum), q, m, s, ms)
    with pytest.raises(NkiError, match="quadrant"):
        nisa.nc_matmul_mx(nl.ndarray((8, 8), nl.float32, buffer=nl.psum), m, m,
                          nl.ndarray((16, 8), nl.uint8), ms)


# ------------------------------------------------------------------------------------------------
# simulate, LNC2, profile


def _mx_gemm_kernel(x_KM, y_KN):
    """out[M, N] = x^T y through WRAPX tiles, quantize_mx and nc_matmul_mx (K % 512 == 0)."""
    K, M = x_KM.shape
    N = y_KN.shape[1]
    out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
    nprog = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    n_half = N // nprog
    with region("mm"):
        acc = nl.ndarray((M, n_half), nl.float32, buffer=nl.psum)
        for k in nl.affine_range(K // 512):
            xs = nl.ndarray((128, 4 * M), nl.bfloat16)
            ys = nl.ndarray((128, 4 * n_half), nl.bfloat16)
            for i in range(4):
                rows = nl.ds(k * 512 + i * 128, 128)
                nisa.dma_copy(xs.reshape((128, M, 4))[:, :, i], x_KM[rows, :])
                nisa.dma_copy(ys.reshape((128, n_half, 4))[:, :, i],
                              y_KN[rows, nl.ds(pid * n_half, n_half)])
            xq = nl.ndarray((128, M), nl.float8_e4m3fn_x4)
            yq = nl.ndarray((128, n_half), nl.float8_e4m3fn_x4)
            xsc = nl.ndarray((128, M), nl.uint8)
            ysc = nl.ndarray((128, n_half), nl.uint8)
            nisa.quantize_mx(xq, xs, xsc)
            nisa.quantize_mx(yq, ys, ysc)
            nisa.nc_matmul_mx(acc, xq, yq, xsc, ysc)
        o = nl.ndarray((M, n_half), nl.float32)
        nisa.tensor_copy(o, acc)
        nisa.dma_copy(out[:, nl.ds(pid * n_half, n_half)], o)
    nisa.core_barrier(out, (0, 1))
    return out


def test_simulate_lnc1_lnc2_same_and_profile():
    import torch

    x = torch.randn(1024, 64, dtype=torch.bfloat16)
    y = torch.randn(1024, 256, dtype=torch.bfloat16)
    s1 = nki.simulate(_mx_gemm_kernel)
    s2 = nki.simulate(_mx_gemm_kernel, lnc=2)
    o1 = s1(x, y)
    o2 = s2(x, y)
    assert isinstance(o1, torch.Tensor) and o1.dtype == torch.float32
    assert torch.equal(o1, o2)
    ref = x.double().T @ y.double()
    rel = ((o1.double() - ref).norm() / ref.norm()).item()
    assert rel < 0.06
    p1, p2 = s1.last_profile, s2.last_profile
    c1 = p1.counters("mm")
    assert c1.macs_mx == 1024 * 64 * 256
    assert c1.instructions["tensor"] == 2 and c1.instructions["vector"] == 5
    assert c1.dma_bytes == (1024 * 64 + 1024 * 256) * 2 + 64 * 256 * 4
    assert p2.counters("mm").macs_mx == c1.macs_mx and p2.cores == [0, 1]
    # LNC2 splits the work: modeled time drops, utilization stays within (0, 1]
    assert p2.modeled_time_us("mm") < p1.modeled_time_us("mm")
    for p in (p1, p2):
        assert 0 < p.tensor_e_utilization("mm") <= 1
    mem = p1.memory[0]
    assert mem["psum_peak_banks"] == 1  # one [64, 128] fp32 accumulator
    assert mem["sbuf_peak_bytes"] >= (4 * 64 + 4 * 256) * 2  # the bf16 staging tiles
    assert sorted(p2.memory) == [0, 1]
    eng = p1.engine_time_us("mm")
    # modeled DMA: the staging copies write 2-byte elements 8 bytes apart in SBUF (one chunk per
    # element); the output store moves 1 KiB per partition
    from nki_kernels.interp.profile import dma_cost_ns

    m = p1.model
    want = 8 * dma_cost_ns(m, 128 * 64 * 2, 2, 128) + 8 * dma_cost_ns(m, 128 * 256 * 2, 2, 128)
    want += dma_cost_ns(m, 64 * 256 * 4, 1024, 64)
    assert eng["dma"] == pytest.approx(want / 1e3)
    assert c1.dma_count == 17 and c1.dma_chunks == 8 * 128 * (64 + 256) + 64
    assert p1.modeled_time_us("mm") >= p1.perfect_overlap_time_us("mm") - 1e-9


def test_sbuf_peak_per_region():
    """Profile.memory[core]["sbuf_peak_by_region"]: the SBUF live while in each region (at
    entry and at every allocation), tiles still live from an earlier region included."""

    def k(x):
        a = nl.ndarray((128, 1024), nl.uint8)  # 1 KiB, live through both regions
        with region("one"):
            b = nl.ndarray((128, 4096), nl.uint8)
            nisa.memset(b, 0)
            del b
        with region("two"):
            c = nl.ndarray((128, 2048), nl.uint8)
            nisa.memset(c, 0)
            nisa.memset(a, 0)
        return x

    s = nki.simulate(k)
    s(np.zeros((4, 4), np.float32))
    peaks = s.last_profile.memory[0]["sbuf_peak_by_region"]
    assert peaks["one"] == 1024 + 4096 and peaks["two"] == 1024 + 2048
    assert s.last_profile.memory[0]["sbuf_peak_bytes"] == 1024 + 4096


def test_lnc2_program_ids_shared_alloc_sendrecv():
    def k(x):
        pid = nl.program_id(0)
        n = nl.num_programs(0)
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 4), nl.float32)
        nisa.memset(t, float(pid + 1))
        nisa.dma_copy(shared[pid], t)
        nisa.core_barrier(shared, (0, 1))
        r = nl.ndarray((1, 4), nl.float32)
        nisa.sendrecv(src=t, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        out = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        both = nl.ndarray((1, 4), nl.float32)
        nisa.tensor_tensor(both, t, r, nl.add)
        nisa.dma_copy(out[pid], both)
        nisa.core_barrier(out, (0, 1))
        assert n == 2 and nl.program_ndim() == 1
        return shared, out

    shared, out = nki.simulate(k, lnc=2)(np.zeros(1, np.float32))
    np.testing.assert_array_equal(shared, [[1] * 4, [2] * 4])
    np.testing.assert_array_equal(out, np.full((2, 4), 3.0))


def test_lnc2_error_in_one_core_is_raised():
    def k(x):
        if nl.program_id(0) == 1:
            nl.ndarray((200, 4), nl.float32)
        nisa.core_barrier(x, (0, 1))

    with pytest.raises(NkiError, match="partition dim 200"):
        nki.simulate(k, lnc=2, timeout_s=10)(np.zeros(4, np.float32))


def test_return_must_be_shared_hbm_and_inputs_written_in_place():
    def k(x):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.memset(t, 7.0)
        nisa.dma_copy(x.reshape((1, 4)), t)
        return nl.ndarray((4,), nl.float32, buffer=nl.hbm)

    x = np.zeros(4, np.float32)
    with pytest.raises(NkiError, match="shared_hbm"):
        nki.simulate(k)(x)
    np.testing.assert_array_equal(x, 7.0)


def test_jit_launch_grid():
    @nki.jit
    def k(x):
        out = nl.ndarray((2,), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 1), nl.int32)
        nisa.memset(t, nl.num_programs(0))
        nisa.dma_copy(out[nl.program_id(0)].reshape((1, 1)), t)
        nisa.core_barrier(out, (0, 1))
        return out

    np.testing.assert_array_equal(k[2](np.zeros(2, np.int32)), [2, 2])


def test_per_instruction_overhead_is_small():
    a = sbuf_from(np.ones((128, 64), np.float32))
    d = nl.ndarray((128, 64), nl.float32)
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        nisa.tensor_tensor(d, a, a, nl.add)
    per = (time.perf_counter() - t0) / n
    assert per < 2e-3  # typically ~30-60 us


def test_registers_dynamic_range_and_scalar_offset():
    flag = sbuf_from(np.array([[0]], np.int32))
    reg = nisa.register_alloc(0)
    nisa.register_load(reg, flag)
    with pytest.raises(NkiError, match="deprecated.*fori_loop"):
        nl.dynamic_range(reg)
    nl.ALLOW_DYNAMIC_RANGE["value"] = True
    try:
        assert list(nl.dynamic_range(reg)) == []
        nisa.register_move(reg, 3)
        assert list(nl.dynamic_range(1, reg)) == [1, 2]
    finally:
        nl.ALLOW_DYNAMIC_RANGE["value"] = False
    with pytest.raises(TypeError):
        bool(reg)
    with pytest.raises(NkiError, match="integer"):
        nisa.register_load(reg, sbuf_from(np.array([[1.0]], np.float32)))
    # fori_loop with the induction register as a scalar offset: copy rows 0..2 of a table
    table = hbm_from(np.arange(12, dtype=np.float32).reshape(4, 3))
    out = hbm_from(np.zeros((4, 3), np.float32))
    tmp = nl.ndarray((1, 3), nl.float32)

    def body(i):
        nisa.dma_copy(tmp, table.ap([[3, 1], [1, 3]], scalar_offset=i, indirect_dim=0))
        nisa.dma_copy(out.ap([[3, 1], [1, 3]], scalar_offset=i, indirect_dim=0), tmp)

    nl.fori_loop(0, nisa.register_alloc(3), body)
    with pytest.raises(NkiError, match="cannot return a value"):
        nl.fori_loop(0, 1, lambda i: 1)
    exp = np.arange(12, dtype=np.float32).reshape(4, 3)
    exp[3] = 0
    np.testing.assert_array_equal(out.numpy(), exp)
    st = nl.ndarray((1, 1), nl.int32)
    nisa.register_store(st, reg)
    assert st.numpy()[0, 0] == 3
    # while_loop counts down
    cnt = sbuf_from(np.array([[4]], np.int32))
    one = sbuf_from(np.array([[1]], np.int32))
    seen = []

    def wbody(r):
        seen.append(r.value)
        nisa.tensor_tensor(cnt, cnt, one, nl.subtract)
        nisa.register_load(r, cnt)
        return r

    r0 = nisa.register_alloc()
    nisa.register_load(r0, cnt)
    nl.while_loop(r0, wbody)
    assert seen == [4, 3, 2, 1]


def test_bypass_stage():
    x = rng().standard_normal((4, 6)).astype(np.float32)
    d = nl.ndarray((4, 6), nl.float32)
    nisa.tensor_scalar(d, sbuf_from(x), nl.bypass, 0.0, op1=nl.multiply, operand1=2.0)
    np.testing.assert_array_equal(d.numpy(), 2 * x)
    nisa.activation(d, nl.bypass, sbuf_from(x), scale=3.0)
    np.testing.assert_array_equal(d.numpy(), (3 * x).astype(np.float32))


def test_engine_start_partition_rule():
    t = nl.ndarray((128, 8), nl.float32)
    nisa.memset(t[64:128, :], 1.0)  # 64 partitions at 64: legal
    nisa.memset(t[96:112, :], 1.0)  # 16 at 96: legal
    with pytest.raises(NkiError, match="starting at partition 16"):
        nisa.memset(t[16:48, :], 1.0)
    with pytest.raises(NkiError, match="starting at partition 32"):
        nisa.tensor_copy(t[32:96, :], t[0:64, :])
    src = nl.ndarray((16, 8), nl.float32)
    nisa.dma_copy(t[16:32, :], src)  # DMA is not constrained
    x = sbuf_from(np.ones((32, 16), BF16))
    sc = nl.ndarray((128, 4), nl.uint8)
    nisa.quantize_mx(nl.ndarray((32, 4), nl.float8_e4m3fn_x4), x, sc[8:, :])  # scale slot 8
    assert (sc.numpy()[8:12] == 120).all()  # amax 1 -> 2^(0 - 7) -> byte 120


def test_dma_transpose_4d_and_hwdge_rules():
    a = rng().standard_normal((4, 1, 8, 32)).astype(BF16)
    h = hbm_from(a)
    d = nl.ndarray((32, 1, 8, 4), nl.bfloat16)
    nisa.dma_transpose(d, h, dge_mode=nisa.dge_mode.hwdge)
    np.testing.assert_array_equal(d.numpy(), np.transpose(a, (3, 1, 2, 0)))
    with pytest.raises(NkiError, match="not allowed"):
        nisa.dma_transpose(d, h, axes=(3, 2, 1, 0))
    bad = hbm_from(rng().standard_normal((8, 32)).astype(BF16))
    with pytest.raises(NkiError, match="shape\\[0\\] == 16"):
        nisa.dma_transpose(nl.ndarray((32, 8), nl.bfloat16), bad, dge_mode=nisa.dge_mode.hwdge)
    i32 = hbm_from(np.arange(64, dtype=np.int32).reshape(16, 4))
    d32 = nl.ndarray((4, 16), nl.int32)
    nisa.dma_transpose(d32, i32)  # 4-byte types transpose bit-exactly (swdge)
    np.testing.assert_array_equal(d32.numpy(), np.arange(64).reshape(16, 4).T)


def test_affine_select_and_copy_predicated():
    src = sbuf_from(np.arange(32, dtype=np.float32).reshape(4, 8))
    d = nl.ndarray((4, 8), nl.float32)
    # keep elements with p - j >= 0 (lower triangle), else -1
    nisa.affine_select(d, [[-1, 8]], 1, src, -1.0, cmp_op=nl.greater_equal)
    p, j = np.meshgrid(np.arange(4), np.arange(8), indexing="ij")
    np.testing.assert_array_equal(d.numpy(), np.where(p - j >= 0, np.arange(32).reshape(4, 8), -1))
    pred = sbuf_from((np.arange(32).reshape(4, 8) % 3 == 0).astype(np.uint8))
    nisa.tensor_copy_predicated(d, 7.0, pred)
    exp = np.where(np.arange(32).reshape(4, 8) % 3 == 0, 7.0,
                   np.where(p - j >= 0, np.arange(32).reshape(4, 8), -1))
    np.testing.assert_array_equal(d.numpy(), exp)


def test_zeros_ones_full_in_each_buffer():
    z = nl.zeros((4, 4), nl.bfloat16)
    o = nl.ones((4,), nl.int32, buffer=nl.shared_hbm)
    f = nl.full((2, 3), 2.5, nl.float32, buffer=nl.hbm)
    assert (z.numpy().astype(np.float32) == 0).all()
    assert (o.numpy() == 1).all()
    assert (f.numpy() == 2.5).all()
    with pytest.raises(ValueError, match="buffer"):
        nl.ndarray((4, 4), nl.float32, buffer="sbuf")


def test_dtype_normalization_and_errors():
    import torch

    from nki_kernels.interp import dtypes

    assert dtypes.normalize(torch.bfloat16) == "bfloat16"
    assert dtypes.normalize(np.float32) == "float32"
    assert dtypes.normalize(ml_dtypes.float8_e4m3fn) == "float8_e4m3fn"
    assert dtypes.itemsize(nl.float8_e4m3fn_x4) == 4 and dtypes.itemsize(nl.float4_e2m1fn_x4) == 2
    with pytest.raises(ValueError, match="not an NKI dtype"):
        dtypes.normalize("float64")


def test_matmul_tiling_rules():
    a = sbuf_from(np.ones((32, 16), BF16))
    b = sbuf_from(np.ones((32, 8), BF16))
    p = nl.ndarray((16, 8), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(p, a, b, tile_position=(32, 64), tile_size=(32, 64))
    assert (p.numpy() == 32).all()
    with pytest.raises(NkiError, match="together"):
        nisa.nc_matmul(p, a, b, tile_position=(0, 0))
    with pytest.raises(NkiError, match="not aligned"):
        nisa.nc_matmul(p, a, b, tile_position=(16, 0), tile_size=(32, 32))
    with pytest.raises(NkiError, match="exceed"):
        nisa.nc_matmul(p, sbuf_from(np.ones((64, 16), BF16)), sbuf_from(np.ones((64, 8), BF16)),
                       tile_position=(0, 0), tile_size=(32, 32))
    q = nl.ndarray((32, 16), nl.float8_e4m3fn_x4)
    s = nl.ndarray((32, 16), nl.uint8)
    nisa.quantize_mx(q, sbuf_from(np.ones((32, 64), BF16)), s)
    pm = nl.ndarray((16, 16), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(pm, q, q, s, s, tile_position=(0, 0), tile_size=(32, 128))
    assert (pm.numpy() == 128).all()
    # operands on partitions 64..96: only on the row tile that starts there (SDK stub, tiling)
    q64 = nl.ndarray((128, 16), nl.float8_e4m3fn_x4)
    s64 = nl.ndarray((128, 16), nl.uint8)
    nisa.quantize_mx(q64[64:96], sbuf_from(np.ones((128, 64), BF16))[64:96], s64[64:96])
    nisa.nc_matmul_mx(pm, q64[64:96], q64[64:96], s64[64:96], s64[64:96],
                      tile_position=(64, 0), tile_size=(32, 128), accumulate=False)
    assert (pm.numpy() == 128).all()
    with pytest.raises(NkiError, match="starts at partition 64.*tile_position=\\(64, 0\\)"):
        nisa.nc_matmul_mx(pm, q64[64:96], q64[64:96], s64[64:96], s64[64:96])
    with pytest.raises(NkiError, match="row tile starts at row 64"):
        nisa.nc_matmul_mx(pm, q, q, s, s, tile_position=(64, 0), tile_size=(32, 128))
    pm2 = nl.ndarray((48, 16), nl.float32, buffer=nl.psum)
    with pytest.raises(NkiError, match="dst starts at partition 32"):
        nisa.nc_matmul_mx(pm2[32:48], q, q, s, s)
    with pytest.raises(NkiError, match="96 is not supported"):
        nisa.nc_matmul_mx(pm, q64[0:96], q64[0:96], s64[0:96], s64[0:96])
    with pytest.raises(NkiError, match="rows only"):
        nisa.nc_matmul_mx(pm, q, q, s, s, tile_position=(0, 0), tile_size=(32, 64))


def test_lnc2_divergent_barriers_fail_fast():
    def k(x):
        if nl.program_id(0) == 0:
            nisa.core_barrier(x, (0, 1))  # core 1 never comes

    t0 = time.perf_counter()
    with pytest.raises(interp.NkiBarrierError, match="core 1 returned"):
        nki.simulate(k, lnc=2)(np.zeros(4, np.float32))
    assert time.perf_counter() - t0 < 5

    def k2(x):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.memset(t, 0.0)
        if nl.program_id(0) == 1:
            raise ValueError("boom")
        nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=3)

    with pytest.raises(ValueError, match="boom"):
        nki.simulate(k2, lnc=2)(np.zeros(4, np.float32))


@pytest.mark.parametrize("elem,x4", [("e4m3", "float8_e4m3fn_x4"), ("e5m2", "float8_e5m2_x4")])
def test_dequantize_x4_matches_common_mx(elem, x4):
    """The interpreter's exact dequantization of packed x4 tiles equals common.mx.dequantize_mx."""
    import torch

    cmx = pytest.importorskip("common.mx")
    x = _edge_tile()
    x = np.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0)  # NaN groups compared separately
    words, scale = mxops.quantize_groups(x, elem, impl="common")
    ours = mxops.dequantize_x4(words, x4, scale, np.float64)  # [P, C, 4]
    P, C = words.shape
    g = ours.reshape(P // 8, 8, C, 4).transpose(0, 2, 1, 3).reshape(P // 8, C, 32)
    data = words.view(np.uint8).reshape(P // 8, 8, C, 4).transpose(0, 2, 1, 3).reshape(P // 8, C, 32)
    tdt = torch.float8_e4m3fn if elem == "e4m3" else torch.float8_e5m2
    ref = cmx.dequantize_mx(torch.from_numpy(np.ascontiguousarray(data)).view(tdt),
                            torch.from_numpy(scale[..., None].copy()), elem=elem,
                            dtype=torch.float64)
    np.testing.assert_array_equal(g, ref.numpy())
    nan_words = np.full((8, 1), 0x7F7F7F7F, np.uint32)
    assert np.isnan(mxops.dequantize_x4(nan_words, x4, np.array([[127]], np.uint8))).all()
    assert np.isnan(mxops.dequantize_x4(np.zeros((8, 1), np.uint32), x4,
                                        np.array([[255]], np.uint8))).all()


def test_simulate_dtype_round_trip_torch_and_numpy():
    import torch

    def k(x_bf16, ids_i32):
        out = nl.ndarray(x_bf16.shape, nl.bfloat16, buffer=nl.shared_hbm)
        ids = nl.ndarray(ids_i32.shape, nl.int32, buffer=nl.shared_hbm)
        sc = nl.ndarray((2, 3), nl.float8_e8m0fnu, buffer=nl.shared_hbm)
        t = nl.ndarray(x_bf16.shape, nl.bfloat16)
        nisa.dma_copy(t, x_bf16)
        nisa.activation(t, nl.copy, t, scale=2.0)
        nisa.dma_copy(out, t)
        i = nl.ndarray(ids_i32.shape, nl.int32)
        nisa.dma_copy(i, ids_i32)
        nisa.tensor_scalar(i, i, nl.add, 1)
        nisa.dma_copy(ids, i)
        s = nl.ndarray((2, 3), nl.uint8)
        nisa.memset(s, 127)
        nisa.dma_copy(sc.view(nl.uint8), s)
        return out, ids, sc

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    ids = torch.arange(4, dtype=torch.int32).reshape(4, 1)
    out, o_ids, sc = nki.simulate(k)(x, ids)
    assert out.dtype == torch.bfloat16 and torch.equal(out, x * 2)
    assert o_ids.dtype == torch.int32 and torch.equal(o_ids, ids + 1)
    assert sc.dtype == torch.float8_e8m0fnu and (sc.view(torch.uint8) == 127).all()
    out_np, ids_np, sc_np = nki.simulate(k)(x.view(torch.int16).numpy().view(BF16), ids.numpy())
    assert out_np.dtype == BF16
    np.testing.assert_array_equal(out_np.astype(np.float32), (x * 2).float().numpy())
    np.testing.assert_array_equal(ids_np, ids.numpy() + 1)
    assert sc_np.dtype == ml_dtypes.float8_e8m0fnu


def test_tensor_scalar_gpsimd_only_for_rsqrt():
    """SDK stub nisa.tensor_scalar: ``engine=gpsimd`` "(only allowed for rsqrt)"."""
    x = sbuf_from(np.full((32, 8), 4.0, np.float32))
    y = nl.ndarray((32, 8), nl.float32)
    for op in (nl.less, nl.greater, nl.multiply, nl.add):
        with pytest.raises(NkiError, match="gpsimd is only allowed for rsqrt"):
            nisa.tensor_scalar(y, x, op, 1.0, engine=nisa.engine.gpsimd)
    with pytest.raises(NkiError, match="gpsimd is only allowed for rsqrt"):
        nisa.tensor_scalar(y, x, nl.multiply, 2.0, op1=nl.add, operand1=1.0,
                           engine=nisa.engine.gpsimd)
    # (unary ops such as rsqrt are not modeled in tensor_scalar by this interpreter)
    nisa.tensor_scalar(y, x, nl.less, 5.0, engine=nisa.engine.vector)
    assert (y.numpy() == 1).all()


def test_kernel_arguments_must_be_nkiobjects_or_plain_values():
    """SDK language guide, Class Support: classes used by a kernel derive from NKIObject only;
    migration guide: list arguments must be tuples."""
    import dataclasses as dc

    from common.problem import ClampLimits
    from nki_kernels.config import KernelClampLimits

    def k(x, opt=None):
        return None

    @dc.dataclass
    class Plain:
        v: int = 1

    class Good(nl.NKIObject):
        def __init__(self):
            self.v = (1, 2.0, "s", None)

    sim = nki.simulate(k)
    sim(np.zeros(4, np.float32), opt=Good())
    sim(np.zeros(4, np.float32), opt=KernelClampLimits(linear_clamp_upper_limit=7.0))
    for bad, frag in ((Plain(), "does not derive from nl.NKIObject"),
                      (ClampLimits(), "does not derive from nl.NKIObject"),
                      ([1, 2], "NKI takes tuples"), ((1, Plain()), r"opt\[1\]")):
        with pytest.raises(NkiError, match=frag):
            sim(np.zeros(4, np.float32), opt=bad)


def test_program_ndim_outside_a_launch_names_the_launcher():
    with pytest.raises(NkiError, match="interp.simulate"):
        nl.program_ndim()
