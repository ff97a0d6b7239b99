"""A Llama in Flax NNX, built only on the public model contract (:mod:`meshtron.models.contract`).

RMSNorm (pre-norm), rotary position embeddings (the half-split rotation Hugging Face's Llama uses),
a SwiGLU MLP, grouped-query attention with ``kv_heads`` key/value heads, and an untied LM head
stored ``[vocab, embed]`` (Hugging Face's ``lm_head.weight`` layout). No biases.

Tensor parallelism follows from the logical names alone: query heads (``heads``) and the MLP's
inner dimension (``mlp``) split over ``tensor`` Megatron-style (column-parallel in, row-parallel
out); key/value heads (``kv_heads``, a name of their own, distinct from ``head_dim``) split too when
``kv_heads`` is a multiple of the tensor size, and are replicated on every tensor rank when the
tensor size is a multiple of ``kv_heads`` (:func:`extra_rules` maps ``kv_heads`` to nothing then),
which is what Megatron does when there are fewer key/value heads than ranks. The vocabulary of the
embedding and of the head splits over ``tensor`` (vocab-parallel lookup and cross-entropy).

With ``model.moe.experts`` every block's MLP is a mixture of experts (:mod:`meshtron.models.moe`):
the model is then a Mixtral.
"""

from __future__ import annotations

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
from meshtron.models.layers import (
    INIT_STD,
    fused_projection,
    normal,
    ones,
    padded_vocab_init,
    pre_norm_block,
    projection_kernel,
    with_added_output,
)
from meshtron.models.master_weight_gemm import keep_master_weight
from meshtron.models.moe import MoE, MoEDims, moe_dims_from_config
from meshtron.sharding import constrain, divides, same_layout


@dataclass(frozen=True)
class LlamaDims:
    """The model's static shape. ``vocab_padded`` >= ``vocab_size``; padded ids never win the softmax."""

    vocab_size: int
    vocab_padded: int
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    mlp_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    moe: MoEDims | None = None  # a mixture of experts in place of every block's MLP (a Mixtral)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of ``x`` [b, s, heads, head_dim] at ``positions`` [b, s]: the first
    and second halves of each head are the two coordinates rotated by ``position * theta^(-2i/d)``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, half]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _rms_norm(dims: LlamaDims, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(dims.hidden, epsilon=dims.norm_eps, dtype=dims.dtype, param_dtype=dims.param_dtype,
                       scale_init=ones(("embed",)), rngs=rngs)


def _projection(spec: str, shape: tuple[int, ...], axes: tuple[str, ...], dims: LlamaDims, rngs: nnx.Rngs, *,
                row: bool = False):
    """A column-parallel projection into a tensor-parallel region, or (``row``) a row-parallel one out of it."""
    einsum_op = row_parallel(axes) if row else column_parallel(axes)
    return nnx.Einsum(spec, shape, kernel_init=normal(INIT_STD, axes), dtype=dims.dtype,
                      param_dtype=dims.param_dtype, einsum_op=einsum_op, promote_dtype=keep_master_weight, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query attention: ``heads`` query heads share ``kv_heads`` key/value heads."""

    def __init__(self, dims: LlamaDims, *, rngs: nnx.Rngs):
        h, n, k, d = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim
        self.wq = _projection("bse,ehd->bshd", (h, n, d), ("embed", "heads", "head_dim"), dims, rngs)
        self.wk = _projection("bse,ekd->bskd", (h, k, d), ("embed", "kv_heads", "head_dim"), dims, rngs)
        self.wv = _projection("bse,ekd->bskd", (h, k, d), ("embed", "kv_heads", "head_dim"), dims, rngs)
        self.wo = _projection("bshd,hde->bse", (n, d, h), ("heads", "head_dim", "embed"), dims, rngs, row=True)
        self.theta = dims.rope_theta

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v. When key/value heads are split like query heads, the three kernels are joined along
        a per-kv-head group axis (a local concatenation: every shard holds whole groups) and applied
        as one einsum, so the backward pass all-reduces one input gradient, as Megatron's fused QKV
        does; with replicated key/value heads they are separate einsums. What a layer hook adds to a
        projection's output (LoRA's rank-r terms) is added beside the joined matmul."""
        if not same_layout("heads", "kv_heads") or not divides("heads"):
            return self.wq(x), self.wk(x), self.wv(x)
        wq, wk, wv = projection_kernel(self.wq), projection_kernel(self.wk), projection_kernel(self.wv)
        e, n, d = wq.shape
        kv = wk.shape[1]
        b, s = x.shape[:2]

        def split(y):
            return y[:, :, :, :-2].reshape(b, s, n, d), y[:, :, :, -2], y[:, :, :, -1]

        y = fused_projection("bse,ekgd->bskgd", x, lambda wq, wk, wv: jnp.concatenate(
            [wq.reshape(e, kv, n // kv, d), wk[:, :, None], wv[:, :, None]], axis=2), wq, wk, wv,
            axes=("embed", "kv_heads", None, "head_dim"), parts=(split, ("bse,end->bsnd",) * 3))
        q, k, v = split(y)
        return with_added_output(self.wq, x, q), with_added_output(self.wk, x, k), with_added_output(self.wv, x, v)

    def __call__(self, x: jax.Array, ctx: Context):
        q, k, v = self.project(x)
        q = constrain(rotary(q, ctx.positions, self.theta), ("batch", "seq", "heads", "head_dim"))
        k = constrain(rotary(k, ctx.positions, self.theta), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if ctx.cache is None:
            return self.wo(causal_attention(q, k, v))
        context, cache = causal_attention(q, k, v, positions=ctx.positions, cache=ctx.cache)
        return self.wo(context), cache


def _gate_and_up(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gate's and the up projection's outputs in their joined output ``[b, s, 2, f]``."""
    return y[:, :, 0], y[:, :, 1]


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up column-parallel, down row-parallel."""

    def __init__(self, dims: LlamaDims, *, rngs: nnx.Rngs):
        h, f = dims.hidden, dims.mlp_dim
        self.gate = _projection("bse,ef->bsf", (h, f), ("embed", "mlp"), dims, rngs)
        self.up = _projection("bse,ef->bsf", (h, f), ("embed", "mlp"), dims, rngs)
        self.down = _projection("bsf,fe->bse", (f, h), ("mlp", "embed"), dims, rngs, row=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        if not divides("mlp"):  # nothing to all-reduce: joining the kernels would only copy them
            hidden = constrain(jax.nn.silu(self.gate(x)) * self.up(x), ("batch", "seq", "mlp"))
            return self.down(hidden)
        # gate and up applied as one einsum over their stacked kernels (both split on ``mlp``: a local
        # stack), so the backward pass all-reduces one input gradient, as Megatron's fused projection;
        # what a layer hook adds to either output (LoRA's rank-r terms) is added beside it.
        y = fused_projection("bse,etf->bstf", x, lambda gate, up: jnp.stack([gate, up], axis=1),
                             projection_kernel(self.gate), projection_kernel(self.up), axes=("embed", None, "mlp"),
                             parts=(_gate_and_up, ("bse,ef->bsf",) * 2))
        gate, up = with_added_output(self.gate, x, y[:, :, 0]), with_added_output(self.up, x, y[:, :, 1])
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return self.down(hidden)


class Block(nnx.Module):
    """Pre-RMSNorm block; returns ``(x, cache)`` when decoding with a cache."""

    def __init__(self, dims: LlamaDims, *, rngs: nnx.Rngs):
        self.attn_norm = _rms_norm(dims, rngs)
        self.attn = Attention(dims, rngs=rngs)
        self.mlp_norm = _rms_norm(dims, rngs)
        self.mlp = MLP(dims, rngs=rngs) if dims.moe is None else MoE(dims.moe, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context):
        """``x`` after the block; ``(x, cache)`` when decoding with ``ctx.cache``."""
        return pre_norm_block(x, ctx, self.attn_norm, self.attn, self.mlp_norm, self.mlp)


class Llama(nnx.Module):
    """Token embedding, stacked blocks, final RMSNorm, untied LM head."""

    def __init__(self, dims: LlamaDims, *, rngs: nnx.Rngs):
        self.dims = dims
        self.embedding = nnx.Param(
            padded_vocab_init(dims.vocab_size)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype)
        )
        self.blocks = stack_blocks(lambda r: Block(dims, rngs=r), dims.layers, rngs)
        self.norm = _rms_norm(dims, rngs)
        self.lm_head = nnx.Param(
            padded_vocab_init(dims.vocab_size)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype)
        )

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    def embed(self, tokens: jax.Array, ctx: Context) -> jax.Array:
        del ctx  # positions enter through the rotary embedding in every block
        x = jnp.take(self.embedding[...], tokens, axis=0)
        return exit_parallel_region(constrain(x.astype(self.dims.dtype), WHOLE_SEQUENCE))

    def head(self, x: jax.Array) -> jax.Array:
        """Logits over the padded vocabulary, left split over ``vocab`` (fp32 for the loss)."""
        x = enter_parallel_region(self.norm(x))
        logits = jnp.einsum("bse,ve->bsv", x, self.lm_head[...].astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Zeroed key/value caches for every layer, stacked ``[layers, ...]``."""
        d = self.dims
        return stacked_caches(d.layers, batch, max_len, d.kv_heads, d.head_dim, d.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return logits_of(self, tokens)


def dims_from_config(cfg: ModelConfig, tensor: int = 1) -> LlamaDims:
    """Static shape; the vocabulary is padded to a multiple of 128 x tensor as in Megatron."""
    return LlamaDims(
        vocab_size=cfg.vocab_size, vocab_padded=padded_vocab_size(cfg.vocab_size, tensor), hidden=cfg.hidden,
        heads=cfg.heads, kv_heads=cfg.kv_heads or cfg.heads, layers=cfg.layers, mlp_dim=cfg.mlp_dim,
        rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype), moe=moe_dims_from_config(cfg),
    )


def build(cfg: ModelConfig, rngs: nnx.Rngs, *, tensor: int = 1) -> Llama:
    """The ``model.family=llama`` factory."""
    return Llama(dims_from_config(cfg, tensor), rngs=rngs)


def extra_rules(cfg: ModelConfig, tensor: int) -> dict[str, str | None]:
    """Fewer key/value heads than tensor ranks: replicate them on every rank (Megatron's choice)."""
    kv = cfg.kv_heads or cfg.heads
    return {"kv_heads": None} if tensor > 1 and kv % tensor else {}
