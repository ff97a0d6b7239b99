"""A block's dense projections as real FP8 GEMMs (``model.fp8``), and the hook a model's projections call.

Hopper's tensor cores multiply float8 operands at twice the bf16 rate. What reaches them must be a
``dot_general`` whose operands *are* float8 -- XLA turns that into a cuBLASLt FP8 GEMM (or a Triton f8
fusion) -- not a quantize-dequantize pair around a bf16 dot, which the compiler may leave a bf16 GEMM.
So each projection here quantizes its two operands to ``float8_e4m3fn`` and multiplies those; its
backward quantizes the output gradient to ``float8_e5m2`` (five exponent bits: gradients span more
binades than they need mantissa) and runs both backward GEMMs (input gradient: e5m2 x e4m3 weight;
weight gradient: e5m2 x e4m3 input) on float8 operands too. The residuals the backward keeps are the
float8 operands themselves: half the bytes of bf16 ones. The quantized weight is named
:data:`FP8_WEIGHT`, so a recomputation policy can keep it through the rerun instead of quantizing again.

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

**Weights gathered as their layer runs** (``parallel.zero=3``): a layer view gathers each layer's
parameters from every rank's share and records where each came from
(:class:`meshtron.trace_context.GatheredShard`). A projection by such a weight quantizes the *share*
with the whole tensor's scale -- for ``current`` from the maximum of the shares' amaxes (one scalar
reduction), for ``delayed`` from the history -- and gathers its float8 bytes: half a bf16 gather's
traffic, and the same float8 weight quantizing the gathered one gives, bit for bit (the cast is
elementwise). The quantized share is named :data:`FP8_SHARD`: a recomputed layer keeps it (one byte per
parameter of the share) and gathers it again instead of quantizing again. The weight's gradient still
reaches the gathered parameter, whose own gather's transpose reduce-scatters it onto the share.

**Weights quantized beforehand.** A runtime that runs a layer several times per step on the same weights
(a pipeline stage: each microbatch's forward, its recomputation, a zero-bubble W pass rerunning it) may
quantize them once, before: :func:`quantized_weights` traces the layer recording what each projection
quantizes -- a weight's float8 bytes, its scale and its amax's one-hot, or for a gathered weight the
*shares'* bytes; for a grouped expert matmul its ``[experts, k, n]`` weight as the program holds it (experts
split over a manual axis: this device's, at their own amax's scale, as each use quantizes them) -- and keeps
only that computation; a layer traced with those entries
(:class:`PreparedWeights` in :attr:`meshtron.trace_context.TraceContext.fp8_weights`) multiplies by them
(gathering a share's bytes per use), in the order its projections run. The scales do not change within a
step (``current``: the weights do not; ``delayed``: the history does not), so that is bit for bit what
quantizing per use gives, and the histories record the same amaxes. The weight's gradient still reaches the
high-precision weight.

**Delayed scaling** (``delayed``): inside a block, each operand's scale comes from its projection's amax
history instead (:mod:`meshtron.models.fp8_scaling`: the state, its probe, the scales a history gives).
The GEMM still takes each operand's amax, for the next step's history, and hands it back as its probe's
gradient; an empty history scales by the amax as ``current`` does.

**The pieces** are Flax's (``flax.linen.fp8_ops``): its ``quantize`` and the two
``dot_general`` transposes its own FP8 dot uses. Flax's modules (``Fp8DirectDotGeneralOp``,
``Fp8Einsum``) carry delayed-scaling state as variables of the module that multiplies; here the state
belongs to the block, so the custom VJPs stay functions any projection can call.

**The hook.** Model code multiplies by its projection matrices through :func:`projection_einsum` (the
``einsum_op`` of an ``nnx.Einsum``) or :func:`projection_dot_general` (the ``dot_general`` of an
``nnx.Linear`` or a Linen ``Dense``): plain ``einsum``/``dot_general`` when the run's ``model.fp8`` is
``off``, these FP8 GEMMs otherwise. The run's choice reaches them through the trace context
(:mod:`meshtron.trace_context`), so a model names no recipe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.interpreters.partial_eval import dce_jaxpr

from meshtron.models.cast_weights import prepared
from meshtron.models.fp8_scaling import current_layer, exponent_bins
from meshtron.sharding import varying_like
from meshtron.trace_context import GatheredShard, current, using

__all__ = ["E4M3", "E5M2", "FP8_SHARD", "FP8_WEIGHT", "PreparedWeights", "fp8_dot_general", "joined_weight",
           "power_of_two_scale", "projection_dot_general", "projection_einsum", "projection_ragged_dot",
           "quantized_weights"]

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, range +-448
E5M2 = jnp.float8_e5m2  # output gradients: 2 mantissa bits, range +-57344

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def power_of_two_scale(x: jax.Array, dtype: Any) -> jax.Array:
    """The f32 scale ``s`` that ``x / s`` is cast to ``dtype`` with: ``amax(|x|) / max(dtype)`` rounded up
    to a power of two (1 for an all-zero tensor; NaN or Inf when ``x`` holds one, so the step's loss shows
    it instead of a silently clipped product)."""
    return _scale_of(_amax(x), dtype)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _scale_of(amax: jax.Array, dtype: Any) -> jax.Array:
    scale = _power_of_two_at_least(amax / jnp.finfo(dtype).max.astype(jnp.float32))
    return jnp.where(amax == 0, jnp.ones_like(scale), scale).astype(jnp.float32)


def _power_of_two_at_least(v: jax.Array) -> jax.Array:
    """``2^ceil(log2(v))`` exactly (XLA's ``exp2`` of an integer is not always a power of two); a non-finite
    ``v`` as it is."""
    mantissa, exponent = jnp.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    power = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    return jnp.where(jnp.isfinite(v), power, v)


def _quantized(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    scale = power_of_two_scale(x, dtype)
    return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


def _quantized_delayed(x: jax.Array, dtype: Any, delayed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x`` cast by its history's scale ``delayed`` (by its own amax where the history is empty: 0), the
    scale used, and the one-hot of ``x``'s amax exponent for the next step's history."""
    amax = _amax(x)
    scale = jnp.where(delayed == 0, _scale_of(amax, dtype), delayed)
    return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale, exponent_bins(amax)


def _quantized_gradient(g: jax.Array, delayed: jax.Array, groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An output gradient cast to e5m2 as :func:`_quantized_delayed` casts, its history kept in the whole
    batch's units: a step that averages ``groups`` groups' mean losses back-propagates ``groups`` times
    the whole batch's gradients, so the history's scale is multiplied by ``groups`` (rounded up to a
    power of two) and the amax recorded divided by it -- a history restored onto a mesh with other data
    ranks or microbatches then still fits its gradients."""
    amax = _amax(g)
    grouped = _power_of_two_at_least(delayed * groups) if groups > 1 else delayed
    scale = jnp.where(delayed == 0, _scale_of(amax, E5M2), grouped)
    return fp8_ops.quantize(g, E5M2, scale, jnp.float32), scale, exponent_bins(amax / groups)


def _bits(q: jax.Array) -> jax.Array:
    """A float8 array's bytes as ``uint8``: what the backward keeps of a quantized operand. Under
    ``jax.checkpoint`` JAX passes every floating-point value a layer keeps through
    ``reduce_precision`` with its dtype's exponent and mantissa widths, and XLA's ``reduce-precision``
    takes the top binade of ``float8_e4m3fn`` (256 to 448: finite in this format, no infinities) for
    infinities -- a kept e4m3 operand would come back NaN. Bytes pass through untouched."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


FP8_WEIGHT = "fp8_weight"
"""The checkpoint name of a projection's quantized weight (its bytes and scale): a recomputation policy
that saves it (:func:`meshtron.models.blocks.recomputed`) keeps the weight in FP8 from the forward to the
backward instead of quantizing it again in the rerun."""


def _kept_weight(qw: jax.Array, sw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A quantized weight's bytes and scale, named :data:`FP8_WEIGHT`."""
    return checkpoint_name(_bits(qw), FP8_WEIGHT), checkpoint_name(sw, FP8_WEIGHT)


FP8_SHARD = "fp8_shard"
"""The checkpoint name of what a projection by a gathered weight quantizes before the gather: the share's
float8 bytes and the whole tensor's amax. A recomputed layer whose parameters are gathered as it runs
keeps these (:func:`meshtron.models.blocks.recomputed`) and gathers the bytes again in the rerun."""


@dataclass(frozen=True)
class _Joined:
    """A joined kernel ``fuse(*parts)`` whose parts a layer view gathered (:func:`joined_weight`)."""

    fuse: Callable[..., jax.Array]
    parts: tuple[GatheredShard, ...]


_Source = GatheredShard | _Joined


def _gathered_source(w: jax.Array) -> _Source | None:
    """Where a layer view gathered ``w`` from, if it did (:attr:`meshtron.trace_context.TraceContext.gathered`)."""
    table = current().gathered
    found = None if table is None else table.get(id(w))
    return found[1] if found is not None and found[0] is w else None


def _source_amax(source: _Source, dtype: Any) -> jax.Array:
    """The amax of the whole gathered weight (in ``dtype``, the gathered weight's): the shares' largest."""
    if isinstance(source, _Joined):
        return functools.reduce(jnp.maximum, [_source_amax(part, dtype) for part in source.parts])
    share = jax.lax.stop_gradient(source.shard).astype(dtype)
    # typed as varying like the share, as a scale taken from the gathered weight is: a scale the group's
    # maximum made invariant would meet varying operands through an implicit cast in the backward, which
    # a replayed pullback (the pipeline's split backward) cannot reproduce
    return checkpoint_name(varying_like(source.group_max(_amax(share)), share), FP8_SHARD)


def _gathered_bits(source: _Source, scale: jax.Array, dtype: Any) -> jax.Array:
    """The gathered weight's e4m3 bytes at ``scale``: the share cast, then its bytes gathered (a joined
    kernel's: its parts' bytes, joined)."""
    if isinstance(source, _Joined):
        return source.fuse(*[_gathered_bits(part, scale, dtype) for part in source.parts])
    share = jax.lax.stop_gradient(source.shard).astype(dtype)
    return source.gather(checkpoint_name(_bits(fp8_ops.quantize(share, E4M3, scale, jnp.float32)), FP8_SHARD))


def joined_weight(fuse: Callable[..., jax.Array], kernels: tuple[jax.Array, ...], dtype: Any) -> jax.Array:
    """The joined kernel ``fuse(*kernels)`` in ``dtype``, for a projection that multiplies by several matrices
    at once. ``fuse`` only places values (concatenates, reshapes, indexes), so where a layer view gathered
    every kernel, an FP8 GEMM by the joined one quantizes their shares at its scale and joins their bytes:
    what quantizing the joined kernel gives, without quantizing it."""
    joined = fuse(*kernels).astype(dtype)
    table = current().gathered
    parts = [_gathered_source(k) for k in kernels]
    if table is not None and parts and all(isinstance(p, GatheredShard) for p in parts):
        table[id(joined)] = (joined, _Joined(fuse, tuple(parts)))
    return joined


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
    (qx, sx), (qw_bits, sw) = _quantized(x, E4M3), _kept_weight(*_quantized(w, E4M3))
    y = jax.lax.dot_general(qx, _float8(qw_bits, E4M3), dims, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, qw_bits, sw)


def _fp8_dot_backward(dims, out_dtype, operand_dtypes, residuals, g):
    del out_dtype
    x_bits, sx, w_bits, sw = residuals
    qx, qw = _float8(x_bits, E4M3), _float8(w_bits, E4M3)
    qg, sg = _quantized(g, E5M2)
    return _dot_transposes(dims, operand_dtypes, qx, sx, qw, sw, qg, sg)


def _dot_transposes(dims, operand_dtypes, qx, sx, qw, sw, qg, sg):
    """Both backward GEMMs of ``x . w`` on float8 operands: the input and the weight gradient, scaled."""
    x_dtype, w_dtype = operand_dtypes
    dx = fp8_ops.dot_general_transpose_lhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                           preferred_element_type=_accumulated(x_dtype))
    dw = fp8_ops.dot_general_transpose_rhs(qg, qx, qw, dimension_numbers=dims, precision=None,
                                           preferred_element_type=_accumulated(w_dtype))
    return _scaled(dx, sg * sw, x_dtype), _scaled(dw, sg * sx, w_dtype)


_fp8_dot.defvjp(_fp8_dot_forward, _fp8_dot_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_dot_quantized_weight(x: jax.Array, w: jax.Array, w_bits: jax.Array, sw: jax.Array, dims: DimensionNumbers,
                              out_dtype: Any, operand_dtypes: tuple[Any, Any]) -> jax.Array:
    """:func:`_fp8_dot` with the weight already quantized (``w_bits`` at ``sw``): ``w`` is read for its
    gradient alone."""
    return _fp8_dot_quantized_weight_forward(x, w, w_bits, sw, dims, out_dtype, operand_dtypes)[0]


def _fp8_dot_quantized_weight_forward(x, w, w_bits, sw, dims, out_dtype, operand_dtypes):
    del w, operand_dtypes
    qx, sx = _quantized(x, E4M3)
    y = jax.lax.dot_general(qx, _float8(w_bits, E4M3), dims, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, w_bits, sw)


def _fp8_dot_quantized_weight_backward(dims, out_dtype, operand_dtypes, residuals, g):
    return (*_fp8_dot_backward(dims, out_dtype, operand_dtypes, residuals, g), None, None)


_fp8_dot_quantized_weight.defvjp(_fp8_dot_quantized_weight_forward, _fp8_dot_quantized_weight_backward)


def _site_cotangent(forward_bins: jax.Array, gradient_bins: jax.Array) -> jax.Array:
    """The cotangent of a delayed GEMM's site (``[3, 1 + BINS]``: its scales, then its probe): nothing for
    the scales, which come from the history and do not train; the three operands' amax one-hots for the
    probe. One input for both keeps the backward free of a separate zero cotangent whose replication type
    a replayed pullback (the pipeline's split backward) could not reproduce."""
    bins = jnp.concatenate([forward_bins, gradient_bins[None]])
    return jnp.concatenate([jnp.zeros_like(bins[:, :1]), bins], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _delayed_dot(x, w, site, dims, out_dtype, operand_dtypes, groups):
    return _delayed_dot_forward(x, w, site, dims, out_dtype, operand_dtypes, groups)[0]


def _delayed_operands(x, w, scales):
    """Both forward operands cast at their history's scales: ``x`` in float8 and its scale, the weight's
    kept bytes and scale, and their amaxes' one-hots for the next step's history."""
    qx, sx, bx = _quantized_delayed(x, E4M3, scales[0])
    qw, sw, bw = _quantized_delayed(w, E4M3, scales[1])
    return (qx, sx, *_kept_weight(qw, sw), jnp.stack([bx, bw]))


def _delayed_dot_forward(x, w, site, dims, out_dtype, operand_dtypes, groups):
    del operand_dtypes, groups
    scales = site[:, 0]
    qx, sx, qw_bits, sw, bins = _delayed_operands(x, w, scales)
    y = jax.lax.dot_general(qx, _float8(qw_bits, E4M3), dims, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, qw_bits, sw, scales, bins)


def _delayed_dot_backward(dims, out_dtype, operand_dtypes, groups, residuals, g):
    x_bits, sx, w_bits, sw, scales, forward_bins = residuals
    qg, sg, bg = _quantized_gradient(g, scales[2], groups)
    dx, dw = _dot_transposes(dims, operand_dtypes, _float8(x_bits, E4M3), sx, _float8(w_bits, E4M3), sw, qg, sg)
    return dx, dw, _site_cotangent(forward_bins, bg)


_delayed_dot.defvjp(_delayed_dot_forward, _delayed_dot_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _delayed_dot_quantized_weight(x, w, w_bits, sw, w_bins, site, dims, out_dtype, operand_dtypes, groups):
    """:func:`_delayed_dot` with the weight already quantized (``w_bits`` at ``sw``, its amax's one-hot
    ``w_bins``): ``w`` is read for its gradient alone."""
    return _delayed_dot_quantized_weight_forward(x, w, w_bits, sw, w_bins, site, dims, out_dtype, operand_dtypes,
                                                 groups)[0]


def _delayed_dot_quantized_weight_forward(x, w, w_bits, sw, w_bins, site, dims, out_dtype, operand_dtypes, groups):
    del w, operand_dtypes, groups
    scales = site[:, 0]
    qx, sx, bx = _quantized_delayed(x, E4M3, scales[0])
    y = jax.lax.dot_general(qx, _float8(w_bits, E4M3), dims, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, w_bits, sw, scales, jnp.stack([bx, w_bins]))


def _delayed_dot_quantized_weight_backward(dims, out_dtype, operand_dtypes, groups, residuals, g):
    dx, dw, site = _delayed_dot_backward(dims, out_dtype, operand_dtypes, groups, residuals, g)
    return dx, dw, None, None, None, site


_delayed_dot_quantized_weight.defvjp(_delayed_dot_quantized_weight_forward, _delayed_dot_quantized_weight_backward)


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers, precision: Any = None,
                    preferred_element_type: Any = None, **_: Any) -> jax.Array:
    """``jax.lax.dot_general`` computed as an FP8 GEMM (both operands ``e4m3``; in the backward the output
    gradient ``e5m2``), accumulated in f32 and returned in ``preferred_element_type`` (default: the
    operands' promoted dtype). Scaled per tensor by its own amax (current scaling), or inside a block under
    ``model.fp8=delayed`` by its projection's amax history. ``precision`` has no meaning for float8
    operands and is ignored; the operands' own dtypes are their gradients' dtypes."""
    del precision
    return _fp8_product(lhs, rhs, dimension_numbers, preferred_element_type, projections=1)


def _fp8_product(lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers, preferred_element_type: Any,
                 projections: int) -> jax.Array:
    """:func:`fp8_dot_general` of a GEMM that multiplies by ``projections`` joined weight matrices."""
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    dims = tuple(tuple(tuple(int(a) for a in axes) for axes in pair) for pair in dimension_numbers)
    dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
    site = _delayed_site(projections)
    source = _gathered_source(rhs)
    if current().fp8_weights is not None:
        return _prepared_product(lhs, rhs, source, site, dims, out_dtype, dtypes)
    if source is not None:
        return _gathered_product(lhs, rhs, source, site, dims, out_dtype, dtypes)
    if site is not None:
        return _delayed_dot(lhs, rhs, site, dims, out_dtype, dtypes, current().loss_groups)
    return _fp8_dot(lhs, rhs, dims, out_dtype, dtypes)


def _gathered_product(x: jax.Array, w: jax.Array, source: _Source, site: jax.Array | None,
                      dims: DimensionNumbers, out_dtype: Any, dtypes: tuple[Any, Any]) -> jax.Array:
    """The FP8 GEMM by a weight a layer view gathered: the share quantized at the whole weight's scale (its
    history's under delayed scaling, else its amax's), its bytes gathered."""
    amax = _source_amax(source, w.dtype)
    if site is None:
        sw = _scale_of(amax, E4M3)
        return _fp8_dot_quantized_weight(x, w, _gathered_bits(source, sw, w.dtype), sw, dims, out_dtype, dtypes)
    delayed = jax.lax.stop_gradient(site[1, 0])
    sw = jnp.where(delayed == 0, _scale_of(amax, E4M3), delayed)
    return _delayed_dot_quantized_weight(x, w, _gathered_bits(source, sw, w.dtype), sw, exponent_bins(amax), site,
                                         dims, out_dtype, dtypes, current().loss_groups)


WeightEntry = tuple[tuple[jax.Array, ...], jax.Array, jax.Array]
"""What a projection quantizes of its weight: the float8 bytes (a gathered weight's: each part's share, in
its joined parts' order), the scale, and the amax's exponent one-hot (delayed scaling's next history)."""


class _Recording:
    """The entries a traced layer's projections quantize, in the order they run (:func:`quantized_weights`)."""

    def __init__(self):
        self.entries: list[WeightEntry] = []


class PreparedWeights:
    """One layer's weights quantized beforehand (the entries :func:`quantized_weights` returned), handed to its
    projections in the order they run. Set as :attr:`meshtron.trace_context.TraceContext.fp8_weights` while
    the layer is traced (:func:`meshtron.models.blocks.run_layer` does)."""

    def __init__(self, entries: list[WeightEntry]):
        self.entries, self.used = list(entries), 0

    def next(self, w: jax.Array, source: _Source | None, grouped: bool = False) -> WeightEntry:
        """The next projection's entry, checked against the weight it multiplies by (``w``, or the shares of a
        gathered ``source``; ``grouped``: a grouped expert matmul's ``[experts, k, n]`` weight, named so in
        the error)."""
        what = "a grouped expert projection" if grouped else "a projection"
        if self.used == len(self.entries):
            raise ValueError(f"FP8 weights prepared for {len(self.entries)} projections; the layer runs more "
                             f"({what} by {w.shape})")
        entry = self.entries[self.used]
        self.used += 1
        expected = [w.shape] if source is None else [p.shard.shape for p in _parts(source)]
        if [b.shape for b in entry[0]] != expected:
            raise ValueError(f"FP8 weight prepared as {[b.shape for b in entry[0]]} for {what} by {expected}: "
                             "the layer runs its projections in another order than it was prepared in")
        return entry

    def check_complete(self) -> None:
        if self.used != len(self.entries):
            raise ValueError(f"FP8 weights prepared for {len(self.entries)} projections; the layer ran {self.used}")


def _parts(source: _Source) -> tuple[GatheredShard, ...]:
    return source.parts if isinstance(source, _Joined) else (source,)


def _weight_entry(w: jax.Array, source: _Source | None, site: jax.Array | None) -> WeightEntry:
    """``w`` quantized as the projection by it quantizes it: at its own amax's scale, or its history's under
    delayed scaling; a gathered weight's shares at the whole weight's."""
    amax = _amax(jax.lax.stop_gradient(w)) if source is None else _source_amax(source, w.dtype)
    scale = _scale_of(amax, E4M3)
    if site is not None:
        delayed = jax.lax.stop_gradient(site[1, 0])
        scale = jnp.where(delayed == 0, scale, delayed)
    if source is None:
        bits = (_bits(fp8_ops.quantize(jax.lax.stop_gradient(w), E4M3, scale, jnp.float32)),)
    else:
        bits = tuple(_bits(fp8_ops.quantize(jax.lax.stop_gradient(p.shard).astype(w.dtype), E4M3, scale, jnp.float32))
                     for p in _parts(source))
    return bits, scale, exponent_bins(amax)


def _prepared_entry(w: jax.Array, source: _Source | None, site: jax.Array | None, grouped: bool = False) -> WeightEntry:
    """The next projection's weight entry from the trace context's :class:`PreparedWeights`; while recording
    (:func:`quantized_weights`), ``w`` quantized here and recorded."""
    prepared = current().fp8_weights
    if isinstance(prepared, _Recording):
        entry = _weight_entry(w, source, site)
        prepared.entries.append(entry)
        return entry
    return prepared.next(w, source, grouped)


def _prepared_product(x: jax.Array, w: jax.Array, source: _Source | None, site: jax.Array | None,
                      dims: DimensionNumbers, out_dtype: Any, dtypes: tuple[Any, Any]) -> jax.Array:
    """The FP8 GEMM by ``w`` quantized beforehand (:class:`PreparedWeights`; while recording, quantized here and
    recorded): a gathered weight's share bytes are gathered here, as the view gathers the weight."""
    bits, scale, bins = _prepared_entry(w, source, site)
    if source is not None:
        gathered = [p.gather(b) for p, b in zip(_parts(source), bits, strict=True)]
        w_bits = source.fuse(*gathered) if isinstance(source, _Joined) else gathered[0]
    else:
        w_bits = bits[0]
    if site is None:
        return _fp8_dot_quantized_weight(x, w, w_bits, scale, dims, out_dtype, dtypes)
    return _delayed_dot_quantized_weight(x, w, w_bits, scale, bins, site, dims, out_dtype, dtypes,
                                         current().loss_groups)


def quantized_weights(layer: Callable[..., Any], *args: Any) -> list[WeightEntry]:
    """What each FP8 projection of ``layer(*args)`` (a layer, traced under the run's ``model.fp8``) multiplies
    by, quantized as it quantizes it, in the order the projections run: the entries a
    :class:`PreparedWeights` hands back to the layer. Only that is computed: the layer is traced, and
    everything the entries do not need (its activations, a view's gather of the whole weights) pruned
    before it runs."""
    def record(*inputs):
        recording = _Recording()
        with using(fp8_weights=recording):
            layer(*inputs)
        return recording.entries

    closed, shapes = jax.make_jaxpr(record, return_shape=True)(*args)
    jaxpr, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    inputs = [a for a, keep in zip(jax.tree.leaves(args), used, strict=True) if keep]
    return jax.tree.unflatten(jax.tree.structure(shapes), jaxpr_as_fun(ClosedJaxpr(jaxpr, closed.consts))(*inputs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, out_dtype: Any,
                    operand_dtypes: tuple[Any, Any]) -> jax.Array:
    return _fp8_ragged_forward(x, w, sizes, out_dtype, operand_dtypes)[0]


def _fp8_ragged_forward(x, w, sizes, out_dtype, operand_dtypes):
    del operand_dtypes
    (qx, sx), (qw_bits, sw) = _quantized(x, E4M3), _kept_weight(*_quantized(w, E4M3))
    y = jax.lax.ragged_dot(qx, _float8(qw_bits, E4M3), sizes, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, qw_bits, sw, sizes)


# dw[g] = x_g^T g_g: the rows' (ragged) dimension contracted, one output per group.
_PER_GROUP_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _fp8_ragged_backward(out_dtype, operand_dtypes, residuals, g):
    del out_dtype
    x_bits, sx, w_bits, sw, sizes = residuals
    qx, qw = _float8(x_bits, E4M3), _float8(w_bits, E4M3)
    qg, sg = _quantized(g, E5M2)
    return (*_ragged_transposes(operand_dtypes, qx, sx, qw, sw, qg, sg, sizes), None)


def _ragged_transposes(operand_dtypes, qx, sx, qw, sw, qg, sg, sizes):
    """Both backward grouped GEMMs of a ragged ``x . w[group]`` on float8 operands, scaled."""
    x_dtype, w_dtype = operand_dtypes
    dx = jax.lax.ragged_dot(qg, jnp.swapaxes(qw, 1, 2), sizes, preferred_element_type=_accumulated(x_dtype))
    dw = jax.lax.ragged_dot_general(qx, qg, sizes, _PER_GROUP_WEIGHT_GRADIENT,
                                    preferred_element_type=_accumulated(w_dtype))
    return _scaled(dx, sg * sw, x_dtype), _scaled(dw, sg * sx, w_dtype)


_fp8_ragged_dot.defvjp(_fp8_ragged_forward, _fp8_ragged_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _delayed_ragged_dot(x, w, sizes, site, out_dtype, operand_dtypes, groups):
    return _delayed_ragged_forward(x, w, sizes, site, out_dtype, operand_dtypes, groups)[0]


def _delayed_ragged_forward(x, w, sizes, site, out_dtype, operand_dtypes, groups):
    del operand_dtypes, groups
    scales = site[:, 0]
    qx, sx, qw_bits, sw, bins = _delayed_operands(x, w, scales)
    y = jax.lax.ragged_dot(qx, _float8(qw_bits, E4M3), sizes, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, qw_bits, sw, sizes, scales, bins)


def _delayed_ragged_backward(out_dtype, operand_dtypes, groups, residuals, g):
    x_bits, sx, w_bits, sw, sizes, scales, forward_bins = residuals
    qg, sg, bg = _quantized_gradient(g, scales[2], groups)
    dx, dw = _ragged_transposes(operand_dtypes, _float8(x_bits, E4M3), sx, _float8(w_bits, E4M3), sw, qg, sg, sizes)
    return dx, dw, None, _site_cotangent(forward_bins, bg)


_delayed_ragged_dot.defvjp(_delayed_ragged_forward, _delayed_ragged_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fp8_ragged_dot_quantized_weight(x: jax.Array, w: jax.Array, w_bits: jax.Array, sw: jax.Array, sizes: jax.Array,
                                     out_dtype: Any, operand_dtypes: tuple[Any, Any]) -> jax.Array:
    """:func:`_fp8_ragged_dot` with the ``[experts, k, n]`` weight already quantized (``w_bits`` at ``sw``):
    ``w`` is read for its gradient alone."""
    return _fp8_ragged_quantized_weight_forward(x, w, w_bits, sw, sizes, out_dtype, operand_dtypes)[0]


def _fp8_ragged_quantized_weight_forward(x, w, w_bits, sw, sizes, out_dtype, operand_dtypes):
    del w, operand_dtypes
    qx, sx = _quantized(x, E4M3)
    y = jax.lax.ragged_dot(qx, _float8(w_bits, E4M3), sizes, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, w_bits, sw, sizes)


def _fp8_ragged_quantized_weight_backward(out_dtype, operand_dtypes, residuals, g):
    dx, dw, _ = _fp8_ragged_backward(out_dtype, operand_dtypes, residuals, g)
    return dx, dw, None, None, None


_fp8_ragged_dot_quantized_weight.defvjp(_fp8_ragged_quantized_weight_forward, _fp8_ragged_quantized_weight_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _delayed_ragged_dot_quantized_weight(x, w, w_bits, sw, w_bins, sizes, site, out_dtype, operand_dtypes, groups):
    """:func:`_delayed_ragged_dot` with the ``[experts, k, n]`` weight already quantized (``w_bits`` at ``sw``,
    its amax's one-hot ``w_bins``): ``w`` is read for its gradient alone."""
    return _delayed_ragged_quantized_weight_forward(x, w, w_bits, sw, w_bins, sizes, site, out_dtype,
                                                    operand_dtypes, groups)[0]


def _delayed_ragged_quantized_weight_forward(x, w, w_bits, sw, w_bins, sizes, site, out_dtype, operand_dtypes,
                                             groups):
    del w, operand_dtypes, groups
    scales = site[:, 0]
    qx, sx, bx = _quantized_delayed(x, E4M3, scales[0])
    y = jax.lax.ragged_dot(qx, _float8(w_bits, E4M3), sizes, preferred_element_type=_accumulated(out_dtype))
    return _scaled(y, sx * sw, out_dtype), (_bits(qx), sx, w_bits, sw, sizes, scales, jnp.stack([bx, w_bins]))


def _delayed_ragged_quantized_weight_backward(out_dtype, operand_dtypes, groups, residuals, g):
    dx, dw, _, site = _delayed_ragged_backward(out_dtype, operand_dtypes, groups, residuals, g)
    return dx, dw, None, None, None, None, site


_delayed_ragged_dot_quantized_weight.defvjp(_delayed_ragged_quantized_weight_forward,
                                            _delayed_ragged_quantized_weight_backward)


def _prepared_ragged_product(x: jax.Array, w: jax.Array, sizes: jax.Array, site: jax.Array | None,
                             dtypes: tuple[Any, Any]) -> jax.Array:
    """The grouped FP8 GEMM by ``w`` [experts, k, n] quantized beforehand (:class:`PreparedWeights`; while
    recording, quantized here and recorded) as the per-use grouped GEMM quantizes it: the amax, and under
    delayed scaling the history's scale, of the weight this program holds (with the experts split over a
    manual axis, this device's experts: the per-use GEMM takes no maximum over the expert group either)."""
    bits, scale, bins = _prepared_entry(w, None, site, grouped=True)
    if site is None:
        return _fp8_ragged_dot_quantized_weight(x, w, bits[0], scale, sizes, jnp.dtype(x.dtype), dtypes)
    return _delayed_ragged_dot_quantized_weight(x, w, bits[0], scale, bins, sizes, site, jnp.dtype(x.dtype), dtypes,
                                                current().loss_groups)


def _fp8_on() -> bool:
    return current().fp8 != "off"


def _delayed_site(projections: int = 1) -> jax.Array | None:
    """Under ``model.fp8=delayed`` inside a layer: the scales and probe of the next ``projections``
    (:meth:`meshtron.models.fp8_scaling.LayerScaling.next_site`); ``None`` otherwise (current scaling:
    there is no state outside the blocks)."""
    layer = current_layer() if current().fp8 == "delayed" else None
    return None if layer is None else layer.next_site(projections)


def projection_einsum(spec: str, x: jax.Array, w: jax.Array, *, precision: Any = None,
                      preferred_element_type: Any = None, out_sharding: Any = None, projections: int = 1) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a projection by a weight matrix: FP8 GEMMs under the run's
    ``model.fp8`` (:func:`fp8_dot_general`), the plain einsum otherwise. Pass it as an ``nnx.Einsum``'s
    ``einsum_op`` (or call it where a model multiplies by a matrix itself). ``projections``: how many
    projection matrices ``w`` joins (a fused query/key/value or gate/up kernel): under delayed scaling it
    takes the scales of all of them and records its amaxes for each, so the state means the same whether
    a layout joins them or not."""
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    if _fp8_on() and ((current().fp8 == "delayed" and current_layer() is not None) or _gathered_source(w) is not None
                      or current().fp8_weights is not None):
        y = _einsum_by_dot_general(spec, x, w, preferred_element_type, projections)
        return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)
    if _fp8_on():
        extra["_dot_general"] = fp8_dot_general
    else:
        w = prepared(w)  # a pipeline stage's weight cast once per step (meshtron.models.cast_weights)
    return jnp.einsum(spec, x, w, precision=precision, preferred_element_type=preferred_element_type, **extra)


def _einsum_by_dot_general(spec: str, x: jax.Array, w: jax.Array, preferred_element_type: Any,
                           projections: int) -> jax.Array:
    """``einsum(spec, x, w)`` as one FP8 GEMM (:func:`_fp8_product`) called here, in this trace. ``jnp.einsum`` calls
    its ``_dot_general`` inside a cached ``jit``: a second projection of the same shapes would reuse the
    first one's trace, and with it the first one's scaling state; and inside it ``w`` is another value than
    the one a layer view gathered (:func:`_gathered_source`)."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if "..." in xs:  # a leading ellipsis over x's extra axes: name them
        free = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec)[:x.ndim - len(xs) + 3]
        xs, out = xs.replace("...", free), out.replace("...", free)
    batch = [c for c in xs if c in ws and c in out]
    contract = [c for c in xs if c in ws and c not in out]
    dims = ((tuple(xs.index(c) for c in contract), tuple(ws.index(c) for c in contract)),
            (tuple(xs.index(c) for c in batch), tuple(ws.index(c) for c in batch)))
    y = _fp8_product(x, w, dims, preferred_element_type, projections)
    produced = batch + [c for c in xs if c not in ws] + [c for c in ws if c not in xs]
    return jnp.transpose(y, [produced.index(c) for c in out])


def projection_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [m, k], rhs [groups, k, n], group_sizes)`` for grouped expert matmuls:
    FP8 GEMMs under the run's ``model.fp8`` (each operand scaled as a whole, the weight gradient one
    GEMM per group over its rows), the plain grouped matmul otherwise. Returns ``lhs``'s dtype. In a layer
    whose weights were quantized beforehand (:class:`PreparedWeights`) it multiplies by the next entry's
    bytes, as the dense projections do."""
    if _fp8_on():
        dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
        site = _delayed_site()
        if current().fp8_weights is not None:
            return _prepared_ragged_product(lhs, rhs, group_sizes, site, dtypes)
        if site is not None:
            return _delayed_ragged_dot(lhs, rhs, group_sizes, site, jnp.dtype(lhs.dtype), dtypes, current().loss_groups)
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
