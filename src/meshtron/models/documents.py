"""Packed documents: windows that hold several documents, each attending, positioned and scored on
its own -- Megatron-LM's ``--reset-attention-mask --reset-position-ids --eod-mask-loss`` and
MaxText's segment ids, for every model of the contract.

A training batch is either plain windows of tokens, ``[b, s + 1]`` (documents run into each other:
pretraining's default), or **document windows** ``[b, s + 1, 3]``: every token with its segment id
(which document of the window it belongs to; ``0`` marks padding) and its loss mask (1 where the
token counts as a target: every token of pretraining data, the responses alone of supervised
fine-tuning data). The train step turns document windows into per-token **features** ``[b, s, 5]``
(:func:`document_features`) before it splits the batch over devices, so that every device, pipeline
stage and context-parallel rank reads what it needs from its own tokens:

* ``input``, ``target``: the token and the one it predicts;
* ``position``: the token's place in its own document (rotary or learned positions restart at every
  document);
* ``segment``: its document, which attention masks by (a query sees the earlier keys of its own
  document only: :func:`meshtron.models.attention.causal_attention` reads it from the scope
  :func:`document_segments` that :func:`meshtron.models.blocks.run_blocks` opens, so no model
  passes anything);
* ``weight``: the token's share of the batch's loss, as fp32 bits. It is zero where the target is
  not the same document's next token (the last token of a document, padding) or is masked out, and
  ``b·s / N`` elsewhere for the batch's ``N`` counted targets, so that the per-microbatch,
  per-device means the step already averages come to the batch's mean over its counted targets,
  whatever the microbatches, data shards and context ranks (Megatron-LM's loss over the global
  number of tokens).

Preference pairs whose reference log-probabilities were computed before training
(``train.dpo.precompute_reference``) carry a fourth window channel and a sixth feature, ``reference``:
the row's reference log-probability as fp32 bits on every position, so that every data shard, pipeline
stage and context rank reads it from its own tokens, as it reads the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtron.trace_context import current, using

WINDOW_CHANNELS = 3  # token, segment, loss mask
FEATURES = 5  # input, target, position, segment, weight
INPUT, TARGET, POSITION, SEGMENT, WEIGHT = range(FEATURES)
REFERENCE = FEATURES  # a sixth feature (fourth window channel): a row's precomputed reference log-probability


class TokenView(NamedTuple):
    """What a batch as the step hands it (``[b, s + 1]`` tokens, ``[b, s, 2]`` context-split pairs or
    ``[b, s, 5]`` features) says about each of its ``[b, s]`` inputs. ``positions``, ``segments`` and
    ``weights`` are ``None`` for plain windows: positions then follow from the sequence's layout, and
    every token counts alike."""

    inputs: jax.Array
    targets: jax.Array
    positions: jax.Array | None = None
    segments: jax.Array | None = None
    weights: jax.Array | None = None
    reference: jax.Array | None = None  # [b, s] fp32: the row's precomputed reference log-probability


def is_document_windows(tokens: jax.Array) -> bool:
    """Whether a host batch is document windows ``[b, s + 1, 3]`` (or ``4`` with a reference channel;
    else plain ``[b, s + 1]``)."""
    return tokens.ndim == 3 and tokens.shape[-1] in (WINDOW_CHANNELS, WINDOW_CHANNELS + 1)


def view(tokens: jax.Array) -> TokenView:
    """The inputs, targets and, for features, positions, segments and loss weights of a batch."""
    if tokens.ndim == 2:
        return TokenView(tokens[:, :-1], tokens[:, 1:])
    if tokens.shape[-1] == 2:
        return TokenView(tokens[..., 0], tokens[..., 1])
    if tokens.shape[-1] not in (FEATURES, FEATURES + 1):
        raise ValueError(f"tokens: expected [b, s+1], [b, s, 2] or [b, s, {FEATURES}] features, got {tokens.shape}")
    weights = jax.lax.bitcast_convert_type(tokens[..., WEIGHT], jnp.float32)
    reference = (jax.lax.bitcast_convert_type(tokens[..., REFERENCE], jnp.float32)
                 if tokens.shape[-1] > FEATURES else None)
    return TokenView(tokens[..., INPUT], tokens[..., TARGET], tokens[..., POSITION], tokens[..., SEGMENT], weights,
                     reference)


def document_positions(segments: jax.Array) -> jax.Array:
    """``[b, s]`` positions that restart at 0 wherever the segment id changes along a row."""
    index = jnp.arange(segments.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return index - first


def document_features(windows: jax.Array) -> jax.Array:
    """Document windows ``[b, s + 1, 3]`` (token, segment, loss mask) as features ``[b, s, 5]``
    (module doc): the whole batch at once, so the loss weights are normalised over all of it. A fourth
    channel (a precomputed reference log-probability's bits) becomes a sixth feature."""
    tokens, segments, mask = (windows[..., i].astype(jnp.int32) for i in range(WINDOW_CHANNELS))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    own = segments[:, :-1]
    counted = (mask[:, 1:] != 0) & (segments[:, 1:] == own) & (own != 0)
    count = jnp.sum(counted.astype(jnp.float32))
    weights = jnp.where(counted, counted.size / jnp.maximum(count, 1.0), 0.0).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(weights, jnp.int32)
    reference = [windows[:, :-1, WINDOW_CHANNELS].astype(jnp.int32)] if windows.shape[-1] > WINDOW_CHANNELS else []
    return jnp.stack([inputs, targets, document_positions(own), own, bits, *reference], axis=-1)


def weighted_mean(losses: jax.Array, weights: jax.Array | None) -> jax.Array:
    """The mean of per-token ``losses`` [b, s], each scaled by its loss weight (features')."""
    if weights is None:
        return jnp.mean(losses)
    return jnp.mean(losses * weights)


@contextlib.contextmanager
def document_segments(segments: jax.Array | None) -> Iterator[None]:
    """Inside the block, attention over a whole sequence (no cache) masks keys of other documents:
    ``segments`` [b, s] are the segment ids of the tokens attention sees (``None``: one sequence)."""
    with using(segments=segments):
        yield


def active_segments() -> jax.Array | None:
    """The segment ids of the innermost :func:`document_segments` (``None`` outside one)."""
    return current().segments


def same_document(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """``[b, 1, s_q, s_k]``: whether each query and key are of the same document (a mask over heads)."""
    return (query_segments[:, :, None] == key_segments[:, None, :])[:, None]
