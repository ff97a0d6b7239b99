"""Two processes x four CPU devices (gloo) as one run: the same losses as one 8-device process,
checkpoints written and read by both, and a dead process ending the other with a clear error."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import subprocess_env

from meshtron.config import load_config
from meshtron.launch import free_port
from meshtron.train.loop import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

ROOT = Path(__file__).resolve().parents[1]
# data=4 x tensor=2: each process holds two data shards (its own rows) and whole tensor groups, so
# the data-parallel reduction crosses the process boundary (no pipeline: quicker to compile).
RUN = ["model.layers=4", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=16", "train.batch_size=8",
       "train.steps=6", "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1",
       "parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.chunks=1", "parallel.microbatches=1"]


def cli_env() -> dict[str, str]:
    return subprocess_env()


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron.cli", "launch", "--processes", "2", *args], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=400, check=False)


def losses(metrics: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_two_processes_train_and_resume_like_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--config", "mesh_configs/cpu8.yaml", *RUN, f"checkpoint.dir={ckpt}", "checkpoint.every=3"]
    first = launch("--metrics", str(tmp_path / "a.jsonl"), *args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 processes x 4 devices" in first.stderr and "[p0] held-out loss" in first.stdout
    assert (ckpt / "6" / "state" / "ocdbt.process_1").is_dir()  # each process wrote its own shards

    shutil.rmtree(ckpt / "6")  # both processes read step 3 back and redo 4..6
    second = launch("--metrics", str(tmp_path / "b.jsonl"), *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {ckpt}/3" in second.stdout

    straight = Trainer.from_config(load_config("mesh_configs/cpu8.yaml", RUN)).run()
    # Resuming is bitwise (the same process layout, the same programs). Against one process of 8 devices
    # the losses agree to float rounding, not bitwise: XLA's CPU code for jax.nn.dot_product_attention's
    # contractions rounds differently with 4 devices per process than with 8 (the explicit-softmax
    # attention it replaced happened to be bitwise equal; measured: 1 ulp at step 3).
    assert losses(tmp_path / "b.jsonl") == losses(tmp_path / "a.jsonl")[3:]
    np.testing.assert_allclose(losses(tmp_path / "a.jsonl"), straight.losses, rtol=1e-6)


@pytest.mark.first_stack_only
@pytest.mark.extended  # two processes training like one in CI: test_two_processes_train_and_resume_like_one
def test_a_context_group_across_two_processes_trains_like_one(tmp_path):
    # (data, context, pipe, tensor) = (1, 4, 1, 2): context ranks 0-1 in one process, 2-3 in the other, so
    # the key/value all-gathers and the gradient reduction over data x context cross the boundary
    run = [*RUN, "parallel.data=1", "parallel.context=4", "train.steps=3"]
    result = launch("--metrics", str(tmp_path / "a.jsonl"), "--config", "mesh_configs/cpu8.yaml", *run)
    assert result.returncode == 0, result.stdout + result.stderr
    straight = Trainer.from_config(load_config("mesh_configs/cpu8.yaml", run)).run()
    np.testing.assert_allclose(losses(tmp_path / "a.jsonl"), straight.losses, rtol=1e-6)


@pytest.mark.first_stack_only  # the second stack's watchdog test sees a peer fail; this one sees it die
def test_a_dead_process_ends_the_other_with_a_clear_error(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    metrics = tmp_path / "m.jsonl"
    procs = []
    for rank in range(2):
        env = dict(cli_env(), MESHTRON_COORDINATOR_ADDRESS=address, MESHTRON_NUM_PROCESSES="2",
                   MESHTRON_PROCESS_ID=str(rank))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "meshtron.cli", "train", "--config", "mesh_configs/cpu8.yaml", "--metrics",
             str(metrics), *RUN, "train.steps=100000"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # a step done: compiled and training
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].stderr.read()
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = procs[0].wait(timeout=90)
        waited = time.monotonic() - killed
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            p.kill()
    # Gloo notices the closed connection inside the step (what happens almost always), or the watchdog
    # notices the missing heartbeats, or -- if the watchdog thread cannot get the GIL -- JAX's own
    # backstop (distributed.heartbeat_timeout + 10 s) aborts, naming the task that stopped.
    assert waited < 60
    assert (status == 3 and "meshtron: error (process 0): lost a peer process in a collective" in err
            and "it has probably died" in err) \
        or (status == 70 and "meshtron: error (process 0): process 1 of 2 sent no heartbeat" in err) \
        or (status == -signal.SIGABRT and "tasks are unhealthy (stopped sending heartbeats):\n1" in err), err


def probes(behaviours: list[str]) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_probe.py"), address, str(rank), b],
                             env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank, b in enumerate(behaviours)]


def test_watchdog_names_a_silent_peer_and_a_failed_one():
    """Where no collective notices (the process waits in Python), the heartbeat watchdog does."""
    killed, failing = probes(["wait", "wait"]), probes(["wait", "fail"])
    try:
        for p in (*killed, *failing):
            assert p.stdout.readline() == "joined\n"
        killed[1].send_signal(signal.SIGKILL)
        start = time.monotonic()
        status = killed[0].wait(timeout=60)
        waited = time.monotonic() - start
        assert status == 70 and waited < 15  # distributed.heartbeat_timeout=10, heartbeats every 2 s
        assert "process 1 of 2 sent no heartbeat for" in killed[0].stderr.read()

        assert failing[1].wait(timeout=60) == 3
        assert failing[0].wait(timeout=10) == 70  # told at once through the key-value store
        assert "meshtron: error (process 0): process 1 failed: ValueError: this process gave up" in failing[0].stderr.read()
    finally:
        for p in (*killed, *failing):
            p.kill()
