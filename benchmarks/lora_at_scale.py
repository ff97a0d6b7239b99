"""LoRA on real model sizes, compiled here without the hardware: per-device memory, compute and data
traffic of full fine-tuning against LoRA at every ZeRO level.

For Llama-2 7B (8 x 1 x 8, sequence parallelism) and 70B (2 x 4 x 8, 1F1B), at their real dimensions
(4096-token sequences, bf16 compute, fp32 parameters, AdamW), compiles the train step from abstract
arrays on 64 simulated devices -- nothing is allocated -- for full fine-tuning and for LoRA of rank
16 on every block matrix, and prints per device: parameters and optimizer state (read from the
shardings the compiled program takes), temporaries, the peak, the step memory model's estimate
(``meshtron describe``), the step's FLOPs (XLA's cost analysis) and the bytes it sends over ``data``.

    .venv/bin/python benchmarks/lora_at_scale.py          # about 3 minutes on 2 cores

Writes ``results/lora_at_scale.{json,png}``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"

import _common
import jax
import numpy as np
from memory_at_scale import compiled_step, memory_bars

from meshtron.describe import bytes_per_device, modelled_step_memory, parameter_rows
from meshtron.hlo.collectives import collectives

GB = 1e9
LORA = ["train.lora.rank=16", "train.lora.alpha=32"]
SP = ["parallel.sequence_parallel=true"]
# (model, config, mesh (data, pipe, tensor), fine-tuning, overrides)
CASES = [
    ("7B", "llama2_7b", (8, 1, 8), "full", [*SP, "parallel.zero=1"]),
    *[("7B", "llama2_7b", (8, 1, 8), "LoRA r=16", [*SP, *LORA, f"parallel.zero={z}"]) for z in (0, 1, 3)],
    ("7B", "llama2_7b", (8, 1, 8), "LoRA r=16", [*SP, *LORA, "parallel.zero=3", "parallel.gather_once=true"]),
    ("70B", "llama2_70b", (2, 4, 8), "full", [*SP, "parallel.zero=1", "parallel.gather_once=false"]),
    ("70B", "llama2_70b", (2, 4, 8), "LoRA r=16", [*SP, *LORA, "parallel.zero=0", "parallel.gather_once=false"]),
    ("70B", "llama2_70b", (2, 4, 8), "LoRA r=16", [*SP, *LORA, "parallel.zero=3", "parallel.gather_once=true"]),
]


def measure(name: str, config: str, sizes: tuple[int, int, int], tuning: str, extra: list[str]) -> dict:
    trainer, program, params, opt_state, seconds = compiled_step(config, sizes, extra)
    param_in, opt_in = program.input_shardings[0][:2]
    memory = program.memory_analysis()
    model = modelled_step_memory(trainer.resolved, parameter_rows(trainer.model_def, dict(trainer.mesh.shape)), "cpu")
    flags = trainer.steps.trainable.mask
    counts = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    trainable = sum(c for c, keep in zip(counts, jax.tree.leaves(flags), strict=True) if keep) if flags else sum(counts)
    result = {
        "model": name, "config": config, "mesh": list(sizes), "tuning": tuning, "zero": trainer.cfg.train.zero,
        "gather_once": trainer.cfg.train.gather_once,
        "microbatches": trainer.cfg.train.microbatches, "parameters": sum(counts), "trainable": trainable,
        "compile_seconds": round(seconds, 1),
        "compiled": {"parameters": bytes_per_device(params, param_in), "optimizer": bytes_per_device(opt_state, opt_in),
                     "temporaries": float(memory.temp_size_in_bytes),
                     "peak": float(memory.argument_size_in_bytes + memory.temp_size_in_bytes)},
        "step_model_peak_cpu": model.peak,
        "flops_per_device": float(program.cost_analysis()["flops"]),
        "data_wire_bytes": sum(c.total_wire_bytes for c in collectives(program, trainer.mesh) if "data" in c.axes),
    }
    print(f"  compiled {name} {tuning} zero={result['zero']} in {seconds:.1f} s", flush=True)
    return result


def main() -> None:
    results = [measure(*case) for case in CASES]
    rows = []
    for r in results:
        c = r["compiled"]
        full = next(f for f in results if f["model"] == r["model"] and f["tuning"] == "full")
        rows.append([r["model"], "x".join(map(str, r["mesh"])), r["tuning"],
                     f"{r['zero']}{', once' if r['gather_once'] else ''}",
                     f"{r['trainable'] / 1e6:,.1f} M ({100 * r['trainable'] / r['parameters']:.2f}%)",
                     f"{c['parameters'] / GB:.2f}", f"{c['optimizer'] / GB:.3f}", f"{c['temporaries'] / GB:.1f}",
                     f"{c['peak'] / GB:.1f}", f"{r['step_model_peak_cpu'] / GB:.1f}",
                     f"{100 * (r['step_model_peak_cpu'] / c['peak'] - 1):+.1f}%",
                     f"{r['flops_per_device'] / 1e12:.1f}", f"{r['flops_per_device'] / full['flops_per_device']:.2f}",
                     f"{r['data_wire_bytes'] / GB:.2f}"])
    print("bf16 compute, fp32 parameters, AdamW; GB (1e9 bytes) per device; model: the step memory model (XLA:CPU)")
    _common.print_table(["model", "mesh d x p x t", "fine-tuning", "zero", "trainable", "params", "opt state", "temp",
                         "peak", "model", "error", "TFLOP/step", "x full", "data GB/step"], rows)
    path = _common.write_results("lora_at_scale", {"results": results})
    plot(results)
    print(f"wrote {path}")


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, flops) = plt.subplots(1, 2, figsize=(13, 4.8))
    x = memory_bars(mem, results)
    labels = [f"{r['model']} {r['tuning']}\nzero={r['zero']}{' once' if r['gather_once'] else ''}" for r in results]
    mem.scatter(x, [r["step_model_peak_cpu"] / GB for r in results], color="k", marker="_", s=300,
                label="step memory model", zorder=3)
    mem.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    mem.set_ylabel("GB per device")
    mem.set_title("compiled train step, memory per device")
    mem.legend(fontsize=8)
    flops.bar(x, [r["flops_per_device"] / 1e12 for r in results], color="C4")
    flops.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    flops.set_ylabel("TFLOP per device per step (XLA cost analysis)")
    flops.set_title("compute of the step")
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "lora_at_scale.png", dpi=120)


if __name__ == "__main__":
    main()
