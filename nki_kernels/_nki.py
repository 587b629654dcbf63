"""Import shim: the real NKI when installed, our CPU interpreter otherwise.

The kernel imports only from here::

    from nki_kernels._nki import nki, nl, nisa, region

Exports:
    nki: the ``nki`` package (real) or :mod:`nki_kernels.interp` (which offers ``nki.jit``,
        ``nki.simulate``, ``nki.language``, ``nki.isa``, ``nki.dtype``).
    nl, nisa: ``nki.language`` and ``nki.isa``.
    HAVE_REAL_NKI: True when ``import nki`` gives AWS's NKI: ``nki.jit``, ``nki.isa.nc_matmul_mx``
        and the rest of :data:`REQUIRED_API`, version >= 0.6.0 (``nki.__version__`` or the
        installed distribution). Anything else named ``nki`` on ``sys.path`` (a placeholder
        package) leaves the interpreter in charge; :data:`REAL_NKI_PROBLEM` says why.
    region(name): context manager attributing the interpreter's work counters to ``name``
        (e.g. "phase1"); a no-op on real NKI.
    simulate(kernel, lnc=1, target="trn3"): the interpreter's launcher (always available).
"""

from __future__ import annotations

import contextlib
import importlib

MIN_NKI_VERSION = (0, 6, 0)  # NKI 0.6.0 / Neuron SDK 2.32: nl.fori_loop, nisa.nc_matmul_mx
# The public API surface the kernel uses (SDK stubs nki/api/nki/{,isa/,language/}__init__.py).
REQUIRED_API = {
    "nki": ("jit",),
    "nki.isa": ("nc_matmul_mx", "quantize_mx", "dma_copy", "tensor_scalar", "register_load"),
    "nki.language": ("NKIObject", "ndarray", "fori_loop", "program_id", "shared_hbm"),
}


def _version_tuple(text) -> tuple[int, ...] | None:
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if parts else None


def real_nki_problem() -> str | None:
    """None when an importable ``nki`` is AWS's NKI (>= 0.6.0 with the API the kernel uses),
    else why not: a placeholder package named ``nki`` leaves the interpreter in charge."""
    try:
        mods = {name: importlib.import_module(name) for name in REQUIRED_API}
    except Exception as exc:  # noqa: BLE001 - any import failure means "no real NKI"
        return f"import failed ({type(exc).__name__}: {exc})"
    for name, attrs in REQUIRED_API.items():
        missing = [a for a in attrs if not hasattr(mods[name], a)]
        if missing:
            return f"{name} lacks {', '.join(missing)} (not AWS's NKI API)"
    version = getattr(mods["nki"], "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as _dist_version

            version = _dist_version("nki")
        except Exception:  # noqa: BLE001
            return "no version (neither nki.__version__ nor an installed 'nki' distribution)"
    vt = _version_tuple(version)
    if vt is None or vt < MIN_NKI_VERSION:
        return f"nki version {version!r} < {'.'.join(map(str, MIN_NKI_VERSION))}"
    return None


REAL_NKI_PROBLEM = real_nki_problem()
HAVE_REAL_NKI = REAL_NKI_PROBLEM is None

if HAVE_REAL_NKI:  # pragma: no cover - the real NKI wheel is only on AWS's index
    import nki  # type: ignore[import-not-found]
    import nki.isa as nisa  # type: ignore[import-not-found]
    import nki.language as nl  # type: ignore[import-not-found]

    @contextlib.contextmanager
    def region(name: str):
        """No-op on real NKI (the profiler attributes work there)."""
        yield

else:
    from nki_kernels import interp as nki
    from nki_kernels.interp import isa as nisa
    from nki_kernels.interp import language as nl
    from nki_kernels.interp import region

from nki_kernels.interp import simulate  # noqa: E402 - after the choice above

__all__ = ["HAVE_REAL_NKI", "REAL_NKI_PROBLEM", "nisa", "nki", "nl", "real_nki_problem", "region",
           "simulate"]
