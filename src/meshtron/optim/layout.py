"""Where every leaf of an optax state lives on the mesh.

Moments and other parameter-shaped parts of a state follow their parameters; 1-bit LAMB's state
knows its own layout (per-layer values split like the layer axis, error buffers per device);
anything else (step counts, scalars) is replicated. This replaces ``optax.tree_map_params``, which
discovers parameter-shaped parts by calling ``init`` on a placeholder -- something 1-bit LAMB's
``init`` (which sizes its buffers from the parameters and the mesh) cannot do.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from meshtron.optim.onebit_lamb import OnebitLambState, SpecsLike, _spec_leaves, state_specs
from meshtron.sharding import manual_part

__all__ = ["manual_part", "opt_state_specs"]


def opt_state_specs(opt_state: Any, params: Any, param_specs: SpecsLike, mesh, axis_name: str = "data") -> Any:
    """A tree of ``PartitionSpec`` shaped like ``opt_state`` (arrays or ``ShapeDtypeStruct`` s).

    ``params`` (arrays or shapes) and ``param_specs`` (specs or shardings shaped like them) say
    where parameter-shaped leaves go; ``mesh`` and ``axis_name`` place 1-bit LAMB's per-device
    error buffers.
    """
    treedef = jax.tree.structure(params)
    spec_leaves = _spec_leaves(param_specs, params, treedef)
    param_spec_tree = treedef.unflatten(spec_leaves)
    shapes = [x.shape for x in jax.tree.leaves(params)]

    def param_like(node) -> bool:
        if jax.tree.structure(node) != treedef:
            return False
        return [getattr(x, "shape", None) for x in jax.tree.leaves(node)] == shapes

    def is_leaf(node) -> bool:
        return isinstance(node, OnebitLambState) or param_like(node)

    def spec_of(node):
        if isinstance(node, OnebitLambState):
            return state_specs(node, spec_leaves, mesh, axis_name)
        if param_like(node):
            return param_spec_tree
        return P()

    return jax.tree.map(spec_of, opt_state, is_leaf=is_leaf)


def _is_onebit(node) -> bool:
    return isinstance(node, OnebitLambState)


def split_error_buffers(opt_state: Any) -> tuple[Any, list[dict[str, Any]]]:
    """``opt_state`` without 1-bit LAMB's per-device error buffers (``None`` in their place), and the
    buffers themselves, one ``{"worker": ..., "server": ...}`` per 1-bit LAMB state found.

    The buffers are what a checkpoint may drop: they are laid out per device, so they mean nothing
    on another mesh, and they are reset to zero there (1-bit LAMB reference, section 2.9).
    """
    found: list[dict[str, Any]] = []

    def strip(node):
        if _is_onebit(node):
            found.append({"worker": node.worker_error, "server": node.server_error})
            return node._replace(worker_error=None, server_error=None)
        return node

    return jax.tree.map(strip, opt_state, is_leaf=_is_onebit), found


def merge_error_buffers(opt_state: Any, buffers: list[dict[str, Any]]) -> Any:
    """Inverse of :func:`split_error_buffers`: put ``buffers`` back, in the order they were taken."""
    remaining = iter(buffers)

    def fill(node):
        if _is_onebit(node):
            b = next(remaining)
            return node._replace(worker_error=b["worker"], server_error=b["server"])
        return node

    merged = jax.tree.map(fill, opt_state, is_leaf=_is_onebit)
    if next(remaining, None) is not None:
        raise ValueError("buffers: more error buffers than 1-bit LAMB states in opt_state")
    return merged
