"""Zero bubble against 1F1B where a bubble costs real time: two simulated devices on two cores.

With 8 simulated devices on this 2-core machine an idle stage just lends its core to a busy one,
so bubbles cost nothing measurable. Here ``pipe = 2`` runs on exactly 2 devices (one stage per
core) and every schedule trains the same GPT with the same (p, m): GPipe, 1F1B (Megatron's lockstep
table), 1F1B with p in flight, interleaved (v = 2), ZB-H1, and "1f1b split": 1F1B's own table with
each weight gradient in the tick of its input gradient, which isolates what splitting the backward
costs from what the zero-bubble table saves. Each step is timed in rounds that
cycle through the schedules (so slow phases of the machine hit all of them alike); the table gives
medians, the compiled step's temp memory, and the time each table *predicts* from the checker
with this runtime's costs. Every schedule runs in both of the runtime's modes:

* ``recompute`` (``parallel.recompute=true``, the default): a stage backward recomputes its
  forward from the stashed input, so B (recompute + input gradient) costs 2 forwards, W 2 (it
  reruns the forward too, for the activations it multiplies), and an unsplit backward 3;
* ``keep`` (``parallel.recompute=false``): the forward keeps every layer's matmul outputs, B is
  the input gradient alone; priced with the paper's t_F = t_B = t_W.

The check: ZB-H1's measured saving over 1F1B is at least half the predicted one,
and its temp memory within 15% of 1F1B's.

Besides the unit-cost prediction, every table is also priced with this runtime's own costs: a
subprocess pinned to one core times one chunk's forward, B, W and fused backward (the runtime's
per-layer code, outside the tick loop) and the checker prices each table with them (a fused
backward at its own measured cost, not B + W). What the measured step exceeds that by is what the
tick loop itself costs.

Where the time goes on this machine: the CPU runtime allocates a step's temporaries afresh for
every step, and glibc serves allocations that large with ``mmap``, so every step first-touches
(page-faults in) its whole temp memory: a cost proportional to temp memory that a GPU's pooled
allocator does not pay, and larger for the schedules that hold more. ``--pooled-malloc`` reruns
the benchmark with glibc told to keep freed memory in its heap (``GLIBC_TUNABLES``: no ``mmap``,
one arena, no trimming), which reuses it from step to step; the table reports minor page faults
per step in both modes, and the results go to ``zero_bubble_pooled.{json,png}``.

Two simulated devices in one process are still not two GPUs: XLA's CPU client gives the process one
intra-op thread pool, sized by its cores and shared by its devices, so while one stage idles in a
bubble its core runs part of the other stage's parallel work, and a bubble costs less than its
length. ``--process-per-stage`` runs each stage as its own process instead (``jax.distributed``
on 127.0.0.1, gloo collectives, the same SPMD program), pinned to its own core before JAX starts,
so its thread pool has that one core: a stage in a bubble leaves its core idle, as a GPU's idle SMs
are. The tick's exchange then goes through gloo over loopback TCP instead of memory; results go to
``zero_bubble_processes.{json,png}`` (``_pooled`` with ``--pooled-malloc``).

The model is a 4-layer GPT of width 256 (sequence 128, 4 sequences per microbatch): there B costs
1.3 forwards and W 1.1 on this CPU (element-wise work, attention and copies weigh about as much as
the GEMMs), not the t_F = t_B = t_W of the paper's GPU-sized layers. ``--hidden 1024 --rows 2`` runs a
GEMM-bound layer instead (MLP 4x, one head per 64; results get a ``_h1024_b2`` suffix), and
``--zb-only`` times only what the check compares -- 1F1B, ZB-H1 and 1F1B split, residuals
kept (``_zb``) -- since a wide step takes seconds.

    .venv/bin/python benchmarks/zero_bubble.py [--rounds N] [--microbatches M ...] [--pooled-malloc]
                                               [--process-per-stage] [--hidden H --rows R] [--zb-only]
"""

from __future__ import annotations

import os
import sys

OP_COSTS = "--op-costs"  # the subprocess that times one chunk's work on one core
STAGE_WORKER = "--stage-worker"  # RANK PORT: one of --process-per-stage's two processes
POOLED = "--pooled-malloc"
POOLED_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736:glibc.malloc.arena_max=1"
if POOLED in sys.argv and os.environ.get("GLIBC_TUNABLES") != POOLED_TUNABLES:
    # glibc reads its tunables at process start: run again with them (the op-cost subprocess inherits them).
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": POOLED_TUNABLES})
if STAGE_WORKER in sys.argv:  # one core per stage: pinned before JAX sizes its thread pools by the affinity
    os.sched_setaffinity(0, {int(sys.argv[sys.argv.index(STAGE_WORKER) + 1]) % os.cpu_count()})
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                           + ("1" if OP_COSTS in sys.argv or STAGE_WORKER in sys.argv else "2")).strip()

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import time

import _common
import jax
import numpy as np

from meshtron.config import MeshConfig, ModelConfig, TrainConfig
from meshtron.mesh import build_mesh
from meshtron.optim import build_optimizer, data_parallel_mean
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.schedules import Costs, Schedule, check, compile_program, make_schedule
from meshtron.train.pipelined import to_stage_order
from meshtron.train.state import model_def_from_config
from meshtron.train.step import build_steps

ZB_ONLY = "--zb-only"  # only what the check compares: 1F1B, ZB-H1 (and 1F1B split), residuals kept


def _shape_flag(flag: str, default: int) -> int:
    """A model-shape flag, read before JAX starts: the op-cost subprocess and the stage workers get it too."""
    return int(sys.argv[sys.argv.index(flag) + 1]) if flag in sys.argv else default


HIDDEN = _shape_flag("--hidden", 256)
MODEL = ModelConfig(hidden=HIDDEN, heads=max(4, HIDDEN // 64), layers=4, mlp_dim=4 * HIDDEN, seq_len=128)
ROWS = _shape_flag("--rows", 4)  # sequences per microbatch
SHAPE_ARGS = ["--hidden", str(HIDDEN), "--rows", str(ROWS), *([ZB_ONLY] if ZB_ONLY in sys.argv else [])]
SPLIT_1F1B = "1f1b split"  # 1F1B's own table, each W in the tick of its B: what splitting alone costs
RUNTIME_COSTS = {True: Costs(forward=1.0, backward=2.0, weight=2.0),  # recompute: B and W rerun the stage forward
                 False: Costs(forward=1.0, backward=1.0, weight=1.0)}  # keep: the paper's unit costs
MODES = (False,) if ZB_ONLY in sys.argv else (True, False)  # parallel.recompute


def table(name: str, m: int, chunks: int) -> Schedule:
    if name == SPLIT_1F1B:
        fused = make_schedule("1f1b", 2, m, 1)
        return dataclasses.replace(fused, name=SPLIT_1F1B, weight=fused.backward)
    return make_schedule(name, 2, m, chunks)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b-p", 1), ("interleaved", 2), ("zb-h1", 1), (SPLIT_1F1B, 1)]
if ZB_ONLY in sys.argv:
    SCHEDULES = [s for s in SCHEDULES if s[0] in ("1f1b", "zb-h1", SPLIT_1F1B)]


def place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``host`` (the same on every process) as a global array: each process fills its own shards."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def build(schedule: str, chunks: int, m: int, keep: bool = False):
    """A ready-to-time train step (and its state) of ``schedule`` on mesh (1, 2, 1); ``keep``: the
    forward keeps the layers' residuals (``parallel.recompute=false``)."""
    md = model_def_from_config(MODEL, 1)
    mesh = build_mesh(MeshConfig(1, 2, 1), jax.devices()[:2])
    program = compile_program(table(schedule, m, chunks), keep_residuals=keep)
    train = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()),
                        microbatches=m, pipeline=PipelinePlan(program))
    one_device = build_mesh(MeshConfig(1, 1, 1), jax.local_devices()[:1])  # initialised where it is readable
    host = to_stage_order(jax.device_get(md.init(one_device, 0)), MODEL.layers, 2, chunks)
    params = jax.tree.map(lambda a, s: place(np.asarray(a), s), host, train.param_shardings)
    opt_state = train.init_opt_state(params)
    rng = np.random.default_rng(0)
    batch = place(rng.integers(0, 256, (m * ROWS, MODEL.seq_len + 1), dtype=np.int32), train.batch_sharding)
    memory = train.lower(params, opt_state, batch).compile().memory_analysis().temp_size_in_bytes
    state = {"params": params, "opt": opt_state}

    def step() -> tuple[float, int]:
        """(seconds, minor page faults of the process) of one step."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        state["params"], state["opt"], metrics = train.train(state["params"], state["opt"], batch)
        metrics.loss.block_until_ready()
        return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    step()  # compile and warm up
    return step, memory


def op_costs(repeats: int = 15) -> dict:
    """Median seconds of one chunk's work (``MODEL.layers / 2`` layers, one microbatch) on one core:
    forward, B, W and the fused backward, in both recomputation modes, with the runtime's own
    per-layer code and its buffers updated in place (donated), as in the tick loop. Run in a
    subprocess pinned to core 0 (:func:`measured_costs`), so no second device shares the core."""
    import jax.numpy as jnp

    from meshtron.pipeline.buffers import get
    from meshtron.pipeline.layer_backward import LayerBackward
    from meshtron.train.pipelined import stage_functions

    md = model_def_from_config(MODEL, 1)
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    fns = stage_functions(md)
    chunk = jax.tree.map(lambda a: a[: MODEL.layers // 2], jax.device_get(md.init(mesh, 0))["blocks"])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(ROWS, MODEL.seq_len, MODEL.hidden)), jnp.float32)
    dy = 0.01 * x
    tok = jnp.zeros((ROWS, MODEL.seq_len + 1), jnp.int32)  # the microbatch's tokens (the layers read positions)
    slot = jnp.int32(0)

    def zeros(tree):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)

    def timed(step, state):
        """Median time of ``state = step(state)``, and the last state."""
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            state = jax.block_until_ready(step(state))
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]), state

    def chunk_costs(keep: bool) -> dict:
        program = compile_program(make_schedule("zb-h1", 2, 2, 1), keep_residuals=keep)

        def lb(cp):  # built while tracing: it tells parameters from residuals by identity
            return LayerBackward(program, fns, jax.tree.map(lambda a: a[None], cp), x, tok, lambda a: a, zeros)

        def residual_of(cp, rb):
            if keep:
                return lambda i: [get(b, (slot, i)) for b in rb[:-1]]
            stored = lb(cp).layers_forward(cp, x, tok)[1]
            return lambda i: [jax.lax.dynamic_index_in_dim(a, i, keepdims=False) for a in stored]

        grads = jax.tree.map(lambda a: jnp.zeros((1, *a.shape), a.dtype), chunk)
        wbuf = jax.jit(lambda cp: lb(cp).buffers(1))(chunk)
        if keep:
            rbuf = jax.jit(lambda cp: lb(cp).residual_buffers(1))(chunk)
            forward = jax.jit(lambda cp, rb: [*lb(cp).forward_into(cp, x, tok, None, rb[:-1], slot)[1], rb[-1]],
                              donate_argnums=1)
            fused = jax.jit(lambda cp, rb, g: lb(cp).backward_into(cp, residual_of(cp, rb), dy, None, g, slot)[1],
                            donate_argnums=2)
        else:
            rbuf = None
            forward = jax.jit(lambda cp, _: fns.stage(cp, x, tok))  # returns y: the timing waits for it
            fused = jax.jit(lambda cp, rb, g: jax.tree.map(jnp.add, g, jax.vjp(lambda c, h: fns.stage(c, h, tok), cp, x)[1](dy)[0]),
                            donate_argnums=2)
        def input_gradient(cp, rb, wb, g):  # kept residuals: B also writes boundary values over those only B reads
            kept = None if rb is None else (rb[:-1], slot)
            wb, layers, g = lb(cp).input_gradient_into(cp, residual_of(cp, rb), dy, None, wb, slot, g, slot, kept)[1]
            return None if rb is None else [*layers, rb[-1]], wb, g

        b = jax.jit(input_gradient, donate_argnums=(1, 2, 3))
        # W reads the layers' residuals (B left it only what depends on the cotangent): kept ones, which
        # live until W, or, recomputing, those of the chunk's forward W reruns from the stage input.
        def weight_gradient(cp, rb, wb, g):
            if keep:
                return lb(cp).weight_gradient_into(cp, wb, slot, None, g, slot, (rb[:-1], slot))
            return lb(cp).forward_weight_gradient_into(cp, x, tok, wb, slot, None, g, slot)

        w = jax.jit(weight_gradient, donate_argnums=3)
        costs = {}
        costs["forward"], kept = timed(lambda rb: forward(chunk, rb), rbuf)
        rbuf = kept if keep else None
        costs["input_gradient"], (rbuf, wbuf, grads) = timed(lambda bufs: b(chunk, *bufs), (rbuf, wbuf, grads))
        costs["weight_gradient"], grads = timed(lambda g: w(chunk, rbuf, wbuf, g), grads)
        costs["fused_backward"], _ = timed(lambda g: fused(chunk, rbuf, g), grads)
        return costs

    with jax.set_mesh(mesh):
        return {"keep": chunk_costs(True), "recompute": chunk_costs(False)}


def child_env() -> dict[str, str]:
    """This environment for a subprocess that sets its own simulated device count (XLA_FLAGS without ours)."""
    return {**os.environ, "XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                                if "device_count" not in f)}


def measured_costs() -> dict:
    """:func:`op_costs` in a subprocess pinned to one core."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import os, sys, json; os.sched_setaffinity(0, {{0}}); sys.argv.append({OP_COSTS!r}); "
            f"sys.argv.extend({SHAPE_ARGS!r}); sys.path.insert(0, {here!r}); import zero_bubble; "
            f"print(json.dumps(zero_bubble.op_costs()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def table_costs(schedule: Schedule, ops: dict) -> Costs:
    """The checker's costs for ``schedule`` from measured chunk work: a split table at t_F, t_B, t_W;
    a fused one at t_F and the fused backward's own time (``weight`` 0)."""
    if schedule.split_backward:
        return Costs(ops["forward"], ops["input_gradient"], ops["weight_gradient"])
    return Costs(ops["forward"], ops["fused_backward"], 0.0)


def measure(m: int, rounds: int, ops: dict) -> list[dict]:
    steps, memory, times, faults = {}, {}, {}, {}
    runs = [(schedule, chunks, recompute) for recompute in MODES for schedule, chunks in SCHEDULES
            if chunks == 1 or m % 2 == 0]  # interleaving needs m a multiple of p = 2
    for schedule, chunks, recompute in runs:
        key = (schedule, recompute)
        steps[key], memory[key] = build(schedule, chunks, m, keep=not recompute)
        times[key], faults[key] = [], []
    for _ in range(rounds):
        for schedule, _, recompute in runs:
            seconds, faulted = steps[(schedule, recompute)]()
            times[(schedule, recompute)].append(seconds)
            faults[(schedule, recompute)].append(faulted)
    out = []
    for schedule, chunks, recompute in runs:
        key, costs = (schedule, recompute), RUNTIME_COSTS[recompute]
        ideal = m * (costs.forward + costs.backward + costs.weight)
        stats = check(table(schedule, m, chunks), costs)
        measured_costs = table_costs(table(schedule, m, chunks), ops["recompute" if recompute else "keep"])
        priced = check(table(schedule, m, chunks), measured_costs)
        per_microbatch = measured_costs.forward + measured_costs.backward + measured_costs.weight
        out.append({"schedule": schedule, "recompute": recompute, "p": 2, "m": m, "v": chunks, "ticks": stats.ticks,
                    "bubble": stats.bubble_fraction, "predicted_units": ideal * (1 + stats.bubble_fraction),
                    "predicted_from_op_costs_s": m * per_microbatch * (1 + priced.bubble_fraction),
                    "step_s": statistics.median(times[key]), "step_s_all": times[key],
                    "page_faults_per_step": statistics.median(faults[key]),
                    "temp_bytes": memory[key], "in_flight": list(stats.peak_in_flight),
                    "weight_pending": list(stats.peak_weight_pending)})
    return out


def stage_worker(rank: int, port: int, rounds: int, microbatches: list[int], ops: dict, out: str) -> None:
    """One stage of ``--process-per-stage``: the same measurements as one process runs, in lockstep
    with the other stage's process; rank 0 writes the results (page faults summed over both)."""
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, rank)
    results = []
    for m in microbatches:
        runs = measure(m, rounds, ops)
        faults = multihost_utils.process_allgather(np.array([r["page_faults_per_step"] for r in runs]))
        for r, both in zip(runs, np.asarray(faults).sum(axis=0)):
            r["page_faults_per_step"] = float(both)
        results.append(runs)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    jax.distributed.shutdown()


def measure_in_processes(microbatches: list[int], rounds: int, ops: dict) -> list[list[dict]]:
    """:func:`measure` for each ``m`` with each stage in its own process, pinned to its own core."""
    import tempfile

    from meshtron.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out, ops_file = os.path.join(tmp, "results.json"), os.path.join(tmp, "ops.json")
        with open(ops_file, "w") as f:
            json.dump(ops, f)
        env = child_env()
        workers = [subprocess.Popen([sys.executable, os.path.abspath(__file__), STAGE_WORKER, str(rank), str(port),
                                     "--ops", ops_file, "--out", out, "--rounds", str(rounds),
                                     "--microbatches", *map(str, microbatches), *SHAPE_ARGS], env=env)
                   for rank in range(2)]
        codes = [w.wait() for w in workers]
        if any(codes):
            raise SystemExit(f"--process-per-stage: a stage process failed (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="model width (MLP 4x, one head per 64); default 256")
    parser.add_argument("--rows", type=int, default=ROWS, help="sequences (of 128 tokens) per microbatch; default 4")
    parser.add_argument(ZB_ONLY, action="store_true",
                        help="only 1F1B, ZB-H1 and 1F1B split with residuals kept (what the zero-bubble bar compares)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 3, 4])  # m=8 compiles for minutes
    parser.add_argument(POOLED, action="store_true", help="glibc keeps freed memory for reuse (see the docstring)")
    parser.add_argument("--process-per-stage", action="store_true",
                        help="each stage in its own process on its own core (see the docstring)")
    parser.add_argument(STAGE_WORKER, nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--ops", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_worker:
        with open(args.ops) as f:
            stage_worker(*args.stage_worker, args.rounds, args.microbatches, json.load(f), args.out)
        return
    name = (("zero_bubble_processes" if args.process_per_stage else "zero_bubble")
            + ("" if (HIDDEN, ROWS) == (256, 4) else f"_h{HIDDEN}_b{ROWS}") + ("_zb" if args.zb_only else "")
            + ("_pooled" if args.pooled_malloc else ""))
    assert len(jax.devices()) == 2, "this benchmark needs exactly 2 simulated devices (one stage per core)"
    ops = measured_costs()
    print("one chunk's work on one core (ms):", json.dumps({mode: {k: round(v * 1e3, 1) for k, v in c.items()}
                                                           for mode, c in ops.items()}), flush=True)
    per_m = (measure_in_processes(args.microbatches, args.rounds, ops) if args.process_per_stage
             else [measure(m, args.rounds, ops) for m in args.microbatches])
    results, rows, verdicts = [], [], []
    for m, runs in zip(args.microbatches, per_m):
        results += runs
        for recompute in MODES:
            mine = [r for r in runs if r["recompute"] == recompute]
            base = next(r for r in mine if r["schedule"] == "1f1b")
            for r in mine:
                rows.append([r["schedule"], "recompute" if recompute else "keep", m, r["v"], r["ticks"],
                             f"{r['bubble']:.3f}", f"{r['predicted_units'] / base['predicted_units']:.3f}",
                             f"{r['predicted_from_op_costs_s'] / base['predicted_from_op_costs_s']:.3f}",
                             f"{r['predicted_from_op_costs_s'] * 1e3:.0f}",
                             f"{r['step_s'] * 1e3:.0f}", f"{r['step_s'] / base['step_s']:.3f}",
                             f"{r['step_s'] / r['predicted_from_op_costs_s']:.2f}",
                             f"{r['temp_bytes'] / 2**20:.1f}", f"{r['temp_bytes'] / base['temp_bytes']:.2f}",
                             f"{r['page_faults_per_step']:.0f}"])
            zb = next(r for r in mine if r["schedule"] == "zb-h1")
            predicted = 1 - zb["predicted_units"] / base["predicted_units"]
            from_ops = 1 - zb["predicted_from_op_costs_s"] / base["predicted_from_op_costs_s"]
            measured = 1 - zb["step_s"] / base["step_s"]
            memory = zb["temp_bytes"] / base["temp_bytes"]
            verdicts.append({"m": m, "recompute": recompute, "predicted_saving": predicted,
                             "predicted_saving_from_op_costs": from_ops, "measured_saving": measured,
                             "half_of_predicted_reached": measured >= predicted / 2,
                             "half_of_op_cost_predicted_reached": measured >= from_ops / 2, "memory_ratio": memory,
                             "memory_within_15pct": memory <= 1.15})
        print(rows[-len(runs):], flush=True)
    where = "2 processes, one device and one core each" if args.process_per_stage else "2 simulated devices"
    print(f"\nmodel {MODEL.layers}x{MODEL.hidden}, seq {MODEL.seq_len}, {ROWS} sequences per microbatch, mesh (1,2,1) on "
          f"{where}; median of {args.rounds} steps per schedule (rounds cycle the schedules); predicted from "
          f"the checker with t_F=1, t_B=2 (recompute + input gradient), t_W=1 (recompute) and unit costs (keep)")
    _common.print_table(["schedule", "mode", "m", "v", "ticks", "bubble", "predicted x 1F1B",
                         "op-cost predicted x 1F1B", "op-cost predicted ms", "step ms", "measured x 1F1B",
                         "measured / op-cost predicted", "temp MiB", "memory x 1F1B", "page faults / step"], rows)
    print("\nZB-H1 vs 1F1B (same mode)")
    _common.print_table(["m", "mode", "predicted saving", "op-cost predicted saving", "measured saving",
                         ">= half predicted", ">= half op-cost predicted", "memory x 1F1B", "<= 1.15"],
                        [[v["m"], "recompute" if v["recompute"] else "keep", f"{v['predicted_saving']:.1%}",
                          f"{v['predicted_saving_from_op_costs']:.1%}", f"{v['measured_saving']:.1%}", v["half_of_predicted_reached"],
                          v["half_of_op_cost_predicted_reached"], f"{v['memory_ratio']:.2f}",
                          v["memory_within_15pct"]] for v in verdicts])
    path = _common.write_results(name, {"model": MODEL.__dict__, "rows_per_microbatch": ROWS,
                                        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                                        "process_per_stage": args.process_per_stage,
                                                  "costs": {("recompute" if k else "keep"): c.__dict__
                                                            for k, c in RUNTIME_COSTS.items()},
                                                  "op_costs_s": ops,
                                                  "results": results, "verdicts": verdicts})
    plot(results, name)
    print(f"wrote {path}")


def plot(results: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["m"], not r["recompute"]) for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(SCHEDULES)
    for i, (schedule, _) in enumerate(SCHEDULES):
        found = [(j, next((r for r in results if r["schedule"] == schedule and (r["m"], not r["recompute"]) == g),
                          None)) for j, g in enumerate(groups)]
        mine = [r for _, r in found if r is not None]  # interleaved has no odd m
        xs = [j + i * width for j, r in found if r is not None]
        axes[0].bar(xs, [r["step_s"] * 1e3 for r in mine], width, label=schedule)
        axes[1].bar(xs, [r["temp_bytes"] / 2**20 for r in mine], width, label=schedule)
    for ax, label in zip(axes, ("median step time (ms)", "compiled temp memory (MiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                      [f"m={m}, {'keep' if keep else 'recompute'}" for m, keep in groups], fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(("pipe=2 as 2 processes, one device and one core each" if "processes" in name
                  else "pipe=2 on 2 simulated devices (one stage per core)")
                 + (", glibc keeping freed memory (--pooled-malloc)" if name.endswith("pooled") else ""))
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
