"""Proof, from a compiled program, that no device can start its collectives in another order.

A collective completes only when every device of its group has entered it. Two devices that start
the same two collectives in opposite orders wait for each other forever (XLA's CPU runtime aborts
after 40 s; NCCL hangs). A plain SPMD program is safe because each device's runtime executes the
collectives of one computation in the order of its instruction sequence, the same on every device.
That guarantee does **not** reach inside a ``conditional`` (or ``while``): its collectives sit in a
nested executor, and XLA's CPU runtime of jaxlib 0.10.2 schedules such an instruction as soon as
its operands are ready, concurrently with the collectives around it. Only data dependencies order
it: ``optimization_barrier`` does not survive XLA's pipeline (the optimized HLO holds none), so
barriers in the Python code prove nothing.

The rule this module checks, per computation of the optimized HLO:

    every instruction that runs collectives inside a nested computation (a ``conditional``,
    ``while`` or ``call`` whose callees contain one) is ordered by data dependencies --
    operand chains or control predecessors -- before or after every other instruction of the
    same computation that runs collectives.

Plain collectives among themselves are left to the runtime's program order. The rule is checked
on the text of ``compiled.as_text()``, so it holds for what XLA will run, not for what the Python
code meant. :func:`unordered_collectives` lists the violations (empty = proved).

**A runtime that executes the schedule.** XLA:GPU runs a scheduled module (``is_scheduled=true``) as
one sequence per computation: each instruction is issued after the one before it in schedule order,
a ``conditional`` runs its branch in line, and every device runs the same schedule. The collectives
are then *started* in one order on every device whatever the data dependencies say, and what can
still deadlock is an asynchronous collective in flight -- issued, its ``*-done`` not yet reached --
while the instructions scheduled under it run collectives of their own: NCCL does not promise in
which order it runs the kernels of two collectives in flight on different streams, so two devices
that both belong to both could each wait for the other (XLA:GPU's scheduler refuses to overlap two
collectives that share more than one device, for that reason). With one device in common at most,
no two devices wait on each other, and the in-flight collective needs nothing scheduled after its
start on any device. So with ``in_schedule_order=True`` the rule checked is:

    every instruction that runs collectives (a collective, or a ``conditional``/``while``/``call``
    whose callees run one) scheduled between an asynchronous collective's start and its done shares
    at most one device with it, group by group.

(The sends of one collective-permute that XLA decomposed -- the ring's pairs and its back edge, both
sending the same buffer -- are taken as the one collective the program asked for, as
:mod:`meshtron.hlo.schedule` counts them: the rule is about the runtime's own collectives.)

That rule does not hold for XLA:CPU, whose runtime runs a ``conditional`` as soon as its operands
are ready; its programs are checked with the data rule above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from meshtron.hlo.collectives import ASYNC_START_KIND, COLLECTIVE_KINDS, device_groups
from meshtron.hlo.schedule import done_for, wrapped_collective
from meshtron.hlo.text import (
    HloComputation,
    HloInstruction,
    HloModule,
    call_edges,
    execution_counts,
    parse_hlo_module,
)

__all__ = ["UnorderedPair", "unordered_collectives"]

_NESTING_OPCODES = ("conditional", "while", "call", "async-start")
_CONTROL_PREDECESSORS = "control-predecessors={"


class _HasHloText(Protocol):
    def as_text(self) -> str: ...


@dataclass(frozen=True)
class UnorderedPair:
    """Two collective-bearing instructions of one computation that no dependency orders."""

    computation: str
    first: str
    second: str
    shared_devices: int = 0  # in schedule order: the devices ``second`` shares with ``first`` in flight

    def __str__(self) -> str:
        if self.shared_devices:
            return (f"{self.computation}: {self.second} runs collectives under {self.first} in flight, sharing "
                    f"{self.shared_devices} devices with it")
        return f"{self.computation}: {self.first} and {self.second} are unordered"


# A mixture of experts' ragged exchange (XLA:GPU and TPU): a collective whose sizes are set when it
# runs, so it is ordered like the others though the byte counts leave it out.
_RAGGED = ("ragged-all-to-all", "ragged-all-to-all-start")


def _is_collective(opcode: str) -> bool:
    return ASYNC_START_KIND.get(opcode, opcode) in COLLECTIVE_KINDS or opcode in _RAGGED


def _callees(module: HloModule) -> dict[str, set[str]]:
    return {
        name: {edge.callee for inst in comp.instructions for edge in call_edges(inst)
               if edge.callee in module.computations}
        for name, comp in module.computations.items()
    }


def _computations_with_collectives(module: HloModule) -> set[str]:
    """Computations that run a collective, directly or through anything they call."""
    callees = _callees(module)
    direct = {name for name, comp in module.computations.items()
              if any(_is_collective(inst.opcode) for inst in comp.instructions)}
    found = set(direct)
    changed = True
    while changed:
        changed = False
        for name, called in callees.items():
            if name not in found and called & found:
                found.add(name)
                changed = True
    return found


def _predecessors(computation: HloComputation) -> dict[str, set[str]]:
    """Direct predecessors of every instruction: its operands and control predecessors."""
    names = {inst.name for inst in computation.instructions}
    preds: dict[str, set[str]] = {}
    for inst in computation.instructions:
        before = set(inst.operands)
        at = inst.attributes.find(_CONTROL_PREDECESSORS)
        if at >= 0:
            end = inst.attributes.find("}", at)
            before |= {n.strip().lstrip("%") for n in inst.attributes[at + len(_CONTROL_PREDECESSORS):end].split(",")}
        preds[inst.name] = before & names
    return preds


def _ancestors(preds: dict[str, set[str]]) -> dict[str, set[str]]:
    """Transitive predecessors of every instruction (memoised depth-first walk)."""
    result: dict[str, set[str]] = {}
    for root in preds:
        stack = [root]
        while stack:
            name = stack[-1]
            if name in result:
                stack.pop()
                continue
            pending = [p for p in preds[name] if p not in result]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            acc = set(preds[name])
            for p in preds[name]:
                acc |= result[p]
            result[name] = acc
    return result


_SCHEDULED = re.compile(r"^HloModule\s+\S+,[^\n]*\bis_scheduled=true\b")
_PARTITIONS = re.compile(r"^HloModule\s+[^\n]*\bnum_partitions=(\d+)")


def _groups_run(instruction: HloInstruction, module: HloModule, bearing: set[str], num_devices: int,
                memo: dict[str, list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """The device groups of every collective ``instruction`` runs, itself or in what it calls."""
    if _is_collective(instruction.opcode):
        return device_groups(instruction, num_devices)
    if instruction.opcode == "async-start":
        wrapped = wrapped_collective(instruction, module)
        return [] if wrapped is None else device_groups(wrapped, num_devices)
    groups: list[tuple[int, ...]] = []
    for edge in call_edges(instruction):
        if edge.callee not in bearing:
            continue
        if edge.callee not in memo:
            memo[edge.callee] = []
            memo[edge.callee] = [g for inner in module.computations[edge.callee].instructions
                                 for g in _groups_run(inner, module, bearing, num_devices, memo)]
        groups.extend(memo[edge.callee])
    return groups


def _shared_devices(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> int:
    """The most devices one group of ``a`` and one group of ``b`` have in common."""
    sets = [set(g) for g in b]
    return max((len(set(g) & other) for g in a for other in sets), default=0)


def _overlapping_in_flight(module: HloModule, text: str) -> list[UnorderedPair]:
    """The schedule-order rule of the module docstring: what runs collectives under an asynchronous
    collective in flight shares at most one device with it."""
    found_partitions = _PARTITIONS.search(text)
    num_devices = int(found_partitions.group(1)) if found_partitions else 1
    bearing = _computations_with_collectives(module)
    memo: dict[str, list[tuple[int, ...]]] = {}
    found: list[UnorderedPair] = []
    for name in execution_counts(module):
        computation = module.computations[name]
        done_of = done_for(computation)
        position = {inst.name: i for i, inst in enumerate(computation.instructions)}
        for index, start in enumerate(computation.instructions):
            done = done_of.get(start.name)
            if done is None or not (start.opcode in ASYNC_START_KIND or start.opcode == "async-start"):
                continue
            flying = _groups_run(start, module, bearing, num_devices, memo)
            for under in computation.instructions[index + 1 : position[done]]:
                if under.opcode in ("recv", "recv-done", "send-done") or under.name in done_of.values():
                    continue  # the other end, or the done, of a transfer already counted at its start
                if start.opcode == under.opcode == "send" and start.operands[:1] == under.operands[:1]:
                    continue  # one collective-permute XLA split into sends of the same buffer (ring and back edge)
                shared = _shared_devices(flying, _groups_run(under, module, bearing, num_devices, memo))
                if shared > 1:
                    found.append(UnorderedPair(name, start.name, under.name, shared))
    return found


def unordered_collectives(compiled_or_hlo_text: _HasHloText | str, *,
                          in_schedule_order: bool = False) -> list[UnorderedPair]:
    """Pairs that break the rule in the module docstring; empty when the order is proved.

    ``in_schedule_order``: the program runs on a runtime that executes each computation in its schedule
    order (XLA:GPU), and the schedule-order rule is checked instead of the data rule; the module must be
    scheduled."""
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    module = parse_hlo_module(text)
    if in_schedule_order:
        if not _SCHEDULED.search(text):
            raise ValueError("unordered_collectives: in_schedule_order needs a scheduled module (is_scheduled=true); "
                             "this one has no schedule to go by")
        return _overlapping_in_flight(module, text)
    reachable = execution_counts(module)
    bearing = _computations_with_collectives(module)
    found: list[UnorderedPair] = []
    for name in reachable:
        computation = module.computations[name]
        nested, plain = [], []
        for inst in computation.instructions:
            if _is_collective(inst.opcode):
                plain.append(inst.name)
            elif inst.opcode in _NESTING_OPCODES and any(
                    edge.callee in bearing for edge in call_edges(inst)):
                nested.append(inst.name)
        if not nested or len(nested) + len(plain) < 2:
            continue
        ancestors = _ancestors(_predecessors(computation))
        others = nested + plain
        for i, a in enumerate(nested):
            for b in others:
                if b == a or (b in nested and nested.index(b) < i):
                    continue
                if a not in ancestors[b] and b not in ancestors[a]:
                    found.append(UnorderedPair(name, a, b))
    return found
