"""The planner's performance model on this machine: measured per-operation costs in, meshtron's step time out.

``meshtron.plan`` prices a layout from a cluster's rates (GEMM efficiency by size, memory bandwidth,
collective bandwidth and latency). Here the same model is fed the rates of the simulated 8-device
CPU mesh, measured by :func:`meshtron.plan.calibration.measure` (dense-layer GEMMs by smallest
dimension, element-wise kernels, first-touch page zeroing, all-reduce and ``ppermute`` between
compute, every device at once and one device alone), and predicts the step time of six meshtron
runs -- data, tensor and pipeline parallel, GPipe, 1F1B and interleaved 1F1B -- which are then
trained with meshtron's :class:`~meshtron.train.loop.Trainer` and timed: all six compiled first,
then a few steps of each in turn, for a few rounds (the machine is shared, so its speed drifts;
round-robin makes the drift hit every run alike), median of all timed steps.

Nothing is fitted to the runs (no per-run factor, no global constant): the prediction uses the
micro-measurements, the plan's counts, the schedule tables' ticks and the compiled program's temp
size (what XLA allocates per step; see the calibration module's docstring for why it costs time).
The last column prices that allocation from meshtron's own activation count instead, for a
prediction that needs no compiled program.

    .venv/bin/python benchmarks/plan_calibration.py [--steps N] [--rounds R] [--repeats R] [--only NAME ...]

Writes ``benchmarks/results/plan_calibration.{json,png}``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import jax
from calibration import TERMS, CpuMesh, calibrate, cluster_to_dict, measure, predict

from meshtron.config import load_config
from meshtron.train.loop import Trainer

MODEL = {"hidden": 128, "heads": 8, "layers": 8, "mlp_dim": 512, "seq_len": 128, "vocab_size": 256}
BATCH = 32
# name, (data, pipe, tensor), schedule, chunks, microbatches
RUNS = [
    ("data", (8, 1, 1), None, 1, 1),
    ("tensor", (1, 1, 8), None, 1, 1),
    ("ptd-1f1b", (2, 2, 2), "1f1b", 1, 4),
    ("gpipe", (1, 4, 2), "gpipe", 1, 8),
    ("interleaved", (1, 2, 4), "interleaved", 2, 4),
    ("pipe-1f1b", (1, 8, 1), "1f1b", 1, 8),
]


def config_of(mesh: tuple[int, int, int], schedule: str | None, chunks: int, microbatches: int):
    d, p, t = mesh
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"parallel.data={d}", f"parallel.pipe={p}", f"parallel.tensor={t}", f"train.batch_size={BATCH}",
        f"parallel.microbatches={microbatches}", f"parallel.chunks={chunks}", "train.steps=100",
    ]
    if schedule is not None:
        overrides.append(f"parallel.schedule={schedule}")
    return load_config(None, overrides)


class Run:
    """One configuration, compiled and warmed up, timed a few steps at a time."""

    def __init__(self, cfg) -> None:
        self.trainer = trainer = Trainer.from_config(cfg)
        self.params = trainer.init_params()
        self.opt_state = trainer.steps.init_opt_state(self.params)
        self.stream = trainer.train_stream()
        self.batch = self.stream.next(trainer.steps.batch_sharding)
        start = time.perf_counter()
        compiled = trainer.steps.compile(self.params, self.opt_state, self.batch)
        self.compile_s = time.perf_counter() - start
        self.temp_bytes = float(compiled.memory_analysis().temp_size_in_bytes)
        self.times: list[float] = []
        self.steps(1)  # the first execution (allocations, caches) is not timed
        self.times.clear()

    def steps(self, count: int) -> None:
        steps = self.trainer.steps
        for _ in range(count):
            start = time.perf_counter()
            self.params, self.opt_state, metrics = steps.train(self.params, self.opt_state, self.batch)
            metrics.loss.block_until_ready()
            self.times.append(time.perf_counter() - start)
            self.batch = self.stream.next(steps.batch_sharding)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the runs (median of steps x rounds)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each micro-measurement (median)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these configurations")
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"measuring per-operation costs on {len(jax.devices())} devices ...", flush=True)
    measured = measure(repeats=args.repeats, log=lambda line: print("  " + line, flush=True))
    machine = calibrate(measured)
    c = machine.cluster
    print(f"calibrated in {measured.seconds:.0f} s: per device (of {machine.devices} sharing {machine.cores} cores) "
          f"peak {c.peak_tflops * 1e3:.1f} GFLOP/s, gemm efficiency "
          + ", ".join(f"{x}: {e:.2f}" for x, e in c.gemm_efficiency)
          + f"; element-wise {c.hbm_gbps:.2f} GB/s; all-reduce {c.nvlink_gbps:.2f} GB/s + {c.nvlink_latency_us:.0f} us"
          f"/step; ppermute {machine.p2p_gbps:.2f} GB/s + {machine.p2p_latency_us:.0f} us; first touch "
          f"{machine.first_touch_gbps:.2f} GB/s; alone x{machine.gemm_alone:.1f} (GEMM), "
          f"x{machine.elementwise_alone:.1f} (element-wise)", flush=True)
    chosen = [r for r in RUNS if not args.only or r[0] in args.only]
    runs = {}
    for name, mesh, schedule, chunks, m in chosen:
        runs[name] = Run(config_of(mesh, schedule, chunks, m))
        print(f"  compiled {name} in {runs[name].compile_s:.1f} s", flush=True)
    for _ in range(args.rounds):  # round-robin, so that a change of machine load hits every run alike
        for run in runs.values():
            run.steps(args.steps)
    rows, results = [], []
    for name, mesh, schedule, chunks, m in chosen:
        cfg = config_of(mesh, schedule, chunks, m)
        times, compile_s, temp = runs[name].times, runs[name].compile_s, runs[name].temp_bytes
        measured_s = statistics.median(times)
        predicted = predict(cfg, machine, temp_bytes=temp)
        from_plan = predict(cfg, machine)  # allocation from meshtron's activation count, no compiled program
        ratio = predicted.step_seconds / measured_s
        label = schedule if chunks == 1 or schedule is None else f"{schedule} v={chunks}"
        results.append({
            "name": name, "mesh": list(mesh), "schedule": schedule, "chunks": chunks, "microbatches": m,
            "microbatch_size": predicted.layout.microbatch, "recompute": predicted.layout.recompute,
            "ticks": predicted.ticks, "sends": predicted.sends, "temp_bytes": temp,
            "predicted_s": predicted.step_seconds, "measured_s": measured_s, "ratio": ratio,
            "terms_s": predicted.seconds, "step_times_s": times, "compile_s": compile_s,
            "predicted_s_counted_temp": from_plan.step_seconds, "counted_temp_bytes": from_plan.temp_bytes,
        })
        rows.append([name, "x".join(map(str, mesh)), label or "none", m, predicted.ticks,
                     f"{predicted.step_seconds:.3f}", f"{measured_s:.3f}", f"{ratio:.2f}",
                     f"{from_plan.step_seconds / measured_s:.2f}"])
        print(f"  {name}: predicted {predicted.step_seconds:.3f} s, measured {measured_s:.3f} s, ratio {ratio:.2f} ("
              + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in predicted.seconds.items() if v) + " ms)", flush=True)
    total = time.perf_counter() - began
    print(f"\nmodel {MODEL['layers']}x{MODEL['hidden']}, {MODEL['heads']} heads, seq {MODEL['seq_len']}, vocabulary "
          f"{MODEL['vocab_size']}, batch {BATCH}; median of {args.rounds} x {args.steps} steps after compilation and "
          "one warm-up step; ratio = predicted / measured")
    _common.print_table(["config", "mesh dxpxt", "schedule", "m", "ticks", "predicted s/step", "measured s/step",
                         "ratio", "ratio (counted temp)"], rows)
    print("ratio (counted temp): the allocation term from meshtron's count of the activations "
          "(calibration.kept_bytes) instead of the compiled program's temp size")
    print(f"benchmark wall time {total:.0f} s")
    path = _common.write_results("plan_calibration", {
        "model": MODEL, "batch": BATCH, "steps": args.steps, "rounds": args.rounds, "measurements": measured.to_dict(),
        "machine": machine.to_dict(), "cluster": cluster_to_dict(c), "runs": results, "wall_time_s": total,
    })
    plot(results, machine)
    print(f"wrote {path}")


def plot(results: list[dict], machine: CpuMesh) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    names = [r["name"] for r in results]
    ratios = [r["ratio"] for r in results]
    ax.axhspan(0.75, 1.25, color="0.9", label="within 25%")
    ax.axhline(1.0, color="k", linewidth=1)
    ax.bar(range(len(results)), ratios, 0.6)
    for i, ratio in enumerate(ratios):
        ax.text(i, ratio + 0.02, f"{ratio:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), names, fontsize=8, rotation=20)
    ax.set_ylim(0, 1.5)
    ax.set_ylabel("predicted / measured step time")
    ax.legend(fontsize=8, loc="lower right")
    names = [r["name"] for r in results]
    x = np.arange(len(results))
    bottom = np.zeros(len(results))
    for term in TERMS:
        values = np.array([r["terms_s"][term] for r in results])
        if values.any():
            bx.bar(x - 0.2, values, 0.38, bottom=bottom, label=term)
            bottom += values
    bx.bar(x + 0.2, [r["measured_s"] for r in results], 0.38, color="k", label="measured")
    bx.set_xticks(x, names, fontsize=8)
    bx.set_ylabel("s/step")
    bx.set_title(f"predicted terms (left) vs measured (right); {machine.devices} devices on {machine.cores} cores",
                 fontsize=9)
    bx.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "plan_calibration.png", dpi=120)


if __name__ == "__main__":
    main()

