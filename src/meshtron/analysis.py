"""What a compiled step communicates, and what Megatron's paper says it should.

Two halves that are meant to be compared with each other:

* :func:`collectives` reads the *optimized, post-SPMD* HLO of a compiled program (what XLA will
  really run, after sharding propagation, collective combining and loop rewriting) and lists every
  collective with the mesh axes it talks over, its per-device size and how many times it runs per
  step. Reading the text rather than trusting the Python code is the point: a misplaced sharding
  annotation shows up here as an unexpected all-gather over ``data``, long before it shows up as a
  slow step on real hardware.
* :func:`layer_activation_bytes` and friends give the activation memory of Korthikanti et al.
  (2022), Table 2, with the constants of meshtron's blocks, next to the compiled ``memory_analysis``.
* :func:`megatron_figures` gives the analytical parameter, FLOP and communication figures from
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC21), in the same bytes convention, so a test or a benchmark can put the two side
  by side.

Bytes convention (used everywhere in this module): the size in bytes, on one device, of the
collective's *result* for one execution. For an all-reduce that is the reduced array, for an
all-gather the gathered array, for a reduce-scatter the scattered shard. Wire traffic under a ring
algorithm is derived from it by :func:`ring_wire_bytes`.

Only the HLO text is needed, so this module does not import JAX.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from meshtron.config import REMAT_MODES

if TYPE_CHECKING:
    import jax

__all__ = [
    "COLLECTIVE_KINDS",
    "MESHTRON_BLOCK",
    "ArrayShape",
    "BlockActivations",
    "Collective",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "MegatronFigures",
    "MemoryFigures",
    "StepAnalysis",
    "analyze",
    "bytes_by_axes",
    "collectives",
    "count_by",
    "execution_counts",
    "format_bytes",
    "iota_device_groups",
    "layer_activation_bytes",
    "megatron_figures",
    "megatron_flops",
    "megatron_params",
    "megatron_stage_activation_bytes",
    "model_flops_per_token",
    "paper_layer_activation_bytes",
    "parse_hlo_module",
    "parse_shape",
    "pipeline_activation_bytes",
    "ring_wire_bytes",
]

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)

# Async collectives are a start/done pair; the start carries the groups and the data, the done only
# waits, so only the start is counted.
_ASYNC_START_KIND = {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "collective-permute-start": "collective-permute",
}

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
        pos = _matching_close(text, pos) + 1
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


def _leaves(shape: Shape) -> list[ArrayShape]:
    if isinstance(shape, ArrayShape):
        return [shape]
    return [leaf for element in shape for leaf in _leaves(element)]


def _matching_close(text: str, open_pos: int) -> int:
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


@dataclass(frozen=True)
class HloComputation:
    name: str
    instructions: tuple[HloInstruction, ...]


@dataclass(frozen=True)
class HloModule:
    computations: Mapping[str, HloComputation]
    entry: str


_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([A-Za-z_][\w.\-]*)\s*\(")
_INSTRUCTION_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\s*\(")
_OPERAND_NAME = re.compile(r"%([A-Za-z_][\w.\-]*)")


def parse_hlo_module(text: str) -> HloModule:
    """Split HLO text into computations of parsed instructions.

    A computation starts at an unindented line ending in ``{`` (``%name (p: f32[2]) -> f32[2] {``
    or ``ENTRY %main ... {``) and ends at an unindented ``}``. Only the name is read from the
    header, so ``/*index=5*/`` comments and nested tuple signatures cannot confuse it.
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
        if line.strip() == "}" and not line[:1].isspace():
            computations[current] = HloComputation(current, tuple(body))
            current = None
            continue
        instruction = _parse_instruction(line)
        if instruction is not None:
            body.append(instruction)
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return HloModule(computations, entry)


def _parse_instruction(line: str) -> HloInstruction | None:
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    shape, pos = _parse_shape_at(line, head.end())
    opcode = _OPCODE.match(line, pos)
    if opcode is None:
        return None
    operands_end = _matching_close(line, opcode.end() - 1)
    operands = tuple(_OPERAND_NAME.findall(line, opcode.end(), operands_end))
    number = None
    if opcode.group(1) == "parameter":
        inside = line[opcode.end() : operands_end].strip()
        number = int(inside) if inside.isdigit() else None
    return HloInstruction(head.group(1), opcode.group(1), shape, line[operands_end + 1 :], operands, number)


# --------------------------------------------------------------------------------------------------
# Call graph and execution counts
# --------------------------------------------------------------------------------------------------

_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMPUTATION_REFERENCE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[A-Za-z_][\w.\-]*)"
)
_REFERENCED_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclass(frozen=True)
class _CallEdge:
    callee: str
    multiplier: int
    unknown_trip_count: bool


def _call_edges(instruction: HloInstruction) -> list[_CallEdge]:
    """Computations an instruction runs, with how many times per execution of the instruction.

    ``to_apply`` is followed only for ``call``: on reductions it names the scalar combiner, which
    runs per element and holds no collectives. ``async-done``/``async-update`` repeat the
    ``calls=`` of their ``async-start``, which already accounts for the wrapped computation.
    Every branch of a conditional is counted as taken (an upper bound).
    """
    if instruction.opcode in ("async-done", "async-update"):
        return []
    # Blank out string literals so an op_name like "while/body=..." cannot fake a reference.
    attributes = _STRING_LITERAL.sub('""', instruction.attributes)
    trip_count: int | None = None
    if instruction.opcode == "while":
        found = _TRIP_COUNT.search(instruction.attributes)
        trip_count = int(found.group(1)) if found else None
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
            edges.append(_CallEdge(name, multiplier, unknown))
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
            for edge in _call_edges(instruction)
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


# --------------------------------------------------------------------------------------------------
# Device groups -> mesh axes
# --------------------------------------------------------------------------------------------------

_IOTA_GROUPS = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_ID_LIST = re.compile(r"\{([\d,\s]*)\}")


def iota_device_groups(
    num_groups: int, group_size: int, dims: Sequence[int], permutation: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """Expand XLA's compact ``[G,S]<=[dims]T(perm)`` groups: iota over prod(dims) reshaped to
    ``dims``, transposed by ``perm``, reshaped to G groups of S ids."""
    ids = np.arange(math.prod(dims)).reshape(tuple(dims))
    if permutation is not None:
        ids = ids.transpose(tuple(permutation))
    return [tuple(int(i) for i in row) for row in ids.reshape(num_groups, group_size)]


def _device_groups(attributes: str, num_devices: int) -> list[tuple[int, ...]]:
    """The ``replica_groups`` of a collective; empty or absent means one group of every device."""
    position = attributes.find("replica_groups=")
    if position < 0:
        return [tuple(range(num_devices))]
    value_start = position + len("replica_groups=")
    if attributes.startswith("mesh[", value_start):
        return _mesh_device_groups(attributes[value_start:])
    iota = _IOTA_GROUPS.match(attributes, value_start)
    if iota:
        dims = [int(d) for d in iota.group(3).split(",")]
        permutation = [int(p) for p in iota.group(4).split(",")] if iota.group(4) else None
        return iota_device_groups(int(iota.group(1)), int(iota.group(2)), dims, permutation)
    value = attributes[value_start : _matching_close(attributes, value_start) + 1]
    groups = _id_lists(value[1:-1])
    return groups if groups else [tuple(range(num_devices))]


_MESH_GROUPS = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
    r"\s*\{(?P<group_axes>[^}]*)\}"
)


def _mesh_device_groups(text: str) -> list[tuple[int, ...]]:
    """Expand the mesh form ``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}``.

    XLA names a (possibly reordered) device mesh and the axes a group spans: devices that differ
    only along those axes form one group.
    """
    match = _MESH_GROUPS.match(text)
    if match is None:
        raise ValueError(f"unrecognised replica_groups: {text[:120]}")
    named = re.findall(r"'([^']+)'=(\d+)", match.group("axes"))
    names = [name for name, _ in named]
    sizes = tuple(int(size) for _, size in named)
    ids = np.arange(math.prod(sizes))
    if match.group("dims"):
        dims = tuple(int(d) for d in match.group("dims").split(","))
        ids = ids.reshape(dims)
        if match.group("perm"):
            ids = ids.transpose(tuple(int(p) for p in match.group("perm").split(",")))
    grid = ids.reshape(sizes)
    group_axes = [names.index(a) for a in re.findall(r"'([^']+)'", match.group("group_axes"))]
    other_axes = [i for i in range(len(sizes)) if i not in group_axes]
    grouped = grid.transpose(other_axes + group_axes).reshape(-1, math.prod(sizes[i] for i in group_axes))
    return [tuple(int(i) for i in row) for row in grouped]


def _source_target_pairs(attributes: str) -> list[tuple[int, ...]]:
    position = attributes.find("source_target_pairs=")
    if position < 0:
        return []
    value_start = position + len("source_target_pairs=")
    value = attributes[value_start : _matching_close(attributes, value_start) + 1]
    return _id_lists(value[1:-1])


def _id_lists(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in ids.split(",") if i.strip()) for ids in _ID_LIST.findall(text)]


def _axes_spanned(groups: Iterable[Sequence[int]], axis_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes along which some group's members differ, in mesh order.

    Ids are positions in the mesh's row-major flattened device array: SPMD partition ids (and
    ``use_global_device_ids`` ids) index the program's device assignment, which JAX builds from
    ``mesh.devices.flat`` -- not ``jax.Device.id``.
    """
    shape = tuple(axis_sizes.values())
    num_devices = math.prod(shape)
    varying = np.zeros(len(shape), dtype=bool)
    for group in groups:
        ids = np.asarray(group, dtype=np.int64)
        if ids.size == 0:
            continue
        if ids.max() >= num_devices:
            raise ValueError(
                f"device id {int(ids.max())} in the HLO does not fit a mesh of {num_devices} devices "
                f"{dict(axis_sizes)}; pass the mesh the program was compiled for"
            )
        coordinates = np.stack(np.unravel_index(ids, shape))
        varying |= coordinates.min(axis=1) != coordinates.max(axis=1)
    return tuple(name for name, differs in zip(axis_sizes, varying) if differs)


class _MeshLike(Protocol):
    axis_names: tuple[str, ...]
    devices: Any


# A jax.sharding.Mesh satisfies _MeshLike.
MeshOrSizes = _MeshLike | Mapping[str, int]


def _axis_sizes(mesh: MeshOrSizes) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return {str(name): int(size) for name, size in mesh.items()}
    return {str(name): int(size) for name, size in zip(mesh.axis_names, mesh.devices.shape)}


# --------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------


def ring_wire_bytes(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes one device sends under a ring (bandwidth-optimal) algorithm, from the result size S.

    all-reduce 2(n-1)/n*S (reduce-scatter then all-gather), all-gather (n-1)/n*S_out,
    reduce-scatter (n-1)*S_out, all-to-all (n-1)/n*S, collective-permute and -broadcast S.
    A group of one device sends nothing.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * nbytes
    if kind == "reduce-scatter":
        return (n - 1) * nbytes
    if kind in ("collective-permute", "collective-broadcast"):
        return float(nbytes)
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    ``bytes`` is the per-device size of one execution's result (tuple results of combined
    collectives summed; for async ops the data, not the start's bookkeeping tuple); ``count`` is
    executions per program run (product of enclosing loop trip counts, summed over call sites).
    ``from_all_reduce``: a reduce-scatter found as an all-reduce whose result is only ever sliced to
    the device's part -- how XLA's partitioner writes it before the GPU compiler turns it into one;
    the CPU compiler runs the all-reduce (see :func:`collectives`).
    """

    kind: str
    axes: tuple[str, ...]
    dtype: str
    bytes: int
    count: int
    group_size: int
    name: str
    unknown_trip_count: bool = False
    from_all_reduce: bool = False  # a reduce-scatter the CPU compiler runs as all-reduce + slice

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count

    @property
    def wire_bytes(self) -> float:
        """Ring-algorithm bytes sent per device for one execution."""
        return ring_wire_bytes(self.kind, self.bytes, self.group_size)

    @property
    def total_wire_bytes(self) -> float:
        return self.wire_bytes * self.count


class _HasHloText(Protocol):
    def as_text(self) -> str: ...


def collectives(compiled_or_hlo_text: _HasHloText | str, mesh: MeshOrSizes) -> list[Collective]:
    """Every collective the program runs, in the order of the HLO text.

    ``compiled_or_hlo_text`` is a ``jax.stages.Compiled`` (its ``as_text()`` is the optimized,
    partitioned HLO) or HLO text. ``mesh`` is the ``Mesh`` the program was compiled for, or its
    axis sizes in mesh order as a dict; it is what turns device ids into axis names.
    """
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    axis_sizes = _axis_sizes(mesh)
    module = parse_hlo_module(text)
    counts = execution_counts(module)
    found = []
    for computation in module.computations.values():
        if computation.name not in counts:
            continue
        count, unknown = counts[computation.name]
        users = _users(computation)
        for instruction in computation.instructions:
            collective = _collective(instruction, count, unknown, axis_sizes)
            if collective is not None and collective.kind == "all-reduce" and instruction.opcode == "all-reduce":
                found.extend(_as_reduce_scatter(collective, instruction, users, module))
            elif collective is not None:
                found.append(collective)
    return found


# XLA's SPMD partitioner writes a reduce-scatter as an all-reduce whose result every user slices to
# its own 1/n part (a ``dynamic-slice``, often fused into the consumer). XLA's GPU compiler rewrites
# exactly that pattern into a ``reduce-scatter`` (its ReduceScatterCreator pass); the CPU compiler
# has no such pass and runs the all-reduce. Counting the pattern as the reduce-scatter it is keeps
# this module's figures those of the program a GPU runs (sequence parallelism's reduce-scatters).
_LAYOUT_ONLY = ("bitcast", "copy", "reshape")


def _users(computation: HloComputation) -> dict[str, list[HloInstruction]]:
    users: dict[str, list[HloInstruction]] = defaultdict(list)
    for instruction in computation.instructions:
        for operand in dict.fromkeys(instruction.operands):
            users[operand].append(instruction)
    return users


_CALLS = re.compile(r"\bcalls=%?([A-Za-z_][\w.\-]*)")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")


def _sliced_to_part(name: str, elements: int, parts: int, users: Mapping[str, list[HloInstruction]],
                    module: HloModule, depth: int = 0) -> bool:
    """Whether every use of value ``name`` (``elements`` elements) keeps only ``1/parts`` of it through a
    ``dynamic-slice`` -- directly, behind layout-only ops, or inside a fusion that receives it."""
    uses = users.get(name, [])
    if not uses or depth > 4:
        return False
    for use in uses:
        if use.opcode == "dynamic-slice":
            if use.operands[0] != name or sum(leaf.elements for leaf in _leaves(use.shape)) * parts != elements:
                return False
        elif use.opcode in _LAYOUT_ONLY:
            if not _sliced_to_part(use.name, elements, parts, users, module, depth + 1):
                return False
        elif use.opcode == "fusion":
            callee = _CALLS.search(_STRING_LITERAL.sub('""', use.attributes))
            fused = module.computations.get(callee.group(1)) if callee else None
            if fused is None:
                return False
            fused_users = _users(fused)
            params = {i.parameter_number: i.name for i in fused.instructions if i.opcode == "parameter"}
            for position, operand in enumerate(use.operands):
                if operand == name and (position not in params or
                                        not _sliced_to_part(params[position], elements, parts, fused_users, module,
                                                            depth + 1)):
                    return False
        else:
            return False
    return True


def _as_reduce_scatter(collective: Collective, instruction: HloInstruction,
                       users: Mapping[str, list[HloInstruction]], module: HloModule) -> list[Collective]:
    """``collective`` (an all-reduce), with the parts of its result that are only ever sliced to this
    device's ``1/n`` counted as a reduce-scatter (see above); one or two records."""
    n = collective.group_size
    leaves = _leaves(_payload_shape(instruction.opcode, instruction.shape))
    if n < 2:
        return [collective]
    if isinstance(instruction.shape, tuple):
        element_users: dict[int, list[str]] = defaultdict(list)
        for use in users.get(instruction.name, []):
            index = _TUPLE_INDEX.search(use.attributes) if use.opcode == "get-tuple-element" else None
            if index is None:
                return [collective]
            element_users[int(index.group(1))].append(use.name)
        scattered = [bool(element_users.get(i)) and all(_sliced_to_part(u, leaf.elements, n, users, module)
                                                        for u in element_users[i])
                     for i, leaf in enumerate(leaves)]
    else:
        scattered = [_sliced_to_part(instruction.name, leaves[0].elements, n, users, module)]
    if not any(scattered):
        return [collective]
    rs_bytes = sum(leaf.nbytes for leaf, s in zip(leaves, scattered, strict=True) if s) // n
    ar_bytes = sum(leaf.nbytes for leaf, s in zip(leaves, scattered, strict=True) if not s)
    out = [replace(collective, kind="reduce-scatter", bytes=rs_bytes, from_all_reduce=True)]
    if ar_bytes:
        out.append(replace(collective, bytes=ar_bytes, name=collective.name + "(rest)"))
    return out


def _collective(
    instruction: HloInstruction, count: int, unknown_trip_count: bool, axis_sizes: Mapping[str, int]
) -> Collective | None:
    opcode = instruction.opcode
    kind = _ASYNC_START_KIND.get(opcode, opcode)
    if kind not in COLLECTIVE_KINDS:
        return None
    leaves = _leaves(_payload_shape(opcode, instruction.shape))
    dtypes = list(dict.fromkeys(leaf.dtype for leaf in leaves))
    attributes = _STRING_LITERAL.sub('""', instruction.attributes)  # ignore text inside metadata
    if kind == "collective-permute":
        pairs = [pair for pair in _source_target_pairs(attributes) if pair[0] != pair[-1]]
        axes = _axes_spanned(pairs, axis_sizes)
        group_size = math.prod(axis_sizes[axis] for axis in axes) if pairs else 1
    else:
        groups = _device_groups(attributes, math.prod(axis_sizes.values()))
        axes = _axes_spanned(groups, axis_sizes)
        group_size = len(groups[0])
    return Collective(
        kind=kind,
        axes=axes,
        dtype="+".join(dtypes),
        bytes=sum(leaf.nbytes for leaf in leaves),
        count=count,
        group_size=group_size,
        name=instruction.name,
        unknown_trip_count=unknown_trip_count,
    )


def _payload_shape(opcode: str, shape: Shape) -> Shape:
    """The data part of a collective's result.

    ``all-gather-start`` returns ``(operands, results)`` and ``collective-permute-start``
    ``(operand, result[, u32[], u32[]])``: the result is element 1. ``all-reduce-start`` returns
    the data itself, like the synchronous ops.
    """
    if opcode in ("all-gather-start", "collective-permute-start") and isinstance(shape, tuple):
        return shape[1]
    return shape


# --------------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------------


def bytes_by_axes(colls: Iterable[Collective]) -> dict[tuple[str, ...], int]:
    """Per-device result bytes per step, summed by the mesh axes communicated over."""
    totals: dict[tuple[str, ...], int] = defaultdict(int)
    for collective in colls:
        totals[collective.axes] += collective.total_bytes
    return dict(totals)


def count_by(
    colls: Iterable[Collective], kind: str | None = None, axes: str | Sequence[str] | None = None
) -> int:
    """Executions per step of the collectives matching ``kind`` and exactly ``axes`` (a name or a
    tuple in mesh order); ``None`` matches anything."""
    wanted_axes = (axes,) if isinstance(axes, str) else (tuple(axes) if axes is not None else None)
    return sum(
        c.count
        for c in colls
        if (kind is None or c.kind == kind) and (wanted_axes is None or c.axes == wanted_axes)
    )


def format_bytes(nbytes: float) -> str:
    """Binary-prefixed size: ``128 B``, ``1.5 MiB``."""
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        nbytes /= 1024
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.1f} {unit}"
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Decimal-suffixed count (parameters): ``842.5K``, ``1.0T``."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(int(n))


@dataclass(frozen=True)
class MemoryFigures:
    """Per-device buffer sizes XLA reports for a compiled program."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    temp_size_in_bytes: int
    alias_size_in_bytes: int

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs + temporaries, not counting outputs that alias (donated) inputs."""
        return (
            self.argument_size_in_bytes
            + self.output_size_in_bytes
            + self.temp_size_in_bytes
            - self.alias_size_in_bytes
        )


@dataclass(frozen=True)
class StepAnalysis:
    """Communication, compute and memory of one compiled step, per device."""

    collectives: tuple[Collective, ...]
    flops: float | None
    memory: MemoryFigures | None

    def bytes_by_axes(self) -> dict[tuple[str, ...], int]:
        return bytes_by_axes(self.collectives)

    def table(self) -> str:
        """Collectives grouped by (kind, axes, dtype): instructions, executions and bytes per step."""
        groups: dict[tuple[str, tuple[str, ...], str], list[Collective]] = defaultdict(list)
        for collective in self.collectives:
            groups[(collective.kind, collective.axes, collective.dtype)].append(collective)
        header = ("kind", "axes", "dtype", "ops", "count", "bytes", "wire bytes")
        rows = [
            (
                kind,
                ",".join(axes) or "-",
                dtype,
                str(len(members)),
                str(sum(c.count for c in members))
                + ("?" if any(c.unknown_trip_count for c in members) else ""),
                format_bytes(sum(c.total_bytes for c in members)),
                format_bytes(sum(c.total_wire_bytes for c in members)),
            )
            for (kind, axes, dtype), members in sorted(
                groups.items(), key=lambda item: -sum(c.total_bytes for c in item[1])
            )
        ]
        rows.append((
            "total", "", "", str(len(self.collectives)),
            str(sum(c.count for c in self.collectives)),
            format_bytes(sum(c.total_bytes for c in self.collectives)),
            format_bytes(sum(c.total_wire_bytes for c in self.collectives)),
        ))  # fmt: skip
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        numeric = {3, 4, 5, 6}

        def render(row: Sequence[str]) -> str:
            cells = (
                cell.rjust(w) if i in numeric else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        lines = [render(header), rule, *(render(row) for row in rows[:-1]), rule, render(rows[-1])]
        if self.flops is not None:
            lines.append(f"flops: {self.flops:.4g}")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"memory: arguments {format_bytes(m.argument_size_in_bytes)}, outputs "
                f"{format_bytes(m.output_size_in_bytes)}, temporaries {format_bytes(m.temp_size_in_bytes)}, "
                f"aliased {format_bytes(m.alias_size_in_bytes)}"
            )
        return "\n".join(lines)


def analyze(compiled: jax.stages.Compiled, mesh: MeshOrSizes) -> StepAnalysis:
    """Collectives, FLOPs and memory of a compiled program. FLOPs or memory are ``None`` when the
    backend does not report them."""
    return StepAnalysis(
        collectives=tuple(collectives(compiled, mesh)),
        flops=_flops(compiled),
        memory=_memory(compiled),
    )


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - backends without a cost model raise various errors
        return None
    if isinstance(cost, Sequence) and not isinstance(cost, Mapping):  # older JAX: one dict per module
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def _memory(compiled: Any) -> MemoryFigures | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if stats is None:
        return None
    return MemoryFigures(
        argument_size_in_bytes=int(stats.argument_size_in_bytes),
        output_size_in_bytes=int(stats.output_size_in_bytes),
        temp_size_in_bytes=int(stats.temp_size_in_bytes),
        alias_size_in_bytes=int(stats.alias_size_in_bytes),
    )


# --------------------------------------------------------------------------------------------------
# Megatron analytical figures
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MegatronFigures:
    """Analytical model size, FLOPs and per-device communication of one training step.

    Byte figures follow this module's convention -- per-device *result-shape* bytes, summed over
    the step, the same quantity as :attr:`Collective.total_bytes` -- so they can be compared
    directly with :func:`bytes_by_axes` of a compiled step. Tensor-parallel figures are for one
    device and cover all its microbatches; the embedding and loss terms are paid by the first and
    last pipeline stage (both on every device when ``pipe == 1``).
    """

    params: int
    flops_per_iteration: int
    flops_per_iteration_no_remat: int
    microbatch_size: int
    layers_per_stage: int
    tensor_allreduces_per_layer: int
    tensor_layer_allreduces: int
    tensor_allreduce_bytes: int
    tensor_layer_bytes: int
    tensor_embedding_bytes: int
    tensor_loss_bytes: int
    pipe_bytes: int
    data_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return self.tensor_layer_bytes + self.tensor_embedding_bytes + self.tensor_loss_bytes

    @property
    def bytes_by_axes(self) -> dict[tuple[str, ...], int]:
        """The same keys :func:`bytes_by_axes` produces for a (data, pipe, tensor) mesh."""
        return {("data",): self.data_bytes, ("pipe",): self.pipe_bytes, ("tensor",): self.tensor_bytes}


def model_flops_per_token(params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Model FLOPs of one training token: ``6·N + 12·l·h·s`` (Chowdhery et al., PaLM, appendix B:
    a multiply-add per parameter in the forward and two in the backward, plus the attention scores
    and their product with the values, ``6·l·h·s`` forward-and-backward each); recomputation is not
    counted (model FLOPs, not hardware FLOPs). The figure behind logged FLOP/s and utilisation."""
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def megatron_params(*, vocab_size: int, hidden: int, layers: int, seq_len: int) -> int:
    """Parameters of the paper's GPT, eq. 2 of Narayanan et al. (SC21):
    ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` = ``12lh² + 13lh + (V+s)h`` -- per layer the QKV,
    projection and two MLP matrices (12h²) with their biases and two layer norms (13h), plus the
    word and position embeddings. The one copy of the formula (:func:`megatron_figures` and
    :mod:`meshtron.plan` call it)."""
    V, h, l, s = vocab_size, hidden, layers, seq_len  # the paper's symbols
    return 12 * l * h * h + 13 * l * h + (V + s) * h


def megatron_flops(*, vocab_size: int, hidden: int, layers: int, seq_len: int, global_batch: int,
                   recompute: str = "full") -> int:
    """FLOPs of one iteration (GEMMs only), eq. 3 of Narayanan et al. (SC21) and its appendix.

    A layer's forward costs ``24·B·s·h² + 4·B·s²·h`` (QKV 6, projection 2, MLP 16 ·Bsh²; scores and
    their product with the values 2 ·Bs²h each); the backward twice that; the LM head ``2·B·s·h·V``
    forward and twice that backward, never recomputed. ``recompute``: ``full`` runs every layer's
    forward again (eq. 3 as printed, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``); ``selective``
    (Korthikanti et al. 2022) only the attention core's ``4·B·s²·h``; ``none`` nothing
    (``72·B·s·l·h²·(1 + s/(6h)) + 6·B·s·h·V``)."""
    if recompute not in REMAT_MODES:
        raise ValueError(f"recompute must be one of {', '.join(REMAT_MODES)}, got {recompute!r}")
    V, h, l, s, B = vocab_size, hidden, layers, seq_len, global_batch  # the paper's symbols
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]  # forward-equivalents of the layers
    attention = 4 * B * s * s * l * h * (passes + (recompute == "selective"))
    return passes * 24 * B * s * l * h * h + attention + 6 * B * s * h * V


def megatron_figures(
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    seq_len: int,
    heads: int,
    global_batch: int,
    data: int,
    pipe: int,
    tensor: int,
    microbatches: int,
    remat: bool,
    bytes_per_element: int = 4,
    layers_per_stage: int | None = None,
) -> MegatronFigures:
    """Figures from Narayanan et al. (SC21) for a GPT with the given shape and parallel layout.

    ``layers_per_stage``: the most layers one pipeline stage runs, for an uneven
    ``pipeline.layout``; by default ``layers / pipe``, which must then be whole.

    * ``params`` -- eq. 2: 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), i.e. 12lh^2 + 13lh + (V+s)h.
    * ``flops_per_iteration`` -- eq. 3, which assumes full activation recomputation (four passes
      of the forward cost): 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)).
      ``flops_per_iteration_no_remat`` drops the recomputed forward: 72*B*s*l*h^2*(1 + s/(6h)) +
      6*B*s*h*V (the LM head is never recomputed in either).
    * Tensor parallelism (Megatron's f/g operators): per layer two all-reduces forward (after
      attention and after the MLP) and two backward, plus two more when the forward is recomputed,
      each of one microbatch's activations b*s*h. The vocab-parallel embedding adds a forward
      all-reduce and the LM head's input gradient a backward one (b*s*h each); the vocab-parallel
      cross-entropy all-reduces the max, the target logit and the sum of exponentials (b*s each).
    * Pipeline: one activation forward and one gradient backward per microbatch per stage boundary.
    * Data parallelism: one all-reduce of the local gradient shard, params/(tensor*pipe) elements.

    ``heads`` does not enter the paper's formulas; it is validated so an impossible layout fails
    here rather than at compile time.
    """
    for name, value in (
        ("vocab_size", vocab_size), ("hidden", hidden), ("layers", layers), ("seq_len", seq_len),
        ("heads", heads), ("global_batch", global_batch), ("data", data), ("pipe", pipe),
        ("tensor", tensor), ("microbatches", microbatches), ("bytes_per_element", bytes_per_element),
    ):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if global_batch % (data * microbatches):
        raise ValueError(
            f"global_batch={global_batch} is not divisible by data*microbatches={data * microbatches}"
        )
    if layers % pipe and layers_per_stage is None:
        raise ValueError(f"layers={layers} is not divisible by pipe={pipe}")
    if hidden % heads or heads % tensor:
        raise ValueError(
            f"need hidden % heads == 0 and heads % tensor == 0, got {hidden=}, {heads=}, {tensor=}"
        )

    shape = {"vocab_size": vocab_size, "hidden": hidden, "layers": layers, "seq_len": seq_len}
    params = megatron_params(**shape)
    flops = megatron_flops(**shape, global_batch=global_batch, recompute="full")
    flops_no_remat = megatron_flops(**shape, global_batch=global_batch, recompute="none")

    b, s, h = global_batch // (data * microbatches), seq_len, hidden
    layers_per_stage = layers // pipe if layers_per_stage is None else layers_per_stage
    activation_bytes = b * s * h * bytes_per_element
    tensor_parallel = tensor > 1
    per_layer = (6 if remat else 4) if tensor_parallel else 0
    layer_allreduces = microbatches * layers_per_stage * per_layer
    return MegatronFigures(
        params=params,
        flops_per_iteration=flops,
        flops_per_iteration_no_remat=flops_no_remat,
        microbatch_size=b,
        layers_per_stage=layers_per_stage,
        tensor_allreduces_per_layer=per_layer,
        tensor_layer_allreduces=layer_allreduces,
        tensor_allreduce_bytes=activation_bytes if tensor_parallel else 0,
        tensor_layer_bytes=layer_allreduces * activation_bytes,
        tensor_embedding_bytes=microbatches * 2 * activation_bytes if tensor_parallel else 0,
        tensor_loss_bytes=microbatches * 3 * b * s * bytes_per_element if tensor_parallel else 0,
        pipe_bytes=2 * microbatches * activation_bytes if pipe > 1 else 0,
        data_bytes=round(params * bytes_per_element / (tensor * pipe)) if data > 1 else 0,
    )


# --------------------------------------------------------------------------------------------------
# Activation memory (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", Table 2), and the same model with the constants of meshtron's blocks
# --------------------------------------------------------------------------------------------------

def _check_activation_args(seq_len: int, microbatch: int, hidden: int, heads: int, tensor: int,
                           remat: str) -> None:
    for name, value in (("seq_len", seq_len), ("microbatch", microbatch), ("hidden", hidden), ("heads", heads),
                        ("tensor", tensor)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)}, got {remat!r}")


def paper_layer_activation_bytes(*, seq_len: int, microbatch: int, hidden: int, heads: int, tensor: int = 1,
                                 sequence_parallel: bool = False, remat: str = "none") -> float:
    """Activation bytes one transformer layer keeps for its backward pass -- Korthikanti et al., Table 2,
    verbatim (GPT block, fp16 activations, 1-byte dropout masks):

    * no parallelism ``s·b·h·(34 + 5·a·s/h)``; tensor parallel ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``;
    * tensor + sequence parallel ``s·b·h·(34 + 5·a·s/h)/t``;
    * selective recomputation drops the ``5·a·s/h`` attention-core term (``s·b·h·34/t`` with SP);
    * full recomputation keeps the layer input only: ``2·s·b·h`` (``/t`` with SP).
    """
    _check_activation_args(seq_len, microbatch, hidden, heads, tensor, remat)
    s, b, h, a, t = seq_len, microbatch, hidden, heads, tensor
    if remat == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    core = 0.0 if remat == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + core) / t
    return s * b * h * (10 + 24 / t + core / t)


@dataclass(frozen=True)
class BlockActivations:
    """What one block keeps for its backward pass, per token, in elements: the constants of Table 2
    for a given block (the paper's are bytes at fp16 with dropout; these are elements).

    Outside the tensor-parallel regions every tensor rank holds the residual-width arrays:
    ``residual`` of them (norm inputs, their centred/normalized values, residual sums) are the ones
    sequence parallelism splits over the sequence; ``gathered`` are the norm outputs the regions
    take whole (the all-gathered input of the column-parallel projections, kept for their weight
    gradients). Inside the regions everything is split over ``tensor``: ``query`` arrays the width
    of the query heads (``heads·head_dim``), ``key_value`` arrays the width of the key/value heads,
    ``mlp`` arrays the width of the MLP, and ``scores`` per-head ``[s, s]`` arrays (attention logits
    and probabilities) -- the only term selective recomputation drops.
    """

    residual: float
    gathered: float
    query: float
    key_value: float
    mlp: float
    scores: float


MESHTRON_BLOCK = BlockActivations(residual=6, gathered=2, query=2, key_value=2, mlp=6, scores=2)
"""The residuals JAX's autodiff keeps for meshtron's GPT and Llama blocks (fp32, no dropout), counted
with ``jax.ad_checkpoint.saved_residuals`` (``tests/test_sequence_parallel.py`` holds both families to
it): two norms' inputs and normalized values and the residual sum (6), the two norm outputs entering
the regions (2), query and attention output (2), key and value (2), six MLP-width arrays (GELU's
tanh-form intermediates; SwiGLU's gate, up, SiLU parts and product), logits and probabilities (2 per
head). With ``mlp = 4h`` and as many key/value heads as query heads: ``s·b·h·(8 + 28/t + 2·a·s/(h·t))``
elements per layer with tensor parallelism, ``s·b·h·(2 + (34 + 2·a·s/h)/t)`` with sequence
parallelism -- against the paper's ``10 + 24/t + 5·a·s/(h·t)`` and ``(34 + 5·a·s/h)/t`` bytes at
fp16. The ``2`` that sequence parallelism leaves whole is a choice: Megatron-LM keeps the norm
outputs split and all-gathers them again for the weight gradients (two more all-gathers per layer
backward); meshtron keeps them gathered, so the tensor traffic stays exactly that of the all-reduces
it replaces."""


def layer_activation_bytes(*, seq_len: int, microbatch: int, hidden: int, heads: int, kv_heads: int | None = None,
                           mlp_dim: int | None = None, tensor: int = 1, sequence_parallel: bool = False,
                           remat: str = "none", bytes_per_element: int = 4,
                           block: BlockActivations = MESHTRON_BLOCK) -> float:
    """Activation bytes one layer keeps for its backward pass, per device: Table 2 adapted to ``block``.

    ``s·b·((R + G)·h + (Q·h + KV·h·k/a + M·f + S·a·s)/t)`` elements (``R``, ``G``, ``Q``, ``KV``,
    ``M``, ``S`` the fields of :class:`BlockActivations`; ``k`` key/value heads, replicated on every
    tensor rank when ``t`` does not divide them, as the rules do); sequence parallelism divides the
    ``R`` term by ``t`` too; ``selective`` drops the ``S`` term; ``full`` keeps the layer input,
    ``s·b·h`` (``/t`` with SP).
    """
    _check_activation_args(seq_len, microbatch, hidden, heads, tensor, remat)
    s, b, h, a, t = seq_len, microbatch, hidden, heads, tensor
    k = kv_heads or heads
    f = mlp_dim or 4 * hidden
    residual = h / (t if sequence_parallel else 1)
    if remat == "full":
        return s * b * residual * bytes_per_element
    kv_split = t if k % t == 0 else 1
    inside = (block.query * h + block.mlp * f) / t + block.key_value * h * k / a / kv_split
    if remat == "none":
        inside += block.scores * a * s / t
    return s * b * (block.residual * residual + block.gathered * h + inside) * bytes_per_element


def pipeline_activation_bytes(*, layer_bytes: float, input_bytes: float, layers_per_chunk: int,
                              in_flight: int) -> float:
    """Activation bytes per device under meshtron's pipeline runtime, for one step.

    The runtime keeps only each in-flight microbatch's *stage input* (``input_bytes``: ``s·b·h``
    elements, ``/t`` with sequence parallelism) in its stash -- ``in_flight`` is the schedule's
    ``stash_slots`` -- and recomputes a virtual stage from it at its backward tick, which holds one
    chunk's activations (``layers_per_chunk`` × ``layer_bytes``, the model's own remat mode) at a
    time. Megatron's runtime instead keeps every in-flight microbatch's layer activations:
    :func:`megatron_stage_activation_bytes`.
    """
    return in_flight * input_bytes + layers_per_chunk * layer_bytes


def megatron_stage_activation_bytes(*, layer_bytes: float, layers_per_stage: int, in_flight: int) -> float:
    """Activation bytes on a pipeline stage that keeps each in-flight microbatch's layer activations
    (Megatron-LM; Korthikanti et al. §4.2.3: with 1F1B the first stage holds ``p`` microbatches, so its
    total is ``L/p · p`` = ``L`` layers' worth): ``in_flight × layers_per_stage × layer_bytes``."""
    return in_flight * layers_per_stage * layer_bytes
