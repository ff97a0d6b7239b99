"""Where a run's records are written: the metrics JSONL, TensorBoard event files, and the experiment
trackers (:mod:`meshtron.train.trackers`), all behind one small interface, :class:`MetricSink`.

Why one seam: every sink must get the same figures at the same steps. The loop makes each logged
step's record once (:class:`meshtron.train.reporting.RunProgress`) and hands it to every sink; a sink
only decides how its store spells it (:func:`scalars`: the JSONL keys -> TensorBoard-style tags, which
W&B and MLflow group by their prefix too). The rest of a run's story -- where its weights came from,
its resolved config, its compiled step's memory, and how it ended (finished, failed, stopped with a
checkpoint) -- goes through the same calls, each sink keeping what its store can hold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import yaml

Outcome = Literal["finished", "failed", "stopped"]
"""How a run ended: all its steps done, an error, or stopped early (a signal, ``train.max_minutes``)
after writing a checkpoint that the same command resumes from."""

# JSONL keys -> the tags the other sinks write them under (grouped by the prefix); every other
# ``"group/name"`` key of a record (``moe/aux_loss``, ``mtp/loss``) keeps its name.
SCALARS = {
    "loss": "train/loss",
    "heldout_loss": "eval/heldout_loss",
    "heldout_loss_per_byte": "eval/heldout_nats_per_byte",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_seconds": "perf/step_seconds",
    "model_flops_per_s": "perf/model_flops_per_s",
    "mfu": "perf/model_flops_utilisation",
    "data_bytes": "comm/bytes_over_data_per_step",
}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A step's record as the sinks other than the JSONL name its figures: the known ones under their
    tags (:data:`SCALARS`), every ``"group/name"`` key as it is; only finite numbers (the JSONL keeps a
    step's NaN throughput, a chart has no point for it)."""
    tags = {**SCALARS, **{key: key for key in record if "/" in key}}
    return {tag: float(record[key]) for key, tag in tags.items()
            if isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool)
            and math.isfinite(record[key])}


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (``train.lr``), for stores whose parameters are flat."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MetricSink(Protocol):
    """One store of a run's records. Calls come in this order: :meth:`start` once, then :meth:`write`
    for each logged step and :meth:`summary` when a step's program has been compiled, then
    :meth:`close` once, whatever happened."""

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        """The run begins after ``step`` (0, or the step it resumed at) with ``weights`` (where they came
        from, one line) and ``config`` (the resolved config, as ``--print-config`` shows it)."""

    def write(self, step: int, record: dict[str, Any]) -> None:
        """A logged step's record: the JSONL's keys and values (:func:`scalars` names them for a chart)."""

    def summary(self, step: int, values: dict[str, float]) -> None:
        """Figures of the run as a whole, known at ``step`` (the compiled step's memory)."""

    def close(self, outcome: Outcome) -> None:
        """Flush and end the store's run, recording how it ended."""


class JsonLines:
    """The ``--metrics`` file: one JSON object per record, the start record first (``"event": "start"``).
    Flushed per line so that a killed run's file holds every step it logged."""

    def __init__(self, file: IO[str]):
        self.file = file

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        self._line({"step": step, "event": "start", "weights": weights})

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._line(record)

    def summary(self, step: int, values: dict[str, float]) -> None:
        """Nothing: the file holds the steps' records, which a resumed run rewrites from its step on."""

    def close(self, outcome: Outcome) -> None:
        self.file.flush()

    def _line(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


class TensorBoard:
    """Scalars into TensorBoard event files (``tensorboardX``'s writer, no TensorFlow needed); the start
    line and the resolved config as text (``run/weights``, ``run/config``)."""

    def __init__(self, directory: str | Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(directory), flush_secs=10)

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        self.writer.add_text("run/weights", weights, global_step=step)
        self.writer.add_text("run/config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```",
                             global_step=step)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)

    def summary(self, step: int, values: dict[str, float]) -> None:
        """Nothing: event files have no run summary."""

    def close(self, outcome: Outcome) -> None:
        self.writer.flush()
        self.writer.close()
