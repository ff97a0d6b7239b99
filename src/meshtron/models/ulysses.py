"""Ulysses context parallelism: two all-to-alls turn a sequence split into a head split.

Each of ``c`` ranks of the ``context`` axis holds ``S/c`` tokens of a sequence with all of its tensor
rank's heads. An all-to-all over ``u`` ranks (split the heads, concatenate the sequence) gives each the
``u`` ranks' tokens -- ``u·S/c`` of them, in order -- for ``1/u`` of the heads; attention over them
needs nothing from any other rank, and a second all-to-all gives each rank its own tokens back with all
heads (DeepSpeed-Ulysses; Megatron's ``cp_comm_type a2a``). What one rank sends per all-to-all is
``(u-1)/u`` of its block, so the traffic per rank stays the same as ``c`` grows with the sequence, and
the attention in between is any kernel's ordinary causal attention (cuDNN's flash attention included).

With ``u = c`` (``parallel.context_attention=ulysses``) the ranks hold the whole sequence after the
exchange; the heads per tensor rank must be a multiple of ``c``. With ``u < c``
(``parallel.context_attention=hybrid``, ``parallel.ulysses_degree=u``; USP, Megatron's ``a2a+p2p``) the
all-to-all runs within each group of ``u`` consecutive ranks, and the ``c/u`` groups attend over the
whole sequence by the load-balanced ring (:func:`meshtron.models.context_attention.ring_attention`, its
ranks ``u`` apart). Both are one split of the one ``context`` mesh axis rather than two mesh axes: the
mesh keeps its four axes, so rules tables, checkpoints and every other feature's view of ``context``
stay as they are; and consecutive ranks of the axis -- those the all-to-all joins -- are the axis's
closest devices (the mesh's device order puts them in one node where ``pipe × tensor`` leave room),
the ring going across the groups. A second mesh axis would buy nothing the groups do not give: XLA
takes the groups as the all-to-all's replica groups, and the ring's permutes name its pairs.

:func:`ulysses_attention` is the exchange around an attention given to it (``attend``), called inside
``shard_map`` manual over the sequence's axis. Grouped-query attention: a rank's key/value heads are
repeated (``jnp.repeat``, which keeps query head ``j`` reading the same key head) to the least common
multiple of their count and ``u`` when ``u`` does not divide them, as Megatron does: the keys' and
values' all-to-alls then send ``lcm(kv, u) / kv`` times the bytes (``u / kv`` when ``kv`` divides
``u``); the repeat's backward sums the copies' gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from meshtron.errors import ConfigError
from meshtron.models.fused_attention import entry_ranks, local_spec, spec_entry
from meshtron.sharding import LogicalAxes, constrain

TOKENS = ("batch", "seq")

Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], jax.Array]


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, ulysses: int, attend: Attend, *,
                      segments: jax.Array | None = None, query_axes: LogicalAxes, key_axes: LogicalAxes,
                      value_axes: LogicalAxes, exchange: str = "ulysses") -> jax.Array:
    """``attend(q, k, v, segments)`` of the ``u = ulysses`` consecutive ranks' tokens of the manual mesh
    ``axis`` for ``1/u`` of this rank's heads, between an all-to-all of ``q`` [b, s, h, d], ``k``/``v``
    [b, s, kv, d] (and an all-gather of ``segments`` [b, s]) to ``[b, u·s, h/u, d]`` and one of the
    result back to ``[b, s, h, d]``.

    ``attend``'s keys and values are laid out as the queries (``query_axes``): where ``k`` and ``v`` are
    whole on every tensor rank (``key_axes`` keep them so) while the queries are split, each device
    first keeps the key/value heads its query heads read (:func:`_own_key_heads`). ``exchange``: the
    setting named when the heads do not split (``ulysses`` or ``hybrid``)."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    sizes = dict(mesh.shape)
    q_spec = local_spec(tuple(query_axes), q.shape, auto, sizes)
    kv_spec = local_spec(tuple(key_axes), k.shape, auto, sizes)
    if kv_spec != local_spec(tuple(value_axes), v.shape, auto, sizes):
        raise ValueError(f"ulysses_attention: keys {tuple(key_axes)} and values {tuple(value_axes)} must be laid out alike")
    if ulysses < 1 or sizes[axis] % ulysses:
        raise ValueError(f"ulysses_attention: {ulysses} ranks per all-to-all must divide the {sizes[axis]} of {axis!r}")
    heads_entry = spec_entry(q_spec, 2)
    heads = q.shape[2] // entry_ranks(heads_entry, sizes)
    _check_heads(heads, ulysses, sizes[axis], exchange)
    groups = None if ulysses == sizes[axis] else [list(range(g * ulysses, (g + 1) * ulysses))
                                                   for g in range(sizes[axis] // ulysses)]
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True,
                                 axis_index_groups=groups)
    if heads_entry is not None and spec_entry(kv_spec, 2) is None:  # whole keys, split queries: each its own
        k, v = (constrain(jnp.take(x, _own_key_heads(q.shape[2], x.shape[2], entry_ranks(heads_entry, sizes)), axis=2),
                          tuple(query_axes)) for x in (k, v))
        kv_spec = q_spec

    def keys(x):  # the key/value heads repeated so that the ranks split them as they split the queries
        kv = x.shape[2]
        if kv % ulysses:
            x = jnp.repeat(x, math.lcm(kv, ulysses) // kv, axis=2)
        return to_heads(x)

    def gathered(x):  # [b, s] -> [b, u·s]: an all-gather within the group, as an all-to-all of u copies
        return jax.lax.all_to_all(jnp.broadcast_to(x[..., None], (*x.shape, ulysses)), axis, 2, 1, tiled=True,
                                  axis_index_groups=groups)[..., 0]

    q, k, v = (_manual(to_heads, q, q_spec, q_spec, auto), _manual(keys, k, kv_spec, kv_spec, auto),
               _manual(keys, v, kv_spec, kv_spec, auto))
    if segments is not None:
        token_spec = local_spec(TOKENS, segments.shape, auto, sizes)
        segments = _manual(gathered, segments, token_spec, token_spec, auto)
    out = attend(q, k, v, segments)
    to_sequence = functools.partial(jax.lax.all_to_all, axis_name=axis, split_axis=1, concat_axis=2, tiled=True,
                                    axis_index_groups=groups)
    return _manual(to_sequence, out, q_spec, q_spec, auto)


def key_heads_per_rank(heads: int, kv_heads: int, ranks: int) -> int:
    """How many key/value heads each of ``ranks`` tensor ranks sends through the all-to-all when the model
    keeps its ``kv_heads`` whole on every rank while its ``heads`` query heads split: those its own query
    heads read (:func:`_own_key_heads`), before any repetition to the all-to-all's ranks."""
    return len(_own_key_heads(heads, kv_heads, ranks)) // ranks


def _own_key_heads(heads: int, kv_heads: int, ranks: int) -> np.ndarray:
    """The key/value heads each of ``ranks`` tensor ranks holding ``heads / ranks`` of the query heads reads,
    rank after rank: grouped-query attention pairs query head ``n`` with key head ``n // (heads / kv_heads)``;
    a contiguous run of them when a rank's heads read whole groups or lie in one, else one per query head.
    Taken from keys whole on every rank (a static gather, which each device does locally), they are laid out
    as the queries are, and the all-to-all sends each device's own only."""
    group, local = heads // kv_heads, heads // ranks
    if local % group == 0 or group % local == 0:
        width = max(1, local // group)
        return np.concatenate([np.arange(width) + t * local // group for t in range(ranks)])
    return np.arange(heads) // group


def _check_heads(heads: int, ulysses: int, ranks: int, exchange: str) -> None:
    """The heads of a tensor rank must split evenly over the ``ulysses`` ranks: one line naming the way out."""
    if heads % ulysses == 0:
        return
    if exchange == "hybrid":
        raise ConfigError(f"parallel.ulysses_degree: {ulysses} must divide the {heads} query heads of each tensor "
                          f"rank (the all-to-all splits them); use a divisor of {heads} that divides "
                          f"parallel.context={ranks}")
    raise ConfigError(f"parallel.context_attention: ulysses splits the {heads} query heads of each tensor rank over "
                      f"parallel.context={ranks} ranks, which must divide them; use parallel.context_attention=hybrid "
                      f"with a parallel.ulysses_degree that divides {heads} (the rest of the ranks a ring)")


def _manual(fn: Callable[[jax.Array], jax.Array], x: jax.Array, in_spec: PartitionSpec, out_spec: PartitionSpec,
            auto: frozenset[str]) -> jax.Array:
    """``fn(x)`` where every mesh axis still automatic here is manual too (``in_spec``, ``out_spec`` over
    those): left to the partitioner, an all-to-all in a partly manual region first gathers what the
    automatic axes split (the heads over tensor ranks), as :func:`meshtron.models.context_attention._gathered_heads`
    says of its all-gather."""
    if not auto:
        return fn(x)
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, axis_names=set(auto))(x)
