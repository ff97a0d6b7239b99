"""Optimized HLO text, parsed: shapes, computations and their instructions, and how many times each
computation runs per execution of the entry computation (loop trip counts multiply along the call
graph). Only the text is needed: no JAX here."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

__all__ = [
    "STRING_LITERAL",
    "ArrayShape",
    "CallEdge",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "Shape",
    "call_edges",
    "execution_counts",
    "leaves",
    "matching_close",
    "parse_hlo_module",
    "parse_shape",
]

# Bits per element of every HLO primitive type that can carry data.
_ELEMENT_BITS = {
    "pred": 8,
    "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8,
    "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "token": 0, "opaque": 0,
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayShape:
    """One dense array in an HLO shape: element type and dimensions (layout dropped)."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the array; sub-byte types are packed, as XLA stores them."""
        return (self.elements * _ELEMENT_BITS[self.dtype] + 7) // 8


# An HLO shape is an array or a (possibly nested) tuple of shapes.
Shape = ArrayShape | tuple["Shape", ...]

_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_shape(text: str) -> Shape:
    """Parse ``f32[4,8]{1,0}``, ``f32[]`` or ``(f32[4], (bf16[2,2], u32[]))``.

    Layouts (``{1,0}``, ``{1,0:T(8,128)}``) and dynamic-dimension markers (``<=``) are ignored:
    neither changes how many bytes an array holds at its bound.
    """
    shape, _ = _parse_shape_at(text.strip(), 0)
    return shape


def _parse_shape_at(text: str, pos: int) -> tuple[Shape, int]:
    pos = _skip_spaces(text, pos)
    if text.startswith("(", pos):
        elements: list[Shape] = []
        pos += 1
        while True:
            pos = _skip_spaces(text, pos)
            if text.startswith(")", pos):
                return tuple(elements), pos + 1
            element, pos = _parse_shape_at(text, pos)
            elements.append(element)
            pos = _skip_spaces(text, pos)
            if text.startswith(",", pos):
                pos += 1
    match = _ARRAY_SHAPE.match(text, pos)
    if match is None or match.group(1) not in _ELEMENT_BITS:
        raise ValueError(f"cannot parse an HLO shape at {text[pos : pos + 40]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in match.group(2).split(",") if d.strip())
    pos = match.end()
    if text.startswith("{", pos):  # layout
        pos = matching_close(text, pos) + 1
    return ArrayShape(match.group(1), dims), pos


def _skip_spaces(text: str, pos: int) -> int:
    """Skip whitespace and the ``/*index=5*/`` comments XLA puts inside long tuples."""
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
        elif text.startswith("/*", pos):
            end = text.find("*/", pos + 2)
            pos = len(text) if end < 0 else end + 2
        else:
            break
    return pos


def leaves(shape: Shape) -> list[ArrayShape]:
    if isinstance(shape, ArrayShape):
        return [shape]
    return [leaf for element in shape for leaf in leaves(element)]


def matching_close(text: str, open_pos: int) -> int:
    """Index of the bracket closing the one at ``open_pos``; string literals are skipped."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    opener = text[open_pos]
    closer = pairs[opener]
    depth = 0
    pos = open_pos
    while pos < len(text):
        char = text[pos]
        if char == '"':
            pos = _end_of_string(text, pos)
        elif char == opener:
            depth += 1
        elif char == closer:
            depth -= 1
            if depth == 0:
                return pos
        pos += 1
    raise ValueError(f"unbalanced {opener!r} in {text[open_pos : open_pos + 60]!r}")


def _end_of_string(text: str, quote_pos: int) -> int:
    pos = quote_pos + 1
    while pos < len(text) and text[pos] != '"':
        pos += 2 if text[pos] == "\\" else 1
    return pos


# --------------------------------------------------------------------------------------------------
# HLO module structure
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HloInstruction:
    """One instruction line: ``[ROOT] %name = <shape> <opcode>(<operands>), <attributes>``."""

    name: str
    opcode: str
    shape: Shape
    attributes: str  # everything after the operand list, verbatim
    operands: tuple[str, ...] = ()  # names of the instructions it reads, in order
    parameter_number: int | None = None  # for ``parameter(n)``: n
    inferred_trip_count: int | None = None  # a ``while`` XLA recorded no trip count for: read from its loop


@dataclass(frozen=True)
class HloComputation:
    name: str
    instructions: tuple[HloInstruction, ...]


@dataclass(frozen=True)
class HloModule:
    computations: Mapping[str, HloComputation]
    entry: str


_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([A-Za-z_][\w.\-]*)\s*\(")
_COMPUTATION_CLOSE = re.compile(r"^\}\s*(?:,\s*execution_thread=\"[^\"]*\"\s*)?$")
_INSTRUCTION_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\s*\(")
_OPERAND_NAME = re.compile(r"%([A-Za-z_][\w.\-]*)")


def parse_hlo_module(text: str) -> HloModule:
    """Split HLO text into computations of parsed instructions.

    A computation starts at an unindented line ending in ``{`` (``%name (p: f32[2]) -> f32[2] {``
    or ``ENTRY %main ... {``) and ends at an unindented ``}`` -- or ``}, execution_thread="..."``,
    the close of a computation XLA runs on another thread (the GEMMs of a windowed einsum loop,
    asynchronous ``fusion-start``s). Only the name is read from the header, so ``/*index=5*/``
    comments and nested tuple signatures cannot confuse it.
    """
    computations: dict[str, HloComputation] = {}
    entry: str | None = None
    current: str | None = None
    body: list[HloInstruction] = []
    for line in text.splitlines():
        if current is None:
            header = _COMPUTATION_HEADER.match(line)
            if header and line.rstrip().endswith("{"):
                current, body = header.group(2), []
                if header.group(1):
                    entry = current
            continue
        if _COMPUTATION_CLOSE.match(line):
            computations[current] = HloComputation(current, tuple(body))
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            body.append(instruction)
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return HloModule(_with_inferred_trip_counts(computations, text), entry)


_SCALAR_CONSTANT = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*s32\[\]\s+constant\((-?\d+)\)", re.MULTILINE)
_INDUCTION = re.compile(r'"known_induction_variable"\s*:\s*\{\s*"tuple_index"\s*:\s*"?(\d+)')
_CONDITION = re.compile(r"\bcondition=%?([A-Za-z_][\w.\-]*)")
_CALLED = re.compile(r"\bcalls=%?([A-Za-z_][\w.\-]*)")
_DIRECTION = re.compile(r"\bdirection=(LT|LE)\b")


def _with_inferred_trip_counts(computations: dict[str, HloComputation], text: str) -> dict[str, HloComputation]:
    """Computations whose ``while`` loops without a recorded trip count carry one read from the loop.

    XLA records ``known_trip_count`` for the loops it can analyse, but not always for a loop a pass
    rewrote (the collective pipeliner peels an iteration off a microbatch loop and leaves only
    ``known_induction_variable``). Such a loop counts its induction variable (tuple element ``i``) up
    by one from a constant ``c`` (through copies) while ``i < n`` (or ``<=``) for a constant ``n``:
    ``n - c`` iterations. A loop of any other form keeps no count (and is reported unknown)."""
    constants = {name: int(value) for name, value in _SCALAR_CONSTANT.findall(text)}
    changed = dict(computations)
    for computation in computations.values():
        by_name = {i.name: i for i in computation.instructions}
        instructions = list(computation.instructions)
        for index, instruction in enumerate(instructions):
            if instruction.opcode != "while" or _TRIP_COUNT.search(instruction.attributes):
                continue
            count = _loop_trip_count(instruction, by_name, computations, constants)
            if count is not None:
                instructions[index] = replace(instruction, inferred_trip_count=count)
        if instructions != list(computation.instructions):
            changed[computation.name] = HloComputation(computation.name, tuple(instructions))
    return changed


def _loop_trip_count(loop: HloInstruction, by_name: dict[str, HloInstruction],
                     computations: dict[str, HloComputation], constants: dict[str, int]) -> int | None:
    induction, condition = _INDUCTION.search(loop.attributes), _CONDITION.search(loop.attributes)
    if induction is None or condition is None or condition.group(1) not in computations or not loop.operands:
        return None
    position = int(induction.group(1))
    start = by_name.get(loop.operands[0])
    if start is None or start.opcode != "tuple" or len(start.operands) <= position:
        return None
    first = _constant_behind(start.operands[position], by_name, constants)
    compare = computations[condition.group(1)].instructions[-1]
    if compare.opcode == "fusion":  # XLA:GPU fuses the compare: read it inside, its constant bound there
        called = _CALLED.search(compare.attributes)
        inner = computations.get(called.group(1)) if called else None
        compare = inner.instructions[-1] if inner else compare
        scope = {i.name: i for i in inner.instructions} if inner else {}
    else:
        scope = {i.name: i for i in computations[condition.group(1)].instructions}
    direction = _DIRECTION.search(compare.attributes)
    if compare.opcode != "compare" or direction is None or len(compare.operands) != 2 or first is None:
        return None
    counter = scope.get(compare.operands[0])
    bound = _constant_behind(compare.operands[1], scope, constants)
    if bound is None or counter is None or counter.opcode not in ("parameter", "get-tuple-element"):
        return None
    return max(0, bound - first + (direction.group(1) == "LE"))


def _constant_behind(name: str, by_name: dict[str, HloInstruction], constants: dict[str, int]) -> int | None:
    """The s32 constant ``name`` is, through copies and bitcasts; ``None`` for anything else."""
    while name not in constants:
        instruction = by_name.get(name)
        if instruction is None or instruction.opcode not in ("copy", "bitcast") or not instruction.operands:
            return None
        name = instruction.operands[0]
    return constants[name]


def _parse_instruction(line: str) -> HloInstruction | None:
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    shape, pos = _parse_shape_at(line, head.end())
    opcode = _OPCODE.match(line, pos)
    if opcode is None:
        return None
    operands_end = matching_close(line, opcode.end() - 1)
    operands = tuple(_OPERAND_NAME.findall(line, opcode.end(), operands_end))
    number = None
    if opcode.group(1) == "parameter":
        inside = line[opcode.end() : operands_end].strip()
        number = int(inside) if inside.isdigit() else None
    return HloInstruction(head.group(1), opcode.group(1), shape, line[operands_end + 1 :], operands, number)


# --------------------------------------------------------------------------------------------------
# Call graph and execution counts
# --------------------------------------------------------------------------------------------------

STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMPUTATION_REFERENCE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[A-Za-z_][\w.\-]*)"
)
_REFERENCED_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class CallEdge:
    callee: str
    multiplier: int
    unknown_trip_count: bool


def call_edges(instruction: HloInstruction) -> list[CallEdge]:
    """Computations an instruction runs, with how many times per execution of the instruction.

    ``to_apply`` is followed only for ``call``: on reductions it names the scalar combiner, which
    runs per element and holds no collectives. ``async-done``/``async-update`` repeat the
    ``calls=`` of their ``async-start``, which already accounts for the wrapped computation.
    Every branch of a conditional is counted as taken (an upper bound).
    """
    if instruction.opcode in ("async-done", "async-update"):
        return []
    # Blank out string literals so an op_name like "while/body=..." cannot fake a reference.
    attributes = STRING_LITERAL.sub('""', instruction.attributes)
    trip_count: int | None = None
    if instruction.opcode == "while":
        found = _TRIP_COUNT.search(instruction.attributes)
        trip_count = int(found.group(1)) if found else instruction.inferred_trip_count
    edges = []
    for reference in _COMPUTATION_REFERENCE.finditer(attributes):
        role, value = reference.group(1), reference.group(2)
        if role == "to_apply" and instruction.opcode != "call":
            continue
        multiplier, unknown = 1, False
        if instruction.opcode == "while" and role in ("body", "condition"):
            unknown = trip_count is None
            if trip_count is not None:
                # The condition is evaluated once more than the body, to exit the loop.
                multiplier = trip_count + 1 if role == "condition" else trip_count
        for name in _REFERENCED_NAME.findall(value):
            edges.append(CallEdge(name, multiplier, unknown))
    return edges


def execution_counts(module: HloModule) -> dict[str, tuple[int, bool]]:
    """Times each computation reachable from ENTRY runs per program run, and whether that figure
    passes through a ``while`` without a known trip count (then counted as one iteration).

    Counts multiply down nested loops and add up over call sites, so a body shared by two loops
    counts both. The call graph of an HLO module is acyclic, so a topological pass suffices.
    """
    edges = {
        name: [
            edge
            for instruction in computation.instructions
            for edge in call_edges(instruction)
            if edge.callee in module.computations
        ]
        for name, computation in module.computations.items()
    }
    reachable, stack = {module.entry}, [module.entry]
    while stack:
        for edge in edges[stack.pop()]:
            if edge.callee not in reachable:
                reachable.add(edge.callee)
                stack.append(edge.callee)
    pending_callers = dict.fromkeys(reachable, 0)
    for name in reachable:
        for edge in edges[name]:
            pending_callers[edge.callee] += 1
    counts = dict.fromkeys(reachable, 0)
    unknown = dict.fromkeys(reachable, False)
    counts[module.entry] = 1
    ready = [module.entry]
    while ready:
        caller = ready.pop()
        for edge in edges[caller]:
            counts[edge.callee] += counts[caller] * edge.multiplier
            unknown[edge.callee] |= unknown[caller] or edge.unknown_trip_count
            pending_callers[edge.callee] -= 1
            if pending_callers[edge.callee] == 0:
                ready.append(edge.callee)
    return {name: (counts[name], unknown[name]) for name in reachable}
