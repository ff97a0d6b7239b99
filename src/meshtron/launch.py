"""``meshtron launch --processes N [train args]``: a multi-process run on one machine.

Starts N ``meshtron train`` processes that form one JAX distributed run, the way N hosts of a GPU
pod would: process 0 hosts the coordination service on a free local port, every process gets
``MESHTRON_COORDINATOR_ADDRESS`` / ``MESHTRON_NUM_PROCESSES`` / ``MESHTRON_PROCESS_ID`` and, on CPU,
its share of the mesh's devices. Output lines are prefixed ``[pI]``.

If a process fails, the others are given a few seconds to report (their watchdogs name the failed
process), then killed: a survivor blocked in a collective with a dead peer never returns by itself.
SIGTERM or Ctrl-C is passed on to every process, which stop together after the step in flight
with a checkpoint and exit status 75 (see :mod:`meshtron.train.stopping`); launch waits for them
and exits 75 too. A second signal kills them at once. Otherwise the exit status is the first
failure's (128 + signal for a signal).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from meshtron.config import load_config
from meshtron.distributed import ENV_ADDRESS, ENV_PROCESS_ID, ENV_PROCESSES
from meshtron.errors import EXIT_STOPPED, ConfigError
from meshtron.mesh import devices_requested
from meshtron.run import check_features

GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def devices_per_process(config: str | None, overrides: list[str], processes: int) -> int:
    """The mesh's devices split evenly over the processes (CPU: each simulates its share)."""
    cfg = load_config(config, overrides, notes=False)  # the first process notes old keys, once
    check_features(cfg)
    total = devices_requested(cfg.mesh)
    if cfg.distributed.local_devices is not None:
        return cfg.distributed.local_devices
    if total % processes:
        raise ConfigError(
            f"--processes {processes}: the mesh's {total} devices cannot be split evenly over {processes} processes; "
            f"use a process count that divides {total}, or set distributed.local_devices"
        )
    return total // processes


def launch(processes: int, train_args: list[str], config: str | None, overrides: list[str]) -> int:
    """Run ``meshtron train train_args`` in ``processes`` local processes; returns the exit status."""
    if processes < 1:
        raise ConfigError(f"--processes: must be >= 1, got {processes}")
    local = devices_per_process(config, overrides, processes)
    address = f"127.0.0.1:{free_port()}"
    children: list[subprocess.Popen] = []
    interrupted: dict[str, float] = {}

    def signal_all(sig: int) -> None:
        for child in children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, sig)
                except ProcessLookupError:
                    pass

    def on_signal(signum, _frame) -> None:
        # The children stop cleanly on their own (a checkpoint, then exit 75); a second signal kills them.
        if interrupted:
            signal_all(signal.SIGKILL)
            return
        interrupted["at"], interrupted["signal"] = time.monotonic(), signum
        signal_all(signum)

    # Installed before the children start, so they inherit default handlers (not an ignored SIGINT).
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(processes):
            env = dict(os.environ, PYTHONUNBUFFERED="1", **{
                ENV_ADDRESS: address, ENV_PROCESSES: str(processes), ENV_PROCESS_ID: str(rank),
            })
            flags = env.get("XLA_FLAGS", "")
            if "xla_force_host_platform_device_count" not in flags and env.get("JAX_PLATFORMS", "cpu") == "cpu":
                env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local}".strip()
            children.append(subprocess.Popen(
                [sys.executable, "-m", "meshtron.cli", "train", *train_args], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace",
            ))
        print(f"meshtron launch: {processes} processes x {local} devices, coordinator {address}", file=sys.stderr,
              flush=True)
        pumps = [threading.Thread(target=_prefix_lines, args=(rank, child), daemon=True)
                 for rank, child in enumerate(children)]
        for pump in pumps:
            pump.start()
        failed = _supervise(children, interrupted, signal_all)
        for pump in pumps:
            pump.join(timeout=2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal_all(signal.SIGKILL)
    if children and all(child.returncode == EXIT_STOPPED for child in children):
        return EXIT_STOPPED  # stopped together at one step, with a checkpoint
    if interrupted:
        return 130 if interrupted["signal"] == signal.SIGINT else 143
    if failed is not None:
        status = children[failed].returncode
        return status if status > 0 else 128 - status
    return 0


def _prefix_lines(rank: int, child: subprocess.Popen) -> None:
    for line in child.stdout:
        if "[Gloo] Rank" in line:  # gloo's per-communicator connection chatter (several per compiled program)
            continue
        sys.stdout.write(f"[p{rank}] {line}")
        sys.stdout.flush()


def _supervise(children: list[subprocess.Popen], interrupted: dict, signal_all) -> int | None:
    """Wait for all children; on the first failure, a grace period and then SIGKILL for the rest."""
    while any(child.poll() is None for child in children):
        for rank, child in enumerate(children):
            status = child.poll()
            if status not in (None, 0, EXIT_STOPPED):  # a stopped process waits for its peers' stop
                alive = [r for r, c in enumerate(children) if c.poll() is None]
                print(f"meshtron launch: process {rank} failed ({describe_status(status)}); stopping processes "
                      f"{alive}", file=sys.stderr, flush=True)
                deadline = time.monotonic() + GRACE_S
                while time.monotonic() < deadline and any(c.poll() is None for c in children):
                    time.sleep(0.05)
                signal_all(signal.SIGKILL)
                for c in children:
                    c.wait()
                return rank
        time.sleep(0.05)
    failures = [rank for rank, child in enumerate(children) if child.returncode not in (0, EXIT_STOPPED)]
    return failures[0] if failures else None

