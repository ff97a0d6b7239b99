"""Direct preference optimisation's loss (Rafailov et al., 2023), IPO's (Azar et al., 2023) and
conservative DPO's label smoothing, on any contract model, in TRL's formulas and names.

A batch of preference pairs is laid out with each pair's chosen and rejected conversation side by side
on the batch axis (rows ``2k`` and ``2k + 1``), as packed-document windows (one conversation per row,
its loss mask on the answer): :func:`sequence_logps` sums each row's answer-token log-probabilities,
and for ``logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``

* ``sigmoid``: ``-logsigmoid(beta·logits)·(1 - ls) - logsigmoid(-beta·logits)·ls``;
* ``ipo``: ``(logits - 1 / (2·beta))²``;

averaged over the pairs. Because a pair never leaves its microbatch, the mean over microbatches and data
shards the train step already takes is the mean over the batch's pairs. The rewards TRL reports are
``beta·(pi - ref)`` of each answer (:func:`preference_metrics`).

**Packed pairs** (``data.pairs_per_window`` = ``K`` > 1): row ``2k`` holds the chosen conversations of up
to ``K`` pairs, each a document of its own (segment ids ``1..K``), and row ``2k + 1`` their rejected
conversations under the same ids. Every per-row value is then ``[b, K]``, one per document
(:func:`document_sums`: a sum over the positions of each segment id); slots no pair fills are masked
(``real``), and the loss and metrics are means over a microbatch's real pairs. Microbatches and data
shards weigh alike in the step's mean over them, as gradient accumulation does in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models import documents
from meshtron.models.blocks import Context
from meshtron.models.contract import final_hidden, token_losses

__all__ = ["PreferenceLoss", "document_sums", "document_targets", "head_logps", "pairs", "precomputed_reference",
           "preference_metrics", "sequence_logps"]

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(model: nnx.Module, tokens: jax.Array, *, remat: str = "none", packed: int = 0) -> jax.Array:
    """``[b]``: each row's summed log-probability of its counted targets (its answer), for a batch of
    packed-document features ``[b, s, 5]`` (:func:`meshtron.models.documents.document_features`);
    ``[b, packed]``, each document's, for rows of up to ``packed`` documents (module doc)."""
    seen, ctx = documents.view(tokens), Context.for_tokens(tokens)
    return head_logps(model, final_hidden(model, seen.inputs, ctx, remat=remat), tokens, packed=packed)


def head_logps(model: nnx.Module, x: jax.Array, tokens: jax.Array, *, packed: int = 0) -> jax.Array:
    """:func:`sequence_logps` from the last block's output ``x`` [b, s, h] (a pipeline's last stage)."""
    seen = documents.view(tokens)
    if seen.weights is None:
        raise ValueError("sequence_logps: needs packed-document features [b, s, 5] whose loss mask marks the answers")
    losses = token_losses(model, model.head(x), seen.targets).astype(jnp.float32)
    taken = jnp.where(seen.weights > 0, -losses, 0.0)
    return document_sums(taken, seen.segments, packed) if packed else jnp.sum(taken, axis=-1)


def document_sums(values: jax.Array, segments: jax.Array, packed: int) -> jax.Array:
    """``[b, packed]``: per-position ``values`` [b, s] summed over each document (segment ids ``1..packed``)."""
    ids = jnp.arange(1, packed + 1, dtype=segments.dtype)
    return jnp.sum(jnp.where(segments[..., None] == ids, values[..., None], 0.0), axis=1)


def document_targets(tokens: jax.Array, packed: int) -> jax.Array:
    """``[b, packed]``: each document's counted targets (its answer's tokens; 0: no document there)."""
    seen = documents.view(tokens)
    return document_sums((seen.weights > 0).astype(jnp.float32), seen.segments, packed)


def precomputed_reference(tokens: jax.Array, packed: int = 0) -> jax.Array:
    """``[b]``: each row's reference log-probability computed before training, which features carry
    (:data:`meshtron.models.documents.REFERENCE`) on every position; ``[b, packed]`` for rows of documents,
    each position carrying its own document's (``-inf`` where a row holds no such document)."""
    seen = documents.view(tokens)
    if seen.reference is None:
        raise ValueError("precomputed_reference: the features [b, s, 6] carry no reference log-probabilities")
    if not packed:
        return seen.reference[:, 0]
    ids = jnp.arange(1, packed + 1, dtype=seen.segments.dtype)
    return jnp.max(jnp.where(seen.segments[..., None] == ids, seen.reference[..., None], -jnp.inf), axis=1)


def pairs(logps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) ``[b / 2, ...]`` of per-row values laid out pair by pair (module doc)."""
    paired = logps.reshape(-1, 2, *logps.shape[1:])
    return paired[:, 0], paired[:, 1]


def _mean(values: jax.Array, real: jax.Array | None) -> jax.Array:
    """The mean of ``values`` over the real pairs (``real``: a mask of them; ``None``: all are)."""
    if real is None:
        return jnp.mean(values)
    return jnp.sum(jnp.where(real, values, 0.0)) / jnp.maximum(jnp.sum(real.astype(jnp.float32)), 1.0)


@dataclass(frozen=True)
class PreferenceLoss:
    """``train.dpo``'s loss: ``beta``, ``label_smoothing`` and ``kind`` (``sigmoid`` or ``ipo``)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    kind: str = "sigmoid"

    def per_pair(self, policy: jax.Array, reference: jax.Array) -> jax.Array:
        """``[b / 2]`` losses of the pairs, from the policy's and the reference's per-row log-probabilities."""
        pi_c, pi_r = pairs(policy)
        ref_c, ref_r = pairs(reference)
        logits = (pi_c - pi_r) - (ref_c - ref_r)
        if self.kind == "ipo":
            return (logits - 1.0 / (2.0 * self.beta)) ** 2
        ls = self.label_smoothing
        return -jax.nn.log_sigmoid(self.beta * logits) * (1.0 - ls) - jax.nn.log_sigmoid(-self.beta * logits) * ls

    def __call__(self, policy: jax.Array, reference: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """The mean loss over the (``real``: masked) pairs; the reference enters under ``stop_gradient``."""
        return _mean(self.per_pair(policy, jax.lax.stop_gradient(reference)), real)


def preference_metrics(beta: float, policy: jax.Array, reference: jax.Array,
                       real: jax.Array | None = None) -> dict[str, jax.Array]:
    """TRL's metrics of a batch, each a mean over its (``real``: masked) pairs: the implicit rewards
    ``beta·(pi - ref)`` of the chosen and rejected answers, how often the chosen one's is higher, their
    margin, and the policy's summed log-probabilities of each answer."""
    pi_c, pi_r = pairs(policy)
    ref_c, ref_r = pairs(reference)
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    values = (chosen, rejected, (chosen > rejected).astype(jnp.float32), chosen - rejected, pi_c, pi_r)
    return {name: _mean(v, real) for name, v in zip(METRICS, values)}
