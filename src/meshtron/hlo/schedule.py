"""Which compute a scheduled GPU program runs while each collective is in flight.

XLA:GPU emits a *scheduled* module (``is_scheduled=true``): the order of a computation's
instructions is the order the compute stream issues them. A collective the compiler made
asynchronous is a ``*-start``/``*-done`` pair (``all-reduce-start``, ``all-gather-start``,
``collective-permute-start``, ``reduce-scatter-start``, a generic ``async-start`` wrapping a
``reduce-scatter``/``all-to-all`` computation, or a ``send``/``send-done`` of a collective-permute
XLA decomposed into send/recv pairs); the communication runs on its own stream from the
start to the done, and everything the schedule put between the two is compute that can hide it.
A collective that stayed synchronous (a plain ``all-reduce``, or a pair whose backend config says
``"is_sync":true`` -- the scheduler found nothing to overlap and NCCL runs it on the compute
stream) hides nothing: its window is empty.

This module only reads the schedule (no costs, no JAX); :mod:`meshtron.gpu.step_time` prices it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from meshtron.hlo.collectives import (
    ASYNC_START_KIND,
    COLLECTIVE_KINDS,
    Collective,
    MeshOrSizes,
    _axis_sizes,
    collective_of,
    device_groups,
)
from meshtron.hlo.text import (
    STRING_LITERAL,
    HloComputation,
    HloInstruction,
    HloModule,
    execution_counts,
    parse_hlo_module,
)

__all__ = ["CollectiveWindow", "async_wrapped_computations", "collective_windows", "done_for", "is_sync", "module_of",
           "windows_by_start", "wrapped_collective"]

_IS_SYNC = re.compile(r'"is_sync"\s*:\s*true')
_CALLS = re.compile(r"\bcalls=%?([A-Za-z_][\w.\-]*)")
_DONE_OPCODES = {"all-reduce-done", "all-gather-done", "reduce-scatter-done", "collective-permute-done", "async-done",
                 "send-done"}


@dataclass(frozen=True)
class CollectiveWindow:
    """One collective of a computation and the instructions scheduled while it is in flight.

    ``start``/``done`` name the pair (the same name for a synchronous op); ``between`` is the
    instructions strictly between them in schedule order (empty when ``synchronous``);
    ``collective`` carries the mesh axes, per-device result bytes, group size and executions per
    step (``collective.count``: the product of enclosing loops' trip counts).
    """

    computation: str
    start: str
    done: str
    synchronous: bool
    collective: Collective
    between: tuple[HloInstruction, ...]
    device_groups: tuple[tuple[int, ...], ...] = ()  # the ids that talk (replica groups or permute pairs)

    @property
    def kind(self) -> str:
        return self.collective.kind


def is_sync(instruction: HloInstruction) -> bool:
    """Whether the backend config of an async collective says XLA runs it synchronously."""
    return bool(_IS_SYNC.search(instruction.attributes))


def computations_called_by(module: HloModule, opcode: str) -> set[str]:
    """The computations the ``calls=`` of every ``opcode`` instruction of ``module`` names."""
    called = set()
    for computation in module.computations.values():
        for instruction in computation.instructions:
            if instruction.opcode == opcode:
                found = _CALLS.search(STRING_LITERAL.sub('""', instruction.attributes))
                if found:
                    called.add(found.group(1))
    return called


def async_wrapped_computations(module: HloModule) -> set[str]:
    """Computations an ``async-start`` wraps (run on another stream, not called in line)."""
    return computations_called_by(module, "async-start")


def wrapped_collective(instruction: HloInstruction, module: HloModule) -> HloInstruction | None:
    """The collective an ``async-start`` wraps (its computation's last collective), if any."""
    called = _CALLS.search(STRING_LITERAL.sub('""', instruction.attributes))
    computation = module.computations.get(called.group(1)) if called else None
    if computation is None:
        return None
    found = [i for i in computation.instructions if i.opcode in COLLECTIVE_KINDS]
    return found[-1] if found else None


def done_for(computation: HloComputation) -> dict[str, str]:
    """start name -> done name: a done reads its start, possibly through ``async-update``s."""
    source: dict[str, str] = {}
    for instruction in computation.instructions:
        if instruction.opcode == "async-update" and instruction.operands:
            source[instruction.name] = source.get(instruction.operands[0], instruction.operands[0])
    done = {}
    for instruction in computation.instructions:
        if instruction.opcode in _DONE_OPCODES and instruction.operands:
            operand = instruction.operands[0]
            done[source.get(operand, operand)] = instruction.name
    return done


def _computation_windows(computation: HloComputation, module: HloModule, count: int, unknown: bool,
                         mesh: MeshOrSizes) -> list[CollectiveWindow]:
    num_devices = math.prod(_axis_sizes(mesh).values())
    position = {instruction.name: index for index, instruction in enumerate(computation.instructions)}
    done_of = done_for(computation)
    windows = []
    sent: set[str] = set()
    for index, instruction in enumerate(computation.instructions):
        opcode = instruction.opcode
        if opcode == "send":
            # XLA:GPU decomposes a cyclic permute into two sends of the same data (the ring's forward
            # pairs and its back edge): each device sends once, so the permute is priced at its first.
            if instruction.operands and instruction.operands[0] in sent:
                continue
            sent.update(instruction.operands[:1])
        if opcode in COLLECTIVE_KINDS:
            collective_instruction, synchronous, done = instruction, True, instruction.name
        elif opcode in ASYNC_START_KIND or opcode == "async-start":
            collective_instruction = instruction if opcode in ASYNC_START_KIND else wrapped_collective(instruction,
                                                                                                        module)
            if collective_instruction is None:
                continue  # an async computation that is not a collective (e.g. a host offload)
            done = done_of.get(instruction.name, instruction.name)
            synchronous = is_sync(instruction) or done == instruction.name
        else:
            continue
        collective = collective_of(collective_instruction, count, unknown, mesh)
        if collective is None:
            continue
        collective = replace(collective, name=instruction.name)
        between = () if synchronous else computation.instructions[index + 1 : position[done]]
        groups = tuple(device_groups(collective_instruction, num_devices))
        windows.append(CollectiveWindow(computation.name, instruction.name, done, synchronous, collective, between,
                                        groups))
    return windows


def collective_windows(program: object, mesh_or_sizes: MeshOrSizes) -> list[CollectiveWindow]:
    """Every collective of the program with the compute scheduled under it, computation by
    computation (entry, while bodies, called computations) in text order.

    ``program`` is a jax ``Compiled``, its HLO text, or a parsed :class:`HloModule`; ``mesh_or_sizes``
    as :func:`meshtron.hlo.collectives.collectives` takes it.
    """
    module = module_of(program)
    counts = execution_counts(module)
    wrapped = async_wrapped_computations(module)
    windows = []
    for computation in module.computations.values():
        if computation.name not in counts or computation.name in wrapped:
            continue
        count, unknown = counts[computation.name]
        windows.extend(_computation_windows(computation, module, count, unknown, mesh_or_sizes))
    return windows


def windows_by_start(windows: list[CollectiveWindow]) -> Mapping[tuple[str, str], CollectiveWindow]:
    """(computation, start name) -> window, for walking a schedule instruction by instruction."""
    return {(window.computation, window.start): window for window in windows}


def module_of(program: object) -> HloModule:
    """A jax ``Compiled``, HLO text or a parsed module, parsed."""
    if isinstance(program, HloModule):
        return program
    text = program if isinstance(program, str) else program.as_text()  # type: ignore[attr-defined]
    return parse_hlo_module(text)
