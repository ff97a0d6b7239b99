"""A step-time estimate read off the scheduled XLA:GPU program, with one fitted number.

The compiled program is the best description of a step there is: XLA:GPU has already chosen the
GEMM kernels, the fusions, which collectives run asynchronously and what compute the scheduler
placed under each. This module walks that program in schedule order and prices each instruction
with the target's planner cluster (:func:`meshtron.gpu.targets.target` -> ``cluster`` ->
:func:`meshtron.plan.cluster.load_cluster`):

- **GEMMs** -- cuBLAS custom-calls (``__cublas$gemm``, ``__cublas$lt$matmul``, ``...$f8``), Triton GEMM
  fusions and any ``dot`` inside a fusion (:mod:`meshtron.hlo.gemms` finds them): ``2*M*N*K`` FLOPs
  (batch dimensions multiply ``M*N``) at the dense peak ``peak_tflops`` times ``gemm_efficiency`` -- or,
  when both operands are 8-bit floats, at the target's dense FP8 peak
  (:attr:`meshtron.gpu.targets.Target.fp8_peak_tflops`, twice the bf16 one on H100/H200) times the same
  ``gemm_efficiency``; a float8 GEMM priced on a target without FP8 tensor cores (A100, for which XLA
  upcasts float8 dots to bf16, so none of its programs has one) is one ConfigError line. cuDNN fused attention (``__cudnn$fmha*``) is
  a GEMM too: forward ``4*B*H*Sq*Skv*D`` (scores and their product with the values), backward 2.5x
  that (five products: the recomputed scores, dV, dP, dQ, dK), halved under a causal mask, which
  cuDNN skips block by block. ``gemm_efficiency`` is the estimator's only fitted number
  (:func:`fit_gemm_efficiency` solves for it from one measured step time).
- **Memory-bound ops** -- every other fusion, copies, unfused element-wise ops: the bytes read and
  written at ``hbm_gbps * efficiency.memory``. A fusion reads of each parameter only the elements its
  outputs' elements need (a (dynamic-)slice of a parameter counts the slice, an element-wise chain
  under a slice the slice, a pad/concatenate/dynamic-update-slice shares what is read among its
  operands; :func:`_operand_demand`), and an in-place ``dynamic-update-slice`` reads and writes only
  the update. An async
  fusion (``fusion-start``/``fusion-done``, XLA's asynchronous dynamic-slice fusions) is priced at
  its start, on the compute stream -- unless XLA put it on a stream of its own (a nonzero
  ``operation_queue_id``: the GEMMs of a multi-streamed windowed einsum loop): then it runs from its
  start to its ``fusion-done`` beside the compute stream, sharing the SMs with its compute but not
  with its collectives, which it hides (``_SideStreams``).
- **Collectives** -- ring wire bytes (:func:`meshtron.hlo.collectives.ring_wire_bytes`) at NVLink
  (``nvlink_gbps * efficiency.nvlink``) when every group stays inside one node (device id //
  ``gpus_per_node``), else over the network: a group with ``g`` members in each node runs as ``g``
  rings (NCCL's channels) that leave the node on ``g`` NICs at once, so it moves at ``g`` GPUs'
  shares of the node's network (``g * network_gbps / gpus_per_node * efficiency.network``, at most
  NVLink's rate: the rings' other hops are NVLink) -- a whole node's group (FSDP over 64 GPUs) at the
  node's full 400 GB/s, one member per node (data parallelism across nodes of tensor-parallel
  groups) at one NIC's 50 GB/s -- plus the ring's steps times the link latency (``2(n-1)``
  for an all-reduce, ``n-1`` for all-gather/reduce-scatter/all-to-all, one for a permute).

The walk keeps one clock for the compute stream and one for the collective stream (collectives
run one at a time, in issue order). A ``*-start`` issues its collective when the collective stream
is free; the compute stream goes on with the instructions scheduled after it; the ``*-done`` waits
until the collective has finished. So a collective is hidden up to the compute the schedule placed
between its start and done, and the exposed remainder adds to the step. A synchronous collective
(``is_sync``, or not async at all) is fully exposed. ``while`` loops cost their body times the
trip count (``known_trip_count``), ``call``/async-wrapped computations their callee in line, a
``conditional`` its most expensive branch -- except a pipelined step's slots given its tick table
(``estimate_step(..., ticks=)``, :mod:`meshtron.gpu.slots`): each tick is then priced at the branches its
slowest stage takes, the loops over ticks iteration by iteration. Host-side time, kernel launch gaps and the
compute-communication contention on the SMs are not modelled: ``gemm_efficiency`` absorbs what a
measured step shows of them.

**MFU** is ``model_flops_per_step / (seconds * gpus * peak_tflops)``. Model FLOPs are the caller's
(they are a property of the model, not the program): per token ``6*N + 12*L*H*s`` -- a multiply-add
per parameter forward and two backward, plus attention's scores and values ``12*L*H*s`` (layers,
hidden, sequence length; :func:`meshtron.megatron.model_flops_per_token`, and :func:`model_flops`
here splits the attention part out). ``mfu`` counts the attention FLOPs whole (PaLM's convention);
``mfu_causal_halved`` counts half of ``causal_attention_flops_per_step``, the work a causal mask
leaves (the convention of MaxText and of FlashAttention's reports). Both are relative to the dense bf16
peak whatever precision the program's GEMMs run in, as torchtitan's (whose peak table holds only bf16
figures, FP8 runs included) and MaxText's (one hardware peak per chip) are, so an FP8 step's MFU compares
with a bf16 step's; ``mfu_fp8_peak`` gives the same model FLOPs relative to the dense FP8 peak.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshtron.errors import ConfigError
from meshtron.gpu.slots import SlotConditional, TickTable, slot_conditionals, taken_branches
from meshtron.gpu.targets import target as gpu_target
from meshtron.hlo.collectives import MeshOrSizes, _axis_sizes, ring_wire_bytes
from meshtron.hlo.gemms import GemmFinder, gemm_flops, shapes_of
from meshtron.hlo.schedule import (
    CollectiveWindow,
    async_wrapped_computations,
    collective_windows,
    module_of,
)
from meshtron.hlo.text import (
    STRING_LITERAL,
    ArrayShape,
    HloComputation,
    HloInstruction,
    HloModule,
    call_edges,
    leaves,
)
from meshtron.megatron import model_flops_per_token
from meshtron.plan.cluster import Cluster, load_cluster

__all__ = ["DEFAULT_GEMM_EFFICIENCY", "StepEstimate", "estimate_json", "estimate_step", "fit_gemm_efficiency",
           "flop_floor_seconds", "gemm_flops", "model_flops", "slot_seconds"]

# Fraction of the dense peak GEMMs achieve: fitted on MaxText's own Llama-2 7B step compiled for 8 H100s
# against its published 0.721 s (NVIDIA JAX-Toolbox), with which the estimate predicts MaxText's published
# 70B on 64 H100s within 8.2% (benchmarks/vs_maxtext.py --target h100; benchmarks/2026-11-29-vs-maxtext-h100.md).
DEFAULT_GEMM_EFFICIENCY = 0.630

_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "iota",
    "all-reduce-done", "all-gather-done", "reduce-scatter-done", "collective-permute-done", "async-done",
    "async-update", "copy-done", "send-done", "recv", "recv-done", "fusion-done",
}  # fmt: skip
_CALLS = re.compile(r"\bcalls=%?([A-Za-z_][\w.\-]*)")


# --------------------------------------------------------------------------------------------------
# Model FLOPs
# --------------------------------------------------------------------------------------------------


def model_flops(*, params: int, layers: int, hidden: int, seq_len: int, tokens: int) -> tuple[float, float]:
    """(model FLOPs of ``tokens`` training tokens, the attention part of them): ``6*N + 12*L*H*s``
    per token and its ``12*L*H*s`` (:func:`meshtron.megatron.model_flops_per_token`)."""
    total = model_flops_per_token(params, layers, hidden, seq_len) * tokens
    attention = model_flops_per_token(0, layers, hidden, seq_len) * tokens
    return total, attention


# --------------------------------------------------------------------------------------------------
# Memory-bound bytes
# --------------------------------------------------------------------------------------------------


def _nbytes(shape) -> int:
    return sum(leaf.nbytes for leaf in leaves(shape))


_VIEWS = ("bitcast", "reshape")  # change no bytes: a slice behind them still reads only the slice

# Ops whose every output element reads one element of each operand of the output's shape (and of a
# scalar operand the same element): the elements a fusion's kernel reads of such an operand are those
# of the output it computes, no more.
_PER_ELEMENT = frozenset({
    "abs", "add", "and", "atan2", "bitcast", "bitcast-convert", "cbrt", "ceil", "clamp", "compare", "complex",
    "convert", "copy", "cosine", "count-leading-zeros", "divide", "erf", "exponential", "exponential-minus-one",
    "floor", "imag", "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
    "not", "or", "popcnt", "power", "real", "reduce-precision", "remainder", "reshape", "reverse",
    "round-nearest-afz", "round-nearest-even", "rsqrt", "select", "shift-left", "shift-right-arithmetic",
    "shift-right-logical", "sign", "sine", "sqrt", "stochastic-convert", "subtract", "tan", "tanh", "transpose",
    "xor",
})  # fmt: skip


def _elements(shape) -> int:
    return sum(leaf.elements for leaf in leaves(shape))


def _operand_demand(instruction: HloInstruction, demanded: float, visible: float, by_name: Mapping[str, HloInstruction],
                    in_place_root: bool) -> list[tuple[float, float | None]]:
    """For each operand: the elements a fusion's kernel reads of it to compute ``demanded`` of the
    ``visible`` elements of ``instruction`` (those a later dynamic-update-slice does not overwrite), and
    how many of the operand's own elements are visible through ``instruction`` (``None``: all).

    A loop fusion is generated element by element: an element of the output is computed from the
    operand elements it needs, and nothing else is read. Per-element ops read as many elements of
    each operand as they compute; a (dynamic-)slice reads its own elements of its operand; a
    broadcast at most its operand. A pad, a concatenate and a dynamic-update-slice pick each element
    from one operand (XLA emits a branch, not a select): each operand is read at the density its
    visible elements are demanded at -- exact when the whole output is demanded, and the expected
    share when a slice at an offset known only at run time is (a ring's chunk read out of a buffer its
    steps' products fill); a dynamic-update-slice's buffer is not read where the update overwrites it.
    A reduce reads each output element's window of its inputs. An in-place dynamic-update-slice root
    reads only its update (the buffer is the output). Any other op (dot, gather, scatter, ...) reads
    its operands whole."""
    sizes = [_elements(by_name[o].shape) if o in by_name else 0 for o in instruction.operands]
    density = demanded / visible if visible else 0.0
    opcode = instruction.opcode
    if opcode in _PER_ELEMENT or opcode == "broadcast":
        return [(min(n, demanded), None) for n in sizes]
    if opcode in ("slice", "dynamic-slice"):
        return [(min(sizes[0], demanded), None), *((n, None) for n in sizes[1:])]
    if opcode == "pad":
        return [(sizes[0] * density, None), *((n, None) for n in sizes[1:])]
    if opcode == "concatenate":
        return [(n * density, None) for n in sizes]
    if opcode == "reduce":  # each output element reads its own window of the inputs, and the init values
        half = len(sizes) // 2
        return [*((n * density, None) for n in sizes[:half]), *((n, None) for n in sizes[half:])]
    if opcode == "dynamic-update-slice" and len(sizes) > 1:
        if in_place_root:
            return [(0.0, None), (sizes[1], None), *((n, None) for n in sizes[2:])]
        shown = max(visible - sizes[1], 0.0)
        return [(shown * density, shown), (sizes[1] * density, None), *((n, None) for n in sizes[2:])]
    return [(n, None) for n in sizes]


def _fusion_bytes(instruction: HloInstruction, operand_bytes: list[int], module: HloModule) -> int:
    """Bytes a fusion reads and writes: of each parameter the elements the outputs' elements need
    (:func:`_operand_demand`, propagated from the outputs back to the parameters), and the outputs --
    of an in-place dynamic-update-slice root (its buffer a parameter, behind bitcasts or reshapes at
    most) only the update, the rest of the buffer neither read nor written."""
    called = _CALLS.search(STRING_LITERAL.sub('""', instruction.attributes))
    fused = module.computations.get(called.group(1)) if called else None
    if fused is None:
        return sum(operand_bytes) + _nbytes(instruction.shape)
    by_name = {i.name: i for i in fused.instructions}
    uses = Counter(o for i in fused.instructions for o in i.operands)
    root = fused.instructions[-1]
    outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
    roots = [_behind_views(o.name, by_name) or o for o in outputs]
    in_place = set()
    for r in roots:
        if r.opcode == "dynamic-update-slice" and r.operands:
            buffer = _behind_views(r.operands[0], by_name)
            if buffer is not None and buffer.opcode == "parameter":
                in_place.add(r.name)
    demanded: dict[str, float] = defaultdict(float)
    visible: dict[str, float] = {}
    for o in outputs:
        demanded[o.name] = _elements(o.shape)
    for i in reversed(fused.instructions):
        if i.opcode in ("parameter", "tuple") or demanded.get(i.name, 0.0) <= 0:
            continue
        shown = visible.get(i.name, _elements(i.shape))
        need = min(demanded[i.name], shown)
        for operand, (elements, operand_shown) in zip(
                i.operands, _operand_demand(i, need, shown, by_name, i.name in in_place)):
            demanded[operand] += elements
            if operand_shown is not None and uses[operand] == 1:
                visible[operand] = operand_shown
    total = 0.0
    for i in fused.instructions:
        if i.opcode != "parameter" or i.parameter_number is None:
            continue
        whole = operand_bytes[i.parameter_number] if i.parameter_number < len(operand_bytes) else _nbytes(i.shape)
        elements = _elements(i.shape)
        total += whole * min(1.0, demanded.get(i.name, 0.0) / elements) if elements else whole
    for r in roots:
        if r.name in in_place and len(r.operands) > 1 and r.operands[1] in by_name:
            total += _nbytes(by_name[r.operands[1]].shape)
        else:
            total += _nbytes(r.shape)
    return round(total)


def _behind_views(name: str, by_name: Mapping[str, HloInstruction]) -> HloInstruction | None:
    instruction = by_name.get(name)
    while instruction is not None and instruction.opcode in _VIEWS and instruction.operands:
        instruction = by_name.get(instruction.operands[0])
    return instruction


# --------------------------------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------------------------------


@dataclass
class _Totals:
    """Seconds and bytes of one execution of a computation (or of the step)."""

    seconds: float = 0.0
    compute: float = 0.0
    memory: float = 0.0
    gemm_flops: float = 0.0
    f8_gemm_flops: float = 0.0
    communication: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))
    exposed: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))
    bytes: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))

    def add(self, other: _Totals, times: float) -> None:
        self.compute += other.compute * times
        self.memory += other.memory * times
        self.gemm_flops += other.gemm_flops * times
        self.f8_gemm_flops += other.f8_gemm_flops * times
        for mine, theirs in ((self.communication, other.communication), (self.exposed, other.exposed),
                             (self.bytes, other.bytes)):
            for axes, value in theirs.items():
                mine[axes] += value * times


@dataclass(frozen=True)
class _Slots:
    """A pipelined program's slot conditionals (in execution order) matched with its tick table;
    ``names`` the conditionals, ``holders`` the computations that run one (directly or through a loop
    or call), whose cost changes from one execution to the next."""

    conditionals: list[SlotConditional]
    ticks: TickTable
    names: frozenset[str]
    holders: frozenset[str]

    @classmethod
    def of(cls, module: HloModule, ticks: TickTable | None) -> _Slots | None:
        """None without a table, or when the program branches on no slot (not pipelined, or a lockstep
        pipeline: every stage runs every slot, which the plain walk prices exactly)."""
        conditionals = slot_conditionals(module) if ticks is not None else []
        if not conditionals:
            return None
        names = frozenset(c.instruction for c in conditionals)
        holders = {c.name for c in module.computations.values() if any(i.name in names for i in c.instructions)}
        grew = True
        while grew:
            grew = False
            for c in module.computations.values():
                if c.name not in holders and any(i.opcode in ("while", "call", "async-start")
                                                 and any(e.callee in holders for e in call_edges(i))
                                                 for i in c.instructions):
                    holders.add(c.name)
                    grew = True
        return cls(conditionals, ticks, names, frozenset(holders))


_QUEUE_ID = re.compile(r'"operation_queue_id"\s*:\s*"?(\d+)')


class _SideStreams:
    """GEMMs XLA launched on other compute streams (``fusion-start`` with a nonzero
    ``operation_queue_id``: the multi-streamed GEMMs of a windowed einsum loop) and what they overlap.

    Such a GEMM starts when the SMs are free and runs until its ``fusion-done`` waits for it; the
    compute stream goes on meanwhile. The SMs are one resource, so compute-stream work starts only
    when the side GEMMs before it are done (:meth:`after_compute`), but a collective on the compute
    stream -- even a synchronous one -- runs beside them: only the part of its wait after the side
    GEMMs finish is exposed (:meth:`idle`). Without side GEMMs every method is the identity.
    """

    def __init__(self) -> None:
        self.busy_until = 0.0  # when the side GEMMs launched so far are done
        self.pending: dict[str, float] = {}  # fusion-start name -> its end

    def handles(self, instruction: HloInstruction) -> bool:
        if instruction.opcode == "fusion-done":
            return bool(instruction.operands) and instruction.operands[0] in self.pending
        if instruction.opcode != "fusion-start":
            return False
        queue = _QUEUE_ID.search(instruction.attributes)
        return queue is not None and int(queue.group(1)) != 0

    def step(self, instruction: HloInstruction, clock: float, seconds: float) -> float:
        """The compute stream's clock after a side ``fusion-start`` of ``seconds`` (unchanged) or its
        ``fusion-done`` (the GEMM's end, if later)."""
        if instruction.opcode == "fusion-done":
            return max(clock, self.pending.pop(instruction.operands[0]))
        self.busy_until = max(clock, self.busy_until) + seconds
        self.pending[instruction.name] = self.busy_until
        return clock

    def after_compute(self, clock: float, seconds: float) -> float:
        """The compute stream's clock after ``seconds`` of its own work issued at ``clock``: work
        (not free ops) waits for the SMs."""
        return max(clock, self.busy_until) + seconds if seconds > 0 else clock

    def idle(self, begin: float, end: float) -> float:
        """The part of the compute stream's wait ``[begin, end]`` on a collective with no side GEMM running."""
        return end - min(max(self.busy_until, begin), end)


class _Walk:
    """Prices a parsed program's computations; see the module docstring for the model."""

    def __init__(self, module: HloModule, mesh: MeshOrSizes, cluster: Cluster, gemm_efficiency: float,
                 windows: list[CollectiveWindow] | None = None, slots: _Slots | None = None, *,
                 fp8_peak_tflops: float | None = None, target: str = ""):
        self.module = module
        self.cluster = cluster
        self.target = target
        self.gemm_rate = cluster.peak_tflops * 1e12 * gemm_efficiency
        # Same fraction of the FP8 peak as of the bf16 one: the estimator's one fitted number prices both.
        self.fp8_rate = fp8_peak_tflops * 1e12 * gemm_efficiency if fp8_peak_tflops else None
        self.hbm_rate = cluster.hbm_gbps * 1e9 * cluster.memory_efficiency
        self.gemms = GemmFinder(module)
        self.windows = {(w.computation, w.start): w for w in (windows if windows is not None else collective_windows(module, mesh))}
        self.wrapped = async_wrapped_computations(module)
        self.memo: dict[str, _Totals] = {}
        # Per-tick pricing: the branch each executed slot is priced at, in execution order (``cursor`` the
        # next one), and the computations holding slots, which cost differently on each execution.
        self.slots = slots
        self.taken = (taken_branches(slots.conditionals, slots.ticks, lambda name: self.computation(name).seconds)
                      if slots is not None else [])
        self.cursor = 0

    def collective_seconds(self, window: CollectiveWindow) -> float:
        c, cluster = window.collective, self.cluster
        n = c.group_size
        if n <= 1:
            return 0.0
        per_node = cluster.gpus_per_node
        crosses = any(len({d // per_node for d in group}) > 1 for group in window.device_groups)
        if crosses:  # g members per node: g rings leave each node at once, each on its own NIC
            together = min(max(Counter(d // per_node for d in group).values()) for group in window.device_groups)
            rate = min(cluster.nic_gbps * together * cluster.network_efficiency,
                       cluster.nvlink_gbps * cluster.nvlink_efficiency) * 1e9
            latency = cluster.network_latency_us * 1e-6
        else:
            rate = cluster.nvlink_gbps * 1e9 * cluster.nvlink_efficiency
            latency = cluster.nvlink_latency_us * 1e-6
        steps = {"all-reduce": 2 * (n - 1), "collective-permute": 1, "collective-broadcast": 1}.get(c.kind, n - 1)
        return ring_wire_bytes(c.kind, c.bytes, n) / rate + steps * latency

    def computation(self, name: str) -> _Totals:
        if self.slots is not None and name in self.slots.holders:  # its slots' branches change per execution
            return self._walk(self.module.computations[name])
        if name not in self.memo:
            self.memo[name] = self._walk(self.module.computations[name])
        return self.memo[name]

    def _walk(self, computation: HloComputation) -> _Totals:
        totals = _Totals()
        shapes = shapes_of(computation)
        sizes = {i.name: _nbytes(i.shape) for i in computation.instructions}
        clock = 0.0  # compute stream
        collective_free = 0.0  # collective stream
        in_flight: dict[str, tuple[float, tuple[str, ...]]] = {}  # done name -> (end, axes)
        side = _SideStreams()
        for instruction in computation.instructions:
            if side.handles(instruction):  # a GEMM on another stream, or the wait for one
                clock = side.step(instruction, clock, self._instruction(instruction, shapes, sizes, totals))
                continue
            window = self.windows.get((computation.name, instruction.name))
            if window is not None:
                duration = self.collective_seconds(window)
                axes = window.collective.axes
                totals.communication[axes] += duration
                totals.bytes[axes] += window.collective.bytes
                if window.synchronous:  # waits for the collective stream, then runs on the compute stream
                    finish = max(clock, collective_free) + duration
                    totals.exposed[axes] += side.idle(clock, finish)
                    clock = finish
                else:
                    begin = max(clock, collective_free)
                    collective_free = begin + duration
                    in_flight[window.done] = (collective_free, axes)
                continue
            if instruction.name in in_flight:
                end, axes = in_flight.pop(instruction.name)
                wait = max(0.0, end - clock)  # includes any queueing behind earlier collectives
                totals.exposed[axes] += side.idle(clock, clock + wait)
                clock += wait
                continue
            seconds = self._instruction(instruction, shapes, sizes, totals)
            clock = side.after_compute(clock, seconds)
        totals.seconds = max(clock, side.busy_until)
        return totals

    def _instruction(self, instruction: HloInstruction, shapes: Mapping[str, ArrayShape],
                     sizes: Mapping[str, int], totals: _Totals) -> float:
        """Seconds one instruction holds the compute stream; adds its parts to ``totals``."""
        opcode = instruction.opcode
        if opcode in _FREE:
            return 0.0
        if opcode in ("while", "call", "conditional", "async-start"):
            edges = [e for e in call_edges(instruction) if e.callee in self.module.computations]
            if opcode == "conditional" and self.slots is not None and instruction.name in self.slots.names:
                taken = self.computation(self.taken[self.cursor])
                self.cursor += 1
                totals.add(taken, 1)
                return taken.seconds
            if opcode == "conditional":
                branches = [self.computation(e.callee) for e in edges]
                if not branches:
                    return 0.0
                slowest = max(branches, key=lambda t: t.seconds)
                totals.add(slowest, 1)
                return slowest.seconds
            seconds = 0.0
            for edge in edges:
                # a loop over ticks: each iteration priced on its own
                for times in ([1] * edge.multiplier if self.slots is not None and edge.callee in self.slots.holders
                              else [edge.multiplier]):
                    callee = self.computation(edge.callee)
                    totals.add(callee, times)
                    seconds += callee.seconds * times
            return seconds
        gemms = self.gemms.of(instruction, shapes)
        flops = sum(g.flops for g in gemms)
        if flops > 0:
            f8_flops = sum(g.flops for g in gemms if g.f8)
            if f8_flops and self.fp8_rate is None:
                raise ConfigError(f"target {self.target!r}: the program runs float8 GEMMs ({instruction.name}), but "
                                  "this GPU has no FP8 tensor cores and XLA compiles no float8 GEMM for it; price "
                                  "the program on the target it was compiled for (h100, h200)")
            totals.gemm_flops += flops
            totals.f8_gemm_flops += f8_flops
            seconds = (flops - f8_flops) / self.gemm_rate + (f8_flops / self.fp8_rate if f8_flops else 0.0)
            totals.compute += seconds
            return seconds
        operand_bytes = [sizes.get(o, 0) for o in instruction.operands]
        if opcode in ("fusion", "fusion-start"):
            nbytes = _fusion_bytes(instruction, operand_bytes, self.module)
        elif opcode in ("dynamic-slice", "slice"):
            nbytes = 2 * _nbytes(instruction.shape)
        elif opcode == "dynamic-update-slice":
            nbytes = 2 * (operand_bytes[1] if len(operand_bytes) > 1 else 0)
        else:
            nbytes = sum(operand_bytes) + _nbytes(instruction.shape)
        seconds = nbytes / self.hbm_rate
        totals.memory += seconds
        return seconds


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepEstimate:
    """One step of a compiled program on a target, estimated (see the module docstring).

    ``seconds`` = ``compute_seconds + memory_seconds + exposed_communication_seconds`` (the compute
    stream's time; exposed time is the compute stream's waits on collectives, queueing behind an
    earlier collective included); ``communication_seconds`` is all collective time, hidden or not.
    Per mesh axes (the tuple of axes a collective spans): ``hidden_fraction_by_axes`` the share of
    its collective time hidden under compute (0 when queueing exposes more than its own time),
    ``bytes_by_axes`` per-device result bytes per step (the convention of
    :func:`meshtron.hlo.collectives.bytes_by_axes`; of a ``conditional`` only the branch priced),
    ``communication_seconds_by_axes``.
    ``gemm_flops`` is per device per step, ``f8_gemm_flops`` the part of it in GEMMs of two float8
    operands (priced at the FP8 peak); ``gpus`` the mesh's device count. ``mfu`` and ``mfu_causal_halved``
    are relative to the dense bf16 peak whatever the program's precision, so an FP8 program's MFU compares
    with a bf16 one's (and may exceed 1 in principle); ``mfu_fp8_peak`` is the model's FLOPs relative to the
    dense FP8 peak (``None`` on a target without one), the fraction of what the chip could do were every
    FLOP an FP8 one. ``per_tick``: a pipelined
    program's slots were priced tick by tick (a :class:`~meshtron.gpu.slots.TickTable` was given and the
    program branches on its slots), not each at its costliest branch.
    """

    target: str
    gpus: int
    gemm_efficiency: float
    seconds: float
    compute_seconds: float
    memory_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    hidden_fraction_by_axes: dict[tuple[str, ...], float]
    bytes_by_axes: dict[tuple[str, ...], int]
    communication_seconds_by_axes: dict[tuple[str, ...], float]
    gemm_flops: float
    tokens_per_step: int
    model_flops_per_step: float
    tokens_per_s_per_gpu: float
    mfu: float
    mfu_causal_halved: float
    per_tick: bool = False
    f8_gemm_flops: float = 0.0
    mfu_fp8_peak: float | None = None

    @property
    def hidden_fraction(self) -> float:
        """Share of all collective time hidden under compute (1 when there is none)."""
        if self.communication_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_communication_seconds / self.communication_seconds)

    def lines(self) -> list[str]:
        """The estimate as lines of text, for a report."""
        ms = 1e3
        out = [
            (f"step time on {self.gpus} x {self.target} (gemm_efficiency {self.gemm_efficiency:.3f}): "
            f"{self.seconds * ms:.3f} ms"),
            (f"  GEMMs {self.compute_seconds * ms:.3f} ms ({self.gemm_flops / 1e12:.3f} TFLOP per GPU), "
            f"memory-bound {self.memory_seconds * ms:.3f} ms, "
            f"collectives {self.communication_seconds * ms:.3f} ms of which exposed "
            f"{self.exposed_communication_seconds * ms:.3f} ms (hidden {self.hidden_fraction:.0%})"),
        ]
        for axes in sorted(self.bytes_by_axes, key=lambda a: (len(a), a)):
            out.append(f"  over {'+'.join(axes) or '(none)'}: {self.bytes_by_axes[axes] / 1e6:.2f} MB, "
                       f"{self.communication_seconds_by_axes.get(axes, 0.0) * ms:.3f} ms, "
                       f"hidden {self.hidden_fraction_by_axes.get(axes, 1.0):.0%}")
        out.append(f"  {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%} "
                   f"(causal attention halved: {self.mfu_causal_halved:.1%})")
        if self.f8_gemm_flops > 0:
            fp8 = f", MFU vs the FP8 peak {self.mfu_fp8_peak:.1%}" if self.mfu_fp8_peak is not None else ""
            out.append(f"  float8 GEMMs: {self.f8_gemm_flops / 1e12:.3f} TFLOP per GPU "
                       f"({self.f8_gemm_flops / self.gemm_flops:.0%} of GEMM FLOPs, at the FP8 peak); "
                       f"MFU above is vs the bf16 peak{fp8}")
        return out


def _cluster(target_name: str) -> Cluster:
    return load_cluster(gpu_target(target_name).cluster)


def _check_efficiency(gemm_efficiency: float) -> None:
    if not (isinstance(gemm_efficiency, (int, float)) and 0 < gemm_efficiency <= 1):
        raise ConfigError(f"gemm_efficiency: a fraction of the dense peak in (0, 1], got {gemm_efficiency!r}")


class _Priced:
    """A parsed program and its collective windows, priced at any ``gemm_efficiency``."""

    def __init__(self, program: object, mesh_or_sizes: MeshOrSizes, target: str, ticks: TickTable | None = None):
        self.module = module_of(program)
        self.mesh = mesh_or_sizes
        self.target = target
        self.cluster = _cluster(target)
        self.fp8_peak_tflops = gpu_target(target).fp8_peak_tflops
        self.gpus = math.prod(_axis_sizes(mesh_or_sizes).values())
        self.windows = collective_windows(self.module, mesh_or_sizes)
        self.slots = _Slots.of(self.module, ticks)
        self._totals: dict[float, _Totals] = {}

    def totals(self, gemm_efficiency: float) -> _Totals:
        if gemm_efficiency not in self._totals:
            walk = _Walk(self.module, self.mesh, self.cluster, gemm_efficiency, self.windows, self.slots,
                         fp8_peak_tflops=self.fp8_peak_tflops, target=self.target)
            self._totals[gemm_efficiency] = walk.computation(self.module.entry)
        return self._totals[gemm_efficiency]


def _estimate(priced: _Priced, *, tokens_per_step: int, model_flops_per_step: float,
              causal_attention_flops_per_step: float, gemm_efficiency: float) -> StepEstimate:
    _check_efficiency(gemm_efficiency)
    totals = priced.totals(float(gemm_efficiency))
    seconds = totals.seconds
    communication = sum(totals.communication.values())
    exposed = sum(totals.exposed.values())
    peak = priced.cluster.peak_tflops * 1e12 * priced.gpus
    fp8_peak = priced.fp8_peak_tflops * 1e12 * priced.gpus if priced.fp8_peak_tflops else None
    hidden = {axes: (max(0.0, 1.0 - totals.exposed[axes] / value) if value > 0 else 1.0)
              for axes, value in totals.communication.items()}
    halved = model_flops_per_step - causal_attention_flops_per_step / 2
    return StepEstimate(
        target=priced.target, gpus=priced.gpus, gemm_efficiency=float(gemm_efficiency), seconds=seconds,
        compute_seconds=totals.compute, memory_seconds=totals.memory, communication_seconds=communication,
        exposed_communication_seconds=exposed, hidden_fraction_by_axes=hidden,
        bytes_by_axes={axes: round(value) for axes, value in totals.bytes.items()},
        communication_seconds_by_axes=dict(totals.communication), gemm_flops=totals.gemm_flops,
        tokens_per_step=tokens_per_step, model_flops_per_step=model_flops_per_step,
        tokens_per_s_per_gpu=tokens_per_step / seconds / priced.gpus if seconds > 0 else 0.0,
        mfu=model_flops_per_step / (seconds * peak) if seconds > 0 else 0.0,
        mfu_causal_halved=halved / (seconds * peak) if seconds > 0 else 0.0, per_tick=priced.slots is not None,
        f8_gemm_flops=totals.f8_gemm_flops,
        mfu_fp8_peak=(model_flops_per_step / (seconds * fp8_peak) if seconds > 0 else 0.0) if fp8_peak else None,
    )


def estimate_step(program: object, mesh_or_sizes: MeshOrSizes, target: str, *, tokens_per_step: int,
                  model_flops_per_step: float, causal_attention_flops_per_step: float = 0.0,
                  gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY, ticks: TickTable | None = None) -> StepEstimate:
    """Estimate one step of ``program`` (a jax ``Compiled`` or its scheduled HLO text) compiled
    for ``mesh_or_sizes`` (a ``Mesh`` or axis sizes in mesh order) on GPU target ``target``
    (``h100``, ``h200``, ``a100``). ``tokens_per_step`` and ``model_flops_per_step`` (all devices
    together) give throughput and MFU; ``causal_attention_flops_per_step`` is the attention part
    of the model FLOPs, halved in ``mfu_causal_halved``. ``ticks``: a pipelined program's tick table
    (:func:`meshtron.gpu.pipeline_ticks.tick_table` of the run's program) prices each tick at the
    branches its stages take (:mod:`meshtron.gpu.slots`); a table that does not match the program's
    slots is one ConfigError line. See the module docstring for the model."""
    priced = _Priced(program, mesh_or_sizes, target, ticks)
    return _estimate(priced, tokens_per_step=tokens_per_step, model_flops_per_step=model_flops_per_step,
                     causal_attention_flops_per_step=causal_attention_flops_per_step,
                     gemm_efficiency=gemm_efficiency)


def flop_floor_seconds(target: str, gpus: int, *, model_flops_per_step: float,
                       causal_attention_flops_per_step: float = 0.0,
                       gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY, fp8: bool = False) -> float:
    """The fastest step any layout of the model could take under this estimator: the model's FLOPs
    (``model_flops_per_step`` with the causal half of ``causal_attention_flops_per_step`` skipped,
    nothing recomputed) spread evenly over ``gpus`` GPUs at the GEMM rate, with no memory-bound work,
    no bubble and no exposed communication. A layout's estimate can approach it, never beat it, so a
    speed-up goal past ``reference_seconds / floor`` is out of reach for every layout. The floor is at
    the bf16 peak; a program with float8 GEMMs can beat it, and its floor is the one with ``fp8=True``:
    every FLOP at the FP8 peak (a ConfigError line on a target without one)."""
    _check_efficiency(gemm_efficiency)
    if not (isinstance(gpus, int) and gpus > 0):
        raise ConfigError(f"gpus: a positive number of GPUs, got {gpus!r}")
    work = model_flops_per_step - causal_attention_flops_per_step / 2
    peak = _cluster(target).peak_tflops
    if fp8:
        peak = gpu_target(target).fp8_peak_tflops
        if peak is None:
            raise ConfigError(f"target {target!r}: no FP8 tensor cores, so no FP8 FLOP floor; use fp8=False")
    return work / (gpus * peak * 1e12 * gemm_efficiency)


def slot_seconds(program: object, mesh_or_sizes: MeshOrSizes, target: str, ticks: TickTable, *,
                 gemm_efficiency: float = DEFAULT_GEMM_EFFICIENCY) -> list[tuple[float, float]]:
    """``(run, skip)``: seconds of each pipeline slot's two branches, in ``ticks``' order (the program's
    execution order), as :func:`estimate_step` prices them; empty for a program that branches on no
    slot. A table that does not match the program's slots is one ConfigError line."""
    _check_efficiency(gemm_efficiency)
    priced = _Priced(program, mesh_or_sizes, target, ticks)
    if priced.slots is None:
        return []
    walk = _Walk(priced.module, priced.mesh, priced.cluster, float(gemm_efficiency), priced.windows, priced.slots,
                 fp8_peak_tflops=priced.fp8_peak_tflops, target=target)
    return [(walk.computation(c.run).seconds, walk.computation(c.skip).seconds) for c in priced.slots.conditionals]


def fit_gemm_efficiency(program: object, mesh_or_sizes: MeshOrSizes, target: str, *, measured_seconds: float,
                        tolerance: float = 1e-9, ticks: TickTable | None = None) -> float:
    """The ``gemm_efficiency`` at which :func:`estimate_step` (with ``ticks``) gives ``measured_seconds``.

    The estimate falls monotonically as the efficiency rises, so bisection (in log space) finds
    it. A measured time below the estimate at efficiency 1 (faster than the dense peak allows with
    the program's memory and communication) or one GEMMs alone cannot reach is one ConfigError line.
    """
    if not (measured_seconds > 0):
        raise ConfigError(f"measured_seconds: a positive step time in seconds, got {measured_seconds!r}")
    priced = _Priced(program, mesh_or_sizes, target, ticks)

    def seconds(efficiency: float) -> float:
        return priced.totals(efficiency).seconds

    low, high = 1e-4, 1.0
    if seconds(high) > measured_seconds:
        raise ConfigError(f"measured_seconds: {measured_seconds:.6g} s is faster than the estimate at the dense peak "
                          f"({seconds(high):.6g} s): the program's memory-bound and exposed collective time alone "
                          "exceed it; check the target and the program measured")
    if seconds(low) < measured_seconds:
        raise ConfigError(f"measured_seconds: {measured_seconds:.6g} s is slower than the estimate at gemm_efficiency "
                          f"{low:g} ({seconds(low):.6g} s); the program has too few GEMMs to explain it")
    while high / low > 1 + tolerance:
        middle = math.sqrt(low * high)
        if seconds(middle) > measured_seconds:
            low = middle
        else:
            high = middle
    return math.sqrt(low * high)


def estimate_json(estimate: StepEstimate) -> dict:
    """The estimate as JSON-ready values (axes tuples joined with ``+``)."""
    values = dict(estimate.__dict__)
    for key in ("hidden_fraction_by_axes", "bytes_by_axes", "communication_seconds_by_axes"):
        values[key] = {"+".join(axes): value for axes, value in values[key].items()}
    return json.loads(json.dumps(values))
