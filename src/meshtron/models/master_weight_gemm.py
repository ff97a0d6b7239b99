"""Projections whose weight gradient leaves the GEMM in float32: gradient-accumulation fusion.

A projection multiplies in the compute dtype (``model.dtype``, bf16) by its float32 master weight cast
down. Autodiff then transposes the cast: the weight-gradient GEMM ``dW = xᵀ·dy`` runs in bf16, rounds
its float32 sums to bf16, and only then is ``dW`` converted back to float32 and added to the
gradient. Over microbatches that is, per layer and microbatch, a bf16 ``dW`` written and read again
plus the float32 accumulator read and written by a separate element-wise pass. Megatron's
``--gradient-accumulation-fusion`` has the weight-gradient GEMM write float32 straight into the
parameter's ``main_grad``.

Here the projection and its cast are one :func:`jax.custom_vjp`: the forward is the same bf16 GEMM;
the backward computes the input gradient in bf16 as before and the weight gradient as a GEMM of bf16
operands with a float32 result (``preferred_element_type``), returned as the master weight's
cotangent without a round trip through bf16. The accumulation that follows (``g + dW`` in float32)
then adds a GEMM's float32 output, which XLA can fold into the GEMM's epilogue, and the gradient is
the one the float32 product gives (no bf16 rounding of ``dW``).

Projections opt in where they are built: :func:`keep_master_weight` as an ``nnx.Einsum``'s
``promote_dtype`` leaves the kernel in its parameter dtype under ``parallel.gradient_accumulation_fusion``
(the trace context's ``gradient_accumulation_fusion``), and the projection's ``einsum_op`` calls
:func:`master_weight_einsum`, which casts it itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax.nnx.nn import dtypes

from meshtron.models.cast_weights import prepared_entry, preparing
from meshtron.trace_context import current

__all__ = ["fusing", "joined_master_einsum", "keep_master_weight", "master_weight_einsum"]


def fusing() -> bool:
    """Whether projections traced now take their weight gradient in float32 from the GEMM (the run's
    ``parallel.gradient_accumulation_fusion``; never under FP8, whose GEMMs have their own backward)."""
    ctx = current()
    return ctx.gradient_accumulation_fusion and ctx.fp8 == "off"


def keep_master_weight(args: tuple[Any, ...], *, dtype: Any = None, inexact: bool = True) -> tuple[Any, ...]:
    """An ``nnx.Einsum``'s ``promote_dtype`` for ``(inputs, kernel, bias)``: flax's promotion, except that
    while :func:`fusing` the kernel keeps its parameter dtype, for :func:`master_weight_einsum` to cast."""
    inputs, kernel, bias = args
    if not fusing() or dtype is None or kernel is None:
        return dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)
    inputs, bias = dtypes.promote_dtype((inputs, bias), dtype=dtype, inexact=inexact)
    return inputs, kernel, bias


def master_weight_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w.astype(x.dtype))`` whose cotangent for ``w`` comes from a GEMM with a ``w.dtype``
    result: the bf16 product of the forward, a float32 weight gradient in the backward."""
    if w.dtype == x.dtype:
        return jnp.einsum(spec, x, w)
    entry = prepared_entry(w.astype(x.dtype)) if preparing() else None
    return _einsum(spec, x, w) if entry is None else _einsum_prepared(spec, x, w, entry)


def _weight_spec(spec: str) -> str:
    """The einsum that gives ``w``'s cotangent of ``spec`` (``x, w -> y``): ``x, dy -> dw``."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    return f"{xs},{out}->{ws}"


def _input_spec(spec: str) -> str:
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    return f"{out},{ws}->{xs}"


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _einsum_fwd(spec: str, x: jax.Array, w: jax.Array):
    low = w.astype(x.dtype)
    # The master weight's dtype rides along as a zero-size array: residuals must be arrays.
    return jnp.einsum(spec, x, low), (x, low, jnp.zeros((0,), w.dtype))


def _einsum_bwd(spec: str, res, dy: jax.Array):
    x, low, master = res
    dx = jnp.einsum(_input_spec(spec), dy, low, preferred_element_type=x.dtype).astype(x.dtype)
    dw = jnp.einsum(_weight_spec(spec), x, dy, preferred_element_type=master.dtype)
    return dx, dw


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


# The same projections multiplying by their weight cast beforehand (meshtron.models.cast_weights): ``low`` is the
# entry, the cast of ``w``; the gradient still goes to ``w``, the entry is not differentiated.

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_prepared(spec: str, x: jax.Array, w: jax.Array, low: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, low)


def _einsum_prepared_fwd(spec, x, w, low):
    return jnp.einsum(spec, x, low), (x, low, jnp.zeros((0,), w.dtype))


def _einsum_prepared_bwd(spec, res, dy):
    return (*_einsum_bwd(spec, res, dy), None)


_einsum_prepared.defvjp(_einsum_prepared_fwd, _einsum_prepared_bwd)


def joined_master_einsum(spec: str, x: jax.Array, fuse: Callable[..., jax.Array], kernels: Sequence[jax.Array],
                         split: Callable[[jax.Array], Sequence[jax.Array]], specs: Sequence[str]) -> jax.Array:
    """``einsum(spec, x, fuse(*kernels).astype(x.dtype))``, one GEMM over master weights joined by ``fuse``
    (a fused query/key/value or gate/up projection), whose backward computes each kernel's float32 gradient
    by a GEMM of its own: ``split(y)`` cuts the joined output into the kernels' outputs, ``y_i =
    einsum(specs[i], x, kernels[i])``, so the same cut of the output cotangent gives each kernel's
    cotangent. One GEMM per kernel, not one over the joined kernel cut afterwards, lets each add its
    product straight into that kernel's accumulator."""
    entry = prepared_entry(fuse(*kernels).astype(x.dtype)) if preparing() else None
    if entry is not None:
        return _joined_prepared(spec, fuse, split, tuple(specs), x, entry, *kernels)
    return _joined(spec, fuse, split, tuple(specs), x, *kernels)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _joined(spec, fuse, split, specs, x, *kernels):
    return jnp.einsum(spec, x, fuse(*kernels).astype(x.dtype))


def _joined_fwd(spec, fuse, split, specs, x, *kernels):
    low = fuse(*kernels).astype(x.dtype)
    return jnp.einsum(spec, x, low), (x, low, tuple(jnp.zeros((0,), k.dtype) for k in kernels))


def _joined_bwd(spec, fuse, split, specs, res, dy):
    x, low, masters = res
    dx = jnp.einsum(_input_spec(spec), dy, low, preferred_element_type=x.dtype).astype(x.dtype)
    dws = tuple(jnp.einsum(_weight_spec(s), x, part, preferred_element_type=m.dtype)
                for s, part, m in zip(specs, split(dy), masters, strict=True))
    return (dx, *dws)


_joined.defvjp(_joined_fwd, _joined_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _joined_prepared(spec, fuse, split, specs, x, low, *kernels):
    return jnp.einsum(spec, x, low)


def _joined_prepared_fwd(spec, fuse, split, specs, x, low, *kernels):
    return jnp.einsum(spec, x, low), (x, low, tuple(jnp.zeros((0,), k.dtype) for k in kernels))


def _joined_prepared_bwd(spec, fuse, split, specs, res, dy):
    dx, *dws = _joined_bwd(spec, fuse, split, specs, res, dy)
    return (dx, None, *dws)


_joined_prepared.defvjp(_joined_prepared_fwd, _joined_prepared_bwd)
