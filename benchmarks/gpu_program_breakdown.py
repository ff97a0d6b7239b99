"""Where a scheduled XLA:GPU program's estimated step time goes, instruction by instruction.

:func:`meshtron.gpu.step_time.estimate_step` prices a program in three totals (GEMMs, memory-bound
ops, exposed collectives). Comparing two programs needs the parts: this script walks the same
program with the same prices and lists each instruction's seconds per step (its cost per run
times how often its computation runs: loop trip counts multiply; every branch of a conditional is
counted, an upper bound -- the estimate itself prices a pipelined step's slots per tick from the
run's table, which a lone HLO file does not carry), grouped by the instruction's ``op_name`` (the JAX operation it came
from), by XLA's fusion name (``loop_convert_fusion``, ``input_reduce_fusion``...: the kind and the
root operation) and listed one by one with shape and bytes.

    python benchmarks/gpu_program_breakdown.py PROGRAM.hlo.txt [--mesh data=8] [--target h100]
        [--gemm-efficiency 0.63] [--top 30]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from meshtron.gpu import step_time
from meshtron.hlo.text import execution_counts

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NOISE = re.compile(r"^jit\([^)]*\)/|/?(shard_map|eval_jaxpr|while/body|while/cond|checkpoint|rematted_computation)")


@dataclass
class Cost:
    """One instruction's price per run of its computation."""

    computation: str
    name: str
    opcode: str
    kind: str  # "gemm" or "memory"
    seconds: float
    amount: float  # FLOPs for a GEMM, bytes otherwise
    shape: str
    op_name: str


class _RecordingWalk(step_time._Walk):
    """The estimator's walk, unchanged, that also remembers each leaf instruction's price."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.costs: list[Cost] = []
        self._current: str = ""

    def _walk(self, computation):
        outer, self._current = self._current, computation.name
        try:
            return super()._walk(computation)
        finally:
            self._current = outer

    def _instruction(self, instruction, shapes, sizes, totals):
        before_flops, before_memory = totals.gemm_flops, totals.memory
        seconds = super()._instruction(instruction, shapes, sizes, totals)
        if instruction.opcode in ("while", "call", "conditional", "async-start") or seconds == 0.0:
            return seconds
        flops = totals.gemm_flops - before_flops
        found = _OP_NAME.search(instruction.attributes)
        kind = "gemm" if flops > 0 else "memory"
        amount = flops if flops > 0 else (totals.memory - before_memory) * self.hbm_rate
        self.costs.append(Cost(self._current, instruction.name, instruction.opcode, kind, seconds, amount,
                               _shape_text(instruction.shape), found.group(1) if found else ""))
        return seconds


def _shape_text(shape) -> str:
    return " ".join(f"{leaf.dtype}{list(leaf.dims)}" for leaf in step_time.leaves(shape))


def short_op_name(op_name: str) -> str:
    """``op_name`` without the jit/shard_map/while-body/remat wrappers that every op shares."""
    name = _NOISE.sub("", op_name)
    name = re.sub(r"/+", "/", name).strip("/")
    return name or "(none)"


def fusion_family(name: str) -> str:
    """XLA's instruction name without its number: ``loop_convert_fusion.12`` -> ``loop_convert_fusion``."""
    return re.sub(r"(\.\d+)+$", "", name)


def breakdown(text: str, mesh: dict[str, int], target: str, gemm_efficiency: float):
    """(per-step costs as (Cost, runs per step), the estimate) for one program."""
    priced = step_time._Priced(text, mesh, target)
    walk = _RecordingWalk(priced.module, mesh, priced.cluster, gemm_efficiency, priced.windows,
                          fp8_peak_tflops=priced.fp8_peak_tflops, target=target)
    walk.computation(priced.module.entry)
    counts = execution_counts(priced.module)
    estimate = step_time._estimate(priced, tokens_per_step=1, model_flops_per_step=0.0,
                                   causal_attention_flops_per_step=0.0, gemm_efficiency=gemm_efficiency)
    return [(c, counts.get(c.computation, (1, False))[0]) for c in walk.costs], estimate


def _table(title: str, rows: dict[str, list[float]], top: int, unit: str) -> list[str]:
    out = [f"== {title}", f"{'seconds':>9} {'runs':>6} {unit:>10}  key"]
    for key, (seconds, runs, amount) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{seconds:9.4f} {int(runs):6d} {amount:10.2f}  {key}")
    return out


def report(text: str, mesh: dict[str, int], target: str, gemm_efficiency: float, top: int) -> list[str]:
    costs, estimate = breakdown(text, mesh, target, gemm_efficiency)
    out = list(estimate.lines()[:2])
    for kind, unit, scale in (("memory", "GB", 1e9), ("gemm", "TFLOP", 1e12)):
        chosen = [(c, n) for c, n in costs if c.kind == kind]
        by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        by_family: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        for c, n in chosen:
            for table, key in ((by_op, short_op_name(c.op_name)), (by_family, fusion_family(c.name))):
                table[key][0] += c.seconds * n
                table[key][1] += n
                table[key][2] += c.amount * n / scale
        out += _table(f"{kind}: by op_name", by_op, top, unit)
        out += _table(f"{kind}: by XLA instruction family", by_family, top, unit)
        single = {f"{c.name} {c.shape} [{short_op_name(c.op_name)}]": [c.seconds * n, n, c.amount * n / scale]
                  for c, n in chosen}
        out += _table(f"{kind}: instructions", single, top, unit)
    return out


def _mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hlo", type=Path)
    parser.add_argument("--mesh", type=_mesh, help="axis sizes in mesh order: data=2,tensor=4 (default: the "
                        "mesh_sizes of the .json written beside the program by benchmarks/vs_maxtext.py)")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--gemm-efficiency", type=float, default=0.630)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    mesh = args.mesh
    if mesh is None:
        beside = args.hlo.with_name(args.hlo.name.removesuffix(".hlo.txt") + ".json")
        mesh = json.loads(beside.read_text())["mesh_sizes"]
    print("\n".join(report(args.hlo.read_text(), mesh, args.target, args.gemm_efficiency, args.top)))


if __name__ == "__main__":
    main()
