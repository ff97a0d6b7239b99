"""Preemption: SIGTERM/SIGINT and ``train.max_minutes`` end a run after the step in flight with a
checkpoint of that step on disk, one line saying why, and exit status 75; the same command then
resumes it and ends bit for bit where an uninterrupted run ends.

One real CLI process gets a real SIGTERM; the other cases run in this process (sharing one
trainer's compiled steps) and signal themselves from the trainer's event hook, at a known step.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

from meshtron.checkpoint import CheckpointStore
from meshtron.config import ConfigError, load_config
from meshtron.errors import EXIT_STOPPED, RunStopped
from meshtron.train.loop import Trainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 50  # enough that the CLI run cannot finish between its first logged step and the signal
RUN = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.mlp_dim=64", "model.seq_len=16",
       "train.batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2", "train.log_every=1",
       "train.eval_every=1000", "train.eval_batches=1", "parallel.data=8", "parallel.pipe=1", "parallel.tensor=1",
       "checkpoint.every=1000"]


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    return Trainer.from_config(load_config(None, RUN))


@pytest.fixture(scope="module")
def straight(trainer) -> list[float]:
    """The uninterrupted run's losses (no checkpoints)."""
    return trainer.run().losses


def configured(t: Trainer, checkpoint_dir: Path | None, **train) -> Trainer:
    """``t`` (compiled steps shared) with another checkpoint.dir and train.* values."""
    directory = None if checkpoint_dir is None else str(checkpoint_dir)
    cfg = replace(t.cfg, checkpoint=replace(t.cfg.checkpoint, dir=directory), train=replace(t.cfg.train, **train))
    return replace(t, resolved=replace(t.resolved, cfg=cfg))


def signal_at(event: str, step: int, *signals: int):
    def hook(at_event: str, at_step: int) -> None:
        if at_event == event and at_step == step:
            for sig in signals:
                os.kill(os.getpid(), sig)
    return hook


def sigterm_after_first_record(proc: subprocess.Popen, metrics: Path) -> tuple[str, str]:
    """SIGTERM ``proc`` once its first metrics record exists (a step done: compiled and training);
    its (stdout, stderr) once it has exited."""
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        return proc.communicate(timeout=300)
    finally:
        proc.kill()


def records(metrics: Path) -> list[dict]:
    """The per-step records (not the start records that say where each run's weights came from)."""
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_sigterm_stops_a_cli_run_with_a_checkpoint_and_the_resumed_run_is_bitwise(tmp_path, trainer, straight):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    env = subprocess_env()  # the CLI adds the device flag itself
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron.cli", "train", "--metrics", str(metrics), *RUN, f"checkpoint.dir={ckpt}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = sigterm_after_first_record(proc, metrics)
    assert proc.returncode == EXIT_STOPPED, err
    logged = records(metrics)
    stopped = logged[-1]["step"]
    assert 1 <= stopped < STEPS
    assert (f"meshtron: stopped at step {stopped} of {STEPS} (SIGTERM received): checkpoint {ckpt}/{stopped} "
            "written; the same command resumes from it (exit status 75)") in err
    assert "Traceback" not in err and "held-out loss" not in out  # no traceback, no summary of a finished run
    assert CheckpointStore(ckpt, keep=3).steps() == [stopped]  # (checkpoint.every=1000: only the stop's save)
    assert [r["step"] for r in logged] == list(range(1, stopped + 1))

    with open(metrics, "a+") as f:
        resumed = configured(trainer, ckpt).run(metrics_file=f)
    assert resumed.first_step == stopped + 1
    assert [r["loss"] for r in records(metrics)] == straight  # bitwise, every logged step


@pytest.fixture
def sigint_not_ignored():
    """SIGINT as an interactive shell leaves it. A suite started in the background (``cmd &`` from a
    script) inherits SIGINT ignored, and the run rightly keeps an ignored signal ignored."""
    inherited = signal.getsignal(signal.SIGINT)
    if inherited is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


@pytest.mark.usefixtures("sigint_not_ignored")
def test_sigint_once_stops_after_the_step_in_flight(tmp_path, trainer, straight, capsys):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    t = configured(trainer, tmp_path, log_every=4)
    metrics = tmp_path / "m.jsonl"
    with open(metrics, "a+") as f, pytest.raises(RunStopped) as info:
        t.run(metrics_file=f, on_event=signal_at("dispatched", 2, signal.SIGINT))
    assert (info.value.step, info.value.reason, info.value.checkpoint) == (2, "SIGINT", f"{tmp_path}/2")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers restored
    err = capsys.readouterr().err
    assert "meshtron: SIGINT received: stopping after the step in flight" in err
    assert f"meshtron: stopped at step 2 of {STEPS} (SIGINT received): checkpoint {tmp_path}/2 written" in err
    assert CheckpointStore(tmp_path, keep=3).steps() == [2]
    assert [r["step"] for r in records(metrics)] == [2]  # the stopping step is logged even off log_every

    resumed = t.run()
    assert resumed.first_step == 3 and resumed.losses == straight[2:]


def test_a_second_sigterm_does_not_cut_the_checkpoint_short(tmp_path, trainer, capsys):
    t = configured(trainer, tmp_path)
    with pytest.raises(RunStopped) as info:
        t.run(on_event=signal_at("dispatched", 1, signal.SIGTERM, signal.SIGTERM))
    assert info.value.step == 1 and info.value.reason == "SIGTERM"
    assert "meshtron: SIGTERM again: ignored while the run stops" in capsys.readouterr().err
    assert CheckpointStore(tmp_path, keep=3).steps() == [1]


def test_max_minutes_stops_at_the_first_step_past_the_budget(tmp_path, trainer, straight, capsys):
    t = configured(trainer, tmp_path, max_minutes=1e-6)  # 60 µs: over before the first step is done
    with pytest.raises(RunStopped) as info:
        t.run()
    assert (info.value.step, info.value.reason) == (1, "max_minutes")
    err = capsys.readouterr().err
    assert f"meshtron: stopped at step 1 of {STEPS} (train.max_minutes=1e-06 reached after " in err
    assert CheckpointStore(tmp_path, keep=3).steps() == [1]
    resumed = configured(trainer, tmp_path).run()  # the budget is per run: lifted here, the run ends
    assert resumed.first_step == 2 and resumed.losses == straight[1:]

    with pytest.raises(RunStopped) as info:  # without checkpoint.dir it stops all the same, and says so
        configured(trainer, None, max_minutes=1e-6).run()
    assert info.value.checkpoint is None
    assert "no checkpoint written (checkpoint.dir is unset)" in str(info.value)


def test_max_minutes_must_be_positive():
    with pytest.raises(ConfigError, match=r"train\.max_minutes: must be > 0"):
        load_config(None, ["train.max_minutes=0"])
    assert load_config(None, ["train.max_minutes=90"]).train.max_minutes == 90


def test_sigterm_to_meshtron_launch_stops_every_process_at_one_step(tmp_path):
    """SLURM signals the job step; `meshtron launch` passes it on and all processes stop together."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    env = subprocess_env()
    run = [arg for arg in RUN if not arg.startswith("mesh.")] + ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtron.cli", "launch", "--processes", "2", "--metrics", str(metrics), *run,
         f"checkpoint.dir={ckpt}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    out, _ = sigterm_after_first_record(proc, metrics)
    assert proc.returncode == EXIT_STOPPED, out
    stopped = records(metrics)[-1]["step"]
    assert f"stopped at step {stopped} of {STEPS} (SIGTERM received)" in out
    assert CheckpointStore(ckpt, keep=3).steps() == [stopped]
    assert "Traceback" not in out
