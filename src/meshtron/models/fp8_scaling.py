"""Delayed FP8 scaling (``model.fp8=delayed``): each projection's scales come from a history of its operands' amaxes.

Current scaling (:mod:`meshtron.models.fp8`) divides each tensor by a scale taken from its own absolute
maximum, so the cast waits for a reduction over the whole tensor. Delayed scaling (Transformer Engine's
default recipe, Flax's ``Fp8DotGeneralOp``) takes the scale from the largest amax of the last ``H``
steps instead: the cast no longer depends on the tensor's own maximum, and the amax observed in this
step only enters the history for the next. That is state, and it is per GEMM operand: for every
projection a block multiplies through the hook, the forward's input and weight and the backward's
output gradient.

**Where the state lives.** In the model's blocks, as two variables stacked on the ``layers`` axis like
every block parameter (so pipeline stage placement, checkpoints and restoring onto another mesh handle
them as they handle the weights); neither trains:

* ``fp8_history`` ``[layers, sites, 3, H]``: for each projection *site* (the projections a block calls,
  numbered in call order) and each of its three operands, the power-of-two upper bound ``2^e`` of each of
  the last ``H`` steps' amax (``amax < 2^e``; 0: nothing seen; ``inf``: a non-finite amax);
* ``fp8_observed`` ``[layers, sites, 3, BINS]``: zeros, read for its *gradient* only. Each FP8 GEMM's
  backward returns, as this leaf's cotangent, a one-hot over amax exponents for each of its operands
  (the forward's two and the output gradient's, which exists only in the backward). Gradients are summed
  over microbatches and averaged over data ranks, which would blur a maximum but keeps a histogram's
  non-empty bins non-empty: the step reads the highest one (:func:`observed_bounds`), takes the maximum
  over the data group and pushes it into the history (:func:`rolled`). The pair is a
  :class:`~meshtron.models.probed_state.ProbedState` (:data:`DELAYED_SCALING`).

A scale is ``2^(e - m)`` with ``2^m`` the largest power of two within the format (e4m3: 256 < 448; e5m2:
32768 < 57344), so the history's largest amax lands below the format's maximum; an amax larger than the
history's saturates at the format's maximum (Flax's ``quantize`` clips). An operand with no history yet
(the first step) is scaled by its own amax, as current scaling does, so no step multiplies unscaled
tensors; a non-finite amax in the history makes the scale NaN, so the loss shows it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.errors import ConfigError
from meshtron.models.probed_state import PROBED, ProbedState, StepTotals
from meshtron.trace_context import current, using

__all__ = ["BINS", "DELAYED_SCALING", "HISTORY", "OBSERVED", "Fp8History", "Fp8Observed", "LayerScaling", "counting_sites",
           "delayed_scales", "exponent_bins", "layer_scaling", "observed_bounds", "rolled", "with_scaling_state"]

HISTORY = "fp8_history"
OBSERVED = "fp8_observed"
OPERANDS = 3  # per site: the forward's input and weight, the backward's output gradient
_OFFSET = 149  # f32's smallest amax, 2^-149, has exponent -148 (frexp): bin 1; the largest finite, bin 277
BINS = 280  # bin BINS - 1: a non-finite amax
_NONFINITE = BINS - 1
_E4M3_TOP = math.floor(math.log2(float(jnp.finfo(jnp.float8_e4m3fn).max)))  # 8: 256 <= 448
_E5M2_TOP = math.floor(math.log2(float(jnp.finfo(jnp.float8_e5m2).max)))  # 15: 32768 <= 57344
_TOPS = (_E4M3_TOP, _E4M3_TOP, _E5M2_TOP)


class Fp8History(nnx.Param):
    """A block's amax history (``[layers, sites, 3, H]``): state, not a trained weight."""


class Fp8Observed(nnx.Param):
    """Zeros whose gradient is a step's amax histogram (``[layers, sites, 3, BINS]``); never trained."""


def exponent_bins(amax: jax.Array) -> jax.Array:
    """A one-hot ``[BINS]`` (f32) of ``amax``'s binary exponent ``e`` (``amax < 2^e``): all zeros for 0,
    the last bin for a non-finite amax."""
    _, e = jnp.frexp(amax.astype(jnp.float32))
    index = jnp.where(jnp.isfinite(amax), e + _OFFSET, _NONFINITE)
    return jnp.where(amax == 0, 0.0, jax.nn.one_hot(index, BINS, dtype=jnp.float32))


def observed_bounds(counts: jax.Array) -> jax.Array:
    """The power-of-two bound of each histogram's highest non-empty bin (``counts``: ``[..., BINS]``):
    ``2^e``, 0 for an empty histogram, ``inf`` where a non-finite amax was seen."""
    seen = counts > 0
    top = jnp.max(jnp.where(seen, jnp.arange(BINS), -1), axis=-1)
    bound = jnp.ldexp(jnp.float32(1), top - _OFFSET)  # exact, where exp2 of an integer need not be
    return jnp.where(top < 0, 0.0, jnp.where(top == _NONFINITE, jnp.inf, bound))


def rolled(history: jax.Array, bounds: jax.Array) -> jax.Array:
    """``history`` ``[..., H]`` with this step's ``bounds`` ``[...]`` first and its oldest entry dropped."""
    return jnp.concatenate([bounds[..., None].astype(history.dtype), history[..., :-1]], axis=-1)


def delayed_scales(history: jax.Array) -> jax.Array:
    """Per operand (``history``: ``[3, H]``), the scale its cast divides by: ``2^(e - m)`` for the history's
    largest bound ``2^e``; 0 where the history is empty (the GEMM then scales by the operand's own amax);
    NaN where it saw a non-finite amax."""
    top = jnp.max(history, axis=-1)
    scale = jnp.stack([jnp.ldexp(top[i], -exponent) for i, exponent in enumerate(_TOPS)])
    return jnp.where(jnp.isinf(top), jnp.nan, scale)


def _advanced(history: jax.Array, histogram: jax.Array, totals: StepTotals) -> jax.Array:
    """The history after a step whose probe's gradient (this rank's) is ``histogram``: each site's
    highest exponent, the largest over the data group, rolled in."""
    return rolled(history, totals.reduce(jax.lax.pmax, observed_bounds(histogram)))


DELAYED_SCALING = ProbedState(HISTORY, OBSERVED, _advanced)


class LayerScaling:
    """What one traced layer's FP8 GEMMs read: their sites' histories and probes, handed out in call order."""

    def __init__(self, history: jax.Array | None, observed: jax.Array | None):
        self.history, self.observed, self.used = history, observed, 0

    def next_site(self, projections: int = 1) -> jax.Array:
        """The site ``[3, 1 + BINS]`` of the GEMM that multiplies by the next ``projections`` (one, or a fused
        kernel's joined matrices): per operand its scale -- from the largest of their histories -- then a
        probe whose gradient reaches each of their sites."""
        site, self.used = self.used, self.used + projections
        if self.history is None:  # counting: the sites are being numbered
            return jnp.zeros((OPERANDS, 1 + BINS), jnp.float32)
        if self.used > self.sites:
            raise ConfigError(f"model.fp8=delayed: a block multiplied by more than the {self.sites} projections counted "
                             "when the model was built; its projections must not depend on the input (call the same "
                             "ones every time, a joined kernel through projection_einsum(..., projections=n))")
        history = jax.lax.stop_gradient(jnp.max(self.history[site:self.used], axis=0))
        probe = jnp.sum(self.observed[site:self.used], axis=0)
        return jnp.concatenate([delayed_scales(history)[:, None], probe], axis=1)

    @property
    def sites(self) -> int:
        return self.history.shape[0]

    def check_complete(self) -> None:
        """Every site was used (or none: the layer ran without FP8 projections)."""
        if self.history is not None and self.used not in (0, self.sites):
            raise ConfigError(f"model.fp8=delayed: a block multiplied by {self.used} projections, {self.sites} were "
                             "counted when the model was built; its projections must not depend on the input")


def current_layer() -> LayerScaling | None:
    """The scaling state of the layer being traced (``None`` outside one, or with no delayed scaling)."""
    return current().fp8_layer


@contextlib.contextmanager
def layer_scaling(block: nnx.Module) -> Iterator[None]:
    """Inside this, ``block``'s FP8 GEMMs take their scales from its history and report into its probe
    (nothing without them: other recipes, or a model built without delayed scaling)."""
    history = getattr(block, HISTORY, None)
    if history is None:
        yield
        return
    scaling = LayerScaling(history[...], getattr(block, OBSERVED)[...])
    with using(fp8_layer=scaling):
        yield
    scaling.check_complete()


@contextlib.contextmanager
def counting_sites() -> Iterator[LayerScaling]:
    """Inside this, each FP8 projection traced counts one site (``.used``) and multiplies as delayed
    scaling's first step does."""
    counter = LayerScaling(None, None)
    with using(fp8="delayed", fp8_layer=counter):
        yield counter


def with_scaling_state(factory: Callable[[nnx.Rngs], nnx.Module], sites: int, history: int
                       ) -> Callable[[nnx.Rngs], nnx.Module]:
    """``factory`` whose model's blocks also carry delayed scaling's state for ``sites`` projections per
    block and ``history`` steps (:data:`HISTORY`, :data:`OBSERVED`)."""

    def make(rngs: nnx.Rngs) -> nnx.Module:
        model = factory(rngs)
        layers = jax.tree.leaves(nnx.state(model.blocks, nnx.Param))[0].shape[0]
        axes = ("layers", None, None, None)
        setattr(model.blocks, HISTORY, Fp8History(
            nnx.with_partitioning(nnx.initializers.zeros_init(), axes)(None, (layers, sites, OPERANDS, history), jnp.float32)))
        setattr(model.blocks, OBSERVED, Fp8Observed(
            nnx.with_partitioning(nnx.initializers.zeros_init(), axes)(None, (layers, sites, OPERANDS, BINS), jnp.float32)))
        setattr(model.blocks, PROBED, (*getattr(model.blocks, PROBED, ()), DELAYED_SCALING))
        return model

    return make
