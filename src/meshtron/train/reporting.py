"""Where a run's numbers go besides the progress bar: JSON lines, TensorBoard event files, a plain
progress line for logs that are not a terminal, and a ``jax.profiler`` trace of chosen steps.

Why apart from the loop: each sink has its own failure modes (a pipe that cannot be re-read, a
TensorBoard directory on a shared disk, a profiler that must stop even when a step raises), and the
loop only says *what* happened at a step; :class:`RunReport` decides where it is written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from meshtron.errors import ConfigError
from meshtron.plotting import pyplot, save

# JSONL / TensorBoard names of the per-step figures (TensorBoard groups them by the prefix).
SCALARS = {
    "loss": "train/loss",
    "heldout_loss": "eval/heldout_loss",
    "heldout_loss_per_byte": "eval/heldout_nats_per_byte",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "model_flops_per_s": "perf/model_flops_per_s",
    "mfu": "perf/model_flops_utilisation",
    "data_bytes": "comm/bytes_over_data_per_step",
}


class StepProfiler:
    """Starts a ``jax.profiler`` trace before step ``first`` and stops it after step ``last`` has
    finished (its results are on the host), writing under ``directory`` the files TensorBoard's
    profile plugin and Perfetto read (``plugins/profile/<run>/*.xplane.pb``, ``*.trace.json.gz``)."""

    def __init__(self, steps: tuple[int, int] | None, directory: str | Path):
        self.steps, self.directory, self.active = steps, Path(directory), False

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0] and not self.active:
            import jax

            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.steps[1]:
            self.stop()

    def stop(self) -> None:
        if self.active:
            import jax

            jax.profiler.stop_trace()
            self.active = False


class TensorBoard:
    """Scalars into TensorBoard event files (``tensorboardX``'s writer, no TensorFlow needed)."""

    def __init__(self, directory: str | Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(directory), flush_secs=10)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, global_step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


@dataclass
class PlainProgress:
    """What the progress bar shows, as one line every ``train.log_every`` steps, for a log file
    (a cluster job's stdout), where a redrawn bar is a single truncated line at the end."""

    total: int
    out: IO[str] = sys.stderr
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.perf_counter()

    def line(self, step: int, record: dict[str, Any], stage: str = "") -> None:
        elapsed = time.perf_counter() - self.start
        parts = [f"step {step}/{self.total}", f"loss {record['loss']:.4f}"]
        if math.isfinite(record.get("tokens_per_s", math.nan)):
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        parts += [f"lr {record['lr']:.2e}", f"grad norm {record['grad_norm']:.3g}"]
        if stage:
            parts.append(f"stage {stage}")
        parts.append(f"{elapsed:,.0f} s")
        print("  ".join(parts), file=self.out, flush=True)


class RunReport:
    """The metrics of one run: JSON lines (``--metrics``) and TensorBoard (``--tensorboard``),
    written by process 0 only."""

    def __init__(self, metrics_file: IO[str] | None, tensorboard: str | Path | None, *, lead: bool):
        self.metrics_file = metrics_file if lead else None
        self.tensorboard = TensorBoard(tensorboard) if (tensorboard and lead) else None

    def write(self, record: dict[str, Any]) -> None:
        self._line(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record["step"], record)

    def start(self, record: dict[str, Any]) -> None:
        """The run's first record (``"event": "start"``): where its weights came from, at the step it
        starts after; TensorBoard gets it as text (``run/weights``)."""
        self._line(record)
        if self.tensorboard is not None:
            self.tensorboard.text(record["step"], "run/weights", record["weights"])

    def _line(self, record: dict[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``--metrics`` JSONL file (a line cut short by a killed run is skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such metrics file; give the --metrics JSONL a run wrote")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not any("loss" in r or "heldout_loss" in r for r in records):
        raise ConfigError(f"{path}: holds no loss records; give the --metrics JSONL a run wrote")
    return records


def plot_runs(paths: list[str | Path], output: str | Path, *, per_byte: bool = False) -> Path:
    """Training and held-out loss curves of one or several runs (their ``--metrics`` files) in one
    PNG; ``per_byte``: held-out loss in nats per byte of text, which compares tokenizers."""
    plt = pyplot("meshtron plot")
    runs = [(Path(p), read_metrics(p)) for p in paths]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    key = "heldout_loss_per_byte" if per_byte else "heldout_loss"
    for i, (path, records) in enumerate(runs):
        color = f"C{i}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        held = [(r["step"], r[key]) for r in records if key in r]
        if train and not per_byte:
            ax.plot(*zip(*train), color=color, alpha=0.6, label=f"{path.stem}: train")
        if held:
            ax.plot(*zip(*held), "o-", color=color, label=f"{path.stem}: held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/byte)" if per_byte else "loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, output)
