"""What every family's Hugging Face mapping is made of: one meshtron parameter and its Hugging Face
tensor (:class:`HfTensor`), the conversion between their layouts, and the one-line errors for what a
``config.json`` holds that a family cannot represent. NumPy only: no JAX, no torch.

A family's mapping (``models/<family>_hf.py``) provides ``FAMILY`` (its ``model.family``),
``ARCHITECTURES`` and ``MODEL_TYPES`` (what it reads), ``PREFIX`` (the part of the stored names a
headless save drops), ``model_config(hf, where)`` (the :class:`~meshtron.config.ModelConfig`, or one
line naming the field it cannot represent), ``tensors(model)``, ``head_tied(hf)`` (the head is
stored as the embedding), ``HEAD`` and ``EMBEDDING`` (the meshtron head parameter, if separate, and
the Hugging Face name of the embedding), ``hf_config(model, tied, eod)`` (the exported
``config.json``), ``ties_on_export(params)``, and for listings ``DISPLAY_NAME`` and
``GROUPED_QUERY``. Optionally ``constants(model)`` (parameters Hugging Face does not store, by
meshtron name: values fixed by the config) and ``ignored(hf, model)`` (prefixes of stored tensors the
model has no place for and leaves out on purpose, with the line that says why) and
``zeros_on_export(model)`` (tensors transformers needs that the model does not hold, by Hugging Face
name: zeros that change nothing), ``stored_model(model, names)`` (the model as the stored tensors hold
it, where ``config.json`` alone does not say; ``names()`` lists them) and ``copies(model, tied)`` (``(copy,
original, shape)``: tensors stored twice, which an import requires to be equal and an export writes
again). :mod:`meshtron.huggingface`
reads and writes the directories through them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError

__all__ = ["HfTensor", "context", "number", "refuse", "size", "to_hf", "to_meshtron"]


@dataclass(frozen=True)
class HfTensor:
    """One meshtron parameter and its Hugging Face tensor.

    ``hf`` is a name, with ``{i}`` for the layer of a per-layer tensor (the parameter is then
    stacked ``[layers, ...]``) and ``{j}`` for the expert of a per-expert one (stacked
    ``[layers, experts, ...]``). ``linear``: a ``[out, in]`` ``nn.Linear`` weight, transposed before
    it is reshaped to meshtron's shape. ``vocab``: the leading axis is the (padded) vocabulary.
    ``layers``: the ``[first, end)`` Hugging Face layers a per-layer parameter's stack holds (None:
    all), layer ``i`` at index ``i - first`` (a DeepSeek's dense ``prefix`` and its expert ``blocks``).
    """

    path: str
    hf: str
    hf_shape: tuple[int, ...]
    linear: bool = False
    vocab: bool = False
    layers: tuple[int, int] | None = None

    def stored_in(self, layer: int) -> bool:
        """Whether this per-layer parameter's stack holds Hugging Face's ``layer``."""
        return self.layers is None or self.layers[0] <= layer < self.layers[1]

    def stacked(self, layers: int) -> range:
        """The Hugging Face layers this per-layer parameter stacks, in its order (of a model of ``layers``)."""
        return range(layers) if self.layers is None else range(*self.layers)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf


def context(m: ModelConfig) -> int:
    """The longest sequence the model is made for (``max_position_embeddings``, else the window)."""
    return m.max_position_embeddings or m.seq_len


def to_meshtron(x: np.ndarray, spec: HfTensor, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A Hugging Face tensor (of ``spec.hf_shape``) as the meshtron parameter of ``shape`` (one layer's)."""
    x = np.asarray(x, dtype=np.float32)
    if spec.linear:
        x = x.T
    if spec.vocab:
        x = np.pad(x, [(0, shape[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return np.ascontiguousarray(x.reshape(shape).astype(dtype))


def to_hf(x: np.ndarray, spec: HfTensor) -> np.ndarray:
    """Inverse of :func:`to_meshtron` (padding rows dropped), as float32."""
    x = np.asarray(x, dtype=np.float32)
    if spec.vocab:
        x = x[: spec.hf_shape[0]]
    x = x.reshape(spec.hf_shape[::-1]).T if spec.linear else x.reshape(spec.hf_shape)
    return np.ascontiguousarray(x)


def refuse(where: Path, field: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(f"{where}: {field}={json.dumps(value)} is not supported; {supported}")


def size(hf: dict[str, Any], name: str, where: Path, default: int | None = None) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: {name}={json.dumps(value)}: expected a positive integer")
    return value


def number(hf: dict[str, Any], name: str, where: Path, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where}: {name}={json.dumps(value)}: expected a positive number")
    return float(value)
