"""Pipeline schedules on the simulated CPU mesh: step time, bubble, work and memory.

For each schedule and (p, m, v): the train step of a small GPT on mesh (data=1, pipe=p,
tensor=1) next to the unpipelined step (pipe=1, one device) at the same global batch and
microbatches; the predicted bubble and in-flight activations from the schedule checker; and the
compiled step's temp memory.

Are idle slots skipped or computed-and-masked? The lockstep cost of a table (sum over ticks of
the busiest stage's work, t_b = 2 t_f) is the same for GPipe and 1F1B at equal (p, m) -- both are
(m + p - 1)(t_f + t_b) -- while their tick counts differ a lot. If idle slots were masked, every
tick would cost a full forward + backward and GPipe would take ticks_gpipe / ticks_1f1b times as
long as 1F1B; if they are skipped, the two take about the same time. The second table compares
the measured ratio with both predictions. (The simulated devices share two cores, so absolute
times mix work with whatever parallelism two cores give.)

Compile time (``--part compile``): the pipelined train step of the wide model (4 layers,
hidden 256, seq 128, vocabulary 1024, 8 sequences, m = 4) on mesh 2x2x2 for each schedule, next to
the unpipelined step of the same model, batch per data shard and microbatches on 2x1x2; median
of ``--repeats`` fresh lowerings and compilations, and the size of the optimized HLO.

    .venv/bin/python benchmarks/pipeline.py [--steps N] [--part all|schedules|compile] [--repeats R]

Where a bubble costs real time (one stage per core: exactly 2 simulated devices, a process-wide
setting this script's 8-device mesh cannot share), GPipe, 1F1B, 1F1B with p in flight, interleaved
and ZB-H1 are compared in one run, same (p, m), in both recomputation modes, by
``benchmarks/zero_bubble.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import jax
import numpy as np

from meshtron.config import MeshConfig, ModelConfig, TrainConfig
from meshtron.mesh import build_mesh
from meshtron.optim import build_optimizer, data_parallel_mean
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.schedules import check, compile_program, make_schedule
from meshtron.train.pipelined import to_stage_order
from meshtron.train.state import model_def_from_config
from meshtron.train.step import build_steps

MODEL = ModelConfig(hidden=128, heads=4, layers=8, mlp_dim=512, seq_len=64)
ROWS = 2  # sequences per microbatch


def step_time_and_memory(p: int, m: int, schedule: str | None, chunks: int, steps: int) -> tuple[float, int]:
    md = model_def_from_config(MODEL, 1)
    mesh = build_mesh(MeshConfig(1, p, 1), jax.devices()[:p])
    program = compile_program(make_schedule(schedule, p, m, chunks)) if p > 1 else None
    train = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()), microbatches=m,
                        pipeline=program and PipelinePlan(program))
    params = md.init(mesh, 0)
    if p > 1:
        params = jax.device_put(to_stage_order(jax.device_get(params), MODEL.layers, p, chunks), train.param_shardings)
    opt_state = train.init_opt_state(params)
    rng = np.random.default_rng(0)
    batch = jax.device_put(rng.integers(0, 256, (m * ROWS, MODEL.seq_len + 1), dtype=np.int32), train.batch_sharding)
    memory = train.lower(params, opt_state, batch).compile().memory_analysis().temp_size_in_bytes
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        params, opt_state, metrics = train.train(params, opt_state, batch)
        metrics.loss.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), memory


COMPILE_MODEL = ModelConfig(vocab_size=1024, hidden=256, heads=4, layers=4, mlp_dim=1024, seq_len=128)
COMPILE_LAYOUTS = [((2, 1, 2), None, 1), ((2, 2, 2), "gpipe", 1), ((2, 2, 2), "1f1b", 1),
                   ((2, 2, 2), "interleaved", 2)]


def compile_seconds(mesh_shape: tuple[int, int, int], schedule: str | None, chunks: int, m: int = 4,
                    batch: int = 8) -> tuple[float, float, int]:
    """(lowering s, XLA compile s, instructions in the optimized HLO) of one fresh train step."""
    jax.clear_caches()
    md = model_def_from_config(COMPILE_MODEL, mesh_shape[2])
    mesh = build_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
    p = mesh_shape[1]
    program = compile_program(make_schedule(schedule, p, m, chunks)) if p > 1 else None
    train = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()), microbatches=m,
                        pipeline=program and PipelinePlan(program))
    params = md.init(mesh, 0)
    if p > 1:
        params = jax.device_put(to_stage_order(jax.device_get(params), COMPILE_MODEL.layers, p, chunks),
                                train.param_shardings)
    opt_state = train.init_opt_state(params)
    tokens = jax.device_put(np.zeros((batch, COMPILE_MODEL.seq_len + 1), np.int32), train.batch_sharding)
    start = time.perf_counter()
    lowered = train.lower(params, opt_state, tokens)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    instructions = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    return lowered_at - start, done - lowered_at, instructions


def compile_table(repeats: int) -> tuple[list[list], list[dict]]:
    rows, results = [], []
    base = None
    for mesh_shape, schedule, chunks in COMPILE_LAYOUTS:
        runs = [compile_seconds(mesh_shape, schedule, chunks) for _ in range(repeats)]
        lower = statistics.median(r[0] for r in runs)
        comp = statistics.median(r[1] for r in runs)
        total = lower + comp
        base = base or total
        label = schedule or "none (pipe=1)"
        results.append({"mesh": list(mesh_shape), "schedule": schedule, "chunks": chunks, "lower_s": lower,
                        "compile_s": comp, "total_s": total, "ratio_to_unpipelined": total / base,
                        "hlo_instructions": runs[0][2]})
        rows.append([label, "x".join(map(str, mesh_shape)), f"{lower:.1f}", f"{comp:.1f}", f"{total:.1f}",
                     f"{total / base:.2f}", runs[0][2]])
        print(rows[-1], flush=True)
    return rows, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--part", choices=("all", "schedules", "compile"), default="all")
    parser.add_argument("--repeats", type=int, default=3, help="compilations per layout (median)")
    args = parser.parse_args()
    if args.part in ("all", "compile"):
        rows, compile_results = compile_table(args.repeats)
        print(f"\ncompile time of the train step, model {COMPILE_MODEL.layers}x{COMPILE_MODEL.hidden}, "
              f"seq {COMPILE_MODEL.seq_len}, vocab {COMPILE_MODEL.vocab_size}, m=4; median of {args.repeats}")
        _common.print_table(["schedule", "mesh", "lower s", "compile s", "total s", "x unpipelined",
                             "HLO instructions"], rows)
        path = _common.write_results("pipeline_compile", {"model": COMPILE_MODEL.__dict__, "microbatches": 4,
                                                          "repeats": args.repeats, "results": compile_results})
        plot_compile(compile_results)
        print(f"wrote {path}")
    if args.part == "compile":
        return
    rows, results = [], []
    for p in (2, 4):
        for m in (p, 2 * p, 4 * p):
            base_time, base_mem = step_time_and_memory(1, m, None, 1, args.steps)
            for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
                stats = check(make_schedule(schedule, p, m, chunks))
                t, mem = step_time_and_memory(p, m, schedule, chunks, args.steps)
                ratio = t / base_time
                result = {
                    "schedule": schedule, "p": p, "m": m, "v": chunks, "ticks": stats.ticks,
                    "bubble": stats.bubble_fraction, "peak_in_flight_stage0": stats.peak_in_flight[0],
                    "step_s": t, "pipe1_step_s": base_time, "time_ratio": ratio,
                    "temp_bytes": mem, "pipe1_temp_bytes": base_mem,
                }
                results.append(result)
                rows.append([schedule, p, m, chunks, stats.ticks, f"{stats.bubble_fraction:.3f}",
                             stats.peak_in_flight[0], f"{t * 1e3:.0f}", f"{ratio:.2f}",
                             f"{mem / 2**20:.2f}"])
                print(rows[-1], flush=True)
    print(f"\nmodel {MODEL.layers}x{MODEL.hidden}, seq {MODEL.seq_len}, {ROWS} sequences per microbatch, "
          f"median of {args.steps} steps; time ratio = pipelined / pipe=1 step time at the same global batch")
    _common.print_table(
        ["schedule", "p", "m", "v", "ticks", "bubble", "in-flight s0", "step ms", "time ratio", "temp MiB"],
        rows)
    skip_rows = idle_slot_evidence(results)
    print("\nidle slots: GPipe / 1F1B step time at the same (p, m)")
    _common.print_table(["p", "m", "measured", "if masked (tick ratio)", "if skipped"], skip_rows)
    path = _common.write_results("pipeline", {"model": MODEL.__dict__, "rows_per_microbatch": ROWS,
                                               "results": results, "idle_slots": skip_rows})
    plot(results)
    print(f"wrote {path}")


def idle_slot_evidence(results: list[dict]) -> list[list]:
    """Measured GPipe/1F1B time ratio next to the masked (tick ratio) and skipped (1.0) predictions."""
    out = []
    for g in (r for r in results if r["schedule"] == "gpipe"):
        f = next(r for r in results if r["schedule"] == "1f1b" and r["p"] == g["p"] and r["m"] == g["m"])
        out.append([g["p"], g["m"], f"{g['step_s'] / f['step_s']:.2f}", f"{g['ticks'] / f['ticks']:.2f}", "1.00"])
    return out


def plot_compile(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["schedule"] or "pipe=1" for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [r["lower_s"] for r in results], label="lowering (trace + StableHLO)")
    ax.bar(labels, [r["compile_s"] for r in results], bottom=[r["lower_s"] for r in results], label="XLA compile")
    ax.axhline(2 * results[0]["total_s"], color="k", linestyle="--", linewidth=1, label="2x unpipelined")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "pipeline_compile.png", dpi=120)


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s"), ("interleaved", "^")):
        for p, style in ((2, "-"), (4, "--")):
            sel = [r for r in results if r["schedule"] == schedule and r["p"] == p]
            ms = [r["m"] for r in sel]
            axes[0].plot(ms, [r["time_ratio"] for r in sel], style, marker=marker, label=f"{schedule} p={p}")
            axes[1].plot(ms, [r["temp_bytes"] / 2**20 for r in sel], style, marker=marker, label=f"{schedule} p={p}")
    axes[0].set_ylabel("step time / pipe=1 step time")
    axes[1].set_ylabel("compiled temp memory (MiB)")
    for ax in axes:
        ax.set_xlabel("microbatches m")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "pipeline.png", dpi=120)


if __name__ == "__main__":
    main()
