"""What FP8 GEMMs, ``gpu.overlap=on`` and host offload do to Llama-2 7B and 70B steps on H100s.

Compiles one training step (compile-only H100 80 GB devices, no GPU needed) per model, layout and
setting:

- Llama-2 70B on 64 H100 in FSDP (data 64, zero=3, full recomputation, bf16 gradient reduce-scatter,
  2 sequences per GPU: the layout and batch of MaxText's published 70B run, and meshtron's fastest
  70B layout in ``2026-11-29-vs-maxtext-h100.md``);
- Llama-2 7B on 8 H100 in FSDP (data 8, zero=3, selective recomputation, 2 sequences per GPU);
- Llama-2 7B on 64 H100 as ``mesh_configs/llama2_7b`` lays it out (data 8 x pipe 4 x tensor 2, 1F1B,
  zero=1);

each as bf16, ``model.fp8=current``, FP8 + ``gpu.overlap=on``, and FP8 + overlap with both host
offloads (``model.remat=offload``, ``train.offload_optimizer=true``), then a few rows that explain
those: bf16 with offload, FP8 with the collective pipeliner on FSDP's gathers and reduce-scatters,
overlap less its pipelined p2p, the 7B on 64 with XLA's attention (where ``gpu.overlap=on``
compiles in bf16), and the 7B on 8 with full recomputation (FP8's memory with selective). Every run uses cuDNN attention (unless the row says otherwise) and bf16 compute;
"vs bf16" is against the bf16 row of the same model and attention. For each program it records the device peak (arguments + temporaries, from
``memory_analysis()``), the bytes held in pinned host memory, the collective bytes per device and
step, the hidden fraction of the communication, and the estimated step, tokens/s/GPU and MFU
(:func:`meshtron.gpu.step_time.estimate_step`; GEMMs of two float8 operands priced at the FP8 peak).

Each compile runs in a child process with a timeout: a setting that fails is a row with its error.
Rows are written to ``benchmarks/results/hopper_levers.json`` as each finishes (a partial run is
kept), and finished rows are not compiled again (rows that failed are tried again; ``--fresh``
recompiles all). ``--only A,B`` runs the
rows whose keys (``MODEL:SETTING``, as the table prints them) contain any of the comma-separated
strings. Writes ``hopper_levers.png`` and prints the table.

Each compile took 10-25 s on a 2-core machine (the 7B's 1F1B program on 64 GPUs the longest; the
FSDP programs scan their layers), about 8 minutes for all rows with their child processes; the
``gpu-compile`` extra (Python 3.12 venv) is needed.
Usage: ``python benchmarks/hopper_levers.py [--only 70b] [--fresh]``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TARGET = "h100"
H100_BYTES = 80 * 10**9  # an H100 SXM's 80 GB of HBM3
RESULT_NAME = "hopper_levers"
HLO_DIR = Path(os.environ.get("HOPPER_LEVERS_HLO_DIR", "/tmp/hopper_levers_hlo"))
TIMEOUT_S = int(os.environ.get("HOPPER_LEVERS_TIMEOUT_S", "1500"))

COMMON = ["model.attention=cudnn", "model.dtype=bfloat16"]
# (key, config, devices, layout label, overrides)
MODELS = [
    ("70b-64", "llama2_70b", 64, "FSDP data 64, zero=3, remat full, batch 128",
     ["train.batch_size=128", "parallel.data=64", "parallel.pipe=1", "parallel.tensor=1", "parallel.zero=3",
      "parallel.microbatches=1", "parallel.sequence_parallel=false", "parallel.gather_once=false",
      "model.remat=full", "parallel.reduce_dtype=bfloat16"]),
    ("7b-8", "llama2_7b", 8, "FSDP data 8, zero=3, remat selective, batch 16",
     ["train.batch_size=16", "parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.zero=3",
      "parallel.microbatches=1", "model.remat=selective"]),
    ("7b-64", "llama2_7b", 64, "data 8 x pipe 4 x tensor 2, 1F1B, zero=1, remat full, batch 512",
     ["parallel.zero=1"]),
]
FP8 = ["model.fp8=current"]
OVERLAP = ["gpu.overlap=on"]
OFFLOAD = ["model.remat=offload", "train.offload_optimizer=true"]
# gpu.overlap=on less its pipelined p2p (which XLA aborts on with FP8 on the 1F1B program); the
# collective pipeliner on FSDP's all-gathers and reduce-scatters (not in the overlap bundle).
NO_P2P = ["gpu.xla_flags=--xla_gpu_enable_pipelined_p2p=false"]
FSDP_PIPELINER = [("gpu.xla_flags=--xla_gpu_enable_pipelined_all_gather=true "
                   "--xla_gpu_enable_pipelined_reduce_scatter=true")]
# XLA's own attention instead of cuDNN's: gpu.overlap=on's pipelined p2p aborts XLA on the 1F1B
# program with cuDNN attention, not with XLA's.
XLA_ATTENTION = ["model.attention=xla"]
SETTINGS = [
    ("bf16", []),
    ("fp8", FP8),
    ("fp8+overlap", FP8 + OVERLAP),
    ("fp8+overlap+offload", FP8 + OVERLAP + OFFLOAD),
    ("bf16+offload", OFFLOAD),
    ("bf16+overlap", OVERLAP),
    ("fp8+offload", FP8 + OFFLOAD),
    ("fp8+overlap-p2p", FP8 + OVERLAP + NO_P2P),
    ("fp8+pipelined AG/RS", FP8 + FSDP_PIPELINER),
    ("bf16 (xla attention)", XLA_ATTENTION),
    ("bf16+overlap (xla attention)", OVERLAP + XLA_ATTENTION),
    ("fp8+overlap (xla attention)", FP8 + OVERLAP + XLA_ATTENTION),
    ("bf16 (remat full)", ["model.remat=full"]),
    ("fp8 (remat full)", FP8 + ["model.remat=full"]),
]
# The order rows are compiled in: the 70B's goal figures first, then the 7B on 8, the 7B on 64, offloads last.
ORDER = ["70b-64:bf16", "70b-64:fp8", "70b-64:fp8+overlap",
         "7b-8:bf16", "7b-8:fp8", "7b-8:fp8+overlap", "7b-8:fp8+overlap+offload",
         "7b-64:bf16", "7b-64:fp8", "7b-64:fp8+overlap",
         "70b-64:fp8+overlap+offload", "7b-64:fp8+overlap+offload",
         "70b-64:bf16+offload", "7b-8:bf16+offload",
         "7b-64:bf16+overlap", "7b-64:fp8+overlap-p2p", "7b-64:fp8+offload", "7b-64:bf16+offload",
         "70b-64:fp8+pipelined AG/RS", "7b-8:fp8+pipelined AG/RS",
         "7b-64:bf16 (xla attention)", "7b-64:bf16+overlap (xla attention)", "7b-64:fp8+overlap (xla attention)",
         "7b-8:bf16 (remat full)", "7b-8:fp8 (remat full)"]


def _spec(key: str) -> tuple[str, int, str, list[str]]:
    """A row's config, device count, layout label and overrides."""
    model, setting = key.split(":")
    _, config, devices, layout, overrides = next(m for m in MODELS if m[0] == model)
    return config, devices, layout, [*COMMON, *overrides, *dict(SETTINGS)[setting]]


def _one(config: str, overrides: list[str], hlo_path: str) -> dict:
    """Child process: compile the step on compile-only H100s, keep its HLO text, measure and estimate it."""
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    import jax

    from meshtron.config import load_config
    from meshtron.describe import bytes_per_device, host_bytes
    from meshtron.gpu.pipeline_ticks import tick_table
    from meshtron.gpu.step_time import estimate_json, estimate_step, model_flops
    from meshtron.hlo.gemms import gemms, totals_by_operand_types
    from meshtron.train.loop import Trainer
    from meshtron.xla_options import as_flags

    trainer = Trainer.from_config(load_config(config, overrides), target=TARGET, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    start = time.perf_counter()
    program = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    compile_s = time.perf_counter() - start
    text = program.as_text()
    Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
    Path(hlo_path).write_text(text)
    memory = program.memory_analysis()
    param_in, opt_in = program.input_shardings[0][:2]

    cfg, m = trainer.cfg, trainer.cfg.model
    sizes = dict(trainer.mesh.shape)
    step_tokens = cfg.train.batch_size * m.seq_len
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    total, attention = model_flops(params=n_params, layers=m.layers, hidden=m.hidden, seq_len=m.seq_len,
                                   tokens=step_tokens)
    ticks = tick_table(trainer.resolved.program) if trainer.resolved.program is not None else None
    estimate = estimate_step(text, sizes, TARGET, tokens_per_step=step_tokens, model_flops_per_step=total,
                             causal_attention_flops_per_step=attention, ticks=ticks)
    return {"compile_s": round(compile_s, 1), "hlo": hlo_path, "mesh": sizes, "parameters": n_params,
            "options": as_flags(trainer.steps.compiler_options),
            "gemms": {f"{lhs} x {rhs}": t.__dict__ for (lhs, rhs), t in totals_by_operand_types(gemms(text)).items()},
            "memory": {"argument": int(memory.argument_size_in_bytes), "temp": int(memory.temp_size_in_bytes),
                       "output": int(memory.output_size_in_bytes), "alias": int(memory.alias_size_in_bytes),
                       "peak": int(memory.argument_size_in_bytes + memory.temp_size_in_bytes),
                       "host": int(host_bytes(memory)),
                       "host_argument": int(getattr(memory, "host_argument_size_in_bytes", 0)),
                       "host_temp": int(getattr(memory, "host_temp_size_in_bytes", 0)),
                       "parameters": int(bytes_per_device(params, param_in)),
                       "optimizer_state": int(bytes_per_device(opt_state, opt_in))},
            "estimate": estimate_json(estimate), "hidden_fraction": estimate.hidden_fraction}


def _run_row(key: str) -> dict:
    from _common import child_failure  # (sets the simulated device count: in the parent only)

    config, devices, layout, overrides = _spec(key)
    hlo = HLO_DIR / f"{key.replace(':', '-').replace('+', '_').replace('/', '_').replace(' ', '_').replace('(', '').replace(')', '')}.hlo"
    record = {"key": key, "model": key.split(":")[0], "setting": key.split(":")[1], "config": config,
              "devices": devices, "layout": layout, "overrides": overrides}
    child = [sys.executable, __file__, "--one", config, str(hlo), *overrides]
    start = time.perf_counter()
    try:
        done = subprocess.run(child, check=False, env={**os.environ, "XLA_FLAGS": ""}, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {**record, "error": f"compile did not finish in {TIMEOUT_S} s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    record.update({"error": child_failure(done)} if line is None else json.loads(line[len("RESULT "):]))
    return record


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def _attention(run: dict) -> str:
    """The row's attention implementation: its speed-up is against the bf16 row with the same one."""
    return "xla" if "model.attention=xla" in run["overrides"] else "cudnn"


def _rows(runs: list[dict]) -> list[list]:
    base = {(r["model"], _attention(r)): r["estimate"]["tokens_per_s_per_gpu"] for r in runs
            if r["setting"].startswith("bf16") and r["setting"].replace(" (xla attention)", "") == "bf16"
            and "error" not in r}
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["key"], r["error"][:80], *[""] * 9])
            continue
        e, mem = r["estimate"], r["memory"]
        collective = sum(e["bytes_by_axes"].values())
        reference = base.get((r["model"], _attention(r)))
        speedup = e["tokens_per_s_per_gpu"] / reference if reference else float("nan")
        fp8_mfu = f"{e['mfu_fp8_peak']:.1%}" if e.get("mfu_fp8_peak") is not None else "-"
        rows.append([r["key"], _gb(mem["peak"]), _gb(mem["host"]), _gb(collective), f"{r['hidden_fraction']:.1%}",
                     f"{e['seconds']:.3f}", f"{e['tokens_per_s_per_gpu']:,.0f}", f"{speedup:.2f}x", f"{e['mfu']:.1%}",
                     fp8_mfu, "yes" if mem["peak"] <= H100_BYTES else "NO"])
    return rows


HEADER = ["model:setting", "peak GB", "host GB", "coll. GB", "hidden", "step s", "tok/s/GPU", "vs bf16",
          "MFU (bf16 peak)", "MFU (FP8 peak)", "fits 80 GB"]


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m[0] for m in MODELS if any(r["model"] == m[0] for r in runs)]
    if not models:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 10), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in runs if r["model"] == model]
        labels = [r["setting"] for r in mine]
        layout = next(m[3] for m in MODELS if m[0] == model)
        colors = ["tab:gray" if r["setting"].startswith("bf16") else "tab:orange" for r in mine]
        tokens = [0.0 if "error" in r else r["estimate"]["tokens_per_s_per_gpu"] for r in mine]
        peak = [0.0 if "error" in r else r["memory"]["peak"] / 1e9 for r in mine]
        host = [0.0 if "error" in r else r["memory"]["host"] / 1e9 for r in mine]
        top, bottom = axes[0][col], axes[1][col]
        top.barh(labels, tokens, color=colors)
        bottom.barh(labels, peak, color=colors, label="device peak")
        bottom.barh(labels, host, left=peak, color="tab:blue", alpha=0.4, label="pinned host")
        for i, r in enumerate(mine):
            if "error" in r:
                for ax in (top, bottom):
                    ax.text(0, i, " XLA aborted (no program)", va="center", fontsize=7, color="red")
        top.set_title(f"{model}:\n" + layout.replace(", remat", ",\nremat"), fontsize=9)
        top.set_xlabel("estimated tokens/s per GPU")
        top.invert_yaxis()
        bottom.axvline(H100_BYTES / 1e9, color="red", linestyle=":", label="80 GB")
        bottom.set_xlabel("GB per GPU")
        bottom.invert_yaxis()
        bottom.legend(fontsize=7)
    fig.suptitle("Hopper levers: bf16 vs FP8 vs FP8 + overlap, with and without offload (compile-only H100, estimated)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if "--one" in sys.argv:
        at = sys.argv.index("--one")
        config, hlo_path, *overrides = sys.argv[at + 1:]
        print("RESULT " + json.dumps(_one(config, overrides, hlo_path)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import RESULTS, print_table, write_results

    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    previous = RESULTS / f"{RESULT_NAME}.json"
    kept = {} if "--fresh" in sys.argv or not previous.exists() else \
        {r["key"]: r for r in json.loads(previous.read_text())["runs"]}
    header = {"target": TARGET, "models": {m[0]: {"config": m[1], "devices": m[2], "layout": m[3]} for m in MODELS},
              "common_overrides": COMMON, "settings": dict(SETTINGS)}

    def ordered(rows: dict) -> list[dict]:
        return [rows[k] for k in ORDER if k in rows]

    for key in ORDER:
        wanted = only is None or any(s in key for s in only)
        if not wanted or (key in kept and "error" not in kept[key] and only is None):
            continue
        print(f"{key}: compiling", file=sys.stderr, flush=True)
        kept[key] = _run_row(key)
        print(f"{key}: {'failed: ' + kept[key]['error'] if 'error' in kept[key] else 'done'}", file=sys.stderr,
              flush=True)
        write_results(RESULT_NAME, {**header, "runs": ordered(kept)})
    runs = ordered(kept)
    print(f"Llama-2 on compile-only {TARGET} (estimated): bf16 vs FP8 vs FP8 + overlap, with and without offload")
    print_table(HEADER, _rows(runs))
    path = write_results(RESULT_NAME, {**header, "runs": runs})
    _plot(runs, RESULTS / f"{RESULT_NAME}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
