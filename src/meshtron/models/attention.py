"""Causal self-attention shared by every model family (GPT, Llama, a user's own blocks).

One function, :func:`causal_attention`, does both the training-time attention over a whole
sequence and cached decoding (prefill, then one token at a time), on top of
:func:`jax.nn.dot_product_attention`, so that every model gets the same numerics and the same
fast paths:

* **Grouped-query attention without copies.** ``q`` has ``heads`` heads, ``k``/``v`` have
  ``kv_heads`` with ``heads % kv_heads == 0``. ``jax.nn.dot_product_attention`` takes the two head
  counts as they are (its XLA implementation views ``q`` as ``[b, s, kv_heads, group, d]`` and
  contracts every group against the same key head), so the ``kv_heads`` keys and values are never
  repeated in memory -- neither in the forward nor in the backward pass, and not in a decoding
  cache, which holds ``kv_heads`` heads only.
* **fp32 scores.** The XLA implementation (the default, and the only one on CPU) computes the
  logits ``q k^T`` with fp32 accumulation and an fp32 result for bf16/fp16 inputs
  (``preferred_element_type`` float32, dot algorithm ``BF16_BF16_F32`` / ``F16_F16_F32``) and the
  softmax in fp32; the probabilities are then rounded to the inputs' dtype for the ``probs @ v``
  product (as flash attention does), and the output has ``v``'s dtype. Nothing has to be upcast
  here, which would double the memory of ``q`` and ``k`` for nothing.
* **Backends.** ``implementation=None`` is the run's choice (:func:`attention_implementation`,
  set from ``model.attention`` by the trainer), and else JAX's: today (jax 0.10 / 0.12) always XLA.
  On GPUs choose ``"cudnn"`` for cuDNN flash attention (fp16/bf16 only, a subset of
  head sizes; it raises, at trace time, for what it does not support). The cached path's
  explicit mask is turned into an additive bias by the cuDNN path. cuDNN is called where every mesh
  axis is manual (:mod:`meshtron.models.fused_attention`: JAX's partitioner for it fails inside the
  train step's partly manual ``shard_map``); over a sequence split on context ranks, by any
  exchange (the gathered one and Ulysses's as one call, the ring and the hybrid one call per block:
  :mod:`meshtron.models.cudnn_blocks`).
* **Tensor parallelism.** Nothing here names a mesh axis: with ``q`` split over heads (and ``k``/
  ``v`` split over ``kv_heads`` when ``tensor`` divides it, else replicated) every head's attention
  is local to its device and the compiler inserts no collective.

Shapes: ``q`` ``[batch, seq, heads, head_dim]``; ``k``, ``v`` ``[batch, seq, kv_heads, head_dim]``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, overload

import jax
import jax.numpy as jnp

from meshtron.models.context_attention import kv_axes, query_axes, sequence_split, split_attention
from meshtron.models.documents import active_segments, same_document
from meshtron.models.fused_attention import dot_product_attention
from meshtron.trace_context import current, using

Implementation = Literal["xla", "cudnn"] | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """One layer's decoding cache: keys and values of every position written so far.

    ``k``, ``v``: ``[batch, max_len, kv_heads, head_dim]``. Entries at positions not yet written
    hold anything (zeros at first); :func:`causal_attention` never lets a query see them. A pytree
    (both fields are leaves), so a model can stack one per layer (``[layers, batch, max_len, ...]``)
    and hand each layer its slice through ``lax.scan``.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype: jnp.dtype | type = jnp.float32) -> KVCache:
        """An empty cache for ``max_len`` positions, in ``dtype`` (new keys/values are cast to it)."""
        shape = (batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


@contextlib.contextmanager
def attention_implementation(name: Implementation) -> Iterator[None]:
    """Inside the block, :func:`causal_attention` calls without ``implementation`` use ``name``
    (``model.attention``: ``"xla"`` or ``"cudnn"``); models need not pass it down."""
    with using(attention=name):
        yield


@contextlib.contextmanager
def selective_recompute(enabled: bool = True) -> Iterator[None]:
    """Inside the block, functions wrapped by :func:`attention_core` keep nothing for the backward pass
    but their inputs (``model.remat=selective``; the trainer sets it)."""
    with using(recompute_core=enabled):
        yield


def attention_core(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Mark ``fn`` as an attention core -- scores, softmax, dropout, the weighted sum of values -- for
    Megatron's selective activation recomputation (Korthikanti et al. 2022, §5).

    Under ``model.remat=selective`` the call is ``jax.checkpoint(fn)`` with the ``nothing_saveable``
    policy: the backward pass keeps only ``fn``'s inputs (q, k, v, which the block keeps anyway) and
    recomputes the ``[batch, heads, seq, seq]`` scores and probabilities, the ``5·a·s/h`` term of the
    paper's per-layer memory, at the cost of one core forward. Everything else in the block is kept.
    This is the whole selective policy in one place, so it works for any model whose attention
    goes through :func:`causal_attention` (or a core of its own wrapped by this); the alternative,
    a block-level policy on named values, would need every model to name every value it keeps.
    Outside ``selective`` the call is ``fn`` itself.
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not current().recompute_core:
            return fn(*args, **kwargs)
        return jax.checkpoint(functools.partial(fn, **kwargs), policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=False)(*args)

    return call


@attention_core
def _causal_core(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, implementation: Implementation,
                 key_axes: tuple[str | None, ...], value_axes: tuple[str | None, ...]) -> jax.Array:
    return dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation=implementation,
                                 key_axes=key_axes, value_axes=value_axes)


@attention_core
def _documents_core(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, *, scale: float,
                    implementation: Implementation, key_axes: tuple[str | None, ...],
                    value_axes: tuple[str | None, ...]) -> jax.Array:
    # A boolean mask beside the causal one: XLA applies both to the scores; cuDNN turns the mask into
    # a bias and keeps its own causal mask.
    return dot_product_attention(q, k, v, mask=same_document(segments, segments), is_causal=True, scale=scale,
                                 implementation=implementation, key_axes=key_axes, value_axes=value_axes)


_split_core = attention_core(split_attention)


def stacked_caches(layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                   dtype: jnp.dtype | type = jnp.float32) -> KVCache:
    """Empty caches for ``layers`` layers, stacked ``[layers, ...]`` (a model's ``init_cache``)."""
    one = KVCache.zeros(batch, max_len, kv_heads, head_dim, dtype)
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (layers, *a.shape)), one)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Fail at trace time with a message naming the shapes, instead of deep inside the attention."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "causal_attention: q, k, v must be [batch, seq, heads, head_dim]; "
            f"got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"causal_attention: k {k.shape} and v {v.shape} must have the same shape")
    (b, s, n, d), (kb, ks, kn, kd) = q.shape, k.shape
    if (b, s, d) != (kb, ks, kd):
        raise ValueError(
            f"causal_attention: q {q.shape} and k/v {k.shape} must agree on batch, seq and head_dim"
        )
    if n % kn:
        raise ValueError(f"causal_attention: heads ({n}) must be a multiple of kv_heads ({kn})")


@overload
def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array | None = None,
    cache: None = None, implementation: Implementation = None, segments: jax.Array | None = None,
) -> jax.Array: ...


@overload
def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, positions: jax.Array, cache: KVCache,
    implementation: Implementation = None, segments: None = None,
) -> tuple[jax.Array, KVCache]: ...


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    positions: jax.Array | None = None,
    cache: KVCache | None = None,
    implementation: Implementation = None,
    segments: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, KVCache]:
    """Causal (grouped-query) self-attention, scaled by ``1/sqrt(head_dim)``.

    Without ``cache``: every query attends to the keys at its own and earlier positions of the
    same sequence; returns ``[batch, seq, heads, head_dim]`` in ``v``'s dtype. ``positions`` is not
    needed (and is ignored): the mask depends only on the order within the sequence. In a window of
    packed documents a query sees only the earlier keys of its own document: ``segments`` [batch, seq]
    say which document each token is of (default: those of the active
    :func:`~meshtron.models.documents.document_segments` scope, which the trainer opens around the
    blocks, so a model passes nothing). When the
    sequence is split over context-parallel ranks (traced inside the train step on a mesh with
    ``context`` > 1), ``q``, ``k``, ``v`` are this rank's tokens and the keys and values of the others
    are exchanged over that axis (:mod:`meshtron.models.context_attention`); the model does nothing.

    With ``cache`` (decoding): ``positions`` ``[batch, seq]`` are the absolute positions of the
    query tokens. They must be contiguous and start at the same position in every row -- true
    for prefill (``0 .. prompt_len - 1``) and for a one-token step at position ``p``, and what
    :meth:`meshtron.models.blocks.Context.for_sequence` makes. The new ``k``/``v`` (cast to the
    cache's dtype) are written at ``positions[0, 0] ..`` with one ``dynamic_update_slice`` (a
    contiguous in-place write, no scatter), and each query attends to the cache entries at
    positions ``<= its own`` (an explicit boolean mask built from ``positions``; later, unwritten
    or stale entries are ignored). Returns ``(out, new_cache)``. The caller must keep
    ``positions[0, 0] + seq <= max_len``: ``dynamic_update_slice`` clamps an out-of-range start
    (it would overwrite the last entries instead of failing), and a traced start cannot be
    checked here.
    """
    _check_shapes(q, k, v)
    implementation = implementation or current().attention
    scale = 1.0 / math.sqrt(q.shape[-1])
    if cache is None:
        segments = active_segments() if segments is None else segments
        if sequence_split() is not None:  # k's and v's layouts read here: the core may retrace them
            return _split_core(q, k, v, implementation=implementation, segments=segments, key_axes=kv_axes(k),
                               value_axes=kv_axes(v), q_axes=query_axes(q))
        layouts = {"key_axes": kv_axes(k), "value_axes": kv_axes(v)}  # read before the core retraces k and v
        if segments is not None:
            return _documents_core(q, k, v, segments, scale=scale, implementation=implementation, **layouts)
        return _causal_core(q, k, v, scale=scale, implementation=implementation, **layouts)

    if positions is None:
        raise ValueError("causal_attention: decoding with a cache needs the queries' positions [batch, seq]")
    batch, seq = q.shape[:2]
    if positions.shape != (batch, seq):
        raise ValueError(f"causal_attention: positions {positions.shape} must be [batch, seq] = {(batch, seq)}")
    expected = (batch, cache.k.shape[1], k.shape[2], k.shape[3])
    if cache.k.shape != expected or cache.v.shape != expected:
        raise ValueError(
            f"causal_attention: cache k {cache.k.shape} / v {cache.v.shape} must be "
            f"[batch, max_len, kv_heads, head_dim] = {expected} for k/v {k.shape}"
        )
    max_len = cache.k.shape[1]
    if seq > max_len:
        raise ValueError(f"causal_attention: {seq} new tokens do not fit a cache of {max_len} positions")

    positions = positions.astype(jnp.int32)
    start = positions[0, 0]
    zero = jnp.zeros((), jnp.int32)
    index = (zero, start, zero, zero)
    new_cache = KVCache(
        jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), index),
        jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), index),
    )
    # [batch, 1, seq, max_len]: query t of row b sees cache entry j iff j <= positions[b, t]. Broadcast
    # over heads (dot_product_attention accepts a size-1 head axis), so it costs batch*seq*max_len bools.
    key_positions = jnp.arange(max_len, dtype=jnp.int32)
    mask = (key_positions[None, None, :] <= positions[:, :, None])[:, None, :, :]
    out = dot_product_attention(q.astype(new_cache.k.dtype), new_cache.k, new_cache.v, mask=mask, scale=scale,
                                implementation=implementation)
    return out.astype(v.dtype), new_cache
