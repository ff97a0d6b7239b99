"""Pipeline schedules as data: tables of (tick, stage) -> forward / backward work, a checker, and
the per-tick instructions the SPMD runtime executes. No JAX here.

Why tables: the runtime in :mod:`meshtron.pipeline.runtime` runs every stage in lockstep inside
one ``shard_map``, so it needs, for every tick, what each stage computes and which buffer slot
each value lives in. Keeping the schedule as plain data lets us prove it correct (``check``),
price it (bubble, memory) and compile it (``compile_program``) without tracing anything.

Execution model: ``p`` stages on a ring, ``m`` microbatches, ``v`` model chunks per stage
(virtual stage ``k = chunk·p + stage``; virtual stage ``k`` feeds ``k + 1``, so stage ``p - 1``
chunk ``c`` feeds stage 0 chunk ``c + 1``). In each tick every stage runs at most one forward and
at most one backward, forward first. A value produced in tick ``t`` is sent at the end of the
tick and can be used from tick ``t + 1`` on (the receiver buffers it). Hence a forward of
``(mb, k)`` needs the forward of ``(mb, k-1)`` in an earlier tick, and a backward of ``(mb, k)``
needs its own forward (same tick or earlier) and the backward of ``(mb, k+1)`` in an earlier tick.

All three schedules give every stage the same op *order*, shifted in time: forward op ``j`` of
stage ``s`` runs in tick ``j + s`` and backward op ``j`` in tick ``T0 + j + (p - 1 - s)``. The
order is Megatron-LM's (microbatches in groups of ``p`` per chunk for the interleaved schedule,
backwards through the chunks in reverse); ``T0`` decides how early backwards start: after all
forwards (GPipe) or as soon as the last virtual stage has the first microbatch's output (1F1B,
interleaved). The lockstep shift costs memory, not time: the bubble is exactly the textbook one,
but stage 0 holds ``2p - 1`` microbatches in flight instead of Megatron's ``p`` (it cannot start
a backward before the gradient has travelled back through the whole ring).

Held-out evaluation uses a fourth, forward-only table (:func:`forward_only`): the same lockstep
forward order with no backward work. Evaluating with the unpipelined model instead would make the
compiler gather every pipe-sharded layer onto every device; the forward-only table keeps each
stage's layers where they are and moves only activations, like training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "1f1b-p", "zb-h1")  # training schedules, as configs name them
SPLIT_SCHEDULES = ("zb-h1",)  # schedules whose backward is split into B (input) and W (weight)
FORWARD_ONLY = "forward-only"  # the name of :func:`forward_only` tables (not a training schedule)


class ScheduleError(ValueError):
    """A schedule cannot be built as asked, or a table breaks a dependency."""


@dataclass(frozen=True)
class Work:
    """Microbatch ``microbatch`` through model chunk ``chunk`` of the stage whose column holds it.

    The stage is deliberately not stored: a table cell's column *is* the stage, so the virtual
    stage of a cell is ``chunk * p + column`` and a misplaced cell shows up as a different
    virtual stage (which ``check`` reports as work on the wrong stage).
    """

    microbatch: int
    chunk: int


Table = tuple[tuple["Work | None", ...], ...]


@dataclass(frozen=True)
class Costs:
    """Unit costs of the three kinds of work (Qi et al.'s t_F, t_B, t_W). A backward that is not
    split costs ``backward + weight``; the defaults make it twice a forward, the usual assumption
    (and the paper's t_F = t_B = t_W)."""

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0

    def of_chunk_work(self, split: bool, chunks: int) -> tuple[float, float, float]:
        """(forward, backward, weight) cost of one table cell with ``chunks`` chunks per stage: a
        chunk does 1/v of a stage's work, and an unsplit backward includes the weight gradient."""
        backward = self.backward if split else self.backward + self.weight
        return self.forward / chunks, backward / chunks, self.weight / chunks


UNIT_COSTS = Costs()


@dataclass(frozen=True)
class Schedule:
    """``forward[tick][stage]`` and ``backward[tick][stage]``: the work, or None when idle.

    ``weight`` is empty unless the backward is *split* (zero-bubble schedules): then
    ``backward`` holds the input-gradient halves (B) and ``weight[tick][stage]`` the
    weight-gradient halves (W), each of which must run at or after its own B. Within a tick a
    stage runs its forward, then its backward, then its weight work.
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    forward: Table
    backward: Table
    weight: Table = ()

    @property
    def ticks(self) -> int:
        return len(self.forward)

    @property
    def split_backward(self) -> bool:
        """True when the table schedules weight gradients (W) apart from input gradients (B)."""
        return bool(self.weight)

    @property
    def weight_table(self) -> Table:
        """``weight`` with one (idle) row per tick also when the backward is not split."""
        return self.weight or ((None,) * self.stages,) * self.ticks

    @property
    def forward_only(self) -> bool:
        """An evaluation table (:func:`forward_only`): the checker then requires *no* backward work,
        where for a training table a missing backward is an error."""
        return self.name == FORWARD_ONLY


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


def _greedy(name: str, stages: int, microbatches: int, *, in_flight: list[int]) -> Schedule:
    """Lay one chunk per stage out tick by tick, each stage doing the most urgent ready work.

    Per stage and tick: the forward of the next microbatch whose input has arrived, if fewer than
    ``in_flight[s]`` are forwarded but not backwarded (the stage's stash bound), and the backward
    of the oldest microbatch whose output gradient has arrived -- both in one tick when both are
    ready, as the lockstep 1F1B does. Values produced in a tick are usable from the next, exactly
    as :func:`check` requires.
    """
    p, m = stages, microbatches
    f_tick = [[-1] * m for _ in range(p)]
    b_tick = [[-1] * m for _ in range(p)]
    nf, nb = [0] * p, [0] * p
    forward: list[list[Work | None]] = []
    backward: list[list[Work | None]] = []
    tick = 0
    while min(nb) < m:
        if tick > 4 * m * p + 4 * p:  # cannot happen for the bounds used here; guards a bad bound
            raise ScheduleError(f"{name}: no progress with stage bounds {in_flight} (p={p}, m={m})")
        frow: list[Work | None] = [None] * p
        brow: list[Work | None] = [None] * p
        for s in range(p):
            ready_f = nf[s] < m and (s == 0 or 0 <= f_tick[s - 1][nf[s]] < tick)
            if ready_f and nf[s] - nb[s] < in_flight[s]:
                frow[s] = Work(nf[s], 0)
            mb = nb[s]  # the next backward: its output gradient must have arrived (or be the loss)
            grad_here = mb < m and (s == p - 1 or 0 <= b_tick[s + 1][mb] < tick)
            if grad_here and mb < nf[s] + (frow[s] is not None):
                brow[s] = Work(mb, 0)
        for s in range(p):  # commit the tick: every decision above saw only earlier ticks
            if frow[s] is not None:
                f_tick[s][nf[s]] = tick
                nf[s] += 1
            if brow[s] is not None:
                b_tick[s][nb[s]] = tick
                nb[s] += 1
        forward.append(frow)
        backward.append(brow)
        tick += 1
    return Schedule(name, p, m, 1, _as_table(forward), _as_table(backward))


def _as_table(rows: list[list[Work | None]]) -> Table:
    return tuple(map(tuple, rows))


def one_f_one_b_p_in_flight(stages: int, microbatches: int) -> Schedule:
    """1F1B as Megatron-LM runs it: stage ``s`` holds at most ``p - s`` microbatches (stage 0: ``p``,
    where the lockstep :func:`one_f_one_b` holds ``2p - 1``). A stage whose stash is full waits for
    a gradient before its next forward, which costs ticks where the lockstep table overlaps."""
    _validate("1f1b-p", stages, microbatches, 1)
    return _greedy("1f1b-p", stages, microbatches, in_flight=[stages - s for s in range(stages)])


def _zb_h1_order(stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
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
    return _as_soon_as_ready("zb-h1", [_zb_h1_order(stages, microbatches, s) for s in range(stages)], microbatches)


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
    from meshtron.pipeline.torch_actions import read_csv, to_schedule  # it builds on this module

    table = to_schedule(read_csv(path), name=Path(path).name)
    for label, want, got, key in (("stages", stages, table.stages, "mesh.pipe"),
                                  ("microbatches", microbatches, table.microbatches, "train.microbatches"),
                                  ("chunks", chunks, table.chunks, "pipeline.chunks")):
        if want is not None and want != got:
            raise ScheduleError(f"{label}: {path} schedules {got} {label}, the run has {want}; set {key}={got} "
                                "or give a schedule written for this run")
    return table


# --------------------------------------------------------------------------------------------
# Checking and pricing tables


@dataclass(frozen=True)
class ScheduleStats:
    """What a valid table costs: ticks, bubble (under :class:`Costs`) and activation memory."""

    ticks: int
    bubble_fraction: float  # (lockstep run time - m·(t_F + t_B + t_W)) / m·(t_F + t_B + t_W); forward-only: m·t_F
    ideal_bubble: float  # textbook: (p-1)/m, (p-1)/(v·m) interleaved, (p-1)(t_F+t_B-t_W)/(m·Σt) ZB-H1; NaN: none
    peak_in_flight: tuple[int, ...]  # per stage, in chunk-microbatches (stage inputs stashed)
    megatron_peak_in_flight_stage0: int  # Megatron's asynchronous schedule on rank 0, for comparison
    peak_weight_pending: tuple[int, ...] = ()  # per stage, most Bs whose W has not run (what W keeps)
    # per stage, most forwards whose W (unsplit: whose backward) has not run: the residual slots of a
    # pipeline that keeps residuals, which W reads too (see split_backward's weight_reads_residuals)
    peak_until_weight: tuple[int, ...] = ()


Placement = dict[tuple[int, int], int]  # (microbatch, virtual stage) -> tick


def _describe(kind: str, microbatch: int, virtual: int, stages: int) -> str:
    return f"{kind} of microbatch {microbatch} chunk {virtual // stages} (virtual stage {virtual})"


def _check_shape(schedule: Schedule) -> None:
    p = schedule.stages
    if len(schedule.forward) != len(schedule.backward):
        raise ScheduleError(
            f"tables: forward has {len(schedule.forward)} ticks but backward has {len(schedule.backward)}"
        )
    if schedule.weight and len(schedule.weight) != len(schedule.forward):
        raise ScheduleError(
            f"tables: forward has {len(schedule.forward)} ticks but weight has {len(schedule.weight)}"
        )
    for label, table in (("forward", schedule.forward), ("backward", schedule.backward), ("weight", schedule.weight)):
        for tick, row in enumerate(table):
            if len(row) != p:
                raise ScheduleError(f"{label} table, tick {tick}: needs one entry per stage ({p}), got {len(row)}")


def _occurrences(schedule: Schedule, table: tuple[tuple[Work | None, ...], ...], kind: str) -> dict:
    """(microbatch, virtual stage) -> every (tick, stage) that runs it; rejects out-of-range work."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    seen: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for tick, row in enumerate(table):
        for stage, work in enumerate(row):
            if work is None:
                continue
            if not (0 <= work.microbatch < m and 0 <= work.chunk < v):
                raise ScheduleError(f"tick {tick}, stage {stage}: {kind} {work} is out of range (m={m}, v={v})")
            seen.setdefault((work.microbatch, work.chunk * p + stage), []).append((tick, stage))
    return seen


def _placement(schedule: Schedule, kind: str) -> Placement:
    """Where each (microbatch, virtual stage) runs; every one exactly once, on its own stage."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    table = {"forward": schedule.forward, "backward": schedule.backward, "weight": schedule.weight}[kind]
    seen = _occurrences(schedule, table, kind)
    missing = [(mb, k) for mb in range(m) for k in range(p * v) if (mb, k) not in seen]
    doubled = sorted((where[1], where[0][0], key) for key, where in seen.items() if len(where) > 1)
    for (tick, stage), first, (mb, k) in doubled:
        chunk = k // p
        homes = [kk % p for mm, kk in missing if mm == mb and kk // p == chunk]
        if homes:  # the same (microbatch, chunk) is doubled here and absent from another stage
            raise ScheduleError(
                f"tick {tick}, stage {stage}: {kind} of microbatch {mb} chunk {chunk} is on the wrong stage: "
                f"stage {stage} already runs it at tick {first}, while stage {homes[0]} never does "
                f"(virtual stage {chunk * p + homes[0]} lives on stage {homes[0]})"
            )
        raise ScheduleError(
            f"tick {tick}, stage {stage}: {_describe(kind, mb, k, p)} runs twice (first at tick {first})"
        )
    if missing:
        mb, k = missing[0]
        raise ScheduleError(f"{_describe(kind, mb, k, p)} never runs (it belongs on stage {k % p})")
    return {key: where[0][0] for key, where in seen.items()}


def _check_dependencies(schedule: Schedule, fwd: Placement, bwd: Placement, wgt: Placement | None = None) -> None:
    """Walk the work in execution order (tick, stage, forward before backward before weight) and
    stop at the first value that is used before it can have arrived."""
    p = schedule.stages
    last = p * schedule.chunks - 1
    events = sorted([(t, k % p, 0, mb, k) for (mb, k), t in fwd.items()] +
                    [(t, k % p, 1, mb, k) for (mb, k), t in bwd.items()] +
                    [(t, k % p, 2, mb, k) for (mb, k), t in (wgt or {}).items()])
    for tick, stage, phase, mb, k in events:
        where = f"tick {tick}, stage {stage}: "
        if phase == 2:
            if bwd[(mb, k)] > tick:
                raise ScheduleError(
                    where + f"{_describe('weight gradient', mb, k, p)} runs before its own input-gradient "
                    f"backward (tick {bwd[(mb, k)]}): W reads what B leaves behind"
                )
            continue
        if phase == 0:
            if k > 0 and fwd[(mb, k - 1)] >= tick:
                sent = fwd[(mb, k - 1)]
                raise ScheduleError(
                    where + f"{_describe('forward', mb, k, p)} runs before its input arrives: virtual stage "
                    f"{k - 1} (stage {(k - 1) % p}) runs its forward at tick {sent}, usable from tick {sent + 1}"
                )
            continue
        if fwd[(mb, k)] > tick:
            raise ScheduleError(
                where + f"{_describe('backward', mb, k, p)} runs before its own forward (tick {fwd[(mb, k)]})"
            )
        if k < last and bwd[(mb, k + 1)] >= tick:
            sent = bwd[(mb, k + 1)]
            raise ScheduleError(
                where + f"{_describe('backward', mb, k, p)} runs before its output gradient arrives: virtual "
                f"stage {k + 1} (stage {(k + 1) % p}) runs its backward at tick {sent}, usable from tick {sent + 1}"
            )


def _run_time(schedule: Schedule, costs: Costs) -> float:
    """Lockstep time: each tick lasts as long as its busiest stage (per chunk, costs divided by ``v``;
    an unsplit backward costs ``t_B + t_W``)."""
    cost_f, cost_b, cost_w = costs.of_chunk_work(schedule.split_backward, schedule.chunks)
    weight = schedule.weight_table
    return sum(
        max(cost_f * (f is not None) + cost_b * (b is not None) + cost_w * (w is not None)
            for f, b, w in zip(frow, brow, wrow))
        for frow, brow, wrow in zip(schedule.forward, schedule.backward, weight)
    )


def _peak_weight_pending(schedule: Schedule, stage: int) -> int:
    """Most input-gradient backwards on ``stage`` whose weight gradient has not run yet, counted
    after a tick's B and before its W: each holds B's boundary values (see split_backward)."""
    live = peak = 0
    for brow, wrow in zip(schedule.backward, schedule.weight):
        live += brow[stage] is not None
        peak = max(peak, live)
        live -= wrow[stage] is not None
    return peak


def _peak_until_weight(schedule: Schedule, stage: int) -> int:
    """Most (microbatch, chunk) pairs forwarded on ``stage`` whose weight gradient has not run (with
    an unsplit backward: whose backward has not), counted after a tick's forward: what a stage that
    keeps each forward's residuals until its W holds."""
    done = schedule.weight if schedule.split_backward else schedule.backward
    live = peak = 0
    for frow, drow in zip(schedule.forward, done):
        live += frow[stage] is not None
        peak = max(peak, live)
        live -= drow[stage] is not None
    return peak


def _ideal_bubble(schedule: Schedule, costs: Costs) -> float:
    """The closed form of a built-in schedule; NaN for a table read from a file (no formula)."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if schedule.name not in SCHEDULES and not schedule.forward_only:
        return float("nan")
    if schedule.name == "zb-h1":  # Qi et al.: (p-1)(t_F + t_B - t_W) over m(t_F + t_B + t_W)
        total = costs.forward + costs.backward + costs.weight
        return (p - 1) * max(costs.forward + costs.backward - costs.weight, 0.0) / (m * total)
    return (p - 1) / (v * m)


def _peak_in_flight(schedule: Schedule, stage: int) -> int:
    """Most (microbatch, chunk) pairs forwarded but not yet backwarded on ``stage``, counted after
    a tick's forward and before its backward (when a stage's stash is fullest). A forward-only
    table drops a stage input as soon as its forward has run."""
    live = peak = 0
    for frow, brow in zip(schedule.forward, schedule.backward):
        live += frow[stage] is not None
        peak = max(peak, live)
        live -= (frow if schedule.forward_only else brow)[stage] is not None
    return peak


def _megatron_peak_stage0(name: str, stages: int, microbatches: int, chunks: int) -> int:
    """Megatron-LM's asynchronous schedules keep ``warmup + 1`` chunk-microbatches on rank 0:
    warmup is ``p - 1`` for 1F1B and ``2(p-1) + (v-1)p`` interleaved (capped at all ``m·v``)."""
    total = microbatches * chunks
    if name == FORWARD_ONLY:  # Megatron's forward_only mode frees each stage input after its forward
        return min(total, 1)
    if name == "gpipe":
        return total
    warmup = stages - 1 if chunks == 1 else 2 * (stages - 1) + (chunks - 1) * stages
    return min(total, warmup + 1)


def _check_no_backward(schedule: Schedule) -> None:
    """A forward-only table must not run backwards: its program keeps no stage inputs for them."""
    p = schedule.stages
    for tick, row in enumerate(schedule.backward):
        for stage, work in enumerate(row):
            if work is not None:
                raise ScheduleError(
                    f"tick {tick}, stage {stage}: a forward-only table runs no backward, but this one "
                    f"runs the {_describe('backward', work.microbatch, work.chunk * p + stage, p)}"
                )


def check(schedule: Schedule, costs: Costs = UNIT_COSTS) -> ScheduleStats:
    """Prove ``schedule`` runs every forward and backward (and, split, every weight gradient)
    exactly once on the right stage and respects every dependency; report its cost under ``costs``.
    A forward-only table must run every forward and no backward. Raises :class:`ScheduleError`
    naming the first problem (tick, stage and what is wrong)."""
    _check_shape(schedule)
    fwd = _placement(schedule, "forward")
    wgt: Placement | None = None
    if schedule.forward_only:
        _check_no_backward(schedule)
        bwd: Placement = {}
    else:
        bwd = _placement(schedule, "backward")
        if schedule.split_backward:
            wgt = _placement(schedule, "weight")
    _check_dependencies(schedule, fwd, bwd, wgt)
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    per_microbatch = costs.forward + (0.0 if schedule.forward_only else costs.backward + costs.weight)
    ideal = m * per_microbatch
    return ScheduleStats(
        ticks=schedule.ticks,
        bubble_fraction=(_run_time(schedule, costs) - ideal) / ideal,
        ideal_bubble=_ideal_bubble(schedule, costs),
        peak_in_flight=tuple(_peak_in_flight(schedule, s) for s in range(p)),
        megatron_peak_in_flight_stage0=_megatron_peak_stage0(schedule.name, p, m, v),
        peak_weight_pending=tuple(_peak_weight_pending(schedule, s) for s in range(p)) if wgt else (0,) * p,
        peak_until_weight=(tuple(_peak_until_weight(schedule, s) for s in range(p)) if not schedule.forward_only
                           else (0,) * p),
    )


def render(schedule: Schedule) -> str:
    """Ticks left to right, one row per stage: ``F3`` forward of microbatch 3, ``B1`` backward
    (split: its input gradient), ``W1`` its weight gradient, ``F3B1`` both in one tick, ``.`` idle;
    with chunks > 1 the chunk follows (``F3.1``)."""

    def one(tag: str, work: Work | None) -> str:
        if work is None:
            return ""
        return f"{tag}{work.microbatch}" + (f".{work.chunk}" if schedule.chunks > 1 else "")

    weight = schedule.weight_table
    cells = [
        [(one("F", schedule.forward[t][s]) + one("B", schedule.backward[t][s]) + one("W", weight[t][s])) or "."
         for t in range(schedule.ticks)]
        for s in range(schedule.stages)
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in row).rstrip() for s, row in enumerate(cells))


# --------------------------------------------------------------------------------------------
# Compiling tables into per-tick buffer instructions


# eq=False: the fields are numpy arrays, whose == is elementwise, so a generated __eq__/__hash__
# would raise rather than compare; identity is the meaningful equality for a compiled program.
@dataclass(frozen=True, eq=False)
class Program:
    """Per-tick, per-stage instructions for the runtime; read-only int32 arrays ``[ticks, stages]``,
    -1 = none. Received values wait in per-stage slot buffers (``stash`` for activations, ``grad``
    for output gradients) whose sizes are ``stash_slots`` and ``grad_slots``. A forward-only
    program has no backward instructions (all -1 / 0) and ``grad_slots == 0``.

    ``keeps_residuals``: compiled with ``keep_residuals=True``, the forward keeps what each layer's
    backward needs (its ``jax.vjp`` residuals) in ``residual_slots`` per-stage slots from the forward
    (``fwd_res_slot``) to the backward (``bwd_res_slot``) -- with a split backward to the weight
    gradient (``wgt_res_slot``), which reads them too -- and the backward recomputes nothing; the
    stash then holds a received activation only until its forward (``bwd_stash_slot`` is -1).
    Otherwise (the default: Megatron's full recomputation) the stash keeps the stage input until
    the backward, which recomputes the stage from it."""

    schedule: Schedule
    fwd_mb: np.ndarray
    fwd_chunk: np.ndarray
    fwd_slot: np.ndarray  # stash slot with the forward's input; -1 on virtual stage 0 (tokens)
    fwd_send: np.ndarray  # 1 if the output goes to the next stage (all but the last virtual stage)
    recv_fwd_slot: np.ndarray  # stash slot for the activation arriving at the start of the tick
    bwd_mb: np.ndarray
    bwd_chunk: np.ndarray
    bwd_stash_slot: np.ndarray  # stash slot with the stage input to recompute from; -1 on virtual stage 0
    bwd_grad_slot: np.ndarray  # gradient-buffer slot with d(output); -1 on the last virtual stage (loss)
    bwd_send: np.ndarray  # 1 if the input gradient goes to the previous stage (all but virtual stage 0)
    recv_bwd_slot: np.ndarray  # gradient-buffer slot for the gradient arriving at the start of the tick
    bwd_weight_slot: np.ndarray  # split backward: weight-buffer slot where B leaves what W needs; else -1
    wgt_mb: np.ndarray  # split backward: the weight gradient (W) of this tick
    wgt_chunk: np.ndarray
    wgt_slot: np.ndarray  # weight-buffer slot W reads (and frees)
    stash_slots: int
    grad_slots: int
    weight_slots: int = 0  # split backward: B-to-W buffers per stage (the table's peak_weight_pending)
    fwd_res_slot: np.ndarray | None = None  # keep_residuals: residual slot the forward fills; else -1
    bwd_res_slot: np.ndarray | None = None  # keep_residuals: residual slot the backward reads (and frees, unsplit)
    residual_slots: int = 0  # keep_residuals: forward-to-backward (split: to-W) residual buffers per stage
    wgt_res_slot: np.ndarray | None = None  # keep_residuals, split backward: residual slot W reads and frees

    @property
    def keeps_residuals(self) -> bool:
        return self.residual_slots > 0


_COLUMNS = (
    "fwd_mb", "fwd_chunk", "fwd_slot", "fwd_send", "recv_fwd_slot",
    "bwd_mb", "bwd_chunk", "bwd_stash_slot", "bwd_grad_slot", "bwd_send", "recv_bwd_slot",
    "bwd_weight_slot", "wgt_mb", "wgt_chunk", "wgt_slot", "fwd_res_slot", "bwd_res_slot", "wgt_res_slot",
)


class _Slots:
    """A free list of buffer slots that remembers how many were ever live at once."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0
        self.owner: dict[tuple[int, int], int] = {}  # (microbatch, virtual stage) -> slot

    def take(self, key: tuple[int, int]) -> int:
        slot = self.free.pop() if self.free else self.size
        self.size = max(self.size, slot + 1)
        self.owner[key] = slot
        return slot

    def release(self, key: tuple[int, int]) -> int:
        """The slot ``key`` lived in, now free for values arriving in later ticks; -1 if none."""
        slot = self.owner.pop(key, -1)
        if slot >= 0:
            self.free.append(slot)
        return slot


def _compile_stage(schedule: Schedule, stage: int, keep: bool) -> tuple[dict[str, list[int]], int, int, int, int]:
    """One stage's instruction columns plus its stash, grad, weight and residual buffer sizes.

    A slot is taken when a value arrives (start of tick ``t``) and released by the backward that
    consumes it -- by the forward in a forward-only table or when the forward ``keep``-s the
    residuals, where nothing is recomputed; since
    arrivals are handled before that tick's work, a released slot is first reused by a value
    arriving in a later tick, so nothing is overwritten while live.
    """
    p, ticks = schedule.stages, schedule.ticks
    last = p * schedule.chunks - 1
    prev, nxt = (stage - 1) % p, (stage + 1) % p
    col = {name: [-1] * ticks for name in _COLUMNS}
    col["fwd_send"] = [0] * ticks
    col["bwd_send"] = [0] * ticks
    stash, grads, weights, kept = _Slots(), _Slots(), _Slots(), _Slots()
    for tick in range(ticks):
        if tick > 0:
            sent = schedule.forward[tick - 1][prev]
            if sent is not None and sent.chunk * p + prev < last:
                col["recv_fwd_slot"][tick] = stash.take((sent.microbatch, sent.chunk * p + prev + 1))
            sent = schedule.backward[tick - 1][nxt]
            if sent is not None and sent.chunk * p + nxt > 0:
                col["recv_bwd_slot"][tick] = grads.take((sent.microbatch, sent.chunk * p + nxt - 1))
        work = schedule.forward[tick][stage]
        if work is not None:
            key = (work.microbatch, work.chunk * p + stage)
            col["fwd_mb"][tick], col["fwd_chunk"][tick] = work.microbatch, work.chunk
            consumed = schedule.forward_only or keep
            col["fwd_slot"][tick] = stash.release(key) if consumed else stash.owner.get(key, -1)
            if keep:
                col["fwd_res_slot"][tick] = kept.take(key)
            col["fwd_send"][tick] = int(key[1] < last)
        work = schedule.backward[tick][stage]
        if work is not None:
            key = (work.microbatch, work.chunk * p + stage)
            col["bwd_mb"][tick], col["bwd_chunk"][tick] = work.microbatch, work.chunk
            col["bwd_stash_slot"][tick] = stash.release(key)  # -1 when the forward consumed it
            if keep:  # a split backward's W reads the residuals too and frees them
                col["bwd_res_slot"][tick] = kept.owner[key] if schedule.split_backward else kept.release(key)
            col["bwd_grad_slot"][tick] = grads.release(key)
            col["bwd_send"][tick] = int(key[1] > 0)
            if schedule.split_backward:
                col["bwd_weight_slot"][tick] = weights.take(key)
        work = schedule.weight[tick][stage] if schedule.split_backward else None
        if work is not None:
            # W runs after B in its tick, so a slot W frees is first reused by the next tick's B.
            key = (work.microbatch, work.chunk * p + stage)
            col["wgt_mb"][tick], col["wgt_chunk"][tick] = work.microbatch, work.chunk
            col["wgt_slot"][tick] = weights.release(key)
            if keep:
                col["wgt_res_slot"][tick] = kept.release(key)
    return col, stash.size, grads.size, weights.size, kept.size


def compile_program(schedule: Schedule, keep_residuals: bool = False) -> Program:
    """Turn a table into buffer-slot instructions (the table is checked first, so a compiled
    program never reads a value before it arrives).

    ``keep_residuals``: the forward keeps every layer's backward residuals until the backward
    (no recomputation; ``pipeline.recompute=false``) instead of the stage input alone."""
    check(schedule)
    if keep_residuals and schedule.forward_only:
        raise ScheduleError("keep_residuals: a forward-only table has no backward to keep residuals for")
    per_stage = [_compile_stage(schedule, s, keep_residuals) for s in range(schedule.stages)]
    arrays = {}
    for name in _COLUMNS:
        array = np.array([col[name] for col, *_ in per_stage], np.int32).T.copy()  # [ticks, stages]
        array.setflags(write=False)
        arrays[name] = array
    return Program(
        schedule,
        **arrays,
        stash_slots=max(sizes[1] for sizes in per_stage),
        grad_slots=max(sizes[2] for sizes in per_stage),
        weight_slots=max(sizes[3] for sizes in per_stage),
        residual_slots=max(sizes[4] for sizes in per_stage),
    )
