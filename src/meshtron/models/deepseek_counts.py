"""The deepseek family's numbers (:mod:`meshtron.models.deepseek`): what its block keeps for the backward,
its parameters per tensor rank, and what its decoding cache holds per token. Pure Python, no JAX: the
planner, the step-memory model (:mod:`meshtron.plan.step_memory`) and ``describe`` ask for them through
:mod:`meshtron.families`.

The block: two RMSNorms, multi-head latent attention (``model.mla``: the query latent and its norm, the
key/value latent with the shared rotary key and its norm, the per-head expansions, the output
projection), and a dense SwiGLU MLP of ``mlp_dim`` or a mixture of experts (``model.moe``). The block
parameters price the dense block (``describe`` prices a run's parameters from the model itself);
what a block keeps for the backward (:func:`block_activations`) counts the latent attention's own
widths and the experts' rows; the parameters outside the blocks include the multi-token prediction
modules (:func:`mtp_parameters`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from meshtron.megatron import BlockActivations

if TYPE_CHECKING:
    from meshtron.config import ModelConfig

BLOCK = BlockActivations(residual=6, gathered=2, query=2, key_value=2, mlp=6, scores=2)
"""The Llama block's constants (:data:`meshtron.models.llama_counts.BLOCK`): what a model of this family
keeps when only a Llama-like block's shape is known. :func:`block_activations` counts its own."""

ROW_STATISTICS = 2
"""Per token and RMSNorm (two on the residual stream, the key/value latent's and any query latent's), the
per-row scalars the block keeps of its reciprocal root mean square."""

ROUTING_SCALARS = 4
"""Per token, besides ``5·top_k`` per-choice numbers (the chosen experts' indices, scores and combine
weights), the scalars a mixture of experts keeps: its rows' sort positions and the weights' sums."""


def block_activations(shape: Any) -> BlockActivations:
    """What autodiff keeps of one block for its backward, per token, as :class:`BlockActivations` in its
    units (``tests/test_sequence_parallel.py`` holds them to ``jax.ad_checkpoint.saved_residuals``):

    * outside the tensor-parallel regions, the Llama block's six residual-stream arrays and two norm
      outputs, and, whole on every tensor rank, the latents (the query latent's and the key/value
      latent's projection, norm input and output: four of each), the norms' row statistics, and a
      mixture of experts' rows in and out (``2·top_k·h``: dispatched and combined), its output and router
      scores (``h + experts``) and its routing scalars;
    * inside them, split over ``tensor``: the queries, keys and values, each head's padded to the wider
      of ``qk_nope + qk_rope`` and ``v_head_dim`` (three arrays), and the attention output (``v_head_dim``
      per head) -- counted in ``query`` units of ``hidden``; the dense MLP's six ``mlp_dim``-wide arrays,
      and a mixture of experts' six per chosen expert (``moe.mlp_dim``) and six of the shared experts'
      width -- in ``mlp`` units of ``mlp_dim``; and the scores (two per head, as the Llama block's).

    With ``first_k_dense_replace`` > 0 and experts, the model runs that many dense blocks (its
    ``prefix``) and then expert blocks: the layer average of the two, what the model keeps over all its
    layers divided by their number."""
    moe = getattr(shape, "moe", None)
    first_dense = getattr(shape, "first_k_dense_replace", 0)
    if moe is None or moe.experts == 0 or first_dense == 0:
        return _block_activations(shape, moe if moe is not None and moe.experts > 0 else None)
    dense, routed = _block_activations(shape, None), _block_activations(shape, moe)
    share = first_dense / shape.layers
    return BlockActivations(**{f.name: share * getattr(dense, f.name) + (1 - share) * getattr(routed, f.name)
                               for f in fields(BlockActivations)})


def _block_activations(shape: Any, moe: Any) -> BlockActivations:
    """One block's: a dense MLP without ``moe``, the experts with it."""
    a, h, n, f = _mla(shape), shape.hidden, shape.heads, shape.mlp_dim
    width = max(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
    norms = 3 + (a.q_lora_rank is not None)
    latents = 4 * ((a.q_lora_rank or 0) + a.kv_lora_rank) + norms * ROW_STATISTICS
    mlp = 6.0
    if moe is not None:
        fe = moe.mlp_dim or f
        mlp = 6 * (moe.top_k * fe + moe.shared_experts * fe) / f
        latents += (2 * moe.top_k + 1) * h + moe.experts + 5 * moe.top_k + ROUTING_SCALARS
    return BlockActivations(residual=6, gathered=2 + latents / h, query=(3 * n * width + n * a.v_head_dim) / h,
                            key_value=0, mlp=mlp, scores=2)


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


def moe_parameters(shape: Any, tensor: int) -> float:
    """One mixture of experts' parameters on one tensor rank: the routed and shared experts' SwiGLU
    matrices split over ``tensor`` (their ``mlp`` dimension), the router whole, and with a selection
    bias the bias and its load probe (``experts`` each)."""
    e, h = shape.moe, shape.hidden
    fe = e.mlp_dim or shape.mlp_dim
    bias = 2 * e.experts if e.selection_bias or e.bias_update_rate > 0 else 0
    return 3 * h * fe * (e.experts + e.shared_experts) / tensor + h * e.experts + bias


def mtp_parameters(shape: Any, tensor: int) -> float:
    """The multi-token prediction modules' parameters on one tensor rank (``mtp_layers`` of them, DeepSeek-V3's
    11.6B for its one): per module three RMSNorms (``enorm``, ``hnorm``, ``norm``), ``eh_proj``
    (``2·hidden × hidden``, whole) and a block -- the latent attention, two norms, and a mixture of experts
    when the model has experts, else the dense MLP. The embedding and head are the model's own."""
    depths = getattr(shape, "mtp_layers", 0)
    if not depths:
        return 0.0
    h, moe = shape.hidden, getattr(shape, "moe", None)
    mlp = moe_parameters(shape, tensor) if moe is not None and moe.experts else 3 * h * shape.mlp_dim / tensor
    return depths * (3 * h + 2 * h * h + attention_parameters(shape, tensor) + 2 * h + mlp)


def other_parameters(shape: Any, vocab: int, tensor: int) -> float:
    """Outside the blocks on one tensor rank (``vocab``: the padded vocabulary): the embedding, the
    untied head, the final RMSNorm, and the multi-token prediction modules (:func:`mtp_parameters`)."""
    h = shape.hidden
    return 2 * vocab * h / tensor + h + mtp_parameters(shape, tensor)


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
