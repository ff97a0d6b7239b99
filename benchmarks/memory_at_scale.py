"""Per-device memory of real Llama models on their target meshes, compiled here without the hardware.

For Llama-2 7B and 70B (their real dimensions, 4096-token sequences, bf16 compute with fp32
parameters, AdamW), compiles the real train step from abstract arrays on up to 64 simulated devices
-- nothing is allocated -- across ``parallel.zero`` 0/1/3, recomputation, sequence parallelism and
pipeline schedules (and Llama-2 13B, Llama-3 8B and the paper's GPT 3.6B as bundled), and prints
per device: what the compiled program's arguments hold (parameters, optimizer state, read from the
shardings it takes), its temporaries and the peak of the two, next to the step memory model
(:mod:`meshtron.plan.step_memory`, as ``describe`` prints it) on XLA:CPU -- the error is against
this -- and on a GPU, and to the bytes-per-parameter arithmetic (16 bytes per parameter of fp32
AdamW training -- weights, gradients, two moments -- divided as the mesh and the zero level split
them).

    .venv/bin/python benchmarks/memory_at_scale.py          # about 5 minutes on 2 cores

It first prints the state a step keeps per parameter per device for AdamW, LAMB and 1-bit LAMB at
each zero level (the default model on 8 data ranks, from the compiled program).

The temporaries are XLA:CPU's buffer assignment: attention through ``model.attention=xla``
materialises the ``[batch, heads, seq, seq]`` scores (a GPU run would use cuDNN's fused attention),
and bf16 buffers the CPU cannot compute on are also held converted to f32.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"

import time

import _common
import jax
import numpy as np

from meshtron.config import load_config
from meshtron.describe import bytes_per_device, modelled_step_memory, parameter_rows
from meshtron.hlo.collectives import collectives
from meshtron.train.loop import Trainer

GB = 1e9
GPU_GB = 80

# (name, config, mesh (data, pipe, tensor), extra overrides)
CASES = [
    *[("7B", "llama2_7b", (8, 1, 8), [f"parallel.zero={z}", "parallel.sequence_parallel=true"]) for z in (0, 1, 3)],
    ("7B", "llama2_7b", (8, 1, 8), ["parallel.zero=1", "parallel.sequence_parallel=true", "model.remat=selective"]),
    ("7B", "llama2_7b", (8, 1, 8), ["parallel.zero=1"]),
    *[("7B", "llama2_7b", (2, 4, 8), [f"parallel.zero={z}", "parallel.sequence_parallel=true", "parallel.microbatches=64"])
      for z in (0, 1, 3)],
    *[("7B", "llama2_7b", (8, 4, 2), [f"parallel.zero={z}"]) for z in (0, 1, 3)],
    *[("70B", "llama2_70b", (2, 4, 8), [f"parallel.zero={z}", "parallel.gather_once=false"]) for z in (0, 1)],
    ("70B", "llama2_70b", (2, 4, 8), ["parallel.zero=3", "parallel.gather_once=false", "parallel.microbatches=16"]),
    ("70B", "llama2_70b", (2, 4, 8), ["parallel.zero=3", "parallel.gather_once=true"]),
    *[("7B", "llama2_7b", (8, 4, 2), ["parallel.zero=1", f"parallel.schedule={schedule}", f"parallel.chunks={chunks}"])
      for schedule, chunks in (("gpipe", 1), ("interleaved", 2), ("zb-h1", 1))],
    ("13B", "llama2_13b", (8, 4, 2), []),
    ("L3 8B", "llama3_8b", (8, 1, 1), []),
    ("GPT 3.6B", "paper/gpt_3_6b", (8, 1, 8), []),
]


def arithmetic(params: int, sizes: tuple[int, int, int], zero: int) -> float:
    """16 bytes per parameter (fp32 weights 4, gradients 4, AdamW moments 8), split over pipe x tensor
    and, by the zero level, over data."""
    d, p, t = sizes
    weights = grads = 4 / (d if zero == 3 else 1)
    moments = 8 / (d if zero >= 1 else 1)
    return params * (weights + grads + moments) / (p * t)


def compiled_step(config: str, sizes: tuple[int, int, int], extra: list[str]):
    """``(trainer, compiled train step, abstract params, abstract optimizer state, seconds to build and
    compile)`` of ``config`` on the mesh ``sizes`` (data, pipe, tensor) of simulated devices."""
    d, p, t = sizes
    cfg = load_config(config, [f"parallel.data={d}", f"parallel.pipe={p}", f"parallel.tensor={t}", *extra])
    started = time.perf_counter()
    trainer = Trainer.from_config(cfg, jax.devices()[: d * p * t], read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    program = trainer.steps.compile(params, opt_state, tokens)
    return trainer, program, params, opt_state, time.perf_counter() - started


def measure(name: str, config: str, sizes: tuple[int, int, int], extra: list[str]) -> dict:
    p = sizes[1]
    trainer, program, params, opt_state, seconds = compiled_step(config, sizes, extra)
    param_in, opt_in = program.input_shardings[0][:2]
    memory = program.memory_analysis()
    data_bytes = sum(c.total_wire_bytes for c in collectives(program, trainer.mesh) if "data" in c.axes)
    rows = parameter_rows(trainer.model_def, dict(trainer.mesh.shape))
    model = {backend: modelled_step_memory(trainer.resolved, rows, backend) for backend in ("cpu", "gpu")}
    count = trainer.model_def.parameter_count()
    c = trainer.cfg
    return {
        "model": name, "config": config, "mesh": list(sizes), "zero": c.train.zero,
        "gather_once": c.train.gather_once, "remat": c.model.remat,
        "schedule": (c.pipeline.schedule + (f" v={c.pipeline.chunks}" if c.pipeline.chunks > 1 else "")) if p > 1 else "-", "sequence_parallel": c.model.sequence_parallel,
        "microbatches": c.train.microbatches, "parameters": count, "compile_seconds": round(seconds, 1),
        "compiled": {"parameters": bytes_per_device(params, param_in), "optimizer": bytes_per_device(opt_state, opt_in),
                     "temporaries": float(memory.temp_size_in_bytes),
                     "peak": float(memory.argument_size_in_bytes + memory.temp_size_in_bytes)},
        "data_wire_bytes": data_bytes,
        "step_model": {backend: {**mem.terms(), "temporaries": mem.temporaries, "peak": mem.peak}
                  for backend, mem in model.items()},
        "arithmetic_16_bytes": arithmetic(count, sizes, c.train.zero),
    }


def bytes_per_parameter() -> list[dict]:
    """Bytes per parameter per device of the state a step keeps (parameters + optimizer state, read from
    the compiled program's input shardings) for each optimizer and zero level, on 8 data ranks (the
    default model at fp32; 1-bit LAMB's state cannot be split: parallel.zero=0 only)."""
    table = []
    for optimizer in ("adamw", "lamb", "onebit_lamb"):
        for zero in (0, 1, 3):
            if optimizer == "onebit_lamb" and zero:
                table.append({"optimizer": optimizer, "zero": zero, "bytes_per_parameter": None})
                continue
            cfg = load_config("cpu8", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.chunks=1",
                                       "parallel.schedule=1f1b", f"train.optimizer={optimizer}", f"parallel.zero={zero}"])
            trainer = Trainer.from_config(cfg, jax.devices()[:8], read_data=False)
            params, opt_state, tokens = trainer.abstract_step_arguments()
            stage = trainer.steps.stages[-1]  # 1-bit LAMB: the compression stage's state
            program = trainer.steps.compile(params, opt_state, tokens, stage)
            param_in, opt_in = program.input_shardings[0][:2]
            count = trainer.model_def.parameter_count()
            table.append({"optimizer": optimizer, "zero": zero, "parameters": count,
                          "bytes_per_parameter": (bytes_per_device(params, param_in) + bytes_per_device(opt_state, opt_in)) / count,
                          "weights": bytes_per_device(params, param_in) / count,
                          "optimizer_state": bytes_per_device(opt_state, opt_in) / count})
    return table


def main() -> None:
    per_param = bytes_per_parameter()
    print("state a step keeps, bytes per parameter per device (data=8, fp32; compiled input shardings)")
    _common.print_table(["optimizer", "zero", "weights", "optimizer state", "total"], [
        [r["optimizer"], r["zero"], *(["cannot be split"] * 3 if r["bytes_per_parameter"] is None else
                                      [f"{r['weights']:.2f}", f"{r['optimizer_state']:.2f}",
                                       f"{r['bytes_per_parameter']:.2f}"])] for r in per_param])
    results = []
    for case in CASES:
        results.append(measure(*case))
        r = results[-1]
        print(f"  compiled {r['model']} {r['mesh']} zero={r['zero']} in {r['compile_seconds']} s", flush=True)
    rows = []
    for r in results:
        c = r["compiled"]
        label = f"zero={r['zero']}" + (" once" if r["gather_once"] else "")
        rows.append([r["model"], "x".join(map(str, r["mesh"])), r["schedule"], label, r["remat"], "sp" if r["sequence_parallel"] else "-",
                     r["microbatches"], f"{c['parameters'] / GB:.2f}", f"{c['optimizer'] / GB:.2f}",
                     f"{c['temporaries'] / GB:.1f}", f"{c['peak'] / GB:.1f}", f"{r['step_model']['cpu']['peak'] / GB:.1f}",
                     f"{100 * (r['step_model']['cpu']['peak'] / c['peak'] - 1):+.1f}%", f"{r['step_model']['gpu']['peak'] / GB:.1f}",
                     f"{r['arithmetic_16_bytes'] / GB:.1f}", f"{r['data_wire_bytes'] / GB:.1f}",
                     "yes" if c["peak"] <= GPU_GB * GB else "no", r["compile_seconds"]])
    print("bf16 compute, fp32 parameters, AdamW; GB per device (1e9 bytes); error: model (CPU) against the compiled peak")
    _common.print_table(["model", "mesh d x p x t", "schedule", "zero", "remat", "SP", "m", "params", "opt state", "temp",
                         "peak", "model (CPU)", "error", "model (GPU)", "16 B/param", "data GB/step",
                         f"peak <= {GPU_GB} GB", "compile s"], rows)
    path = _common.write_results("memory_at_scale", {"bytes_per_parameter": per_param, "results": results})
    plot(results)
    print(f"wrote {path}")


def memory_bars(ax, results: list[dict]) -> np.ndarray:
    """Each result's compiled parameters, optimizer state and temporaries stacked as bars on ``ax``
    (GB per device); returns the bars' positions."""
    x = np.arange(len(results))
    bottom = np.zeros(len(results))
    for key, label in (("parameters", "parameters"), ("optimizer", "optimizer state"),
                       ("temporaries", "temporaries (XLA:CPU)")):
        heights = np.array([r["compiled"][key] for r in results]) / GB
        ax.bar(x, heights, bottom=bottom, label=label)
        bottom = bottom + heights
    return x


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 5.5))
    x = memory_bars(ax, results)
    ax.scatter(x, [r["step_model"]["cpu"]["peak"] / GB for r in results], color="k", marker="_", s=300,
               label="step memory model, XLA:CPU", zorder=3)
    ax.scatter(x, [r["step_model"]["gpu"]["peak"] / GB for r in results], color="C3", marker="x", s=30,
               label="step memory model, GPU", zorder=3)
    ax.axhline(GPU_GB, color="r", linestyle="--", label=f"{GPU_GB} GB GPU")
    labels = [f"{r['model']} {'x'.join(map(str, r['mesh']))} {r['schedule'] if r['schedule'] != '-' else ''}\n"
              f"z{r['zero']}{' once' if r['gather_once'] else ''} {r['remat'][:3]}{' sp' if r['sequence_parallel'] else ''}"
              for r in results]
    ax.set_xticks(x, labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel("GB per device")
    ax.set_title("compiled train step, memory per device (64 simulated devices, nothing allocated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "memory_at_scale.png", dpi=120)


if __name__ == "__main__":
    main()
