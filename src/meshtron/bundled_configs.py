"""The run configurations shipped with meshtron, by name: ``--config cpu8``, ``--config paper/gpt_1t``.

They are the YAML files of the repository's top-level ``mesh_configs/`` directory, which a wheel or
an editable install provides as the package ``meshtron.mesh_configs`` (see pyproject.toml); they are
read with :mod:`importlib.resources`, so an installed meshtron finds them from any directory. A
config's name is its path below that directory, with or without ``.yaml``. No JAX here: names are
resolved, and ``meshtron configs`` lists them, before JAX starts.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from meshtron.analysis import format_count
from meshtron.config import Config, ConfigError, MeshConfig, config_from_dict

PACKAGE = "meshtron.mesh_configs"
SUFFIX = ".yaml"


def _root() -> Traversable:
    try:
        return resources.files(PACKAGE)
    except ModuleNotFoundError:  # a source checkout put on PYTHONPATH, not installed: the directory itself
        return Path(__file__).resolve().parents[2] / "mesh_configs"


def _natural_order(name: str) -> tuple:
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
    return {name: found[name] for name in sorted(found, key=_natural_order)}


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


def read(name: str, source: Traversable) -> Config:
    """A bundled config as a :class:`Config` (type-checked; not validated against this machine)."""
    try:
        values = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"bundled config {name}: not valid YAML ({err})") from None
    return config_from_dict(values, f"bundled config {name}")


def _devices(mesh: MeshConfig) -> int:
    """The mesh's device count; 0 when an axis is -1 ("the rest of the devices")."""
    sizes = (mesh.data, mesh.pipe, mesh.tensor)
    return sizes[0] * sizes[1] * sizes[2] if min(sizes) >= 1 else 0


def summary(cfg: Config) -> str:
    """One line about a config: its mesh, and the model's family, size and shape (counted without JAX)."""
    mesh, m = cfg.mesh, cfg.model
    sizes = {"data": mesh.data, "pipe": mesh.pipe, "tensor": mesh.tensor}
    layout = " x ".join(f"{axis} {'rest' if size == -1 else size}" for axis, size in sizes.items())
    if _devices(mesh):
        layout += f" = {_devices(mesh)} devices"
    if m.factory is not None:
        return f"{layout}; model from {m.factory}: seq {m.seq_len}, {m.dtype}"
    h = m.hidden
    if m.family == "llama":
        # No biases: attention (2 + 2 kv/heads) h^2, SwiGLU 3hm, two RMSNorms 2h; untied embedding and
        # head, final RMSNorm.
        kv = m.kv_heads or m.heads
        attention = 2 * h * h + 2 * h * (h // m.heads) * kv
        params = m.layers * (attention + 3 * h * m.mlp_dim + 2 * h) + 2 * m.vocab_size * h + h
        heads = f"{m.heads} heads ({kv} kv)"
    else:
        # Pre-LN blocks with biases (attention 4h^2 + 4h, MLP 2hm + m + h, two LayerNorms 4h), token and
        # position embeddings (the LM head is tied), final LayerNorm.
        params = (m.layers * (4 * h * h + 2 * h * m.mlp_dim + 9 * h + m.mlp_dim) + (m.vocab_size + m.seq_len) * h
                  + 2 * h)
        heads = f"{m.heads} heads"
    return (f"{layout}; { {'gpt': 'GPT', 'llama': 'Llama'}[m.family]} {format_count(params)} params: "
            f"{m.layers} layers, hidden {h}, {heads}, seq {m.seq_len}, {m.dtype}")


def listing() -> list[str]:
    """``meshtron configs``: one line per bundled config (name and :func:`summary`), smallest mesh first
    within a directory."""
    configs = {name: read(name, source) for name, source in bundled().items()}
    order = sorted(configs, key=lambda name: (name.count("/"), _devices(configs[name].mesh), _natural_order(name)))
    width = max((len(name) for name in configs), default=0)
    return [f"{name:<{width}}  {summary(configs[name])}" for name in order]
