"""The Llama family's numbers (:mod:`meshtron.models.llama`): what its block keeps for the backward,
its parameters per tensor rank, its key/value heads. Pure Python, no JAX: the planner and the
step-memory model (:mod:`meshtron.plan.step_memory`) ask for them through :mod:`meshtron.families`.

The block: RMSNorm (a scale), query, key, value and output projections without biases (``kv_heads``
key/value heads: grouped-query attention), a SwiGLU MLP (three matrices); rotary positions, an
untied head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshtron.megatron import BlockActivations

if TYPE_CHECKING:
    from meshtron.config import ModelConfig

BLOCK = BlockActivations(residual=6, gathered=2, query=2, key_value=2, mlp=6, scores=2)
"""The residuals JAX's autodiff keeps for the Llama block (fp32), counted with
``jax.ad_checkpoint.saved_residuals`` (``tests/test_sequence_parallel.py`` holds it to them): two
norms' inputs and normalized values and the residual sum (6), the two norm outputs entering the
regions (2), query and attention output (2), key and value (2, the width of the key/value heads),
six MLP-width arrays (SwiGLU's gate, up, SiLU parts and product), logits and probabilities (2 per
head) -- the GPT block's constants (:data:`meshtron.models.gpt_counts.BLOCK`)."""

PAPER_GPT = False
"""Not the PTD-P paper's GPT: the planner (:mod:`meshtron.plan`) does not price it."""


def kv_heads(m: ModelConfig) -> int:
    """Key/value heads: ``model.kv_heads``, else one per query head."""
    return m.kv_heads or m.heads


def block_parameters(shape: Any, tensor: int) -> float:
    """One layer's parameters on one tensor rank: the query and output projections and the MLP's three
    matrices split over ``tensor``, the key and value projections too when ``tensor`` divides their
    heads (else whole), the two RMSNorms' scales whole."""
    h, a, k, d, f, t = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.mlp_dim, tensor
    kv_split = t if k % t == 0 else 1
    return 2 * h * a * d / t + 2 * h * k * d / kv_split + 3 * h * f / t + 2 * h


def other_parameters(shape: Any, vocab: int, tensor: int) -> float:
    """Outside the blocks on one tensor rank (``vocab``: the padded vocabulary): the embedding, the
    untied head and the final RMSNorm."""
    h = shape.hidden
    return 2 * vocab * h / tensor + h


def weight_boundary(shape: Any, tensor: int) -> float:
    """Per token, the elements a zb-h1 ``B`` leaves for ``W`` (:mod:`meshtron.plan.step_memory`): the
    weight-bearing projections' output cotangents -- the attention output's and the MLP down
    projection's whole (``h`` each), the query/key/value and gate/up ones split over ``tensor``. W
    recomputes the activations it multiplies from the layer's residuals, and B computes the norms'
    scale gradients itself."""
    h, a, k, d, f, t = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.mlp_dim, tensor
    return 2 * h + (a + 2 * k) * d / t + 2 * f / t
