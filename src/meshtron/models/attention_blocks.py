"""Attention of one block of queries against one block of keys, as the pair of kernels a blockwise
attention combines (the ring of :mod:`meshtron.models.context_attention`).

The forward gives the block's normalised output and the log-sum-exp of its scores; blocks combine by
their log-sum-exps, so that any kernel that returns both (cuDNN's flash attention,
:mod:`meshtron.models.cudnn_blocks`) can compute one block. The backward gives the block's share of
the gradients from the *whole* attention's output and log-sum-exp (flash attention's backward:
``P = exp(S - lse)``, ``D = rowsum(dO ∘ O)``), so the blocks' shares add up to the whole's gradients
and no block's own normalisation is ever needed.

Conventions (cuDNN's): ``q``, ``out``, ``d_out`` ``[b, t, heads, d]``; ``k``, ``v`` ``[b, s, kv_heads,
d]`` (grouped-query: query head ``i`` reads key head ``i // (heads / kv_heads)``); ``lse`` ``[b, heads,
t]`` fp32, natural log of the sum over keys of ``exp(scale · q·k)``. ``causal``: key ``j`` visible to
query ``i`` iff ``j <= i`` (``t == s``); ``mask`` ``[b or 1, 1, t, s]`` boolean, ``True`` visible. A
hidden score is pushed to a large negative number, not ``-inf``: a query that sees no key of a block
gets a finite log-sum-exp far below any visible one's, so it weighs nothing when blocks combine and
nothing is ever ``0/0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

HIDDEN = -1e30  # a hidden score (fp32): exp of it minus any visible log-sum-exp is 0


class BlockKernels(NamedTuple):
    """``forward(q, k, v, *, scale, causal, mask) -> (out, lse)`` and ``backward(q, k, v, out, lse,
    d_out, *, scale, causal, mask) -> (dq, dk, dv)``, with the module's conventions. ``out`` may come
    in ``q``'s dtype or fp32, the gradients in their inputs' dtypes or fp32: a caller combines in fp32."""

    forward: Callable[..., tuple[jax.Array, jax.Array]]
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def visible(causal: bool, mask: jax.Array | None, t: int, s: int) -> jax.Array | None:
    """``[b or 1, 1, t, s]``: which scores a block's queries see; ``None``: all of them."""
    if causal:
        lower = (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None, None]
        return lower if mask is None else lower & mask
    return mask


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[b, t, heads, d]`` -> ``[b, t, kv_heads, group, d]`` fp32: each key/value head's query heads."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, d).astype(jnp.float32)


def _scores(q, k, scale, causal, mask):
    """``[b, kv_heads, group, t, s]`` fp32 scaled scores, the hidden ones at :data:`HIDDEN`."""
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", _grouped(q, k.shape[2]), k.astype(jnp.float32),
                        preferred_element_type=jnp.float32) * scale
    shown = visible(causal, mask, q.shape[1], k.shape[1])
    return scores if shown is None else jnp.where(shown[:, :, None], scores, HIDDEN)


def xla_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool,
                mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One block's output (fp32) and log-sum-exp, in XLA's ops with fp32 math."""
    b, t, h, _ = q.shape
    scores = _scores(q, k, scale, causal, mask)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, t, h, v.shape[-1]), lse.reshape(b, h, t)


def xla_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array, *,
                 scale: float, causal: bool, mask: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's share ``(dq, dk, dv)`` (fp32) of the gradients, from the whole attention's ``out``,
    ``lse`` and output gradient ``d_out``."""
    kv_heads = k.shape[2]
    qg, og, dog = (_grouped(x, kv_heads) for x in (q, out, d_out))
    b, t, _, g, _ = qg.shape
    p = jnp.exp(_scores(q, k, scale, causal, mask) - lse.reshape(b, kv_heads, g, t)[..., None])
    correction = jnp.einsum("bqhgd,bqhgd->bhgq", dog, og)  # D = rowsum(dO ∘ O)
    ds = p * (jnp.einsum("bqhgd,bkhd->bhgqk", dog, v.astype(jnp.float32)) - correction[..., None])
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(jnp.float32)) * scale
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg) * scale
    return dq.reshape(q.shape), dk, jnp.einsum("bhgqk,bqhgd->bkhd", p, dog)


XLA_KERNELS = BlockKernels(xla_forward, xla_backward)
