"""A checkpoint directory's layout as plain files: its step directories and their meta records, read
without orbax or JAX (the CLI reads them before JAX starts, to size the simulated mesh and to
check what it was given)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TRACKER_RUNS", "checkpoint_location", "imported_step", "is_import", "read_step_meta", "step_directories"]


TRACKER_RUNS = "tracker_runs.json"
"""The file beside a run's checkpoints naming its experiment trackers' runs (W&B run id, MLflow run id),
so that a resumed run continues them (:mod:`meshtron.train.trackers`). It does not make a checkpoint
directory used: a run that fails before its first checkpoint removes it with the directory."""


def step_directories(directory: str | Path) -> list[int]:
    """The step numbers of ``directory``'s step directories, oldest first (complete or not)."""
    return sorted(int(p.name) for p in Path(directory).glob("*") if p.name.isdigit() and p.is_dir())


def read_step_meta(directory: str | Path, step: int) -> dict[str, Any] | None:
    """A step's meta record read as plain JSON (no orbax, no JAX); None when it cannot be read."""
    try:
        meta = json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_import(meta: dict[str, Any] | None) -> bool:
    """Whether a step's meta record is an imported model's (``meshtron import-hf``): parameters only,
    written by no run; nothing ever trains into it or deletes it."""
    return bool(meta) and "imported" in meta


def checkpoint_location(path: str | Path) -> tuple[Path, int | None]:
    """A checkpoint directory, or one of its step directories (``DIR/300``), as ``(DIR, step or None)``."""
    path = Path(path)
    if path.name.isdigit() and read_step_meta(path.parent, int(path.name)) is not None:
        return path.parent, int(path.name)
    return path, None


def imported_step(directory: str | Path) -> int | None:
    """The step of an imported model ``directory`` holds, if it holds one."""
    return next((step for step in step_directories(directory) if is_import(read_step_meta(directory, step))), None)
