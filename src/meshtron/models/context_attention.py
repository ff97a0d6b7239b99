"""Causal attention over a sequence split across devices (context parallelism).

Each of ``n`` ranks of a mesh axis holds ``S/n`` of a sequence's tokens. Under a causal mask a
token attends to the tokens before it, so a rank that held one contiguous slice would have work in
proportion to its position: the last rank's queries see the whole sequence, the first's almost
nothing. :func:`balanced_order` gives rank ``r`` two slices, chunk ``r`` and chunk ``2n-1-r`` of the
sequence cut into ``2n``, so that every rank has the same amount of attention (Megatron-Core's and
torchtitan's load balancing). Positions (RoPE, and the causal mask) are then those of the rank's own
tokens, not ``0 .. S/n - 1``.

:func:`gathered_kv_attention` is the simplest exchange: each rank all-gathers the keys and values
(only the key/value heads under grouped-query attention) and attends for its own queries, with the
mask built from the positions. Call it inside ``shard_map`` manual over the sequence's mesh axis.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from meshtron.models.attention import Implementation


def balanced_order(seq_len: int, ranks: int) -> np.ndarray:
    """``order[i]``: the position of the token stored at index ``i`` when a sequence of ``seq_len``
    tokens is split over ``ranks`` in equal contiguous parts of ``seq_len / ranks``: rank ``r``'s part
    is chunks ``r`` and ``2·ranks - 1 - r`` of ``2·ranks`` equal chunks, in that order."""
    if seq_len % (2 * ranks):
        raise ValueError(f"balanced_order: seq_len={seq_len} must be divisible by 2 x ranks = {2 * ranks}")
    chunk = seq_len // (2 * ranks)
    starts = [c for r in range(ranks) for c in (r, 2 * ranks - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in starts])


def gathered_kv_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, axis: str, *,
                          implementation: Implementation = None) -> jax.Array:
    """Causal attention of this rank's queries over the whole sequence, whose keys and values are
    all-gathered over the manual mesh ``axis``.

    ``q`` ``[b, s, heads, d]``, ``k``/``v`` ``[b, s, kv_heads, d]`` and ``positions`` ``[s]`` (int) are
    this rank's ``s`` tokens, in any order the ranks agree on (:func:`balanced_order`); a query attends
    to every key at its own or an earlier position. Returns ``[b, s, heads, d]``. The backward pass of
    the all-gather is a reduce-scatter of the keys' and values' gradients.
    """
    keys = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    values = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    key_positions = jax.lax.all_gather(positions, axis, axis=0, tiled=True)
    mask = (key_positions[None, :] <= positions[:, None])[None, None]  # [1, 1, s, S]
    scale = 1.0 / math.sqrt(q.shape[-1])
    return jax.nn.dot_product_attention(q, keys, values, mask=mask, scale=scale, implementation=implementation)
