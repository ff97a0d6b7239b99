"""Logical axis names -> mesh axes: the one table that decides the parallel layout.

Model code names *logical* axes only (``batch``, ``seq``, ``embed``, ``heads``, ``kv``, ``qkv``,
``mlp``, ``vocab``, ``layers``). :data:`MEGATRON_RULES` maps them onto the mesh the way
Megatron-LM splits a transformer: attention by heads and the MLP's inner dimension over
``tensor`` (column-parallel in, row-parallel out), the vocabulary over ``tensor`` (vocab-parallel
embedding and cross-entropy), the batch over ``data`` and the stacked layer axis over ``pipe``.
Changing the layout means changing this table, never the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

LogicalAxes = Sequence[str | None]
Rules = Sequence[tuple[str, str | None]]

MESH_AXES = ("data", "pipe", "tensor")

MEGATRON_RULES: Rules = (
    ("batch", "data"),
    ("layers", "pipe"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", None),
    ("kv", None),
    ("qkv", None),
    ("seq", None),
    ("pos", None),
)

_active_rules: list[Rules] = [MEGATRON_RULES]


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[None]:
    """Use another rules table inside the block (for experiments and tests)."""
    _active_rules.append(tuple(rules))
    try:
        with nnx.logical_axis_rules(list(rules)):
            yield
    finally:
        _active_rules.pop()


def current_rules() -> Rules:
    return _active_rules[-1]


def logical_to_spec(axes: LogicalAxes, rules: Rules | None = None) -> PartitionSpec:
    """First matching rule wins; a mesh axis already used by an earlier dimension is skipped."""
    table = current_rules() if rules is None else rules
    used: set[str] = set()
    spec: list[str | None] = []
    for name in axes:
        target = None
        if name is not None:
            for logical, mesh_axis in table:
                if logical == name and (mesh_axis is None or mesh_axis not in used):
                    target = mesh_axis
                    break
            else:
                if name not in {logical for logical, _ in table}:
                    raise KeyError(f"logical axis {name!r} has no rule; add it to the rules table")
        if target is not None:
            used.add(target)
        spec.append(target)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, axes: LogicalAxes, rules: Rules | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, rules))


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Pin an activation's layout by logical names; a no-op outside a mesh context.

    Inside a ``shard_map`` the manual axes are already local to the device, so they are dropped
    from the constraint; only the compiler-managed (auto) axes are constrained.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = set(mesh.manual_axes)
    spec = logical_to_spec(axes)
    spec = PartitionSpec(*(None if (a is None or a in manual or a not in mesh.axis_names) else a for a in spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was declared with (``out_sharding`` metadata)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if axes is None:
        raise ValueError(f"parameter of shape {variable.value.shape} has no logical axes; annotate it")
    return tuple(axes)


def spec_axes(spec: PartitionSpec) -> set[str]:
    """The mesh axes a ``PartitionSpec`` splits over."""
    names: set[str] = set()
    for entry in spec:
        if entry is not None:
            names.update((entry,) if isinstance(entry, str) else entry)
    return names


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
