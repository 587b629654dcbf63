"""The layer's CPU path at small shapes: one intra-op thread while the expert GEMMs are small
(restored afterwards), and BF16 GEMMs as fp32 GEMMs of the same BF16 values where the CPU has no
native BF16 matmul -- the same products, rounded to BF16 as before."""

from __future__ import annotations

import torch

from common import torch_backward as tb


def test_cpu_threads_one_thread_for_small_problems_and_restored():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with tb.cpu_threads(torch.device("cpu"), 1024, 8, 256, 128):  # 8 experts of 128 rows
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with tb.cpu_threads(torch.device("cpu"), 16384, 8, 4096, 2048):  # large: untouched
            assert torch.get_num_threads() == 2
        with tb.cpu_threads(torch.device("meta"), 1024, 8, 256, 128):  # not the CPU
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_grouped_gemms_equal_bf16_products_whatever_the_cpu(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x_SK = torch.randn(48, 64, generator=g)
    w_EKN = torch.randn(3, 64, 32, generator=g)
    offsets_E = torch.tensor([16, 16, 48], dtype=torch.int32)
    want = torch.cat([x_SK[:16].bfloat16() @ w_EKN[0].bfloat16(),
                      x_SK[16:].bfloat16() @ w_EKN[2].bfloat16()]).float()
    for fast in (True, False):
        monkeypatch.setattr(tb, "_cpu_has_fast_bf16", lambda fast=fast: fast)
        got = tb.grouped_mm_rows(x_SK, w_EKN, offsets_E)
        assert got.dtype == torch.float32
        assert torch.equal(got, got.bfloat16().float())  # products rounded to BF16
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)  # BF16 rounding apart
        dw = tb.grouped_wgrad_default(x_SK.t(), torch.randn(48, 32, generator=g), offsets_E)
        assert torch.equal(dw[1], torch.zeros(64, 32))  # the empty expert: exactly 0
