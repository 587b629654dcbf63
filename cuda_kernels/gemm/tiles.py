"""The one source of the grouped-wgrad tile rules: what tiles each kernel family accepts.

Read by the kernels (``Sm90TileConfig`` / ``Sm100TileConfig`` and the keys validate against it,
and size their shared-memory pipelines from it), by the API's validation
(``validate.check_tiling``) and by the docs (the class docstrings are generated from
:meth:`TileRules.describe`; ``configs/cuda/*_tiles.yaml`` point here). The YAML files hold only
the tuned per-shape choice among these tiles, read by :func:`load_tile_rules` and matched by
:func:`match_rule`; every YAML row is checked against these rules when read.

No CuTe DSL, no torch, no GPU query.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

from common.config_files import config_path, load_yaml_file

__all__ = [
    "SM90_TILES",
    "SM100_TILES",
    "TILE_RULES",
    "TileRules",
    "load_tile_rules",
    "match_rule",
    "rules_loader",
    "select_tile",
]


def _or(values: tuple[int, ...]) -> str:
    return " or ".join(str(v) for v in values) if len(values) < 3 else str(values)


@dataclasses.dataclass(frozen=True)
class TileRules:
    """The tiles one kernel family accepts.

    Attributes:
        arch: "SM90" | "SM100" (messages).
        tile_m: output rows (hidden) per MMA tile.
        tile_n_step: tile N is a multiple of this in ``[tile_n_step, tile_n_max]``.
        tile_n_max: largest tile N.
        tile_k: tokens per pipeline stage.
        two_cta_tile_m: the tile M that runs as a 2-CTA MMA over a (2, 1) cluster, or None (every
            tile on one CTA, cluster (1, 1)).
        max_cluster_ctas: the largest cluster the API accepts (a power of two); the kernel runs
            only :meth:`cluster_for` of its tile.
        group_align: every expert's token count is a multiple of this (tile K divides it).
        dense_partial_tiles: dense outputs may end in partial tiles (TMA clips); otherwise hidden
            and intermediate must be multiples of the tile.
        smem_bytes: usable dynamic shared memory per CTA (227 KiB on H100/H200 and B200).
        smem_reserved: shared memory kept for barriers and scheduler state.
        max_auto_stages: most pipeline stages chosen for a caller's tile.
        yaml: the tuned per-shape rules (``configs/cuda``).
    """

    arch: str
    tile_m: tuple[int, ...]
    tile_n_step: int
    tile_k: tuple[int, ...]
    two_cta_tile_m: int | None
    max_cluster_ctas: int
    group_align: int
    dense_partial_tiles: bool
    yaml: pathlib.Path
    tile_n_max: int = 256
    smem_bytes: int = 227 * 1024
    smem_reserved: int = 1024
    max_auto_stages: int = 8

    @property
    def tile_n(self) -> tuple[int, ...]:
        """Every accepted tile N."""
        return tuple(range(self.tile_n_step, self.tile_n_max + 1, self.tile_n_step))

    def cluster_for(self, tile_m: int) -> tuple[int, int]:
        """The CTA cluster the kernel runs ``tile_m`` on: (2, 1) for the 2-CTA tile, else (1, 1)."""
        return (2, 1) if tile_m == self.two_cta_tile_m else (1, 1)

    def stage_bytes(self, tile_m: int, tile_n: int, tile_k: int) -> int:
        """Bytes of one pipeline stage in one CTA: bf16 A and B tiles (a 2-CTA MMA splits both
        between the pair)."""
        return 2 * tile_k * (tile_m + tile_n) // self.cluster_for(tile_m)[0]

    def stages_for(self, tile_m: int, tile_n: int, tile_k: int) -> int:
        """As many stages (2 .. ``max_auto_stages``) as shared memory holds for this tile."""
        fit = (self.smem_bytes - self.smem_reserved) // self.stage_bytes(tile_m, tile_n, tile_k)
        return max(2, min(self.max_auto_stages, fit))

    def check_config(self, config) -> None:
        """Validate a tile config (``tile_m``, ``tile_n``, ``tile_k``, ``stages``).

        Raises:
            ValueError: naming ``<ConfigClass>.<field>`` and the rule.
        """
        cls = type(config).__name__
        if config.tile_m not in self.tile_m:
            raise ValueError(f"{cls}.tile_m must be {_or(self.tile_m)}, got {config.tile_m}")
        if config.tile_n % self.tile_n_step or not (
            self.tile_n_step <= config.tile_n <= self.tile_n_max
        ):
            raise ValueError(
                f"{cls}.tile_n must be a multiple of {self.tile_n_step} in [{self.tile_n_step}, "
                f"{self.tile_n_max}], got {config.tile_n}"
            )
        if config.tile_k not in self.tile_k:
            why = (
                f" (a divisor of the {self.group_align}-token expert alignment)"
                if self.group_align > 1
                else ""
            )
            raise ValueError(f"{cls}.tile_k must be {_or(self.tile_k)}{why}, got {config.tile_k}")
        if config.stages < 2:
            raise ValueError(f"{cls}.stages must be >= 2, got {config.stages}")
        stage_bytes = self.stage_bytes(config.tile_m, config.tile_n, config.tile_k)
        if stage_bytes * config.stages + self.smem_reserved > self.smem_bytes:
            raise ValueError(
                f"{cls}: {config.stages} stages of {stage_bytes} bytes overflow the "
                f"{self.smem_bytes}-byte shared memory of an {self.arch} CTA"
            )

    def describe(self, default: str) -> str:
        """The tiling sentence of the docs (class docstrings), from these rules."""
        if self.two_cta_tile_m is None:
            clusters = "cluster (1, 1) only (no clusters)"
        else:
            clusters = (
                f"cluster (1, 1), or (2, 1) for tile M {self.two_cta_tile_m} (2-CTA MMA); the API "
                f"takes powers of two up to {self.max_cluster_ctas} CTAs, the kernel only these"
            )
        partial = (
            "dense outputs may end in partial tiles, discrete ones need hidden / intermediate "
            "multiples of the tile"
            if self.dense_partial_tiles
            else "hidden and intermediate multiples of the tile (no partial output tiles)"
        )
        return (
            f"default {default}; tile M {_or(self.tile_m)}, N a multiple of {self.tile_n_step} "
            f"in [{self.tile_n_step}, {self.tile_n_max}], K {_or(self.tile_k)}; {clusters}; "
            f"{partial}"
        )


#: SM90 (sm90_bf16.py): one 64-row wgmma slab per consumer warp group (tile M 64 or 128);
#: wgmma N a multiple of 16 up to 256; tile K 64 bf16 = one 128-byte swizzle row; no clusters;
#: dense outputs may end in partial tiles (TMA zero-fills the loads and clips the stores and
#: reduce-adds of each expert's last tiles); discrete outputs (register stores) need whole tiles;
#: any expert token count.
SM90_TILES = TileRules(
    arch="SM90",
    tile_m=(64, 128),
    tile_n_step=16,
    tile_k=(64,),
    two_cta_tile_m=None,
    max_cluster_ctas=1,
    group_align=1,
    dense_partial_tiles=True,
    yaml=config_path("cuda", "sm90_tiles.yaml"),
)

#: SM100 (sm100_bf16.py; CUTLASS Blackwell dense GEMM can_implement): tcgen05.mma M 128 on one
#: CTA or 256 on a (2, 1) cluster; N a multiple of 32 up to 256 (two fp32 TMEM accumulators of
#: tile N columns each fit 512 columns); tile K 64 or 128 divides the 256-token expert alignment,
#: so no K tile straddles two experts; dense outputs may end in partial tiles (TMA zero-fills
#: loads, clips stores).
SM100_TILES = TileRules(
    arch="SM100",
    tile_m=(128, 256),
    tile_n_step=32,
    tile_k=(64, 128),
    two_cta_tile_m=256,
    max_cluster_ctas=16,
    group_align=256,
    dense_partial_tiles=True,
    yaml=config_path("cuda", "sm100_tiles.yaml"),
)


#: The BF16 tile rules of each kernel arch: the API's tiling checks (``validate.check_tiling``)
#: and per-expert token multiple (``bf16.TOKEN_ALIGN``) read them here. A new architecture adds
#: its :class:`TileRules` and a row.
TILE_RULES = {"sm90": SM90_TILES, "sm100": SM100_TILES}


def load_tile_rules(path: pathlib.Path, config_cls: type, arch: str) -> tuple:
    """Rules of a ``configs/cuda/*_tiles.yaml`` as ``(name, conditions, config)`` in file order
    (each config validated by ``config_cls``, i.e. against the family's :class:`TileRules`).

    Raises:
        RuntimeError: the file is missing or malformed.
    """
    try:
        data = load_yaml_file(path)
        rules = []
        for rule in data["rules"]:
            cond = {k: v for k, v in rule.items() if k not in ("name", "config")}
            rules.append((rule["name"], cond, config_cls(**rule["config"])))
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read {arch} tile configs from {path}: {exc}") from exc
    return tuple(rules)


def match_rule(
    rules: tuple,
    hidden: int,
    intermediate: int,
    num_experts: int,
    *,
    accumulate: bool = False,
    whole_tiles: bool = False,
):
    """The config of the first rule whose conditions hold (``hidden_multiple``,
    ``intermediate_multiple``, ``min_intermediate``, ``min_experts``, ``accumulate``; all
    optional), or None. ``whole_tiles``: skip configs whose tile does not divide hidden and
    intermediate (outputs that cannot end in partial tiles)."""
    for _name, cond, config in rules:
        if "accumulate" in cond and bool(cond["accumulate"]) != accumulate:
            continue
        if whole_tiles and (hidden % config.tile_m or intermediate % config.tile_n):
            continue
        if hidden % cond.get("hidden_multiple", 1):
            continue
        if intermediate % cond.get("intermediate_multiple", 1):
            continue
        if intermediate < cond.get("min_intermediate", 0):
            continue
        if num_experts < cond.get("min_experts", 0):
            continue
        return config
    return None


def rules_loader(rules: TileRules, config_cls: type):
    """The cached ``load_<family>_tile_rules()`` of a family: :func:`load_tile_rules` of
    ``rules.yaml`` with ``config_cls``, read once per process.

    Raises (when called):
        RuntimeError: the file is missing or malformed.
    """

    @functools.cache
    def load() -> tuple:
        return load_tile_rules(rules.yaml, config_cls, rules.arch)

    load.__doc__ = (
        f"Rules of ``configs/cuda/{rules.yaml.name}`` as ``(name, conditions, "
        f"{config_cls.__name__})`` in file order, read once (``tiles.load_tile_rules``).\n\n"
        "    Raises:\n        RuntimeError: the file is missing or malformed.\n    "
    )
    return load


def select_tile(
    rules: TileRules,
    config_cls: type,
    load_rules,
    hidden: int,
    intermediate: int,
    num_experts: int,
    *,
    mma_tiler_mn: tuple[int, int] | None,
    who: str,
    accumulate: bool = False,
    whole_tiles: bool = False,
):
    """The tile config a family's ``select_<family>_tile_config`` starts from: the caller's
    ``mma_tiler_mn`` as a ``config_cls`` (tile K the rules' first, as many stages as shared
    memory holds: :meth:`TileRules.stages_for`), else the first rule of ``load_rules()`` that
    holds (:func:`match_rule`), else None (the family says why no tile fits).

    The families' ``select_<family>_tile_config(hidden, intermediate, num_experts, tokens_hint,
    *, mma_tiler_mn, ...)`` take M (rows of Wgrad), N (columns) and E, a ``tokens_hint`` (the
    expected tokens_sum: unused by the current rules, kept for the contract) and the caller's
    ``mma_tiler_mn``, and return this config or refuse with ``ValueError``.

    Raises:
        ValueError: non-positive sizes (``who`` names the function), or a caller's tile the
            config refuses.
    """
    if hidden < 1 or intermediate < 1 or num_experts < 1:
        raise ValueError(
            f"{who}: sizes must be positive, got hidden={hidden}, intermediate={intermediate}, "
            f"num_experts={num_experts}"
        )
    if mma_tiler_mn is not None:
        tile_m, tile_n = (int(v) for v in mma_tiler_mn)
        tile_k = rules.tile_k[0]
        return config_cls(tile_m, tile_n, tile_k, rules.stages_for(tile_m, tile_n, tile_k))
    return match_rule(
        load_rules(), hidden, intermediate, num_experts, accumulate=accumulate,
        whole_tiles=whole_tiles,
    )
