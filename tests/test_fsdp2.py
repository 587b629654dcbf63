"""FSDP2 (``torch.distributed.fsdp.fully_shard``) of models whose MoE layer is ours: 2 processes
on the CPU (gloo), each on its half of the batch, give the loss and the gradients of one process
on the whole batch -- for :class:`common.layer.MoEExperts` in a small block and for a transformers
model on ``experts_implementation="moe_bwd"``.

FSDP2 shards every parameter on dim 0 (the experts dimension E of ours and of transformers'
``gate_up_proj`` / ``down_proj``), all-gathers them before the module's forward into plain
tensors (the layer sees ordinary [E, ...] weights, strided views included) and reduce-scatters
the gradients after the backward: the layer needs nothing of its own."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
T, H, I, E, K = 16, 32, 16, 4, 2


class Block(torch.nn.Module):
    """Linear router + our experts + a residual, the loss a mean square."""

    def __init__(self):
        super().__init__()
        from common.layer import MoEExperts

        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = MoEExperts(E, H, I, bias=True, dtype=torch.float32)

    def forward(self, x):
        w, idx = torch.topk(self.router(x).softmax(-1), K, dim=-1)
        return (x + self.experts(x, idx, w)).square().mean()


def _hf_model():
    import transformers as tf

    from common.integrations.transformers import register

    register()
    cfg = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                            num_experts_per_tok=2)
    return tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="moe_bwd")


def _cases():
    """(name, model, loss of one half-batch, units to shard): the same on every rank."""
    torch.manual_seed(0)
    block = Block()
    xs = torch.randn(WORLD, T, H)
    yield "MoEExperts", block, lambda m, r: m(xs[r]), [block.experts]
    if _has_transformers():
        torch.manual_seed(0)
        model = _hf_model()
        ids = torch.randint(0, 64, (WORLD, 2, 8), generator=torch.Generator().manual_seed(1))
        yield ("transformers", model, lambda m, r: m(ids[r], labels=ids[r]).loss,
               list(model.model.layers))


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _worker(rank: int, init_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        for name, model, half_loss, units in _cases():
            # one process, the whole batch: the mean of the half-batch losses
            ref = copy.deepcopy(model)
            ref_loss = sum(half_loss(ref, r) for r in range(WORLD)) / WORLD
            ref_loss.backward()
            for unit in units:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            loss = half_loss(model, rank)
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            torch.testing.assert_close(mean / WORLD, ref_loss.detach(), rtol=1e-6, atol=0)
            grads = dict(ref.named_parameters())
            for pname, p in model.named_parameters():
                full = p.grad.full_tensor()
                want = grads[pname].grad
                torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-7,
                                           msg=lambda m, n=pname, c=name: f"{c} {n}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_fully_shard_two_processes_match_one():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
