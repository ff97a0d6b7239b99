"""The model contract: what a causal language model provides so that meshtron can train it data x
pipeline x tensor parallel, checkpoint it, evaluate it and generate from it.

Every consumer -- the train step, the pipeline's stage functions, stage-order layer placement,
evaluation, checkpoints, ``describe``, ``generate`` and the optimizer's per-layer choices -- goes
through this contract and nothing else, so GPT and Llama are two implementations of it and a
user's model is a third. A model is any ``nnx.Module`` with:

``vocab_size: int``
    The real vocabulary. Logits may be padded beyond it (Megatron pads to a multiple of
    128 x tensor); padded ids are masked out of the loss and never generated.
``embed(tokens [b, s], ctx) -> x [b, s, h]``
    Token (and, if the model has them, position) embeddings: the first virtual pipeline stage.
``blocks``
    One block class, its parameters stacked on a leading ``layers`` axis: build it with
    :func:`stack_blocks` from any function that makes one block. A block is called
    ``block(x, ctx) -> x``; during cached decoding ``ctx.cache`` holds the block's own cache and
    the block returns ``(x, new_cache)`` (:func:`meshtron.models.attention.causal_attention`
    does both).
``head(x [b, s, h]) -> logits [b, s, V]``
    Final norm and output projection: the last virtual stage. Logits stay split over the
    vocabulary when the head's parameters are (logical axis ``vocab``).
``loss(logits, targets) -> [b, s]`` (optional)
    Per-token loss; default :func:`vocab_parallel_cross_entropy` over ``vocab_size``.
``max_len: int`` (optional)
    The longest sequence the model can attend over (learned positions); generation keeps at
    most this many tokens of context. Without it, the run's ``model.seq_len``.
``init_cache(batch, max_len) -> caches`` (optional)
    Zeroed per-layer decoding caches stacked ``[layers, ...]``; with it, ``generate`` runs one
    prefill and one compiled step per token instead of re-running the whole window.

Every ``nnx.Param`` carries logical axis names (``nnx.with_partitioning(init, names)``); the
rules table (:mod:`meshtron.sharding`) maps them to mesh axes, so the model names no mesh axis.
Activations are pinned the same way (:func:`meshtron.sharding.constrain`): the residual stream --
what ``embed`` returns, what blocks take and return, and the running sum inside a block -- as
:data:`RESIDUAL` ``(batch, residual_seq, embed)``, activations inside the tensor-parallel regions
with ``seq`` (e.g. ``(batch, seq, heads, head_dim)``). That one name is what sequence parallelism
(``parallel.sequence_parallel``) needs: it splits ``residual_seq`` over the tensor ranks. Where a value
crosses between the two -- a norm's output into a region, a region's summed output (or the
vocab-parallel embedding lookup) back into the stream -- :func:`enter_parallel_region` and
:func:`exit_parallel_region` are Megatron's ``g`` and ``ḡ``: all-gather forward and reduce-scatter
backward, and the reverse, so each tensor all-reduce becomes a reduce-scatter and an all-gather of
the same bytes. :func:`run_blocks` pins block inputs and outputs itself. Without sequence
parallelism all of these are the plain tensor-parallel layout, so a model that skips them trains
the same; under it, it may communicate more (the compiler then chooses where to reshard).
:func:`check_model` enforces all of this with one error that names what is missing and the fix.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.errors import ConfigError
from meshtron.models import documents
from meshtron.models.auxiliary import collecting_reports
from meshtron.models.context_attention import local_positions
from meshtron.sharding import Rules, constrain, variable_axes, varying_like

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
LAYERS = "layers"
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


def enter_parallel_region(x: jax.Array) -> jax.Array:
    """``x`` from the residual stream into a tensor-parallel region -- Megatron's ``g`` operator.

    Forward, ``x`` is laid out :data:`WHOLE_SEQUENCE`; backward, its gradient is laid out
    :data:`RESIDUAL`. Under sequence parallelism that is an all-gather forward and a reduce-scatter
    of the region's partial input gradients backward; without it, nothing forward and the
    all-reduce backward. A plain constraint would pin the gradient to the whole sequence too (an
    all-reduce, then a slice), and no constraint leaves the choice to the compiler's propagation,
    which may reshard inside attention with all-to-alls instead.
    """
    return _into_region(x)


def exit_parallel_region(x: jax.Array) -> jax.Array:
    """A tensor-parallel region's output, summed over the tensor shards, into the residual stream --
    Megatron's ``ḡ`` operator (the output of a row-parallel projection, or of the vocab-parallel
    embedding lookup).

    Forward, laid out :data:`RESIDUAL`: the sum is an all-reduce, or under sequence parallelism a
    reduce-scatter. Backward, its gradient is laid out :data:`WHOLE_SEQUENCE`: an all-gather under
    sequence parallelism, so the region's backward runs on the whole sequence as its forward did
    (without the pin the compiler may gather the projection's weights instead and reshard the
    attention backward with all-to-alls)."""
    return _out_of_region(x)


class ModelContractError(ConfigError):
    """The model does not provide what :mod:`meshtron.models.contract` asks for; the message says what and how to fix it."""


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
        """The context of a training batch as the step hands it (:func:`next_token_pairs`' forms, or
        packed documents' features): their own positions and segments, else :meth:`for_sequence`."""
        seen = documents.view(tokens)
        if seen.segments is None:
            return cls.for_sequence(*seen.inputs.shape)
        return cls(seen.positions, segments=seen.segments)


def stack_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, rngs: nnx.Rngs) -> nnx.Module:
    """``layers`` independent blocks made by ``make_block(rngs)``, their parameters stacked on a leading
    ``layers`` axis (the canonical layout pipeline placement and checkpoints rely on).

    Each block draws from its own key, split from ``rngs.params()``.
    """
    keys = jax.random.split(rngs.params(), layers)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def make(key: jax.Array) -> nnx.Module:
        return make_block(nnx.Rngs(params=key))

    return make(keys)


LayerHook = Callable[[nnx.Module, "jax.Array | None"], None]
_layer_views: list[tuple[Callable[[dict], dict] | None, str | None, LayerHook | None]] = []


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
    _layer_views.append((view, unsaved, hook))
    try:
        yield
    finally:
        _layer_views.pop()


def layer_view(graphdef: Any, layer_state: Any, x: jax.Array | None = None) -> nnx.Module:
    """One block from its layer's state, through the active :func:`layer_parameters` views and hooks
    (``x``: the input the block is about to run on, for the hooks)."""
    views = [view for view, _, _ in reversed(_layer_views) if view is not None]
    if views:
        layer_state = jax.tree.map(lambda v: v, layer_state)
        values = nnx.to_pure_dict(layer_state)
        for view in views:
            values = view(values)
        nnx.replace_by_pure_dict(layer_state, values)
    block = nnx.merge(graphdef, layer_state)
    for _, _, hook in reversed(_layer_views):
        if hook is not None:
            hook(block, x)
    return block


def regathered(layer: Callable) -> Callable:
    """``layer`` not keeping what a :func:`layer_parameters` view makes for its backward pass: the
    view's output (a layer's gathered parameters, adapters merged into their matrices) is made again in
    the backward instead of living from the forward until the backward reaches the layer. A view that
    names what it makes (``unsaved``) has just that recomputed; otherwise the layer keeps only its
    matrix products' outputs (the elementwise work between them is recomputed). The identity without
    a view, or when the layer is recomputed whole anyway (``remat="full"``)."""
    if not _layer_views:
        return layer
    names = [name for _, name, _ in _layer_views if name is not None]
    if len(names) == len(_layer_views):
        policy = jax.checkpoint_policies.save_anything_except_these_names(*names)
    else:
        policy = jax.checkpoint_policies.dots_saveable
    return jax.checkpoint(layer, policy=policy, prevent_cse=False)


def run_blocks(blocks: nnx.Module, x: jax.Array, ctx: Context, *, remat: str = "none",
               active: jax.Array | int | None = None, collect: bool = False):
    """Apply stacked blocks in order with a ``lax.scan`` over the ``layers`` axis.

    With ``ctx.cache`` (stacked caches ``[layers, ...]``) every block gets its own and the result is
    ``(x, new_caches)``; otherwise ``x``. ``remat="full"`` recomputes each block in the backward pass
    (Megatron's full activation recomputation: only block inputs are kept); ``"selective"`` is applied
    inside the block, to its attention core (:func:`meshtron.models.attention.attention_core`).
    Between blocks ``x`` is the residual stream, laid out :data:`RESIDUAL` (split over the sequence
    under sequence parallelism). ``active``: run only the first ``active`` blocks and pass ``x``
    through the rest (the padding slots of an uneven pipeline chunk).

    ``collect=True`` (forward only) returns ``(x, reports)``: what each block
    :func:`~meshtron.models.auxiliary.report` ed, a tuple per block stacked over the layers (zeros
    for padding slots; ``()`` when no block reports anything).
    """
    graphdef, state = nnx.split(blocks)
    if ctx.cache is None and ctx.segments is not None and documents.active_segments() is not ctx.segments:
        with documents.document_segments(ctx.segments):  # what causal_attention masks packed documents by
            return run_blocks(blocks, x, ctx, remat=remat, active=active, collect=collect)
    if collect:
        return _run_collecting(graphdef, state, x, ctx, active)
    if ctx.cache is None:
        def one_layer(h, layer_state):
            return constrain(layer_view(graphdef, layer_state, h)(h, ctx), RESIDUAL), None

        one_layer = jax.checkpoint(one_layer, prevent_cse=False) if remat == "full" else regathered(one_layer)
        if active is None:
            x, _ = jax.lax.scan(one_layer, x, state)
            return x

        def maybe_layer(h, xs):
            i, layer_state = xs
            return jax.lax.cond(i < active, lambda: one_layer(h, layer_state)[0], lambda: h), None

        layers = jax.tree.leaves(state)[0].shape[0]
        x, _ = jax.lax.scan(maybe_layer, x, (jnp.arange(layers), state))
        return x

    # The stacked caches ride in the carry and each layer updates its own slice in place: as scan
    # inputs and outputs they would be copied whole every decoding step.
    def cached_layer(carry, layer_state):
        h, caches, i = carry
        cache = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, i, keepdims=False), caches)
        h, cache = layer_view(graphdef, layer_state, h)(h, replace(ctx, cache=cache))
        caches = jax.tree.map(lambda c, n: jax.lax.dynamic_update_index_in_dim(c, n, i, 0), caches, cache)
        return (h, caches, i + 1), None

    (x, caches, _), _ = jax.lax.scan(cached_layer, (x, ctx.cache, jnp.int32(0)), state)
    return x, caches


def _run_collecting(graphdef: Any, state: Any, x: jax.Array, ctx: Context, active: jax.Array | int | None):
    def one_layer(h, layer_state):
        with collecting_reports() as found:
            h = constrain(layer_view(graphdef, layer_state, h)(h, ctx), RESIDUAL)
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


def next_token_pairs(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(inputs, targets)`` [b, s] of a batch: ``tokens`` [b, s + 1] read as a window, or -- this rank's
    share of sequences split over context-parallel ranks, whose tokens are not contiguous --
    ``[b, s, 2]``, every input token stacked with the one it predicts, or packed documents' features
    ``[b, s, 5]`` (:mod:`meshtron.models.documents`)."""
    seen = documents.view(tokens)
    return seen.inputs, seen.targets


def layer_reports(model: nnx.Module, tokens: jax.Array, ctx: Context | None = None) -> tuple[Any, ...]:
    """What the blocks :func:`~meshtron.models.auxiliary.report` for ``tokens`` [b, s] (the inputs,
    without the last target; in ``ctx``, default one sequence per row), stacked over the layers: a
    forward through embedding and blocks."""
    ctx = Context.for_sequence(*tokens.shape) if ctx is None else ctx
    return run_blocks(model.blocks, model.embed(tokens, ctx), ctx, collect=True)[1]


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
    """Per-token cross-entropy computed on vocabulary shards, as Megatron's ``_VocabParallelCrossEntropy``.

    Written so that every reduction over the vocabulary is a plain max/sum: with logits split over
    ``vocab`` the compiler turns them into three small all-reduces of [batch, seq] (max, target
    logit, sum of exponentials), and the full logits are never gathered. Padded vocabulary entries
    (ids >= ``vocab_size``) are masked out of the softmax.
    """
    logits = logits.astype(jnp.float32)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    logits = jnp.where(ids < vocab_size, logits, jnp.finfo(logits.dtype).min)
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    target_logit = jnp.sum(jnp.where(ids == targets[..., None], shifted, 0.0), axis=-1)
    return log_normaliser - target_logit


def token_losses(model: nnx.Module, logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token loss [b, s]: the model's own ``loss`` if it has one, else the vocab-parallel cross-entropy."""
    own = getattr(model, "loss", None)
    if own is not None:
        return own(logits, targets)
    return vocab_parallel_cross_entropy(logits, targets, model.vocab_size)


def logits_of(model: nnx.Module, tokens: jax.Array, *, remat: str = "none", ctx: Context | None = None) -> jax.Array:
    """The full forward pass through the contract: embed -> blocks -> head, of ``tokens`` [b, s] (in
    ``ctx``: packed documents', :meth:`Context.for_tokens`; default, one sequence per row)."""
    ctx = Context.for_sequence(*tokens.shape) if ctx is None else ctx
    return model.head(run_blocks(model.blocks, model.embed(tokens, ctx), ctx, remat=remat))


def lm_loss(model: nnx.Module, tokens: jax.Array, *, remat: str = "none") -> jax.Array:
    """Mean next-token loss of a batch (any form :func:`next_token_pairs` reads); for packed
    documents' features, each token's loss weighted as they say."""
    seen = documents.view(tokens)
    logits = logits_of(model, seen.inputs, remat=remat, ctx=Context.for_tokens(tokens))
    return documents.weighted_mean(token_losses(model, logits, seen.targets), seen.weights)


# ---- checking a model -------------------------------------------------------------------------


def _fail(what: str, fix: str) -> None:
    raise ModelContractError(f"model: {what}; {fix} (see meshtron.models.contract)")


def _path(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def checked_model(factory: ModelFactory, rngs: nnx.Rngs) -> nnx.Module:
    """``factory(rngs)``, with one line instead of a traceback when the factory cannot be called that
    way or does not return an NNX module (a Flax Linen module, say)."""
    import inspect

    name = getattr(factory, "__qualname__", type(factory).__name__)
    if inspect.isclass(factory) and _first_positional(factory) != "rngs":
        _fail(f"the model factory {name} is a class, called as {name}(rngs), whose first argument is not rngs",
              f"pass a function rngs -> model, e.g. lambda rngs: {name}(..., rngs=rngs)")
    if callable(factory) and not _takes_positional(factory, 1):
        _fail(f"the model factory {name}{_signature(factory)} cannot be called as factory(rngs)",
              "pass a function rngs -> model, e.g. lambda rngs: MyModel(..., rngs=rngs)")
    try:
        model = factory(rngs)
    except ConfigError:
        raise
    except TypeError as err:  # a callable that is not a model builder (os.path:join, a class's wrong call)
        where = traceback.extract_tb(err.__traceback__)[-1]
        message = str(err).splitlines()[0] if str(err) else ""
        _fail(f"the model factory {name} raised TypeError while building the model: {message} "
              f"({Path(where.filename).name}:{where.lineno})",
              "give a function that builds the model (model.factory: build(model_config, rngs) -> model; from "
              "Python: rngs -> model); MESHTRON_TRACEBACK=1 shows where it failed")
    if _is_linen(model):
        _fail(f"the factory returned a Flax Linen module ({type(model).__name__}), not an nnx.Module",
              "wrap its embed, block and head modules with meshtron.models.linen.LinenLM")
    if not isinstance(model, nnx.Module):
        _fail(f"the factory returned a {type(model).__name__}, not an nnx.Module",
              "return the model instance from the factory")
    return model


def _is_linen(value: Any) -> bool:
    from flax import linen

    return isinstance(value, linen.Module)


def _signature(fn: Callable[..., Any]) -> str:
    import inspect

    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _first_positional(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s first positional parameter (None: it has none, or no signature)."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return next((p.name for p in parameters if p.kind in kinds), None)


def _takes_positional(fn: Callable[..., Any], count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments (True when it cannot be told)."""
    import inspect

    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call decide
        return True
    return True


def check_model(model: Any, rules: Rules) -> None:
    """Raise :class:`ModelContractError` (one line: what is missing, and the fix) unless ``model``
    (typically abstract, from ``nnx.eval_shape``) follows the contract under ``rules``."""
    kind = type(model).__name__
    if _is_linen(model):
        _fail(f"the factory returned a Flax Linen module ({kind}), not an nnx.Module",
              "wrap its embed, block and head modules with meshtron.models.linen.LinenLM")
    if not isinstance(model, nnx.Module):
        _fail(f"the factory returned a {kind}, not an nnx.Module", "return the model instance from the factory")
    for method in ("embed", "head"):
        if not callable(getattr(model, method, None)):
            _fail(f"{kind} has no method {method}()",
                  "add embed(tokens, ctx) -> x and head(x) -> logits" if method == "embed" else
                  "add head(x) -> logits (final norm + output projection)")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nnx.Module):
        _fail(f"{kind} has no attribute 'blocks' holding stacked blocks",
              "set self.blocks = meshtron.models.stack_blocks(make_block, layers, rngs)")
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        _fail(f"{kind}.vocab_size is {vocab!r}, not a positive int",
              "give the model a vocab_size attribute (the real vocabulary, before padding)")
    named = {name for name, _ in rules}
    depth = None
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        where = _path(path)
        try:
            axes = variable_axes(var)
        except ValueError:
            _fail(f"parameter {where} has no logical axis names",
                  "create it with nnx.with_partitioning(init, (names...)) or pass kernel_init/bias_init that do")
        shape = var.get_value().shape
        if len(axes) != len(shape):
            _fail(f"parameter {where} has shape {shape} but {len(axes)} axis names {axes}", "name every axis once")
        unknown = [a for a in axes if a is not None and a not in named]
        if unknown:
            _fail(f"parameter {where} uses logical axis {unknown[0]!r}, which no sharding rule maps",
                  f"add a rule, e.g. model.rules={{{unknown[0]}: null}} (replicated) or rules={{'{unknown[0]}': 'tensor'}}")
        in_blocks = where.startswith("blocks.")
        if in_blocks and axes[0] != LAYERS:
            _fail(f"parameter {where} is under blocks but its first axis is {axes[0]!r}, not 'layers'",
                  "build blocks with meshtron.models.stack_blocks(make_block, layers, rngs)")
        if not in_blocks and LAYERS in axes:
            _fail(f"parameter {where} has a 'layers' axis outside blocks",
                  "keep stacked layers under the model's blocks attribute")
        if in_blocks:
            if depth is not None and shape[0] != depth:
                _fail(f"parameter {where} stacks {shape[0]} layers, others {depth}", "stack every block parameter once")
            depth = shape[0]
    if depth is None:
        _fail(f"{kind}.blocks holds no parameters", "build blocks with meshtron.models.stack_blocks")
