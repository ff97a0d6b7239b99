"""The GPT's parameter tree, its logical layout, and sharded initialisation.

Parameters are kept as a plain nested dict of arrays (the canonical tree a checkpoint sees);
:class:`ModelDef` knows how to rebuild the NNX module from such a dict (``bind``), what logical
axes every leaf carries, and how to create the tree *already sharded*: initialisation runs
under ``jax.jit`` with ``out_shardings`` from the rules table, so no parameter is ever
materialised whole on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshtron.config import ModelConfig, padded_vocab_size
from meshtron.models.gpt import GPT, GPTDims
from meshtron.sharding import logical_to_spec, variable_axes
from meshtron.trees import leaf_names

Params = dict[str, Any]


def dims_from_config(cfg: ModelConfig, tensor: int = 1) -> GPTDims:
    """Static model shape; the vocabulary is padded to a multiple of 128 x tensor as in Megatron."""
    return GPTDims(
        vocab_size=cfg.vocab_size,
        vocab_padded=padded_vocab_size(cfg.vocab_size, tensor),
        hidden=cfg.hidden,
        heads=cfg.heads,
        layers=cfg.layers,
        mlp_dim=cfg.mlp_dim,
        seq_len=cfg.seq_len,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        remat=cfg.remat == "full",
    )


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclass(frozen=True)
class ModelDef:
    """A GPT's structure without its values: rebuilds modules from parameter dicts."""

    dims: GPTDims
    graphdef: Any
    abstract_state: Any  # nnx.State of abstract Param variables (shapes + logical-axis metadata)

    @classmethod
    def create(cls, dims: GPTDims) -> ModelDef:
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: GPT(dims, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract, nnx.Param)
        return cls(dims, graphdef, state)

    def bind(self, params: Params) -> GPT:
        """The NNX module for a parameter dict (inside jit this costs nothing at run time)."""
        state = jax.tree.map(lambda v: v, self.abstract_state, is_leaf=_is_variable)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def logical_axes(self) -> Params:
        """Logical axis names of every parameter, as a tree shaped like the parameters."""
        axes = jax.tree.map(lambda v: _Axes(variable_axes(v)), self.abstract_state, is_leaf=_is_variable)
        return jax.tree.map(lambda a: a.names, nnx.to_pure_dict(axes), is_leaf=lambda x: isinstance(x, _Axes))

    def shapes(self) -> Params:
        return nnx.to_pure_dict(
            jax.tree.map(
                lambda v: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype),
                self.abstract_state,
                is_leaf=_is_variable,
            )
        )

    def vocab_parameters(self) -> set[str]:
        """Dotted names of parameters whose leading axis is the (padded) vocabulary."""
        axes = jax.tree.leaves(self.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
        return {name for name, a in zip(leaf_names(self.shapes()), axes, strict=True) if a and a[0] == "vocab"}

    def resizable_in(self, state: Any) -> frozenset[str]:
        """Leaves of a checkpoint ``state`` (parameters, moments) laid out ``[vocab_padded, ...]``: their
        padding depends on the tensor-parallel size, so a checkpoint may resize them."""
        vocab = self.vocab_parameters()
        return frozenset(
            name for name, x in zip(leaf_names(state), jax.tree.leaves(state), strict=True)
            if x.ndim and x.shape[0] == self.dims.vocab_padded and any(name.endswith("." + v) for v in vocab)
        )

    def shardings(self, mesh: Mesh) -> Params:
        """Where every parameter lives on ``mesh`` according to the active rules table."""
        return jax.tree.map(
            lambda names: NamedSharding(mesh, logical_to_spec(names)),
            self.logical_axes(),
            is_leaf=lambda x: isinstance(x, tuple),
        )

    def init(self, mesh: Mesh, seed: int) -> Params:
        """Parameters created sharded (jit with ``out_shardings``), then checked against the layout."""
        dims = self.dims

        def create() -> Params:
            with nnx.use_eager_sharding(False):
                model = GPT(dims, rngs=nnx.Rngs(params=seed))
            return nnx.to_pure_dict(nnx.state(model, nnx.Param))

        shardings = self.shardings(mesh)
        with jax.set_mesh(mesh):
            params = jax.jit(create, out_shardings=shardings)()
        check_layout(params, shardings)
        return params


@dataclass(frozen=True)
class _Axes:
    """Wraps a tuple of names so tree utilities treat it as one leaf."""

    names: tuple[str | None, ...]


def check_layout(params: Params, shardings: Params) -> None:
    """Every array's real sharding must equal the declared one (guards against silent replication)."""
    wrong = []
    for (path, array), sharding in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings), strict=True
    ):
        if not array.sharding.is_equivalent_to(sharding, array.ndim):
            wrong.append(f"{jax.tree_util.keystr(path)}: has {array.sharding.spec}, declared {sharding.spec}")
    if wrong:
        raise AssertionError("parameters are not laid out as declared:\n  " + "\n  ".join(wrong))
