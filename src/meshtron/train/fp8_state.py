"""Delayed FP8 scaling's state through the train step: what this step's GEMMs saw goes into the amax history.

The gradient of each block's probe (``fp8_observed``, :mod:`meshtron.models.fp8_scaling`) is a histogram of
the amax exponents its FP8 GEMMs saw -- the forward's operands and the backward's output gradients -- summed
over this rank's microbatches. The probe does not train, so the step reads that gradient before frozen
leaves leave the tree (:meth:`ScalingState.read`), and after the update rolls each site's highest
exponent, the largest over the data group (each rank saw other tokens), into the history beside the probe
(:meth:`ScalingState.advanced`). Nothing of it reaches the gradient sync or the optimizer: no reduction,
no compression, no weight decay. A step the non-finite guard skips keeps the old history too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from meshtron.models.fp8_scaling import HISTORY, OBSERVED, observed_bounds, rolled
from meshtron.trees import leaf_names

__all__ = ["ScalingState", "holds_scaling_state", "with_fresh_scaling_state", "without_scaling_state"]


@dataclass(frozen=True)
class ScalingState:
    """``observed``: ``True`` at the probes (:attr:`meshtron.train.trainable.Trainable.observed`); ``None``:
    the model carries no delayed scaling and the step does nothing here."""

    observed: Any = None

    def read(self, grads: Any, into: list) -> Any:
        """``grads``, after appending to ``into`` the probes' gradients (this rank's histograms, in tree order)."""
        if self.observed is not None:
            into.extend(g for g, seen in zip(jax.tree.leaves(grads), jax.tree.leaves(self.observed), strict=True)
                        if seen)
        return grads

    def advanced(self, params: Any, histograms: list[jax.Array], group: Any) -> Any:
        """``params`` with each history rolled by the highest exponent its probe's histogram (from
        :meth:`read`) holds on any rank of ``group`` (the data-parallel axes)."""
        if self.observed is None:
            return params
        leaves, structure = jax.tree.flatten(params)
        names = leaf_names(params)
        index = {name: i for i, name in enumerate(names)}
        probes = [name for name, seen in zip(names, jax.tree.leaves(self.observed), strict=True) if seen]
        for probe, histogram in zip(probes, histograms, strict=True):
            history = index[probe[:-len(OBSERVED)] + HISTORY]
            bounds = observed_bounds(histogram)
            if jax.lax.axis_size(group) > 1:  # (XLA refuses a reduction over one rank of a partly manual region)
                bounds = jax.lax.pmax(bounds, group)
            leaves[history] = rolled(leaves[history], bounds)
        return jax.tree.unflatten(structure, leaves)


def holds_scaling_state(meta: dict[str, Any] | None) -> bool:
    """Whether the checkpoint of the meta record ``meta`` was written by a run with delayed FP8 scaling."""
    config = (meta or {}).get("config") or {}
    return (config.get("model") or {}).get("fp8") == "delayed"


def without_scaling_state(tree: Any) -> Any:
    """A parameter-shaped tree (nested dicts) without delayed FP8 scaling's leaves."""
    if not isinstance(tree, dict):
        return tree
    return {k: without_scaling_state(v) for k, v in tree.items() if k not in (HISTORY, OBSERVED)}


def with_fresh_scaling_state(params: Any, shapes: Any, shardings: Any) -> Any:
    """``params`` (without the state) with delayed FP8 scaling's leaves of ``shapes`` added as zeros -- an
    empty history -- on ``shardings``: a model trained without it, fine-tuned with it."""
    if not isinstance(shapes, dict):
        return params
    out = dict(params)
    for key, shape in shapes.items():
        if key in (HISTORY, OBSERVED):
            out[key] = jax.device_put(jax.numpy.zeros(shape.shape, shape.dtype), shardings[key])
        elif isinstance(shape, dict):
            out[key] = with_fresh_scaling_state(params[key], shape, shardings[key])
    return out
