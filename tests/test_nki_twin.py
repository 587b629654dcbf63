"""Backend ``nki-twin`` (issue 9 item 3): the NKI MXFP8 kernel's MX-faithful torch twin as a
backend. On the CPU it equals ``nki-sim`` (the kernel on our interpreter) bit for bit; on a GPU
(marked ``gpu``, run on the H200) it equals itself on the CPU bit for bit: the MX instruction
sums are exact in fp64 on any device, and the order-dependent sums and the sigmoid run on the host."""

from __future__ import annotations

import pytest
import torch

from common.dispatch import BACKEND_NAMES, registered_backends, resolve_backend, run_backward
from common.inputs import make_problem
from common.problem import ClampLimits

CLAMP = ClampLimits(linear_clamp_upper_limit=7.0, linear_clamp_lower_limit=-7.0,
                    non_linear_clamp_upper_limit=7.0)
GRADS = ("hidden_states_grad_TH", "affinity_grad_TE", "w_gate_up_grad_EH2I", "w_down_grad_EIH",
         "b_gate_up_grad_E2I", "b_down_grad_EH")

CASES = {
    # name: (make_problem kwargs, backend options)
    "top4": ({"num_tokens": 64, "hidden": 256, "intermediate": 256, "num_experts": 8,
              "top_k": 4}, {}),
    "clamp_bias_zero_row_fp32acc": (
        {"num_tokens": 40, "hidden": 128, "intermediate": 384, "num_experts": 4, "top_k": 2,
         "bias": True, "clamp_limits": CLAMP},
        {"padding": "zero_row", "accumulation_dtype": "float32"},
    ),
    "B256_uneven_H384": ({"num_tokens": 96, "hidden": 384, "intermediate": 128,
                          "num_experts": 3, "top_k": 1, "skew": 2.0}, {"block_size": 256}),
}


def _assert_bitwise(a, b):
    for name in GRADS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), name


def test_registered():
    assert "nki-twin" in BACKEND_NAMES and "nki-twin" in registered_backends()
    assert resolve_backend("nki-twin", "cpu").name == "nki-twin"


@pytest.mark.parametrize("case", sorted(CASES))
def test_twin_equals_interpreter_bitwise(case):
    mk, opts = CASES[case]
    p = make_problem(seed=5, **mk)
    twin = run_backward(p, "nki-twin", **opts)
    sim = run_backward(p, "nki-sim", **opts)
    assert twin.info["backend"] == "nki-twin" and twin.info["num_blocks"] == sim.info["num_blocks"]
    _assert_bitwise(twin, sim)


def test_twin_refuses_what_the_kernel_refuses():
    backend = resolve_backend("nki-twin", "cpu")
    assert "multiples of 128" in backend.check_shape({"H": 192, "I": 128})
    assert "SwiGLU" in backend.check_shape({"H": 128, "I": 128, "activation": "gpt_oss"})
    p = make_problem(8, 192, 128, 2, 1)
    with pytest.raises(ValueError, match="multiples of 128"):
        run_backward(p, "nki-twin")
    with pytest.raises(ValueError, match="unknown options"):
        run_backward(make_problem(8, 128, 128, 2, 1), "nki-twin", spill_reload=True)


def test_twin_zero_tokens():
    g = run_backward(make_problem(0, 128, 128, 2, 1), "nki-twin")
    assert g.hidden_states_grad_TH.shape == (0, 128)
    assert torch.count_nonzero(g.w_down_grad_EIH) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
def test_twin_on_cuda_equals_cpu_bitwise(case):
    """Tolerance 0: the twin's MX instruction sums are exact in fp64 (MX products have <= 8
    significant bits), its fp32 adds elementwise; the sums of fp32 products (dA, bias
    gradients), whose fp64 rounding depends on the order, and the sigmoid (NumPy's) run on the
    host."""
    from common.bundle import problem_to

    mk, opts = CASES[case]
    p = make_problem(seed=5, **mk)
    cpu = run_backward(p, "nki-twin", **opts)
    gpu = run_backward(problem_to(p, "cuda"), "nki-twin", **opts)
    assert gpu.hidden_states_grad_TH.device.type == "cuda"
    _assert_bitwise(gpu, cpu)
