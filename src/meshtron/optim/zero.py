"""Optimizer state (ZeRO-1) and parameters (ZeRO-3) split over the data-parallel axis.

Every data-parallel rank computes the same update from the same reduced gradient, so with plain
data parallelism each one holds -- and updates -- a full copy of the optimizer state. ZeRO splits
that work: each rank keeps the state of a ``1/d`` share of every parameter, receives only that
share of the reduced gradient (a reduce-scatter, which moves the bytes of half an all-reduce),
updates it, and the ranks all-gather the updated parameters (the other half). The bytes crossing
``data`` per step stay those of the all-reduce; the optimizer state per device is divided by ``d``.
At ``zero=3`` the parameters themselves stay split between steps and are gathered when a step
starts.

**Where a leaf is split.** Along one dimension the mesh does not already split (``tensor`` and
``pipe`` keep theirs, so the share is local on every tensor/pipeline rank and splitting needs no
data movement across those axes), never a stacked ``layers`` axis (LAMB's per-layer norms then
stay whole on every rank after one sum over ``data``), and only one that ``d`` divides: the
largest such dimension. Checkpoints stay canonical: the state has the parameters' shapes, only
its sharding changes, so it restores onto any mesh and any zero level. A leaf with no such
dimension (a bias split over ``tensor``, a dimension ``d`` does not divide) stays whole on every
data rank, reduced with an all-reduce and updated redundantly; :meth:`ZeroPlan.replicated` lists
them and ``meshtron describe`` prints their bytes.

Norms over the whole gradient (clipping) or over a layer (LAMB's trust ratio) are then sums of
per-rank partial sums: :meth:`ZeroPlan.sum_squares` adds the split leaves' over ``data``.

**Leaves the model itself splits over data.** A mixture of experts' weights are split over ``data``
by the rules table (expert parallelism: each data rank holds ``E/d`` experts), at every zero level.
Their gradients are complete on the rank that holds them (the tokens of every rank reached them
through the all-to-alls), so they are not reduced over ``data``, only divided by ``d`` for the mean;
their optimizer state is split like them; and norms sum their squares over ``data`` like a split
leaf's. The plan calls them *native*: :meth:`ZeroPlan.native_flags`.

**Frozen leaves.** Trees given to the methods below may hold ``None`` for a leaf (LoRA's frozen base:
:class:`meshtron.train.trainable.Trainable`): it is passed over -- nothing reduced, split or
gathered for it -- so only what trains crosses ``data``, while at level 3 the frozen parameters are
still split between steps and gathered layer by layer like the rest.

All methods that communicate run inside the trainer's ``shard_map`` that is manual over ``data``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtron.sharding import axis_names, gradient_axes, manual_part, splits_over
from meshtron.trace_context import GatheredShard, current
from meshtron.trees import leaf_names

ZERO_LEVELS = (0, 1, 3)


def _entries(spec: P, ndim: int) -> list[Any]:
    return list(spec) + [None] * (ndim - len(spec))


@dataclass(frozen=True)
class ZeroPlan:
    """For every parameter leaf, the dimension split over ``axis`` (``None``: kept whole).

    ``level`` 0 splits nothing; 1 splits the optimizer state and the update; 3 also the parameters
    between steps. ``dims`` is a tree shaped like the parameters.
    """

    level: int
    size: int
    dims: Any
    param_specs: Any = None  # the parameters' own PartitionSpecs (tensor, pipe), a tree
    names: tuple[str, ...] = ()
    nbytes: tuple[int, ...] = ()
    axis: str | tuple[str, ...] = "data"  # one mesh axis, or the group data x context
    native: Any = None  # a tree of bools: leaves the parameters' own layout splits over ``axis``
    gather_once: bool = False  # level 3: gather the parameters once when a step starts, not each layer as it runs
    gather_dtype: str | None = None  # level 3: floating leaves are gathered cast to this (None: as held)
    reduce_dtype: str | None = None  # level 3: their gradients are reduce-scattered in this (None: as held)
    # Whether the backend's collectives reduce in a dtype narrower than fp32. XLA:CPU does not: it promotes
    # them to fp32 (its AllReducePromotion), and that pass aborts on the reducers JAX emits under a mesh, so
    # on CPU the same arithmetic is written out (:func:`_reduced_as`).
    narrow_reductions: bool = True

    @classmethod
    def build(cls, level: int, shapes: Any, specs: Any, stacked: Any, size: int,
              axis: str | tuple[str, ...] = "data", *, gather_once: bool = False,
              gather_dtype: str | None = None, reduce_dtype: str | None = None,
              narrow_reductions: bool = True, whole: Any = None) -> ZeroPlan:
        """The plan for parameters of ``shapes`` laid out by ``specs`` (``PartitionSpec`` s or
        shardings) on a mesh whose ``axis`` has ``size`` devices; ``stacked`` marks leaves with a
        leading ``layers`` axis; ``whole`` (optional) marks leaves kept whole on every rank (state the
        step updates itself, such as delayed FP8 scaling's)."""
        if level not in ZERO_LEVELS:
            raise ValueError(f"parallel.zero: {level!r} is not one of {ZERO_LEVELS}")
        treedef = jax.tree.structure(shapes)
        spec_leaves = [getattr(s, "spec", s) for s in treedef.flatten_up_to(specs)]

        def choose(shape, spec, is_stacked, kept_whole) -> int | None:
            if level == 0 or size == 1 or splits_over(spec, axis) or kept_whole:
                return None
            free = [k for k, entry in enumerate(_entries(spec, len(shape.shape)))
                    if entry is None and not (is_stacked and k == 0) and shape.shape[k] % size == 0]
            return max(free, key=lambda k: (shape.shape[k], -k), default=None)

        leaves = jax.tree.leaves(shapes)
        kept = [False] * len(leaves) if whole is None else treedef.flatten_up_to(whole)
        dims = [choose(s, p, st, k) for s, p, st, k in
                zip(leaves, spec_leaves, treedef.flatten_up_to(stacked), kept, strict=True)]
        nbytes = tuple(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in leaves)
        native = treedef.unflatten([size > 1 and splits_over(spec, axis) for spec in spec_leaves])
        return cls(level, size, treedef.unflatten(dims), treedef.unflatten(spec_leaves), tuple(leaf_names(shapes)),
                   nbytes, axis, native, gather_once, gather_dtype, reduce_dtype, narrow_reductions)

    @classmethod
    def for_mesh(cls, level: int, shapes: Any, specs: Any, stacked: Any, mesh, *, gather_once: bool = False,
                 gather_dtype: str | None = None, reduce_dtype: str | None = None, whole: Any = None) -> ZeroPlan:
        """:meth:`build` over ``mesh``'s gradient group (:func:`meshtron.sharding.gradient_axes`: data,
        and context when sequences are split -- Megatron's distributed optimizer over data x context).
        ``level``, ``gather_once`` and the dtypes: a run's choice (:class:`meshtron.run.ZeroChoice`, ``Run.zero``)."""
        axis = gradient_axes(mesh.shape)
        return cls.build(level, shapes, specs, stacked, math.prod(mesh.shape[a] for a in axis_names(axis)), axis,
                         gather_once=gather_once, gather_dtype=gather_dtype, reduce_dtype=reduce_dtype,
                         narrow_reductions=_platform(mesh) != "cpu", whole=whole)

    @property
    def active(self) -> bool:
        """Whether anything is split (level > 0 on more than one data rank)."""
        return self.level > 0 and self.size > 1

    @property
    def shards_params(self) -> bool:
        return self.active and self.level == 3

    def _dim_leaves(self) -> list[int | None]:
        return jax.tree.leaves(self.dims, is_leaf=lambda x: x is None)

    def native_flags(self) -> Any:
        """``True`` where the parameters' own layout splits a leaf over ``axis`` (expert parallelism)."""
        if self.native is None:
            return jax.tree.map(lambda d: False, self.dims, is_leaf=lambda x: x is None)
        return self.native

    @property
    def has_native(self) -> bool:
        return any(jax.tree.leaves(self.native_flags()))

    @property
    def splits_norms(self) -> bool:
        """Whether a norm of the gradient needs sums over ``axis`` (some leaf is split over it)."""
        return self.active or self.has_native

    def replicated(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of the leaves kept whole on every data rank although the plan is active."""
        if not self.active:
            return []
        native = jax.tree.leaves(self.native_flags())
        return [(n, b) for n, b, d, own in zip(self.names, self.nbytes, self._dim_leaves(), native, strict=True)
                if d is None and not own]

    def split_flags(self) -> Any:
        """``True`` where a leaf is split over ``axis``, by the plan or natively (a tree shaped like the
        parameters)."""
        return jax.tree.map(lambda d, own: d is not None or own, self.dims, self.native_flags(),
                            is_leaf=lambda x: x is None)

    def mean_native(self, grads: Any) -> Any:
        """The native leaves' local gradients divided by ``size`` (their mean over ``axis``: they are
        complete where they are held); the other leaves as they are."""
        return jax.tree.map(lambda g, own: g / self.size if own and g is not None else g, grads, self.native_flags(),
                            is_leaf=lambda x: x is None)

    def specs(self, specs: Any) -> Any:
        """``specs`` (or shardings) with ``axis`` added on every split leaf's dimension."""

        def add(spec, dim):
            spec = getattr(spec, "spec", spec)
            if dim is None:
                return spec
            entries = _entries(spec, dim + 1)
            entries[dim] = self.axis
            return P(*entries)

        return jax.tree.map(add, specs, self.dims, is_leaf=lambda x: isinstance(x, P) or hasattr(x, "spec"))

    # ---- inside the data-parallel shard_map ---------------------------------------------------

    def _map(self, fn, tree, dims=None, specs=None):
        """``fn(leaf, dim)`` on every leaf, run on each device's own block of it.

        The collectives over ``data`` act on blocks that ``tensor`` and ``pipe`` already split: left
        to the compiler inside a region manual over ``data`` only, XLA's partitioner gathers a
        tensor-split operand whole before a reduce-scatter over ``data`` (measured: an all-gather
        over ``tensor`` per leaf and the data traffic multiplied). Manual over every axis, each
        device reduces exactly its block.
        """
        dims = self.dims if dims is None else dims
        specs = self.param_specs if specs is None else specs
        body = lambda t: jax.tree.map(lambda x, d: None if x is None else fn(x, d), t, dims, is_leaf=lambda x: x is None)
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)
        if not auto or specs is None:
            return body(tree)
        specs = manual_part(specs, auto)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs, axis_names=set(auto))(tree)

    def shard(self, tree: Any) -> Any:
        """This rank's share of a tree that every rank holds whole."""
        def take(x, dim):
            if dim is None:
                return x
            n = x.shape[dim] // self.size
            return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis) * n, n, axis=dim)

        return self._map(take, tree)

    def scatter_mean(self, grads: Any, summed: frozenset[str] = frozenset(), *, like: Any = None) -> Any:
        """Local gradients averaged over ``axis``, each rank receiving its share of the split leaves
        (one reduce-scatter each) and the whole of the others (an all-reduce).

        ``summed``: top-level keys whose split leaves arrive already reduce-scattered -- the gradient
        of a layer gathered by :meth:`layer_view` is its all-gather's transpose -- and are only
        divided by the number of ranks. ``like``: the parameters (a tree of arrays or shapes) when the
        gradients are those of parameters gathered for compute (:meth:`gather` with ``for_compute``,
        :meth:`layer_view`): each reduction then runs in ``reduce_dtype`` and its result has the
        parameter's dtype."""
        dtypes = (jax.tree.map(lambda d: None, self.dims, is_leaf=lambda x: x is None) if like is None else
                  jax.tree.map(lambda p: None if p is None else jnp.dtype(p.dtype), like, is_leaf=lambda x: x is None))

        def reduce(g, how):
            dim, arrived_summed, own, dtype = how
            if own or (arrived_summed and dim is not None):
                return g / self.size
            if dtype is not None:
                g = _cast(g, self.reduce_dtype)
            if dim is None:
                out = _reduced_as(lambda v: jax.lax.pmean(v, self.axis), g, self.narrow_reductions)
            else:
                out = _reduced_as(lambda v: jax.lax.psum_scatter(v, self.axis, scatter_dimension=dim, tiled=True), g,
                                  self.narrow_reductions) / self.size
            return out if dtype is None else out.astype(dtype)

        native = self.native_flags()
        how = {k: jax.tree.map(lambda d, own, dt, _k=k: (d, _k in summed, own, dt), v, native[k], dtypes[k],
                               is_leaf=lambda x: x is None)
               for k, v in self.dims.items()}
        return self._map(reduce, grads, dims=how)

    def gather(self, tree: Any, keep: frozenset[str] = frozenset(), *, for_compute: bool = False) -> Any:
        """Whole leaves from every rank's share (an all-gather each); the result is the same on every
        rank. Leaves under the top-level keys ``keep`` stay as they are (split). ``for_compute``: the
        leaves are gathered to be computed with, so they cross the wire in ``gather_dtype`` (and are
        held again in their own dtype, in which their gradients then accumulate over microbatches);
        otherwise they are the parameters themselves, sent as held."""
        dims = {k: jax.tree.map(lambda d: None, v, is_leaf=lambda x: x is None) if k in keep else v
                for k, v in self.dims.items()}

        def gather(x, dim):
            if dim is None:
                return x
            wire = _cast(x, self.gather_dtype) if for_compute else x
            return jax.lax.all_gather(wire, self.axis, axis=dim, tiled=True, to="invarying").astype(x.dtype)

        return self._map(gather, tree, dims=dims)

    def arrives_split(self, keep: frozenset[str]) -> Any:
        """``True`` for the leaves :meth:`gather` with ``keep`` leaves split (a tree like the parameters)."""
        return {k: jax.tree.map(lambda d, _k=k: _k in keep and d is not None, v, is_leaf=lambda x: x is None)
                for k, v in self.dims.items()}

    def layer_view(self, key: str = "blocks"):
        """A :func:`meshtron.models.blocks.layer_parameters` view: one layer of the stacked ``key``
        parameters (its leading ``layers`` axis gone), gathered whole from this rank's shares.

        Its transpose reduce-scatters the layer's gradient as the backward pass makes it. The backward
        gathers the layer again -- the layer is recomputed whole (``model.remat=full``) or keeps only
        its matrix products (:func:`meshtron.models.blocks.regathered`) -- so a layer's whole
        parameters live only while it runs, forward and backward. Floating leaves cross the wire
        in ``gather_dtype`` and their gradients in ``reduce_dtype`` (:func:`_all_gather_cast`).

        Under ``model.fp8`` each gathered floating leaf is also recorded with its share
        (:class:`~meshtron.trace_context.GatheredShard`): an FP8 projection by it quantizes the share
        and gathers the float8 bytes instead of the gathered leaf, whose forward gather is then unused
        (only its transpose, the gradient's reduce-scatter, remains)."""
        dims = jax.tree.map(lambda d: None if d is None else d - 1, self.dims[key], is_leaf=lambda x: x is None)
        specs = jax.tree.map(lambda p: P(*tuple(p)[1:]), self.param_specs[key], is_leaf=lambda x: isinstance(x, P))

        def gather(layer):
            whole = self._map(lambda x, dim: x if dim is None else
                              _all_gather_cast(x, self.axis, dim, _wire_dtype(x, self.gather_dtype),
                                               _wire_dtype(x, self.reduce_dtype), self.narrow_reductions),
                              layer, dims=dims, specs=specs)
            table = current().gathered
            if table is not None:
                jax.tree.map(lambda share, out, dim, spec: self._record(table, share, out, dim, spec),
                             layer, whole, dims, specs, is_leaf=lambda x: x is None or isinstance(x, P))
            return whole

        return gather

    def _record(self, table: dict, share: Any, whole: Any, dim: int | None, spec: P) -> None:
        """``whole`` (gathered from ``share`` along ``dim``, laid out ``spec``) recorded in ``table`` with how
        its bytes are gathered: as it is where it was kept whole (``dim`` None)."""
        if share is None or not jnp.issubdtype(share.dtype, jnp.floating):
            return
        if dim is None:
            table[id(whole)] = (whole, GatheredShard(share, lambda a: a, lambda s: s))
            return

        def gather(a):
            return self._map(lambda v, d: jax.lax.all_gather(v, self.axis, axis=d, tiled=True),
                             {"leaf": a}, dims={"leaf": dim}, specs={"leaf": spec})["leaf"]

        table[id(whole)] = (whole, GatheredShard(share, gather, lambda s: jax.lax.pmax(s, self.axis)))

    def sum_squares(self, squares: Any, split: Any = None) -> Any:
        """Per-leaf sums of squares made whole: those of split leaves summed over ``axis``.

        ``squares`` is shaped like the parameters (a scalar or a per-layer vector per leaf);
        ``split`` is :meth:`split_flags` (the default)."""
        flags = self.split_flags() if split is None else split
        return jax.tree.map(lambda s, f: jax.lax.psum(s, self.axis) if f and s is not None else s, squares, flags,
                            is_leaf=lambda x: x is None)


def _platform(mesh) -> str | None:
    """The platform of ``mesh``'s devices (None for an abstract mesh)."""
    devices = getattr(mesh, "devices", None)
    return None if devices is None else devices.flat[0].platform


def _wire_dtype(x: jax.Array, dtype: str | None) -> Any:
    """The dtype a leaf crosses the wire in: ``dtype`` for a floating leaf, else its own."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x.dtype
    return jnp.dtype(dtype)


def _cast(x: jax.Array, dtype: str | None) -> jax.Array:
    return x.astype(_wire_dtype(x, dtype))


def _reduced_as(reduce: Any, x: jax.Array, narrow: bool) -> jax.Array:
    """``reduce(x)``, a sum over ranks, with ``x``'s dtype. Where the backend has no ``narrow`` reductions
    and ``x`` is narrower than fp32: summed in fp32 and rounded back, the arithmetic XLA:CPU's own
    promotion would do."""
    if narrow or jnp.dtype(x.dtype).itemsize >= 4:
        return reduce(x)
    return reduce(x.astype(jnp.float32)).astype(x.dtype)


def _all_gather_cast(x: jax.Array, axis: str | tuple[str, ...], dim: int, gather_dtype: Any, reduce_dtype: Any,
                     narrow_reductions: bool = True) -> jax.Array:
    """``x`` gathered whole over ``axis`` along ``dim`` in ``gather_dtype``; the transpose reduce-scatters
    the cotangent in ``reduce_dtype`` and returns it in ``x``'s dtype.

    Autodiff of a cast then a gather would reduce-scatter in the gathered dtype: a bf16 gather would
    force a bf16 gradient reduction. Gathering in the compute dtype halves the forward's (and the
    recomputing backward's) bytes for an fp32-held model, while summing a layer's gradient over many
    ranks in fp32 keeps its low bits (torchtitan's FSDP ``param_dtype`` / ``reduce_dtype``)."""
    if gather_dtype == x.dtype and reduce_dtype == x.dtype:
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    @jax.custom_vjp
    def gathered(share):
        return jax.lax.all_gather(share.astype(gather_dtype), axis, axis=dim, tiled=True)

    def forward(share):
        return gathered(share), None

    def backward(_, cotangent):
        reduced = _reduced_as(lambda v: jax.lax.psum_scatter(v, axis, scatter_dimension=dim, tiled=True),
                              cotangent.astype(reduce_dtype), narrow_reductions)
        return (reduced.astype(x.dtype),)

    gathered.defvjp(forward, backward)
    return gathered(x)
