"""Torch implementation of the grouped weight gradient: the fallback and the test twin of the kernels.

Dimensions:
    H: hidden (the GEMM's M), I: intermediate (the GEMM's N), S: tokens_sum (the GEMM's K, grouped),
    E: experts. Legend in ``common/shapes.py``.

For expert ``e`` with ``begin = offsets_E[e - 1]`` (0 for ``e = 0``) and ``end = offsets_E[e]``::

    out_EHI[e] = a_HS[:, begin:end] @ b_SI[begin:end, :]        (fp32 accumulation)

Source of the formula: ``shared/seeds/grouped_gemm_wgrad_sm100.md`` ("Operation"), the cuDNN
frontend's grouped GEMM wgrad contract.
"""

from __future__ import annotations

import torch

__all__ = [
    "INPUT_ORDERS",
    "check_row_indexes",
    "gather_operands",
    "grouped_wgrad_torch",
    "ragged_expert_views",
]

INPUT_ORDERS = ("tensor2d", "tensor_ragged")

# Output dtypes of the seed's BF16 contract (and float64 for the reference twins).
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _grouped_mm_eligible(a_HS, b_SI, offsets_E, out_dtype, accumulate, input_order) -> bool:
    """Whether ``torch._grouped_mm`` computes exactly what this function promises.

    ``torch._grouped_mm`` (CUDA, SM90+) rounds the fp32 accumulator once to the input dtype and
    refuses another output dtype, so it is used only for BF16 inputs with BF16 overwrite output;
    its TMA needs 16-byte-aligned strides (multiples of 8 BF16 elements), and it asserts on the
    device unless every group spans a multiple of 16 bytes (8 BF16 rows): outside CUDA-graph
    capture the offsets are read to check that (an unaligned split takes the loop, which reads
    them anyway); under capture no read is possible and the groups must be aligned (the layer's
    are: ALIGN rows).
    """
    if not hasattr(torch, "_grouped_mm") or a_HS.device.type != "cuda":
        return False
    if accumulate or out_dtype != torch.bfloat16:
        return False
    if a_HS.dtype != torch.bfloat16 or b_SI.dtype != torch.bfloat16:
        return False
    if input_order != "tensor2d":
        return False
    if torch.cuda.get_device_capability(a_HS.device)[0] < 9:
        return False
    for t in (a_HS, b_SI):
        if t.data_ptr() % 16 or not any(s == 1 for s in t.stride()):
            return False
        if any(s != 1 and s % 8 for s in t.stride()):
            return False
    if _capturing(a_HS.device):
        return True
    offs = offsets_E.to(torch.int64)
    return not bool((torch.diff(offs, prepend=offs.new_zeros(1)) % 8).any())


_INDEX_DTYPES = (torch.int32, torch.int64)


def check_row_indexes(a_HS, b_SI, a_rows_S, b_rows_S, who: str):
    """Check the row indexes of a gathered grouped wgrad (host metadata only: shapes, dtypes,
    devices; the index VALUES are never read on the host) and return ``S``, the grouped row
    count.

    With ``a_rows_S`` given, ``a_HS`` is an ``[H, T_a]`` source read as ``A[:, s] =
    a_HS[:, a_rows_S[s]]``; with ``b_rows_S`` given, ``b_SI`` is a ``[T_b, I]`` source read as
    ``B[s] = b_SI[b_rows_S[s]]``. ``S`` is the index length (both indexes: the same), and the
    operand that is not gathered must have ``S`` token rows.

    Raises:
        ValueError: an operand that is not a rank-2 tensor, an index that is not a rank-1
            int32 / int64 tensor of ``S`` entries on the operands' device (named ``a_rows_S`` /
            ``b_rows_S``), or a token count of the other operand that differs from ``S``.
    """
    for t, arg in ((a_HS, "a_HS"), (b_SI, "b_SI")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(
                f"{who}: {arg} must be a rank-2 torch.Tensor, got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    sizes = {}
    for rows, arg, src in ((a_rows_S, "a_rows_S", a_HS), (b_rows_S, "b_rows_S", b_SI)):
        if rows is None:
            continue
        if not isinstance(rows, torch.Tensor):
            raise ValueError(  # noqa: TRY004 - ValueError is the API contract
                f"{who}: {arg} must be a torch.Tensor or None, got {type(rows).__name__}"
            )
        if rows.dtype not in _INDEX_DTYPES or rows.dim() != 1:
            raise ValueError(
                f"{who}: {arg} must be a rank-1 torch.int32 / torch.int64 tensor [S], got "
                f"shape {tuple(rows.shape)} dtype {rows.dtype}"
            )
        if rows.device != src.device:
            raise ValueError(
                f"{who}: {arg} is on {rows.device}, its source operand on {src.device}"
            )
        sizes[arg] = rows.shape[0]
    if a_rows_S is None:
        sizes["a_HS.shape[1]"] = a_HS.shape[1]
    if b_rows_S is None:
        sizes["b_SI.shape[0]"] = b_SI.shape[0]
    if len(set(sizes.values())) > 1:
        got = ", ".join(f"{k} = {v}" for k, v in sizes.items())
        raise ValueError(f"{who}: the grouped row counts S differ: {got}")
    return next(iter(sizes.values()))


def _gather_rows(x_TC: torch.Tensor, rows_S: torch.Tensor) -> torch.Tensor:
    """``[S, C]`` rows ``x_TC[rows_S[s]]``, zeros where ``rows_S[s] < 0`` (a select: a NaN of
    the row read in place of a padding row never leaks). Device ops only (no host read)."""
    rows = rows_S.to(torch.int64)
    if x_TC.shape[0] == 0:  # no source rows: every index must be padding
        return x_TC.new_zeros((rows.shape[0], x_TC.shape[1]))
    out = x_TC.index_select(0, rows.clamp(min=0))
    return out.masked_fill_((rows < 0)[:, None], 0)


def gather_operands(a_HS, b_SI, a_rows_S=None, b_rows_S=None):
    """The dense operands of a gathered grouped wgrad (the fallback where no kernel gathers in
    its operand load, and the twin): ``(A [H, S], B [S, I])`` with ``A[:, s] =
    a_HS[:, a_rows_S[s]]`` (an M-major copy) and ``B[s] = b_SI[b_rows_S[s]]`` (row-major),
    zeros for a negative index; an operand without index is returned as is. Source rows that
    no index names are never read (they may hold NaN).

    Args:
        a_HS: [H, T_a] source (or [H, S] without ``a_rows_S``). b_SI: [T_b, I] (or [S, I]).
        a_rows_S, b_rows_S: [S] int32 / int64 or None; every value < the source's T (a
            negative value is a padding row). Checked by :func:`check_row_indexes` first.
    """
    if a_rows_S is not None:
        a_HS = _gather_rows(a_HS.t(), a_rows_S).t()
    if b_rows_S is not None:
        b_SI = _gather_rows(b_SI, b_rows_S)
    return a_HS, b_SI


def ragged_expert_views(a_HS, b_SI, begin: int, end: int):
    """Views of one expert's operands under ``input_order="tensor_ragged"``.

    In ragged order each operand is stored as per-expert blocks concatenated in memory, and only
    its unit-stride axis is meaningful (seed, "input_order"). A K-major operand (unit stride along
    tokens) holds expert ``e``'s block as a contiguous ``[H, n_e]`` (A) or ``[I, n_e]`` (B) matrix
    starting at element ``H * begin`` (``I * begin``); an M-/N-major operand is the same as in
    ``tensor2d`` order.

    Args:
        a_HS: [H, S] A operand; b_SI: [S, I] B operand; begin, end: host ints, expert's K range.

    Returns:
        (a_Hn, b_nI) views of the expert's operands, n = end - begin.
    """
    n = end - begin
    hidden, inter = a_HS.shape[0], b_SI.shape[1]
    if a_HS.stride(1) == 1 and hidden > 1:  # K-major A: contiguous [H, n] blocks
        a_e = torch.as_strided(a_HS, (hidden, n), (n, 1), a_HS.storage_offset() + hidden * begin)
    else:
        a_e = a_HS[:, begin:end]
    if b_SI.stride(0) == 1 and inter > 1:  # K-major B: contiguous [I, n] blocks (B_e^T)
        b_e = torch.as_strided(b_SI, (n, inter), (1, n), b_SI.storage_offset() + inter * begin)
    else:
        b_e = b_SI[begin:end, :]
    return a_e, b_e


def grouped_wgrad_torch(
    a_HS: torch.Tensor,
    b_SI: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
    input_order: str = "tensor2d",
    use_grouped_mm: bool | None = None,
    a_rows_S: torch.Tensor | None = None,
    b_rows_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped weight gradient in torch: ``out[e] = A[:, begin:end] @ B[begin:end, :]``.

    Dimensions: H hidden, S tokens_sum, I intermediate, E experts.

    Args:
        a_HS: [H, S] float (BF16 in the kernels' contract), any strides, any device. A = X_sorted^T.
        b_SI: [S, I] same dtype as ``a_HS``, same device. B = dY_sorted.
        offsets_E: [E] int32/int64, cumulative END of each expert's rows; non-decreasing, >= 0 and
            ``offsets_E[-1] <= S``. Rows at and past ``offsets_E[-1]`` are never read (they may hold
            NaN). Any group size >= 0 (no alignment rule here).
        out: optional [E, H, I] output written in place (any strides); required when
            ``accumulate``. Its dtype wins over ``out_dtype``.
        accumulate: add the product to ``out`` (``out = out + A_e @ B_e``, the sum in fp32, then
            rounded once to out's dtype); an empty expert leaves ``out[e]`` untouched. When false,
            an empty expert's ``out[e]`` is written with zeros.
        out_dtype: dtype of an allocated output; default float32 (the dispatcher's contract).
        input_order: ``"tensor2d"`` or ``"tensor_ragged"`` (see :func:`ragged_expert_views`).
        use_grouped_mm: force (True, CUDA tensors only) or forbid (False) ``torch._grouped_mm``;
            ``None`` picks it when it is exact for the request (CUDA SM90+, BF16 in and out,
            overwrite, tensor2d)
            and every group is a multiple of 8 rows (read on the host; while a CUDA graph is
            being captured the groups are not read and must be multiples of 8 rows, as
            ``torch._grouped_mm`` asserts on the device otherwise).
        a_rows_S, b_rows_S: optional [S] int32 / int64 row indexes (``tensor2d`` only): with
            ``a_rows_S``, ``a_HS`` is an ``[H, T]`` source and ``A[:, s] = a_HS[:, a_rows_S[s]]``
            (zeros where ``a_rows_S[s] < 0``); with ``b_rows_S``, ``b_SI`` is a ``[T, I]`` source
            and ``B[s] = b_SI[b_rows_S[s]]``. The rows are gathered first
            (:func:`gather_operands`: index_select and a zero select, no host read of the
            index), then the dense path runs; source rows no index names are never read.

    Returns:
        [E, H, I] tensor (``out`` when given). Accumulation is in fp32 (float64 for float64
        inputs); BF16/FP16 outputs are rounded once from the fp32 result.

    Raises:
        ValueError: ranks, mismatched token dims, dtypes, devices, ``out`` shape, ``input_order``,
            ``accumulate`` without ``out``, ``use_grouped_mm=True`` off CUDA or for a request it
            cannot compute exactly, or offsets values that break the rules above (checked on the
            host whenever the host reads them).
        RuntimeError: the per-expert loop needs a host read of ``offsets_E`` and the current CUDA
            stream is capturing a graph (use the BF16 ``torch._grouped_mm`` path or a kernel).

    Notes:
        The ``torch._grouped_mm`` path reads nothing on the host and masks empty experts to zero
        with a select (never a multiply, so NaN never leaks). The loop path reads ``offsets_E`` on
        the host once (one device sync on CUDA).
    """
    if a_rows_S is not None or b_rows_S is not None:
        check_row_indexes(a_HS, b_SI, a_rows_S, b_rows_S, "grouped_wgrad_torch")
        if input_order != "tensor2d":
            raise ValueError(
                f"grouped_wgrad_torch: a_rows_S / b_rows_S need input_order='tensor2d', got "
                f"{input_order!r}"
            )
        a_HS, b_SI = gather_operands(a_HS, b_SI, a_rows_S, b_rows_S)
    if a_HS.dim() != 2 or b_SI.dim() != 2:
        raise ValueError(
            f"grouped_wgrad_torch: a_HS and b_SI must be rank-2, got {tuple(a_HS.shape)} and "
            f"{tuple(b_SI.shape)}"
        )
    hidden, tokens_sum = a_HS.shape
    if b_SI.shape[0] != tokens_sum:
        raise ValueError(
            f"grouped_wgrad_torch: token dims differ: a_HS has S={tokens_sum}, b_SI has "
            f"S={b_SI.shape[0]}"
        )
    inter = b_SI.shape[1]
    if a_HS.dtype != b_SI.dtype or not a_HS.dtype.is_floating_point:
        raise ValueError(
            f"grouped_wgrad_torch: a_HS and b_SI need one floating dtype, got {a_HS.dtype} and "
            f"{b_SI.dtype}"
        )
    if offsets_E.dim() != 1 or offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"grouped_wgrad_torch: offsets_E must be a rank-1 int32/int64 tensor, got shape "
            f"{tuple(offsets_E.shape)} dtype {offsets_E.dtype}"
        )
    if input_order not in INPUT_ORDERS:
        raise ValueError(f"grouped_wgrad_torch: input_order must be one of {INPUT_ORDERS}, "
                         f"got {input_order!r}")
    devices = {a_HS.device, b_SI.device, offsets_E.device}
    if out is not None:
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"grouped_wgrad_torch: tensors on mixed devices {sorted(map(str, devices))}")
    num_experts = offsets_E.shape[0]
    if out is not None:
        if tuple(out.shape) != (num_experts, hidden, inter):
            raise ValueError(
                f"grouped_wgrad_torch: out must have shape {(num_experts, hidden, inter)}, got "
                f"{tuple(out.shape)}"
            )
        if out.dtype not in _OUT_DTYPES:
            raise ValueError(f"grouped_wgrad_torch: out dtype {out.dtype} not in {_OUT_DTYPES}")
        out_dtype = out.dtype
    elif accumulate:
        raise ValueError("grouped_wgrad_torch: accumulate=True needs an initialized out tensor")
    if out_dtype is None:
        out_dtype = torch.float32
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"grouped_wgrad_torch: out_dtype {out_dtype} not in {_OUT_DTYPES}")

    device = a_HS.device
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_eligible(
            a_HS, b_SI, offsets_E, out_dtype, accumulate, input_order
        )
    if use_grouped_mm:
        if accumulate or out_dtype != torch.bfloat16 or input_order != "tensor2d":
            raise ValueError(
                "grouped_wgrad_torch: use_grouped_mm=True needs BF16 overwrite output in tensor2d "
                "order (torch._grouped_mm rounds to the input dtype)"
            )
        if device.type != "cuda":
            # torch 2.13's CPU kernel reads the last group up to a multiple of 8 rows, past
            # offsets_E[-1] and past the operands' views (seen on an AMX-BF16 Xeon, 2026-12-02)
            raise ValueError(
                "grouped_wgrad_torch: use_grouped_mm=True needs CUDA tensors (torch._grouped_mm "
                f"on {device.type} reads rows past the last offset), got {device}"
            )
        offs32 = offsets_E.to(torch.int32)
        # An empty expert's group is masked with a select so no kernel's choice can leak.
        counts_E = torch.diff(offs32, prepend=offs32.new_zeros(1))
        res_EHI = torch._grouped_mm(a_HS, b_SI, offs=offs32)
        res_EHI = torch.where((counts_E == 0)[:, None, None], torch.zeros_like(res_EHI), res_EHI)
        if out is None:
            return res_EHI
        out.copy_(res_EHI)
        return out

    if _capturing(device):
        raise RuntimeError(
            "grouped_wgrad_torch: the per-expert loop reads offsets_E on the host, which breaks "
            "CUDA graph capture; capture a kernel path instead"
        )
    ends = [int(v) for v in offsets_E.tolist()]
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(
                f"grouped_wgrad_torch: offsets_E must be non-decreasing and >= 0; offsets_E[{e}] = "
                f"{end} after {prev}"
            )
        prev = end
    if ends and ends[-1] > tokens_sum:
        raise ValueError(
            f"grouped_wgrad_torch: offsets_E[-1] = {ends[-1]} exceeds tokens_sum S = {tokens_sum}"
        )

    acc_dtype = torch.float64 if a_HS.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty((num_experts, hidden, inter), dtype=out_dtype, device=device)
    begin = 0
    for e, end in enumerate(ends):
        if end == begin:
            if not accumulate:
                out[e].zero_()
            continue
        if input_order == "tensor_ragged":
            a_e, b_e = ragged_expert_views(a_HS, b_SI, begin, end)
        else:
            a_e, b_e = a_HS[:, begin:end], b_SI[begin:end, :]
        prod_HI = torch.matmul(a_e.to(acc_dtype), b_e.to(acc_dtype))
        if accumulate:
            prod_HI = prod_HI + out[e].to(acc_dtype)
        out[e].copy_(prod_HI)
        begin = end
    return out
