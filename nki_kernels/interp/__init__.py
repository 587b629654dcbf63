"""CPU interpreter of the NKI API subset used by the blockwise MXFP8 MoE backward.

Use it through :mod:`nki_kernels._nki` (``from nki_kernels._nki import nki, nl, nisa, region``),
which picks the real ``nki`` when it is importable. This package doubles as the ``nki`` module:
``nki.language``, ``nki.isa``, ``nki.jit``, ``nki.simulate``, ``nki.dtype``.

``simulate(kernel, lnc=1, target="trn3")`` runs a kernel on NumPy; ``.last_profile`` then holds
per-region, per-engine counters and a modeled Trainium time (:mod:`.profile`).
Rules enforced and the memory policy: :mod:`.core`; instruction semantics: :mod:`.isa`.
"""

from . import dtypes, isa, language
from .core import (
    MemoryRegion,
    NkiBarrierError,
    NkiCapacityError,
    NkiError,
    NkiOOBError,
    NkiTensor,
    ProgramContext,
    current,
)
from .profile import Profile
from .runtime import Kernel, Simulated, jit, region, simulate

dtype = dtypes  # `nki.dtype` (LIB: `from nki.dtype import float8_e4m3fn_x4`)

__all__ = [
    "Kernel",
    "MemoryRegion",
    "NkiBarrierError",
    "NkiCapacityError",
    "NkiError",
    "NkiOOBError",
    "NkiTensor",
    "Profile",
    "ProgramContext",
    "Simulated",
    "current",
    "dtype",
    "dtypes",
    "isa",
    "jit",
    "language",
    "region",
    "simulate",
]
