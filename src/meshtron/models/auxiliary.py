"""Auxiliary losses a block adds to the training objective without returning them.

A mixture-of-experts layer has losses of its own (load balance, router z-loss) that belong in the
objective but are made deep inside a block, which returns only its output. Threading them out would
change what a block returns, and with it the layer scan, recomputation and every pipeline schedule.
Instead a block attaches each one to an activation it returns (:func:`attach_auxiliary_loss`): the
forward value is unchanged, and the backward pass seeds the loss's gradient as if ``weight · loss``
had been added to the objective. This is Megatron-Core's ``MoEAuxLossAutoScaler``.

The seed must follow how the objective is averaged. The unpipelined step differentiates each
microbatch's mean loss with a seed of 1 and averages the gradients afterwards, so the auxiliary seed
is ``weight``; a pipeline seeds every microbatch's loss with ``1/m`` and sums, so it traces its blocks
inside :func:`auxiliary_loss_scale` ``(1/m)``. Either way the gradient is that of
``mean over microbatches (loss + Σ weight · auxiliary loss)``.

A block carries a statistic out the same way (:func:`carry_out`): the gradient of a probe parameter,
which the step reads (:mod:`meshtron.models.probed_state`).

A block reports what it measured on the way (a mixture of experts' routing: expert load, dropped
assignments, the unweighted losses) with :func:`report`; :func:`meshtron.models.blocks.run_blocks`
with ``collect=True`` gathers each layer's reports and returns them stacked over the layers, so the
measurement needs no new output of the block either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from meshtron.trace_context import current, using


@contextlib.contextmanager
def auxiliary_loss_scale(scale: float) -> Iterator[None]:
    """Blocks traced inside seed their auxiliary losses' gradients with ``weight · scale``: the
    gradient seed the caller gives the main loss of the same microbatch."""
    with using(aux_scale=float(scale)):
        yield


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attached(x: jax.Array, loss: jax.Array, seed: float) -> jax.Array:
    del loss, seed
    return x


def _attached_forward(x, loss, seed):
    del seed
    return x, jnp.zeros_like(loss)


def _attached_backward(seed, zero_loss, grad):
    return grad, zero_loss + jnp.asarray(seed, zero_loss.dtype)


_attached.defvjp(_attached_forward, _attached_backward)


def attach_auxiliary_loss(x: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    """``x``, unchanged, whose backward pass also differentiates ``weight · loss`` (a scalar).

    Attach it to a value that reaches the objective (a block's output): a loss attached to a value
    nothing differentiates gets no gradient. ``weight`` 0 attaches nothing.
    """
    if not weight:
        return x
    return _attached(x, loss.astype(jnp.float32), weight * current().aux_scale)


@jax.custom_vjp
def _carrying(x: jax.Array, probe: jax.Array, value: jax.Array) -> jax.Array:
    del probe, value
    return x


def _carrying_forward(x, probe, value):
    del probe
    return x, value


def _carrying_backward(value, grad):
    return grad, value, jnp.zeros_like(value)


_carrying.defvjp(_carrying_forward, _carrying_backward)


def carry_out(x: jax.Array, probe: jax.Array, value: jax.Array) -> jax.Array:
    """``x``, unchanged, whose backward pass gives ``probe`` (a parameter of zeros shaped like ``value``)
    the gradient ``value``: a statistic of the forward carried out of the block by the gradients every
    schedule already returns (:mod:`meshtron.models.probed_state`).

    It is seeded like an auxiliary loss (``value · scale`` inside :func:`auxiliary_loss_scale`), so that
    whichever way the step combines its microbatches' gradients, the probe's is the mean over them of
    ``value``. Attach it, as a loss, to a value that reaches the objective.
    """
    return _carrying(x, probe, (value * current().aux_scale).astype(probe.dtype))


@contextlib.contextmanager
def collecting_reports() -> Iterator[list[Any]]:
    """What blocks traced inside (not under a ``scan`` of their own) :func:`report`, in call order."""
    found: list[Any] = []
    with using(reports=found):
        yield found


def report(value: Any) -> None:
    """Hand ``value`` (a pytree of arrays) to the innermost :func:`collecting_reports`, if any."""
    found = current().reports
    if found is not None:
        found.append(value)
