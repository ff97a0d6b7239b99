"""Collective matmul: the tensor-parallel regions' sequence collectives under sequence parallelism
overlapped with the projections that consume or produce them.

Under sequence parallelism each tensor rank holds ``s/t`` tokens of the residual stream. A region
(attention, MLP) all-gathers its input to the whole sequence before its column-parallel projection
and reduce-scatters the row-parallel projection's partial sums back to ``s/t`` tokens; each
collective waits on a GEMM or makes one wait. Here both are rings over the tensor ranks, in ``t``
steps, each step's GEMM running while the next chunk travels (``ppermute``):

* :func:`allgather_matmul` -- ``x`` [b, s/t, e] (split sequence) times the local column shard of
  ``w``: each step multiplies the chunk the rank holds by ``w`` and passes the chunk on; the result is
  the whole sequence's [b, s, local features].
* :func:`matmul_reduce_scatter` -- ``h`` [b, s, local features] times the local row shard of ``w``,
  summed over the ranks and split over the sequence: each step computes one chunk's partial product,
  adds the accumulator received from the previous rank, and passes it on; after ``t`` steps each
  rank holds its own chunk's sum.

Both have their own backward, itself rings: the input gradient of one is the other primitive
(``dx`` of the all-gather-matmul is a matmul-reduce-scatter of ``dy`` by ``wᵀ``; ``dh`` of the
matmul-reduce-scatter an all-gather-matmul of ``dy``), and the weight gradient is one GEMM on the
whole sequence's operand, beside the input gradient's ring. The all-gather-matmul keeps its input
gathered from the forward (the chunks written into place as they pass; :data:`GATHERED_INPUT`): the
same ``s`` tokens per layer that sequence parallelism's region keeps without it (the fused projections'
saved operand), and passing them round again in the backward, as Megatron-LM does, would move a third
more bytes over the tensor axis. The matmul-reduce-scatter's backward keeps the chunks of ``dy`` its
input gradient's ring passes round anyway. (Summing a weight gradient chunk by chunk instead would read
and write a weight-sized accumulator at every step.)

The ring runs over the mesh axis the rules place the residual stream's ``residual_seq`` on (``tensor``
under ``parallel.sequence_parallel``), in a nested ``shard_map`` manual over every mesh axis not yet
manual (inside the train step's region over data, a pipeline's over pipe, or none). Model code names no mesh axis: the built-in families' projections call these through
:func:`column_parallel` and :func:`row_parallel` einsum operations, which multiply as
:func:`meshtron.models.fp8.projection_einsum` does unless the run turned collective matmul on
(:func:`collective_matmul`, ``parallel.collective_matmul``) and the residual stream is split.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from meshtron.models.cast_weights import prepared
from meshtron.models.fp8 import projection_einsum
from meshtron.models.master_weight_gemm import fusing, master_weight_einsum
from meshtron.sharding import LogicalAxes, logical_to_spec, manual_part
from meshtron.trace_context import current, using

__all__ = ["GATHERED_INPUT", "allgather_matmul", "collective_matmul", "column_parallel", "matmul_reduce_scatter",
           "row_parallel", "sequence_ring"]


GATHERED_INPUT = "collective_matmul_gathered_input"
"""The checkpoint name of what an all-gather-matmul keeps for its backward: its input gathered over the
ring (the weight gradient's operand). A projection recomputed but for its inputs keeps it by this name
(:func:`meshtron.models.layers.fused_projection`)."""


@contextlib.contextmanager
def collective_matmul(on: bool = True) -> Iterator[None]:
    """Inside the block, the tensor-parallel regions' projections that are :func:`column_parallel` or
    :func:`row_parallel` gather and scatter the residual stream themselves, as rings overlapped with
    their GEMMs, wherever the rules split the residual stream over a mesh axis (``on=False``: they
    don't)."""
    with using(collective_matmul=on):
        yield


def sequence_ring(seq_len: int) -> str | None:
    """The mesh axis the projections' rings run over for a residual stream of ``seq_len`` tokens (as this
    trace sees it), or ``None`` where they do not: collective matmul is off, the rules keep
    ``residual_seq`` whole (no sequence parallelism) or on one device, an outer ``shard_map`` is
    already manual over it, or ``seq_len`` does not divide into its ranks. The region's entry and exit
    (:func:`meshtron.models.blocks.enter_parallel_region`) read the same answer, so they leave the
    collectives to the projections exactly when the projections do them."""
    if not current().collective_matmul:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    placed = logical_to_spec(("residual_seq",))
    axis = placed[0] if len(placed) else None
    if not isinstance(axis, str) or axis in mesh.manual_axes or mesh.shape[axis] == 1:
        return None
    return axis if seq_len % mesh.shape[axis] == 0 else None


def _parse(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    if "..." in spec or len(x) < 2 or x[:2] != out[:2]:
        raise ValueError(f"collective matmul: {spec!r} must name batch and sequence first in its input and "
                         "output (as 'bse,ef->bsf'), without an ellipsis")
    return x, w, out


def _shift(value: jax.Array, axis: str) -> jax.Array:
    """``value`` from the previous rank of the ring over ``axis`` (each rank sends to the next)."""
    n = jax.lax.axis_size(axis)
    return jax.lax.ppermute(value, axis, [(i, (i + 1) % n) for i in range(n)])


def _behind(rank: jax.Array, steps: int, n: int) -> jax.Array:
    """``(rank - steps) mod n`` in ``lax`` integer operations on Python literals (``jnp``'s modulo would
    capture array constants)."""
    return jax.lax.rem(rank + (-steps) % n, n)


def _zero_from(anchor: jax.Array, dtype) -> jax.Array:
    """An exact zero of ``dtype`` computed from ``anchor`` (whether its first element is NaN, times zero):
    one element read, and the result depends on ``anchor`` and varies over the manual axes it varies
    over. (An empty slice's sum would not do: JAX folds it to a constant.)"""
    return jnp.isnan(anchor.reshape(-1)[0]).astype(dtype) * jnp.zeros((), dtype)


def _rank(axis: str, operand: jax.Array) -> jax.Array:
    """This rank's index on ``axis``, made to depend on ``operand`` (see :func:`_tied`)."""
    return jax.lax.axis_index(axis) + _zero_from(operand, jnp.int32)


def _tied(value: jax.Array, anchor: jax.Array) -> jax.Array:
    """``value``, made to depend on ``anchor``.

    Nothing in a ring may be computable without the operand it is about. Differentiating the scan over
    the layers moves what can be computed ahead (what needs no input of the ring, and in a backward what
    needs no cotangent) out of the nested ``shard_map`` into a region of its own, and JAX lays such
    values out over the enclosing region's manual axes first when it passes them back in, which
    Shardy's verifier rejects. Chunk indices are tied to the travelling operand, and a backward's
    forward values to the cotangent."""
    return value + _zero_from(anchor, value.dtype)


def _after(operand: jax.Array, previous: jax.Array | None) -> jax.Array:
    """``operand`` of a ring step's GEMM, made to depend on the previous step's product. The steps' GEMMs
    would otherwise be independent products of one weight, and XLA merges such dots into one (its dot
    merger), run after every transfer has landed: no overlap left. Chained, they run one after another,
    each while the next chunk travels (the transfers take the untied chunks). The dependency is
    ``min(|p|, 0)`` of the product's first element ``p``: zero for every finite or infinite ``p`` (NaN
    stays NaN), which XLA cannot fold away as it folds :func:`_tied`'s. Adding it rewrites the operand,
    a pass over each step's chunk; an optimization barrier over the operand and the product would tie
    them without one, but XLA:GPU then schedules some of a ring's transfers with no GEMM under them
    (some synchronous)."""
    if previous is None:
        return operand
    first = previous.reshape(-1)[0]
    return operand + jnp.minimum(jnp.abs(first), jnp.zeros((), first.dtype)).astype(operand.dtype)


def _around(chunk: jax.Array, axis: str) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Every rank's chunk in turn, each with the index of the rank that holds it: the rank's own first,
    then the previous rank's, and so on. The next chunk's transfer is issued before the current one is
    handed out, so whatever the caller computes with it runs while the chunk travels."""
    n, rank = jax.lax.axis_size(axis), _rank(axis, chunk)
    for step in range(n):
        following = _shift(chunk, axis) if step < n - 1 else None
        yield chunk, _behind(rank, step, n)
        chunk = following


def _gather_multiply(spec: str, x: jax.Array, w: jax.Array, axis: str,
                     keep: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The all-gather-matmul on local shards: ``x`` [b, s/t, ...] -> ``einsum(spec)`` over the whole sequence;
    with ``keep``, also ``x`` gathered (the chunks written into place as they pass)."""
    out = y = gathered = None
    n = jax.lax.axis_size(axis)
    for chunk, source in _around(x, axis):
        if keep:
            gathered = _placed(gathered, chunk, source, n)
        y = jnp.einsum(spec, _after(chunk, y), w)
        out = _placed(out, y, source, n)
    return (out, gathered) if keep else out


def _placed(buffer: jax.Array | None, chunk: jax.Array, source: jax.Array, n: int) -> jax.Array:
    """``buffer`` [b, n·c, ...] with ``chunk`` [b, c, ...] written at chunk ``source``; the first chunk makes the
    buffer (padded from it: every chunk is written once, so the padding's values never survive)."""
    c = chunk.shape[1]
    if buffer is None:
        buffer = jax.lax.pad(chunk, jnp.zeros((), chunk.dtype),
                             [(0, 0, 0), (0, c * (n - 1), 0)] + [(0, 0, 0)] * (chunk.ndim - 2))
    return jax.lax.dynamic_update_slice_in_dim(buffer, chunk, source * c, axis=1)


def _multiply_scatter(spec: str, h: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """The matmul-reduce-scatter on local shards: ``h`` [b, s, ...] -> this rank's chunk of ``einsum(spec)``
    summed over the ring. At step ``k`` rank ``r`` adds its partial product for chunk ``r - k - 1`` to
    what it received and passes it on, so the sum of chunk ``r`` arrives complete at the last step."""
    n, rank = jax.lax.axis_size(axis), _rank(axis, h)
    chunk_len = h.shape[1] // n
    total = part = None
    for step in range(n):
        index = _behind(rank, step + 1, n)
        part = jnp.einsum(spec, _after(jax.lax.dynamic_slice_in_dim(h, index * chunk_len, chunk_len, axis=1), part), w)
        total = part if total is None else total + part
        if step < n - 1:
            total = _shift(total, axis)
    return total


def _varying(x: jax.Array) -> set[str]:
    """The manual mesh axes ``x`` varies over (``aval.vma`` in older JAX, ``aval.mat.varying`` now)."""
    aval = jax.typeof(x)
    return set(aval.vma if hasattr(aval, "vma") else aval.mat.varying)


def _summed(gradient: jax.Array, ring: _Ring) -> jax.Array:
    """A weight's gradient summed over the mesh axes the ring's operands split (the batch over data, say)
    and the weight does not, besides the ring's own (which the ring sums). Axes an enclosing
    ``shard_map`` is manual over are left to it: the train step reduces gradients over data itself."""
    sizes = jax.sharding.get_abstract_mesh().shape
    extra = (_spec_names(ring.split) | _spec_names(ring.whole)) - _spec_names(ring.weight) - {ring.axis}
    extra = tuple(sorted(a for a in extra if sizes[a] > 1))
    return jax.lax.psum(gradient, extra) if extra else gradient


def _spec_names(spec: PartitionSpec) -> set[str]:
    names: set[str] = set()
    for entry in spec:
        names.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return names


@dataclass(frozen=True)
class _Ring:
    """One projection's ring: the einsum, the mesh axis the sequence travels round, the axes the nested
    ``shard_map`` is manual over and the layouts there of the sequence-split operand or result
    (``split``), of the whole-sequence one (``whole``), of the weight and of the sequence-split operand
    gathered (``gathered``)."""

    spec: str
    axis: str
    manual: frozenset[str]
    split: PartitionSpec
    whole: PartitionSpec
    weight: PartitionSpec
    gathered: PartitionSpec

    def run(self, body, in_specs, out_specs):
        """``body`` on local shards, in a ``shard_map`` that does not check manual-axis types: with checks, JAX
        types every literal a ring combines with its varying values through a ``pvary`` of its own, and
        differentiating the scan over the layers hoists those out as inputs laid out in a way Shardy's
        verifier rejects (see :func:`_tied`). :func:`_typed` and :func:`_cotangent` give the results
        their types back."""
        return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(self.manual), check_vma=False)


def _typed(value: jax.Array, *inputs: jax.Array) -> jax.Array:
    """An output of the ring's unchecked ``shard_map`` typed as varying over the enclosing manual axes its
    ``inputs`` vary over (the region drops their types; the values are per rank already)."""
    axes = tuple(sorted(set().union(*(_varying(x) for x in inputs)) - _varying(value)))
    return jax.lax.pcast(value, axes, to="varying") if axes else value


def _cotangent(gradient: jax.Array, primal: jax.Array, *inputs: jax.Array) -> jax.Array:
    """The gradient of ``primal`` computed per rank from ``inputs``, summed over the enclosing manual axes
    the inputs vary over and ``primal`` does not (the transpose of using an invariant value with varying
    ones), typed as ``primal`` is."""
    extra = tuple(sorted(set().union(*(_varying(x) for x in inputs)) - _varying(primal)))
    gradient = jax.lax.psum(gradient, extra) if extra else gradient
    return _typed(gradient, primal)


# Each primitive is differentiated outside its ``shard_map``s: forward and backward are rings of their own,
# and no ``shard_map`` is ever linearized (JAX would carry residuals out of a nested manual region laid out
# over the enclosing region's manual axes first, which Shardy's verifier rejects).

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _allgather_matmul(ring: _Ring, x, w):
    y = ring.run(lambda x, w: _gather_multiply(ring.spec, x, _tied(w, x), ring.axis),
                 (ring.split, ring.weight), ring.whole)(x, w)
    return _typed(y, x, w)


def _allgather_matmul_fwd(ring, x, w):
    y, gathered = ring.run(lambda x, w: _gather_multiply(ring.spec, x, _tied(w, x), ring.axis, keep=True),
                           (ring.split, ring.weight), (ring.whole, ring.gathered))(x, w)
    return _typed(y, x, w), (checkpoint_name(_typed(gathered, x), GATHERED_INPUT), w)


def _allgather_matmul_bwd(ring, residuals, dy):
    gathered, w = residuals
    xs, ws, out = _parse(ring.spec)

    def gradients(dy, gathered, w):
        gathered, w = _tied(gathered, dy), _tied(w, dy)
        dx = _multiply_scatter(f"{out},{ws}->{xs}", dy, w, ring.axis)
        dw = jnp.einsum(f"{out},{xs}->{ws}", dy, gathered)  # beside the ring: nothing of it waits on a transfer
        return dx, _summed(dw, ring)

    operands = (dy, gathered.astype(dy.dtype), w.astype(dy.dtype))  # cast here: nothing in the ring without dy
    dx, dw = ring.run(gradients, (ring.whole, ring.gathered, ring.weight), (ring.split, ring.weight))(*operands)
    return (_cotangent(dx, gathered, dy, w).astype(gathered.dtype), _cotangent(dw, w, dy, gathered).astype(w.dtype))


_allgather_matmul.defvjp(_allgather_matmul_fwd, _allgather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_reduce_scatter(ring: _Ring, h, w):
    y = ring.run(lambda h, w: _multiply_scatter(ring.spec, h, _tied(w, h), ring.axis),
                 (ring.whole, ring.weight), ring.split)(h, w)
    return _typed(y, h, w)


def _matmul_reduce_scatter_fwd(ring, h, w):
    return _matmul_reduce_scatter(ring, h, w), (h, w)


def _matmul_reduce_scatter_bwd(ring, residuals, dy):
    h, w = residuals
    hs, ws, out = _parse(ring.spec)

    def gradients(dy, h, w):
        h, w = _tied(h, dy), _tied(w, dy)
        dh, gathered = _gather_multiply(f"{out},{ws}->{hs}", dy, w, ring.axis, keep=True)
        dw = jnp.einsum(f"{hs},{out}->{ws}", h, gathered)
        return dh, _summed(dw, ring)

    operands = (dy, h.astype(dy.dtype), w.astype(dy.dtype))  # cast here: nothing in the ring without dy
    dh, dw = ring.run(gradients, (ring.split, ring.whole, ring.weight), (ring.whole, ring.weight))(*operands)
    return (_cotangent(dh, h, dy, w).astype(h.dtype), _cotangent(dw, w, dy, h).astype(w.dtype))


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def _axes_of(subscripts: str, ws: str, w_axes: tuple[str | None, ...], sequence: str) -> tuple[str | None, ...]:
    """The logical axes of an operand or result named by einsum ``subscripts``: batch, ``sequence``, then
    each letter as the weight names it (``None`` for one the weight does not have)."""
    return ("batch", sequence, *(w_axes[ws.index(c)] if c in ws else None for c in subscripts[2:]))


def _ring(spec: str, x: jax.Array, w: jax.Array, w_axes: LogicalAxes, *, gathered_input: bool) -> _Ring | None:
    """The ring of a projection of ``x`` by ``w`` (laid out by logical ``w_axes``), or ``None`` where none
    applies: no :func:`sequence_ring`, the weight's outer dimensions (the output features of an
    all-gather-matmul, the contracted ones of a matmul-reduce-scatter) not split over the ring's axis or
    another of its dimensions split over it, or an uneven split. The nested ``shard_map`` is manual over
    every mesh axis still automatic, the ring's and the others alike."""
    axis = sequence_ring(x.shape[1])
    if axis is None:
        return None
    xs, ws, out = _parse(spec)
    w_axes = tuple(w_axes)
    if len(w_axes) != len(ws):
        raise ValueError(f"collective matmul: {spec!r} has a {len(ws)}-dimensional weight, laid out by {w_axes}")
    ring_part = manual_part(logical_to_spec(w_axes), {axis})
    outer = set(out[2:]) if gathered_input else set(xs[2:])
    split = {c for i, c in enumerate(ws) if i < len(ring_part) and ring_part[i] is not None}
    if not split or not split <= outer:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(mesh.axis_names) - set(mesh.manual_axes)
    split_axes = _axes_of(xs if gathered_input else out, ws, w_axes, "residual_seq")
    whole_axes = _axes_of(out if gathered_input else xs, ws, w_axes, "seq")
    gathered_axes = _axes_of(xs, ws, w_axes, "seq")
    split_spec, whole_spec, w_spec, gathered_spec = (manual_part(logical_to_spec(a), manual)
                                                     for a in (split_axes, whole_axes, w_axes, gathered_axes))
    if not _even(x, split_spec if gathered_input else whole_spec, mesh) or not _even(w, w_spec, mesh):
        return None
    return _Ring(spec, axis, manual, split_spec, whole_spec, w_spec, gathered_spec)


def _even(x: jax.Array, spec: PartitionSpec, mesh) -> bool:
    """Whether ``spec`` splits every dimension of ``x`` evenly (``shard_map`` takes even splits only)."""
    return all(size % math.prod(mesh.shape[n] for n in _spec_names(PartitionSpec(entry))) == 0
               for size, entry in zip(x.shape, spec))


def allgather_matmul(spec: str, x: jax.Array, w: jax.Array, w_axes: LogicalAxes) -> jax.Array | None:
    """``einsum(spec, x, w)`` for ``x`` [b, s, ...] laid out with its sequence split over the ring's mesh
    axis (:func:`sequence_ring`) and ``w`` a column-parallel weight laid out by logical ``w_axes``, its
    output features split over that axis: the whole sequence's product, features split, with the
    sequence gathered chunk by chunk while the GEMMs run. ``None`` where no ring applies (the caller then
    multiplies as usual)."""
    ring = _ring(spec, x, w, w_axes, gathered_input=True)
    return None if ring is None else _allgather_matmul(ring, x, w)


def matmul_reduce_scatter(spec: str, h: jax.Array, w: jax.Array, w_axes: LogicalAxes) -> jax.Array | None:
    """``einsum(spec, h, w)`` for ``h`` [b, s, ...] the whole sequence with features split over the ring's
    mesh axis and ``w`` a row-parallel weight laid out by logical ``w_axes`` (its contracted features
    split alike): the product summed over the ranks, laid out with its sequence split over the axis,
    each chunk's partial sums passed round while the next chunk's GEMM runs. ``None`` where no ring
    applies."""
    ring = _ring(spec, h, w, w_axes, gathered_input=False)
    return None if ring is None else _matmul_reduce_scatter(ring, h, w)


@dataclass(frozen=True)
class _ProjectionEinsum:
    """An ``nnx.Einsum``'s ``einsum_op`` (and :func:`meshtron.models.layers.fused_projection`'s product)
    for a weight laid out by the logical ``axes``: the ring (``ring``) where one applies, else
    :func:`meshtron.models.fp8.projection_einsum`. A frozen dataclass, so that two models built alike
    have equal graph definitions."""

    axes: tuple[str | None, ...]
    ring: str

    def __call__(self, spec: str, x: jax.Array, w: jax.Array, **options: Any) -> jax.Array:
        if current().fp8 == "off" and options.get("preferred_element_type") is None:
            gather = self.ring == "gather"
            ring = _ring(spec, x, w, self.axes, gathered_input=gather)
            if ring is not None:
                low = prepared(w.astype(x.dtype))  # a pipeline stage's weight cast once per step
                return (_allgather_matmul if gather else _matmul_reduce_scatter)(ring, x, low)
        if w.dtype != x.dtype and fusing():  # the master weight, kept by keep_master_weight
            return master_weight_einsum(spec, x, w)
        return projection_einsum(spec, x, w, **options)


def column_parallel(axes: LogicalAxes) -> _ProjectionEinsum:
    """The ``einsum_op`` of a column-parallel projection whose weight is laid out by the logical ``axes``
    (its output features split over tensor ranks): under collective matmul it consumes the region's
    sequence-split input through :func:`allgather_matmul`; its region's entry then leaves the residual
    stream split (:func:`meshtron.models.blocks.enter_parallel_region` with ``collective=True``)."""
    return _ProjectionEinsum(tuple(axes), "gather")


def row_parallel(axes: LogicalAxes) -> _ProjectionEinsum:
    """The ``einsum_op`` of a row-parallel projection whose weight is laid out by the logical ``axes``
    (its input features split over tensor ranks): under collective matmul its output goes into the
    residual stream through :func:`matmul_reduce_scatter`, and its region's exit does no collective of
    its own (:func:`meshtron.models.blocks.exit_parallel_region` with ``collective=True``)."""
    return _ProjectionEinsum(tuple(axes), "scatter")
