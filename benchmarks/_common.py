"""Shared helpers for the benchmark scripts: simulated devices, results folder, table printing."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, **payload}
    path = RESULTS / f"{name}.json"
    partial = path.with_name(path.name + ".partial")  # a run that dies mid-write leaves the last results whole
    partial.write_text(json.dumps(payload, indent=2) + "\n")
    partial.replace(path)
    return path


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def child_failure(done: subprocess.CompletedProcess) -> str:
    """Why a child compile gave no result: XLA's failed check, else the signal that ended it, else its
    last line of stderr."""
    lines = [x.strip() for x in done.stderr.splitlines() if x.strip() and not x.lstrip().startswith("@")]
    checks = [x.split("] ", 1)[-1] for x in lines if "Check failed" in x]
    if checks:
        return f"XLA aborted: {checks[0]}"
    if done.returncode < 0:
        return f"XLA crashed: {signal.Signals(-done.returncode).name}"
    return lines[-1] if lines else f"exit {done.returncode}"
