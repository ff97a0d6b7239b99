"""Per-parameter optimizer choices read from *logical axes*, never from parameter names.

A model declares what each parameter is through its axis names (``meshtron.models.contract``), so
the optimizer can decide without knowing the model family:

* **stacked**: a leading ``layers`` axis holds one slice per layer: LAMB and 1-bit LAMB compute a
  trust ratio per slice (per layer), not one for the whole stack;
* **weight decay**: on weight matrices and embeddings -- parameters with the model width ``embed``
  and at least one more axis (``[embed, mlp]``, ``[heads, head_dim, embed]``, ``[vocab, embed]``) --
  never on biases or norm scales (one axis, or no ``embed``), as Megatron-LM does.

For a model whose width axis has another name, pass ``hidden=`` that name, or build the masks yourself.
"""

from __future__ import annotations

from typing import Any

import jax

LAYERS = "layers"
STACKED = frozenset({LAYERS, "prefix_layers"})  # the contract's stacked blocks' axis, and its prefix's
Axes = tuple[str | None, ...]


def _map(fn, axes: Any) -> Any:
    return jax.tree.map(fn, axes, is_leaf=lambda x: isinstance(x, tuple))


def stacked_from_axes(axes: Any) -> Any:
    """``True`` where a parameter's first logical axis stacks layers (``layers``, or a prefix's
    ``prefix_layers``; a tree shaped like ``axes``)."""
    return _map(lambda a: bool(a) and a[0] in STACKED, axes)


def decay_from_axes(axes: Any, hidden: str = "embed") -> Any:
    """``True`` for weight matrices and embeddings: ``hidden`` and at least one other axis besides ``layers``."""

    def decays(a: Axes) -> bool:
        own = [n for n in a if n not in STACKED]
        return hidden in own and len(own) >= 2

    return _map(decays, axes)


def tree_or_call(value: Any, params: Any) -> Any:
    """A mask given as a tree, or as a function of the parameters (optax's convention)."""
    return value(params) if callable(value) else value
