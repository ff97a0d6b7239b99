"""Stacked blocks: how they are built, what each is called with, what flows between them, and how they run.

A model's ``blocks`` is one block class whose parameters are stacked on a leading ``layers`` axis
(:func:`stack_blocks`), the layout that pipeline placement, checkpoints and per-layer optimizer choices
rely on. :func:`run_blocks` applies them in order with one ``lax.scan``, so a model of any depth traces
one block; every consumer that runs blocks (the whole model's forward, a pipeline stage, one layer of a
kept-residual backward, cached decoding) runs them here, so what surrounds each block -- the residual
stream's layout between blocks (:data:`RESIDUAL`), packed documents' scope, the trainer's per-layer
views of the parameters (:func:`layer_parameters`: gathered ZeRO-3 shards, LoRA's adapters), activation
recomputation and collected reports -- is the same for all of them and no model does any of it.

What a model as a whole provides (embed, blocks, head, loss) and its check are
:mod:`meshtron.models.contract`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtron.models import documents
from meshtron.models.auxiliary import collecting_reports
from meshtron.models.cast_weights import PreparedCasts
from meshtron.models.collective_matmul import sequence_ring
from meshtron.models.context_attention import local_positions
from meshtron.models.fp8 import FP8_SHARD, FP8_WEIGHT, PreparedWeights
from meshtron.models.fp8_scaling import layer_scaling
from meshtron.sharding import constrain, varying_like
from meshtron.trace_context import LayerView, current, using

LAYERS = "layers"
PREFIX_LAYERS = "prefix_layers"
"""The logical axis a model's ``prefix`` stacks its blocks on (:mod:`meshtron.models.contract`): replicated
over pipeline stages (the prefix runs with the embedding, on the first virtual stage), where ``layers``
is split over them."""
RESIDUAL = ("batch", "residual_seq", "embed")
"""Logical axes of the residual stream -- embedding output, block inputs and outputs, the inputs of
norms and of the head. ``residual_seq`` is replicated by default and split over ``tensor`` under
sequence parallelism (``parallel.sequence_parallel``); the sequence axis *inside* the tensor-parallel
regions (attention, MLP) is ``seq`` and is never split there."""
WHOLE_SEQUENCE = ("batch", "seq", "embed")
"""Logical axes of a residual-width value that needs the whole sequence: the input of a
tensor-parallel region (a norm's output, before the column-parallel projections), and an embedding
lookup before it enters the residual stream. See :func:`enter_parallel_region`."""


def _layout_pin(forward: tuple[str, ...], backward: tuple[str, ...]) -> Callable[[jax.Array], jax.Array]:
    """Identity that lays its value out ``forward`` and its gradient ``backward`` (logical axes)."""

    @jax.custom_vjp
    def pin(x: jax.Array) -> jax.Array:
        return constrain(x, forward)

    pin.defvjp(lambda x: (constrain(x, forward), None), lambda _, grad: (constrain(grad, backward),))
    return pin


_into_region = _layout_pin(WHOLE_SEQUENCE, RESIDUAL)
_out_of_region = _layout_pin(RESIDUAL, WHOLE_SEQUENCE)


def enter_parallel_region(x: jax.Array, *, collective: bool = False) -> jax.Array:
    """``x`` from the residual stream into a tensor-parallel region -- Megatron's ``g`` operator.

    Forward, ``x`` is laid out :data:`WHOLE_SEQUENCE`; backward, its gradient is laid out
    :data:`RESIDUAL`. Under sequence parallelism that is an all-gather forward and a reduce-scatter
    of the region's partial input gradients backward; without it, nothing forward and the
    all-reduce backward. A plain constraint would pin the gradient to the whole sequence too (an
    all-reduce, then a slice), and no constraint leaves the choice to the compiler's propagation,
    which may reshard inside attention with all-to-alls instead.

    ``collective=True`` says the region's column-parallel projections gather ``x`` themselves
    (:func:`meshtron.models.collective_matmul.column_parallel`): where the run does collective matmul
    (:func:`~meshtron.models.collective_matmul.sequence_ring`), ``x`` then enters as it is, laid out
    :data:`RESIDUAL`, and the projections' rings do the gather (and its reduce-scatter backward);
    elsewhere it changes nothing. Whatever else in the region reads ``x`` gets the same values, the
    compiler gathering them for it.
    """
    if collective and sequence_ring(x.shape[1]) is not None:
        return constrain(x, RESIDUAL)
    return _into_region(x)


def exit_parallel_region(x: jax.Array, *, collective: bool = False) -> jax.Array:
    """A tensor-parallel region's output, summed over the tensor shards, into the residual stream --
    Megatron's ``ḡ`` operator (the output of a row-parallel projection, or of the vocab-parallel
    embedding lookup).

    Forward, laid out :data:`RESIDUAL`: the sum is an all-reduce, or under sequence parallelism a
    reduce-scatter. Backward, its gradient is laid out :data:`WHOLE_SEQUENCE`: an all-gather under
    sequence parallelism, so the region's backward runs on the whole sequence as its forward did
    (without the pin the compiler may gather the projection's weights instead and reshard the
    attention backward with all-to-alls).

    ``collective=True`` says ``x`` comes from a row-parallel projection that reduce-scatters its output
    itself (:func:`meshtron.models.collective_matmul.row_parallel`): where the run does collective
    matmul, ``x`` is already summed and split over the sequence, and its gradient goes back to the
    projection as it is (the projection's backward ring gathers it)."""
    if collective and sequence_ring(x.shape[1]) is not None:
        return constrain(x, RESIDUAL)
    return _out_of_region(x)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Context:
    """What a block needs besides its input ``x``.

    ``positions`` [b, s] are the absolute positions of ``x``'s tokens (rotary embeddings use them).
    They are not always contiguous: where a sequence is split over context-parallel ranks, a rank
    holds two chunks of it (:mod:`meshtron.models.context_attention`), so look rows of a position
    table up by them (``take``) rather than slicing from the first;
    ``cache`` is, during cached decoding, this block's own cache (the layer scan hands every block
    its slice of the stacked caches), else ``None``.
    ``segments`` [b, s], for windows of packed documents (:mod:`meshtron.models.documents`), is which
    document each token belongs to (positions then restart at every document, so they differ from
    row to row: look them up per row); attention masks by them on its own (``run_blocks`` opens
    their scope). ``None`` for one sequence per row.
    """

    positions: jax.Array
    cache: Any = None
    segments: jax.Array | None = None

    @classmethod
    def for_sequence(cls, batch: int, seq: int, start: int | jax.Array = 0, cache: Any = None) -> Context:
        """Positions ``start .. start + seq - 1`` for every row; for this rank's ``seq`` tokens of a
        sequence split over context-parallel ranks, their own positions
        (:func:`~meshtron.models.context_attention.local_positions`)."""
        if cache is None and isinstance(start, int) and start == 0:
            positions = local_positions(seq)[None, :]
        else:
            positions = jnp.arange(seq, dtype=jnp.int32)[None, :] + jnp.asarray(start, jnp.int32)
        return cls(jnp.broadcast_to(positions, (batch, seq)), cache)

    @classmethod
    def for_tokens(cls, tokens: jax.Array) -> Context:
        """The context of a training batch as the step hands it (the forms
        :func:`~meshtron.models.contract.next_token_pairs` reads, or packed documents' features): their
        own positions and segments, else :meth:`for_sequence`."""
        seen = documents.view(tokens)
        if seen.segments is None:
            return cls.for_sequence(*seen.inputs.shape)
        return cls(seen.positions, segments=seen.segments)


def stack_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, rngs: nnx.Rngs, *,
                 axis: str = LAYERS) -> nnx.Module:
    """``layers`` independent blocks made by ``make_block(rngs)``, their parameters stacked on a leading
    ``layers`` axis (the canonical layout pipeline placement and checkpoints rely on); a model's
    ``prefix`` stacks its own on :data:`PREFIX_LAYERS` (``axis``).

    Each block draws from its own key, split from ``rngs.params()``.
    """
    keys = jax.random.split(rngs.params(), layers)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(key: jax.Array) -> nnx.Module:
        return make_block(nnx.Rngs(params=key))

    return make(keys)


LayerHook = Callable[[nnx.Module, "jax.Array | None"], None]


@contextlib.contextmanager
def layer_parameters(view: Callable[[dict], dict] | None, *, unsaved: str | None = None,
                     hook: LayerHook | None = None) -> Iterator[None]:
    """Blocks traced inside this run on ``view(parameters)`` of each layer (a pure dict shaped like one
    layer of ``blocks``) instead of the parameters themselves; the model does nothing for it.

    The trainer uses it to keep parameters split across devices between uses and gather each layer's
    just before that layer runs (fully sharded data parallelism). ``hook(block, x)`` then sees the
    block built from them, and its input ``x``, before the block runs, and may change its modules in
    place: low-rank adapters are applied that way (:mod:`meshtron.models.lora`). Views nest: the
    innermost sees the stored parameters first; hooks run after every view, innermost first.
    ``unsaved``: the checkpoint name (``jax.ad_checkpoint.checkpoint_name``) of what the view or hook
    makes and a layer's backward recomputes rather than keeps (see :func:`regathered`).
    """
    if view is None and hook is None:
        yield
        return
    with using(layer_views=(*current().layer_views, LayerView(view, unsaved, hook))):
        yield


def layer_view(graphdef: Any, layer_state: Any, x: jax.Array | None = None) -> nnx.Module:
    """One block from its layer's state, through the active :func:`layer_parameters` views and hooks
    (``x``: the input the block is about to run on, for the hooks)."""
    layer_views = current().layer_views
    views = [entry.view for entry in reversed(layer_views) if entry.view is not None]
    if views:
        layer_state = jax.tree.map(lambda v: v, layer_state)
        values = nnx.to_pure_dict(layer_state)
        for view in views:
            values = view(values)
        nnx.replace_by_pure_dict(layer_state, values)
    block = nnx.merge(graphdef, layer_state)
    for entry in reversed(layer_views):
        if entry.hook is not None:
            entry.hook(block, x)
    return block


def run_layer(graphdef: Any, layer_state: Any, x: jax.Array, ctx: Context, weights: Any = None) -> Any:
    """One block from its layer's state (:func:`layer_view`) applied to ``x``, its FP8 projections
    reading that layer's delayed-scaling state (:func:`meshtron.models.fp8_scaling.layer_scaling`) and,
    for the weights a view gathered, the shares they came from
    (:attr:`meshtron.trace_context.TraceContext.gathered`: the shares are quantized, not the gathered weights).
    ``weights``: the layer's FP8 weights quantized beforehand (:func:`meshtron.models.fp8.quantized_weights`),
    which its projections multiply by instead of quantizing their weights; without FP8, its projections'
    weights cast beforehand (:func:`meshtron.models.cast_weights.cast_weights`), which they multiply by
    instead of casting their weights."""
    fp8 = current().fp8 != "off"
    recording = fp8 and any(entry.view is not None for entry in current().layer_views)
    prepared, changes = None, {}
    if weights is not None:
        prepared = PreparedWeights(weights) if fp8 else PreparedCasts(weights)
        changes = {"fp8_weights" if fp8 else "cast_weights": prepared}
    with using(gathered={} if recording else None, **changes):
        block = layer_view(graphdef, layer_state, x)
        with layer_scaling(block):
            y = block(x, ctx)
        if prepared is not None:
            prepared.check_complete()
        return y


def regathered(layer: Callable) -> Callable:
    """``layer`` not keeping what a :func:`layer_parameters` view makes for its backward pass: the
    view's output (a layer's gathered parameters, adapters merged into their matrices) is made again in
    the backward instead of living from the forward until the backward reaches the layer. A view that
    names what it makes (``unsaved``) has just that recomputed; otherwise the layer keeps only its
    matrix products' outputs (the elementwise work between them is recomputed) and, under ``model.fp8``,
    what :func:`_kept_through_recomputation` names. The identity without
    a view, or when the layer is recomputed whole anyway (``remat`` full or offload)."""
    layer_views = current().layer_views
    if not layer_views:
        return layer
    names = [entry.unsaved for entry in layer_views if entry.unsaved is not None]
    if len(names) == len(layer_views):
        policy = jax.checkpoint_policies.save_anything_except_these_names(*names)
    else:
        policy = jax.checkpoint_policies.dots_saveable
        kept = _kept_through_recomputation()
        if kept:
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(*kept))
    return jax.checkpoint(layer, policy=policy, prevent_cse=False)


BLOCK_INPUT = "block_input"
"""The checkpoint name of a block's input under ``remat="offload"``: the one value its backward keeps,
moved to pinned host memory between the forward and the backward."""


def offload_policy(kept: tuple[str, ...] = ()) -> Callable:
    """The ``remat="offload"`` policy: :data:`BLOCK_INPUT` to pinned host memory, the ``kept`` names saved on
    the device, the rest recomputed."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(kept), names_which_can_be_offloaded=[BLOCK_INPUT],
        offload_src="device", offload_dst="pinned_host")


def _kept_through_recomputation() -> tuple[str, ...]:
    """What a recomputed block keeps besides its input under ``model.fp8``: its FP8 weights (1 byte per
    weight, quantized once instead of again in the rerun); where each layer's parameters are gathered as
    it runs (fully sharded data parallelism), the quantized *shares* they are gathered from instead (1 byte
    per parameter of the share: the rerun gathers their bytes again) -- keeping the gathered weights would
    hold every layer's at once."""
    if current().fp8 == "off":
        return ()
    gathered = any(entry.view is not None for entry in current().layer_views)
    return (FP8_SHARD,) if gathered else (FP8_WEIGHT,)


def recomputed(layer: Callable, remat: str) -> Callable:
    """``layer(h, ...)`` as ``remat`` keeps it for the backward: recomputed whole from its input kept on
    the device (``full``) or in pinned host memory (``offload``: the input is named :data:`BLOCK_INPUT`
    and the policy copies it to the host in the forward and back in the backward, where everything
    else is recomputed from it); otherwise as :func:`regathered` leaves it. Under ``model.fp8`` both
    keep the quantized weights (:func:`_kept_through_recomputation`)."""
    kept = _kept_through_recomputation()
    if remat == "full":
        policy = jax.checkpoint_policies.save_only_these_names(*kept) if kept else None
        return jax.checkpoint(layer, policy=policy, prevent_cse=False)
    if remat == "offload":
        return jax.checkpoint(lambda h, *rest: layer(checkpoint_name(h, BLOCK_INPUT), *rest),
                              policy=offload_policy(kept), prevent_cse=False)
    return regathered(layer)


def run_blocks(blocks: nnx.Module, x: jax.Array, ctx: Context, *, remat: str = "none",
               active: jax.Array | int | None = None, collect: bool = False, weights: Any = None):
    """Apply stacked blocks in order with a ``lax.scan`` over the ``layers`` axis.

    With ``ctx.cache`` (stacked caches ``[layers, ...]``) every block gets its own and the result is
    ``(x, new_caches)``; otherwise ``x``. ``remat="full"`` recomputes each block in the backward pass
    (Megatron's full activation recomputation: only block inputs are kept), ``"offload"`` too with
    those inputs in pinned host memory (:func:`recomputed`); ``"selective"`` is applied
    inside the block, to its attention core (:func:`meshtron.models.attention.attention_core`).
    Between blocks ``x`` is the residual stream, laid out :data:`RESIDUAL` (split over the sequence
    under sequence parallelism). ``active``: run only the first ``active`` blocks and pass ``x``
    through the rest (the padding slots of an uneven pipeline chunk).

    ``weights``: the blocks' FP8 weights quantized beforehand, or without FP8 their weights cast beforehand,
    stacked over the layers (each layer's :func:`meshtron.models.fp8.quantized_weights` or
    :func:`meshtron.models.cast_weights.cast_weights`); each block multiplies by its own (:func:`run_layer`).

    ``collect=True`` (forward only) returns ``(x, reports)``: what each block
    :func:`~meshtron.models.auxiliary.report` ed, a tuple per block stacked over the layers (zeros
    for padding slots; ``()`` when no block reports anything).
    """
    graphdef, state = nnx.split(blocks)
    if ctx.cache is None and ctx.segments is not None and documents.active_segments() is not ctx.segments:
        with documents.document_segments(ctx.segments):  # what causal_attention masks packed documents by
            return run_blocks(blocks, x, ctx, remat=remat, active=active, collect=collect, weights=weights)
    if collect:
        return _run_collecting(graphdef, state, x, ctx, active)
    if ctx.cache is None:
        def one_layer(h, layer):
            layer_state, layer_weights = layer
            return constrain(run_layer(graphdef, layer_state, h, ctx, layer_weights), RESIDUAL), None

        one_layer = recomputed(one_layer, remat)
        if active is None:
            x, _ = jax.lax.scan(one_layer, x, (state, weights))
            return x

        def maybe_layer(h, xs):
            i, layer = xs
            return jax.lax.cond(i < active, lambda: one_layer(h, layer)[0], lambda: h), None

        layers = jax.tree.leaves(state)[0].shape[0]
        x, _ = jax.lax.scan(maybe_layer, x, (jnp.arange(layers), (state, weights)))
        return x

    # The stacked caches ride in the carry and each layer updates its own slice in place: as scan
    # inputs and outputs they would be copied whole every decoding step.
    def cached_layer(carry, layer_state):
        h, caches, i = carry
        cache = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, i, keepdims=False), caches)
        h, cache = run_layer(graphdef, layer_state, h, replace(ctx, cache=cache))
        caches = jax.tree.map(lambda c, n: jax.lax.dynamic_update_index_in_dim(c, n, i, 0), caches, cache)
        return (h, caches, i + 1), None

    (x, caches, _), _ = jax.lax.scan(cached_layer, (x, ctx.cache, jnp.int32(0)), state)
    return x, caches


def _run_collecting(graphdef: Any, state: Any, x: jax.Array, ctx: Context, active: jax.Array | int | None):
    def one_layer(h, layer_state):
        with collecting_reports() as found:
            h = constrain(run_layer(graphdef, layer_state, h, ctx), RESIDUAL)
        return h, tuple(found)

    layers = jax.tree.leaves(state)[0].shape[0]
    if active is None:
        return jax.lax.scan(one_layer, x, state)
    reports = jax.eval_shape(one_layer, x, jax.tree.map(lambda a: a[0], state))[1]

    def maybe_layer(h, xs):
        i, layer_state = xs
        return jax.lax.cond(i < active, lambda: one_layer(h, layer_state),  # a padding slot reports zeros
                            lambda: (h, jax.tree.map(lambda r: varying_like(jnp.zeros(r.shape, r.dtype), h), reports)))

    return jax.lax.scan(maybe_layer, x, (jnp.arange(layers), state))
