"""Hugging Face checkpoints in and out: Llama-family, DeepSeek and GPT-2 weights <-> meshtron checkpoints.

:func:`import_hf` reads a Hugging Face model directory (``config.json`` and ``*.safetensors``, one
file or shards listed by ``model.safetensors.index.json``) of a ``LlamaForCausalLM`` (or a
``MistralForCausalLM`` that is a Llama: no sliding window), a ``MixtralForCausalLM``, a
``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` or a ``GPT2LMHeadModel`` and writes a
meshtron checkpoint directory: the model's parameters as step 0, and a recorded config that
describes the model, so that ``load_pretrained`` / ``meshtron generate --checkpoint`` read it onto
any mesh. ``config.yaml`` in the directory is the config of a run that fine-tunes it: it starts
from the import (``train.init_from``) and saves to a directory of its own beside it; nothing
ever trains into an import or deletes it. :func:`export_hf` writes
the newest checkpoint's parameters back as ``config.json`` + ``model.safetensors`` that
``transformers``' ``from_pretrained`` loads. Tensors are read and written with
``safetensors.numpy``: no torch is needed.

Each family's mapping -- which architectures it reads, its tensors' names and layouts, its
``config.json`` fields both ways -- lives with the family (``models/llama_hf.py``,
``models/deepseek_hf.py``, ``models/gpt_hf.py``; :mod:`meshtron.families` names them); this module
reads and writes the directories through them. A stack of blocks may hold some of Hugging Face's
layers only (a DeepSeek's dense first layers are its ``prefix``, the expert layers its ``blocks``);
parameters Hugging Face does not store at all are the mapping's constants; tensors a mapping leaves out on
purpose (DeepSeek-V3's multi-token-prediction layers) are named in one line on stderr.

meshtron pads the vocabulary of its embedding and head to a multiple of 128 x tensor
(:func:`meshtron.config.padded_vocab_size`); the padding rows are zeros on import (as meshtron's
initialisation makes them) and dropped on export.

What meshtron's models cannot represent (scaled RoPE, biases in a Llama, another activation, a
sliding window, ...) is refused with one line naming the Hugging Face config field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import ml_dtypes  # noqa: F401 -- registers bfloat16 with NumPy, so safetensors.numpy reads BF16 tensors
import numpy as np
import yaml

from meshtron.checkpoint import CheckpointError, CheckpointStore, RunPosition
from meshtron.config import Config, MeshConfig, ModelConfig, load_config, to_dict
from meshtron.data.tokenizers import (
    CHECKPOINT_FILES,
    check_vocab,
    checkpoint_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from meshtron.errors import ConfigError
from meshtron.mesh import build_mesh, resolve_sizes
from meshtron.models.hf_mapping import context, refuse, to_hf, to_meshtron
from meshtron.models.llama_hf import DEFAULT_SEQ_LEN as DEFAULT_LLAMA_SEQ_LEN
from meshtron.models.registry import hf_families, hf_mapping
from meshtron.outputs import check_new_directory, new_directory, readable_by_all
from meshtron.run import check_features
from meshtron.trees import leaf_names

__all__ = ["CONFIG_FILE", "DEFAULT_LLAMA_SEQ_LEN", "FINETUNE_SUFFIX", "export_hf", "finetune_config", "import_hf"]

CONFIG_FILE = "config.yaml"  # the imported run's config beside its checkpoints (meshtron train --config)
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
FINETUNE_SUFFIX = "-finetune"  # config.yaml's checkpoint.dir: the import's directory name with this added

# Tensors a Hugging Face file may hold that are not weights: causal-mask and RoPE buffers of old saves.
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# Fields of model.* that the Hugging Face weights fix (an override may not change them).
_SHAPE_FIELDS = ("family", "factory", "vocab_size", "hidden", "heads", "kv_heads", "layers", "mlp_dim",
                 "rope_theta", "norm_eps", "max_position_embeddings")
_MOE_FIELDS = ("experts", "top_k", "mlp_dim", "shared_experts", "selection_bias")  # also fixed by the weights
# A DeepSeek's latent attention and dense blocks, also fixed by the weights.
_DEEPSEEK_FIELDS = ("first_k_dense_replace", "mla.q_lora_rank", "mla.kv_lora_rank", "mla.qk_nope_head_dim",
                    "mla.qk_rope_head_dim", "mla.v_head_dim")



# ---- reading a Hugging Face directory --------------------------------------------------------------


def _read_hf_config(hf_dir: Path) -> dict[str, Any]:
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir}: no such directory; give a Hugging Face model directory (config.json and "
                              "*.safetensors)")
    path = hf_dir / HF_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{hf_dir}: has no {HF_CONFIG}; give a Hugging Face model directory (config.json and "
                              "*.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object of model settings")
    return config


def _mapping(hf: dict[str, Any], where: Path) -> ModuleType:
    """The family mapping that reads this ``config.json`` (by ``architectures``, else ``model_type``)."""
    mappings = [hf_mapping(family) for family in hf_families()]
    names = [name for m in mappings for name in m.ARCHITECTURES]
    supported = f"meshtron imports {', '.join(names)} (a Mistral without a sliding window is a Llama)"
    architectures = hf.get("architectures") or []
    if architectures:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise refuse(where, "architectures", architectures, supported)
        found = [m for m in mappings if architectures[0] in m.ARCHITECTURES]
        if not found:
            raise refuse(where, "architectures", architectures, supported)
        return found[0]
    found = [m for m in mappings if hf.get("model_type") in m.MODEL_TYPES]
    if not found:
        raise refuse(where, "model_type", hf.get("model_type"), supported)
    return found[0]


class _Weights:
    """The tensors of a Hugging Face directory's safetensors file(s), read one at a time as NumPy."""

    def __init__(self, hf_dir: Path):
        self.where = hf_dir
        index = hf_dir / HF_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map: {err})") from None
            self.files = {name: hf_dir / file for name, file in weight_map.items()}
            for file in sorted(set(self.files.values())):
                if not file.is_file():
                    raise CheckpointError(f"{index}: names the shard {file.name}, which {hf_dir} does not hold")
        else:
            shards = sorted(hf_dir.glob("*.safetensors"))
            if not shards:
                others = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt*"))
                hint = f" (it holds {others[0]}: save the model with safe_serialization=True)" if others else ""
                raise CheckpointError(f"{hf_dir}: holds no *.safetensors weights{hint}")
            self.files = {}
            for file in shards:
                with self._open(file) as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        self.used: set[str] = set()

    @staticmethod
    @contextlib.contextmanager
    def _open(path: Path) -> Iterator[Any]:
        """A safetensors file open for reading; a truncated or garbled one is one line naming it."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="np") as f:
                yield f
        except SafetensorError as err:
            raise CheckpointError(f"{path}: not a readable safetensors file ({str(err).splitlines()[0][:200]}); "
                                  "it may be truncated: download or copy it again") from None

    def find(self, name: str, prefixes: Sequence[str]) -> str | None:
        """The stored name of ``name``: as is, or with/without one of the model's prefixes."""
        candidates = [name]
        for prefix in prefixes:
            candidates += [name[len(prefix):]] if name.startswith(prefix) else [prefix + name]
        return next((c for c in candidates if c in self.files), None)

    def read(self, name: str, shape: tuple[int, ...], prefixes: Sequence[str]) -> np.ndarray:
        stored = self.find(name, prefixes)
        if stored is None:
            raise CheckpointError(f"{self.where}: has no tensor {name} (shape {list(shape)}); the safetensors "
                                  "files do not match config.json")
        with self._open(self.files[stored]) as f:
            x = f.get_tensor(stored)
        if tuple(x.shape) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {stored} is {list(x.shape)}, config.json implies "
                                  f"{list(shape)}; the safetensors files do not match config.json")
        self.used.add(stored)
        return x

    def unused(self) -> list[str]:
        return sorted(n for n in self.files if n not in self.used and not n.endswith(_BUFFERS))


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _read_params(weights: _Weights, mapping: ModuleType, m: ModelConfig, shapes: dict[str, jax.ShapeDtypeStruct],
                 tied: bool, hf: dict[str, Any]) -> dict[str, Any]:
    """The meshtron parameter tree (host arrays, vocabulary padded as ``shapes`` say); a tied head is
    read from the embedding, each stack holds the layers its tensors name, and the mapping's constants
    fill what Hugging Face does not store."""
    prefixes = (mapping.PREFIX,)
    params: dict[str, Any] = {}
    for spec in mapping.tensors(m):
        target = shapes[spec.path]
        name = mapping.EMBEDDING if spec.path == mapping.HEAD and tied else spec.hf

        def layer(i: int, spec=spec, name=name, shape=target.shape[1:], dtype=target.dtype) -> np.ndarray:
            if spec.per_expert:
                return np.stack([to_meshtron(weights.read(name.format(i=i, j=j), spec.hf_shape, prefixes), spec,
                                             shape[1:], dtype) for j in range(shape[0])])
            return to_meshtron(weights.read(name.format(i=i), spec.hf_shape, prefixes), spec, shape, dtype)

        if spec.per_layer:
            value = np.stack([layer(i) for i in spec.stacked(m.layers)])
        elif spec.per_expert:  # one module's experts, not a stack's (a multi-token prediction block)
            value = np.stack([to_meshtron(weights.read(name.format(j=j), spec.hf_shape, prefixes), spec,
                                          target.shape[1:], target.dtype) for j in range(target.shape[0])])
        else:
            value = to_meshtron(weights.read(name, spec.hf_shape, prefixes), spec, target.shape, target.dtype)
        _set(params, spec.path, value)
    for path, value in getattr(mapping, "constants", lambda _: {})(m).items():
        _set(params, path, np.asarray(value, shapes[path].dtype).reshape(shapes[path].shape))
    assert sorted(leaf_names(params)) == sorted(shapes), (
        f"the {m.family} mapping fills {sorted(set(leaf_names(params)) ^ set(shapes))} wrongly")
    tied_head = [n for n in weights.unused() if n.endswith("lm_head.weight")] if tied else []
    weights.used.update(tied_head)  # a saved copy of a tied head is the embedding again
    for copy, original, shape in getattr(mapping, "copies", lambda *_: [])(m, tied):
        if not np.array_equal(weights.read(copy, shape, prefixes), weights.read(original, shape, prefixes)):
            raise CheckpointError(f"{weights.where}: tensor {copy} differs from {original}; meshtron's {m.family} "
                                  f"shares {original} there, as the checkpoints it reads store it (an exact copy)")
    left_out, why = getattr(mapping, "ignored", lambda *_: ((), ""))(hf, m)
    skipped = [n for n in weights.unused() if n.startswith(left_out)] if left_out else []
    if skipped:
        weights.used.update(skipped)
        print(f"meshtron: {weights.where}: {len(skipped)} tensors ({skipped[0]}, ...) left out: {why}", file=sys.stderr)
    extra = weights.unused()
    if extra:
        raise CheckpointError(f"{weights.where}: tensor {extra[0]} ({len(extra)} in all) has no place in meshtron's "
                              f"{m.family} model; config.json does not describe these weights (biases? another "
                              "architecture?)")
    return params


# ---- import -------------------------------------------------------------------------------------


def _override_lines(m: ModelConfig, mesh: MeshConfig) -> list[str]:
    lines = [f"model.{name}={getattr(m, name)!r}" for name in
             ("family", "vocab_size", "hidden", "heads", "layers", "mlp_dim", "seq_len", "max_position_embeddings",
              "rope_theta", "norm_eps")]
    if m.kv_heads is not None:
        lines.append(f"model.kv_heads={m.kv_heads}")
    if m.moe.experts:
        lines += [f"model.moe.{name}={getattr(m.moe, name)!r}" for name in (*_MOE_FIELDS, "aux_loss_weight")]
    lines = [line.replace("'", "") for line in lines]
    # the rest of the model that differs from the defaults (a DeepSeek's routing, latent attention, YaRN)
    lines += [f"model.{name}={json.dumps(value)}" for name, value in _changed(m, ModelConfig()) if name not in
              {line.split("=")[0][len("model."):] for line in lines}]
    lines += [f"parallel.{axis}={getattr(mesh, axis)}" for axis in ("data", "pipe", "tensor")]
    if mesh.pipe > 1:  # the fewest microbatches that fill the pipeline (an override may ask for more)
        lines.append(f"parallel.microbatches={mesh.pipe}")
    return lines


def _changed(value: Any, default: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The dotted fields of a config dataclass ``value`` that differ from ``default``'s (nested sections
    field by field; a dict, such as ``rope_scaling``, whole)."""
    if not dataclasses.is_dataclass(value):
        return [] if value == default else [(prefix[:-1], value)]
    return [found for f in dataclasses.fields(value)
            for found in _changed(getattr(value, f.name), getattr(default, f.name), f"{prefix}{f.name}.")]


def _run_config(model: ModelConfig, mesh: MeshConfig, overrides: Sequence[str]) -> Config:
    """The run config of the imported checkpoint: defaults, the model from Hugging Face, the mesh, then
    the caller's ``overrides`` (which may not change the model's shape)."""
    cfg = load_config(None, overrides, preset=_override_lines(model, mesh))
    check_features(cfg)
    fixed = [(name, getattr(model, name), getattr(cfg.model, name)) for name in _SHAPE_FIELDS]
    fixed += [(f"moe.{name}", getattr(model.moe, name), getattr(cfg.model.moe, name)) for name in _MOE_FIELDS]
    fixed += [(name, _dotted(model, name), _dotted(cfg.model, name)) for name in _DEEPSEEK_FIELDS]
    for name, wanted, got in fixed:
        if name == "kv_heads":
            wanted, got = wanted or model.heads, got or cfg.model.heads
        if wanted != got:
            raise ConfigError(f"model.{name}: the Hugging Face weights fix it at {wanted!r}; do not override it "
                              f"(got {got!r})")
    if cfg.model.mtp.layers not in (0, model.mtp.layers):
        raise ConfigError(f"model.mtp.layers: the Hugging Face weights hold {model.mtp.layers} multi-token prediction "
                          f"layers; keep them or leave them out with 0 (got {cfg.model.mtp.layers})")
    return cfg


def _dotted(section: Any, name: str) -> Any:
    for part in name.split("."):
        section = getattr(section, part)
    return section


def _hf_tokenizer(hf_dir: Path, vocab_size: int):
    for name in (CHECKPOINT_FILES["huggingface"], CHECKPOINT_FILES["sentencepiece"]):
        if (hf_dir / name).is_file():
            tokenizer = load_tokenizer(hf_dir / name)
            check_vocab(tokenizer, vocab_size)
            return tokenizer
    return None


def finetune_config(cfg: Config, tokenizer: Path | None) -> dict[str, Any]:
    """``config.yaml`` of an import: the run that fine-tunes it. It starts from the import
    (``train.init_from``) and saves beside it, in a directory of its own; every path is written
    relative to the file (``${config_dir:}``), so a moved or copied import stays self-contained."""
    values = to_dict(cfg)
    values["train"]["init_from"] = "${config_dir:}"
    values["checkpoint"]["dir"] = "${config_dir:}" + FINETUNE_SUFFIX
    if tokenizer is not None:
        values["data"]["tokenizer"] = "${config_dir:}/" + tokenizer.name
    return values


def import_hf(hf_dir: str | Path, output: str | Path, *, mesh: MeshConfig | None = None,
              overrides: Sequence[str] = (), argument: str = "output") -> Path:
    """Write the Hugging Face model in ``hf_dir`` as step 0 of a meshtron checkpoint directory ``output``.

    ``mesh``: the mesh the checkpoint is written from and records (default 1x1x1; any mesh restores
    it). ``overrides``: ``section.key=value`` settings of the recorded run (``train.optimizer=lamb``,
    ``model.seq_len=8192`` for a Llama, ...); the model's shape comes from ``config.json``. The
    checkpoint holds the parameters only: a run started from it (``train.init_from``) creates its
    own optimizer state.

    ``output`` must be a new (or empty) directory; it is written whole under a temporary name and put
    in place at the end, so a failed import leaves nothing (``argument``: how errors name it). The
    tokenizer (``tokenizer.json``, else ``tokenizer.model``) is copied into ``output`` and
    recorded as ``data.tokenizer``. ``output/config.yaml`` is the config of a fine-tune
    (:func:`finetune_config`): ``meshtron train --config output/config.yaml`` starts from the import
    and saves to ``output-finetune``. Returns ``output``.
    """
    hf_dir = Path(hf_dir)
    if Path(output).is_dir() and any(p.name.isdigit() for p in Path(output).iterdir()):
        raise CheckpointError(f"{argument}: {output} already holds checkpoints; give a new directory (nothing is "
                              "overwritten)")
    check_new_directory(output, argument, inside=hf_dir if hf_dir.is_dir() else None, what="the checkpoint")
    output = Path(output).absolute()
    hf = _read_hf_config(hf_dir)
    where = hf_dir / HF_CONFIG
    mapping = _mapping(hf, where)
    read: list[_Weights] = []  # the weights, once read: what config.json or the overrides cannot hold is said first

    def weights() -> _Weights:
        if not read:
            read.append(_Weights(hf_dir))
        return read[0]

    model = getattr(mapping, "stored_model", lambda m, _: m)(mapping.model_config(hf, where), lambda: weights().files)
    tied = mapping.head_tied(hf)
    devices = jax.devices()
    mesh_cfg = resolve_sizes(mesh or MeshConfig(1, 1, 1), len(devices))
    tensor = mesh_cfg.tensor
    cfg = _run_config(model, mesh_cfg, overrides)
    tokenizer = _hf_tokenizer(hf_dir, model.vocab_size)

    from meshtron.train.state import model_def_from_config

    device_mesh = build_mesh(mesh_cfg, devices)
    model_def = model_def_from_config(cfg.model, tensor)
    model_def.check_mesh(device_mesh)
    shapes = dict(zip(leaf_names(model_def.shapes()), jax.tree.leaves(model_def.shapes()), strict=True))
    host = _read_params(weights(), mapping, replace(model, mtp=cfg.model.mtp), shapes, tied, hf)
    params = jax.device_put(host, model_def.shardings(device_mesh))
    del host

    with new_directory(output, argument, what="the checkpoint") as partial:
        copy = save_tokenizer(tokenizer, partial) if tokenizer is not None else None
        if copy is not None:  # recorded where it will be once the directory is in place
            copy = output / copy.name
            cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(copy)))
        layout = {"mesh": [mesh_cfg.data, mesh_cfg.pipe, tensor],
                  "chunks": cfg.pipeline.chunks if mesh_cfg.pipe > 1 else 1}
        store = CheckpointStore(partial, async_save=False)  # run_id None: no run owns an import
        try:
            store.save(RunPosition(0, 0, 0), {"params": params}, None, device_mesh,
                       {"seed": cfg.train.seed, "layout": layout, "config": to_dict(cfg),
                        "imported": {"from": "huggingface", "path": str(hf_dir.absolute()),
                                     "architectures": hf.get("architectures")}})
            store.wait()
        finally:
            store.close()
        (partial / CONFIG_FILE).write_text(yaml.safe_dump(finetune_config(cfg, copy), sort_keys=False))
    m = cfg.model
    if m.seq_len < context(m):
        print(f"meshtron: model.seq_len={m.seq_len} (the training window, and generate's context); the model's own "
              f"context, max_position_embeddings={context(m)}, is kept and exported; model.seq_len=N chooses "
              "another window", file=sys.stderr)
    return output


# ---- export -------------------------------------------------------------------------------------


def _restore_params(checkpoint_dir: Path) -> tuple[dict[str, Any], Config]:
    """The newest intact checkpoint's parameters as host arrays (on one device: padded for tensor=1)."""
    from meshtron.pretrained import load_pretrained, saved_config

    store, cfg = saved_config(checkpoint_dir, argument="checkpoint_dir")
    store.close()
    m = cfg.model
    if m.factory is not None or m.family not in hf_families():
        raise CheckpointError(f"{checkpoint_dir}: holds a model.factory={m.factory} model; only the built-in "
                              f"families ({', '.join(hf_families())}) export to Hugging Face")
    model = load_pretrained(checkpoint_dir, MeshConfig(1, 1, 1), jax.devices()[:1], argument="checkpoint_dir")
    params = model.params
    adaptation = model.model_def.adaptation
    if adaptation is not None:  # a LoRA run's adapters, folded into their matrices
        params = jax.jit(adaptation.merged)(params)
    return jax.device_get(params), cfg


def _get(tree: dict[str, Any], dotted: str) -> np.ndarray:
    for part in dotted.split("."):
        tree = tree[part]
    return np.asarray(tree)


def export_hf(checkpoint_dir: str | Path, output_dir: str | Path, *, argument: str = "output_dir") -> Path:
    """Write the newest checkpoint in ``checkpoint_dir`` as a Hugging Face model directory.

    ``output_dir`` gets ``config.json`` (``LlamaForCausalLM``, ``DeepseekV3ForCausalLM`` or ``GPT2LMHeadModel``,
    float32) and
    ``model.safetensors`` (float32, without meshtron's vocabulary padding), plus the checkpoint's
    tokenizer file (``tokenizer.json``: with a ``tokenizer_config.json`` for ``AutoTokenizer``).
    A Llama's head is written tied (``tie_word_embeddings: true``, no ``lm_head.weight``) when it
    still equals the embedding. ``output_dir`` must be a new (or empty) directory outside the
    checkpoint: an earlier export is never replaced. It is written whole under a temporary name and
    put in place at the end (``argument``: how errors name it). Returns ``output_dir``.
    """
    from safetensors.numpy import save_file

    checkpoint_dir = Path(checkpoint_dir)
    check_new_directory(output_dir, argument, inside=checkpoint_dir if checkpoint_dir.is_dir() else None,
                        what="the export")
    output_dir = Path(output_dir).absolute()
    params, cfg = _restore_params(checkpoint_dir)
    m = cfg.model
    mapping = hf_mapping(m.family)
    tied = mapping.ties_on_export(params)
    tensors: dict[str, np.ndarray] = {}
    for spec in mapping.tensors(m):
        if spec.path == mapping.HEAD and tied:
            continue
        value = _get(params, spec.path)
        stored = spec.stacked(m.layers)
        if spec.per_expert and not spec.per_layer:  # one module's experts (a multi-token prediction block)
            for j in range(value.shape[0]):
                tensors[spec.hf.format(j=j)] = to_hf(value[j], spec)
        elif spec.per_expert:
            for n, i in enumerate(stored):
                for j in range(value.shape[1]):
                    tensors[spec.hf.format(i=i, j=j)] = to_hf(value[n, j], spec)
        elif spec.per_layer:
            for n, i in enumerate(stored):
                tensors[spec.hf.format(i=i)] = to_hf(value[n], spec)
        else:
            tensors[spec.hf] = to_hf(value, spec)
    tensors.update(getattr(mapping, "zeros_on_export", lambda _: {})(m))
    for copy, original, _ in getattr(mapping, "copies", lambda *_: [])(m, tied):
        tensors[copy] = tensors[original]
    tokenizer = checkpoint_tokenizer(checkpoint_dir)
    with new_directory(output_dir, argument, what="the export") as partial:
        save_file(tensors, str(partial / HF_WEIGHTS), metadata={"format": "pt"})
        readable_by_all(partial / HF_WEIGHTS)
        (partial / HF_CONFIG).write_text(json.dumps(mapping.hf_config(m, tied, tokenizer.eod), indent=2) + "\n")
        if tokenizer.kind != "bytes":
            shutil.copyfile(tokenizer.path, partial / CHECKPOINT_FILES[tokenizer.kind])
            if tokenizer.kind == "huggingface":
                settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                            "model_max_length": context(m)}
                if tokenizer.eod is not None:
                    settings["eos_token"] = tokenizer.decode([tokenizer.eod])
                (partial / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return output_dir
