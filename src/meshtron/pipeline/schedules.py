"""Pipeline schedules as data: tables of (tick, stage) -> forward / backward work, a checker, and
the per-tick instructions the SPMD runtime executes. No JAX here.

Execution model (what the runtime in :mod:`meshtron.pipeline.runtime` does): ``p`` stages on a
ring, ``m`` microbatches, ``v`` model chunks per stage (virtual stage ``k = chunk·p + stage``).
In each tick every stage runs at most one forward and at most one backward, forward first. A
value produced in tick ``t`` is sent at the end of the tick and can be used from tick ``t + 1``
on (the receiver buffers it). Hence a forward of ``(mb, k)`` needs the forward of ``(mb, k-1)``
in an earlier tick, and a backward of ``(mb, k)`` needs its own forward (same tick or earlier)
and the backward of ``(mb, k+1)`` in an earlier tick.

All three schedules give every stage the same op *order*, shifted in time: forward op ``j`` of
stage ``s`` runs in tick ``j + s`` and backward op ``j`` in tick ``T0 + j + (p - 1 - s)``. The
order is Megatron-LM's (microbatches in groups of ``p`` per chunk for the interleaved schedule);
``T0`` decides how early backwards start: after all forwards (GPipe) or as soon as the last
virtual stage has the first microbatch's output (1F1B, interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

T_FORWARD, T_BACKWARD = 1.0, 2.0  # unit cost model: a backward costs two forwards


class ScheduleError(ValueError):
    """A schedule cannot be built as asked, or a table breaks a dependency."""


@dataclass(frozen=True)
class Work:
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Schedule:
    """``forward[tick][stage]`` and ``backward[tick][stage]``: the work, or None when idle."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    forward: tuple[tuple[Work | None, ...], ...]
    backward: tuple[tuple[Work | None, ...], ...]

    @property
    def ticks(self) -> int:
        return len(self.forward)


def _megatron_order(stages: int, microbatches: int, chunks: int) -> list[Work]:
    """Forward op order of every stage: groups of ``p`` microbatches through chunk 0, then chunk 1, ..."""
    group = stages * chunks
    return [
        Work((j // group) * stages + j % stages, (j % group) // stages) for j in range(microbatches * chunks)
    ]


def _shifted(name: str, stages: int, microbatches: int, chunks: int, backward_start: int) -> Schedule:
    order = _megatron_order(stages, microbatches, chunks)
    n = len(order)
    ticks = backward_start + n + stages - 1
    forward = [[None] * stages for _ in range(ticks)]
    backward = [[None] * stages for _ in range(ticks)]
    for s in range(stages):
        for j, work in enumerate(order):
            forward[j + s][s] = work
            backward[backward_start + j + stages - 1 - s][s] = Work(work.microbatch, chunks - 1 - work.chunk)
    return Schedule(
        name, stages, microbatches, chunks, tuple(map(tuple, forward)), tuple(map(tuple, backward))
    )


def _validate(name: str, stages: int, microbatches: int, chunks: int) -> None:
    if stages < 1:
        raise ScheduleError(f"stages: need at least 1, got {stages}")
    if chunks < 1:
        raise ScheduleError(f"chunks: need at least 1, got {chunks}")
    if microbatches < stages:
        raise ScheduleError(
            f"microbatches: m={microbatches} < p={stages}: the pipeline cannot fill; use at least {stages}"
        )
    if chunks > 1 and name != "interleaved":
        raise ScheduleError(f"chunks: {name} runs one chunk per stage; use the interleaved schedule for chunks={chunks}")
    if name == "interleaved" and microbatches % stages:
        raise ScheduleError(
            f"microbatches: the interleaved schedule needs a multiple of p={stages}, got m={microbatches}"
        )


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al.); in-flight activations grow with m."""
    _validate("gpipe", stages, microbatches, 1)
    return _shifted("gpipe", stages, microbatches, 1, backward_start=microbatches + stages - 2)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """PipeDream-Flush: backwards start as soon as possible, so in-flight activations stay bounded."""
    _validate("1f1b", stages, microbatches, 1)
    return _shifted("1f1b", stages, microbatches, 1, backward_start=stages - 1)


def interleaved(stages: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per stage cut the bubble by v (ring wrap-around)."""
    _validate("interleaved", stages, microbatches, chunks)
    return _shifted("interleaved", stages, microbatches, chunks, backward_start=chunks * stages - 1)


def make_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    if name == "gpipe":
        _validate(name, stages, microbatches, chunks)
        return gpipe(stages, microbatches)
    if name == "1f1b":
        _validate(name, stages, microbatches, chunks)
        return one_f_one_b(stages, microbatches)
    if name == "interleaved":
        return interleaved(stages, microbatches, chunks)
    raise ScheduleError(f"schedule: unknown {name!r}; use 'gpipe', '1f1b' or 'interleaved'")


@dataclass(frozen=True)
class ScheduleStats:
    """What a valid table costs: ticks, bubble (unit costs t_b = 2 t_f) and activation memory."""

    ticks: int
    bubble_fraction: float
    ideal_bubble: float
    peak_in_flight: tuple[int, ...]  # per stage, in chunk-microbatches (stage inputs stashed)
    megatron_peak_in_flight_stage0: int  # Megatron's asynchronous schedule, for comparison


def _positions(schedule: Schedule) -> tuple[dict, dict]:
    """(mb, virtual stage) -> tick, for forwards and backwards; checks stage and uniqueness."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    found: list[dict] = [{}, {}]
    for kind, table in enumerate((schedule.forward, schedule.backward)):
        label = "forward" if kind == 0 else "backward"
        if any(len(row) != p for row in table):
            raise ScheduleError(f"{label} table: every tick needs one entry per stage ({p})")
        for tick, row in enumerate(table):
            for stage, work in enumerate(row):
                if work is None:
                    continue
                if not (0 <= work.microbatch < m and 0 <= work.chunk < v):
                    raise ScheduleError(f"tick {tick}, stage {stage}: {label} {work} is out of range (m={m}, v={v})")
                key = (work.microbatch, work.chunk * p + stage)
                if key in found[kind]:
                    raise ScheduleError(
                        f"tick {tick}, stage {stage}: {label} of microbatch {work.microbatch} chunk {work.chunk} "
                        f"runs twice (first at tick {found[kind][key]})"
                    )
                found[kind][key] = tick
    for kind, label in ((0, "forward"), (1, "backward")):
        for mb in range(m):
            for k in range(p * v):
                if (mb, k) not in found[kind]:
                    raise ScheduleError(
                        f"{label} of microbatch {mb} on virtual stage {k} (stage {k % p}, chunk {k // p}) never runs"
                    )
    return found[0], found[1]


def check(schedule: Schedule) -> ScheduleStats:
    """Prove ``schedule`` respects every dependency and report its cost; raise on the first violation."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if len(schedule.forward) != len(schedule.backward):
        raise ScheduleError("forward and backward tables must have the same number of ticks")
    fwd, bwd = _positions(schedule)
    last = p * v - 1
    for (mb, k), tick in sorted(fwd.items(), key=lambda kv: kv[1]):
        if k > 0 and fwd[(mb, k - 1)] >= tick:
            raise ScheduleError(
                f"tick {tick}, stage {k % p}: forward of microbatch {mb} chunk {k // p} runs before its input "
                f"arrives (virtual stage {k - 1} runs it at tick {fwd[(mb, k - 1)]}, usable from the next tick)"
            )
    for (mb, k), tick in sorted(bwd.items(), key=lambda kv: kv[1]):
        if fwd[(mb, k)] > tick:
            raise ScheduleError(
                f"tick {tick}, stage {k % p}: backward of microbatch {mb} chunk {k // p} runs before its own "
                f"forward (tick {fwd[(mb, k)]})"
            )
        if k < last and bwd[(mb, k + 1)] >= tick:
            raise ScheduleError(
                f"tick {tick}, stage {k % p}: backward of microbatch {mb} chunk {k // p} runs before its output "
                f"gradient arrives (virtual stage {k + 1} runs its backward at tick {bwd[(mb, k + 1)]})"
            )
    cost_f, cost_b = T_FORWARD / v, T_BACKWARD / v
    time = sum(
        max((cost_f if f is not None else 0.0) + (cost_b if b is not None else 0.0) for f, b in zip(frow, brow))
        for frow, brow in zip(schedule.forward, schedule.backward)
    )
    ideal = m * (T_FORWARD + T_BACKWARD)
    peaks = []
    for stage in range(p):
        live = peak = 0
        for frow, brow in zip(schedule.forward, schedule.backward):
            live += frow[stage] is not None
            peak = max(peak, live)
            live -= brow[stage] is not None
        peaks.append(peak)
    # Megatron-LM's asynchronous schedules on rank 0: warmup + 1 chunk-microbatches (GPipe: all m).
    megatron = m * v if schedule.name == "gpipe" else min(m * v, 2 * (p - 1) + (v - 1) * p + 1 if v > 1 else p)
    return ScheduleStats(
        ticks=schedule.ticks,
        bubble_fraction=(time - ideal) / ideal,
        ideal_bubble=(p - 1) / (v * m),
        peak_in_flight=tuple(peaks),
        megatron_peak_in_flight_stage0=megatron,
    )


def render(schedule: Schedule) -> str:
    """Ticks left to right, one row per stage: ``F3`` forward of microbatch 3, ``B1`` backward,
    ``F3B1`` both in one tick, ``.`` idle; with chunks > 1 the chunk follows (``F3.1``)."""

    def cell(f: Work | None, b: Work | None) -> str:
        def one(tag: str, w: Work | None) -> str:
            if w is None:
                return ""
            return f"{tag}{w.microbatch}" + (f".{w.chunk}" if schedule.chunks > 1 else "")

        return (one("F", f) + one("B", b)) or "."

    cells = [
        [cell(schedule.forward[t][s], schedule.backward[t][s]) for t in range(schedule.ticks)]
        for s in range(schedule.stages)
    ]
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in row).rstrip() for s, row in enumerate(cells))


@dataclass(frozen=True)
class Program:
    """Per-tick, per-stage instructions for the runtime; int32 arrays ``[ticks, stages]``, -1 = none."""

    schedule: Schedule
    fwd_mb: np.ndarray
    fwd_chunk: np.ndarray
    fwd_slot: np.ndarray  # stash slot with the forward's input; -1 on virtual stage 0 (tokens)
    fwd_send: np.ndarray  # 1 if the output goes to the next stage
    recv_fwd_slot: np.ndarray  # stash slot for the activation arriving at the start of the tick
    bwd_mb: np.ndarray
    bwd_chunk: np.ndarray
    bwd_stash_slot: np.ndarray  # stash slot with the stage input to recompute from; -1 on virtual stage 0
    bwd_grad_slot: np.ndarray  # gradient-buffer slot with d(output); -1 on the last virtual stage (loss)
    bwd_send: np.ndarray  # 1 if the input gradient goes to the previous stage
    recv_bwd_slot: np.ndarray  # gradient-buffer slot for the gradient arriving at the start of the tick
    stash_slots: int
    grad_slots: int


class _Slots:
    """A free list of buffer slots; records how many were ever needed at once."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        self.free.append(slot)


def compile_program(schedule: Schedule) -> Program:
    """Turn a valid table into buffer-slot instructions (checks the table first)."""
    check(schedule)
    p, v, ticks = schedule.stages, schedule.chunks, schedule.ticks
    last = p * v - 1
    arrays = {
        name: np.full((ticks, p), -1, np.int32)
        for name in ("fwd_mb", "fwd_chunk", "fwd_slot", "recv_fwd_slot", "bwd_mb", "bwd_chunk",
                     "bwd_stash_slot", "bwd_grad_slot", "recv_bwd_slot")
    }
    arrays["fwd_send"] = np.zeros((ticks, p), np.int32)
    arrays["bwd_send"] = np.zeros((ticks, p), np.int32)
    stash_size = grad_size = 0
    for stage in range(p):
        stash, grads = _Slots(), _Slots()
        stash_of: dict[tuple[int, int], int] = {}
        grad_of: dict[tuple[int, int], int] = {}
        prev = (stage - 1) % p
        nxt = (stage + 1) % p
        for tick in range(ticks):
            if tick > 0:
                sent = schedule.forward[tick - 1][prev]
                if sent is not None:
                    k = sent.chunk * p + prev + 1  # the receiving virtual stage
                    if k <= last:
                        stash_of[(sent.microbatch, k)] = arrays["recv_fwd_slot"][tick, stage] = stash.take()
                sent = schedule.backward[tick - 1][nxt]
                if sent is not None:
                    k = sent.chunk * p + nxt - 1
                    if k >= 0:
                        grad_of[(sent.microbatch, k)] = arrays["recv_bwd_slot"][tick, stage] = grads.take()
            work = schedule.forward[tick][stage]
            if work is not None:
                k = work.chunk * p + stage
                arrays["fwd_mb"][tick, stage], arrays["fwd_chunk"][tick, stage] = work.microbatch, work.chunk
                arrays["fwd_slot"][tick, stage] = stash_of.get((work.microbatch, k), -1)
                arrays["fwd_send"][tick, stage] = int(k < last)
            work = schedule.backward[tick][stage]
            if work is not None:
                k = work.chunk * p + stage
                arrays["bwd_mb"][tick, stage], arrays["bwd_chunk"][tick, stage] = work.microbatch, work.chunk
                arrays["bwd_send"][tick, stage] = int(k > 0)
                if (work.microbatch, k) in stash_of:
                    slot = stash_of.pop((work.microbatch, k))
                    arrays["bwd_stash_slot"][tick, stage] = slot
                    stash.give(slot)
                if (work.microbatch, k) in grad_of:
                    slot = grad_of.pop((work.microbatch, k))
                    arrays["bwd_grad_slot"][tick, stage] = slot
                    grads.give(slot)
        stash_size, grad_size = max(stash_size, stash.size), max(grad_size, grads.size)
    return Program(schedule, **arrays, stash_slots=stash_size, grad_slots=grad_size)
