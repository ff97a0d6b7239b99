"""The model, cut for pipelining: what the runtime calls on a stage (:class:`StageFunctions`). It
knows nothing about GPT or any family: :mod:`meshtron.train.pipelined` cuts any contract model
into these functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

PyTree = Any

__all__ = ["PyTree", "StageFunctions"]


@dataclass(frozen=True)
class StageFunctions:
    """The model, cut for pipelining.

    ``embed(shared, tokens) -> x`` builds the first virtual stage's input from a microbatch of
    tokens; ``stage(chunk_params, x, tokens) -> y`` runs one chunk of layers on that microbatch (its
    tokens say where its tokens are: positions, packed documents); ``loss(shared, y, tokens)`` is the
    scalar loss after the last virtual stage. ``layout(x) -> x`` pins an activation (or its
    gradient) to the layout the stages produce over the compiler-managed axes; the runtime applies
    it to everything it stores, reads and sends, so its buffers and messages keep that layout
    (under sequence parallelism a ``seq/t`` slice) instead of one the compiler's propagation picks.

    ``layer(layer_params, x, tokens) -> y`` is one layer of a chunk (``stage`` applied to a chunk equals
    ``layer`` applied to each of its layers in order, the chunk's leaves being ``[layers, ...]``);
    schedules with a split backward (zero bubble) need it, to cut each layer's backward into the
    input gradient and the weight gradient (:mod:`meshtron.pipeline.split_backward`).

    ``remat`` is how the model recomputes a layer (``model.remat``: ``none``, ``selective``, ``offload`` or
    ``full``). When the forward keeps each layer's residuals for the backward (``parallel.recompute``
    false), ``full`` keeps only each layer's input and recomputes the layer once in its backward:
    Megatron's full recomputation, two forwards per layer instead of the three a stage recomputed
    from its stashed input, with each in-flight microbatch keeping one input per layer.

    ``activation_spec()`` is the ``PartitionSpec`` ``layout`` pins activations to (None: unknown);
    with it the runtime orders its collectives by tokens read from each device's own shard
    (:func:`meshtron.pipeline.buffers.local_token`). ``chunk_specs()`` is the same for one chunk's
    parameters (a tree of ``PartitionSpec`` s shaped like them, the leading layer axis unsplit): the
    runtime orders the embedding's backward after all of a chunk's parameter gradients with it.

    ``prepare(stage_params, x, tokens) -> weights`` computes once per step, before the tick loop, what the
    stage's layers would otherwise compute from their parameters again in every forward, recomputation and
    W pass (a model's FP8 weights, quantized), for example activation ``x`` and microbatch ``tokens``: a
    pytree whose leaves are stacked ``[chunks, layers_per_chunk, ...]`` like ``stage_params``, or ``None``
    (nothing to prepare). The runtime then hands ``stage`` its chunk's slice and ``layer`` its layer's, as
    the argument after ``active`` (``stage(chunk_params, x, tokens, active, weights)``) and after ``tokens``
    (``layer(layer_params, x, tokens, weights)``). The weights are not differentiated: gradients still go to
    the parameters.

    ``reporting_stage(chunk_params, x, tokens[, active]) -> (y, reports)`` is ``stage`` that also returns
    what the chunk's layers measured (a pytree of arrays stacked over the chunk's layers, e.g. a
    mixture of experts' routing): the forward-only pipeline sums it over the microbatches when asked
    (:func:`meshtron.pipeline.runtime.run_pipeline_forward` with ``reports=True``).
    """

    embed: Callable[[PyTree, jax.Array], jax.Array]
    stage: Callable[..., jax.Array]
    loss: Callable[[PyTree, jax.Array, jax.Array], jax.Array]
    layout: Callable[[jax.Array], jax.Array] = lambda x: x
    layer: Callable[[PyTree, jax.Array, jax.Array], jax.Array] | None = None
    remat: str = "none"
    activation_spec: Callable[[], Any] | None = None
    chunk_specs: Callable[[], Any] | None = None
    reporting_stage: Callable[..., tuple[jax.Array, PyTree]] | None = None
    prepare: Callable[[PyTree, jax.Array, jax.Array], PyTree | None] | None = None
