"""Measured vs predicted on one real GPU: tokens/s and MFU of two models, beside the step-time estimator.

Made for a short loan of one H200 (at most 15 minutes, nothing downloadable there): every phase runs
in its own Python process under a wall-clock budget, so a slow compile or a hang costs that phase only
and the whole check stays under ``--total-budget-s`` (default 450 s). The phases:

* ``default``: the default config's model (``mesh_configs/cpu8.yaml``: GPT, 4 layers, hidden 128, fp32)
  with every parallel size 1, on the first device;
* ``llama_1b``: ``mesh_configs/tinyllama_1b.yaml`` (1.1B Llama, bf16 compute, cuDNN flash attention),
  one GPU's share of it (``parallel.data=1``, 16 sequences of 2048 tokens). If the cuDNN attention
  does not build or compile, the phase says so in one line and uses ``model.attention=xla``.

Each phase compiles the train step once, reads the compiled program's memory figures, asks
``meshtron.gpu.step_time.estimate_step`` (if this checkout has it) for the same compiled program,
then trains on synthetic tokens (uniform over the vocabulary, placed on the device before timing):
warmup steps, then timed steps until ``--steps`` or the phase's budget. Reported: the median step
time of the timed steps, tokens/s = tokens per step / median, and

    MFU = model FLOPs per step / (median step seconds x peak)
    model FLOPs per step = (6 N + 12 l h s) x tokens per step     (meshtron.megatron.model_flops_per_token)

with N the model's parameter count (embedding and untied head included), l layers, h hidden, s the
sequence length, and peak = 989e12 FLOP/s, the dense bf16 rate of an H100/H200 SXM (the same figure
for the fp32 default model, whose MFU is therefore only a lower bound of interest).

Needs: jax (with a GPU plugin for the real check), flax, optax, orbax-checkpoint, numpy, PyYAML,
rich, omegaconf -- what ``meshtron.config`` and ``meshtron.train`` import; none of meshtron's data
dependencies (tokenizers, sentencepiece, safetensors, tensorboardX). A missing one is one line and
exit status 2. The meshtron code is this checkout's ``src/`` (put on the phases' ``PYTHONPATH``).

    bash benchmarks/gpu_check.sh                      # on the GPU machine
    python benchmarks/gpu_check.py --cpu --steps 2 --scale tiny   # the same code path on CPU, seconds

Results: ``$OUT/gpu_check.json`` when ``OUT`` is set, else ``benchmarks/results/gpu_check.json``
(``--out DIR`` overrides both); a table on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (NVIDIA's datasheet, without sparsity)
TARGET = "h200"  # the estimator's GPU
NEEDED = {"jax": "jax", "flax": "flax", "optax": "optax", "orbax.checkpoint": "orbax-checkpoint",
          "numpy": "numpy", "yaml": "PyYAML", "rich": "rich", "omegaconf": "omegaconf"}
PHASES = ("default", "llama_1b")
SINGLE_DEVICE = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.context=1"]

# Per scale: each phase's config file and overrides. "full" is the GPU check; "tiny" the same code
# path in seconds on a CPU (the tests run it).
PHASE_CONFIGS = {
    "full": {
        "default": ("cpu8.yaml", SINGLE_DEVICE),
        "llama_1b": ("tinyllama_1b.yaml", [*SINGLE_DEVICE, "train.batch_size=16"]),
    },
    "tiny": {
        "default": ("cpu8.yaml", [*SINGLE_DEVICE, "train.batch_size=4", "parallel.microbatches=2", "model.hidden=32",
                                  "model.heads=2", "model.layers=2", "model.mlp_dim=64", "model.seq_len=32"]),
        "llama_1b": ("tinyllama_1b.yaml", [
            *SINGLE_DEVICE, "train.batch_size=4", "parallel.microbatches=2", "model.vocab_size=256",
            "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.layers=2", "model.mlp_dim=64",
            "model.seq_len=32", "model.max_position_embeddings=32"]),
    },
}
# Seconds of each phase's budget (of the total) on the GPU; the rest of the total is slack for startup.
PHASE_SHARE = {"default": 0.3, "llama_1b": 0.7}


def missing_packages() -> list[str]:
    """Distribution names of the packages the phases import that this Python cannot find."""
    missing = []
    for module, dist in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is absent (orbax for orbax.checkpoint)
            found = False
        if not found:
            missing.append(dist)
    return missing


def results_dir(out: str | None) -> Path:
    if out:
        return Path(out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------- one phase (its own process)


def run_phase(name: str, scale: str, steps: int, warmup: int, budget_s: float) -> dict:
    """Compile, estimate and time one model; returns the phase's record (also on failure, with ``error``)."""
    started = time.perf_counter()
    import jax

    from meshtron.config import load_config

    file, overrides = PHASE_CONFIGS[scale][name]
    devices = jax.devices()[:1]
    record: dict = {"phase": name, "config": f"mesh_configs/{file}", "overrides": list(overrides),
                    "device": _device_facts(devices[0]), "notes": []}
    cfg = load_config(ROOT / "mesh_configs" / file, list(overrides))
    try:
        trainer, compiled, compile_s = _build_and_compile(cfg, devices, record)
    except Exception as err:  # the fallback's reason is printed and recorded
        if cfg.model.attention != "cudnn":
            raise
        note = (f"model.attention=cudnn did not compile ({type(err).__name__}: {_first_line(err)}); "
                "using model.attention=xla")
        print(f"[{name}] note: {note}", flush=True)
        record["notes"].append(note)
        cfg = load_config(ROOT / "mesh_configs" / file, [*overrides, "model.attention=xla"])
        trainer, compiled, compile_s = _build_and_compile(cfg, devices, record)
    m = trainer.cfg.model
    params_count = trainer.model_def.parameter_count()
    tokens_per_step = trainer.cfg.train.batch_size * m.seq_len
    from meshtron.megatron import model_flops_per_token

    flops_per_step = model_flops_per_token(params_count, m.layers, m.hidden, m.seq_len) * tokens_per_step
    record.update({
        "attention": m.attention, "dtype": m.dtype, "param_dtype": m.param_dtype, "family": m.family,
        "params": params_count, "layers": m.layers, "hidden": m.hidden, "seq_len": m.seq_len,
        "batch_size": trainer.cfg.train.batch_size, "microbatches": trainer.cfg.train.microbatches,
        "tokens_per_step": tokens_per_step, "model_flops_per_step": flops_per_step, "compile_s": compile_s,
        "compiled_memory": _memory_figures(compiled),
        "estimate": _estimate(compiled, trainer.mesh, tokens_per_step, flops_per_step, name),
    })
    times, losses = _timed_steps(trainer, steps, warmup, deadline=started + budget_s - 10.0, phase=name)
    record["step_times_s"] = times
    record["losses"] = losses
    record["device_memory"] = _device_memory(devices[0])
    if times:
        median = statistics.median(times)
        record.update({"median_step_s": median, "tokens_per_s": tokens_per_step / median,
                       "mfu": flops_per_step / (median * PEAK_FLOPS)})
    else:
        record["notes"].append("no timed step finished within the phase's budget")
    record["phase_s"] = time.perf_counter() - started
    return record


def _build_and_compile(cfg, devices, record: dict):
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(cfg, devices=devices, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    start = time.perf_counter()
    compiled = trainer.steps.compile(params, opt_state, tokens)
    return trainer, compiled, time.perf_counter() - start


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def _device_facts(device) -> dict:
    import jax
    import jaxlib

    return {"platform": device.platform, "kind": device.device_kind, "count": len(jax.devices()),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "plugins": _jax_distributions(),
            "python": platform.python_version()}


def _jax_distributions() -> dict[str, str]:
    """Installed JAX plugin and runtime distributions (jax-cuda13-plugin, jax-cuda13-pjrt, ...)."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax-", "jax_")) or name == "jaxlib":
            found[name] = dist.version
    return dict(sorted(found.items()))


def _memory_figures(compiled) -> dict | None:
    """Bytes the compiled program asks for on one device (XLA's memory analysis), where it has one."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    figures = {f: int(getattr(analysis, f)) for f in fields if getattr(analysis, f, None) is not None}
    if {"argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"} <= set(figures):
        figures["total_bytes"] = (figures["argument_size_in_bytes"] + figures["output_size_in_bytes"]
                                  - figures["alias_size_in_bytes"] + figures["temp_size_in_bytes"])
    return figures


def _device_memory(device) -> dict | None:
    """The allocator's own figures (peak bytes in use, the limit) where the device keeps them (GPUs)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 -- CPUs may not implement it
        return None
    if not stats:
        return None
    keep = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size", "num_allocs")
    return {k: int(stats[k]) for k in keep if k in stats}


def _estimate(compiled, mesh, tokens_per_step: int, flops_per_step: float, phase: str) -> dict:
    """The step-time estimator's prediction for this compiled program on an H200, or why there is none."""
    try:
        from meshtron.gpu.step_time import estimate_step
    except ImportError:
        print(f"[{phase}] estimator not available", flush=True)
        return {"available": False, "error": "estimator not available"}
    try:
        try:
            est = estimate_step(compiled, mesh, TARGET, tokens_per_step=tokens_per_step,
                                model_flops_per_step=flops_per_step)
        except (TypeError, AttributeError):  # an estimator that reads the program's HLO text only
            est = estimate_step(compiled.as_text(), mesh, TARGET, tokens_per_step=tokens_per_step,
                                model_flops_per_step=flops_per_step)
    except Exception as err:  # noqa: BLE001 -- recorded beside the measurement, never fatal
        message = f"{type(err).__name__}: {_first_line(err)}"
        print(f"[{phase}] estimator failed: {message}", flush=True)
        return {"available": True, "error": message}
    lines = list(est.lines())
    for line in lines:
        print(f"[{phase}] estimate: {line}", flush=True)
    return {"available": True, "target": TARGET, "seconds": float(est.seconds),
            "tokens_per_s_per_gpu": float(est.tokens_per_s_per_gpu), "mfu": float(est.mfu), "lines": lines}


def _timed_steps(trainer, steps: int, warmup: int, deadline: float, phase: str) -> tuple[list[float], list[float]]:
    """Seconds of each timed step (after ``warmup`` untimed ones) and every step's loss; stops at ``deadline``."""
    import jax
    import numpy as np

    cfg = trainer.cfg
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len + 1)
    batches = [jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
                              trainer.steps.batch_sharding) for _ in range(2)]
    params = trainer.init_params()
    opt_state = trainer.steps.init_opt_state(params)
    jax.block_until_ready((params, opt_state, batches))
    times, losses = [], []
    for i in range(warmup + steps):
        if time.perf_counter() > deadline:
            print(f"[{phase}] budget reached after {len(times)} timed steps", flush=True)
            break
        start = time.perf_counter()
        params, opt_state, metrics = trainer.steps.train(params, opt_state, batches[i % len(batches)])
        loss = float(np.mean(jax.device_get(metrics.loss)))
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= warmup:
            times.append(elapsed)
    return times, losses


# ---------------------------------------------------------------- the driver


def phase_main(args) -> int:
    out = Path(args.phase_out)
    try:
        record = run_phase(args.phase, args.scale, args.steps, args.warmup, args.budget_s)
    except Exception as err:  # noqa: BLE001 -- one line in the record and on stderr
        record = {"phase": args.phase, "error": f"{type(err).__name__}: {_first_line(err)}"}
        print(f"[{args.phase}] failed: {record['error']}", file=sys.stderr, flush=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if "error" not in record else 1


def phase_env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    else:  # the GPU's memory is the phase's own: no preallocated 75% fraction between processes to guess
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    return env


def run_phases(args) -> dict:
    folder = results_dir(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    phases = {}
    for name in args.phases:
        left = args.total_budget_s - (time.perf_counter() - started)
        budget = min(left, args.total_budget_s * PHASE_SHARE[name]) if name != args.phases[-1] else left
        if budget < 20:
            phases[name] = {"phase": name, "error": f"skipped: {left:.0f} s of the total budget left"}
            continue
        out = folder / f"gpu_check_{name}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--phase", name, "--phase-out", str(out),
                   "--scale", args.scale, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--budget-s", f"{budget:.0f}", *(["--cpu"] if args.cpu else [])]
        print(f"== phase {name}: budget {budget:.0f} s", flush=True)
        try:
            done = subprocess.run(command, env=phase_env(args.cpu), cwd=ROOT, timeout=budget, check=False)
            ended = f"exited with status {done.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"stopped after its budget of {budget:.0f} s"
            print(f"== phase {name}: {ended}", flush=True)
        phases[name] = (json.loads(out.read_text()) if out.exists()
                        else {"phase": name, "error": f"{ended}, no result"})
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
               "scale": args.scale, "cpu_mode": args.cpu, "steps": args.steps, "warmup": args.warmup,
               "peak_flops": PEAK_FLOPS, "estimator_target": TARGET,
               "mfu_formula": "(6*N + 12*layers*hidden*seq_len) * tokens_per_step / (median_step_s * 989e12)",
               "total_s": time.perf_counter() - started, "phases": phases}
    path = folder / "gpu_check.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print_table(phases)
    print(f"wrote {path}")
    return payload


def print_table(phases: dict) -> None:
    header = ["phase", "attention", "params", "tokens/step", "step ms", "tokens/s", "MFU",
              "est ms", "est tokens/s", "est MFU", "compiled GB", "peak GB"]
    rows = []
    for name, r in phases.items():
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        est = r.get("estimate") or {}
        mem = r.get("compiled_memory") or {}
        peak = (r.get("device_memory") or {}).get("peak_bytes_in_use")
        has_est = "seconds" in est
        rows.append([
            name, r["attention"], _count(r["params"]), f"{r['tokens_per_step']:,}",
            _fmt(r.get("median_step_s"), 1e3, ".1f"), _fmt(r.get("tokens_per_s"), 1, ",.0f"),
            _fmt(r.get("mfu"), 100, ".1f", "%"),
            _fmt(est.get("seconds") if has_est else None, 1e3, ".1f"),
            _fmt(est.get("tokens_per_s_per_gpu") if has_est else None, 1, ",.0f"),
            _fmt(est.get("mfu") if has_est else None, 100, ".1f", "%"),
            _fmt(mem.get("total_bytes"), 1e-9, ".2f"), _fmt(peak, 1e-9, ".2f"),
        ])
    if not rows:
        return
    cells = [header] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for name, r in phases.items():
        for note in r.get("notes", []):
            print(f"{name}: {note}")
        if "error" in (r.get("estimate") or {}):
            print(f"{name}: estimate: {r['estimate']['error']}")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _fmt(value, scale: float, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true",
                        help="run on the CPU (JAX_PLATFORMS=cpu): the same code path, for tests")
    parser.add_argument("--scale", choices=sorted(PHASE_CONFIGS), default="full")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--total-budget-s", type=float, default=450.0, help="wall-clock seconds for all phases")
    parser.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # a phase's own process
    parser.add_argument("--phase-out", help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=300.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"gpu_check: needs the Python package(s) {', '.join(missing)}, absent from {sys.executable}; "
              "install them (meshtron's own dependencies) or use a Python that has them", file=sys.stderr)
        return 2
    if args.phase:
        return phase_main(args)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"--phases: unknown {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    payload = run_phases(args)
    return 0 if all("error" not in r for r in payload["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
