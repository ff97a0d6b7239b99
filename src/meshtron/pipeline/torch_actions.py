"""PyTorch's pipeline action lists (``torch.distributed.pipelining``) read into meshtron's tables,
and meshtron's tables written out as action lists. No JAX, no torch.

Why: PyTorch writes a schedule as one list of actions per pipeline rank -- ``2F0`` is the forward
of microbatch 0 through stage 2, ``I`` the input-gradient half of a split backward, ``W`` its
weight-gradient half, ``B`` a whole backward -- one CSV row per rank (``_dump_csv`` /
``_load_csv`` in its ``compute_only`` form). Reading that format lets a schedule designed with
PyTorch's tools (or any of its built-in ones) run in meshtron's one-program runtime, and writing it
lets PyTorch's tools draw and simulate meshtron's tables.

The two models of time differ, and the conversion is where they meet. A PyTorch rank runs its list
in order, each action as soon as what it receives has arrived (empty cells are drawing aids,
skipped). meshtron's table is lockstep: in each tick every stage runs at most one forward, one
backward and one weight gradient, in that order, and a value sent in a tick is usable from the next.
:func:`to_schedule` places every rank's actions in list order, each in the earliest tick that
respects both -- the table a PyTorch run of that list would follow if every action took one tick
-- then hands the table to :func:`meshtron.pipeline.schedules.check`. Lists the lockstep runtime
cannot run are refused with the reason: a stage on another rank than ``stage mod p`` (the V
placement of ZBV and DualPipeV), missing or repeated work, or an order in which some rank waits for
a value that can never arrive (the first waits are named).

Actions that are not computation are dropped, because the runtime does that work itself: sends and
receives (``SEND_F``, ``RECV_B``, ...: every tick ends with a ring exchange), ``REDUCE_GRAD`` (the
data-parallel reduction follows the step) and ``UNSHARD``/``RESHARD`` (FSDP's; meshtron shards with
the optimizer). ``(a;b)OVERLAP_F_B`` runs its sub-actions in order. A list that mixes whole
backwards with split ones runs each ``B`` as ``I`` then ``W`` in the same tick.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from meshtron.pipeline.table import Schedule, ScheduleError, Work, check

FORWARD, BACKWARD, INPUT_GRADIENT, WEIGHT_GRADIENT = "F", "B", "I", "W"
_COMPUTE = (FORWARD, BACKWARD, INPUT_GRADIENT, WEIGHT_GRADIENT)
_NOT_COMPUTE = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
# Longest kinds first, so that ``RECV_F`` is not read as ``R`` + ``ECV_F``.
_ACTION = re.compile(r"(\d+)(" + "|".join(sorted(_COMPUTE + _NOT_COMPUTE, key=len, reverse=True)) + r")(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_PHASE = {FORWARD: 0, BACKWARD: 1, INPUT_GRADIENT: 1, WEIGHT_GRADIENT: 2}  # order of work within a tick


@dataclass(frozen=True)
class Action:
    """One computation of a PyTorch action list: ``kind`` (F, B, I or W) of ``microbatch`` through
    ``stage`` (PyTorch's stage index: meshtron's virtual stage, ``chunk·p + rank``)."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:  # PyTorch's spelling, e.g. ``2F0``
        return f"{self.stage}{self.kind}{self.microbatch}"


ActionLists = list[list["Action | None"]]  # one list per pipeline rank; None: an idle step (drawing aid)


def parse_action(text: str) -> list[Action]:
    """The computations in one CSV cell: none for an empty cell or a non-compute action, one for
    ``2F0``, the sub-actions of ``(0F1;1B0)OVERLAP_F_B``. Raises :class:`ScheduleError` saying
    what a cell should look like."""
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP.fullmatch(text)
    if overlap:
        return [a for part in overlap.group(1).split(";") for a in parse_action(part)]
    match = _ACTION.fullmatch(text)
    if match is None:
        raise ScheduleError(f"action {text!r} is not PyTorch's [stage][kind][microbatch] form, e.g. 2F0, 1I3, 0W3 "
                            f"(kinds {', '.join(_COMPUTE + _NOT_COMPUTE)})")
    stage, kind, microbatch = match.groups()
    if kind in _NOT_COMPUTE:
        return []
    if not microbatch:
        raise ScheduleError(f"action {text!r}: a {kind} action needs a microbatch index, e.g. {stage}{kind}0")
    return [Action(int(stage), kind, int(microbatch))]


def read_csv(path: str | Path) -> ActionLists:
    """One list of computations per rank from a CSV as PyTorch's ``_dump_csv`` writes it (empty
    cells become ``None``). Raises :class:`ScheduleError` naming the file, rank and column."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.reader(file))
    except (OSError, UnicodeDecodeError) as err:
        raise ScheduleError(f"{path}: cannot read a PyTorch action CSV ({err})") from None
    ranks: ActionLists = []
    for rank, row in enumerate(rows):
        actions: list[Action | None] = []
        for column, cell in enumerate(row):
            try:
                parsed = parse_action(cell)
            except ScheduleError as err:
                raise ScheduleError(f"{path}: rank {rank} (row {rank + 1}), column {column + 1}: {err}") from None
            actions.extend(parsed if parsed or cell.strip() else [None])
        ranks.append(actions)
    while ranks and not any(ranks[-1]):  # a trailing blank line is not a rank
        ranks.pop()
    if not ranks:
        raise ScheduleError(f"{path}: no actions; expected one row of actions (e.g. 0F0,0F1,0B0) per pipeline rank")
    return ranks


def write_csv(actions: ActionLists, path: str | Path) -> Path:
    """Write one row per rank, as PyTorch's ``_dump_csv`` does (``None`` as an empty cell), so its
    ``_load_csv`` reads the file back."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        for row in actions:
            writer.writerow(["" if a is None else str(a) for a in row])
    return path


def from_schedule(schedule: Schedule) -> ActionLists:
    """A checked table as PyTorch actions: per rank, each tick's forward, backward (``I`` when the
    table splits the backward, else ``B``) and weight gradient in that order, and ``None`` for a
    tick the rank idles (PyTorch draws it as a bubble and skips it when it runs)."""
    check(schedule)
    if schedule.forward_only:
        raise ScheduleError("from_schedule: a forward-only table is not a training schedule PyTorch can run")
    p = schedule.stages
    backward_kind = INPUT_GRADIENT if schedule.split_backward else BACKWARD
    ranks: ActionLists = [[] for _ in range(p)]
    for frow, brow, wrow in zip(schedule.forward, schedule.backward, schedule.weight_table):
        for rank in range(p):
            cell = [Action(work.chunk * p + rank, kind, work.microbatch)
                    for kind, work in ((FORWARD, frow[rank]), (backward_kind, brow[rank]), (WEIGHT_GRADIENT, wrow[rank]))
                    if work is not None]
            ranks[rank].extend(cell or [None])
    for row in ranks:  # idle ticks after a rank's last work are not worth a cell
        while row and row[-1] is None:
            row.pop()
    return ranks


def to_schedule(actions: ActionLists, name: str = "torch") -> Schedule:
    """The lockstep table that runs each rank's actions in its order (see the module docstring),
    checked. Raises :class:`ScheduleError` with the reason when the runtime cannot run them."""
    lists = [[a for a in row if a is not None] for row in actions]
    p = len(lists)
    if not any(lists):
        raise ScheduleError(f"{name}: no computations (F, B, I or W actions) in any rank's list")
    stages = 1 + max(a.stage for row in lists for a in row)
    _check_placement(lists, stages, name)
    split = any(a.kind in (INPUT_GRADIENT, WEIGHT_GRADIENT) for row in lists for a in row)
    if split:  # a whole backward in a split table: its input gradient, then its weight gradient
        lists = [[b for a in row for b in ((Action(a.stage, INPUT_GRADIENT, a.microbatch),
                                             Action(a.stage, WEIGHT_GRADIENT, a.microbatch))
                                            if a.kind == BACKWARD else (a,))] for row in lists]
    microbatches = _check_coverage(lists, stages, split, name)
    ticks = _place(lists, stages, name, one_per_tick=split)
    length = 1 + max(ticks.values())
    tables: dict[str, list[list[Work | None]]] = {
        kind: [[None] * p for _ in range(length)] for kind in (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT)}
    for (kind, stage, mb), tick in ticks.items():
        table = tables[INPUT_GRADIENT if kind == BACKWARD else kind]
        table[tick][stage % p] = Work(mb, stage // p)
    forward, backward, weight = (tuple(map(tuple, tables[kind])) for kind in (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT))
    schedule = Schedule(name, p, microbatches, stages // p, forward, backward, weight if split else ())
    try:
        check(schedule)
    except ScheduleError as err:  # cannot happen for a placement that waited for every input; kept honest
        raise ScheduleError(f"{name}: {err}") from None
    return schedule


def _check_placement(lists: list[list[Action]], stages: int, name: str) -> None:
    """Every stage on rank ``stage mod p``: the runtime's ring passes virtual stage ``k`` to ``k + 1``
    on the next rank, so stage ``k`` must live on rank ``k mod p``, with the same number per rank."""
    p = len(lists)
    if stages % p:
        raise ScheduleError(f"{name}: {stages} stages on {p} ranks; the runtime needs the same number of "
                            f"stages (model chunks) on every rank, i.e. a multiple of {p}")
    for rank, row in enumerate(lists):
        for position, action in enumerate(row):
            if action.stage % p != rank:
                v_shape = stages == 2 * p and action.stage == 2 * p - 1 - rank
                raise ScheduleError(
                    f"{name}: rank {rank} runs stage {action.stage} ({action}, action {position + 1} of its list), "
                    f"but meshtron runs stage k on rank k mod p = {action.stage % p} (loop placement: the ring "
                    "carries stage k's output to rank k+1)"
                    + ("; this is a V placement (rank r holds stages r and 2p-1-r, as ZBV and DualPipeV do), "
                       "which the one-program runtime cannot run" if v_shape else "")
                )


def _check_coverage(lists: list[list[Action]], stages: int, split: bool, name: str) -> int:
    """The number of microbatches (those stage 0 forwards, which must be 0..m-1), after proving each
    stage runs each microbatch's forward, backward and (split) weight gradient exactly once."""
    p = len(lists)
    seen: dict[tuple[str, int], list[int]] = {}
    for row in lists:
        for a in row:
            seen.setdefault((a.kind, a.stage), []).append(a.microbatch)
    first = sorted(seen.get((FORWARD, 0), []))
    microbatches = len(first)
    if first != list(range(microbatches)) or not microbatches:
        raise ScheduleError(f"{name}: stage 0 (rank 0) must forward microbatches 0, 1, ..., m-1 once each; "
                            f"it forwards {first}")
    kinds = (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT) if split else (FORWARD, BACKWARD)
    words = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRADIENT: "input gradient (I)",
             WEIGHT_GRADIENT: "weight gradient (W)"}
    for stage in range(stages):
        for kind in kinds:
            got = sorted(seen.get((kind, stage), []))
            if got == first:
                continue
            missing = sorted(set(first) - set(got))
            unknown = sorted({mb for mb in got if mb not in first})
            twice = sorted({mb for mb in got if mb in first and got.count(mb) > 1})
            problems = [f"never runs microbatch {', '.join(map(str, missing))}"] if missing else []
            problems += [f"runs microbatch {', '.join(map(str, unknown))} which stage 0 never forwards"] if unknown else []
            problems += [f"runs microbatch {', '.join(map(str, twice))} twice"] if twice else []
            problem = "; ".join(problems)
            raise ScheduleError(f"{name}: the {words[kind]} of stage {stage} (rank {stage % p}) {problem} "
                                f"(stage 0 forwards microbatches 0..{microbatches - 1})")
    return microbatches


def _ready(action: Action, tick: int, done: dict[tuple[str, int, int], int], last: int) -> tuple[str, int, int] | None:
    """What ``action`` still waits for in ``tick`` (None: it can run). Another rank's value must come
    from an earlier tick; the rank's own earlier work may be from this one. A backward needs its own
    forward and the same kind of backward (B or I) of the next stage."""
    kind, stage, mb = action.kind, action.stage, action.microbatch
    if kind == FORWARD:
        need = (FORWARD, stage - 1, mb)
        return None if stage == 0 or done.get(need, tick) < tick else need
    own = (INPUT_GRADIENT if kind == WEIGHT_GRADIENT else FORWARD, stage, mb)
    if done.get(own, tick + 1) > tick:
        return own
    if kind == WEIGHT_GRADIENT or stage == last:
        return None
    need = (kind, stage + 1, mb)
    return None if done.get(need, tick) < tick else need


def _place(lists: list[list[Action]], stages: int, name: str, one_per_tick: bool) -> dict[tuple[str, int, int], int]:
    """(kind, stage, microbatch) -> tick: each rank's actions in order, each in the earliest tick that
    has its inputs and keeps the within-tick order forward, backward, weight gradient; with
    ``one_per_tick``, at most one action per rank and tick."""
    done: dict[tuple[str, int, int], int] = {}
    nxt = [0] * len(lists)
    tick = 0
    while any(n < len(row) for n, row in zip(nxt, lists)):
        moved = False
        for rank, row in enumerate(lists):
            phase = -1
            while nxt[rank] < len(row):
                action = row[nxt[rank]]
                if _PHASE[action.kind] <= phase or _ready(action, tick, done, stages - 1) is not None:
                    break
                done[(action.kind, action.stage, action.microbatch)] = tick
                phase = 3 if one_per_tick else _PHASE[action.kind]
                nxt[rank] += 1
                moved = True
        if not moved:
            raise ScheduleError(f"{name}: no rank can go on (deadlock): " + "; ".join(_waits(lists, nxt, done, tick,
                                                                                           stages - 1)))
        tick += 1
    return done


def _waits(lists: list[list[Action]], nxt: list[int], done: dict, tick: int, last: int) -> list[str]:
    """For each rank still working: the action it is stuck at, the value it waits for, and where
    that value's producer stands in its own list."""
    p = len(lists)
    out = []
    for rank, row in enumerate(lists):
        if nxt[rank] >= len(row):
            continue
        action = row[nxt[rank]]
        kind, stage, mb = need = _ready(action, tick, done, last)
        owner = stage % p
        producer = next((i for i, a in enumerate(lists[owner]) if (a.kind, a.stage, a.microbatch) == need), None)
        what = ("its own" if stage == action.stage else "the output of" if kind == FORWARD else
                "the input gradient from")
        where = (f"which rank {owner} lists as action {producer + 1}, after where it waits" if producer is not None
                 else f"which rank {owner} never runs")
        out.append(f"rank {rank} waits at {action} (action {nxt[rank] + 1}) for {what} {stage}{kind}{mb}, {where}")
    return out
