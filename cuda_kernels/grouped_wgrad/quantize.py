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

Program ``(j, hb)`` handles atom column ``j`` (4 groups = 128 tokens of one expert) and rows
``[hb·BLOCK_H, (hb+1)·BLOCK_H)``. By default a tiny first kernel writes each column's (first token,
expert end, expert's first column, atom count) into an int32 table (``LAUNCH["table"]``; else each
program derives them from the offsets); programs past the experts' atoms only write zero scales
and the data padding. Nothing is read on the host in the hot path (CUDA
graph capturable with ``validate=False``); the grid depends on ``tokens_sum``, E and H only.

Element rounding: ``"integer"`` computes round-to-nearest-even with integer ops on the fp32 bits
(exact on every device, subnormals included, no reliance on FTZ settings or the interpreter's
casts); ``"native"`` multiplies by the power-of-two scale in fp32 and uses the hardware's saturating
FP8 conversion (``cvt.rn.satfinite``), cheaper on the GPU. ``"auto"``: native on CUDA for FP8,
integer otherwise (FP4 and the interpreter always use integer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.mx_atoms import ATOM_ROWS, round_up

from ..triton.launch import interpreting
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
# Launch configuration, every key selectable (benchmarks/bench_mx_quantize.py --sweep times the
# alternatives on a GPU and checks they write the same bytes):
#   block_h: rows of H per program (power of two, 32..512); num_warps;
#   table: 1 = a tiny kernel first writes each atom column's (first token, expert end, expert's
#     first atom column, atom count) into an int32 table that each program reads with 4 scalar
#     loads; 0 = every program derives them from the offsets (BLOCK_E-wide loads + cumsum);
# History: 128 rows / 4 warps beat 32 / 64 rows and 8 warps on the H200 (2026-12-01, table=0,
# the kernel of that date). Grouping the transposed tile as [BLOCK_H*4, 32] or
# reducing [4, 32, BLOCK_H] in the load's orientation compiled to the same SASS (sm_90, Triton
# 3.6), so only [BLOCK_H, 4, 32] is kept; compiling the whole column twice (aligned / not) rather
# than its store only raised registers to spilling (128 rows / 4 warps).
# H200, 2026-12-01 (`bench_mx_quantize.py --sweep`, 24 settings, floor rule): 64 rows / 4 warps
# with the table fastest on all six MoE shapes (1843 µs total vs 2095 for 128 / 4, 2383 for
# 32 / 4; 8 and 16 warps 1.6-3x slower); a variant storing 16-aligned columns through vector
# stores was 8-15 % slower in every setting and was removed.
_LAUNCH_DEFAULTS = {"block_h": 64, "num_warps": 4, "table": 1}
LAUNCH = dict(_LAUNCH_DEFAULTS)
BLOCK_H = _LAUNCH_DEFAULTS["block_h"]


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
def _expert_atoms(offs_ptr, S, E, BLOCK_E: tl.constexpr, TOK: tl.constexpr):
    """Per expert (padded to BLOCK_E): clamped token begins / ends, atom columns, inclusive cumsum
    of the atom columns (offsets clamped into [0, S]: memory-safe for any input)."""
    eidx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + eidx, mask=eidx < E, other=0)
    begins = tl.load(offs_ptr + eidx - 1, mask=(eidx >= 1) & (eidx < E), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), S)
    begins = tl.minimum(tl.maximum(begins, 0), S)
    counts = tl.maximum(ends - begins, 0)
    atoms = (counts + TOK - 1) // TOK
    return eidx, begins, ends, atoms, tl.cumsum(atoms, 0)


@triton.jit
def _atom_table_kernel(offs_ptr, tab_ptr, S, E, S_PAD, N_COLS,
                       BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, TOK: tl.constexpr):
    """``tab[j] = (tok0, end, start, n_at)`` of atom column j < N_COLS (the main kernel's grid
    columns): the expert's first atom column ``start`` and atom count ``n_at``, the column's first
    token ``tok0`` and the expert's token end. Columns past the experts' atoms get ``n_at = 0``,
    ``tok0 = S`` and ``end = S_PAD`` for the first of them (it writes the data padding), else S."""
    eidx, begins, ends, atoms, cum = _expert_atoms(offs_ptr, S, E, BLOCK_E, TOK)
    total = tl.sum(atoms, 0)
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    e = tl.sum((cum[None, :] <= j[:, None]).to(tl.int32), 1)
    sel = eidx[None, :] == e[:, None]
    start = tl.sum(tl.where(sel, (cum - atoms)[None, :], 0), 1)
    n_at = tl.sum(tl.where(sel, atoms[None, :], 0), 1)
    begin = tl.sum(tl.where(sel, begins[None, :], 0), 1)
    end = tl.sum(tl.where(sel, ends[None, :], 0), 1)
    pad = j >= total
    tok0 = tl.where(pad, S, begin + (j - start) * TOK)
    end = tl.where(pad, tl.where(j == total, S_PAD, S), end)
    start = tl.where(pad, j, start)
    n_at = tl.where(pad, 0, n_at)
    ok = j < N_COLS
    tl.store(tab_ptr + 4 * j, tok0, mask=ok)
    tl.store(tab_ptr + 4 * j + 1, end, mask=ok)
    tl.store(tab_ptr + 4 * j + 2, start, mask=ok)
    tl.store(tab_ptr + 4 * j + 3, n_at, mask=ok)


@triton.jit
def _codes_and_scales(xb, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                      EMAX: tl.constexpr, MAXV: tl.constexpr, MAXCODE: tl.constexpr,
                      NANCODE: tl.constexpr, RCEIL: tl.constexpr, NATIVE: tl.constexpr,
                      AXIS: tl.constexpr):
    """Element codes (int32, shape of ``xb``) and E8M0 scale bytes (``xb`` reduced along AXIS) of
    the fp32 bits ``xb`` whose axis AXIS (size SF) is one MX group."""
    mag = xb & 0x7FFFFFFF
    amax = tl.max(mag, axis=AXIS)
    bad = amax >= 0x7F800000  # NaN / Inf in the group (integer max of magnitudes: exact)
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
    e3 = tl.expand_dims(ex, AXIS)
    bad3 = tl.expand_dims(bad, AXIS)
    if NATIVE:
        pw = ((127 - e3) << 23).to(tl.float32, bitcast=True)
        v = xb.to(tl.float32, bitcast=True) * pw
        v = tl.minimum(tl.maximum(v, -MAXV), MAXV)
        if EBITS == 4:
            c8 = v.to(tl.float8e4nv)
        else:
            c8 = v.to(tl.float8e5)
        codes = c8.to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        codes = _round_codes(xb, e3, EBITS, MBITS, BIAS, MAXCODE)
        codes = codes | (((xb >> 31) & 1) << (EBITS + MBITS))
    codes = tl.where(bad3, NANCODE, codes)
    return codes, byte


@triton.jit
def _quant_kernel(
    x_ptr, offs_ptr, tab_ptr, data_ptr, scale_ptr,
    S, H, E, stride_x, stride_d, S_PAD, M_PAD, N_ATOMS,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SF: tl.constexpr,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, EMAX: tl.constexpr,
    MAXV: tl.constexpr, MAXCODE: tl.constexpr, NANCODE: tl.constexpr,
    RCEIL: tl.constexpr, FP4: tl.constexpr, NATIVE: tl.constexpr,
    TABLE: tl.constexpr, IDX64: tl.constexpr,
):
    TOK: tl.constexpr = 4 * SF
    j = tl.program_id(0)
    hb = tl.program_id(1)
    # ---- atom column j: first token, the expert's token end, its atom columns [start, +n_at)
    if TABLE:
        tok0 = tl.load(tab_ptr + 4 * j)
        end = tl.load(tab_ptr + 4 * j + 1)
        start = tl.load(tab_ptr + 4 * j + 2)
        n_at = tl.load(tab_ptr + 4 * j + 3)
    else:
        eidx, begins, ends, atoms, cum = _expert_atoms(offs_ptr, S, E, BLOCK_E, TOK)
        total = tl.sum(atoms, 0)
        e = tl.sum((cum <= j).to(tl.int32), 0)
        sel = eidx == e
        pad = j >= total
        start = tl.sum(tl.where(sel, cum - atoms, 0), 0)
        n_at = tl.sum(tl.where(sel, atoms, 0), 0)
        begin = tl.sum(tl.where(sel, begins, 0), 0)
        end = tl.sum(tl.where(sel, ends, 0), 0)
        tok0 = tl.where(pad, S, begin + (j - start) * TOK)
        end = tl.where(pad, tl.where(j == total, S_PAD, S), end)
        start = tl.where(pad, j, start)
        n_at = tl.where(pad, 0, n_at)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    if IDX64:
        h_row = h.to(tl.int64) * stride_d
    else:
        h_row = h * stride_d
    st_h = (h < H)[:, None]
    # ---- scales: expert's atom matrix [M_PAD, 4 * n_at] at byte M_PAD * 4 * start (padding
    # columns: zero bytes, one atom column each, while it fits the scale tensor)
    is_pad = n_at == 0
    n_sc = tl.maximum(n_at, 1)
    fits = (start + n_sc) <= N_ATOMS
    sc_rows = (h < M_PAD)[:, None] & fits
    if IDX64:
        sc_off = (M_PAD.to(tl.int64) * 4 * start + ((h // 128) * n_sc + (j - start)).to(tl.int64)
                  * 512 + (h % 32) * 16 + ((h % 128) // 32) * 4)
    else:
        sc_off = (M_PAD * 4 * start + ((h // 128) * n_sc + (j - start)) * 512 + (h % 32) * 16
                  + ((h % 128) // 32) * 4)
    sc_ptr = scale_ptr + sc_off[:, None] + tl.arange(0, 4)[None, :]

    if is_pad:
        tl.store(sc_ptr, tl.zeros((BLOCK_H, 4), tl.uint8), mask=sc_rows)
        # data padding columns [S, S_PAD) (end == S_PAD on the first padding column only)
        # (names of their own: a name bound in both arms of this runtime `if` must keep one type)
        if FP4:
            tz = S // 2 + tl.arange(0, SF // 2)
            tl.store(data_ptr + h_row[:, None] + tz[None, :], tl.zeros((BLOCK_H, SF // 2), tl.uint8),
                     mask=st_h & (tz < end // 2)[None, :])
        else:
            tz = S + tl.arange(0, SF)
            tl.store(data_ptr + h_row[:, None] + tz[None, :], tl.zeros((BLOCK_H, SF), tl.uint8),
                     mask=st_h & (tz < end)[None, :])
    else:
        t = tok0 + tl.arange(0, TOK)
        ld = (t < end)[:, None] & (h < H)[None, :]
        if IDX64:
            x_off = t.to(tl.int64)[:, None] * stride_x + h[None, :]
        else:
            x_off = t[:, None] * stride_x + h[None, :]
        x = tl.load(x_ptr + x_off, mask=ld, other=0.0)
        xb = x.to(tl.int16, bitcast=True).to(tl.int32) << 16  # exact fp32 bits of the BF16 values
        g = tl.reshape(tl.trans(xb), (BLOCK_H, 4, SF))  # [rows, groups, tokens of a group]
        codes, byte = _codes_and_scales(g, EBITS, MBITS, BIAS, EMAX, MAXV, MAXCODE, NANCODE,
                                        RCEIL, NATIVE, 2)
        codes = tl.reshape(codes, (BLOCK_H, TOK))
        tl.store(sc_ptr, byte.to(tl.uint8), mask=sc_rows)

        lim = tl.minimum(end, tok0 + TOK)  # this column's tokens: [tok0, lim)
        if FP4:
            lo, hi = tl.split(tl.reshape(codes, (BLOCK_H, TOK // 2, 2)))
            packed = (lo | (hi << 4)).to(tl.uint8)
            tp = tok0 // 2 + tl.arange(0, TOK // 2)
            tl.store(data_ptr + h_row[:, None] + tp[None, :], packed,
                     mask=st_h & (tp < lim // 2)[None, :])
        else:
            tl.store(data_ptr + h_row[:, None] + t[None, :], codes.to(tl.uint8),
                     mask=st_h & (t < lim)[None, :])


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

    if x_SH.device.type != "cuda" and not interpreting():
        raise RuntimeError("quantize_wgrad_operand: the Triton kernel needs CUDA tensors (or "
                           "TRITON_INTERPRET=1 set before importing triton, for CPU tensors)")
    native = rounding == "native" or (rounding == "auto" and x_SH.device.type == "cuda")
    if fp4 or interpreting():
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
        cfg = {**_LAUNCH_DEFAULTS, **LAUNCH}
        block_h, num_warps = cfg["block_h"], cfg["num_warps"]
        if block_h not in (32, 64, 128, 256, 512):
            raise _err(f"bad LAUNCH {LAUNCH}: block_h must be a power of two in 32..512")
        n_cols = n_atoms + 1  # + one padding column (data padding, any atoms left unused)
        block_e = triton.next_power_of_2(max(num_experts, 2))
        # the main kernel reads BLOCK_E only without the table (one compile for every E with it)
        block_e_main = 2 if cfg["table"] else block_e
        tab = offsets_E  # unused by the kernel without the table
        if cfg["table"]:
            tab = torch.empty((n_cols, 4), dtype=torch.int32, device=x_SH.device)
            block_j = max(16, min(256, 8192 // block_e))
            _atom_table_kernel[(triton.cdiv(n_cols, block_j),)](
                offsets_E, tab, tokens_sum, num_experts, s_pad, n_cols,
                BLOCK_E=block_e, BLOCK_J=block_j, TOK=4 * SF_VEC, num_warps=4)
        # 32-bit offsets where every byte offset fits (x, data and scales)
        idx64 = max((tokens_sum + 4 * SF_VEC) * x_SH.stride(0) + hidden,
                    (m_pad + block_h) * buf.stride(0) + s_pad,
                    (m_pad + block_h) * 4 * (n_cols + 1)) >= 2**31
        grid = (n_cols, triton.cdiv(m_pad, block_h))
        _quant_kernel[grid](
            x_SH, offsets_E, tab, buf, scales,
            tokens_sum, hidden, num_experts, x_SH.stride(0), buf.stride(0), s_pad, m_pad, n_atoms,
            BLOCK_E=block_e_main, BLOCK_H=block_h, SF=SF_VEC,
            EBITS=ebits, MBITS=mbits, BIAS=bias, EMAX=emax, MAXV=maxv, MAXCODE=maxcode,
            NANCODE=nancode, RCEIL=scale_rule == "rceil", FP4=fp4, NATIVE=native,
            TABLE=bool(cfg["table"]),
            IDX64=idx64, num_warps=num_warps,
        )
    storage = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8}[elem]
    return buf.view(storage)[:, : tokens_sum // pack], scales.view(torch.float8_e8m0fnu)
