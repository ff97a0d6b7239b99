"""The run configurations shipped with meshtron, by name: ``--config cpu8``, ``--config paper/gpt_1t``.

They are the YAML files of the repository's top-level ``mesh_configs/`` directory, which a wheel or
an editable install provides as the package ``meshtron.mesh_configs`` (see pyproject.toml); they are
read with :mod:`importlib.resources`, so an installed meshtron finds them from any directory. A
config's name is its path below that directory, with or without ``.yaml``. No JAX and no config
schema here: names are resolved before either is needed.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from meshtron.errors import ConfigError

PACKAGE = "meshtron.mesh_configs"
SUFFIX = ".yaml"


def _root() -> Traversable:
    try:
        return resources.files(PACKAGE)
    except ModuleNotFoundError:  # a source checkout put on PYTHONPATH, not installed: the directory itself
        return Path(__file__).resolve().parents[2] / "mesh_configs"


def natural_order(name: str) -> tuple:
    """Top-level configs first, then numbers by value: paper/gpt_7_5b before paper/gpt_18_4b."""
    parts = re.split(r"(\d+)", name)
    return name.count("/"), [int(part) if i % 2 else part for i, part in enumerate(parts)]


def bundled() -> dict[str, Traversable]:
    """Every bundled config, name -> file."""
    found: dict[str, Traversable] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                if not entry.name.startswith(("_", ".")):  # __pycache__
                    walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(SUFFIX):
                found[prefix + entry.name.removesuffix(SUFFIX)] = entry

    root = _root()
    if root.is_dir():
        walk(root, "")
    return {name: found[name] for name in sorted(found, key=natural_order)}


def find(name: str) -> Traversable | None:
    """The bundled file called ``name`` (``cpu8``, ``cpu8.yaml``, ``paper/gpt_1t``), or None."""
    key = name.replace(os.sep, "/").removeprefix("mesh_configs/").removesuffix(SUFFIX)
    return bundled().get(key)


def resolve(config: str | os.PathLike) -> Path | Traversable:
    """What ``--config`` means: an existing file first, else a bundled config's name; else one clear error."""
    path = Path(config)
    if path.is_file():
        return path
    found = find(os.fspath(config))
    if found is not None:
        return found
    known = ", ".join(bundled()) or "none (this installation has no mesh_configs)"
    raise ConfigError(
        f"--config: no such file or bundled config {os.fspath(config)!r}; bundled: {known}; see 'meshtron configs'"
    )
