"""Expert parallelism on the CPU (gloo): process groups of 2 and 4 against one process.

* Our path (:mod:`common.expert_parallel`), 2 and 4 processes: loss, y, dX, the router
  gradient (through the affinities; all-reduced over the group, as data parallelism would) and
  each rank's expert weight and bias gradients equal a single-process run of the same
  :class:`~common.layer.MoEExperts` on the concatenated tokens. Uneven token counts per rank
  (one rank with none), empty experts (all of one rank's), dropped slots (-1, also every slot).
* torchtitan 0.3.0's own MoE (router, ``AllToAllTokenDispatcher``, combine) with EP 2 (a
  dp2 x ep2 mesh) and EP 4, in one 4-process group: its default experts and ours
  (:func:`common.expert_parallel.use_moe_experts_in_torchtitan`) each equal their
  single-process run; ours and torchtitan's default agree to BF16 accuracy. torchtitan's
  token choice has no capacity, so no dropped slots there. Skipped without torchtitan.

Every process group is bounded (``SPAWN_TIMEOUT_S``; collectives time out after ``PG_TIMEOUT_S``).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import multiprocessing
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 120  # 4 processes take 4-12 s on 2 cores; a hang fails, not stalls
PG_TIMEOUT_S = 60  # a rank stuck in a collective raises instead of blocking the run
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
"""EP vs one process, fp32 parameters and activations: the same BF16 GEMM operands, the same
fp32 accumulations per expert (rows of an expert arrive in token order, as in one process);
only all-reduces and K-slot sums may differ in order. Observed: bitwise equal (our path),
<= 5e-7 (torchtitan's router gradient)."""
BF16_REL_TOL = 3e-2
"""Ours vs torchtitan's default experts, relative Frobenius error: both use BF16 GEMM operands
but torchtitan rounds the SwiGLU output h (and its gradients) to BF16, we keep fp32."""

# (E, K, tokens per rank, empty experts, fraction of dropped slots, bias)
CASES = {
    2: [
        (8, 2, (6, 9), (6, 7), 0.25, True),
        (8, 4, (0, 5), (0, 1, 2, 3), 0.2, False),  # no tokens on rank 0; rank 0's experts empty
        (8, 2, (3, 4), (), 1.0, True),  # every slot dropped
    ],
    4: [
        (16, 4, (5, 0, 7, 3), (2, 12, 13, 14, 15), 0.2, True),  # rank 3's experts all empty
        (16, 2, (4, 4, 4, 4), (0, 5), 0.0, False),
    ],
}
H, I = 16, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes, bounded in time; a child's
    exception fails the test with its traceback. Started from a fork server that imported torch
    (and torchtitan) once: a spawned child re-imports them (4-5x slower on 2 cores), and a plain
    fork of the pytest process is unsafe once other tests have started threads (JAX's)."""
    preload = ["torch", "torch.distributed", "common.expert_parallel"]
    if _torchtitan_missing() is None:
        preload += ["torchtitan.models.common.moe", "torchtitan.models.common.token_dispatcher"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    ctx = mp.start_processes(
        fn, args=(world, _free_port(), *args), nprocs=world, join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world} processes did not finish in {SPAWN_TIMEOUT_S} s")


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------ our path
def _problem(E, K, tokens, empty, drop, bias, seed):
    """The full problem, identical on every rank (seeded): layer, x, routing, router, dY."""
    from common.layer import MoEExperts

    g = torch.Generator().manual_seed(seed)
    T = sum(tokens)
    layer = MoEExperts(E, H, I, dtype=torch.float32, bias=bias)
    layer.reset_parameters(generator=g)
    if bias:
        with torch.no_grad():
            layer.b_gate_up.normal_(generator=g)
            layer.b_down.normal_(generator=g)
    allowed = torch.tensor([x for x in range(E) if x not in empty])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    idx = idx.reshape(T, K)
    idx[torch.rand(T, K, generator=g) < drop] = -1
    x = torch.randn(T, H, generator=g)
    w_router = torch.randn(H, E, generator=g) * H**-0.5
    dy = torch.randn(T, H, generator=g)
    return layer, x, idx, w_router, dy


def _run(moe, x, idx, w_router, dy):
    """loss = <y, dy> with affinities from a softmax router; returns (loss, y, grads)."""
    x = x.clone().requires_grad_()
    w_router = w_router.clone().requires_grad_()
    affinity = torch.softmax(x @ w_router, dim=-1).gather(1, idx.clamp(min=0))
    y = moe(x, idx, affinity)
    loss = (y * dy).sum()
    loss.backward()
    return loss.detach(), y.detach(), x.grad, w_router.grad


def _ours_worker(rank: int, world: int, port: int) -> None:
    from common.expert_parallel import ExpertParallelMoEExperts

    _init(rank, world, port)
    try:
        for n, (E, K, tokens, empty, drop, bias) in enumerate(CASES[world]):
            case = f"world {world} case {n} rank {rank}"
            layer, x, idx, w_router, dy = _problem(E, K, tokens, empty, drop, bias, seed=n)
            loss, y, dx, dw_router = _run(layer, x, idx, w_router, dy)

            ep_layer = ExpertParallelMoEExperts.from_experts(layer)
            mine = slice(sum(tokens[:rank]), sum(tokens[: rank + 1]))
            loss_r, y_r, dx_r, dw_router_r = _run(ep_layer, x[mine], idx[mine], w_router, dy[mine])
            dist.all_reduce(loss_r)
            dist.all_reduce(dw_router_r)
            _close(f"{case} loss", loss_r, loss)
            _close(f"{case} y", y_r, y[mine])
            _close(f"{case} dX", dx_r, dx[mine])
            _close(f"{case} router grad", dw_router_r, dw_router)
            experts = slice(ep_layer.experts.start, ep_layer.experts.stop)
            for name, p in ep_layer.local.named_parameters():
                _close(f"{case} {name} grad", p.grad, getattr(layer, name).grad[experts])
            if drop == 1.0:
                assert not y_r.any() and not dx_r.any(), case
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(CASES))
def test_expert_parallel_matches_one_process(world):
    _spawn(_ours_worker, world)


def test_single_rank_without_process_group_is_the_layer():
    """No ``torch.distributed``: one rank, no exchange, the layer's own result."""
    from common.expert_parallel import ExpertParallelMoEExperts

    layer, x, idx, w_router, dy = _problem(8, 2, (7,), (3,), 0.2, True, seed=0)
    want = _run(layer, x, idx, w_router, dy)
    ep_layer = ExpertParallelMoEExperts.from_experts(layer)
    got = _run(ep_layer, x, idx, w_router, dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_expert_parallel_refuses_bad_arguments():
    from common.expert_parallel import ExpertParallelMoEExperts, expert_parallel_moe
    from common.layer import MoEExperts

    layer = MoEExperts(4, H, I, dtype=torch.float32)
    x, a = torch.randn(3, H), torch.rand(3, 2)
    with pytest.raises(ValueError, match=r"values must lie in \[-1, num_experts=4\)"):
        ExpertParallelMoEExperts.from_experts(layer)(x, torch.tensor([[0, 4]] * 3), a)
    with pytest.raises(ValueError, match="holds 4 experts but this rank owns"):
        expert_parallel_moe(x, torch.zeros(3, 2, dtype=torch.long), a, layer.w_gate_up,
                            layer.w_down, num_experts=8)


# ---------------------------------------------------------------------------------- torchtitan
TT_E, TT_K, TT_SEQS, TT_L = 8, 3, 1, 6  # per rank: TT_SEQS sequences of TT_L tokens
TT_EMPTY = (6, 7)  # never chosen (expert bias -100): all of rank 3's experts at EP 4


def _torchtitan_missing() -> str | None:
    for mod in ("torchtitan", "spmd_types", "tyro"):
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


def _tt_moe():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        MoE,
        GroupedExperts,
        RoutedExperts,
        TokenChoiceTopKRouter,
    )
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    cfg = MoE.Config(
        num_experts=TT_E,
        load_balance_coeff=1e-3,  # gives the expert_bias_E buffer (routing only)
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=I, num_experts=TT_E),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=TT_E, top_k=TT_K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=TT_E, gate=Linear.Config(in_features=H, out_features=TT_E),
            top_k=TT_K, score_func="softmax",
        ),
    )
    torch.manual_seed(0)
    moe = cfg.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.expert_bias_E[list(TT_EMPTY)] = -100.0
    return moe


def _tt_run(moe, x, dy):
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * dy).sum().backward()
    ie = moe.routed_experts.inner_experts
    return {
        "y": y.detach(), "dX": x.grad, "router grad": moe.router.gate.weight.grad,
        **{n: getattr(ie, n).grad for n in ("w1_EFD", "w2_EDF", "w3_EFD")},
    }


def _tt_worker(rank: int, world: int, port: int) -> None:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as tt_dist_utils

    from common.expert_parallel import use_moe_experts_in_torchtitan

    warnings.filterwarnings("ignore", message="In CPU autocast")
    tt_dist_utils.set_spmd_backend("partial_dtensor")  # the DTensor path, no spmd_types mesh
    _init(rank, world, port)
    try:
        meshes = {
            "ep4": init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)),
            "dp2 x ep2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"],
        }
        base = _tt_moe()
        singles = {}
        for variant in ("torchtitan", "ours"):
            moe = copy.deepcopy(base)
            if variant == "ours":
                assert use_moe_experts_in_torchtitan(moe) == 1
            for label, mesh in meshes.items():
                ep, r = mesh.size(), mesh.get_local_rank()
                g = torch.Generator().manual_seed(ep)
                x = torch.randn(ep * TT_SEQS, TT_L, H, generator=g)
                dy = torch.randn(ep * TT_SEQS, TT_L, H, generator=g)
                want = _tt_run(copy.deepcopy(moe), x, dy)
                singles[variant, ep] = want
                ep_moe = copy.deepcopy(moe)
                ie, e = ep_moe.routed_experts.inner_experts, TT_E // ep
                for n in ("w1_EFD", "w2_EDF", "w3_EFD"):  # this rank's experts, plain tensors
                    setattr(ie, n, torch.nn.Parameter(getattr(ie, n).detach()[r * e:(r + 1) * e]))
                ep_moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
                mine = slice(r * TT_SEQS, (r + 1) * TT_SEQS)
                got = _tt_run(ep_moe, x[mine], dy[mine])
                dist.all_reduce(got["router grad"], group=mesh.get_group())
                case = f"{variant} experts, {label}, rank {rank}"
                for name, t in got.items():
                    w = want[name]
                    if name in ("y", "dX"):
                        w = w[mine]
                    elif name != "router grad":
                        w = w[r * e:(r + 1) * e]
                    _close(f"{case} {name}", t, w)
        for ep in (2, 4):  # ours against torchtitan's default experts: BF16 accuracy
            for name, w in singles["torchtitan", ep].items():
                got = singles["ours", ep][name]
                rel = ((got - w).norm() / w.norm()).item()
                assert rel <= BF16_REL_TOL, f"ours vs torchtitan {name}, ep {ep}: rel {rel:.3g}"
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchtitan's imports (torch.jit)
@pytest.mark.skipif(_torchtitan_missing() is not None,
                    reason="torchtitan not installed (pip install moe-bwd-kernels[torchtitan])")
def test_torchtitan_expert_parallel_with_our_experts():
    _spawn(_tt_worker, 4)
