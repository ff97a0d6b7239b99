"""A model's parameter tree, its logical layout, and sharded initialisation -- for any model that
follows :mod:`meshtron.models.contract`.

Parameters are kept as a plain nested dict of arrays (the canonical tree a checkpoint sees);
:class:`ModelDef` knows how to rebuild the NNX module from such a dict (``bind``), what logical
axes every leaf carries, which rules table places them, and how to create the tree *already
sharded*: initialisation runs under ``jax.jit`` with ``out_shardings`` from the rules table, so no
parameter is ever materialised whole on one device.

A :class:`ModelDef` is the model's structure only; how a run executes it (recomputation, the attention
implementation, the exchange over a split sequence, generation's window) is a separate
:class:`~meshtron.execution.Execution` that :meth:`ModelDef.scope`, :meth:`~ModelDef.traced` and
:meth:`~ModelDef.loss` take, so one structure serves runs that execute it differently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError
from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models.adaptation import Adaptation
from meshtron.models.blocks import LAYERS, PREFIX_LAYERS, Context, run_layer
from meshtron.models.contract import ModelFactory, check_model, checked_model, embed_tokens, lm_loss
from meshtron.models.fp8_scaling import counting_sites, with_scaling_state
from meshtron.models.probed_state import ProbedState, declared
from meshtron.run import check_sequence_parallel
from meshtron.sharding import MEGATRON_RULES, Rules, axis_rules, extend_rules, logical_to_spec, variable_axes
from meshtron.trace_context import current, using
from meshtron.trees import leaf_names
from meshtron.units import format_count

Params = dict[str, Any]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclass(frozen=True)
class ModelDef:
    """A model's structure without its values: rebuilds modules from parameter dicts.

    ``factory(rngs)`` makes the model (any :mod:`~meshtron.models.contract` model); ``rules`` is the
    logical -> mesh axis table that lays it out. What a run chooses about executing it (``model.remat``,
    ``model.attention``, ...) is not here but in an :class:`~meshtron.execution.Execution`: the methods
    that trace model code take one.
    """

    factory: ModelFactory
    graphdef: Any
    abstract_state: Any  # nnx.State of abstract Param variables (shapes + logical-axis metadata)
    rules: Rules
    vocab_size: int  # the real vocabulary (logits may be padded beyond it)
    max_len: int | None  # the model's own context limit (learned positions), if it has one
    can_cache: bool  # the model provides init_cache: generation decodes with a KV cache
    adaptation: Adaptation | None = None  # added parameters applied through the layer hook (LoRA's adapters)
    fp8_history: int = 0  # steps of amax history its blocks carry for delayed FP8 scaling (0: none)
    probed: tuple[tuple[str, ProbedState], ...] = ()  # state advanced from probes' gradients, by probe leaf name

    @classmethod
    def create(cls, factory: ModelFactory, *, rules: Rules = MEGATRON_RULES,
               adaptation: Adaptation | None = None, fp8_history: int = 0) -> ModelDef:
        """Trace ``factory`` abstractly (no parameter is created) and check the model contract. With an
        ``adaptation`` (:mod:`meshtron.models.adaptation`: LoRA's adapters), the model carries its
        parameters and its factory makes them. ``fp8_history`` > 0: the blocks also carry delayed FP8
        scaling's state (:mod:`meshtron.models.fp8_scaling`) for every projection one block calls."""
        rules = tuple(rules)
        if adaptation is not None:
            factory = adaptation.wrap(factory)
        with axis_rules(rules), nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: checked_model(factory, nnx.Rngs(0)))
            if fp8_history:
                factory = with_scaling_state(factory, _projection_sites(abstract, adaptation), fp8_history)
                abstract = nnx.eval_shape(lambda: factory(nnx.Rngs(0)))
        check_model(abstract, rules)
        max_len = getattr(abstract, "max_len", None)
        can_cache = callable(getattr(abstract, "init_cache", None))
        probed = tuple(sorted(declared(abstract).items(), key=lambda item: item[0]))
        graphdef, state = nnx.split(abstract, nnx.Param)
        return cls(factory, graphdef, state, rules, abstract.vocab_size, max_len, can_cache, adaptation, fp8_history,
                   probed)

    @contextlib.contextmanager
    def scope(self, execution: Execution = DEFAULT_EXECUTION) -> Iterator[None]:
        """Trace model code inside this: its activation constraints follow this model's rules (flax's
        partitioning metadata too) and its blocks apply the adaptation (:meth:`adapted`) -- the
        structure's part --, while ``execution`` says how it runs: its attention implementation (and,
        over a split sequence, its exchange), cores recomputed under ``remat=selective``."""
        views = current().layer_views
        if self.adaptation is not None:
            views = (*views, self._adaptation_view())
        with execution.scope(), using(rules=tuple(self.rules), layer_views=views), \
                nnx.logical_axis_rules(list(self.rules)):
            yield

    def adapted(self) -> contextlib.AbstractContextManager:
        """Inside this, blocks apply the adaptation (nothing without one): for code that traces the model
        under scopes of its own rather than :meth:`scope` (generation)."""
        if self.adaptation is None:
            return contextlib.nullcontext()
        return using(layer_views=(*current().layer_views, self._adaptation_view()))

    def frozen_base(self) -> contextlib.AbstractContextManager:
        """Inside this (within :meth:`scope`), blocks run without the adaptation: the frozen base model
        on the same parameters, no second copy of them (DPO's reference under LoRA). Other layer views
        (ZeRO-3's gathers) stay."""
        return using(layer_views=tuple(v for v in current().layer_views if not v.adaptation))

    def _adaptation_view(self):
        return dataclasses.replace(self.adaptation.layer_view(), adaptation=True)

    def training(self, seed: int) -> contextlib.AbstractContextManager:
        """Inside this, model code runs as in training: what is random only in training (an adaptation's
        dropout) is on, drawn from ``seed``."""
        return contextlib.nullcontext() if self.adaptation is None else self.adaptation.training(seed)

    def traced(self, fn: Callable[..., Any], execution: Execution = DEFAULT_EXECUTION) -> Callable[..., Any]:
        """``fn`` traced under this model's rules, executed as ``execution`` says (wrap what ``jax.jit``
        traces; :meth:`scope`)."""

        @functools.wraps(fn)
        def within_rules(*args, **kwargs):
            with self.scope(execution):
                return fn(*args, **kwargs)

        return within_rules

    @property
    def layers(self) -> int:
        """Depth of the block stack (the leading size of every block parameter)."""
        return jax.tree.leaves(self.shapes()["blocks"])[0].shape[0]

    @property
    def prefix_layers(self) -> int:
        """Depth of the model's ``prefix`` stack, the blocks it runs before ``blocks`` (0 without one)."""
        prefix = self.shapes().get("prefix")
        return jax.tree.leaves(prefix)[0].shape[0] if prefix else 0

    @property
    def vocab_padded(self) -> int:
        """The vocabulary as the parameters hold it (the leading size of a ``vocab``-first parameter)."""
        sizes = [s.shape[0] for s, a in zip(jax.tree.leaves(self.shapes()), self._axes_leaves(), strict=True)
                 if a and a[0] == "vocab"]
        return max(sizes, default=self.vocab_size)

    def parameter_count(self) -> int:
        """The model's weights (state advanced from probes -- delayed FP8 scaling's, a mixture of experts'
        selection bias -- is not counted: it is not a weight)."""
        return sum(math.prod(s.shape) for s, state in zip(jax.tree.leaves(self.shapes()),
                                                         jax.tree.leaves(self.probed_state()), strict=True)
                   if not state)

    def state_leaf(self, probe: str) -> str:
        """The dotted name of the state that the probe leaf named ``probe`` (a key of :attr:`probed`) advances."""
        kind = dict(self.probed)[probe]
        return probe[:len(probe) - len(kind.probe)] + kind.state

    def probed_state(self) -> Params:
        """``True`` for the leaves of state advanced from probes and for the probes
        (:mod:`meshtron.models.probed_state`): kept by the step, never trained, not the model's weights."""
        kept = {name for probe, _ in self.probed for name in (probe, self.state_leaf(probe))}
        return jax.tree.unflatten(jax.tree.structure(self.shapes()), [n in kept for n in leaf_names(self.shapes())])

    def describe(self) -> str:
        """One line: the model's class, size and depth (run summaries)."""
        return f"{type(nnx.merge(self.graphdef, self.abstract_state)).__name__} {format_count(self.parameter_count())} params, {self.layers} layers"

    def check_mesh(self, mesh: Mesh, layers: int | None = None) -> None:
        """Every sharded dimension must split evenly over its mesh axes; one line naming the parameter,
        the logical axis and the fix otherwise (instead of JAX's error from inside ``jit``).

        ``layers``: the stacked layer axis as training holds it, when that differs from the model's
        depth (an uneven ``parallel.layout`` pads every chunk to the largest)."""
        for name, shape, axes in zip(leaf_names(self.shapes()), jax.tree.leaves(self.shapes()), self._axes_leaves(),
                                     strict=True):
            spec = logical_to_spec(axes, self.rules)
            for size, logical, entry in zip(shape.shape, axes, spec, strict=False):
                size = layers if logical == "layers" and layers is not None else size
                names = () if entry is None else (entry,) if isinstance(entry, str) else entry
                split = math.prod(mesh.shape[a] for a in names)
                if size % split:
                    where = "x".join(f"{a}={mesh.shape[a]}" for a in names)
                    raise ConfigError(
                        f"model: parameter {name} has {logical!r} of size {size}, which {where} does not divide; "
                        f"use a size divisible by {split}, a smaller mesh axis, or model.rules={{{logical}: null}} "
                        "to replicate it")

    def loss(self, params: Params, tokens: jax.Array, execution: Execution = DEFAULT_EXECUTION) -> jax.Array:
        """Mean next-token loss of ``tokens`` [batch, seq + 1] through the contract, its blocks recomputed
        as ``execution.remat`` says (trace it within :meth:`scope` of the same ``execution``)."""
        return lm_loss(self.bind(params), tokens, remat=execution.remat)

    def stacked(self) -> Params:
        """``True`` for parameters with a leading ``layers`` axis, or a prefix's ``prefix_layers`` (per-layer
        optimizer choices)."""
        return jax.tree.map(lambda a: bool(a) and a[0] in (LAYERS, PREFIX_LAYERS), self.logical_axes(),
                            is_leaf=lambda x: isinstance(x, tuple))

    def _axes_leaves(self) -> list[tuple[str | None, ...]]:
        return jax.tree.leaves(self.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))

    def bind(self, params: Params) -> nnx.Module:
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
        return {name for name, a in zip(leaf_names(self.shapes()), self._axes_leaves(), strict=True)
                if a and a[0] == "vocab"}

    def resizable_in(self, state: Any) -> frozenset[str]:
        """Leaves of a checkpoint ``state`` (parameters, moments) laid out ``[vocab_padded, ...]``: their
        padding depends on the tensor-parallel size, so a checkpoint may resize them."""
        vocab = self.vocab_parameters()
        return frozenset(
            name for name, x in zip(leaf_names(state), jax.tree.leaves(state), strict=True)
            if x.ndim and x.shape[0] == self.vocab_padded and any(name.endswith("." + v) for v in vocab)
        )

    def shardings(self, mesh: Mesh) -> Params:
        """Where every parameter lives on ``mesh`` according to this model's rules table."""
        return jax.tree.map(
            lambda names: NamedSharding(mesh, logical_to_spec(names, self.rules)),
            self.logical_axes(),
            is_leaf=lambda x: isinstance(x, tuple),
        )

    def init(self, mesh: Mesh, seed: int, into: Callable[[Params], Params] | None = None,
             shardings: Params | None = None) -> Params:
        """Parameters created sharded (jit with ``out_shardings``), then checked against the layout.

        ``into``: applied to the fresh parameters in the same program, before they are placed (the
        pipeline's stage order, whose padded layer axis ``pipe`` may split where the model's does not).
        ``shardings``: where to place them, when not as the rules say (a training layout that also
        splits them over ``data``)."""

        def create() -> Params:
            with nnx.use_eager_sharding(False):
                model = self.factory(nnx.Rngs(params=seed))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            return params if into is None else into(params)

        shardings = self.shardings(mesh) if shardings is None else shardings
        with jax.set_mesh(mesh), self.scope():
            params = jax.jit(create, out_shardings=shardings)()
        check_layout(params, shardings)
        return params


def _projection_sites(abstract: nnx.Module, adaptation: Adaptation | None) -> int:
    """How many FP8 projections one block of ``abstract`` calls through the hook (:mod:`meshtron.models.fp8`),
    counted by tracing its first block, as the run will (the adaptation's hook applied), on a short input."""
    graphdef, state = nnx.split(abstract)
    views = () if adaptation is None else (adaptation.layer_view(),)
    counted = []

    def first_block(state: Any) -> None:
        model = nnx.merge(graphdef, state)
        ctx = Context.for_sequence(1, 8)
        x = embed_tokens(model, jnp.zeros((1, 8), jnp.int32), ctx)
        blocks_graph, blocks_state = nnx.split(model.blocks)
        with using(layer_views=views), counting_sites() as counter:
            run_layer(blocks_graph, jax.tree.map(lambda a: a[0], blocks_state), x, ctx)
        counted.append(counter.used)

    jax.eval_shape(first_block, state)
    return counted[0]


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


def model_def_from_config(cfg: ModelConfig, tensor: int = 1, *, rules: Mapping[str, str | None] | None = None,
                          factory: ModelFactory | None = None, adaptation: Adaptation | None = None,
                          platform: str | None = None) -> ModelDef:
    """The :class:`ModelDef` of a run: ``factory`` (a user's model), else ``model.factory`` or
    ``model.family`` from the config; Megatron's rules extended by the family's own, then by
    ``model.rules`` and ``rules`` (later ones win). ``parallel.sequence_parallel`` maps the residual
    stream's ``residual_seq`` onto ``tensor`` (:data:`meshtron.models.contract.RESIDUAL`). The structure
    only: the run's switches are ``Execution.of_model_config(cfg)`` (:class:`~meshtron.execution.Execution`),
    checked here where they need the devices (``model.attention=cudnn``): ``platform`` is the run's
    devices' (``"gpu"`` for compile-only GPU targets on a CPU machine), by default JAX's default backend."""
    from meshtron.models.registry import family_rules, model_factory

    table = extend_rules(MEGATRON_RULES, family_rules(cfg, tensor) if factory is None else {})
    table = extend_rules(extend_rules(table, cfg.rules), rules or {})
    check_sequence_parallel(cfg, tensor)
    if cfg.sequence_parallel:
        table = extend_rules(table, {"residual_seq": "tensor"})
    platform = platform or jax.default_backend()
    if cfg.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention: cudnn (flash attention) needs GPUs, this run has {platform} devices; use "
                          "model.attention=xla (or compile for a GPU target: describe --compile --target h100)")
    return ModelDef.create(factory or model_factory(cfg, tensor), rules=table, adaptation=adaptation,
                           fp8_history=cfg.fp8_amax_history if cfg.fp8 == "delayed" else 0)
