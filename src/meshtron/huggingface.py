"""Hugging Face checkpoints in and out: Llama-family and GPT-2 weights <-> meshtron checkpoints.

:func:`import_hf` reads a Hugging Face model directory (``config.json`` and ``*.safetensors``, one
file or shards listed by ``model.safetensors.index.json``) of a ``LlamaForCausalLM`` (or a
``MistralForCausalLM`` that is a Llama: no sliding window) or a ``GPT2LMHeadModel`` and writes a
meshtron checkpoint directory: the model's parameters as step 0, and a recorded config that
describes the model, so that ``load_pretrained`` / ``meshtron generate --checkpoint`` read it onto
any mesh. ``config.yaml`` in the directory is the config of a run that fine-tunes it: it starts
from the import (``train.init_from``) and saves to a directory of its own beside it; nothing
ever trains into an import or deletes it. :func:`export_hf` writes
the newest checkpoint's parameters back as ``config.json`` + ``model.safetensors`` that
``transformers``' ``from_pretrained`` loads. Tensors are read and written with
``safetensors.numpy``: no torch is needed.

Layouts (Hugging Face -> meshtron, per layer; ``n`` query heads, ``k`` key/value heads, ``d`` head
size, ``h`` hidden size):

* Llama: ``nn.Linear`` weights are ``[out, in]``; the query projection's ``out`` is ``(n, d)``
  (head-major), so ``wq[h, n, d] = q_proj.weight.T.reshape(h, n, d)``, likewise ``wk``/``wv`` with
  ``k`` heads, and ``wo[n, d, h] = o_proj.weight.T.reshape(n, d, h)``. Query head ``j`` uses
  key/value head ``j // (n / k)`` in both (Hugging Face's ``repeat_kv``, ``jax.nn``'s grouping).
  Both use the half-split rotary embedding (``rotate_half``) with ``theta^(-2i/d)`` frequencies,
  so no permutation of the query/key rows is needed.
* GPT-2: ``Conv1D`` weights are ``[in, out]``; ``c_attn``'s ``3h`` outputs are the query, key and
  value blocks, each head-major, so ``qkv[h, 3, n, d] = c_attn.weight.reshape(h, 3, n, d)``; GELU is
  the tanh approximation (``gelu_new``, ``jax.nn.gelu``'s default); the LM head is the embedding.

meshtron pads the vocabulary of its embedding and head to a multiple of 128 x tensor
(:func:`meshtron.config.padded_vocab_size`); the padding rows are zeros on import (as meshtron's
initialisation makes them) and dropped on export. A tied Llama (``tie_word_embeddings: true``)
is imported with its embedding copied into meshtron's separate ``lm_head``; on export the head is
tied again when the two are still equal.

What meshtron's models cannot represent (scaled RoPE, biases in a Llama, another activation, a
sliding window, ...) is refused with one line naming the Hugging Face config field.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
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
from meshtron.trees import leaf_names

__all__ = ["CONFIG_FILE", "DEFAULT_LLAMA_SEQ_LEN", "FINETUNE_SUFFIX", "export_hf", "finetune_config", "import_hf"]

CONFIG_FILE = "config.yaml"  # the imported run's config beside its checkpoints (meshtron train --config)
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# A Llama's max_position_embeddings is its longest context (128k for Llama 3.x), kept as
# model.max_position_embeddings; meshtron's seq_len is the training window and generate's context,
# so an import caps that here (model.seq_len overrides it).
DEFAULT_LLAMA_SEQ_LEN = 4096
FINETUNE_SUFFIX = "-finetune"  # config.yaml's checkpoint.dir: the import's directory name with this added

_LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_GPT2_ARCHITECTURES = ("GPT2LMHeadModel",)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
# Tensors a Hugging Face file may hold that are not weights: causal-mask and RoPE buffers of old saves.
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# Fields of model.* that the Hugging Face weights fix (an override may not change them).
_SHAPE_FIELDS = ("family", "factory", "vocab_size", "hidden", "heads", "kv_heads", "layers", "mlp_dim",
                 "rope_theta", "norm_eps", "max_position_embeddings")


# ---- the two layouts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One meshtron parameter and its Hugging Face tensor.

    ``hf`` is a name, with ``{i}`` for the layer of a per-layer tensor (the parameter is then
    stacked ``[layers, ...]``). ``linear``: a ``[out, in]`` ``nn.Linear`` weight, transposed before
    it is reshaped to meshtron's shape. ``vocab``: the leading axis is the (padded) vocabulary.
    """

    path: str
    hf: str
    hf_shape: tuple[int, ...]
    linear: bool = False
    vocab: bool = False

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _llama_tensors(m: ModelConfig) -> list[_Tensor]:
    h, f, v = m.hidden, m.mlp_dim, m.vocab_size
    d = m.hidden // m.heads
    qd, kvd = m.heads * d, (m.kv_heads or m.heads) * d
    layer = "model.layers.{i}."
    return [
        _Tensor("embedding", "model.embed_tokens.weight", (v, h), vocab=True),
        _Tensor("blocks.attn_norm.scale", layer + "input_layernorm.weight", (h,)),
        _Tensor("blocks.attn.wq.kernel", layer + "self_attn.q_proj.weight", (qd, h), linear=True),
        _Tensor("blocks.attn.wk.kernel", layer + "self_attn.k_proj.weight", (kvd, h), linear=True),
        _Tensor("blocks.attn.wv.kernel", layer + "self_attn.v_proj.weight", (kvd, h), linear=True),
        _Tensor("blocks.attn.wo.kernel", layer + "self_attn.o_proj.weight", (h, qd), linear=True),
        _Tensor("blocks.mlp_norm.scale", layer + "post_attention_layernorm.weight", (h,)),
        _Tensor("blocks.mlp.gate.kernel", layer + "mlp.gate_proj.weight", (f, h), linear=True),
        _Tensor("blocks.mlp.up.kernel", layer + "mlp.up_proj.weight", (f, h), linear=True),
        _Tensor("blocks.mlp.down.kernel", layer + "mlp.down_proj.weight", (h, f), linear=True),
        _Tensor("norm.scale", "model.norm.weight", (h,)),
        _Tensor("lm_head", "lm_head.weight", (v, h), vocab=True),
    ]


def _gpt2_tensors(m: ModelConfig) -> list[_Tensor]:
    h, f, v = m.hidden, m.mlp_dim, m.vocab_size
    layer = "transformer.h.{i}."
    return [
        _Tensor("wte", "transformer.wte.weight", (v, h), vocab=True),
        _Tensor("wpe", "transformer.wpe.weight", (context(m), h)),
        _Tensor("blocks.ln1.scale", layer + "ln_1.weight", (h,)),
        _Tensor("blocks.ln1.bias", layer + "ln_1.bias", (h,)),
        _Tensor("blocks.attn.qkv.kernel", layer + "attn.c_attn.weight", (h, 3 * h)),
        _Tensor("blocks.attn.qkv.bias", layer + "attn.c_attn.bias", (3 * h,)),
        _Tensor("blocks.attn.out.kernel", layer + "attn.c_proj.weight", (h, h)),
        _Tensor("blocks.attn.out.bias", layer + "attn.c_proj.bias", (h,)),
        _Tensor("blocks.ln2.scale", layer + "ln_2.weight", (h,)),
        _Tensor("blocks.ln2.bias", layer + "ln_2.bias", (h,)),
        _Tensor("blocks.mlp.fc1.kernel", layer + "mlp.c_fc.weight", (h, f)),
        _Tensor("blocks.mlp.fc1.bias", layer + "mlp.c_fc.bias", (f,)),
        _Tensor("blocks.mlp.fc2.kernel", layer + "mlp.c_proj.weight", (f, h)),
        _Tensor("blocks.mlp.fc2.bias", layer + "mlp.c_proj.bias", (h,)),
        _Tensor("ln_f.scale", "transformer.ln_f.weight", (h,)),
        _Tensor("ln_f.bias", "transformer.ln_f.bias", (h,)),
    ]


def context(m: ModelConfig) -> int:
    """The longest sequence the model is made for (``max_position_embeddings``, else the window)."""
    return m.max_position_embeddings or m.seq_len


def _tensors(m: ModelConfig) -> list[_Tensor]:
    return _llama_tensors(m) if m.family == "llama" else _gpt2_tensors(m)


def _to_meshtron(x: np.ndarray, spec: _Tensor, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A Hugging Face tensor (of ``spec.hf_shape``) as the meshtron parameter of ``shape`` (one layer's)."""
    x = np.asarray(x, dtype=np.float32)
    if spec.linear:
        x = x.T
    if spec.vocab:
        x = np.pad(x, [(0, shape[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return np.ascontiguousarray(x.reshape(shape).astype(dtype))


def _to_hf(x: np.ndarray, spec: _Tensor) -> np.ndarray:
    """Inverse of :func:`_to_meshtron` (padding rows dropped), as float32."""
    x = np.asarray(x, dtype=np.float32)
    if spec.vocab:
        x = x[: spec.hf_shape[0]]
    x = x.reshape(spec.hf_shape[::-1]).T if spec.linear else x.reshape(spec.hf_shape)
    return np.ascontiguousarray(x)


# ---- reading a Hugging Face directory --------------------------------------------------------------


def _refuse(where: Path, field: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(f"{where}: {field}={json.dumps(value)} is not supported; {supported}")


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


def _family(hf: dict[str, Any], where: Path) -> str:
    supported = ("meshtron imports LlamaForCausalLM (and MistralForCausalLM without a sliding window) and "
                 "GPT2LMHeadModel")
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if architectures:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise _refuse(where, "architectures", architectures, supported)
        if architectures[0] in _LLAMA_ARCHITECTURES:
            return "llama"
        if architectures[0] in _GPT2_ARCHITECTURES:
            return "gpt"
        raise _refuse(where, "architectures", architectures, supported)
    if model_type in ("llama", "mistral"):
        return "llama"
    if model_type == "gpt2":
        return "gpt"
    raise _refuse(where, "model_type", model_type, supported)


def _size(hf: dict[str, Any], name: str, where: Path, default: int | None = None) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}: {name}={json.dumps(value)}: expected a positive integer")
    return value


def _number(hf: dict[str, Any], name: str, where: Path, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where}: {name}={json.dumps(value)}: expected a positive number")
    return float(value)


def _rope_theta(hf: dict[str, Any], where: Path) -> float:
    """The RoPE base of a plain (unscaled, full-head) rotary embedding, in either spelling:
    ``rope_theta`` + ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x)."""
    supported = "meshtron's Llama has plain RoPE (rope_type default: no scaling); use a model without RoPE scaling"
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    for field, rope in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise _refuse(where, field, rope, supported)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise _refuse(where, field, rope, supported)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise _refuse(where, f"{field}.partial_rotary_factor", rope["partial_rotary_factor"],
                          "meshtron's Llama rotates the whole head (1.0)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(where, "partial_rotary_factor", hf["partial_rotary_factor"],
                      "meshtron's Llama rotates the whole head (1.0)")
    theta = (parameters or {}).get("rope_theta", (scaling or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    return _number({"rope_theta": theta}, "rope_theta", where, 10000.0)


def _llama_model(hf: dict[str, Any], where: Path) -> ModelConfig:
    def flag(field: str) -> None:
        if hf.get(field, False):
            raise _refuse(where, field, hf[field], "meshtron's Llama has no biases (false)")

    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", hf["hidden_act"], "meshtron's Llama MLP is SwiGLU (silu)")
    flag("attention_bias")
    flag("mlp_bias")
    if hf.get("model_type") == "mistral" or hf.get("architectures") == ["MistralForCausalLM"]:
        window = hf.get("sliding_window", 4096)  # Mistral's default when the field is absent
        if window is not None:
            raise _refuse(where, "sliding_window", window, "meshtron attends to the whole context (null)")
    elif hf.get("sliding_window") is not None or hf.get("use_sliding_window"):
        field = "use_sliding_window" if hf.get("use_sliding_window") else "sliding_window"
        raise _refuse(where, field, hf[field], "meshtron attends to the whole context (null / false)")
    hidden, heads = _size(hf, "hidden_size", where), _size(hf, "num_attention_heads", where)
    if hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise _refuse(where, "head_dim", head_dim,
                      f"meshtron's heads are hidden_size / num_attention_heads = {hidden // heads} wide")
    kv_heads = _size(hf, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    max_positions = _size(hf, "max_position_embeddings", where, 2048)
    return ModelConfig(
        family="llama", vocab_size=_size(hf, "vocab_size", where), hidden=hidden, heads=heads, kv_heads=kv_heads,
        layers=_size(hf, "num_hidden_layers", where), mlp_dim=_size(hf, "intermediate_size", where),
        seq_len=min(max_positions, DEFAULT_LLAMA_SEQ_LEN), max_position_embeddings=max_positions,
        rope_theta=_rope_theta(hf, where), norm_eps=_number(hf, "rms_norm_eps", where, 1e-6),
    )


def _gpt2_model(hf: dict[str, Any], where: Path) -> ModelConfig:
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        raise _refuse(where, "activation_function", hf["activation_function"],
                      "meshtron's GPT uses the tanh-approximated GELU (gelu_new)")
    for field, wanted, why in (
        ("scale_attn_weights", True, "meshtron scales attention scores by 1/sqrt(head_dim) (true)"),
        ("scale_attn_by_inverse_layer_idx", False, "meshtron does not scale attention by layer (false)"),
        ("add_cross_attention", False, "meshtron's GPT is decoder-only (false)"),
        ("tie_word_embeddings", True, "meshtron's GPT ties its LM head to the embedding (true)"),
    ):
        if hf.get(field, wanted) != wanted:
            raise _refuse(where, field, hf[field], why)
    hidden, heads = _size(hf, "n_embd", where, 768), _size(hf, "n_head", where, 12)
    if hidden % heads:
        raise ConfigError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
    inner = hf.get("n_inner")
    positions = _size(hf, "n_positions", where, 1024)
    return ModelConfig(
        family="gpt", vocab_size=_size(hf, "vocab_size", where, 50257), hidden=hidden, heads=heads,
        layers=_size(hf, "n_layer", where, 12), mlp_dim=4 * hidden if inner is None else _size(hf, "n_inner", where),
        seq_len=positions, max_position_embeddings=positions,
        norm_eps=_number(hf, "layer_norm_epsilon", where, 1e-5),
    )


class _Weights:
    """The tensors of a Hugging Face directory's safetensors file(s), read one at a time as NumPy."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self._open = lambda path: safe_open(str(path), framework="np")
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


def _read_params(weights: _Weights, m: ModelConfig, shapes: dict[str, jax.ShapeDtypeStruct],
                 tied: bool) -> dict[str, Any]:
    """The meshtron parameter tree (host arrays, vocabulary padded as ``shapes`` say)."""
    prefixes = ("model.",) if m.family == "llama" else ("transformer.",)
    params: dict[str, Any] = {}
    for spec in _tensors(m):
        target = shapes[spec.path]
        name = "model.embed_tokens.weight" if spec.path == "lm_head" and tied else spec.hf  # tied: the embedding
        if spec.per_layer:
            value = np.stack([
                _to_meshtron(weights.read(name.format(i=i), spec.hf_shape, prefixes), spec, target.shape[1:],
                             target.dtype)
                for i in range(m.layers)
            ])
        else:
            value = _to_meshtron(weights.read(name, spec.hf_shape, prefixes), spec, target.shape, target.dtype)
        _set(params, spec.path, value)
    tied_head = [n for n in weights.unused() if n.endswith("lm_head.weight")] if tied or m.family == "gpt" else []
    weights.used.update(tied_head)  # a saved copy of a tied head is the embedding again
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
    lines += [f"mesh.{axis}={getattr(mesh, axis)}" for axis in ("data", "pipe", "tensor")]
    if mesh.pipe > 1:  # the fewest microbatches that fill the pipeline (an override may ask for more)
        lines.append(f"train.microbatches={mesh.pipe}")
    return [line.replace("'", "") for line in lines]


def _run_config(model: ModelConfig, mesh: MeshConfig, overrides: Sequence[str]) -> Config:
    """The run config of the imported checkpoint: defaults, the model from Hugging Face, the mesh, then
    the caller's ``overrides`` (which may not change the model's shape)."""
    cfg = load_config(None, [*_override_lines(model, mesh), *overrides])
    for name in _SHAPE_FIELDS:
        wanted, got = getattr(model, name), getattr(cfg.model, name)
        if name == "kv_heads":
            wanted, got = wanted or model.heads, got or cfg.model.heads
        if wanted != got:
            raise ConfigError(f"model.{name}: the Hugging Face weights fix it at {wanted!r}; do not override it "
                              f"(got {got!r})")
    return cfg


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
              overrides: Sequence[str] = ()) -> Path:
    """Write the Hugging Face model in ``hf_dir`` as step 0 of a meshtron checkpoint directory ``output``.

    ``mesh``: the mesh the checkpoint is written from and records (default 1x1x1; any mesh restores
    it). ``overrides``: ``section.key=value`` settings of the recorded run (``train.optimizer=lamb``,
    ``model.seq_len=8192`` for a Llama, ...); the model's shape comes from ``config.json``. The
    checkpoint holds the parameters only: a run started from it (``train.init_from``) creates its
    own optimizer state.

    The tokenizer (``tokenizer.json``, else ``tokenizer.model``) is copied into ``output`` and
    recorded as ``data.tokenizer``. ``output/config.yaml`` is the config of a fine-tune
    (:func:`finetune_config`): ``meshtron train --config output/config.yaml`` starts from the import
    and saves to ``output-finetune``. Returns ``output``.
    """
    hf_dir, output = Path(hf_dir), Path(output).absolute()
    hf = _read_hf_config(hf_dir)
    where = hf_dir / HF_CONFIG
    family = _family(hf, where)
    model = _llama_model(hf, where) if family == "llama" else _gpt2_model(hf, where)
    tied = family == "llama" and bool(hf.get("tie_word_embeddings", False))
    devices = jax.devices()
    data, pipe, tensor = resolve_sizes(mesh or MeshConfig(1, 1, 1), len(devices))
    mesh_cfg = MeshConfig(data, pipe, tensor)
    cfg = _run_config(model, mesh_cfg, overrides)
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"{output}: is a file; give a new directory for the checkpoint")
    if output.is_dir() and any(p.name.isdigit() for p in output.iterdir()):
        raise CheckpointError(f"{output}: already holds checkpoints; give a new directory (nothing is overwritten)")
    tokenizer = _hf_tokenizer(hf_dir, model.vocab_size)

    from meshtron.train.state import model_def_from_config

    device_mesh = build_mesh(mesh_cfg, devices)
    model_def = model_def_from_config(cfg.model, tensor)
    model_def.check_mesh(device_mesh)
    shapes = dict(zip(leaf_names(model_def.shapes()), jax.tree.leaves(model_def.shapes()), strict=True))
    host = _read_params(_Weights(hf_dir), model, shapes, tied)
    params = jax.device_put(host, model_def.shardings(device_mesh))
    del host

    output.mkdir(parents=True, exist_ok=True)
    copy = save_tokenizer(tokenizer, output) if tokenizer is not None else None
    if copy is not None:
        cfg = replace(cfg, data=replace(cfg.data, tokenizer=str(copy)))
    layout = {"mesh": [data, pipe, tensor], "chunks": cfg.pipeline.chunks if pipe > 1 else 1}
    store = CheckpointStore(output, async_save=False)  # run_id None: no run owns an import
    try:
        store.save(RunPosition(0, 0, 0), {"params": params}, None, device_mesh,
                   {"seed": cfg.train.seed, "layout": layout, "config": to_dict(cfg),
                    "imported": {"from": "huggingface", "path": str(hf_dir.absolute()),
                                 "architectures": hf.get("architectures")}})
        store.wait()
    finally:
        store.close()
    (output / CONFIG_FILE).write_text(yaml.safe_dump(finetune_config(cfg, copy), sort_keys=False))
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
    if m.factory is not None or m.family not in ("llama", "gpt"):
        raise CheckpointError(f"{checkpoint_dir}: holds a model.factory={m.factory} model; only the built-in "
                              "families (llama, gpt) export to Hugging Face")
    model = load_pretrained(checkpoint_dir, MeshConfig(1, 1, 1), jax.devices()[:1], argument="checkpoint_dir")
    return jax.device_get(model.params), cfg


def _get(tree: dict[str, Any], dotted: str) -> np.ndarray:
    for part in dotted.split("."):
        tree = tree[part]
    return np.asarray(tree)


def _hf_config(m: ModelConfig, tied: bool, eod: int | None) -> dict[str, Any]:
    common = {"vocab_size": m.vocab_size, "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": tied,
              "torch_dtype": "float32", "dtype": "float32", "use_cache": True}
    if m.family == "gpt":
        return {
            "architectures": list(_GPT2_ARCHITECTURES), "model_type": "gpt2", **common,
            "n_embd": m.hidden, "n_head": m.heads, "n_layer": m.layers, "n_inner": m.mlp_dim,
            "n_positions": context(m), "n_ctx": context(m), "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
        "hidden_size": m.hidden, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads or m.heads,
        "head_dim": m.hidden // m.heads, "num_hidden_layers": m.layers, "intermediate_size": m.mlp_dim,
        "max_position_embeddings": context(m), "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": 0.02,
    }


def export_hf(checkpoint_dir: str | Path, output_dir: str | Path) -> Path:
    """Write the newest checkpoint in ``checkpoint_dir`` as a Hugging Face model directory.

    ``output_dir`` gets ``config.json`` (``LlamaForCausalLM`` or ``GPT2LMHeadModel``, float32) and
    ``model.safetensors`` (float32, without meshtron's vocabulary padding), plus the checkpoint's
    tokenizer file (``tokenizer.json``: with a ``tokenizer_config.json`` for ``AutoTokenizer``).
    A Llama's head is written tied (``tie_word_embeddings: true``, no ``lm_head.weight``) when it
    still equals the embedding. Returns ``output_dir``.
    """
    from safetensors.numpy import save_file

    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    params, cfg = _restore_params(checkpoint_dir)
    m = cfg.model
    tied = m.family == "gpt" or bool(np.array_equal(_get(params, "embedding"), _get(params, "lm_head")))
    tensors: dict[str, np.ndarray] = {}
    for spec in _tensors(m):
        if spec.path == "lm_head" and tied:
            continue
        value = _get(params, spec.path)
        if spec.per_layer:
            for i in range(m.layers):
                tensors[spec.hf.format(i=i)] = _to_hf(value[i], spec)
        else:
            tensors[spec.hf] = _to_hf(value, spec)
    tokenizer = checkpoint_tokenizer(checkpoint_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / HF_WEIGHTS), metadata={"format": "pt"})
    (output_dir / HF_CONFIG).write_text(json.dumps(_hf_config(m, tied, tokenizer.eod), indent=2) + "\n")
    if tokenizer.kind != "bytes":
        shutil.copyfile(tokenizer.path, output_dir / CHECKPOINT_FILES[tokenizer.kind])
        if tokenizer.kind == "huggingface":
            settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context(m)}
            if tokenizer.eod is not None:
                settings["eos_token"] = tokenizer.decode([tokenizer.eod])
            (output_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return output_dir
