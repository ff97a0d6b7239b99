"""The training loop's bookkeeping: what it accumulates over a run (:class:`RunRecord`, with the
per-stage step times in :class:`StageTiming`), and the small rules that decide what a step does besides
training -- which steps log, evaluate and checkpoint (:class:`Cadence`), and what a non-finite step
does (:class:`NonFinitePolicy`).

Apart from the loop so that each rule reads as one thing and the loop reads as the order of events.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from meshtron.checkpoint import CheckpointStore
from meshtron.config import Config, TrainConfig
from meshtron.errors import NonFiniteLossError


@dataclass
class StageTiming:
    """Steps run and bytes sent over ``data`` in each optimizer stage (1-bit LAMB: warmup, then
    compression), and the time of the steps that compile nothing -- all but each stage's first -- which
    is what tokens/s is measured on."""

    stage_steps: dict[str, int]
    tokens_per_step: int
    timed_steps: int = 0
    timed_seconds: float = 0.0
    data_bytes: float = 0.0  # bytes one device sent over `data`, all stages
    last_done: float = 0.0  # when the previous step finished (perf_counter)

    @classmethod
    def of(cls, stages: Iterable[str], cfg: Config) -> StageTiming:
        rows = cfg.train.batch_size * (2 if cfg.train.objective == "dpo" else 1)  # a DPO pair is two sequences
        return cls({name: 0 for name in stages}, rows * cfg.model.seq_len)

    def start(self) -> None:
        """The clock of the first step's interval starts now."""
        self.last_done = time.perf_counter()

    def lap(self, tick: float) -> tuple[float, float]:
        """A step has just finished: (seconds since ``tick``, its dispatch; seconds since the previous
        step finished)."""
        done = time.perf_counter()
        elapsed, interval, self.last_done = done - tick, done - self.last_done, done
        return elapsed, interval

    def add(self, stage: str, seconds: float, data_bytes: float) -> bool:
        """Counts a step of ``stage``; whether it was the stage's first (which includes its compilation,
        so its time is left out)."""
        if self.stage_steps[stage] > 0:
            self.timed_steps += 1
            self.timed_seconds += seconds
        self.data_bytes += data_bytes
        self.stage_steps[stage] += 1
        return self.stage_steps[stage] == 1

    @property
    def tokens_per_s(self) -> float:
        """Over the timed steps; NaN before there is one."""
        return self.tokens_per_step * self.timed_steps / self.timed_seconds if self.timed_seconds else float("nan")


@dataclass
class RunRecord:
    """What the loop accumulates: the losses, the held-out evaluations, the optimizer updates applied
    (a skipped step applies none), the stage timing, and where the run stopped early."""

    updates: int  # optimizer updates applied, counted from the restored position's
    timing: StageTiming
    schedule: Callable[[int], Any]  # the learning rate after a number of updates
    losses: list[float] = field(default_factory=list)
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)
    heldout: float = float("nan")  # the newest held-out loss
    stopped: tuple[int, int] | None = None  # (step, stop code) when the run stops early
    start: float = field(default_factory=time.perf_counter)  # for the run's wall time

    def stepped(self, loss: float, applied: bool, stage: str, seconds: float, data_bytes: float) -> bool:
        """Counts a step; whether it was its stage's first."""
        if applied:
            self.updates += 1
        self.losses.append(loss)
        return self.timing.add(stage, seconds, data_bytes)

    def lr(self, applied: bool) -> float:
        """The learning rate of the update the last step applied (or, skipped, would have applied)."""
        return float(self.schedule(self.updates - 1 if applied else self.updates))

    def evaluated(self, step: int, loss: float) -> float:
        self.heldout = loss
        self.evaluations.append((step, loss))
        return loss


@dataclass(frozen=True)
class Cadence:
    """Which steps log, evaluate on held-out data and checkpoint: every ``train.log_every``,
    ``train.eval_every`` and ``checkpoint.every`` steps, and the last step. A step that stops the run
    early logs and checkpoints but is not evaluated (the run is on its way out)."""

    steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int | None

    @classmethod
    def of(cls, cfg: Config) -> Cadence:
        t = cfg.train
        return cls(t.steps, t.log_every, t.eval_every, cfg.checkpoint.every)

    def logs(self, step: int, stop: int = 0) -> bool:
        return step % self.log_every == 0 or step == self.steps or bool(stop)

    def evaluates(self, step: int, stop: int) -> bool:
        return (step % self.eval_every == 0 or step == self.steps) and not stop

    def saves(self, step: int, stop: int) -> bool:
        return step % self.checkpoint_every == 0 or step == self.steps or bool(stop)


@dataclass
class NonFinitePolicy:
    """``train.on_nonfinite``: a step whose loss or gradient norm is not finite (or whose update the
    step did not apply) stops the run, or with ``skip`` leaves the parameters as they were -- until
    ``train.max_skipped_steps`` such steps come in a row."""

    on_nonfinite: str
    max_skipped_steps: int
    store: CheckpointStore | None  # named in the message: what a stopped run can resume from
    skipped_in_row: int = 0

    @classmethod
    def of(cls, t: TrainConfig, store: CheckpointStore | None) -> NonFinitePolicy:
        return cls(t.on_nonfinite, t.max_skipped_steps, store)

    def applies(self, step: int, loss: float, grad_norm: float, metrics, note: Callable[[str], None]) -> bool:
        """Whether the step's update counts (``metrics.was_applied()`` is asked only of a finite step);
        a skipped step is ``note``\\ d, and one the run cannot skip raises :class:`NonFiniteLossError`."""
        if math.isfinite(loss) and math.isfinite(grad_norm) and metrics.was_applied():
            self.skipped_in_row = 0
            return True
        if self.on_nonfinite == "stop" or self.skipped_in_row + 1 >= self.max_skipped_steps:
            raise NonFiniteLossError(self.message(step, loss, grad_norm, self.skipped_in_row + 1))
        self.skipped_in_row += 1
        note(f"step {step}: loss {loss}, gradient norm {grad_norm}: update skipped")
        return False

    def message(self, step: int, loss: float, grad_norm: float, in_row: int) -> str:
        saved = self.store.steps() if self.store is not None else []
        where = f"the newest checkpoint (step {saved[-1]}) is intact" if saved else "no checkpoint was written"
        if self.on_nonfinite == "skip":
            return (f"step {step}: {in_row} non-finite steps in a row (loss {loss}, gradient norm {grad_norm}), "
                    f"train.max_skipped_steps={self.max_skipped_steps}; stopped, {where}; lower train.lr")
        return (f"step {step}: loss {loss}, gradient norm {grad_norm} is not finite; stopped, {where}. "
                "Lower train.lr (or raise train.warmup_steps), or set train.on_nonfinite=skip to skip such steps")
