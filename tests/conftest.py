"""Test-session settings shared by every test file."""

import os

import torch

# One intra-op thread: the suite is thousands of small tensor ops, for which a second thread on
# a 2-core CI machine only adds synchronisation (measured here: 71 s with 2 threads, 16 s with 1).
torch.set_num_threads(1)

# JAX takes 75 % of a GPU's memory at its first use unless told not to; with pytest -n N on a GPU
# machine every worker that imports JAX (tests/test_jax_entries.py too) would, and the other
# workers' CUDA tests then fail with out-of-memory (seen on the H200, 2026-12-01).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Without a GPU, the Triton kernels of the fused backward run in Triton's interpreter on CPU
# tensors (the same kernel source). The variable must be set before Triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No persistent kernel cache (cuda_kernels/gemm/kernel_cache.py) unless the run asks for one: a
# kernel another process stored would stand in for the compile that tests count or replace with
# a stand-in (tests/test_kernel_cache.py sets its own directory).
os.environ.setdefault("MOE_BWD_KERNEL_CACHE", "off")


def pytest_report_teststatus(report, config):
    """A passing test prints nothing (no progress dot): a green run of ~2,700 tests is its summary
    line, not 35 lines of dots. Skips ('s'), failures and errors still print their letter, and
    ``-v`` still names every test."""
    if report.passed and report.when == "call" and config.get_verbosity() <= 0:
        return "passed", "", "PASSED"
    return None
