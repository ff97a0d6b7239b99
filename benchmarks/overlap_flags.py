"""What each XLA:GPU overlap flag, and ``gpu.overlap=on``, does to the compiled Llama-2 7B step on 64 H100s.

Compiles one training step of Llama-2 7B (mesh_configs/llama2_7b, ZeRO-1) for 64 H100s (compile-only,
no GPU needed) in two layouts -- data 8 x pipe 4 x tensor 2 with the 1F1B pipeline, and data 8 x
tensor 8 with sequence parallelism -- once per setting: XLA's defaults, each candidate flag alone
(given as ``gpu.xla_flags``, so the run's own path hands it to the compiler as a per-program option),
and ``gpu.overlap=on``. Each compile runs in a child process (a setting XLA crashes on is a row with
the crash, not the end of the benchmark). For each program it prints the hidden fraction of the
communication per mesh axis (tensor, pipe, data) and the estimated step time
(:func:`meshtron.gpu.step_time.estimate_step`, a pipelined step priced tick by tick), and for the
pipe and tensor axes what the schedule puts under each collective: how many of the axis's
collectives (collective-permutes, send/recv pairs) are asynchronous, and the GEMMs between their
start and done.

Writes ``benchmarks/results/overlap_flags.json`` and ``overlap_flags.png`` and keeps each program's
HLO text (``$OVERLAP_HLO_DIR``, default ``/tmp/overlap_flags_hlo``). Finished settings are kept in
the JSON and not compiled again (``--fresh`` recompiles all; ``--only LAYOUT:SETTING`` runs one;
``--reestimate`` prices the kept programs again, compiling nothing). ``--schedule HLO AXIS
data=8,context=1,pipe=4,tensor=2`` prints what a kept program schedules under an axis's collectives.
Each compile takes 1-3 minutes on a 2-core machine; the ``gpu-compile`` extra is needed.
Usage: ``python benchmarks/overlap_flags.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

CONFIG = "llama2_7b"
TARGET = "h100"
LAYOUTS = {
    "8x4x2": ["parallel.zero=1"],
    "8x1x8": ["parallel.pipe=1", "parallel.tensor=8", "parallel.zero=1", "parallel.sequence_parallel=true"],
}
P2P = "--xla_gpu_enable_pipelined_p2p=true --xla_gpu_collective_permute_decomposer_threshold=0"
WINDOWED = "--xla_gpu_threshold_for_windowed_einsum_mib=0"
# (label, config overrides, layouts it is run on)
SETTINGS = [
    ("defaults", [], ("8x4x2", "8x1x8")),
    ("pipelined all-gather", ["gpu.xla_flags=--xla_gpu_enable_pipelined_all_gather=true"], ("8x4x2", "8x1x8")),
    ("pipelined reduce-scatter", ["gpu.xla_flags=--xla_gpu_enable_pipelined_reduce_scatter=true"], ("8x4x2", "8x1x8")),
    ("pipelined all-reduce", ["gpu.xla_flags=--xla_gpu_enable_pipelined_all_reduce=true"], ("8x4x2", "8x1x8")),
    ("pipelined p2p", [f"gpu.xla_flags={P2P}"], ("8x4x2",)),
    ("pipelined p2p, pipeline-parallelism opt level",
     [f"gpu.xla_flags={P2P} --xla_gpu_experimental_pipeline_parallelism_opt_level=PIPELINE_PARALLELISM_OPT_LEVEL_ENABLE"],
     ("8x4x2",)),
    ("loops double-buffered",
     ["gpu.xla_flags=--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER"], ("8x4x2", "8x1x8")),
    ("2 collectives in flight", ["gpu.xla_flags=--xla_gpu_experimental_parallel_collective_overlap_limit=2"],
     ("8x4x2", "8x1x8")),
    ("windowed einsum", [f"gpu.xla_flags={WINDOWED}"], ("8x4x2", "8x1x8")),
    ("windowed einsum, no sequence parallelism", [f"gpu.xla_flags={WINDOWED}", "parallel.sequence_parallel=false"],
     ("8x1x8",)),
    ("no sequence parallelism (reference)", ["parallel.sequence_parallel=false"], ("8x1x8",)),
    ("gpu.overlap=on", ["gpu.overlap=on"], ("8x4x2", "8x1x8")),
    ("collective matmul", ["parallel.collective_matmul=true"], ("8x1x8",)),
    ("collective matmul, gpu.overlap=on", ["parallel.collective_matmul=true", "gpu.overlap=on"], ("8x1x8",)),
]
RESULT_NAME = "overlap_flags"
HLO_DIR = Path(os.environ.get("OVERLAP_HLO_DIR", "/tmp/overlap_flags_hlo"))


def _axis_schedule(windows, module, axis: str) -> dict:
    """The ``axis``'s collectives as the schedule places them: kinds (sync/async), and the GEMMs
    (custom calls and GEMM fusions, those in a pipeline stage's ``conditional`` included) and other
    instructions between each async one's start and done."""
    from meshtron.hlo.gemms import GemmFinder, gemms_launched

    finder = GemmFinder(module)
    mine = [w for w in windows if axis in w.collective.axes]
    kinds = Counter(f"{w.kind} {'sync' if w.synchronous else 'async'}" for w in mine)

    def gemms(w) -> int:
        return gemms_launched(w.between, module.computations[w.computation], finder)

    overlapped = [w for w in mine if not w.synchronous]
    return {"collectives": dict(kinds),
            "async_with_gemm_under": sum(1 for w in overlapped if gemms(w) > 0),
            "gemms_under_per_execution": sum(gemms(w) * w.collective.count for w in overlapped),
            "instructions_under": sum(len(w.between) * w.collective.count for w in overlapped)}


def schedule_excerpt(hlo_path: str, sizes: dict[str, int], axis: str, limit: int = 6) -> list[str]:
    """The ``axis``'s asynchronous collectives in a kept program, as the schedule places them: each
    start, the instructions between it and its done (GEMMs marked), the done; ``limit`` of them."""
    from meshtron.hlo.gemms import GemmFinder, gemms_launched
    from meshtron.hlo.schedule import collective_windows, module_of

    module = module_of(Path(hlo_path).read_text())
    finder = GemmFinder(module)

    def shown(i, computation) -> str:
        found = gemms_launched([i], computation, finder)
        if not found:
            return i.name
        return f"{i.name} [GEMM]" if i.opcode != "conditional" else f"{i.name} [{found} GEMMs]"

    lines = []
    for w in [w for w in collective_windows(module, sizes) if axis in w.collective.axes][:limit]:
        if w.synchronous:
            lines.append(f"{w.computation}: {w.start} ({w.kind}, {w.collective.bytes / 2**20:.0f} MiB) synchronous")
            continue
        under = [shown(i, module.computations[w.computation]) for i in w.between
                 if i.opcode not in ("get-tuple-element", "tuple", "bitcast", "constant", "parameter", "after-all")]
        lines.append(f"{w.computation}: {w.start} ({w.kind}, {w.collective.bytes / 2**20:.0f} MiB, x{w.collective.count})"
                     f" -> {', '.join(under) or 'nothing'} -> {w.done}")
    return lines


def _trainer(layout: str, overrides: list[str]):
    """The run's trainer on 64 compile-only H100s (nothing compiled yet)."""
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    return Trainer.from_config(load_config(CONFIG, [*LAYOUTS[layout], *overrides]), target=TARGET, read_data=False)


def _figures(trainer, text: str) -> dict:
    """The program's estimate (a pipelined step priced tick by tick) and its schedule per axis."""
    import jax

    from meshtron.gpu.pipeline_ticks import tick_table
    from meshtron.gpu.step_time import estimate_json, estimate_step, model_flops
    from meshtron.hlo.schedule import collective_windows, module_of
    from meshtron.xla_options import as_flags

    cfg, (params, _, _) = trainer.cfg, trainer.abstract_step_arguments()
    sizes = dict(trainer.mesh.shape)
    m = cfg.model
    step_tokens = cfg.train.batch_size * m.seq_len
    n_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    total, attention = model_flops(params=n_params, layers=m.layers, hidden=m.hidden, seq_len=m.seq_len,
                                   tokens=step_tokens)
    ticks = tick_table(trainer.resolved.program) if trainer.resolved.program is not None else None
    estimate = estimate_step(text, sizes, TARGET, tokens_per_step=step_tokens, model_flops_per_step=total,
                             causal_attention_flops_per_step=attention, ticks=ticks)
    module = module_of(text)
    windows = collective_windows(module, sizes)
    return {"options": as_flags(trainer.steps.compiler_options),
            "schedule": {axis: _axis_schedule(windows, module, axis) for axis in ("pipe", "tensor", "data")},
            "estimate": estimate_json(estimate)}


def _one(layout: str, overrides: list[str], hlo_path: str) -> dict:
    """Child process: compile the step with these overrides, keep its HLO text, estimate it."""
    trainer = _trainer(layout, overrides)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    start = time.perf_counter()
    text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
    compile_s = time.perf_counter() - start
    Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
    Path(hlo_path).write_text(text)
    return {"compile_s": round(compile_s, 1), "hlo": hlo_path, **_figures(trainer, text)}


def _reestimate(runs: list[dict]) -> list[dict]:
    """Each run's kept program estimated again (after a change to the estimate), nothing recompiled."""
    out = []
    for run in runs:
        hlo = Path(run.get("hlo") or _hlo_path(run["layout"], run["setting"]))
        if "error" in run or not hlo.exists():
            out.append(run)
            continue
        out.append({**run, "hlo": str(hlo), **_figures(_trainer(run["layout"], run["overrides"]), hlo.read_text())})
        print(f"{run['layout']} {run['setting']}: estimated again", file=sys.stderr, flush=True)
    return out


def _hlo_path(layout: str, label: str) -> Path:
    return HLO_DIR / f"{layout}-{label.replace(' ', '_').replace(',', '').replace('/', '_')}.hlo"


def _rows(runs: list[dict]) -> list[list]:
    rows = []
    for run in runs:
        if "error" in run:
            rows.append([run["layout"], run["setting"], run["error"][:70], "", "", "", ""])
            continue
        e = run["estimate"]
        hidden = e["hidden_fraction_by_axes"]
        rows.append([run["layout"], run["setting"], f"{e['seconds'] * 1e3:.1f}",
                     *[f"{hidden[a]:.1%}" if a in hidden else "-" for a in ("tensor", "pipe", "data")],
                     f"{e['exposed_communication_seconds'] * 1e3:.1f}"])
    return rows


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(13, 5), sharey=False)
    for ax, layout in zip(axes, LAYOUTS):
        mine = [r for r in runs if r["layout"] == layout and "error" not in r]
        base = next((r["estimate"]["seconds"] for r in mine if r["setting"] == "defaults"), None)
        labels = [r["setting"] for r in mine]
        seconds = [r["estimate"]["seconds"] * 1e3 for r in mine]
        ax.barh(labels, seconds, color=["tab:orange" if r["setting"] == "gpu.overlap=on" else "tab:blue" for r in mine])
        if base:
            ax.axvline(base * 1e3, color="gray", linestyle=":")
        ax.set_title(f"Llama-2 7B {layout} (data x pipe x tensor), 64 H100", fontsize=10)
        ax.set_xlabel("estimated step (ms)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if "--schedule" in sys.argv:  # --schedule HLO_FILE AXIS data=8,pipe=4,tensor=2
        hlo, axis, sizes = sys.argv[sys.argv.index("--schedule") + 1:][:3]
        print("\n".join(schedule_excerpt(hlo, {k: int(v) for k, v in (x.split("=") for x in sizes.split(","))}, axis)))
        return
    if "--one" in sys.argv:
        at = sys.argv.index("--one")
        layout, hlo_path, *overrides = sys.argv[at + 1:]
        print("RESULT " + json.dumps(_one(layout, overrides, hlo_path)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import RESULTS, child_failure, print_table, write_results

    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    previous = RESULTS / f"{RESULT_NAME}.json"
    kept = [] if "--fresh" in sys.argv or not previous.exists() else json.loads(previous.read_text())["runs"]
    done_keys = {(r["layout"], r["setting"], tuple(r["overrides"])): r for r in kept}
    if "--reestimate" in sys.argv:
        kept = _reestimate(kept)
        done_keys = {(r["layout"], r["setting"], tuple(r["overrides"])): r for r in kept}
    runs = []
    for label, overrides, layouts in SETTINGS:
        for layout in layouts:
            key = (layout, label, tuple(overrides))
            wanted = only is None or only == f"{layout}:{label}"
            if key in done_keys and not (only and wanted):
                runs.append(done_keys[key])
                continue
            if not wanted:
                continue
            hlo = _hlo_path(layout, label)
            env = {**os.environ, "XLA_FLAGS": ""}
            child = [sys.executable, __file__, "--one", layout, str(hlo), *overrides]
            done = subprocess.run(child, check=False, env=env, capture_output=True, text=True)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            record = {"layout": layout, "setting": label, "overrides": overrides}
            record.update({"error": child_failure(done)} if line is None else json.loads(line[len("RESULT "):]))
            runs.append(record)
            print(f"{layout} {label}: {'failed: ' + record['error'] if 'error' in record else 'done'}", file=sys.stderr,
                  flush=True)
            write_results(RESULT_NAME, {"config": CONFIG, "layouts": LAYOUTS, "target": TARGET, "runs": runs})
    print(f"{CONFIG} on 64 x {TARGET}: estimated step and hidden fraction of each axis's communication")
    print_table(["layout", "setting", "step ms", "tensor hidden", "pipe hidden", "data hidden", "exposed ms"],
                _rows(runs))
    path = write_results(RESULT_NAME, {"config": CONFIG, "layouts": LAYOUTS, "target": TARGET, "runs": runs})
    _plot(runs, RESULTS / f"{RESULT_NAME}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
