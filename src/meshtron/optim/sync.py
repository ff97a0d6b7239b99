"""How one step's local gradients cross the data group: one strategy per :class:`ZeroPlan`, chosen once.

Every strategy answers the same three questions for the train step, so the step is one composition --
gradients, then this sync, then the optimizer -- whatever the zero level or the model's layout:

* :meth:`GradientSync.reduced`: what the parameters look like while gradients are taken (whole, gathered
  once from shares, or each layer gathered as it runs), and how the local gradients are averaged (the
  ``reduction`` transform, a reduce-scatter into shares, or complete where they are held);
* :meth:`GradientSync.updated`: the updated parameters as the step hands them back (shares gathered
  again at zero=1, kept as shares at zero=3);
* :meth:`GradientSync.agreed`: a per-rank verdict (the non-finite guard's) made the same on every rank
  when ranks saw different shares of the update.

The five strategies: an all-reduce through ``reduction`` (zero=0; :class:`AllReduce`); the same with
leaves the model splits over data itself -- a mixture of experts' experts, complete where held and only
divided by the group's size (:class:`ExpertLocal`); zero=1's reduce-scatter then all-gather
(:class:`ScatterGather`); zero=3 with parameters gathered once when the step starts
(:class:`GatheredOnce`); zero=3 with each layer gathered as it runs and its gradient reduce-scattered as
it is made (:class:`PerLayer`). A new strategy is one class here and one line in :func:`gradient_sync`.

Trees handed to a strategy may hold ``None`` for a frozen leaf (:class:`meshtron.train.trainable.Trainable`):
nothing of it is reduced, split or gathered. All methods run inside the step's ``shard_map`` manual over
the data group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from meshtron.optim.reduce import mean_over
from meshtron.optim.zero import ZeroPlan

__all__ = ["STACKED_LAYERS", "GradientSync", "Reduced", "gradient_sync"]

STACKED_LAYERS = frozenset({"blocks"})  # the contract's stacked layers: gathered one layer at a time at zero=3

Differentiate = Callable[..., tuple[jax.Array, Any]]
"""``(params, local_leaves, layer_view=None) -> (loss, trainable gradients)``: the step's gradient of its
own tokens. ``local_leaves`` marks leaves that are already local to this rank (not cast to varying);
``layer_view`` (a :meth:`ZeroPlan.layer_view`) is installed while the layers run."""


class Reduced(NamedTuple):
    """What the optimizer needs: the loss, the averaged gradients, the parameters it updates (whole, or
    this rank's shares), the reduction's new state, and the whole gradient's norm."""

    loss: jax.Array
    grads: Any
    params: Any
    reduction_state: Any
    grad_norm: jax.Array


@dataclass(frozen=True)
class GradientSync(ABC):
    """The strategy's shared parts; subclasses say how gradients are reduced."""

    plan: ZeroPlan
    reduction: optax.GradientTransformation

    @property
    def local_leaves(self) -> Any:
        """Leaves local to each rank whatever the strategy (split over the group by the model itself)."""
        return self.plan.native_flags()

    @abstractmethod
    def reduced(self, differentiate: Differentiate, params: Any, trainable: Any, reduction_state: Any) -> Reduced:
        """``params``: the whole tree as the step holds it; ``trainable``: its trainable part."""

    def updated(self, params: Any) -> Any:
        """The updated trainable parameters as the step returns them."""
        return params

    def agreed(self, verdict: jax.Array) -> jax.Array:
        """``verdict`` (a bool) true on every rank only if it is on all of them."""
        return verdict

    def averaged(self, loss: jax.Array, grads: Any) -> tuple[jax.Array, Any]:
        """Loss and whole gradients averaged over the group, for analysis (no optimizer, every leaf whole)."""
        local = self.local_leaves
        shared = mean_over(_without(grads, local), self.plan.axis)
        return mean_over(loss, self.plan.axis), self.plan.mean_native(_merged(shared, grads, local))

    def norm(self, grads: Any) -> jax.Array:
        """The whole gradient's norm when ranks hold shares of it (split and local leaves summed over the group)."""
        squares = jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)
        return jnp.sqrt(sum(jax.tree.leaves(self.plan.sum_squares(squares))))


def _on_every_rank(verdict: jax.Array, axis) -> jax.Array:
    """``verdict`` (a bool) true on every rank of ``axis`` only if it is on all of them."""
    return jax.lax.pmin(verdict.astype(jnp.int32), axis) > 0


class AllReduce(GradientSync):
    """zero=0: every rank holds everything; ``reduction`` (an all-reduce, or nothing for an optimizer that
    reduces itself) averages the gradients."""

    def reduced(self, differentiate, params, trainable, reduction_state):
        loss, grads = differentiate(params, self.local_leaves)
        grads, reduction_state = self.reduction.update(grads, reduction_state, trainable)
        return Reduced(loss, grads, trainable, reduction_state, optax.tree.norm(grads))


class ExpertLocal(GradientSync):
    """zero=0 with leaves the model splits over the group (experts): ``reduction`` averages what every rank
    holds whole; the local leaves are complete where they are held and only divided by the group's size."""

    def reduced(self, differentiate, params, trainable, reduction_state):
        local = self.local_leaves
        loss, grads = differentiate(params, local)
        shared, reduction_state = self.reduction.update(_without(grads, local), reduction_state,
                                                        _without(trainable, local))
        grads = self.plan.mean_native(_merged(shared, grads, local))
        return Reduced(loss, grads, trainable, reduction_state, self.norm(grads))

    def agreed(self, verdict):
        # Each rank updates its own experts, so each judges other updates: all must pass.
        return _on_every_rank(verdict, self.plan.axis)


class _Sharded(GradientSync):
    """zero=1/3: gradients reduce-scattered into shares, each rank updating its own."""

    def agreed(self, verdict):
        return _on_every_rank(verdict, self.plan.axis)


class ScatterGather(_Sharded):
    """zero=1: whole parameters; the gradient reduce-scattered, the updated shares all-gathered."""

    def reduced(self, differentiate, params, trainable, reduction_state):
        loss, grads = differentiate(params, self.local_leaves)
        grads = self.plan.scatter_mean(grads)
        return Reduced(loss, grads, self.plan.shard(trainable), reduction_state, self.norm(grads))

    def updated(self, params):
        return self.plan.gather(params)


class GatheredOnce(_Sharded):
    """zero=3, gathered once: the shares all-gathered when the step starts (zero=1's traffic, zero=0's
    parameter memory while the step runs), the gradient reduce-scattered."""

    def reduced(self, differentiate, params, trainable, reduction_state):
        loss, grads = differentiate(self.plan.gather(params, for_compute=True), self.local_leaves)
        grads = self.plan.scatter_mean(grads, like=trainable)
        return Reduced(loss, grads, trainable, reduction_state, self.norm(grads))


class PerLayer(_Sharded):
    """zero=3 (fully sharded data parallelism): each layer's parameters all-gathered just before it runs,
    forward and again for the backward, its gradient reduce-scattered as it is made; the rest gathered
    once."""

    def reduced(self, differentiate, params, trainable, reduction_state):
        plan = self.plan
        whole = plan.gather(params, keep=STACKED_LAYERS, for_compute=True)
        local = jax.tree.map(lambda split, own: split or own, plan.arrives_split(STACKED_LAYERS), self.local_leaves)
        loss, grads = differentiate(whole, local, plan.layer_view())
        grads = plan.scatter_mean(grads, summed=STACKED_LAYERS, like=trainable)
        return Reduced(loss, grads, trainable, reduction_state, self.norm(grads))


def gradient_sync(plan: ZeroPlan, reduction: optax.GradientTransformation) -> GradientSync:
    """The strategy for ``plan`` (every strategy passes a frozen leaf's ``None`` through)."""
    if not plan.active:
        return (ExpertLocal if plan.has_native else AllReduce)(plan, reduction)
    if not plan.shards_params:
        return ScatterGather(plan, reduction)
    return (GatheredOnce if plan.gather_once else PerLayer)(plan, reduction)


def _without(tree: Any, drop: Any) -> Any:
    """``tree`` with ``None`` where ``drop`` is true (a frozen leaf's ``None`` stays)."""
    return jax.tree.map(lambda x, d: None if d else x, tree, drop, is_leaf=lambda x: x is None)


def _merged(kept: Any, tree: Any, drop: Any) -> Any:
    """``kept`` (from :func:`_without`) with ``tree``'s leaves where ``drop`` is true."""
    return jax.tree.map(lambda d, x, k: x if d else k, drop, tree, kept, is_leaf=lambda x: x is None)
