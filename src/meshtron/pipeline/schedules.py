"""The pipeline schedules meshtron runs, as tables of (tick, stage) -> forward / backward work
(:mod:`meshtron.pipeline.table`), and the catalog a run names them from: a built-in schedule by
name or a PyTorch action CSV. No JAX here. The table types, the checker and the compiled program
(:mod:`meshtron.pipeline.program`) are re-exported here under their long-standing names.

Why tables: the runtime in :mod:`meshtron.pipeline.runtime` runs every stage in lockstep inside
one ``shard_map``, so it needs, for every tick, what each stage computes and which buffer slot
each value lives in. Keeping the schedule as plain data lets us prove it correct (``check``),
price it (bubble, memory) and compile it (``compile_program``) without tracing anything.

The execution model (ticks, stages, virtual stages, dependencies) is :mod:`meshtron.pipeline.table`'s.

GPipe, 1F1B and the interleaved schedule give every stage the same op *order*, shifted in time:
forward op ``j`` of stage ``s`` runs in tick ``j + s`` and backward op ``j`` in tick
``T0 + j + (p - 1 - s)``. The
order is Megatron-LM's (microbatches in groups of ``p`` per chunk for the interleaved schedule,
backwards through the chunks in reverse); ``T0`` decides how early backwards start: after all
forwards (GPipe) or as soon as the last virtual stage has the first microbatch's output (1F1B,
interleaved). The lockstep shift costs memory, not time: the bubble is exactly the textbook one,
but stage 0 holds ``2p - 1`` microbatches in flight instead of Megatron's ``p`` (it cannot start
a backward before the gradient has travelled back through the whole ring).

``1f1b-p`` (:func:`one_f_one_b_p_in_flight`) gets Megatron's ``p - s`` in lockstep by halving the
tick: each tick holds a forward *or* a backward per stage, stage ``s`` alternating them with a phase
of its own (forward ``j`` in tick ``s + 2j``, backward ``j`` in tick ``2p - 1 - s + 2j``), so a
gradient's round trip spans every other tick's forward only. Under full recomputation (the default)
the program reruns each of its backwards' stage forward in the forward tick before
(:func:`meshtron.pipeline.table.hoisted_recomputes`), which balances the two kinds of tick:
with ``t_R = t_F`` and an unsplit backward of ``2·t_F`` it runs in ``4m + 3(p - 1)`` forward-times
against 1F1B's ``4m + 4(p - 1)``. Without recomputation its backward ticks set the pace and it is
slower than 1F1B.

ZB-H1 (:func:`zb_h1`) is laid out from per-stage work orders, each op as soon as what it needs is
there.

Held-out evaluation uses a fourth, forward-only table (:func:`forward_only`): the same lockstep
forward order with no backward work. Evaluating with the unpipelined model instead would make the
compiler gather every pipe-sharded layer onto every device; the forward-only table keeps each
stage's layers where they are and moves only activations, like training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtron.pipeline.program import Program, compile_program
from meshtron.pipeline.table import (
    FORWARD_ONLY,
    SCHEDULES,
    SPLIT_SCHEDULES,
    UNIT_COSTS,
    Costs,
    Schedule,
    ScheduleError,
    ScheduleStats,
    Table,
    Work,
    check,
    render,
)
from meshtron.pipeline.torch_actions import read_csv, to_schedule

__all__ = [
    "FORWARD_ONLY", "SCHEDULES", "SPLIT_SCHEDULES", "UNIT_COSTS", "Costs", "Program", "Schedule", "ScheduleError",
    "ScheduleStats", "Work", "check", "compile_program", "forward_only", "gpipe", "interleaved", "is_schedule_file",
    "make_schedule", "one_f_one_b", "one_f_one_b_p_in_flight", "render", "zb_h1", "zb_h1_order",
]

# --------------------------------------------------------------------------------------------
# Building tables


def _megatron_order(stages: int, microbatches: int, chunks: int) -> list[Work]:
    """Forward op order shared by every stage: ``p`` microbatches through chunk 0, the same ``p``
    through chunk 1, ..., then the next group of ``p``. Grouping by ``p`` is what lets stage 0's
    chunk ``c + 1`` pick up the first microbatch just as it comes round the ring from stage
    ``p - 1`` (for ``v = 1`` this is simply microbatch ``j``)."""
    group = stages * chunks
    return [
        Work((j // group) * stages + j % stages, (j % group) // stages) for j in range(microbatches * chunks)
    ]


def _shifted(name: str, stages: int, microbatches: int, chunks: int, first_backward: int) -> Schedule:
    """Lay the common op order out in lockstep: stage ``s`` runs forward op ``j`` in tick ``j + s``
    and backward op ``j`` in tick ``first_backward + j + (p - 1 - s)``, walking the chunks in
    reverse so gradients flow back along the ring."""
    order = _megatron_order(stages, microbatches, chunks)
    ticks = first_backward + len(order) + stages - 1
    forward: list[list[Work | None]] = [[None] * stages for _ in range(ticks)]
    backward: list[list[Work | None]] = [[None] * stages for _ in range(ticks)]
    for stage in range(stages):
        for j, work in enumerate(order):
            forward[j + stage][stage] = work
            backward[first_backward + j + stages - 1 - stage][stage] = Work(work.microbatch, chunks - 1 - work.chunk)
    return Schedule(name, stages, microbatches, chunks, tuple(map(tuple, forward)), tuple(map(tuple, backward)))


def _require_int(label: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ScheduleError(f"{label}: must be an integer, got {value!r}")


def _validate(name: str, stages: int, microbatches: int, chunks: int) -> None:
    """Reject requests no schedule of this family can serve, saying which parameter to change."""
    for label, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        _require_int(label, value)
    if stages < 1:
        raise ScheduleError(f"stages: need at least 1 pipeline stage, got {stages}")
    if chunks < 1:
        raise ScheduleError(f"chunks: need at least 1 model chunk per stage, got {chunks}")
    if name == FORWARD_ONLY:  # no backward to overlap with: any m >= 1 and v >= 1 is a valid table
        if microbatches < 1:
            raise ScheduleError(f"microbatches: need at least 1 microbatch, got {microbatches}")
        return
    if microbatches < stages:
        raise ScheduleError(
            f"microbatches: m={microbatches} < p={stages}: the pipeline cannot fill; use at least {stages}"
        )
    if chunks > 1 and name != "interleaved":
        raise ScheduleError(
            f"chunks: {name} runs one chunk per stage; use the interleaved schedule for chunks={chunks}"
        )
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"microbatches: the interleaved schedule needs a multiple of p={stages}, got m={microbatches}; "
            f"use {microbatches + stages - microbatches % stages}"
        )


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al.): simplest, but every stage holds all ``m``
    microbatches' activations at the turn-around."""
    _validate("gpipe", stages, microbatches, 1)
    # The last stage turns around in the tick of its last forward.
    return _shifted("gpipe", stages, microbatches, 1, first_backward=microbatches + stages - 2)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """PipeDream-Flush: backwards start as soon as the first microbatch reaches the end, so the
    in-flight activations stay bounded by the pipeline depth instead of growing with ``m``."""
    _validate("1f1b", stages, microbatches, 1)
    return _shifted("1f1b", stages, microbatches, 1, first_backward=stages - 1)


def interleaved(stages: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: ``v`` chunks per stage make each tick ``v`` times shorter, so the
    same ``p - 1`` ramp-up ticks cost ``v`` times less (bubble ``(p-1)/(v·m)``) at ``v`` times the
    point-to-point traffic. ``chunks=1`` is exactly :func:`one_f_one_b`."""
    _validate("interleaved", stages, microbatches, chunks)
    return _shifted("interleaved", stages, microbatches, chunks, first_backward=chunks * stages - 1)


def _as_table(rows: list[list[Work | None]]) -> Table:
    return tuple(map(tuple, rows))


def one_f_one_b_p_in_flight(stages: int, microbatches: int) -> Schedule:
    """1F1B as Megatron-LM runs it: stage ``s`` holds at most ``p - s`` microbatches (stage 0: ``p``,
    where the lockstep :func:`one_f_one_b` holds ``2p - 1``).

    The in-flight count is a gradient's round trip from stage ``s`` to the last stage and back,
    counted in forwards of stage ``s``. In :func:`one_f_one_b` a tick holds a forward *and* a
    backward and the round trip is ``2(p - 1 - s) + 1`` ticks, each with a forward. Here a tick is
    half of that: stage ``s`` runs forward ``j`` in tick ``s + 2j`` and backward ``j`` in tick
    ``2p - 1 - s + 2j``, so it alternates forward and backward ticks with a phase of its own
    (forwards where ``tick - s`` is even). A forward's output reaches the next stage, and an input
    gradient the previous one, just in time for that stage's next tick of the same kind, so the round
    trip still takes ``2(p - 1 - s) + 1`` ticks, but only every other one is a forward: ``p - s`` in
    flight, with two messages per forward-and-backward instead of one (the same bytes).

    It takes ``2(m + p - 1)`` ticks of one op each. With unit costs (a backward twice a forward) its
    backward ticks set the pace: ``4m + 3p - 4`` forward-times, bubble ``(m + 3p - 4)/(3m)``. Under
    full recomputation the program reruns each backward's stage forward in the forward tick before it
    (:func:`meshtron.pipeline.table.hoisted_recomputes`), so both kinds of tick cost
    ``t_F + t_R = t_B + t_W`` (``2·t_F`` with ``t_R = t_F``): ``4m + 3(p - 1)``, bubble
    ``3(p - 1)/(4m)``, where :func:`one_f_one_b` recomputing takes ``4m + 4(p - 1)``.
    """
    _validate("1f1b-p", stages, microbatches, 1)
    p, m = stages, microbatches
    ticks = 2 * (m + p - 1)
    forward: list[list[Work | None]] = [[None] * p for _ in range(ticks)]
    backward: list[list[Work | None]] = [[None] * p for _ in range(ticks)]
    for stage in range(p):
        for j in range(m):
            forward[stage + 2 * j][stage] = Work(j, 0)
            backward[2 * p - 1 - stage + 2 * j][stage] = Work(j, 0)
    return Schedule("1f1b-p", p, m, 1, _as_table(forward), _as_table(backward))


def zb_h1_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s work in ZB-H1's order (Qi et al., 2023, Figure 3): 1F1B's warmup of
    ``p - stage`` forwards, then for each microbatch ``k`` its B, the W of microbatch
    ``k - stage`` and the next forward; the ``stage`` weight gradients still owed run last.

    Stage ``s`` thus defers ``s`` weight gradients -- into the ticks where 1F1B's stage ``s``
    waits -- and never holds more than ``p`` forwards whose W has not run: 1F1B's stage-0 bound on
    every stage, which is the paper's point (the same peak activation memory as 1F1B)."""
    ahead = min(stages - stage, microbatches)
    order = [("F", k) for k in range(ahead)]
    for k in range(microbatches):
        order.append(("B", k))
        if k >= stage:
            order.append(("W", k - stage))
        if ahead < microbatches:
            order.append(("F", ahead))
            ahead += 1
    return order + [("W", k) for k in range(max(microbatches - stage, 0), microbatches)]


def _as_soon_as_ready(name: str, orders: list[list[tuple[str, int]]], microbatches: int) -> Schedule:
    """Lay per-stage work orders (``("F" | "B" | "W", microbatch)``, one chunk per stage) out tick
    by tick: each stage runs the next work of its order as soon as what it needs was produced in an
    earlier tick (F: the previous stage's F; B: its own F and the next stage's B; W: its own B)."""
    p = len(orders)
    done: dict[tuple[str, int, int], int] = {}
    position = [0] * p
    rows: dict[str, list[list[Work | None]]] = {"F": [], "B": [], "W": []}
    tick = 0
    while any(position[s] < len(orders[s]) for s in range(p)):
        if tick > 4 * microbatches * p + 4 * p:  # cannot happen for the orders built here
            raise ScheduleError(f"{name}: a stage's work order waits for work that never runs")
        row: dict[str, list[Work | None]] = {kind: [None] * p for kind in rows}
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, mb = orders[s][position[s]]
            needs = {"F": [("F", s - 1, mb)] if s else [],
                     "B": [("F", s, mb)] + ([("B", s + 1, mb)] if s < p - 1 else []),
                     "W": [("B", s, mb)]}[kind]
            if all(done.get(need, tick) < tick for need in needs):
                row[kind][s] = Work(mb, 0)
                position[s] += 1
        for kind, cells in row.items():
            for s, work in enumerate(cells):
                if work is not None:
                    done[(kind, s, work.microbatch)] = tick
            rows[kind].append(cells)
        tick += 1
    return Schedule(name, p, microbatches, 1, _as_table(rows["F"]), _as_table(rows["B"]), _as_table(rows["W"]))


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2023): the backward split into B and W, 1F1B's stash bound (``p - s`` on
    stage ``s``), stage ``s`` deferring ``s`` weight gradients into what would be bubbles, and at
    most ``p`` forwards awaiting their W on any stage (1F1B's peak). With t_F = t_B = t_W the run
    takes ``3m + p - 1`` ticks: bubble ``(p - 1)/(3m)``, a third of 1F1B's."""
    _validate("zb-h1", stages, microbatches, 1)
    return _as_soon_as_ready("zb-h1", [zb_h1_order(stages, microbatches, s) for s in range(stages)], microbatches)


def forward_only(stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Forwards only, for held-out evaluation: every microbatch passes every virtual stage once, in
    order, with nothing kept for a backward.

    The op order is the training schedules' (:func:`_megatron_order`; for ``v = 1`` GPipe's fill),
    so stage ``s`` chunk ``c`` holds the same layers as in training (stage-ordered interleaved
    parameters work unchanged), and stage ``s`` runs op ``j`` in tick ``j + s``: every activation
    is consumed the tick it arrives, so each stage needs one stash slot whatever ``m``. Unlike
    training, ``m`` need not fill the pipeline nor be a multiple of ``p``: the order is laid out
    for whole groups of ``p`` microbatches and the missing ones of a last, partial group leave their
    cells idle (the ring hand-off of chunk ``c`` to ``c + 1`` needs that spacing), then trailing
    idle ticks are dropped.
    """
    _validate(FORWARD_ONLY, stages, microbatches, chunks)
    padded = -(-microbatches // stages) * stages
    cells = {
        (j + stage, stage): work
        for j, work in enumerate(_megatron_order(stages, padded, chunks))
        if work.microbatch < microbatches
        for stage in range(stages)
    }
    ticks = 1 + max(tick for tick, _ in cells)
    forward = tuple(tuple(cells.get((tick, stage)) for stage in range(stages)) for tick in range(ticks))
    return Schedule(FORWARD_ONLY, stages, microbatches, chunks, forward, ((None,) * stages,) * ticks)


def is_schedule_file(name: str) -> bool:
    """A schedule given as a PyTorch action CSV (``torch.distributed.pipelining``'s ``_dump_csv``)."""
    return str(name).lower().endswith(".csv")


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build a schedule by name (one of :data:`SCHEDULES`), as configs spell it, or read it from a
    PyTorch action CSV (:mod:`meshtron.pipeline.torch_actions`), which must be for this many stages,
    microbatches and chunks."""
    if is_schedule_file(name):
        return _from_csv(name, stages, microbatches, chunks)
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule: unknown {name!r}; use one of {', '.join(map(repr, SCHEDULES))} "
                            "or a PyTorch action CSV file")
    _validate(name, stages, microbatches, chunks)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-p": one_f_one_b_p_in_flight, "zb-h1": zb_h1}
    if name == "interleaved":
        return interleaved(stages, microbatches, chunks)
    return builders[name](stages, microbatches)


def _from_csv(path: str, stages: int | None, microbatches: int | None, chunks: int | None) -> Schedule:
    if not Path(path).is_file():
        raise ScheduleError(f"schedule: {path!r} is not a file; give a PyTorch action CSV or a schedule name")
    table = to_schedule(read_csv(path), name=Path(path).name)
    for label, want, got, key in (("stages", stages, table.stages, "parallel.pipe"),
                                  ("microbatches", microbatches, table.microbatches, "parallel.microbatches"),
                                  ("chunks", chunks, table.chunks, "parallel.chunks")):
        if want is not None and want != got:
            raise ScheduleError(f"{label}: {path} schedules {got} {label}, the run has {want}; set {key}={got} "
                                "or give a schedule written for this run")
    return table
