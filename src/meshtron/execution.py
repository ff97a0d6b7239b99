"""How a run executes a model's code, as opposed to what the model is: one frozen value built once from
the run.

A :class:`meshtron.train.state.ModelDef` is a model's structure -- its modules, parameter shapes, the
rules table that lays them out, an adaptation's added parameters -- and the same structure runs under
many runs. What differs between those runs without changing a single parameter is here: whether
blocks or attention cores are recomputed in the backward pass (``model.remat``), which
``jax.nn.dot_product_attention`` implementation attention uses (``model.attention``), how attention
over a sequence split across devices exchanges keys and values (``parallel.context_attention``), and
the training window that generation sees by default (``model.seq_len``). Keeping them off the model's
structure lets one model definition serve a training run, a sampler and a parity check that each
execute it their own way, and gives every consumer the switches from one place
(:attr:`meshtron.run.Run.execution`, or :meth:`Execution.of_model_config`).

Pure Python and no JAX: it imports only the package's ground floor (:mod:`meshtron.trace_context`, and
:mod:`meshtron.megatron` for the recompute modes' names), so the CLI may build it before JAX starts and
every floor above may read it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from meshtron.megatron import REMAT_MODES as MEGATRON_REMAT_MODES
from meshtron.trace_context import TraceContext, using

__all__ = ["DEFAULT_EXECUTION", "EXCHANGES", "FP8_RECIPES", "REMAT_MODES", "Execution", "checked_exchange"]

REMAT_MODES = (*MEGATRON_REMAT_MODES, "offload")
"""``model.remat``: Megatron's recomputation modes, and ``offload`` -- what ``full`` keeps (each block's
input) kept in pinned host memory instead of on the device."""
FP8_RECIPES = ("off", "current", "delayed")  # model.fp8: projections in their own dtype, or FP8 GEMMs scaled per
# tensor by its own amax now, or by an amax history (models/fp8.py, models/fp8_scaling.py)
# parallel.context_attention: keys and values all-gathered, or passed round a ring; or heads and sequence swapped by
# all-to-alls over every context rank (ulysses) or over parallel.ulysses_degree of them, a ring across (hybrid)
EXCHANGES = ("gathered", "ring", "ulysses", "hybrid")


class _RunModelSettings(Protocol):
    """What :meth:`Execution.of_model_config` reads of a run's ``model`` section
    (:class:`meshtron.config.ModelConfig`, which this module does not import: the config imports it)."""

    @property
    def remat(self) -> str: ...
    @property
    def attention(self) -> str | None: ...
    @property
    def context_attention(self) -> str: ...
    @property
    def ulysses_degree(self) -> int: ...
    @property
    def seq_len(self) -> int | None: ...
    @property
    def fp8(self) -> str: ...
    @property
    def collective_matmul(self) -> bool: ...
    @property
    def gradient_accumulation_fusion(self) -> bool: ...
    @property
    def cast_once(self) -> bool: ...


@dataclass(frozen=True)
class Execution:
    """The run's switches for executing a model's code (defaults: a model traced on its own).

    ``remat``: ``none``, ``full`` (each block recomputed in the backward pass), ``selective`` (only
    attention cores recomputed) or ``offload`` (``full`` with each block's input kept in pinned host
    memory). ``attention``: ``jax.nn.dot_product_attention``'s implementation
    (``None``: JAX's choice). ``context_attention``: the exchange over a split sequence (:data:`EXCHANGES`);
    ``ulysses_degree``: the context ranks the hybrid's all-to-alls join. ``fp8``: the recipe the blocks' projections multiply by (:data:`FP8_RECIPES`,
    :mod:`meshtron.models.fp8`). ``window``: the run's ``model.seq_len``, the context generation sees by default
    (:meth:`context`; ``None``: the model's own limit). ``collective_matmul``: under sequence parallelism
    the blocks' projections gather and reduce-scatter the residual stream as rings overlapped with their
    GEMMs (:mod:`meshtron.models.collective_matmul`). ``cast_once``: a pipeline stage casts its projection
    weights to the compute dtype once per step (:mod:`meshtron.models.cast_weights`)."""

    remat: str = "none"
    attention: str | None = None
    context_attention: str = "gathered"
    window: int | None = None
    fp8: str = "off"
    collective_matmul: bool = False
    ulysses_degree: int = 1
    gradient_accumulation_fusion: bool = False
    cast_once: bool = False

    def __post_init__(self) -> None:
        if self.remat not in REMAT_MODES:
            raise ValueError(f"model.remat: must be one of {', '.join(REMAT_MODES)}, got {self.remat!r}")
        checked_exchange(self.context_attention)
        if not isinstance(self.ulysses_degree, int) or self.ulysses_degree < 1:
            raise ValueError(f"parallel.ulysses_degree: must be a whole number >= 1, got {self.ulysses_degree!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"model.fp8: must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")

    @classmethod
    def of_model_config(cls, model: _RunModelSettings) -> Execution:
        """The switches a run's ``model`` section (``cfg.model``) sets."""
        return cls(remat=model.remat, attention=model.attention, context_attention=model.context_attention,
                   ulysses_degree=model.ulysses_degree, fp8=model.fp8, window=model.seq_len, collective_matmul=model.collective_matmul,
                   gradient_accumulation_fusion=model.gradient_accumulation_fusion, cast_once=model.cast_once)

    def scope(self) -> contextlib.AbstractContextManager[TraceContext]:
        """Inside this, traced model code runs as these switches say: attention through this
        implementation and, over a split sequence, this exchange; attention cores keep only their inputs
        for the backward under ``remat=selective`` (``full`` and ``offload`` are applied where blocks run:
        :func:`meshtron.models.blocks.run_blocks`)."""
        return using(attention=self.attention, recompute_core=self.remat == "selective",
                     exchange=self.context_attention,
                     ulysses_degree=self.ulysses_degree, fp8=self.fp8, collective_matmul=self.collective_matmul,
                     gradient_accumulation_fusion=self.gradient_accumulation_fusion)

    def context(self, max_len: int | None) -> int | None:
        """How many tokens generation sees by default: the training window, within the model's
        ``max_len`` (either alone when only one is known)."""
        if self.window is None:
            return max_len
        return self.window if max_len is None else min(self.window, max_len)


def checked_exchange(name: str) -> str:
    """``name`` if it is one of :data:`EXCHANGES`, else a ``ValueError`` that says which are."""
    if name not in EXCHANGES:
        raise ValueError(f"parallel.context_attention: must be one of {', '.join(EXCHANGES)}, got {name!r}")
    return name


DEFAULT_EXECUTION = Execution()
"""A model traced on its own (the default of every function that takes an execution): nothing
recomputed, JAX's attention implementation, keys and values gathered, no training window."""
