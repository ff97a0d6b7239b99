"""Experiment trackers as metric sinks (:class:`meshtron.train.sinks.MetricSink`): Weights & Biases and
MLflow get the records the metrics JSONL gets, at the same steps, under TensorBoard's tags; the resolved
config as the run's hyperparameters; the compiled step's memory as its summary; and how the run ended.

Each library is an extra (``pip install 'meshtron[wandb]'``, ``'meshtron[mlflow]'``), imported only
when its tracker is on; ``train.trackers`` naming a missing one is refused when the config is checked
(:func:`meshtron.config.validate_trackers`). Everything a library reads from its environment is left to
it (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_API_KEY``, ``MLFLOW_TRACKING_URI``, ...): meshtron
passes only what the config sets. A tracker that cannot start its run is a :class:`ConfigError` before
the first step; one that fails later (a server gone) says so in one line and stops recording, because
an outage of a dashboard must not end a training run.

**Resuming.** With ``checkpoint.dir``, the trackers' runs are named in ``tracker_runs.json`` beside the
checkpoints (:data:`meshtron.checkpoint_dirs.TRACKER_RUNS`; written by process 0, under a temporary name
then renamed), and a run that resumes from a checkpoint there continues them: the same W&B run
(``id=``, ``resume="allow"``) and the same MLflow run (its ``run_id``, set running again), its steps
after the ones already recorded. MLflow's parameters cannot change: a resumed run adds the ones the
first did not have, and those it changed (``train.steps``) keep their first values there (the W&B
config and the metrics JSONL's start record have the new ones).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from meshtron.checkpoint_dirs import TRACKER_RUNS
from meshtron.config import TRACKERS, MlflowConfig, TrainConfig, WandbConfig
from meshtron.errors import EXIT_STOPPED, ConfigError
from meshtron.train.sinks import MetricSink, Outcome, flat, scalars


def open_trackers(train: TrainConfig) -> list[MetricSink]:
    """The trackers ``train.trackers`` names, in its order (none started yet: :meth:`MetricSink.start`)."""
    makers = {"wandb": lambda: WandbTracker(train.wandb), "mlflow": lambda: MlflowTracker(train.mlflow)}
    return [makers[name]() for name in train.trackers]


def read_tracker_runs(directory: str | Path) -> dict[str, str]:
    """``{tracker: run id}`` of the runs recorded in ``directory`` (none when there is no readable file)."""
    try:
        runs = json.loads((Path(directory) / TRACKER_RUNS).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in runs.items() if k in TRACKERS and isinstance(v, str)} if isinstance(runs, dict) else {}


def save_tracker_runs(directory: str | Path, runs: dict[str, str]) -> None:
    """Record ``{tracker: run id}`` in ``directory`` (which the run's checkpoint store made or was given):
    written whole under a temporary name, then renamed over the old record."""
    path = Path(directory) / TRACKER_RUNS
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(runs, indent=1) + "\n")
    os.replace(partial, path)


def _library(name: str) -> Any:
    """The tracker's library, or the one line that says which extra installs it."""
    assert name in TRACKERS
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"train.trackers: {name} is not installed; pip install 'meshtron[{name}]'") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


class Tracker:
    """What both trackers share: stop recording, with one line, after the library's first error."""

    name = ""  # as train.trackers names it
    label = ""
    errors: tuple[type[BaseException], ...] = ()
    resume: str | None = None  # the id of the run to continue (set before start), else a new run

    @property
    def run_ref(self) -> str | None:
        """The started run's id, which a resumed run continues (:attr:`resume`)."""

    def _failed(self, err: BaseException, step: int | None) -> None:
        at = f" at step {step}" if step is not None else ""
        print(f"meshtron: train.trackers: {self.label} stopped recording{at}: {_one_line(err)}", file=sys.stderr)


class WandbTracker(Tracker):
    """A W&B run: each record's :func:`scalars` logged at its step, the config as ``run.config``, the
    start line and the memory figures in ``run.summary``; finished with exit code 0, 1 (failed) or 75
    (stopped: marked preempting, as a run that resumes)."""

    name, label = "wandb", "W&B"

    def __init__(self, settings: WandbConfig):
        self.wandb = _library("wandb")
        self.settings = settings
        self.errors = (self.wandb.errors.Error,)
        self.run = None

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        s = self.settings
        try:
            # create_new: a run of the caller's own (a notebook's) stays open beside this one
            resumed = {"id": self.resume, "resume": "allow"} if self.resume else {}
            self.run = self.wandb.init(project=s.project, entity=s.entity, name=s.name, tags=list(s.tags) or None,
                                       config=config, reinit="create_new", **resumed)
        except self.errors as err:
            raise ConfigError(f"train.trackers: W&B could not start a run ({_one_line(err)}); log in with "
                              "`wandb login` or set WANDB_MODE=offline") from None
        self.run.summary["run/weights"] = weights
        self._id = self.run.id

    @property
    def run_ref(self) -> str | None:
        return getattr(self, "_id", None)

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._call(step, lambda: self.run.log(scalars(record), step=step))

    def summary(self, step: int, values: dict[str, float]) -> None:
        self._call(step, lambda: self.run.summary.update(values))

    def close(self, outcome: Outcome) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            if outcome == "stopped":
                run.mark_preempting()
            run.finish(exit_code={"finished": 0, "failed": 1, "stopped": EXIT_STOPPED}[outcome])
        except self.errors as err:
            self._failed(err, None)

    def _call(self, step: int, call) -> None:
        if self.run is None:
            return
        try:
            call()
        except self.errors as err:
            self._failed(err, step)
            self.run.finish(exit_code=1)
            self.run = None


class MlflowTracker(Tracker):
    """An MLflow run (through ``MlflowClient``, so no global active run is set or ended): each record's
    :func:`scalars` as metrics at its step, the config as parameters with dotted keys (``train.lr``), the
    start line as the tag ``run/weights``, the memory figures as metrics at the step they were compiled
    at; ended ``FINISHED``, ``FAILED`` or ``KILLED`` (stopped)."""

    name, label = "mlflow", "MLflow"

    def __init__(self, settings: MlflowConfig):
        self.mlflow = _library("mlflow")
        from mlflow.exceptions import MlflowException

        self.settings = settings
        self.errors = (MlflowException, OSError)
        self.client = None
        self.run_id: str | None = None

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        s = self.settings
        try:
            self.client = MlflowClient(s.tracking_uri)  # None: MLFLOW_TRACKING_URI, else MLflow's default
            known = self._resumed()
            if known is None:
                run = self.client.create_run(self._experiment_id(), run_name=s.run_name, tags={"run/weights": weights})
                self.run_id, known = run.info.run_id, {}
            else:
                self.run_id = self.resume
                self.client.update_run(self.run_id, status="RUNNING")
                self.client.set_tag(self.run_id, "run/weights", weights)
            self.client.log_batch(self.run_id, params=[Param(key, _param(value)) for key, value in flat(config).items()
                                                       if key not in known])
        except self.errors as err:
            where = self.client.tracking_uri if self.client is not None else s.tracking_uri
            raise ConfigError(f"train.trackers: MLflow could not start a run at {where} ({_one_line(err)}); set "
                              "train.mlflow.tracking_uri or MLFLOW_TRACKING_URI to a store it can write "
                              "(sqlite:///mlflow.db, a server's http://...)") from None

    @property
    def run_ref(self) -> str | None:
        return self.run_id

    def _resumed(self) -> dict[str, str] | None:
        """The parameters of the run :attr:`resume` names, None when there is none to continue (none
        named, or not in this store: deleted, or another tracking URI)."""
        if not self.resume:
            return None
        try:
            return dict(self.client.get_run(self.resume).data.params)
        except self.errors:
            return None

    def _experiment_id(self) -> str:
        """``train.mlflow.experiment`` (made if missing), else MLflow's own choice: the environment's
        ``MLFLOW_EXPERIMENT_NAME`` or ``MLFLOW_EXPERIMENT_ID``, else the ``Default`` experiment."""
        name = self.settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._metrics(step, scalars(record))

    def summary(self, step: int, values: dict[str, float]) -> None:
        self._metrics(step, values)

    def _metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None or not values:
            return
        now = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])
        except self.errors as err:
            self._failed(err, step)
            self.run_id = None

    def close(self, outcome: Outcome) -> None:
        run_id, self.run_id = self.run_id, None
        if run_id is None:
            return
        try:
            self.client.set_terminated(run_id, {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}[outcome])
        except self.errors as err:
            self._failed(err, None)


def _param(value: Any) -> str:
    """A config value as an MLflow parameter: strings as they are, the rest as JSON (``null``, ``true``,
    ``[1, 2]``), cut to the longest value MLflow stores."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_PARAM_VAL_LENGTH else text[:MAX_PARAM_VAL_LENGTH - 3] + "..."
