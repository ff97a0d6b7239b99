"""What ``meshtron schedule`` prints and draws: a table, its checker report, and a timeline PNG.

Pure Python (no JAX): a schedule can be inspected on a laptop before anything is compiled. The
PNG needs matplotlib (the ``bench`` extra); the text report does not.
"""

from __future__ import annotations

import math
from pathlib import Path

from meshtron.pipeline.schedules import UNIT_COSTS, Costs, Schedule, ScheduleStats, check, render
from meshtron.pipeline.table import hoisted_recomputes
from meshtron.plotting import pyplot, save

# Colours of the kinds of work in the timeline (forward, input gradient, weight gradient, a backward's
# recomputation of its stage forward).
_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "R": "#8172B3"}


def text_report(schedule: Schedule, costs: Costs = UNIT_COSTS) -> tuple[str, ScheduleStats]:
    """The table (:func:`render`) followed by what :func:`check` proves and prices."""
    stats = check(schedule, costs)
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    lines = [
        (f"{schedule.name}: p={p} stages, m={m} microbatches, v={v} chunk{'s' if v > 1 else ''} per stage"
         + (", backward split into B (input gradient) and W (weight gradient)" if schedule.split_backward else "")),
        render(schedule),
        "",
        f"ticks                {stats.ticks}",
        (f"bubble               {stats.bubble_fraction:.4f} of the ideal time "
         f"(t_F={costs.forward:g}, t_B={costs.backward:g}, t_W={costs.weight:g}"
         + (f", t_R={costs.recompute:g}" if costs.recompute else "") + "); "
         + ("no textbook value" if math.isnan(stats.ideal_bubble) else f"textbook {stats.ideal_bubble:.4f}")),
        (f"in flight per stage  {', '.join(map(str, stats.peak_in_flight))} (stage inputs stashed; "
         f"Megatron's stage 0: {stats.megatron_peak_in_flight_stage0})"),
    ]
    if schedule.split_backward:
        lines.append(f"W pending per stage  {', '.join(map(str, stats.peak_weight_pending))} "
                     "(input-gradient boundaries kept for a later weight gradient)")
        lines.append(f"until W per stage    {', '.join(map(str, stats.peak_until_weight))} "
                     "(forwards whose weight gradient has not run: their stage inputs stashed, "
                     "or residuals kept with parallel.recompute=false)")
    return "\n".join(lines), stats


def draw(schedule: Schedule, path: str | Path, costs: Costs = UNIT_COSTS) -> Path:
    """A timeline: one row per stage, one box per unit of work, placed at the lockstep time its
    tick starts (a tick lasts as long as its busiest stage), labelled with the microbatch."""
    plt = pyplot("drawing a schedule")
    v = schedule.chunks
    unit = dict(zip("FBW", costs.of_chunk_work(schedule.split_backward, v)), R=costs.recompute / v)
    weight = schedule.weight_table
    # A backward's rerun: in its own tick, or after the forward of the tick before where it is hoisted.
    hoisted = hoisted_recomputes(schedule) if costs.recompute else frozenset()
    rerun = {(t - 1 if (t, s) in hoisted else t, s): work for t, row in enumerate(schedule.backward)
             for s, work in enumerate(row) if work is not None and costs.recompute}
    fig, ax = plt.subplots(figsize=(min(4 + 0.35 * schedule.ticks, 40), 1 + 0.6 * schedule.stages))
    start = 0.0
    for tick, (frow, brow, wrow) in enumerate(zip(schedule.forward, schedule.backward, weight)):
        longest = 0.0
        for stage in range(schedule.stages):
            at = start
            for kind, work in (("F", frow[stage]), ("R", rerun.get((tick, stage))), ("B", brow[stage]),
                               ("W", wrow[stage])):
                if work is None:
                    continue
                ax.broken_barh([(at, unit[kind])], (stage - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolor="white")
                label = f"{work.microbatch}" + (f".{work.chunk}" if v > 1 else "")
                ax.text(at + unit[kind] / 2, stage, label, ha="center", va="center", fontsize=7, color="white")
                at += unit[kind]
            longest = max(longest, at - start)
        start += longest
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of t_F)")
    stats = check(schedule, costs)
    ax.set_title(f"{schedule.name}  p={schedule.stages} m={schedule.microbatches} v={v}  "
                 f"bubble {stats.bubble_fraction:.3f}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, ["forward", "backward (input grad)" if schedule.split_backward else "backward", "weight grad",
                        "recomputation"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return save(fig, path)
