"""Storage, tensor views and per-program state of the CPU NKI interpreter.

Memory model (NKI_API.md §2.2-§2.3, §4):

* Every allocation is a :class:`Storage`: a flat, byte-addressed NumPy ``uint8`` buffer. On-chip
  (SBUF/PSUM) storage of shape ``[P, f1, ...]`` is laid out partition-major: partition ``p`` owns
  bytes ``[p * pbytes, (p + 1) * pbytes)`` with ``pbytes = prod(f) * itemsize``.
* A :class:`NkiTensor` is a view: dtype, shape, byte strides and a byte offset into one storage.
  Views never copy; ``view(dtype)`` / ``.ap(dtype=...)`` reinterpret bytes, so x4 <-> uint32 and
  e8m0 <-> uint8 round-trip bit-exactly.
* New storage is filled with sentinels as AWS's simulator does: NaN for floating dtypes (and for
  each byte of packed fp8 x4 words), 4 for integers, so a read of unwritten data shows.

Capacity policy (simple, documented): each program instance tracks the bytes per partition of its
live SBUF allocations and the PSUM banks of its live PSUM allocations. An allocation is live until
its last view is garbage-collected (CPython frees it when the last reference goes, e.g. when a loop
rebinds the name). PSUM allocations are rounded up to whole 2 KiB banks (matmul destinations
start on a bank boundary). Exceeding the budget raises :class:`NkiCapacityError` at allocation.
Budgets per partition: SBUF usable bytes from nki-library (NKI_API.md §4.1), trn3
``256*1024-16384-8-256``, trn2 ``224*1024-16384-8-520``; PSUM 8 banks x 2 KiB.
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
import weakref
from typing import ClassVar

import numpy as np

from . import dtypes as _dt

__all__ = [
    "TARGETS",
    "IndirectAP",
    "MemoryRegion",
    "NkiCapacityError",
    "NkiError",
    "NkiOOBError",
    "NkiTensor",
    "ProgramContext",
    "Storage",
    "current",
    "hbm",
    "private_hbm",
    "psum",
    "sbuf",
    "shared_hbm",
]


class NkiError(RuntimeError):
    """A rule of the NKI programming model (or of Trainium) broken by a kernel."""


class NkiCapacityError(NkiError):
    """SBUF or PSUM capacity exceeded at allocation."""


class NkiOOBError(NkiError):
    """Out-of-bounds indirect DMA with ``oob_mode.error``."""


class NkiBarrierError(NkiError):
    """A core_barrier / sendrecv that cannot complete (the other core failed, returned or hung)."""


class MemoryRegion(enum.Enum):
    """Buffers of NKI (values as the SDK's ``nl.MemoryRegion``)."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"


sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
hbm = private_hbm  # alias, as in the SDK stub
shared_hbm = MemoryRegion.shared_hbm

PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_NUM_BANKS = 8

# Per-target constants. sbuf_usable_bytes: usable SBUF bytes per partition as nki-library
# hard-codes them (NKI_API.md §4.1); matmul_moving_fmax: largest nc_matmul moving free size.
TARGETS = {
    "trn2": {"nc_version": 3, "sbuf_bytes": 224 * 1024,
             "sbuf_usable_bytes": 224 * 1024 - 16384 - 8 - 520, "has_mx": False},
    "trn3": {"nc_version": 4, "sbuf_bytes": 256 * 1024,
             "sbuf_usable_bytes": 256 * 1024 - 16384 - 8 - 256, "has_mx": True},
}


def _is_onchip(buffer) -> bool:
    return buffer is sbuf or buffer is psum


class _Fill:
    """Sentinel bytes of fresh storage per dtype (NaN for floats, 4 for ints)."""

    _cache: ClassVar[dict] = {}

    @classmethod
    def pattern(cls, dtype: str) -> np.ndarray:
        p = cls._cache.get(dtype)
        if p is None:
            npdt = _dt.np_dtype(dtype)
            if dtype in (_dt.float8_e4m3fn_x4, _dt.float8_e5m2_x4):
                p = np.array([0x7F7F7F7F], dtype=np.uint32).view(np.uint8)
            elif dtype == _dt.float4_e2m1fn_x4:
                p = np.array([0x4444], dtype=np.uint16).view(np.uint8)
            elif _dt.is_int(dtype):
                p = np.array([4], dtype=npdt).view(np.uint8)
            else:
                p = np.array([np.nan], dtype=np.float32).astype(npdt).view(np.uint8)
            cls._cache[dtype] = p
        return p


_UIDS = itertools.count()


class Storage:
    """One allocation: a flat byte buffer plus bookkeeping.

    Attributes:
        data: ``uint8`` NumPy array holding the bytes.
        buffer: the :class:`MemoryRegion`.
        partitions, pbytes: on-chip geometry (partition count, bytes per partition); 0 for HBM.
        written: PSUM only, a ``uint8`` flag per byte: 1 once written (``accumulate=None`` rule).
        version: bumped on every write (used by caches).
    """

    __slots__ = (
        "__weakref__",
        "buffer",
        "data",
        "name",
        "owner_core",
        "partitions",
        "pbytes",
        "uid",
        "version",
        "written",
    )

    def __init__(self, data, buffer, partitions=0, pbytes=0, name=""):
        self.data = data
        self.buffer = buffer
        self.partitions = partitions
        self.pbytes = pbytes
        self.written = np.zeros(data.shape[0], np.uint8) if buffer is psum else None
        self.name = name
        self.version = 0
        self.owner_core = None
        self.uid = next(_UIDS)


def _norm_shape(shape) -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise ValueError(f"shape: expected a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: negative dimension in {shape}")
    return shape


class NkiTensor:
    """A view of interpreter storage (the NKI ``NkiTensor``; NKI_API.md §2.3).

    ``shape``/``strides``/``offset`` follow the SDK: strides and offset are in elements of the
    view's dtype (internally kept in bytes so reinterpretation is exact). On-chip tensors have the
    partition dimension first.
    """

    __slots__ = (
        "__weakref__",
        "_npdt",
        "boffset",
        "bstrides",
        "dtype",
        "name",
        "shape",
        "storage",
    )

    def __init__(self, storage, dtype, shape, bstrides, boffset, name=""):
        self.storage = storage
        self.dtype = dtype
        self.shape = shape
        self.bstrides = bstrides
        self.boffset = boffset
        self.name = name
        self._npdt = _dt.np_dtype(dtype)

    # --- attributes of the SDK --------------------------------------------------------------
    @property
    def buffer(self):
        return self.storage.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self._npdt.itemsize

    @property
    def strides(self) -> tuple:
        isz = self._npdt.itemsize
        return tuple(s // isz for s in self.bstrides)

    @property
    def offset(self) -> int:
        return self.boffset // self._npdt.itemsize

    @property
    def is_onchip(self) -> bool:
        return _is_onchip(self.storage.buffer)

    def __repr__(self) -> str:
        return (f"NkiTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"buffer={self.storage.buffer.value})")

    # --- data access (interpreter internals) ------------------------------------------------
    def _np(self) -> np.ndarray:
        """Strided NumPy view of the tensor's elements (writes go to the storage)."""
        return np.ndarray(self.shape, self._npdt, buffer=self.storage.data, offset=self.boffset,
                          strides=self.bstrides)

    def _np_as(self, npdt) -> np.ndarray:
        """The same element positions viewed with another dtype of the SAME itemsize."""
        return np.ndarray(self.shape, npdt, buffer=self.storage.data, offset=self.boffset,
                          strides=self.bstrides)

    def _written_flags(self) -> np.ndarray:
        """PSUM only: the 'already written' flag of each element (flag of its first byte)."""
        return np.ndarray(self.shape, np.uint8, buffer=self.storage.written,
                          offset=self.boffset, strides=self.bstrides)

    def numpy(self) -> np.ndarray:
        """A copy of the tensor's elements (ml_dtypes / raw words for x4 types)."""
        return self._np().copy()

    def _derive(self, shape, bstrides, boffset, dtype=None) -> NkiTensor:
        return NkiTensor(self.storage, dtype or self.dtype, tuple(shape), tuple(bstrides),
                         boffset, self.name)

    # --- indexing ---------------------------------------------------------------------------
    def __getitem__(self, key) -> NkiTensor:
        if not isinstance(key, tuple):
            key = (key,)
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell > 1:
            raise IndexError(f"{self.name or 'tensor'}: more than one '...' in index")
        if n_ell:
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise IndexError(f"{self.name or 'tensor'}: {len(key)} indices for {self.ndim}-D "
                             f"tensor of shape {self.shape}")
        key = key + (slice(None),) * (self.ndim - len(key))
        boff = self.boffset
        shape, strides, dropped = [], [], []
        for d, (k, n, st) in enumerate(zip(key, self.shape, self.bstrides)):
            if isinstance(k, (int, np.integer)):
                i = int(k)
                if i < 0:
                    i += n
                if not 0 <= i < n:
                    raise IndexError(f"{self.name or 'tensor'}: index {k} out of bounds for dim "
                                     f"{d} of size {n} (shape {self.shape})")
                boff += i * st
                shape.append(1)
                strides.append(st)
                dropped.append(True)
            elif isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step == 0:
                    raise IndexError("slice step cannot be 0")
                if step > 0:
                    start = 0 if start is None else int(start)
                    stop = n if stop is None else int(stop)
                    if start < 0:
                        start += n
                    if stop < 0:
                        stop += n
                    if not (0 <= start <= n and 0 <= stop <= n):
                        raise IndexError(f"{self.name or 'tensor'}: slice {k.start}:{k.stop} "
                                         "out of "
                                         f"bounds for dim {d} of size {n} (shape {self.shape})")
                    cnt = max(0, -(-(stop - start) // step))
                else:
                    start, stop, step = k.indices(n)
                    cnt = len(range(start, stop, step))
                boff += start * st if cnt else 0
                shape.append(cnt)
                strides.append(st * step)
                dropped.append(False)
            else:
                raise TypeError(f"{self.name or 'tensor'}: unsupported index {k!r} (use int, "
                                "slice, nl.ds or ...; dynamic indices go through .ap())")
        keep = [not x for x in dropped]
        if self.is_onchip:
            keep[0] = True
            if sum(keep) < 2 and self.ndim >= 2:
                last = max(i for i in range(1, self.ndim) if dropped[i])
                keep[last] = True
        else:
            if not any(keep):
                keep[-1] = True
        shape = [s for s, k in zip(shape, keep) if k]
        strides = [s for s, k in zip(strides, keep) if k]
        return self._derive(shape, strides, boff)

    # --- view methods of the SDK ------------------------------------------------------------
    def slice(self, dim, start, end, step=1) -> NkiTensor:
        """View of ``start:end:step`` along ``dim`` (``0 <= start < end <= shape[dim]``)."""
        if not 0 <= start < end <= self.shape[dim]:
            raise IndexError(f"slice: need 0 <= start < end <= shape[{dim}]={self.shape[dim]}, "
                             f"got {start}, {end}")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim, index) -> NkiTensor:
        """Drop ``dim`` at a static ``index``."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError("select: only static int indices are supported by the interpreter")
        if self.is_onchip and dim == 0:
            raise NkiError("select: cannot select the partition dim of an on-chip tensor")
        i = int(index) % self.shape[dim]
        shape = self.shape[:dim] + self.shape[dim + 1:]
        strides = self.bstrides[:dim] + self.bstrides[dim + 1:]
        return self._derive(shape, strides, self.boffset + i * self.bstrides[dim])

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.is_onchip and dims[0] != 0:
            raise NkiError("permute: on-chip tensors must keep the partition dim first")
        return self._derive([self.shape[d] for d in dims], [self.bstrides[d] for d in dims],
                            self.boffset)

    def broadcast(self, dim, size) -> NkiTensor:
        if self.shape[dim] != 1:
            raise ValueError(f"broadcast: dim {dim} has size {self.shape[dim]}, needs 1")
        if self.is_onchip and dim == 0:
            raise NkiError("broadcast: cannot broadcast the partition dim of an on-chip tensor")
        shape, strides = list(self.shape), list(self.bstrides)
        shape[dim], strides[dim] = int(size), 0
        return self._derive(shape, strides, self.boffset)

    def expand_dim(self, dim) -> NkiTensor:
        shape, strides = list(self.shape), list(self.bstrides)
        shape.insert(dim, 1)
        strides.insert(dim, 0)
        return self._derive(shape, strides, self.boffset)

    def squeeze_dim(self, dim) -> NkiTensor:
        if self.shape[dim] != 1:
            raise ValueError(f"squeeze_dim: dim {dim} has size {self.shape[dim]}, needs 1")
        return self._derive(self.shape[:dim] + self.shape[dim + 1:],
                            self.bstrides[:dim] + self.bstrides[dim + 1:], self.boffset)

    def reshape_dim(self, dim, shape) -> NkiTensor:
        shape = _norm_shape(shape)
        if math.prod(shape) != self.shape[dim]:
            raise ValueError(f"reshape_dim: {shape} does not have {self.shape[dim]} elements")
        st = self.bstrides[dim]
        sub = [st * math.prod(shape[i + 1:]) for i in range(len(shape))]
        return self._derive(self.shape[:dim] + shape + self.shape[dim + 1:],
                            self.bstrides[:dim] + tuple(sub) + self.bstrides[dim + 1:],
                            self.boffset)

    def flatten_dims(self, start_dim, end_dim) -> NkiTensor:
        for d in range(start_dim, end_dim):
            if self.bstrides[d] != self.bstrides[d + 1] * self.shape[d + 1]:
                raise NkiError(f"flatten_dims: dims {start_dim}..{end_dim} are not contiguous")
        n = math.prod(self.shape[start_dim:end_dim + 1])
        return self._derive(self.shape[:start_dim] + (n,) + self.shape[end_dim + 1:],
                            self.bstrides[:start_dim] + (self.bstrides[end_dim],)
                            + self.bstrides[end_dim + 1:], self.boffset)

    def is_contiguous(self) -> bool:
        """Row-major contiguous (the partition dim is ignored on-chip)."""
        first = 1 if self.is_onchip else 0
        expect = self.itemsize
        for n, st in zip(reversed(self.shape[first:]), reversed(self.bstrides[first:])):
            if n != 1 and st != expect:
                return False
            expect *= n
        return True

    def reshape(self, shape) -> NkiTensor:
        """Reshape a contiguous view (on-chip: the partition dim must stay ``shape[0]``).

        Raises:
            ValueError: element count differs, or the partition dim changes on-chip.
            NkiError: the view is not contiguous.
        """
        shape = list(_norm_shape(shape) if not isinstance(shape, (list, tuple)) else
                     tuple(int(s) for s in shape))
        if shape.count(-1) > 1:
            raise ValueError("reshape: at most one -1")
        if -1 in shape:
            rest = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = self.size // rest if rest else 0
        if math.prod(shape) != self.size:
            raise ValueError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into "
                             f"{tuple(shape)}")
        if not self.is_contiguous():
            raise NkiError(f"reshape: view of shape {self.shape} is not contiguous")
        isz = self.itemsize
        if self.is_onchip:
            if shape[0] != self.shape[0]:
                raise ValueError(f"reshape: on-chip tensors keep the partition dim "
                                 f"({self.shape[0]}), got {tuple(shape)}")
            free = shape[1:]
            strides = [self.bstrides[0]] + [isz * math.prod(free[i + 1:]) for i in range(len(free))]
        else:
            strides = [isz * math.prod(shape[i + 1:]) for i in range(len(shape))]
        return self._derive(shape, strides, self.boffset)

    def view(self, dtype) -> NkiTensor:
        """Reinterpret the bytes as ``dtype``; the last dim scales by the itemsize ratio.

        Raises:
            NkiError: the last dim is not contiguous or does not divide evenly.
        """
        dtype = _dt.normalize(dtype)
        new = _dt.itemsize(dtype)
        old = self.itemsize
        if new == old:
            return self._derive(self.shape, self.bstrides, self.boffset, dtype)
        if self.ndim == 0:
            raise NkiError("view: 0-d tensor")
        last = self.shape[-1]
        if last != 1 and self.bstrides[-1] != old:
            raise NkiError(f"view({dtype}): the last dim of {self.shape} must be contiguous")
        nbytes = last * old
        if nbytes % new:
            raise NkiError(f"view({dtype}): last dim of {last} x {old} B is not a multiple of "
                           f"{new} B")
        shape = self.shape[:-1] + (nbytes // new,)
        return self._derive(shape, self.bstrides[:-1] + (new,), self.boffset, dtype)

    reinterpret_cast = view

    def get_pattern(self) -> list:
        """Access pattern ``[[step, num], ...]`` (steps in elements), outermost first."""
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_indirect(self) -> bool:
        return False

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0,
           dtype=None):
        """Raw access pattern (NKI_API.md §2.3).

        ``pattern = [[step, num], ...]`` in elements of ``dtype`` (default: this view's), base =
        this view's offset + ``offset``. With ``scalar_offset`` (a (1,1) SBUF tensor) or
        ``vector_offset`` (a (P,1) SBUF index tile) the result is an :class:`IndirectAP`,
        usable only by DMA instructions; the row stride is ``prod(self.shape[indirect_dim+1:])``.

        Raises:
            NkiError: on-chip partition step differs from the storage's partition size; both
                offsets given; vector offset on a non-HBM tensor.
        """
        dtype = self.dtype if dtype is None else _dt.normalize(dtype)
        isz = _dt.itemsize(dtype)
        pat = [(int(s), int(n)) for s, n in pattern]
        if not pat:
            raise ValueError("ap: empty pattern")
        boff = self.boffset + (int(offset) if offset is not None else 0) * isz
        shape = tuple(n for _, n in pat)
        bstrides = tuple(s * isz for s, _ in pat)
        if (self.is_onchip and vector_offset is None and pat[0][1] > 1
                and bstrides[0] != self.storage.pbytes):
            raise NkiError(f"ap: on-chip partition step {pat[0][0]} x {isz} B must equal the "
                           f"storage's partition size {self.storage.pbytes} B")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiError("ap: scalar_offset and vector_offset are mutually exclusive")
        if scalar_offset is None and vector_offset is None:
            return NkiTensor(self.storage, dtype, shape, bstrides, boff, self.name)
        if not 0 <= indirect_dim < self.ndim:
            raise NkiError(f"ap: indirect_dim {indirect_dim} out of range for {self.shape}")
        if vector_offset is not None:
            if self.is_onchip:
                raise NkiError("ap: a vector_offset needs an HBM tensor (dma_copy rule)")
            if indirect_dim != 0:
                raise NkiError("ap: vector_offset supports only indirect_dim=0")
        row_bytes = math.prod(self.shape[indirect_dim + 1:]) * self.itemsize
        return IndirectAP(self.storage, dtype, shape, bstrides, boff, self.name, row_bytes,
                          self.shape[indirect_dim], scalar_offset, vector_offset)


class IndirectAP:
    """An access pattern with a runtime offset (scalar or per-partition vector); DMA only.

    Element ``(w, ...)`` lives at byte ``boffset + idx * row_bytes + sum(step_k * i_k)`` with the
    leading step ignored in the vector form (``idx = vector_offset[w]``). An index outside
    ``[0, rows)`` is out of bounds (rows = ``shape[indirect_dim]`` of the tensor ``.ap`` was called
    on; the same rule for gathers and scatters).
    """

    __slots__ = (
        "_npdt",
        "boffset",
        "bstrides",
        "dtype",
        "name",
        "row_bytes",
        "rows",
        "scalar_offset",
        "shape",
        "storage",
        "vector_offset",
    )

    def __init__(self, storage, dtype, shape, bstrides, boffset, name, row_bytes, rows,
                 scalar_offset, vector_offset):
        self.storage, self.dtype, self.shape = storage, dtype, shape
        self.bstrides, self.boffset, self.name = bstrides, boffset, name
        self.row_bytes, self.rows = row_bytes, rows
        self.scalar_offset, self.vector_offset = scalar_offset, vector_offset
        self._npdt = _dt.np_dtype(dtype)
        if vector_offset is not None:
            if not isinstance(vector_offset, NkiTensor) or not vector_offset.is_onchip:
                raise NkiError("ap: vector_offset must be an SBUF index tile")
        elif isinstance(scalar_offset, NkiTensor) and scalar_offset.size != 1:
            raise NkiError(f"ap: scalar_offset must be a (1, 1) tensor, got {scalar_offset.shape}")

    @property
    def buffer(self):
        return self.storage.buffer

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self._npdt.itemsize

    @property
    def is_onchip(self) -> bool:
        return _is_onchip(self.storage.buffer)

    def is_indirect(self) -> bool:
        return True

    def __repr__(self) -> str:
        kind = "vector" if self.vector_offset is not None else "scalar"
        return f"IndirectAP({kind}, name={self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def row_table(self, where: str, oob_skip: bool):
        """Fast path of the vector form: ``(table, rows_idx, valid)`` with ``table[i]`` the
        pattern's inner block at row ``i`` (a strided view), or None when it does not apply."""
        vo = self.vector_offset
        if vo is None:
            return None
        if vo.size != vo.shape[0] or vo.shape[0] != self.shape[0]:
            return None  # resolve() raises the error
        try:
            table = np.ndarray((self.rows,) + self.shape[1:], self._npdt,
                               buffer=self.storage.data, offset=self.boffset,
                               strides=(self.row_bytes,) + self.bstrides[1:])
        except (ValueError, TypeError):
            return None
        idx = vo._np().reshape(-1).astype(np.int64)
        valid = (idx >= 0) & (idx < self.rows)
        if not oob_skip and not valid.all():
            bad = int(idx[~valid][0])
            raise NkiOOBError(f"{where}: indirect index {bad} out of bounds [0, {self.rows}) with "
                              "oob_mode.error")
        return table, idx, valid

    def resolve(self, where: str, oob_skip: bool):
        """Element indices into the storage (typed flat view) and the per-row valid mask.

        Returns:
            (flat, index [R, ...] int64, valid [R] bool). Rows are the leading pattern dim for the
            vector form; the scalar form has one "row" covering everything (R = 1 after reshape).

        Raises:
            NkiOOBError: an out-of-bounds index with oob_mode.error.
            NkiError: misaligned access or an address past the storage.
        """
        isz = self.itemsize
        if (self.boffset % isz or self.row_bytes % isz or any(s % isz for s in self.bstrides)):
            raise NkiError(f"{where}: indirect access not aligned to {self.dtype} elements")
        nel = self.storage.data.shape[0] // isz
        flat = np.ndarray((nel,), self._npdt, buffer=self.storage.data,
                          offset=0, strides=(isz,))
        base = self.boffset // isz
        row_el = self.row_bytes // isz
        if self.vector_offset is not None:
            vo = self.vector_offset
            if vo.size != vo.shape[0]:
                raise NkiError(f"{where}: vector_offset must be a (P, 1) tile, got {vo.shape}")
            if vo.shape[0] != self.shape[0]:
                raise NkiError(f"{where}: vector_offset has {vo.shape[0]} partitions but the "
                               f"pattern's leading dim is {self.shape[0]}")
            idx = vo._np().reshape(-1).astype(np.int64)
            inner = _pattern_index(self.shape[1:], [s // isz for s in self.bstrides[1:]])
            valid = (idx >= 0) & (idx < self.rows)
            bad = ~valid
            if bad.any() and not oob_skip:
                raise NkiOOBError(f"{where}: indirect index {int(idx[bad][0])} out of bounds "
                                  f"[0, {self.rows}) with oob_mode.error")
            idx_c = np.where(valid, idx, 0)
            index = base + idx_c.reshape((-1,) + (1,) * (len(self.shape) - 1)) * row_el + inner
        else:
            so = self.scalar_offset
            if isinstance(so, NkiTensor):
                s = int(np.asarray(so._np()).reshape(-1)[0].astype(np.int64))
            else:  # a VirtualRegister
                s = int(so.value)
            ok = 0 <= s < self.rows
            if not ok and not oob_skip:
                raise NkiOOBError(f"{where}: scalar offset {s} out of bounds [0, {self.rows}) with "
                                  "oob_mode.error")
            inner = _pattern_index(self.shape, [st // isz for st in self.bstrides])
            index = (base + (s if ok else 0) * row_el + inner).reshape((1,) + self.shape)
            valid = np.array([ok])
        vi = index[valid] if self.vector_offset is not None else (index if valid[0] else index[:0])
        if vi.size and (vi.min() < 0 or vi.max() >= nel):
            raise NkiError(f"{where}: indirect access reaches element {int(vi.max())} outside the "
                           f"storage of {nel} elements ({self.name!r})")
        return flat, index, valid


_PATTERN_CACHE: dict = {}


def _pattern_index(shape, steps) -> np.ndarray:
    """Element offsets of a strided pattern: sum_k i_k * steps[k], shape ``shape`` (cached)."""
    key = (tuple(shape), tuple(steps))
    out = _PATTERN_CACHE.get(key)
    if out is None:
        out = np.zeros(shape, dtype=np.int64)
        for k, (n, st) in enumerate(zip(shape, steps)):
            ax = [1] * len(shape)
            ax[k] = n
            out = out + (np.arange(n, dtype=np.int64) * st).reshape(ax)
        out.setflags(write=False)
        if len(_PATTERN_CACHE) > 256:
            _PATTERN_CACHE.clear()
        _PATTERN_CACHE[key] = out
    return out


# ------------------------------------------------------------------------------------------------
# Program instances


class CoreBarrier:
    """Reusable n-party barrier that fails fast: :meth:`abort` (a core failed, or returned while
    the other still waits) wakes every waiter with :class:`NkiError` instead of a hang."""

    def __init__(self, n: int):
        self.n = n
        self.cond = threading.Condition()
        self.count = 0
        self.generation = 0
        self.broken: str | None = None

    def abort(self, reason: str) -> None:
        with self.cond:
            if self.broken is None:
                self.broken = reason
            self.cond.notify_all()

    def wait(self, timeout_s: float, where: str) -> None:
        import time

        with self.cond:
            if self.broken:
                raise NkiBarrierError(f"{where}: barrier broken ({self.broken})")
            gen = self.generation
            self.count += 1
            if self.count == self.n:
                self.count = 0
                self.generation += 1
                self.cond.notify_all()
                return
            deadline = time.monotonic() + timeout_s
            while gen == self.generation:
                if self.broken:
                    raise NkiBarrierError(f"{where}: barrier broken ({self.broken})")
                left = deadline - time.monotonic()
                if left <= 0:
                    self.broken = f"timed out after {timeout_s} s"
                    self.cond.notify_all()
                    raise NkiBarrierError(f"{where}: barrier broken ({self.broken})")
                self.cond.wait(min(left, 0.5))


class SharedState:
    """State shared by the program instances of one launch (LNC2: two NeuronCores)."""

    def __init__(self, num_programs: int, timeout_s: float = 120.0):
        self.num_programs = num_programs
        self.lock = threading.Lock()
        self.barrier = CoreBarrier(num_programs) if num_programs > 1 else None
        self.shared_allocs: list = []  # in-kernel shared_hbm allocations, matched by order
        self.mailboxes: dict = {}
        self.timeout_s = timeout_s

    def mailbox(self, key):
        import queue

        with self.lock:
            q = self.mailboxes.get(key)
            if q is None:
                q = self.mailboxes[key] = queue.Queue()
            return q


class ProgramContext:
    """State of one program instance (one NeuronCore): target, SBUF/PSUM accounting, counters."""

    def __init__(self, *, target="trn3", program_id=0, num_programs=1, grid_ndim=None,
                 shared=None, profile=None):
        if target not in TARGETS:
            raise ValueError(f"target: {target!r} not one of {sorted(TARGETS)}")
        self.target = target
        self.spec = TARGETS[target]
        self.program_id = program_id
        self.num_programs = num_programs
        self.grid_ndim = (1 if num_programs > 1 else 0) if grid_ndim is None else grid_ndim
        self.shared = shared or SharedState(num_programs)
        self.sbuf_used = 0
        self.sbuf_peak = 0
        self.sbuf_peak_by_region: dict = {}  # region -> SBUF peak (B/partition) while in it
        self.psum_banks_used = 0
        self.psum_banks_peak = 0
        self.n_shared_allocs = 0
        self.act_registers = np.zeros(PMAX, np.float32)  # activation reduce registers
        from .profile import Profile

        self.profile = profile if profile is not None else Profile(target)
        self.counters = self.profile._core(program_id)
        self.region_stack = ["kernel"]
        self.launched = False  # True inside simulate()
        self.deq_cache: dict = {}
        self.lock = threading.Lock()  # guards the SBUF/PSUM counters (finalizers may run anywhere)  # nc_matmul_mx dequantized operands, keyed by storage versions

    # --- allocation -------------------------------------------------------------------------
    def allocate(self, shape, dtype, buffer, name="") -> NkiTensor:
        shape = _norm_shape(shape)
        dtype = _dt.normalize(dtype)
        if not isinstance(buffer, MemoryRegion):
            raise ValueError(
f"ndarray: buffer must be nl.sbuf/nl.psum/nl.hbm/nl.private_hbm/"
                             f"nl.shared_hbm, got {buffer!r} (strings are rejected since NKI 0.3)")
        isz = _dt.itemsize(dtype)
        if _is_onchip(buffer):
            if len(shape) < 1:
                raise ValueError("ndarray: on-chip tensors need a partition dim")
            P = shape[0]
            if not 1 <= P <= PMAX:
                raise NkiError(f"ndarray({name or '?'}): partition dim {P} of {buffer.value} "
                               f"tensor must be in [1, {PMAX}]")
            pbytes = math.prod(shape[1:]) * isz
            with self.lock:
                cost = self._reserve(buffer, pbytes, name)
            self.note_region_sbuf()  # outside the lock (a dict insert may run finalizers)
            data = np.empty(P * pbytes, np.uint8)
            st = Storage(data, buffer, P, pbytes, name)
            weakref.finalize(st, ProgramContext._free, weakref.ref(self), buffer is sbuf, cost)
            bstrides = [pbytes] + [isz * math.prod(shape[i + 1:]) for i in range(1, len(shape))]
        else:
            if buffer is shared_hbm and self.num_programs > 1:
                return self._shared_alloc(shape, dtype, name)
            data = np.empty(math.prod(shape) * isz, np.uint8)
            st = Storage(data, buffer, 0, 0, name)
            bstrides = [isz * math.prod(shape[i + 1:]) for i in range(len(shape))]
        _fill(data, dtype)
        st.owner_core = self.program_id
        return NkiTensor(st, dtype, shape, tuple(bstrides), 0, name)

    def _reserve(self, buffer, pbytes, name):
        """Account an on-chip allocation of ``pbytes`` per partition; returns its cost."""
        if buffer is sbuf:
            need = self.sbuf_used + pbytes
            cap = self.spec["sbuf_usable_bytes"]
            if need > cap:
                raise NkiCapacityError(
                    f"ndarray({name or '?'}): SBUF capacity exceeded on {self.target}: "
                    f"{pbytes} B/partition requested, {self.sbuf_used} B live, budget {cap} B")
            self.sbuf_used = need
            self.sbuf_peak = max(self.sbuf_peak, need)
            cost = pbytes
        else:
            banks = max(1, -(-pbytes // PSUM_BANK_BYTES))
            if self.psum_banks_used + banks > PSUM_NUM_BANKS:
                raise NkiCapacityError(
                    f"ndarray({name or '?'}): PSUM capacity exceeded: {pbytes} B/partition "
                    f"needs {banks} bank(s) of 2 KiB, {self.psum_banks_used} of "
                    f"{PSUM_NUM_BANKS} banks live")
            self.psum_banks_used += banks
            self.psum_banks_peak = max(self.psum_banks_peak, self.psum_banks_used)
            cost = banks
        return cost

    def note_region_sbuf(self) -> None:
        """Raise the current region's SBUF peak to the live bytes (at allocation and entry)."""
        r = self.region_stack[-1]
        self.sbuf_peak_by_region[r] = max(self.sbuf_peak_by_region.get(r, 0), self.sbuf_used)

    def _shared_alloc(self, shape, dtype, name):
        sh = self.shared
        k = self.n_shared_allocs
        self.n_shared_allocs += 1
        with sh.lock:
            if k < len(sh.shared_allocs):
                t = sh.shared_allocs[k]
                if t.shape != shape or t.dtype != dtype:
                    raise NkiError(f"ndarray(shared_hbm): allocation #{k} differs between program "
                                   f"instances ({t.shape}/{t.dtype} vs {shape}/{dtype}); both "
                                   "cores must follow the same control flow")
                return NkiTensor(t.storage, dtype, shape, t.bstrides, 0, name)
            isz = _dt.itemsize(dtype)
            data = np.empty(math.prod(shape) * isz, np.uint8)
            _fill(data, dtype)
            st = Storage(data, shared_hbm, 0, 0, name)
            t = NkiTensor(st, dtype, shape,
                          tuple(isz * math.prod(shape[i + 1:]) for i in range(len(shape))), 0, name)
            sh.shared_allocs.append(t)
            return t

    @staticmethod
    def _free(ctx_ref, is_sbuf, cost):
        ctx = ctx_ref()
        if ctx is None:
            return
        with ctx.lock:
            if is_sbuf:
                ctx.sbuf_used -= cost
            else:
                ctx.psum_banks_used -= cost


def _fill(data: np.ndarray, dtype: str) -> None:
    pat = _Fill.pattern(dtype)
    k = pat.size
    if data.size % k == 0:
        word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[k]
        data.view(word).fill(pat.view(word)[0])
    else:
        data[:] = np.resize(pat, data.size)


_tls = threading.local()


def current() -> ProgramContext:
    """The program instance running on this thread (a default trn3 LNC1 one outside simulate)."""
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        ctx = _tls.default = getattr(_tls, "default", None) or ProgramContext()
        _tls.ctx = ctx
    return ctx


def in_kernel() -> bool:
    """True while a simulate() launch runs on this thread."""
    ctx = getattr(_tls, "ctx", None)
    return ctx is not None and ctx.launched


def set_current(ctx):
    """Install ``ctx`` as this thread's program instance; returns the previous one."""
    prev = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    return prev


def wrap_array(arr: np.ndarray, dtype: str, buffer=None, name="") -> NkiTensor:
    """Wrap a C-contiguous NumPy array as an HBM tensor sharing its memory (no copy)."""
    if buffer is None:
        buffer = shared_hbm
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    data = arr.reshape(-1).view(np.uint8)
    st = Storage(data, buffer, 0, 0, name)
    st.owner_core = -1  # caller's memory (see runtime._convert_out)
    isz = _dt.itemsize(dtype)
    shape = tuple(arr.shape) if arr.ndim else (1,)
    bstrides = tuple(isz * math.prod(shape[i + 1:]) for i in range(len(shape)))
    return NkiTensor(st, dtype, shape, bstrides, 0, name)
