"""Which parameters training updates, as one mask that travels with the training state.

Fine-tuning methods differ only in this mask (LoRA trains its adapters, a frozen embedding trains
everything else); the step, the gradient sync and the optimizer read the mask and never the method. Frozen
leaves enter differentiation under ``stop_gradient`` -- no gradient is formed for them -- and are ``None``
in the trees the reduction and the optimizer see (levanter's ``trainables_only``; optax's own transforms
treat a ``None`` leaf as absent), so nothing of them crosses the data group and they hold no optimizer
state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from meshtron.train.state import ModelDef
from meshtron.trees import leaf_names

__all__ = ["Trainable"]


@dataclass(frozen=True)
class Trainable:
    """``mask``: a tree shaped like the parameters, ``True`` where a leaf trains; ``None``: every leaf trains.
    ``observed``: ``True`` where a leaf that does not train is differentiated all the same, its gradient read
    by the step rather than applied (a probe, :mod:`meshtron.models.probed_state`)."""

    mask: Any = None
    observed: Any = None

    @classmethod
    def of_model(cls, model_def: ModelDef) -> Trainable:
        """What trains in ``model_def``: everything, or what its adaptation says (LoRA: the adapters); never
        state advanced from probes, nor the probes."""
        adaptation, state = model_def.adaptation, jax.tree.leaves(model_def.probed_state())
        if adaptation is None and not any(state):
            return cls()
        shapes = model_def.shapes()
        names = leaf_names(shapes)
        trains = [(adaptation is None or adaptation.trains(n)) and not kept for n, kept in zip(names, state, strict=True)]
        probes = dict(model_def.probed)
        observed = [n in probes for n in names]
        structure = jax.tree.structure(shapes)
        return cls(jax.tree.unflatten(structure, trains),
                   jax.tree.unflatten(structure, observed) if any(observed) else None)

    @property
    def is_partial(self) -> bool:
        """Whether some leaves are frozen."""
        return self.mask is not None

    def stopped(self, params: Any) -> Any:
        """``params`` as differentiation should see them: frozen leaves under ``stop_gradient``."""
        if self.mask is None:
            return params
        observed = self.observed if self.observed is not None else jax.tree.map(lambda _: False, self.mask)
        return jax.tree.map(lambda keep, seen, x: x if keep or seen else jax.lax.stop_gradient(x),
                            self.mask, observed, params)

    def part(self, tree: Any) -> Any:
        """The trainable part of a parameter-shaped ``tree``: its frozen leaves ``None``."""
        if self.mask is None:
            return tree
        return jax.tree.map(lambda keep, x: x if keep else None, self.mask, tree)

    def completed(self, part: Any, whole: Any) -> Any:
        """``part`` (from :meth:`part`) with ``whole``'s frozen leaves put back."""
        if self.mask is None:
            return part
        return jax.tree.map(lambda keep, x, y: x if keep else y, self.mask, part, whole)
