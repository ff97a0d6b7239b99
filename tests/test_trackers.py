"""Experiment trackers (``train.trackers``): offline W&B and MLflow runs hold every scalar the metrics
JSONL holds, at the same steps, the resolved config as hyperparameters, the compiled step's memory as a
summary, and how each run ended (finished, failed, stopped) -- read back with each library's own
reader (``wandb leet inspect`` on the offline run's ``.wandb`` log, ``MlflowClient``). A missing library
is one line naming the extra. One tiny single-device trainer serves every run (one compile)."""

import json
import math
import subprocess
import sys

import jax
import pytest

from meshtron.cli import main
from meshtron.config import ConfigError, load_config, to_dict
from meshtron.errors import EXIT_STOPPED, RunStopped
from meshtron.train.loop import Trainer
from meshtron.train.sinks import SCALARS

MODEL = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.mlp_dim=64", "model.seq_len=16",
         "train.batch_size=4", "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1"]
RUN = ["train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.peak_flops=1e12",
       "train.trackers=[wandb,mlflow]", "train.wandb.project=meshtron-tests", "train.wandb.tags=[tiny,cpu]",
       "train.mlflow.experiment=meshtron-tests"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of one trainer, each tracked offline by W&B and in a local MLflow store: ``finished``
    (4 steps, with its metrics JSONL), ``failed`` (its second step raises) and ``stopped``
    (``train.max_minutes`` passed at once)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", str(tmp))
        env.setenv("WANDB_SILENT", "true")
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        trainer = Trainer.from_config(load_config(None, [*MODEL, *RUN]), devices=jax.devices()[:1])
        t = trainer.cfg.train

        def named(name: str) -> None:
            t.wandb.name = t.mlflow.run_name = name

        named("finished")
        metrics = tmp / "metrics.jsonl"
        with open(metrics, "w") as f:
            trainer.run(metrics_file=f)
        config = json.loads(json.dumps(to_dict(trainer.cfg)))  # the resolved config (parallel.data=1) it ran with

        named("failed")
        step, calls = trainer.steps.train, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the device went away")
            return step(*args, **kwargs)

        env.setattr(trainer.steps, "train", failing)
        with pytest.raises(RuntimeError, match="went away"):
            trainer.run()
        env.setattr(trainer.steps, "train", step)

        named("stopped")
        env.setattr(t, "max_minutes", 1e-9)
        with pytest.raises(RunStopped):
            trainer.run()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return trainer, records, config, tmp


def expected_scalars(records):
    """step -> {tag: value}: every finite number of each logged step's JSONL record, under its tag
    (the TensorBoard tags; ``group/name`` keys as they are)."""
    out = {}
    for record in records:
        if record.get("event") == "start":
            continue
        out[record["step"]] = {SCALARS.get(key, key): value for key, value in record.items()
                               if (key in SCALARS or "/" in key) and isinstance(value, (int, float))
                               and math.isfinite(value)}
    return out


def dotted(config, prefix=""):
    keys = set()
    for key, value in config.items():
        if isinstance(value, dict) and value:
            keys |= dotted(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def wandb_runs(directory):
    """display name -> the records of its offline run's transaction log, as W&B's own reader prints them."""
    found = {}
    for log in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        shown = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                               capture_output=True, text=True, check=True, timeout=120)
        records = [json.loads(line) for line in shown.stdout.splitlines() if line.startswith("{")]
        name = next(r["run"]["display_name"] for r in records if r["type"] == "run")
        found[name] = records
    return found


@pytest.mark.slow
def test_wandb_holds_every_jsonl_scalar_at_its_step_the_config_and_the_memory(runs):
    trainer, records, config, tmp = runs
    logged = wandb_runs(tmp)
    assert set(logged) == {"finished", "failed", "stopped"}
    finished = logged["finished"]
    history = {r["history"]["step"]["num"]: {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
               for r in finished if r["type"] == "history"}
    expected = expected_scalars(records)
    assert sorted(history) == sorted(expected) == [1, 2, 3, 4]
    assert "eval/heldout_loss" in expected[2] and "perf/model_flops_utilisation" in expected[4]
    for step, scalars in expected.items():
        assert history[step] == pytest.approx(scalars), step
    run = next(r["run"] for r in finished if r["type"] == "run")
    assert run["project"] == "meshtron-tests" and run["tags"] == ["tiny", "cpu"]
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == config
    assert config["parallel"]["data"] == 1 and config["train"]["wandb"]["name"] == "finished"
    summary = {}
    for r in finished:
        if r["type"] == "summary":
            summary.update(r["summary"]["update"])
    memory = trainer.steps.memory()
    assert memory.total_bytes > 0 and summary["memory/total_bytes"] == memory.total_bytes
    assert summary["memory/temp_bytes"] == memory.temp_size_in_bytes
    assert summary["run/weights"] == "a new model from seed 0"
    exits = {name: next(r["exit"].get("exit_code", 0) for r in log if r["type"] == "exit") for name, log in logged.items()}
    assert exits == {"finished": 0, "failed": 1, "stopped": EXIT_STOPPED}
    assert [r["history"]["step"]["num"] for r in logged["failed"] if r["type"] == "history"] == [1]


@pytest.mark.slow
def test_mlflow_holds_every_jsonl_scalar_at_its_step_the_config_and_the_memory(runs):
    from mlflow.tracking import MlflowClient

    trainer, records, config, tmp = runs
    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("meshtron-tests")
    tracked = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert {name: r.info.status for name, r in tracked.items()} == {
        "finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
    run = tracked["finished"]
    expected = expected_scalars(records)
    tags = {tag for scalars in expected.values() for tag in scalars}
    assert set(run.data.metrics) - tags == {f"memory/{name}_bytes" for name in ("argument", "output", "temp", "alias",
                                                                                  "total")}
    for tag in tags:
        history = client.get_metric_history(run.info.run_id, tag)
        assert [m.step for m in history] == [step for step, scalars in expected.items() if tag in scalars], tag
        assert {m.step: m.value for m in history} == pytest.approx(
            {step: scalars[tag] for step, scalars in expected.items() if tag in scalars}), tag
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/heldout_loss")] == [2, 4]
    memory = client.get_metric_history(run.info.run_id, "memory/total_bytes")
    assert [(m.step, m.value) for m in memory] == [(1, trainer.steps.memory().total_bytes)]
    params = run.data.params
    assert set(params) == dotted(config)
    assert params["parallel.data"] == "1" and params["train.lr"] == str(trainer.cfg.train.lr)
    assert params["train.trackers"] == '["wandb", "mlflow"]' and params["data.path"] == "null"
    assert run.data.tags["run/weights"] == "a new model from seed 0"


def test_a_missing_tracker_library_is_one_line_naming_the_extra(monkeypatch, capsys):
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # `import wandb` fails; find_spec finds nothing
        with pytest.raises(ConfigError, match=rf"^train.trackers: {name} is not installed; "
                                              rf"pip install 'meshtron\[{name}\]'$"):
            load_config(None, [f"train.trackers=[{name}]"])
    assert main(["train", *MODEL, "train.trackers=[mlflow]"]) == 2  # refused before anything runs
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "meshtron: error: train.trackers: mlflow is not installed; pip install 'meshtron[mlflow]'"]
    from meshtron.train.trackers import WandbTracker

    with pytest.raises(ConfigError, match=r"pip install 'meshtron\[wandb\]'"):
        WandbTracker(load_config(None).train.wandb)


def test_a_tracker_that_cannot_start_its_run_is_one_line():
    pytest.importorskip("mlflow")
    from meshtron.config import MlflowConfig
    from meshtron.train.trackers import MlflowTracker

    with pytest.raises(ConfigError, match=r"^train.trackers: MLflow could not start a run at nowhere://x \(.*\); set "
                                          r"train.mlflow.tracking_uri or MLFLOW_TRACKING_URI to a store it can write"):
        MlflowTracker(MlflowConfig(tracking_uri="nowhere://x")).start(0, "a new model from seed 0", {"train": {}})


def test_only_the_first_process_opens_the_trackers(monkeypatch):
    from meshtron.train.reporting import RunReport

    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # not even imported by the other processes
    train = load_config(None).train
    train.trackers = ["wandb", "mlflow"]
    assert RunReport(None, train, lead=False).sinks == []
    with pytest.raises(ConfigError, match=r"meshtron\[wandb\]"):
        RunReport(None, train, lead=True)


def test_tracker_names_are_checked():
    with pytest.raises(ConfigError, match="train.trackers: 'neptune' is not a tracker; use wandb or mlflow"):
        load_config(None, ["train.trackers=[neptune]"])
    with pytest.raises(ConfigError, match=r"train.trackers: names a tracker twice: \['wandb', 'wandb'\]"):
        load_config(None, ["train.trackers=[wandb,wandb]"])
    with pytest.raises(ConfigError, match="train.wandb.projct .*valid keys: project, entity, name, tags"):
        load_config(None, ["train.wandb.projct=x"])


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch, request):
    """Two steps, then the same command resumed to four from the checkpoint directory: one W&B run (the
    resumed part's offline log carries the first part's run id) and one MLflow run, with steps 1..4; the
    runs' ids are recorded beside the checkpoints."""
    wandb = pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from meshtron.checkpoint_dirs import TRACKER_RUNS

    wandb.teardown()  # W&B reads WANDB_DIR once a process: forget the earlier tests' (it starts again below)
    request.addfinalizer(wandb.teardown)  # and this test's, for the tests after it

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    saved = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=2", "checkpoint.async_save=false"]
    trainer = Trainer.from_config(load_config(None, [*MODEL, *RUN, *saved, "train.steps=2"]), devices=jax.devices()[:1])
    trainer.run()
    recorded = json.loads((tmp_path / "ck" / TRACKER_RUNS).read_text())
    assert set(recorded) == {"wandb", "mlflow"}
    monkeypatch.setattr(trainer.cfg.train, "steps", 4)  # the same run, asked for two more steps
    trainer.run()
    assert json.loads((tmp_path / "ck" / TRACKER_RUNS).read_text()) == recorded

    logs = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(log.name == f"run-{recorded['wandb']}.wandb" for log in logs)
    steps = []
    for log in logs:
        shown = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                               capture_output=True, text=True, check=True, timeout=120)
        records = [json.loads(line) for line in shown.stdout.splitlines() if line.startswith("{")]
        assert {r["run"]["run_id"] for r in records if r["type"] == "run"} == {recorded["wandb"]}
        steps += [r["history"]["step"]["num"] for r in records if r["type"] == "history"]
    assert steps == [1, 2, 3, 4]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("meshtron-tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == recorded["mlflow"] and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert run.data.params["train.steps"] == "2"  # MLflow's parameters keep their first values


def test_the_tracker_runs_file_is_read_back_and_goes_with_an_unused_checkpoint_directory(tmp_path):
    from meshtron.checkpoint import CheckpointStore
    from meshtron.checkpoint_dirs import TRACKER_RUNS
    from meshtron.train.trackers import read_tracker_runs, save_tracker_runs

    store = CheckpointStore(tmp_path / "runs" / "ck", async_save=False)
    save_tracker_runs(store.directory, {"wandb": "abc123", "mlflow": "0f1e"})
    assert read_tracker_runs(store.directory) == {"wandb": "abc123", "mlflow": "0f1e"}
    assert sorted(p.name for p in store.directory.iterdir()) == [TRACKER_RUNS]  # no temporary left
    (store.directory / TRACKER_RUNS).write_text("{not json")
    assert read_tracker_runs(store.directory) == {}  # an unreadable record: new runs
    store.discard_if_unused()  # a run that failed before its first checkpoint
    assert list(tmp_path.iterdir()) == []
