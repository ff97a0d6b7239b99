"""The deepseek family's numbers (:mod:`meshtron.models.deepseek`): what its block keeps for the backward,
its parameters per tensor rank, and what its decoding cache holds per token. Pure Python, no JAX: the
planner, the step-memory model (:mod:`meshtron.plan.step_memory`) and ``describe`` ask for them through
:mod:`meshtron.families`.

The block: two RMSNorms, multi-head latent attention (``model.mla``: the query latent and its norm, the
key/value latent with the shared rotary key and its norm, the per-head expansions, the output
projection), and a dense SwiGLU MLP of ``mlp_dim``. Like the Llama family's counts these price the
dense block: a mixture of experts' parameters are not counted here (``describe`` prices a run's
parameters from the model itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshtron.megatron import BlockActivations

if TYPE_CHECKING:
    from meshtron.config import ModelConfig

BLOCK = BlockActivations(residual=6, gathered=2, query=2, key_value=2, mlp=6, scores=2)
"""The Llama block's constants (:data:`meshtron.models.llama_counts.BLOCK`), in units of
``hidden``-wide query and key/value arrays. Latent attention keeps arrays of other widths (per head
``qk_nope + qk_rope`` query and key features, ``v_head_dim`` value features padded to the wider of the
two, the latents replicated on every tensor rank): these constants price it as a Llama block of the
same hidden size, heads and MLP width."""

PAPER_GPT = False
"""Not the PTD-P paper's GPT: the planner (:mod:`meshtron.plan`) does not price it."""


def kv_heads(m: ModelConfig) -> int:
    """Key/value heads in training: one per query head (each head expands the shared latent itself)."""
    return m.heads


def _mla(shape: Any) -> Any:
    mla = getattr(shape, "mla", None)
    if mla is None:
        raise ValueError(f"deepseek counts need the model's latent attention sizes (model.mla); {type(shape).__name__} "
                         "has none")
    return mla


def attention_parameters(shape: Any, tensor: int) -> float:
    """One layer's latent attention parameters on one tensor rank: the per-head projections (``q_b_proj``
    or ``q_proj``, ``kv_b_proj``, ``o_proj``) split over ``tensor``, the latent projections and their norms
    whole."""
    a, h, n, t = _mla(shape), shape.hidden, shape.heads, tensor
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    query = n * qk * h / t if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * qk / t
    latent = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    return query + latent + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) / t + n * a.v_head_dim * h / t


def block_parameters(shape: Any, tensor: int) -> float:
    """One layer's parameters on one tensor rank: the latent attention (:func:`attention_parameters`), the
    MLP's three matrices split over ``tensor``, the two RMSNorms' scales whole."""
    h, f = shape.hidden, shape.mlp_dim
    return attention_parameters(shape, tensor) + 3 * h * f / tensor + 2 * h


def other_parameters(shape: Any, vocab: int, tensor: int) -> float:
    """Outside the blocks on one tensor rank (``vocab``: the padded vocabulary): the embedding, the
    untied head and the final RMSNorm."""
    h = shape.hidden
    return 2 * vocab * h / tensor + h


def weight_boundary(shape: Any, tensor: int) -> float:
    """Per token, the elements a zb-h1 ``B`` leaves for ``W`` (:mod:`meshtron.plan.step_memory`): every
    weight-bearing projection's output cotangent -- the latent projections' whole (replicated), the
    per-head ones and the gate/up ones split over ``tensor``, the attention output's and the MLP down
    projection's whole (``h`` each)."""
    a, h, n, f, t = _mla(shape), shape.hidden, shape.heads, shape.mlp_dim, tensor
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    latents = (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
    return 2 * h + latents + n * (qk + a.qk_nope_head_dim + a.v_head_dim) / t + 2 * f / t


def cache_elements_per_token(m: ModelConfig) -> dict[str, int]:
    """Per token and layer, what a decoding cache holds: the latent cache (``kv_lora_rank +
    qk_rope_head_dim``) and, for comparison, full keys and values (``heads · (qk_nope + qk_rope +
    v_head_dim)``)."""
    a = m.mla
    return {"latent": a.kv_lora_rank + a.qk_rope_head_dim,
            "keys_values": m.heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)}
