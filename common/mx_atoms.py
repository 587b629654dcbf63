"""Scale-factor layouts of block-scaled GEMMs: 128×4 atoms (SWIZZLE_32_4_4) and K-grouped scales.

Blackwell's block-scaled MMA (and cuBLAS, cuDNN, torch ``_scaled_mm``) reads the scale factors of an
operand ``[rows, K]`` as a ``[round_up(rows, 128), round_up(K / sf_vec, 4)]`` matrix cut into
128×4 "atoms" of 512 bytes (REFERENCE.md §4; PyTorch calls the layout SWIZZLE_32_4_4). The atoms
are stored row-block-major (all atoms of rows 0..127 first, left to right along K), and inside an
atom logical scale ``(r, c)`` (``r < 128``, ``c < 4``) sits at byte ``(r % 32) * 16 + (r // 32) * 4
+ c``. Sources: CUTLASS ``blockscaled_layout.tile_atom_to_shape_SF`` (atom
``((32, 4), (sf_vec, 4)) : ((16, 4), (0, 1))`` tiled K-first), cuDNN frontend, torchao
``to_blocked``; the same bytes in each.

K-grouped scales (the wgrad operands, K = tokens grouped by expert, ``offsets_E`` the cumulative
token ends): expert ``e`` with ``k_e`` tokens has ``c_e = ceil(k_e / sf_vec)`` scale columns (its
last group may be partial; groups never straddle two experts), padded to ``C_e = round_up(c_e, 4)``
and stored as its own atom matrix ``[round_up(rows, 128), C_e]`` starting at byte
``round_up(rows, 128) * s_e`` with ``s_e = sum_{e' < e} C_e'``. This is cuDNN frontend's layout
(``WgradSfTensormapConstructor``: per-expert base ``sfa + M_pad * token_offset / sf_vec`` and
``tile_atom_to_shape_SF((M_pad, k_e))``) and torchao's ``torch_to_blocked_2d_K_groups``; where every
``k_e`` is a multiple of ``4 * sf_vec`` (cuDNN's rule: 128 for MXFP8, 64 for NVFP4) ``s_e`` equals
``begin_e / sf_vec`` and the whole tensor is ``[round_up(rows, 128), tokens_sum / sf_vec]``. For
any other counts the columns needed, ``sum_e C_e``, may exceed ``round_up(ceil(tokens_sum /
sf_vec), 4)``; :func:`grouped_scale_cols_bound` is a bound that holds for every split of a given
``tokens_sum`` into ``E`` experts (so buffers can be sized without reading offsets on the host).
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "ATOM_BYTES",
    "ATOM_COLS",
    "ATOM_ROWS",
    "atom_offsets",
    "from_atoms",
    "grouped_scale_cols",
    "grouped_scale_cols_bound",
    "pack_grouped_scales",
    "round_up",
    "to_atoms",
    "unpack_grouped_scales",
]

ATOM_ROWS = 128
ATOM_COLS = 4
ATOM_BYTES = ATOM_ROWS * ATOM_COLS  # 512


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


@functools.lru_cache(maxsize=64)
def _atom_offsets_cpu(rows_padded: int, cols_padded: int) -> torch.Tensor:
    r = torch.arange(rows_padded).view(-1, 1)
    c = torch.arange(cols_padded).view(1, -1)
    atom = (r // ATOM_ROWS) * (cols_padded // ATOM_COLS) + c // ATOM_COLS
    return atom * ATOM_BYTES + (r % 32) * 16 + ((r % ATOM_ROWS) // 32) * 4 + c % ATOM_COLS


def atom_offsets(rows_padded: int, cols_padded: int, device=None) -> torch.Tensor:
    """int64 ``[rows_padded, cols_padded]``: the element offset of logical scale ``(r, c)`` in the
    128×4 atom layout of a ``[rows_padded, cols_padded]`` scale matrix.

    Raises:
        ValueError: ``rows_padded`` not a multiple of 128 or ``cols_padded`` not a multiple of 4.
    """
    if rows_padded < 0 or rows_padded % ATOM_ROWS or cols_padded < 0 or cols_padded % ATOM_COLS:
        raise ValueError(
            f"atom layout needs rows a multiple of 128 and cols a multiple of 4; got "
            f"{rows_padded} x {cols_padded}"
        )
    off = _atom_offsets_cpu(rows_padded, cols_padded)
    return off.to(device) if device is not None else off.clone()


def to_atoms(scale_RC: torch.Tensor) -> torch.Tensor:
    """Logical scales ``[R, C]`` → the atom-layout matrix ``[round_up(R,128), round_up(C,4)]``
    (row-major storage holds the swizzled bytes; padding entries are zero bytes)."""
    if scale_RC.dim() != 2:
        raise ValueError(f"scale_RC must be 2-D; got shape {tuple(scale_RC.shape)}")
    rows, cols = scale_RC.shape
    rp, cp = round_up(rows, ATOM_ROWS), round_up(cols, ATOM_COLS)
    raw = scale_RC.view(torch.uint8) if scale_RC.element_size() == 1 else scale_RC
    padded = raw.new_zeros(rp, cp)
    padded[:rows, :cols] = raw
    flat = raw.new_zeros(rp * cp)
    flat[atom_offsets(rp, cp, scale_RC.device).reshape(-1)] = padded.reshape(-1)
    return flat.view(rp, cp).view(scale_RC.dtype)


def from_atoms(atoms: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_atoms`: the logical ``[rows, cols]`` scales of an atom-layout matrix
    (any 1-byte dtype; only its first ``round_up(rows,128) * round_up(cols,4)`` elements in memory
    order are read)."""
    rp, cp = round_up(rows, ATOM_ROWS), round_up(cols, ATOM_COLS)
    flat = atoms.reshape(-1)
    if flat.numel() < rp * cp:
        raise ValueError(f"atom matrix has {flat.numel()} elements; {rp} x {cp} needed")
    off = atom_offsets(rp, cp, atoms.device)
    return flat[off[:rows, :cols].reshape(-1)].view(rows, cols)


def _counts(offsets) -> list[int]:
    ends = [int(v) for v in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    prev, counts = 0, []
    for end in ends:
        counts.append(end - prev)
        prev = end
    return counts


def grouped_scale_cols(offsets, sf_vec: int) -> tuple[list[int], list[int], int]:
    """Per expert ``(c_e, s_e)`` and the total ``sum C_e`` of the K-grouped layout (host ints).

    Args:
        offsets: cumulative token ends (tensor or sequence), non-decreasing, >= 0 (not checked).
        sf_vec: tokens per scale group.

    Returns:
        (groups ``c_e = ceil(k_e / sf_vec)``, column starts ``s_e``, total padded columns).
    """
    groups, starts, col = [], [], 0
    for k in _counts(offsets):
        c = -(-max(k, 0) // sf_vec)
        groups.append(c)
        starts.append(col)
        col += round_up(c, ATOM_COLS)
    return groups, starts, col


def grouped_scale_cols_bound(tokens_sum: int, num_experts: int, sf_vec: int) -> int:
    """Scale columns that suffice for every split of ``tokens_sum`` tokens into ``num_experts``
    experts: ``round_up(ceil(tokens_sum / sf_vec), 4) + 4 * (num_experts - 1)``.

    ``sum_e ceil(k_e / (4 sf_vec)) <= ceil(tokens_sum / (4 sf_vec)) + E - 1`` since each expert's
    ceiling adds less than one atom column. With cuDNN-aligned counts the first term alone is exact.
    """
    if tokens_sum < 0 or num_experts < 0 or sf_vec < 1:
        raise ValueError(f"bad sizes: tokens_sum={tokens_sum} num_experts={num_experts} "
                         f"sf_vec={sf_vec}")
    return round_up(-(-tokens_sum // sf_vec), ATOM_COLS) + ATOM_COLS * max(num_experts - 1, 0)


def pack_grouped_scales(scales: list[torch.Tensor], rows: int, total_cols: int) -> torch.Tensor:
    """Per-expert logical scales ``[rows, c_e]`` → the K-grouped atom tensor
    ``[round_up(rows, 128), total_cols]`` (zero bytes in every padding entry).

    Raises:
        ValueError: a scale with the wrong row count, or more columns needed than ``total_cols``.
    """
    rp = round_up(rows, ATOM_ROWS)
    dtype = scales[0].dtype if scales else torch.uint8
    device = scales[0].device if scales else None
    flat = torch.zeros(rp * total_cols, dtype=torch.uint8, device=device)
    col = 0
    for e, s in enumerate(scales):
        if s.dim() != 2 or s.shape[0] != rows:
            raise ValueError(f"scales[{e}] must be [{rows}, c_e]; got {tuple(s.shape)}")
        cp = round_up(s.shape[1], ATOM_COLS)
        if col + cp > total_cols:
            raise ValueError(f"the experts' scales need more than total_cols={total_cols} columns")
        flat[rp * col: rp * (col + cp)] = to_atoms(s).view(torch.uint8).reshape(-1)
        col += cp
    return flat.view(rp, total_cols).view(dtype)


def unpack_grouped_scales(sf: torch.Tensor, rows: int, offsets, sf_vec: int) -> list[torch.Tensor]:
    """The K-grouped atom tensor ``sf`` ``[round_up(rows,128), cols]`` → per-expert logical scales
    ``[rows, c_e]`` (views of nothing: fresh tensors, ``sf``'s dtype). Padding bytes are never read.

    Raises:
        ValueError: ``sf`` not contiguous 2-D ``[round_up(rows,128), cols]`` with enough columns.
    """
    rp = round_up(rows, ATOM_ROWS)
    groups, starts, total = grouped_scale_cols(offsets, sf_vec)
    if sf.dim() != 2 or sf.shape[0] != rp or not sf.is_contiguous():
        raise ValueError(f"sf must be a contiguous [{rp}, cols] tensor; got shape "
                         f"{tuple(sf.shape)} strides {tuple(sf.stride())}")
    if sf.shape[1] < total:
        raise ValueError(f"sf has {sf.shape[1]} columns; the experts' scales need {total}")
    flat = sf.view(torch.uint8).reshape(-1)
    out = []
    for c, s in zip(groups, starts):
        cp = round_up(c, ATOM_COLS)
        block = flat[rp * s: rp * (s + cp)]
        out.append(from_atoms(block, rows, c).view(sf.dtype) if c else
                   sf.new_empty((rows, 0)))
    return out
