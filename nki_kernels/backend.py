"""Backends ``nki`` (real AWS NKI on Trainium), ``nki-sim`` (our CPU NKI interpreter) and
``nki-twin`` (the kernel's MX-faithful torch twin, any device).

Registered with :mod:`common.dispatch` on import (the dispatcher imports this module lazily by
name). Both run :func:`nki_kernels.blockwise_mm_bwd_mxfp8` on one
:class:`~common.problem.MoEBackwardProblem`:

1. routing plan -> AWS's blockwise layout (``plan.blockwise(block_size, padding)``): token ids
   ``[N*B]`` int32, ``block_to_expert`` ``[N, 1]`` int32, affinities ``[T*E, 1]`` (``[(T+1)*E, 1]``
   and a zero row T appended to X and dY with ``padding="zero_row"``);
2. the per-pair checkpoint ``[R, 2, I]`` -> the kernel's ``[N, 2, I, B]``; activations, weights,
   checkpoint and affinities cast to BF16 (the kernel's input dtypes);
3. the kernel, through ``nki_kernels.interp.simulate`` (``nki-sim``) or ``nki.jit`` (``nki``);
4. back to :class:`~common.problem.MoEGrads` in float32: the padding row sliced off, affinity
   grad ``[T*E, 1]`` -> ``[T, E]`` plus the down-bias term ``<dY, b_down>`` on routed cells when
   the problem has a down bias (the kernel has no bias values, REFERENCE §2), and with ``nki-sim``
   the interpreter's per-phase modeled Trainium3 time and TensorE utilization in
   ``info["nki_phases"]``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common.dispatch import Backend, register_backend
from common.problem import MoEBackwardProblem, MoEGrads
from nki_kernels.config import PHASE_NAMES, SkipMode, load_tuned_phase_configs
from nki_kernels.validation import dtype_name, validate_blockwise_mm_bwd_args

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "check_nki",
    "check_nki_sim",
    "check_shape",
    "prepare_blockwise_args",
    "run_blockwise",
    "run_twin",
]

# 128: the smallest legal block; under the interpreter every slot of a non-empty block costs CPU
# time, and MoE training shapes average ~64 slots per expert at 1k tokens (Qwen3-30B-A3B).
DEFAULT_BLOCK_SIZE = 128
RUN_OPTIONS = (
    "block_size",
    "padding",
    "run_with_lnc2",
    "accumulation_dtype",
    "phase_configs",
    "use_tuned_configs",
    "is_tensor_update_accumulating",
    "use_scale_packing",
    "spill_reload",
)


def check_nki() -> str | None:
    """None when the real AWS NKI toolchain is importable (``nki_kernels._nki`` checks its API
    surface and version, so a placeholder ``nki`` package does not count), else the reason."""
    from nki_kernels import _nki

    if _nki.REAL_NKI_PROBLEM is not None:
        return (
            f"the AWS Neuron NKI toolchain is not available ({_nki.REAL_NKI_PROBLEM}); it ships "
            "with the Neuron SDK on Trainium hosts. Use backend 'nki-sim' to run the same kernel "
            "on our CPU interpreter"
        )
    return None


def check_nki_sim() -> str | None:
    """None when the kernel and our interpreter import, else the reason."""
    try:
        from nki_kernels.interp import simulate  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"nki_kernels.interp (the CPU NKI interpreter) does not import: {exc}"
    try:
        from nki_kernels.blockwise_mm_bwd_mxfp8 import blockwise_mm_bwd_mxfp8  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"the kernel nki_kernels.blockwise_mm_bwd_mxfp8 does not import: {exc}"
    return None


def check_shape(dims: dict[str, Any]) -> str | None:
    """None when the MXFP8 kernel takes a problem of these dimensions, else the reason:
    H and I multiples of 128 (the partition tile, :data:`~nki_kernels.validation.DIM_ALIGN`)
    and the SwiGLU activation. For :class:`~common.dispatch.Backend` ``check_shape``, so the
    command line refuses before building any input."""
    from nki_kernels.validation import DIM_ALIGN

    reasons = []
    H, I = dims.get("H"), dims.get("I")
    bad = [f"{k}={v}" for k, v in (("H", H), ("I", I)) if v is not None and v % DIM_ALIGN]
    if bad:
        reasons.append(
            f"{' and '.join(bad)} must be multiples of {DIM_ALIGN} (the kernel's partition "
            "tile)"
        )
    act = dims.get("activation")
    if act not in (None, "swiglu"):
        reasons.append(
            f"activation {act!r}: the MXFP8 kernel computes only SwiGLU (silu(g) * u); use "
            "backend 'torch' or 'reference'"
        )
    return "; ".join(reasons) or None


def _check_activation(problem: MoEBackwardProblem, who: str = "the NKI kernel") -> None:
    """Raise ValueError unless ``problem.activation`` is SwiGLU, the only activation the MXFP8
    kernel computes (its phase 1 is SiLU; gpt-oss's ``g sigmoid(1.702 g) (u + 1)`` is not
    expressible through ``activation_type``, REFERENCE §2)."""
    act = problem.activation
    if not act.is_swiglu:
        raise ValueError(
            f"problem.activation is {act.name!r} (alpha={act.alpha}, up_offset={act.up_offset}); "
            f"{who} computes only SwiGLU (silu(g) * u, alpha=1, up_offset=0). Use backend "
            "'torch' or 'reference' for this activation"
        )


def prepare_blockwise_args(
    problem: MoEBackwardProblem,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    padding: str = "skip",
) -> tuple[tuple, dict, Any]:
    """The kernel's positional args, checkpoint/bias keywords and the layout, from a problem.

    Args:
        problem: the backend-neutral problem (any float dtypes; cast to BF16 here).
        block_size: B, one of 128/256/512/1024/2048/4096.
        padding: ``"skip"`` (padding ids -1, OOB-skipped by the kernel's DMA) or ``"zero_row"``
            (padding ids T; X, dY and the affinities get an all-zero row T).

    Returns:
        ``(args, kwargs, layout)``: ``args`` = (hidden_states [T', H] bf16,
        expert_affinities_masked [T'*E, 1] bf16, gate_up_proj_weight [E, H, 2, I] bf16,
        down_proj_weight [E, I, H] bf16, token_position_to_id [N*B] int32, block_to_expert
        [N, 1] int32, output_hidden_states_grad [T', H] bf16, block_size) with T' = T or T+1;
        ``kwargs`` = gate_up_proj_act_checkpoint_T [N, 2, I, B] bf16, skip_dma, clamp_limits,
        bias; ``layout`` = the :class:`~common.routing.BlockwiseLayout`.

    Raises:
        ValueError: bad ``block_size``/``padding`` (from the routing layer), a problem whose
            shapes disagree, or a problem whose ``activation`` is not SwiGLU.
    """
    _check_activation(problem)
    bf16 = torch.bfloat16
    p = problem
    T = p.hidden_states_TH.shape[0]
    E = p.w_down_EIH.shape[0]
    if p.plan.num_tokens != T or p.plan.num_experts != E:
        raise ValueError(
            f"problem.plan has T={p.plan.num_tokens}, E={p.plan.num_experts}; the tensors have "
            f"T={T}, E={E}"
        )
    layout = p.plan.blockwise(block_size, padding)
    x = layout.pad_token_rows(p.hidden_states_TH.to(bf16)).contiguous()
    dy = layout.pad_token_rows(p.output_grad_TH.to(bf16)).contiguous()
    ckpt = layout.checkpoint_from_pairs(p.act_checkpoint_R2I.to(bf16)).contiguous()
    args = (
        x,
        layout.expert_affinities_masked.to(bf16).contiguous(),
        p.w_gate_up_EH2I.to(bf16).contiguous(),
        p.w_down_EIH.to(bf16).contiguous(),
        layout.token_position_to_id.to(torch.int32).contiguous(),
        layout.block_to_expert.to(torch.int32).contiguous(),
        dy,
        block_size,
    )
    kwargs = {
        "gate_up_proj_act_checkpoint_T": ckpt,
        "skip_dma": SkipMode(skip_token=padding == "skip", skip_weight=False),
        "clamp_limits": p.clamp_limits,
        "bias": p.has_bias,
    }
    return args, kwargs, layout


def _routed_mask_TE(problem: MoEBackwardProblem) -> torch.Tensor:
    plan = problem.plan
    T, E = plan.num_tokens, plan.num_experts
    mask = torch.zeros(T * E, dtype=torch.bool, device=problem.hidden_states_TH.device)
    valid = plan.pair_valid_R
    cells = plan.pair_token_R.clamp(min=0) * E + plan.pair_expert_R.clamp(max=E - 1)
    mask[cells[valid]] = True
    return mask.reshape(T, E)


def _as_float_tensor(x: Any) -> torch.Tensor:
    """A kernel output (torch tensor, or numpy array incl. ml_dtypes BF16) as float32 torch."""
    if isinstance(x, torch.Tensor):
        return x.float()
    import numpy as np

    return torch.from_numpy(np.asarray(x).astype(np.float32))


def _grads_from_outputs(problem: MoEBackwardProblem, outputs: tuple) -> MoEGrads:
    p = problem
    T, _ = p.hidden_states_TH.shape
    E = p.w_down_EIH.shape[0]
    has_bias = p.has_bias
    expected = 6 if has_bias else 4
    if not isinstance(outputs, (tuple, list)) or len(outputs) != expected:
        raise RuntimeError(
            f"blockwise_mm_bwd_mxfp8 returned {type(outputs).__name__} of length "
            f"{len(outputs) if isinstance(outputs, (tuple, list)) else '?'}, expected {expected}"
        )
    outs = [_as_float_tensor(o) for o in outputs]
    dx = outs[0][:T]
    da = outs[1].reshape(-1, E)[:T].clone()
    if p.b_down_EH is not None:
        # <dY_t, b_down[e]>, which the kernel does not compute; on the host so that every device
        # gets the CPU's fp32 sum order (on the H200 cuBLAS gave 1-ULP different dA cells)
        bias_term = (p.output_grad_TH.float().cpu() @ p.b_down_EH.float().cpu().T).to(da.device)
        da = da + torch.where(_routed_mask_TE(p), bias_term, torch.zeros((), dtype=da.dtype))
    return MoEGrads(
        hidden_states_grad_TH=dx,
        affinity_grad_TE=da,
        w_gate_up_grad_EH2I=outs[2],
        w_down_grad_EIH=outs[3],
        b_gate_up_grad_E2I=outs[4] if has_bias else None,
        b_down_grad_EH=outs[5] if has_bias else None,
    )


def _phase_configs(phase_configs, use_tuned_configs, H, I, block_size, run_with_lnc2):
    """The four per-phase configs to run: given, tuned (configs/nki/), or all defaults.

    Raises:
        ValueError: ``phase_configs`` is not four entries.
    """
    if phase_configs is None:
        phase_configs = (
            load_tuned_phase_configs(H, I, block_size, run_with_lnc2)
            if use_tuned_configs
            else (None, None, None, None)
        )
    if not isinstance(phase_configs, (tuple, list)) or len(phase_configs) != 4:
        raise ValueError(f"phase_configs must be 4 entries (phase1..phase4), got {phase_configs!r}")
    return phase_configs


def _zero_grads(problem: MoEBackwardProblem, backend: str) -> MoEGrads:
    """Gradients of a problem with no tokens (nothing to launch): dW zeros, empty dX / dA."""
    p = problem
    H = p.hidden_states_TH.shape[1]
    E, I, _ = p.w_down_EIH.shape

    def z(*shape):
        return torch.zeros(*shape, dtype=torch.float32, device=p.hidden_states_TH.device)

    return MoEGrads(
        hidden_states_grad_TH=z(0, H),
        affinity_grad_TE=z(0, E),
        w_gate_up_grad_EH2I=z(E, H, 2, I),
        w_down_grad_EIH=z(E, I, H),
        b_gate_up_grad_E2I=z(E, 2, I) if p.has_bias else None,
        b_down_grad_EH=z(E, H) if p.has_bias else None,
        info={"backend": backend, "note": "no tokens: the kernel is not launched"},
    )


def _profile_rows(profile: Any) -> list[dict]:
    if profile is None:
        return []
    rows = []
    for name in PHASE_NAMES:
        if name not in getattr(profile, "regions", PHASE_NAMES):
            continue
        rows.append(
            {
                "phase": name,
                "modeled_us": float(profile.modeled_time_us(name)),
                "tensor_e_util": float(profile.tensor_e_utilization(name)),
            }
        )
    return rows


def run_blockwise(
    problem: MoEBackwardProblem,
    *,
    backend: str = "nki-sim",
    block_size: int = DEFAULT_BLOCK_SIZE,
    padding: str = "skip",
    run_with_lnc2: bool = True,
    accumulation_dtype: Any = None,
    phase_configs: tuple | None = None,
    use_tuned_configs: bool = True,
    is_tensor_update_accumulating: bool = True,
    use_scale_packing: bool = True,
    spill_reload: bool = False,
) -> MoEGrads:
    """Run the NKI MXFP8 backward on ``problem`` and return float32 :class:`MoEGrads`.

    Args:
        problem: the :class:`~common.problem.MoEBackwardProblem`.
        backend: ``"nki-sim"`` (our interpreter, CPU) or ``"nki"`` (real NKI, Trainium).
        block_size: B in (128, 256, 512, 1024, 2048, 4096).
        padding: ``"skip"`` (ids -1) or ``"zero_row"`` (ids T with a zero row).
        run_with_lnc2: 2 program instances (LNC2) or 1.
        accumulation_dtype: None (AWS: BF16 read-add-write across blocks) or float32.
        phase_configs: 4 :class:`~nki_kernels.config.MatmulMxfp8KernelConfig` or None entries;
            None with ``use_tuned_configs`` -> ``configs/nki/*.yaml`` for this shape, if any.
        is_tensor_update_accumulating: scatter-add dX across top_k (True is always correct).
        use_scale_packing, spill_reload: the kernel's wrapper defaults for omitted phases.

    Returns:
        :class:`~common.problem.MoEGrads` (float32) with ``info``: backend, block_size,
        num_blocks, padding, run_with_lnc2, accumulation_dtype, wall_s and, for ``nki-sim``,
        ``nki_phases`` = [{"phase", "modeled_us", "tensor_e_util"}, ...] and
        ``nki_modeled_total_us``.

    Raises:
        ValueError: a bad option or problem (the kernel's validation runs before any work),
            including a problem whose ``activation`` is not SwiGLU (the kernel's only one).
        RuntimeError: the backend cannot run here (the reason from :func:`check_nki` /
            :func:`check_nki_sim`).
    """
    if backend not in ("nki", "nki-sim"):
        raise ValueError(f"backend must be 'nki' or 'nki-sim', got {backend!r}")
    reason = check_nki() if backend == "nki" else check_nki_sim()
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} cannot run here: {reason}")
    if not isinstance(run_with_lnc2, bool):
        msg = f"run_with_lnc2 must be a bool, got {run_with_lnc2!r}"
        raise ValueError(msg)
    problem.validate()
    _check_activation(problem, f"backend {backend!r}")
    if not is_tensor_update_accumulating and problem.plan.top_k > 1:
        raise ValueError(
            "is_tensor_update_accumulating=False overwrites dX rows, which is correct only when "
            f"each token is in one block; this plan has top_k={problem.plan.top_k}"
        )
    if problem.hidden_states_TH.shape[0] == 0:
        return _zero_grads(problem, backend)
    args, kwargs, layout = prepare_blockwise_args(problem, block_size=block_size, padding=padding)
    H = problem.hidden_states_TH.shape[1]
    I = problem.w_down_EIH.shape[1]
    phase_configs = _phase_configs(
        phase_configs, use_tuned_configs, H, I, block_size, run_with_lnc2
    )
    kwargs.update(
        phase1_config=phase_configs[0],
        phase2_config=phase_configs[1],
        phase3_config=phase_configs[2],
        phase4_config=phase_configs[3],
        run_with_lnc2=run_with_lnc2,
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        use_scale_packing=use_scale_packing,
        spill_reload=spill_reload,
        accumulation_dtype=accumulation_dtype,
    )
    from nki_kernels.blockwise_mm_bwd_mxfp8 import blockwise_mm_bwd_mxfp8 as kernel

    # Fail on bad input here, before any tensor moves or the interpreter starts.
    validate_blockwise_mm_bwd_args(*args, **kwargs)

    lnc = 2 if run_with_lnc2 else 1
    profile = None
    start = time.perf_counter()
    if backend == "nki-sim":
        from nki_kernels.interp import simulate

        sim = simulate(kernel, lnc=lnc)
        outputs = sim(*args, **kwargs)
        profile = getattr(sim, "last_profile", None)
    else:  # pragma: no cover - needs a Trainium host
        import nki  # type: ignore[import-not-found]

        from nki_kernels.validation import prepare_kernel_call

        # host side of the call, as simulate() does it: validation and NKIObject arguments
        args, kwargs = prepare_kernel_call(args, kwargs)
        outputs = nki.jit(kernel)[lnc](*args, **kwargs)
    wall_s = time.perf_counter() - start

    grads = _grads_from_outputs(problem, outputs)
    acc = None if accumulation_dtype is None else dtype_name(accumulation_dtype)
    grads.info.update(
        backend=backend,
        block_size=block_size,
        num_blocks=layout.num_blocks,
        padding=padding,
        run_with_lnc2=run_with_lnc2,
        accumulation_dtype=acc,
        wall_s=wall_s,
    )
    if profile is not None:
        grads.info["nki_phases"] = _profile_rows(profile)
        grads.info["nki_modeled_total_us"] = float(profile.modeled_time_us(None))
        grads.info["nki_profile"] = profile
    return grads


TWIN_OPTIONS = ("block_size", "padding", "accumulation_dtype", "phase_configs",
                "use_tuned_configs", "run_with_lnc2")


def run_twin(
    problem: MoEBackwardProblem,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    padding: str = "skip",
    accumulation_dtype: Any = None,
    phase_configs: tuple | None = None,
    use_tuned_configs: bool = True,
    run_with_lnc2: bool = True,
) -> MoEGrads:
    """The kernel's MX-faithful torch twin (:mod:`nki_kernels.blockwise_mm_bwd_mxfp8_torch`) on
    ``problem``, on the problem's device (CPU or CUDA): what ``nki-sim`` (and Trainium) compute,
    in seconds. Same layout, inputs and phase configs as :func:`run_blockwise` with the same
    options, so its gradients equal ``nki-sim``'s bit for bit (tests/test_nki_twin.py).
    ``run_with_lnc2`` only picks the tuned configs (LNC2 and LNC1 give the same bits).

    Raises:
        ValueError: a bad option or problem, including a non-SwiGLU activation.
    """
    from nki_kernels.blockwise_mm_bwd_mxfp8_torch import blockwise_mm_bwd_mxfp8_torch

    problem.validate()
    _check_activation(problem, "backend 'nki-twin'")
    if problem.hidden_states_TH.shape[0] == 0:
        return _zero_grads(problem, "nki-twin")
    args, kwargs, layout = prepare_blockwise_args(problem, block_size=block_size, padding=padding)
    H = problem.hidden_states_TH.shape[1]
    I = problem.w_down_EIH.shape[1]
    why = check_shape({"H": H, "I": I})
    if why is not None:
        raise ValueError(f"backend 'nki-twin': {why}")
    phase_configs = _phase_configs(
        phase_configs, use_tuned_configs, H, I, block_size, run_with_lnc2
    )
    kwargs.pop("skip_dma")  # the twin treats ids outside [0, T) as padding either way
    start = time.perf_counter()
    outputs = blockwise_mm_bwd_mxfp8_torch(
        *args, **kwargs, accumulation_dtype=accumulation_dtype, phase_configs=tuple(phase_configs)
    )
    wall_s = time.perf_counter() - start
    grads = _grads_from_outputs(problem, outputs)
    grads.info.update(
        backend="nki-twin",
        block_size=block_size,
        num_blocks=layout.num_blocks,
        padding=padding,
        accumulation_dtype=None if accumulation_dtype is None else dtype_name(accumulation_dtype),
        wall_s=wall_s,
    )
    return grads


def _run_twin_checked(problem: MoEBackwardProblem, **options: Any) -> MoEGrads:
    unknown = set(options) - set(TWIN_OPTIONS)
    if unknown:
        raise ValueError(
            f"backend 'nki-twin': unknown options {sorted(unknown)}; accepted: {TWIN_OPTIONS}"
        )
    return run_twin(problem, **options)


def _make_run(backend: str):
    def run(problem: MoEBackwardProblem, **options: Any) -> MoEGrads:
        unknown = set(options) - set(RUN_OPTIONS)
        if unknown:
            raise ValueError(
                f"backend {backend!r}: unknown options {sorted(unknown)}; accepted: {RUN_OPTIONS}"
            )
        return run_blockwise(problem, backend=backend, **options)

    return run


register_backend(
    Backend(
        name="nki",
        summary="AWS NKI blockwise MXFP8 backward on Trainium (needs the Neuron 'nki' package)",
        check=check_nki,
        run=_make_run("nki"),
        check_shape=check_shape,
    )
)
register_backend(
    Backend(
        name="nki-sim",
        summary="the NKI blockwise MXFP8 backward on our CPU NKI interpreter, with modeled "
        "Trainium3 time per phase",
        check=check_nki_sim,
        run=_make_run("nki-sim"),
        check_shape=check_shape,
    )
)

register_backend(
    Backend(
        name="nki-twin",
        summary="the NKI MXFP8 kernel's MX-faithful torch twin, on any device (CPU or CUDA): "
        "Trainium's numbers in seconds",
        check=lambda: None,
        run=_run_twin_checked,
        check_shape=check_shape,
    )
)


# --------------------------------------------------------------------------------------------
# Tuning per-phase configs against the interpreter's modeled Trainium3 time


def candidate_phase_overrides(M: int, K: int, N: int) -> list[dict[str, Any]]:
    """A small family of per-phase config overrides to try for one phase shape (M, K, N).

    AWS's defaults (one tile per block), the whole N extent of a block kept resident, the
    whole K extent folded in SBUF instead of PSUM copy-in (``enable_psum_copy_in=False``: the
    only case where the kernel reads ``TILES_IN_BLOCK_K``), then smaller ``tile_k`` / ``tile_n``
    (256, 128) covering the whole extent. Only exact tile counts are used (tiles dividing the
    extent). Fields the kernel ignores (``TILES_IN_BLOCK_M``/``TILES_IN_LOAD_M``,
    ``spill_reload``, loop orders) are not varied: they would only repeat the default's time.
    """
    tiles = {
        "tile_m": min(128, M),
        "tile_k": min(512, K),
        "tile_n": min(512, N),
    }
    nk = max(1, K // tiles["tile_k"]) if K % tiles["tile_k"] == 0 else 1
    nn = max(1, N // tiles["tile_n"]) if N % tiles["tile_n"] == 0 else 1
    whole_k_sbuf = {"TILES_IN_BLOCK_K": nk, "enable_psum_copy_in": False}
    whole_n = {"TILES_IN_BLOCK_N": nn, "TILES_IN_LOAD_N": nn}
    family = [{}, whole_n, whole_k_sbuf]
    # Smaller matmul tiles (more instructions, less padding inside a tile).
    for tk in (256, 128):
        if tk < tiles["tile_k"] and K % tk == 0:
            family.append({"tile_k": tk, "TILES_IN_BLOCK_K": K // tk})
    for tn in (256, 128):
        if tn < tiles["tile_n"] and N % tn == 0:
            family.append({"tile_n": tn, "TILES_IN_BLOCK_N": N // tn, "TILES_IN_LOAD_N": N // tn})
    out: list[dict[str, Any]] = []
    for cand in family:
        if cand not in out:
            out.append(cand)
    return out


def tune_phase_configs(
    H: int, I: int, B: int, lnc2: bool, *, seed: int = 0, use_scale_packing: bool = True
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Pick each phase's override with the lowest modeled Trainium3 time under ``nki-sim``.

    Runs the kernel on one full block (T = B tokens, one expert, top_k 1; the phase costs are
    per block, so one block ranks configs as a full run does) once per candidate index, every
    phase taking its own i-th candidate (:func:`candidate_phase_overrides`), and keeps per phase
    the fastest. Modeled time is the interpreter's model (REFERENCE §5 numbers, our per-
    instruction cost assumptions), not a hardware measurement.

    Every candidate runs with ``enable_scale_packing = use_scale_packing`` (default True, the
    seed's ``use_scale_packing`` default; ``MatmulMxfp8KernelConfig``'s own field default is
    AWS's False), and a phase's best overrides other than AWS's defaults carry it, so a tuned
    config loaded from ``configs/nki/`` runs packed as it was tuned.

    Returns:
        ``(best, rows)``: best = {"phase1": overrides, ...} (the YAML entry for
        :func:`~nki_kernels.config.tuned_config_key`; ``{}`` = AWS's defaults, the phase then
        takes the wrapper's ``use_scale_packing``); rows = one dict per (run, phase) with the
        overrides tried and ``modeled_us``.

    Raises:
        RuntimeError: nki-sim cannot run here; ValueError: a shape the kernel rejects.
    """
    from common.routing import plan_routing
    from nki_kernels.config import MatmulMxfp8KernelConfig, phase_shapes

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, generator=g).bfloat16()
    dy = torch.randn(B, H, generator=g).bfloat16()
    wgu = (torch.randn(1, H, 2, I, generator=g) * H**-0.5).bfloat16()
    wd = (torch.randn(1, I, H, generator=g) * I**-0.5).bfloat16()
    plan = plan_routing(torch.zeros(B, 1, dtype=torch.long), torch.rand(B, 1, generator=g), 1)
    act = torch.randn(B, 2, I, generator=g).bfloat16()
    problem = MoEBackwardProblem(x, dy, wgu, wd, plan, act)
    cands = [candidate_phase_overrides(*shape) for shape in phase_shapes(H, I, B, lnc2)]
    rows: list[dict[str, Any]] = []
    best: dict[str, tuple[float, dict[str, Any]]] = {}
    for i in range(max(len(c) for c in cands)):
        picked = [c[min(i, len(c) - 1)] for c in cands]
        configs = tuple(
            MatmulMxfp8KernelConfig(M=0, K=0, N=0, enable_scale_packing=use_scale_packing, **o)
            for o in picked
        )
        grads = run_blockwise(problem, block_size=B, run_with_lnc2=lnc2, phase_configs=configs,
                              use_scale_packing=use_scale_packing)
        for row in grads.info["nki_phases"]:
            p = PHASE_NAMES.index(row["phase"])
            rows.append({"run": i, "phase": row["phase"], "overrides": picked[p], **row})
            if row["phase"] not in best or row["modeled_us"] < best[row["phase"]][0]:
                best[row["phase"]] = (row["modeled_us"], picked[p])
    out: dict[str, dict[str, Any]] = {}
    for name in PHASE_NAMES:
        if name in best:
            o = dict(best[name][1])
            if o and use_scale_packing:
                o["enable_scale_packing"] = True  # the config field's own default is False
            out[name] = o
    return out, rows
