"""The Llama family's Hugging Face mapping: ``LlamaForCausalLM`` (and a ``MistralForCausalLM`` that is a
Llama: no sliding window) and ``MixtralForCausalLM`` <-> meshtron's Llama (:mod:`meshtron.models.llama`,
with ``model.moe`` for a Mixtral); the contract of a mapping is :mod:`meshtron.models.hf_mapping`'s.

Layouts: ``nn.Linear`` weights are ``[out, in]``; the query projection's ``out`` is ``(n, d)``
(head-major), so ``wq[h, n, d] = q_proj.weight.T.reshape(h, n, d)``, likewise ``wk``/``wv`` with
``k`` heads, and ``wo[n, d, h] = o_proj.weight.T.reshape(n, d, h)``. Query head ``j`` uses key/value
head ``j // (n / k)`` in both (Hugging Face's ``repeat_kv``, ``jax.nn``'s grouping). Both use the
half-split rotary embedding (``rotate_half``) with ``theta^(-2i/d)`` frequencies, so no permutation
of the query/key rows is needed. A tied Llama (``tie_word_embeddings: true``) is imported with its
embedding copied into meshtron's separate ``lm_head``; on export the head is tied again when the two
are still equal.

A Mixtral's experts are stored one by one, as the Hub's checkpoints and ``save_pretrained`` write
them: ``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up) and ``w2`` (down), each an
``nn.Linear``, and the router ``block_sparse_moe.gate.weight`` ``[experts, hidden]``. meshtron
stacks them ``[layers, experts, ...]`` and its router is ``[hidden, experts]``. Both route the same
way: softmax over the experts, top-k, the k weights renormalised.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from meshtron.config import ModelConfig, MoEConfig
from meshtron.errors import ConfigError
from meshtron.models.hf_mapping import HfTensor, context, number, refuse, size

DISPLAY_NAME = "Llama"  # as meshtron configs lists it
GROUPED_QUERY = True  # key/value heads of their own (model.kv_heads)
FAMILY = "llama"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
MODEL_TYPES = ("llama", "mistral", "mixtral")
PREFIX = "model."
HEAD = "lm_head"  # meshtron's separate head parameter
EMBEDDING = "model.embed_tokens.weight"
# A Llama's max_position_embeddings is its longest context (128k for Llama 3.x), kept as
# model.max_position_embeddings; meshtron's seq_len is the training window and generate's context,
# so an import caps that here (model.seq_len overrides it).
DEFAULT_SEQ_LEN = 4096


def tensors(m: ModelConfig) -> list[HfTensor]:
    h, f, v = m.hidden, m.mlp_dim, m.vocab_size
    d = m.hidden // m.heads
    qd, kvd = m.heads * d, (m.kv_heads or m.heads) * d
    layer = "model.layers.{i}."
    return [
        HfTensor("embedding", "model.embed_tokens.weight", (v, h), vocab=True),
        HfTensor("blocks.attn_norm.scale", layer + "input_layernorm.weight", (h,)),
        HfTensor("blocks.attn.wq.kernel", layer + "self_attn.q_proj.weight", (qd, h), linear=True),
        HfTensor("blocks.attn.wk.kernel", layer + "self_attn.k_proj.weight", (kvd, h), linear=True),
        HfTensor("blocks.attn.wv.kernel", layer + "self_attn.v_proj.weight", (kvd, h), linear=True),
        HfTensor("blocks.attn.wo.kernel", layer + "self_attn.o_proj.weight", (h, qd), linear=True),
        HfTensor("blocks.mlp_norm.scale", layer + "post_attention_layernorm.weight", (h,)),
        *(_experts(m, layer) if m.moe.experts else [
            HfTensor("blocks.mlp.gate.kernel", layer + "mlp.gate_proj.weight", (f, h), linear=True),
            HfTensor("blocks.mlp.up.kernel", layer + "mlp.up_proj.weight", (f, h), linear=True),
            HfTensor("blocks.mlp.down.kernel", layer + "mlp.down_proj.weight", (h, f), linear=True),
        ]),
        HfTensor("norm.scale", "model.norm.weight", (h,)),
        HfTensor("lm_head", "lm_head.weight", (v, h), vocab=True),
    ]


def _experts(m: ModelConfig, layer: str) -> list[HfTensor]:
    h, f = m.hidden, m.moe.mlp_dim or m.mlp_dim
    expert = layer + "block_sparse_moe.experts.{j}."
    return [
        HfTensor("blocks.mlp.router", layer + "block_sparse_moe.gate.weight", (m.moe.experts, h), linear=True),
        HfTensor("blocks.mlp.gate", expert + "w1.weight", (f, h), linear=True),
        HfTensor("blocks.mlp.up", expert + "w3.weight", (f, h), linear=True),
        HfTensor("blocks.mlp.down", expert + "w2.weight", (h, f), linear=True),
    ]


def _rope_theta(hf: dict[str, Any], where: Path) -> float:
    """The RoPE base of a plain (unscaled, full-head) rotary embedding, in either spelling:
    ``rope_theta`` + ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x)."""
    supported = "meshtron's Llama has plain RoPE (rope_type default: no scaling); use a model without RoPE scaling"
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    for field, rope in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise refuse(where, field, rope, supported)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise refuse(where, field, rope, supported)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise refuse(where, f"{field}.partial_rotary_factor", rope["partial_rotary_factor"],
                          "meshtron's Llama rotates the whole head (1.0)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(where, "partial_rotary_factor", hf["partial_rotary_factor"],
                      "meshtron's Llama rotates the whole head (1.0)")
    theta = (parameters or {}).get("rope_theta", (scaling or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    return number({"rope_theta": theta}, "rope_theta", where, 10000.0)


def model_config(hf: dict[str, Any], where: Path) -> ModelConfig:
    """The meshtron model of a Llama ``config.json``; what it cannot represent (scaled RoPE, biases,
    another activation, a sliding window, an explicit head size) is one line naming the field."""
    def flag(field: str) -> None:
        if hf.get(field, False):
            raise refuse(where, field, hf[field], "meshtron's Llama has no biases (false)")

    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", hf["hidden_act"], "meshtron's Llama MLP is SwiGLU (silu)")
    flag("attention_bias")
    flag("mlp_bias")
    if hf.get("model_type") == "mistral" or hf.get("architectures") == ["MistralForCausalLM"]:
        window = hf.get("sliding_window", 4096)  # Mistral's default when the field is absent
        if window is not None:
            raise refuse(where, "sliding_window", window, "meshtron attends to the whole context (null)")
    elif hf.get("sliding_window") is not None or hf.get("use_sliding_window"):
        field = "use_sliding_window" if hf.get("use_sliding_window") else "sliding_window"
        raise refuse(where, field, hf[field], "meshtron attends to the whole context (null / false)")
    hidden, heads = size(hf, "hidden_size", where), size(hf, "num_attention_heads", where)
    if hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise refuse(where, "head_dim", head_dim,
                      f"meshtron's heads are hidden_size / num_attention_heads = {hidden // heads} wide")
    kv_heads = size(hf, "num_key_value_heads", where, heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    max_positions = size(hf, "max_position_embeddings", where, 2048)
    mlp_dim = size(hf, "intermediate_size", where)
    return ModelConfig(
        family="llama", vocab_size=size(hf, "vocab_size", where), hidden=hidden, heads=heads, kv_heads=kv_heads,
        layers=size(hf, "num_hidden_layers", where), mlp_dim=mlp_dim,
        seq_len=min(max_positions, DEFAULT_SEQ_LEN), max_position_embeddings=max_positions,
        rope_theta=_rope_theta(hf, where), norm_eps=number(hf, "rms_norm_eps", where, 1e-6),
        moe=_moe_config(hf, where, mlp_dim),
    )


def _is_mixtral(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") == "mixtral" or hf.get("architectures") == ["MixtralForCausalLM"]


def _moe_config(hf: dict[str, Any], where: Path, mlp_dim: int) -> MoEConfig:
    """A Mixtral's experts (its experts are ``intermediate_size`` wide); a dense Llama's none."""
    if not _is_mixtral(hf):
        return MoEConfig()
    if hf.get("router_jitter_noise", 0.0):
        raise refuse(where, "router_jitter_noise", hf["router_jitter_noise"],
                     "meshtron routes without noise (0.0); it only affects training in transformers")
    experts = size(hf, "num_local_experts", where, 8)
    top_k = size(hf, "num_experts_per_tok", where, 2)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} is more than num_local_experts={experts}")
    return MoEConfig(experts=experts, top_k=top_k, mlp_dim=mlp_dim,
                     aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))



def head_tied(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint stores its head as the embedding (Llama 3.2's ``tie_word_embeddings``)."""
    return bool(hf.get("tie_word_embeddings", False))


def ties_on_export(params: dict[str, Any]) -> bool:
    """Write the head tied when it still equals the embedding."""
    return bool(np.array_equal(np.asarray(params["embedding"]), np.asarray(params["lm_head"])))


def hf_config(m: ModelConfig, tied: bool, eod: int | None) -> dict[str, Any]:
    """The exported ``config.json``: a ``LlamaForCausalLM`` in float32, or a ``MixtralForCausalLM``."""
    if m.moe.experts:
        e = m.moe
        if e.capacity_factor or e.shared_experts or not e.normalize_top_k:
            field = ("capacity_factor" if e.capacity_factor else "shared_experts" if e.shared_experts
                     else "normalize_top_k")
            raise ConfigError(f"model.moe.{field}: a Mixtral is dropless, without shared experts and with "
                              "renormalised top-k weights; this model cannot be exported as one")
        limited = e.n_group > 1 and (e.topk_group or e.n_group) < e.n_group
        routed = {"router": e.router != "softmax", "routed_scaling_factor": e.routed_scaling_factor != 1.0,
                  "topk_group": limited, "bias_update_rate": e.bias_update_rate > 0, "selection_bias": e.selection_bias}
        for field, differs in routed.items():
            if differs:
                raise ConfigError(f"model.moe.{field}: a Mixtral routes by softmax top-k over every expert, without a "
                                  "selection bias or a scaling factor; this model cannot be exported as one")
        dense = hf_config(replace(m, moe=MoEConfig(), mlp_dim=e.mlp_dim or m.mlp_dim), tied, eod)
        for field in ("mlp_bias", "pretraining_tp", "head_dim"):
            dense.pop(field)
        return {**dense, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": e.experts, "num_experts_per_tok": e.top_k, "router_jitter_noise": 0.0,
                "router_aux_loss_coef": e.aux_loss_weight, "output_router_logits": False, "sliding_window": None}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
        "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": tied, "torch_dtype": "float32",
        "dtype": "float32", "use_cache": True,
        "hidden_size": m.hidden, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads or m.heads,
        "head_dim": m.hidden // m.heads, "num_hidden_layers": m.layers, "intermediate_size": m.mlp_dim,
        "max_position_embeddings": context(m), "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": 0.02,
    }
