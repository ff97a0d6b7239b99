"""Where each training step's time goes, meshtron against MaxText 0.2.5, from profiler traces.

``vs_maxtext.py`` says how long a step takes; this says what the step spends it on. Both libraries
train the same Llama (``vs_maxtext.MESHTRON_MODEL`` / ``MAXTEXT_MODEL``; meshtron with
``model.remat=full``, MaxText's default full recomputation) for ``--steps`` steps on each mesh, one
run at a time, with a ``jax.profiler`` trace (xplane) of the steady-state steps ``--profile-steps``
(meshtron's ``train.profile_steps``; MaxText's ``profiler=xplane skip_first_n_steps_for_profiler
profiler_steps`` for the same steps, MaxText counting from 0) and XLA's optimized HLO of the train
step (``--xla_dump_to``, ``--xla_dump_hlo_as_text``, only the ``jit_train`` / ``jit_train_step``
module). Each XLA:CPU thunk event of the trace carries the HLO instruction it runs (``hlo_op``),
the module, the device and a ``run_id`` shared by all devices' parts of one execution; the
instruction is looked up in the dumped HLO and its time is counted under one kind, the first rule
that matches:

1. collective: all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all,
   collective-broadcast and their -start/-done. On simulated CPU devices this includes the wait for
   the other devices to arrive (the rendezvous), i.e. load imbalance, not only data movement.
2. attention / GEMM: a dot or convolution, a fusion whose fused computation contains one (XLA:CPU's
   ``ynn_fusion``\\s, ``__onednn$matmul`` custom calls). It is attention when one of the dot's operand or
   result shapes has rank >= 3 and two dimensions equal to the sequence length (the [.., 128, 128]
   scores: QK^T, PV and their gradients), otherwise GEMM.
3. attention: any other op whose result or operand has such a [.., seq, seq] shape (softmax's
   max/exp/sum, the causal mask, their gradients, copies of scores).
4. optimizer: an op whose name stack (HLO ``metadata op_name``, the jax name stack) lies outside the
   differentiated function and every loop, i.e. contains none of ``jvp(``, ``transpose(`` and ``while/``
   (a pipeline's backward taken layer by layer from kept residuals runs outside ``jvp``, inside the
   schedule's loop): gradient clipping and
   the global norm, the AdamW moments and update, learning-rate schedule, step counters (optax has
   no name scopes of its own in either library, so this is the rule that works for both).
5. copy/transpose: copy or transpose, or a fusion of nothing but copies, transposes, bitcasts and
   reshapes (``copy_bitcast_fusion``, ``wrapped_transpose``). The JSON also gives the part of it
   whose result feeds a GEMM directly (through bitcasts).
6. element-wise: every other op of the train step (loop/input fusions, reductions, gathers,
   dynamic-(update-)slices of the layer loop's stacked activations, ...). The JSON also gives the
   part of it spent in fusions that contain a transpose (element-wise work that writes its result
   transposed, e.g. for the weight-gradient GEMM that follows).
7. other: control flow shells (while, conditional, call: only their own time, the thunks they run
   are counted by what they are), events whose name is not in the HLO dump, and ops of other jitted
   programs that run during the step (small eager computations, e.g. meshtron's learning-rate
   schedule).

Op time is each event's exclusive time on its thread (an op nested in another on the same thread is
taken out of the outer one), summed over all devices. The op-seconds of a step can exceed its wall
time even on one device (XLA:CPU runs independent thunks concurrently), and on the 8-device meshes
they are up to 8 x the wall time, because the simulated devices share this machine's cores (an op's
time stretches when they compete for them, and a collective waits while the others compute). Step boundaries are the starts of
consecutive executions of the train step (the first op event of a ``run_id``); the last profiled
step, which has no successor, is left out. Host gap = step wall time minus the union of all op
events of all devices in that window: time when no device runs anything, split in the JSON into the
part inside the train step's execution (from its first op to its last: the executor between thunks,
waiting on dependencies) and the part after it (Python, dispatch of the next step, data, metrics,
profiler). Step times are under the profiler; the unprofiled median of the steps before it is
printed next to them.

The floor: this machine's fp32 matmul rate measured once (jitted ``jnp.dot`` of one layer's forward
projections at 1024 tokens: 4 x [1024,256]x[256,256], 2 x [1024,256]x[256,1024],
[1024,1024]x[1024,256], median of 20) and the step's GEMM FLOPs: the model FLOPs 6N + 12·l·h·s per
token (``vs_maxtext.model_flops_per_token``; N counts the embedding too, ~4 %) plus the forward
recomputed under full remat, 2·l·(4h² + 3hf) + 4·l·h·s per token, times 8 x 128 tokens.
Floor seconds = FLOPs / rate, to hold against each library's GEMM op-seconds and step time.

Two counts check that both libraries do the same work, whatever the op times: the GEMM FLOPs the step
executes (each GEMM event's dots, 2 x result elements x contracted elements, summed over devices; the
attention's dots are not in it), and the bytes of the collectives' results per device, by collective.

    .venv/bin/python benchmarks/step_profile.py                 # the two default meshes, about 80 s
    .venv/bin/python benchmarks/step_profile.py --libraries meshtron --label after \\
        --meshtron-overrides model.remat=selective             # a variant of meshtron's run

MaxText must be set up (``benchmarks/vs_maxtext.py --setup``). Writes ``results/step_profile.json``
and ``.png`` (``step_profile_<label>.*`` with ``--label``); traces and HLO dumps stay in
``--scratch`` (default ``/tmp/step_profile``).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import _common
import vs_maxtext

from meshtron.config import parse_profile_steps

DEFAULT_MESHES = ("1 device", "data 4 x tensor 2")
LIBRARIES = ("maxtext", "meshtron")
LABELS = {"maxtext": "MaxText 0.2.5", "meshtron": "meshtron"}
KINDS = ("GEMM", "copy/transpose", "attention", "element-wise", "collective", "optimizer", "other")
COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "ragged-all-to-all"}
LAYOUT_OPS = {"parameter", "bitcast", "copy", "transpose", "reshape"}
CONTROL_FLOW = {"while", "conditional", "call"}
SEQ, HIDDEN, MLP, LAYERS, TOKENS = 128, 256, 1024, 4, vs_maxtext.TOKENS


# --- the optimized HLO ---------------------------------------------------------------------------

@dataclass
class Instruction:
    name: str
    opcode: str
    shapes: list[tuple[int, ...]]  # the result's array shapes (several for a tuple)
    operands: list[tuple[str, int | None]]  # (name, tuple index of ``%name#i``)
    called: list[str]  # computations it calls (fusion bodies, loop bodies, reducers)
    op_name: str
    batch_dot: bool  # a dot with batch dimensions
    target: str  # custom-call target
    contracting: tuple[int, ...] = ()  # a dot's lhs contracting dimensions
    result_bytes: int = 0  # bytes of the result (all elements of a tuple)


@dataclass
class Hlo:
    instructions: dict[str, Instruction] = field(default_factory=dict)
    computations: dict[str, list[str]] = field(default_factory=dict)
    users: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", text)]


ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                 "f64": 8, "s64": 8, "u64": 8}


def _bytes(text: str) -> int:
    return sum(ELEMENT_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text))


def parse_hlo(text: str) -> Hlo:
    hlo, computation = Hlo(), None
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.-]+) \(.*\{$", line)
        if header:
            computation = header[1]
            hlo.computations[computation] = []
            continue
        match = re.match(r"\s+(?:ROOT )?%([\w.-]+) = ", line)
        if not match or computation is None:
            continue
        rest = line[match.end():]
        end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:end], rest[end:].lstrip()
        opcode = re.match(r"([\w-]+)\(", rest)
        if not opcode:
            continue
        close = _balanced(rest, opcode.end() - 1)
        operands = [(name, int(index) if index else None)
                    for name, index in re.findall(r"%([\w.-]+)(?:#(\d+))?", rest[opcode.end():close])]
        attributes = rest[close:]
        called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.-]+)", attributes)
        for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", attributes):
            called += re.findall(r"%([\w.-]+)", group)
        op_name = re.search(r'op_name="([^"]*)"', attributes)
        target = re.search(r'custom_call_target="([^"]*)"', attributes)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
        instruction = Instruction(match[1], opcode[1], _shapes(shape), operands, called,
                                  op_name[1] if op_name else "", "lhs_batch_dims=" in attributes,
                                  target[1] if target else "",
                                  tuple(int(d) for d in contracting[1].split(",") if d) if contracting else (),
                                  _bytes(shape))
        hlo.instructions[instruction.name] = instruction
        hlo.computations[computation].append(instruction.name)
        for operand, _ in operands:
            hlo.users[operand].append(instruction.name)
    return hlo


class Classifier:
    """The kind of an HLO instruction (the rules of the module docstring), memoised."""

    def __init__(self, hlo: Hlo, seq: int = SEQ):
        self.hlo, self.seq = hlo, seq
        self.kinds: dict[str, str] = {}
        self.layout_cache: dict[str, bool] = {}

    def scores_shaped(self, shapes: list[tuple[int, ...]]) -> bool:
        return any(len(s) >= 3 and s.count(self.seq) >= 2 for s in shapes)

    def operand_shapes(self, instruction: Instruction) -> list[tuple[int, ...]]:
        """Its result's and array operands' shapes (an element ``%x#i`` of a tuple: that element's)."""
        shapes = list(instruction.shapes) if len(instruction.shapes) == 1 else []
        for operand, index in instruction.operands:
            found = self.hlo.instructions[operand].shapes if operand in self.hlo.instructions else []
            if index is not None and index < len(found):
                shapes.append(found[index])
            elif index is None and len(found) == 1:
                shapes += found
        return shapes

    def fused(self, instruction: Instruction) -> list[Instruction]:
        """The instructions of a fusion's computation, nested fusions included."""
        if instruction.opcode != "fusion":
            return []
        found = []
        for computation in instruction.called:
            for name in self.hlo.computations.get(computation, []):
                inner = self.hlo.instructions[name]
                found += [inner, *self.fused(inner)]
        return found

    def dots(self, instruction: Instruction) -> list[Instruction]:
        return [i for i in [instruction, *self.fused(instruction)]
                if i.opcode in ("dot", "convolution")
                or (i.opcode == "custom-call" and re.search(r"matmul|dot|conv", i.target, re.IGNORECASE))]

    def dot_flops(self, instruction: Instruction) -> int:
        """FLOPs of the dots an instruction runs: 2 x result elements x contracted elements of each."""
        flops = 0
        for dot in self.dots(instruction):
            if dot.opcode != "dot" or len(dot.shapes) != 1:
                continue
            lhs = self.operand_shapes(dot)[1]
            flops += 2 * math.prod(dot.shapes[0]) * math.prod(lhs[d] for d in dot.contracting)
        return flops

    def is_layout(self, instruction: Instruction) -> bool:
        if instruction.opcode in ("copy", "transpose"):
            return True
        inner = self.fused(instruction)
        return bool(inner) and all(i.opcode in LAYOUT_OPS for i in inner) and any(
            i.opcode in ("copy", "transpose") for i in inner)

    def transposes(self, name: str) -> bool:
        """A fusion that also transposes (e.g. an element-wise op writing its result in a GEMM's layout)."""
        return any(i.opcode == "transpose" for i in self.fused(self.hlo.instructions[name]))

    def feeds_gemm(self, name: str) -> bool:
        for user in self.hlo.users.get(name, []):
            instruction = self.hlo.instructions[user]
            if self.kind(user) == "GEMM" or (instruction.opcode in ("bitcast", "reshape") and self.feeds_gemm(user)):
                return True
        return False

    def kind(self, name: str) -> str:
        if name not in self.kinds:
            self.kinds[name] = self._kind(name)
        return self.kinds[name]

    def _kind(self, name: str) -> str:
        instruction = self.hlo.instructions.get(name)
        if instruction is None:
            return "other"
        opcode = re.sub(r"-(start|done|update)$", "", instruction.opcode)
        if opcode in COLLECTIVES:
            return "collective"
        if instruction.opcode in CONTROL_FLOW:
            return "other"
        dots = self.dots(instruction)
        if dots:
            scores = any(self.scores_shaped(self.operand_shapes(d)) for d in dots)
            return "attention" if scores else "GEMM"
        if self.scores_shaped(self.operand_shapes(instruction)):
            return "attention"
        if instruction.op_name and not any(scope in instruction.op_name for scope in ("jvp(", "transpose(", "while/")):
            return "optimizer"
        if self.is_layout(instruction):
            return "copy/transpose"
        return "element-wise"


# --- the trace -----------------------------------------------------------------------------------

@dataclass
class OpEvent:
    name: str
    module: str
    run_id: int
    device: int
    start: int  # ns
    end: int
    exclusive: int  # ns, nested op events on the same thread taken out
    waiting: int = 0  # ns in ``Rendezvous`` events inside it (a collective waiting for the other devices)


def read_trace(path: Path) -> list[OpEvent]:
    """All XLA thunk events (those carrying ``hlo_op``) of the host plane, with exclusive times."""
    from jax.profiler import ProfileData

    events: list[OpEvent] = []
    for plane in ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            stack: list[OpEvent] = []
            ops, rendezvous = [], []
            for event in line.events:
                if event.name == "Rendezvous":
                    rendezvous.append((int(event.start_ns), int(event.duration_ns)))
                    continue
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    start = int(event.start_ns)
                    end = start + int(event.duration_ns)
                    ops.append(OpEvent(str(stats["hlo_op"]), str(stats.get("hlo_module", "")),
                                       int(stats.get("run_id", 0)), int(stats.get("device_ordinal", -1)),
                                       start, end, end - start))
            for op in sorted(ops, key=lambda o: (o.start, -o.end)):
                while stack and stack[-1].end <= op.start:
                    stack.pop()
                if stack:
                    stack[-1].exclusive -= min(op.end, stack[-1].end) - op.start
                stack.append(op)
            rendezvous.sort()
            starts = [r[0] for r in rendezvous]
            for op in ops:
                inside = rendezvous[bisect.bisect_left(starts, op.start):bisect.bisect_left(starts, op.end)]
                op.waiting = sum(min(d, op.end - s) for s, d in inside)
            events += ops
    return events


def idle(window: tuple[int, int], busy: list[tuple[int, int]], split: int) -> tuple[int, int]:
    """Time in ``window`` covered by no busy interval: (before ``split``, after it)."""
    before, after, reach = 0, 0, window[0]
    for start, end in [*sorted(busy), (window[1], window[1])]:
        if start > reach:
            before += max(0, min(start, split) - reach)
            after += start - max(reach, split) if start > split else 0
        reach = max(reach, end)
    return before, after


def breakdown(trace: Path, hlo_path: Path, module: str) -> dict:
    """Per-step op-seconds by kind, wall step time and host gap of a trace (see the docstring)."""
    classifier = Classifier(parse_hlo(hlo_path.read_text()))
    events = read_trace(trace)
    train = [e for e in events if e.module == module]
    firsts: dict[int, int] = {}
    lasts: dict[int, int] = {}
    counts: dict[int, int] = defaultdict(int)
    for e in train:
        firsts[e.run_id] = min(firsts.get(e.run_id, e.start), e.start)
        lasts[e.run_id] = max(lasts.get(e.run_id, e.end), e.end)
        counts[e.run_id] += 1
    # An execution cut by the trace's start (the previous step's last ops) is not a step.
    order = sorted((run for run in firsts if counts[run] >= max(counts.values()) / 2), key=firsts.get)
    if len(order) < 2:
        raise RuntimeError(f"{trace}: {len(order)} executions of {module} in the trace; need at least 2")
    windows = [(firsts[a], firsts[b]) for a, b in itertools.pairwise(order)]
    step_of = {run: i for i, run in enumerate(order[:-1])}
    steps = len(windows)
    kinds = dict.fromkeys(KINDS, 0.0)
    per_op: dict[str, float] = defaultdict(float)
    unmapped: dict[str, float] = defaultdict(float)
    feeding, waiting, transposing = 0.0, 0.0, 0.0
    gemm_flops = 0
    collective_bytes: dict[str, int] = defaultdict(int)
    busy: list[list[tuple[int, int]]] = [[] for _ in windows]
    devices = set()
    for e in events:
        if e.module == module:
            step = step_of.get(e.run_id)
        else:
            step = next((i for i, (a, b) in enumerate(windows) if a <= e.start < b), None)
        if step is None:
            continue
        a, b = windows[step]
        if min(e.end, b) > max(e.start, a):
            busy[step].append((max(e.start, a), min(e.end, b)))
        seconds = e.exclusive / 1e9
        if e.module != module:
            kinds["other"] += seconds
            per_op[f"{e.module}:{e.name}"] += seconds
            continue
        devices.add(e.device)
        kind = classifier.kind(e.name)
        kinds[kind] += seconds
        per_op[e.name] += seconds
        if e.name not in classifier.hlo.instructions:
            unmapped[e.name] += seconds
        elif kind == "copy/transpose" and classifier.feeds_gemm(e.name):
            feeding += seconds
        elif kind == "element-wise" and classifier.transposes(e.name):
            transposing += seconds
        if kind == "collective":
            waiting += e.waiting / 1e9
            instruction = classifier.hlo.instructions[e.name]
            if not instruction.opcode.endswith("-done"):
                collective_bytes[re.sub(r"-start$", "", instruction.opcode)] += instruction.result_bytes
        elif kind == "GEMM":
            gemm_flops += classifier.dot_flops(classifier.hlo.instructions[e.name])
    walls = [(b - a) / 1e9 for a, b in windows]
    gaps = [idle(w, iv, lasts[run]) for w, iv, run in zip(windows, busy, order)]
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:12]
    return {"steps_analysed": steps, "devices": len(devices), "step_seconds": statistics.mean(walls),
            "step_seconds_each": walls, "host_gap_seconds": statistics.mean(sum(g) for g in gaps) / 1e9,
            "host_gap_inside_execution_seconds": statistics.mean(g[0] for g in gaps) / 1e9,
            "host_gap_between_executions_seconds": statistics.mean(g[1] for g in gaps) / 1e9,
            "op_seconds": {k: v / steps for k, v in kinds.items()},
            "op_seconds_total": sum(kinds.values()) / steps,
            "copy_transpose_feeding_gemm_seconds": feeding / steps, "collective_waiting_seconds": waiting / steps,
            "element_wise_transposing_seconds": transposing / steps,
            "gemm_flops": gemm_flops / steps,
            "collective_bytes_per_device": {k: v / steps / len(devices) for k, v in collective_bytes.items()},
            "unmapped_seconds": {k: v / steps for k, v in sorted(unmapped.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": name, "kind": "other" if ":" in name else classifier.kind(name), "seconds": s / steps,
                         "op_name": _op_name(classifier, name)} for name, s in top]}


def _op_name(classifier: Classifier, name: str) -> str:
    instruction = classifier.hlo.instructions.get(name)
    return instruction.op_name if instruction else ""


# --- the runs ------------------------------------------------------------------------------------

def _dump_flags(devices: int, dump: Path, module: str) -> str:
    return (f"--xla_force_host_platform_device_count={devices} --xla_dump_to={dump} --xla_dump_hlo_as_text "
            f"--xla_dump_hlo_module_re=^{module}$")


def _only(pattern: str, directory: Path) -> Path:
    found = sorted(directory.glob(pattern))
    if not found:
        raise RuntimeError(f"nothing matches {pattern} under {directory}")
    return found[-1]


def _unprofiled_median(times: dict[int, float], first_profiled: int) -> float:
    """Median step time of steps 4 .. first_profiled - 1 (1-based), the steady state before the trace."""
    chosen = [t for step, t in times.items() if 4 <= step < first_profiled]
    return statistics.median(chosen) if chosen else float("nan")


def profile_meshtron(work: Path, devices: int, overrides: list[str], steps: int, window: tuple[int, int]) -> dict:
    module = "jit_train"
    env = {**os.environ, "XLA_FLAGS": _dump_flags(devices, work / "hlo", module)}
    metrics = work / "metrics.jsonl"
    command = [sys.executable, "-m", "meshtron.cli", "train", "--config", "llama_cpu8", "--metrics", str(metrics),
               *vs_maxtext.MESHTRON_MODEL, *overrides, f"train.steps={steps}",
               f"train.profile_steps={window[0]}:{window[1]}", f"train.profile_dir={work / 'trace'}"]
    proc = subprocess.run(command, cwd=vs_maxtext.ROOT, env=env, capture_output=True, text=True, timeout=1200,
                          check=False)
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"meshtron failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = {r["step"]: r["step_seconds"] for r in records if "step_seconds" in r}
    return {"trace": _only("**/*.xplane.pb", work / "trace"),
            "hlo": _only(f"*.{module}.cpu_after_optimizations.txt", work / "hlo"), "module": module,
            "unprofiled_step_seconds": _unprofiled_median(times, window[0]), "command": command}


def profile_maxtext(work: Path, directory: Path, devices: int, extra: list[str], steps: int,
                    window: tuple[int, int]) -> dict:
    """MaxText through vs_maxtext's wrapper, with its xplane profiler on for the same (0-based) steps."""
    module = "jit_train_step"
    python = directory / "venv" / "bin" / "python"
    if not python.exists():
        sys.exit(f"MaxText is not set up in {directory}: run benchmarks/vs_maxtext.py --setup first")
    config = next((directory / "venv" / "lib").glob("python3.12/site-packages/maxtext/configs/base.yml"))
    (directory / "maxtext_train.py").write_text(vs_maxtext.MAXTEXT_WRAPPER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_GCE_CHECK": "True",
           "XLA_FLAGS": _dump_flags(devices, work / "hlo", module)}
    command = [str(python), str(directory / "maxtext_train.py"), str(config), "run_name=profile",
               f"base_output_directory={work / 'out'}", f"steps={steps}", *vs_maxtext.MAXTEXT_MODEL, *extra,
               "profiler=xplane", f"skip_first_n_steps_for_profiler={window[0] - 1}",
               f"profiler_steps={window[1] - window[0] + 1}"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, check=False)
    text = proc.stdout + proc.stderr
    (work / "log.txt").write_text(text)
    if proc.returncode:
        raise RuntimeError(f"MaxText failed (exit {proc.returncode}):\n{text[-3000:]}")
    # MaxText's own step times count from 0 and are dispatch-to-dispatch (they can be ~0 when a step
    # only enqueued); the median over several steps is still the step time.
    times = {int(k) + 1: float(s) for k, s in re.findall(r"completed step: (\d+), seconds: ([\d.]+)", text)}
    return {"trace": _only("**/*.xplane.pb", work / "out"),
            "hlo": _only(f"*.{module}.cpu_after_optimizations.txt", work / "hlo"), "module": module,
            "unprofiled_step_seconds": _unprofiled_median(times, window[0]), "command": command}


# --- the floor -----------------------------------------------------------------------------------

def gemm_rate(repeats: int = 20) -> dict:
    """fp32 matmul FLOP/s of one layer's forward projections at 1024 tokens, on one device."""
    import jax
    import jax.numpy as jnp

    shapes = {"qkvo [1024,256]x[256,256]": ((TOKENS, HIDDEN), (HIDDEN, HIDDEN), 4),
              "gate/up [1024,256]x[256,1024]": ((TOKENS, HIDDEN), (HIDDEN, MLP), 2),
              "down [1024,1024]x[1024,256]": ((TOKENS, MLP), (MLP, HIDDEN), 1)}
    dot = jax.jit(jnp.dot)
    per_shape, flops, seconds = {}, 0.0, 0.0
    for label, (a_shape, b_shape, count) in shapes.items():
        a = jax.random.normal(jax.random.key(0), a_shape, jnp.float32)
        b = jax.random.normal(jax.random.key(1), b_shape, jnp.float32)
        dot(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dot(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        f = 2 * a_shape[0] * a_shape[1] * b_shape[1]
        per_shape[label] = f / t
        flops += count * f
        seconds += count * t
    return {"flops_per_second": flops / seconds, "per_shape_flops_per_second": per_shape}


def step_gemm_flops() -> dict:
    model = vs_maxtext.model_flops_per_token()  # 6N + 12·l·h·s
    recompute = 2 * LAYERS * (4 * HIDDEN**2 + 3 * HIDDEN * MLP) + 4 * LAYERS * HIDDEN * SEQ
    return {"model_flops_per_token": model, "recompute_flops_per_token": recompute,
            "flops_per_step": (model + recompute) * TOKENS}


# --- output --------------------------------------------------------------------------------------

def print_results(results: list[dict], floor: dict) -> None:
    header = ["mesh", "library", "step s", "unprof. s", "op-s", *KINDS, "host gap", "GEMM floor s"]
    rows = []
    for r in results:
        b, total = r["breakdown"], r["breakdown"]["op_seconds_total"]
        cells = [f"{b['op_seconds'][k]:.3f} {100 * b['op_seconds'][k] / total:3.0f}%" for k in KINDS]
        gap = f"{b['host_gap_seconds']:.3f} {100 * b['host_gap_seconds'] / b['step_seconds']:3.0f}%"
        rows.append([r["mesh"], LABELS[r["library"]], f"{b['step_seconds']:.3f}", f"{r['unprofiled_step_seconds']:.3f}",
                     f"{total:.3f}", *cells, gap, f"{floor['seconds']:.3f}"])
    print(f"\nseconds per step (op-seconds summed over devices; % of op-seconds; host gap: % of the step); "
          f"GEMM floor = {floor['flops_per_step'] / 1e9:.1f} GFLOP / {floor['flops_per_second'] / 1e9:.1f} GFLOP/s")
    _common.print_table(header, rows)
    for r in results:
        b = r["breakdown"]
        unmapped = sum(b["unmapped_seconds"].values())
        print(f"\n{r['mesh']}, {LABELS[r['library']]}: {b['devices']} devices, {b['steps_analysed']} steps; "
              f"copy/transpose feeding a GEMM {b['copy_transpose_feeding_gemm_seconds']:.3f} s; "
              f"collectives waiting in a rendezvous {b['collective_waiting_seconds']:.3f} s; "
              f"element-wise fusions that also transpose {b['element_wise_transposing_seconds']:.3f} s; "
              f"host gap inside the execution {b['host_gap_inside_execution_seconds']:.3f} s, "
              f"after it {b['host_gap_between_executions_seconds']:.3f} s; "
              f"names not in the HLO {unmapped:.4f} s; GEMMs run {b['gemm_flops'] / 1e9:.2f} GFLOP "
              f"({b['gemm_flops'] / 1e9 / b['op_seconds']['GEMM']:.1f} GFLOP per op-second); collectives write "
              + (", ".join(f"{v / 2**20:.2f} MiB of {k}" for k, v in b["collective_bytes_per_device"].items())
                 or "nothing") + " per device; top ops (s/step):")
        for op in b["top_ops"][:8]:
            print(f"    {op['seconds']:7.3f}  {op['kind']:<14} {op['op']:<40} {op['op_name'][:90]}")


def plot(results: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = np.arange(len(results))
    labels = [f"{LABELS[r['library']]}\n{r['mesh']}" for r in results]
    colors = plt.get_cmap("tab10").colors
    bottom_s, bottom_p = np.zeros(len(results)), np.zeros(len(results))
    for i, kind in enumerate([*KINDS, "host gap"]):
        if kind == "host gap":
            seconds = np.array([r["breakdown"]["host_gap_seconds"] for r in results])
        else:
            seconds = np.array([r["breakdown"]["op_seconds"][kind] for r in results])
        totals = np.array([r["breakdown"]["op_seconds_total"] for r in results])
        left.bar(x, seconds, bottom=bottom_s, color=colors[i], label=kind)
        bottom_s += seconds
        if kind != "host gap":
            right.bar(x, 100 * seconds / totals, bottom=bottom_p, color=colors[i], label=kind)
            bottom_p += 100 * seconds / totals
    for xi, r in zip(x, results):
        step = r["breakdown"]["step_seconds"]
        left.plot([xi - 0.4, xi + 0.4], [step * r["breakdown"]["devices"]] * 2, "k--", lw=1)
    left.set_ylabel("op-seconds per step, all devices (dashes: step x devices)")
    left.set_xticks(x, labels, fontsize=7)
    left.legend(fontsize=7)
    right.set_ylabel("% of op-seconds")
    right.set_xticks(x, labels, fontsize=7)
    fig.suptitle("Where a training step's time goes: Llama 4x256, seq 128, batch 8, fp32, full remat")
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES),
                        help=f"comma-separated names from vs_maxtext.MESHES: {list(vs_maxtext.MESHES)}")
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated: maxtext, meshtron")
    parser.add_argument("--meshtron-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra meshtron overrides, appended after the model's and model.remat=full")
    parser.add_argument("--label", default="", help="suffix of the output files: results/step_profile_<label>.*")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--profile-steps", default="8:11",
                        help="FIRST:LAST (1-based) steps traced; the last only bounds the one before")
    parser.add_argument("--maxtext-dir", type=Path, default=Path("/tmp/maxtext_try"))
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/step_profile"))
    args = parser.parse_args()
    names = [n.strip() for n in args.meshes.split(",")]
    libraries = [n.strip() for n in args.libraries.split(",")]
    if [n for n in names if n not in vs_maxtext.MESHES] or [n for n in libraries if n not in LIBRARIES]:
        sys.exit(f"--meshes from {list(vs_maxtext.MESHES)}, --libraries from {list(LIBRARIES)}")
    window = parse_profile_steps(args.profile_steps)
    if window[1] - window[0] < 1 or window[1] > args.steps or window[0] < 5:
        sys.exit("--profile-steps: need 5 <= FIRST < LAST <= --steps (two executions at least, after warm-up)")

    rate = gemm_rate()
    flops = step_gemm_flops()
    floor = {**flops, **rate, "seconds": flops["flops_per_step"] / rate["flops_per_second"]}
    print(f"fp32 matmul rate {rate['flops_per_second'] / 1e9:.1f} GFLOP/s "
          f"({', '.join(f'{k} {v / 1e9:.1f}' for k, v in rate['per_shape_flops_per_second'].items())}); "
          f"step GEMM FLOPs {flops['flops_per_step'] / 1e9:.1f} G; floor {floor['seconds']:.3f} s", flush=True)

    suffix = f"_{args.label}" if args.label else ""
    results = []
    started = time.perf_counter()
    for name in names:
        devices, maxtext_args, meshtron_overrides = vs_maxtext.MESHES[name]
        for library in libraries:
            slug = re.sub(r"\W+", "_", name).strip("_")
            work = args.scratch / f"{library}_{slug}{suffix}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            t0 = time.perf_counter()
            if library == "meshtron":
                overrides = [*meshtron_overrides, "model.remat=full", *args.meshtron_overrides]
                run = profile_meshtron(work, devices, overrides, args.steps, window)
            else:
                run = profile_maxtext(work, args.maxtext_dir, devices, maxtext_args, args.steps, window)
            result = breakdown(run["trace"], run["hlo"], run["module"])
            results.append({"mesh": name, "library": library, "breakdown": result,
                            "unprofiled_step_seconds": run["unprofiled_step_seconds"],
                            "trace": str(run["trace"]), "hlo": str(run["hlo"]), "command": run["command"]})
            print(f"  {name}, {LABELS[library]}: step {result['step_seconds']:.3f} s under the profiler "
                  f"({run['unprofiled_step_seconds']:.3f} s without), ran in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    print_results(results, floor)
    path = _common.write_results(f"step_profile{suffix}", {
        "steps": args.steps, "profile_steps": args.profile_steps, "meshtron_overrides": args.meshtron_overrides,
        "kinds": list(KINDS), "floor": floor, "results": results,
        "seconds": round(time.perf_counter() - started, 1)})
    plot(results, f"step_profile{suffix}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
