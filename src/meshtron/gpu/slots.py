"""A pipelined step's slots in its scheduled GPU program, and which branch each runs on which stage.

meshtron's pipeline runtime (:mod:`meshtron.pipeline.runtime`) runs a step as lockstep ticks of one
SPMD program: per tick, a ``lax.cond`` per forward / backward / weight-gradient *slot* whose true
branch runs the stage and whose false branch skips it, on each device by its own stage's instruction.
The compiled program holds one ``conditional`` per slot the runtime traced -- inside the tick
loops' ``while`` bodies, or inline where XLA unrolled a short loop -- and priced on its own, each is
worth its costliest branch on every tick. :class:`TickTable` (built from the run's program by
:func:`meshtron.gpu.pipeline_ticks.tick_table`) says, for every slot in the order the runtime traced
them, its tick, its kind and which stages run it; :func:`slot_conditionals` finds the slots'
``conditional``-s in the order the program executes them, which is the traced order: every slot reads
the ordering token the one before it produced (:mod:`meshtron.pipeline.runtime`'s ``seq``), so no
schedule can reorder them.

**The rule** (:func:`taken_branches`). Every device runs the same program and the stages meet once
per tick, at the ``collective-permute``-s that send activations forward and gradients backward (after
the tick's last slot, or, with the runtime's early sends, each in flight under the slot after it); no
slot waits for another stage (the collectives inside a branch are the stage's own tensor-parallel ones). So a tick lasts as long as its slowest stage: the
tick's work outside the slots (the same on every stage) plus, on the stage whose slots cost the most,
each slot at the branch that stage takes -- ``max over stages s of sum over the tick's slots of
cost(branch s takes)``. The step is the sum over ticks. A per-kind maximum (the costliest stage's
forward plus the costliest stage's backward, from different stages) would count time no stage spends
when, in a ramp tick, one stage runs a forward while another runs a backward. The sends join a stage
with its two ring neighbours only, so the slowest stage of the whole pipeline is exact for two stages
and, for more, an upper bound on what each stage waits for (two slow stages far apart could overlap).
No JAX here: the HLO text is enough.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshtron.errors import ConfigError
from meshtron.hlo.text import HloInstruction, HloModule, call_edges

__all__ = ["KINDS", "Slot", "SlotConditional", "TickTable", "slot_conditionals", "taken_branches"]

KINDS = ("forward", "recompute", "backward", "weight")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPED = re.compile(r"pipeline_(forward|recompute|backward|weight)/cond$")
_TRUE = re.compile(r"\btrue_computation=%?([\w.\-]+)")
_FALSE = re.compile(r"\bfalse_computation=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Slot:
    """One slot the runtime traced: its tick, its kind (forward, recompute, backward, weight) and, per stage,
    whether the stage runs it (True) or skips it."""

    tick: int
    kind: str
    runs: tuple[bool, ...]


@dataclass(frozen=True)
class TickTable:
    """A pipelined program's slots, in the order the runtime traced them (tick by tick; within a
    tick forward, recompute (a backward's rerun hoisted into the tick before), backward, weight, those
    the tick's loop has)."""

    slots: tuple[Slot, ...]

    @property
    def stages(self) -> int:
        return len(self.slots[0].runs) if self.slots else 0


@dataclass(frozen=True)
class SlotConditional:
    """A slot's ``conditional`` in the program: ``run`` the branch that runs the stage (the ``cond``'s
    true branch), ``skip`` the one that skips it; ``kind`` from the ``pipeline_<kind>`` named scope
    in its ``op_name`` (None for a program traced before the runtime named its slots)."""

    instruction: str
    run: str
    skip: str
    kind: str | None


def _op_name(instruction: HloInstruction) -> str:
    found = _OP_NAME.search(instruction.attributes)
    return found.group(1) if found else ""


def _branches(instruction: HloInstruction) -> tuple[str, str] | None:
    """(run, skip): a two-way ``lax.cond`` lowers to ``true_computation``/``false_computation`` or to
    ``branch_computations={false, true}`` (the index is the predicate)."""
    true, false = _TRUE.search(instruction.attributes), _FALSE.search(instruction.attributes)
    if true and false:
        return true.group(1), false.group(1)
    listed = _BRANCHES.search(instruction.attributes)
    names = re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed else []
    return (names[1], names[0]) if len(names) == 2 else None


def _inside_branches(module: HloModule) -> set[str]:
    """Computations a ``conditional``'s branch runs, directly or through what it calls."""
    inside: set[str] = set()
    stack = [e.callee for c in module.computations.values() for i in c.instructions if i.opcode == "conditional"
             for e in call_edges(i)]
    while stack:
        name = stack.pop()
        if name in inside or name not in module.computations:
            continue
        inside.add(name)
        stack.extend(e.callee for i in module.computations[name].instructions for e in call_edges(i))
    return inside


def _is_slot(instruction: HloInstruction, scoped: bool) -> bool:
    name = _op_name(instruction)
    if scoped:
        return _SCOPED.search(name) is not None
    # traced before the slots were named: the tick loop's ``cond``-s are the outermost ones in a ``scan``
    return name.endswith("/cond") and "/while/body/" in name


def slot_conditionals(module: HloModule) -> list[SlotConditional]:
    """The slots' ``conditional``-s, once per execution, in the order the program executes them: the
    outermost ``conditional``-s (in no branch of another) named ``pipeline_<kind>/cond`` -- or, in a
    program whose slots are unnamed, in a ``scan`` body -- walking each computation in schedule order,
    a ``while`` body as many times as its known trip count. Empty for a program without them (not
    pipelined, or a lockstep pipeline, which selects instead of branching)."""
    inside = _inside_branches(module)
    outer = [i for name, c in module.computations.items() if name not in inside for i in c.instructions
             if i.opcode == "conditional"]
    scoped = any(_SCOPED.search(_op_name(i)) for i in outer)
    slots = {i.name: i for i in outer if _is_slot(i, scoped)}
    out: list[SlotConditional] = []

    def walk(name: str) -> None:
        for instruction in module.computations[name].instructions:
            if instruction.name in slots:
                branches = _branches(instruction)
                if branches is None:
                    raise ConfigError(f"ticks: the pipeline slot {instruction.name} is not a two-way conditional")
                found = _SCOPED.search(_op_name(instruction))
                out.append(SlotConditional(instruction.name, *branches, found.group(1) if found else None))
            elif instruction.opcode in ("while", "call", "async-start"):
                # a while's body as many times as its known trip count (once if unknown); its condition,
                # walked too, holds no slot
                for edge in call_edges(instruction):
                    if edge.callee in module.computations:
                        for _ in range(edge.multiplier):
                            walk(edge.callee)

    walk(module.entry)
    return out


def check_matches(conditionals: list[SlotConditional], ticks: TickTable) -> None:
    """One ConfigError line when the program's slots are not the table's: another count, or a slot
    whose named kind differs."""
    if len(conditionals) != len(ticks.slots):
        raise ConfigError(f"ticks: the program runs {len(conditionals)} pipeline slot conditionals and the tick "
                          f"table has {len(ticks.slots)} slots; build the table from the run the program was "
                          "compiled for (meshtron.gpu.pipeline_ticks.tick_table(run.program))")
    for index, (conditional, slot) in enumerate(zip(conditionals, ticks.slots, strict=True)):
        if conditional.kind is not None and conditional.kind != slot.kind:
            raise ConfigError(f"ticks: the program's slot {index} ({conditional.instruction}) is a {conditional.kind} "
                              f"and the table's a {slot.kind} (tick {slot.tick}); build the table from the run the "
                              "program was compiled for")


def taken_branches(conditionals: list[SlotConditional], ticks: TickTable, seconds) -> list[str]:
    """The branch each executed slot is priced at (see the module docstring's rule): per tick, the
    stage whose taken branches cost the most (``seconds(computation)``; the first such stage on a
    tie), and each of the tick's slots at the branch that stage takes."""
    check_matches(conditionals, ticks)
    by_tick: dict[int, list[int]] = {}
    for index, slot in enumerate(ticks.slots):
        by_tick.setdefault(slot.tick, []).append(index)
    taken = [""] * len(conditionals)
    for indices in by_tick.values():
        def cost(stage: int, indices=indices) -> float:
            return sum(seconds(conditionals[k].run if ticks.slots[k].runs[stage] else conditionals[k].skip)
                       for k in indices)

        slowest = max(range(ticks.stages), key=cost)
        for k in indices:
            taken[k] = conditionals[k].run if ticks.slots[k].runs[slowest] else conditionals[k].skip
    return taken
