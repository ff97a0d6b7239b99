"""``meshtron plan``'s answer: the ranked table, the reasons in the paper's terms, and what 1-bit
LAMB would buy on this network.

The search (:mod:`meshtron.plan.search`) prices every layout; this module explains the winner the
way §3 of Narayanan et al. (SC21) reasons, each takeaway checked against the alternatives the
search actually priced rather than asserted: tensor parallelism within a node (#1), the smallest
model-parallel size that fits (#2), the microbatch size (#3), interleaving against its extra
point-to-point traffic (§2.2.2), and recomputation (§3.5). The optimizer section prices the chosen
layout's data-parallel exchange with each optimizer and, for 1-bit LAMB (Li et al. 2021), the
speedup of its compression stage and over a whole run that spends ``freeze_fraction`` of its steps
in the uncompressed warmup.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshtron.config import OPTIMIZERS
from meshtron.errors import ConfigError
from meshtron.plan.cluster import Cluster
from meshtron.plan.model import (
    FP32_GRADIENTS,
    MEMORY_MODEL,
    RECOMPUTE,
    Gradients,
    ModelShape,
    exchange_words,
    flops_per_iteration,
    parameter_count,
)
from meshtron.plan.search import SearchResult, search
from meshtron.plan.step_memory import layout_step_memory
from meshtron.plan.timing import Estimate, estimate

__all__ = ["OptimizerRow", "Plan", "make_plan", "onebit_summary", "optimizer_rows", "reasons", "render"]


@dataclass(frozen=True)
class OptimizerRow:
    """One optimizer on its own best layout (``estimate``; None when no layout fits its state). For
    1-bit LAMB the estimate's step is its compression stage; ``warmup_seconds`` is its uncompressed
    warmup step on the same layout and ``run_seconds`` the mean over a run with ``freeze_fraction``
    of warmup. For the others both are the step."""

    optimizer: str
    estimate: Estimate | None
    warmup_seconds: float
    run_seconds: float


@dataclass(frozen=True)
class Plan:
    """Everything ``meshtron plan`` prints, for a caller that wants the numbers (``--json``)."""

    model: ModelShape
    gpus: int
    global_batch: int
    cluster: Cluster
    optimizer: str
    result: SearchResult
    optimizers: list[OptimizerRow]
    reasons: list[str]
    freeze_fraction: float
    gradients: Gradients = FP32_GRADIENTS

    def meshtron_gb(self, e: Estimate) -> float | None:
        """GB per GPU of meshtron's own step on this layout (:func:`~meshtron.plan.step_memory.layout_step_memory`),
        None where its schedule tables cannot run it, or where that function does not model the layout
        (it counts the paper's GPT without sequence parallelism)."""
        zero = 0 if self.optimizer == "onebit_lamb" else self.gradients.zero
        if self.model.family != "gpt" or e.layout.sequence_parallel:
            return None
        memory = layout_step_memory(self.model, e.layout, self.optimizer, zero)
        return None if memory is None else memory.peak / 1e9

    def to_dict(self, top: int = 10) -> dict:
        def layout(e: Estimate) -> dict:
            lay = e.layout
            return {"tensor": lay.tensor, "pipe": lay.pipe, "data": lay.data, "context": lay.context,
                    "context_attention": lay.context_attention, "ulysses_degree": lay.ulysses_degree,
                    "chunks": lay.chunks, "sequence_parallel": lay.sequence_parallel,
                    "microbatch": lay.microbatch, "microbatches": lay.microbatches, "recompute": lay.recompute,
                    "memory_gb": e.memory.total / 1e9, "meshtron_memory_gb": self.meshtron_gb(e),
                    "tflops_per_gpu": e.tflops_per_gpu,
                    "step_seconds": e.step_seconds, "bubble": e.bubble,
                    "communication_share": e.communication_share, "data_bytes": e.data_bytes,
                    "recompute_seconds": e.recompute_seconds, "seconds": dict(e.seconds), "priced_by": e.priced_by}

        return {
            "model": {"parameters": parameter_count(self.model), "family": self.model.family,
                      "layers": self.model.layers, "hidden": self.model.hidden, "heads": self.model.heads,
                      "kv_heads": self.model.kv_heads, "mlp_dim": self.model.mlp_dim, "seq_len": self.model.seq_len,
                      "vocab_size": self.model.vocab_size},
            "gpus": self.gpus, "global_batch": self.global_batch, "cluster": self.cluster.name,
            "optimizer": self.optimizer, "layouts_tried": self.result.tried, "too_big": self.result.too_big,
            "ranked": [layout(e) for e in self.result.ranked[:top]],
            "optimizers": [{"optimizer": row.optimizer, **(layout(row.estimate) if row.estimate else {}),
                            "warmup_seconds": row.warmup_seconds, "run_seconds": row.run_seconds}
                           for row in self.optimizers],
            "freeze_fraction": self.freeze_fraction,
            "gradients": dataclasses.asdict(self.gradients),
            "reasons": self.reasons,
        }


def make_plan(model: ModelShape, gpus: int, global_batch: int, cluster: Cluster, optimizer: str = "adamw",
              recompute: tuple[str, ...] = RECOMPUTE, freeze_fraction: float = 0.16,
              gradients: Gradients = FP32_GRADIENTS, context: int = 1, sequence_parallel: bool = False,
              context_attention: str = "gathered", ulysses_degree: int = 1) -> Plan:
    """Search, explain the winner, and price every optimizer on its own best layout (``context``:
    every layout splits each sequence over that many ranks, exchanging as ``context_attention`` and
    ``ulysses_degree`` say; ``sequence_parallel``: every layout with ``t > 1`` runs it)."""
    result = search(model, gpus, global_batch, cluster, optimizer, recompute,
                    freeze_fraction=freeze_fraction, gradients=gradients, context=context,
                    sequence_parallel=sequence_parallel, context_attention=context_attention,
                    ulysses_degree=ulysses_degree)
    rows = optimizer_rows(model, gpus, global_batch, cluster, recompute, freeze_fraction,
                          known={optimizer: result.best}, gradients=gradients, context=context,
                          sequence_parallel=sequence_parallel, context_attention=context_attention,
                          ulysses_degree=ulysses_degree)
    return Plan(model, gpus, global_batch, cluster, optimizer, result, rows,
                reasons(model, result, cluster, freeze_fraction), freeze_fraction, gradients)


def optimizer_rows(model: ModelShape, gpus: int, global_batch: int, cluster: Cluster,
                   recompute: tuple[str, ...] = RECOMPUTE, freeze_fraction: float = 0.16,
                   known: dict[str, Estimate] | None = None,
                   gradients: Gradients = FP32_GRADIENTS, context: int = 1,
                   sequence_parallel: bool = False, context_attention: str = "gathered",
                   ulysses_degree: int = 1) -> list[OptimizerRow]:
    """AdamW, LAMB and 1-bit LAMB, each on the layout the search ranks first for it: 1-bit LAMB's
    extra state may force another layout, and its compressed exchange may favour more data
    parallelism, so comparing both on one layout would misstate the choice. 1-bit LAMB is ranked by
    its run mean ``f·t_warmup + (1−f)·t_compressed`` (its warmup exchanges the gradients
    uncompressed, as LAMB does, on the same layout)."""
    rows = []
    for name in OPTIMIZERS:
        best = (known or {}).get(name)
        if best is None:
            # 1-bit LAMB keeps its state whole (zero=0): it is priced so beside a split optimizer state
            own = dataclasses.replace(gradients, zero=0) if name == "onebit_lamb" else gradients
            try:
                best = search(model, gpus, global_batch, cluster, name, recompute,
                              freeze_fraction=freeze_fraction, gradients=own, context=context,
                              sequence_parallel=sequence_parallel, context_attention=context_attention,
                              ulysses_degree=ulysses_degree).best
            except ConfigError:  # nothing fits this optimizer's state
                rows.append(OptimizerRow(name, None, math.inf, math.inf))
                continue
        warm = best.warmup_seconds if best.warmup_seconds is not None else best.step_seconds
        rows.append(OptimizerRow(name, best, warm, best.run_seconds(freeze_fraction)))
    return rows


def _best_by(ranked: list[Estimate], key) -> dict:
    out: dict = {}
    for e in ranked:  # ranked fastest first: the first of each key is its best
        out.setdefault(key(e.layout), e)
    return out


def _speed(e: Estimate, freeze_fraction: float) -> float:
    """TF/s per GPU over a run (eq. 3's FLOPs): the step's, or 1-bit LAMB's mean with its warmup."""
    return e.tflops_per_gpu * e.step_seconds / e.run_seconds(freeze_fraction)


def _slower(e: Estimate, best: Estimate, freeze_fraction: float) -> str:
    return f"{1 - best.run_seconds(freeze_fraction) / e.run_seconds(freeze_fraction):.1%} slower"


def _describe(e: Estimate, freeze_fraction: float) -> str:
    lay = e.layout
    return (f"t={lay.tensor} p={lay.pipe} v={lay.chunks} b={lay.microbatch} {lay.recompute} "
            f"({_speed(e, freeze_fraction):.0f} TF/s)")


def reasons(model: ModelShape, result: SearchResult, cluster: Cluster, freeze_fraction: float = 0.16) -> list[str]:
    """Why the best layout won, one sentence per takeaway, each against the best priced alternative
    (compared by time per step, for 1-bit LAMB the mean over a run with ``freeze_fraction`` of warmup)."""
    f = freeze_fraction
    best = result.best
    lay = best.layout
    g = cluster.gpus_per_node
    lines = []
    by_tp = _best_by(result.ranked, lambda x: (x.tensor, x.pipe))

    # Takeaway #1: tensor parallelism within a node, then pipeline across nodes.
    tensor_share = best.seconds["tensor"] / best.step_seconds
    wider = [e for (t, p), e in by_tp.items() if t > lay.tensor]
    if result.beyond_node:
        text = (f"Takeaway #1 (tensor parallelism within a node) cannot hold: no layout with t <= {g} fits "
                f"in {cluster.memory_gb - cluster.reserved_gb:g} GB, so t={lay.tensor} crosses nodes and its "
                f"all-reduces ({tensor_share:.0%} of the step) run over the network")
    elif lay.tensor == 1:
        text = "Takeaway #1: no tensor parallelism is needed (t=1: no all-reduces inside the layers)"
    else:
        text = (f"Takeaway #1: t={lay.tensor} keeps the tensor all-reduces on NVLink within an {g}-GPU node "
                f"({tensor_share:.0%} of the step)")
    if wider and not result.beyond_node:
        alt = min(wider, key=lambda e: e.run_seconds(f))
        text += (f"; a wider split runs more all-reduces per FLOP and smaller GEMMs: the best with "
                 f"t={alt.layout.tensor} is {_describe(alt, f)}, {_slower(alt, best, f)}")
    lines.append(text + ".")

    # Takeaway #2: the smallest model-parallel size that fits.
    smallest = min(t * p for t, p in by_tp)
    m_size = lay.tensor * lay.pipe
    smaller = [t * p for (t, p) in result.dropped if t * p < smallest]
    fits = (f"; smaller ones (M={max(smaller)}) do not fit in memory" if smaller else
            " (no smaller one splits this batch and these layers)" if smallest > 1 else "")
    if m_size == smallest:
        data = (f"the other {lay.data}-way split is data parallelism, which communicates once per batch"
                if lay.data > 1 else "no GPUs are left for data parallelism")
        lines.append(f"Takeaway #2: M = t·p = {m_size} is the smallest model-parallel size that fits{fits}; {data}.")
    else:
        alt = min((e for (t, p), e in by_tp.items() if t * p == smallest), key=lambda e: e.run_seconds(f))
        lines.append(f"Takeaway #2 bends: the smallest model-parallel size that fits is M={smallest}{fits} "
                     f"({_describe(alt, f)}, {_slower(alt, best, f)}); M={m_size} wins with " + _why_larger(alt, best) + ".")

    # Takeaway #3: microbatch size, the same (t, p, v, recompute) at other b.
    same = [e for e in result.ranked if (e.layout.tensor, e.layout.pipe, e.layout.chunks, e.layout.recompute)
            == (lay.tensor, lay.pipe, lay.chunks, lay.recompute)]
    alts = _best_by(same, lambda x: x.microbatch)
    others = sorted(set(alts) - {lay.microbatch})
    text = f"Takeaway #3: microbatch b={lay.microbatch} ({lay.microbatches} microbatches per pipeline)"
    if others:
        text += "; " + ", ".join(f"b={b}: {_speed(alts[b], f):.1f} TF/s" for b in others[:4])
        tied = [b for b in others if math.isclose(alts[b].run_seconds(f), best.run_seconds(f), rel_tol=1e-6)]
        if tied:
            text += f" (b={', '.join(map(str, tied))} ties: the GEMMs are too small for a larger b to help)"
        elif lay.pipe > 1:
            text += (" -- a larger b runs more efficient GEMMs but, with the batch fixed, leaves fewer microbatches "
                     "to fill the pipeline (eq. 1's bubble (p−1)/m)")
        else:
            text += " -- a larger b runs more efficient GEMMs, a smaller one less efficient ones"
    else:
        text += ", the only size that fits with this (t, p, v, recompute)"
    lines.append(text + ".")

    # Interleaving (§2.2.2).
    if lay.pipe > 1:
        same_tp = [e for e in result.ranked if (e.layout.tensor, e.layout.pipe) == (lay.tensor, lay.pipe)]
        one = f"(p−1)/(v·m) = {best.bubble:.1%}"
        if lay.chunks > 1:
            plain = [e for e in same_tp if e.layout.chunks == 1]
            text = (f"Interleaving: v={lay.chunks} chunks per stage cut the bubble to {one} "
                    f"from {(lay.pipe - 1) / lay.microbatches:.1%} at the cost of {lay.chunks}x the pipeline "
                    f"traffic ({best.seconds['pipe'] / best.step_seconds:.1%} of the step)")
            if plain:
                text += f"; the best non-interleaved layout is {_describe(plain[0], f)}, {_slower(plain[0], best, f)}"
        elif any(e.layout.chunks > 1 for e in same_tp):
            text = (f"No interleaving: the bubble (p−1)/m = {best.bubble:.1%} is small enough that more chunks' "
                    "extra point-to-point traffic does not pay")
        else:
            text = (f"No interleaving: not possible here (it needs p > 2, m a multiple of p and more than one "
                    f"layer per stage); the bubble is (p−1)/m = {best.bubble:.1%}")
        lines.append(text + ".")

    # Recomputation (§3.5).
    modes = _best_by([e for e in result.ranked if (e.layout.tensor, e.layout.pipe) == (lay.tensor, lay.pipe)],
                     lambda x: x.recompute)
    priced = [mode for mode in RECOMPUTE if mode in modes and mode != lay.recompute]
    text = f"Recomputation: {lay.recompute}"
    if lay.recompute == "full":
        text += " (each layer's forward runs again in the backward, 4/3 of its GEMM FLOPs, §3.5)"
    elif lay.recompute == "selective":
        text += " (only the attention core runs again in the backward, Korthikanti et al. 2022)"
    text += f", {best.recompute_seconds / best.step_seconds:.1%} of the step" if lay.recompute != "none" else ""
    if priced:
        text += "; " + ", ".join(f"{mode}: best {_describe(modes[mode], f)}" for mode in priced)
        text += "; full recomputation frees memory for larger microbatches" if lay.recompute == "full" else ""
    lines.append(text + ".")
    return lines


def _why_larger(small: Estimate, large: Estimate) -> str:
    """The terms in which the larger model-parallel layout spends less time, largest first, as shares
    of the smaller layout's step."""
    saved = {name: (small.seconds[name] - large.seconds[name]) / small.step_seconds for name in small.seconds}
    labels = {"gemm": "GEMM time", "elementwise": "element-wise time", "tensor": "tensor all-reduce time",
              "pipe": "pipeline exchange time", "bubble": "pipeline bubble", "data": "data-parallel all-reduce time",
              "optimizer": "optimizer time", "host": "host step overhead"}
    top = [name for name, gain in sorted(saved.items(), key=lambda kv: -kv[1]) if gain > 0.005][:2]
    if not top:
        return "terms that add up to less"
    return " and ".join(f"less {labels[name]} ({saved[name]:.1%} of the step)" for name in top)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _count(n: float) -> str:
    """1.65B, 840.19M, 1.01T."""
    return next(f"{n / scale:.2f}{unit}" for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
                if n >= scale or scale == 1)


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(plan: Plan, top: int = 10) -> str:
    """The text ``meshtron plan`` prints."""
    model, cluster, result = plan.model, plan.cluster, plan.result
    if model.family == "gpt":
        what, counts = "parameters (eq. 2)", "(eq. 3)"
        heads = f"{model.heads} heads"
    else:
        what, counts = f"parameters ({model.family}: SwiGLU MLP {model.mlp_dim}, untied head)", "(recomputing every layer)"
        heads = f"{model.heads} heads ({model.kv_heads} kv)"
    out = [
        (f"model     {_count(parameter_count(model))} {what}: {model.layers} layers, hidden {model.hidden}, "
        f"{heads}, seq {model.seq_len}, vocab {model.vocab_size}; "
        f"{flops_per_iteration(model, plan.global_batch):.3g} FLOPs per batch of {plan.global_batch} {counts}"),
        (f"cluster   {cluster.name}: {plan.gpus} GPUs, {cluster.gpus_per_node} per node, {cluster.peak_tflops:g} TF/s "
        f"peak, {cluster.memory_gb:g} GB ({cluster.memory_gb - cluster.reserved_gb:g} usable), NVLink "
        f"{cluster.nvlink_gbps:g} GB/s, network {cluster.network_gbps:g} GB/s per node"),
        (f"searched  {result.tried} layouts, {result.too_big} do not fit; optimizer {plan.optimizer}; "
         + (f"every sequence split over {result.best.layout.context} context ranks "
            f"({exchange_words(result.best.layout)}); "
            if result.best.layout.context > 1 else "")
         + ("sequence parallelism on every layout with t > 1; "
            if any(e.layout.sequence_parallel for e in result.ranked) else "")
         + f"gradients all-reduced in {8 * plan.gradients.element_bytes} bits"
         + (f"; zero={plan.gradients.zero} (split over data: "
            f"{'optimizer state' if plan.gradients.zero == 1 else 'weights, gradients and optimizer state'})"
            if plan.gradients.zero else "")),
        f"memory    {MEMORY_MODEL} (meshtron describe counts a run as configured)",
        "",
    ]
    header = ["#", "t", "p", "d", "v", "b", "m", "recompute", "GB/GPU", "meshtron GB", "TF/s/GPU*", "step s",
              "recompute s", "bubble", "comm", "GB over data (lamb)", "GB over data (1-bit)", "priced by"]
    rows = []
    for i, e in enumerate(result.ranked[:top], 1):
        lay = e.layout
        fp32 = estimate(plan.model, lay, cluster, "lamb", gradients=plan.gradients).data_bytes
        onebit = estimate(plan.model, lay, cluster, "onebit_lamb",
                          gradients=dataclasses.replace(plan.gradients, zero=0)).data_bytes
        rows.append([i, lay.tensor, lay.pipe, lay.data, lay.chunks, lay.microbatch, lay.microbatches, lay.recompute,
                     f"{e.memory.total / 1e9:.1f}", _gb(plan.meshtron_gb(e)), f"{_speed(e, plan.freeze_fraction):.1f}",
                     f"{e.run_seconds(plan.freeze_fraction):.3g}", f"{e.recompute_seconds:.3g}", f"{e.bubble:.1%}",
                     f"{e.communication_share:.1%}", f"{fp32 / 1e9:.3g}", f"{onebit / 1e9:.3g}", e.priced_by])
    out.append(_table(header, rows))
    out.append("* eq. 3's FLOPs (with full recomputation, the paper's count) per second per GPU; GB = 10^9 bytes; "
               "meshtron GB: meshtron's own step on the layout (fp32 parameters, two gradient buffers, cuDNN "
               "attention; docs/memory.md; the paper's GPT without sequence parallelism), which the ranking does "
               "not use; recompute s: what the step spends recomputing; priced by: the time model behind the row "
               "(analytical: meshtron.plan.timing's terms); "
               + ("step and TF/s are the mean over a run, 1-bit LAMB's warmup included" if plan.optimizer == "onebit_lamb"
                  else "ranked by step time"))
    out += ["", "why #1 (Narayanan et al. 2021, §3):"] + [f"  - {line}" for line in plan.reasons]

    out += ["", "each optimizer on its own best layout: the data-parallel exchange and the step"]
    orows = []
    base = next(r for r in plan.optimizers if r.optimizer == "lamb")
    for row in plan.optimizers:
        e = row.estimate
        if e is None:
            orows.append([row.optimizer, "nothing fits", "", "", "", "", "", "", ""])
            continue
        lay = e.layout
        where = f"t={lay.tensor} p={lay.pipe} d={lay.data} v={lay.chunks} b={lay.microbatch} {lay.recompute}"
        where += f" c={lay.context}" if lay.context > 1 else ""
        orows.append([row.optimizer, where, f"{e.data_bytes / 1e9:.3g}", f"{e.seconds['data'] * 1e3:.1f} ms",
                      f"{e.data_share:.1%}", f"{e.memory.total / 1e9:.1f}", f"{e.step_seconds:.3g}",
                      f"{row.run_seconds:.3g}",
                      f"{base.run_seconds / row.run_seconds:.2f}x" if base.estimate is not None else "-"])
    out.append(_table(["optimizer", "layout", "GB over data", "exchange", "share of step", "GB/GPU", "step s",
                       "run mean s", "vs lamb"], orows))
    out.append(onebit_summary(plan))
    return "\n".join(out)


def onebit_summary(plan: Plan) -> str:
    """One sentence: what 1-bit LAMB buys over LAMB on this network, each on its own best layout."""
    rows = {row.optimizer: row for row in plan.optimizers}
    lamb, onebit = rows["lamb"], rows["onebit_lamb"]
    if onebit.estimate is None:
        return "1-bit LAMB: its extra state (v̂ and two error buffers) fits no layout of this model on these GPUs."
    if lamb.estimate is None:
        return "1-bit LAMB: LAMB fits no layout here, so there is nothing to compare with."
    if onebit.estimate.layout.data == 1:
        return "1-bit LAMB: its best layout has no data parallelism (d=1): nothing to compress."
    e = onebit.estimate
    return (f"1-bit LAMB on {plan.cluster.name}: LAMB's gradient exchange is {lamb.estimate.data_share:.0%} of its "
            f"step; with compression ({e.data_share:.1%} of a compressed step) a run is {lamb.run_seconds / onebit.run_seconds:.2f}x "
            f"as fast ({lamb.estimate.step_seconds / e.step_seconds:.2f}x per compressed step, "
            f"{plan.freeze_fraction:.0%} of the steps in the uncompressed warmup, optim.freeze_step), "
            f"holding {e.memory.total / 1e9:.1f} GB per GPU against LAMB's {lamb.estimate.memory.total / 1e9:.1f}.")
