"""The one plug-in point of the grouped GEMM kernel families: which kernel serves a static
contract, and why not.

A kernel family is one module (``sm90_bf16.py``, ``sm100_blockscaled.py``, ...) that the API
reaches only through this registry, by module name, imported when first asked (importing the
package imports no kernel module; CuTe DSL waits until a kernel compiles). Every family answers
the same three questions (the provider protocol of quack's ``backends/registry.py``:
``is_available`` / ``supports`` -> reason / ``load_op``):

- :meth:`KernelProvider.unavailable`: why the family cannot run in this process at all -- its
  module is not built, CuTe DSL is not installed, or the family's own gate says no (a
  hardware-unverified kernel's opt-in) -- or None;
- :meth:`KernelProvider.supports`: why it cannot serve one static contract
  (``_types.WgradContract``: shapes, majors, dtypes, modes, tiles), or None;
- :meth:`KernelProvider.launcher`: the launcher of a contract it supports, in its format's
  launcher signature (``bf16.py`` / ``blockscaled.py`` document them), compiled once per kernel
  key by the family's ``launch.KernelFamily``.

Adding a family (a new architecture, a new format, or the varlen-M grouped GEMMs of the forward
and the dgrad, ``problem="varlen_m"``):

1. write ``<family>.py``: its kernel, its compile key and ``FAMILY = launch.KernelFamily(...)``
   whose ``key_from_contract(contract)`` raises ``ValueError`` for a contract it cannot serve.
   That is the whole protocol by default; a module overrides a step by defining it:
   ``unavailable_reason() -> str | None`` (a gate), ``supports(contract) -> str | None`` (when
   "no key" is not the whole answer) and ``contract_launcher(contract) -> launcher`` (another
   launcher signature, or a lazy compile);
2. add one :func:`register_family` row at the end of this module (or call it from your own
   package before the first call);
3. if it has tuned tiles: its :class:`tiles.TileRules` in ``tiles.py`` and
   ``configs/cuda/<arch>_tiles.yaml``; on a new architecture also its row of
   ``tiles.TILE_RULES`` and its compute capability in ``env.kernel_arch``.

Nothing else in the package names a family: dispatch, the formats' compile, the device
selection and the JAX entries all ask :func:`provider` / :func:`find_kernel`. What the registry
reads of a contract is its ``arch`` and its format (``block_scaled``: None for BF16, else the
spec's ``fmt``); the rest is the family's to judge, so a varlen-M contract type of its own
plugs in the same way.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from . import env

__all__ = [
    "PROBLEMS",
    "KernelProvider",
    "contract_format",
    "find_kernel",
    "provider",
    "providers",
    "register_family",
]

#: The grouped-GEMM problems a family can solve: ``"varlen_k"`` (grouped wgrad: the tokens are
#: the GEMM's K, one output per expert) and ``"varlen_m"`` (grouped forward / dgrad: the tokens
#: are the GEMM's M, one weight per expert).
PROBLEMS = ("varlen_k", "varlen_m")


@dataclasses.dataclass(frozen=True)
class KernelProvider:
    """One kernel family as the API sees it.

    Attributes:
        name: the family ("sm90_bf16"); names it in messages.
        module: its module, imported by name when first asked
            ("cuda_kernels.gemm.sm90.wgrad_bf16").
        arch: the device generation the API routes to it: "sm90" (SM 9.x) or "sm100" (SM100+).
        formats: the operand formats it computes: "bf16", "mxfp8", "mxfp4", "nvfp4".
        problem: one of :data:`PROBLEMS`.
    """

    name: str
    module: str
    arch: str
    formats: tuple[str, ...]
    problem: str = "varlen_k"

    def load(self) -> Any:
        """The family module, or None when it is not built (``env.family_module``)."""
        return env.family_module(self.module)

    def gate(self) -> str | None:
        """The family's own gate: its module's ``unavailable_reason()`` (e.g. the opt-in of a
        kernel never run on hardware), or None (no gate, or not built: see :meth:`unavailable`)."""
        module = self.load()
        check = getattr(module, "unavailable_reason", None) if module is not None else None
        return check() if check is not None else None

    def unavailable(self) -> str | None:
        """Why the family cannot run here (module missing, the family's :meth:`gate`, CuTe DSL
        missing, checked in that order), or None."""
        if self.load() is None:
            return f"the {self.name} kernel module ({self.module}) cannot be imported"
        return self.gate() or env.cutlass_dsl_missing()

    def supports(self, contract: Any) -> str | None:
        """Why the family cannot serve ``contract``, or None: the module's ``supports``, else
        the ``ValueError`` of ``FAMILY.key_from_contract`` (no key, e.g. no tile fits)."""
        module = self.load()
        check = getattr(module, "supports", None)
        if check is not None:
            return check(contract)
        try:
            module.FAMILY.key_from_contract(contract)
        except ValueError as exc:
            return str(exc)
        return None

    def launcher(self, contract: Any):
        """The launcher of a supported ``contract``: the module's ``contract_launcher``, else
        ``FAMILY.launcher(FAMILY.key_from_contract(contract))`` (compiled now, once per key)."""
        module = self.load()
        make = getattr(module, "contract_launcher", None)
        if make is not None:
            return make(contract)
        return module.FAMILY.launcher(module.FAMILY.key_from_contract(contract))


_LOCK = threading.Lock()
_PROVIDERS: list[KernelProvider] = []


def register_family(family: KernelProvider) -> KernelProvider:
    """Plug ``family`` in (after the families registered before it: the first that serves a
    contract wins). Registering the same name again replaces the row in place.

    Raises:
        ValueError: an unknown ``problem`` or an empty ``formats``.
    """
    if family.problem not in PROBLEMS:
        raise ValueError(f"problem must be one of {PROBLEMS}, got {family.problem!r}")
    if not family.formats:
        raise ValueError(f"{family.name}: formats must name at least one operand format")
    with _LOCK:
        for i, known in enumerate(_PROVIDERS):
            if known.name == family.name:
                _PROVIDERS[i] = family
                break
        else:
            _PROVIDERS.append(family)
    return family


def providers(
    *, arch: str | None = None, fmt: str | None = None, problem: str = "varlen_k"
) -> tuple[KernelProvider, ...]:
    """The registered families of ``problem`` (and ``arch`` / ``fmt`` when given), in order."""
    with _LOCK:
        rows = tuple(_PROVIDERS)
    return tuple(
        p for p in rows
        if p.problem == problem and arch in (None, p.arch) and (fmt is None or fmt in p.formats)
    )


def provider(arch: str, fmt: str, problem: str = "varlen_k") -> KernelProvider | None:
    """The first family registered for ``arch`` and ``fmt``, or None."""
    rows = providers(arch=arch, fmt=fmt, problem=problem)
    return rows[0] if rows else None


def contract_format(contract: Any) -> str:
    """The operand format of a ``WgradContract``: "bf16", or its block-scaled ``fmt``."""
    spec = getattr(contract, "block_scaled", None)
    return "bf16" if spec is None else spec.fmt


def find_kernel(contract: Any, problem: str = "varlen_k") -> tuple[KernelProvider | None, str]:
    """The first family that can run ``contract`` here: ``(provider, "")``, or ``(None, why)``
    with every candidate's reason ("; "-joined; "no ... family is registered" without one)."""
    fmt = contract_format(contract)
    reasons = []
    for p in providers(arch=contract.arch, fmt=fmt, problem=problem):
        why = p.unavailable() or p.supports(contract)
        if why is None:
            return p, ""
        reasons.append(f"{p.name}: {why}")
    if not reasons:
        return None, f"no {fmt} {problem} kernel family is registered for {contract.arch}"
    return None, "; ".join(reasons)


# ---------------------------------------------------------------------------------------------
# The families of this package (one row each)
# ---------------------------------------------------------------------------------------------

_PKG = __name__.rpartition(".")[0]
register_family(KernelProvider("sm90_bf16", f"{_PKG}.sm90.wgrad_bf16", "sm90", ("bf16",)))
register_family(KernelProvider("sm100_bf16", f"{_PKG}.sm100.wgrad_bf16", "sm100", ("bf16",)))
register_family(
    KernelProvider("sm100_blockscaled", f"{_PKG}.sm100.wgrad_blockscaled", "sm100",
                   ("mxfp8", "mxfp4", "nvfp4"))
)
register_family(KernelProvider("sm90_mxfp8", f"{_PKG}.sm90.wgrad_mxfp8", "sm90", ("mxfp8",)))
register_family(
    KernelProvider("sm90_grouped_mm", f"{_PKG}.sm90.grouped_mm", "sm90", ("bf16",),
                   problem="varlen_m")
)
