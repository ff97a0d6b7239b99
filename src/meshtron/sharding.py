"""Logical axis names -> mesh axes: the one table that decides the parallel layout.

Model code names *logical* axes only (``batch``, ``seq``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``qkv``, ``mlp``, ``experts``, ``vocab``, ``layers``, ``prefix_layers``). :data:`MEGATRON_RULES` maps them onto the mesh the way
Megatron-LM splits a transformer: attention by heads and the MLP's inner dimension over
``tensor`` (column-parallel in, row-parallel out), the vocabulary over ``tensor`` (vocab-parallel
embedding and cross-entropy), the batch over ``data``, the stacked layer axis over ``pipe`` (a model's
``prefix`` stack, which runs with the embedding, is replicated over it) and the
sequence over ``context`` (context parallelism: the train step is manual over that axis, and
attention exchanges keys and values over it, :mod:`meshtron.models.context_attention`).
Changing the layout means changing this table, never the model: :func:`extend_rules` adds a
model's own logical names or overrides a mapping (``model.rules`` in a config).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtron.trace_context import current, using

LogicalAxes = Sequence[str | None]
Rules = Sequence[tuple[str, str | None]]

MESH_AXES = ("data", "context", "pipe", "tensor")

MEGATRON_RULES: Rules = (
    ("batch", "data"),
    ("layers", "pipe"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", None),
    ("head_dim", None),
    ("qkv", None),
    ("seq", "context"),
    ("residual_seq", None),
    ("pos", None),
    ("experts", "data"),
    ("lora_rank", None),
    ("prefix_layers", None),  # a model's prefix stack runs with the embedding: replicated over pipe like it
)


def extend_rules(rules: Rules, overrides: Mapping[str, str | None]) -> Rules:
    """``rules`` with ``overrides`` applied: a name already in the table is remapped in place (every
    rule for it is replaced by one), a new name is appended. ``None`` means replicated."""
    for name, axis in overrides.items():
        if axis is not None and axis not in MESH_AXES:
            raise ValueError(f"model.rules.{name}: {axis!r} is not a mesh axis; use one of {MESH_AXES} or null")
    table = [(n, overrides.get(n, a)) for n, a in rules]
    table = list(dict.fromkeys(table)) if overrides else table
    seen = {n for n, _ in rules}
    return tuple(table + [(n, a) for n, a in overrides.items() if n not in seen])


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[None]:
    """Use another rules table inside the block: model code traced here constrains its activations by it
    (and flax resolves partitioning metadata by it)."""
    with using(rules=tuple(rules)), nnx.logical_axis_rules(list(rules)):
        yield


def current_rules() -> Rules:
    """The rules table of the innermost :func:`axis_rules` (:data:`MEGATRON_RULES` outside one)."""
    rules = current().rules
    return MEGATRON_RULES if rules is None else rules


def placing_rules(axes: LogicalAxes, rules: Rules | None = None) -> list[int | None]:
    """For every dimension, the index in ``rules`` of the rule that places it (``None`` for an unnamed
    dimension). First matching rule wins; a rule whose mesh axis an earlier dimension already uses is
    skipped."""
    table = current_rules() if rules is None else rules
    used: set[str] = set()
    chosen: list[int | None] = []
    for name in axes:
        index = None
        if name is not None:
            for i, (logical, mesh_axis) in enumerate(table):
                if logical == name and (mesh_axis is None or mesh_axis not in used):
                    index = i
                    break
            else:
                if name not in {logical for logical, _ in table}:
                    raise KeyError(f"logical axis {name!r} has no rule; add it to the rules table")
        if index is not None and table[index][1] is not None:
            used.add(table[index][1])
        chosen.append(index)
    return chosen


def logical_to_spec(axes: LogicalAxes, rules: Rules | None = None) -> PartitionSpec:
    """The mesh layout of logical ``axes`` under ``rules`` (default: the active table); see :func:`placing_rules`."""
    table = current_rules() if rules is None else rules
    return PartitionSpec(*(None if i is None else table[i][1] for i in placing_rules(axes, table)))


def same_layout(a: str, b: str) -> bool:
    """Whether logical axes ``a`` and ``b`` are placed alike by the active rules (a model may choose a
    computation by it -- e.g. join two kernels only when that is a local operation -- without
    naming a mesh axis)."""
    return logical_to_spec((a,)) == logical_to_spec((b,))


def divides(axis: str) -> bool:
    """Whether the active rules split logical ``axis`` over more than one device of the current mesh
    (any placement, outside a mesh). A model may choose a computation by it -- join kernels into one
    matmul only where that saves a collective -- without naming a mesh axis."""
    placed = logical_to_spec((axis,))[0]
    if placed is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return True
    return any(mesh.shape[a] > 1 for a in axis_names(placed) if a in mesh.axis_names)


def logical_sharding(mesh: Mesh, axes: LogicalAxes, rules: Rules | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside a mesh context.

    Inside a ``shard_map`` the manual axes are already local to the device, so they are dropped
    from the constraint; only the compiler-managed (auto) axes are constrained. Axes of one device
    split nothing and are dropped too (``seq`` maps to ``context``, of one device unless sequences
    are split): the constraint is the same, and the program names only axes that split. The result
    remembers ``axes`` (:func:`pinned_axes`): the gathered context exchange keeps keys and values as
    the model laid them out, under whatever names it gave their heads.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = set(mesh.manual_axes)
    spec = logical_to_spec(axes)
    spec = PartitionSpec(*(None if (a is None or a in manual or a not in mesh.axis_names or mesh.shape[a] == 1)
                           else a for a in spec))
    return _pinned_to(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)), axes)


def _pinned_to(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """``x``, remembered as laid out by the logical ``axes`` (:func:`pinned_axes`) for as long as it
    lives: with automatic mesh axes an array's type does not say how they split it, and code that
    must name its layout (a ``shard_map`` over those axes) needs the model's own names for it."""
    pins, key = current().pins, id(x)

    def forget(ref: weakref.ref) -> None:
        if pins.get(key, (None,))[0] is ref:
            del pins[key]

    try:
        pins[key] = (weakref.ref(x, forget), tuple(axes))
    except TypeError:  # a value that cannot be referred to weakly is simply not remembered
        pass
    return x


def pinned_axes(x: jax.Array) -> tuple[str | None, ...] | None:
    """The logical axes :func:`constrain` last pinned this very value to, or ``None`` (never pinned,
    or computed from a pinned value: a new value, whose layout the compiler chooses)."""
    entry = current().pins.get(id(x))
    return entry[1] if entry is not None and entry[0]() is x else None


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was declared with (``out_sharding`` metadata)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if axes is None:
        raise ValueError(f"parameter of shape {variable.get_value().shape} has no logical axes; annotate it")
    return tuple(axes)


def spec_axes(spec: PartitionSpec) -> set[str]:
    """The mesh axes a ``PartitionSpec`` splits over."""
    names: set[str] = set()
    for entry in spec:
        if entry is not None:
            names.update((entry,) if isinstance(entry, str) else entry)
    return names


GRADIENT_AXES = ("data", "context")


def gradient_axes(sizes: Mapping[str, int]) -> str | tuple[str, ...]:
    """The mesh axes local gradients are averaged over, given the mesh's sizes: ``data``, and with a
    sequence split over ``context`` both together (each context rank's gradient covers its tokens
    only, as in Megatron-LM's data x context-parallel group). Only axes of more than one device;
    ``"data"`` (a single axis name) unless the sequence is split."""
    split = tuple(a for a in GRADIENT_AXES if sizes.get(a, 1) > 1)
    if sizes.get("context", 1) == 1 or len(split) == 1:
        return split[0] if split else "data"
    return split


def axis_names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes a collective's ``axis_name`` names (one, or a group such as data x context)."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def splits_over(spec: PartitionSpec, axis: str | tuple[str, ...]) -> bool:
    """Whether ``spec`` splits over any of the mesh axes ``axis`` names."""
    return bool(spec_axes(spec) & set(axis_names(axis)))


def manual_part(specs, axes: set[str] | frozenset[str]):
    """The specs as a ``shard_map`` manual over ``axes`` (only) must see them: other axes dropped."""

    def restrict(spec: PartitionSpec) -> PartitionSpec:
        entries = []
        for entry in spec:
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            kept = tuple(n for n in names if n in axes)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    return jax.tree.map(restrict, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """``x`` typed as varying over the manual mesh axes ``ref`` varies over, its values unchanged: a
    fresh constant (zeros for a ``cond`` branch or a ``scan`` carry) inside ``shard_map`` varies over
    none, and must match what the other branch or the loop body computes from ``ref``. The sum of an
    empty slice of ``ref`` is an exact zero with ``ref``'s type; it moves no data."""
    return x + jax.numpy.sum(ref.reshape(-1)[:0]).astype(x.dtype)

