"""API layer of the NKI blockwise MXFP8 backward: config types, validation, backends, autograd.

The kernel's numerics are tested in tests/test_nki_kernel.py; here the kernel only runs (under
the interpreter, tiny shapes) in the backend and autograd tests, which skip while the kernel or
the interpreter does not import.
"""

from __future__ import annotations

import dataclasses
import inspect

import ml_dtypes
import numpy as np
import pytest
import torch

import nki_kernels
from common.dispatch import registered_backends, resolve_backend
from common.metrics import sqnr_db, sqnr_floor
from common.problem import ClampLimits as CommonClampLimits
from common.problem import MoEBackwardProblem
from common.reference import reference_backward, reference_forward
from common.routing import plan_routing
from nki_kernels import backend as nki_backend
from common.nki_layer import expert_mlp_forward, moe_expert_mlp
from nki_kernels.config import (
    ActFnType,
    AffinityOption,
    ClampLimits,
    MatmulMxfp8KernelConfig,
    QuantScheme,
    ShardOption,
    SkipMode,
    default_phase_configs,
    load_tuned_phase_configs,
    phase_shapes,
    tuned_config_key,
)
from nki_kernels.validation import (
    PARAMETER_NAMES,
    UnsupportedOptionError,
    dtype_name,
    validate_blockwise_mm_bwd_args,
)

# AWS nki-library e9ef98fc field order (NKI_API.md §5), then our appended TILES_IN_LOAD_K.
AWS_FIELDS = [
    "M",
    "K",
    "N",
    "tile_m",
    "tile_k",
    "tile_n",
    "TILES_IN_BLOCK_M",
    "TILES_IN_BLOCK_N",
    "TILES_IN_BLOCK_K",
    "TILES_IN_LOAD_M",
    "TILES_IN_LOAD_N",
    "block_loop_order",
    "tile_loop_order",
    "float8_dtype",
    "enable_scale_packing",
    "run_with_lnc2",
    "lnc_2_shard_rhs",
    "spill_reload",
    "enable_psum_copy_in",
    "lhs_is_swizzled",
    "rhs_is_swizzled",
    "load_with_PE_swizzle",
    "quant_scheme",
    "output_dtype",
]

# The seed's parameter list (seeds/blockwise_mm_bwd_mxfp8.rst), then our extension.
SEED_PARAMS = [
    "hidden_states",
    "expert_affinities_masked",
    "gate_up_proj_weight",
    "down_proj_weight",
    "token_position_to_id",
    "block_to_expert",
    "output_hidden_states_grad",
    "block_size",
    "gate_up_proj_act_checkpoint_T",
    "gate_act_checkpoint_T",
    "intermediate_checkpoint_T",
    "scaled_intermediate_checkpoint_T",
    "down_proj_act_checkpoint",
    "gate_up_weight_scales",
    "gate_up_weight_is_swizzled",
    "down_weight_scales",
    "down_weight_is_swizzled",
    "phase1_config",
    "phase2_config",
    "phase3_config",
    "phase4_config",
    "fp8_x4_dtype",
    "spill_reload",
    "use_scale_packing",
    "run_with_lnc2",
    "shard_option",
    "affinity_option",
    "compute_dtype",
    "skip_dma",
    "skip_grad_initialization",
    "is_tensor_update_accumulating",
    "clamp_limits",
    "activation_type",
    "bias",
] + ["accumulation_dtype"]


# ----------------------------------------------------------------------------------- config
def test_config_field_order_and_defaults_match_aws():
    names = [f.name for f in dataclasses.fields(MatmulMxfp8KernelConfig)]
    assert names == AWS_FIELDS + ["TILES_IN_LOAD_K"]
    c = MatmulMxfp8KernelConfig(M=128, K=512, N=256)
    assert (c.tile_m, c.tile_k, c.tile_n) == (None, None, None)
    assert c.block_loop_order == c.tile_loop_order == "mnk"
    assert c.float8_dtype == "float8_e4m3fn"
    assert (c.enable_scale_packing, c.run_with_lnc2, c.spill_reload) == (False, True, False)
    assert (c.enable_psum_copy_in, c.lhs_is_swizzled, c.rhs_is_swizzled) == (True, True, True)
    assert c.quant_scheme is QuantScheme.WRAPX  # the string default becomes the enum
    assert MatmulMxfp8KernelConfig(0, 0, 0, quant_scheme="1x32").quant_scheme is QuantScheme._1x32
    assert not c.is_resolved
    assert hash(c.key()) == hash(MatmulMxfp8KernelConfig(M=128, K=512, N=256).key())


def test_enums_and_small_types_match_aws():
    assert [(m.name, m.value) for m in ShardOption] == [
        ("SHARD_ON_FREE", 0),
        ("SHARD_ON_HIDDEN", 1),
        ("SHARD_ON_BLOCK", 2),
    ]
    assert [(m.name, m.value) for m in AffinityOption] == [
        ("AFFINITY_ON_H", 0),
        ("AFFINITY_ON_I", 1),
    ]
    assert ActFnType.SiLU.value == 0 and ActFnType.SquaredReLU.value == 5
    assert QuantScheme("wrapX") is QuantScheme.WRAPX
    assert SkipMode() == SkipMode(False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SkipMode().skip_token = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="skip_token"):
        SkipMode(skip_token="yes")  # type: ignore[arg-type]
    assert ClampLimits is CommonClampLimits
    assert nki_kernels.MatmulMxfp8KernelConfig is MatmulMxfp8KernelConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tile_k": 64}, "tile_k"),
        ({"tile_k": 1024}, "tile_k"),
        ({"tile_m": 256}, "tile_m"),
        ({"tile_n": 48}, "tile_n"),
        ({"TILES_IN_BLOCK_K": 0}, "TILES_IN_BLOCK_K"),
        ({"TILES_IN_BLOCK_M": 4, "TILES_IN_LOAD_M": 3}, "TILES_IN_LOAD_M"),
        ({"block_loop_order": "mkx"}, "block_loop_order"),
        ({"float8_dtype": "float16"}, "float8_dtype"),
        ({"quant_scheme": "2x16"}, "quant_scheme"),
        ({"spill_reload": 1}, "spill_reload"),
        ({"M": -1}, "M"),
    ],
)
def test_config_rejects_bad_fields(kwargs, field):
    base = {"M": 128, "K": 512, "N": 512}
    base.update(kwargs)
    with pytest.raises(ValueError, match=rf"MatmulMxfp8KernelConfig\.{field}"):
        MatmulMxfp8KernelConfig(**base)


def test_default_phase_configs_qwen3_lnc2():
    # Qwen3-30B-A3B expert MLP: H=2048, I=768; block 512; LNC2 (SHARD_ON_FREE halves N).
    cfgs = default_phase_configs(2048, 768, 512, True)
    assert [(c.M, c.K, c.N) for c in cfgs] == [
        (512, 2048, 384),
        (512, 1536, 1024),
        (768, 512, 1024),
        (1024, 512, 768),
    ]
    # AWS get_tile_sizes: tile_m = min(M,128)-ish, tile_k 512, tile_n 512 or N when N < 512.
    assert [(c.tile_m, c.tile_k, c.tile_n) for c in cfgs] == [
        (128, 512, 384),
        (128, 512, 512),
        (128, 512, 512),
        (128, 512, 512),
    ]
    for c in cfgs:
        assert c.is_resolved and c.run_with_lnc2 is True
        assert c.enable_scale_packing is True and c.spill_reload is False  # wrapper defaults
        assert c.TILES_IN_BLOCK_M == c.TILES_IN_LOAD_N == c.TILES_IN_LOAD_K == 1


def test_default_phase_configs_lnc1_small_and_given_configs_kept():
    assert phase_shapes(256, 128, 128, False) == (
        (128, 256, 128),
        (128, 256, 256),
        (128, 128, 256),
        (256, 128, 128),
    )
    given = MatmulMxfp8KernelConfig(M=0, K=0, N=0, tile_k=128, TILES_IN_BLOCK_K=2)
    before = given.key()
    cfgs = default_phase_configs(256, 128, 128, False, (None, None, given, None), spill_reload=True,
                                 use_scale_packing=True)
    assert given.key() == before  # the caller's config is not mutated
    p3 = cfgs[2]
    assert (p3.M, p3.K, p3.N, p3.tile_k, p3.TILES_IN_BLOCK_K) == (128, 128, 256, 128, 2)
    assert p3.spill_reload is False and p3.enable_scale_packing is False  # given phase: its own
    assert cfgs[0].spill_reload is True and cfgs[0].enable_scale_packing is True  # omitted phase
    assert cfgs[0].tile_k == 256 and cfgs[0].tile_n == 128 and cfgs[0].run_with_lnc2 is False
    # H = 384 keeps AWS's padded 512^3 tile geometry.
    assert {(c.tile_m, c.tile_k, c.tile_n) for c in default_phase_configs(384, 128, 128, True)} == {
        (128, 512, 512)
    }


def test_default_phase_configs_errors_name_the_phase():
    bad = MatmulMxfp8KernelConfig(M=0, K=0, N=0, quant_scheme=QuantScheme._1x32)
    with pytest.raises(ValueError, match="phase2: unsupported quant_scheme"):
        default_phase_configs(256, 128, 128, True, (None, bad, None, None))
    with pytest.raises(ValueError, match="phase4_config must be a MatmulMxfp8KernelConfig"):
        default_phase_configs(256, 128, 128, True, (None, None, None, {"tile_k": 128}))
    with pytest.raises(ValueError, match="divisible by num_shards"):
        phase_shapes(256, 129, 128, True)


def test_tuned_config_loader(tmp_path):
    (tmp_path / "a.yaml").write_text(
        "configs:\n"
        f"  {tuned_config_key(256, 128, 128, True)}:\n"
        "    phase1: {tile_k: 256, TILES_IN_BLOCK_K: 1}\n"
        "    phase3: {tile_n: 128, spill_reload: true}\n"
    )
    cfgs = load_tuned_phase_configs(256, 128, 128, True, tmp_path)
    assert cfgs[1] is None and cfgs[3] is None
    assert cfgs[0].tile_k == 256 and cfgs[2].tile_n == 128 and cfgs[2].spill_reload is True
    assert load_tuned_phase_configs(256, 128, 256, True, tmp_path) == (None, None, None, None)
    resolved = default_phase_configs(256, 128, 128, True, cfgs)
    assert resolved[2].tile_n == 128 and resolved[2].M == 128

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.yaml").write_text(
        "configs:\n  H256_I128_B128_lnc2:\n    phase2: {tile_q: 3}\n"
    )
    with pytest.raises(ValueError, match=r"phase2: unknown fields \['tile_q'\]"):
        load_tuned_phase_configs(256, 128, 128, True, tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.yaml").write_text(
        "configs:\n  H256_I128_B128_lnc2:\n    phase2: {tile_k: 100}\n"
    )
    with pytest.raises(ValueError, match=r"H256_I128_B128_lnc2\.phase2: .*tile_k"):
        load_tuned_phase_configs(256, 128, 128, True, tmp_path / "c")


def test_repository_tuned_configs_are_valid():
    from nki_kernels.config import TUNED_CONFIG_DIR, _read_tuned_tables

    table = _read_tuned_tables(str(TUNED_CONFIG_DIR))
    assert table, "configs/nki/ holds at least one tuned entry"
    for key in table:
        h, i, b, lnc = key.split("_")
        H, I, B, lnc2 = int(h[1:]), int(i[1:]), int(b[1:]), lnc == "lnc2"
        assert tuned_config_key(H, I, B, lnc2) == key
        resolved = default_phase_configs(H, I, B, lnc2, load_tuned_phase_configs(H, I, B, lnc2))
        assert all(c.is_resolved for c in resolved)


def test_repository_tuned_configs_keep_scale_packing_on():
    """configs/nki/ was tuned with scale packing on (the seed's use_scale_packing=True): a tuned
    phase states it, since MatmulMxfp8KernelConfig's own default is AWS's False and a given
    config decides its phase's packing."""
    from nki_kernels.config import TUNED_CONFIG_DIR, _read_tuned_tables

    for key, entry in _read_tuned_tables(str(TUNED_CONFIG_DIR)).items():
        for phase, fields in (entry["phases"] or {}).items():
            assert fields.get("enable_scale_packing") is True, f"{key}.{phase}"


# ------------------------------------------------------------------------------- validation
T_, H_, I_, E_, B_, N_ = 10, 256, 128, 4, 128, 5


def _valid_args(lib: str = "torch", zero_row: bool = False) -> dict:
    T = T_ + (1 if zero_row else 0)
    if lib == "torch":
        bf, i32 = torch.bfloat16, torch.int32

        def z(shape, dt):
            return torch.zeros(shape, dtype=dt)
    else:
        bf, i32 = ml_dtypes.bfloat16, np.int32

        def z(shape, dt):
            return np.zeros(shape, dtype=dt)

    return {
        "hidden_states": z((T, H_), bf),
        "expert_affinities_masked": z((T * E_, 1), bf),
        "gate_up_proj_weight": z((E_, H_, 2, I_), bf),
        "down_proj_weight": z((E_, I_, H_), bf),
        "token_position_to_id": z((N_ * B_,), i32),
        "block_to_expert": z((N_, 1), i32),
        "output_hidden_states_grad": z((T, H_), bf),
        "block_size": B_,
        "gate_up_proj_act_checkpoint_T": z((N_, 2, I_, B_), bf),
    }


@pytest.mark.parametrize("lib", ["torch", "numpy"])
@pytest.mark.parametrize("zero_row", [False, True])
def test_validation_accepts_valid_args_and_derives_dims(lib, zero_row):
    d = validate_blockwise_mm_bwd_args(**_valid_args(lib, zero_row))
    assert (d.T, d.H, d.I, d.E, d.N, d.B) == (T_ + zero_row, H_, I_, E_, N_, B_)
    assert d.num_shards == 2 and d.accumulation_dtype is None
    assert d.skip_dma == SkipMode() and d.clamp_limits == ClampLimits()
    assert [(c.M, c.K, c.N) for c in d.phase_configs] == list(phase_shapes(H_, I_, B_, True))
    d1 = validate_blockwise_mm_bwd_args(
        **_valid_args(lib), run_with_lnc2=False, accumulation_dtype=torch.float32
    )
    assert d1.num_shards == 1 and d1.accumulation_dtype == "float32"
    assert d1.phase_configs[0].N == I_


def test_validation_signature_is_the_seed_plus_accumulation_dtype():
    assert list(PARAMETER_NAMES) == SEED_PARAMS


def _bf(shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


# (overrides, exception type, the message must contain)
BAD_CASES = {
    "H_not_128": (
        {"hidden_states": _bf((T_, 192)), "output_hidden_states_grad": _bf((T_, 192))},
        ValueError,
        "H=192 (hidden_states.shape[1]) must be divisible by 128",
    ),
    "I_not_128": (
        {
            "gate_up_proj_act_checkpoint_T": _bf((N_, 2, 192, B_)),
            "gate_up_proj_weight": _bf((E_, H_, 2, 192)),
            "down_proj_weight": _bf((E_, 192, H_)),
        },
        ValueError,
        "I_TP=192",
    ),
    "block_size": ({"block_size": 64}, ValueError, "block_size must be one of"),
    "block_size_8192": ({"block_size": 8192}, ValueError, "block_size must be one of"),
    "checkpoint_shape": (
        {"gate_up_proj_act_checkpoint_T": _bf((N_, 2, I_, 64))},
        ValueError,
        "gate_up_proj_act_checkpoint_T shape",
    ),
    "checkpoint_rank": (
        {"gate_up_proj_act_checkpoint_T": _bf((N_, 2 * I_, B_))},
        ValueError,
        "gate_up_proj_act_checkpoint_T must be 4-D",
    ),
    "checkpoint_missing": (
        {"gate_up_proj_act_checkpoint_T": None},
        UnsupportedOptionError,
        "gate_up_proj_act_checkpoint_T is currently required",
    ),
    "checkpoint_dtype": (
        {"gate_up_proj_act_checkpoint_T": torch.zeros(N_, 2, I_, B_)},
        ValueError,
        "gate_up_proj_act_checkpoint_T dtype must be bfloat16",
    ),
    "affinities_shape": (
        {"expert_affinities_masked": _bf((T_ * E_,))},
        ValueError,
        "expert_affinities_masked shape",
    ),
    "affinities_rows": (
        {"expert_affinities_masked": _bf(((T_ + 1) * E_, 1))},
        ValueError,
        "expert_affinities_masked shape",
    ),
    "affinities_dtype": (
        {"expert_affinities_masked": torch.zeros(T_ * E_, 1, dtype=torch.float16)},
        ValueError,
        "expert_affinities_masked dtype",
    ),
    "tpti_dtype": (
        {"token_position_to_id": torch.zeros(N_ * B_, dtype=torch.int64)},
        ValueError,
        "token_position_to_id dtype must be int32",
    ),
    "tpti_shape": (
        {"token_position_to_id": torch.zeros(N_ * B_ + 3, dtype=torch.int32)},
        ValueError,
        "token_position_to_id must be 1-D [N*B]",
    ),
    "bte_dtype": (
        {"block_to_expert": torch.zeros(N_, 1, dtype=torch.float32)},
        ValueError,
        "block_to_expert dtype must be int32",
    ),
    "bte_shape": (
        {"block_to_expert": torch.zeros(N_, dtype=torch.int32)},
        ValueError,
        "block_to_expert shape",
    ),
    "hidden_dtype": (
        {"hidden_states": torch.zeros(T_, H_)},
        ValueError,
        "hidden_states dtype must be bfloat16",
    ),
    "grad_dtype": (
        {"output_hidden_states_grad": torch.zeros(T_, H_, dtype=torch.float16)},
        ValueError,
        "output_hidden_states_grad dtype must be bfloat16",
    ),
    "grad_shape": (
        {"output_hidden_states_grad": _bf((T_ + 1, H_))},
        ValueError,
        "output_hidden_states_grad shape",
    ),
    "gate_up_shape": (
        {"gate_up_proj_weight": _bf((E_, H_, 2 * I_))},
        ValueError,
        "gate_up_proj_weight shape",
    ),
    "down_shape": ({"down_proj_weight": _bf((E_, H_, I_))}, ValueError, "down_proj_weight shape"),
    "weight_dtype": (
        {"down_proj_weight": torch.zeros(E_, I_, H_)},
        ValueError,
        "down_proj_weight dtype must be bfloat16",
    ),
    "missing_tensor": ({"block_to_expert": None}, ValueError, "block_to_expert is required"),
    "prequant_gate_up_shape": (
        {"gate_up_weight_scales": torch.zeros(E_, 8, H_, dtype=torch.uint8)},
        ValueError,
        "gate_up_proj_weight shape",
    ),
    "prequant_down_scales": (
        {
            "down_proj_weight": torch.zeros(E_, H_ // 4, I_, dtype=torch.int32),
            "down_weight_scales": torch.zeros(E_, 8, H_, dtype=torch.uint8),
        },
        ValueError,
        "down_weight_scales shape",
    ),
    "gate_checkpoint": (
        {"gate_act_checkpoint_T": _bf((N_, I_, B_))},
        UnsupportedOptionError,
        "gate_act_checkpoint_T is not currently supported",
    ),
    "intermediate_checkpoint": (
        {"intermediate_checkpoint_T": _bf((N_, I_, B_))},
        UnsupportedOptionError,
        "intermediate_checkpoint_T is not currently supported",
    ),
    "scaled_checkpoint": (
        {"scaled_intermediate_checkpoint_T": _bf((N_, I_, B_))},
        UnsupportedOptionError,
        "scaled_intermediate_checkpoint_T is not currently supported",
    ),
    "down_checkpoint": (
        {"down_proj_act_checkpoint": _bf((N_, B_, H_))},
        UnsupportedOptionError,
        "down_proj_act_checkpoint must be None",
    ),
    "swizzled_gate_up": (
        {"gate_up_weight_is_swizzled": True},
        UnsupportedOptionError,
        "gate_up_weight_is_swizzled",
    ),
    "swizzled_down": (
        {"down_weight_is_swizzled": True},
        UnsupportedOptionError,
        "down_weight_is_swizzled",
    ),
    "affinity_on_h": (
        {"affinity_option": AffinityOption.AFFINITY_ON_H},
        UnsupportedOptionError,
        "affinity_option=AFFINITY_ON_H",
    ),
    "gelu": (
        {"activation_type": ActFnType.GELU},
        UnsupportedOptionError,
        "activation_type=GELU",
    ),
    "shard_hidden": (
        {"shard_option": ShardOption.SHARD_ON_HIDDEN},
        UnsupportedOptionError,
        "shard_option=SHARD_ON_HIDDEN",
    ),
    "compute_fp32": (
        {"compute_dtype": "float32"},
        UnsupportedOptionError,
        "compute_dtype=float32",
    ),
    "fp8_e5m2": (
        {"fp8_x4_dtype": "float8_e5m2_x4"},
        UnsupportedOptionError,
        "fp8_x4_dtype=float8_e5m2_x4",
    ),
    "accumulation_bf16": (
        {"accumulation_dtype": torch.bfloat16},
        ValueError,
        "accumulation_dtype must be None",
    ),
    "flag_type": ({"bias": 1}, ValueError, "bias must be a bool"),
    "skip_dma_type": ({"skip_dma": True}, ValueError, "skip_dma must be a SkipMode"),
    "clamp_type": ({"clamp_limits": (1.0, 2.0)}, ValueError, "clamp_limits must be a ClampLimits"),
    "enum_type": ({"shard_option": 0}, ValueError, "shard_option must be a ShardOption"),
    "phase_config_type": (
        {"phase3_config": {"tile_k": 128}},
        ValueError,
        "phase3_config must be a MatmulMxfp8KernelConfig",
    ),
    "phase_config_quant": (
        {"phase1_config": MatmulMxfp8KernelConfig(0, 0, 0, quant_scheme="1x32")},
        ValueError,
        "phase1: unsupported quant_scheme",
    ),
    "phase2_tile_m": (
        {"phase2_config": MatmulMxfp8KernelConfig(0, 0, 0, tile_m=64)},
        UnsupportedOptionError,
        "phase2_config.tile_m=64 is not implemented",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validation_rejects_with_named_argument(case):
    overrides, exc_type, fragment = BAD_CASES[case]
    args = _valid_args()
    args.update(overrides)
    with pytest.raises(exc_type) as info:
        validate_blockwise_mm_bwd_args(**args)
    msg = str(info.value)
    assert fragment in msg, msg
    assert msg.startswith("blockwise_mm_bwd_mxfp8: ")
    assert isinstance(info.value, ValueError)  # every rule raises a ValueError (subclass)


def test_unsupported_option_error_is_both_value_and_not_implemented_error():
    err = UnsupportedOptionError("x")
    assert isinstance(err, ValueError) and isinstance(err, NotImplementedError)
    assert len({frag for _, _, frag in BAD_CASES.values()}) >= 10


def test_dtype_name_spellings():
    assert {
        dtype_name(x)
        for x in ("bfloat16", torch.bfloat16, ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16))
    } == {"bfloat16"}
    assert dtype_name(np.float32) == dtype_name(torch.float32) == "float32"
    assert dtype_name("nl.float8_e4m3fn_x4") == "float8_e4m3fn_x4"


# --------------------------------------------------------------------------------- backends
def _problem(T=24, H=128, I=128, E=3, K=2, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    dy = torch.randn(T, H, generator=g).bfloat16()
    wgu = (torch.randn(E, H, 2, I, generator=g) / H**0.5).bfloat16()
    wd = (torch.randn(E, I, H, generator=g) / I**0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[0, -1] = -1  # one dropped slot
    aff = torch.rand(T, K, generator=g)
    plan = plan_routing(idx, aff, E)
    bgu = (0.1 * torch.randn(E, 2, I, generator=g)) if bias else None
    bd = (0.1 * torch.randn(E, H, generator=g)) if bias else None
    _, act = reference_forward(x, wgu, wd, plan, b_gate_up_E2I=bgu, b_down_EH=bd)
    return MoEBackwardProblem(x, dy, wgu, wd, plan, act.bfloat16(), bgu, bd)


def test_backends_registered_and_nki_unavailable_reason():
    names = registered_backends()
    assert {"nki", "nki-sim"} <= set(names)
    assert nki_backend.check_nki() is not None  # no Neuron SDK on this machine
    with pytest.raises(RuntimeError, match="backend 'nki' .* NKI toolchain is not available"):
        resolve_backend("nki")
    reason = nki_backend.check_nki_sim()
    if reason is None:
        assert resolve_backend("nki-sim").name == "nki-sim"
    else:
        with pytest.raises(RuntimeError, match="nki-sim"):
            resolve_backend("nki-sim")


def test_auto_selection_on_a_neuron_device_falls_back_with_the_reason(monkeypatch):
    monkeypatch.delenv("MOE_BWD_BACKEND", raising=False)
    chosen = resolve_backend("auto", "xla")
    assert chosen.name == "torch"
    assert chosen.fallback_reason.startswith("nki unavailable: the AWS Neuron NKI toolchain is not available")
    monkeypatch.setenv("MOE_BWD_BACKEND", "nki")
    with pytest.raises(RuntimeError, match="backend 'nki' .*MOE_BWD_BACKEND"):
        resolve_backend("auto", "cpu")


def test_backend_rejects_unknown_options_before_work():
    run = registered_backends()["nki-sim"].run
    with pytest.raises(ValueError, match=r"unknown options \['tile'\]"):
        run(_problem(), tile=3)


@pytest.mark.parametrize("padding", ["skip", "zero_row"])
def test_prepare_blockwise_args_layout(padding):
    p = _problem()
    args, kwargs, layout = nki_backend.prepare_blockwise_args(p, block_size=128, padding=padding)
    T = p.hidden_states_TH.shape[0] + (padding == "zero_row")
    assert args[0].shape == (T, 128) and args[0].dtype == torch.bfloat16
    assert args[1].shape == (T * 3, 1) and args[1].dtype == torch.bfloat16
    assert args[4].dtype == args[5].dtype == torch.int32 and args[7] == 128
    assert kwargs["gate_up_proj_act_checkpoint_T"].shape == (layout.num_blocks, 2, 128, 128)
    assert kwargs["skip_dma"] == SkipMode(skip_token=padding == "skip")
    if padding == "zero_row":
        assert torch.all(args[0][-1] == 0) and torch.all(args[6][-1] == 0)
    d = validate_blockwise_mm_bwd_args(*args, **kwargs)
    assert d.T == T and d.N == layout.num_blocks


def test_grads_from_outputs_slices_padding_and_adds_down_bias_term():
    p = _problem(bias=True)
    T, H = p.hidden_states_TH.shape
    E, I, _ = p.w_down_EIH.shape
    g = torch.Generator().manual_seed(1)
    # Fake kernel outputs with the zero-row padding layout (T+1 rows).
    outs = (
        torch.randn(T + 1, H, generator=g).bfloat16(),
        torch.randn((T + 1) * E, 1, generator=g).bfloat16(),
        torch.randn(E, H, 2, I, generator=g).bfloat16(),
        torch.randn(E, I, H, generator=g).bfloat16(),
        torch.randn(E, 2, I, generator=g),
        torch.randn(E, H, generator=g),
    )
    grads = nki_backend._grads_from_outputs(p, outs)
    assert grads.hidden_states_grad_TH.dtype == torch.float32
    assert torch.equal(grads.hidden_states_grad_TH, outs[0][:T].float())
    routed = torch.zeros(T, E, dtype=torch.bool)
    for t, e in zip(p.plan.pair_token_R.tolist(), p.plan.pair_expert_R.tolist()):
        if t >= 0:
            routed[t, e] = True
    bias_term = p.output_grad_TH.float() @ p.b_down_EH.float().T
    expect = outs[1].float().reshape(T + 1, E)[:T] + torch.where(routed, bias_term, 0.0)
    torch.testing.assert_close(grads.affinity_grad_TE, expect)
    assert torch.equal(grads.w_gate_up_grad_EH2I, outs[2].float())
    assert torch.equal(grads.b_down_grad_EH, outs[5])
    with pytest.raises(RuntimeError, match="expected 6"):
        nki_backend._grads_from_outputs(p, outs[:4])


# --------------------------------------------------------------------------------- autograd
def _torch_forward(x, aff, wgu, wd, bgu, bd, idx, clamp):
    """Differentiable fp32 forward in plain torch, per slot (duplicates not merged)."""
    T, K = idx.shape
    cl = clamp or ClampLimits()
    y = torch.zeros(T, x.shape[1])
    for k in range(K):
        for t in range(T):
            e = int(idx[t, k])
            if e < 0:
                continue
            gu = x[t].float() @ wgu[e].float().flatten(1)
            gu = gu.reshape(2, -1) + (bgu[e] if bgu is not None else 0.0)
            g = gu[0].clamp(cl.non_linear_clamp_lower_limit, cl.non_linear_clamp_upper_limit)
            u = gu[1].clamp(cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit)
            out = (torch.nn.functional.silu(g) * u) @ wd[e].float()
            if bd is not None:
                out = out + bd[e]
            y = y.index_add(0, torch.tensor([t]), (aff[t, k] * out)[None])
    return y


def test_autograd_wiring_matches_torch_autograd_with_reference_backend():
    g = torch.Generator().manual_seed(3)
    T, H, I, E, K = 6, 128, 128, 3, 2
    clamp = ClampLimits(
        linear_clamp_lower_limit=-1.0,
        linear_clamp_upper_limit=1.0,
        non_linear_clamp_upper_limit=1.5,
    )
    idx = torch.tensor([[0, 1], [2, -1], [1, 1], [0, 2], [2, 0], [1, 2]])  # dropped + duplicate
    leaves = [
        torch.randn(T, H, generator=g),
        torch.rand(T, K, generator=g),
        torch.randn(E, H, 2, I, generator=g) / H**0.5,
        torch.randn(E, I, H, generator=g) / I**0.5,
        0.1 * torch.randn(E, 2, I, generator=g),
        0.1 * torch.randn(E, H, generator=g),
    ]
    dy = torch.randn(T, H, generator=g)
    a = [t.clone().requires_grad_() for t in leaves]
    b = [t.clone().requires_grad_() for t in leaves]
    y = moe_expert_mlp(
        a[0], idx, a[1], a[2], a[3], a[4], a[5], clamp_limits=clamp, backend="reference"
    )
    y_ref = _torch_forward(b[0], b[1], b[2], b[3], b[4], b[5], idx, clamp)
    # the forward (common.layer's) runs BF16 GEMM operands, the float64 backward its BF16
    # checkpoint: wiring is judged by SQNR against fp32 torch autograd, not to fp32 rounding
    assert sqnr_db(y.double(), y_ref.double()) > 40
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name, ta, tb in zip(("dX", "dA", "dWgu", "dWd", "dBgu", "dBd"), a, b):
        assert sqnr_db(ta.grad.double(), tb.grad.double()) > 35, name
    assert a[2].grad.shape == (E, H, 2, I)
    assert a[1].grad[1, 1] == 0  # dropped slot


def test_autograd_forward_checkpoint_matches_reference():
    p = _problem(T=12)
    y, act = expert_mlp_forward(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan)
    y_ref, act_ref = reference_forward(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, p.plan)
    assert y.dtype == act.dtype == torch.bfloat16
    assert sqnr_db(y.double(), y_ref) > 45 and sqnr_db(act.double(), act_ref) > 45


@pytest.mark.parametrize("dtype, lo, hi",
                         [(torch.float32, 47.0, 50.5), (torch.bfloat16, 50.0, 52.5)])
def test_reference_backend_through_autograd_is_bounded_by_the_bf16_checkpoint(dtype, lo, hi):
    """moe_expert_mlp(backend="reference") is no float64 anchor: the float64 backward runs on
    the forward's BF16 checkpoint (~47-52 dB against a float64 forward + backward, as its
    docstring and the backend's summary say, on this shape)."""
    assert "BF16" in registered_backends()["reference"].summary
    assert "no float64 anchor" in registered_backends()["reference"].summary
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 256, 512, 256, 16, 4
    x = torch.randn(T, H, generator=g).to(dtype)
    wgu = (torch.randn(E, H, 2, I, generator=g) * H**-0.5).to(dtype)
    wd = (torch.randn(E, I, H, generator=g) * I**-0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    aff = torch.rand(T, K, generator=g).softmax(-1)
    dy = torch.randn(T, H, generator=g).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, aff, wgu, wd)]
    y = moe_expert_mlp(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend="reference")
    y.backward(dy)
    plan = plan_routing(idx, aff.double(), E)
    _, act = reference_forward(x.double(), wgu.double(), wd.double(), plan)
    ref = reference_backward(
        MoEBackwardProblem(x.double(), dy.double(), wgu.double(), wd.double(), plan, act))
    want = (ref.hidden_states_grad_TH, plan.slot_affinity_grad(ref.affinity_grad_TE),
            ref.w_gate_up_grad_EH2I, ref.w_down_grad_EIH)
    figures = [sqnr_db(t.grad.double(), w) for t, w in zip(leaves, want)]
    print(dtype, "reference backend vs float64 forward + backward, dB:", figures)
    assert all(lo <= db <= hi for db in figures), figures


def test_autograd_rejects_unusable_backend_before_work():
    x = torch.zeros(2, 128, requires_grad=True)
    with pytest.raises(RuntimeError, match="backend 'nki'"):
        moe_expert_mlp(
            x,
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            torch.zeros(1, 128, 2, 128),
            torch.zeros(1, 128, 128),
            backend="nki",
        )


needs_sim = pytest.mark.skipif(
    nki_backend.check_nki_sim() is not None, reason=f"nki-sim: {nki_backend.check_nki_sim()}"
)


@needs_sim
def test_nki_sim_backend_and_autograd_against_reference():
    p = _problem(T=24, bias=True)
    ref = reference_backward(p)
    grads = resolve_backend("nki-sim").run(p, block_size=128, run_with_lnc2=False)
    figures = {}
    for name, out in grads.named().items():
        figures[name] = sqnr_db(out.double(), ref.named()[name])
    print("nki-sim vs float64 reference, SQNR dB:", {k: round(v, 1) for k, v in figures.items()})
    assert all(db >= sqnr_floor("nki", name) for name, db in figures.items()), figures
    phases = grads.info["nki_phases"]
    assert [r["phase"] for r in phases] == ["phase1", "phase2", "phase3", "phase4"]
    assert all(r["modeled_us"] > 0 and 0 < r["tensor_e_util"] <= 1 for r in phases)
    assert grads.info["num_blocks"] == p.plan.blockwise(128).num_blocks

    # LNC2 (two program instances), zero-row padding and fp32 accumulation: same gradients up to
    # fp32 summation order / the BF16 rounding of the cross-block accumulation.
    other = resolve_backend("nki-sim").run(
        p, block_size=128, run_with_lnc2=True, padding="zero_row", accumulation_dtype="float32"
    )
    assert other.info["run_with_lnc2"] is True and other.info["accumulation_dtype"] == "float32"
    for name, out in other.named().items():
        assert sqnr_db(out.double(), grads.named()[name].double()) > 40, name

    # The same kernel through the autograd Function.
    leaves = [
        p.hidden_states_TH.clone().requires_grad_(),
        torch.rand(24, 2, generator=torch.Generator().manual_seed(5)).requires_grad_(),
        p.w_gate_up_EH2I.clone().requires_grad_(),
        p.w_down_EIH.clone().requires_grad_(),
    ]
    idx = torch.stack([torch.tensor([t % 3, (t + 1) % 3]) for t in range(24)])
    y = moe_expert_mlp(leaves[0], idx, *leaves[1:], backend="nki-sim", run_with_lnc2=False)
    dy = p.output_grad_TH.float()
    (y.float() * dy).sum().backward()
    plan = plan_routing(idx, leaves[1].detach(), 3)
    _, act = expert_mlp_forward(p.hidden_states_TH, p.w_gate_up_EH2I, p.w_down_EIH, plan)
    ref = reference_backward(
        MoEBackwardProblem(p.hidden_states_TH, dy, p.w_gate_up_EH2I, p.w_down_EIH, plan, act)
    )
    assert sqnr_db(leaves[0].grad.double(), ref.hidden_states_grad_TH) >= sqnr_floor("nki", "dX")
    assert sqnr_db(leaves[2].grad.double(), ref.w_gate_up_grad_EH2I) >= sqnr_floor(
        "nki", "dW_gate_up")
    assert sqnr_db(leaves[3].grad.double(), ref.w_down_grad_EIH) >= sqnr_floor("nki", "dW_down")
    d_aff_ref = plan.slot_affinity_grad(ref.affinity_grad_TE)
    assert sqnr_db(leaves[1].grad.double(), d_aff_ref) >= sqnr_floor("nki", "dA")


def test_candidate_phase_overrides_are_valid_configs():
    for shape in phase_shapes(2048, 768, 128, True) + phase_shapes(256, 128, 512, False):
        cands = nki_backend.candidate_phase_overrides(*shape)
        assert cands[0] == {} and len(cands) == len({tuple(sorted(c.items())) for c in cands})
        for c in cands:
            cfg = MatmulMxfp8KernelConfig(0, 0, 0, **c)  # every candidate passes the config rules
            assert cfg.TILES_IN_BLOCK_M is None or cfg.TILES_IN_BLOCK_M % cfg.TILES_IN_LOAD_M == 0
    # phase2 of Qwen3 under LNC2: (M, K, N) = (128, 1536, 1024): 3 K tiles of 512, 2 N tiles.
    assert {"TILES_IN_BLOCK_K": 3, "enable_psum_copy_in": False} in (
        nki_backend.candidate_phase_overrides(128, 1536, 1024)
    )
    assert {"TILES_IN_BLOCK_N": 2, "TILES_IN_LOAD_N": 2} in nki_backend.candidate_phase_overrides(
        128, 1536, 1024
    )


@needs_sim
def test_zero_tokens_gives_zero_weight_grads_without_launch():
    p = _problem(T=4)
    empty = MoEBackwardProblem(
        p.hidden_states_TH[:0],
        p.output_grad_TH[:0],
        p.w_gate_up_EH2I,
        p.w_down_EIH,
        plan_routing(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), 3),
        p.act_checkpoint_R2I[:0],
    )
    grads = resolve_backend("nki-sim").run(empty)
    assert grads.hidden_states_grad_TH.shape == (0, 128)
    assert grads.affinity_grad_TE.shape == (0, 3)
    assert torch.count_nonzero(grads.w_gate_up_grad_EH2I) == 0
    assert grads.w_down_grad_EIH.shape == (3, 128, 128)


@needs_sim
def test_kernel_signature_is_the_seed_and_package_exports_the_function():
    import importlib
    import inspect

    # Importing the submodule must not shadow the function on the package.
    kernel_module = importlib.import_module("nki_kernels.blockwise_mm_bwd_mxfp8")
    fn = nki_kernels.blockwise_mm_bwd_mxfp8
    from nki_kernels import blockwise_mm_bwd_mxfp8 as fn2

    assert fn2 is fn
    assert inspect.isfunction(fn) and fn is kernel_module.blockwise_mm_bwd_mxfp8
    params = inspect.signature(fn).parameters
    assert list(params) == SEED_PARAMS
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    assert list(defaults) == SEED_PARAMS[8:]  # the first 8 (through block_size) are required
    assert all(defaults[n] is None for n in SEED_PARAMS[8:14] + ["skip_dma", "clamp_limits"])
    assert all(
        defaults[n] is None for n in ("phase1_config", "phase4_config", "accumulation_dtype")
    )
    assert dtype_name(defaults["fp8_x4_dtype"]) == "float8_e4m3fn_x4"
    assert dtype_name(defaults["compute_dtype"]) == "bfloat16"
    assert defaults["shard_option"] is ShardOption.SHARD_ON_FREE
    assert defaults["affinity_option"] is AffinityOption.AFFINITY_ON_I
    assert defaults["activation_type"] is ActFnType.SiLU
    flags = ("gate_up_weight_is_swizzled", "down_weight_is_swizzled", "spill_reload")
    assert all(defaults[n] is False for n in flags + ("skip_grad_initialization", "bias"))
    # use_scale_packing: AWS's default, True (issue 24 item 1: scale packing implemented)
    assert defaults["use_scale_packing"] is True and defaults["run_with_lnc2"] is True
    assert defaults["is_tensor_update_accumulating"] is True


@needs_sim
def test_kernel_validates_before_any_work():
    from nki_kernels.interp import simulate

    args = _valid_args()
    args["block_size"] = 96
    sim = simulate(nki_kernels.blockwise_mm_bwd_mxfp8, lnc=1)
    with pytest.raises(ValueError, match="block_size must be one of"):
        sim(**args)
    args = _valid_args()
    with pytest.raises(ValueError, match="activation_type=ReLU"):
        sim(**args, activation_type=ActFnType.ReLU)


def test_grads_from_numpy_bf16_outputs():
    p = _problem(T=5)
    T, H = p.hidden_states_TH.shape
    E, I, _ = p.w_down_EIH.shape
    outs = (
        np.ones((T, H), dtype=ml_dtypes.bfloat16),
        np.full((T * E, 1), 2, dtype=ml_dtypes.bfloat16),
        np.zeros((E, H, 2, I), dtype=ml_dtypes.bfloat16),
        np.zeros((E, I, H), dtype=np.float32),
    )
    grads = nki_backend._grads_from_outputs(p, outs)
    assert grads.hidden_states_grad_TH.dtype == torch.float32
    assert torch.all(grads.hidden_states_grad_TH == 1) and torch.all(grads.affinity_grad_TE == 2)


@needs_sim
def test_tuner_picks_per_phase_minimum_of_modeled_time():
    best, rows = nki_backend.tune_phase_configs(256, 128, 128, True)
    assert set(best) == {"phase1", "phase2", "phase3", "phase4"}
    for phase, overrides in best.items():
        times = [r["modeled_us"] for r in rows if r["phase"] == phase]
        chosen = [
            r["modeled_us"] for r in rows if r["phase"] == phase and r["overrides"] == overrides
        ]
        assert min(chosen) == min(times) and min(times) > 0
        default = next(r for r in rows if r["phase"] == phase and r["run"] == 0)
        assert min(times) <= default["modeled_us"]


UNSUPPORTED_FIELDS = {
    "TILES_IN_BLOCK_M": 2,
    "TILES_IN_LOAD_K": 2,
    "block_loop_order": "nmk",
    "tile_loop_order": "kmn",
    "float8_dtype": "float8_e5m2",
    "lnc_2_shard_rhs": False,
    "spill_reload": True,
    "lhs_is_swizzled": False,
    "rhs_is_swizzled": False,
    "load_with_PE_swizzle": True,
    "output_dtype": "float32",
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_unimplemented_config_fields_raise_naming_the_field(field):
    """Issue 11 item 3: a field the kernel does not implement is never silently ignored."""
    extra = {"TILES_IN_BLOCK_K": 2} if field == "TILES_IN_LOAD_K" else {}
    cfg = MatmulMxfp8KernelConfig(0, 0, 0, **{field: UNSUPPORTED_FIELDS[field]}, **extra)
    args = _valid_args()
    with pytest.raises(UnsupportedOptionError, match=f"phase3_config.{field}=.*not implemented"):
        validate_blockwise_mm_bwd_args(**args, phase3_config=cfg)


def test_load_tiles_must_match_block_tiles_and_wrapper_spill_reload_raises():
    args = _valid_args()
    ok = MatmulMxfp8KernelConfig(0, 0, 0, TILES_IN_BLOCK_N=2, TILES_IN_LOAD_N=2,
                                 TILES_IN_BLOCK_M=1, TILES_IN_LOAD_M=1, TILES_IN_LOAD_K=1,
                                 lnc_2_shard_rhs=True)
    validate_blockwise_mm_bwd_args(**args, phase2_config=ok)
    bad = MatmulMxfp8KernelConfig(0, 0, 0, TILES_IN_BLOCK_N=4, TILES_IN_LOAD_N=2)
    with pytest.raises(UnsupportedOptionError, match="phase2_config.TILES_IN_LOAD_N=2"):
        validate_blockwise_mm_bwd_args(**args, phase2_config=bad)
    with pytest.raises(UnsupportedOptionError, match="phase1_config.spill_reload=True"):
        validate_blockwise_mm_bwd_args(**args, spill_reload=True)


def test_scale_packing_is_accepted_both_ways():
    """Issue 24 item 1: scale packing is implemented; use_scale_packing (default True, AWS's) and
    a phase config's enable_scale_packing are accepted either way, and an omitted phase takes
    the wrapper's value while a given one keeps its own."""
    args = _valid_args()
    validate_blockwise_mm_bwd_args(**args)  # defaults: packing on
    validate_blockwise_mm_bwd_args(**args, use_scale_packing=False)
    for flag in (True, False):
        cfg = MatmulMxfp8KernelConfig(0, 0, 0, enable_scale_packing=flag)
        validate_blockwise_mm_bwd_args(**args, phase4_config=cfg, use_scale_packing=not flag)
    with pytest.raises(ValueError, match="use_scale_packing must be a bool"):
        validate_blockwise_mm_bwd_args(**args, use_scale_packing=1)
    cfgs = default_phase_configs(256, 128, 128, False)
    assert all(c.enable_scale_packing is True for c in cfgs)
    cfgs = default_phase_configs(256, 128, 128, False, use_scale_packing=False)
    assert all(c.enable_scale_packing is False for c in cfgs)


# The seed's signature (shared/seeds/blockwise_mm_bwd_mxfp8.rst, ".. py:function::"), verbatim.
SEED_SIGNATURE = (
    "blockwise_mm_bwd_mxfp8(hidden_states: nl.ndarray, expert_affinities_masked: nl.ndarray, "
    "gate_up_proj_weight: nl.ndarray, down_proj_weight: nl.ndarray, token_position_to_id: "
    "nl.ndarray, block_to_expert: nl.ndarray, output_hidden_states_grad: nl.ndarray, "
    "block_size: int, gate_up_proj_act_checkpoint_T: Optional[nl.ndarray] = None, "
    "gate_act_checkpoint_T: nl.ndarray = None, intermediate_checkpoint_T: nl.ndarray = None, "
    "scaled_intermediate_checkpoint_T: nl.ndarray = None, down_proj_act_checkpoint: "
    "Optional[nl.ndarray] = None, gate_up_weight_scales: nl.ndarray = None, "
    "gate_up_weight_is_swizzled: bool = False, down_weight_scales: nl.ndarray = None, "
    "down_weight_is_swizzled: bool = False, phase1_config: Optional[MatmulMxfp8KernelConfig] = "
    "None, phase2_config: Optional[MatmulMxfp8KernelConfig] = None, phase3_config: "
    "Optional[MatmulMxfp8KernelConfig] = None, phase4_config: Optional[MatmulMxfp8KernelConfig] "
    "= None, fp8_x4_dtype: type = float8_e4m3fn_x4, spill_reload: bool = False, "
    "use_scale_packing: bool = True, run_with_lnc2: bool = True, shard_option: ShardOption = "
    "ShardOption.SHARD_ON_FREE, affinity_option: AffinityOption = AffinityOption.AFFINITY_ON_I, "
    "compute_dtype: nki.dtype = nl.bfloat16, skip_dma: SkipMode = None, "
    "skip_grad_initialization: bool = False, is_tensor_update_accumulating: bool = True, "
    "clamp_limits: ClampLimits = None, activation_type: ActFnType = ActFnType.SiLU, "
    "bias: bool = False)"
)
_SEED_VALUES = {
    "None": None, "True": True, "False": False,
    "ShardOption.SHARD_ON_FREE": ShardOption.SHARD_ON_FREE,
    "AffinityOption.AFFINITY_ON_I": AffinityOption.AFFINITY_ON_I,
    "ActFnType.SiLU": ActFnType.SiLU,
}
_SEED_DTYPES = {"float8_e4m3fn_x4": "float8_e4m3fn_x4", "nl.bfloat16": "bfloat16"}


def _seed_defaults() -> dict:
    """{parameter: default text or None (required)} parsed from SEED_SIGNATURE, in order."""
    body = SEED_SIGNATURE[SEED_SIGNATURE.index("(") + 1 : SEED_SIGNATURE.rindex(")")]
    out = {}
    for item in body.split(", "):
        name, _, rest = item.partition(": ")
        out[name] = rest.split(" = ", 1)[1] if " = " in rest else None
    return out


def test_seed_signature_copy_is_the_seeds():
    import pathlib

    here = pathlib.Path(__file__).resolve()
    for root in (here.parents[1], here.parents[2]):
        rst = root / "shared" / "seeds" / "blockwise_mm_bwd_mxfp8.rst"
        if rst.exists():
            assert SEED_SIGNATURE in " ".join(rst.read_text().split())
            return
    pytest.skip("shared/seeds/blockwise_mm_bwd_mxfp8.rst not found (the verbatim copy stands)")


def test_wrapper_defaults_equal_the_seed_field_by_field():
    """Every default of the entry (and of the host validation that mirrors it, and of the
    backend / config helpers' copies of the wrapper defaults) equals the seed signature's."""
    seed = _seed_defaults()
    params = inspect.signature(nki_kernels.blockwise_mm_bwd_mxfp8).parameters
    assert list(params)[: len(seed)] == list(seed)
    vparams = inspect.signature(validate_blockwise_mm_bwd_args).parameters
    for name, text in seed.items():
        for where, ps in (("kernel", params), ("validation", vparams)):
            got = ps[name].default
            if text is None:
                assert got is inspect.Parameter.empty, (where, name)
            elif text in _SEED_DTYPES:
                assert dtype_name(got) == _SEED_DTYPES[text], (where, name)
            else:
                assert got is _SEED_VALUES[text], (where, name, got, text)
    helpers = (
        inspect.signature(nki_backend.run_blockwise).parameters,
        inspect.signature(default_phase_configs).parameters,
    )
    for ps in helpers:
        for name in ("use_scale_packing", "spill_reload"):
            assert ps[name].default is _SEED_VALUES[seed[name]], name
    assert inspect.signature(nki_backend.run_blockwise).parameters["run_with_lnc2"].default is (
        _SEED_VALUES[seed["run_with_lnc2"]])