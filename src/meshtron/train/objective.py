"""What the train step minimises (``train.objective``): the next-token loss, or direct preference
optimisation's loss over pairs with a frozen reference model.

An objective is what the step's two gradient sources need of it: without a pipeline,
``loss(model_def, params, tokens, execution)``, the mean over one microbatch of one data rank; in a
pipeline, ``head_loss(model, y, tokens)``, the same from the last block's output at the last stage, of
each microbatch as :meth:`~Objective.pipelined_rows` lays it out, traced in :meth:`~Objective.pipelined`.
``metrics`` are what it reports besides the loss. The step averages all of them over microbatches and
data ranks. Preference pairs sit side by side in every microbatch (:mod:`meshtron.data.preference`), so
that mean is the batch's mean over its pairs.

**The reference** is the frozen base of a model adaptation (LoRA): the same parameters without the
adapters, so the step holds no second copy of the model. Without a pipeline it is a second forward
traced without the adaptation's layer view (:meth:`~meshtron.train.state.ModelDef.frozen_base`), under
``stop_gradient``, with no backward. A pipeline's stages run one network over a microbatch, so there each
microbatch's rows are doubled, the copies marked as the reference's (``reference_rows`` of the trace
context: the adapters add nothing to them), and the last stage reads both halves' log-probabilities; the
copies' backward carries zeros.

**The whole model** trains against the starting (``train.init_from``) weights, whose log-probabilities
the loss reads from the batch (a sixth feature, :func:`~meshtron.models.preference.precomputed_reference`;
``carried``): either a frozen copy of those weights, an argument of the train step held in the
parameters' layout without gradient or optimizer state, runs a forward over the step's batch inside the
step and adds them there (:class:`meshtron.train.step.StepInputs`; in a pipeline the forward-only
schedule, each stage's layers on their own devices), or, with ``train.dpo.precompute_reference``, one
pass before training computes every pair's (:mod:`meshtron.train.reference_pass`) and no second copy of
the model is held at all (with LoRA that also saves the reference's forward and, in a pipeline, the
doubled rows).

**Over context ranks** each rank holds a share of every sequence, so an answer's log-probability is the
ranks' shares summed (:meth:`Preference.summed`); the policy's is summed so that the step's mean over the
ranks gives each rank's positions their own gradient (:meth:`Preference.whole`).

**Packed pairs** (``data.pairs_per_window`` > 1): every value above is per document of a row rather than
per row, and the loss and metrics are means over the microbatch's real pairs (:meth:`Preference.real`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.config import Config, TrainConfig
from meshtron.errors import ConfigError
from meshtron.execution import Execution
from meshtron.models.contract import head_loss
from meshtron.models.preference import (
    METRICS,
    PreferenceLoss,
    document_targets,
    head_logps,
    pairs,
    precomputed_reference,
    preference_metrics,
    sequence_logps,
)
from meshtron.trace_context import using
from meshtron.train.data_shards import CONTEXT
from meshtron.train.state import ModelDef, Params

__all__ = ["LanguageModeling", "Objective", "Preference", "check_objective_data", "frozen_copy", "objective_for",
           "window_channels"]


class Objective(Protocol):
    METRICS: tuple[str, ...]  # the names of what :meth:`metrics` reports
    packed: int  # rows hold up to this many packed pairs, each document's values apart (0: one a window pair)

    def loss(self, model_def: ModelDef, params: Params, tokens: jax.Array, execution: Execution) -> jax.Array:
        """The mean loss of one microbatch ``tokens`` (as the step lays batches out)."""

    def metrics(self, model_def: ModelDef, params: Params, tokens: jax.Array,
                execution: Execution) -> dict[str, jax.Array]:
        """What the run reports besides the loss, as means over the microbatch (``{}``: nothing)."""

    def head_loss(self, model: nnx.Module, y: jax.Array, tokens: jax.Array) -> jax.Array:
        """A pipeline's last stage: the mean loss of a microbatch from the last block's output ``y``."""

    def pipelined_rows(self, tokens: jax.Array) -> jax.Array:
        """Microbatches ``[m, rows, ...]`` as a pipeline runs them."""

    def pipelined(self) -> contextlib.AbstractContextManager:
        """What a pipeline's stages are traced in."""

    def head_metrics(self, rows: jax.Array, tokens: jax.Array) -> dict[str, jax.Array]:
        """:meth:`metrics` of microbatches ``tokens`` [m, rows, ...] from their rows' summed log-probabilities
        ``rows`` [m, ...] as a pipeline's last stage computes them, of the rows :meth:`pipelined_rows` lays out."""


@dataclass(frozen=True)
class LanguageModeling:
    """The mean next-token loss (with a model's further loss in its gradient): ``train.objective: lm``."""

    METRICS = ()
    packed = 0

    def loss(self, model_def: ModelDef, params: Params, tokens: jax.Array, execution: Execution) -> jax.Array:
        return model_def.loss(params, tokens, execution)

    def metrics(self, model_def: ModelDef, params: Params, tokens: jax.Array,
                execution: Execution) -> dict[str, jax.Array]:
        return {}

    def head_loss(self, model: nnx.Module, y: jax.Array, tokens: jax.Array) -> jax.Array:
        return head_loss(model, y, tokens)

    def pipelined_rows(self, tokens: jax.Array) -> jax.Array:
        return tokens

    def pipelined(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def head_metrics(self, rows: jax.Array, tokens: jax.Array) -> dict[str, jax.Array]:
        return {}


@dataclass(frozen=True)
class Preference:
    """DPO (``train.objective: dpo``) with the frozen base of a model adaptation as its reference, or
    (``carried``) the reference's log-probabilities that the batch carries (module doc); ``packed``: up to
    that many pairs a window pair, each answer's values per document (0: one pair a window pair;
    :mod:`meshtron.models.preference`)."""

    preference: PreferenceLoss
    carried: bool = False
    context: int = 1  # the context ranks each sequence is split over
    packed: int = 0
    METRICS = METRICS

    def logps(self, model_def: ModelDef, params: Params, tokens: jax.Array,
              execution: Execution) -> tuple[jax.Array, jax.Array]:
        """Per-row (``packed``: per-document) summed answer log-probabilities: the policy's, and the
        reference's (no gradient)."""
        policy = self.whole(sequence_logps(model_def.bind(params), tokens, remat=execution.remat, packed=self.packed))
        if self.carried:
            return policy, self.carried_reference(tokens)
        with model_def.frozen_base():
            reference = sequence_logps(model_def.bind(jax.lax.stop_gradient(params)), tokens, packed=self.packed)
        return policy, jax.lax.stop_gradient(self.summed(reference))

    def loss(self, model_def: ModelDef, params: Params, tokens: jax.Array, execution: Execution) -> jax.Array:
        return self.preference(*self.logps(model_def, params, tokens, execution), self.real(tokens))

    def metrics(self, model_def: ModelDef, params: Params, tokens: jax.Array,
                execution: Execution) -> dict[str, jax.Array]:
        return preference_metrics(self.preference.beta, *self.logps(model_def, params, tokens, execution),
                                  self.real(tokens))

    def head_loss(self, model: nnx.Module, y: jax.Array, tokens: jax.Array) -> jax.Array:
        if self.carried:
            return self.preference(self.whole(head_logps(model, y, tokens, packed=self.packed)),
                                   self.carried_reference(tokens), self.real(tokens))
        policy, reference = jnp.split(head_logps(model, y, tokens, packed=self.packed), 2)
        return self.preference(self.whole(policy), self.summed(reference), self.real(jnp.split(tokens, 2)[0]))

    def carried_reference(self, tokens: jax.Array) -> jax.Array:
        """The reference's values the batch carries: a row's, or (``packed``) each document's, taken over
        the context ranks (a document may lie on some of them only); 0 where no document is."""
        if not self.packed:
            return precomputed_reference(tokens)
        found = precomputed_reference(tokens, self.packed)
        found = found if self.context == 1 else jax.lax.pmax(found, CONTEXT)
        return jnp.where(jnp.isfinite(found), found, 0.0)

    def real(self, tokens: jax.Array) -> jax.Array | None:
        """``packed``: ``[pairs, packed]``, which slots of each window pair hold a pair (its answers have
        counted targets, summed over the context ranks); ``None``: every pair is one."""
        if not self.packed:
            return None
        chosen, rejected = pairs(self.summed(document_targets(tokens, self.packed)))
        return (chosen > 0) & (rejected > 0)

    def head_metrics(self, rows: jax.Array, tokens: jax.Array) -> dict[str, jax.Array]:
        """The batch's metrics from a pipeline's per-row (``packed``: per-document) sums ``rows``
        ``[m, rows, ...]``: each microbatch's means over its (real) pairs, which lie whole in it, averaged
        over the microbatches, as :meth:`metrics` is averaged outside a pipeline (packed microbatches hold
        different numbers of real pairs, so this is not the mean over the batch's pairs)."""
        def of_microbatch(found: tuple[jax.Array, jax.Array]) -> dict[str, jax.Array]:
            mb_rows, mb_tokens = found
            if self.carried:
                policy, reference = mb_rows, self.carried_reference(mb_tokens)
            else:
                policy, reference = jnp.split(mb_rows, 2)
                reference = self.summed(reference)
            return preference_metrics(self.preference.beta, self.summed(policy), reference, self.real(mb_tokens))

        return jax.tree.map(lambda v: jnp.mean(v, axis=0), jax.lax.map(of_microbatch, (rows, tokens)))

    def summed(self, local: jax.Array) -> jax.Array:
        """Per-row sums over a sequence split over ``context`` ranks: each rank's share summed over them."""
        return local if self.context == 1 else jax.lax.psum(local, CONTEXT)

    def whole(self, local: jax.Array) -> jax.Array:
        """:meth:`summed` of the policy's shares, whose gradient reaches each rank's own positions at
        ``context`` times their weight: the step averages every rank's loss and gradient over the context
        ranks (as it does the next-token loss's per-rank means), which brings the rank's share of the
        gradient back to its own, and their sum to the whole sequence's."""
        if self.context == 1:
            return local
        scaled = self.context * local
        return scaled + jax.lax.stop_gradient(self.summed(local) - scaled)

    def pipelined_rows(self, tokens: jax.Array) -> jax.Array:
        """Each microbatch's rows, then (a reference that runs) the same rows again for the reference."""
        return tokens if self.carried else jnp.concatenate([tokens, tokens], axis=1)

    def pipelined(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.carried else using(reference_rows=True)


def objective_for(cfg: Config, model_def: ModelDef) -> Objective:
    """``train.objective`` of ``cfg`` for ``model_def``; one line for what this step cannot train."""
    t = cfg.train
    if t.objective == "lm":
        return LanguageModeling()
    carried = model_def.adaptation is None or t.dpo.precompute_reference
    packed = cfg.data.pairs_per_window if cfg.data.pairs_per_window > 1 else 0
    return Preference(PreferenceLoss(t.dpo.beta, t.dpo.label_smoothing, t.dpo.loss), carried, cfg.mesh.context,
                      packed)


def window_channels(t: TrainConfig, documents: bool) -> tuple[int, ...]:
    """The channels of a batch's windows the step takes: none for plain windows, 3 for packed documents
    (``documents``) and preference pairs (one conversation a window), 4 where the batch carries the
    precomputed reference's log-probabilities (a frozen copy's the step adds itself)."""
    if t.objective == "dpo":
        return (4,) if t.dpo.precompute_reference else (3,)
    return (3,) if documents else ()


def frozen_copy(cfg: Config) -> bool:
    """Whether ``cfg``'s run holds a frozen copy of its starting weights as DPO's reference (the whole model
    trains, and the reference's log-probabilities are not precomputed)."""
    t = cfg.train
    return t.objective == "dpo" and not t.lora.rank and not t.dpo.precompute_reference


def check_objective_data(objective: str, preference: bool) -> None:
    """``train.objective`` against the data: DPO trains on pairs, the next-token loss on anything else."""
    if objective == "dpo" and not preference:
        raise ConfigError("train.objective: dpo trains on preference pairs, and data.path is not a dataset of them; "
                          "make one with meshtron preprocess --preference (JSON lines of prompt, chosen, rejected)")
    if objective != "dpo" and preference:
        raise ConfigError("data.path: holds preference pairs (meshtron preprocess --preference), which train with "
                          "train.objective=dpo; set it, or give next-token data")
