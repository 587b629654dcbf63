"""Argument validation of ``blockwise_mm_bwd_mxfp8``, done before any work, as AWS's entry does.

The rules follow AWS nki-library's ``_validate_inputs_and_derive_dims`` and
``_validate_kernel_options`` (``experimental/moe_mxfp8/bwd/blockwise_mm_backward_mxfp8.py``) and the
seed (``seeds/blockwise_mm_bwd_mxfp8.rst``), with three differences, each stricter or documented:

- ``run_with_lnc2=False`` is accepted (AWS asserts LNC2; our interpreter runs both and the tests
  compare them);
- the routing dtypes (int32), the checkpoint dtype (BF16) and the activation dtypes (BF16, as the
  seed says; AWS also lets FP16 through) are checked (AWS leaves a TODO);
- ``block_size`` is one of 128/256/512/1024/2048/4096: the seed's list plus the 2048/4096 of
  AWS's newest revision (its default is 4096); the kernel streams blocks over 512 slots.

Every error is a :class:`ValueError` whose message names the argument (or option) and the rule.
Options the kernel does not implement raise :class:`UnsupportedOptionError`, which is both a
``ValueError`` and a ``NotImplementedError``.

Works on anything with ``.shape`` and ``.dtype``: numpy arrays, torch tensors, our interpreter's
tensors and real ``nl.ndarray`` (dtype names compared as strings, NKI_API.md §2.1).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nki_kernels.config import (
    DEFAULT_COMPUTE_DTYPE,
    DEFAULT_FP8_X4_DTYPE,
    ActFnType,
    AffinityOption,
    ClampLimits,
    KernelClampLimits,
    MatmulMxfp8KernelConfig,
    ShardOption,
    SkipMode,
    default_phase_configs,
)

__all__ = [
    "BLOCK_SIZES",
    "BlockwiseMmBwdArgs",
    "prepare_kernel_call",
    "UnsupportedOptionError",
    "dtype_name",
    "validate_blockwise_mm_bwd_args",
]

BLOCK_SIZES = (128, 256, 512, 1024, 2048, 4096)  # the seed's list + AWS's 2048/4096 (Neuron 2.33)
DIM_ALIGN = 128  # H and I_TP: the partition dimension / smallest DGT K tile (AWS asserts)
ACTIVATION_DTYPES = ("bfloat16",)  # seed: activations are BF16 (gathered by indirect DMA)
AFFINITY_DTYPES = ("bfloat16", "float32")
ROUTING_DTYPE = "int32"
X4_DATA_DTYPES = ("float8_e4m3fn_x4", "float8_e5m2_x4", "uint32", "int32")  # packed x4 words
SCALE_DTYPES = ("uint8", "float8_e8m0fnu")  # E8M0 scale bytes


class UnsupportedOptionError(ValueError, NotImplementedError):
    """An option of AWS's API that ``blockwise_mm_bwd_mxfp8`` does not implement (yet)."""


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as an nl dtype string, torch dtype or numpy dtype/type.

    ``"bfloat16"``, ``nl.bfloat16``, ``torch.bfloat16``, ``np.dtype(ml_dtypes.bfloat16)`` and
    ``ml_dtypes.bfloat16`` all give ``"bfloat16"``. Unknown objects give ``str(dtype)``.
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            import torch

            if isinstance(dtype, torch.dtype):
                return str(dtype).removeprefix("torch.")
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        try:
            import numpy as np

            return np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    for prefix in ("nki.language.", "nl.", "nki.dtype.", "dtype."):
        name = name.removeprefix(prefix)
    return name


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class BlockwiseMmBwdArgs:
    """What validation derives, for the kernel to use (all plain Python values).

    Attributes:
        T: rows of ``hidden_states`` (tokens, plus the zero row when padding uses id ``T``).
        H: hidden size. I: ``I_TP``, intermediate size per TP shard (from the checkpoint).
        E: experts. N: blocks. B: block_size. num_shards: 2 under LNC2, else 1.
        gate_up_weight_prequantized, down_weight_prequantized: weights arrive as MXFP8 x4 data
            with E8M0 scales.
        phase_configs: the four resolved :class:`MatmulMxfp8KernelConfig` (copies).
        skip_dma: the :class:`SkipMode` in force (``SkipMode()`` for None).
        clamp_limits: the :class:`ClampLimits` in force (``ClampLimits()`` for None).
        accumulation_dtype: None (BF16 read-add-write across blocks, AWS) or ``"float32"``.
    """

    T: int
    H: int
    I: int
    E: int
    N: int
    B: int
    num_shards: int
    gate_up_weight_prequantized: bool
    down_weight_prequantized: bool
    phase_configs: tuple[MatmulMxfp8KernelConfig, ...]
    skip_dma: SkipMode
    clamp_limits: ClampLimits
    accumulation_dtype: str | None


def _require(cond: bool, msg: str, exc: type = ValueError) -> None:
    if not cond:
        raise exc(f"blockwise_mm_bwd_mxfp8: {msg}")


def _unsupported(cond: bool, msg: str) -> None:
    _require(cond, msg, UnsupportedOptionError)


def _validate_options(
    *,
    gate_act_checkpoint_T: Any,
    intermediate_checkpoint_T: Any,
    scaled_intermediate_checkpoint_T: Any,
    down_proj_act_checkpoint: Any,
    gate_up_weight_is_swizzled: Any,
    down_weight_is_swizzled: Any,
    fp8_x4_dtype: Any,
    spill_reload: Any,
    use_scale_packing: Any,
    run_with_lnc2: Any,
    shard_option: Any,
    affinity_option: Any,
    compute_dtype: Any,
    skip_dma: Any,
    skip_grad_initialization: Any,
    is_tensor_update_accumulating: Any,
    clamp_limits: Any,
    activation_type: Any,
    bias: Any,
    accumulation_dtype: Any,
) -> str | None:
    for name, value in (
        ("gate_up_weight_is_swizzled", gate_up_weight_is_swizzled),
        ("down_weight_is_swizzled", down_weight_is_swizzled),
        ("spill_reload", spill_reload),
        ("use_scale_packing", use_scale_packing),
        ("run_with_lnc2", run_with_lnc2),
        ("skip_grad_initialization", skip_grad_initialization),
        ("is_tensor_update_accumulating", is_tensor_update_accumulating),
        ("bias", bias),
    ):
        _require(isinstance(value, bool), f"{name} must be a bool, got {value!r}")
    for name, value in (
        ("gate_act_checkpoint_T", gate_act_checkpoint_T),
        ("intermediate_checkpoint_T", intermediate_checkpoint_T),
        ("scaled_intermediate_checkpoint_T", scaled_intermediate_checkpoint_T),
    ):
        _unsupported(value is None, f"{name} is not currently supported and must be None")
    _unsupported(
        not gate_up_weight_is_swizzled,
        "gate_up_weight_is_swizzled=True (pre-swizzled weights) is not currently supported",
    )
    _unsupported(
        not down_weight_is_swizzled,
        "down_weight_is_swizzled=True (pre-swizzled weights) is not currently supported",
    )
    _require(
        isinstance(affinity_option, AffinityOption),
        f"affinity_option must be an AffinityOption, got {affinity_option!r}",
    )
    _unsupported(
        affinity_option == AffinityOption.AFFINITY_ON_I,
        f"affinity_option={affinity_option.name} is not supported; only AFFINITY_ON_I",
    )
    _unsupported(
        down_proj_act_checkpoint is None,
        "down_proj_act_checkpoint must be None for AFFINITY_ON_I (only AFFINITY_ON_H uses it)",
    )
    _require(
        isinstance(shard_option, ShardOption),
        f"shard_option must be a ShardOption, got {shard_option!r}",
    )
    _unsupported(
        shard_option == ShardOption.SHARD_ON_FREE,
        f"shard_option={shard_option.name} is not supported; only SHARD_ON_FREE",
    )
    _require(
        isinstance(activation_type, ActFnType),
        f"activation_type must be an ActFnType, got {activation_type!r}",
    )
    _unsupported(
        activation_type == ActFnType.SiLU,
        f"activation_type={activation_type.name} is not implemented; only ActFnType.SiLU",
    )
    _unsupported(
        dtype_name(compute_dtype) == DEFAULT_COMPUTE_DTYPE,
        f"compute_dtype={dtype_name(compute_dtype)} is not supported; only bfloat16 "
        "(the DMA transpose path moves 2-byte elements)",
    )
    _unsupported(
        dtype_name(fp8_x4_dtype) == DEFAULT_FP8_X4_DTYPE,
        f"fp8_x4_dtype={dtype_name(fp8_x4_dtype)} is not supported; only float8_e4m3fn_x4",
    )
    _require(
        skip_dma is None or isinstance(skip_dma, SkipMode),
        f"skip_dma must be a SkipMode or None, got {skip_dma!r}",
    )
    _require(
        clamp_limits is None or isinstance(clamp_limits, (ClampLimits, KernelClampLimits)),
        f"clamp_limits must be a ClampLimits or None, got {clamp_limits!r}",
    )
    if accumulation_dtype is None:
        return None
    acc = dtype_name(accumulation_dtype)
    _require(
        acc == "float32",
        f"accumulation_dtype must be None (BF16 read-add-write, AWS) or float32, got {acc}",
    )
    return acc


def validate_blockwise_mm_bwd_args(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    output_hidden_states_grad: Any,
    block_size: int,
    gate_up_proj_act_checkpoint_T: Any = None,
    gate_act_checkpoint_T: Any = None,
    intermediate_checkpoint_T: Any = None,
    scaled_intermediate_checkpoint_T: Any = None,
    down_proj_act_checkpoint: Any = None,
    gate_up_weight_scales: Any = None,
    gate_up_weight_is_swizzled: bool = False,
    down_weight_scales: Any = None,
    down_weight_is_swizzled: bool = False,
    phase1_config: MatmulMxfp8KernelConfig | None = None,
    phase2_config: MatmulMxfp8KernelConfig | None = None,
    phase3_config: MatmulMxfp8KernelConfig | None = None,
    phase4_config: MatmulMxfp8KernelConfig | None = None,
    fp8_x4_dtype: Any = DEFAULT_FP8_X4_DTYPE,
    spill_reload: bool = False,
    use_scale_packing: bool = True,
    run_with_lnc2: bool = True,
    shard_option: ShardOption = ShardOption.SHARD_ON_FREE,
    affinity_option: AffinityOption = AffinityOption.AFFINITY_ON_I,
    compute_dtype: Any = DEFAULT_COMPUTE_DTYPE,
    skip_dma: SkipMode | None = None,
    skip_grad_initialization: bool = False,
    is_tensor_update_accumulating: bool = True,
    clamp_limits: ClampLimits | None = None,
    activation_type: ActFnType = ActFnType.SiLU,
    bias: bool = False,
    accumulation_dtype: Any = None,
) -> BlockwiseMmBwdArgs:
    """Check every argument of ``blockwise_mm_bwd_mxfp8`` and derive its dimensions.

    Takes exactly the kernel's parameters (the seed's, then ``accumulation_dtype``); the kernel
    entry calls it first, before allocating or writing anything.

    Dimensions: T tokens (``hidden_states`` rows; T+1 with the zero padding row), H hidden,
    I = I_TP, E experts, B = block_size, N blocks.

    Rules (each error names the argument):
        - required tensors present: hidden_states, expert_affinities_masked, gate_up_proj_weight,
          down_proj_weight, token_position_to_id, block_to_expert, output_hidden_states_grad,
          gate_up_proj_act_checkpoint_T (recompute is not supported);
        - block_size in (128, 256, 512, 1024, 2048, 4096); H % 128 == 0; I_TP % 128 == 0;
        - hidden_states, output_hidden_states_grad: [T, H] bfloat16;
        - expert_affinities_masked: [T*E, 1] bfloat16 or float32 (with padding id T, T counts
          the zero row, i.e. [(T_real+1)*E, 1]);
        - token_position_to_id: [N*B] int32 (N >= 1); block_to_expert: [N, 1] int32;
        - gate_up_proj_act_checkpoint_T: [N, 2, I_TP, B] bfloat16;
        - gate_up_proj_weight: [E, H, 2, I_TP] bfloat16, or with gate_up_weight_scales MXFP8 x4
          words [E, 2*I_TP/4, H] plus scales [E, *, H] (uint8/E8M0);
          down_proj_weight: [E, I_TP, H] bfloat16, or with down_weight_scales x4 words
          [E, H/4, I_TP] plus scales [E, *, I_TP];
        - unsupported options raise :class:`UnsupportedOptionError` naming the option:
          gate/intermediate/scaled-intermediate checkpoints, down_proj_act_checkpoint,
          swizzled weights, AFFINITY_ON_H, activations other than SiLU, shard options other
          than SHARD_ON_FREE, compute_dtype other than bfloat16, fp8_x4_dtype other than
          float8_e4m3fn_x4;
        - flags are bools; skip_dma a SkipMode or None; clamp_limits a ClampLimits or None;
          accumulation_dtype None or float32; phase configs resolve (tile_k in 128/256/512,
          WRAPX).

    Returns:
        :class:`BlockwiseMmBwdArgs` with T, H, I, E, N, B, the resolved phase configs and modes.

    Raises:
        ValueError: a broken rule; :class:`UnsupportedOptionError` (a ValueError) for an option
            the kernel does not implement.
    """
    required = (
        ("hidden_states", hidden_states),
        ("expert_affinities_masked", expert_affinities_masked),
        ("gate_up_proj_weight", gate_up_proj_weight),
        ("down_proj_weight", down_proj_weight),
        ("token_position_to_id", token_position_to_id),
        ("block_to_expert", block_to_expert),
        ("output_hidden_states_grad", output_hidden_states_grad),
    )
    for name, tensor in required:
        _require(tensor is not None, f"{name} is required")
    _unsupported(
        gate_up_proj_act_checkpoint_T is not None,
        "gate_up_proj_act_checkpoint_T is currently required (recompute of the gate and up "
        "activations is not supported)",
    )
    accumulation = _validate_options(
        gate_act_checkpoint_T=gate_act_checkpoint_T,
        intermediate_checkpoint_T=intermediate_checkpoint_T,
        scaled_intermediate_checkpoint_T=scaled_intermediate_checkpoint_T,
        down_proj_act_checkpoint=down_proj_act_checkpoint,
        gate_up_weight_is_swizzled=gate_up_weight_is_swizzled,
        down_weight_is_swizzled=down_weight_is_swizzled,
        fp8_x4_dtype=fp8_x4_dtype,
        spill_reload=spill_reload,
        use_scale_packing=use_scale_packing,
        run_with_lnc2=run_with_lnc2,
        shard_option=shard_option,
        affinity_option=affinity_option,
        compute_dtype=compute_dtype,
        skip_dma=skip_dma,
        skip_grad_initialization=skip_grad_initialization,
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        clamp_limits=clamp_limits,
        activation_type=activation_type,
        bias=bias,
        accumulation_dtype=accumulation_dtype,
    )

    _require(
        _is_int(block_size) and block_size in BLOCK_SIZES,
        f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}",
    )
    B = block_size

    hs_shape = _shape(hidden_states)
    _require(len(hs_shape) == 2, f"hidden_states must be 2-D [T, H], got shape {hs_shape}")
    T, H = hs_shape
    _require(T >= 1, f"hidden_states must have at least one row (T >= 1), got shape {hs_shape}")
    _require(H % DIM_ALIGN == 0, f"H={H} (hidden_states.shape[1]) must be divisible by {DIM_ALIGN}")
    dw_shape = _shape(down_proj_weight)
    _require(
        len(dw_shape) == 3,
        f"down_proj_weight must be 3-D ([E, I_TP, H], or [E, H/4, I_TP] x4 words with "
        f"down_weight_scales), got shape {dw_shape}",
    )
    E = dw_shape[0]
    _require(E >= 1, f"down_proj_weight must hold at least one expert, got shape {dw_shape}")

    tpti_shape = _shape(token_position_to_id)
    _require(
        len(tpti_shape) == 1 and tpti_shape[0] >= B and tpti_shape[0] % B == 0,
        f"token_position_to_id must be 1-D [N*B] with N >= 1 and B={B}, got shape {tpti_shape}",
    )
    N = tpti_shape[0] // B

    ckpt_shape = _shape(gate_up_proj_act_checkpoint_T)
    _require(
        len(ckpt_shape) == 4,
        f"gate_up_proj_act_checkpoint_T must be 4-D [N, 2, I_TP, B], got shape {ckpt_shape}",
    )
    I_TP = ckpt_shape[2]
    _require(
        ckpt_shape == (N, 2, I_TP, B),
        f"gate_up_proj_act_checkpoint_T shape {ckpt_shape} must be [N={N}, 2, I_TP, B={B}]",
    )
    _require(
        I_TP % DIM_ALIGN == 0 and I_TP > 0,
        f"I_TP={I_TP} (gate_up_proj_act_checkpoint_T.shape[2]) must be a positive multiple of "
        f"{DIM_ALIGN}",
    )

    # Weights: BF16, or pre-quantized MXFP8 x4 words with E8M0 scales (AWS's backward layout:
    # contracted along 2I for gate/up (phase 2) and along H for down (phase 1)).
    gate_up_q = gate_up_weight_scales is not None
    down_q = down_weight_scales is not None
    gu_shape = _shape(gate_up_proj_weight)
    if not gate_up_q:
        _require(
            gu_shape == (E, H, 2, I_TP),
            f"gate_up_proj_weight shape {gu_shape} must be [E={E}, H={H}, 2, I_TP={I_TP}] "
            "(or pass gate_up_weight_scales for pre-quantized weights)",
        )
        _require(
            dtype_name(gate_up_proj_weight.dtype) == "bfloat16",
            "gate_up_proj_weight dtype must be bfloat16, got "
            f"{dtype_name(gate_up_proj_weight.dtype)}",
        )
    else:
        _require(
            gu_shape == (E, 2 * I_TP // 4, H),
            f"gate_up_proj_weight shape {gu_shape} must be x4 words [E={E}, 2*I_TP/4="
            f"{2 * I_TP // 4}, H={H}] when gate_up_weight_scales is given",
        )
        _check_prequantized("gate_up", gate_up_proj_weight, gate_up_weight_scales, E, H)
    if not down_q:
        _require(
            dw_shape == (E, I_TP, H),
            f"down_proj_weight shape {dw_shape} must be [E={E}, I_TP={I_TP}, H={H}] "
            "(or pass down_weight_scales for pre-quantized weights)",
        )
        _require(
            dtype_name(down_proj_weight.dtype) == "bfloat16",
            f"down_proj_weight dtype must be bfloat16, got {dtype_name(down_proj_weight.dtype)}",
        )
    else:
        _require(
            dw_shape == (E, H // 4, I_TP),
            f"down_proj_weight shape {dw_shape} must be x4 words [E={E}, H/4={H // 4}, "
            f"I_TP={I_TP}] when down_weight_scales is given",
        )
        _check_prequantized("down", down_proj_weight, down_weight_scales, E, I_TP)

    # Activations, affinities, routing.
    og_shape = _shape(output_hidden_states_grad)
    _require(
        og_shape == (T, H),
        f"output_hidden_states_grad shape {og_shape} must match hidden_states [T={T}, H={H}]",
    )
    for name, tensor in (
        ("hidden_states", hidden_states),
        ("output_hidden_states_grad", output_hidden_states_grad),
    ):
        dt = dtype_name(tensor.dtype)
        _require(dt in ACTIVATION_DTYPES, f"{name} dtype must be bfloat16, got {dt}")
    ea_shape = _shape(expert_affinities_masked)
    _require(
        ea_shape == (T * E, 1),
        f"expert_affinities_masked shape {ea_shape} must be [T*E={T * E}, 1] with T={T} rows of "
        "hidden_states (T counts the zero padding row when padding ids equal T)",
    )
    dt = dtype_name(expert_affinities_masked.dtype)
    _require(
        dt in AFFINITY_DTYPES,
        f"expert_affinities_masked dtype must be one of {AFFINITY_DTYPES}, got {dt}",
    )
    bte_shape = _shape(block_to_expert)
    _require(bte_shape == (N, 1), f"block_to_expert shape {bte_shape} must be [N={N}, 1]")
    for name, tensor in (
        ("token_position_to_id", token_position_to_id),
        ("block_to_expert", block_to_expert),
    ):
        dt = dtype_name(tensor.dtype)
        _require(dt == ROUTING_DTYPE, f"{name} dtype must be int32, got {dt}")
    dt = dtype_name(gate_up_proj_act_checkpoint_T.dtype)
    _require(dt == "bfloat16", f"gate_up_proj_act_checkpoint_T dtype must be bfloat16, got {dt}")
    _check_routing_values(token_position_to_id, block_to_expert, T, E, skip_dma)

    # LNC2 shards I_TP (SHARD_ON_FREE) and H; both are multiples of 128, so this always holds.
    num_shards = 2 if run_with_lnc2 else 1
    _require(
        H % num_shards == 0 and I_TP % num_shards == 0,
        f"H={H} and I_TP={I_TP} must be divisible by num_shards={num_shards}",
    )

    given = (phase1_config, phase2_config, phase3_config, phase4_config)
    for i, cfg in enumerate(given, start=1):
        _require(
            cfg is None or isinstance(cfg, MatmulMxfp8KernelConfig),
            f"phase{i}_config must be a MatmulMxfp8KernelConfig or None, got {type(cfg).__name__}",
        )
        if cfg is not None:
            try:
                cfg.validate()
            except ValueError as exc:
                raise ValueError(f"blockwise_mm_bwd_mxfp8: phase{i}_config: {exc}") from None
    try:
        phase_configs = default_phase_configs(
            H,
            I_TP,
            B,
            run_with_lnc2,
            given,
            spill_reload=spill_reload,
            use_scale_packing=use_scale_packing,
        )
    except ValueError as exc:
        raise ValueError(f"blockwise_mm_bwd_mxfp8: {exc}") from None

    for i, cfg in enumerate(phase_configs, start=1):
        check_phase_config_supported(i, cfg)

    return BlockwiseMmBwdArgs(
        T=T,
        H=H,
        I=I_TP,
        E=E,
        N=N,
        B=B,
        num_shards=num_shards,
        gate_up_weight_prequantized=gate_up_q,
        down_weight_prequantized=down_q,
        phase_configs=phase_configs,
        skip_dma=skip_dma if skip_dma is not None else SkipMode(),
        clamp_limits=(ClampLimits(**dataclasses.asdict(clamp_limits))
                      if isinstance(clamp_limits, KernelClampLimits)
                      else clamp_limits if clamp_limits is not None else ClampLimits()),
        accumulation_dtype=accumulation,
    )


def check_phase_config_supported(phase: int, cfg: MatmulMxfp8KernelConfig) -> None:
    """Raise :class:`UnsupportedOptionError` for a resolved phase config the kernel does not
    implement, naming the phase and the field.

    Honoured: M/K/N (set from the phase shape), tile_m (phases 3-4; 128 in phases 1-2), tile_k,
    tile_n, TILES_IN_BLOCK_N, TILES_IN_BLOCK_K (with ``enable_psum_copy_in=False``),
    enable_psum_copy_in, enable_scale_packing (either value; the wrapper's ``use_scale_packing``
    for an omitted phase, True by default as AWS's: up to four scale views share one scale tile
    at offsets 0/4/8/12 of each quadrant, NKI_API.md §4.5; bit-identical to unpacked scales),
    run_with_lnc2 (the wrapper's), quant_scheme (WRAPX only, checked when resolving). Every
    other field raises here when set to a value the kernel does not implement.

    - phases 1-2: ``tile_m < 128``. Their stationary columns are the 128 slots of a natural-
      layout chunk; an MX matmul's output starts at PSUM partition 0 (``nc_matmul_mx`` has row
      tiling only, SDK stub), so a 32/64-column tile would land its slots on partitions 0..63
      instead of their own.
    """
    name = f"phase{phase}_config"
    # Fields with a non-default value the kernel does not implement (AWS meaning in brackets).
    unsupported = (
        ("TILES_IN_BLOCK_M", cfg.TILES_IN_BLOCK_M in (None, 1),
         "several M tiles resident per block (the kernel keeps one M tile)"),
        ("TILES_IN_LOAD_M", cfg.TILES_IN_LOAD_M in (None, 1, cfg.TILES_IN_BLOCK_M),
         "M tiles per DMA load other than the block's"),
        ("TILES_IN_LOAD_N", cfg.TILES_IN_LOAD_N in (None, 1, cfg.TILES_IN_BLOCK_N),
         "N tiles per DMA load other than the block's (the kernel loads a whole "
         "TILES_IN_BLOCK_N x tile_n weight block at once)"),
        ("TILES_IN_LOAD_K", cfg.TILES_IN_LOAD_K in (None, 1),
         "K tiles per DMA load (the kernel loads every K tile of a block)"),
        ("block_loop_order", cfg.block_loop_order == "mnk", "block loop orders other than 'mnk'"),
        ("tile_loop_order", cfg.tile_loop_order == "mnk", "tile loop orders other than 'mnk'"),
        ("float8_dtype", str(cfg.float8_dtype) == "float8_e4m3fn", "E5M2 operands"),
        ("lnc_2_shard_rhs", cfg.lnc_2_shard_rhs in (None, True),
         "sharding the stationary (lhs) operand under LNC2 (SHARD_ON_FREE shards the moving one)"),
        ("spill_reload", cfg.spill_reload is False, "spilling quantized tiles to HBM"),
        ("lhs_is_swizzled", cfg.lhs_is_swizzled is True,
         "a stationary operand not already WRAPX-swizzled"),
        ("rhs_is_swizzled", cfg.rhs_is_swizzled is True,
         "a moving operand not already WRAPX-swizzled"),
        ("load_with_PE_swizzle", cfg.load_with_PE_swizzle is False, "swizzling on TensorE"),
        ("output_dtype", cfg.output_dtype is None, "a GEMM output dtype (each phase fixes its own)"),
    )
    for field, ok, what in unsupported:
        _unsupported(
            ok,
            f"{name}.{field}={getattr(cfg, field)!r} is not implemented ({what}); leave the "
            "default",
        )
    if phase in (1, 2):
        _unsupported(
            cfg.tile_m >= min(128, cfg.M),
            f"{name}.tile_m={cfg.tile_m} is not implemented: phase {phase} multiplies the 128 "
            "slots of a chunk at once (nc_matmul_mx output starts at partition 0); use 128 "
            "(the default)",
        )


def _host_values(t: Any):
    """The values of a host-readable torch tensor / numpy array, else None (traced tensors)."""
    if isinstance(t, np.ndarray):
        return t
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        return t.detach().numpy()
    if type(t).__module__.startswith("nki_kernels.interp"):  # our interpreter's HBM tensors
        return t.numpy()
    return None


def _check_routing_values(token_position_to_id: Any, block_to_expert: Any, T: int, E: int,
                          skip_dma: SkipMode | None) -> None:
    """Value checks of the routing tensors, when their values are readable on the host.

    On hardware an id outside the rows of hidden_states is an out-of-bounds DMA: skipped with
    ``skip_dma.skip_token`` (so a mistyped id would silently drop a token) or an error. Here
    only -1 (with ``skip_token``) and ids in [0, T) are accepted, T = hidden_states rows (the
    zero padding row included).
    """
    b2e = _host_values(block_to_expert)
    if b2e is not None and b2e.size:
        lo, hi = int(b2e.min()), int(b2e.max())
        _require(0 <= lo and hi < E, f"block_to_expert values must lie in [0, E={E}), found [{lo}, {hi}]")
    tpti = _host_values(token_position_to_id)
    if tpti is None or not tpti.size:
        return
    skip = skip_dma is not None and skip_dma.skip_token
    valid = (tpti >= 0) & (tpti < T)
    if skip:
        valid |= tpti == -1
    bad = tpti[~valid]
    _require(
        bad.size == 0,
        f"token_position_to_id values must lie in [0, T={T})"
        + (" or be -1 (skip_dma.skip_token=True)" if skip else
           " (padding -1 needs skip_dma=SkipMode(skip_token=True))")
        + (f", found {int(bad[0])}" if bad.size else ""),
    )


def _check_prequantized(which: str, data: Any, scales: Any, E: int, F: int) -> None:
    weight = f"{which}_proj_weight"
    scales_name = f"{which}_weight_scales"
    dt = dtype_name(data.dtype)
    _require(
        dt in X4_DATA_DTYPES,
        f"{weight} dtype must be MXFP8 x4 words {X4_DATA_DTYPES} when {scales_name} is given, "
        f"got {dt}",
    )
    s_shape = _shape(scales)
    _require(
        len(s_shape) == 3 and s_shape[0] == E and s_shape[1] >= 1 and s_shape[2] == F,
        f"{scales_name} shape {s_shape} must be [E={E}, scale rows, {F}]",
    )
    sdt = dtype_name(scales.dtype)
    _require(sdt in SCALE_DTYPES, f"{scales_name} dtype must be one of {SCALE_DTYPES}, got {sdt}")


# The kernel's keyword parameters, in order, for callers that forward **kwargs.
PARAMETER_NAMES = validate_blockwise_mm_bwd_args.__code__.co_varnames[
    : validate_blockwise_mm_bwd_args.__code__.co_argcount
]


def prepare_kernel_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Host-side step before tracing ``blockwise_mm_bwd_mxfp8``: validate every argument (raises
    ValueError naming it, before any work) and pass ``clamp_limits`` as a
    :class:`~nki_kernels.config.KernelClampLimits` (an ``NKIObject``; the kernel may only see
    classes derived from it, SDK nki-language-guide "Class Support").

    Args:
        args, kwargs: the kernel call's positional and keyword arguments.

    Returns:
        ``(args, kwargs)`` to trace the kernel with.
    """
    bound = inspect.signature(validate_blockwise_mm_bwd_args).bind(*args, **kwargs)
    validate_blockwise_mm_bwd_args(*bound.args, **bound.kwargs)
    if "clamp_limits" in bound.arguments:
        bound.arguments["clamp_limits"] = KernelClampLimits.from_limits(
            bound.arguments["clamp_limits"]
        )
    return tuple(bound.args), dict(bound.kwargs)
