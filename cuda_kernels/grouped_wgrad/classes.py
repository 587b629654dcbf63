"""The cuDNN-style classes ``GroupedGemmWgradSm100`` / ``GroupedGemmWgradSm90``: samples fix the
static contract; ``check_support()`` -> ``compile()`` -> ``execute(...)`` any number of times.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import torch

from . import env, launch
from ._types import (
    NAME_TO_DTYPE,
    SM100_GROUP_ALIGN,
    TMA_ALIGN_BYTES,
    WgradContract,
    elem_bytes,
)
from .tiles import SM90_TILES, SM100_TILES
from .validate import (
    _Call,
    _check_blockscaled_values,
    _check_dense_out,
    _check_expert_out,
    _check_input_order,
    _check_offsets_values,
    _check_pointer_values,
    _check_ptrs_tensor,
    _check_same_device,
    _check_scale_controls,
    _check_tiling,
    _check_wgrad_dtype,
    _check_workspace,
    _is_blockscaled_pair,
    _ragged_compact,
    _validate_blockscaled,
    _validate_operands,
)


class _GroupedGemmWgradBase:
    """Shared lifecycle of the SM100 and SM90 classes (see their docstrings)."""

    _ARCH = ""
    _NAME = ""
    _GROUP_ALIGN = 1
    _DEFAULT_TILER: tuple[int, int] | None = None

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
        if mma_tiler_mn is None:
            mma_tiler_mn = self._DEFAULT_TILER
        self._samples = {
            "a": sample_a,
            "b": sample_b,
            "offsets": sample_offsets,
            "wgrad": sample_wgrad,
            "wgrad_expert": sample_wgrad_expert,
        }
        self._scale_controls = {
            "sample_sfa": sample_sfa,
            "sample_sfb": sample_sfb,
            "sample_global_scale_a": sample_global_scale_a,
            "sample_global_scale_b": sample_global_scale_b,
            "sf_fp8_dtype_override": sf_fp8_dtype_override,
        }
        self._num_experts_arg = num_experts
        self._wgrad_shape_arg = wgrad_shape
        self._wgrad_dtype_arg = wgrad_dtype
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
        self._launcher: Callable | None = None
        #: After ``compile()``: the implementation that runs ("sm100" / "sm90": a native kernel;
        #: "torch": the block-scaled twin while no native block-scaled kernel is built) and why.
        self.backend: str | None = None
        self.backend_reason = ""

    # -- check_support --------------------------------------------------------------------------

    def _static_contract(self) -> WgradContract:
        s = self._samples
        sc = self._scale_controls
        block_scaled = _is_blockscaled_pair(s["a"], s["b"], "sample_a", "sample_b")
        if not block_scaled:
            _check_scale_controls(sc, self.sf_vec_size, self.acc_dtype)
        input_order = _check_input_order(self.input_order)
        tiler, cluster = _check_tiling(self._ARCH, self.mma_tiler_mn, self.cluster_shape_mn)
        sample_a, sample_b = s["a"], s["b"]
        if input_order == "tensor_ragged":
            sample_a, sample_b = _ragged_compact(sample_a, sample_b, ("sample_a", "sample_b"))
        spec = None
        if block_scaled:
            ops = _validate_blockscaled(
                self._ARCH, sample_a, sample_b, sc["sample_sfa"], sc["sample_sfb"],
                s["offsets"], sc["sample_global_scale_a"], sc["sample_global_scale_b"],
                sf_vec_size=self.sf_vec_size,
                sf_fp8_dtype_override=sc["sf_fp8_dtype_override"], acc_dtype=self.acc_dtype,
                names=("sample_a", "sample_b", "sample_sfa", "sample_sfb", "sample_offsets",
                       "sample_global_scale_a", "sample_global_scale_b"),
            )
            hidden, tokens_sum, inter = ops.hidden, ops.tokens_sum, ops.intermediate
            num_experts, a_majors, b_majors, spec = (
                ops.num_experts, ops.a_majors, ops.b_majors, ops.spec
            )
        else:
            hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
                self._ARCH, sample_a, sample_b, s["offsets"],
                ("sample_a", "sample_b", "sample_offsets"),
            )
        if self.output_mode == "dense":
            out_dtype = _check_dense_out(
                self._ARCH, s["wgrad"], (num_experts, hidden, inter), "sample_wgrad"
            )
        else:
            if self._num_experts_arg != num_experts:
                raise ValueError(
                    f"num_experts={self._num_experts_arg} must equal sample_offsets.numel() = "
                    f"{num_experts}"
                )
            if tuple(self._wgrad_shape_arg) != (hidden, inter):
                raise ValueError(
                    f"wgrad_shape must be (hidden, intermediate) = {(hidden, inter)}, got "
                    f"{tuple(self._wgrad_shape_arg)}"
                )
            out_dtype = _check_wgrad_dtype(self._wgrad_dtype_arg)
            if self._ARCH != "torch" and inter % (TMA_ALIGN_BYTES // elem_bytes(out_dtype)):
                raise ValueError(
                    f"wgrad_shape: intermediate % {TMA_ALIGN_BYTES // elem_bytes(out_dtype)} == 0 "
                    f"needed for 16-byte TMA stores of {out_dtype}, got {inter}"
                )
            if s["wgrad_expert"] is not None:
                _check_expert_out(
                    self._ARCH,
                    s["wgrad_expert"],
                    (hidden, inter),
                    self._wgrad_dtype_arg,
                    "sample_wgrad_expert",
                )
        _check_same_device(
            {
                "sample_a": s["a"],
                "sample_b": s["b"],
                "sample_offsets": s["offsets"],
                "sample_wgrad": s["wgrad"],
                "sample_wgrad_expert": s["wgrad_expert"],
                **({k: v for k, v in sc.items() if isinstance(v, torch.Tensor)}
                   if block_scaled else {}),
            }
        )
        if self.validate_offsets and not env.capturing(s["offsets"].device):
            if spec is not None:
                _check_blockscaled_values(
                    self._ARCH, spec, s["offsets"], tokens_sum, sc["sample_sfa"],
                    sc["sample_sfb"], "sample_offsets", ("sample_sfa", "sample_sfb"),
                )
            else:
                _check_offsets_values(
                    s["offsets"], tokens_sum, self._GROUP_ALIGN, "sample_offsets"
                )
        contract = WgradContract(
            arch=self._ARCH,
            hidden=hidden,
            intermediate=inter,
            num_experts=num_experts,
            a_major=a_majors[0],
            b_major=b_majors[0],
            out_dtype=out_dtype,
            output_mode=self.output_mode,
            accumulate=self.accumulate_on_output,
            input_order=input_order,
            mma_tiler_mn=tiler,
            cluster_shape_mn=cluster,
            block_scaled=spec,
        )
        if spec is None:  # the BF16 families' tile fit; block-scaled: the hook's concern
            launch._check_contract_fits(contract)
        return contract

    @classmethod
    def _check_arch(cls, device: torch.device, arg: str = "sample_a") -> None:
        """The device rule (CUDA available, a CUDA device, the compute capability): RuntimeError
        / ValueError. Checked FIRST by ``check_support()`` and the wrappers, before any rule on
        the tensors, so a call that cannot run here says so before a data rule."""
        raise NotImplementedError

    @classmethod
    def _from_contract(cls, contract: WgradContract, device: torch.device):
        """A supported operator for an already validated ``contract`` (used by the wrappers)."""
        op = cls.__new__(cls)
        op.output_mode = contract.output_mode
        op._samples = None
        op._scale_controls = {}
        op.acc_dtype = torch.float32
        op.mma_tiler_mn = contract.mma_tiler_mn
        op.cluster_shape_mn = contract.cluster_shape_mn
        op.sf_vec_size = contract.block_scaled.sf_vec_size if contract.block_scaled else 16
        op.backend, op.backend_reason = None, ""
        op.accumulate_on_output = contract.accumulate
        op.input_order = contract.input_order
        op.validate_offsets = False
        op._launcher = None
        op._check_arch(device)
        op.contract = contract
        op.device = device
        op._is_supported = True
        return op

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
        sample_a = self._samples["a"]
        if isinstance(sample_a, torch.Tensor):  # the device rule first (else: the type rule)
            self._check_arch(sample_a.device)
        contract = self._static_contract()
        device = sample_a.device
        self.contract = contract
        self.device = device
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
        if self._launcher is None:
            if self.contract.block_scaled is not None:
                from . import dispatch  # the hook of the native block-scaled kernels

                self._launcher, self.backend, self.backend_reason = (
                    dispatch._blockscaled_launcher(self.contract)
                )
            else:
                self._launcher = launch._compile_kernel(self.contract, self._NAME)
                self.backend = self.contract.arch

    # -- execute --------------------------------------------------------------------------------

    def _validate_call(
        self,
        a_tensor,
        b_tensor,
        sfa_tensor,
        sfb_tensor,
        offsets_tensor,
        wgrad_tensor,
        wgrad_ptrs,
        global_scale_a,
        global_scale_b,
        validate_offsets: bool,
        workspaces=(),
    ) -> _Call:
        c = self.contract
        spec = c.block_scaled
        if spec is None:
            _check_scale_controls(
                {
                    "sfa_tensor": sfa_tensor,
                    "sfb_tensor": sfb_tensor,
                    "global_scale_a": global_scale_a,
                    "global_scale_b": global_scale_b,
                },
                16,
                torch.float32,
            )
        elif not _is_blockscaled_pair(a_tensor, b_tensor):
            raise ValueError(
                f"a_tensor/b_tensor: this operator was compiled for block-scaled {spec.fmt} "
                f"operands ({spec.ab_dtype}); got {getattr(a_tensor, 'dtype', a_tensor)} and "
                f"{getattr(b_tensor, 'dtype', b_tensor)}; build another operator"
            )
        if c.input_order == "tensor_ragged":
            a_tensor, b_tensor = _ragged_compact(a_tensor, b_tensor)
        if spec is not None:
            ops = _validate_blockscaled(
                c.arch, a_tensor, b_tensor, sfa_tensor, sfb_tensor, offsets_tensor,
                global_scale_a, global_scale_b, sf_vec_size=spec.sf_vec_size,
                sf_fp8_dtype_override=spec.sf_fp8_dtype_override, acc_dtype=torch.float32,
            )
            if ops.spec != spec:
                raise ValueError(
                    f"a_tensor/sfa_tensor: the block-scaled format of this call ({ops.spec.fmt}, "
                    f"{ops.spec.ab_dtype}, scales {ops.spec.sf_dtype}) differs from the compiled "
                    f"contract ({spec.fmt}, {spec.ab_dtype}, scales {spec.sf_dtype}); build "
                    "another operator for a new static contract"
                )
            hidden, tokens_sum, inter = ops.hidden, ops.tokens_sum, ops.intermediate
            num_experts, a_majors, b_majors = ops.num_experts, ops.a_majors, ops.b_majors
        else:
            hidden, tokens_sum, inter, num_experts, a_majors, b_majors = _validate_operands(
                c.arch, a_tensor, b_tensor, offsets_tensor,
                ("a_tensor", "b_tensor", "offsets_tensor"),
            )
        scales = (sfa_tensor, sfb_tensor, global_scale_a, global_scale_b) if spec else None
        static = {
            "hidden": (hidden,),
            "intermediate": (inter,),
            "num_experts": (num_experts,),
            "a_major": a_majors,
            "b_major": b_majors,
        }
        for name, allowed in static.items():
            if getattr(c, name) not in allowed:
                raise ValueError(
                    f"{name} of this call ({allowed[0]}) differs from the compiled contract "
                    f"({getattr(c, name)}); build another operator for a new static contract"
                )
        out_dtype = NAME_TO_DTYPE[c.out_dtype]
        if c.output_mode == "dense":
            if wgrad_ptrs is not None:
                raise ValueError("wgrad_ptrs must be None in dense output mode")
            if wgrad_tensor is None:
                raise ValueError("wgrad_tensor is required in dense output mode")
            _check_dense_out(
                c.arch, wgrad_tensor, (num_experts, hidden, inter), "wgrad_tensor", out_dtype
            )
            out = wgrad_tensor
        else:
            if wgrad_tensor is None and wgrad_ptrs is None:
                raise ValueError(
                    "wgrad_ptrs is required in discrete output mode (or wgrad_tensor, the "
                    "stacked [E, H, I] output whose expert slabs the kernel then writes)"
                )
            if wgrad_tensor is not None:
                _check_dense_out(
                    c.arch, wgrad_tensor, (num_experts, hidden, inter), "wgrad_tensor", out_dtype
                )
            if wgrad_ptrs is not None:
                _check_ptrs_tensor(wgrad_ptrs, num_experts)
                out = wgrad_ptrs
            else:
                out = _stacked_pointers(wgrad_tensor)
        device = _check_same_device(
            {
                "a_tensor": a_tensor,
                "b_tensor": b_tensor,
                "offsets_tensor": offsets_tensor,
                "wgrad_tensor": wgrad_tensor,
                "wgrad_ptrs": wgrad_ptrs,
                **{name: ws for name, ws in workspaces if ws is not None},
                **(
                    {
                        k: v
                        for k, v in zip(
                            ("sfa_tensor", "sfb_tensor", "global_scale_a", "global_scale_b"),
                            scales,
                        )
                        if v is not None
                    }
                    if scales
                    else {}
                ),
            }
        )
        if self.device is not None and device != self.device:
            raise ValueError(
                f"a_tensor is on {device} but this operator was compiled for {self.device}"
            )
        if validate_offsets and not env.capturing(device):
            if spec is not None:
                _check_blockscaled_values(
                    c.arch, spec, offsets_tensor, tokens_sum, sfa_tensor, sfb_tensor
                )
            else:
                _check_offsets_values(
                    offsets_tensor, tokens_sum, self._GROUP_ALIGN, "offsets_tensor"
                )
            if wgrad_ptrs is not None:
                _check_pointer_values(wgrad_ptrs, "wgrad_ptrs", wgrad_tensor)
        return _Call(tokens_sum=tokens_sum, out=out, a=a_tensor, b=b_tensor, scales=scales)

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
        if self._launcher is None:
            raise RuntimeError(
                f"{self._NAME}.execute() before compile(): call check_support() and compile() first"
            )
        if validate_offsets is None:
            validate_offsets = self.validate_offsets
        c = self.contract
        ws = _check_workspace(
            descriptor_workspace,
            workspace,
            offsets_tensor.shape[0]
            if isinstance(offsets_tensor, torch.Tensor) and offsets_tensor.dim() == 1
            else 1,
            c.output_mode,
            c.input_order,
        )
        call = self._validate_call(
            a_tensor,
            b_tensor,
            sfa_tensor,
            sfb_tensor,
            offsets_tensor,
            wgrad_tensor,
            wgrad_ptrs,
            global_scale_a,
            global_scale_b,
            validate_offsets,
            workspaces=(("descriptor_workspace", ws),),
        )
        self._launch(
            call.a,
            call.b,
            offsets_tensor,
            call.out,
            current_stream,
            pointers=call.out if c.output_mode == "discrete" else None,
            scales=call.scales,
            workspace=ws,
        )

    def _launch(
        self, a, b, offsets, out, current_stream, pointers=None, scales=None, workspace=None
    ) -> None:
        stream = current_stream
        if a.device.type == "cuda" and current_stream is not None:
            stream = _torch_stream(current_stream, a.device)
        if pointers is not None and pointers.device.type == "cuda":
            # The seed: the API records the pointer tensor on the launch stream.
            pointers.record_stream(_torch_stream(stream, pointers.device))
        if self.contract.block_scaled is not None:
            sfa, sfb, gsa, gsb = scales
            self._launcher(
                a, b, sfa, sfb, offsets, out, global_scale_a=gsa, global_scale_b=gsb,
                descriptor_workspace=workspace, stream=stream,
            )
            return
        # the SM100 BF16 kernel builds its per-expert TMA descriptors (discrete outputs,
        # tensor_ragged K-major operands) in this buffer, or in one of its own when None
        self._launcher(a, b, offsets, out, stream=stream, descriptor_workspace=workspace)


def _torch_stream(stream: Any, device: torch.device):
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(int(stream), device=device)


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
    _GROUP_ALIGN = SM100_GROUP_ALIGN
    _DEFAULT_TILER = None  # chosen per shape from configs/cuda/sm100_tiles.yaml

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on SM100+ (the seed's class); refuses devices below SM100.\n\n"
        "    The SM100 BF16 kernel (sm100_bf16.py) is compiled offline for sm_100a but has never\n"
        "    run on hardware: ``execute()`` raises RuntimeError unless the environment sets\n"
        "    MOE_BWD_ENABLE_UNVERIFIED_SM100=1 (validation and support checks are complete).",
        tiling=_indented(SM100_TILES.describe("None: per shape from configs/cuda")),
        groups="every expert token count a multiple of 256",
    )

    @classmethod
    def _check_arch(cls, device: torch.device, arg: str = "sample_a") -> None:
        cc = env.query_arch(device, arg)
        if cc < 100:
            raise RuntimeError(
                f"{cls._NAME} requires SM100 or newer, found SM{cc} on {device}; use "
                "GroupedGemmWgradSm90 on Hopper or grouped_gemm_wgrad() for any device"
            )


class GroupedGemmWgradSm90(_GroupedGemmWgradBase):
    _ARCH = "sm90"
    _NAME = "GroupedGemmWgradSm90"
    _GROUP_ALIGN = 1
    _DEFAULT_TILER = None

    __doc__ = _CLASS_DOC.format(
        summary="Grouped GEMM wgrad on Hopper (SM 9.x) with the CuTe DSL kernel of sm90_bf16.py.\n\n"
        "    Same surface and contract as GroupedGemmWgradSm100 except that expert token counts\n"
        "    may be any value >= 0. sm_90a code (wgmma) runs only on SM 9.x devices.",
        tiling=_indented(SM90_TILES.describe("None: per shape from configs/cuda")),
        groups="any expert token count >= 0 (0 included)",
    )

    @classmethod
    def _check_arch(cls, device: torch.device, arg: str = "sample_a") -> None:
        cc = env.query_arch(device, arg)
        if cc < 90:
            raise RuntimeError(
                f"{cls._NAME} requires SM90 (Hopper), found SM{cc} on {device} (below SM90)"
            )
        if cc >= 100:
            raise RuntimeError(
                f"{cls._NAME} runs sm_90a code (wgmma) only on SM 9.x, found SM{cc} on "
                f"{device}; use GroupedGemmWgradSm100 or grouped_gemm_wgrad()"
            )


def _stacked_pointers(stacked: torch.Tensor) -> torch.Tensor:
    """int64 address of each expert's [H, I] slab of a contiguous [E, H, I] tensor (no sync)."""
    e = stacked.shape[0]
    step = stacked[0].numel() * stacked.element_size() if e else 0
    idx = torch.arange(e, dtype=torch.int64, device=stacked.device)
    return idx * step + stacked.data_ptr()
