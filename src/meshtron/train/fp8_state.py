"""Delayed FP8 scaling's state in checkpoints: a model trained without it, fine-tuned with it.

The step advances the amax history as it does every state read from a probe (:mod:`meshtron.train.probed_state`);
what is particular to it is that a checkpoint written without delayed scaling holds none, and a run that
turns it on starts from an empty history.
"""

from __future__ import annotations

from typing import Any

import jax

from meshtron.models.fp8_scaling import HISTORY, OBSERVED

__all__ = ["holds_scaling_state", "with_fresh_scaling_state", "without_scaling_state"]


def holds_scaling_state(meta: dict[str, Any] | None) -> bool:
    """Whether the checkpoint of the meta record ``meta`` was written by a run with delayed FP8 scaling."""
    config = (meta or {}).get("config") or {}
    return (config.get("model") or {}).get("fp8") == "delayed"


def without_scaling_state(tree: Any) -> Any:
    """A parameter-shaped tree (nested dicts) without delayed FP8 scaling's leaves."""
    if not isinstance(tree, dict):
        return tree
    return {k: without_scaling_state(v) for k, v in tree.items() if k not in (HISTORY, OBSERVED)}


def with_fresh_scaling_state(params: Any, shapes: Any, shardings: Any) -> Any:
    """``params`` (without the state) with delayed FP8 scaling's leaves of ``shapes`` added as zeros -- an
    empty history -- on ``shardings``: a model trained without it, fine-tuned with it."""
    if not isinstance(shapes, dict):
        return params
    out = dict(params)
    for key, shape in shapes.items():
        if key in (HISTORY, OBSERVED):
            out[key] = jax.device_put(jax.numpy.zeros(shape.shape, shape.dtype), shardings[key])
        elif isinstance(shape, dict):
            out[key] = with_fresh_scaling_state(params[key], shape, shardings[key])
    return out
