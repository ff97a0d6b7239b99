"""What a model adaptation provides, so that the code that builds, traces and trains a model can carry one
without knowing which it is.

An adaptation adds parameters to a model's blocks and applies them while the blocks run, through the
layer hook (:func:`meshtron.models.blocks.layer_parameters`); it says which parameters train and what it
does only in training. LoRA is one (:class:`meshtron.models.lora.LoraSpec`); another (a prefix, IA3, a
frozen embedding with trainable norms) is one class with these five methods, and nothing in
:mod:`meshtron.train` or in a model family changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from flax import nnx

from meshtron.trace_context import LayerView

__all__ = ["Adaptation"]


@runtime_checkable
class Adaptation(Protocol):
    def wrap(self, factory: Callable[[nnx.Rngs], nnx.Module]) -> Callable[[nnx.Rngs], nnx.Module]:
        """``factory`` whose model also carries the adaptation's parameters."""

    def layer_view(self) -> LayerView:
        """The layer scope that applies them while each block runs."""

    def trains(self, name: str) -> bool:
        """Whether the parameter of this dotted name trains (the rest is frozen)."""

    def training(self, seed: int) -> contextlib.AbstractContextManager:
        """What is on only in training (dropout), drawn from ``seed``."""

    def merged(self, params: Any) -> Any:
        """``params`` with the adaptation folded into the model's own parameters (export)."""
