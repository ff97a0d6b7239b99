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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meshtron.hlo.collectives import ASYNC_START_KIND, COLLECTIVE_KINDS
from meshtron.hlo.text import HloComputation, HloModule, call_edges, execution_counts, parse_hlo_module

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

    def __str__(self) -> str:
        return f"{self.computation}: {self.first} and {self.second} are unordered"


def _is_collective(opcode: str) -> bool:
    return ASYNC_START_KIND.get(opcode, opcode) in COLLECTIVE_KINDS


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


def unordered_collectives(compiled_or_hlo_text: _HasHloText | str) -> list[UnorderedPair]:
    """Pairs that break the rule in the module docstring; empty when the order is proved."""
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    module = parse_hlo_module(text)
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
