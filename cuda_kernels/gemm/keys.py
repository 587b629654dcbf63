"""The compile key every grouped-wgrad kernel family shares (``KernelKey``: the static-contract
fields and their rules; each family adds its ``tile``). The tile rules are ``tiles.py``'s, the
compile / launch plumbing ``launch.py``'s. No CuTe DSL import at module level."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

OUT_DTYPES = ("bfloat16", "float16", "float32")


def check_key_fields(key: Any) -> None:
    """Validate the fields every grouped-wgrad compile key shares (sizes, majors, dtype, modes).

    Raises:
        ValueError: naming ``<KeyClass>.<field>`` and the rule.
    """
    cls = type(key).__name__
    for name in ("hidden", "intermediate", "num_experts"):
        value = getattr(key, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{cls}.{name} must be a positive int, got {value!r}")
    if key.a_major not in ("k", "m"):
        raise ValueError(f"{cls}.a_major must be 'k' or 'm', got {key.a_major!r}")
    if key.b_major not in ("k", "n"):
        raise ValueError(f"{cls}.b_major must be 'k' or 'n', got {key.b_major!r}")
    if key.out_dtype not in OUT_DTYPES:
        raise ValueError(f"{cls}.out_dtype must be one of {OUT_DTYPES}, got {key.out_dtype!r}")
    if key.output_mode not in ("dense", "discrete"):
        raise ValueError(
            f"{cls}.output_mode must be 'dense' or 'discrete', got {key.output_mode!r}"
        )
    if key.input_order not in ("tensor2d", "tensor_ragged"):
        raise ValueError(
            f"{cls}.input_order must be 'tensor2d' or 'tensor_ragged', got {key.input_order!r}"
        )


def check_k_major_tensor2d(key: Any, why: str) -> None:
    """The rule of the block-scaled keys: both operands K-major along tokens (``a_major =
    b_major = "k"``; ``why`` says whose rule) and ``input_order="tensor2d"``.

    Raises:
        ValueError: naming ``<KeyClass>`` and the rule.
    """
    cls = type(key).__name__
    if key.a_major != "k" or key.b_major != "k":
        raise ValueError(
            f"{cls}: {why} (a_major='k', b_major='k'); got a_major={key.a_major!r}, "
            f"b_major={key.b_major!r}"
        )
    if key.input_order != "tensor2d":
        raise ValueError(f"{cls}.input_order must be 'tensor2d', got {key.input_order!r}")


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Static contract of one compiled grouped-wgrad kernel (a family's compile-cache key).

    The token dimension (``tokens_sum``) and the offsets values are dynamic and not part of it.
    A family subclasses it with a last field ``tile`` (its tile config) and ``_TILES`` (its
    ``tiles.TileRules``).

    Attributes:
        hidden: M, rows of each expert's Wgrad (and of A).
        intermediate: N, columns of each expert's Wgrad (and of B).
        num_experts: E.
        a_major: ``"k"`` (A stride ``(tokens_sum, 1)``) or ``"m"`` (stride ``(1, hidden)``).
        b_major: ``"k"`` (B stride ``(1, tokens_sum)``) or ``"n"`` (stride ``(intermediate, 1)``).
        out_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        output_mode: ``"dense"`` (one ``(E, M, N)`` row-major tensor) or ``"discrete"`` (``(E,)``
            int64 pointers to ``(M, N)`` row-major outputs, 16-byte aligned).
        accumulate: add into the output instead of overwriting it.
        input_order: ``"tensor2d"`` or ``"tensor_ragged"``.

    Raises:
        ValueError: a field outside the values above, a ``tile`` of another family, or hidden /
            intermediate that the tile does not divide where the family writes whole tiles.
    """

    _TILES: ClassVar[Any] = None

    hidden: int
    intermediate: int
    num_experts: int
    a_major: str = "k"
    b_major: str = "n"
    out_dtype: str = "bfloat16"
    output_mode: str = "dense"
    accumulate: bool = False
    input_order: str = "tensor2d"

    def __post_init__(self) -> None:
        check_key_fields(self)
        cls = type(self).__name__
        tile_cls = type(self).__dataclass_fields__["tile"].default.__class__
        if not isinstance(self.tile, tile_cls):
            msg = f"{cls}.tile must be a {tile_cls.__name__}, got {self.tile!r}"
            raise ValueError(msg)  # noqa: TRY004 - ValueError is the API contract
        rules = self._TILES
        if rules.dense_partial_tiles and self.output_mode == "dense":
            return  # TMA zero-fills the loads and clips the stores of each expert's last tiles
        why = (
            "for discrete outputs (no partial output tiles)"
            if rules.dense_partial_tiles
            else f"(the {rules.arch} kernel has no partial output tiles)"
        )
        if self.hidden % self.tile.tile_m:
            raise ValueError(
                f"{cls}: hidden={self.hidden} must be a multiple of tile_m={self.tile.tile_m} {why}"
            )
        if self.intermediate % self.tile.tile_n:
            raise ValueError(
                f"{cls}: intermediate={self.intermediate} must be a multiple of tile_n="
                f"{self.tile.tile_n} {why}"
            )

    @property
    def m_tiles(self) -> int:
        """MMA tiles along hidden: ``ceil(M / tile_m)``."""
        return -(-self.hidden // self.tile.tile_m)

    @property
    def n_tiles(self) -> int:
        """MMA tiles along intermediate: ``ceil(N / tile_n)``."""
        return -(-self.intermediate // self.tile.tile_n)

    @property
    def num_tiles(self) -> int:
        """Output tiles of one launch: ``E * ceil(M / tile_m) * ceil(N / tile_n)``."""
        return self.num_experts * self.m_tiles * self.n_tiles


@dataclasses.dataclass(frozen=True)
class KMajorKernelKey(KernelKey):
    """A :class:`KernelKey` whose operands are both K-major along tokens, ``tensor2d`` (FP8
    wgmma, the block-scaled tcgen05.mma): the block-scaled families' keys, fp32 output by
    default. A subclass says whose rule in ``_K_MAJOR_WHY``, the element types its format
    takes in :meth:`elems`, and adds its fields (an ``elem`` among them) and ``tile``.

    Raises:
        ValueError: :class:`KernelKey`'s rules, :func:`check_k_major_tensor2d`, or an ``elem``
            outside :meth:`elems`.
    """

    _K_MAJOR_WHY: ClassVar[str] = "both operands must be K-major along tokens"

    a_major: str = "k"
    b_major: str = "k"
    out_dtype: str = "float32"

    def elems(self) -> tuple[str, ...]:
        """The operand element types the key's format takes (``"e4m3"``, ``"e2m1"``, ...)."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        super().__post_init__()
        check_k_major_tensor2d(self, self._K_MAJOR_WHY)
        elems = self.elems()
        if self.elem not in elems:
            raise ValueError(
                f"{type(self).__name__}.elem must be one of {elems}, got {self.elem!r}"
            )
