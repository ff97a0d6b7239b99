"""What model code reads while it is traced besides its arguments: one immutable value, the trace context.

A model's blocks are called as ``block(x, ctx)`` and nothing more, yet how they trace depends on the
run: which rules table lays out activations, which attention backend and context-parallel exchange
attention uses, whether attention cores are recomputed, which views and hooks turn a layer's stored
parameters into the block that runs, which packed documents attention masks by, adapter dropout, how
auxiliary losses are seeded and where blocks' reports go. Threading all of that through every model
would put the trainer's choices into every user's code, so the trainer sets them here and the few
functions that need one read it (:mod:`meshtron.sharding`, :mod:`meshtron.models.attention`, ...).

All of it is one frozen :class:`TraceContext` in one ``ContextVar``: :func:`using` replaces fields for
the duration of a ``with`` block (the inner block wins, and leaving it restores the outer value),
:func:`current` reads it. Values are read when JAX traces the code, which happens in the thread that
calls the transformation, inside the ``with`` block that wraps it.

This module imports nothing of meshtron: every floor above may read the context.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

__all__ = ["GatheredShard", "LayerView", "TraceContext", "current", "using"]


@dataclasses.dataclass(frozen=True)
class LayerView:
    """One :func:`meshtron.models.blocks.layer_parameters` scope: ``view`` maps a layer's stored
    parameters (a pure dict) to those its block runs on, ``hook(block, x)`` may change the block built
    from them before it runs, ``unsaved`` names what either makes that a layer's backward recomputes."""

    view: Callable[[dict], dict] | None
    unsaved: str | None
    hook: Callable[[Any, Any], None] | None
    adaptation: bool = False  # a model adaptation's (LoRA's adapters): left out where the frozen base runs alone


@dataclasses.dataclass(frozen=True)
class GatheredShard:
    """Where a parameter a layer view gathered whole came from, for what multiplies by it in FP8: ``shard``,
    this rank's share as held; ``gather(a)``, an array shaped like ``shard`` (its quantized bytes)
    gathered whole as the view gathers the parameter; ``group_max(s)``, a scalar's maximum over the
    ranks that hold the shares. Quantizing the shard with the whole tensor's scale and gathering the
    bytes gives what quantizing the gathered parameter gives, for half a bf16 gather's traffic."""

    shard: Any
    gather: Callable[[Any], Any]
    group_max: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class TraceContext:
    """The run's choices that model code reads while traced (defaults: no choice made).

    ``rules``: the logical -> mesh axis table activations are constrained by (``None``: meshtron's
    default, :data:`meshtron.sharding.MEGATRON_RULES`).
    ``attention``: the attention backend when a call names none (``None``: JAX's choice).
    ``recompute_core``: attention cores keep only their inputs for the backward (``remat=selective``).
    ``fp8``: the recipe projections multiply by (``off``: their own dtype; ``current``/``delayed``: FP8 GEMMs).
    ``fp8_layer``: under ``delayed``, the scaling state of the layer being traced
    (:class:`meshtron.models.fp8_scaling.LayerScaling`; ``None`` outside a layer).
    ``loss_groups``: how many groups of rows (microbatches x data ranks) the step averages its loss over,
    each group's loss a mean of its own: a backward's output gradients are about that many times the
    whole batch's (delayed FP8 scaling records them in the whole batch's units).
    ``exchange``: how attention over a split sequence exchanges keys and values.
    ``ulysses_degree``: under the ``hybrid`` exchange, how many consecutive context ranks its all-to-alls join.
    ``collective_matmul``: the tensor-parallel regions' projections gather and scatter a split residual
    stream themselves, overlapped with their GEMMs (:mod:`meshtron.models.collective_matmul`).
    ``layer_views``: the active layer views, outermost first.
    ``fp8_weights``: while a layer is traced under FP8, its weights quantized beforehand, one entry per
    projection in the order they run (:class:`meshtron.models.fp8.PreparedWeights`), or what records them
    (``None``: each projection quantizes its weight itself).
    ``cast_weights``: while a layer is traced, its projections' weights in the compute dtype made beforehand,
    one entry per projection in the order they run (:class:`meshtron.models.cast_weights.PreparedCasts`), or
    what records them (``None``: each projection casts its weight itself).
    ``gathered``: while a layer is traced under FP8 with layer views, what the views gathered: by ``id`` of
    the gathered array, that array (which tells the value is still that one) and its
    :class:`GatheredShard` (``None``: nothing is recorded).
    ``segments``: packed documents' segment ids that whole-sequence attention masks by.
    ``dropout``: adapter dropout's ``(rate, seed)``.
    ``reference_rows``: the second half of every batch's rows repeats the first for a frozen reference
    model (DPO's, in a pipeline): a model adaptation adds nothing to those rows.
    ``aux_scale``: what auxiliary losses' gradient seeds are multiplied by.
    ``reports``: where blocks' reports are collected (``None``: dropped).
    ``pins``: the logical axes each live value was last constrained to, by ``id`` (with a weak
    reference that tells the value is still that one); one table shared by every context.
    """

    rules: tuple[tuple[str, str | None], ...] | None = None
    attention: str | None = None
    recompute_core: bool = False
    fp8: str = "off"
    fp8_layer: Any = None
    loss_groups: int = 1
    exchange: str = "gathered"
    ulysses_degree: int = 1
    collective_matmul: bool = False
    gradient_accumulation_fusion: bool = False
    layer_views: tuple[LayerView, ...] = ()
    fp8_weights: Any = None
    cast_weights: Any = None
    gathered: dict[int, tuple[Any, GatheredShard]] | None = None
    segments: Any = None
    dropout: tuple[float, int] = (0.0, 0)
    reference_rows: bool = False
    aux_scale: float = 1.0
    reports: list[Any] | None = None
    pins: dict[int, tuple[Any, tuple[str | None, ...]]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False)


# Every context derives from this root (in every thread), so all share its one pins table, as they must:
# a value pinned under one context is the same value under another.
_current: ContextVar[TraceContext] = ContextVar("meshtron_trace_context", default=TraceContext())  # noqa: B039


def current() -> TraceContext:
    """The trace context in force here."""
    return _current.get()


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[TraceContext]:
    """Inside the block, the current context with ``changes`` (fields of :class:`TraceContext`) made."""
    token = _current.set(dataclasses.replace(_current.get(), **changes))
    try:
        yield _current.get()
    finally:
        _current.reset(token)
