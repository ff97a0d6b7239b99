"""Llama-2 70B on 64 compile-only H100s: pipelined layouts, with and without casting each stage's weights once.

Every row compiles meshtron's real training step for 64 H100s (``benchmarks/gpu_step_estimate.py`` in a
process of its own: jax 0.12 and the ``gpu-compile`` extra, so the second stack's ``.venv-py312``) at
MaxText's published batch (128 sequences of 4,096), with cuDNN attention, selective recomputation,
kept residuals (``parallel.recompute=false``), 64 microbatches a step where the layout allows and fused
weight-gradient accumulation, and prints the estimator's step (``meshtron.gpu.step_time``: GEMMs,
memory-bound work, exposed communication) and the compiled program's memory. The rows vary the mesh,
``parallel.zero``, ``parallel.cast_once`` and XLA's flags (``gpu.xla_flags``: the GEMM library, the scheduler's memory
budget, collectives in flight; ``gpu.overlap``). MaxText's estimated
step on the same devices, for the line in the plot, is read from ``results/vs_maxtext_h100.json``.

    .venv-py312/bin/python benchmarks/pipelined_layouts_h100.py     # about 7 minutes; results/pipelined_layouts_h100.{json,png}
    .venv-py312/bin/python benchmarks/pipelined_layouts_h100.py --only "2x8x4"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent
COMMON = ["train.batch_size=128", "model.attention=cudnn", "model.remat=selective", "parallel.gather_once=false",
          "parallel.recompute=false", "parallel.gradient_accumulation_fusion=true"]
CUBLAS = "gpu.xla_flags=--xla_gpu_enable_triton_gemm=false"
# cuBLAS GEMMs, the latency-hiding scheduler's memory budget at slop factor 130 (XLA's default: 95), two
# collectives in flight
# (docs/gpu.md#the-schedulers-memory-budget)
SCHEDULED = CUBLAS + (" --xla_gpu_memory_limit_slop_factor=130"
                      " --xla_gpu_experimental_parallel_collective_overlap_limit=2")


def _mesh(data: int, pipe: int, tensor: int, microbatches: int, schedule: str = "1f1b") -> list[str]:
    return [f"parallel.data={data}", f"parallel.pipe={pipe}", f"parallel.tensor={tensor}",
            f"parallel.microbatches={microbatches}", f"parallel.schedule={schedule}"]


# label: overrides (besides COMMON)
ROWS = {
    "2x4x8 1f1b zero=1": [*_mesh(2, 4, 8, 64), "parallel.zero=1"],
    "2x4x8 1f1b zero=1, cast once": [*_mesh(2, 4, 8, 64), "parallel.zero=1", "parallel.cast_once=true"],
    "2x8x4 1f1b zero=1": [*_mesh(2, 8, 4, 64), "parallel.zero=1"],
    "2x8x4 1f1b zero=1, cast once": [*_mesh(2, 8, 4, 64), "parallel.zero=1", "parallel.cast_once=true"],
    "2x8x4 1f1b zero=1, cast once, cuBLAS": [*_mesh(2, 8, 4, 64), "parallel.zero=1", "parallel.cast_once=true", CUBLAS],
    "2x8x4 1f1b zero=0, cuBLAS": [*_mesh(2, 8, 4, 64), "parallel.zero=0", CUBLAS],
    "2x8x4 1f1b zero=0, cast once, cuBLAS": [*_mesh(2, 8, 4, 64), "parallel.zero=0", "parallel.cast_once=true", CUBLAS],
    "2x8x4 1f1b zero=0, cast once, cuBLAS, scheduler budget 130%, two in flight": [
        *_mesh(2, 8, 4, 64), "parallel.zero=0", "parallel.cast_once=true", SCHEDULED],
    "2x8x4 1f1b zero=0, cast once, cuBLAS, scheduler budget 130%, two in flight, overlap on, pipelined all-gather": [
        *_mesh(2, 8, 4, 64), "parallel.zero=0", "parallel.cast_once=true", "gpu.overlap=on",
        SCHEDULED + " --xla_gpu_pipeline_all_gather=on"],
    "2x8x4 interleaved(2) zero=1, cast once": [*_mesh(2, 8, 4, 64, "interleaved"), "parallel.chunks=2",
                                               "parallel.zero=1", "parallel.cast_once=true"],
    "2x8x4 zb-h1 zero=1, cast once": [*_mesh(2, 8, 4, 64, "zb-h1"), "parallel.zero=1", "parallel.cast_once=true"],
    "4x4x4 1f1b zero=1, cast once": [*_mesh(4, 4, 4, 32), "parallel.zero=1", "parallel.cast_once=true"],
    "1x8x8 1f1b zero=1, cast once": [*_mesh(1, 8, 8, 128), "parallel.zero=1", "parallel.cast_once=true"],
}

_STEP = re.compile(r"step time on \d+ x \w+ \(gemm_efficiency [\d.]+\): ([\d.]+) ms")
_PARTS = re.compile(r"GEMMs ([\d.]+) ms .*memory-bound ([\d.]+) ms, collectives ([\d.]+) ms of which exposed "
                    r"([\d.]+) ms \(hidden (\d+)%\)")


def compile_row(label: str, overrides: list[str]) -> dict:
    """One layout compiled and estimated in a child process; the figures it printed, or why it gave none."""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([sys.executable, str(HERE / "gpu_step_estimate.py"), "--config", "llama2_70b", "--hlo",
                               str(Path(scratch) / "step.hlo.txt"), *COMMON, *overrides],
                              check=False, capture_output=True, text=True, env=_gpu_env(), timeout=1800)
    step, parts = _STEP.search(done.stdout), _PARTS.search(done.stdout)
    if done.returncode != 0 or step is None or parts is None:
        return {"label": label, "overrides": overrides, "error": _common.child_failure(done)}
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    gemm, mem, comm, exposed, hidden = (float(v) for v in parts.groups())
    return {"label": label, "overrides": [*COMMON, *overrides], "step_seconds": float(step.group(1)) / 1e3,
            "gemm_seconds": gemm / 1e3, "memory_bound_seconds": mem / 1e3, "communication_seconds": comm / 1e3,
            "exposed_seconds": exposed / 1e3, "hidden_percent": hidden, **memory}


def _gpu_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    env.pop("XLA_FLAGS", None)
    return env


def maxtext_step() -> float | None:
    """MaxText's estimated 70B step on 64 H100s from the side-by-side comparison's results, if present."""
    path = _common.RESULTS / "vs_maxtext_h100.json"
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text()).get("results", []) if r["model"].startswith("llama2_70b")]
    return rows[0]["maxtext_estimated_step_seconds"] if rows else None


def plot(rows: list[dict], maxtext: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "step_seconds" in r]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(done) + 1.5))
    names = [r["label"] for r in done]
    left = [0.0] * len(done)
    for key, color, name in (("gemm_seconds", "#4c72b0", "GEMMs"), ("memory_bound_seconds", "#dd8452", "memory-bound"),
                             ("exposed_seconds", "#c44e52", "exposed communication")):
        values = [r[key] for r in done]
        ax.barh(names, values, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    if maxtext is not None:
        ax.axvline(maxtext, color="black", linestyle="--", label=f"MaxText FSDP, estimated ({maxtext:.3f} s)")
        ax.axvline(maxtext / 1.2, color="grey", linestyle=":", label=f"1.2x ahead of it ({maxtext / 1.2:.3f} s)")
    ax.invert_yaxis()
    ax.set_xlabel("estimated seconds per step (Llama-2 70B, 64 compile-only H100, 128 x 4096 tokens)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "pipelined_layouts_h100.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="rows whose label contains this")
    args = parser.parse_args()
    rows = []
    for label, overrides in ROWS.items():
        if args.only and args.only not in label:
            continue
        print(f"{label}...", flush=True)
        rows.append(compile_row(label, overrides))
    maxtext = maxtext_step()
    _common.print_table(
        ["layout", "step s", "GEMMs s", "memory-bound s", "exposed s", "hidden", "temp GiB", "arguments GiB",
         "vs MaxText"],
        [[r["label"], *(("failed: " + r["error"],) + ("",) * 7 if "error" in r else
                        (f"{r['step_seconds']:.3f}", f"{r['gemm_seconds']:.3f}", f"{r['memory_bound_seconds']:.3f}",
                         f"{r['exposed_seconds']:.3f}", f"{r['hidden_percent']:.0f}%", f"{r['temp_gib']:.1f}",
                         f"{r['argument_gib']:.1f}",
                         "" if maxtext is None else f"{maxtext / r['step_seconds']:.3f}x"))] for r in rows])
    path = _common.write_results("pipelined_layouts_h100", {"model": "llama2_70b", "devices": 64, "target": "h100",
                                                            "maxtext_estimated_step_seconds": maxtext, "rows": rows})
    plot(rows, maxtext)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
