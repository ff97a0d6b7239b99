"""The data-parallel gradient reduction, as an optax transform.

Gradients arrive *local*: each data-parallel shard computed them on its own slice of the batch
inside a ``shard_map`` that is manual over ``data``. This transform averages them over that axis
-- once per optimizer step, after gradient accumulation -- and is the one place the trainer
communicates over ``data``. Making it an ordinary ``GradientTransformation`` is what lets a
compressed optimizer (1-bit LAMB) own the reduction instead.
"""

from __future__ import annotations

import jax
import optax

from meshtron.sharding import gradient_axes


def mean_over(tree, axis_name: str | tuple[str, ...]):
    """``lax.pmean`` over ``axis_name``, skipped when the axis has size 1.

    Skipping is exact (the mean over one shard is the shard) and also needed: XLA 0.10's SPMD
    partitioner rejects an all-reduce over a size-1 axis of a partially manual ``shard_map``
    ("Cross-partition allreduce must be in (partial) manual partitioning mode").
    """
    if jax.lax.axis_size(axis_name) == 1:
        return tree
    return jax.lax.pmean(tree, axis_name)


def data_parallel_mean(axis_name: str | tuple[str, ...] | None = None) -> optax.GradientTransformation:
    """Average updates over the named mesh axis, or axes (``lax.pmean``); stateless.

    Must run inside a ``shard_map``/``pmap`` where ``axis_name`` is bound; the result is
    identical (invariant) on every shard of that axis. ``None``: the mesh's gradient group,
    :func:`meshtron.sharding.gradient_axes` (``data``, and ``context`` when sequences are split).
    """

    def init(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None):
        del params
        return mean_over(updates, axis_name or gradient_axes(jax.sharding.get_abstract_mesh().shape)), state

    return optax.GradientTransformation(init, update)
