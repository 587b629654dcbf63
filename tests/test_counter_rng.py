"""The counter-based generator of the seeded inputs (common/counter_rng.py): its values follow
the documented map and hash, do not depend on the chunking or the threads, keep their statistics,
and (GPU) are the same bits on CUDA as on the CPU."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from common import counter_rng
from common.counter_rng import BLOCK, TABLE_SIZE, hash_counters, normal, normal_table

HALF = BLOCK // 2
# A tensor of several blocks that ends inside one (5 whole blocks and 777 elements).
N_ODD = 5 * BLOCK + 777

# Digests that change only when the generator does (every saved bundle depends on its bits):
# the float32 quantile table, and one BF16 draw.
TABLE_SHA256 = "8babbcaf96568f10165a1eab530c0e5c92d04de96761b6dbb3dadfa94baba37f"
DRAW_SHA256 = "f1f831d04c37d959eff27a89c63ca44a239ff63beee8b8f0db14522c466c8360"


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor's bits (for exact comparisons, -0.0 and NaN too)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def reference_values(indices, seed, stream, table, segment_bits=32):
    """The draws of ``indices`` computed from the module docstring's definition with Python
    ints (an independent implementation of the index map and the hash)."""
    out = []
    for i in indices:
        b, p = divmod(i, BLOCK)
        c = b * HALF + p % HALF
        x = c & ((1 << segment_bits) - 1)
        for key, mult in zip(counter_rng._keys(seed, stream, c >> segment_bits),
                             counter_rng._MULTIPLIERS):
            prod = (x ^ key) * mult
            assert prod < 2**63  # int64-exact on every device
            x = (prod ^ (prod >> 32)) & 0xFFFFFFFF
        out.append(table[(x >> 16) if p < HALF else (x & 0xFFFF)])
    return torch.stack(out)


# ------------------------------------------------------------------------- the definition
def test_table_is_pinned_symmetric_and_unit_variance():
    t = counter_rng._table_float32()
    assert t.shape == (TABLE_SIZE,) and t.dtype == torch.float32
    assert _sha(t) == TABLE_SHA256  # a platform whose log moves a float32 value fails here
    assert torch.equal(t, -t.flip(0)) and bool((t[1:] > t[:-1]).all())
    assert abs(t.double().pow(2).mean().item() - 1) < 1e-7
    assert 4.32 < t.max().item() < 4.33  # Phi^-1(1 - 0.5 / 65536)
    assert torch.equal(normal_table(), t) and normal_table() is not t  # a copy per call


@pytest.mark.parametrize("seed,stream", [(0, "hidden_states_TH"), (7, "w_down_EIH"), (-3, "x")])
def test_values_follow_the_documented_map(seed, stream):
    idx = [0, 1, HALF - 1, HALF, HALF + 1, BLOCK - 1, BLOCK, 3 * BLOCK + HALF + 5, N_ODD - 1]
    got = normal((N_ODD,), seed=seed, stream=stream)
    want = reference_values(idx, seed, stream, normal_table())
    assert torch.equal(_bits(got[idx]), _bits(want))


def test_counter_segments_follow_the_documented_map(monkeypatch):
    """Counters past 2**32 (tensors over 2**33 elements) take the next segment's keys: checked
    with 2**16-counter segments, so a small tensor crosses several."""
    monkeypatch.setattr(counter_rng, "_SEGMENT_BITS", 16)
    n = 5 * BLOCK + 99  # counters 0 .. 2.5 * 2**16: three segments
    with pytest.raises(ValueError, match=r"chunk_blocks must be a power of two in \[1, 2\*\*1\]"):
        normal(4, seed=0, stream="s", chunk_blocks=4)
    for cb in (1, 2):
        got = normal((n,), seed=1, stream="s", chunk_blocks=cb)
        idx = [0, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + HALF, 4 * BLOCK + 3, n - 1]
        want = reference_values(idx, 1, "s", normal_table(), segment_bits=16)
        assert torch.equal(_bits(got[idx]), _bits(want))
    monkeypatch.undo()
    assert not torch.equal(normal((n,), seed=1, stream="s")[2 * BLOCK:], got[2 * BLOCK:])


def test_hash_counters_in_place_and_in_range():
    c = torch.arange(1000, dtype=torch.int64) + (2**32 - 500)  # up to the top of the range
    c %= 2**32
    h = hash_counters(c.clone(), 5, "s", segment=3)
    assert h.dtype == torch.int64 and int(h.min()) >= 0 and int(h.max()) < 2**32
    assert len(set(h.tolist())) > 990  # (a hash, not a permutation: rare collisions)
    x = c.clone()
    assert hash_counters(x, 5, "s", segment=3) is x and torch.equal(x, h)
    assert not torch.equal(hash_counters(c.clone(), 5, "s", segment=4), h)
    with pytest.raises(ValueError, match="counters must be int64"):
        hash_counters(c.int(), 5, "s")


def test_draw_is_pinned():
    d = normal((3, 70001), seed=0, stream="hidden_states_TH", dtype=torch.bfloat16)
    assert _sha(d) == DRAW_SHA256


# ---------------------------------------------------------- chunks, threads, dtypes, devices
@pytest.mark.parametrize("n", [1, 777, BLOCK, N_ODD])
def test_chunking_and_threads_never_change_a_value(n, monkeypatch):
    one = normal((n,), seed=3, stream="w", dtype=torch.bfloat16, chunk_blocks=1)
    for cb in (2, 4, 8, 256, 2**17):
        assert torch.equal(_bits(normal((n,), seed=3, stream="w", dtype=torch.bfloat16,
                                        chunk_blocks=cb)), _bits(one)), cb
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # the worker-thread path
    threaded = normal((n,), seed=3, stream="w", dtype=torch.bfloat16)
    assert torch.equal(_bits(threaded), _bits(one))


def test_shape_is_a_view_of_the_flat_draw():
    flat = normal((6 * 5000,), seed=2, stream="t")
    assert torch.equal(normal((6, 5000), seed=2, stream="t"), flat.view(6, 5000))
    assert torch.equal(normal(30000, seed=2, stream="t"), flat)
    assert normal((3, 0, 2), seed=2, stream="t").shape == (3, 0, 2)
    scalar = normal((), seed=2, stream="t")
    assert scalar.shape == () and torch.equal(scalar, flat[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_is_one_rounding_of_the_float32_draw(dtype):
    std = 2048**-0.5
    f32 = normal((N_ODD,), seed=4, stream="w", std=std)
    got = normal((N_ODD,), seed=4, stream="w", std=std, dtype=dtype)
    assert got.dtype == dtype and torch.equal(_bits(got), _bits(f32.to(dtype)))
    unit = normal((N_ODD,), seed=4, stream="w")
    assert torch.equal(f32, unit * torch.tensor(std, dtype=torch.float32))  # one fp32 product


def test_device_without_exact_int64_gets_the_cpu_draw():
    m = normal((4, 5), seed=0, stream="x", dtype=torch.bfloat16, device="meta")
    assert m.device.type == "meta" and m.shape == (4, 5) and m.dtype == torch.bfloat16


# ---------------------------------------------------------------------------- statistics
def test_statistics_of_a_draw():
    n = 1 << 22
    z = normal((n,), seed=0, stream="stats", dtype=torch.float64)
    tol = 5 / math.sqrt(n)  # 5 sigma of a mean / correlation of n independent draws
    assert abs(z.mean().item()) < tol
    assert abs(z.std().item() - 1) < 0.002
    assert abs(z.pow(4).mean().item() - 3) < 0.03  # normal kurtosis
    assert abs((z.abs() > 2).double().mean().item() - 0.0455) < 0.0006
    assert z.abs().max().item() <= 4.33

    def corr(a, b):
        return torch.corrcoef(torch.stack([a, b]))[0, 1].item()

    assert abs(corr(z[:-1], z[1:])) < tol  # neighbours
    blocks = z[: (n // BLOCK) * BLOCK].view(-1, 2, HALF)  # the two halves of one hash
    assert abs(corr(blocks[:, 0].reshape(-1), blocks[:, 1].reshape(-1))) < 2 * tol
    other = normal((n,), seed=0, stream="stats2", dtype=torch.float64)
    assert abs(corr(z, other)) < tol  # streams of one seed
    assert abs(corr(z, normal((n,), seed=1, stream="stats", dtype=torch.float64))) < tol


@pytest.mark.parametrize("std", [0.1, 2048**-0.5, 768**-0.5])
def test_std_of_each_input_tensor(std):
    w = normal((64, 2048), seed=0, stream="w", std=std, dtype=torch.bfloat16).float()
    assert abs(w.std().item() / std - 1) < 0.01 and abs(w.mean().item()) < 0.01 * std


def test_problem_inputs_have_todays_scales():
    """make_problem's tensors: X, dY ~ N(0, 1), gate/up ~ N(0, 1/H), down ~ N(0, 1/I),
    biases ~ N(0, 0.01), one stream each (x and dY not equal)."""
    from common.inputs import make_problem

    T, H, I, E = 256, 512, 256, 8
    p = make_problem(T, H, I, E, 2, seed=5, bias=True)
    for t, std in ((p.hidden_states_TH, 1.0), (p.output_grad_TH, 1.0),
                   (p.w_gate_up_EH2I, H**-0.5), (p.w_down_EIH, I**-0.5),
                   (p.b_gate_up_E2I, 0.1), (p.b_down_EH, 0.1)):
        assert t.dtype == torch.bfloat16
        assert abs(t.float().std().item() / std - 1) < 0.08, (t.shape, std)
    assert torch.equal(p.w_down_EIH, normal((E, I, H), seed=5, stream="w_down_EIH",
                                            std=I**-0.5, dtype=torch.bfloat16))
    assert not torch.equal(p.hidden_states_TH, p.output_grad_TH)


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    ({"seed": "0"}, "seed must be an int"),
    ({"seed": True}, "seed must be an int"),
    ({"stream": 3}, "stream must be a str"),
    ({"shape": (-1, 2)}, "shape must be ints >= 0"),
    ({"shape": (2.0,)}, "shape must be ints >= 0"),
    ({"std": -1.0}, "std must be a finite real number >= 0"),
    ({"std": float("nan")}, "std must be a finite real number >= 0"),
    ({"std": True}, "std must be a finite real number >= 0"),
    ({"dtype": torch.int32}, "dtype must be a floating torch.dtype"),
    ({"chunk_blocks": 3}, "chunk_blocks must be a power of two"),
    ({"chunk_blocks": 0}, "chunk_blocks must be a power of two"),
    ({"chunk_blocks": 2**18}, "chunk_blocks must be a power of two"),
    ({"chunk_blocks": 2.0}, "chunk_blocks must be an int"),
])
def test_bad_arguments_are_refused(kwargs, match):
    args = {"shape": (4,), "seed": 0, "stream": "x", **kwargs}
    with pytest.raises(ValueError, match=match):
        normal(args.pop("shape"), **args)


# --------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, N_ODD, 256 * BLOCK + 5])  # the last: two CUDA chunks
def test_cuda_draws_are_the_cpu_bits(dtype, n):
    cpu = normal((n,), seed=11, stream="w_gate_up_EH2I", std=0.02, dtype=dtype)
    for cb in (None, 1, 4):
        gpu = normal((n,), seed=11, stream="w_gate_up_EH2I", std=0.02, dtype=dtype,
                     device="cuda", chunk_blocks=cb)
        assert gpu.device.type == "cuda" and torch.equal(_bits(gpu.cpu()), _bits(cpu)), cb


@pytest.mark.gpu
@needs_cuda
def test_cuda_problem_inputs_are_the_cpu_bits():
    from common.inputs import make_problem

    args = (512, 256, 128, 8, 2)
    cpu = make_problem(*args, seed=3, bias=True)
    gpu = make_problem(*args, seed=3, bias=True, device="cuda")
    for name in ("hidden_states_TH", "output_grad_TH", "w_gate_up_EH2I", "w_down_EIH",
                 "b_gate_up_E2I", "b_down_EH"):
        g = getattr(gpu, name)
        assert g.is_cuda and torch.equal(_bits(g.cpu()), _bits(getattr(cpu, name))), name
