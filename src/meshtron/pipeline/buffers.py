"""The runtime's buffers and its ordering token: slot buffers of activations and gradients written and
read in place inside the tick loop, per-layer accumulators, and ``seq``, the exactly-zero scalar whose
data dependencies put every collective-bearing operation in one order on every device (the runtime's
deadlock rule, :mod:`meshtron.pipeline.runtime`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshtron.pipeline.stage import PyTree
from meshtron.sharding import manual_part, spec_axes

__all__ = ["accumulate", "after", "chunk_of", "get", "index_after", "put", "read_slot", "token", "write_slot"]


def write_slot(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer[slot] = value`` when ``slot >= 0``; unchanged otherwise."""
    index = jnp.maximum(slot, 0)
    current = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, current), index, 0)


def read_slot(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


def get(buffer: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
    """``buffer[index]`` for leading indices ``index`` (each in range)."""
    start = (*index, *(0,) * (buffer.ndim - len(index)))
    return jax.lax.dynamic_slice(buffer, start, (*(1,) * len(index), *buffer.shape[len(index):])).reshape(
        buffer.shape[len(index):])


def put(buffer: jax.Array, index: tuple[jax.Array, ...], value: jax.Array) -> jax.Array:
    """``buffer[index] = value`` for leading indices ``index`` (each in range): in place in a loop."""
    start = (*index, *(0,) * (buffer.ndim - len(index)))
    return jax.lax.dynamic_update_slice(buffer, value.reshape((1,) * len(index) + value.shape).astype(buffer.dtype),
                                        start)


def index_after(index: jax.Array, seq: jax.Array) -> jax.Array:
    """``index`` unchanged in value, but computed after ``seq`` (exactly zero) exists: reads at it wait
    for ``seq`` without a pass over the values they read."""
    return index + seq.astype(index.dtype)


def accumulate(g_stage: PyTree, index: tuple[jax.Array, ...], flat: list[jax.Array]) -> PyTree:
    """``g_stage[index] += d`` for every leaf, in place in a loop: ``index`` is ``(chunk,)`` with a
    chunk's gradients or ``(chunk, layer)`` with one layer's (``flat``: in leaf order; ``None``
    leaves that one as it is)."""
    leaves, treedef = jax.tree.flatten(g_stage)
    return treedef.unflatten([g if d is None else put(g, index, get(g, index) + d) for g, d in zip(leaves, flat)])


def chunk_of(stage_params: PyTree, chunk: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False), stage_params)


def token(tree: PyTree) -> jax.Array:
    """``0.0`` as an f32 scalar that *depends on* ``tree`` (one element of its first leaf, made finite,
    times zero). XLA does not fold ``x * 0`` for floating point (NaN semantics), so whatever consumes
    the token is ordered after whatever produced ``tree``; the value is exactly zero (or -0.0)."""
    leaf = jax.tree.leaves(tree)[0]
    # One element by index, not ``ravel(leaf)[0]``: flattening an array split over an auto axis (a
    # sequence-parallel activation) would make the compiler gather all of it first.
    v = leaf[(0,) * leaf.ndim].astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0) * 0.0


def local_token(x: jax.Array, spec: PartitionSpec | None) -> jax.Array:
    """:func:`token` of ``x`` laid out ``spec``, taken from each device's own shard: no collective.

    An element of an array the compiler splits (a sequence-parallel activation) lives on one device
    of its group; reading it from the others is an all-reduce -- a collective outside the chain the
    token builds, racing the ``conditional`` s it should order. Each device reads its own block's
    first element instead, in a ``shard_map`` over the compiler-managed axes, and the zeros agree."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
    if spec is None or mesh.empty or not spec_axes(spec) & auto:
        return token(x)
    return jax.shard_map(token, mesh=mesh, in_specs=(manual_part(spec, auto),), out_specs=PartitionSpec(),
                         axis_names=set(auto), check_vma=False)(x)


def after(tree: PyTree, seq: jax.Array) -> PyTree:
    """``tree`` unchanged in value (``x + 0.0``), but computed after ``seq`` exists."""
    return jax.tree.map(lambda x: x + seq.astype(x.dtype), tree)
