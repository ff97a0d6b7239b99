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
    :func:`meshtron.models.blocks.stack_blocks` from any function that makes one block. A block is
    called ``block(x, ctx) -> x`` (``ctx``: a :class:`~meshtron.models.blocks.Context`); during
    cached decoding ``ctx.cache`` holds the block's own cache and the block returns
    ``(x, new_cache)`` (:func:`meshtron.models.attention.causal_attention` does both).
``prefix`` (optional)
    A second stack of blocks, of another class, that runs after ``embed`` and before ``blocks``
    (DeepSeek's first dense layers before its expert layers): build it with
    ``stack_blocks(make_block, n, rngs, axis=PREFIX_LAYERS)``, its blocks called as ``blocks``' are. It
    is part of the first virtual pipeline stage: every consumer runs ``embed`` then ``prefix`` through
    :func:`embed_tokens`. Its stacked axis, :data:`~meshtron.models.blocks.PREFIX_LAYERS`, is replicated
    over pipeline stages as the embedding is (the pipeline's shared parameters are everything but
    ``blocks``), and gathered whole under fully sharded data parallelism; ``execution.remat`` recomputes
    its blocks as it does ``blocks``'. What its blocks report (routing statistics) is not collected:
    the per-layer reports are ``blocks``'. Under ``model.fp8`` its projections use current scaling
    (delayed scaling's state, and a pipeline's weights quantized once per step, are ``blocks``').
``head(x [b, s, h]) -> logits [b, s, V]``
    Final norm and output projection: the last virtual stage. Logits stay split over the
    vocabulary when the head's parameters are (logical axis ``vocab``).
``loss(logits, targets) -> [b, s]`` (optional)
    Per-token loss; default :func:`vocab_parallel_cross_entropy` over ``vocab_size``.
``extra_loss(x [b, s, h], tokens) -> ExtraLoss | None`` (optional)
    One further loss of the last block's output ``x`` and the batch's ``tokens`` (any form
    :func:`next_token_pairs` reads), computed where the head runs (the last pipeline stage):
    :class:`ExtraLoss`, its unweighted value, the weight it joins the objective's gradient with and
    the metric it is reported under (:func:`head_loss`); ``None``: none. DeepSeek-V3's multi-token
    prediction (:mod:`meshtron.models.mtp`).
``max_len: int`` (optional)
    The longest sequence the model can attend over (learned positions); generation keeps at
    most this many tokens of context. Without it, the run's ``model.seq_len``.
``init_cache(batch, max_len) -> caches`` (optional)
    Zeroed per-layer decoding caches stacked ``[layers, ...]``; with it, ``generate`` runs one
    prefill and one compiled step per token instead of re-running the whole window. A model with a
    ``prefix`` returns :class:`PrefixedCaches`: the prefix's stacked caches and the blocks'.

Every ``nnx.Param`` carries logical axis names (``nnx.with_partitioning(init, names)``); the
rules table (:mod:`meshtron.sharding`) maps them to mesh axes, so the model names no mesh axis.
Activations are pinned the same way (:func:`meshtron.sharding.constrain`): the residual stream --
what ``embed`` returns, what blocks take and return, and the running sum inside a block -- as
:data:`~meshtron.models.blocks.RESIDUAL` ``(batch, residual_seq, embed)``, activations inside the
tensor-parallel regions with ``seq`` (e.g. ``(batch, seq, heads, head_dim)``). That one name is what
sequence parallelism (``parallel.sequence_parallel``) needs: it splits ``residual_seq`` over the tensor
ranks. Where a value crosses between the two -- a norm's output into a region, a region's summed
output (or the vocab-parallel embedding lookup) back into the stream --
:func:`~meshtron.models.blocks.enter_parallel_region` and
:func:`~meshtron.models.blocks.exit_parallel_region` are Megatron's ``g`` and ``ḡ``: all-gather
forward and reduce-scatter backward, and the reverse, so each tensor all-reduce becomes a
reduce-scatter and an all-gather of the same bytes. :func:`~meshtron.models.blocks.run_blocks` pins
block inputs and outputs itself. Without sequence parallelism all of these are the plain
tensor-parallel layout, so a model that skips them trains the same; under it, it may communicate
more (the compiler then chooses where to reshard).
:func:`check_model` enforces all of this with one error that names what is missing and the fix.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.errors import ConfigError
from meshtron.models import documents
from meshtron.models.blocks import LAYERS, PREFIX_LAYERS, Context, layer_parameters, run_blocks
from meshtron.sharding import Rules, variable_axes
from meshtron.trace_context import using

__all__ = [
    "Context", "ExtraLoss", "ExtraLossReport", "ModelContractError", "ModelFactory", "PrefixedCaches", "batch_reports",
    "check_model", "checked_model", "embed_tokens", "extra_loss", "final_hidden", "head_loss", "layer_parameters",
    "layer_reports", "lm_loss", "logits_of", "next_token_pairs", "token_losses", "vocab_parallel_cross_entropy",
]  # Context and layer_parameters are blocks' (imported from here by the train step)

ModelFactory = Callable[[nnx.Rngs], nnx.Module]


class ModelContractError(ConfigError):
    """The model does not provide what :mod:`meshtron.models.contract` asks for; the message says what and how to fix it."""


def next_token_pairs(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(inputs, targets)`` [b, s] of a batch: ``tokens`` [b, s + 1] read as a window, or -- this rank's
    share of sequences split over context-parallel ranks, whose tokens are not contiguous --
    ``[b, s, 2]``, every input token stacked with the one it predicts, or packed documents' features
    ``[b, s, 5]`` (:mod:`meshtron.models.documents`)."""
    seen = documents.view(tokens)
    return seen.inputs, seen.targets


class PrefixedCaches(NamedTuple):
    """The decoding caches of a model with a ``prefix``: the prefix's, stacked over its layers, and the
    blocks', stacked over theirs (what its ``init_cache`` returns)."""

    prefix: Any
    blocks: Any


PREFIX = "prefix"


def embed_tokens(model: nnx.Module, tokens: jax.Array, ctx: Context, *, remat: str = "none") -> Any:
    """What ``blocks`` take for ``tokens`` [b, s]: the model's ``embed``, then its ``prefix`` if it has one
    (recomputed as ``remat`` says); the first virtual pipeline stage. With ``ctx.cache`` (decoding a model
    with a prefix: the prefix's caches), ``(x, the prefix's new caches)``.

    The prefix runs outside :func:`layer_parameters` views (those are shaped like one layer of
    ``blocks``): its parameters are used as they arrive, as the embedding's are."""
    x = model.embed(tokens, ctx)
    prefix = getattr(model, PREFIX, None)
    if prefix is None:
        return x
    with using(layer_views=()):
        return run_blocks(prefix, x, ctx, remat=remat)


def final_hidden(model: nnx.Module, tokens: jax.Array, ctx: Context, *, remat: str = "none") -> Any:
    """The last block's output ``x`` [b, s, h] for ``tokens`` [b, s]: embed, prefix, blocks. With
    ``ctx.cache`` (what the model's ``init_cache`` made), ``(x, new caches)`` of the same structure."""
    prefix = getattr(model, PREFIX, None)
    if ctx.cache is None or prefix is None:
        return run_blocks(model.blocks, embed_tokens(model, tokens, ctx, remat=remat), ctx, remat=remat)
    caches = ctx.cache
    x, prefix_caches = embed_tokens(model, tokens, replace(ctx, cache=caches.prefix))
    x, block_caches = run_blocks(model.blocks, x, replace(ctx, cache=caches.blocks))
    return x, PrefixedCaches(prefix_caches, block_caches)


def layer_reports(model: nnx.Module, tokens: jax.Array, ctx: Context | None = None) -> tuple[Any, ...]:
    """What the blocks :func:`~meshtron.models.auxiliary.report` for ``tokens`` [b, s] (the inputs,
    without the last target; in ``ctx``, default one sequence per row), stacked over the layers: a
    forward through embedding, prefix (which reports nothing) and blocks."""
    ctx = Context.for_sequence(*tokens.shape) if ctx is None else ctx
    return run_blocks(model.blocks, embed_tokens(model, tokens, ctx), ctx, collect=True)[1]


class ExtraLoss(NamedTuple):
    """A model's further loss (its ``extra_loss``): the scalar ``value`` (unweighted), the ``weight`` it
    joins the objective's gradient with, and the ``name`` of the metric it is reported under."""

    name: str
    value: jax.Array
    weight: float


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExtraLossReport:
    """A model's further loss as the step reports it: ``value`` summed over the report's groups
    (microbatches × data shards), :meth:`metrics` their mean under ``name``."""

    value: jax.Array
    name: str = field(metadata={"static": True})

    def metrics(self, groups: int = 1) -> dict[str, float]:
        return {self.name: float(self.value) / groups}


def extra_loss(model: nnx.Module, x: jax.Array, tokens: jax.Array) -> ExtraLoss | None:
    """The model's further loss of the last block's output ``x`` (``None`` without one)."""
    own = getattr(model, "extra_loss", None)
    return None if own is None else own(x, tokens)


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
    """The full forward pass through the contract: embed -> prefix -> blocks -> head, of ``tokens`` [b, s]
    (in ``ctx``: packed documents', :meth:`Context.for_tokens`; default, one sequence per row)."""
    ctx = Context.for_sequence(*tokens.shape) if ctx is None else ctx
    return model.head(final_hidden(model, tokens, ctx, remat=remat))


def head_loss(model: nnx.Module, x: jax.Array, tokens: jax.Array) -> jax.Array:
    """The objective of the last block's output ``x`` [b, s, h] for a batch ``tokens`` (any form
    :func:`next_token_pairs` reads): the mean next-token loss through the head, for packed documents'
    features each token's loss weighted as they say.

    A model's :func:`extra_loss` joins the gradient only: ``weight · extra`` is added and subtracted
    again under ``stop_gradient``, so the value stays the next-token loss exactly (the loss every run
    reports and evaluates, comparable with a model without it) while the gradient is that of
    ``loss + weight · extra``, whatever seed a schedule gives the loss. The extra loss is reported on
    its own (:func:`batch_reports`)."""
    seen = documents.view(tokens)
    loss = documents.weighted_mean(token_losses(model, model.head(x), seen.targets), seen.weights)
    extra = extra_loss(model, x, tokens)
    if extra is not None and extra.weight:
        term = extra.weight * extra.value.astype(jnp.float32)
        loss = loss + (term - jax.lax.stop_gradient(term))
    return loss


def lm_loss(model: nnx.Module, tokens: jax.Array, *, remat: str = "none") -> jax.Array:
    """Mean next-token loss of a batch (any form :func:`next_token_pairs` reads); for packed
    documents' features, each token's loss weighted as they say. The objective: with a model's
    :func:`extra_loss`, its gradient is that of the extra loss too (:func:`head_loss`)."""
    seen, ctx = documents.view(tokens), Context.for_tokens(tokens)
    return head_loss(model, final_hidden(model, seen.inputs, ctx, remat=remat), tokens)


def batch_reports(model: nnx.Module, tokens: jax.Array) -> tuple[Any, ...]:
    """What a forward over a batch ``tokens`` (any form :func:`next_token_pairs` reads) reports: the
    blocks' reports stacked over the layers (:func:`layer_reports`), then, with a model's
    :func:`extra_loss`, its unweighted value (:class:`ExtraLossReport`)."""
    seen, ctx = documents.view(tokens), Context.for_tokens(tokens)
    x, found = run_blocks(model.blocks, embed_tokens(model, seen.inputs, ctx), ctx, collect=True)
    extra = extra_loss(model, x, tokens)
    return found if extra is None else (*found, ExtraLossReport(extra.value.astype(jnp.float32), extra.name))


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
    prefix = getattr(model, PREFIX, None)
    if prefix is not None and not isinstance(prefix, nnx.Module):
        _fail(f"{kind}.prefix is a {type(prefix).__name__}, not stacked blocks",
              "set self.prefix = meshtron.models.stack_blocks(make_block, n, rngs, axis=PREFIX_LAYERS), or no prefix")
    named = {name for name, _ in rules}
    depth, prefix_depth = None, None
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
        in_blocks, in_prefix = where.startswith("blocks."), where.startswith(f"{PREFIX}.")
        if in_blocks and axes[0] != LAYERS:
            _fail(f"parameter {where} is under blocks but its first axis is {axes[0]!r}, not 'layers'",
                  "build blocks with meshtron.models.stack_blocks(make_block, layers, rngs)")
        if in_prefix and (not axes or axes[0] != PREFIX_LAYERS):
            _fail(f"parameter {where} is under prefix but its first axis is {axes[0] if axes else None!r}, "
                  f"not {PREFIX_LAYERS!r}", "build the prefix with meshtron.models.stack_blocks(make_block, n, rngs, "
                  "axis=PREFIX_LAYERS)")
        if not in_blocks and LAYERS in axes:
            _fail(f"parameter {where} has a 'layers' axis outside blocks",
                  "keep stacked layers under the model's blocks attribute")
        if not in_prefix and PREFIX_LAYERS in axes:
            _fail(f"parameter {where} has a {PREFIX_LAYERS!r} axis outside prefix",
                  "keep the prefix's stacked layers under the model's prefix attribute")
        if in_prefix:
            if prefix_depth is not None and shape[0] != prefix_depth:
                _fail(f"parameter {where} stacks {shape[0]} layers, others of the prefix {prefix_depth}",
                      "stack every prefix parameter once")
            prefix_depth = shape[0]
        if in_blocks:
            if depth is not None and shape[0] != depth:
                _fail(f"parameter {where} stacks {shape[0]} layers, others {depth}", "stack every block parameter once")
            depth = shape[0]
    if depth is None:
        _fail(f"{kind}.blocks holds no parameters", "build blocks with meshtron.models.stack_blocks")
