"""The public surface of the grouped wgrad, pinned (issue 21 item 1: the re-cut by format keeps it).

The names ``cuda_kernels`` and ``cuda_kernels.grouped_wgrad`` export (the cuDNN-facing surface:
the classes, the wrappers, the generic entry, their tables), the JAX modules' names, and the
parameters of every public callable (names, kinds, defaults: ``*name`` is keyword-only), as they
were before the re-cut (main at 869af0b). A name or a parameter that changes must change here
too, on purpose. Additions (new public helpers) are listed in ``ADDED``.
"""

import importlib
import inspect

import pytest

import cuda_kernels
import cuda_kernels.grouped_wgrad as gw

#: ``cuda_kernels.__all__`` == ``cuda_kernels.grouped_wgrad.__all__`` before the re-cut.
PUBLIC = [
    "GroupedGemmWgradSm100", "GroupedGemmWgradSm90", "OUTPUT_DTYPES", "SM100_GROUP_ALIGN",
    "TupleDict", "WgradContract", "clear_grouped_wgrad_caches",
    "get_grouped_gemm_wgrad_workspace_size_sm100", "grouped_gemm_wgrad",
    "grouped_gemm_wgrad_wrapper_sm100", "grouped_gemm_wgrad_wrapper_sm90", "grouped_wgrad_fp32",
    "grouped_wgrad_into", "grouped_wgrad_torch", "kernel_unsupported_reason",
    "select_grouped_wgrad_backend",
]
#: Public names added since (issue 23 item 7's cuDNN parity; issue 33 item 5's gather backends).
ADDED = ["wgrad_expert_ptrs", "WGRAD_GATHER_BACKENDS", "wgrad_gather_enabled"]
#: cuDNN exposes its jit entry at the top level (``cudnn.grouped_gemm_wgrad_jax_sm100``):
#: ``cuda_kernels`` too, resolved lazily from ``grouped_wgrad.jax_ffi`` (issue 23 item 7).
TOP_LEVEL_JAX = ["grouped_gemm_wgrad_jax_sm100", "grouped_gemm_wgrad_jax_sm90"]
#: ``cuda_kernels.grouped_wgrad.jax.__all__`` and ``jax_ffi.__all__`` before the re-cut.
JAX_PUBLIC = [
    "call_wrapper_on_jax_arrays", "check_jax_wgrad_call", "grouped_gemm_wgrad_dense_jax_sm100",
    "grouped_gemm_wgrad_dense_jax_sm90", "grouped_gemm_wgrad_jax", "grouped_gemm_wgrad_jax_sm100",
    "grouped_gemm_wgrad_jax_sm90", "grouped_wgrad_jax", "grouped_wgrad_jax_reference",
    "has_jax_arrays", "jax_arrays_to_torch", "pack_pointers_uint8",
]
JAX_FFI_PUBLIC = [
    "JaxWgradPlan", "check_jax_wgrad_call", "grouped_gemm_wgrad_dense_jax_sm100",
    "grouped_gemm_wgrad_dense_jax_sm90", "grouped_gemm_wgrad_jax_sm100",
    "grouped_gemm_wgrad_jax_sm90", "grouped_wgrad_jax", "grouped_wgrad_jax_reference",
    "pack_pointers_uint8",
]
#: The classes' lifecycle methods (cuDNN's).
METHODS = ("check_support", "compile", "execute")

SIGNATURES = {
    "wgrad_expert_ptrs": ("wgrad_tensor current_stream=None"),
    "grouped_gemm_wgrad": (
        "a_tensor b_tensor offsets_tensor *output_mode='dense' *wgrad_tensor=None "
        "*wgrad_ptrs=None *wgrad_dtype=torch.bfloat16 *accumulate_on_output=False "
        "*input_order='tensor2d' *backend='auto' *validate_offsets=True *current_stream=None "
        "*sfa_tensor=None *sfb_tensor=None *global_scale_a=None *global_scale_b=None "
        "*sf_vec_size=None *sf_fp8_dtype_override=None *descriptor_workspace=None *stats=None"
    ),
    "grouped_gemm_wgrad_wrapper_sm100": (
        "a_tensor b_tensor sfa_tensor sfb_tensor offsets_tensor output_mode='dense' "
        "wgrad_tensor=None wgrad_ptrs=None global_scale_a=None global_scale_b=None "
        "acc_dtype=torch.float32 wgrad_dtype=torch.bfloat16 mma_tiler_mn=(256, 256) "
        "cluster_shape_mn=None sf_vec_size=16 sf_fp8_dtype_override=None "
        "accumulate_on_output=False input_order='tensor2d' current_stream=None "
        "*descriptor_workspace=None *validate_offsets=True"
    ),
    "grouped_gemm_wgrad_wrapper_sm90": (
        "a_tensor b_tensor sfa_tensor sfb_tensor offsets_tensor output_mode='dense' "
        "wgrad_tensor=None wgrad_ptrs=None global_scale_a=None global_scale_b=None "
        "acc_dtype=torch.float32 wgrad_dtype=torch.bfloat16 mma_tiler_mn=None "
        "cluster_shape_mn=None sf_vec_size=16 sf_fp8_dtype_override=None "
        "accumulate_on_output=False input_order='tensor2d' current_stream=None "
        "*descriptor_workspace=None *validate_offsets=True"
    ),
    "grouped_wgrad_fp32": (
        "a_HS b_SI offsets_E *backend='auto' *stats=None *group_align=1"
    ),
    "grouped_wgrad_into": (
        "a_HS b_SI offsets_E out_EHI *accumulate=False *backend='sm90' *a_rows_S=None "
        "*b_rows_S=None"
    ),
    "kernel_unsupported_reason": (
        "arch a_HS b_SI offsets_E *sfa_tensor=None *sfb_tensor=None *global_scale_a=None "
        "*global_scale_b=None *sf_vec_size=None"
    ),
    "select_grouped_wgrad_backend": (
        "device"
    ),
    "get_grouped_gemm_wgrad_workspace_size_sm100": (
        "num_experts output_mode='dense' input_order='tensor2d'"
    ),
    "clear_grouped_wgrad_caches": (
    ),
    "grouped_wgrad_torch": (
        "a_HS b_SI offsets_E *out=None *accumulate=False *out_dtype=None *input_order='tensor2d' "
        "*use_grouped_mm=None *a_rows_S=None *b_rows_S=None"
    ),
    "GroupedGemmWgradSm100": (
        "sample_a sample_b sample_sfa sample_sfb sample_offsets sample_wgrad=None "
        "sample_wgrad_expert=None num_experts=None wgrad_shape=None wgrad_dtype=None "
        "sample_global_scale_a=None sample_global_scale_b=None acc_dtype=torch.float32 "
        "mma_tiler_mn=None cluster_shape_mn=None sf_vec_size=16 sf_fp8_dtype_override=None "
        "accumulate_on_output=False input_order='tensor2d' *validate_offsets=True"
    ),
    "GroupedGemmWgradSm100.execute": (
        "self a_tensor b_tensor sfa_tensor sfb_tensor offsets_tensor wgrad_tensor=None "
        "wgrad_ptrs=None global_scale_a=None global_scale_b=None current_stream=None "
        "*descriptor_workspace=None *workspace=None *validate_offsets=None"
    ),
    "GroupedGemmWgradSm90": (
        "sample_a sample_b sample_sfa sample_sfb sample_offsets sample_wgrad=None "
        "sample_wgrad_expert=None num_experts=None wgrad_shape=None wgrad_dtype=None "
        "sample_global_scale_a=None sample_global_scale_b=None acc_dtype=torch.float32 "
        "mma_tiler_mn=None cluster_shape_mn=None sf_vec_size=16 sf_fp8_dtype_override=None "
        "accumulate_on_output=False input_order='tensor2d' *validate_offsets=True"
    ),
    "GroupedGemmWgradSm90.execute": (
        "self a_tensor b_tensor sfa_tensor sfb_tensor offsets_tensor wgrad_tensor=None "
        "wgrad_ptrs=None global_scale_a=None global_scale_b=None current_stream=None "
        "*descriptor_workspace=None *workspace=None *validate_offsets=None"
    ),
    "jax.grouped_gemm_wgrad_jax": (
        "a b offsets *output_mode='dense' *wgrad=None *wgrad_ptrs=None *wgrad_dtype='bfloat16' "
        "*accumulate_on_output=False *input_order='tensor2d' *backend='auto' "
        "*validate_offsets=True"
    ),
    "jax.grouped_gemm_wgrad_jax_sm90": (
        "a b offsets wgrad_ptrs *wgrad_dtype='bfloat16' *accumulate_on_output=False "
        "*validate_offsets=False *mma_tiler_mn=None *allow_cuda_graph=True"
    ),
    "jax.grouped_gemm_wgrad_jax_sm100": (
        "a b offsets wgrad_ptrs *wgrad_dtype='bfloat16' *accumulate_on_output=False "
        "*validate_offsets=False *mma_tiler_mn=(256, 256) *cluster_shape_mn=None "
        "*allow_cuda_graph=True"
    ),
    "jax.grouped_gemm_wgrad_dense_jax_sm90": (
        "a b offsets *wgrad_dtype='float32' *wgrad_init=None *validate_offsets=False "
        "*mma_tiler_mn=None *allow_cuda_graph=True"
    ),
    "jax.grouped_gemm_wgrad_dense_jax_sm100": (
        "a b offsets *wgrad_dtype='float32' *wgrad_init=None *validate_offsets=False "
        "*mma_tiler_mn=(256, 256) *cluster_shape_mn=None *allow_cuda_graph=True"
    ),
    "jax.grouped_wgrad_jax": (
        "a b offsets *wgrad_dtype='float32' *backend='auto' *group_align=1 *validate_offsets=True"
    ),
    "jax.check_jax_wgrad_call": (
        "arch a b offsets *wgrad_ptrs=None *wgrad_init=None *output_mode='discrete' "
        "*wgrad_dtype='bfloat16' *accumulate_on_output=False *mma_tiler_mn=None "
        "*cluster_shape_mn=None"
    ),
}


def _signature(obj) -> str:
    kinds = {inspect.Parameter.KEYWORD_ONLY: "*", inspect.Parameter.VAR_POSITIONAL: "*",
             inspect.Parameter.VAR_KEYWORD: "**"}
    return " ".join(
        kinds.get(p.kind, "") + p.name
        + ("" if p.default is inspect.Parameter.empty else "=" + repr(p.default))
        for p in inspect.signature(obj).parameters.values()
    )


def test_package_exports_are_pinned():
    assert sorted(gw.__all__) == sorted(PUBLIC + ADDED)
    assert sorted(cuda_kernels.__all__) == sorted(PUBLIC + ADDED + TOP_LEVEL_JAX)
    for name in PUBLIC + ADDED:
        assert getattr(cuda_kernels, name) is getattr(gw, name), name
        assert hasattr(gw.api, name) or name == "grouped_wgrad_torch", name


def test_jit_entries_at_the_top_level_without_importing_jax():
    """``cuda_kernels.grouped_gemm_wgrad_jax_sm100`` is the jit entry itself, as cuDNN's
    ``cudnn.grouped_gemm_wgrad_jax_sm100``; neither ``import cuda_kernels`` nor the name imports
    JAX (the entry imports it when called)."""
    import subprocess
    import sys

    code = (
        "import sys, cuda_kernels\n"
        "assert 'jax' not in sys.modules and 'cuda_kernels.grouped_wgrad.jax_ffi' not in "
        "sys.modules\n"
        "from cuda_kernels import grouped_gemm_wgrad_jax_sm100 as f\n"
        "from cuda_kernels.grouped_wgrad import jax_ffi\n"
        "assert f is jax_ffi.grouped_gemm_wgrad_jax_sm100\n"
        "assert cuda_kernels.grouped_gemm_wgrad_jax_sm90 is jax_ffi.grouped_gemm_wgrad_jax_sm90\n"
        "assert 'grouped_gemm_wgrad_jax_sm100' in dir(cuda_kernels)\n"
        "print('jax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
    with pytest.raises(AttributeError, match="no attribute 'grouped_gemm_wgrad_jax_sm110'"):
        _ = cuda_kernels.grouped_gemm_wgrad_jax_sm110


def test_jax_module_names_are_pinned():
    jax_mod = importlib.import_module("cuda_kernels.grouped_wgrad.jax")
    jax_ffi = importlib.import_module("cuda_kernels.grouped_wgrad.jax_ffi")
    assert sorted(jax_mod.__all__) == sorted(JAX_PUBLIC)
    assert sorted(jax_ffi.__all__) == sorted(JAX_FFI_PUBLIC)
    for name in JAX_PUBLIC:
        assert callable(getattr(jax_mod, name)), name


def _resolve(name: str):
    if name.startswith("jax."):
        return getattr(importlib.import_module("cuda_kernels.grouped_wgrad.jax"), name[4:])
    cls, _, method = name.partition(".")
    obj = getattr(gw, cls)
    return getattr(obj, method) if method else obj


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_pinned(name):
    assert _signature(_resolve(name)) == "".join(SIGNATURES[name])


@pytest.mark.parametrize("cls", ["GroupedGemmWgradSm100", "GroupedGemmWgradSm90"])
def test_classes_keep_cudnns_lifecycle(cls):
    for method in METHODS:
        assert callable(getattr(getattr(gw, cls), method)), method
