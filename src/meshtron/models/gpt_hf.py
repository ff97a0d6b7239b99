"""The GPT family's Hugging Face mapping: ``GPT2LMHeadModel`` <-> meshtron's GPT
(:mod:`meshtron.models.gpt`); the contract of a mapping is :mod:`meshtron.models.hf_mapping`'s.

Layouts: ``Conv1D`` weights are ``[in, out]``; ``c_attn``'s ``3h`` outputs are the query, key and
value blocks, each head-major, so ``qkv[h, 3, n, d] = c_attn.weight.reshape(h, 3, n, d)``, exactly
meshtron's fused kernel; GELU is the tanh approximation (``gelu_new``, ``jax.nn.gelu``'s default); the
LM head is the embedding (tied), and the learned position table keeps its ``n_positions`` rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtron.config import ModelConfig
from meshtron.errors import ConfigError
from meshtron.models.hf_mapping import HfTensor, context, number, refuse, size

DISPLAY_NAME = "GPT"  # as meshtron configs lists it
GROUPED_QUERY = False  # key/value heads of their own (model.kv_heads)
FAMILY = "gpt"
ARCHITECTURES = ("GPT2LMHeadModel",)
MODEL_TYPES = ("gpt2",)
PREFIX = "transformer."
HEAD = None  # the head is the embedding
EMBEDDING = "transformer.wte.weight"
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def tensors(m: ModelConfig) -> list[HfTensor]:
    h, f, v = m.hidden, m.mlp_dim, m.vocab_size
    layer = "transformer.h.{i}."
    return [
        HfTensor("wte", "transformer.wte.weight", (v, h), vocab=True),
        HfTensor("wpe", "transformer.wpe.weight", (context(m), h)),
        HfTensor("blocks.ln1.scale", layer + "ln_1.weight", (h,)),
        HfTensor("blocks.ln1.bias", layer + "ln_1.bias", (h,)),
        HfTensor("blocks.attn.qkv.kernel", layer + "attn.c_attn.weight", (h, 3 * h)),
        HfTensor("blocks.attn.qkv.bias", layer + "attn.c_attn.bias", (3 * h,)),
        HfTensor("blocks.attn.out.kernel", layer + "attn.c_proj.weight", (h, h)),
        HfTensor("blocks.attn.out.bias", layer + "attn.c_proj.bias", (h,)),
        HfTensor("blocks.ln2.scale", layer + "ln_2.weight", (h,)),
        HfTensor("blocks.ln2.bias", layer + "ln_2.bias", (h,)),
        HfTensor("blocks.mlp.fc1.kernel", layer + "mlp.c_fc.weight", (h, f)),
        HfTensor("blocks.mlp.fc1.bias", layer + "mlp.c_fc.bias", (f,)),
        HfTensor("blocks.mlp.fc2.kernel", layer + "mlp.c_proj.weight", (f, h)),
        HfTensor("blocks.mlp.fc2.bias", layer + "mlp.c_proj.bias", (h,)),
        HfTensor("ln_f.scale", "transformer.ln_f.weight", (h,)),
        HfTensor("ln_f.bias", "transformer.ln_f.bias", (h,)),
    ]


def model_config(hf: dict[str, Any], where: Path) -> ModelConfig:
    """The meshtron model of a GPT-2 ``config.json``; what it cannot represent (another activation,
    untied head, cross-attention, attention scaled by layer) is one line naming the field."""
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        raise refuse(where, "activation_function", hf["activation_function"],
                      "meshtron's GPT uses the tanh-approximated GELU (gelu_new)")
    for field, wanted, why in (
        ("scale_attn_weights", True, "meshtron scales attention scores by 1/sqrt(head_dim) (true)"),
        ("scale_attn_by_inverse_layer_idx", False, "meshtron does not scale attention by layer (false)"),
        ("add_cross_attention", False, "meshtron's GPT is decoder-only (false)"),
        ("tie_word_embeddings", True, "meshtron's GPT ties its LM head to the embedding (true)"),
    ):
        if hf.get(field, wanted) != wanted:
            raise refuse(where, field, hf[field], why)
    hidden, heads = size(hf, "n_embd", where, 768), size(hf, "n_head", where, 12)
    if hidden % heads:
        raise ConfigError(f"{where}: n_embd={hidden} is not a multiple of n_head={heads}")
    inner = hf.get("n_inner")
    positions = size(hf, "n_positions", where, 1024)
    return ModelConfig(
        family="gpt", vocab_size=size(hf, "vocab_size", where, 50257), hidden=hidden, heads=heads,
        layers=size(hf, "n_layer", where, 12), mlp_dim=4 * hidden if inner is None else size(hf, "n_inner", where),
        seq_len=positions, max_position_embeddings=positions,
        norm_eps=number(hf, "layer_norm_epsilon", where, 1e-5),
    )



def head_tied(hf: dict[str, Any]) -> bool:
    """GPT-2's head is its embedding (a saved ``lm_head.weight`` is a copy)."""
    return True


def ties_on_export(params: dict[str, Any]) -> bool:
    return True


def hf_config(m: ModelConfig, tied: bool, eod: int | None) -> dict[str, Any]:
    """The exported ``config.json``: a ``GPT2LMHeadModel`` in float32."""
    return {
        "architectures": list(ARCHITECTURES), "model_type": "gpt2", "vocab_size": m.vocab_size,
        "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": tied, "torch_dtype": "float32",
        "dtype": "float32", "use_cache": True,
        "n_embd": m.hidden, "n_head": m.heads, "n_layer": m.layers, "n_inner": m.mlp_dim,
        "n_positions": context(m), "n_ctx": context(m), "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
    }
