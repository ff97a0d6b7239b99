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

from dataclasses import dataclass

from meshtron.analysis import format_bytes
from meshtron.config import OPTIMIZERS
from meshtron.plan.cluster import Cluster
from meshtron.plan.model import RECOMPUTE, ModelShape, flops_per_iteration, parameter_count
from meshtron.plan.search import SearchResult, search
from meshtron.plan.timing import Estimate, estimate

__all__ = ["OptimizerRow", "Plan", "make_plan", "optimizer_rows", "reasons", "render"]


@dataclass(frozen=True)
class OptimizerRow:
    """The chosen layout's step with one optimizer. For 1-bit LAMB the row is its compression stage;
    ``warmup_seconds`` is its uncompressed warmup step (LAMB's exchange with 1-bit LAMB's memory
    traffic), and ``run_seconds`` the mean over a run with ``freeze_fraction`` of warmup."""

    optimizer: str
    estimate: Estimate
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

    def to_dict(self, top: int = 10) -> dict:
        def layout(e: Estimate) -> dict:
            lay = e.layout
            return {"tensor": lay.tensor, "pipe": lay.pipe, "data": lay.data, "chunks": lay.chunks,
                    "microbatch": lay.microbatch, "microbatches": lay.microbatches, "recompute": lay.recompute,
                    "memory_gb": e.memory.total / 1e9, "tflops_per_gpu": e.tflops_per_gpu,
                    "step_seconds": e.step_seconds, "bubble": e.bubble,
                    "communication_share": e.communication_share, "data_bytes": e.data_bytes,
                    "seconds": dict(e.seconds)}

        return {
            "model": {"parameters": parameter_count(self.model), "layers": self.model.layers,
                      "hidden": self.model.hidden, "heads": self.model.heads, "seq_len": self.model.seq_len,
                      "vocab_size": self.model.vocab_size},
            "gpus": self.gpus, "global_batch": self.global_batch, "cluster": self.cluster.name,
            "optimizer": self.optimizer, "layouts_tried": self.result.tried, "too_big": self.result.too_big,
            "ranked": [layout(e) for e in self.result.ranked[:top]],
            "optimizers": [{"optimizer": row.optimizer, **layout(row.estimate), "warmup_seconds": row.warmup_seconds,
                            "run_seconds": row.run_seconds} for row in self.optimizers],
            "freeze_fraction": self.freeze_fraction,
            "reasons": self.reasons,
        }


def make_plan(model: ModelShape, gpus: int, global_batch: int, cluster: Cluster, optimizer: str = "adamw",
              recompute: tuple[str, ...] = RECOMPUTE, freeze_fraction: float = 0.16,
              overlap_data: bool = False) -> Plan:
    """Search, explain the winner, and price it with every optimizer."""
    result = search(model, gpus, global_batch, cluster, optimizer, recompute, overlap_data)
    rows = optimizer_rows(model, result.best, cluster, freeze_fraction, overlap_data)
    return Plan(model, gpus, global_batch, cluster, optimizer, result, rows,
                reasons(model, result, cluster), freeze_fraction)


def optimizer_rows(model: ModelShape, best: Estimate, cluster: Cluster, freeze_fraction: float,
                   overlap_data: bool = False) -> list[OptimizerRow]:
    """The best layout's step with AdamW, LAMB and 1-bit LAMB. 1-bit LAMB's warmup exchanges the
    gradients uncompressed, as LAMB does (its first ``freeze_step`` steps), so its run mean is
    ``f·t_warmup + (1−f)·t_compressed``."""
    rows = []
    for name in OPTIMIZERS:
        step = estimate(model, best.layout, cluster, name, overlap_data)
        warm = step.step_seconds
        if name == "onebit_lamb":
            uncompressed = estimate(model, best.layout, cluster, "lamb", overlap_data)
            warm = step.step_seconds - step.seconds["data"] + uncompressed.seconds["data"]
        run = freeze_fraction * warm + (1 - freeze_fraction) * step.step_seconds if name == "onebit_lamb" else warm
        rows.append(OptimizerRow(name, step, warm, run))
    return rows


def _best_by(ranked: list[Estimate], key) -> dict:
    out: dict = {}
    for e in ranked:  # ranked fastest first: the first of each key is its best
        out.setdefault(key(e.layout), e)
    return out


def _slower(e: Estimate, best: Estimate) -> str:
    return f"{1 - e.tflops_per_gpu / best.tflops_per_gpu:.1%} slower"


def _describe(e: Estimate) -> str:
    lay = e.layout
    return (f"t={lay.tensor} p={lay.pipe} v={lay.chunks} b={lay.microbatch} {lay.recompute} "
            f"({e.tflops_per_gpu:.0f} TF/s)")


def reasons(model: ModelShape, result: SearchResult, cluster: Cluster) -> list[str]:
    """Why the best layout won, one sentence per takeaway, each against the best priced alternative."""
    best = result.best
    lay = best.layout
    g = cluster.gpus_per_node
    lines = []
    by_tp = _best_by(result.ranked, lambda x: (x.tensor, x.pipe))

    # Takeaway #1: tensor parallelism within a node, then pipeline across nodes.
    tensor_share = best.seconds["tensor"] / best.step_seconds
    if result.beyond_node:
        lines.append(f"Takeaway #1 (tensor parallelism within a node) cannot hold: no layout with t <= {g} fits "
                     f"in {cluster.memory_gb - cluster.reserved_gb:g} GB, so t={lay.tensor} crosses nodes and its "
                     f"all-reduces ({tensor_share:.0%} of the step) run over the network.")
    else:
        wider = [e for (t, p), e in by_tp.items() if t > lay.tensor]
        text = (f"Takeaway #1: t={lay.tensor} keeps the tensor all-reduces on NVLink within a {g}-GPU node "
                f"({tensor_share:.0%} of the step)")
        if wider:
            alt = max(wider, key=lambda e: e.tflops_per_gpu)
            text += (f"; a wider split costs more all-reduces per FLOP and smaller GEMMs: best with t={alt.layout.tensor} "
                     f"is {_describe(alt)}, {_slower(alt, best)}")
        lines.append(text + ".")

    # Takeaway #2: the smallest model-parallel size that fits.
    sizes = sorted({t * p for t, p in by_tp})
    smallest = sizes[0]
    m_size = lay.tensor * lay.pipe
    if m_size == smallest:
        smaller = [t * p for (t, p) in result.dropped if t * p < m_size]
        why = (f"; smaller ones (M={max(smaller)}) do not fit in memory" if smaller else "")
        lines.append(f"Takeaway #2: M = t·p = {m_size} is the smallest model-parallel size that fits{why}; "
                     f"the other {lay.data}-way split is data parallelism, which communicates once per batch.")
    else:
        alt = max((e for (t, p), e in by_tp.items() if t * p == smallest), key=lambda e: e.tflops_per_gpu)
        lines.append(f"Takeaway #2 bends: the smallest model-parallel size that fits is M={smallest} "
                     f"({_describe(alt)}, {_slower(alt, best)}); M={m_size} wins because "
                     + _why_larger(alt, best) + ".")

    # Takeaway #3: microbatch size, the same (t, p, v, recompute) at other b.
    same = [e for e in result.ranked if (e.layout.tensor, e.layout.pipe, e.layout.chunks, e.layout.recompute)
            == (lay.tensor, lay.pipe, lay.chunks, lay.recompute)]
    others = sorted({e.layout.microbatch for e in same} - {lay.microbatch})
    text = f"Takeaway #3: microbatch b={lay.microbatch} ({lay.microbatches} microbatches per pipeline)"
    if others:
        alts = _best_by(same, lambda x: x.microbatch)
        text += "; " + ", ".join(f"b={b}: {alts[b].tflops_per_gpu:.0f} TF/s" for b in others[:4])
        text += (" -- larger b runs more efficient GEMMs but, with the batch fixed, leaves fewer microbatches "
                 "to fill the pipeline (eq. 1's bubble (p−1)/m)" if lay.pipe > 1 else
                 " -- larger b runs more efficient GEMMs until memory runs out")
    else:
        text += ", the only size that fits with this (t, p, v, recompute)"
    lines.append(text + ".")

    # Interleaving (§2.2.2).
    if lay.pipe > 1:
        plain = [e for e in result.ranked if (e.layout.tensor, e.layout.pipe, e.layout.chunks)
                 == (lay.tensor, lay.pipe, 1)]
        one = f"(p−1)/(v·m) = {best.bubble:.1%}"
        if lay.chunks > 1:
            text = (f"Interleaving: v={lay.chunks} chunks per stage cut the bubble to {one} "
                    f"from {(lay.pipe - 1) / lay.microbatches:.1%} at the cost of {lay.chunks}x the pipeline "
                    f"traffic ({best.seconds['pipe'] / best.step_seconds:.1%} of the step)")
            if plain:
                text += f"; the best non-interleaved layout is {_describe(plain[0])}, {_slower(plain[0], best)}"
        else:
            text = (f"No interleaving: the bubble {one} is small enough that more chunks' extra point-to-point "
                    "traffic does not pay")
        lines.append(text + ".")

    # Recomputation (§3.5).
    modes = _best_by([e for e in result.ranked if (e.layout.tensor, e.layout.pipe) == (lay.tensor, lay.pipe)],
                     lambda x: x.recompute)
    priced = [mode for mode in RECOMPUTE if mode in modes and mode != lay.recompute]
    text = f"Recomputation: {lay.recompute}"
    if lay.recompute == "full":
        text += " (each layer's forward runs again in the backward, 4/3 of its GEMM FLOPs, §3.5)"
    if priced:
        text += "; " + ", ".join(f"{mode}: best {_describe(modes[mode])}" for mode in priced)
        text += "; full recomputation frees memory for larger microbatches" if lay.recompute == "full" else ""
    lines.append(text + ".")
    return lines


def _why_larger(small: Estimate, large: Estimate) -> str:
    """The terms that make the larger model-parallel layout faster, largest first."""
    gains = {name: small.seconds[name] / small.step_seconds - large.seconds[name] / large.step_seconds
             for name in small.seconds}
    labels = {"gemm": "larger GEMMs", "elementwise": "element-wise work", "tensor": "tensor all-reduces",
              "pipe": "pipeline exchanges", "bubble": "a smaller pipeline bubble",
              "data": "a smaller data-parallel all-reduce", "optimizer": "the optimizer step"}
    top = [name for name, gain in sorted(gains.items(), key=lambda kv: -kv[1]) if gain > 0.005][:2]
    if not top:
        return "its terms add up to less"
    return " and ".join(f"{labels[name]} ({gains[name]:+.1%} of the step)" for name in top)


def _count(n: float) -> str:
    """1.65B, 840.19M, 1.01T."""
    return next(f"{n / scale:.2f}{unit}" for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"), (1, ""))
                if n >= scale or scale == 1)


def _over(e: Estimate, cluster: Cluster) -> bool:
    return e.memory.total > cluster.usable_memory_bytes


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(plan: Plan, top: int = 10) -> str:
    """The text ``meshtron plan`` prints."""
    model, cluster, result = plan.model, plan.cluster, plan.result
    out = [
        (f"model     {_count(parameter_count(model))} parameters (eq. 2): {model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads, seq {model.seq_len}, vocab {model.vocab_size}; "
        f"{flops_per_iteration(model, plan.global_batch):.3g} FLOPs per batch of {plan.global_batch} (eq. 3)"),
        (f"cluster   {cluster.name}: {plan.gpus} GPUs, {cluster.gpus_per_node} per node, {cluster.peak_tflops:g} TF/s "
        f"peak, {cluster.memory_gb:g} GB ({cluster.memory_gb - cluster.reserved_gb:g} usable), NVLink "
        f"{cluster.nvlink_gbps:g} GB/s, network {cluster.network_gbps:g} GB/s per node"),
        f"searched  {result.tried} layouts, {result.too_big} do not fit; optimizer {plan.optimizer}",
        "",
    ]
    header = ["#", "t", "p", "d", "v", "b", "m", "recompute", "GB/GPU", "TF/s/GPU*", "step s", "bubble", "comm",
              "data bytes (lamb)", "data bytes (1-bit)"]
    rows = []
    for i, e in enumerate(result.ranked[:top], 1):
        lay = e.layout
        fp32 = estimate(plan.model, lay, cluster, "lamb").data_bytes
        onebit = estimate(plan.model, lay, cluster, "onebit_lamb").data_bytes
        rows.append([i, lay.tensor, lay.pipe, lay.data, lay.chunks, lay.microbatch, lay.microbatches, lay.recompute,
                     f"{e.memory.total / 1e9:.1f}", f"{e.tflops_per_gpu:.1f}", f"{e.step_seconds:.3g}",
                     f"{e.bubble:.1%}", f"{e.communication_share:.1%}", format_bytes(fp32), format_bytes(onebit)])
    out.append(_table(header, rows))
    out.append("* eq. 3's FLOPs (with full recomputation, the paper's count) per second per GPU; the ranking is by step time")
    out += ["", "why #1 (Narayanan et al. 2021, §3):"] + [f"  - {line}" for line in plan.reasons]

    best = result.best
    out += ["", (f"optimizers on #1 (t={best.layout.tensor} p={best.layout.pipe} d={best.layout.data}): "
            "the data-parallel exchange per step")]
    orows = []
    base = next(r for r in plan.optimizers if r.optimizer == "lamb")
    for row in plan.optimizers:
        e = row.estimate
        orows.append([row.optimizer, format_bytes(e.data_bytes), f"{e.seconds['data'] * 1e3:.1f} ms",
                      f"{e.data_share:.1%}", f"{e.memory.total / 1e9:.1f}" + (" > usable" if _over(e, cluster) else ""),
                      f"{e.step_seconds:.3g}",
                      f"{e.tflops_per_gpu:.1f}", f"{base.run_seconds / row.run_seconds:.2f}x"])
    out.append(_table(["optimizer", "bytes over data", "exchange", "share of step", "GB/GPU", "step s", "TF/s/GPU",
                       "run vs lamb"], orows))
    onebit = next(r for r in plan.optimizers if r.optimizer == "onebit_lamb")
    if best.layout.data == 1:
        out.append("1-bit LAMB: nothing to compress, the layout has no data parallelism (d=1).")
    else:
        compressed = base.estimate.step_seconds / onebit.estimate.step_seconds
        run = base.run_seconds / onebit.run_seconds
        out.append(f"1-bit LAMB on {cluster.name}: the gradient exchange is {base.estimate.data_share:.0%} of a LAMB "
                   f"step; compression makes a step {compressed:.2f}x as fast, {run:.2f}x over a run with "
                   f"{plan.freeze_fraction:.0%} uncompressed warmup (optim.freeze_step), for "
                   f"{(onebit.estimate.memory.total - base.estimate.memory.total) / 1e9:.1f} GB more per GPU "
                   "(v̂ and the error-feedback buffers)"
                   + ("; that does not fit this layout: rank with --optimizer onebit_lamb" if _over(onebit.estimate, cluster)
                      and plan.optimizer != "onebit_lamb" else "") + ".")
    return "\n".join(out)

