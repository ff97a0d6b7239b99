"""One data rank's loss and gradients over its microbatches: the first part of the train step.

Two sources with one shape (:class:`ForwardBackward`), so the step composes either with any gradient
sync: the plain model, its microbatches accumulated with a ``lax.scan``, and the pipeline runtime executing
a schedule over them (:func:`meshtron.train.pipelined.pipelined_forward_backward`). Everything here runs
inside the step's data-parallel ``shard_map``; gradients stay local to the rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.models.contract import batch_reports
from meshtron.models.preference import sequence_logps
from meshtron.train.objective import LanguageModeling, Objective
from meshtron.train.state import ModelDef, Params

__all__ = ["ForwardBackward", "as_microbatches", "local_gradients", "objective_metrics", "plain_forward_backward",
           "row_logps"]


class ForwardBackward(NamedTuple):
    """``gradients(params, tokens) -> (mean loss, local gradients)``; ``loss(params, tokens)``: the
    forward pass alone (evaluation); ``reports(params, tokens)``: what the layers report (a mixture of
    experts' routing), stacked over the layers in model order, then a model's further loss
    (:class:`~meshtron.models.contract.ExtraLossReport`), summed over the microbatches.
    ``loss_groups``: how many microbatches' mean losses the backward seeds at full weight, each averaged
    afterwards (its output gradients are that many times the whole batch's). ``metrics(params, tokens)``:
    what the objective reports besides the loss, means over the microbatches (``None``: nothing).
    ``row_logps(params, tokens)``: each row's summed log-probability of its counted targets, from a forward
    over the microbatches (a precomputed DPO reference's pass, :mod:`meshtron.train.reference_pass`, on
    one pair a window pair). ``reference_logps(params, tokens)``: what a frozen copy inside the step gives
    DPO's reference, the same sums ``[rows]``, or for packed pairs (``objective.packed`` = ``K``) each
    document's, ``[rows, K]``."""

    gradients: Callable[[Params, jax.Array], tuple[jax.Array, Params]]
    loss: Callable[[Params, jax.Array], jax.Array]
    reports: Callable[[Params, jax.Array], Any]
    loss_groups: int = 1
    metrics: Callable[[Params, jax.Array], dict[str, jax.Array]] | None = None
    row_logps: Callable[[Params, jax.Array], jax.Array] | None = None
    reference_logps: Callable[[Params, jax.Array], jax.Array] | None = None


def as_microbatches(tokens: jax.Array, microbatches: int) -> jax.Array:
    return tokens.reshape(microbatches, tokens.shape[0] // microbatches, *tokens.shape[1:])


def local_gradients(model_def: ModelDef, params: Params, tokens: jax.Array, microbatches: int,
                    execution: Execution = DEFAULT_EXECUTION, objective: Objective | None = None):
    """Mean loss and gradient of this shard's ``tokens`` [rows, seq+1], accumulated over microbatches,
    blocks recomputed as ``execution.remat`` says; the loss is ``objective``'s (default: the next-token loss).

    ``params`` must already be varying over ``data`` so the gradients stay local.
    """
    objective = objective or LanguageModeling()
    grad_fn = jax.value_and_grad(functools.partial(objective.loss, model_def, execution=execution))
    if microbatches == 1:
        return grad_fn(params, tokens)
    micro = as_microbatches(tokens, microbatches)

    def accumulate(carry, batch):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, batch)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    # Every microbatch runs through the one loop body: a microbatch peeled off before the loop would be a
    # second copy of the backward's code, and XLA gives each copy its own buffers (under model.remat=offload
    # a second set of layer inputs in host memory). The carry starts at zeros of exactly the (varying-over-
    # data) type of a microbatch's loss and gradients; adding the first microbatch to them is exact, so the
    # sums are those of seeding the carry with it.
    zeros = jax.tree.map(_zeros, jax.eval_shape(grad_fn, params, micro[0]))
    (loss_sum, grad_sum), _ = jax.lax.scan(accumulate, zeros, micro)
    scale = 1.0 / microbatches
    return loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum)


def _zeros(like: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``like``'s shape and dtype, varying over the manual mesh axes it varies over (a scan's
    carry must keep its type)."""
    varying = () if like.manual_axis_type is None else tuple(sorted(like.manual_axis_type.varying))
    zeros = jnp.zeros(like.shape, like.dtype)
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


def objective_metrics(model_def: ModelDef, objective: Objective, microbatches: int,
                      execution: Execution = DEFAULT_EXECUTION):
    """``(params, tokens) -> metrics``: ``objective``'s, each microbatch's from a plain forward, averaged
    over them (``None`` for an objective that reports nothing besides its loss)."""
    if not objective.METRICS:
        return None

    def metrics(params: Params, tokens: jax.Array) -> dict[str, jax.Array]:
        found = jax.lax.map(lambda mb: objective.metrics(model_def, params, mb, execution),
                            as_microbatches(tokens, microbatches))
        return jax.tree.map(lambda v: jnp.mean(v, axis=0), found)

    return metrics


def row_logps(model_def: ModelDef, microbatches: int = 1,
              packed: int = 0) -> Callable[[Params, jax.Array], jax.Array]:
    """``(params, tokens) -> [rows]``: each row's summed counted-target log-probability, a plain forward
    of one microbatch at a time (what it holds at once is one microbatch's, as in the step's own forward);
    ``[rows, packed]``, each document's, for rows of up to ``packed`` documents."""
    def rows(params: Params, tokens: jax.Array) -> jax.Array:
        found = jax.lax.map(lambda mb: sequence_logps(model_def.bind(params), mb, packed=packed),
                            as_microbatches(tokens, microbatches))
        return found.reshape(-1, *found.shape[2:])

    return rows


def plain_forward_backward(model_def: ModelDef, microbatches: int, execution: Execution = DEFAULT_EXECUTION,
                           objective: Objective | None = None) -> ForwardBackward:
    """The whole model on every pipeline rank (``pipe`` = 1), microbatches accumulated in a scan; blocks
    recomputed as ``execution.remat`` says; the loss is ``objective``'s (default: the next-token loss)."""
    objective = objective or LanguageModeling()

    def reports(params: Params, tokens: jax.Array):
        found = jax.lax.map(lambda mb: batch_reports(model_def.bind(params), mb), as_microbatches(tokens, microbatches))
        return jax.tree.map(lambda r: jnp.sum(r, axis=0), found)

    return ForwardBackward(
        gradients=lambda params, tokens: local_gradients(model_def, params, tokens, microbatches, execution, objective),
        loss=functools.partial(objective.loss, model_def, execution=execution),
        reports=reports,
        loss_groups=microbatches,
        metrics=objective_metrics(model_def, objective, microbatches, execution),
        row_logps=row_logps(model_def, microbatches),
        reference_logps=row_logps(model_def, microbatches, objective.packed),
    )
