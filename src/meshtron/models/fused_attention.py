"""``jax.nn.dot_product_attention`` that also compiles with cuDNN inside the train step's ``shard_map``.

JAX lowers ``implementation="cudnn"`` through ``custom_partitioning``: XLA's SPMD partitioner calls back
into Python to split the fused-attention call over the mesh axes that are still automatic. Inside a
``shard_map`` manual over some axes only (the train step: manual over data, context and pipe, automatic
over tensor) that callback fails (jax-ml/jax#21584: an ``AssertionError`` in ``get_num_ways_dim_sharded``,
or ``'GSPMDSharding' object has no attribute 'spec'``). :func:`dot_product_attention` therefore calls
the cuDNN kernel in a nested ``shard_map`` manual over every axis the surrounding code left automatic,
so that no partitioner ever sees it: each device attends for the query heads (and batch rows) it holds,
as the projections laid them out, which needs no collective. The XLA implementation is called as it
is: the partitioner splits its plain dots well.

Layouts are read from the active rules by logical names (:data:`QUERIES`, the keys' own axes), never by
mesh-axis names, so models stay free of them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshtron.models.attention_blocks import BlockKernels
from meshtron.sharding import LogicalAxes, logical_to_spec, manual_part

QUERIES = ("batch", "seq", "heads", "head_dim")
KEYS = ("batch", "seq", "kv_heads", "head_dim")


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, implementation: str | None,
                          mask: jax.Array | None = None, is_causal: bool = False,
                          key_axes: LogicalAxes | None = None, value_axes: LogicalAxes | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention(q, k, v, mask=, is_causal=, scale=, implementation=)``; for
    ``implementation="cudnn"`` inside a ``shard_map`` manual over some mesh axes only, called in a nested
    ``shard_map`` manual over the others. ``key_axes``, ``value_axes``: the logical layout of ``k`` and ``v`` (default
    :data:`KEYS`); ``q`` and the output are laid out as :data:`QUERIES`; ``mask`` ``[b or 1, h or 1,
    s_q, s_k]`` is split like the queries' batch where it has one, else whole. ``k`` and ``v`` may hold
    more tokens than ``q`` (``s_k > s_q``: a context rank's queries against the gathered keys of
    :func:`meshtron.models.context_attention.gathered_kv_attention`); the sequence is never split here."""
    mesh = jax.sharding.get_abstract_mesh()
    partly_manual = not mesh.empty and bool(mesh.manual_axes) and not set(mesh.axis_names) <= set(mesh.manual_axes)
    if implementation != "cudnn" or not partly_manual:  # JAX's own partitioner splits it on a fully automatic mesh
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                                            implementation=implementation)
    return manual_attention(q, k, v, scale=scale, implementation=implementation, mask=mask, is_causal=is_causal,
                            key_axes=key_axes, value_axes=value_axes)


def manual_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, implementation: str | None,
                     mask: jax.Array | None = None, is_causal: bool = False,
                     key_axes: LogicalAxes | None = None, value_axes: LogicalAxes | None = None) -> jax.Array:
    """:func:`dot_product_attention` in a ``shard_map`` manual over the mesh axes still automatic here
    (call inside a mesh with some): what it does for cuDNN, for any ``implementation`` (the tests check
    its layouts and gradients on CPU with XLA's)."""

    def attend(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                                            implementation=implementation)

    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    sizes = dict(mesh.shape)
    q_spec = local_spec(QUERIES, q.shape, auto, sizes)
    k_spec = local_spec(KEYS if key_axes is None else tuple(key_axes), k.shape, auto, sizes)
    v_spec = local_spec(KEYS if value_axes is None else tuple(value_axes), v.shape, auto, sizes)
    if k_spec != v_spec:  # one layout for both, so that a device's key and value heads are the same ones
        k_spec = v_spec = _common(k_spec, v_spec)
    mask_spec = None
    if mask is not None:
        batch = spec_entry(q_spec, 0) if mask.shape[0] == q.shape[0] else None
        mask_spec = PartitionSpec(batch)
    heads_entry, kv_entry = spec_entry(q_spec, 2), spec_entry(k_spec, 2)

    def local(q, k, v, mask):
        # A device holding a share of the query heads but every key/value head (fewer key/value heads
        # than ranks) keeps the key/value heads its query heads read: grouped-query attention pairs
        # query head i with key head i // (heads / kv_heads).
        if heads_entry is not None and kv_entry is None:
            k, v = (_own_key_heads(x, q.shape[2], q.shape[2] * entry_ranks(heads_entry, sizes), heads_entry, sizes)
                    for x in (k, v))
        return attend(q, k, v, mask)

    # check_vma=False: JAX's partial evaluation of a shard_map checked for varying values (the layers' scan
    # hoisting what its loop does not change, remat) names the residuals it splits off over every axis
    # they vary over, the surrounding step's manual ones included (``ShapedArray.nospec`` in jax 0.12), so
    # a residual varying over the step's ``data`` comes out stacked over it where the loop carries one
    # device's: a document mask's bias (the cuDNN call's ``where(mask, 0, -big)``, whose constants vary
    # over ``data`` like the mask) fails to lower. Unchecked, it names the axes this map makes manual only.
    shard = functools.partial(jax.shard_map, mesh=mesh, axis_names=set(auto), check_vma=False)
    in_specs = (q_spec, k_spec, v_spec, None if mask is None else mask_spec)
    # Unchecked, nothing says which of these axes a residual varies over: each device keeps its own row.
    everywhere = PartitionSpec(tuple(sorted(auto)))
    summed = tuple(sorted(_axes(q_spec) - _axes(k_spec)))  # the axes that split the queries, not the keys
    residual_tree = []

    def forward(q, k, v, mask):
        out, grads = jax.vjp(lambda q, k, v: local(q, k, v, mask), *map(_own, (q, k, v)))
        leaves, tree = jax.tree.flatten(grads)
        residual_tree[:] = [(tree, len(leaves))]
        return out, [x[None] for x in leaves]

    def backward(residuals, d_out):
        dq, dk, dv = jax.tree.unflatten(residual_tree[0][0], [x[0] for x in residuals])(_own(d_out))
        # Keys and values whole on ranks that split the queries (over batch or heads) got a share of their
        # gradient on each of those ranks: the sum is theirs.
        if summed:
            dk, dv = jax.lax.psum((dk, dv), summed)
        return dq, dk, dv

    def residual_specs():
        return [everywhere] * residual_tree[0][1]

    def fused_forward(q, k, v, mask):
        jax.eval_shape(shard(forward, in_specs=in_specs, out_specs=(q_spec, everywhere)), q, k, v, mask)
        out, residuals = shard(forward, in_specs=in_specs, out_specs=(q_spec, residual_specs()))(q, k, v, mask)
        return _vary_like(out, q), residuals

    @jax.custom_vjp
    def fused(q, k, v, mask):
        return fused_forward(q, k, v, mask)[0]

    def fused_backward(residuals, d_out):  # gradients vary over the step's manual axes as q, k, v do
        dq, dk, dv = shard(backward, in_specs=(residual_specs(), q_spec),
                           out_specs=(q_spec, k_spec, v_spec))(residuals, d_out)
        return _vary_like(dq, q), _vary_like(dk, k), _vary_like(dv, v), None

    fused.defvjp(fused_forward, fused_backward)
    return fused(q, k, v, mask)


def manual_blocks(kernels: BlockKernels, *, key_axes: LogicalAxes | None = None,
                  value_axes: LogicalAxes | None = None) -> BlockKernels:
    """``kernels`` (:mod:`meshtron.models.attention_blocks`), written for one device's arrays, as a pair
    called where the surrounding code leaves mesh axes automatic: each call runs in a ``shard_map``
    manual over those axes, each device attending for the query heads and batch rows it holds (laid
    out as :func:`manual_attention` lays them out), its key/value heads those its query heads read; the
    keys' and values' gradients are summed over the axes that split the queries but not the keys.
    Called as they are where no axis is automatic. The maps are unchecked (``check_vma=False``) for
    :func:`manual_attention`'s reason: the layers' scan and remat partially evaluate them too."""

    def layouts(q, k, v):
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
        if mesh.empty or not auto:
            return None
        sizes = dict(mesh.shape)
        q_spec = local_spec(QUERIES, q.shape, auto, sizes)
        k_spec = local_spec(KEYS if key_axes is None else tuple(key_axes), k.shape, auto, sizes)
        v_spec = local_spec(KEYS if value_axes is None else tuple(value_axes), v.shape, auto, sizes)
        kv_spec = k_spec if k_spec == v_spec else _common(k_spec, v_spec)
        heads_entry, kv_entry = spec_entry(q_spec, 2), spec_entry(kv_spec, 2)

        def own(x, local_heads):  # the key/value heads a device's query heads read (manual_attention's)
            if heads_entry is None or kv_entry is not None:
                return x
            return _own_key_heads(x, local_heads, local_heads * entry_ranks(heads_entry, sizes), heads_entry, sizes)

        def mask_spec(mask):
            return None if mask is None else PartitionSpec(spec_entry(q_spec, 0) if mask.shape[0] == q.shape[0] else None)

        shard = functools.partial(jax.shard_map, mesh=mesh, axis_names=set(auto), check_vma=False)
        lse_spec = PartitionSpec(spec_entry(q_spec, 0), heads_entry)
        summed = tuple(sorted(_axes(q_spec) - _axes(kv_spec)))  # the axes that split the queries, not the keys
        return shard, q_spec, kv_spec, lse_spec, mask_spec, own, summed

    def forward(q, k, v, *, scale, causal, mask):
        laid = layouts(q, k, v)
        if laid is None:
            return kernels.forward(q, k, v, scale=scale, causal=causal, mask=mask)
        shard, q_spec, kv_spec, lse_spec, mask_spec, own, _ = laid

        def local(q, k, v, mask):
            return kernels.forward(q, own(k, q.shape[2]), own(v, q.shape[2]), scale=scale, causal=causal, mask=mask)

        out, lse = shard(local, in_specs=(q_spec, kv_spec, kv_spec, mask_spec(mask)),
                         out_specs=(q_spec, lse_spec))(q, k, v, mask)
        return _vary_like(out, q), _vary_like(lse, q)

    def backward(q, k, v, out, lse, d_out, *, scale, causal, mask):
        laid = layouts(q, k, v)
        if laid is None:
            return kernels.backward(q, k, v, out, lse, d_out, scale=scale, causal=causal, mask=mask)
        shard, q_spec, kv_spec, lse_spec, mask_spec, own, summed = laid

        def local(q, k, v, out, lse, d_out, mask):
            (k_own, v_own), to_all = jax.vjp(lambda k, v: (own(k, q.shape[2]), own(v, q.shape[2])), _own(k), _own(v))
            dq, dk, dv = kernels.backward(q, k_own, v_own, out, lse, d_out, scale=scale, causal=causal, mask=mask)
            dk, dv = to_all((_own(dk.astype(k.dtype)), _own(dv.astype(v.dtype))))  # back to every key/value head
            if summed:  # keys whole on ranks that split the queries: each got a share of their gradients
                dk, dv = jax.lax.psum((dk, dv), summed)
            return dq, dk, dv

        dq, dk, dv = shard(local, in_specs=(q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec, mask_spec(mask)),
                           out_specs=(q_spec, kv_spec, kv_spec))(q, k, v, out, lse, d_out, mask)
        return _vary_like(dq, q), _vary_like(dk, k), _vary_like(dv, v)

    return BlockKernels(forward, backward)


def _own_key_heads(x: jax.Array, local_heads: int, heads: int, entry, sizes: dict[str, int]) -> jax.Array:
    """The key/value heads ``x`` [b, s, kv_heads, d] (all of them) that this device's ``local_heads``
    query heads read, out of ``heads``, the query heads split over the mesh axes of ``entry``: a
    contiguous slice when the device's query heads read whole groups or lie in one group, else one
    key/value head per query head (the device's heads then straddle two groups)."""
    kv_heads = x.shape[2]
    group = heads // kv_heads
    rank = 0
    for name in (entry,) if isinstance(entry, str) else entry:
        rank = rank * sizes[name] + jax.lax.axis_index(name)
    if local_heads % group == 0 or group % local_heads == 0:
        return jax.lax.dynamic_slice_in_dim(x, rank * local_heads // group, max(1, local_heads // group), axis=2)
    return jnp.take(x, (rank * local_heads + jnp.arange(local_heads)) // group, axis=2)


def local_spec(logical: tuple[str | None, ...], shape: tuple[int, ...], auto: frozenset[str],
                sizes: dict[str, int]) -> PartitionSpec:
    """The layout of an array of ``logical`` axes over the ``auto`` mesh axes only, each dimension the
    rules would split unevenly kept whole (``shard_map`` takes even splits only), and the sequence kept
    whole: causal attention of a sequence's part over that part alone would be wrong (a split sequence
    is manual here already, its exchange done by :mod:`meshtron.models.context_attention`)."""
    spec = manual_part(logical_to_spec(tuple(None if name == "seq" else name for name in logical)), auto)
    entries = [spec_entry(spec, i) for i in range(len(shape))]
    entries = [e if e is None or size % entry_ranks(e, sizes) == 0 else None for e, size in zip(entries, shape, strict=True)]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _common(a: PartitionSpec, b: PartitionSpec) -> PartitionSpec:
    """The entries ``a`` and ``b`` agree on; the others whole."""
    entries = [spec_entry(a, i) if spec_entry(a, i) == spec_entry(b, i) else None for i in range(max(len(a), len(b)))]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def spec_entry(spec: PartitionSpec, i: int) -> str | tuple[str, ...] | None:
    """The mesh axes ``spec`` splits dimension ``i`` over (``None``: whole, as for the dimensions past its end)."""
    return spec[i] if i < len(spec) else None


def _axes(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes ``spec`` splits some dimension over."""
    return frozenset(name for entry in spec if entry is not None
                     for name in ((entry,) if isinstance(entry, str) else entry))


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (``aval.vma`` up to jax 0.10, ``aval.mat.varying`` after)."""
    aval = jax.typeof(x)
    return frozenset(aval.vma if hasattr(aval, "vma") else aval.mat.varying)


def _own(x: jax.Array) -> jax.Array:
    """``x`` as a value of the unchecked ``shard_map`` it is in: that map's inputs keep the surrounding step's
    varying axes, its own operations have none, and an inner vjp takes and returns values of the second
    kind only (``* 1``, which XLA drops, makes one)."""
    return x * jnp.ones((), x.dtype)


def _vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked varying over the manual axes ``like`` varies over (an unchecked ``shard_map``'s results
    vary over none)."""
    return jax.lax.pcast(x, tuple(sorted(_varying(like) - _varying(x))), to="varying")


def entry_ranks(entry: str | tuple[str, ...] | None, sizes: dict[str, int]) -> int:
    """How many ranks a spec entry (:func:`spec_entry`) splits its dimension over on a mesh of ``sizes``."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(sizes[n] for n in names)
