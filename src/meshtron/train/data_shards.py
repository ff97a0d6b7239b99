"""The train step's data-parallel region: which mesh axes it is manual over, how a batch is laid out on
them, and how parameters enter it.

The step is a ``shard_map`` manual over ``data`` (and ``context`` when sequences are split): each rank
sees its slice of the batch, while ``tensor`` and ``pipe`` stay with the compiler. "The group" below is
what gradients are averaged over, :func:`meshtron.sharding.gradient_axes` -- data, or data x context as in
Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.errors import ConfigError
from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models.context_attention import sequence_order
from meshtron.models.documents import document_features, is_document_windows
from meshtron.optim.reduce import mean_over
from meshtron.sharding import Rules, axis_names, gradient_axes, logical_to_spec

__all__ = ["DataShards", "context_layout"]

DATA = "data"
CONTEXT = "context"


@dataclass(frozen=True)
class DataShards:
    """The data-parallel region of one mesh. ``ulysses``: how many consecutive context ranks the run's
    exchange joins by all-to-alls (which decides the order a split sequence is stored in)."""

    mesh: Mesh
    ulysses: int = 1

    @classmethod
    def of(cls, mesh: Mesh, rules: Rules, execution: Execution = DEFAULT_EXECUTION) -> DataShards:
        """The region of ``mesh``; a sequence split over ``context`` needs the rules to place ``seq`` there.
        ``execution``: the run's, whose exchange lays the split sequence out."""
        context = mesh.shape.get(CONTEXT, 1)
        placed = logical_to_spec(("seq",), rules)
        if context > 1 and placed[:1] != P(CONTEXT)[:1]:
            raise ConfigError(f"model.rules.seq: parallel.context={context} splits every sequence over {CONTEXT!r}, "
                              f"but the rules place the logical axis seq on {placed[0]!r}; map seq to context (the default "
                              "rule) or use parallel.context=1")
        exchange = execution.context_attention
        ulysses = context if exchange == "ulysses" else execution.ulysses_degree if exchange == "hybrid" else 1
        return cls(mesh, ulysses)

    @property
    def context(self) -> int:
        return self.mesh.shape.get(CONTEXT, 1)

    @property
    def group(self) -> str | tuple[str, ...]:
        """What gradients are averaged over: data (x context)."""
        return gradient_axes(self.mesh.shape)

    @property
    def replicas(self) -> int:
        return self.mesh.shape[DATA] * self.context

    @property
    def check_vma(self) -> bool:
        """JAX's varying-manual-axes check. With one rank in the group nothing is reduced (no collective is
        emitted: :func:`meshtron.optim.reduce.mean_over`), so values cannot be re-typed from varying to
        replicated; the check is then off, which is exact because every value lives on that one rank."""
        return self.replicas > 1

    @property
    def manual(self) -> set[str]:
        """Data and context whatever their sizes: every mesh axis before ``pipe``, so the pipeline's nested
        manual axes come in mesh order (jax 0.12's XLA aborts on a size-1 auto axis between manual ones:
        "Manual axes must be sorted by mesh axis index")."""
        return {DATA, CONTEXT} & set(self.mesh.axis_names)

    @property
    def batch_sharding(self) -> NamedSharding:
        """A global batch: plain windows ``[b, s+1]`` or packed documents' ``[b, s+1, 3]``, split by rows."""
        return NamedSharding(self.mesh, P(DATA, None))

    @property
    def shard_batch(self) -> P:
        """A rank's tokens, as :func:`context_layout` lays them out."""
        if self.context == 1:
            return P(DATA)
        return P(DATA if DATA in axis_names(self.group) else None, CONTEXT)

    @property
    def per_replica(self) -> P:
        """One value per rank of the group."""
        return P(axis_names(self.group)) if self.context > 1 else P(DATA)

    def shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=self.manual,
                             check_vma=self.check_vma)

    def local(self, params: Any, local_leaves: Any) -> Any:
        """``params`` cast to varying over the group (autodiff then returns each rank's local gradient instead
        of inserting its own reduction), except ``local_leaves``, which are local already."""
        if not self.check_vma:
            return params
        group = self.group
        return jax.tree.map(lambda x, own: x if own else jax.lax.pcast(x, group, to="varying"), params, local_leaves)

    def mean(self, value: Any) -> Any:
        """``value`` averaged over the group (nothing emitted for a group of one)."""
        return mean_over(value, self.group)

    def laid_out(self, tokens: jax.Array) -> jax.Array:
        return context_layout(tokens, self.context, self.ulysses)


def context_layout(tokens: jax.Array, ranks: int, ulysses: int = 1) -> jax.Array:
    """A batch as the train step's shards see it.

    Plain windows ``tokens`` [b, seq + 1] stay as they are on one context rank. When sequences are split
    over ``ranks`` context-parallel ranks they become ``[b, seq, 2]`` (every input token stacked with
    the one it predicts, :func:`meshtron.models.contract.next_token_pairs`), the sequence in the
    load-balanced order (:func:`meshtron.models.context_attention.balanced_order`), so that context
    rank ``r``'s equal share holds chunks ``r`` and ``2·ranks - 1 - r``; or, when the exchange joins
    groups of ``ulysses`` consecutive ranks by all-to-alls, that order over the groups
    (:func:`meshtron.models.context_attention.sequence_order`: under Ulysses alone, the sequence in
    order). Windows of packed documents
    ``[b, seq + 1, 3]`` become their features ``[b, seq, 5]``
    (:func:`meshtron.models.documents.document_features`), in that order too when split."""
    if is_document_windows(tokens):
        pairs = document_features(tokens)
    elif ranks == 1:
        return tokens
    else:
        pairs = jnp.stack([tokens[:, :-1], tokens[:, 1:]], axis=-1)
    if ranks == 1:
        return pairs
    return jnp.take(pairs, jnp.asarray(sequence_order(pairs.shape[1], ranks, ulysses)), axis=1)
