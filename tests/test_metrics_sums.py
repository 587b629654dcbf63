"""common.metrics.error_sums: computed on the tensors' device with one host read at the end
(the GPU main job's comparison no longer copies gradients through the host), with the values of
a direct float64 computation across chunk boundaries and the finiteness rule kept."""

from __future__ import annotations

import math

import torch

from common import metrics


def test_error_sums_match_float64_across_chunks(monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK", 7)  # several chunks and a short last one
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 9, generator=g, dtype=torch.float64)
    out = (ref + 0.01 * torch.randn(5, 9, generator=g, dtype=torch.float64)).bfloat16()
    d = out.double() - ref
    noise2, signal2, dmax, rmax, finite = metrics.error_sums(out, ref)
    assert finite
    assert math.isclose(noise2, float((d * d).sum()), rel_tol=1e-12)
    assert math.isclose(signal2, float((ref * ref).sum()), rel_tol=1e-12)
    assert dmax == float(d.abs().max()) and rmax == float(ref.abs().max())
    assert metrics.error_sums(out, ref, need_max=False)[2:4] == (0.0, 0.0)


def test_error_sums_non_finite_out(monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK", 4)
    ref = torch.ones(10, dtype=torch.float64)
    for bad in (math.inf, math.nan):
        out = torch.ones(10)
        out[9] = bad
        assert metrics.error_sums(out, ref)[4] is False
        assert math.isnan(metrics.sqnr_db(out, ref))
    assert metrics.sqnr_db(ref.float(), ref) == math.inf
