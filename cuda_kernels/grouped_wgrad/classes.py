"""The cuDNN-style classes ``GroupedGemmWgradSm100`` / ``GroupedGemmWgradSm90``: samples fix the
static contract; ``check_support()`` -> ``compile()`` -> ``execute(...)`` any number of times.

The format (BF16 or block-scaled) is picked by the samples' operand dtypes in
``check_support()`` (``pipeline.select_format``); every rule of the samples and of each
``execute`` call is ``pipeline.validate_call``'s, and the compiled operator is a
``pipeline.CompiledWgrad``. The device rule (:func:`require_device`) comes first.
"""

from __future__ import annotations

import textwrap
from typing import Any

import torch

from ..gemm import env
from ..gemm.tiles import SM90_TILES, SM100_TILES
from . import bf16
from ._types import CALL_NAMES, SAMPLE_NAMES, WgradCall, WgradContract
from .pipeline import CompiledWgrad, compile_contract, validate_call

__all__ = ["ARCH_CLASSES", "GroupedGemmWgradSm90", "GroupedGemmWgradSm100", "require_device"]


def require_device(cls: type, device: torch.device, arg: str = "sample_a") -> None:
    """The device rule of ``cls`` (``GroupedGemmWgradSm100`` / ``Sm90``, or a wrapper's class):
    CUDA available, a CUDA device, a compute capability the arch's kernel runs on. Checked FIRST
    by ``check_support()`` and the wrappers, so a call that cannot run here says so before any
    rule on its data.

    Raises:
        RuntimeError: no CUDA, or the wrong compute capability (naming the class to use).
        ValueError: ``device`` is not a CUDA device (argument ``arg``).
    """
    cc = env.query_arch(device, arg)
    if cls._ARCH == "sm100" and cc < 100:
        raise RuntimeError(
            f"{cls._NAME} requires SM100 or newer, found SM{cc} on {device}; use "
            "GroupedGemmWgradSm90 on Hopper or grouped_gemm_wgrad() for any device"
        )
    if cls._ARCH == "sm90" and cc < 90:
        raise RuntimeError(
            f"{cls._NAME} requires SM90 (Hopper), found SM{cc} on {device} (below SM90)"
        )
    if cls._ARCH == "sm90" and cc >= 100:
        raise RuntimeError(
            f"{cls._NAME} runs sm_90a code (wgmma) only on SM 9.x, found SM{cc} on "
            f"{device}; use GroupedGemmWgradSm100 or grouped_gemm_wgrad()"
        )


class _GroupedGemmWgradBase:
    """Shared lifecycle of the SM100 and SM90 classes (see their docstrings)."""

    _ARCH = ""
    _NAME = ""

    def __init__(
        self,
        sample_a: torch.Tensor,
        sample_b: torch.Tensor,
        sample_sfa: torch.Tensor | None,
        sample_sfb: torch.Tensor | None,
        sample_offsets: torch.Tensor,
        sample_wgrad: torch.Tensor | None = None,
        sample_wgrad_expert: torch.Tensor | None = None,
        num_experts: int | None = None,
        wgrad_shape: tuple[int, int] | None = None,
        wgrad_dtype: torch.dtype | None = None,
        sample_global_scale_a: torch.Tensor | None = None,
        sample_global_scale_b: torch.Tensor | None = None,
        acc_dtype: torch.dtype = torch.float32,
        mma_tiler_mn: tuple[int, int] | None = None,
        cluster_shape_mn: tuple[int, int] | None = None,
        sf_vec_size: int = 16,
        sf_fp8_dtype_override: str | None = None,
        accumulate_on_output: bool = False,
        input_order: str = "tensor2d",
        *,
        validate_offsets: bool = True,
    ) -> None:
        if sample_wgrad is not None and num_experts is None:
            self.output_mode = "dense"
        elif sample_wgrad is None and num_experts is not None:
            self.output_mode = "discrete"
            if wgrad_shape is None or wgrad_dtype is None:
                raise ValueError(
                    f"{self._NAME}: discrete output needs num_experts, wgrad_shape and wgrad_dtype"
                )
        elif sample_wgrad is None:
            raise ValueError(
                f"{self._NAME}: no output sample: give sample_wgrad (the dense [E, H, I] output) "
                "or num_experts + wgrad_shape + wgrad_dtype (+ optional sample_wgrad_expert) for "
                "discrete output"
            )
        else:
            raise ValueError(
                f"{self._NAME}: give sample_wgrad (dense output) or num_experts + wgrad_shape + "
                "wgrad_dtype (+ optional sample_wgrad_expert) for discrete output, not both"
            )
        #: The samples as the pipeline's call (dropped after ``check_support()``).
        self._samples: WgradCall | None = WgradCall(
            a=sample_a, b=sample_b, offsets=sample_offsets, sfa=sample_sfa, sfb=sample_sfb,
            global_scale_a=sample_global_scale_a, global_scale_b=sample_global_scale_b,
            output_mode=self.output_mode, wgrad_tensor=sample_wgrad, wgrad_dtype=wgrad_dtype,
            acc_dtype=acc_dtype, mma_tiler_mn=mma_tiler_mn, cluster_shape_mn=cluster_shape_mn,
            sf_vec_size=sf_vec_size, sf_fp8_dtype_override=sf_fp8_dtype_override,
            accumulate_on_output=bool(accumulate_on_output), input_order=input_order,
            validate_offsets=bool(validate_offsets), names=SAMPLE_NAMES,
            num_experts=num_experts, wgrad_shape=wgrad_shape, wgrad_expert=sample_wgrad_expert,
        )
        self.acc_dtype = acc_dtype
        self.mma_tiler_mn = mma_tiler_mn
        self.cluster_shape_mn = cluster_shape_mn
        self.sf_vec_size = sf_vec_size
        self.accumulate_on_output = bool(accumulate_on_output)
        self.input_order = input_order
        self.validate_offsets = bool(validate_offsets)
        self.contract: WgradContract | None = None
        self.device: torch.device | None = None
        self._is_supported = False
        self._compiled: CompiledWgrad | None = None
        #: After ``compile()``: the implementation that runs ("sm100" / "sm90": a native kernel;
        #: "torch": the block-scaled twin while no native block-scaled kernel serves it) and why.
        self.backend: str | None = None
        self.backend_reason = ""

    def check_support(self) -> bool:
        """Validate the samples against the device, then the contract; True or raises.

        The device rule (CUDA, compute capability) comes first, then the static rules, then the
        offsets values.

        Raises:
            ValueError: a sample, dtype, layout, tiling, scale control or offsets rule is broken
                (offsets values only with ``validate_offsets=True``, not while capturing).
            RuntimeError: no CUDA, or the device's compute capability is not supported.
        """
        if self._is_supported:
            return True
        samples = self._samples
        if isinstance(samples.a, torch.Tensor):  # the device rule first (else: the type rule)
            require_device(type(self), samples.a.device)
        validated = validate_call(samples, self._ARCH, mode="samples")
        validated.check_fits()
        self.contract = validated.contract
        self.device = samples.a.device
        self._is_supported = True
        self._samples = None  # do not keep the samples alive
        return True

    def compile(self) -> None:
        """Compile the kernel for the static contract (cached per process; new token splits reuse
        it). Runs ``check_support()`` first when it has not run.

        Raises:
            RuntimeError: the kernel or the CuTe DSL is not available; see ``check_support``.
        """
        if not self._is_supported:
            self.check_support()
        if self._compiled is None:
            self._compiled = compile_contract(self.contract, self._NAME)
            self.backend, self.backend_reason = self._compiled.backend, self._compiled.reason

    def execute(
        self,
        a_tensor: torch.Tensor,
        b_tensor: torch.Tensor,
        sfa_tensor: torch.Tensor | None,
        sfb_tensor: torch.Tensor | None,
        offsets_tensor: torch.Tensor,
        wgrad_tensor: torch.Tensor | None = None,
        wgrad_ptrs: torch.Tensor | None = None,
        global_scale_a: torch.Tensor | None = None,
        global_scale_b: torch.Tensor | None = None,
        current_stream: Any = None,
        *,
        descriptor_workspace: torch.Tensor | None = None,
        workspace: torch.Tensor | None = None,
        validate_offsets: bool | None = None,
    ) -> None:
        """Run the compiled kernel: ``wgrad[e] (+)= A[:, begin:end] @ B[begin:end, :]``.

        Args: as the seed (shapes in the module docstring), positional prefix as cuDNN's
        ``execute``. ``current_stream``: a ``torch.cuda.Stream``, a raw ``CUstream``/int handle,
        or None (torch's current stream).
        Discrete operators take ``wgrad_ptrs``, ``wgrad_tensor`` (the stacked [E, H, I] output:
        its expert slabs are written) or both, as cuDNN passes them: then the kernel writes
        through ``wgrad_ptrs``, and with validation on the pointers must be
        ``wgrad_tensor``'s expert slabs.
        ``descriptor_workspace`` / ``workspace`` (keywords, cuDNN's): caller-owned uint8
        buffers of at least ``get_grouped_gemm_wgrad_workspace_size_sm100(E, output_mode,
        input_order)`` bytes on the inputs' device; both given must be the same buffer. The SM100
        BF16 kernel writes its per-expert TMA descriptors there (discrete outputs, tensor_ragged
        K-major operands: at most 3 x 128 bytes per expert, within that size; the buffer must
        then be 64-byte aligned) and allocates its own when none is given; the SM90 BF16 kernel
        builds no runtime descriptors and leaves it untouched.
        ``validate_offsets``: host-read offsets (and pointer) values, once per tensor version;
        default: the value given at construction. Skipped while the stream is capturing a CUDA
        graph.

        Raises:
            RuntimeError: ``compile()`` has not run.
            ValueError: a call argument breaks the contract or differs from the compiled one.
        """
        if self._compiled is None:
            raise RuntimeError(
                f"{self._NAME}.execute() before compile(): call check_support() and compile() first"
            )
        call = WgradCall(
            a=a_tensor, b=b_tensor, offsets=offsets_tensor, sfa=sfa_tensor, sfb=sfb_tensor,
            global_scale_a=global_scale_a, global_scale_b=global_scale_b,
            wgrad_tensor=wgrad_tensor, wgrad_ptrs=wgrad_ptrs, current_stream=current_stream,
            descriptor_workspace=descriptor_workspace, workspace=workspace,
            validate_offsets=self.validate_offsets if validate_offsets is None
            else bool(validate_offsets),
            names=CALL_NAMES,
        )
        if self.contract.block_scaled is not None:  # the compiled format's own scale rules
            spec = self.contract.block_scaled
            call.sf_vec_size = spec.sf_vec_size
            call.sf_fp8_dtype_override = spec.sf_fp8_dtype_override
        v = validate_call(
            call, self.contract.arch, mode="execute", compiled=self.contract, device=self.device
        )
        self._compiled.launch(
            v.a, v.b, offsets_tensor, v.out, stream=current_stream, scales=v.scales,
            workspace=v.workspace,
        )


def _indented(text: str) -> str:
    """``text`` as docstring lines under an argument (12 spaces, 100 columns)."""
    return textwrap.fill(text, width=100, initial_indent=" " * 12, subsequent_indent=" " * 12)


_CLASS_DOC = """{summary}

    Dimensions: H hidden, S tokens_sum (dynamic), I intermediate, E num_experts.

    Constructor (samples fix the static contract; ``sample_sfa``/``sample_sfb``/global scales must
    be None for BF16):
        sample_a: [H, S] torch.bfloat16, K-major strides (S, 1) or M-major strides (1, H).
        sample_b: [S, I] torch.bfloat16, K-major strides (1, S) or N-major strides (I, 1).
        sample_offsets: [E] torch.int32 contiguous, cumulative END of each expert's tokens.
        sample_wgrad: dense output [E, H, I] contiguous, BF16/FP16/FP32 (dense mode), or
        num_experts, wgrad_shape=(H, I), wgrad_dtype (+ optional sample_wgrad_expert [H, I]
        contiguous) for discrete mode (one int64 address per expert at execute).
        acc_dtype: torch.float32 only. sf_vec_size: 16 only (BF16).
        mma_tiler_mn, cluster_shape_mn: tiling, from ``tiles.py``:
{tiling}.
        accumulate_on_output: add to the output instead of overwriting (empty experts then leave
            it untouched; overwrite writes zeros for them).
        input_order: "tensor2d" or "tensor_ragged" (per-expert K-contiguous blocks).
        validate_offsets (keyword): host-read offsets/pointer values in check_support and execute
            (one device sync each); never while a CUDA graph is being captured.

    Offsets rule: non-decreasing, {groups}, last == tokens_sum.
    Alignment: data pointers of A, B and outputs 16-byte aligned (offsets 4, pointer array 8);
    K-major operands need tokens_sum % 8 == 0, M-/N-major ones hidden/intermediate % 8 == 0,
    outputs intermediate * element size % 16 == 0 (16-byte TMA strides).

    Lifecycle: ``check_support()`` -> ``compile()`` -> ``execute(...)`` any number of times with new
    tokens_sum and splits (the token dimension is dynamic: no recompile).
"""


class GroupedGemmWgradSm100(_GroupedGemmWgradBase):
    _ARCH = "sm100"
    _NAME = "GroupedGemmWgradSm100"

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on SM100+ (the seed's class); refuses devices below SM100.\n\n"
        "    The SM100 BF16 kernel (sm100_bf16.py) is compiled offline for sm_100a but has never\n"
        "    run on hardware: ``execute()`` raises RuntimeError unless the environment sets\n"
        "    MOE_BWD_ENABLE_UNVERIFIED_SM100=1 (validation and support checks are complete).",
        tiling=_indented(SM100_TILES.describe("None: per shape from configs/cuda")),
        groups=f"every expert token count a multiple of {bf16.TOKEN_ALIGN['sm100']}",
    )


class GroupedGemmWgradSm90(_GroupedGemmWgradBase):
    _ARCH = "sm90"
    _NAME = "GroupedGemmWgradSm90"

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on Hopper (SM 9.x) with the CuTe DSL kernel of sm90_bf16.py.\n\n"
        "    Same surface and contract as GroupedGemmWgradSm100 except that expert token counts\n"
        "    may be any value >= 0. sm_90a code (wgmma) runs only on SM 9.x devices.",
        tiling=_indented(SM90_TILES.describe("None: per shape from configs/cuda")),
        groups="any expert token count >= 0 (0 included)",
    )


#: The class of each kernel arch (``grouped_wgrad_into`` and the wrappers route by arch).
ARCH_CLASSES = {cls._ARCH: cls for cls in (GroupedGemmWgradSm100, GroupedGemmWgradSm90)}
