"""Torch twin of the block-scaled (MXFP8 / MXFP4 / NVFP4) grouped weight gradient and its operands.

Dimensions:
    M rows of A (hidden), N rows of B^T (intermediate), S tokens_sum (the grouped contraction K),
    E experts. Legend in ``common/shapes.py``.

Operation (seed ``grouped_gemm_wgrad_sm100.md``, "Operation" and "Block-scaled contract"): for
expert ``e`` with tokens ``[begin, end)`` (``begin = offsets_E[e-1]``, 0 for ``e = 0``)::

    out[e] = gs_a[e] * gs_b[e] * ( deq(A)[:, begin:end] @ deq(B)[begin:end, :] )

with ``deq`` the MX / NVFP4 decoding of :mod:`common.mx` (element value times its group's scale),
the sum over tokens in fp32, and ``gs_a[e] * gs_b[e]`` (NVFP4 only: the per-expert fp32 global
scales, multiplied in the epilogue as ``(gs_a[e] * gs_b[e]) * acc``; 1 otherwise).

Groups: expert ``e``'s ``g``-th scale group holds its tokens ``[begin + g·sf, min(begin + (g+1)·sf,
end))`` (a partial last group stands for a zero-padded one; groups never straddle two experts).
Scales are in the K-grouped 128×4 atom layout of :mod:`common.mx_atoms` (cuDNN's layout).

Formats (``sf_vec_size``, scale dtype): FP8 E4M3/E5M2 data with E8M0 scales at 32 (MXFP8), FP4
E2M1 (two per uint8 along tokens, even token in the low nibble, or ``torch.float4_e2m1fn_x2``) with
E4M3 scales at 16 plus ``global_scale_a/b`` (NVFP4), or FP4 with E8M0 scales at 32 (MXFP4).
"""

from __future__ import annotations

import torch

from common import mx
from common.mx_atoms import (
    ATOM_ROWS,
    grouped_scale_cols,
    pack_grouped_scales,
    round_up,
    unpack_grouped_scales,
)

from . import validate
from .validate import QUANT_SF_VEC

__all__ = [
    "BLOCKSCALED_FORMATS",
    "OUT_DTYPES",
    "blockscaled_format",
    "dequantize_wgrad_operand",
    "grouped_wgrad_blockscaled_torch",
    "quantize_wgrad_operand_torch",
]

# (data kind, scale dtype, sf_vec_size) → format name. Source: the seed's block-scaled contract
# and cuDNN frontend's ``is_valid_dtypes_and_scale_factor_vec_size`` (FP8 only with E8M0 at 32,
# E4M3 scales only at 16).
BLOCKSCALED_FORMATS = {
    ("e4m3", torch.float8_e8m0fnu, 32): "mxfp8",
    ("e5m2", torch.float8_e8m0fnu, 32): "mxfp8",
    ("e2m1", torch.float8_e8m0fnu, 32): "mxfp4",
    ("e2m1", torch.float8_e4m3fn, 16): "nvfp4",
}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP4_DTYPES = (torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.uint8))
_ELEM_OF = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _err(msg: str) -> ValueError:
    return ValueError(f"grouped_wgrad_blockscaled: {msg}")


def _elem(t: torch.Tensor, name: str) -> str:
    if not isinstance(t, torch.Tensor):
        raise _err(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype in _ELEM_OF:
        return _ELEM_OF[t.dtype]
    if t.dtype in _FP4_DTYPES:
        return "e2m1"
    raise _err(f"{name} must be float8_e4m3fn / float8_e5m2 or packed FP4 (uint8 / "
               f"float4_e2m1fn_x2); got {t.dtype}")


def blockscaled_format(a, b, sfa, sfb, sf_vec_size=None) -> tuple[str, str, int]:
    """(format name, element name, sf_vec_size) of an operand pair, or ValueError."""
    ea, eb = _elem(a, "a_tensor"), _elem(b, "b_tensor")
    if ea != eb or (ea != "e2m1" and a.dtype != b.dtype):
        raise _err(f"a_tensor and b_tensor need one element format; got {a.dtype} and {b.dtype}")
    for name, s in (("sfa_tensor", sfa), ("sfb_tensor", sfb)):
        if not isinstance(s, torch.Tensor):
            raise _err(f"{name} is required for block-scaled operands; got {type(s).__name__}")
    if sfa.dtype != sfb.dtype:
        raise _err(f"sfa_tensor and sfb_tensor need one dtype; got {sfa.dtype} and {sfb.dtype}")
    if sf_vec_size is None:
        sf_vec_size = 16 if sfa.dtype == torch.float8_e4m3fn else 32
    fmt = BLOCKSCALED_FORMATS.get((ea, sfa.dtype, sf_vec_size))
    if fmt is None:
        allowed = ", ".join(f"{k[0]} + {k[1]} @ {k[2]}" for k in BLOCKSCALED_FORMATS)
        raise _err(f"unsupported combination: elements {ea}, scales {sfa.dtype}, sf_vec_size="
                   f"{sf_vec_size} (supported: {allowed})")
    return fmt, ea, sf_vec_size


def _check_offsets(offsets_E: torch.Tensor, tokens_sum: int, fp4: bool) -> list[int]:
    if not isinstance(offsets_E, torch.Tensor) or offsets_E.dim() != 1 or \
            offsets_E.dtype != torch.int32:
        raise _err("offsets_tensor must be a rank-1 int32 tensor")
    if offsets_E.numel() == 0:
        raise _err("offsets_tensor must hold at least one expert")
    return validate.host_offset_ends(offsets_E, tokens_sum, arg="offsets_tensor", err=_err,
                                     even=fp4)


def _check_scales(sf, rows, offsets_E, sf_vec, name) -> None:
    _, _, need = grouped_scale_cols(offsets_E, sf_vec)
    rp = round_up(rows, ATOM_ROWS)
    if sf.dim() != 2 or sf.shape[0] != rp or sf.shape[1] % 4 or sf.shape[1] < need:
        raise _err(f"{name} must be [round_up(rows,128)={rp}, cols] with cols a multiple of 4 and "
                   f">= {need} (the experts' padded scale columns; {name} of cuDNN-aligned counts: "
                   f"tokens_sum / sf_vec_size); got {tuple(sf.shape)}")
    if not sf.is_contiguous():
        raise _err(f"{name} must be contiguous (atom layout); got strides {tuple(sf.stride())}")


def grouped_wgrad_blockscaled_torch(
    a_tensor: torch.Tensor,
    b_tensor: torch.Tensor,
    sfa_tensor: torch.Tensor,
    sfb_tensor: torch.Tensor,
    offsets_tensor: torch.Tensor,
    *,
    sf_vec_size: int | None = None,
    global_scale_a: torch.Tensor | None = None,
    global_scale_b: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Block-scaled grouped weight gradient in torch (the definition the kernels are tested against).

    Dimensions: M hidden, N intermediate, S tokens_sum, E experts.

    Args:
        a_tensor: [M, S] FP8 (E4M3 / E5M2), or FP4 [M, S/2] uint8 (two tokens per byte, even token
            in the low nibble). A = X_sorted^T. Any strides, any device.
        b_tensor: [S, N] same format as A, or FP4 [S/2, N] packed along tokens. B = dY_sorted.
        sfa_tensor: [round_up(M,128), cols] contiguous, A's scales in the K-grouped 128×4 atom
            layout (``common/mx_atoms``); float8_e8m0fnu (MX) or float8_e4m3fn (NVFP4).
        sfb_tensor: [round_up(N,128), cols'] likewise for B (rows = N).
        offsets_tensor: [E] int32 cumulative token ends; non-decreasing, last == S; any count per
            expert (0 included); even for FP4.
        sf_vec_size: tokens per scale group: 32 (MXFP8, MXFP4) or 16 (NVFP4); default from the
            scale dtype.
        global_scale_a, global_scale_b: [E] float32, required for NVFP4 and forbidden otherwise.
        out: optional [E, M, N] bf16 / fp16 / fp32 output written in place; required when
            ``accumulate``.
        accumulate: ``out[e] = out[e] + result`` (the sum in fp32, rounded once); an empty expert
            leaves ``out[e]`` untouched. Otherwise an empty expert's ``out[e]`` is zero.
        out_dtype: dtype of an allocated output (default float32).

    Returns:
        [E, M, N] tensor (``out`` when given).

    Raises:
        ValueError: every rule above, before anything is written.

    Notes:
        Scale entries outside an expert's ``[M, c_e]`` region (row padding up to 128, column
        padding to 4, trailing columns) are never read, whatever they hold. Reads ``offsets`` on
        the host (not CUDA-graph capturable): this is the reference, not a kernel.
    """
    fmt, elem, sf_vec = blockscaled_format(a_tensor, b_tensor, sfa_tensor, sfb_tensor, sf_vec_size)
    fp4 = elem == "e2m1"
    if a_tensor.dim() != 2 or b_tensor.dim() != 2:
        raise _err(f"a_tensor and b_tensor must be rank-2; got {tuple(a_tensor.shape)} and "
                   f"{tuple(b_tensor.shape)}")
    pack = 2 if fp4 else 1
    m, tokens_sum = a_tensor.shape[0], a_tensor.shape[1] * pack
    n = b_tensor.shape[1]
    if b_tensor.shape[0] * pack != tokens_sum:
        raise _err(f"token dims differ: a_tensor has S={tokens_sum}, b_tensor has "
                   f"S={b_tensor.shape[0] * pack}")
    devices = {t.device for t in (a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor)
               if isinstance(t, torch.Tensor)}
    for t in (global_scale_a, global_scale_b, out):
        if isinstance(t, torch.Tensor):
            devices.add(t.device)
    if len(devices) != 1:
        raise _err(f"tensors on mixed devices {sorted(map(str, devices))}")
    ends = _check_offsets(offsets_tensor, tokens_sum, fp4)
    num_experts = len(ends)
    _check_scales(sfa_tensor, m, ends, sf_vec, "sfa_tensor")
    _check_scales(sfb_tensor, n, ends, sf_vec, "sfb_tensor")
    if fmt == "nvfp4":
        for name, g in (("global_scale_a", global_scale_a), ("global_scale_b", global_scale_b)):
            if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or \
                    tuple(g.shape) != (num_experts,):
                raise _err(f"NVFP4 needs {name} as a float32 tensor of shape ({num_experts},)")
    elif global_scale_a is not None or global_scale_b is not None:
        raise _err(f"global_scale_a / global_scale_b belong to NVFP4 only; got {fmt}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (num_experts, m, n):
            raise _err(f"out must have shape {(num_experts, m, n)}")
        if out.dtype not in OUT_DTYPES:
            raise _err(f"out dtype {out.dtype} not in {OUT_DTYPES}")
        out_dtype = out.dtype
    elif accumulate:
        raise _err("accumulate=True needs an initialized out tensor")
    out_dtype = torch.float32 if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise _err(f"out_dtype {out_dtype} not in {OUT_DTYPES}")

    sfa_e = unpack_grouped_scales(sfa_tensor, m, ends, sf_vec)
    sfb_e = unpack_grouped_scales(sfb_tensor, n, ends, sf_vec)
    a_u8 = a_tensor.view(torch.uint8) if fp4 else a_tensor
    b_u8 = b_tensor.view(torch.uint8) if fp4 else b_tensor
    if out is None:
        out = torch.empty((num_experts, m, n), dtype=out_dtype, device=a_tensor.device)
    begin = 0
    for e, end in enumerate(ends):
        if end == begin:
            if not accumulate:
                out[e].zero_()
            continue
        a_deq = _dequant_rows(a_u8[:, begin // pack: end // pack], sfa_e[e], fmt, elem, sf_vec)
        b_deq = _dequant_rows(b_u8[begin // pack: end // pack, :].t(), sfb_e[e], fmt, elem, sf_vec)
        acc = a_deq @ b_deq.t()  # fp32
        if fmt == "nvfp4":
            acc = (global_scale_a[e] * global_scale_b[e]) * acc
        if accumulate:
            acc = acc + out[e].to(torch.float32)
        out[e].copy_(acc)
        begin = end
    return out


def _dequant_rows(data_RK, scale_RC, fmt, elem, sf_vec) -> torch.Tensor:
    """fp32 [R, k] of one expert's operand rows (data along tokens, k tokens, packed for FP4)."""
    rows = data_RK.shape[0]
    groups = scale_RC.shape[1]
    width = groups * sf_vec // (2 if elem == "e2m1" else 1)
    padded = torch.zeros((rows, width), dtype=data_RK.dtype, device=data_RK.device)
    padded[:, : data_RK.shape[1]] = data_RK
    if fmt == "nvfp4":
        deq = mx.dequantize_nvfp4(padded, scale_RC, 1.0, axis=1)
    else:
        deq = mx.dequantize_mx(padded, scale_RC, elem=elem, block_size=sf_vec, axis=1)
    k = data_RK.shape[1] * (2 if elem == "e2m1" else 1)
    return deq[:, :k]


def quantize_wgrad_operand_torch(
    x_SH: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    elem: str = "e4m3",
    scale_rule: str = "ocp",
    scale_cols: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`cuda_kernels.grouped_wgrad.quantize.quantize_wgrad_operand` (MX formats).

    Token-major rows ``x_SH`` [S, H] → the wgrad operand K-major along tokens: data [H, S] (a view
    of an [H, round_up(S, 32)] buffer whose padding columns are zero; FP4: [H, S/2] of [H,
    round_up(S, 32)/2]) and E8M0 scales [round_up(H,128), scale_cols] in the K-grouped atom layout,
    every group quantized by :func:`common.mx.quantize_mx` (block 32, ``scale_rule``) on the
    expert's tokens zero-padded to a whole group. Padding scale bytes are 0.

    ``scale_cols`` defaults to :func:`common.mx_atoms.grouped_scale_cols_bound`.

    Inputs follow the Triton entry's rules, checked by the same function
    (:func:`.validate.check_quantize_args`, always with the host read of the offsets): ``x_SH``
    [S, H] bfloat16 (any strides), ``offsets_E`` [E] int32 non-decreasing with last == S (even
    for ``elem="e2m1"``) on x's device, ``elem`` in e4m3 / e5m2 / e2m1, ``scale_rule`` ocp /
    rceil, ``scale_cols`` a multiple of 4 large enough for the offsets.

    Raises:
        ValueError: any of those rules, naming the argument, before anything is computed.
    """
    sf_vec = QUANT_SF_VEC
    scale_cols = validate.check_quantize_args(
        x_SH, offsets_E, elem=elem, scale_rule=scale_rule, scale_cols=scale_cols,
        fn="quantize_wgrad_operand_torch")
    ends = [int(v) for v in offsets_E.tolist()]
    hidden = x_SH.shape[1]
    tokens_sum = x_SH.shape[0]
    pack = 2 if elem == "e2m1" else 1
    s_pad = round_up(tokens_sum, 32)
    buf = torch.zeros((hidden, s_pad // pack), dtype=torch.uint8, device=x_SH.device)
    scales = []
    begin = 0
    for end in ends:
        k = end - begin
        c = -(-k // sf_vec)
        xt = torch.zeros((hidden, c * sf_vec), dtype=x_SH.dtype, device=x_SH.device)
        xt[:, :k] = x_SH[begin:end].t()
        data, scale = mx.quantize_mx(xt, elem=elem, block_size=sf_vec, scale_rule=scale_rule,
                                     axis=1)
        buf[:, begin // pack: end // pack] = data.view(torch.uint8)[:, : k // pack]
        scales.append(scale)
        begin = end
    sf = pack_grouped_scales(scales, hidden, scale_cols) if scales else None
    storage = torch.uint8 if elem == "e2m1" else mx.ELEMENT_FORMATS[elem].storage_dtype
    return buf.view(storage)[:, : tokens_sum // pack], sf


def dequantize_wgrad_operand(
    data_RS: torch.Tensor,
    sf: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """MXFP8 wgrad operand → dense [R, S] values, vectorized (a few whole-tensor ops, no loop
    over experts): element times its group's E8M0 scale ``2^(byte-127)`` (byte 255: NaN).

    The inverse direction of :func:`quantize_wgrad_operand_torch` and the decoding the twin
    applies (:func:`common.mx.dequantize_mx` per expert, OCP MX v1.0 §5.3); equal to it element
    for element in fp32. Used as the "dequantize to BF16, then the BF16 kernel" baseline.

    Args:
        data_RS: [R, S] ``float8_e4m3fn`` / ``float8_e5m2`` (rows, tokens; any strides).
        sf: [round_up(R, 128), cols] E8M0 (``float8_e8m0fnu`` or uint8) scales in the K-grouped
            128x4 atom layout, contiguous, with the columns these offsets need.
        offsets_E: [E] int32 cumulative token ends (non-decreasing, last == S), any device.
        out_dtype: floating dtype of the result (bfloat16 default; float32 is exact).

    Returns:
        [R, S] tensor of ``out_dtype`` on data's device.

    Raises:
        ValueError: a non-FP8 ``data_RS``, offsets that do not end at S, or ``sf`` of the wrong
            shape / too few columns.
    """
    if data_RS.dtype not in _ELEM_OF or data_RS.dim() != 2:
        raise _err(f"data_RS must be a 2-D float8_e4m3fn / float8_e5m2 tensor; got "
                   f"{data_RS.dtype} {tuple(data_RS.shape)}")
    rows, tokens_sum = data_RS.shape
    ends = [int(v) for v in offsets_E.tolist()]
    if not ends or ends[-1] != tokens_sum or any(b > a for b, a in zip([0, *ends], ends)):
        raise _err(f"offsets_E must be non-decreasing cumulative ends with last == S="
                   f"{tokens_sum}; got {ends[:8]}{'...' if len(ends) > 8 else ''}")
    groups, starts, total = grouped_scale_cols(ends, QUANT_SF_VEC)
    rp = round_up(rows, ATOM_ROWS)
    if sf.dim() != 2 or sf.shape[0] != rp or sf.shape[1] < total or not sf.is_contiguous():
        raise _err(f"sf must be a contiguous [{rp}, >= {total}] scale tensor for these offsets; "
                   f"got {tuple(sf.shape)}")
    dev = data_RS.device
    n_groups = sum(groups)

    def ints(values):
        return torch.tensor(values, dtype=torch.int64, device=dev)

    # one entry per (expert, group): its atom column, the expert's first atom and atom count (all
    # index math on data's device; sizes known on the host, so no further sync)
    g_e = ints(groups)
    e_of_g = torch.repeat_interleave(torch.arange(len(ends), device=dev), g_e,
                                     output_size=n_groups)
    first = ints(starts)[e_of_g]  # expert's first scale column
    ncols = ints([round_up(c, 4) for c in groups])[e_of_g]
    g_first = g_e.cumsum(0) - g_e  # each expert's first global group
    g_loc = torch.arange(n_groups, device=dev) - g_first[e_of_g]
    col_part = rp * first + (g_loc // 4) * 512 + g_loc % 4  # byte offset without the row part
    r = torch.arange(rows, dtype=torch.int64, device=dev)
    row_part = (r % 32) * 16 + ((r % ATOM_ROWS) // 32) * 4
    off = ((r // ATOM_ROWS)[:, None] * (ncols[None, :] // 4) * 512 + row_part[:, None]
           + col_part[None, :])  # [R, G] byte offsets (common.mx_atoms layout)
    scale_RG = sf.view(torch.uint8).reshape(-1)[off]
    # token -> its global group index
    tok = torch.arange(tokens_sum, dtype=torch.int64, device=dev)
    e_of_t = torch.searchsorted(ints(ends), tok, right=True)
    gidx = g_first[e_of_t] + (tok - ints([0, *ends[:-1]])[e_of_t]) // QUANT_SF_VEC
    byte = scale_RG[:, gidx].to(torch.int32)
    factor = torch.where(byte == 255, torch.nan, torch.exp2((byte - 127).to(torch.float32)))
    return (data_RS.to(torch.float32) * factor).to(out_dtype)
