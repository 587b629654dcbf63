"""Kernel inputs in the style of AWS nki-library's MXFP8 MoE backward tests (our own code).

AWS's test fixtures (``build_mxfp8_moe_bwd_inputs`` and its routing helper in nki-library's
``test/integration``) draw inputs a particular way, which our other generators do not: a router
that gives every token ``top_k`` distinct experts uniformly at random, routing tables built
straight from the dense token-by-expert mask (expert-contiguous blocks, tokens ascending inside
an expert, the unused trailing blocks given to the last expert, padding slots ``-1``),
weights ~ U(-0.1, 0.1), hidden states ~ U[0, 1), upstream gradient ~ U(-1, 1), affinities
U[0, 1) times the routing mask (0 where not routed), a per-shape seed from a hash of the
parameters, and the checkpoint from an fp32 forward of the BF16 inputs. This module rebuilds
that recipe from its description, independently of :mod:`common.routing`, so the kernel also
sees AWS-style inputs (all-positive X, unnormalised affinities, |dY| up to 1).
"""

from __future__ import annotations

import hashlib
import math

import torch

from common.problem import ClampLimits


def num_blocks(T: int, top_k: int, E: int, B: int) -> int:
    """Static block count ``ceil((T*top_k - (E-1)) / B) + E - 1`` (REFERENCE §1.1)."""
    return math.ceil((T * top_k - (E - 1)) / B) + E - 1


def param_seed(*params) -> int:
    """A reproducible seed per shape: the first 32 bits of sha256 of the joined parameters."""
    text = "_".join(str(p) for p in params)
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % (2**32)


def random_router(T: int, top_k: int, E: int, seed: int = 0) -> torch.Tensor:
    """[T, top_k] int64: per token ``top_k`` distinct experts, uniformly at random."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])


def routing_tables(router: torch.Tensor, E: int, B: int, N: int, padding_id: int = -1):
    """(token_experts [T, E] 0/1 float32, token_position_to_id [N*B] int32,
    block_to_expert [N, 1] int32) from a router, built from the dense mask.

    Expert e owns ``ceil(count_e / B)`` consecutive blocks in expert order (the last expert also
    takes the ``N - sum`` unused trailing blocks); its tokens fill them in ascending token order;
    every other slot holds ``padding_id``."""
    T = router.shape[0]
    mask = torch.zeros(T, E, dtype=torch.float32)
    mask.scatter_(1, router, 1.0)
    counts = mask.sum(0).to(torch.int64)
    blocks = (counts + B - 1) // B
    blocks[E - 1] += N - int(blocks.sum())
    if int(blocks[E - 1]) < 0:
        raise ValueError(f"N={N} blocks are fewer than the routing needs")
    block_to_expert = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), blocks)
    first_slot = torch.cumsum(blocks, 0) * B - blocks * B  # first slot of each expert
    tpti = torch.full((N * B,), padding_id, dtype=torch.int32)
    for e in range(E):
        tokens = torch.nonzero(mask[:, e]).flatten().to(torch.int32)  # ascending
        start = int(first_slot[e])
        tpti[start : start + tokens.numel()] = tokens
    return mask, tpti, block_to_expert.reshape(N, 1)


def checkpoint_fp32(x, w_gu, tpti, b2e, B: int, clamp: ClampLimits | None = None):
    """[N, 2, I, B] BF16 gate/up pre-activations of every slot from an fp32 forward of the BF16
    inputs (padding slots read a zero row: 0), clamped as the forward clamps them."""
    T, H = x.shape
    I = w_gu.shape[3]
    N = b2e.shape[0]
    x_pad = torch.cat([x.float(), torch.zeros(1, H)])  # row T: the padding slots' zeros
    ids = torch.where(tpti < 0, T, tpti).to(torch.int64).reshape(N, B)
    out = torch.zeros(N, 2, I, B, dtype=torch.float32)
    for n in range(N):
        e = int(b2e[n, 0])
        gu = (x_pad[ids[n]] @ w_gu[e].float().reshape(H, 2 * I)).reshape(B, 2, I)
        if clamp is not None:
            for k, lo, hi in ((0, clamp.non_linear_clamp_lower_limit,
                               clamp.non_linear_clamp_upper_limit),
                              (1, clamp.linear_clamp_lower_limit, clamp.linear_clamp_upper_limit)):
                if lo is not None or hi is not None:
                    gu[:, k].clamp_(lo, hi)
        out[n] = gu.permute(1, 2, 0)
    return out.to(torch.bfloat16)


def build_aws_style_bwd_inputs(T: int, H: int, I: int, E: int, B: int, top_k: int,
                               clamp_limits: ClampLimits | None = None) -> dict:
    """Keyword arguments of ``blockwise_mm_bwd_mxfp8`` (the seed's names) for one AWS-style
    problem: BF16 tensors, padding slots ``-1`` (pass ``skip_dma=SkipMode(skip_token=True)``),
    ``is_tensor_update_accumulating = top_k != 1``. Same parameters -> same tensors."""
    N = num_blocks(T, top_k, E, B)
    router = random_router(T, top_k, E, seed=0)
    mask, tpti, b2e = routing_tables(router, E, B, N)
    gen = torch.Generator().manual_seed(param_seed(T, top_k, B, E, I, H, "mxfp8"))

    def uniform(lo, hi, *shape):
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo)

    w_down = uniform(-0.1, 0.1, E, I, H).to(torch.bfloat16)
    w_gu = uniform(-0.1, 0.1, E, H, 2, I).to(torch.bfloat16)
    ea = (uniform(0.0, 1.0, T, E) * mask.double()).to(torch.bfloat16)
    x = uniform(0.0, 1.0, T, H).to(torch.bfloat16)
    dy = uniform(-1.0, 1.0, T, H).to(torch.bfloat16)
    return {
        "hidden_states": x,
        "expert_affinities_masked": ea.reshape(T * E, 1),
        "gate_up_proj_weight": w_gu,
        "down_proj_weight": w_down,
        "token_position_to_id": tpti,
        "block_to_expert": b2e,
        "output_hidden_states_grad": dy,
        "block_size": B,
        "gate_up_proj_act_checkpoint_T": checkpoint_fp32(x, w_gu, tpti, b2e, B, clamp_limits),
        "is_tensor_update_accumulating": top_k != 1,
    }
