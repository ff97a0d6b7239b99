"""LAMB whose trust ratio is per *layer*, also for parameters stacked along a leading layers axis.

``optax.lamb`` computes one trust ratio ``||w|| / ||update||`` per pytree leaf. meshtron stacks
every transformer block's parameters as ``[layers, ...]`` leaves, so plain ``optax.lamb`` would
treat all layers of, say, ``fc1/kernel`` as a single layer. :func:`scale_by_layerwise_trust_ratio`
computes the norms per slice of the leading axis for stacked leaves (and per leaf otherwise),
which is what LAMB (You et al.) and Megatron/DeepSpeed users expect. With the layer axis sharded
over ``pipe`` the per-slice norms need no communication.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtron.optim.masks import tree_or_call


def layer_squares(x: jax.Array, stacked: bool) -> jax.Array:
    """Sum of squares per layer: ``[layers]`` for a stacked leaf, a scalar otherwise."""
    return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)) if stacked else None)


def layer_norm(x: jax.Array, stacked: bool) -> jax.Array:
    """L2 norm per layer: ``[layers]`` for a stacked leaf, a scalar otherwise."""
    return jnp.sqrt(layer_squares(x, stacked))


def _identity(tree: Any) -> Any:
    return tree


def per_layer(value: jax.Array, like: jax.Array) -> jax.Array:
    """A per-layer value (``[layers]`` or scalar) shaped to broadcast against the leaf ``like``."""
    return value.reshape(value.shape + (1,) * (like.ndim - value.ndim))


def _trust_ratio(param_norm: jax.Array, update_norm: jax.Array) -> jax.Array:
    # A zero weight or update norm leaves the update unscaled (ratio 1), as in optax and DeepSpeed.
    return jnp.where((param_norm == 0) | (update_norm == 0), 1.0, param_norm / jnp.where(update_norm == 0, 1.0, update_norm))


def scale_by_layerwise_trust_ratio(stacked: Any = None, complete_sums=None) -> optax.GradientTransformation:
    """Scale each layer's update by ``||w|| / ||u||``. ``stacked`` (a tree of bools, or a function of the
    parameters returning one; ``None``: no stacked leaves) marks leaves with a leading layers axis --
    :func:`meshtron.optim.stacked_from_axes` reads it from the model's logical axes.

    ``complete_sums``: when each rank holds a share of every leaf (ZeRO), a function that turns
    per-leaf partial sums of squares into whole ones (:meth:`meshtron.optim.zero.ZeroPlan.sum_squares`)."""
    complete = complete_sums or _identity

    def init(params: optax.Params) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_layerwise_trust_ratio needs the parameters: pass params to update()")
        flags = jax.tree.map(lambda _: False, params) if stacked is None else tree_or_call(stacked, params)
        param_norms = jax.tree.map(jnp.sqrt, complete(jax.tree.map(layer_squares, params, flags)))
        update_norms = jax.tree.map(jnp.sqrt, complete(jax.tree.map(layer_squares, updates, flags)))
        scaled = jax.tree.map(lambda u, pn, un: u * per_layer(_trust_ratio(pn, un), u).astype(u.dtype),
                              updates, param_norms, update_norms)
        return scaled, state

    return optax.GradientTransformation(init, update)


def layerwise_lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask=None,
    stacked: Any = None,
    complete_sums=None,
) -> optax.GradientTransformation:
    """``optax.lamb`` with per-layer trust ratios for stacked leaves (same chain otherwise);
    ``complete_sums`` as in :func:`scale_by_layerwise_trust_ratio`."""
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask),
        scale_by_layerwise_trust_ratio(stacked, complete_sums),
        optax.scale_by_learning_rate(learning_rate),
    )
