"""Configuration types of the NKI blockwise MXFP8 MoE backward, with AWS nki-library's names.

The names, field order and defaults follow AWS nki-library (``nkilib.experimental``, commit
``e9ef98fc``; NKI_API.md §5): ``MatmulMxfp8KernelConfig`` from ``matmul_mxfp8.matmul_mxfp8_config``,
``SkipMode`` / ``ShardOption`` / ``AffinityOption`` / ``ActFnType`` / ``ClampLimits`` from
``moe.bwd.moe_bwd_parameters`` and ``QuantScheme`` from
``mxfp_utils.mxfp8_utils.common_dataclasses``, so that code written against AWS's kernel reads
the same here. ``ClampLimits`` is the project-wide type of :mod:`common.problem` (same field names
as AWS's).

Per-phase GEMM shapes (M, K, N) of the backward (REFERENCE §3; AWS ``_resolve_phase_configs``),
with ``S = 2`` cores under LNC2 (SHARD_ON_FREE shards the phase's free axis), else ``S = 1``:

=======  ======================  ========================================
phase    (M, K, N)               contraction axis K (MX-quantized)
=======  ======================  ========================================
phase1   (B, H, I / S)           H:  dh_raw = dY_block @ W_down[e]^T
phase2   (B, 2I, H / S)          2I: dX_block = d_gate_up @ W_gate_up[e]^T
phase3   (I, B, H / S)           B:  dW_gate_up[e] += d_gate_up^T @ X_block
phase4   (H / S, B, I)           B:  dW_down[e] += (alpha*h)^T @ dY_block
=======  ======================  ========================================

Tuned per-phase configs are data: ``configs/nki/*.yaml`` keyed by shape, read by
:func:`load_tuned_phase_configs`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config_files import config_path, load_yaml_file
from common.problem import ClampLimits

__all__ = [
    "DEFAULT_COMPUTE_DTYPE",
    "DEFAULT_FP8_X4_DTYPE",
    "PHASE_NAMES",
    "KernelClampLimits",
    "ActFnType",
    "AffinityOption",
    "ClampLimits",
    "MatmulMxfp8KernelConfig",
    "QuantScheme",
    "ShardOption",
    "SkipMode",
    "default_phase_configs",
    "load_tuned_phase_configs",
    "phase_shapes",
    "tuned_config_key",
]

# Classes used while tracing derive from nl.NKIObject (SDK nki-language-guide.rst, "Class
# Support": "the class must inherit from NKIObject and no other classes"): the real one when
# nki_kernels._nki found the real NKI, else our interpreter's (which checks kernel arguments).
from nki_kernels._nki import nl as _nl

_NKIObject: type = _nl.NKIObject

# nl dtypes are plain strings equal to their names (SDK stub: ``DType = str``; NKI_API.md §2.1).
DEFAULT_FP8_X4_DTYPE = "float8_e4m3fn_x4"
DEFAULT_COMPUTE_DTYPE = "bfloat16"

PHASE_NAMES = ("phase1", "phase2", "phase3", "phase4")

# Allowed values, with why (AWS nki-library asserts; REFERENCE §5).
TILE_K_CHOICES = (128, 256, 512)  # one DGT / quantize K tile: 512 = 128 partitions x 4 (x4 words)
MX_PARTITION_SIZE = 32  # one MX group = 8 partitions x 4 lanes; tiles come in multiples of 32
TILE_M_MAX = 128  # nc_matmul_mx stationary free size (gemm_stationary_fmax)
TILE_N_MAX = 8192  # AWS TILE_SIZE_GEMM_MOVING_MAX (moving tiles are split per PSUM bank inside)
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
LOOP_ORDERS = tuple("".join(p) for p in itertools.permutations("mnk"))


@dataclass(frozen=True)
class SkipMode(_NKIObject):
    """Out-of-bounds handling of the indirect DMA gathers (AWS ``moe_bwd_parameters.SkipMode``).

    Attributes:
        skip_token: token rows whose id is out of bounds (padding slot ``-1``) are skipped by the
            DMA (``oob_mode.skip``) instead of raising; the gather tile keeps its memset zeros.
        skip_weight: the same for weight rows.
    """

    skip_token: bool = False
    skip_weight: bool = False

    def __post_init__(self) -> None:
        for name in ("skip_token", "skip_weight"):
            if not isinstance(getattr(self, name), bool):
                msg = f"SkipMode.{name} must be a bool, got {getattr(self, name)!r}"
                raise ValueError(msg)  # noqa: TRY004 - the project raises ValueError for bad input


@dataclass(frozen=True)
class KernelClampLimits(_NKIObject):
    """:class:`ClampLimits` as the kernel receives it: an ``NKIObject`` with the same four fields
    (AWS's ``moe_bwd_parameters.ClampLimits`` is one). :class:`ClampLimits` (common.problem) is
    a plain dataclass, so launchers convert it with :meth:`from_limits` before tracing."""

    linear_clamp_upper_limit: float | None = None
    linear_clamp_lower_limit: float | None = None
    non_linear_clamp_upper_limit: float | None = None
    non_linear_clamp_lower_limit: float | None = None

    @staticmethod
    def from_limits(limits: Any) -> KernelClampLimits | None:
        """None -> None; a ClampLimits (validated by its own constructor) -> the same limits."""
        if limits is None or isinstance(limits, KernelClampLimits):
            return limits
        checked = ClampLimits(**{f.name: getattr(limits, f.name)
                                 for f in dataclasses.fields(KernelClampLimits)})
        return KernelClampLimits(**dataclasses.asdict(checked))


class ShardOption(enum.Enum):
    """LNC2 sharding strategy (AWS ``moe_bwd_parameters.ShardOption``). Only SHARD_ON_FREE runs."""

    SHARD_ON_FREE = 0
    SHARD_ON_HIDDEN = 1
    SHARD_ON_BLOCK = 2


class AffinityOption(enum.Enum):
    """Where the expert affinity is folded into the FFN chain. Only AFFINITY_ON_I runs."""

    AFFINITY_ON_H = 0
    AFFINITY_ON_I = 1


class ActFnType(enum.Enum):
    """Activation of the gated MLP (AWS ``core.utils.common_types.ActFnType``). Only SiLU runs."""

    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3
    ReLU = 4
    SquaredReLU = 5


class QuantScheme(enum.Enum):
    """MX group layout of a quantized operand (AWS ``common_dataclasses.QuantScheme``).

    WRAPX: a 32-element group is 4 runs of 8 consecutive K indices, ``tile_k / 4`` apart
    (NKI_API.md §4.6); the only scheme the MXFP8 backward accepts. _1x32: 32 contiguous K.
    """

    WRAPX = "wrapX"
    _1x32 = "1x32"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class MatmulMxfp8KernelConfig(_NKIObject):
    """Tiling of one MXFP8 GEMM phase (AWS ``matmul_mxfp8_config.MatmulMxfp8KernelConfig``).

    Mutable, like AWS's (AWS's kernel entry fills unset fields in place); the functions of this
    module never mutate a config they are given: they return copies (``dataclasses.replace``).
    Field order and defaults are AWS's at nki-library ``e9ef98fc``; ``TILES_IN_LOAD_K`` (from
    AWS's newer revision) is appended last so positional use of AWS's fields is unchanged.

    Args:
        M, K, N: the GEMM shape ``[M, K] @ [K, N]`` in elements; K is the MX-quantized
            contraction axis. The kernel entry overwrites them with the phase's shape
            (:func:`phase_shapes`); 0 is allowed as "not yet known".
        tile_m: rows of the stationary operand per matmul (multiple of 32, <= 128), or None.
        tile_k: contraction elements per quantize/matmul tile, one of 128, 256, 512, or None.
        tile_n: columns of the moving operand per matmul (multiple of 32, <= 8192), or None.
        TILES_IN_BLOCK_M/N/K: tiles per SBUF-resident block along M/N/K (>= 1), or None (-> 1).
        TILES_IN_LOAD_M/N: tiles per DMA load along M/N (>= 1, dividing the block's), or None.
        block_loop_order, tile_loop_order: a permutation of ``"mnk"``.
        float8_dtype: ``"float8_e4m3fn"`` or ``"float8_e5m2"``.
        enable_scale_packing: up to 4 scale views share one scale tile (offsets 0/4/8/12 of each
            quadrant, NKI_API.md §4.5); our kernel packs the K tiles of each operand in phases
            1-2 and both operands of phases 3-4; changes no value. An omitted phase takes the
            wrapper's ``use_scale_packing`` (default True).
        run_with_lnc2: run the phase sharded over 2 NeuronCores.
        lnc_2_shard_rhs: shard the moving (rhs) operand under LNC2; None = auto (N >= M).
        spill_reload: spill quantized tiles to HBM for reuse across K blocks.
        enable_psum_copy_in: start a K block by copying the fp32 partial into PSUM.
        lhs_is_swizzled, rhs_is_swizzled: operand already in the WRAPX layout in HBM.
        load_with_PE_swizzle: swizzle on TensorE instead of by DMA transpose.
        quant_scheme: :class:`QuantScheme` or its string value; stored as the enum.
        output_dtype: dtype of the GEMM output, or None (the phase decides).
        TILES_IN_LOAD_K: tiles per DMA load along K (>= 1), or None (-> 1). Not in AWS e9ef98fc.

    Raises:
        ValueError: a field outside its allowed values, naming the field and the rule.
    """

    M: int
    K: int
    N: int
    tile_m: int | None = None
    tile_k: int | None = None
    tile_n: int | None = None
    TILES_IN_BLOCK_M: int | None = None
    TILES_IN_BLOCK_N: int | None = None
    TILES_IN_BLOCK_K: int | None = None
    TILES_IN_LOAD_M: int | None = None
    TILES_IN_LOAD_N: int | None = None
    block_loop_order: str = "mnk"
    tile_loop_order: str = "mnk"
    float8_dtype: str = "float8_e4m3fn"
    enable_scale_packing: bool = False
    run_with_lnc2: bool = True
    lnc_2_shard_rhs: bool | None = None
    spill_reload: bool = False
    enable_psum_copy_in: bool = True
    lhs_is_swizzled: bool = True
    rhs_is_swizzled: bool = True
    load_with_PE_swizzle: bool = False
    quant_scheme: str | QuantScheme = "wrapX"
    output_dtype: object | None = None
    TILES_IN_LOAD_K: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.quant_scheme, str):
            try:
                self.quant_scheme = QuantScheme(self.quant_scheme)
            except ValueError:
                raise ValueError(
                    "MatmulMxfp8KernelConfig.quant_scheme must be a QuantScheme or one of "
                    f"{[q.value for q in QuantScheme]}, got {self.quant_scheme!r}"
                ) from None
        self.validate()

    def validate(self) -> MatmulMxfp8KernelConfig:
        """Check every field against its rule; return ``self``.

        Raises:
            ValueError: naming the field and the rule it breaks.
        """
        cls = "MatmulMxfp8KernelConfig"
        for name in ("M", "K", "N"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{cls}.{name} must be an int >= 0, got {v!r}")
        if self.tile_k is not None and self.tile_k not in TILE_K_CHOICES:
            raise ValueError(f"{cls}.tile_k must be one of {TILE_K_CHOICES}, got {self.tile_k!r}")
        for name, hi in (("tile_m", TILE_M_MAX), ("tile_n", TILE_N_MAX)):
            v = getattr(self, name)
            if v is None:
                continue
            if not _is_int(v) or v <= 0 or v % MX_PARTITION_SIZE or v > hi:
                raise ValueError(
                    f"{cls}.{name} must be a positive multiple of {MX_PARTITION_SIZE} and <= {hi}, "
                    f"got {v!r}"
                )
        for name in (
            "TILES_IN_BLOCK_M",
            "TILES_IN_BLOCK_N",
            "TILES_IN_BLOCK_K",
            "TILES_IN_LOAD_M",
            "TILES_IN_LOAD_N",
            "TILES_IN_LOAD_K",
        ):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{cls}.{name} must be an int >= 1 or None, got {v!r}")
        for axis in "MNK":
            block = getattr(self, f"TILES_IN_BLOCK_{axis}")
            load = getattr(self, f"TILES_IN_LOAD_{axis}")
            if block is not None and load is not None and (load > block or block % load):
                raise ValueError(
                    f"{cls}.TILES_IN_LOAD_{axis} ({load}) must divide "
                    f"TILES_IN_BLOCK_{axis} ({block}) (AWS validate_shapes)"
                )
        for name in ("block_loop_order", "tile_loop_order"):
            v = getattr(self, name)
            if v not in LOOP_ORDERS:
                raise ValueError(f"{cls}.{name} must be a permutation of 'mnk', got {v!r}")
        if str(self.float8_dtype) not in FLOAT8_DTYPES:
            raise ValueError(
                f"{cls}.float8_dtype must be one of {FLOAT8_DTYPES}, got {self.float8_dtype!r}"
            )
        for name in (
            "enable_scale_packing",
            "run_with_lnc2",
            "spill_reload",
            "enable_psum_copy_in",
            "lhs_is_swizzled",
            "rhs_is_swizzled",
            "load_with_PE_swizzle",
        ):
            if not isinstance(getattr(self, name), bool):
                msg = f"{cls}.{name} must be a bool, got {getattr(self, name)!r}"
                raise ValueError(msg)  # noqa: TRY004
        if self.lnc_2_shard_rhs is not None and not isinstance(self.lnc_2_shard_rhs, bool):
            raise ValueError(f"{cls}.lnc_2_shard_rhs must be a bool or None")
        if not isinstance(self.quant_scheme, QuantScheme):
            msg = f"{cls}.quant_scheme must be a QuantScheme, got {self.quant_scheme!r}"
            raise ValueError(msg)  # noqa: TRY004
        return self

    @property
    def is_resolved(self) -> bool:
        """True when every tiling field is set (nothing left for :func:`default_phase_configs`)."""
        return all(
            getattr(self, f) is not None
            for f in (
                "tile_m",
                "tile_k",
                "tile_n",
                "TILES_IN_BLOCK_M",
                "TILES_IN_BLOCK_N",
                "TILES_IN_BLOCK_K",
                "TILES_IN_LOAD_M",
                "TILES_IN_LOAD_N",
                "TILES_IN_LOAD_K",
            )
        )

    def key(self) -> tuple:
        """A hashable snapshot of every field (the config is mutable, so it is not hashable)."""
        return tuple(
            (
                f.name,
                getattr(self, f.name).value if f.name == "quant_scheme" else getattr(self, f.name),
            )
            for f in dataclasses.fields(self)
        )


def phase_shapes(H: int, I: int, B: int, lnc2: bool) -> tuple[tuple[int, int, int], ...]:
    """The (M, K, N) GEMM shape of each of the four phases (module table; AWS entry function).

    Args:
        H: hidden size. I: intermediate size per TP shard (``I_TP``). B: block_size.
        lnc2: whether the kernel runs on 2 cores (SHARD_ON_FREE halves each phase's free axis).

    Returns:
        ``((B, H, I/S), (B, 2I, H/S), (I, B, H/S), (H/S, B, I))`` with S = 2 if ``lnc2`` else 1.

    Raises:
        ValueError: a size <= 0, or H / I not divisible by the number of shards.
    """
    S = 2 if lnc2 else 1
    for name, v in (("H", H), ("I", I), ("B", B)):
        if not _is_int(v) or v <= 0:
            raise ValueError(f"phase_shapes: {name} must be a positive int, got {v!r}")
    if H % S or I % S:
        raise ValueError(f"phase_shapes: H={H} and I={I} must be divisible by num_shards={S}")
    return ((B, H, I // S), (B, 2 * I, H // S), (I, B, H // S), (H // S, B, I))


def _default_tile_sizes(M: int, K: int, N: int) -> dict[str, int]:
    """AWS ``mlp_mxfp8.common_utils.get_tile_sizes``: the largest default tile that fits."""
    return {
        "tile_m": min(128, M),
        "tile_k": min(512, K),
        "tile_n": min(512, N),
    }


def default_phase_configs(
    H: int,
    I: int,
    B: int,
    lnc2: bool,
    phase_configs: tuple[MatmulMxfp8KernelConfig | None, ...] = (None, None, None, None),
    *,
    spill_reload: bool = False,
    use_scale_packing: bool = True,
) -> tuple[MatmulMxfp8KernelConfig, ...]:
    """Resolve the four phase configs as AWS's kernel entry does (``_resolve_phase_configs``).

    For each phase: start from the given config (a copy; never mutated) or, when None, from AWS's
    default ``MatmulMxfp8KernelConfig(M=0, K=0, N=0, TILES_IN_BLOCK_*=1, WRAPX)`` with the
    wrapper's ``spill_reload`` and ``enable_scale_packing = use_scale_packing``; set (M, K, N) to
    the phase's shape (:func:`phase_shapes`) and ``run_with_lnc2 = lnc2``; unset ``TILES_IN_*``
    become 1; unset tile sizes come from AWS ``get_tile_sizes(K, M, N)`` (M >= 128 -> 128,
    K >= 512 -> 512, N >= 512 -> 512, else the dimension itself; H = 384 uses the 512^3 tiles).

    Args:
        H, I, B: hidden size, intermediate size per TP shard, block_size.
        lnc2: run on 2 cores (``run_with_lnc2``).
        phase_configs: 4 entries, each a :class:`MatmulMxfp8KernelConfig` or None.
        spill_reload, use_scale_packing: the wrapper defaults, used for omitted phases only.

    Returns:
        Four fully resolved :class:`MatmulMxfp8KernelConfig` (``is_resolved`` is True).

    Raises:
        ValueError: wrong number/type of phase configs, or a resolved config that breaks a rule
            (e.g. ``phase3: tile_k must be one of (128, 256, 512)``), naming the phase.
    """
    if not isinstance(phase_configs, (tuple, list)) or len(phase_configs) != 4:
        raise ValueError(f"phase_configs must be 4 entries (phase1..phase4), got {phase_configs!r}")
    shapes = phase_shapes(H, I, B, lnc2)
    out = []
    for name, given, (M, K, N) in zip(PHASE_NAMES, phase_configs, shapes):
        if given is None:
            cfg = MatmulMxfp8KernelConfig(
                M=0,
                K=0,
                N=0,
                TILES_IN_BLOCK_M=1,
                TILES_IN_BLOCK_N=1,
                TILES_IN_BLOCK_K=1,
                quant_scheme=QuantScheme.WRAPX,
                spill_reload=spill_reload,
                enable_scale_packing=use_scale_packing,
            )
        elif isinstance(given, MatmulMxfp8KernelConfig):
            cfg = dataclasses.replace(given)
        else:
            raise ValueError(
                f"{name}_config must be a MatmulMxfp8KernelConfig or None, "
                f"got {type(given).__name__}"
            )
        tiles = _default_tile_sizes(512, 512, 512) if H == 384 else _default_tile_sizes(M, K, N)
        updates: dict[str, Any] = {"M": M, "K": K, "N": N, "run_with_lnc2": bool(lnc2)}
        for field_name in (
            "TILES_IN_BLOCK_M",
            "TILES_IN_BLOCK_N",
            "TILES_IN_BLOCK_K",
            "TILES_IN_LOAD_M",
            "TILES_IN_LOAD_N",
            "TILES_IN_LOAD_K",
        ):
            if getattr(cfg, field_name) is None:
                updates[field_name] = 1
        for field_name in ("tile_m", "tile_k", "tile_n"):
            if getattr(cfg, field_name) is None:
                updates[field_name] = tiles[field_name]
        try:
            cfg = dataclasses.replace(cfg, **updates)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if cfg.quant_scheme != QuantScheme.WRAPX:
            raise ValueError(
                f"{name}: unsupported quant_scheme {cfg.quant_scheme!r}; only QuantScheme.WRAPX "
                "is supported by blockwise_mm_bwd_mxfp8"
            )
        out.append(cfg)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Tuned per-phase configs (configs/nki/*.yaml)

TUNED_CONFIG_DIR = config_path("nki")  # shipped configs/nki/ (common.config_files)
_TUNABLE_FIELDS = {f.name for f in dataclasses.fields(MatmulMxfp8KernelConfig)} - {"M", "K", "N"}


def tuned_config_key(H: int, I: int, B: int, lnc2: bool) -> str:
    """Key of a tuned entry: ``"H{H}_I{I}_B{B}_lnc{1|2}"`` (e.g. ``H2048_I768_B512_lnc2``)."""
    return f"H{H}_I{I}_B{B}_lnc{2 if lnc2 else 1}"


@functools.lru_cache(maxsize=8)
def _read_tuned_tables(directory: str) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        doc = load_yaml_file(path) or {}
        entries = doc.get("configs", {})
        if not isinstance(entries, dict):
            msg = f"{path}: 'configs' must be a mapping of shape key -> phases"
            raise ValueError(msg)  # noqa: TRY004
        for key, phases in entries.items():
            if key in table:
                raise ValueError(f"{path}: tuned config key {key!r} defined twice")
            table[key] = {"phases": phases, "source": str(path)}
    return table


def load_tuned_phase_configs(
    H: int, I: int, B: int, lnc2: bool, directory: str | Path | None = None
) -> tuple[MatmulMxfp8KernelConfig | None, ...]:
    """Tuned per-phase configs for one shape from ``configs/nki/*.yaml``, or 4 Nones.

    YAML layout::

        configs:
          H2048_I768_B512_lnc2:            # tuned_config_key(H, I, B, lnc2)
            phase1: {tile_k: 512, TILES_IN_BLOCK_K: 4}
            phase3: {tile_n: 256}
            ...                            # omitted phases -> None (kernel defaults)

    M, K and N are never stored (the kernel entry derives them). The result goes straight into
    the kernel's ``phase1_config .. phase4_config``.

    Raises:
        ValueError: an unknown field name or a value that breaks a config rule, naming the file,
            key and phase.
    """
    table = _read_tuned_tables(str(directory or TUNED_CONFIG_DIR))
    entry = table.get(tuned_config_key(H, I, B, lnc2))
    if entry is None:
        return (None, None, None, None)
    phases = entry["phases"] or {}
    unknown_phases = set(phases) - set(PHASE_NAMES)
    if unknown_phases:
        raise ValueError(f"{entry['source']}: unknown phase names {sorted(unknown_phases)}")
    out: list[MatmulMxfp8KernelConfig | None] = []
    for name in PHASE_NAMES:
        fields = phases.get(name)
        if fields is None:
            out.append(None)
            continue
        bad = set(fields) - _TUNABLE_FIELDS
        if bad:
            raise ValueError(
                f"{entry['source']}: {tuned_config_key(H, I, B, lnc2)}.{name}: unknown fields "
                f"{sorted(bad)}"
            )
        try:
            out.append(MatmulMxfp8KernelConfig(M=0, K=0, N=0, **fields))
        except ValueError as exc:
            raise ValueError(
                f"{entry['source']}: {tuned_config_key(H, I, B, lnc2)}.{name}: {exc}"
            ) from None
    return tuple(out)
