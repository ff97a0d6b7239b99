"""A pipeline stage's projection weights in the compute dtype, cast (and joined) once per step.

A projection multiplies in the compute dtype (``model.dtype``, bf16) by its float32 parameter cast
down, and a fused projection (query/key/value, gate/up) by its kernels joined into one. A pipeline stage
runs each of its layers once per microbatch, and again in a recomputation or a zero-bubble W pass, so
without more each cast and each join is a pass over the weight per microbatch: it reads the float32
weight and writes a bf16 copy, ``m`` times a step for ``m`` microbatches. Megatron-LM holds the model's
weights in bf16, made once per step from the float32 main parameters.

Here a stage does the same, before its tick loop (:func:`meshtron.train.pipelined.stage_functions`'
``prepare``): :func:`cast_weights` traces one layer recording the weight each projection multiplies
by, as that projection computes it (cast, joined, an adapter merged in), and keeps only that
computation; the stage runs it once per layer. Every use then multiplies by its recorded entry
(:class:`PreparedCasts` in :attr:`meshtron.trace_context.TraceContext.cast_weights`), the
projections in the order they ran when recorded. An entry is the value the use would compute, bit
for bit. Gradients still reach the parameters: :func:`prepared` returns the entry but hands the
cotangent to the weight as the use computed it, so the cast's and the join's transposes carry it to
the float32 parameters as before, and the use's own cast, which nothing reads, is dropped by XLA.

The cost is the stage's weights in the compute dtype, held for the whole step (half the float32
parameters' bytes for bf16). A layer whose projections run inside a nested trace of their own (a
``shard_map``, a ``cond``) or whose weights depend on the activations cannot be recorded so;
:func:`cast_weights` then returns ``None`` and every use casts for itself, as without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.interpreters.partial_eval import dce_jaxpr

from meshtron.trace_context import current, using

__all__ = ["PreparedCasts", "cast_weights", "prepared", "prepared_entry", "preparing", "recording"]


class _Recording:
    """The weights a traced layer's projections multiply by, in the order they run (:func:`cast_weights`)."""

    def __init__(self):
        self.entries: list[jax.Array] = []


class PreparedCasts:
    """One layer's projection weights made beforehand (the entries :func:`cast_weights` returned), handed to
    its projections in the order they run. Set as :attr:`meshtron.trace_context.TraceContext.cast_weights`
    while the layer is traced (:func:`meshtron.models.blocks.run_layer` does)."""

    def __init__(self, entries: list[jax.Array]):
        self.entries, self.used = list(entries), 0

    def next(self, w: jax.Array) -> jax.Array:
        """The next projection's entry, checked against the weight ``w`` the projection computed."""
        if self.used == len(self.entries):
            raise ValueError(f"weights cast beforehand for {len(self.entries)} projections; the layer runs more "
                             f"(a projection by {w.shape} {w.dtype})")
        entry = self.entries[self.used]
        self.used += 1
        if (entry.shape, entry.dtype) != (w.shape, w.dtype):
            raise ValueError(f"weight cast beforehand as {entry.shape} {entry.dtype} for a projection by {w.shape} "
                             f"{w.dtype}: the layer runs its projections in another order than it was prepared in")
        return entry

    def check_complete(self) -> None:
        if self.used != len(self.entries):
            raise ValueError(f"weights cast beforehand for {len(self.entries)} projections; the layer ran {self.used}")


def preparing() -> bool:
    """Whether projections traced now multiply by weights made beforehand, or record them."""
    return current().cast_weights is not None


def prepared_entry(w: jax.Array) -> jax.Array | None:
    """The entry made beforehand for the projection by ``w`` (the weight as the projection computes it, in the
    compute dtype), or ``None``: nothing is prepared, or this trace records (``w`` is then recorded). For a
    projection that differentiates its weight itself (a ``custom_vjp`` whose forward would multiply by the
    entry and whose backward still returns the weight's cotangent)."""
    casts = current().cast_weights
    if casts is None:
        return None
    if isinstance(casts, _Recording):
        casts.entries.append(jax.lax.stop_gradient(w))
        return None
    return casts.next(w)


def prepared(w: jax.Array) -> jax.Array:
    """``w``, the weight a projection multiplies by, as made beforehand where a stage prepared it: the
    entry's value, with ``w``'s cotangent (the entry itself is not differentiated)."""
    entry = prepared_entry(w)
    return w if entry is None else _substituted(w, entry)


@jax.custom_vjp
def _substituted(w: jax.Array, entry: jax.Array) -> jax.Array:
    return entry


def _substituted_fwd(w, entry):
    return entry, None


def _substituted_bwd(_, g):
    return g, None


_substituted.defvjp(_substituted_fwd, _substituted_bwd)


def recording() -> bool:
    """Whether this trace records the weights projections multiply by (:func:`cast_weights`): a projection
    that would differentiate through a nested trace of its own (a ``jax.checkpoint``) runs without it then,
    since nothing differentiates a recording and its entries must be values of this trace."""
    return isinstance(current().cast_weights, _Recording)


class _Nested(Exception):
    """A projection ran in a nested trace while its layer was recorded."""


def cast_weights(layer: Callable[..., Any], layer_params: Any, *activations: Any) -> list[jax.Array] | None:
    """What each projection of ``layer(layer_params, *activations)`` multiplies by, in the order the
    projections run: the entries a :class:`PreparedCasts` hands back to the layer. Only that is computed
    (the layer is traced, and everything the entries do not need pruned before it runs). ``None`` where the
    layer has no such projection, where an entry would depend on ``activations``, or where a projection
    ran in a nested trace the entries cannot leave."""
    def record(params, *inputs):
        found = _Recording()
        with using(cast_weights=found):
            layer(params, *inputs)
        # an entry recorded inside a nested trace (a jax.checkpoint, a cond, a shard_map) is that trace's value,
        # not this one's: it cannot be kept
        here = {id(getattr(a, "_trace", None)) for a in jax.tree.leaves((params, *inputs))}
        if any(getattr(e, "_trace", None) is not None and id(e._trace) not in here for e in found.entries):
            raise _Nested
        return found.entries

    try:
        closed, shapes = jax.make_jaxpr(record, return_shape=True)(layer_params, *activations)
    except (_Nested, jax.errors.UnexpectedTracerError):
        return None
    if not shapes:
        return None
    jaxpr, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    from_params = len(jax.tree.leaves(layer_params))
    if any(used[from_params:]):
        return None
    inputs = [a for a, keep in zip(jax.tree.leaves((layer_params, *activations)), used, strict=True) if keep]
    return jax.tree.unflatten(jax.tree.structure(shapes), jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))(*inputs))
