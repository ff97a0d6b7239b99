"""The jitted (pjit-style) train and eval steps, composed of parts that each own one decision.

One train step is

1. **gradients** of each data rank's own tokens over its microbatches: the plain model or the pipeline
   runtime (:mod:`meshtron.train.forward_backward`), inside a ``shard_map`` manual over the data group
   (:class:`~meshtron.train.data_shards.DataShards`: data, and context when sequences are split);
   ``tensor`` and ``pipe`` stay with the compiler, which splits every layer Megatron-style from the
   parameter annotations. Parameters are cast to *varying* over the group before differentiation, so
   autodiff returns each rank's local gradient instead of inserting its own reduction; frozen parameters
   (:class:`~meshtron.train.trainable.Trainable`) enter under ``stop_gradient``;
2. one **gradient sync**, chosen once from the zero plan (:func:`meshtron.optim.sync.gradient_sync`): the
   ``reduction`` transform's all-reduce (by default :func:`meshtron.optim.data_parallel_mean`; an optimizer
   that reduces itself, 1-bit LAMB, gets ``optax.identity()`` and the local gradients), a reduce-scatter
   into shares (ZeRO-1), or shares gathered once or layer by layer (ZeRO-3);
3. the **optimizer** update of what trains (whole, or this rank's shares), then the sync's gather back;
4. the **non-finite guard**: with ``skip_nonfinite`` a step whose update holds a NaN or Inf leaves
   parameters and optimizer state as they were, every rank deciding alike.

``jax.jit`` has explicit ``in_shardings``/``out_shardings`` and donates parameters and optimizer state
(updated in place). Optimizers with *stages* that communicate differently (1-bit LAMB's warmup and
compression) get one compiled program per stage: the stage is a static argument whose extra ``update``
arguments come from ``stages``, and the host picks the stage each step. Metrics (loss, gradient norm) come
back per rank of the group and are averaged on the host, so they add no collective to the step.

DPO's frozen copy of the starting weights (``frozen_reference``) is an argument of the step beside the
batch (:class:`StepInputs`): held in the parameters' layout (tensor- and pipe-split; whole over the data
group), never donated, without gradient or optimizer state. Before the gradients, the step runs its
forward over the rank's batch -- one microbatch at a time, or in a pipeline the forward-only schedule, each
stage's layers on their own devices -- and adds each row's summed answer log-probability to the batch (of
packed pairs, each conversation's on its own positions), where the objective reads it
(:mod:`meshtron.train.objective`). The held-out loss and the logged metrics take the
same inputs and do the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.hlo.collectives import collectives
from meshtron.hlo.summary import MemoryFigures, memory_figures
from meshtron.models import documents
from meshtron.models.blocks import layer_parameters
from meshtron.optim.layout import manual_part, opt_state_specs
from meshtron.optim.sync import gradient_sync
from meshtron.optim.zero import ZeroPlan
from meshtron.pipeline.execution import PipelinePlan
from meshtron.trace_context import using
from meshtron.train.data_shards import CONTEXT, DATA, DataShards
from meshtron.train.forward_backward import plain_forward_backward
from meshtron.train.objective import Objective
from meshtron.train.pipelined import pipelined_forward_backward
from meshtron.train.probed_state import ProbedStates
from meshtron.train.state import ModelDef, Params
from meshtron.train.trainable import Trainable

SINGLE_STAGE = {"train": {}}
HOST_MEMORY = "pinned_host"  # where train.offload_optimizer holds the optimizer state between steps


class StepMetrics(NamedTuple):
    """Per data shard (``[data]``): each shard's mean loss, the norm of the gradient it handed to
    the optimizer (the same on every shard after a data-parallel reduction; the shard's own under
    1-bit LAMB), and whether the update was applied (``False`` only when a non-finite update was
    skipped). :meth:`mean` averages them on the host."""

    loss: jax.Array
    grad_norm: jax.Array
    applied: jax.Array

    def mean(self) -> tuple[float, float]:
        """(loss, grad_norm) averaged over data shards; blocks until the step is done."""
        return float(np.mean(_host(self.loss))), float(np.mean(_host(self.grad_norm)))

    def was_applied(self) -> bool:
        return bool(np.all(_host(self.applied)))


def _host(x: jax.Array) -> np.ndarray:
    """All of ``x`` on the host; across processes, each contributes its own shards."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class StepInputs(NamedTuple):
    """What a step reads besides the state it updates, where the run holds DPO's frozen reference: the
    batch ``tokens`` and the ``reference`` weights (laid out as :attr:`TrainSteps.reference_shardings`)."""

    tokens: jax.Array
    reference: Params


class OptState(NamedTuple):
    """State of the reduction transform and of the optimizer proper."""

    reduction: Any
    optimizer: Any


def build_steps(
    model_def: ModelDef,
    mesh: Mesh,
    reduction: optax.GradientTransformation,
    optimizer: optax.GradientTransformation,
    *,
    microbatches: int = 1,
    pipeline: PipelinePlan | None = None,
    stages: Mapping[str, Mapping[str, Any]] = SINGLE_STAGE,
    skip_nonfinite: bool = False, zero: ZeroPlan | None = None, trainable: Trainable | None = None,
    seed: int = 0, execution: Execution = DEFAULT_EXECUTION, objective: Objective | None = None,
    offload_optimizer: bool = False, compiler_options: Mapping[str, Any] | None = None, frozen_reference: bool = False,
) -> TrainSteps:
    """Compile-ready train/eval steps for ``model_def`` on ``mesh``.

    ``pipeline`` (mesh ``pipe`` > 1): gradients come from the pipeline runtime executing its schedule over the
    microbatches; block parameters are then in stage order (:mod:`meshtron.train.pipelined`), padded as an
    uneven layout says. ``stages`` maps each optimizer stage name to the extra keyword arguments of
    ``optimizer.update`` in it. ``zero``: how parameters and optimizer state are split over the data group
    (:mod:`meshtron.optim.zero`; ``optimizer`` must have been built with the same plan, its norms summing over
    the shares). ``trainable``: which parameters train (default: the model's own mask). ``seed``: of what is
    random in training only (dropout). With ``skip_nonfinite`` a non-finite update is not applied
    (``StepMetrics.applied`` false); the test is on the update, which every rank agrees on. ``execution``: how
    the model's code runs (``Run.execution``); ``objective``: what the step minimises. ``offload_optimizer``:
    optimizer state in pinned host memory between steps. ``compiler_options``: XLA's, for every program.
    ``frozen_reference``: the programs take DPO's frozen reference beside the batch (:class:`StepInputs`)."""
    shapes, model_specs = model_def.shapes(), model_def.shardings(mesh)
    shards = DataShards.of(mesh, model_def.rules, execution)
    zero = zero or ZeroPlan.for_mesh(0, shapes, model_specs, model_def.stacked(), mesh, whole=model_def.probed_state())
    trainable = trainable or Trainable.of_model(model_def)
    sync = gradient_sync(zero, reduction)
    source = _gradient_source(model_def, pipeline, shards, microbatches, execution, objective)
    part, probed = trainable.part, ProbedStates(model_def, trainable.observed)
    held = _held_layout(model_def, mesh, shards, zero, part, reduction, optimizer, offload_optimizer)
    given = _Inputs(shards, held.whole, source.reference_logps if frozen_reference else None)

    def per_shard_train(params: Params, opt_state: OptState, tokens: jax.Array, stage: str):
        observed = []  # the probes' gradients (models/probed_state.py), read before frozen leaves leave the tree
        def differentiate(view: Params, local_leaves: Any, layer_view: Any = None):
            with layer_parameters(layer_view) if layer_view is not None else contextlib.nullcontext():
                loss, grads = source.gradients(shards.local(trainable.stopped(view), local_leaves), tokens)
            return loss, part(probed.read(grads, into=observed))

        with model_def.training(seed), using(loss_groups=source.loss_groups * shards.replicas):
            got = sync.reduced(differentiate, params, part(params), opt_state.reduction)
        updates, optimizer_state = optimizer.update(got.grads, opt_state.optimizer, got.params, **stages[stage])
        new_params = trainable.completed(sync.updated(optax.apply_updates(got.params, updates)), params)
        new_params = probed.advanced(new_params, observed, shards.group, microbatches)
        new_state = OptState(got.reduction_state, optimizer_state)
        applied = jnp.bool_(True)
        if skip_nonfinite:
            applied = sync.agreed(jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)])))
            new_params, new_state = _chosen(applied, (new_params, new_state), (params, opt_state))
        return new_params, new_state, StepMetrics(got.loss[None], got.grad_norm[None], applied[None])

    def per_shard_gradients(params: Params, tokens: jax.Array):
        return sync.averaged(*source.gradients(shards.local(trainable.stopped(params), sync.local_leaves), tokens))

    def train(params: Params, opt_state: OptState, inputs: Any, stage: str):
        metrics = StepMetrics(*[shards.per_replica] * 3)
        return shards.shard_map(given.over(partial(per_shard_train, stage=stage)), (held.params, held.state, given.spec),
                                (held.params, held.state, metrics))(params, opt_state, given.laid_out(inputs))

    def whole_params(fn, out_specs, inputs: _Inputs = given):
        """``fn(params, tokens)`` of ``inputs`` over the region with every parameter whole (evaluation, analysis)."""
        return lambda params, tokens: shards.shard_map(inputs.over(fn), (held.whole, inputs.spec), out_specs)(
            params, inputs.laid_out(tokens))

    scoped = partial(model_def.traced, execution=execution)
    return TrainSteps(
        mesh, held.param_shardings, held.opt_shardings, shards.batch_sharding, tuple(stages),
        reference_shardings=model_specs if frozen_reference else None,
        train=scoped(_state_on_host(train) if offload_optimizer else train),
        evaluate=scoped(whole_params(lambda p, t: shards.mean(source.loss(p, t)), P())),
        gradients=scoped(whole_params(per_shard_gradients, (P(), held.whole))),
        init_state=held.init_state, zero=zero, trainable=trainable, reports=scoped(whole_params(partial(_reports, shards, source), P())),
        report_groups=microbatches * shards.replicas, metrics_spec=shards.per_replica, compiler_options=compiler_options,
        objective_metrics=source.metrics and scoped(whole_params(partial(_group_mean, shards, source.metrics), P())),
        row_logps=scoped(whole_params(partial(_summed_rows, shards, source.row_logps), P(DATA), given.plain())))


class _Inputs(NamedTuple):
    """What the region's programs take beside the parameters: a batch, or, with a frozen DPO reference's
    ``row_logps`` (its per-row, or packed pairs' per-document, sums; its weights laid out ``whole`` in the
    region), :class:`StepInputs`."""

    shards: DataShards
    whole: Any
    row_logps: Any = None

    @property
    def spec(self) -> Any:
        return self.shards.shard_batch if self.row_logps is None else StepInputs(self.shards.shard_batch, self.whole)

    def plain(self) -> _Inputs:
        """A batch alone."""
        return self._replace(row_logps=None)

    def laid_out(self, inputs: Any) -> Any:
        if self.row_logps is None:
            return self.shards.laid_out(inputs)
        return inputs._replace(tokens=self.shards.laid_out(inputs.tokens))

    def over(self, fn):
        """``fn(..., tokens)`` as a function of these inputs last (the reference's forward: outside ``fn``'s
        training scope, so no dropout, and under ``stop_gradient``)."""
        return lambda *args: fn(*args[:-1], self.local(args[-1]))

    def local(self, inputs: Any) -> jax.Array:
        """A rank's tokens, with the frozen reference's per-row (per-document) log-probabilities added where
        it has one."""
        if self.row_logps is None:
            return inputs
        rows = _summed_rows(self.shards, self.row_logps, jax.lax.stop_gradient(inputs.reference), inputs.tokens)
        return _with_reference(rows, inputs.tokens)


class _HeldLayout(NamedTuple):
    """How the step's state is held: its shardings, and the specs the data-parallel region sees (of the
    parameters as held between steps, of the optimizer state, of every parameter whole)."""

    init_state: Any
    param_shardings: Any
    opt_shardings: Any
    params: Any
    state: Any
    whole: Any


def _held_layout(model_def: ModelDef, mesh: Mesh, shards: DataShards, zero: ZeroPlan, part, reduction,
                 optimizer, on_host: bool = False) -> _HeldLayout:
    """Optimizer state laid out like the parameters it mirrors (moments are tensor-sharded too, and split
    over data by an active zero plan); per-device parts (1-bit LAMB's error buffers) split over the mesh;
    the rest replicated. Only what trains (``part``) has state; ``on_host``: held in pinned host memory."""
    shapes, model_specs = model_def.shapes(), model_def.shardings(mesh)

    def init_state(p: Params) -> OptState:
        return OptState(reduction.init(part(p)), optimizer.init(part(p)))

    held_specs = zero.specs(model_specs) if zero.shards_params else model_specs
    with jax.set_mesh(mesh):
        state_specs = opt_state_specs(jax.eval_shape(init_state, shapes), part(shapes), part(zero.specs(model_specs)),
                                      mesh, shards.group)
    state_shardings = _named(mesh, state_specs)
    if on_host:
        state_shardings = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), state_shardings,
                                       is_leaf=lambda x: isinstance(x, NamedSharding))
    return _HeldLayout(init_state, _named(mesh, held_specs) if zero.shards_params else model_specs, state_shardings,
                       manual_part(_specs(held_specs), shards.manual), manual_part(state_specs, shards.manual),
                       manual_part(_specs(model_specs), shards.manual))


def _state_on_host(train):
    """``train`` for an optimizer state held in pinned host memory between steps (its shardings' memory kind,
    :func:`_held_layout`): the step moves the state onto the device for the update and the new state back
    out -- memory *space* transfers, which a compile-only GPU target (whose shardings have no memory kinds)
    compiles too."""
    def offloaded(params: Params, opt_state: OptState, tokens: jax.Array, stage: str):
        new_params, new_state, metrics = train(params, jax.device_put(opt_state, jax.memory.Space.Device), tokens, stage)
        return new_params, jax.device_put(new_state, jax.memory.Space.Host), metrics

    return offloaded


def _with_reference(rows: jax.Array, tokens: jax.Array) -> jax.Array:
    """Features ``tokens`` [b, s, 5] with a sixth, the reference log-probabilities as fp32 bits: each row's
    ``rows`` [b] on every position, or of packed documents ``rows`` [b, K] each document's on its own
    positions (segment id ``k`` holds ``rows[:, k - 1]``; 0 where no document is), as
    :func:`meshtron.models.preference.precomputed_reference` reads them."""
    values = rows.astype(jnp.float32)
    if values.ndim == 1:
        per_position = jnp.broadcast_to(values[:, None], tokens.shape[:2])
    else:
        segments = documents.view(tokens).segments
        slot = jnp.clip(segments - 1, 0, values.shape[1] - 1)
        found = jnp.take_along_axis(values, slot, axis=1)
        per_position = jnp.where((segments >= 1) & (segments <= values.shape[1]), found, 0.0)
    bits = jax.lax.bitcast_convert_type(per_position, jnp.int32)
    return jnp.concatenate([tokens, bits[..., None]], axis=-1)


def _chosen(applied: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``applied``, else ``old`` (leaf by leaf): a skipped step changes nothing."""
    return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)


def _summed_rows(shards: DataShards, fn, params: Params, tokens: jax.Array) -> jax.Array:
    """``fn(params, tokens)``'s per-row sums of a rank's positions, summed over a sequence's context ranks."""
    rows = fn(params, tokens)
    return rows if shards.context == 1 else jax.lax.psum(rows, CONTEXT)


def _reports(shards: DataShards, source, params: Params, tokens: jax.Array) -> Any:
    """What the layers report, summed over the data group where the region checks varying types."""
    found = source.reports(params, tokens)
    return jax.lax.psum(found, shards.group) if shards.check_vma else found


def _group_mean(shards: DataShards, fn, params: Params, tokens: jax.Array) -> Any:
    """``fn(params, tokens)`` averaged over the data group."""
    return shards.mean(fn(params, tokens))


def _gradient_source(model_def: ModelDef, pipeline: PipelinePlan | None, shards: DataShards, microbatches: int,
                     execution: Execution, objective: Objective | None):
    """Where the step's local loss and gradients come from: the plain model, or ``pipeline``'s runtime."""
    if pipeline is None:
        return plain_forward_backward(model_def, microbatches, execution, objective)
    return pipelined_forward_backward(model_def, _for_region(pipeline, shards, execution), microbatches, execution,
                                      objective)


def _for_region(pipeline: PipelinePlan, shards: DataShards, execution: Execution) -> PipelinePlan:
    """``pipeline`` as the region runs it: a ring's collective-permutes (ring attention's, collective matmul's
    over the tensor ranks) are entered by every device of the mesh at once, so stages then run every tick's
    work in lockstep instead of skipping idle ticks."""
    tensor_ring = execution.collective_matmul and shards.mesh.shape.get("tensor", 1) > 1
    lockstep = (shards.context > 1 and execution.context_attention in ("ring", "hybrid")) or tensor_ring
    return replace(pipeline, lockstep=lockstep, check_vma=shards.check_vma)


def _specs(tree: Any) -> Any:
    """``PartitionSpec`` s of a tree of shardings or specs."""
    return jax.tree.map(lambda s: getattr(s, "spec", s), tree, is_leaf=lambda x: isinstance(x, P) or hasattr(x, "spec"))


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


class TrainSteps:
    """The jitted entry points of one configuration (pjit-style: explicit in/out shardings).

    The train step is compiled once per stage, on first use, and the compiled program is kept: it
    is what runs, and what :meth:`data_bytes` reads its communication from.
    """

    def __init__(self, mesh: Mesh, param_shardings, opt_shardings, batch_sharding, stages: tuple[str, ...], *,
                 train, evaluate, gradients, init_state, zero: ZeroPlan | None = None,
                 trainable: Trainable | None = None, reports=None,
                 report_groups: int = 1, metrics_spec: P | None = None,
                 compiler_options: Mapping[str, Any] | None = None, objective_metrics=None, row_logps=None,
                 reference_shardings=None):
        self.mesh = mesh
        self.compiler_options = dict(compiler_options or {})  # XLA options of every program below
        jit = partial(jax.jit, compiler_options=self.compiler_options or None)
        self.report_groups = report_groups  # routing groups a step's reports sum over: microbatches × data (× context)
        self.zero = zero  # how parameters and optimizer state are split over data
        self.trainable = trainable or Trainable()  # which parameters train (the rest frozen: no state)
        self.param_shardings = param_shardings
        self.opt_shardings = opt_shardings
        self.batch_sharding = batch_sharding
        # DPO's frozen reference weights, where the programs take them beside the batch (StepInputs); None without
        self.reference_shardings = reference_shardings
        self.input_sharding = (batch_sharding if reference_shardings is None
                               else StepInputs(batch_sharding, reference_shardings))
        self.stages = stages
        replicated = NamedSharding(mesh, P())
        per_shard = NamedSharding(mesh, P(DATA) if metrics_spec is None else metrics_spec)
        self.init_state_fn = init_state  # params -> fresh OptState (for abstract shapes: jax.eval_shape)
        self._init_jit = jit(init_state, in_shardings=(param_shardings,), out_shardings=opt_shardings)
        self._train_jit = jit(
            train,
            in_shardings=(param_shardings, opt_shardings, self.input_sharding),
            out_shardings=(param_shardings, opt_shardings, StepMetrics(per_shard, per_shard, per_shard)),
            donate_argnums=(0, 1),
            static_argnums=3,
        )
        self._compiled: dict[str, jax.stages.Compiled] = {}
        self._data_bytes: dict[str, float] = {}
        inputs = self.input_sharding
        self._eval_jit = jit(evaluate, in_shardings=(param_shardings, inputs), out_shardings=replicated)
        self._gradients_jit = jit(
            gradients, in_shardings=(param_shardings, inputs), out_shardings=(replicated, param_shardings)
        )
        self._reports_jit = None if reports is None else jit(
            reports, in_shardings=(param_shardings, inputs), out_shardings=replicated)
        self._reports_compiled: Any = None
        self._metrics_jit = None if objective_metrics is None else jit(
            objective_metrics, in_shardings=(param_shardings, inputs), out_shardings=replicated)
        self._row_logps_jit = None if row_logps is None else jit(
            row_logps, in_shardings=(param_shardings, batch_sharding), out_shardings=NamedSharding(mesh, P(DATA)))

    def init_opt_state(self, params: Params) -> OptState:
        """Fresh optimizer state, created sharded."""
        with jax.set_mesh(self.mesh):
            return self._init_jit(params)

    def inputs(self, tokens: jax.Array, reference: Params | None = None) -> Any:
        """What the step and the programs beside it take for batch ``tokens``: the batch, or, where the run
        holds DPO's frozen ``reference`` weights, :class:`StepInputs` of both (laid out for the step)."""
        if self.reference_shardings is None:
            return tokens
        if reference is None:
            raise ValueError("reference: this run's step takes DPO's frozen reference weights beside the batch")
        return StepInputs(tokens, jax.device_put(reference, self.reference_shardings))

    def abstract_inputs(self, tokens: jax.ShapeDtypeStruct, shapes: Params) -> Any:
        """:meth:`inputs` as abstract arrays, the reference's shaped like ``shapes`` (compiling without data)."""
        if self.reference_shardings is None:
            return tokens
        return StepInputs(tokens, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                               shapes, self.reference_shardings))

    def train(self, params: Params, opt_state: OptState, tokens: Any, stage: str | None = None):
        """One optimizer step in ``stage`` (default: the only one); ``params`` and ``opt_state`` are
        donated (do not reuse them); ``tokens``: the batch, or (a frozen DPO reference) :meth:`inputs`.
        Returns ``(params, opt_state, StepMetrics)``."""
        stage = self._stage(stage)
        compiled = self.compile(params, opt_state, tokens, stage)
        # Inputs that are laid out differently (e.g. placed by hand) are moved first; a compiled
        # program, unlike jit, does not reshard its arguments.
        params = jax.device_put(params, self.param_shardings)
        opt_state = jax.device_put(opt_state, self.opt_shardings)
        tokens = jax.device_put(tokens, self.input_sharding)
        with jax.set_mesh(self.mesh):
            return compiled(params, opt_state, tokens)

    def compile(self, params: Params, opt_state: OptState, tokens: jax.Array, stage: str | None = None):
        """The compiled train step of ``stage`` for arguments shaped like these (nothing runs)."""
        stage = self._stage(stage)
        if stage not in self._compiled:
            self._compiled[stage] = self.lower(params, opt_state, tokens, stage).compile()
        return self._compiled[stage]

    def data_bytes(self, stage: str | None = None) -> float | None:
        """Bytes one device sends over ``data`` per step in ``stage``, counted from the compiled
        program's collectives (ring algorithms); ``None`` until that stage has been compiled."""
        stage = self._stage(stage)
        if stage not in self._data_bytes and stage in self._compiled:
            colls = collectives(self._compiled[stage], self.mesh)
            self._data_bytes[stage] = sum(c.total_wire_bytes for c in colls if DATA in c.axes)
        return self._data_bytes.get(stage)

    def memory(self, stage: str | None = None) -> MemoryFigures | None:
        """The per-device buffers of ``stage``'s compiled step as XLA reports them (arguments, outputs,
        temporaries, aliased); ``None`` until that stage has been compiled, or where the backend does not
        report them."""
        stage = self._stage(stage)
        return memory_figures(self._compiled[stage]) if stage in self._compiled else None

    def eval(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Mean loss of ``tokens`` (no update); with a pipeline, a forward-only pipeline program."""
        with jax.set_mesh(self.mesh):
            return self._eval_jit(params, tokens)

    def layer_reports(self, params: Params, tokens: jax.Array) -> tuple[Any, ...]:
        """What the layers report (:func:`meshtron.models.contract.layer_reports`; a mixture of
        experts: its routing) for this step's batch, from a forward pass with the step's own
        microbatches and data shards: each field stacked over the layers in model order and summed
        over the :attr:`report_groups` routing groups. ``()`` when no layer reports anything."""
        params = jax.device_put(params, self.param_shardings)
        tokens = jax.device_put(tokens, self.input_sharding)
        with jax.set_mesh(self.mesh):
            if self._reports_compiled is None:  # compiled only for a model whose layers report something
                lowered = self.lower_reports(params, tokens)
                self._reports_compiled = lowered.compile() if jax.tree.leaves(lowered.out_info) else False
            if self._reports_compiled is False:
                return ()
            return jax.device_get(self._reports_compiled(params, tokens))

    def objective_metrics(self, params: Params, tokens: jax.Array) -> dict[str, float]:
        """What the objective reports besides the loss (DPO's rewards and log-probabilities) for this step's
        batch, from a forward pass with the parameters given, averaged as the step averages its loss;
        ``{}`` for the next-token loss."""
        if self._metrics_jit is None:
            return {}
        params = jax.device_put(params, self.param_shardings)
        tokens = jax.device_put(tokens, self.input_sharding)
        with jax.set_mesh(self.mesh):
            return {k: float(v) for k, v in jax.device_get(self._metrics_jit(params, tokens)).items()}

    def row_logps(self, params: Params, tokens: jax.Array) -> np.ndarray:
        """Each row's summed log-probability of its counted targets under ``params`` (a forward pass): what a
        precomputed DPO reference holds (:mod:`meshtron.train.reference_pass`)."""
        params = jax.device_put(params, self.param_shardings)
        tokens = jax.device_put(tokens, self.batch_sharding)
        with jax.set_mesh(self.mesh):
            return np.asarray(jax.device_get(self._row_logps_jit(params, tokens)))

    def lower_row_logps(self, params: Params, tokens: jax.Array) -> jax.stages.Lowered:
        """The lowered program of :meth:`row_logps`, for compiled-program analysis."""
        with jax.set_mesh(self.mesh):
            return self._row_logps_jit.lower(params, tokens)

    def lower_reports(self, params: Params, tokens: jax.Array) -> jax.stages.Lowered:
        """The lowered program of :meth:`layer_reports`, for compiled-program analysis."""
        with jax.set_mesh(self.mesh):
            return self._reports_jit.lower(params, tokens)

    def lower_eval(self, params: Params, tokens: jax.Array) -> jax.stages.Lowered:
        """The lowered evaluation step, for compiled-program analysis."""
        with jax.set_mesh(self.mesh):
            return self._eval_jit.lower(params, tokens)

    def gradients(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, Params]:
        """Mean loss and the gradient averaged over ``data`` (what plain data parallelism reduces)."""
        with jax.set_mesh(self.mesh):
            return self._gradients_jit(params, tokens)

    def lower(self, params: Params, opt_state: OptState, tokens: jax.Array, stage: str | None = None) -> jax.stages.Lowered:
        """The lowered train step, for compiled-program analysis (nothing is executed)."""
        with jax.set_mesh(self.mesh):
            return self._train_jit.lower(params, opt_state, tokens, self._stage(stage))

    def _stage(self, stage: str | None) -> str:
        if stage is None:
            if len(self.stages) != 1:
                raise ValueError(f"stage: this optimizer has stages {self.stages}; say which one")
            return self.stages[0]
        if stage not in self.stages:
            raise ValueError(f"stage: {stage!r} is not one of this optimizer's stages {self.stages}")
        return stage
