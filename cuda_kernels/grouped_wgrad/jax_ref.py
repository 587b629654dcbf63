"""The ``jax.numpy`` twin of the grouped wgrad: ``grouped_wgrad_jax_reference`` and its rules.

Dimensions: H hidden, S tokens_sum, I intermediate, E experts (``common/shapes.py``).

Any JAX backend, any floating dtype, any shapes (no alignment rules): what ``grouped_wgrad_jax``
runs where no kernel does (CPU included) and what the JAX tests compare the kernels with. Its
static rules (:func:`check_reference_call`) hold for tracers and concrete arrays alike; the
offsets VALUES (:func:`check_offsets_concrete`) only for concrete arrays.

Pure JAX: imports no torch, no CuTe DSL and nothing of the package; JAX is imported inside the
functions, so importing this module needs no JAX.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "check_offsets_concrete",
    "check_reference_call",
    "dtype_name",
    "grouped_wgrad_jax_reference",
    "is_tracer",
]


def is_tracer(x: Any) -> bool:
    """True when ``x`` is a JAX tracer (inside ``jax.jit`` / ``grad`` / ``vmap``)."""
    import jax

    return isinstance(x, jax.core.Tracer)


def dtype_name(x: Any) -> str:
    """The numpy name of an array's (or tracer's) dtype: "bfloat16", "int32", ..."""
    import numpy as np

    return np.dtype(x.dtype).name


def _check_jax_array(x: Any, arg: str) -> None:
    """``x`` is a JAX array, a tracer of one, or a numpy array; else a ValueError naming ``arg``
    (a torch tensor has ``shape`` and ``dtype`` too, but jnp code fails on it far inside)."""
    import jax
    import numpy as np

    if not isinstance(x, (jax.Array, np.ndarray)):
        hint = ""
        if isinstance(x, _torch_tensor_type()):
            hint = ("; convert a torch tensor with jax.dlpack.from_dlpack(t) (zero copy) or "
                    "jnp.asarray(t.cpu().numpy()), or call the torch entry grouped_gemm_wgrad")
        raise ValueError(
            f"{arg} must be a JAX array (jax.Array, a tracer of one, or a numpy array), got "
            f"{type(x).__name__}{hint}"
        )


def _torch_tensor_type() -> type:
    """torch.Tensor when torch is imported (never imports it), else a type nothing matches."""
    import sys

    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else type("_NoTorch", (), {})


def check_reference_call(a: Any, b: Any, offsets: Any, wgrad_dtype: Any) -> tuple[int, int]:
    """Static rules of :func:`grouped_wgrad_jax_reference` / :func:`grouped_wgrad_jax` (valid
    for tracers and concrete arrays alike): JAX arrays; ``a`` [H, S] and ``b`` [S, I] floating,
    rank 2, one S; ``offsets`` [E >= 1] int32 (the torch entry's rule); ``wgrad_dtype`` floating.

    Returns:
        (tokens_sum, num_experts).

    Raises:
        ValueError: naming the argument and the rule.
    """
    import jax.numpy as jnp

    for x, arg in ((a, "a"), (b, "b"), (offsets, "offsets")):
        _check_jax_array(x, arg)
    for x, arg, dims in ((a, "a", "[hidden, tokens_sum]"), (b, "b", "[tokens_sum, intermediate]")):
        if len(x.shape) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{arg} must be a 2-D {dims} floating array (bfloat16, float16, float32, "
                f"float64), got shape {tuple(x.shape)} {dtype_name(x)}"
            )
    tokens_sum = int(a.shape[1])
    if int(b.shape[0]) != tokens_sum:
        raise ValueError(
            f"b.shape[0] ({b.shape[0]}) must equal a.shape[1] = tokens_sum ({tokens_sum})"
        )
    if len(offsets.shape) != 1 or dtype_name(offsets) != "int32" or offsets.shape[0] < 1:
        raise ValueError(
            f"offsets must be a 1-D [num_experts >= 1] int32 array of cumulative expert ends, "
            f"got shape {tuple(offsets.shape)} {dtype_name(offsets)}"
        )
    try:
        floating = jnp.issubdtype(jnp.dtype(wgrad_dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(
            f"wgrad_dtype must be a floating dtype (a jnp dtype or its name), got {wgrad_dtype!r}"
        )
    return tokens_sum, int(offsets.shape[0])


def check_offsets_concrete(offsets: Any, tokens_sum: int) -> Any:
    """Host check of concrete offsets values (one device-to-host copy): non-decreasing from 0,
    last == tokens_sum. Returns the per-expert counts (int64 numpy)."""
    import numpy as np

    off = np.asarray(offsets).astype(np.int64)
    counts = np.diff(np.concatenate([[0], off]))
    if (counts < 0).any():
        raise ValueError(
            f"offsets must be non-decreasing cumulative ends starting at >= 0, got {off.tolist()}"
        )
    if off[-1] != tokens_sum:
        raise ValueError(
            f"offsets[-1] ({off[-1]}) must equal tokens_sum = a.shape[1] ({tokens_sum})"
        )
    return counts


def grouped_wgrad_jax_reference(a: Any, b: Any, offsets: Any, *, wgrad_dtype: Any = "float32",
                                validate_offsets: bool = True):
    """The ``jax.numpy`` twin: ``wgrad[e] = a[:, begin:end] @ b[begin:end]`` in fp32, [E, H, I].

    Any JAX backend, any floating dtype, any shapes (no alignment rules). A reference, not a
    fast path, but without an E-fold blow-up: at most (S + E·T)·H·I multiply-adds with T the
    token chunk (64..256), fp32 sums chunk by chunk (equal to the torch twin up to fp32
    summation order); ``_ragged_wgrad_chunked`` says why not ``jax.lax.ragged_dot_general``.

    Args:
        a: [H, S] floating JAX array. b: [S, I] floating JAX array.
        offsets: [E] int32 cumulative expert ends: non-decreasing, last == S (the torch entry's
            rules; any count per expert, 0 included).
        wgrad_dtype: floating dtype of the result (default float32).
        validate_offsets: check the offsets VALUES when they are concrete (one device-to-host
            copy): non-decreasing from 0, last == S. Under ``jax.jit`` / ``grad`` / ``vmap`` the
            offsets are tracers whose values cannot be checked: only the static rules (types,
            ranks, dtypes, shapes) are, and out-of-contract offsets give unspecified results.
    Returns:
        [E, H, I] array of ``wgrad_dtype``.
    Raises:
        ValueError: naming the argument: not a JAX array (a torch tensor included), wrong rank
            or dtype, ``b.shape[0] != a.shape[1]``, offsets not [E >= 1] int32, a non-floating
            ``wgrad_dtype``; with concrete offsets, their values.
    """
    check_reference_call(a, b, offsets, wgrad_dtype)
    if validate_offsets and not is_tracer(offsets):
        check_offsets_concrete(offsets, int(a.shape[1]))
    return _ragged_wgrad_chunked(a, b, offsets).astype(wgrad_dtype)


#: Tokens per chunk of the jnp twin: bounds (H·T + T·I) live operand bytes per step and the
#: masked work to E·T tokens beyond S. T ≈ S / E (the masked waste then at most ~S, i.e. ≤ ~2x a
#: dense product), at least 64 (fewer, smaller steps cost more in loop overhead: 64 was the best
#: of 32..256 at S=4096, H=1024, I=512, E=128 on the CPU) and at most 256 (waste E·256 ≪ S once
#: S/E is large).
_TWIN_CHUNK_MIN, _TWIN_CHUNK_MAX = 64, 256


def _twin_chunk(tokens_sum: int, num_experts: int) -> int:
    per = max(1, -(-tokens_sum // num_experts))
    return min(_TWIN_CHUNK_MAX, max(_TWIN_CHUNK_MIN, 1 << (per - 1).bit_length()))


def _ragged_wgrad_chunked(a: Any, b: Any, offsets: Any) -> Any:
    """fp32 [E, H, I] = per-expert ``a[:, begin:end] @ b[begin:end]`` without an E-fold blow-up.

    Why not ``jax.lax.ragged_dot_general`` (ragged contracting dims, the tgmm form; same API in
    JAX 0.10.2): off TPU its lowering is ``_ragged_dot_general_impl``, which masks both operands
    to dense [E, H, S] and [E, S, I] copies and contracts all of them: E x the FLOPs and memory,
    as slow as the one-hot einsum it would replace (measured 14.8 s vs 15.7 s on the CPU at
    S=4096, H=1024, I=512, E=128). Instead: tokens in static chunks of T; the (chunk, expert)
    pairs that overlap number at most ``ceil(S/T) + E - 1`` (each expert boundary adds one), a
    static trip count; step p finds its pair from the offsets (dynamic: no retrace for new
    values), masks the chunk's tokens outside the expert, and adds the [H, T] @ [T, I] product
    into ``out[e]``. Work: (S + E·T)·H·I multiply-adds at most; memory: the [E, H, I] result and
    one chunk. Steps past the real pairs add zeros. ``fori_loop`` with static bounds lowers to a
    scan, so the twin stays reverse-differentiable, vmappable and jit-compatible.
    """
    import jax.numpy as jnp
    from jax import lax

    hidden, tokens_sum = (int(d) for d in a.shape)
    inter = int(b.shape[1])
    num_experts = int(offsets.shape[0])
    tile = _twin_chunk(tokens_sum, num_experts)
    n_chunks = max(1, -(-tokens_sum // tile))
    pad = n_chunks * tile - tokens_sum
    a_HS = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad)))
    b_SI = jnp.pad(b.astype(jnp.float32), ((0, pad), (0, 0)))
    # The barrier keeps XLA from treating offsets known at trace time (a closed-over constant) as
    # constants: jax 0.11.2's GPU compiler sank them into the loop body and then failed to
    # evaluate the dynamic-slice offsets ("Failed to evaluate instruction ... depends on
    # parameters", H200, 2026-12-01). Data offsets, the usual case, are unaffected.
    ends_E = lax.optimization_barrier(offsets.astype(jnp.int32))
    begins_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E[:-1]])
    first_chunk_E = begins_E // tile
    pairs_E = jnp.where(ends_E > begins_E, (ends_E - 1) // tile - first_chunk_E + 1, 0)
    pairs_end_E = jnp.cumsum(pairs_E)
    pairs_begin_E = pairs_end_E - pairs_E
    tok_T = jnp.arange(tile, dtype=jnp.int32)

    def step(p, out_EHI):
        e = jnp.minimum(jnp.searchsorted(pairs_end_E, p, side="right"), num_experts - 1)
        chunk = jnp.clip(first_chunk_E[e] + p - pairs_begin_E[e], 0, n_chunks - 1)
        t0 = chunk * tile
        a_HT = lax.dynamic_slice_in_dim(a_HS, t0, tile, axis=1)
        b_TI = lax.dynamic_slice_in_dim(b_SI, t0, tile, axis=0)
        tok = t0 + tok_T
        live = (tok >= begins_E[e]) & (tok < ends_E[e]) & (p < pairs_end_E[-1])
        part_HI = jnp.dot(jnp.where(live[None, :], a_HT, 0.0), b_TI,
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return lax.dynamic_update_index_in_dim(out_EHI, out_EHI[e] + part_HI, e, 0)

    out = jnp.zeros((num_experts, hidden, inter), jnp.float32)
    return lax.fori_loop(0, n_chunks + num_experts - 1, step, out)
