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


def data_parallel_mean(axis_name: str = "data") -> optax.GradientTransformation:
    """Average updates over the named mesh axis (``lax.pmean``); stateless.

    Must run inside a ``shard_map``/``pmap`` where ``axis_name`` is bound; the result is
    identical (invariant) on every shard of that axis.
    """

    def init(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None):
        del params
        return jax.lax.pmean(updates, axis_name), state

    return optax.GradientTransformation(init, update)
