"""MX-faithful torch golden twin of :func:`nki_kernels.blockwise_mm_bwd_mxfp8`.

The same math as the NKI kernel, written in plain torch and independent of the interpreter: per
block, the same operands are MX-quantized along the same contraction axis with the same group
layout (``common.mx.quantize_mx(scale_rule="trainium", layout="wrapx")``), the products are summed
in fp32, and every value is rounded to BF16 at the same points as the kernel. The fp32 sums
also follow the kernel's order: every TensorE instruction is modelled as its exact sum (formed
in fp64, where the MX products are exact) rounded once to fp32, and instruction results are
added in fp32 in the kernel's order (K tiles of the phase's ``tile_k``, optional PSUM folds,
128-column chunks for dA, 128 slots per bias instruction). Tests compare with a relative
error <= 1e-5; a config change only moves these fp32 sums.

It runs on the device of its inputs (CPU or CUDA: backend ``nki-twin``): the per-instruction
sums are exact in fp64 wherever they are formed, the fp32 adds are elementwise, and the sigmoid
is NumPy's on the host, so a GPU reproduces the CPU's bits (one host round trip per block).

Dimensions: T tokens (rows of ``hidden_states``; T+1 with the zero padding row), H hidden,
I = I_TP intermediate, E experts, B block_size, N blocks.

Per block n of expert e (REFERENCE §2-§3), with the block's slots j, their tokens t_j and
affinities a_j (padding slots: every gathered value 0):

==========  ==============================================================  ==============
phase       computes                                                        MX along
==========  ==============================================================  ==============
phase1      dh_raw[B, I] = q(dY_blk) @ q(W_down[e])^T (fp32);                H
            dA[t_j, e] = sum_i dh_raw * h;  dh = a * dh_raw;
            dgu[B, 2I] = bf16(dh*u*silu'(g)*mask_g || dh*silu(g)*mask_u);
            ah[B, I] = bf16(a * h)
phase2      dX_blk[B, H] = q(dgu) @ q(W_gate_up[e] as [H, 2I])^T;             2I
            dX[t_j] += dX_blk[j] (BF16 read-add-write or fp32)
phase3      dW_gate_up[e] += q(X_blk)^T @ q(dgu)          [H, 2I]             B
phase4      dW_down[e] += q(ah)^T @ q(dY_blk)             [I, H]              B
bias        dB_gate_up[e] += sum_j dgu[j];  dB_down[e] += sum_j a_j dY[t_j]
==========  ==============================================================  ==============

``q`` is quantize-then-dequantize to MXFP8 E4M3 with Trainium's scale rule. ``s = sigmoid(g)``,
``silu(g) = g*s``, ``silu'(g) = s*(1 + g*(1 - s))``, ``h = silu(g)*u``, all fp32.
Accumulation across blocks in block order: AWS's BF16 read-add-write (``accumulation_dtype=None``)
rounds ``old + new`` to BF16 after every block; ``accumulation_dtype=float32`` keeps fp32 sums and
rounds once at the end. dA is assigned (one cell per (token, expert)), in the affinities' dtype;
it carries no ``<dY, b_down>`` term (the kernel receives no bias values; REFERENCE §2).
"""

from __future__ import annotations

import numpy as np
import torch

from common.activation import gated_terms
from common.mx import dequantize_mx, quantize_mx
from common.problem import SWIGLU, ClampLimits
from nki_kernels.config import MatmulMxfp8KernelConfig, default_phase_configs

__all__ = ["blockwise_mm_bwd_mxfp8_torch", "mx_fake_quant", "prequantize_weight_k_major"]

_F32 = torch.float32
_BF16 = torch.bfloat16


def mx_fake_quant(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Quantize ``x`` to MXFP8 E4M3 along ``axis`` as Trainium's ``quantize_mx`` does, dequantize.

    Args:
        x: float tensor; ``x.shape[axis]`` a multiple of 128 (WRAPX K tiles: 512, then 256/128).
        axis: the contraction axis.
    Returns:
        fp32 tensor of x's shape: the values ``nc_matmul_mx`` multiplies.
    Source: NKI_API.md §3.12 (scale rule) and §4.6 (WRAPX groups), via :mod:`common.mx`.
    """
    opts = {"elem": "e4m3", "block_size": 32, "axis": axis, "layout": "wrapx"}
    data, scale = quantize_mx(x, scale_rule="trainium", **opts)
    return dequantize_mx(data, scale, dtype=_F32, **opts)


def _k_tiles(K: int) -> list:
    """WRAPX K tiles ``(k0, TK)``: 512-wide from the start, then a 256 and a 128 remainder."""
    tiles = [(k0, 512) for k0 in range(0, K - K % 512, 512)]
    k0 = K - K % 512
    for width in (256, 128):
        if K - k0 >= width:
            tiles.append((k0, width))
            k0 += width
    return tiles


def _instruction_chunks(K: int, tile_k: int) -> list:
    """K indices of each ``nc_matmul_mx`` along a contraction of length K, in kernel order.

    Per WRAPX tile (k0, TK) with ``vsk = TK/4`` partitions, one instruction takes
    ``step = min(tile_k/4, vsk)`` partitions from ``pk``: K indices ``k0 + i*vsk + p`` for the 4
    lanes i and ``pk <= p < pk + step`` (NKI_API.md §4.6).
    """
    out = []
    for k0, TK in _k_tiles(K):
        vsk = TK // 4
        step = min(tile_k // 4, vsk)
        for pk in range(0, vsk, step):
            idx = [k0 + i * vsk + p for i in range(4) for p in range(pk, pk + step)]
            out.append(torch.tensor(idx, dtype=torch.int64))
    return out


def _instr(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """One TensorE instruction: exact products summed in fp64, rounded once to fp32."""
    return (a_MK.double() @ b_KN.double()).float()


def _mm(a_MK: torch.Tensor, b_KN: torch.Tensor, chunks: list, fold_k) -> torch.Tensor:
    """fp32 PSUM accumulation of per-instruction results; with ``fold_k``, every ``fold_k``
    instructions the PSUM partial is added into an fp32 SBUF accumulator (kernel ``_fold``)."""
    acc = ps = None
    for c, idx in enumerate(chunks):
        if fold_k is not None and c and c % fold_k == 0:
            acc = ps if acc is None else acc + ps
            ps = None
        part = _instr(a_MK[:, idx], b_KN[idx])
        ps = part if ps is None else ps + part
    return ps if acc is None else acc + ps


def _rowsum_chunks(x_BF: torch.Tensor, bounds: list) -> torch.Tensor:
    """Sum over columns as the kernel's dA: per (start, stop) chunk one instruction, fp32 adds.

    The summands are fp32 products (not MX values), so their fp64 sum is not always exact and its
    last bits depend on the reduction order; it runs on the host so that every device gets the
    CPU's bits (the H200 showed a 1-ULP dA difference when CUDA summed)."""
    x = x_BF.cpu()
    acc = None
    for c0, c1 in bounds:
        part = x[:, c0:c1].double().sum(1).float()
        acc = part if acc is None else acc + part
    return acc.to(x_BF.device)


def _lane_sum(x_BF: torch.Tensor, vs: int = 128) -> torch.Tensor:
    """Sum over the block's slots as the kernel's bias reduction: one instruction per 128 slots
    (on the host, for the reason given in :func:`_rowsum_chunks`)."""
    x = x_BF.cpu()
    acc = None
    for s0 in range(0, x.shape[0], vs):
        part = x[s0 : s0 + vs].double().sum(0).float()
        acc = part if acc is None else acc + part
    return acc.to(x_BF.device)


def prequantize_weight_k_major(w_EFK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-quantize weights for the kernel, contracted along their last axis K (the backward's).

    The layout the kernel DMAs straight into SBUF (no on-chip quantization): per WRAPX K tile
    (k0, TK) of ``vsk = TK/4`` rows, word row ``k0/4 + p`` holds lanes ``i = 0..3`` = K indices
    ``k0 + i*vsk + p`` (byte i of the little-endian uint32 = lane i); its E8M0 scale of group
    ``g`` (8 rows) sits at scale row ``k0/4 + 32*(g//4) + g%4`` (NKI_API.md §4.5-§4.6, AWS's
    unpacked ``[K/4, F]`` scale layout); unused scale rows are 0.

    Args:
        w_EFK: [E, F, K] float weights, K a multiple of 128. For ``gate_up_proj_weight``
            [E, H, 2, I] pass ``w.reshape(E, H, 2*I)`` (K = 2I, phase 2); for
            ``down_proj_weight`` [E, I, H] pass it as is (K = H, phase 1).
    Returns:
        (words [E, K/4, F] uint32 (``float8_e4m3fn_x4`` bits), scales [E, K/4, F] uint8).
    Raises:
        ValueError: not 3-D, or K not a multiple of 128 (from :func:`common.mx.quantize_mx`).
    """
    if w_EFK.dim() != 3:
        raise ValueError(f"w_EFK must be [E, F, K], got shape {tuple(w_EFK.shape)}")
    E, F, K = w_EFK.shape
    data, scale = quantize_mx(w_EFK, elem="e4m3", block_size=32, scale_rule="trainium", axis=-1,
                              layout="wrapx")
    bytes_EFK = data.view(torch.uint8)
    sbytes = scale.view(torch.uint8)  # [E, F, K/32], WRAPX groups tile-major
    words = torch.zeros(E, K // 4, F, dtype=torch.int64)
    scales = torch.zeros(E, K // 4, F, dtype=torch.uint8)
    for k0, TK in _k_tiles(K):
        vsk = TK // 4
        r0 = k0 // 4
        for i in range(4):
            lane = bytes_EFK[:, :, k0 + i * vsk : k0 + (i + 1) * vsk].to(torch.int64)  # [E, F, vsk]
            words[:, r0 : r0 + vsk, :] |= lane.transpose(1, 2) << (8 * i)
        for gi in range(vsk // 8):
            scales[:, r0 + 32 * (gi // 4) + gi % 4, :] = sbytes[:, :, k0 // 32 + gi]
    return words.to(torch.uint32), scales


def _sigmoid_fp32(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in fp32 with NumPy's fp32 ``exp``.

    ScalarE's sigmoid is an undocumented table (NKI_API.md §3.9); the interpreter models it with
    this formula and NumPy's exp, and torch's fp32 exp differs from NumPy's in rare last bits,
    which can flip a BF16 rounding downstream. Using the same formula and library keeps the
    golden bit-comparable; the fp32 math is the golden's own.
    """
    xn = x.detach().cpu().numpy().astype(np.float32)
    with np.errstate(over="ignore"):
        s = (np.float32(1.0) / (np.float32(1.0) + np.exp(-xn))).astype(np.float32)
    return torch.from_numpy(s).to(x.device)  # NumPy's bits on every device


def _accumulate(acc: torch.Tensor, add: torch.Tensor, fp32: bool) -> torch.Tensor:
    """One read-add-write: fp32 sum, then BF16 rounding unless accumulating in fp32."""
    s = acc + add.to(acc.dtype)
    return s if fp32 else s.to(_BF16).to(acc.dtype)


def blockwise_mm_bwd_mxfp8_torch(
    hidden_states: torch.Tensor,
    expert_affinities_masked: torch.Tensor,
    gate_up_proj_weight: torch.Tensor,
    down_proj_weight: torch.Tensor,
    token_position_to_id: torch.Tensor,
    block_to_expert: torch.Tensor,
    output_hidden_states_grad: torch.Tensor,
    block_size: int,
    gate_up_proj_act_checkpoint_T: torch.Tensor,
    *,
    clamp_limits: ClampLimits | None = None,
    bias: bool = False,
    is_tensor_update_accumulating: bool = True,
    accumulation_dtype: object | None = None,
    phase_configs: tuple[MatmulMxfp8KernelConfig | None, ...] = (None, None, None, None),
    output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """The golden backward: same per-phase MX quantization and BF16 rounding points as the kernel.

    Args:
        hidden_states: [T, H] bfloat16 (T counts the zero padding row when padding ids are T).
        expert_affinities_masked: [T*E, 1] bfloat16 or float32, element (t, e) at ``t*E + e``.
        gate_up_proj_weight: [E, H, 2, I] bfloat16 (gate at index 0, up at 1).
        down_proj_weight: [E, I, H] bfloat16.
        token_position_to_id: [N*B] int, token of each slot; ids outside [0, T) are padding.
        block_to_expert: [N, 1] int, expert of each block.
        output_hidden_states_grad: [T, H] bfloat16, dY.
        block_size: B.
        gate_up_proj_act_checkpoint_T: [N, 2, I, B] bfloat16, clamped gate/up pre-activations;
            padding slots may hold anything (they are selected away, never multiplied).
        clamp_limits: gradient masks of the clamps (``non_linear_*`` gate, ``linear_*`` up).
        bias: also return the bias gradients.
        is_tensor_update_accumulating: dX rows add across blocks (top_k > 1); False overwrites.
        accumulation_dtype: None (BF16 read-add-write across blocks, as AWS) or float32
            (``torch.float32`` or ``"float32"``: fp32 sums, one BF16 rounding at the end).
        phase_configs: the kernel's phase1..phase4 configs (None = AWS defaults); only
            ``tile_k`` and ``enable_psum_copy_in`` / ``TILES_IN_BLOCK_K`` matter here (they set
            the fp32 summation order).
        output_dtype: None (the kernel's: BF16, dA in the affinities' dtype) or a float dtype
            for unrounded outputs; with ``accumulation_dtype=torch.float64`` the cross-block
            sums are then exact up to fp64 (the "MX-exact" oracle for accumulation tests).

    Returns:
        ``(dX [T, H], dA [T*E, 1], dW_gate_up [E, H, 2, I], dW_down [E, I, H])`` and, with
        ``bias=True``, ``(dB_gate_up [E, 2, I], dB_down [E, H])``; BF16 except dA, which has the
        affinities' dtype.

    Raises:
        ValueError: shapes that do not fit together.
    """
    T, H = hidden_states.shape
    E, _, _, I = gate_up_proj_weight.shape
    B = int(block_size)
    tpti = token_position_to_id.reshape(-1).to(torch.int64)
    if tpti.numel() % B:
        raise ValueError(f"token_position_to_id length {tpti.numel()} is not a multiple of B={B}")
    N = tpti.numel() // B
    ckpt = gate_up_proj_act_checkpoint_T
    if tuple(ckpt.shape) != (N, 2, I, B):
        raise ValueError(f"gate_up_proj_act_checkpoint_T must be [{N}, 2, {I}, {B}]")
    acc_name = "" if accumulation_dtype is None else str(accumulation_dtype)
    fp32_acc = acc_name.endswith(("float32", "float64"))
    acc_dt = torch.float64 if acc_name.endswith("float64") else _F32
    cl = clamp_limits or ClampLimits()
    cfgs = default_phase_configs(H, I, B, False, tuple(phase_configs))
    folds = [None if c.enable_psum_copy_in else (c.TILES_IN_BLOCK_K or 1) for c in cfgs]
    ch1 = _instruction_chunks(H, cfgs[0].tile_k)
    ch2 = _instruction_chunks(2 * I, cfgs[1].tile_k)
    ch3 = _instruction_chunks(B, cfgs[2].tile_k)
    ch4 = _instruction_chunks(B, cfgs[3].tile_k)
    half = I // 2
    da_halves = [
        [(h0 + c, min(h0 + c + 128, h0 + half)) for c in range(0, half, 128)]
        for h0 in (0, half)
    ]
    b2e = block_to_expert.reshape(-1).to(torch.int64)
    x_TH = hidden_states.to(_F32)
    dy_TH = output_hidden_states_grad.to(_F32)
    ea = expert_affinities_masked.reshape(-1).to(_F32)
    w_gu = gate_up_proj_weight.to(_F32).reshape(E, H, 2 * I)
    w_d = down_proj_weight.to(_F32)

    dev = hidden_states.device  # any device: the same sums (fp64-exact instructions, fp32 adds)
    dX = torch.zeros(T, H, dtype=acc_dt, device=dev)
    dA = torch.zeros(T * E, dtype=_F32, device=dev)
    dWgu = torch.zeros(E, H, 2 * I, dtype=acc_dt, device=dev)
    dWd = torch.zeros(E, I, H, dtype=acc_dt, device=dev)
    dBgu = torch.zeros(E, 2 * I, dtype=acc_dt, device=dev)
    dBd = torch.zeros(E, H, dtype=acc_dt, device=dev)
    zero = torch.zeros((), dtype=_F32, device=dev)
    tpti = tpti.to(dev)
    ch1, ch2, ch3, ch4 = ([c.to(dev) for c in ch] for ch in (ch1, ch2, ch3, ch4))
    wq_cache: dict = {}  # expert -> its MX-quantized weights (same values in every block)

    for n in range(N):
        ids = tpti[n * B : (n + 1) * B]
        valid = (ids >= 0) & (ids < T)
        if not bool(valid.any()):
            continue  # an all-padding block changes nothing (the kernel skips it too)
        e = int(b2e[n])
        tok = ids.clamp(0, T - 1)
        v1 = valid[:, None]
        x_BH = torch.where(v1, x_TH[tok], zero)
        dy_BH = torch.where(v1, dy_TH[tok], zero)
        a_B1 = torch.where(valid, ea[tok * E + e], zero)[:, None]
        g_BI = torch.where(v1, ckpt[n, 0].T.to(_F32), zero)
        u_BI = torch.where(v1, ckpt[n, 1].T.to(_F32), zero)

        if e not in wq_cache:
            wq_cache[e] = (mx_fake_quant(w_d[e], 1).T, mx_fake_quant(w_gu[e], 1).T)
        wdq_HI, wguq_2IH = wq_cache[e]

        # phase 1: dh_raw, dA, SwiGLU backward
        dh_raw = _mm(mx_fake_quant(dy_BH, 1), wdq_HI, ch1, folds[0])
        # common.activation's SwiGLU terms with the kernel's sigmoid, in the kernel's order
        t = gated_terms(SWIGLU, g_BI, u_BI, sigmoid=_sigmoid_fp32)
        h = t.h
        prod = dh_raw * h
        da_B = _rowsum_chunks(prod, da_halves[0]) + _rowsum_chunks(prod, da_halves[1])
        dh = dh_raw * a_B1
        mg = cl.gate_mask(g_BI)
        mu = cl.up_mask(u_BI)
        dg = torch.where(mg, dh * t.up * t.dgate, zero)
        du = torch.where(mu, dh * t.gs, zero)
        dgu_B2I = torch.cat([dg, du], 1).to(_BF16).to(_F32)
        ah_BI = (h * a_B1).to(_BF16).to(_F32)
        dA[ids[valid] * E + e] = da_B[valid]

        # phase 2: dX rows
        dx_BH = _mm(mx_fake_quant(dgu_B2I, 1), wguq_2IH, ch2, folds[1])
        rows = ids[valid]
        if is_tensor_update_accumulating:
            dX[rows] = _accumulate(dX[rows], dx_BH[valid], fp32_acc)
        else:
            dX[rows] = (dx_BH[valid] if fp32_acc else dx_BH[valid].to(_BF16)).to(acc_dt)

        # phase 3 / phase 4: weight gradients, contraction over the block's slots
        xq = mx_fake_quant(x_BH, 0)
        dgq = mx_fake_quant(dgu_B2I, 0)
        dWgu[e] = _accumulate(dWgu[e], _mm(xq.T, dgq, ch3, folds[2]), fp32_acc)
        aq = mx_fake_quant(ah_BI, 0)
        dyq = mx_fake_quant(dy_BH, 0)
        dWd[e] = _accumulate(dWd[e], _mm(aq.T, dyq, ch4, folds[3]), fp32_acc)
        if bias:
            dBgu[e] = _accumulate(dBgu[e], _lane_sum(dgu_B2I), fp32_acc)
            dBd[e] = _accumulate(dBd[e], _lane_sum(dy_BH * a_B1), fp32_acc)

    odt = output_dtype or _BF16
    out = (
        dX.to(odt),
        dA.to(output_dtype or expert_affinities_masked.dtype).reshape(T * E, 1),
        dWgu.to(odt).reshape(E, H, 2, I),
        dWd.to(odt),
    )
    if bias:
        out = out + (dBgu.to(odt).reshape(E, 2, I), dBd.to(odt))
    return out
