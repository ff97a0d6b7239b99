"""Every GEMM of an optimized HLO module: which kernel runs it, its operands' element types and its FLOPs.

The element types of a GEMM's operands decide which tensor-core rate it runs at -- an H100 multiplies
float8 operands at twice the bf16 rate -- and they are only known for certain in the compiled program:
XLA may keep a float8 dot as one, upcast it (XLA:CPU and pre-Hopper GPUs convert float8 operands to
bf16 or f32 first), or fold a quantize-dequantize pattern into a float8 GEMM or drop the float8 round
trip altogether. So the census reads the optimized HLO, not the model code. The GEMMs it finds:

- cuBLAS custom-calls (``__cublas$gemm``, ``__cublas$lt$matmul``, and ``__cublas$lt$matmul$f8``, the
  float8 GEMM whose two extra operands are the scales): the types of the first two operands;
- fusions holding a ``dot`` -- XLA:GPU's Triton GEMM fusions (``kind=kCustom`` with a
  ``__triton_gemm``/``__triton_nested_gemm_fusion`` backend config), XLA:CPU's library fusions, any
  output fusion: the types of the dot's operands inside the fused computation, which are what the
  tensor cores read (a fused ``convert`` of a float8 parameter to bf16 makes a bf16 GEMM);
- unfused ``dot``s (XLA:CPU);
- cuDNN fused attention (``__cudnn$fmha*``): the types of q and k.

XLA merges dots that share an operand (the q/k/v projections, the MLP's gate and up), so a census
counts GEMMs as compiled, not projections as written. FLOPs are ``2*M*N*K`` (batch dimensions multiply
``M*N``); cuDNN attention's are in :func:`fmha_flops`. Each GEMM carries how many times it runs per
program run (loop trip counts multiply, :func:`meshtron.hlo.text.execution_counts`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from meshtron.hlo.schedule import computations_called_by, module_of
from meshtron.hlo.text import (
    STRING_LITERAL,
    ArrayShape,
    HloComputation,
    HloInstruction,
    HloModule,
    call_edges,
    execution_counts,
    leaves,
)

__all__ = ["Gemm", "GemmFinder", "GemmKernel", "GemmTotals", "fmha_flops", "fused_computations", "gemm_flops",
           "gemms", "gemms_launched", "is_f8", "kernels_of", "shapes_of", "totals_by_operand_types"]

_CUBLAS_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")  # prefixes: ``$f8`` and other variants included
_CUDNN_ATTENTION = "__cudnn$fmha"
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"\bcalls=%?([A-Za-z_][\w.\-]*)")
_FUSION_KIND = re.compile(r'"fusion_backend_config"\s*:\s*\{\s*"kind"\s*:\s*"([^"]+)"')
_DOT_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_JSON_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_OP_NAME = re.compile(r'\bop_name="((?:[^"\\]|\\.)*)"')


def _op_name(instruction: HloInstruction) -> str:
    found = _OP_NAME.search(instruction.attributes)
    return found.group(1) if found else ""


def is_f8(dtype: str) -> bool:
    """Whether an HLO element type is one of the 8-bit floats (``f8e4m3fn``, ``f8e5m2``, ...)."""
    return dtype.startswith("f8")


@dataclass(frozen=True)
class GemmKernel:
    """One GEMM one instruction launches, per execution of that instruction.

    ``kernel`` names what runs it: the custom-call target (``__cublas$lt$matmul$f8``,
    ``__cudnn$fmha...``), the fusion's backend kind (``__triton_nested_gemm_fusion``; ``fusion`` when
    the config names none) or ``dot``. ``lhs``/``rhs`` are the element types the GEMM multiplies,
    ``output`` its result's. ``op_name`` is the JAX name stack XLA kept in the dot's metadata (the
    launching instruction's when the dot has none): how a caller tells a transformer block's GEMMs
    from the head's."""

    kernel: str
    lhs: str
    rhs: str
    output: str
    flops: float
    op_name: str = ""

    @property
    def f8(self) -> bool:
        """Both operands 8-bit floats: a GEMM the FP8 tensor cores run."""
        return is_f8(self.lhs) and is_f8(self.rhs)


@dataclass(frozen=True)
class Gemm(GemmKernel):
    """A :class:`GemmKernel` placed in the program: the instruction (in ``computation``) that launches
    it, and ``count`` executions per program run (``unknown_trip_count``: a loop on the way has no
    known trip count and was counted once)."""

    computation: str = ""
    instruction: str = ""
    count: int = 1
    unknown_trip_count: bool = False

    @property
    def total_flops(self) -> float:
        return self.flops * self.count

    @property
    def attention(self) -> bool:
        """cuDNN fused attention, not a projection's GEMM."""
        return self.kernel.startswith(_CUDNN_ATTENTION)


@dataclass(frozen=True)
class GemmTotals:
    """GEMMs of one operand-type pair: ``instructions`` in the program, ``executions`` and ``flops``
    per program run."""

    instructions: int
    executions: int
    flops: float


def _first_array(shape) -> ArrayShape:
    return leaves(shape)[0]


def _dims(text: str) -> list[int]:
    return [int(d.strip().strip('"')) for d in text.split(",") if d.strip().strip('"')]


def shapes_of(computation: HloComputation) -> dict[str, ArrayShape]:
    """Each instruction's (first) array shape, by name: what an operand name refers to."""
    return {i.name: _first_array(i.shape) for i in computation.instructions if leaves(i.shape)}


def _dot_flops(dot: HloInstruction, shapes: Mapping[str, ArrayShape], contracting: list[int]) -> float:
    lhs = shapes.get(dot.operands[0]) if dot.operands else None
    if lhs is None:
        return 0.0
    k = math.prod(lhs.dims[d] for d in contracting)
    return 2.0 * _first_array(dot.shape).elements * k


def fmha_flops(call: HloInstruction, shapes: Mapping[str, ArrayShape], backward: bool) -> float:
    """cuDNN fused attention: forward ``4*B*H*Sq*Skv*D``, backward 2.5x; halved for a causal mask.

    ``B*H*Sq*Skv`` is the scores' shape, which the backend config names
    (``intermediate_tensor_shape``, forward and backward); without it, from ``bmm1``'s dimension
    numbers on the q and k operands, or q and k laid out ``[B, S, H, D]``. ``D`` is q's last (head)
    dimension. Backward is five products (the recomputed scores, dV, dP, dQ, dK); a causal mask lets
    cuDNN skip half the blocks."""
    q = shapes.get(call.operands[0]) if call.operands else None
    k = shapes.get(call.operands[1]) if len(call.operands) > 1 else None
    if q is None:
        return 0.0
    config = call.attributes
    head_dim = q.dims[-1]
    scores = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^{}]*?"dimensions"\s*:\s*\[([^\]]*)\]', config)
    if scores:
        flops = 4.0 * math.prod(_dims(scores.group(1))) * head_dim
    elif k is not None:
        numbers = re.search(r'"bmm1_dot_dimension_numbers"\s*:\s*\{([^}]*)\}', config)

        def field(name: str, default: list[int]) -> list[int]:
            found = re.search(rf'"{name}"\s*:\s*\[([^\]]*)\]', numbers.group(1)) if numbers else None
            return _dims(found.group(1)) if found else default

        q_batch, q_contracting = field("lhs_batch_dimensions", [0, 2]), field("lhs_contracting_dimensions", [3])
        k_batch, k_contracting = field("rhs_batch_dimensions", [0, 2]), field("rhs_contracting_dimensions", [3])
        q_seq = math.prod(d for i, d in enumerate(q.dims) if i not in q_batch + q_contracting)
        k_seq = math.prod(d for i, d in enumerate(k.dims) if i not in k_batch + k_contracting)
        flops = 4.0 * math.prod(q.dims[i] for i in q_batch) * q_seq * k_seq * head_dim
    else:
        return 0.0
    if backward:
        flops *= 2.5
    if re.search(r'"mask_type"\s*:\s*"CAUSAL"', config):
        flops /= 2
    return flops


def _operand_types(instruction: HloInstruction, shapes: Mapping[str, ArrayShape]) -> tuple[str, str]:
    types = [shapes[o].dtype if o in shapes else "?" for o in instruction.operands[:2]]
    return (types + ["?", "?"])[0], (types + ["?", "?"])[1]


class GemmFinder:
    """The GEMMs of one module's instructions, fused computations looked up once."""

    def __init__(self, module: HloModule):
        self.module = module
        self._fused: dict[str, list[GemmKernel]] = {}

    def fused(self, name: str, kernel: str) -> list[GemmKernel]:
        """The GEMMs of fused computation ``name``, launched as ``kernel``."""
        key = f"{kernel}\0{name}"
        if key not in self._fused:
            computation = self.module.computations.get(name)
            found: list[GemmKernel] = []
            if computation is not None:
                shapes = shapes_of(computation)
                for instruction in computation.instructions:
                    for gemm in self.of(instruction, shapes):
                        found.append(GemmKernel(kernel, gemm.lhs, gemm.rhs, gemm.output, gemm.flops, gemm.op_name)
                                     if gemm.kernel == "dot" else gemm)
            self._fused[key] = found
        return self._fused[key]

    def of(self, instruction: HloInstruction, shapes: Mapping[str, ArrayShape]) -> list[GemmKernel]:
        """The GEMMs one instruction launches (none for anything that is not a GEMM), per execution."""
        opcode = instruction.opcode
        if opcode == "dot":
            found = _DOT_CONTRACTING.search(instruction.attributes)
            flops = _dot_flops(instruction, shapes, _dims(found.group(1)) if found else [])
            return [GemmKernel("dot", *_operand_types(instruction, shapes), _first_array(instruction.shape).dtype,
                               flops, _op_name(instruction))]
        if opcode in ("fusion", "fusion-start"):
            called = _CALLS.search(STRING_LITERAL.sub('""', instruction.attributes))
            if called is None:
                return []
            kind = _FUSION_KIND.search(instruction.attributes)
            fused = self.fused(called.group(1), kind.group(1) if kind else "fusion")
            outer = _op_name(instruction)
            return [g if g.op_name or not outer else replace(g, op_name=outer) for g in fused]
        if opcode == "custom-call":
            custom = _CUSTOM_TARGET.search(instruction.attributes)
            name = custom.group(1) if custom else ""
            if name.startswith(_CUBLAS_TARGETS):
                found = _JSON_CONTRACTING.search(instruction.attributes)
                flops = _dot_flops(instruction, shapes, _dims(found.group(1)) if found else [])
            elif name.startswith(_CUDNN_ATTENTION):
                flops = fmha_flops(instruction, shapes, backward="Backward" in name)
            else:
                return []
            return [GemmKernel(name, *_operand_types(instruction, shapes), _first_array(instruction.shape).dtype,
                               flops, _op_name(instruction))]
        return []

    def flops(self, instruction: HloInstruction, shapes: Mapping[str, ArrayShape]) -> float:
        return sum(g.flops for g in self.of(instruction, shapes))


def fused_computations(module: HloModule) -> set[str]:
    """Computations that run inside a fusion (nested fusions included): their instructions are
    kernels' insides, not launches."""
    fused = computations_called_by(module, "fusion") | computations_called_by(module, "fusion-start")
    changed = True
    while changed:
        changed = False
        for name in list(fused):
            for instruction in module.computations.get(name, HloComputation(name, ())).instructions:
                called = _CALLS.search(STRING_LITERAL.sub('""', instruction.attributes))
                if called and called.group(1) not in fused:
                    fused.add(called.group(1))
                    changed = True
    return fused


def gemms(program: object) -> list[Gemm]:
    """Every GEMM of ``program`` (a jax ``Compiled``, its optimized HLO text or a parsed module), in
    program order within each computation, with its executions per program run."""
    module = module_of(program)
    finder = GemmFinder(module)
    fused = fused_computations(module)
    found: list[Gemm] = []
    for name, (count, unknown) in execution_counts(module).items():
        if name in fused:
            continue
        computation = module.computations[name]
        shapes = shapes_of(computation)
        for instruction in computation.instructions:
            for g in finder.of(instruction, shapes):
                found.append(Gemm(g.kernel, g.lhs, g.rhs, g.output, g.flops, g.op_name, name, instruction.name, count,
                                  unknown))
    return found


def gemms_launched(instructions: Iterable[HloInstruction], computation: HloComputation, finder: GemmFinder) -> int:
    """GEMM kernels that ``instructions`` (of ``computation``, in schedule order) launch, those of the computations
    they call included: a ``conditional`` at its branch with the most (a pipeline stage's busy branch), a ``call`` or
    a loop's body once. What a window of the schedule (:class:`meshtron.hlo.schedule.CollectiveWindow`'s
    ``between``) runs while its collective is in flight, GEMMs in a stage's ``cond`` included."""
    module = finder.module
    seen: dict[str, int] = {}

    def in_computation(name: str) -> int:
        if name not in seen:
            seen[name] = 0  # a computation that (indirectly) calls itself counts once
            called = module.computations[name]
            seen[name] = launched(called.instructions, shapes_of(called))
        return seen[name]

    def launched(insts: Iterable[HloInstruction], shapes: Mapping[str, ArrayShape]) -> int:
        total = 0
        for instruction in insts:
            direct = finder.of(instruction, shapes)
            if direct or instruction.opcode in ("fusion", "fusion-start", "async-start"):
                total += len(direct)
                continue
            callees = [e.callee for e in call_edges(instruction) if e.callee in module.computations]
            counts = [in_computation(name) for name in callees]
            if counts:
                total += max(counts) if instruction.opcode == "conditional" else sum(counts)
        return total

    return launched(instructions, shapes_of(computation))


def gemm_flops(program: object) -> float:
    """GEMM FLOPs one device runs per program run: every cuBLAS/Triton/fused ``dot`` and cuDNN
    attention, loops times their trip counts."""
    return sum(g.total_flops for g in gemms(program))


def totals_by_operand_types(found: Iterable[Gemm]) -> dict[tuple[str, str], GemmTotals]:
    """GEMMs grouped by ``(lhs, rhs)`` element types: instructions, executions and FLOPs per run."""
    groups: dict[tuple[str, str], list[Gemm]] = {}
    for gemm in found:
        groups.setdefault((gemm.lhs, gemm.rhs), []).append(gemm)
    return {types: GemmTotals(len(members), sum(g.count for g in members), sum(g.total_flops for g in members))
            for types, members in groups.items()}


def kernels_of(found: Iterable[Gemm]) -> dict[str, int]:
    """How many GEMM instructions each kernel kind runs (``__cublas$lt$matmul$f8``, a Triton fusion
    kind, ``dot``, ...)."""
    counts: dict[str, int] = {}
    for gemm in found:
        counts[gemm.kernel] = counts.get(gemm.kernel, 0) + 1
    return counts
