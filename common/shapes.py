"""The one legend of dimension letters used in shape-suffixed names across the package.

A tensor named ``x_TH`` has shape ``[T, H]``; ``w_gate_up_EH2I`` has shape ``[E, H, 2, I]``.

=======  =====================================================================================
letter   meaning
=======  =====================================================================================
T        tokens (after flattening batch and sequence)
H        hidden size (model dimension)
I        expert intermediate size (per tensor-parallel shard: ``I_TP`` in AWS's docs)
E        number of routed experts
e        local experts of one expert-parallel rank, ``E / ep`` (:mod:`common.expert_parallel`)
K        top_k: routed experts per token (slots per token)
R        routed rows, ``T * K`` (slots, including dropped ones)
B        block_size: token slots per block of the NKI blockwise layout
N        number of blocks of the NKI blockwise layout
S        tokens_sum: rows of the grouped (cuDNN-style) layout, each expert padded to ``align``
=======  =====================================================================================
"""

from __future__ import annotations

import operator

__all__ = ["static_num_blocks", "static_tokens_sum"]


def static_num_blocks(num_tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """Static upper bound N on the number of blocks of the blockwise layout.

    ``N = ceil((T*K - (E-1)) / B) + E - 1`` (REFERENCE §1.1, AWS nki-library's and NxD's
    formula), exactly, for every T, K, E, B: the worst case in which E-1 experts hold one token
    each and the last expert holds the rest. No clamping: a layout built with another N is not
    interchangeable with NxD's. When ``T*K < E-1`` the first term is <= 0 and N falls below
    E-1, yet ``N >= T*K`` still holds (``x / B >= x`` for ``x <= 0``), and T*K blocks cover the
    routing, since each non-empty expert needs at most as many blocks as it has slots. N is 0
    only when there are no slots (``T*K == 0``) and ``B == 1`` or ``E == 1``: nothing to launch.

    The ceiling is integer arithmetic (``-((E-1-T*K) // B)``), exact for any size.

    Raises:
        ValueError: negative sizes or a non-positive ``block_size`` / ``num_experts`` / ``top_k``.
    """
    sizes = {"num_tokens": num_tokens, "top_k": top_k, "num_experts": num_experts,
             "block_size": block_size}
    for name, v in sizes.items():
        try:
            if isinstance(v, bool):
                raise TypeError
            sizes[name] = operator.index(v)  # numpy integers accepted
        except TypeError:
            raise ValueError(f"static_num_blocks: {name} must be an int, got {v!r}") from None
    num_tokens, top_k, num_experts, block_size = sizes.values()
    if num_tokens < 0 or top_k < 1 or num_experts < 1 or block_size < 1:
        raise ValueError(
            "static_num_blocks: need num_tokens >= 0, top_k >= 1, num_experts >= 1, "
            "block_size >= 1; "
            f"got T={num_tokens}, K={top_k}, E={num_experts}, B={block_size}"
        )
    slots_beyond = num_tokens * top_k - (num_experts - 1)
    return -(-slots_beyond // block_size) + num_experts - 1


def static_tokens_sum(num_pair_rows, num_experts, align):
    """Static row bound S of the grouped layout: ``(R + E*(align-1) + align-1) // align * align``
    (R = T*K pair slots, every expert's rows padded up to ``align``): the rows of the worst case
    in which each of the E experts wastes ``align - 1`` padding rows, rounded up to ``align``,
    so every routing of R slots fits. Plain integer arithmetic (works on symbolic sizes while
    ``torch.compile`` traces); no validation."""
    R, E, A = num_pair_rows, num_experts, align
    return (R + E * (A - 1) + A - 1) // A * A
