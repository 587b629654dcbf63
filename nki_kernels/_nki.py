"""Import shim: the real NKI when installed, our CPU interpreter otherwise.

The kernel imports only from here::

    from nki_kernels._nki import nki, nl, nisa, region

Exports:
    nki: the ``nki`` package (real) or :mod:`nki_kernels.interp` (which offers ``nki.jit``,
        ``nki.simulate``, ``nki.language``, ``nki.isa``, ``nki.dtype``).
    nl, nisa: ``nki.language`` and ``nki.isa``.
    HAVE_REAL_NKI: True when ``import nki`` worked.
    region(name): context manager attributing the interpreter's work counters to ``name``
        (e.g. "phase1"); a no-op on real NKI.
    simulate(kernel, lnc=1, target="trn3"): the interpreter's launcher (always available).
"""

from __future__ import annotations

import contextlib

try:  # pragma: no cover - the real NKI wheel is only on AWS's index
    import nki  # type: ignore[import-not-found]
    import nki.isa as nisa  # type: ignore[import-not-found]
    import nki.language as nl  # type: ignore[import-not-found]

    HAVE_REAL_NKI = True

    @contextlib.contextmanager
    def region(name: str):
        """No-op on real NKI (the profiler attributes work there)."""
        yield

except ImportError:
    from nki_kernels import interp as nki
    from nki_kernels.interp import isa as nisa
    from nki_kernels.interp import language as nl
    from nki_kernels.interp import region

    HAVE_REAL_NKI = False

from nki_kernels.interp import simulate

__all__ = ["HAVE_REAL_NKI", "nisa", "nki", "nl", "region", "simulate"]
