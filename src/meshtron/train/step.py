"""The jitted (pjit-style) train and eval steps.

Layout of one step:

* ``jax.jit`` with explicit ``in_shardings``/``out_shardings`` and donated parameters and
  optimizer state (updated in place);
* inside, a ``jax.shard_map`` that is manual over ``data`` only: each data shard sees its slice
  of the batch, while ``tensor`` (and ``pipe``) stay with the compiler, which splits every layer
  Megatron-style from the parameter annotations;
* parameters are cast to *varying* over ``data`` before differentiation, so autodiff returns each
  shard's local gradient instead of inserting its own reduction; parameters the rules split over
  ``data`` themselves (a mixture of experts' experts: expert parallelism) are local already, their
  gradients complete where they are held, and are only divided by the number of data shards
  (:meth:`meshtron.optim.zero.ZeroPlan.mean_native`);
* gradients are accumulated over ``microbatches`` with a ``lax.scan``, then handed to the
  ``reduction`` transform (by default :func:`meshtron.optim.data_parallel_mean`) exactly once per
  step, then to the optimizer; an optimizer that reduces itself (1-bit LAMB) gets ``optax.identity()``
  as the reduction and the local gradients;
* with a sequence split over ``context`` (context parallelism) the ``shard_map`` is manual over
  ``data`` and ``context``: the batch's tokens are laid out as the load-balanced chunks each context
  rank holds (:func:`context_layout`), every rank computes the loss and gradient of its own tokens,
  and "data" below means the group data x context (:func:`meshtron.sharding.gradient_axes`): the
  reduction, 1-bit LAMB and ZeRO all act over both axes together, as Megatron-LM's do;
* with LoRA (:mod:`meshtron.models.lora`) only the adapters train: the frozen parameters enter
  differentiation under ``stop_gradient`` (no gradient is formed for them), their zero gradients are
  dropped before the reduction, and the reduction and the optimizer see the adapters alone, so
  nothing of the base crosses ``data`` and it has no optimizer state -- except, at ``train.zero=3``,
  the all-gathers that bring each layer's frozen matrices to the ranks as it runs;
* windows of packed documents ``[b, seq + 1, 3]`` become per-token features before the split
  (:func:`context_layout`, :mod:`meshtron.models.documents`);
* optimizers with *stages* that communicate differently (1-bit LAMB's warmup and compression) get
  one compiled program per stage: the stage is a static argument whose extra ``update`` arguments
  come from ``stages``, and the host picks the stage each step;
* metrics (loss, gradient norm) come back per data shard and are averaged on the host, so they
  add no collective to the step: what crosses ``data`` is the reduction and nothing else;
* with ``train.zero`` (:mod:`meshtron.optim.zero`) the reduction becomes a reduce-scatter, the
  optimizer updates each rank's share of every parameter, and the shares are all-gathered -- or,
  at zero=3, stay split, each layer's parameters gathered as the layer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.config import RING_IN_PIPELINE
from meshtron.errors import ConfigError
from meshtron.hlo.collectives import collectives
from meshtron.models.context_attention import balanced_order
from meshtron.models.contract import Context, layer_parameters, layer_reports, next_token_pairs
from meshtron.models.documents import document_features, is_document_windows
from meshtron.models.lora import adapter_dropout
from meshtron.optim.layout import manual_part, opt_state_specs
from meshtron.optim.reduce import mean_over
from meshtron.optim.zero import ZeroPlan
from meshtron.pipeline.layout import StageLayout
from meshtron.pipeline.schedules import Program
from meshtron.sharding import axis_names, gradient_axes, logical_to_spec
from meshtron.train.pipelined import canonical_positions, pipelined_gradients, pipelined_loss, stage_order
from meshtron.train.state import ModelDef, Params

DATA = "data"
CONTEXT = "context"
LAYER_KEYS = frozenset({"blocks"})  # the contract's stacked layers, gathered one layer at a time at zero=3
SINGLE_STAGE = {"train": {}}


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


class OptState(NamedTuple):
    """State of the reduction transform and of the optimizer proper."""

    reduction: Any
    optimizer: Any


def local_gradients(model_def: ModelDef, params: Params, tokens: jax.Array, microbatches: int):
    """Mean loss and gradient of this shard's ``tokens`` [rows, seq+1], accumulated over microbatches.

    ``params`` must already be varying over ``data`` so the gradients stay local.
    """

    grad_fn = jax.value_and_grad(model_def.loss)
    if microbatches == 1:
        return grad_fn(params, tokens)

    rows = tokens.shape[0] // microbatches
    micro = tokens.reshape(microbatches, rows, *tokens.shape[1:])

    def accumulate(carry, batch):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    # The first microbatch seeds the carry, so it has exactly the (varying-over-data) type of the rest.
    (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, grad_fn(params, micro[0]), micro[1:])
    scale = 1.0 / microbatches
    return loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum)


def build_steps(
    model_def: ModelDef,
    mesh: Mesh,
    reduction: optax.GradientTransformation,
    optimizer: optax.GradientTransformation,
    *,
    microbatches: int = 1,
    program: Program | None = None,
    layout: StageLayout | None = None,
    stages: Mapping[str, Mapping[str, Any]] = SINGLE_STAGE,
    skip_nonfinite: bool = False,
    zero: ZeroPlan | None = None,
    gather_once: bool = False,
    seed: int = 0,
) -> TrainSteps:
    """Compile-ready train/eval steps for ``model_def`` on ``mesh``.

    With ``skip_nonfinite`` a step whose update holds a NaN or Inf leaves parameters and optimizer
    state as they were (``StepMetrics.applied`` is then false). The test is on the update, which
    is the same on every data shard (it comes from reduced gradients, or 1-bit LAMB's all-reduced
    momentum), so all replicas decide alike with no extra collective over ``data``.

    With a pipeline ``program`` (mesh ``pipe`` > 1) the gradients come from the pipeline runtime
    executing that schedule over the microbatches; block parameters are then in stage order
    (:mod:`meshtron.train.pipelined`), padded as an uneven ``layout`` says. ``stages`` maps each stage name to the extra keyword
    arguments of ``optimizer.update`` in that stage (one stage with none by default).

    With an active ``zero`` plan (:mod:`meshtron.optim.zero`) the optimizer state is split over
    ``data``: the local gradients are reduce-scattered instead of all-reduced (``reduction`` is not
    used), each rank updates its share, and the updated shares are all-gathered -- or, at level 3,
    parameters stay split: each layer's are all-gathered just before it runs (forward, and again for
    the backward) and its gradient reduce-scattered as it is made, so a device holds one layer's whole
    parameters and gradient at a time (fully sharded data parallelism); with ``gather_once`` they
    are all-gathered once when the step starts instead (the traffic of level 1, the parameter
    memory of level 0 while the step runs). ``optimizer`` must have been built with the same plan
    (its norms sum over the shares).
    """
    shapes = model_def.shapes()
    model_specs = model_def.shardings(mesh)
    context = mesh.shape.get(CONTEXT, 1)
    # A ring attention's collective-permutes are entered by every device of the mesh at once: pipeline
    # stages then run every tick's work in lockstep instead of skipping idle ticks.
    lockstep = program is not None and context > 1 and model_def.context_attention == "ring"
    if context > 1 and logical_to_spec(("seq",), model_def.rules)[:1] != P(CONTEXT)[:1]:
        raise ConfigError(f"model.rules.seq: mesh.context={context} splits every sequence over {CONTEXT!r}, but the "
                          f"rules place the logical axis seq on {logical_to_spec(('seq',), model_def.rules)[0]!r}; "
                          "map seq to context (the default rule) or use mesh.context=1")
    if lockstep and layout is not None and not layout.is_even:
        raise ConfigError(f"model.context_attention: {RING_IN_PIPELINE}")
    group = gradient_axes(mesh.shape)  # what gradients are averaged over: data (x context)
    replicas = mesh.shape[DATA] * context
    # Manual over data and context whatever their sizes: every mesh axis before `pipe`, so that the
    # pipeline's nested manual axes come in mesh order (jax 0.12's XLA aborts on a size-1 auto axis
    # between manual ones: "Manual axes must be sorted by mesh axis index").
    manual = {DATA, CONTEXT} & set(mesh.axis_names)
    zero = zero or ZeroPlan.for_mesh(0, shapes, model_specs, model_def.stacked(), mesh)
    # With LoRA only the adapters train: the frozen parameters' (zero) gradients are dropped before the
    # reduction, and the reduction and the optimizer see the adapters alone (no state for the rest).
    trainable = model_def.trainable()
    if trainable is not None and zero.has_native:
        raise ConfigError("train.lora: trains adapters on a dense model; this one splits experts over data "
                          "(model.moe.experts > 0)")

    kept = model_def.trainable_part
    dropout = model_def.lora is not None and model_def.lora.dropout > 0  # LoRA's, in training only

    def with_frozen(part: Any, whole: Any) -> Any:
        """``part`` (from :func:`kept`) completed with ``whole``'s frozen leaves."""
        if trainable is None:
            return part
        return jax.tree.map(lambda keep, x, y: x if keep else y, trainable, part, whole)

    param_shardings = _named(mesh, zero.specs(model_specs)) if zero.shards_params else model_specs
    native = zero.native_flags()  # leaves the model splits over data itself (experts): local, never pcast
    # With one data shard there is nothing to reduce: no collective is emitted (see mean_over), so
    # values cannot be re-typed from "varying" to "replicated" over ``data``; the varying-axes check
    # is then switched off, which is exact because every value lives on that single shard.
    check_vma = replicas > 1

    def local(params: Params, split: Any = native) -> Params:
        """``params`` as differentiation sees them: frozen ones (LoRA's base) under ``stop_gradient``, so no
        gradient is formed for them; over several data ranks, cast to varying (local gradients)."""
        if trainable is not None:
            params = jax.tree.map(lambda keep, x: x if keep else jax.lax.stop_gradient(x), trainable, params)
        if not check_vma:
            return params
        return jax.tree.map(lambda x, own: x if own else jax.lax.pcast(x, group, to="varying"), params, split)

    def data_shard_map(fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual, check_vma=check_vma
        )

    batch_sharding = NamedSharding(mesh, P(DATA, None))  # plain windows [b, s+1] or packed documents' [b, s+1, 3]
    # A shard's tokens (context_layout's), and one value per rank of the group.
    shard_batch = P(DATA if DATA in axis_names(group) else None, CONTEXT) if context > 1 else P(DATA)
    per_replica = P(axis_names(group)) if context > 1 else P(DATA)

    def laid_out(tokens: jax.Array) -> jax.Array:
        return context_layout(tokens, context)

    def as_microbatches(tokens: jax.Array) -> jax.Array:
        return tokens.reshape(microbatches, tokens.shape[0] // microbatches, *tokens.shape[1:])

    if program is not None:
        run_schedule = pipelined_gradients(model_def, program, check_vma, layout, lockstep)
        run_forward = pipelined_loss(model_def, program, check_vma, layout, lockstep=lockstep)
        run_reporting = pipelined_loss(model_def, program, check_vma, layout, reports=True, lockstep=lockstep)
        # The reports come stacked in stage order, as the block parameters are: back to model order.
        sched = program.schedule
        model_order = jnp.asarray(canonical_positions(stage_order(model_def.layers, sched.stages, sched.chunks,
                                                                  layout)))

        def shard_reports(params: Params, tokens: jax.Array):
            found = run_reporting(params, as_microbatches(tokens))[1]
            return jax.tree.map(lambda r: jnp.take(r, model_order, axis=0), found)

        def shard_gradients(params: Params, tokens: jax.Array):
            return run_schedule(params, as_microbatches(tokens))

        def shard_loss(params: Params, tokens: jax.Array) -> jax.Array:
            return run_forward(params, as_microbatches(tokens))
    else:

        def shard_gradients(params: Params, tokens: jax.Array):
            return local_gradients(model_def, params, tokens, microbatches)

        def shard_loss(params: Params, tokens: jax.Array) -> jax.Array:
            return model_def.loss(params, tokens)

        def shard_reports(params: Params, tokens: jax.Array):
            found = jax.lax.map(lambda mb: layer_reports(model_def.bind(params), next_token_pairs(mb)[0],
                                                         Context.for_tokens(mb)), as_microbatches(tokens))
            return jax.tree.map(lambda r: jnp.sum(r, axis=0), found)

    def init_state(p: Params) -> OptState:
        return OptState(reduction.init(kept(p)), optimizer.init(kept(p)))

    # Optimizer state is laid out like the parameters it mirrors (moments are tensor-sharded too,
    # and split over data by an active zero plan); per-device parts (1-bit LAMB's error buffers)
    # are split over the mesh; the rest is replicated.
    with jax.set_mesh(mesh):
        state_specs = opt_state_specs(jax.eval_shape(init_state, shapes), kept(shapes), kept(zero.specs(model_specs)),
                                      mesh, group)
    opt_shardings = _named(mesh, state_specs)
    state_data_specs = manual_part(state_specs, manual)
    param_data_specs = manual_part(_specs(zero.specs(model_specs) if zero.shards_params else model_specs), manual)

    def reduced(params: Params, opt_state: OptState, tokens: jax.Array):
        """Loss, reduced gradients, the parameters the optimizer updates, and the gradient's norm."""
        if not zero.active:
            loss, grads = shard_gradients(local(params), tokens)
            if not zero.has_native:
                grads, reduction_state = reduction.update(kept(grads), opt_state.reduction, kept(params))
                return loss, grads, kept(params), reduction_state, optax.tree.norm(grads)
            # The reduction averages what every data rank holds whole; the native leaves are complete
            # where they are held and only divided by d.
            shared, reduction_state = reduction.update(_without(grads, native), opt_state.reduction, params)
            grads = zero.mean_native(_merged(shared, grads, native))
            return loss, grads, params, reduction_state, _norm(zero, grads)
        # (a frozen leaf is None in kept(...): nothing of it is reduced, split or gathered)
        if not zero.shards_params:
            loss, grads = shard_gradients(local(params), tokens)
            grads = zero.scatter_mean(kept(grads))
        elif gather_once:
            loss, grads = shard_gradients(local(zero.gather(params)), tokens)
            grads = zero.scatter_mean(kept(grads))
        else:  # each layer gathered as it runs; its gradient comes back reduce-scattered
            whole = zero.gather(params, keep=LAYER_KEYS)
            whole = local(whole, jax.tree.map(lambda split, own: split or own, zero.arrives_split(LAYER_KEYS), native))
            with layer_parameters(zero.layer_view()):
                loss, grads = shard_gradients(whole, tokens)
            grads = zero.scatter_mean(kept(grads), summed=LAYER_KEYS)
        own = kept(params) if zero.shards_params else zero.shard(kept(params))
        return loss, grads, own, opt_state.reduction, _norm(zero, grads)

    def per_shard_train(params: Params, opt_state: OptState, tokens: jax.Array, stage: str):
        with adapter_dropout(model_def.lora.dropout, seed) if dropout else contextlib.nullcontext():
            loss, grads, own, reduction_state, grad_norm = reduced(params, opt_state, tokens)
        updates, optimizer_state = optimizer.update(grads, opt_state.optimizer, own, **stages[stage])
        new_own = optax.apply_updates(own, updates)
        new_params = with_frozen(zero.gather(new_own) if zero.active and not zero.shards_params else new_own, params)
        new_state = OptState(reduction_state, optimizer_state)
        applied = jnp.bool_(True)
        if skip_nonfinite:
            applied = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
            if zero.active:  # each rank saw its own share of the update: all must agree
                applied = jax.lax.pmin(applied.astype(jnp.int32), group) > 0
            new_params, new_state = jax.tree.map(
                lambda new, old: jnp.where(applied, new, old), (new_params, new_state), (params, opt_state)
            )
        return new_params, new_state, StepMetrics(loss[None], grad_norm[None], applied[None])

    def train(params: Params, opt_state: OptState, tokens: jax.Array, stage: str):
        return data_shard_map(
            partial(per_shard_train, stage=stage),
            (param_data_specs, state_data_specs, shard_batch),
            (param_data_specs, state_data_specs, StepMetrics(per_replica, per_replica, per_replica)),
        )(params, opt_state, laid_out(tokens))

    def per_shard_gradients(params: Params, tokens: jax.Array):
        loss, grads = shard_gradients(local(params), tokens)
        shared = mean_over(_without(grads, native), group)
        return mean_over(loss, group), zero.mean_native(_merged(shared, grads, native))

    def per_shard_eval(params: Params, tokens: jax.Array) -> jax.Array:
        return mean_over(shard_loss(params, tokens), group)

    # Without zero=3 every data rank holds every parameter whole, except the native leaves (experts).
    model_data_specs = manual_part(_specs(model_specs), manual)

    def evaluate(params: Params, tokens: jax.Array) -> jax.Array:
        # With a pipeline, evaluation is a forward-only pipeline program over the same stages
        # (layers stay where training keeps them: nothing is gathered over ``pipe``).
        return data_shard_map(per_shard_eval, (model_data_specs, shard_batch), P())(params, laid_out(tokens))

    def per_shard_reports(params: Params, tokens: jax.Array):
        found = shard_reports(params, tokens)
        return jax.lax.psum(found, group) if check_vma else found

    def reports(params: Params, tokens: jax.Array):
        # A forward pass (the forward-only pipeline with one), each microbatch of each data shard
        # routed on its own as in training, the reports summed over all of them.
        return data_shard_map(per_shard_reports, (model_data_specs, shard_batch), P())(params, laid_out(tokens))

    def gradients(params: Params, tokens: jax.Array):
        return data_shard_map(per_shard_gradients, (model_data_specs, shard_batch), (P(), model_data_specs))(
            params, laid_out(tokens))

    scoped = model_def.traced
    return TrainSteps(
        mesh, param_shardings, opt_shardings, batch_sharding, tuple(stages),
        train=scoped(train), evaluate=scoped(evaluate), gradients=scoped(gradients), init_state=init_state, zero=zero,
        reports=scoped(reports), report_groups=microbatches * replicas, metrics_spec=per_replica,
    )


def context_layout(tokens: jax.Array, ranks: int) -> jax.Array:
    """A batch as the train step's shards see it.

    Plain windows ``tokens`` [b, seq + 1] stay as they are on one context rank. When sequences are split
    over ``ranks`` context-parallel ranks they become ``[b, seq, 2]`` (every input token stacked with
    the one it predicts, :func:`meshtron.models.contract.next_token_pairs`), the sequence in the
    load-balanced order (:func:`meshtron.models.context_attention.balanced_order`), so that context
    rank ``r``'s equal share holds chunks ``r`` and ``2·ranks - 1 - r``. Windows of packed documents
    ``[b, seq + 1, 3]`` become their features ``[b, seq, 5]``
    (:func:`meshtron.models.documents.document_features`), in that order too when split."""
    if is_document_windows(tokens):
        pairs = document_features(tokens)
    elif ranks == 1:
        return tokens
    else:
        pairs = jnp.stack([tokens[:, :-1], tokens[:, 1:]], axis=-1)
    if ranks == 1:
        return pairs
    return jnp.take(pairs, jnp.asarray(balanced_order(pairs.shape[1], ranks)), axis=1)


def _specs(tree: Any) -> Any:
    """``PartitionSpec`` s of a tree of shardings or specs."""
    return jax.tree.map(lambda s: getattr(s, "spec", s), tree, is_leaf=lambda x: isinstance(x, P) or hasattr(x, "spec"))


def _without(tree: Any, drop: Any) -> Any:
    """``tree`` with ``None`` where ``drop`` is true."""
    return jax.tree.map(lambda x, d: None if d else x, tree, drop)


def _merged(kept: Any, tree: Any, drop: Any) -> Any:
    """``kept`` (from :func:`_without`) with ``tree``'s leaves where ``drop`` is true."""
    return jax.tree.map(lambda d, x, k: x if d else k, drop, tree, kept, is_leaf=lambda x: x is None)


def _norm(zero: ZeroPlan, grads: Any) -> jax.Array:
    """The whole gradient's norm when data ranks hold shares of it (``zero``'s split and native leaves)."""
    return jnp.sqrt(sum(jax.tree.leaves(zero.sum_squares(jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)))))


def _named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


class TrainSteps:
    """The jitted entry points of one configuration (pjit-style: explicit in/out shardings).

    The train step is compiled once per stage, on first use, and the compiled program is kept: it
    is what runs, and what :meth:`data_bytes` reads its communication from.
    """

    def __init__(self, mesh: Mesh, param_shardings, opt_shardings, batch_sharding, stages: tuple[str, ...], *,
                 train, evaluate, gradients, init_state, zero: ZeroPlan | None = None, reports=None,
                 report_groups: int = 1, metrics_spec: P | None = None):
        self.mesh = mesh
        self.report_groups = report_groups  # routing groups a step's reports sum over: microbatches × data (× context)
        self.zero = zero  # how parameters and optimizer state are split over data
        self.param_shardings = param_shardings
        self.opt_shardings = opt_shardings
        self.batch_sharding = batch_sharding
        self.stages = stages
        replicated = NamedSharding(mesh, P())
        per_shard = NamedSharding(mesh, P(DATA) if metrics_spec is None else metrics_spec)
        self.init_state_fn = init_state  # params -> fresh OptState (for abstract shapes: jax.eval_shape)
        self._init_jit = jax.jit(init_state, in_shardings=(param_shardings,), out_shardings=opt_shardings)
        self._train_jit = jax.jit(
            train,
            in_shardings=(param_shardings, opt_shardings, batch_sharding),
            out_shardings=(param_shardings, opt_shardings, StepMetrics(per_shard, per_shard, per_shard)),
            donate_argnums=(0, 1),
            static_argnums=3,
        )
        self._compiled: dict[str, jax.stages.Compiled] = {}
        self._data_bytes: dict[str, float] = {}
        self._eval_jit = jax.jit(evaluate, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated)
        self._gradients_jit = jax.jit(
            gradients, in_shardings=(param_shardings, batch_sharding), out_shardings=(replicated, param_shardings)
        )
        self._reports_jit = None if reports is None else jax.jit(
            reports, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated)
        self._reports_compiled: Any = None

    def init_opt_state(self, params: Params) -> OptState:
        """Fresh optimizer state, created sharded."""
        with jax.set_mesh(self.mesh):
            return self._init_jit(params)

    def train(self, params: Params, opt_state: OptState, tokens: jax.Array, stage: str | None = None):
        """One optimizer step in ``stage`` (default: the only one); ``params`` and ``opt_state`` are
        donated (do not reuse them). Returns ``(params, opt_state, StepMetrics)``."""
        stage = self._stage(stage)
        compiled = self.compile(params, opt_state, tokens, stage)
        # Inputs that are laid out differently (e.g. placed by hand) are moved first; a compiled
        # program, unlike jit, does not reshard its arguments.
        params = jax.device_put(params, self.param_shardings)
        opt_state = jax.device_put(opt_state, self.opt_shardings)
        tokens = jax.device_put(tokens, self.batch_sharding)
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
        tokens = jax.device_put(tokens, self.batch_sharding)
        with jax.set_mesh(self.mesh):
            if self._reports_compiled is None:  # compiled only for a model whose layers report something
                lowered = self.lower_reports(params, tokens)
                self._reports_compiled = lowered.compile() if jax.tree.leaves(lowered.out_info) else False
            if self._reports_compiled is False:
                return ()
            return jax.device_get(self._reports_compiled(params, tokens))

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
