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

    .venv/bin/python benchmarks/memory_at_scale.py --compilers cpu        # about 5 minutes on 2 cores
    .venv-py312/bin/python benchmarks/memory_at_scale.py --compilers h100  # XLA:GPU: 2-6 minutes a case

``--compilers h100`` also compiles each case for as many compile-only H100s as its mesh needs (JAX's
CUDA plugin, the ``gpu-compile`` extra; no GPU) and holds the ``gpu`` model to XLA:GPU's peak; a run
without one compiler keeps that compiler's numbers from the results file it rewrites. ``--attention
xla,cudnn`` runs each case per attention (cuDNN on GPUs only), ``--cases`` a subset, ``--dump=DIR``
writes XLA's buffer assignment of every program.

It first prints the state a step keeps per parameter per device for AdamW, LAMB and 1-bit LAMB at
each zero level (the default model on 8 data ranks, from the compiled program).

The temporaries are XLA:CPU's buffer assignment: attention through ``model.attention=xla``
materialises the ``[batch, heads, seq, seq]`` scores (a GPU run would use cuDNN's fused attention),
and bf16 buffers the CPU cannot compute on are also held converted to f32.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
DUMP = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--dump=")), None)
if DUMP:  # XLA's buffer assignment of every compiled program (*buffer-assignment.txt), read before JAX starts
    os.environ["XLA_FLAGS"] += f" --xla_dump_to={DUMP}"

from meshtron.gpu.targets import prepare_environment

prepare_environment()  # the CUDA plugin loads without CUDA (compile-only H100s)

import json
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
COMPILERS = ("cpu", "h100")  # XLA:CPU on simulated devices; XLA:GPU for compile-only H100s
ATTENTIONS = ("xla", "cudnn")  # cudnn: GPU compiles only (the CPU has no fused attention)

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


def case_config(config: str, sizes: tuple[int, int, int], extra: list[str], attention: str):
    d, p, t = sizes
    return load_config(config, [f"parallel.data={d}", f"parallel.pipe={p}", f"parallel.tensor={t}", *extra,
                                f"model.attention={attention}"])


def compiled_step(config: str, sizes: tuple[int, int, int], extra: list[str], compiler: str, attention: str):
    """``(trainer, compiled train step, abstract params, abstract optimizer state, seconds to build and
    compile)`` of ``config`` on the mesh ``sizes`` (data, pipe, tensor): simulated CPU devices
    (``compiler="cpu"``) or compile-only GPUs of that target (``"h100"``)."""
    d, p, t = sizes
    cfg = case_config(config, sizes, extra, attention)
    started = time.perf_counter()
    if compiler == "cpu":
        trainer = Trainer.from_config(cfg, jax.devices("cpu")[: d * p * t], read_data=False)
    else:
        trainer = Trainer.from_config(cfg, target=compiler, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    program = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    return trainer, program, params, opt_state, time.perf_counter() - started


def compiled_memory(program, params, opt_state, seconds: float) -> dict:
    """A compiled step's bytes per device: its arguments (parameters, optimizer state, from the shardings
    it takes), XLA's argument/output/alias/temporary sizes, and the peak (arguments + temporaries: the
    outputs are the donated arguments)."""
    param_in, opt_in = program.input_shardings[0][:2]
    memory = program.memory_analysis()
    return {"parameters": bytes_per_device(params, param_in), "optimizer": bytes_per_device(opt_state, opt_in),
            "arguments": float(memory.argument_size_in_bytes), "outputs": float(memory.output_size_in_bytes),
            "aliased": float(memory.alias_size_in_bytes), "temporaries": float(memory.temp_size_in_bytes),
            "peak": float(memory.argument_size_in_bytes + memory.temp_size_in_bytes),
            "compile_seconds": round(seconds, 1)}


def measure(name: str, config: str, sizes: tuple[int, int, int], extra: list[str], compilers: list[str],
            attention: str) -> dict:
    """One case compiled by each of ``compilers`` (``cpu`` only with ``attention="xla"``), next to the step
    memory model on both backends."""
    p = sizes[1]
    compiled, trainer, data_bytes = {}, None, None
    for compiler in compilers:
        if compiler == "cpu" and attention != "xla":
            continue
        trainer, program, params, opt_state, seconds = compiled_step(config, sizes, extra, compiler, attention)
        compiled[compiler] = compiled_memory(program, params, opt_state, seconds)
        if data_bytes is None:
            data_bytes = sum(c.total_wire_bytes for c in collectives(program, trainer.mesh) if "data" in c.axes)
        print(f"    {compiler}: peak {compiled[compiler]['peak'] / GB:.1f} GB in {seconds:.0f} s", flush=True)
    if trainer is None:
        raise ValueError(f"nothing to compile for {config} with attention={attention} on {compilers}")
    rows = parameter_rows(trainer.model_def, dict(trainer.mesh.shape))
    model = {backend: modelled_step_memory(trainer.resolved, rows, backend) for backend in ("cpu", "gpu")}
    count = trainer.model_def.parameter_count()
    c = trainer.cfg
    return {
        "model": name, "config": config, "mesh": list(sizes), "extra": extra, "attention": attention,
        "zero": c.train.zero, "gather_once": c.train.gather_once, "remat": c.model.remat,
        "schedule": (c.pipeline.schedule + (f" v={c.pipeline.chunks}" if c.pipeline.chunks > 1 else "")) if p > 1 else "-",
        "sequence_parallel": c.model.sequence_parallel,
        "microbatches": c.train.microbatches, "parameters": count,
        "compiled": compiled, "data_wire_bytes": data_bytes,
        "step_model": {backend: {**mem.terms(), "temporaries": mem.temporaries, "peak": mem.peak}
                       for backend, mem in model.items()},
        "arithmetic_16_bytes": arithmetic(count, sizes, c.train.zero),
    }


def case_key(r: dict) -> tuple:
    return (r["config"], tuple(r["mesh"]), r["zero"], r["gather_once"], r["remat"], r["schedule"],
            r["sequence_parallel"], r["microbatches"], r.get("attention", "xla"))


def merge_previous(results: list[dict], path) -> None:
    """Fill each result's compilers not run this time from an earlier run's results file (same case), so a
    GPU-only run keeps the CPU column it was measured beside; earlier records in the one-compiler
    format (``compiled`` = XLA:CPU's) are read as ``cpu``."""
    if not path.exists():
        return
    previous = {}
    for r in json.loads(path.read_text()).get("results", []):
        compiled = r["compiled"]
        if "peak" in compiled:  # the format before the H100 column
            compiled = {"cpu": {**compiled, "compile_seconds": r.get("compile_seconds")}}
        previous[case_key(r)] = compiled
    for r in results:
        for compiler, numbers in previous.get(case_key(r), {}).items():
            r["compiled"].setdefault(compiler, numbers)


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
            trainer = Trainer.from_config(cfg, jax.devices("cpu")[:8], read_data=False)
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


def error(model: float, compiled: dict, compiler: str) -> str:
    return f"{100 * (model / compiled[compiler]['peak'] - 1):+.1f}%" if compiler in compiled else "-"


def peak(compiled: dict, compiler: str) -> str:
    return f"{compiled[compiler]['peak'] / GB:.1f}" if compiler in compiled else "-"


def print_results(results: list[dict]) -> None:
    rows = []
    for r in results:
        c, m = r["compiled"], r["step_model"]
        label = f"zero={r['zero']}" + (" once" if r["gather_once"] else "")
        first = c.get("cpu") or next(iter(c.values()))
        rows.append([r["model"], "x".join(map(str, r["mesh"])), r["schedule"], label, r["remat"],
                     "sp" if r["sequence_parallel"] else "-", r["microbatches"], r.get("attention", "xla"),
                     f"{first['parameters'] / GB:.2f}", f"{first['optimizer'] / GB:.2f}",
                     peak(c, "cpu"), f"{m['cpu']['peak'] / GB:.1f}", error(m["cpu"]["peak"], c, "cpu"),
                     f"{c['h100']['temporaries'] / GB:.1f}" if "h100" in c else "-",
                     peak(c, "h100"), f"{m['gpu']['peak'] / GB:.1f}", error(m["gpu"]["peak"], c, "h100"),
                     f"{r['arithmetic_16_bytes'] / GB:.1f}",
                     "yes" if c.get("h100", first)["peak"] <= GPU_GB * GB else "no"])
    print("bf16 compute, fp32 parameters, AdamW; GB per device (1e9 bytes); error: each model against its compiler's peak")
    _common.print_table(["model", "mesh d x p x t", "schedule", "zero", "remat", "SP", "m", "attn", "params",
                         "opt state", "XLA:CPU peak", "model (CPU)", "error", "H100 temp", "H100 peak",
                         "model (GPU)", "error", "16 B/param", f"H100 <= {GPU_GB} GB"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compilers", default="cpu,h100", help="comma-separated: cpu (simulated devices), h100")
    parser.add_argument("--attention", default="xla", help="comma-separated model.attention values: xla, cudnn "
                        "(cudnn is compiled for GPUs only)")
    parser.add_argument("--cases", default=None, help="comma-separated indices into CASES (default: all)")
    parser.add_argument("--out", default="memory_at_scale", help="results name under benchmarks/results/")
    parser.add_argument("--skip-bytes-per-parameter", action="store_true")
    parser.add_argument("--dump", default=None, help="=DIR: XLA's dumps (buffer assignment) of every program")
    args = parser.parse_args()
    compilers = args.compilers.split(",")
    attentions = args.attention.split(",")
    for value, known, flag in ((compilers, COMPILERS, "--compilers"), (attentions, ATTENTIONS, "--attention")):
        if not set(value) <= set(known):
            parser.error(f"{flag}: use {', '.join(known)}, got {','.join(value)}")
    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    payload = {}
    if not args.skip_bytes_per_parameter and "cpu" in compilers:
        per_param = bytes_per_parameter()
        payload["bytes_per_parameter"] = per_param
        print("state a step keeps, bytes per parameter per device (data=8, fp32; compiled input shardings)")
        _common.print_table(["optimizer", "zero", "weights", "optimizer state", "total"], [
            [r["optimizer"], r["zero"], *(["cannot be split"] * 3 if r["bytes_per_parameter"] is None else
                                          [f"{r['weights']:.2f}", f"{r['optimizer_state']:.2f}",
                                           f"{r['bytes_per_parameter']:.2f}"])] for r in per_param])
    results = []
    for case in chosen:
        for attention in attentions:
            print(f"  {case[0]} {'x'.join(map(str, case[2]))} {' '.join(case[3])} attention={attention}", flush=True)
            try:
                results.append(measure(*case, compilers, attention))
            except Exception as err:  # noqa: BLE001 - one case that does not compile (cudnn) leaves the others
                print(f"    did not compile: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
                      flush=True)
                continue
            merge_previous(results[-1:], _common.RESULTS / f"{args.out}.json")
            _common.write_results(f"{args.out}.partial", {**payload, "results": results})
    print_results(results)
    path = _common.write_results(args.out, {**payload, "results": results})
    (_common.RESULTS / f"{args.out}.partial.json").unlink(missing_ok=True)
    plot(results, args.out)
    print(f"wrote {path}")


def memory_bars(ax, results: list[dict]) -> np.ndarray:
    """Each result's compiled parameters, optimizer state and temporaries stacked as bars on ``ax``
    (GB per device); returns the bars' positions."""
    x = np.arange(len(results))
    bottom = np.zeros(len(results))
    for key, label in (("parameters", "parameters"), ("optimizer", "optimizer state"),
                       ("temporaries", "temporaries (H100)")):
        heights = np.array([r["compiled"].get("h100", {}).get(key, np.nan) for r in results]) / GB
        ax.bar(x, heights, bottom=bottom, label=label)
        bottom = bottom + heights
    return x


def plot(results: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 5.5))
    x = memory_bars(ax, results)
    ax.scatter(x, [r["compiled"].get("cpu", {}).get("peak", np.nan) / GB for r in results], color="k", marker="o",
               s=20, label="XLA:CPU compiled peak", zorder=3)
    ax.scatter(x, [r["step_model"]["gpu"]["peak"] / GB for r in results], color="C3", marker="x", s=30,
               label="step memory model, GPU", zorder=3)
    ax.scatter(x, [r["step_model"]["cpu"]["peak"] / GB for r in results], color="k", marker="_", s=300,
               label="step memory model, XLA:CPU", zorder=3)
    ax.axhline(GPU_GB, color="r", linestyle="--", label=f"{GPU_GB} GB GPU")
    labels = [f"{r['model']} {'x'.join(map(str, r['mesh']))} {r['schedule'] if r['schedule'] != '-' else ''}\n"
              f"z{r['zero']}{' once' if r['gather_once'] else ''} {r['remat'][:3]}{' sp' if r['sequence_parallel'] else ''}"
              for r in results]
    ax.set_xticks(x, labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel("GB per device")
    ax.set_title("compiled train step, memory per device (compile-only H100s and simulated CPUs, nothing allocated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
