"""Checkpoints of the default run: size on disk, how long a save holds up training, restore times.

For AdamW and 1-bit LAMB (error buffers kept, and ``checkpoint.onebit_errors=reset``) on the
default mesh (cpu8.yaml: 2x2x2, interleaved): ``--saves`` saves at successive steps, timing the
part that blocks the training loop (canonical layout + copy to host + orbax dispatch) with async
saves, and the whole save with synchronous ones; then restores of the newest checkpoint onto the
same mesh and onto 8x1x1 and 4x1x2 (the time of ``Trainer.restore``: reading, checksums, layout).
Medians of one run.

    .venv/bin/python benchmarks/checkpoint.py [--saves 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _common

from meshtron.checkpoint import RunPosition
from meshtron.config import load_config
from meshtron.train.loop import Trainer
from meshtron.units import format_bytes

CONFIG = Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu8.yaml"
VARIANTS = {
    "adamw": ["train.optimizer=adamw"],
    "onebit_lamb": ["train.optimizer=onebit_lamb", "optim.freeze_step=1"],
    "onebit_lamb (errors reset)": ["train.optimizer=onebit_lamb", "optim.freeze_step=1",
                                   "checkpoint.onebit_errors=reset"],
}
RESTORE_MESHES = {
    "2x2x2": [],
    "8x1x1": ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.chunks=1", "parallel.microbatches=1"],
    "4x1x2": ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.chunks=1", "parallel.microbatches=1"],
}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed_saves(trainer: Trainer, directory: Path, saves: int, async_save: bool) -> tuple[list[float], list[float]]:
    """Blocking and total seconds of ``saves`` saves of a trained state (one training step between)."""
    trainer.cfg.checkpoint.async_save = async_save
    store = trainer.open_checkpoints()
    params = trainer.init_params()
    opt_state = trainer.steps.init_opt_state(params)
    stream = trainer.train_stream()
    blocking, total = [], []
    for step in range(1, saves + 1):
        stage = trainer.optimizer.stage_at(step - 1)
        params, opt_state, metrics = trainer.steps.train(params, opt_state, stream.next(trainer.steps.batch_sharding),
                                                        stage)
        metrics.mean()
        start = time.perf_counter()
        trainer.save(store, params, opt_state, RunPosition(step, step, stream.position))
        blocking.append(time.perf_counter() - start)
        store.wait()
        total.append(time.perf_counter() - start)
    store.close()
    return blocking, total


def timed_restore(directory: Path, overrides: list[str]) -> float:
    trainer = Trainer.from_config(load_config(CONFIG, [*overrides, f"checkpoint.dir={directory}"]))
    store = trainer.open_checkpoints()
    start = time.perf_counter()
    trainer.restore(store)
    seconds = time.perf_counter() - start
    store.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    rows, records = [], []
    for name, overrides in VARIANTS.items():
        root = Path(tempfile.mkdtemp(prefix="meshtron-bench-ckpt-"))
        try:
            record = {"variant": name}
            for async_save in (True, False):
                directory = root / ("async" if async_save else "sync")
                trainer = Trainer.from_config(load_config(CONFIG, [*overrides, f"checkpoint.dir={directory}",
                                                                   f"checkpoint.keep={args.saves}"]))
                blocking, total = timed_saves(trainer, directory, args.saves, async_save)
                record["async_blocking_s" if async_save else "sync_s"] = statistics.median(blocking)
                if async_save:
                    record["async_total_s"] = statistics.median(total)
                    record["bytes"] = directory_bytes(directory / str(args.saves))
                    record["restore_s"] = {mesh: timed_restore(directory, [*overrides, *extra])
                                           for mesh, extra in RESTORE_MESHES.items()}
            records.append(record)
            rows.append([name, format_bytes(record["bytes"]), f"{record['async_blocking_s']:.3f}",
                         f"{record['async_total_s']:.3f}", f"{record['sync_s']:.3f}",
                         *(f"{record['restore_s'][m]:.2f}" for m in RESTORE_MESHES)])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"default GPT on 2x2x2 (cpu8.yaml), medians of {args.saves} saves; seconds")
    _common.print_table(["optimizer", "checkpoint", "async: blocks loop", "async: on disk", "sync save",
                         *(f"restore {m}" for m in RESTORE_MESHES)], rows)
    path = _common.write_results("checkpoint", {"config": CONFIG.name, "saves": args.saves, "runs": records})
    plot(records)
    print(f"wrote {path}")


def plot(records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [r["variant"] for r in records]
    series = {"async save: blocks the loop": [r["async_blocking_s"] for r in records],
              "async save: until on disk": [r["async_total_s"] for r in records],
              "synchronous save": [r["sync_s"] for r in records],
              **{f"restore onto {m}": [r["restore_s"][m] for r in records] for m in RESTORE_MESHES}}
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + i * width, values, width, label=name)
    ax.set_xticks(x + 0.4 - width / 2, labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title("checkpoints of the default run (2x2x2, interleaved)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "checkpoint.png", dpi=120)


if __name__ == "__main__":
    main()
