"""Optimizers: the data-parallel reduction transform and the optax chains the trainer uses."""

from __future__ import annotations

import jax
import optax

from meshtron.config import TrainConfig
from meshtron.optim.lamb import layerwise_lamb
from meshtron.optim.reduce import data_parallel_mean

__all__ = ["build_optimizer", "data_parallel_mean", "decay_mask", "layerwise_lamb", "learning_rate_schedule"]


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` then cosine decay to 10% of it at ``steps`` (Megatron/GPT-3 style)."""
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.lr * 0.1,
    )


def decay_mask(params) -> dict:
    """Weight decay on matrices (kernels and embeddings) only, never on biases or LayerNorm (as Megatron)."""

    def wants_decay(path, _leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return name in ("kernel", "wte", "wpe")

    return jax.tree_util.tree_map_with_path(wants_decay, params)


def build_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clipping + AdamW or (layerwise) LAMB on the learning-rate schedule; expects reduced gradients."""
    schedule = learning_rate_schedule(cfg)
    if cfg.optimizer == "adamw":
        base = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=cfg.weight_decay, mask=decay_mask)
    else:
        base = layerwise_lamb(schedule, b1=0.9, b2=0.999, eps=1e-6, weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), base)
    return base
