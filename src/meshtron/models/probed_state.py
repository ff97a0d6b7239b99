"""Training state that a step advances from what the forward saw, carried out by a probe's gradient.

Some layers keep state that is not a trained weight but is updated every step from statistics of that
step's forward (or backward) pass: delayed FP8 scaling's amax history (:mod:`meshtron.models.fp8_scaling`),
a mixture of experts' selection bias for aux-loss-free balancing (:mod:`meshtron.models.moe`). A block
cannot return those statistics -- what it returns is fixed by the layer scan, recomputation and every
pipeline schedule -- so each such state sits beside a *probe*: a parameter of zeros that the layer
differentiates through, whose gradient is the statistic. Every schedule already carries gradients out
of every layer, so the statistic reaches the step with no new output of the block.

A layer declares each such pair as a :class:`ProbedState` in its module attribute :data:`PROBED`; the
model's structure (:meth:`meshtron.train.state.ModelDef.probed`) finds them by the probe leaf's dotted
name, and the step (:mod:`meshtron.train.probed_state`) reads the probes' gradients before frozen leaves
leave the tree and, after the update, replaces each state by :attr:`ProbedState.advance` of it.
Neither leaf is trained: no gradient of the state is formed, neither has optimizer state or weight decay,
and a step the non-finite guard skips keeps the old state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx

__all__ = ["PROBED", "ProbedState", "StepTotals", "declared"]

PROBED = "probed_states"  # the module attribute that holds a layer's ProbedState tuple


@dataclass(frozen=True)
class StepTotals:
    """What an :attr:`ProbedState.advance` needs to know of the step: its ``microbatches`` (a probe's
    gradient is the mean over them of what each microbatch's backward gave it, as for every gradient)
    and ``reduce(fn, x)``: ``fn`` (``jax.lax.psum``, ``jax.lax.pmax``, ...) of ``x`` over the data
    group (each rank saw other tokens), the identity on one rank."""

    microbatches: int
    reduce: Callable[[Callable[..., jax.Array], jax.Array], jax.Array]


@dataclass(frozen=True)
class ProbedState:
    """A state leaf named ``state`` and its probe, the leaf named ``probe`` of the same module.

    ``advance(state, gradient, totals)``: the state after a step whose probe received ``gradient`` on this
    rank (:class:`StepTotals` for the rest). Called inside the step's data-parallel region; the state has
    the probe's leading axes (``[layers, ...]`` in a block)."""

    state: str
    probe: str
    advance: Callable[[jax.Array, jax.Array, StepTotals], jax.Array]


def declared(model: nnx.Module) -> dict[str, ProbedState]:
    """Every :class:`ProbedState` ``model``'s modules declare, by the dotted name of its probe leaf in the
    model's parameter tree (``blocks.mlp.expert_load``)."""
    found = {}
    for path, node in nnx.iter_graph(model):
        for kind in getattr(node, PROBED, ()) if isinstance(node, nnx.Module) else ():
            found[".".join(map(str, (*path, kind.probe)))] = kind
    return found
