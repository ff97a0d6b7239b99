"""A pipeline schedule as data: which (microbatch, chunk) every stage runs forward and backward in
every tick, and the checker that proves a table runs every piece of work once, on the right stage,
after what it depends on -- and prices it (bubble, in-flight microbatches, memory). No JAX here.

Execution model: ``p`` stages on a ring, ``m`` microbatches, ``v`` model chunks per stage
(virtual stage ``k = chunk·p + stage``; virtual stage ``k`` feeds ``k + 1``, so stage ``p - 1``
chunk ``c`` feeds stage 0 chunk ``c + 1``). In each tick every stage runs at most one forward and
at most one backward, forward first. A value produced in tick ``t`` is sent at the end of the
tick and can be used from tick ``t + 1`` on (the receiver buffers it). Hence a forward of
``(mb, k)`` needs the forward of ``(mb, k-1)`` in an earlier tick, and a backward of ``(mb, k)``
needs its own forward (same tick or earlier) and the backward of ``(mb, k+1)`` in an earlier tick.
Under full recomputation a backward also reruns its stage forward; where its stage runs no backward
in the tick before, the program runs that rerun there (:func:`hoisted_recomputes`), and the pricing
(:class:`Costs`' ``recompute``) follows it.
The built-in tables are made in :mod:`meshtron.pipeline.schedules`; PyTorch's are read by
:mod:`meshtron.pipeline.torch_actions`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    # Rerunning a stage's forward for its backward (``parallel.recompute=true``); 0: priced as if the
    # residuals were kept. Priced in the backward's tick, or in the tick before where the program
    # hoists it there (:func:`hoisted_recomputes`).
    recompute: float = 0.0

    def of_chunk_work(self, split: bool, chunks: int) -> tuple[float, float, float]:
        """(forward, backward, weight) cost of one table cell with ``chunks`` chunks per stage: a
        chunk does 1/v of a stage's work, and an unsplit backward includes the weight gradient."""
        backward = self.backward if split else self.backward + self.weight
        return self.forward / chunks, backward / chunks, self.weight / chunks


UNIT_COSTS = Costs()
RECOMPUTE_COSTS = Costs(recompute=1.0)  # unit costs with Megatron's full recomputation (R = F)


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
# Checking and pricing tables


@dataclass(frozen=True)
class ScheduleStats:
    """What a valid table costs: ticks, bubble (under :class:`Costs`) and activation memory."""

    ticks: int
    bubble_fraction: float  # (lockstep run time - m·Σt) / m·Σt, Σt = t_F + t_B + t_W + t_R; forward-only: m·t_F
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


def run_time(schedule: Schedule, costs: Costs, hoist: bool = True) -> float:
    """Lockstep time: each tick lasts as long as its busiest stage (per chunk, costs divided by ``v``;
    an unsplit backward costs ``t_B + t_W``, plus ``costs.recompute`` in its own tick or, hoisted
    (:func:`hoisted_recomputes`; ``hoist=False``: never), in the tick before)."""
    hoisted = hoisted_recomputes(schedule) if costs.recompute and hoist else frozenset()
    return _priced_time(schedule, costs, hoisted)


def _priced_time(schedule: Schedule, costs: Costs, hoisted: frozenset[tuple[int, int]]) -> float:
    cost_f, cost_b, cost_w = costs.of_chunk_work(schedule.split_backward, schedule.chunks)
    cost_r = costs.recompute / schedule.chunks
    weight = schedule.weight_table
    total = 0.0
    for tick, (frow, brow, wrow) in enumerate(zip(schedule.forward, schedule.backward, weight)):
        busiest = 0.0
        for stage, (f, b, w) in enumerate(zip(frow, brow, wrow)):
            here = cost_f * (f is not None) + cost_b * (b is not None) + cost_w * (w is not None)
            here += cost_r * (b is not None and (tick, stage) not in hoisted)
            here += cost_r * ((tick + 1, stage) in hoisted)
            busiest = max(busiest, here)
        total += busiest
    return total


def _hoistable(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """(tick, stage) of the backwards whose recomputation *can* run a tick early: an unsplit backward
    at ``tick`` whose stage runs no backward at ``tick - 1`` and whose forward ran by then (its stashed
    input, or its tokens, are there)."""
    if schedule.split_backward or schedule.forward_only:
        return frozenset()
    p = schedule.stages
    forwarded = {}
    for tick, row in enumerate(schedule.forward):
        for stage, work in enumerate(row):
            if work is not None:
                forwarded[(work.microbatch, work.chunk * p + stage)] = tick
    return frozenset(
        (tick, stage)
        for tick in range(1, schedule.ticks)
        for stage, work in enumerate(schedule.backward[tick])
        if work is not None and schedule.backward[tick - 1][stage] is None
        and forwarded.get((work.microbatch, work.chunk * p + stage), tick) < tick
    )


def hoisted_recomputes(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """(tick, stage) of the backwards whose stage forward is rerun in the tick before, with the layers'
    residuals kept for one tick (``parallel.recompute=true``): a stage that ran a forward-only tick and
    then a backward-only one would otherwise cost ``t_F`` and ``t_R + t_B + t_W``; hoisted, ``t_F + t_R``
    and ``t_B + t_W``, balanced when ``t_R = t_F`` and ``t_B + t_W = 2·t_F``. Every backward that can be
    hoisted (:func:`_hoistable`) is, when that makes the table faster under :data:`RECOMPUTE_COSTS`;
    otherwise none is (the lockstep 1F1B runs a backward in every tick of its steady state, so hoisting its
    first backwards saves no time and would cost a residual slot)."""
    hoistable = _hoistable(schedule)
    if not hoistable or _priced_time(schedule, RECOMPUTE_COSTS, hoistable) >= _priced_time(
            schedule, RECOMPUTE_COSTS, frozenset()):
        return frozenset()
    return hoistable


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
    per_microbatch = costs.forward + (0.0 if schedule.forward_only else costs.backward + costs.weight + costs.recompute)
    ideal = m * per_microbatch
    return ScheduleStats(
        ticks=schedule.ticks,
        bubble_fraction=(run_time(schedule, costs) - ideal) / ideal,
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
