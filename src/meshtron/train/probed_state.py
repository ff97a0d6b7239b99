"""State advanced from probes through the train step (:mod:`meshtron.models.probed_state`).

Each probe's gradient is a statistic of this rank's microbatches (delayed FP8 scaling's amax histogram, a
mixture of experts' expert load). The probes do not train, so the step reads those gradients before frozen
leaves leave the tree (:meth:`ProbedStates.read`), and after the update replaces each probe's state by its
kind's ``advance`` (:meth:`ProbedStates.advanced`), which reduces what it needs over the data group. Nothing
of it reaches the gradient sync or the optimizer: no reduction, no compression, no weight decay. A step the
non-finite guard skips keeps the old state too, since the guard chooses between whole parameter trees.

A checkpoint written without such state (an import, a run without it) is read with the state added fresh
(:func:`absent_from`, :func:`without_leaves`, :func:`with_fresh_leaves`): zeros, an empty history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from meshtron.models.probed_state import StepTotals
from meshtron.train.state import ModelDef
from meshtron.trees import leaf_names

__all__ = ["ProbedStates", "absent_from", "with_fresh_leaves", "without_leaves"]


@dataclass(frozen=True)
class ProbedStates:
    """``observed``: ``True`` at the probes (:attr:`meshtron.train.trainable.Trainable.observed`);
    ``model_def``: whose :attr:`~meshtron.train.state.ModelDef.probed` says how each state advances.
    ``observed`` ``None``: the model carries no such state and the step does nothing here."""

    model_def: ModelDef
    observed: Any = None

    def read(self, grads: Any, into: list) -> Any:
        """``grads``, after appending to ``into`` the probes' gradients (this rank's statistics, in tree order)."""
        if self.observed is not None:
            into.extend(g for g, seen in zip(jax.tree.leaves(grads), jax.tree.leaves(self.observed), strict=True)
                        if seen)
        return grads

    def advanced(self, params: Any, gradients: list[jax.Array], group: Any, microbatches: int) -> Any:
        """``params`` with each probe's state advanced by its kind from the probe's gradient (from
        :meth:`read`), reductions over ``group`` (the data-parallel axes) on the way."""
        if self.observed is None:
            return params
        leaves, structure = jax.tree.flatten(params)
        names = leaf_names(params)
        index = {name: i for i, name in enumerate(names)}
        kinds = dict(self.model_def.probed)
        probes = [name for name, seen in zip(names, jax.tree.leaves(self.observed), strict=True) if seen]

        def reduce(fn, x):
            # (XLA refuses a reduction over one rank of a partly manual region)
            return fn(x, group) if jax.lax.axis_size(group) > 1 else x

        totals = StepTotals(microbatches, reduce)
        for probe, gradient in zip(probes, gradients, strict=True):
            state = index[self.model_def.state_leaf(probe)]
            leaves[state] = kinds[probe].advance(leaves[state], gradient, totals).astype(leaves[state].dtype)
        return jax.tree.unflatten(structure, leaves)


def absent_from(checksums: Any, names: list[str], prefix: str) -> list[str]:
    """Which of the dotted leaf ``names`` a checkpoint whose meta record has ``checksums`` (keys: ``prefix``
    + a parameter's name) does not hold: a model trained without that state (an import, a run without
    delayed FP8 scaling or bias balancing). Without checksums to tell, none."""
    if not isinstance(checksums, dict):
        return []
    return [name for name in names if prefix + name not in checksums]


def without_leaves(tree: Any, names: list[str]) -> Any:
    """A parameter-shaped tree (nested dicts) without the leaves of dotted ``names``."""
    if not names:
        return tree
    out = dict(tree)
    for name in names:
        node = out
        *parents, last = name.split(".")
        for key in parents:
            node[key] = dict(node[key])
            node = node[key]
        del node[last]
    return out


def with_fresh_leaves(params: Any, shapes: Any, shardings: Any, names: list[str]) -> Any:
    """``params`` (without the leaves of dotted ``names``) with those leaves added as zeros of ``shapes``
    on ``shardings``: state that starts empty (an amax history, a selection bias) for a model trained
    without it."""
    out = dict(params)
    for name in names:
        node, shape, sharding = out, shapes, shardings
        *parents, last = name.split(".")
        for key in parents:
            node[key] = dict(node[key])
            node, shape, sharding = node[key], shape[key], sharding[key]
        node[last] = jax.device_put(jax.numpy.zeros(shape[last].shape, shape[last].dtype), sharding[last])
    return out
