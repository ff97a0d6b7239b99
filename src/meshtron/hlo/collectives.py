"""The collectives of a compiled program: every collective of the optimized HLO with the mesh axes it
talks over (its device groups read back onto the mesh), its per-device size and how many times it
runs per step.

Reading the text rather than trusting the Python code is the point: a misplaced sharding
annotation shows up here as an unexpected all-gather over ``data``, long before it shows up as a
slow step on real hardware.

Bytes convention: the size in bytes, on one device, of the collective's *result* for one
execution. For an all-reduce that is the reduced array, for an all-gather the gathered array, for a
reduce-scatter the scattered shard. Wire traffic under a ring algorithm is derived from it by
:func:`ring_wire_bytes`. Only the HLO text is needed: no JAX here.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from meshtron.hlo.text import (
    STRING_LITERAL,
    HloComputation,
    HloInstruction,
    HloModule,
    Shape,
    execution_counts,
    leaves,
    matching_close,
    parse_hlo_module,
)

__all__ = [
    "ASYNC_START_KIND",
    "COLLECTIVE_KINDS",
    "Collective",
    "MeshOrSizes",
    "RaggedAllToAll",
    "bytes_by_axes",
    "collective_of",
    "collectives",
    "count_by",
    "device_groups",
    "iota_device_groups",
    "ragged_all_to_alls",
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
# waits, so only the start is counted. XLA:GPU writes a reduce-scatter's pair under its own name too
# (``reduce-scatter-start``) where older programs wrap the op in a generic ``async-start``.
ASYNC_START_KIND = {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "reduce-scatter-start": "reduce-scatter",
    "collective-permute-start": "collective-permute",
    "all-to-all-start": "all-to-all",  # XLA:GPU's asynchronous all-to-all (a mixture of experts' dispatch)
    # A collective-permute XLA:GPU decomposed into send/recv pairs (pipelined p2p): the send carries the
    # data and its pairs (``_xla_send_recv_source_target_pairs``); its recv is the same transfer's other end.
    "send": "collective-permute",
}


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
    value = attributes[value_start : matching_close(attributes, value_start) + 1]
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
    value = attributes[value_start : matching_close(attributes, value_start) + 1]
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
    A ragged all-to-all's S is what it sends (:class:`RaggedAllToAll`: at most its smaller buffer with
    balanced routing), (n-1)/n of which leaves when the rows spread evenly over the group. A group of one device
    sends nothing.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind in ("all-gather", "all-to-all", "ragged-all-to-all"):
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


def _module(compiled_or_hlo_text: _HasHloText | str, mesh: MeshOrSizes) -> tuple[HloModule, dict[str, int]]:
    """The program's parsed HLO (a ``Compiled``'s optimized text, or the text itself) and the mesh's axis sizes."""
    text = compiled_or_hlo_text if isinstance(compiled_or_hlo_text, str) else compiled_or_hlo_text.as_text()
    return parse_hlo_module(text), _axis_sizes(mesh)


def _executed(module: HloModule) -> Iterator[tuple[HloComputation, int, bool]]:
    """Each computation the program runs, with how often per step and whether a loop's trip count was unknown."""
    counts = execution_counts(module)
    for computation in module.computations.values():
        if computation.name in counts:
            yield (computation, *counts[computation.name])


def collectives(compiled_or_hlo_text: _HasHloText | str, mesh: MeshOrSizes) -> list[Collective]:
    """Every collective the program runs, in the order of the HLO text.

    ``compiled_or_hlo_text`` is a ``jax.stages.Compiled`` (its ``as_text()`` is the optimized,
    partitioned HLO) or HLO text. ``mesh`` is the ``Mesh`` the program was compiled for, or its
    axis sizes in mesh order as a dict; it is what turns device ids into axis names.
    """
    module, axis_sizes = _module(compiled_or_hlo_text, mesh)
    found = []
    for computation, count, unknown in _executed(module):
        users = _users(computation)
        sent: set[str] = set()
        for instruction in computation.instructions:
            if instruction.opcode == "send":  # a decomposed cyclic permute sends its data twice: count it once
                if instruction.operands and instruction.operands[0] in sent:
                    continue
                sent.update(instruction.operands[:1])
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
            if use.operands[0] != name or sum(leaf.elements for leaf in leaves(use.shape)) * parts != elements:
                return False
        elif use.opcode in _LAYOUT_ONLY:
            if not _sliced_to_part(use.name, elements, parts, users, module, depth + 1):
                return False
        elif use.opcode == "fusion":
            callee = _CALLS.search(STRING_LITERAL.sub('""', use.attributes))
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
    arrays = leaves(_payload_shape(instruction.opcode, instruction.shape))
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
                     for i, leaf in enumerate(arrays)]
    else:
        scattered = [_sliced_to_part(instruction.name, arrays[0].elements, n, users, module)]
    if not any(scattered):
        return [collective]
    rs_bytes = sum(leaf.nbytes for leaf, s in zip(arrays, scattered, strict=True) if s) // n
    ar_bytes = sum(leaf.nbytes for leaf, s in zip(arrays, scattered, strict=True) if not s)
    out = [replace(collective, kind="reduce-scatter", bytes=rs_bytes, from_all_reduce=True)]
    if ar_bytes:
        out.append(replace(collective, bytes=ar_bytes, name=collective.name + "(rest)"))
    return out


def collective_of(instruction: HloInstruction, count: int, unknown_trip_count: bool,
                  mesh: MeshOrSizes) -> Collective | None:
    """One collective instruction (synchronous or an async ``*-start``) as a :class:`Collective`
    run ``count`` times per step; ``None`` for any other instruction."""
    return _collective(instruction, count, unknown_trip_count, _axis_sizes(mesh))


def device_groups(instruction: HloInstruction, num_devices: int) -> list[tuple[int, ...]]:
    """The device ids that talk to each other in one collective instruction: its replica groups,
    or a collective-permute's (source, target) pairs that move data."""
    attributes = STRING_LITERAL.sub('""', instruction.attributes)
    if ASYNC_START_KIND.get(instruction.opcode, instruction.opcode) == "collective-permute":
        return [pair for pair in _source_target_pairs(attributes) if pair[0] != pair[-1]]
    return _device_groups(attributes, num_devices)


def _collective(
    instruction: HloInstruction, count: int, unknown_trip_count: bool, axis_sizes: Mapping[str, int]
) -> Collective | None:
    opcode = instruction.opcode
    kind = ASYNC_START_KIND.get(opcode, opcode)
    if kind not in COLLECTIVE_KINDS:
        return None
    arrays = leaves(_payload_shape(opcode, instruction.shape))
    dtypes = list(dict.fromkeys(leaf.dtype for leaf in arrays))
    attributes = STRING_LITERAL.sub('""', instruction.attributes)  # ignore text inside metadata
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
        bytes=sum(leaf.nbytes for leaf in arrays),
        count=count,
        group_size=group_size,
        name=instruction.name,
        unknown_trip_count=unknown_trip_count,
    )


def _payload_shape(opcode: str, shape: Shape) -> Shape:
    """The data part of a collective's result.

    ``all-gather-start``, ``reduce-scatter-start`` and ``all-to-all-start`` return ``(operands, results)`` and
    ``collective-permute-start`` ``(operand, result[, u32[], u32[]])``: the result is element 1.
    ``all-reduce-start`` returns the data itself, like the synchronous ops -- or, in XLA of jaxlib
    0.12, ``((operands), results)`` like the others (told apart by the nested operand tuple). A
    ``send`` returns ``(data, u32[], token[])``: element 0.
    """
    if opcode == "send" and isinstance(shape, tuple):
        return shape[0]
    if opcode in ("all-gather-start", "reduce-scatter-start", "all-to-all-start", "collective-permute-start") \
            and isinstance(shape, tuple):
        return shape[1]
    if opcode == "all-reduce-start" and isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[0], tuple):
        return shape[1]
    return shape


# --------------------------------------------------------------------------------------------------
# Ragged all-to-alls
# --------------------------------------------------------------------------------------------------

_RAGGED_KINDS = ("ragged-all-to-all", "ragged-all-to-all-start")


@dataclass(frozen=True)
class RaggedAllToAll(Collective):
    """One ``ragged-all-to-all`` of a compiled program (a mixture of experts' ragged dispatch).

    Its sizes are arrays the program computes, so what it sends is known only when it runs. The
    program fixes its buffers: ``bytes`` is the send buffer, the most one execution can send (every
    row of it, to other devices), and ``receive_bytes`` the receive buffer, the most it can be sent.
    :attr:`wire_bytes` is the balanced figure: when every device sends as many rows as it receives (a
    balanced router's trips out to the experts and back), it sends at most the smaller buffer, of which
    ``(n-1)/n`` leaves when the rows spread evenly over the group. :func:`collectives` does not list
    these, whose bytes are bounds, not sizes.
    """

    receive_bytes: int = 0

    @property
    def wire_bytes(self) -> float:
        return ring_wire_bytes(self.kind, min(self.bytes, self.receive_bytes), self.group_size)

    @property
    def total_receive_bytes(self) -> int:
        return self.receive_bytes * self.count


def ragged_all_to_alls(compiled_or_hlo_text: _HasHloText | str, mesh: MeshOrSizes) -> list[RaggedAllToAll]:
    """Every ragged all-to-all the program runs (synchronous, or the start of an asynchronous one), in
    the order of the HLO text, with its device groups read back onto ``mesh`` as :func:`collectives`
    does. A synchronous one's result is its receive buffer and its first operand its send buffer; an
    asynchronous start's result lists both first."""
    module, axis_sizes = _module(compiled_or_hlo_text, mesh)
    found = []
    for computation, count, unknown in _executed(module):
        shapes = {instruction.name: instruction.shape for instruction in computation.instructions}
        for instruction in computation.instructions:
            if instruction.opcode not in _RAGGED_KINDS:
                continue
            if instruction.opcode == "ragged-all-to-all-start" and isinstance(instruction.shape, tuple):
                send, receive = leaves(instruction.shape)[:2]
            else:
                send, receive = leaves(shapes[instruction.operands[0]])[0], leaves(instruction.shape)[0]
            groups = _device_groups(STRING_LITERAL.sub('""', instruction.attributes), math.prod(axis_sizes.values()))
            found.append(RaggedAllToAll(
                kind="ragged-all-to-all", axes=_axes_spanned(groups, axis_sizes), dtype=send.dtype, bytes=send.nbytes,
                count=count, group_size=len(groups[0]), name=instruction.name, unknown_trip_count=unknown,
                receive_bytes=receive.nbytes))
    return found


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
