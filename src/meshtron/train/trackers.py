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
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

from meshtron.config import TRACKERS, MlflowConfig, TrainConfig, WandbConfig
from meshtron.errors import EXIT_STOPPED, ConfigError
from meshtron.train.sinks import MetricSink, Outcome, flat, scalars


def open_trackers(train: TrainConfig) -> list[MetricSink]:
    """The trackers ``train.trackers`` names, in its order (none started yet: :meth:`MetricSink.start`)."""
    makers = {"wandb": lambda: WandbTracker(train.wandb), "mlflow": lambda: MlflowTracker(train.mlflow)}
    return [makers[name]() for name in train.trackers]


def _library(name: str) -> Any:
    """The tracker's library, or the one line that says which extra installs it."""
    assert name in TRACKERS
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"train.trackers: {name} is not installed; pip install 'meshtron[{name}]'") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


class _Tracker:
    """What both trackers share: stop recording, with one line, after the library's first error."""

    label = ""
    errors: tuple[type[BaseException], ...] = ()

    def _failed(self, err: BaseException, step: int | None) -> None:
        at = f" at step {step}" if step is not None else ""
        print(f"meshtron: train.trackers: {self.label} stopped recording{at}: {_one_line(err)}", file=sys.stderr)


class WandbTracker(_Tracker):
    """A W&B run: each record's :func:`scalars` logged at its step, the config as ``run.config``, the
    start line and the memory figures in ``run.summary``; finished with exit code 0, 1 (failed) or 75
    (stopped: marked preempting, as a run that resumes)."""

    label = "W&B"

    def __init__(self, settings: WandbConfig):
        self.wandb = _library("wandb")
        self.settings = settings
        self.errors = (self.wandb.errors.Error,)
        self.run = None

    def start(self, step: int, weights: str, config: dict[str, Any]) -> None:
        s = self.settings
        try:
            # create_new: a run of the caller's own (a notebook's) stays open beside this one
            self.run = self.wandb.init(project=s.project, entity=s.entity, name=s.name, tags=list(s.tags) or None,
                                       config=config, reinit="create_new")
        except self.errors as err:
            raise ConfigError(f"train.trackers: W&B could not start a run ({_one_line(err)}); log in with "
                              "`wandb login` or set WANDB_MODE=offline") from None
        self.run.summary["run/weights"] = weights

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


class MlflowTracker(_Tracker):
    """An MLflow run (through ``MlflowClient``, so no global active run is set or ended): each record's
    :func:`scalars` as metrics at its step, the config as parameters with dotted keys (``train.lr``), the
    start line as the tag ``run/weights``, the memory figures as metrics at the step they were compiled
    at; ended ``FINISHED``, ``FAILED`` or ``KILLED`` (stopped)."""

    label = "MLflow"

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
            run = self.client.create_run(self._experiment_id(), run_name=s.run_name, tags={"run/weights": weights})
            self.run_id = run.info.run_id
            self.client.log_batch(self.run_id, params=[Param(key, _param(value)) for key, value in flat(config).items()])
        except self.errors as err:
            where = self.client.tracking_uri if self.client is not None else s.tracking_uri
            raise ConfigError(f"train.trackers: MLflow could not start a run at {where} ({_one_line(err)}); set "
                              "train.mlflow.tracking_uri or MLFLOW_TRACKING_URI to a store it can write "
                              "(sqlite:///mlflow.db, a server's http://...)") from None

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
