"""The built-in model families by name, each with the import paths of what it provides.

One table: ``model.family``'s valid names (:mod:`meshtron.config` checks them), and per family its
model code, its Hugging Face mapping and its counts. Everything is named by import path, exactly like
a user's ``model.factory``, and loaded when asked for, so nothing that reads this table (the config,
the trainer through :mod:`meshtron.models.registry`, ``describe``, the planner) imports a family.

A family's three modules:

* ``module``: ``build(cfg, rngs, *, tensor) -> nnx.Module`` and optionally ``extra_rules(cfg, tensor)``
  (JAX; :mod:`meshtron.models.registry` says more);
* ``hf_mapping``: its Hugging Face mapping (no JAX, no torch; :mod:`meshtron.models.hf_mapping`);
* ``counts``: its numbers, pure Python (the planner and the step-memory model run without JAX):
  ``BLOCK`` (the :class:`meshtron.megatron.BlockActivations` its block keeps for the backward),
  ``PAPER_GPT`` (whether it is the PTD-P paper's GPT, the one :mod:`meshtron.plan` prices),
  ``kv_heads(model_config)``, and per tensor rank ``block_parameters(shape, tensor)``,
  ``other_parameters(shape, vocab, tensor)`` and ``weight_boundary(shape, tensor)``
  (:mod:`meshtron.plan.step_memory`'s terms; ``shape`` a :class:`meshtron.plan.step_memory.StepShape`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

__all__ = ["FACTORY_STAND_IN", "FAMILIES", "Family"]


@dataclass(frozen=True)
class Family:
    """A built-in family: its name (``model.family``) and its modules' import paths."""

    name: str
    module: str
    hf_mapping: str | None
    counts: str

    def load_module(self) -> ModuleType:
        return importlib.import_module(self.module)

    def load_hf_mapping(self) -> ModuleType:
        assert self.hf_mapping is not None, f"{self.name} has no Hugging Face mapping"
        return importlib.import_module(self.hf_mapping)

    def load_counts(self) -> ModuleType:
        return importlib.import_module(self.counts)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt", "meshtron.models.gpt", "meshtron.models.gpt_hf", "meshtron.models.gpt_counts"),
    Family("llama", "meshtron.models.llama", "meshtron.models.llama_hf", "meshtron.models.llama_counts"),
    Family("deepseek", "meshtron.models.deepseek", "meshtron.models.deepseek_hf", "meshtron.models.deepseek_counts"),
)}

FACTORY_STAND_IN = "gpt"
"""The family whose block counts stand for a user's model (``model.factory``) where only a block's
shape is known: ``describe`` prices such a model's activations with them (its parameters it counts)."""
