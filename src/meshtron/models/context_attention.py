"""Causal attention over a sequence split across devices (context parallelism).

Each of ``n`` ranks of a mesh axis holds ``S/n`` of a sequence's tokens. Under a causal mask a
token attends to the tokens before it, so a rank that held one contiguous slice would have work in
proportion to its position: the last rank's queries see the whole sequence, the first's almost
nothing. :func:`balanced_order` gives rank ``r`` two slices, chunk ``r`` and chunk ``2n-1-r`` of the
sequence cut into ``2n``, so that every rank has the same amount of attention (Megatron-Core's and
torchtitan's load balancing). Positions (RoPE, and the causal mask) are then those of the rank's own
tokens, not ``0 .. S/n - 1``.

A model does nothing for any of this. The rules table places the logical ``seq`` axis on a mesh
axis (``context``); the train step runs manual over it, each rank holding its two chunks of every
sequence. :func:`sequence_split` sees that from inside, :meth:`meshtron.models.blocks.Context.for_sequence`
then gives each rank its tokens' positions (:func:`local_positions`), and
:func:`meshtron.models.attention.causal_attention` attends across the ranks with the exchange the run
chose (:func:`context_exchange`, ``parallel.context_attention``).

Four exchanges, all called inside ``shard_map`` manual over the sequence's mesh axis. Two move keys
and values, with the mask built from the positions (which every rank knows from the layout: only keys
and values travel):

* :func:`gathered_kv_attention`: each rank all-gathers the keys and values (only the key/value heads
  under grouped-query attention) and attends for its own queries; it holds the whole sequence's
  keys, values and scores.
* :func:`ring_attention`: the key/value blocks travel around the ring, each block's output folded
  into a running one by their log-sum-exps; forward and backward hold two blocks at a time, so its
  memory does not grow with the number of ranks (``tests/test_context_attention.py`` reads it from
  compiled programs). A pair of kernels attends each block (:mod:`meshtron.models.attention_blocks`):
  XLA's, or cuDNN's flash kernels with ``implementation="cudnn"``.

Two trade the sequence split for a head split by all-to-alls (:mod:`meshtron.models.ulysses`):
``ulysses`` over every rank, each then attending over the whole sequence, in order, with the run's
kernel and its plain causal mask; ``hybrid``, over groups of ``ulysses_degree`` consecutive ranks, the
groups then attending by the ring above (every ``ulysses_degree``-th rank one ring). The order a
sequence is stored in follows the exchange (:func:`sequence_order`): the ranks an all-to-all joins
hold consecutive parts of what their group attends for.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from meshtron.execution import EXCHANGES, checked_exchange
from meshtron.models.attention_blocks import XLA_KERNELS, BlockKernels
from meshtron.models.cudnn_blocks import cudnn_kernels
from meshtron.models.documents import same_document
from meshtron.models.fused_attention import dot_product_attention, manual_blocks
from meshtron.models.ulysses import ulysses_attention
from meshtron.sharding import LogicalAxes, constrain, logical_to_spec, manual_part, pinned_axes
from meshtron.trace_context import current, using


@contextlib.contextmanager
def context_exchange(name: str, ulysses_degree: int = 1) -> Iterator[None]:
    """Inside the block, attention over a split sequence exchanges keys and values as ``name`` says:
    ``"gathered"`` (:func:`gathered_kv_attention`), ``"ring"`` (:func:`ring_attention`), ``"ulysses"`` or
    ``"hybrid"`` (:mod:`meshtron.models.ulysses`; the hybrid's all-to-alls over ``ulysses_degree`` ranks)."""
    with using(exchange=checked_exchange(name), ulysses_degree=ulysses_degree):
        yield


def ulysses_ranks(ranks: int) -> int:
    """How many consecutive ranks of the ``ranks`` a sequence is split over join in the active exchange's
    all-to-all: all of them (``ulysses``), ``ulysses_degree`` (``hybrid``), none but each itself (1:
    ``gathered``, ``ring``)."""
    exchange = current().exchange
    if exchange == "ulysses":
        return ranks
    return current().ulysses_degree if exchange == "hybrid" else 1


def sequence_split() -> tuple[str, int] | None:
    """``(mesh axis, ranks)`` when code traced here sees a split sequence: the rules place the logical
    ``seq`` axis on a mesh axis of more than one device over which the surrounding ``shard_map`` is
    manual. ``None`` otherwise (the whole sequence is local)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    spec = logical_to_spec(("seq",))
    axis = spec[0] if len(spec) else None
    if not isinstance(axis, str) or axis not in mesh.manual_axes or mesh.shape[axis] == 1:
        return None
    return axis, mesh.shape[axis]


def local_positions(tokens: int) -> jax.Array:
    """Positions ``[tokens]`` of this rank's tokens of a split sequence (:func:`sequence_split`), laid
    out by :func:`sequence_order` for the active exchange; ``0 .. tokens-1`` when the sequence is whole."""
    split = sequence_split()
    if split is None:
        return jnp.arange(tokens, dtype=jnp.int32)
    axis, ranks = split
    return _rank_positions(sequence_order(tokens * ranks, ranks, ulysses_ranks(ranks)), axis)


QUERIES = ("batch", "seq", "heads", "head_dim")
KEYS = ("batch", "seq", "kv_heads", "head_dim")
TOKENS = ("batch", "seq")


def query_axes(x: jax.Array) -> tuple[str | None, ...]:
    """The logical axes of queries ``x`` [b, s, heads, d]: those the model pinned it to, else :data:`QUERIES`
    (read, as :func:`kv_axes`, before anything retraces ``x``)."""
    axes = pinned_axes(x)
    return axes if axes is not None and len(axes) == x.ndim else QUERIES


def kv_axes(x: jax.Array) -> tuple[str | None, ...]:
    """The logical axes of keys or values ``x`` [b, s, kv_heads, d] as the model laid them out: those it
    pinned this very value to (:func:`meshtron.sharding.constrain`), else :data:`KEYS`. A model may
    name its key/value heads as it likes (and keep them whole on every tensor rank); read it before
    anything retraces ``x`` (``jax.checkpoint``), since a retraced value is a new one."""
    axes = pinned_axes(x)
    return axes if axes is not None and len(axes) == x.ndim else KEYS


def split_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str | None = None,
                    segments: jax.Array | None = None, key_axes: LogicalAxes | None = None,
                    value_axes: LogicalAxes | None = None, q_axes: LogicalAxes | None = None) -> jax.Array:
    """Causal attention of this rank's tokens of a split sequence over the whole sequence, with the
    active :func:`context_exchange`. Call only where :func:`sequence_split` is not ``None``.
    ``segments`` [b, s]: this rank's tokens' documents, for packed windows (a query then sees keys of
    its own document only). ``key_axes``, ``value_axes``, ``q_axes``: the logical layout of ``k``,
    ``v`` and ``q`` (default :func:`kv_axes`, :func:`query_axes`), which the gathered exchange keeps,
    Ulysses's all-to-alls keep, and cuDNN's kernels are called in. ``implementation="cudnn"``: the
    gathered exchange's one call, Ulysses's attention over the whole sequence, or each of the ring's
    blocks, goes to cuDNN's flash attention."""
    axis, ranks = sequence_split()
    exchange = current().exchange
    key_axes = kv_axes(k) if key_axes is None else tuple(key_axes)
    value_axes = kv_axes(v) if value_axes is None else tuple(value_axes)
    if exchange in ("ulysses", "hybrid"):
        u = ulysses_ranks(ranks)
        if exchange == "hybrid" and not (1 < u < ranks and ranks % u == 0):
            raise ValueError(f"parallel.ulysses_degree: the hybrid exchange needs 1 < parallel.ulysses_degree < "
                             f"parallel.context={ranks}, dividing it, got {u}")
        layout = query_axes(q) if q_axes is None else tuple(q_axes)
        ring = ranks // u
        seq = q.shape[1] * ranks

        def attend(q, k, v, segments):
            if ring == 1:  # the whole sequence, in order: the kernel's own causal mask
                mask = None if segments is None else same_document(segments, segments)
                return dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]),
                                             implementation=implementation, key_axes=layout, value_axes=layout)
            kernels = XLA_KERNELS
            if implementation == "cudnn":
                kernels = manual_blocks(cudnn_kernels(), key_axes=layout, value_axes=layout)
            return ring_attention(q, k, v, balanced_order(seq, ring), axis, segments=segments, kernels=kernels,
                                  stride=u)

        return ulysses_attention(q, k, v, axis, u, attend, segments=segments, query_axes=layout, key_axes=key_axes,
                                 value_axes=value_axes, exchange=exchange)
    order = balanced_order(q.shape[1] * ranks, ranks)
    if exchange == "ring":
        kernels = XLA_KERNELS
        if implementation == "cudnn":
            kernels = manual_blocks(cudnn_kernels(), key_axes=key_axes, value_axes=value_axes)
        return ring_attention(q, k, v, order, axis, segments=segments, kernels=kernels)
    return gathered_kv_attention(q, k, v, order, axis, implementation=implementation, segments=segments,
                                 key_axes=key_axes, value_axes=value_axes)


def sequence_order(seq_len: int, ranks: int, ulysses: int = 1) -> np.ndarray:
    """The order a sequence of ``seq_len`` tokens is stored in over ``ranks`` ranks whose exchange joins
    groups of ``ulysses`` consecutive ranks by all-to-alls (:func:`ulysses_ranks`): the
    :func:`balanced_order` of the ``ranks / ulysses`` groups, rank ``g·ulysses + i`` holding the ``i``-th
    contiguous ``1/ulysses`` of group ``g``'s part. The all-to-all then gives each group its part in that
    order: the whole sequence in order under ``ulysses`` (a plain causal mask), the ring's balanced
    part under the hybrid; ``ulysses=1`` is the gathered and ring exchanges' :func:`balanced_order`."""
    if ulysses < 1 or ranks % ulysses:
        raise ValueError(f"sequence_order: ulysses={ulysses} must divide ranks={ranks}")
    if seq_len % ranks:
        raise ValueError(f"sequence_order: seq_len={seq_len} must be divisible by ranks={ranks}")
    return balanced_order(seq_len, ranks // ulysses)


def balanced_order(seq_len: int, ranks: int) -> np.ndarray:
    """``order[i]``: the position of the token stored at index ``i`` when a sequence of ``seq_len``
    tokens is split over ``ranks`` in equal contiguous parts of ``seq_len / ranks``: rank ``r``'s part
    is chunks ``r`` and ``2·ranks - 1 - r`` of ``2·ranks`` equal chunks, in that order."""
    if seq_len % (2 * ranks):
        raise ValueError(f"balanced_order: seq_len={seq_len} must be divisible by 2 x ranks = {2 * ranks}")
    chunk = seq_len // (2 * ranks)
    starts = [c for r in range(ranks) for c in (r, 2 * ranks - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in starts])


def exchange_bytes(exchange: str, ranks: int, tokens: int, kv_heads: int, head_dim: int,
                   itemsize: int = 4, *, heads: int | None = None,
                   ulysses_degree: int | None = None) -> tuple[float, float]:
    """Bytes one rank sends over the sequence's axis per attention layer, ``(forward, backward)``, for
    ``tokens`` per rank (the rank's block of keys: ``tokens · kv_heads · head_dim · itemsize``).

    ``"gathered"``: the forward all-gathers keys and values (a ring all-gather sends ``(n-1)`` blocks
    of each); the backward reduce-scatters their gradients, as many bytes. ``"ring"``: the forward
    passes keys and values on ``n-1`` times; the backward too, with the keys' and values' fp32
    gradients travelling along, and moves the gradients once more to bring them home. Positions are
    never sent: every rank knows the layout.

    ``"ulysses"`` (``heads``: the query heads per tensor rank): the forward's all-to-alls over the ``u =
    ranks`` ranks send ``(u-1)/u`` of the queries, keys, values (``lcm(kv_heads, u)`` heads when ``u``
    does not divide ``kv_heads``: :mod:`meshtron.models.ulysses`) and the output; the backward's, of the
    output's gradient and the queries', keys' and values' gradients, as many. ``"hybrid"``: those
    all-to-alls over ``u = ulysses_degree`` ranks, and the ring's bytes over the ``ranks / u`` groups,
    each rank passing blocks of ``u · tokens`` tokens and ``lcm(kv_heads, u) / u`` heads. (A packed
    window's segment ids, ``4 · tokens`` bytes gathered alike, are left out.)

    The ring's figure is an upper bound where XLA sends less (docs/context-parallel.md): a ring of 2 ranks
    shares its backward's first move with the (recomputed) forward's where both are one program, and
    XLA:GPU sends the gradients' last move in the compute dtype."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    block = tokens * kv_heads * head_dim * itemsize
    if exchange == "gathered":
        return (ranks - 1) * 2 * block, (ranks - 1) * 2 * block
    if exchange == "ring":
        gradients = 2 * tokens * kv_heads * head_dim * 4
        return (ranks - 1) * 2 * block, (ranks - 1) * 2 * block + ranks * gradients
    if heads is None:
        raise ValueError(f"exchange_bytes: {exchange} needs heads (the query heads per tensor rank)")
    u = ranks if exchange == "ulysses" else ulysses_degree
    if u is None or u < 1 or ranks % u:
        raise ValueError(f"exchange_bytes: hybrid needs a ulysses_degree that divides ranks={ranks}, got {u}")
    kv = kv_heads if kv_heads % u == 0 else math.lcm(kv_heads, u)
    queries, keys = tokens * heads * head_dim * itemsize, tokens * kv * head_dim * itemsize
    all_to_all = (u - 1) / u * (2 * queries + 2 * keys)  # q, k, v and the output; or their gradients
    if exchange == "ulysses" or u == ranks:
        return all_to_all, all_to_all
    ring = exchange_bytes("ring", ranks // u, tokens * u, kv // u, head_dim, itemsize)
    return all_to_all + ring[0], all_to_all + ring[1]


def _rank_positions(order: np.ndarray, axis: str, behind: jax.Array | int = 0, stride: int = 1) -> jax.Array:
    """Positions ``[S/n]`` of the tokens rank ``(this rank - behind) mod n`` holds, in the layout
    ``order`` [S] (positions of the tokens as stored, rank after rank), of a ring of ``n`` ranks: every
    ``stride``-th rank of ``axis`` (:func:`_ring_index`)."""
    n = jax.lax.axis_size(axis) // stride
    rows = jnp.asarray(np.asarray(order, np.int32).reshape(n, -1))
    return rows[(_ring_index(axis, stride) - behind) % n]


def _ring_index(axis: str, stride: int) -> jax.Array:
    """This rank's place in its ring: rank ``g·stride + i`` of ``axis`` is the ``g``-th of the ring of
    ranks ``i, stride + i, ...``."""
    return jax.lax.axis_index(axis) // stride


def gathered_kv_attention(q: jax.Array, k: jax.Array, v: jax.Array, order: np.ndarray, axis: str, *,
                          implementation: str | None = None, segments: jax.Array | None = None,
                          key_axes: LogicalAxes | None = None, value_axes: LogicalAxes | None = None) -> jax.Array:
    """Causal attention of this rank's queries over the whole sequence, whose keys and values are
    all-gathered over the manual mesh ``axis``.

    ``q`` ``[b, s, heads, d]`` and ``k``/``v`` ``[b, s, kv_heads, d]`` are this rank's ``s`` tokens of a
    sequence stored in the order ``order`` ``[n·s]`` (the positions of its tokens, rank after rank:
    :func:`balanced_order`, or any order); a query attends to every key at its own or an earlier
    position. Returns ``[b, s, heads, d]``. The backward pass of the all-gather is a reduce-scatter of
    the keys' and values' gradients. ``segments`` [b, s] (packed documents): the tokens' documents,
    all-gathered too; a query then sees keys of its own document only. ``key_axes``, ``value_axes``:
    the logical axes ``k`` and ``v`` are laid out by (default :func:`kv_axes`); each device gathers
    the heads it holds, split over tensor ranks or whole. ``implementation``: the attention's, called
    through :func:`meshtron.models.fused_attention.dot_product_attention` (cuDNN's in a nested
    ``shard_map`` over the mesh axes still automatic, the mask going to it as a bias).
    """
    key_axes = kv_axes(k) if key_axes is None else tuple(key_axes)
    value_axes = kv_axes(v) if value_axes is None else tuple(value_axes)
    keys, values = _gathered_heads(k, axis, key_axes), _gathered_heads(v, axis, value_axes)
    positions = _rank_positions(order, axis)
    key_positions = jnp.asarray(np.asarray(order, np.int32))
    mask = (key_positions[None, :] <= positions[:, None])[None, None]  # [1, 1, s, S]
    if segments is not None:
        mask = mask & same_document(segments, _gathered_heads(segments, axis, TOKENS))
    scale = 1.0 / math.sqrt(q.shape[-1])
    return dot_product_attention(q, keys, values, mask=mask, scale=scale, implementation=implementation,
                                 key_axes=key_axes, value_axes=value_axes)


def _gathered_heads(x: jax.Array, axis: str, logical: tuple[str | None, ...]) -> jax.Array:
    """``x`` [b, s, kv_heads, d] all-gathered over ``axis`` along the sequence, each device gathering
    only the key/value heads it holds: its share where the rules split ``x``'s ``logical`` axes over
    tensor ranks, all of them where they keep them whole. Every mesh axis still automatic here (tensor)
    is made manual around the all-gather: left to the partitioner, it gathers the heads over them
    first (twice the bytes on two tensor ranks, read from the compiled step by ``describe``), and
    XLA:CPU's compiler aborts on a bf16 all-gather in a partly manual region ("Invalid binary
    instruction opcode copy")."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = set(mesh.axis_names) - set(mesh.manual_axes)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, axis=1, tiled=True)
    if not auto:
        return gather(x)
    logical = _even(logical, x.shape, auto)
    local = manual_part(logical_to_spec(logical), auto)
    return constrain(jax.shard_map(gather, mesh=mesh, in_specs=local, out_specs=local, axis_names=auto)(x), logical)


def _even(logical: tuple[str | None, ...], shape: tuple[int, ...], auto: set[str]) -> tuple[str | None, ...]:
    """``logical`` less the names the rules would split unevenly over the ``auto`` mesh axes (those
    dimensions kept whole): ``shard_map`` takes even splits only, and an array the model left unpinned
    (:func:`kv_axes` then assumes :data:`KEYS`) may have fewer key/value heads than tensor ranks."""
    mesh = jax.sharding.get_abstract_mesh()
    while True:
        spec = logical_to_spec(logical)
        uneven = [i for i, size in enumerate(shape) if size % _ranks(spec[i] if i < len(spec) else None, mesh, auto)]
        if not uneven:
            return logical
        logical = logical[:uneven[0]] + (None,) + logical[uneven[0] + 1:]


def _ranks(entry: str | tuple[str, ...] | None, mesh, auto: set[str]) -> int:
    """How many parts a ``PartitionSpec`` entry splits its dimension into over the ``auto`` mesh axes."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[n] for n in names if n in auto)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, order: np.ndarray, axis: str, *,
                   segments: jax.Array | None = None, kernels: BlockKernels = XLA_KERNELS,
                   stride: int = 1) -> jax.Array:
    """Causal attention of this rank's queries over the whole sequence, the keys and values passed
    around the ring of the manual mesh ``axis`` one block at a time (``ppermute``), each block's
    output folded into a running one by the log-sum-exps (the online softmax of flash attention).

    Arguments and result as :func:`gathered_kv_attention`. A rank holds two key/value blocks at a
    time (its own and the one in flight), never the whole sequence's. The backward pass is a second
    ring: each block's gradients come from the forward's output and log-sum-exp, and the keys' and
    values' gradients travel with their block until they are back on the rank that owns it, so the
    backward also holds two blocks, not every step's scores. Blocks combine in fp32; the result has
    ``v``'s dtype. ``segments`` (packed documents) travel round with their block of keys.
    ``kernels``: what attends one block of queries to one block of keys, forward and backward
    (:mod:`meshtron.models.attention_blocks`): XLA's fp32 ops by default, cuDNN's flash kernels
    (:func:`meshtron.models.cudnn_blocks.cudnn_kernels`, called where every mesh axis is manual:
    :func:`meshtron.models.fused_attention.manual_blocks`). ``stride``: the ring is every ``stride``-th
    rank of ``axis``, ``order`` the layout over its ``n / stride`` ranks (ranks ``i, stride + i, ...``
    form one ring, for each ``i``: the hybrid's, whose all-to-alls join ``stride`` consecutive ranks).
    """
    return _ring(q, k, v, segments, tuple(int(p) for p in order), axis, kernels, stride)


def _documents(query_segments, key_segments):
    """``[b, 1, s_q, s_k]``: same document; ``None`` without segments."""
    if query_segments is None:
        return None
    return same_document(query_segments, key_segments)


def _both(mask, other):
    """The conjunction of two masks, either of which may be ``None`` (no mask)."""
    if mask is None or other is None:
        return other if mask is None else mask
    return mask & other


def _shift(tree, axis: str, stride: int = 1):
    """``tree`` from each rank to the next of its ring (:func:`_ring_index`)."""
    n = jax.lax.axis_size(axis) // stride
    return jax.lax.ppermute(tree, axis, [(g * stride + i, (g + 1) % n * stride + i)
                                         for g in range(n) for i in range(stride)])


def _is_balanced(order, ranks: int) -> bool:
    """Whether ``order`` is :func:`balanced_order`'s layout, whose blocks from other ranks are each
    half masked in a known way (:func:`_ring_forward`)."""
    return len(order) % (2 * ranks) == 0 and np.array_equal(np.asarray(order), balanced_order(len(order), ranks))


def _ascending(order, ranks: int) -> bool:
    """Whether every rank's tokens in ``order`` are in sequence order: its own block is then causal
    by index, the kernels' ``causal`` mask."""
    return bool(np.all(np.diff(np.asarray(order).reshape(ranks, -1), axis=1) > 0))


def _fold(stats, block):
    """The running ``(out [b, t, h, d], lse [b, h, t])`` (fp32) with one more block's folded in."""
    out, lse = stats
    block_out, block_lse = block
    new = jnp.logaddexp(lse, block_lse)

    def weight(x):  # [b, h, t] -> [b, t, h, 1]
        return jnp.moveaxis(jnp.exp(x - new), -1, 1)[..., None]

    return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), new


def _rows(stats, start: int):
    """The running statistics of the queries from row ``start`` on."""
    out, lse = stats
    return out[:, start:], lse[..., start:]


def _with_rows(stats, part, start: int):
    """``stats`` with the rows from ``start`` on replaced by ``part``."""
    (out, lse), (part_out, part_lse) = stats, part
    return (jnp.concatenate([out[:, :start], part_out], axis=1),
            jnp.concatenate([lse[..., :start], part_lse], axis=-1))


def _own_mask(seg, positions, ascending):
    """The rank's own block's ``(causal, mask)``."""
    if ascending:
        return True, _documents(seg, seg)
    return False, _both((positions[None, :] <= positions[:, None])[None, None], _documents(seg, seg))


def _ring_forward(q, k, v, seg, order, axis, kernels, stride):
    """The ring's forward: ``(out, lse)``. Under the balanced layout (:func:`balanced_order`) every
    block after the rank's own is half hidden by the causal mask, in one of two ways: from an earlier
    rank, every query sees its front chunk and none of its back; from a later rank, only the back
    chunk's queries see it, wholly. Each such step computes just that half, unmasked but for packed
    documents (``cond`` on the rank pair): the ring then does ``(n + 1) / 2`` blocks of attention per
    rank instead of ``n``, the same on every rank. ``seg``: the rank's tokens' documents, or ``None``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    attend = functools.partial(kernels.forward, scale=scale)
    s, n = q.shape[1], jax.lax.axis_size(axis) // stride
    positions = _rank_positions(order, axis, stride=stride)
    half, balanced = s // 2, _is_balanced(order, n)
    back = None if seg is None else seg[:, half:]

    def step(carry, behind):
        kb, vb, ks, stats = carry
        kb, vb, ks = _shift((kb, vb, ks), axis, stride)  # the previous rank's block: rank (this - behind) mod n's
        if not balanced:
            kpos = _rank_positions(order, axis, behind, stride)
            mask = _both((kpos[None, :] <= positions[:, None])[None, None], _documents(seg, ks))
            return (kb, vb, ks, _fold(stats, attend(q, kb, vb, causal=False, mask=mask))), None
        earlier = behind <= _ring_index(axis, stride)  # the block comes from a rank before this one
        front = None if ks is None else ks[:, :half]
        stats = jax.lax.cond(
            earlier,  # every query, against the block's front chunk; or the back queries against all of it
            lambda: _fold(stats, attend(q, kb[:, :half], vb[:, :half], causal=False, mask=_documents(seg, front))),
            lambda: _with_rows(stats, _fold(_rows(stats, half), attend(q[:, half:], kb, vb, causal=False,
                                                                        mask=_documents(back, ks))), half))
        return (kb, vb, ks, stats), None

    causal, mask = _own_mask(seg, positions, _ascending(order, n))
    out, lse = attend(q, k, v, causal=causal, mask=mask)
    own = (out.astype(jnp.float32), lse)
    (_, _, _, (out, lse)), _ = jax.lax.scan(step, (k, v, seg, own), jnp.arange(1, n))
    return out.astype(v.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, seg, order, axis, kernels, stride):
    return _ring_forward(q, k, v, seg, order, axis, kernels, stride)[0]


def _ring_fwd(q, k, v, seg, order, axis, kernels, stride):
    out, lse = _ring_forward(q, k, v, seg, order, axis, kernels, stride)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(order, axis, kernels, stride, residuals, d_out):
    q, k, v, seg, out, lse = residuals
    d_out = d_out.astype(out.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    n = jax.lax.axis_size(axis) // stride
    positions = _rank_positions(order, axis, stride=stride)
    half, balanced = q.shape[1] // 2, _is_balanced(order, n)
    back = None if seg is None else seg[:, half:]

    def gradients(q, kb, vb, out, lse, d_out, causal=False, mask=None):  # one block's share, fp32
        grads = kernels.backward(q, kb, vb, out, lse, d_out, scale=scale, causal=causal, mask=mask)
        return tuple(g.astype(jnp.float32) for g in grads)

    def earlier_block(kb, vb, ks, dk, dv, dq):  # every query against the block's front chunk
        front = None if ks is None else ks[:, :half]
        gq, gk, gv = gradients(q, kb[:, :half], vb[:, :half], out, lse, d_out, mask=_documents(seg, front))
        return dk.at[:, :half].add(gk), dv.at[:, :half].add(gv), dq + gq

    def later_block(kb, vb, ks, dk, dv, dq):  # the back chunk's queries against the whole block
        gq, gk, gv = gradients(q[:, half:], kb, vb, out[:, half:], lse[..., half:], d_out[:, half:],
                               mask=_documents(back, ks))
        return dk + gk, dv + gv, dq.at[:, half:].add(gq)

    def step(carry, behind):
        kb, vb, ks, dk, dv, dq = carry
        # the next block arrives with the gradients it has gathered so far
        kb, vb, ks, dk, dv = _shift((kb, vb, ks, dk, dv), axis, stride)
        if balanced:
            dk, dv, dq = jax.lax.cond(behind <= _ring_index(axis, stride), earlier_block, later_block,
                                      kb, vb, ks, dk, dv, dq)
        else:
            kpos = _rank_positions(order, axis, behind, stride)
            mask = _both((kpos[None, :] <= positions[:, None])[None, None], _documents(seg, ks))
            gq, gk, gv = gradients(q, kb, vb, out, lse, d_out, mask=mask)
            dk, dv, dq = dk + gk, dv + gv, dq + gq
        return (kb, vb, ks, dk, dv, dq), None

    # the rank's own block, then the n - 1 others as they come round; a block's gradients travel with
    # it, and one last move brings them home (the block itself is not needed)
    causal, mask = _own_mask(seg, positions, _ascending(order, n))
    dq, dk, dv = gradients(q, k, v, out, lse, d_out, causal=causal, mask=mask)
    (_, _, _, dk, dv, dq), _ = jax.lax.scan(step, (k, v, seg, dk, dv, dq), jnp.arange(1, n))
    dk, dv = _shift((dk, dv), axis, stride)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
