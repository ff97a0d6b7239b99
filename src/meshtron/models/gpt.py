"""A GPT in Flax NNX, annotated with logical axes only (no mesh axis appears here).

Megatron-LM's tensor-parallel split follows from the annotations plus the rules table in
:mod:`meshtron.sharding`:

* attention: the fused QKV projection is column-parallel (split by ``heads``), attention runs
  on local heads (:func:`meshtron.models.attention.causal_attention`, i.e.
  ``jax.nn.dot_product_attention``), the output projection is row-parallel (one all-reduce forward);
* MLP: ``fc1`` is column-parallel (split on ``mlp``), GELU is local, ``fc2`` is row-parallel;
* the word embedding is vocab-parallel and tied to the LM head, so logits stay split over
  ``vocab`` and the cross-entropy (:func:`vocab_parallel_cross_entropy`) never gathers them.

Blocks are stacked along a leading ``layers`` axis (one pytree leaf per parameter kind, shape
``[layers, ...]``): the canonical layout that pipeline placement and checkpoints rely on. The
model implements :mod:`meshtron.models.contract` and is trained through it only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.config import ModelConfig, padded_vocab_size
from meshtron.models.attention import KVCache, causal_attention, stacked_caches
from meshtron.models.blocks import (
    WHOLE_SEQUENCE,
    Context,
    enter_parallel_region,
    exit_parallel_region,
    stack_blocks,
)
from meshtron.models.collective_matmul import column_parallel, row_parallel
from meshtron.models.contract import logits_of
from meshtron.models.layers import INIT_STD, normal, ones, padded_vocab_init, pre_norm_block, zeros
from meshtron.models.master_weight_gemm import keep_master_weight
from meshtron.sharding import constrain


@dataclass(frozen=True)
class GPTDims:
    """The model's static shape. ``vocab_padded`` >= ``vocab_size``; padded ids never win the softmax."""

    vocab_size: int
    vocab_padded: int
    hidden: int
    heads: int
    layers: int
    mlp_dim: int
    positions: int  # rows of the learned position table: the longest sequence the model can read
    norm_eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _layer_norm(dims: GPTDims, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        dims.hidden,
        epsilon=dims.norm_eps,
        dtype=dims.dtype,
        param_dtype=dims.param_dtype,
        scale_init=ones(("embed",)),
        bias_init=zeros(("embed",)),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads are the tensor-parallel unit."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        h, n, d = dims.hidden, dims.heads, dims.head_dim
        out_std = INIT_STD / math.sqrt(2 * dims.layers)
        common = {"dtype": dims.dtype, "param_dtype": dims.param_dtype, "promote_dtype": keep_master_weight, "rngs": rngs}
        self.qkv = nnx.Einsum(
            "bse,ethd->bsthd",
            (h, 3, n, d),
            (3, n, d),
            kernel_init=normal(INIT_STD, ("embed", "qkv", "heads", "head_dim")),
            bias_init=zeros(("qkv", "heads", "head_dim")),
            einsum_op=column_parallel(("embed", "qkv", "heads", "head_dim")),
            **common,
        )
        self.out = nnx.Einsum(
            "bshd,hde->bse",
            (n, d, h),
            (h,),
            kernel_init=normal(out_std, ("heads", "head_dim", "embed")),
            bias_init=zeros(("embed",)),
            einsum_op=row_parallel(("heads", "head_dim", "embed")),
            **common,
        )
        self.head_dim = d

    def __call__(self, x: jax.Array, ctx: Context):
        """Returns the block's attention output, or ``(output, cache)`` when decoding with ``ctx.cache``."""
        qkv = constrain(self.qkv(x), ("batch", "seq", "qkv", "heads", "head_dim"))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if ctx.cache is None:
            return self.out(constrain(causal_attention(q, k, v), ("batch", "seq", "heads", "head_dim")))
        context, cache = causal_attention(q, k, v, positions=ctx.positions, cache=ctx.cache)
        return self.out(context), cache


class MLP(nnx.Module):
    """fc1 (column-parallel) -> GELU -> fc2 (row-parallel)."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        out_std = INIT_STD / math.sqrt(2 * dims.layers)
        common = {"dtype": dims.dtype, "param_dtype": dims.param_dtype, "promote_dtype": keep_master_weight, "rngs": rngs}
        self.fc1 = nnx.Einsum(
            "bse,em->bsm",
            (dims.hidden, dims.mlp_dim),
            (dims.mlp_dim,),
            kernel_init=normal(INIT_STD, ("embed", "mlp")),
            bias_init=zeros(("mlp",)),
            einsum_op=column_parallel(("embed", "mlp")),
            **common,
        )
        self.fc2 = nnx.Einsum(
            "bsm,me->bse",
            (dims.mlp_dim, dims.hidden),
            (dims.hidden,),
            kernel_init=normal(out_std, ("mlp", "embed")),
            bias_init=zeros(("embed",)),
            einsum_op=row_parallel(("mlp", "embed")),
            **common,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = constrain(jax.nn.gelu(self.fc1(x)), ("batch", "seq", "mlp"))
        return self.fc2(hidden)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(dims, rngs)
        self.attn = Attention(dims, rngs=rngs)
        self.ln2 = _layer_norm(dims, rngs)
        self.mlp = MLP(dims, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context):
        """``x`` after the block; ``(x, cache)`` when decoding with ``ctx.cache``."""
        return pre_norm_block(x, ctx, self.ln1, self.attn, self.ln2, self.mlp)


class GPT(nnx.Module):
    """Token + learned position embedding, stacked pre-LN blocks, final LayerNorm, tied LM head."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        self.dims = dims
        self.wte = nnx.Param(
            padded_vocab_init(dims.vocab_size)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype)
        )
        self.wpe = nnx.Param(
            normal(INIT_STD, ("pos", "embed"))(rngs.params(), (dims.positions, dims.hidden), dims.param_dtype)
        )
        self.blocks = stack_blocks(lambda r: Block(dims, rngs=r), dims.layers, rngs)
        self.ln_f = _layer_norm(dims, rngs)

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def max_len(self) -> int:
        """Learned positions: nothing beyond the position table exists."""
        return self.dims.positions

    def embed(self, tokens: jax.Array, ctx: Context) -> jax.Array:
        """Vocab-parallel lookup: each tensor shard holds a vocabulary slice; results are summed.
        One row of ``wpe`` per token, at its position: shared by the rows of one sequence per row (looked
        up once), each row's own in windows of packed documents, whose positions restart per document."""
        positions = ctx.positions[0] if ctx.segments is None else ctx.positions
        x = jnp.take(self.wte[...], tokens, axis=0) + jnp.take(self.wpe[...], positions, axis=0)
        return exit_parallel_region(constrain(x.astype(self.dims.dtype), WHOLE_SEQUENCE))

    def head(self, x: jax.Array) -> jax.Array:
        """Logits over the padded vocabulary, left split over ``vocab`` (fp32 for the loss)."""
        x = enter_parallel_region(self.ln_f(x))
        logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Zeroed key/value caches for every layer, stacked ``[layers, ...]``."""
        d = self.dims
        return stacked_caches(d.layers, batch, max_len, d.heads, d.head_dim, d.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return logits_of(self, tokens)


def dims_from_config(cfg: ModelConfig, tensor: int = 1) -> GPTDims:
    """Static model shape; the vocabulary is padded to a multiple of 128 x tensor as in Megatron."""
    return GPTDims(
        vocab_size=cfg.vocab_size,
        vocab_padded=padded_vocab_size(cfg.vocab_size, tensor),
        hidden=cfg.hidden,
        heads=cfg.heads,
        layers=cfg.layers,
        mlp_dim=cfg.mlp_dim,
        positions=cfg.max_position_embeddings or cfg.seq_len,
        norm_eps=cfg.norm_eps,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
    )


def build(cfg: ModelConfig, rngs: nnx.Rngs, *, tensor: int = 1) -> GPT:
    """The ``model.family=gpt`` factory."""
    return GPT(dims_from_config(cfg, tensor), rngs=rngs)
