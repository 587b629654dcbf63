"""Test-session settings shared by every test file."""

import os

import torch

# One intra-op thread: the suite is thousands of small tensor ops, for which a second thread on
# a 2-core CI machine only adds synchronisation (measured here: 71 s with 2 threads, 16 s with 1).
torch.set_num_threads(1)

# Without a GPU, the Triton kernels of the fused backward run in Triton's interpreter on CPU
# tensors (the same kernel source). The variable must be set before Triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
