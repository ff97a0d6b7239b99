"""The jitted (pjit-style) train and eval steps.

Layout of one step:

* ``jax.jit`` with explicit ``in_shardings``/``out_shardings`` and donated parameters and
  optimizer state (updated in place);
* inside, a ``jax.shard_map`` that is manual over ``data`` only: each data shard sees its slice
  of the batch, while ``tensor`` (and ``pipe``) stay with the compiler, which splits every layer
  Megatron-style from the parameter annotations;
* parameters are cast to *varying* over ``data`` before differentiation, so autodiff returns each
  shard's local gradient instead of inserting its own reduction;
* gradients are accumulated over ``microbatches`` with a ``lax.scan``, then handed to the
  ``reduction`` transform (by default :func:`meshtron.optim.data_parallel_mean`) exactly once per
  step, then to the optimizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.models.gpt import lm_loss
from meshtron.optim.reduce import mean_over
from meshtron.pipeline.schedules import Program
from meshtron.train.pipelined import pipelined_gradients, to_canonical
from meshtron.train.state import ModelDef, Params

DATA = "data"


class StepMetrics(NamedTuple):
    loss: jax.Array
    grad_norm: jax.Array


class OptState(NamedTuple):
    """State of the reduction transform and of the optimizer proper."""

    reduction: Any
    optimizer: Any


def local_gradients(model_def: ModelDef, params: Params, tokens: jax.Array, microbatches: int):
    """Mean loss and gradient of this shard's ``tokens`` [rows, seq+1], accumulated over microbatches.

    ``params`` must already be varying over ``data`` so the gradients stay local.
    """

    def loss_of(p: Params, batch: jax.Array) -> jax.Array:
        return lm_loss(model_def.bind(p), batch)

    grad_fn = jax.value_and_grad(loss_of)
    if microbatches == 1:
        return grad_fn(params, tokens)

    rows = tokens.shape[0] // microbatches
    micro = tokens.reshape(microbatches, rows, tokens.shape[1])

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
) -> TrainSteps:
    """Compile-ready train/eval steps for ``model_def`` on ``mesh``.

    With a pipeline ``program`` (mesh ``pipe`` > 1) the gradients come from the pipeline runtime
    executing that schedule over the microbatches; block parameters are then in stage order
    (:mod:`meshtron.train.pipelined`).
    """
    param_shardings = model_def.shardings(mesh)
    # With one data shard there is nothing to reduce: no collective is emitted (see mean_over), so
    # values cannot be re-typed from "varying" to "replicated" over ``data``; the varying-axes check
    # is then switched off, which is exact because every value lives on that single shard.
    check_vma = mesh.shape[DATA] > 1

    def local(params: Params) -> Params:
        return jax.lax.pcast(params, DATA, to="varying") if check_vma else params

    def data_shard_map(fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=check_vma
        )

    batch_sharding = NamedSharding(mesh, P(DATA, None))
    if program is not None:
        run_schedule = pipelined_gradients(model_def, program, check_vma)

        def shard_gradients(params: Params, tokens: jax.Array):
            rows = tokens.shape[0] // microbatches
            return run_schedule(params, tokens.reshape(microbatches, rows, tokens.shape[1]))
    else:

        def shard_gradients(params: Params, tokens: jax.Array):
            return local_gradients(model_def, params, tokens, microbatches)

    def per_shard_train(params: Params, opt_state: OptState, tokens: jax.Array):
        loss, grads = shard_gradients(local(params), tokens)
        grads, reduction_state = reduction.update(grads, opt_state.reduction, params)
        grad_norm = optax.tree.norm(grads)
        updates, optimizer_state = optimizer.update(grads, opt_state.optimizer, params)
        params = optax.apply_updates(params, updates)
        metrics = StepMetrics(mean_over(loss, DATA), grad_norm)
        return params, OptState(reduction_state, optimizer_state), metrics

    def per_shard_gradients(params: Params, tokens: jax.Array):
        loss, grads = shard_gradients(local(params), tokens)
        grads, _ = reduction.update(grads, reduction.init(params), params)
        return mean_over(loss, DATA), grads

    def per_shard_eval(params: Params, tokens: jax.Array) -> jax.Array:
        # Evaluation runs the plain forward pass (the compiler gathers the pipe-sharded layers),
        # so block layers go back to canonical order first.
        if program is not None:
            sched = program.schedule
            params = to_canonical(params, model_def.dims.layers, sched.stages, sched.chunks)
        return mean_over(lm_loss(model_def.bind(params), tokens), DATA)

    train = data_shard_map(per_shard_train, (P(), P(), P(DATA)), (P(), P(), P()))
    gradients = data_shard_map(per_shard_gradients, (P(), P(DATA)), (P(), P()))
    evaluate = data_shard_map(per_shard_eval, (P(), P(DATA)), P())

    def init_state(p: Params) -> OptState:
        return OptState(reduction.init(p), optimizer.init(p))

    # Optimizer state is laid out like the parameters it mirrors (moments are tensor-sharded too);
    # anything else in it (step counts) is replicated.
    opt_shardings = optax.tree_map_params(
        init_state,
        lambda _, sharding: sharding,
        jax.eval_shape(init_state, model_def.shapes()),
        param_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    return TrainSteps(
        mesh, param_shardings, opt_shardings, batch_sharding,
        train=train, evaluate=evaluate, gradients=gradients, init_state=init_state,
    )


class TrainSteps:
    """The jitted entry points of one configuration (pjit-style: explicit in/out shardings)."""

    def __init__(self, mesh: Mesh, param_shardings, opt_shardings, batch_sharding, *, train, evaluate, gradients,
                 init_state):
        self.mesh = mesh
        self.param_shardings = param_shardings
        self.opt_shardings = opt_shardings
        self.batch_sharding = batch_sharding
        replicated = NamedSharding(mesh, P())
        self._init_jit = jax.jit(init_state, in_shardings=(param_shardings,), out_shardings=opt_shardings)
        self._train_jit = jax.jit(
            train,
            in_shardings=(param_shardings, opt_shardings, batch_sharding),
            out_shardings=(param_shardings, opt_shardings, StepMetrics(replicated, replicated)),
            donate_argnums=(0, 1),
        )
        self._eval_jit = jax.jit(evaluate, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated)
        self._gradients_jit = jax.jit(
            gradients, in_shardings=(param_shardings, batch_sharding), out_shardings=(replicated, param_shardings)
        )

    def init_opt_state(self, params: Params) -> OptState:
        """Fresh optimizer state, created sharded."""
        with jax.set_mesh(self.mesh):
            return self._init_jit(params)

    def train(self, params: Params, opt_state: OptState, tokens: jax.Array):
        """One optimizer step; ``params`` and ``opt_state`` are donated (do not reuse them)."""
        with jax.set_mesh(self.mesh):
            return self._train_jit(params, opt_state, tokens)

    def eval(self, params: Params, tokens: jax.Array) -> jax.Array:
        with jax.set_mesh(self.mesh):
            return self._eval_jit(params, tokens)

    def gradients(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, Params]:
        """Mean loss and the data-parallel-reduced gradient the optimizer would receive."""
        with jax.set_mesh(self.mesh):
            return self._gradients_jit(params, tokens)

    def lower(self, params: Params, opt_state: OptState, tokens: jax.Array) -> jax.stages.Lowered:
        """The lowered train step, for compiled-program analysis (nothing is executed)."""
        with jax.set_mesh(self.mesh):
            return self._train_jit.lower(params, opt_state, tokens)
