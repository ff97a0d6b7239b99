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
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models import documents
from meshtron.models.blocks import Context
from meshtron.models.contract import final_hidden, token_losses

__all__ = ["PreferenceLoss", "head_logps", "pairs", "precomputed_reference", "preference_metrics", "sequence_logps"]

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(model: nnx.Module, tokens: jax.Array, *, remat: str = "none") -> jax.Array:
    """``[b]``: each row's summed log-probability of its counted targets (its answer), for a batch of
    packed-document features ``[b, s, 5]`` (:func:`meshtron.models.documents.document_features`)."""
    seen, ctx = documents.view(tokens), Context.for_tokens(tokens)
    return head_logps(model, final_hidden(model, seen.inputs, ctx, remat=remat), tokens)


def head_logps(model: nnx.Module, x: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[b]``: :func:`sequence_logps` from the last block's output ``x`` [b, s, h] (a pipeline's last stage)."""
    seen = documents.view(tokens)
    if seen.weights is None:
        raise ValueError("sequence_logps: needs packed-document features [b, s, 5] whose loss mask marks the answers")
    losses = token_losses(model, model.head(x), seen.targets).astype(jnp.float32)
    return -jnp.sum(jnp.where(seen.weights > 0, losses, 0.0), axis=-1)


def precomputed_reference(tokens: jax.Array) -> jax.Array:
    """``[b]``: each row's reference log-probability computed before training, which features carry
    (:data:`meshtron.models.documents.REFERENCE`) on every position."""
    reference = documents.view(tokens).reference
    if reference is None:
        raise ValueError("precomputed_reference: the features [b, s, 6] carry no reference log-probabilities")
    return reference[:, 0]


def pairs(logps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) ``[b / 2]`` of per-row values laid out pair by pair (module doc)."""
    paired = logps.reshape(-1, 2)
    return paired[:, 0], paired[:, 1]


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

    def __call__(self, policy: jax.Array, reference: jax.Array) -> jax.Array:
        """The mean loss over the pairs; the reference enters under ``stop_gradient``."""
        return jnp.mean(self.per_pair(policy, jax.lax.stop_gradient(reference)))


def preference_metrics(beta: float, policy: jax.Array, reference: jax.Array) -> dict[str, jax.Array]:
    """TRL's metrics of a batch, each a mean over its pairs: the implicit rewards ``beta·(pi - ref)`` of the
    chosen and rejected answers, how often the chosen one's is higher, their margin, and the policy's
    summed log-probabilities of each answer."""
    pi_c, pi_r = pairs(policy)
    ref_c, ref_r = pairs(reference)
    chosen, rejected = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    values = (chosen, rejected, (chosen > rejected).astype(jnp.float32), chosen - rejected, pi_c, pi_r)
    return {name: jnp.mean(v) for name, v in zip(METRICS, values)}
