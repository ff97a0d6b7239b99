"""The deepseek family's Hugging Face mapping: ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM``
<-> meshtron's DeepSeek (:mod:`meshtron.models.deepseek`); the contract of a mapping is
:mod:`meshtron.models.hf_mapping`'s.

Names: meshtron's parameters are named after Hugging Face's modules, so each tensor is its module's
name. Layouts: ``nn.Linear`` weights are ``[out, in]`` and a per-head ``out`` is ``(heads, d)``
(head-major), so ``q_b_proj[r, n, d] = q_b_proj.weight.T.reshape(r, n, d)`` (``q_proj`` and
``kv_b_proj`` likewise) and ``o_proj[n, v, h] = o_proj.weight.T.reshape(n, v, h)``. The rotary
features are used as stored: meshtron rotates adjacent pairs (``rope_interleave``, and always for a
V2, whose complex-number rotation pairs them the same way) or halves as Hugging Face does.

Experts are stored one by one, as the Hub's checkpoints and ``save_pretrained`` write them
(``mlp.experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj``), with the router ``mlp.gate.weight``
``[experts, hidden]`` and the shared experts as one SwiGLU (``mlp.shared_experts``, ``n_shared_experts
· moe_intermediate_size`` wide). The first ``first_k_dense_replace`` layers store a dense ``mlp``
instead: they are meshtron's ``prefix`` (Hugging Face's layer ``i`` its ``i``-th block), the layers after
them its ``blocks`` (layer ``i`` block ``i - first_k_dense_replace``).

**Routing.** A V3 routes by sigmoid scores, choosing by ``scores + e_score_correction_bias`` within
the ``topk_group`` best of ``n_group`` groups (each scored by its two best), weights renormalised
when ``norm_topk_prob``, times ``routed_scaling_factor``: :func:`meshtron.models.moe.route` with
``router: sigmoid``. The bias is part of the model -- it decides which experts a token uses -- so an
import keeps it as ``model.moe.selection_bias: true`` with ``bias_update_rate: 0``: present, used for
selection, never changed by training (set ``model.moe.bias_update_rate`` to move it by aux-loss-free
balancing in a fine-tune). A V2 routes by softmax scores, top-k without renormalisation (``greedy``),
times ``routed_scaling_factor``. V2's ``group_limited_greedy`` ranks groups by their best expert,
which meshtron's groups (their two best) do not, so only its unlimited form (``topk_group`` =
``n_group``) imports.

**Multi-token prediction.** A V3 stores its ``num_nextn_predict_layers`` modules after its own
layers, module ``k`` as ``model.layers.{num_hidden_layers + k - 1}``: a whole decoder layer (an expert
block, ``self_attn``, ``mlp``, both norms) with ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm``, and copies of the model's embedding (``embed_tokens``) and head
(``shared_head.head``). They are meshtron's ``mtp.depth{k}`` (:mod:`meshtron.models.mtp`:
``enorm``, ``hnorm``, ``eh_proj``, ``block``, ``norm``), which share the model's own embedding and
head, so an import checks that the copies equal them (DeepSeek's do: its weight notes call them
shared) and an export writes them back from the model's. ``transformers`` has no place for these
layers and leaves them out when it loads (for DeepSeek-V3's 61 layers silently, else with a warning
naming them). An import with ``model.mtp.layers=0`` leaves them out, saying so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from meshtron.config import MlaConfig, ModelConfig, MoEConfig, MtpConfig
from meshtron.errors import ConfigError
from meshtron.models.hf_mapping import HfTensor, context, number, refuse, size
from meshtron.models.llama_hf import DEFAULT_SEQ_LEN

DISPLAY_NAME = "DeepSeek"  # as meshtron configs lists it
GROUPED_QUERY = False  # keys and values come from one latent
FAMILY = "deepseek"
ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
PREFIX = "model."
HEAD = "lm_head"
EMBEDDING = "model.embed_tokens.weight"
_YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
         "attention_factor", "truncate")


def _stacks(m: ModelConfig) -> list[tuple[str, tuple[int, int] | None, bool]]:
    """Each stack of blocks: its path, the Hugging Face layers ``[first, end)`` it holds (None: all),
    and whether its blocks are mixtures of experts."""
    dense = m.first_k_dense_replace if m.moe.experts else 0
    if not dense:
        return [("blocks.", None, bool(m.moe.experts))]
    return [("prefix.", (0, dense), False), ("blocks.", (dense, m.layers), True)]


def tensors(m: ModelConfig) -> list[HfTensor]:
    h, v = m.hidden, m.vocab_size
    return [
        HfTensor("embedding", EMBEDDING, (v, h), vocab=True),
        *(spec for stack, layers, experts in _stacks(m) for spec in _block(m, stack, layers, experts)),
        HfTensor("norm.scale", "model.norm.weight", (h,)),
        HfTensor("lm_head", "lm_head.weight", (v, h), vocab=True),
        *mtp_tensors(m),
    ]


def _block(m: ModelConfig, stack: str, layers: tuple[int, int] | None, experts: bool) -> list[HfTensor]:
    """The tensors of the blocks under ``stack`` holding Hugging Face's ``layers``."""
    a, h, n = m.mla, m.hidden, m.heads
    dq = a.qk_nope_head_dim + a.qk_rope_head_dim
    layer, attn = "model.layers.{i}.", stack + "self_attn."

    def tensor(path: str, hf: str, shape: tuple[int, ...], linear: bool = False) -> HfTensor:
        return HfTensor(path, hf, shape, linear=linear, layers=layers)

    if a.q_lora_rank is None:
        queries = [tensor(attn + "q_proj.kernel", layer + "self_attn.q_proj.weight", (n * dq, h), linear=True)]
    else:
        r = a.q_lora_rank
        queries = [
            tensor(attn + "q_a_proj.kernel", layer + "self_attn.q_a_proj.weight", (r, h), linear=True),
            tensor(attn + "q_a_layernorm.scale", layer + "self_attn.q_a_layernorm.weight", (r,)),
            tensor(attn + "q_b_proj.kernel", layer + "self_attn.q_b_proj.weight", (n * dq, r), linear=True),
        ]
    return [
        tensor(stack + "input_layernorm.scale", layer + "input_layernorm.weight", (h,)),
        *queries,
        tensor(attn + "kv_a_proj_with_mqa.kernel", layer + "self_attn.kv_a_proj_with_mqa.weight",
               (a.kv_lora_rank + a.qk_rope_head_dim, h), linear=True),
        tensor(attn + "kv_a_layernorm.scale", layer + "self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,)),
        tensor(attn + "kv_b_proj.kernel", layer + "self_attn.kv_b_proj.weight",
               (n * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank), linear=True),
        tensor(attn + "o_proj.kernel", layer + "self_attn.o_proj.weight", (h, n * a.v_head_dim), linear=True),
        tensor(stack + "post_attention_layernorm.scale", layer + "post_attention_layernorm.weight", (h,)),
        *(_experts(m, stack + "mlp.", layer, layers) if experts else
          [tensor(f"{stack}mlp.{name}.kernel", f"{layer}mlp.{name}_proj.weight", shape, linear=True)
           for name, shape in (("gate", (m.mlp_dim, h)), ("up", (m.mlp_dim, h)), ("down", (h, m.mlp_dim)))]),
    ]


def _experts(m: ModelConfig, path: str, layer: str, layers: tuple[int, int] | None) -> list[HfTensor]:
    h, e = m.hidden, m.moe
    f = e.mlp_dim or m.mlp_dim
    fs, expert = e.shared_experts * f, layer + "mlp.experts.{j}."
    experts = [
        HfTensor(path + "router", layer + "mlp.gate.weight", (e.experts, h), linear=True, layers=layers),
        *(HfTensor(path + name, f"{expert}{name}_proj.weight", shape, linear=True, layers=layers)
          for name, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f)))),
        *(HfTensor(f"{path}shared_{name}", f"{layer}mlp.shared_experts.{name}_proj.weight", shape, linear=True,
                   layers=layers)
          for name, shape in (("gate", (fs, h)), ("up", (fs, h)), ("down", (h, fs)))),
    ]
    if e.selection_bias or e.bias_update_rate > 0:
        experts.append(HfTensor(path + "e_score_correction_bias", layer + "mlp.gate.e_score_correction_bias",
                                (e.experts,), layers=layers))
    return experts


def constants(m: ModelConfig) -> dict[str, np.ndarray]:
    """What Hugging Face does not store: the zeros of the selection bias's load probe, the stack's and
    each multi-token prediction depth's."""
    found: dict[str, np.ndarray] = {}
    if m.moe.experts and (m.moe.selection_bias or m.moe.bias_update_rate > 0):
        stack, layers, _ = _stacks(m)[-1]
        count = m.layers if layers is None else layers[1] - layers[0]
        found[stack + "mlp.expert_load"] = np.zeros((count, m.moe.experts), np.float32)
    return {**found, **_mtp_constants(m)}


def ignored(hf: dict[str, Any], m: ModelConfig) -> tuple[tuple[str, ...], str]:
    """The stored multi-token-prediction layers the model ``m`` has no module for (an import with
    ``model.mtp.layers=0``): left out, with the line that says so."""
    layers, extra = hf.get("num_hidden_layers"), _stored_mtp_layers(hf)
    if not isinstance(layers, int) or extra <= m.mtp.layers:
        return (), ""
    names = tuple(f"{start}layers.{layers + k}." for k in range(m.mtp.layers, extra) for start in ("model.", ""))
    return names, (f"num_nextn_predict_layers={extra}: model.mtp.layers={m.mtp.layers} leaves the "
                   "multi-token-prediction layers out")


# ---- multi-token prediction --------------------------------------------------------------------


def _stored_mtp_layers(hf: dict[str, Any]) -> int:
    extra = hf.get("num_nextn_predict_layers") or 0
    return extra if isinstance(extra, int) and not isinstance(extra, bool) and extra > 0 else 0


def _mtp_config(hf: dict[str, Any], where: Path) -> MtpConfig:
    """The multi-token prediction modules a V3 stores (``num_nextn_predict_layers``; none for a V2)."""
    extra = hf.get("num_nextn_predict_layers") or 0
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
        raise ConfigError(f"{where}: num_nextn_predict_layers={json.dumps(extra)}: expected an integer >= 0")
    return MtpConfig(layers=extra) if extra and not _is_v2(hf) else MtpConfig()


def stored_model(m: ModelConfig, names: Callable[[], Collection[str]]) -> ModelConfig:
    """``m`` with the multi-token prediction layers the checkpoint's tensors (named by ``names()``, asked
    only when ``config.json`` says it has such layers) hold: the first of ``num_nextn_predict_layers``
    that are stored (``transformers``' ``save_pretrained`` writes the field, 1 by default, and no layer)."""
    if not m.mtp.layers:
        return m
    stored = names()
    layers = 0
    while layers < m.mtp.layers and any(n.startswith((_mtp_layer(m, layers + 1), _mtp_layer(m, layers + 1)[len(PREFIX):]))
                                        for n in stored):
        layers += 1
    return replace(m, mtp=replace(m.mtp, layers=layers))


def _mtp_layer(m: ModelConfig, k: int) -> str:
    """Where depth ``k`` (1-based) is stored: the layer after the model's own and the earlier depths'."""
    return f"model.layers.{m.layers + k - 1}."


def mtp_tensors(m: ModelConfig) -> list[HfTensor]:
    """Each multi-token prediction depth's tensors: its norms and projection, and its block's, which
    are those of a layer of the stack after ``first_k_dense_replace`` (an expert block, or a dense one
    for a model without experts), one layer's instead of stacked (per expert, ``{j}``)."""
    if not m.mtp.layers:
        return []
    h = m.hidden
    block = [spec for spec in tensors(replace(m, first_k_dense_replace=0, mtp=MtpConfig())) if spec.per_layer]
    found = []
    for k in range(1, m.mtp.layers + 1):
        depth, layer = f"mtp.depth{k}.", _mtp_layer(m, k)
        found += [
            HfTensor(depth + "enorm.scale", layer + "enorm.weight", (h,)),
            HfTensor(depth + "hnorm.scale", layer + "hnorm.weight", (h,)),
            HfTensor(depth + "eh_proj.kernel", layer + "eh_proj.weight", (h, 2 * h), linear=True),
            HfTensor(depth + "norm.scale", layer + "shared_head.norm.weight", (h,)),
            *(HfTensor(depth + "block." + spec.path.removeprefix("blocks."),
                       spec.hf.replace("model.layers.{i}.", layer), spec.hf_shape, linear=spec.linear)
              for spec in block),
        ]
    return found


def _mtp_constants(m: ModelConfig) -> dict[str, np.ndarray]:
    """The selection bias's load probe of each depth's experts (zeros), as the stack's."""
    if not m.moe.experts or not (m.moe.selection_bias or m.moe.bias_update_rate > 0):
        return {}
    return {f"mtp.depth{k}.block.mlp.expert_load": np.zeros((m.moe.experts,), np.float32)
            for k in range(1, m.mtp.layers + 1)}


def copies(m: ModelConfig, tied: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(stored copy, original, shape)``: what each multi-token prediction layer stores of the model's
    own embedding and head (``embed_tokens``, ``shared_head.head``), which meshtron's depths share.
    An import requires each copy to equal its original; an export writes the original again."""
    head = EMBEDDING if tied else "lm_head.weight"
    shape = (m.vocab_size, m.hidden)
    return [pair for k in range(1, m.mtp.layers + 1)
            for pair in ((_mtp_layer(m, k) + "embed_tokens.weight", EMBEDDING, shape),
                         (_mtp_layer(m, k) + "shared_head.head.weight", head, shape))]


def _is_v2(hf: dict[str, Any]) -> bool:
    return hf.get("architectures") == ["DeepseekV2ForCausalLM"] or (
        not hf.get("architectures") and hf.get("model_type") == "deepseek_v2")


def _rope(hf: dict[str, Any], where: Path, max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """The RoPE base and YaRN parameters (None: plain RoPE), from ``rope_theta`` + ``rope_scaling``
    (transformers 4.x, DeepSeek's own configs) or ``rope_parameters`` (5.x)."""
    supported = "meshtron's deepseek has plain RoPE or YaRN (rope_type default or yarn)"
    scaling, parameters = hf.get("rope_scaling"), hf.get("rope_parameters")
    yarn = None
    for field, rope in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise refuse(where, field, rope, supported)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise refuse(where, field, rope, supported)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise refuse(where, f"{field}.partial_rotary_factor", rope["partial_rotary_factor"],
                          "meshtron's deepseek rotates all qk_rope_head_dim features (1.0)")
        if kind == "yarn":
            yarn = {"type": "yarn", **{k: rope[k] for k in _YARN if rope.get(k) is not None}}
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(where, "partial_rotary_factor", hf["partial_rotary_factor"],
                      "meshtron's deepseek rotates all qk_rope_head_dim features (1.0)")
    theta = (parameters or {}).get("rope_theta", (scaling or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    theta = number({"rope_theta": theta}, "rope_theta", where, 10000.0)
    if yarn is not None:
        original = yarn.setdefault("original_max_position_embeddings", max_positions)
        if yarn.get("factor") is None:  # transformers' rule for a config without one
            yarn["factor"] = max_positions / original
    return theta, yarn


def model_config(hf: dict[str, Any], where: Path) -> ModelConfig:
    """The meshtron model of a DeepSeek-V3 or -V2 ``config.json``; what it cannot represent (biases,
    another activation, another rotary scaling, key/value heads of their own, V2's group-limited
    routing, no shared experts) is one line naming the field."""
    v2 = _is_v2(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", hf["hidden_act"], "meshtron's deepseek MLPs are SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            raise refuse(where, field, hf[field], "meshtron's deepseek has no biases (false)")
    hidden, heads = size(hf, "hidden_size", where), size(hf, "num_attention_heads", where)
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise refuse(where, "num_key_value_heads", kv_heads,
                     f"a DeepSeek's keys and values come from one latent per head: num_attention_heads={heads}")
    layers = size(hf, "num_hidden_layers", where)
    max_positions = size(hf, "max_position_embeddings", where, 2048)
    q_lora_rank = hf.get("q_lora_rank")
    if q_lora_rank is not None:
        q_lora_rank = size(hf, "q_lora_rank", where)
    rope_dim = size(hf, "qk_rope_head_dim", where)
    if rope_dim % 2:
        raise refuse(where, "qk_rope_head_dim", rope_dim, "rotary features turn in pairs: an even number")
    interleave = True if v2 else hf.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise refuse(where, "rope_interleave", interleave, "true or false")
    theta, yarn = _rope(hf, where, max_positions)
    mlp_dim = size(hf, "intermediate_size", where)
    moe, first_dense = _moe_config(hf, where, layers, v2)
    return ModelConfig(
        family=FAMILY, vocab_size=size(hf, "vocab_size", where), hidden=hidden, heads=heads, layers=layers,
        mlp_dim=mlp_dim, seq_len=min(max_positions, DEFAULT_SEQ_LEN), max_position_embeddings=max_positions,
        rope_theta=theta, rope_scaling=yarn, norm_eps=number(hf, "rms_norm_eps", where, 1e-6),
        mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=size(hf, "kv_lora_rank", where),
                      qk_nope_head_dim=size(hf, "qk_nope_head_dim", where), qk_rope_head_dim=rope_dim,
                      v_head_dim=size(hf, "v_head_dim", where), rope_interleave=interleave),
        moe=moe, first_k_dense_replace=first_dense, mtp=_mtp_config(hf, where),
    )


def _moe_config(hf: dict[str, Any], where: Path, layers: int, v2: bool) -> tuple[MoEConfig, int]:
    """The experts and the dense blocks before them; a model whose every layer is dense has none."""
    first_dense = hf.get("first_k_dense_replace", 0)
    if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise ConfigError(f"{where}: first_k_dense_replace={json.dumps(first_dense)}: expected an integer >= 0")
    if hf.get("n_routed_experts") is None or first_dense >= layers:
        return MoEConfig(), 0
    if hf.get("moe_layer_freq", 1) != 1:
        raise refuse(where, "moe_layer_freq", hf["moe_layer_freq"],
                     "every layer after first_k_dense_replace has experts in meshtron's deepseek (1)")
    experts, top_k = size(hf, "n_routed_experts", where), size(hf, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} is more than n_routed_experts={experts}")
    shared = hf.get("n_shared_experts")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise refuse(where, "n_shared_experts", shared, "meshtron's deepseek has at least one shared expert")
    scores, method = ("softmax", "greedy") if v2 else ("sigmoid", "noaux_tc")
    if hf.get("scoring_func", scores) != scores:
        raise refuse(where, "scoring_func", hf["scoring_func"], f"a DeepSeek-{'V2' if v2 else 'V3'} scores by {scores}")
    method_field = hf.get("topk_method", method)
    if method_field not in (method, "group_limited_greedy" if v2 else method):
        raise refuse(where, "topk_method", method_field, f"a DeepSeek-{'V2' if v2 else 'V3'} routes by {method}")
    n_group = size(hf, "n_group", where, 1) if hf.get("n_group") is not None else 1
    topk_group = size(hf, "topk_group", where, n_group) if hf.get("topk_group") is not None else n_group
    if v2 and method_field == "group_limited_greedy" and topk_group < n_group:
        raise refuse(where, "topk_method", method_field, "meshtron ranks expert groups by their two best experts "
                     "(noaux_tc), not their best; greedy, or topk_group = n_group")
    if v2:  # greedy ignores the groups, and group_limited_greedy keeping them all is greedy
        n_group = topk_group = 1
    if experts % n_group or (n_group > 1 and experts // n_group < 2) or topk_group > n_group:
        raise ConfigError(f"{where}: n_group={n_group}, topk_group={topk_group}: expected groups of at least 2 of "
                          f"the n_routed_experts={experts} experts, topk_group of them kept")
    weight = float(hf.get("aux_loss_alpha") or 0.0)
    per_sequence = bool(hf.get("seq_aux", True))
    return MoEConfig(
        experts=experts, top_k=top_k, mlp_dim=size(hf, "moe_intermediate_size", where), shared_experts=shared,
        router=scores, normalize_top_k=False if v2 else bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=number(hf, "routed_scaling_factor", where, 1.0 if v2 else 2.5),
        n_group=n_group, topk_group=topk_group, selection_bias=not v2,
        aux_loss_weight=0.0 if per_sequence else weight, sequence_aux_loss_weight=weight if per_sequence else 0.0,
    ), first_dense


def head_tied(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint stores its head as the embedding (``tie_word_embeddings``)."""
    return bool(hf.get("tie_word_embeddings", False))


def ties_on_export(params: dict[str, Any]) -> bool:
    """Write the head tied when it still equals the embedding."""
    return bool(np.array_equal(np.asarray(params["embedding"]), np.asarray(params["lm_head"])))


def _exportable(m: ModelConfig) -> bool:
    """Whether the model is a V2 (softmax scores, no renormalisation, no bias) rather than a V3; one line
    for a mixture of experts neither can hold."""
    e = m.moe
    if not e.experts:
        return False
    if e.capacity_factor:
        raise ConfigError("model.moe.capacity_factor: a DeepSeek's experts are dropless; this model cannot be exported "
                          "to Hugging Face")
    if not e.shared_experts:
        raise ConfigError("model.moe.shared_experts: a DeepSeek has at least one shared expert; this model cannot be "
                          "exported to Hugging Face")
    if e.router == "sigmoid":
        return False
    if e.normalize_top_k or e.selection_bias or e.bias_update_rate > 0 or not m.mla.rope_interleave:
        field = ("normalize_top_k" if e.normalize_top_k else "selection_bias" if e.selection_bias
                 or e.bias_update_rate > 0 else "mla.rope_interleave")
        raise ConfigError(f"model.{'' if field.startswith('mla') else 'moe.'}{field}: a softmax router is a "
                          "DeepSeek-V2's, which neither renormalises its top-k weights nor has a selection bias, and "
                          "rotates adjacent pairs; this model cannot be exported to Hugging Face")
    return True


def zeros_on_export(m: ModelConfig) -> dict[str, np.ndarray]:
    """What transformers needs that the model does not hold: a V3's selection bias, zeros (no bias) for
    a model routed without one."""
    e = m.moe
    if not e.experts or e.router != "sigmoid" or e.selection_bias or e.bias_update_rate > 0:
        return {}
    return {f"model.layers.{i}.mlp.gate.e_score_correction_bias": np.zeros((e.experts,), np.float32)
            for i in range(m.first_k_dense_replace, m.layers)}


def hf_config(m: ModelConfig, tied: bool, eod: int | None) -> dict[str, Any]:
    """The exported ``config.json``: a ``DeepseekV3ForCausalLM`` (sigmoid router, or no experts) or a
    ``DeepseekV2ForCausalLM`` (softmax router), in float32."""
    v2, a, e = _exportable(m), m.mla, m.moe
    experts = e.experts or 1
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        yarn = {k: v for k, v in m.rope_scaling.items() if k not in ("type", "rope_type")}
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, **yarn}
    config = {
        "architectures": [ARCHITECTURES[1] if v2 else ARCHITECTURES[0]],
        "model_type": MODEL_TYPES[1] if v2 else MODEL_TYPES[0], "vocab_size": m.vocab_size,
        "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": tied, "torch_dtype": "float32",
        "dtype": "float32", "use_cache": True,
        "hidden_size": m.hidden, "num_attention_heads": m.heads, "num_key_value_heads": m.heads,
        "num_hidden_layers": m.layers, "intermediate_size": m.mlp_dim,
        "max_position_embeddings": context(m), "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_parameters": rope, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
        "first_k_dense_replace": m.first_k_dense_replace if e.experts else m.layers,
        "n_routed_experts": experts, "num_experts_per_tok": e.top_k if e.experts else 1,
        "moe_intermediate_size": (e.mlp_dim or m.mlp_dim) if e.experts else m.mlp_dim,
        "n_shared_experts": e.shared_experts if e.experts else 1, "routed_scaling_factor": e.routed_scaling_factor,
        "n_group": e.n_group if e.experts else 1,
        "topk_group": (e.n_group if e.topk_group is None else e.topk_group) if e.experts else 1,
        "aux_loss_alpha": e.sequence_aux_loss_weight or e.aux_loss_weight, "seq_aux": e.sequence_aux_loss_weight > 0,
    }
    if v2:
        ungrouped = {"n_group": None, "topk_group": None} if config["n_group"] == 1 else {}  # V2's spelling
        return {**config, **ungrouped, "mlp_bias": False, "topk_method": "greedy", "scoring_func": "softmax",
                "norm_topk_prob": False}
    return {**config, "rope_interleave": a.rope_interleave, "norm_topk_prob": e.normalize_top_k,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": m.mtp.layers}
