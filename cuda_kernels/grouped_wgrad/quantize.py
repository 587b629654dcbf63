"""GPU quantizer of grouped-wgrad operands: token-major BF16 rows → MX data K-major along tokens.

One Triton kernel reads ``x_SH`` (X or dY rows of the grouped layout, ``[tokens_sum, H]`` BF16) and
the int32 ``offsets_E`` (cumulative token ends per expert, on the device) and writes:

* data ``[H, S]`` K-major along tokens: FP8 E4M3 / E5M2 bytes, or FP4 E2M1 packed two tokens per
  byte (even token in the low nibble, MXFP4); the buffer is ``[H, round_up(S, 32)]`` elements so
  rows are 16-byte aligned for TMA, and its padding columns are written with zeros;
* E8M0 scales ``[round_up(H, 128), scale_cols]`` in the K-grouped 128×4 atom layout of
  :mod:`common.mx_atoms` (cuDNN's layout), padding bytes written with 0.

One MX group is 32 consecutive tokens of one expert; an expert's last partial group is quantized as
if zero-padded (groups never straddle two experts). Every byte equals :func:`common.mx.quantize_mx`
on the zero-padded group (twin: :func:`.blockscaled_ref.quantize_wgrad_operand_torch`), for the
``"ocp"`` (OCP v1.0 floor, torchao FLOOR) and ``"rceil"`` (Blackwell / cuBLAS, torchao RCEIL)
scale rules, NaN / Inf groups included (scale byte 255, FP8 elements NaN 0x7F, FP4 elements 0).

Program ``(j, hb)`` handles atom column ``j`` (4 groups = 128 tokens of one expert, found from the
offsets inside the kernel) and rows ``[hb·BLOCK_H, (hb+1)·BLOCK_H)``; programs past the experts'
atoms write zero scales and the data padding. Nothing is read on the host in the hot path (CUDA
graph capturable with ``validate=False``); the grid depends on ``tokens_sum``, E and H only.

Element rounding: ``"integer"`` computes round-to-nearest-even with integer ops on the fp32 bits
(exact on every device, subnormals included, no reliance on FTZ settings or the interpreter's
casts); ``"native"`` multiplies by the power-of-two scale in fp32 and uses the hardware's saturating
FP8 conversion (``cvt.rn.satfinite``), cheaper on the GPU. ``"auto"``: native on CUDA for FP8,
integer otherwise (FP4 and the interpreter always use integer).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.mx_atoms import ATOM_ROWS, round_up

from . import validate as validate_mod
from .validate import QUANT_ELEMS, QUANT_SCALE_RULES, QUANT_SF_VEC

__all__ = ["QUANT_ELEMS", "QUANT_ROUNDING", "QUANT_SCALE_RULES", "quantize_wgrad_operand"]

QUANT_ROUNDING = ("auto", "integer", "native")
SF_VEC = QUANT_SF_VEC  # QUANT_ELEMS, QUANT_SCALE_RULES: validate.py (shared with the twin)
# per element format: (exponent bits, mantissa bits, bias, OCP emax, max value, max code, NaN code)
# Source: OCP MX v1.0 Table 1 / OFP8 (common/mx.ELEMENT_FORMATS); NaN codes as torch's casts give.
_FMT = {
    "e4m3": (4, 3, 7, 8, 448.0, 0x7E, 0x7F),
    "e5m2": (5, 2, 15, 15, 57344.0, 0x7B, 0x7F),
    "e2m1": (2, 1, 1, 2, 6.0, 0x7, 0x0),
}
_ELEM_ID = {"e4m3": 0, "e5m2": 1, "e2m1": 2}
BLOCK_H = 128  # default rows per program; divides 128 so every scale row block is whole
# Launch configuration (rows per program: 32, 64 or 128; warps). benchmarks/bench_mx_quantize.py
# --sweep times the alternatives on a GPU and checks they give the same bytes: on the H200
# (2026-12-01) 128 rows / 4 warps was fastest on every shape (1.6x the 32 / 4 it replaced).
LAUNCH = {"block_h": BLOCK_H, "num_warps": 4}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _round_codes(xb, e, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 MAXCODE: tl.constexpr):
    """Saturating RNE codes (sign excluded) of ``|x| * 2^-e`` from fp32 bits ``xb`` (int32)."""
    a = xb & 0x7FFFFFFF
    ef = a >> 23
    m = tl.where(ef > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
    ex = tl.where(ef > 0, ef - 150, -149)  # |x| = m * 2^ex
    fl2m = ((m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exact, m < 2^24
    vexp = fl2m + ex - e  # floor(log2 |v|)
    qe = tl.maximum(vexp, 1 - BIAS) - MBITS  # quantum exponent of |v|'s binade
    sh = qe - (ex - e)  # right shift taking m to units of the quantum (>= -MBITS)
    shc = tl.minimum(tl.maximum(sh, 1), 30)
    half = (tl.full(sh.shape, 1, tl.int32) << (shc - 1))
    rnd = (m + half - 1 + ((m >> shc) & 1)) >> shc
    n = tl.where(sh > 0, rnd, m << tl.maximum(-sh, 0))
    code = n + ((qe - (1 - BIAS - MBITS)) << MBITS)
    code = tl.where(m == 0, 0, code)
    return tl.minimum(code, MAXCODE)


@triton.jit
def _quant_kernel(
    x_ptr, offs_ptr, data_ptr, scale_ptr,
    S, H, E, stride_x, stride_d, S_PAD, M_PAD, N_ATOMS,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SF: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, EMAX: tl.constexpr,
    MAXV: tl.constexpr, MAXCODE: tl.constexpr, NANCODE: tl.constexpr,
    RCEIL: tl.constexpr, FP4: tl.constexpr, NATIVE: tl.constexpr,
):
    TOK: tl.constexpr = 4 * SF
    j = tl.program_id(0)
    hb = tl.program_id(1)
    # ---- which expert owns atom column j (offsets clamped into [0, S]: memory-safe for any input)
    eidx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + eidx, mask=eidx < E, other=0)
    begins = tl.load(offs_ptr + eidx - 1, mask=(eidx >= 1) & (eidx < E), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), S)
    begins = tl.minimum(tl.maximum(begins, 0), S)
    counts = tl.maximum(ends - begins, 0)
    atoms = (counts + TOK - 1) // TOK
    cum = tl.cumsum(atoms, 0)
    total = tl.sum(atoms, 0)
    e = tl.sum((cum <= j).to(tl.int32), 0)
    sel = eidx == e
    is_pad = j >= total
    start = tl.sum(tl.where(sel, cum - atoms, 0), 0)
    n_at = tl.sum(tl.where(sel, atoms, 0), 0)
    begin = tl.sum(tl.where(sel, begins, 0), 0)
    end = tl.sum(tl.where(sel, ends, 0), 0)
    start = tl.where(is_pad, j, start)
    n_at = tl.where(is_pad, 1, n_at)
    loc = j - start
    tok0 = tl.where(is_pad, S, begin + loc * TOK)
    ld_end = tl.where(is_pad, S, end)
    st_end = tl.where(is_pad, tl.where(j == total, S_PAD, S), end)

    t = tok0 + tl.arange(0, TOK)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    ld = (t < ld_end)[:, None] & (h < H)[None, :]
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + h[None, :], mask=ld, other=0.0)
    xb = x.to(tl.int16, bitcast=True).to(tl.int32) << 16  # exact fp32 bits of the BF16 values
    xb = tl.reshape(tl.trans(xb), (BLOCK_H, 4, SF))

    # ---- per-group scale exponent (integer max of magnitudes: exact, NaN/Inf detected by bits)
    mag = xb & 0x7FFFFFFF
    amax = tl.max(mag, axis=2)  # [BLOCK_H, 4]
    bad = amax >= 0x7F800000
    if RCEIL:
        q = tl.math.div_rn(amax.to(tl.float32, bitcast=True), MAXV).to(tl.int32, bitcast=True)
        qf = q >> 23
        ce = tl.where(qf > 0, qf - 127 + ((q & 0x7FFFFF) != 0).to(tl.int32),
                      tl.where(q > 0x400000, -126, -127))
        ex = tl.where(q > 0, ce, -127)
    else:
        af = amax >> 23
        ex = tl.where(af > 0, af - 127 - EMAX, -127)
    ex = tl.maximum(ex, -127)
    ex = tl.where(bad, 0, ex)
    byte = tl.where(bad, 255, ex + 127)

    # ---- elements
    e3 = ex[:, :, None]
    if NATIVE:
        pw = ((127 - e3) << 23).to(tl.float32, bitcast=True)
        v = xb.to(tl.float32, bitcast=True) * pw
        v = tl.minimum(tl.maximum(v, -MAXV), MAXV)
        if EBITS == 4:
            c8 = v.to(tl.float8e4nv)
        else:
            c8 = v.to(tl.float8e5)
        codes = c8.to(tl.uint8, bitcast=True).to(tl.int32)
        codes = tl.where(bad[:, :, None], NANCODE, codes)
    else:
        codes = _round_codes(xb, e3, EBITS, MBITS, BIAS, MAXCODE)
        sign = (xb >> 31) & 1
        codes = codes | (sign << (EBITS + MBITS))
        codes = tl.where(bad[:, :, None], NANCODE, codes)
    codes = tl.reshape(codes, (BLOCK_H, TOK))

    st_h = (h < H)[:, None]
    if FP4:
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_H, TOK // 2, 2)))
        packed = (lo | (hi << 4)).to(tl.uint8)
        tp = tok0 // 2 + tl.arange(0, TOK // 2)
        st = st_h & (tp < st_end // 2)[None, :]
        tl.store(data_ptr + h.to(tl.int64)[:, None] * stride_d + tp[None, :], packed, mask=st)
    else:
        st = st_h & (t < st_end)[None, :]
        tl.store(data_ptr + h.to(tl.int64)[:, None] * stride_d + t[None, :],
                 codes.to(tl.uint8), mask=st)

    # ---- scales: expert's atom matrix [M_PAD, 4 * n_at] at byte M_PAD * 4 * start
    c = tl.arange(0, 4)
    r = h
    off = (M_PAD.to(tl.int64) * 4 * start + ((r // 128) * n_at + loc).to(tl.int64) * 512
           + (r % 32) * 16 + ((r % 128) // 32) * 4)
    fits = (start + n_at) <= N_ATOMS
    tl.store(scale_ptr + off[:, None] + c[None, :], byte.to(tl.uint8),
             mask=(r < M_PAD)[:, None] & fits)


def _alloc(shape, device) -> torch.Tensor:
    """Output buffers (uint8); the tests replace it to poison every byte before the kernel."""
    return torch.empty(shape, dtype=torch.uint8, device=device)


def _err(msg: str) -> ValueError:
    return ValueError(f"quantize_wgrad_operand: {msg}")


def quantize_wgrad_operand(
    x_SH: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    elem: str = "e4m3",
    scale_rule: str = "ocp",
    scale_cols: int | None = None,
    validate: bool = True,
    rounding: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize token-major rows to the MX wgrad operand (K-major along tokens) in one kernel.

    Dimensions: S tokens_sum, H the operand's rows (hidden for X, intermediate for dY), E experts.

    Args:
        x_SH: [S, H] bfloat16, unit stride along H (row stride free), CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        offsets_E: [E] int32 on x's device, cumulative token ends: non-decreasing, last == S; any
            count per expert (0 included); even counts for ``elem="e2m1"``.
        elem: "e4m3" | "e5m2" (MXFP8) | "e2m1" (MXFP4, packed two tokens per byte).
        scale_rule: "ocp" (OCP v1.0 floor) | "rceil" (Blackwell / cuBLAS).
        scale_cols: columns of the scale tensor, a multiple of 4 that holds every expert's padded
            scales (``common.mx_atoms.grouped_scale_cols``); default
            ``grouped_scale_cols_bound(S, E, 32)``, which fits every split; cuDNN-aligned counts
            (multiples of 128) fit ``round_up(ceil(S/32), 4)``, cuDNN's own shape.
        validate: check the offsets' values on the host (one device sync). With False nothing is
            read on the host (graph capturable); out-of-contract offsets then give unspecified
            bytes but never an out-of-bounds access.
        rounding: "auto" | "integer" | "native" (module docstring).

    Returns:
        (data, scales): data [H, S] ``float8_e4m3fn`` / ``float8_e5m2`` (or uint8 [H, S/2] for
        e2m1), a view with row stride ``round_up(S, 32)`` (elements; bytes for FP4: half) of a
        buffer whose padding columns are zero; scales ``float8_e8m0fnu`` [round_up(H, 128),
        scale_cols], contiguous, every padding byte 0. Feed ``(data, scales)`` as A / ``sfa`` and
        the dY operand's ``(data.t(), scales)`` as B / ``sfb``.

    Raises:
        ValueError: any rule above, before anything is written.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if rounding not in QUANT_ROUNDING:
        raise _err(f"rounding must be one of {QUANT_ROUNDING}; got {rounding!r}")

    def layout_check() -> None:  # the kernel's own layout rules (the twin reads any strides)
        if x_SH.shape[1] > 1 and x_SH.stride(1) != 1:
            raise _err(f"x_SH needs unit stride along H; got strides {tuple(x_SH.stride())}")
        if not offsets_E.is_contiguous():
            raise _err("offsets_E must be contiguous")

    scale_cols = validate_mod.check_quantize_args(
        x_SH, offsets_E, elem=elem, scale_rule=scale_rule, scale_cols=scale_cols,
        validate=validate, fn="quantize_wgrad_operand", layout_check=layout_check)
    tokens_sum, hidden = x_SH.shape
    num_experts = offsets_E.numel()
    fp4 = elem == "e2m1"

    if x_SH.device.type != "cuda" and not _interpreting():
        raise RuntimeError("quantize_wgrad_operand: the Triton kernel needs CUDA tensors (or "
                           "TRITON_INTERPRET=1 set before importing triton, for CPU tensors)")
    native = rounding == "native" or (rounding == "auto" and x_SH.device.type == "cuda")
    if fp4 or _interpreting():
        if rounding == "native":
            raise _err("rounding='native' needs FP8 on a CUDA device (compiled Triton)")
        native = False
    pack = 2 if fp4 else 1
    s_pad = round_up(tokens_sum, 32)
    m_pad = round_up(hidden, ATOM_ROWS)
    buf = _alloc((hidden, s_pad // pack), x_SH.device)
    scales = _alloc((m_pad, scale_cols), x_SH.device)
    n_atoms = scale_cols // 4
    if m_pad:
        ebits, mbits, bias, emax, maxv, maxcode, nancode = _FMT[elem]
        block_h, num_warps = LAUNCH["block_h"], LAUNCH["num_warps"]
        if 128 % block_h:
            raise _err(f"LAUNCH['block_h'] must divide 128, got {block_h}")
        grid = (n_atoms + 1, m_pad // block_h)
        _quant_kernel[grid](
            x_SH, offsets_E, buf, scales,
            tokens_sum, hidden, num_experts, x_SH.stride(0), buf.stride(0), s_pad, m_pad, n_atoms,
            BLOCK_E=triton.next_power_of_2(max(num_experts, 2)), BLOCK_H=block_h, SF=SF_VEC,
            EBITS=ebits, MBITS=mbits, BIAS=bias, EMAX=emax, MAXV=maxv, MAXCODE=maxcode,
            NANCODE=nancode, RCEIL=scale_rule == "rceil", FP4=fp4, NATIVE=native,
            num_warps=num_warps,
        )
    storage = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8}[elem]
    return buf.view(storage)[:, : tokens_sum // pack], scales.view(torch.float8_e8m0fnu)
