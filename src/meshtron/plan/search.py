"""Every layout of a model on N GPUs, kept if it fits in memory, ranked by predicted throughput.

The paper chooses layouts by heuristics (§3's takeaways) and says it does not search (§1); with a
cost model the search is cheap, so the planner enumerates the space the heuristics prune and lets
the takeaways explain the winner (:mod:`meshtron.plan.report`). The space: tensor size ``t``
dividing the heads and tiling nodes, at most a node's GPUs (§3.2) unless no such layout fits; pipeline size ``p``
dividing the layers (even stages, as the paper's); ``d = N/(t·p)``; microbatch ``b`` with
``d·b`` dividing the batch (1F1B runs with fewer microbatches than stages too, as Megatron does:
all warmup, then all cooldown); chunks ``v`` dividing the layers per stage (``v > 1``: interleaved,
``p > 2`` and ``m`` a multiple of ``p``, Megatron's conditions); full, selective or no
recomputation; sequence parallelism on every layout with ``t > 1`` when the model runs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from meshtron.errors import ConfigError
from meshtron.plan.cluster import Cluster
from meshtron.plan.model import FP32_GRADIENTS, RECOMPUTE, Gradients, Layout, ModelShape, memory_per_gpu
from meshtron.plan.timing import Estimate, estimate

__all__ = ["MAX_MICROBATCH", "SearchResult", "candidate_layouts", "divisors", "search"]

MAX_MICROBATCH = 16  # beyond this the GEMMs have b·s >= 16 s rows: nothing left to gain, only memory


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(model: ModelShape, gpus: int, global_batch: int, max_tensor: int | None,
                      recompute: tuple[str, ...] = RECOMPUTE, tensor: int | None = None,
                      pipe: int | None = None, node: int | None = None, context: int = 1,
                      sequence_parallel: bool = False, context_attention: str = "gathered",
                      ulysses_degree: int = 1) -> Iterator[Layout]:
    """Every valid :class:`~meshtron.plan.model.Layout` with ``t ≤ max_tensor`` (None: no cap), and
    the given ``tensor`` and ``pipe`` sizes if they are given. With ``node`` (GPUs per node), tensor
    groups tile nodes: ``t`` divides ``node``, or is a multiple of it (Megatron places a tensor
    group on consecutive ranks, so any other size puts some group across two nodes). ``context``: the
    context ranks every layout splits each sequence over (its GPUs are ``t·p·d·context``), exchanging as
    ``context_attention`` and ``ulysses_degree`` say (a tensor size that leaves Ulysses too few heads is
    not a candidate).
    ``sequence_parallel``: every layout with ``t > 1`` runs it (those with ``t = 1`` have nothing to split)."""
    if gpus % context:
        return
    gpus //= context
    for t in divisors(model.heads):
        if gpus % t or (max_tensor is not None and t > max_tensor) or tensor not in (None, t):
            continue
        if node is not None and (node % t if t <= node else t % node):
            continue  # a tensor group straddling a node boundary: its all-reduces would cross the network
        for p in divisors(model.layers):
            if (gpus // t) % p or pipe not in (None, p):
                continue
            d = gpus // (t * p)
            if global_batch % d:
                continue
            for b in divisors(global_batch // d):
                if b > MAX_MICROBATCH:
                    break
                for v in divisors(model.layers // p):
                    if v > 1 and p <= 2:
                        continue  # Megatron's batched sends cannot tell a 2-stage ring's neighbours apart
                    for mode in recompute:
                        layout = Layout(t, p, d, b, global_batch, v, mode, context, sequence_parallel and t > 1,
                                        context_attention, ulysses_degree)
                        if layout.problem(model) is None:
                            yield layout


@dataclass(frozen=True)
class SearchResult:
    """The ranked estimates (fastest first), how many layouts were tried, and how many were dropped
    because they do not fit (by whether the tensor size stayed within a node)."""

    ranked: list[Estimate]
    tried: int
    too_big: int
    beyond_node: bool = False  # no layout with t <= gpus_per_node fits: t was allowed to cross nodes
    dropped: Counter = field(default_factory=Counter)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def search(model: ModelShape, gpus: int, global_batch: int, cluster: Cluster, optimizer: str = "adamw",
           recompute: tuple[str, ...] = RECOMPUTE, tensor: int | None = None,
           pipe: int | None = None, freeze_fraction: float = 0.16, gradients: Gradients = FP32_GRADIENTS,
           context: int = 1, sequence_parallel: bool = False, context_attention: str = "gathered",
           ulysses_degree: int = 1) -> SearchResult:
    """Rank every layout that fits ``cluster``'s usable memory by predicted time per step (for 1-bit
    LAMB the mean over a run, ``freeze_fraction`` of it in the uncompressed warmup); ``tensor`` and
    ``pipe`` pin those sizes (to price one (t, p) with its best chunks, microbatch and mode);
    ``gradients`` says how the training program keeps and exchanges gradients (memory and data time);
    ``context`` splits every sequence over that many ranks in every layout; ``sequence_parallel``
    runs sequence parallelism on every layout with ``t > 1`` (``model.sequence_parallel``).

    Tensor parallelism stays within a node (Takeaway #1) unless nothing fits that way. Ties go to
    the smaller model-parallel size (Takeaway #2), then fewer chunks, then the recomputation mode
    listed first. Raises :class:`~meshtron.config.ConfigError` when no layout exists or fits."""
    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    if global_batch < 1:
        raise ConfigError(f"--batch: must be >= 1, got {global_batch}")
    attempts = 0
    for cap, beyond in ((cluster.gpus_per_node, False), (None, True)):
        tried, too_big, dropped, fitting = 0, 0, Counter(), []
        node = cluster.gpus_per_node if gpus > cluster.gpus_per_node else None  # one node: any t is inside it
        for layout in candidate_layouts(model, gpus, global_batch, cap, recompute, tensor, pipe, node, context,
                                        sequence_parallel, context_attention, ulysses_degree):
            tried += 1
            memory = memory_per_gpu(model, layout, optimizer, gradients)
            if memory.total > cluster.usable_memory_bytes:
                too_big += 1
                dropped[(layout.tensor, layout.pipe)] += 1
                continue
            fitting.append(estimate(model, layout, cluster, optimizer, gradients))
        attempts += tried
        if fitting:
            order = {mode: i for i, mode in enumerate(recompute)}
            fitting.sort(key=lambda e: (float(f"{e.run_seconds(freeze_fraction):.6g}"), e.layout.tensor * e.layout.pipe,
                                        e.layout.chunks, order[e.layout.recompute]))
            return SearchResult(fitting, tried, too_big, beyond, dropped)
    if not attempts:
        raise ConfigError(f"--gpus: no layout of {gpus} GPUs splits this model (heads {model.heads}, layers "
                          f"{model.layers}) and batch {global_batch}; use a GPU count and batch with common factors")
    raise ConfigError(f"--gpus: no layout of this model fits {gpus} GPUs of {cluster.name} "
                      f"({cluster.memory_gb - cluster.reserved_gb:g} GB usable each); use more GPUs")
