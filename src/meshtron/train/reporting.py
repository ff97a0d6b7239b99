"""Where a run's numbers go: the progress bar (or a plain line per logged step when stderr is not a
terminal), the records' sinks (JSON lines, TensorBoard event files, W&B and MLflow:
:mod:`meshtron.train.sinks`), and a ``jax.profiler`` trace of chosen steps.

Why apart from the loop: each sink has its own failure modes (a pipe that cannot be re-read, a
TensorBoard directory on a shared disk, a profiler that must stop even when a step raises), and the
loop only says *what* happened at a step; :class:`RunProgress` decides how it is shown and where it is
written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from meshtron.config import TrainConfig
from meshtron.errors import ConfigError
from meshtron.hlo.summary import MemoryFigures
from meshtron.plotting import pyplot, save
from meshtron.train.sinks import JsonLines, MetricSink, Outcome, TensorBoard
from meshtron.train.trackers import Tracker, open_trackers, read_tracker_runs, save_tracker_runs
from meshtron.units import format_bytes


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
        if reported_summary(record):
            parts.append(reported_summary(record))
        if stage:
            parts.append(f"stage {stage}")
        parts.append(f"{elapsed:,.0f} s")
        print("  ".join(parts), file=self.out, flush=True)


def routing_summary(record: dict[str, Any]) -> str:
    """A mixture of experts' balance as the progress shows it: the busiest expert's load over the mean
    (``moe/load_imbalance``) and, with aux-loss-free balancing, the selection bias's range; ``""`` for a
    record without them (a dense model, a step not logged)."""
    if "moe/load_imbalance" not in record:
        return ""
    text = f"imbalance {record['moe/load_imbalance']:.2f}"
    if "moe/bias_min" in record:
        text += f"  bias {record['moe/bias_min']:+.3g}..{record['moe/bias_max']:+.3g}"
    return text


def reported_summary(record: dict[str, Any]) -> str:
    """What the model reported beside the loss, as the progress shows it: the multi-token prediction
    loss (``mtp/loss``, unweighted) and a mixture of experts' balance (:func:`routing_summary`); ``""``
    for a record without them."""
    parts = [f"mtp {record['mtp/loss']:.4f}"] if "mtp/loss" in record else []
    if routing_summary(record):
        parts.append(routing_summary(record))
    return "  ".join(parts)


class RunReport:
    """The records of one run, written to every sink (:mod:`meshtron.train.sinks`): the metrics JSON lines
    (``--metrics``), TensorBoard (``train.tensorboard``) and the experiment trackers (``train.trackers``),
    by process 0 only (``lead``); the other processes hold none. ``run_dir``: the checkpoint directory,
    where the trackers' runs are recorded so that a resumed run continues them
    (:func:`meshtron.train.trackers.save_tracker_runs`)."""

    def __init__(self, metrics_file: IO[str] | None, train: TrainConfig, *, lead: bool,
                 run_dir: str | Path | None = None):
        self.sinks: list[MetricSink] = []
        self.run_dir = Path(run_dir) if run_dir is not None else None
        if not lead:
            return
        trackers = open_trackers(train)  # first: a missing library leaves no event file open
        if metrics_file is not None:
            self.sinks.append(JsonLines(metrics_file))
        if train.tensorboard:
            self.sinks.append(TensorBoard(train.tensorboard))
        self.sinks += trackers

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        """The run's first record: where its weights came from, at the step it starts after, and its
        resolved config. A sink that cannot start (a tracker's login) ends the others, as failed. A run
        resumed after ``step`` > 0 continues the trackers' runs recorded in :attr:`run_dir`."""
        trackers = [sink for sink in self.sinks if isinstance(sink, Tracker)]
        recorded = read_tracker_runs(self.run_dir) if self.run_dir is not None and step > 0 else {}
        for tracker in trackers:
            tracker.resume = recorded.get(tracker.name)
        for sink in self.sinks:
            try:
                sink.start(step, weights, config)
            except BaseException:
                self.close("failed")
                raise
        runs = {tracker.name: tracker.run_ref for tracker in trackers if tracker.run_ref is not None}
        if runs and self.run_dir is not None and self.run_dir.is_dir():
            save_tracker_runs(self.run_dir, runs)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record["step"], record)

    def summary(self, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.summary(step, values)

    def close(self, outcome: Outcome) -> None:
        """Every sink flushed and ended, each even when one before it fails to."""
        sinks, self.sinks = self.sinks, []
        errors = []
        for sink in sinks:
            try:
                sink.close(outcome)
            except Exception as err:  # noqa: BLE001 -- the rest must still close; the first is raised after
                errors.append(err)
        if errors and outcome == "finished":
            raise errors[0]
        for err in errors:  # the run's own error is the one raised
            print(f"meshtron: closing the run's records: {err}", file=sys.stderr)


class RunProgress:
    """One run as its user follows it: the first line (where the weights came from), the progress bar
    -- step, loss, tokens/s, learning rate, the bytes a step sends over ``data`` -- or, when stderr is
    not a terminal, a plain line every logged step, notes above the bar (held-out losses, skipped
    steps), and every logged step's record in the metrics file, TensorBoard and the trackers
    (:class:`RunReport`; ``train``'s ``tensorboard``, ``trackers``, ``wandb`` and ``mlflow``).

    ``flops_per_token``: the model FLOPs of one token (the records' ``model_flops_per_s``);
    ``peak_flops``: the mesh's peak FLOP/s, for ``mfu`` (None: not logged); ``config``: the run's
    resolved config, the sinks' hyperparameters; ``memory(stage)``: the per-device memory of a stage's
    compiled step, which the sinks' run summary gets at the stage's first step. Use as a context
    manager around the steps (the bar), and :meth:`close` the records with how the run ended; they are
    written by process 0 only (``lead``).
    """

    def __init__(self, total: int, completed: int, *, console: Console, lead: bool, metrics_file: IO[str] | None,
                 train: TrainConfig, config: dict[str, Any], staged: bool, flops_per_token: float,
                 peak_flops: float | None, memory: Callable[[str], MemoryFigures | None] = lambda stage: None,
                 run_dir: str | None = None):
        self.total, self.completed, self.console, self.lead = total, completed, console, lead
        self.run_dir = run_dir  # checkpoint.dir: where the trackers' runs are recorded (RunReport)
        self.metrics_file = metrics_file if lead else None
        self.staged, self.flops_per_token, self.peak_flops = staged, flops_per_token, peak_flops
        self.report: RunReport | None = None
        self.train, self.config, self.memory = train, config, memory
        self.plain = None if console.is_terminal or not lead else PlainProgress(total, console.file)
        self.bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[stage]}{task.fields[comm]}/step"),
            TextColumn("{task.fields[routing]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not lead or self.plain is not None,  # a log file gets plain lines instead
        )
        self.task = None

    def started(self, step: int, weights: str) -> None:
        """The run's first line and first record: where its weights came from (``weights: ...``), at the
        step it starts after. A resumed run's metrics file keeps the records up to that step."""
        self.console.print(weights, soft_wrap=True)
        if self.metrics_file is not None:
            keep_records_up_to(self.metrics_file, step)
        self.report = RunReport(self.metrics_file, self.train, lead=self.lead, run_dir=self.run_dir)
        self.report.start(step, weights.removeprefix("weights: "), self.config)

    def __enter__(self) -> Self:
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=self.total, completed=self.completed, loss="-", tps="-", lr="-",
                                      stage="", comm="-", routing="")
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def close(self, outcome: Outcome) -> None:
        """Flush and end the records' sinks, with how the run ended (again: nothing happens)."""
        if self.report is not None:
            report, self.report = self.report, None
            report.close(outcome)

    def _compiled(self, step: int, stage: str) -> None:
        """``stage``'s step, compiled for ``step``: its per-device memory into the sinks' run summary
        (``memory/temp_bytes``, ...; ``memory/<stage>/...`` when the optimizer has stages)."""
        memory = self.memory(stage) if self.report is not None and self.report.sinks else None
        if memory is None:
            return
        prefix = f"memory/{stage}/" if self.staged else "memory/"
        figures = {"argument_bytes": memory.argument_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
                   "temp_bytes": memory.temp_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes,
                   "total_bytes": memory.total_bytes}
        self.report.summary(step, {prefix + name: float(value) for name, value in figures.items()})

    def note(self, text: str) -> None:
        """A line above the progress bar."""
        self.bar.console.print(text, soft_wrap=True)

    def stepped(self, step: int, *, loss: float, grad_norm: float, tokens_per_s: float, lr: float, stage: str,
                data_bytes: float, logged: bool, first_of_stage: bool, heldout: float | None = None,
                unigram: float = math.nan, bytes_per_token: float = math.nan,
                step_seconds: float = math.nan, reported: dict[str, float] | None = None) -> None:
        """A step done: the bar shows it when it is logged or opens a stage (its traffic at once); its
        record is written when it is logged or evaluated (``heldout``: its held-out loss, printed
        above the bar with the unigram baseline and, for text, nats per byte). ``reported``: what
        the layers measured this step (``"group/name"`` keys, e.g. ``moe/aux_loss``), added to it."""
        if first_of_stage:
            self._compiled(step, stage)
        if logged or first_of_stage:
            self.bar.update(self.task, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}",
                            stage=f"{stage} " if self.staged else "", comm=format_bytes(data_bytes))
        if reported:
            self.bar.update(self.task, routing=reported_summary(reported))
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "step_seconds": step_seconds, "lr": lr,
                  "grad_norm": grad_norm,
                  "stage": stage, "data_bytes": data_bytes, "model_flops_per_s": self.flops_per_token * tokens_per_s}
        if self.peak_flops:
            record["mfu"] = record["model_flops_per_s"] / self.peak_flops
        record.update(reported or {})
        if heldout is not None:
            logged = True
            record["heldout_loss"] = heldout
            per_byte = heldout / bytes_per_token
            if math.isfinite(per_byte):
                record["heldout_loss_per_byte"] = per_byte
            baseline = f" (unigram {unigram:.4f})" if math.isfinite(unigram) else ""
            self.bar.console.print(f"step {step}: held-out loss {heldout:.4f}{baseline}"
                                   + (f", {per_byte:.4f} nats/byte" if math.isfinite(per_byte) else ""))
        if logged:
            self.report.write(record)
            if self.plain is not None:
                self.plain.line(step, record, str(stage) if self.staged else "")

    def advance(self) -> None:
        self.bar.advance(self.task)


def keep_records_up_to(metrics_file: IO[str], step: int) -> None:
    """Drop metrics records of steps after ``step`` (a resumed run writes them again); a fresh run
    (``step`` 0) starts the file afresh. Files that cannot be re-read (pipes) are left alone."""
    if not (metrics_file.seekable() and metrics_file.readable()):
        return
    metrics_file.seek(0)
    kept = []
    for line in metrics_file.read().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the run was killed
            continue
        if record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    metrics_file.seek(0)
    metrics_file.truncate()
    metrics_file.writelines(kept)
    metrics_file.flush()



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
