"""The one legend of dimension letters used in shape-suffixed names across the package.

A tensor named ``x_TH`` has shape ``[T, H]``; ``w_gate_up_EH2I`` has shape ``[E, H, 2, I]``.

=======  =====================================================================================
letter   meaning
=======  =====================================================================================
T        tokens (after flattening batch and sequence)
H        hidden size (model dimension)
I        expert intermediate size (per tensor-parallel shard: ``I_TP`` in AWS's docs)
E        number of routed experts
K        top_k: routed experts per token (slots per token)
R        routed rows, ``T * K`` (slots, including dropped ones)
B        block_size: token slots per block of the NKI blockwise layout
N        number of blocks of the NKI blockwise layout
S        tokens_sum: rows of the grouped (cuDNN-style) layout, each expert padded to ``align``
=======  =====================================================================================
"""

from __future__ import annotations

import math

__all__ = ["static_num_blocks"]


def static_num_blocks(num_tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """Static upper bound N on the number of blocks of the blockwise layout.

    ``N = ceil((T*K - (E-1)) / B) + E - 1`` (REFERENCE §1.1, AWS nki-library's formula): the worst
    case in which E-1 experts hold one token each and the last expert holds the rest. For
    ``T*K < E-1`` (fewer slots than experts) the first term is clamped at 0: N = E-1 blocks still
    cover every non-empty expert. N is at least 1, so kernels always see a non-empty grid.

    Raises:
        ValueError: negative sizes or a non-positive ``block_size`` / ``num_experts``.
    """
    if num_tokens < 0 or top_k < 1 or num_experts < 1 or block_size < 1:
        raise ValueError(
            "static_num_blocks: need num_tokens >= 0, top_k >= 1, num_experts >= 1, "
            "block_size >= 1; "
            f"got T={num_tokens}, K={top_k}, E={num_experts}, B={block_size}"
        )
    first = max(0, math.ceil((num_tokens * top_k - (num_experts - 1)) / block_size))
    return max(1, first + num_experts - 1)
