"""Real crashes: a training process SIGKILLed mid-step and mid-save resumes from the newest complete
checkpoint and ends exactly where an uninterrupted run ends."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import subprocess_env

from meshtron.checkpoint import CheckpointStore
from meshtron.config import load_config
from meshtron.train.loop import Trainer

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
RUN = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.mlp_dim=64", "model.seq_len=16",
       "train.batch_size=8", "train.steps=8", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=1000",
       "train.eval_batches=1", "parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "train.optimizer=onebit_lamb",
       "optim.freeze_step=3"]


def killable(event: str, step: int, metrics: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run([sys.executable, str(HERE / "killable_run.py"), event, str(step), str(metrics), *overrides],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_sigkill_mid_step_and_mid_save_loses_nothing_past_the_last_checkpoint(tmp_path):
    ckpt = [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2", "checkpoint.keep=10"]
    metrics = tmp_path / "metrics.jsonl"
    store_steps = []
    for event, step in [("saving", 4), ("dispatched", 7), ("never", 0)]:
        before = CheckpointStore(tmp_path / "ckpt", keep=10).steps() if (tmp_path / "ckpt").exists() else []
        run = killable(event, step, metrics, *RUN, *ckpt)
        if event == "never":
            assert run.returncode == 0, run.stderr
        else:
            assert run.returncode == -signal.SIGKILL, run.stderr
        if before:  # it resumed from the newest checkpoint that was complete when it started
            assert f"resumed from {tmp_path / 'ckpt'}/{before[-1]} " in run.stderr
        store_steps.append(CheckpointStore(tmp_path / "ckpt", keep=10).steps())
    # killed right after save(4) returned: 4 may or may not have been committed -- never half of it
    assert store_steps[0][:2] == [2, 4][: len(store_steps[0])] and store_steps[0][0] == 2
    # killed mid-step 7, with the async save of 6 maybe still in flight: 4 is certainly complete (a save
    # waits for the previous one), 6 only if its files were all written
    assert 4 in store_steps[1] and store_steps[1][-1] in (4, 6)
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))

    straight = Trainer.from_config(load_config(None, RUN)).run()
    assert [r["loss"] for r in records] == straight.losses  # bitwise: nothing lost, nothing repeated
