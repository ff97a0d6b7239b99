"""A block's dense projections as real FP8 GEMMs (``model.fp8``), and the hook a model's projections call.

Hopper's tensor cores multiply float8 operands at twice the bf16 rate. What reaches them must be a
``dot_general`` whose operands *are* float8 -- XLA turns that into a cuBLASLt FP8 GEMM (or a Triton f8
fusion) -- not a quantize-dequantize pair around a bf16 dot, which the compiler may leave a bf16 GEMM.
So each projection here quantizes its two operands to ``float8_e4m3fn`` and multiplies those; its
backward quantizes the output gradient to ``float8_e5m2`` (five exponent bits: gradients span more
binades than they need mantissa) and runs both backward GEMMs (input gradient: e5m2 x e4m3 weight;
weight gradient: e5m2 x e4m3 input) on float8 operands too. The residuals the backward keeps are the
float8 operands themselves: half the bytes of bf16 ones.

**Scaling** (``current``): each tensor is divided by its own scale before the cast, the scale taken
from the tensor's absolute maximum at that moment (per tensor, as Transformer Engine's current
scaling and torchao's tensorwise recipe do), so nothing saturates and no scaling state is carried
between steps. Scales are rounded *up* to a power of two: the largest value then lands in the top
binade below the format's maximum (at most one binade of range is left unused), and multiplying by a
power of two is exact. So each GEMM returns its product already in the operands' dtype (f32
accumulation inside, one rounding; f32 for float16, whose range is too narrow), scaled afterwards: a row-parallel projection's partial sums
then cross the tensor axis in bf16, as without FP8, and the layer keeps bf16 outputs, not f32. Over a
tensor split across devices the maximum is taken over the whole tensor (one scalar reduction), so
every device quantizes with the same scale and a split run computes what one device computes.

**The pieces** are Flax's (``flax.linen.fp8_ops``): its ``quantize`` and the two
``dot_general`` transposes its own FP8 dot uses. Flax's modules (``Fp8DirectDotGeneralOp``,
``Fp8Einsum``) carry delayed-scaling state as variables whose "gradient" is their next value; current
scaling needs no state, so the custom VJP here is a function any projection can call.

**The hook.** Model code multiplies by its projection matrices through :func:`projection_einsum` (the
``einsum_op`` of an ``nnx.Einsum``) or :func:`projection_dot_general` (the ``dot_general`` of an
``nnx.Linear`` or a Linen ``Dense``): plain ``einsum``/``dot_general`` when the run's ``model.fp8`` is
``off``, these FP8 GEMMs otherwise. The run's choice reaches them through the trace context
(:mod:`meshtron.trace_context`), so a model names no recipe.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from meshtron.trace_context import current

__all__ = ["E4M3", "E5M2", "fp8_dot_general", "power_of_two_scale", "projection_dot_general", "projection_einsum",
           "projection_ragged_dot"]

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, range +-448
E5M2 = jnp.float8_e5m2  # output gradients: 2 mantissa bits, range +-57344

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def power_of_two_scale(x: jax.Array, dtype: Any) -> jax.Array:
    """The f32 scale ``s`` that ``x / s`` is cast to ``dtype`` with: ``amax(|x|) / max(dtype)`` rounded up
    to a power of two (1 for an all-zero tensor; NaN or Inf when ``x`` holds one, so the step's loss shows
    it instead of a silently clipped product)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    ratio = amax / jnp.finfo(dtype).max.astype(jnp.float32)
    scale = jnp.exp2(jnp.ceil(jnp.log2(ratio)))
    return jnp.where(amax == 0, jnp.ones_like(scale), scale).astype(jnp.float32)


def _quantized(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    scale = power_of_two_scale(x, dtype)
    return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


def _bits(q: jax.Array) -> jax.Array:
    """A float8 array's bytes as ``uint8``: what the backward keeps of a quantized operand. Under
    ``jax.checkpoint`` JAX passes every floating-point value a layer keeps through
    ``reduce_precision`` with its dtype's exponent and mantissa widths, and XLA's ``reduce-precision``
    takes the top binade of ``float8_e4m3fn`` (256 to 448: finite in this format, no infinities) for
    infinities -- a kept e4m3 operand would come back NaN. Bytes pass through untouched."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _float8(bits: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, dtype)


def _accumulated(dtype: Any) -> Any:
    """The dtype a GEMM returning ``dtype`` writes its unscaled product in: ``dtype`` itself (bf16 and f32
    hold any product of float8 values and any power-of-two scale), f32 for float16, whose range holds
    neither a long sum of e4m3 products (448² each) nor a gradient's small scales."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float16 else dtype


def _scaled(product: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """A GEMM's unscaled product times a power-of-two scale (exact), in ``dtype``."""
    return (product * scale.astype(product.dtype)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_dot(x: jax.Array, w: jax.Array, dims: DimensionNumbers, out_dtype: Any,
             operand_dtypes: tuple[Any, Any]) -> jax.Array:
    return _fp8_dot_forward(x, w, dims, out_dtype, operand_dtypes)[0]


def _fp8_dot_forward(x, w, dims, out_dtype, operand_dtypes):
    del operand_dtypes
    (qx, sx), (qw, sw) = _quantized(x, E4M3), _quantized(w, E4M3)
    y = jax.lax.dot_general(qx, qw, dims, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, _bits(qw), sw)


def _fp8_dot_backward(dims, out_dtype, operand_dtypes, residuals, g):
    del out_dtype
    x_bits, sx, w_bits, sw = residuals
    qx, qw = _float8(x_bits, E4M3), _float8(w_bits, E4M3)
    qg, sg = _quantized(g, E5M2)
    x_dtype, w_dtype = operand_dtypes
    dx = fp8_ops.dot_general_transpose_lhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                           preferred_element_type=_accumulated(x_dtype))
    dw = fp8_ops.dot_general_transpose_rhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                           preferred_element_type=_accumulated(w_dtype))
    return _scaled(dx, sg * sw, x_dtype), _scaled(dw, sg * sx, w_dtype)


_fp8_dot.defvjp(_fp8_dot_forward, _fp8_dot_backward)


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers, precision: Any = None,
                    preferred_element_type: Any = None, **_: Any) -> jax.Array:
    """``jax.lax.dot_general`` computed as an FP8 GEMM with current power-of-two scaling (both operands
    ``e4m3``; in the backward the output gradient ``e5m2``), accumulated in f32 and returned in
    ``preferred_element_type`` (default: the operands' promoted dtype). ``precision`` has no meaning for
    float8 operands and is ignored; the operands' own dtypes are their gradients' dtypes."""
    del precision
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    dims = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dimension_numbers)
    return _fp8_dot(lhs, rhs, dims, jnp.dtype(out_dtype), (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, out_dtype: Any,
                    operand_dtypes: tuple[Any, Any]) -> jax.Array:
    return _fp8_ragged_forward(x, w, sizes, out_dtype, operand_dtypes)[0]


def _fp8_ragged_forward(x, w, sizes, out_dtype, operand_dtypes):
    del operand_dtypes
    (qx, sx), (qw, sw) = _quantized(x, E4M3), _quantized(w, E4M3)
    y = jax.lax.ragged_dot(qx, qw, sizes, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, _bits(qw), sw, sizes)


# dw[g] = x_g^T g_g: the rows' (ragged) dimension contracted, one output per group.
_PER_GROUP_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _fp8_ragged_backward(out_dtype, operand_dtypes, residuals, g):
    del out_dtype
    x_bits, sx, w_bits, sw, sizes = residuals
    qx, qw = _float8(x_bits, E4M3), _float8(w_bits, E4M3)
    qg, sg = _quantized(g, E5M2)
    x_dtype, w_dtype = operand_dtypes
    dx = jax.lax.ragged_dot(qg, jnp.swapaxes(qw, 1, 2), sizes, preferred_element_type=_accumulated(x_dtype))
    dw = jax.lax.ragged_dot_general(qx, qg, sizes, _PER_GROUP_WEIGHT_GRADIENT,
                                    preferred_element_type=_accumulated(w_dtype))
    return _scaled(dx, sg * sw, x_dtype), _scaled(dw, sg * sx, w_dtype), None


_fp8_ragged_dot.defvjp(_fp8_ragged_forward, _fp8_ragged_backward)


def _fp8_on() -> bool:
    return current().fp8 != "off"


def projection_einsum(spec: str, x: jax.Array, w: jax.Array, *, precision: Any = None,
                      preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a projection by a weight matrix: FP8 GEMMs under the run's
    ``model.fp8`` (:func:`fp8_dot_general`), the plain einsum otherwise. Pass it as an ``nnx.Einsum``'s
    ``einsum_op`` (or call it where a model multiplies by a matrix itself)."""
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    if _fp8_on():
        extra["_dot_general"] = fp8_dot_general
    return jnp.einsum(spec, x, w, precision=precision, preferred_element_type=preferred_element_type, **extra)


def projection_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [m, k], rhs [groups, k, n], group_sizes)`` for grouped expert matmuls:
    FP8 GEMMs under the run's ``model.fp8`` (each operand scaled as a whole, the weight gradient one
    GEMM per group over its rows), the plain grouped matmul otherwise. Returns ``lhs``'s dtype."""
    if _fp8_on():
        dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
        return _fp8_ragged_dot(lhs, rhs, group_sizes, jnp.dtype(lhs.dtype), dtypes)
    return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes)


def projection_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers,
                           precision: Any = None, preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """``jax.lax.dot_general`` for a projection by a weight matrix: FP8 GEMMs under the run's
    ``model.fp8``, the plain dot otherwise. Pass it as an ``nnx.Linear``'s (or a Linen ``Dense``'s)
    ``dot_general``."""
    if _fp8_on():
        return fp8_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
