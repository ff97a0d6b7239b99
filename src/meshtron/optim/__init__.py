"""Optimizers: the data-parallel reduction transform, 1-bit LAMB, and the optax chains the trainer uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshtron.config import Config, OptimConfig, TrainConfig, freeze_step
from meshtron.optim.compression import compressed_allreduce
from meshtron.optim.lamb import layerwise_lamb
from meshtron.optim.layout import manual_part, opt_state_specs
from meshtron.optim.masks import decay_from_axes, stacked_from_axes
from meshtron.optim.onebit_lamb import OnebitLamb, OnebitLambState, onebit_lamb
from meshtron.optim.reduce import data_parallel_mean
from meshtron.optim.zero import ZeroPlan
from meshtron.sharding import gradient_axes

__all__ = [
    "OnebitLamb",
    "OnebitLambState",
    "OptimizerSetup",
    "ZeroPlan",
    "build_optimizer",
    "clip_by_global_norm",
    "compressed_allreduce",
    "data_parallel_mean",
    "decay_from_axes",
    "grad_clip_norm",
    "layerwise_lamb",
    "learning_rate_schedule",
    "manual_part",
    "onebit_lamb",
    "opt_state_specs",
    "optimizer_setup",
    "stacked_from_axes",
]


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` then cosine decay to 10% of it at ``steps`` (Megatron/GPT-3 style)."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * 0.1,
    )


_MOMENTS = {"adamw": (0.9, 0.95, 1e-8), "lamb": (0.9, 0.999, 1e-6), "onebit_lamb": (0.9, 0.999, 1e-8)}


def _moments(name: str, optim: OptimConfig) -> tuple[float, float, float]:
    b1, b2, eps = _MOMENTS[name]
    chosen = (optim.b1, optim.b2, optim.eps)
    return tuple(default if value is None else value for value, default in zip(chosen, (b1, b2, eps)))


def grad_clip_norm(cfg: TrainConfig) -> float:
    """``train.grad_clip``, or the optimizer's default: 1.0 for AdamW and LAMB, off for 1-bit LAMB.

    Why off: 1-bit LAMB gets *local* gradients, so clipping acts on each shard's gradient, whose
    norm is larger than the mean's and varies by shard; and once the variance is frozen, an
    always-active clip shrinks the momentum against it and so the steps. Measured on the default
    model (data=8, 300 steps, benchmarks/onebit_lamb.py): held-out loss +4% with local clipping at
    1.0, on par with LAMB without it.
    """
    if cfg.grad_clip is not None:
        return cfg.grad_clip
    return 0.0 if cfg.optimizer == "onebit_lamb" else 1.0


def clip_by_global_norm(max_norm: float, zero: ZeroPlan | None = None) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm``, with the norm of the whole gradient when each data rank holds
    a share of it (``zero``: the plan that split it)."""
    if zero is None or not zero.splits_norms:
        return optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        del params
        squares = zero.sum_squares(jax.tree.map(lambda g: jnp.sum(jnp.square(g)), updates))
        norm = jnp.sqrt(sum(jax.tree.leaves(squares)))
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _clipped(cfg: TrainConfig, base: optax.GradientTransformation, zero: ZeroPlan | None = None):
    norm = grad_clip_norm(cfg)
    return optax.chain(clip_by_global_norm(norm, zero), base) if norm > 0 else base


def build_optimizer(cfg: TrainConfig, axes: Any, optim: OptimConfig | None = None,
                    zero: ZeroPlan | None = None) -> optax.GradientTransformation:
    """Clipping + AdamW or (layerwise) LAMB on the learning-rate schedule; expects reduced gradients.

    ``axes``: the model's logical axes (a tree shaped like the parameters, e.g.
    ``ModelDef.logical_axes()``); weight decay and LAMB's per-layer trust ratios are read from them.
    ``zero``: how gradients, parameters and state are split over ``data`` (norms are then summed
    over the ranks' shares).
    """
    optim = optim or OptimConfig()
    schedule = learning_rate_schedule(cfg)
    if cfg.optimizer == "onebit_lamb":
        raise ValueError("onebit_lamb reduces its own gradients and has two stages: build it with optimizer_setup()")
    b1, b2, eps = _moments(cfg.optimizer, optim)
    decay = decay_from_axes(axes)
    if cfg.optimizer == "adamw":
        base = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=cfg.weight_decay, mask=decay)
    else:
        complete = zero.sum_squares if zero is not None and zero.splits_norms else None
        base = layerwise_lamb(schedule, b1=b1, b2=b2, eps=eps, weight_decay=cfg.weight_decay, mask=decay,
                              stacked=stacked_from_axes(axes), complete_sums=complete)
    return _clipped(cfg, base, zero)


@dataclass(frozen=True)
class OptimizerSetup:
    """What the train step needs from the configured optimizer.

    ``reduction`` averages local gradients over ``data`` (or is ``optax.identity()`` when
    ``transform`` reduces them itself); ``stages`` maps each stage to the extra keyword arguments
    of ``transform.update`` (one stage for AdamW/LAMB; warmup and compression for 1-bit LAMB).
    """

    transform: optax.GradientTransformation
    reduction: optax.GradientTransformation
    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {"train": {}})
    freeze_step: int | None = None

    def stage_at(self, updates_done: int) -> str:
        """The stage of the step that follows ``updates_done`` optimizer updates."""
        if self.freeze_step is None:
            return next(iter(self.stages))
        return "compression" if updates_done >= self.freeze_step else "warmup"


def optimizer_setup(cfg: Config, axes: Any, param_specs: Any = None, zero: ZeroPlan | None = None) -> OptimizerSetup:
    """The configured optimizer for a model with logical ``axes`` (weight decay and per-layer trust
    ratios follow from them: :mod:`meshtron.optim.masks`). For 1-bit LAMB, ``param_specs`` (the parameters' shardings or
    specs) let every device compress its own shard of the momentum under tensor/pipeline
    parallelism; gradient clipping, if asked for, sees each shard's local gradient (as in
    DeepSpeed's compression stage). ``zero``: the optimizer state is split over ``data`` as it says
    (the train step then reduce-scatters the gradients instead of ``reduction``). Both reduce over
    the mesh's gradient group (:func:`meshtron.sharding.gradient_axes`: data, and context when
    ``cfg.mesh`` splits sequences; its sizes must be resolved)."""
    t = cfg.train
    axis = gradient_axes({"data": cfg.mesh.data, "context": cfg.mesh.context})
    if t.optimizer != "onebit_lamb":
        return OptimizerSetup(build_optimizer(t, axes, cfg.optim, zero), data_parallel_mean(axis))
    o = cfg.optim
    b1, b2, eps = _moments("onebit_lamb", o)
    warmup = freeze_step(cfg)
    tx = onebit_lamb(
        learning_rate_schedule(t), freeze_step=warmup, axis_name=axis, b1=b1, b2=b2, eps=eps,
        weight_decay=t.weight_decay, max_coeff=o.max_coeff, min_coeff=o.min_coeff, coeff_beta=o.coeff_beta,
        factor_max=o.factor_max, factor_min=o.factor_min, factor_threshold=o.factor_threshold,
        mask=decay_from_axes(axes), stacked=stacked_from_axes(axes), param_specs=param_specs,
    )
    stages = {"warmup": {"compression_stage": False}, "compression": {"compression_stage": True}}
    return OptimizerSetup(_clipped(t, tx), optax.identity(), stages, warmup)
