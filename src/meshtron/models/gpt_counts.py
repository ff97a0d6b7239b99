"""The GPT family's numbers (:mod:`meshtron.models.gpt`): what its block keeps for the backward, its
parameters per tensor rank, its key/value heads. Pure Python, no JAX: the planner and the step-memory
model (:mod:`meshtron.plan.step_memory`) ask for them through :mod:`meshtron.families`.

The block: LayerNorm (scale and bias), a fused query/key/value projection with biases, an output
projection with a bias, a GELU MLP (two matrices, two biases); learned positions, a tied head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshtron.megatron import BlockActivations

if TYPE_CHECKING:
    from meshtron.config import ModelConfig

BLOCK = BlockActivations(residual=6, gathered=2, query=2, key_value=2, mlp=6, scores=2)
"""The residuals JAX's autodiff keeps for the GPT block (fp32, no dropout), counted with
``jax.ad_checkpoint.saved_residuals`` (``tests/test_sequence_parallel.py`` holds it to them): two
norms' inputs and normalized values and the residual sum (6), the two norm outputs entering the
regions (2), query and attention output (2), key and value (2), six MLP-width arrays (GELU's
tanh-form intermediates), logits and probabilities (2 per head). With ``mlp = 4h``:
``s·b·h·(8 + 28/t + 2·a·s/(h·t))`` elements per layer with tensor parallelism,
``s·b·h·(2 + (34 + 2·a·s/h)/t)`` with sequence parallelism -- against the paper's
``10 + 24/t + 5·a·s/(h·t)`` and ``(34 + 5·a·s/h)/t`` bytes at fp16."""

PAPER_GPT = True
"""The PTD-P paper's GPT (eq. 2, 3): the planner (:mod:`meshtron.plan`) prices it."""


def kv_heads(m: ModelConfig) -> int:
    """Key/value heads: one per query head."""
    return m.heads


def block_parameters(shape: Any, tensor: int) -> float:
    """One layer's parameters on one tensor rank: the fused query/key/value projection and its bias,
    the output projection and the MLP's matrices and inner bias split over ``tensor``; the two
    LayerNorms and the row-parallel biases whole."""
    h, f, t = shape.hidden, shape.mlp_dim, tensor
    return (3 * h * h + 3 * h) / t + h * h / t + h + (2 * h * f + f) / t + h + 4 * h


def other_parameters(shape: Any, vocab: int, tensor: int) -> float:
    """Outside the blocks on one tensor rank (``vocab``: the padded vocabulary): the tied embedding,
    the learned positions and the final LayerNorm."""
    h = shape.hidden
    return vocab * h / tensor + shape.positions * h + 2 * h


def weight_boundary(shape: Any, tensor: int) -> float:
    """Per token, the elements a zb-h1 ``B`` leaves for ``W`` (:mod:`meshtron.plan.step_memory`): the
    weight-bearing projections' output cotangents -- the attention output's and the second MLP
    matmul's whole (``h`` each), the QKV and first MLP matmul ones split over ``tensor``. W recomputes
    the activations it multiplies from the layer's residuals, and B computes the norms' gradients
    itself."""
    h, f, t = shape.hidden, shape.mlp_dim, tensor
    return 2 * h + 3 * h / t + f / t
