"""Tests of the Triton routing build (cuda_kernels/triton/routing.py) against its twin.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1). Every tensor field of the plan and the grouped layout must be bit-identical
(dtype, shape, bits) to ``plan_routing(..., validate=False)`` + ``plan.grouped(align,
max_tokens_sum=S)``. Every output buffer is poisoned with fresh garbage on each call (the module's
``_alloc`` is patched), so an entry no kernel writes shows up as a mismatch. GPU-only properties
(large shapes, no host sync, CUDA-graph replay with new routing, the device-side assert) are
``gpu``-marked.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.routing import plan_routing

rk = pytest.importorskip("cuda_kernels.triton.routing")
from cuda_kernels.triton.routing import build_routing, check_routing_async  # noqa: E402

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer build_routing allocates starts as garbage that differs call to call."""
    gen = torch.Generator().manual_seed(1234)

    def alloc(shape, dtype, device):
        out = torch.empty(shape, dtype=dtype, device=device)
        if out.device.type != "cpu":  # on the device: no host copy (the GPU tests check syncs)
            return out.fill_(float("nan") if dtype.is_floating_point else -(2**30) + 7)
        if dtype.is_floating_point:
            vals = torch.tensor([float("nan"), 7.5, -3.0, float("inf")])
            out.copy_(vals[torch.randint(0, 4, out.shape, generator=gen)])
        else:
            info = torch.iinfo(dtype)
            lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
            out.copy_(torch.randint(lo, hi, out.shape, generator=gen, dtype=torch.int64))
        return out

    monkeypatch.setattr(rk, "_alloc", alloc)


def _reference(ei, af, E, align=16, tokens_sum=None):
    plan = plan_routing(ei, af, E, validate=False)
    S = rk.default_tokens_sum(ei.numel(), E, align) if tokens_sum is None else tokens_sum
    return plan, plan.grouped(align=align, max_tokens_sum=S)


def _assert_same(got, want):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if not isinstance(b, torch.Tensor):
            assert a == b, f.name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a.dtype, b.dtype, a.shape)
        a, b = a.cpu(), b.cpu()
        if b.dtype.is_floating_point:  # bits, so -0.0 vs 0.0 and NaN payloads count
            a, b = a.view(_BITS[b.dtype]), b.view(_BITS[b.dtype])
        assert torch.equal(a, b), (f.name, a, b)


def _check(ei, af, E, align=16, tokens_sum=None):
    plan, layout, code = build_routing(ei, af, E, align=align, tokens_sum=tokens_sum)
    want_plan, want_layout = _reference(ei, af, E, align, tokens_sum)
    _assert_same(plan, want_plan)
    _assert_same(layout, want_layout)
    assert code.dtype == torch.int32 and code.dim() == 0 and int(code) == 0
    return plan, layout


def _routing(T, K, E, seed, drop_p=0.2, dup_p=0.2, id_dtype=torch.int64, aff_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, E, (T, K), generator=g)
    if K > 1:  # duplicates: a slot copies an earlier slot of its token
        src = torch.randint(0, K, (T, K), generator=g)
        src = torch.minimum(src, torch.arange(K).expand(T, K))
        dup = torch.rand(T, K, generator=g) < dup_p
        ei = torch.where(dup, ei.gather(1, src), ei)
    af = (torch.rand(T, K, generator=g) + 0.01).to(aff_dtype)
    if id_dtype.is_signed:
        drop = torch.rand(T, K, generator=g) < drop_p
        ei = torch.where(drop, -1, ei)
        # dropped slots' affinities are ignored, whatever they hold
        junk = torch.tensor([float("nan"), float("inf"), -5.0], dtype=aff_dtype)
        af = torch.where(drop, junk[torch.randint(0, 3, (T, K), generator=g)], af)
    return ei.to(id_dtype), af


# ------------------------------------------------------------------------------- hand-made
def test_hand_made_duplicates_and_drops():
    ei = torch.tensor([[0, 2, 0], [-1, 1, 1], [2, 2, 2], [1, -1, 0], [-1, -1, -1]])
    af = torch.tensor([[0.25, 0.5, 0.125], [float("nan"), 0.3, 0.4], [0.1, 0.2, 0.3],
                       [0.7, float("-inf"), 0.6], [1.0, 2.0, 3.0]])
    plan, layout = _check(ei, af, 4)
    assert int(plan.num_pairs) == 6
    assert plan.tokens_per_expert_E.tolist() == [2, 2, 2, 0]
    assert plan.slot_to_pair_TK[0].tolist() == [0, 4, 0]
    assert layout.slot_to_row_TK[0].tolist() == [0, 32, -1]
    assert layout.offsets_E.tolist() == [16, 32, 48, layout.tokens_sum]
    assert plan.pair_affinity_R[0].item() == 0.25 + 0.125


def test_bf16_duplicate_sum_rounds_each_add():
    # (1 + 2^-8) + 2^-8 rounds to 1 after each add in bf16, 1 + 2^-7 in one rounding
    ei = torch.tensor([[3, 3, 3]])
    af = torch.tensor([[1.0, 2**-8, 2**-8]], dtype=torch.bfloat16)
    plan, _ = _check(ei, af, 4)
    assert plan.pair_affinity_R[0].item() == 1.0


def test_negative_zero_affinity_sums_like_index_add():
    _check(torch.tensor([[1, 0]]), torch.tensor([[-0.0, 0.5]]), 2)


@pytest.mark.parametrize("T,K,E,block_s", [(0, 3, 5, 256), (1, 1, 1, 256), (7, 1, 1, 256),
                                           (700, 3, 5, 256), (90, 4, 7, 16), (60, 8, 3, 16)])
def test_shapes_and_many_blocks(T, K, E, block_s, monkeypatch):
    monkeypatch.setattr(rk, "_BLOCK_S", block_s)
    _check(*_routing(T, K, E, seed=T + K + E), E)


def test_all_dropped_and_empty_experts():
    _check(torch.full((9, 3), -1), torch.full((9, 3), float("nan")), 4)
    ei = torch.tensor([[5, 5], [1, 5], [5, 1]])
    _check(ei, torch.rand(3, 2), 8)


def test_many_experts_chunk_loop():
    _check(*_routing(50, 4, 300, seed=3, drop_p=0.1, dup_p=0.1), 300)
    _check(*_routing(20, 2, 512, seed=4), 512, align=3)


def test_strided_inputs_and_tokens_sum():
    ei, af = _routing(30, 6, 9, seed=5)
    _check(ei.t().contiguous().t(), af.t().contiguous().t(), 9)
    S = rk.default_tokens_sum(ei.numel(), 9, 8) + 24
    _check(ei[:, ::2], af[:, ::2], 9, align=8, tokens_sum=S)


def test_uint64_and_other_dtypes():
    ei, af = _routing(12, 3, 6, seed=6, id_dtype=torch.uint8)
    for dt in (torch.uint16, torch.uint32, torch.uint64, torch.int16, torch.int8):
        _check(ei.to(dt), af, 6)
    for dt in (torch.float16, torch.float64):
        _check(*_routing(12, 3, 6, seed=7, aff_dtype=dt), 6)


@st.composite
def _cases(draw):
    id_dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int8, torch.uint8]))
    return dict(
        T=draw(st.integers(0, 40)), K=draw(st.integers(1, 8)), E=draw(st.integers(1, 40)),
        seed=draw(st.integers(0, 2**31 - 1)),
        drop_p=draw(st.sampled_from([0.0, 0.3, 1.0])), dup_p=draw(st.sampled_from([0.0, 0.3])),
        id_dtype=id_dtype, aff_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
    ), draw(st.sampled_from([16, 1, 4, 5])), draw(st.sampled_from([16, 256]))


@settings(max_examples=40, deadline=None)
@given(case=_cases())
def test_matches_plan_routing_and_grouped(case):
    kw, align, block_s = case
    E = kw["E"]
    old = rk._BLOCK_S
    rk._BLOCK_S = block_s  # (a monkeypatch fixture cannot be reset per hypothesis example)
    try:
        _check(*_routing(**kw), E, align=align)
    finally:
        rk._BLOCK_S = old


# ------------------------------------------------------------------------------ bad input
def _well_formed(plan, layout, E):
    T, S, R = layout.num_tokens, layout.tokens_sum, layout.num_pair_rows
    for x, lo, hi in ((layout.row_to_token_S, -1, T), (layout.row_to_pair_S, -1, R),
                      (layout.slot_to_row_TK, -1, S), (plan.slot_to_pair_TK, -1, R),
                      (plan.pair_token_R, -1, T), (plan.pair_expert_R, 0, E + 1)):
        assert bool(((x >= lo) & (x < hi)).all())
    off = layout.offsets_E.to(torch.int64)
    assert bool((off[1:] >= off[:-1]).all()) and int(off[-1]) == S and int(off[0]) >= 0


@pytest.mark.parametrize("bad,bit", [
    ("id_E", 1), ("id_minus2", 1), ("id_huge", 1), ("nan", 2), ("inf", 2), ("minus_inf", 6),
    ("negative", 4),
    ("inf_dropped", 0), ("nan_bad_id", 1), ("id_and_negative", 5),
])
def test_error_code_bits_and_memory_safety(bad, bit):
    E = 5
    ei, af = _routing(40, 3, E, seed=8, drop_p=0.2)
    ei[0, 0] = 1
    ei[3, 1] = -1
    if bad == "id_E":
        ei[5, 2] = E
    elif bad == "id_minus2":
        ei[6, 0] = -2
    elif bad == "id_huge":
        ei[7, 1] = 2**40
    elif bad == "nan":
        af[0, 0] = float("nan")
    elif bad == "inf":
        af[0, 0] = float("inf")
    elif bad == "minus_inf":  # non-finite and negative
        af[0, 0] = float("-inf")
    elif bad == "negative":
        af[0, 0] = -0.5
    elif bad == "inf_dropped":
        af[3, 1] = float("inf")
    elif bad == "nan_bad_id":  # an out-of-range slot is dropped: its NaN is no affinity error
        ei[9, 0] = E + 1
        af[9, 0] = float("nan")
    elif bad == "id_and_negative":
        ei[5, 2] = E
        af[0, 0] = -1.0
    plan, layout, code = build_routing(ei, af, E)
    assert code.dtype == torch.int32 and int(code) == bit
    _well_formed(plan, layout, E)
    # out-of-range ids are dropped slots; the rest is the twin's layout of the cleaned ids
    clean = torch.where((ei >= 0) & (ei < E), ei, -1)
    want_plan, want_layout = _reference(clean, af, E)
    _assert_same(plan, want_plan)
    _assert_same(layout, want_layout)


def test_uint64_wrapped_ids_are_bad():
    ei = torch.tensor([[2**63, 1], [0, 2**64 - 1]], dtype=torch.uint64)
    plan, layout, code = build_routing(ei, torch.rand(2, 2), 3)
    assert int(code) == 1
    _well_formed(plan, layout, 3)
    assert int(plan.num_pairs) == 2


def test_tokens_sum_too_small_sets_bit_and_stays_in_range():
    ei = torch.arange(8).reshape(8, 1) % 4
    plan, layout, code = build_routing(ei, torch.rand(8, 1), 4, align=16, tokens_sum=32)
    assert int(code) == 8
    _well_formed(plan, layout, 4)


def test_host_side_argument_errors():
    ei, af = _routing(4, 2, 3, seed=9)
    with pytest.raises(ValueError, match="tokens_sum"):
        build_routing(ei, af, 3, tokens_sum=17)
    with pytest.raises(ValueError, match="num_experts"):
        build_routing(ei, af, 0)
    with pytest.raises(ValueError, match="align"):
        build_routing(ei, af, 3, align=0)
    with pytest.raises(ValueError, match="floating"):
        build_routing(ei, ei, 3)
    with pytest.raises(ValueError, match="integer"):
        build_routing(af, af, 3)
    with pytest.raises(ValueError, match="shape"):
        build_routing(ei, af[:, :1], 3)


# ------------------------------------------------------------------- check_routing_async
@pytest.mark.parametrize("bit", [1, 2, 4, 8])
def test_check_routing_async_on_cpu_raises_value_error(bit):
    check_routing_async(torch.tensor(0, dtype=torch.int32))  # valid: nothing happens
    with pytest.raises(ValueError, match=rk.ERROR_MESSAGES[bit].replace("[", r"\[")
                       .replace("(", r"\(").replace(")", r"\)")):
        check_routing_async(torch.tensor(bit, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-d int32"):
        check_routing_async(torch.tensor([bit], dtype=torch.int32))


@pytest.mark.skipif(not rk.interpreting(), reason="Triton interpreter only")
@pytest.mark.parametrize("bit", [1, 2, 4, 8])
def test_check_kernel_asserts_fire_with_interpreter_debug(bit, monkeypatch):
    """Triton 3.6's interpreter ignores device_assert (its builder's options say debug=False
    whatever the kernel's ``debug``); switched on, the kernel's assert for each bit fires with
    its message, raised as triton's InterpreterError wrapping the AssertionError."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    b = interpreter.interpreter_builder
    monkeypatch.setattr(b, "options", dataclasses.replace(b.options, debug=True))
    rk._CHECK.launch(torch.device("cpu"), (1,), torch.tensor(0, dtype=torch.int32))
    with pytest.raises(InterpreterError) as info:
        rk._CHECK.launch(torch.device("cpu"), (1,), torch.tensor(bit, dtype=torch.int32))
    assert rk.ERROR_MESSAGES[bit] in str(info.value)


# ------------------------------------------------------------------- offline GPU compile
_AOT_SCRIPT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import cuda_kernels.triton.routing as rk

def build(kernel, types, consts, **opts):
    names = kernel._fn.arg_names
    typed = dict(types, **{n: "constexpr" for n in consts})
    sig = {n: typed[n] for n in names}
    src = ASTSource(fn=kernel._fn, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, **opts))

strides = dict(s_id0="i32", s_id1="i32", s_aff0="i32", s_aff1="i32")
for idt, adt, cmp in (("*i64", "*fp32", tl.float32), ("*u8", "*bf16", tl.float32),
                      ("*u64", "*fp64", tl.float64)):
    blocks = dict(K=8, COMPUTE=cmp, BLOCK_S=rk._BLOCK_S)
    build(rk._COUNT, dict(ids_ptr=idt, aff_ptr=adt, **strides, counts_ptr="*i32",
                          rank_ptr="*i32", err_ptr="*i32", R="i32", E="i32", NBP="i32"),
          dict(blocks, BLOCK_E=rk._BLOCK_E))
    outs = dict(pair_token_ptr="*i64", pair_expert_ptr="*i64", pair_aff_ptr=adt,
                slot_pair_ptr="*i64", r2t_ptr="*i64", r2p_ptr="*i64", slot_row_ptr="*i64")
    tables = dict(prefix_ptr="*i32", rank_ptr="*i32", pstart_ptr="*i32", rstart_ptr="*i32",
                  num_pairs_ptr="*i64", rows_ptr="*i32")
    ints = {n: "i32" for n in ("R", "E", "S", "A", "nb", "NBP", "rows_per_prog")}
    build(rk._PLACE, dict(ids_ptr=idt, aff_ptr=adt, **strides, **tables, **outs, **ints),
          dict(blocks, RNE_BF16=False, PAD_W=rk._PAD_W))
build(rk._SCAN, dict(counts_ptr="*i32", E="i32", NBP="i32"),
      dict(SCAN_E=rk._SCAN_E, SCAN_B=rk._SCAN_B))
build(rk._STARTS, dict(prefix_ptr="*i32", err_ptr="*i32", pstart_ptr="*i32", rstart_ptr="*i32",
                       tpe_ptr="*i64", offsets_ptr="*i32", num_pairs_ptr="*i64", rows_ptr="*i32",
                       code_ptr="*i32", E="i32", S="i32", A="i32", nb="i32", NBP="i32"),
      dict(STARTS_E=rk._STARTS_E, BLOCK_ERR=rk._BLOCK_ERR))
check = build(rk._CHECK, {"code_ptr": "*i32"}, {}, debug=True)
assert "__assertfail" in check.asm["ptx"], "the check kernel lost its device_asserts"
print("compiled")
"""


def test_kernels_compile_for_sm90_offline():
    """The compiled path (no GPU needed): Triton's front end, LLVM and ptxas accept every kernel
    for sm_90, and ``debug=True`` keeps the check kernel's asserts."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True,
                       timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("no ptxas")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------------------------- GPU only
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("aff_dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_cpu_twin_large(aff_dtype):
    T, K, E = 16384, 8, 128
    ei, af = _routing(T, K, E, seed=10, drop_p=0.05, dup_p=0.1, aff_dtype=aff_dtype)
    plan, layout, code = build_routing(ei.cuda(), af.cuda(), E)
    want_plan, want_layout = _reference(ei, af, E)  # CPU: index_add_ sums duplicates in order
    _assert_same(plan, want_plan)
    _assert_same(layout, want_layout)
    assert int(code) == 0
    again = build_routing(ei.cuda(), af.cuda(), E)
    _assert_same(again[0], plan)
    _assert_same(again[1], layout)


@gpu
@needs_cuda
def test_gpu_no_host_sync():
    ei, af = _routing(4096, 8, 64, seed=11)
    ei, af = ei.cuda(), af.cuda()
    check_routing_async(build_routing(ei, af, 64)[2])  # compile both outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _, _, code = build_routing(ei, af, 64)
        check_routing_async(code)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_with_new_routing():
    T, K, E = 2048, 4, 32
    routes = [_routing(T, K, E, seed=s, drop_p=p) for s, p in ((12, 0.1), (13, 0.5))]
    ei = routes[0][0].cuda()
    af = routes[0][1].cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        check_routing_async(build_routing(ei, af, E)[2])  # warm-up (compiles) outside
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_routing(ei, af, E)
        check_routing_async(out[2])
    for ei_new, af_new in routes:
        ei.copy_(ei_new)
        af.copy_(af_new)
        graph.replay()
        torch.cuda.synchronize()
        want = build_routing(ei_new.cuda(), af_new.cuda(), E)
        for got_x, want_x in zip(out[:2], want[:2]):
            _assert_same(got_x, want_x)
        want_plan, want_layout = _reference(ei_new, af_new, E)
        _assert_same(out[0], want_plan)
        _assert_same(out[1], want_layout)


_ASSERT_SCRIPT = """
import torch
from cuda_kernels.triton.routing import build_routing, check_routing_async
ei = torch.tensor([[0, 7]], device="cuda")
_, _, code = build_routing(ei, torch.ones(1, 2, device="cuda"), 4)
check_routing_async(code)
print("launched", flush=True)
torch.cuda.synchronize()
print("not reached", flush=True)
"""


@gpu
@needs_cuda
def test_gpu_check_routing_async_device_assert():
    # a device-side assert poisons the CUDA context: run it in a child process
    r = subprocess.run([sys.executable, "-c", _ASSERT_SCRIPT], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "launched" in r.stdout and "not reached" not in r.stdout
    both = r.stdout + r.stderr
    assert "device-side assert" in both
    assert rk.ERROR_MESSAGES[1] in both
