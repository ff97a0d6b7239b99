"""DeepSeek-V2/V3 in Flax NNX: multi-head latent attention (MLA) and a mixture of experts after
``first_k_dense_replace`` dense blocks, on the public model contract (:mod:`meshtron.models.contract`).

The math is Hugging Face's ``DeepseekV3`` and the parameters are named after its modules, one to one
(``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), laid out ``[in, out]`` with the heads as an axis of
their own.

**Latent attention.** Queries go through a ``q_lora_rank``-wide latent and its RMSNorm (or one
projection when ``q_lora_rank`` is null, V2-Lite's). Keys and values come from one
``kv_lora_rank``-wide latent per token (RMSNorm'd), expanded per head by ``kv_b_proj`` into
``qk_nope_head_dim`` key and ``v_head_dim`` value features, plus a ``qk_rope_head_dim``-wide rotary
key computed once per token and shared by every head. The softmax scale is ``1/sqrt(qk_nope +
qk_rope)``, times YaRN's ``mscale(factor, mscale_all_dim)²`` when ``rope_scaling`` is YaRN.

Attention runs through :func:`meshtron.models.attention.causal_attention` (packed documents, context
parallelism, cuDNN: the machinery every family shares). ``jax.nn.dot_product_attention`` wants keys
and values of one width, so the narrower of the two is padded with zeros to the wider (zero value
features give zero outputs, which are sliced off; zero query/key features add nothing to a score),
and the queries are pre-scaled so that the attention's own ``1/sqrt(width)`` gives MLA's scale.

**Decoding** caches the latent, not keys and values: per token and layer ``kv_lora_rank +
qk_rope_head_dim`` numbers (the normalized latent and the rotated shared key) instead of ``heads ·
(qk_nope + qk_rope + v_head_dim)``. Each step attends in the latent space with ``kv_b_proj``
absorbed into the queries and the output (DeepSeek-V2 §2.1.3): the keys are the cached rows as one
key head every query head shares, the values their latent part, and each head's latent output goes
through its slice of ``kv_b_proj``'s value part. Where a layer hook adds a term to ``kv_b_proj``
(LoRA's adapters) the cached latents are expanded through the module instead, which keeps the term.

**Tensor parallelism** from logical names alone: query, key and value heads (``heads``) split over
``tensor``, ``q_b_proj``/``kv_b_proj`` column-parallel and ``o_proj`` row-parallel; the latent
projections, their norms and the shared rotary key are replicated (their weights' axes are
``(embed, None)``: a few hundred features, computed whole on every rank).

**Dense blocks, then expert blocks.** With ``first_k_dense_replace`` = k > 0 and experts, the first k
blocks (a dense SwiGLU MLP each) are the model's ``prefix`` -- a stack of their own that runs after the
embedding, on the first virtual pipeline stage, replicated over pipeline stages as the embedding is
(:mod:`meshtron.models.contract`) -- and ``blocks`` holds the ``layers - k`` expert blocks, which
pipeline parallelism splits over its stages. Each block holds only its own parameters; the routing
statistics are the expert blocks'. Without experts, or with k = 0, there is no prefix.

**Multi-token prediction** (``mtp_layers`` > 0, DeepSeek-V3's): the modules of
:mod:`meshtron.models.mtp` under ``mtp`` (``depth1`` ..), each with a block of this family (an
expert block when the model has experts), sharing the embedding and the head's projection
(:meth:`Deepseek.projected`); their loss is the contract's further loss (:meth:`Deepseek.extra_loss`),
so they run where the head runs and generation never calls them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtron.config import ModelConfig, padded_vocab_size
from meshtron.models import mtp
from meshtron.models.attention import causal_attention
from meshtron.models.blocks import (
    PREFIX_LAYERS,
    WHOLE_SEQUENCE,
    Context,
    enter_parallel_region,
    exit_parallel_region,
    stack_blocks,
)
from meshtron.models.collective_matmul import column_parallel, row_parallel
from meshtron.models.contract import ExtraLoss, PrefixedCaches, logits_of, token_losses
from meshtron.models.fp8 import projection_einsum
from meshtron.models.fused_attention import dot_product_attention
from meshtron.models.layers import INIT_STD, normal, ones, padded_vocab_init, pre_norm_block
from meshtron.models.llama import MLP
from meshtron.models.moe import MoE, MoEDims, moe_dims_from_config
from meshtron.sharding import constrain
from meshtron.trace_context import current

LATENT_NORM_EPS = 1e-6  # Hugging Face's q_a_layernorm / kv_a_layernorm (DeepseekV3RMSNorm's default)
HEADS = ("batch", "seq", "heads", "head_dim")


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of the ``qk_rope_head_dim`` features: per-pair inverse frequencies, the
    factor YaRN multiplies cos and sin by, and whether pairs are adjacent (``interleave``) or halves."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0
    interleave: bool = True

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x`` [b, s, heads, d] rotated at ``positions`` [b, s]. Interleaved pairs ``(x0, x1), (x2, x3)``
        come out as Hugging Face's ``apply_rotary_pos_emb_interleave`` lays them: the first features of
        every pair, then the second ones (queries and keys alike, so their products are unchanged)."""
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, d/2]
        cos = (jnp.cos(angles) * self.attention_factor)[:, :, None, :]
        sin = (jnp.sin(angles) * self.attention_factor)[:, :, None, :]
        x = x.astype(jnp.float32)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_from_config(dim: int, theta: float, scaling: dict[str, Any] | None, interleave: bool) -> Rope:
    """The rotary embedding of ``dim`` features as Hugging Face computes it: plain ``theta^(-2i/dim)``
    frequencies, or YaRN's (``scaling``: the config's ``rope_scaling``) -- each frequency interpolated
    by ``factor`` below the ``beta_slow`` rotations, kept above ``beta_fast``, ramped in between -- in
    float32 as Hugging Face does."""
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if scaling is None:
        return Rope(tuple(float(f) for f in (1.0 / pos_freqs).astype(np.float32)), 1.0, interleave)
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (1.0 / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return Rope(tuple(float(f) for f in inv_freq.astype(np.float32)), float(attention_factor), interleave)


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """``1/sqrt(qk_head_dim)``, times ``mscale(factor, mscale_all_dim)²`` under YaRN with ``mscale_all_dim``."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


@dataclass(frozen=True)
class DeepseekDims:
    """The model's static shape. ``vocab_padded`` >= ``vocab_size``; padded ids never win the softmax."""

    vocab_size: int
    vocab_padded: int
    hidden: int
    heads: int
    layers: int
    mlp_dim: int  # the dense blocks' SwiGLU width (Hugging Face's intermediate_size)
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: Rope
    scale: float  # the attention's softmax scale
    first_k_dense: int = 0
    norm_eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    moe: MoEDims | None = None
    mtp_layers: int = 0  # multi-token prediction depths after the last block (0: none)
    mtp_loss_weight: float = 0.0  # their mean loss's weight in the objective

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the decoding cache holds per token and layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LatentCache:
    """One layer's decoding cache: ``latent`` [batch, max_len, kv_lora_rank + qk_rope_head_dim], each
    position's normalized key/value latent followed by its rotated shared key. Entries at positions not
    yet written hold anything; no query sees them (the mask of :func:`latent_attention`)."""

    latent: jax.Array


def _norm(width: int, eps: float, dims: DeepseekDims, rngs: nnx.Rngs, axis: str | None = "embed") -> nnx.RMSNorm:
    return nnx.RMSNorm(width, epsilon=eps, dtype=dims.dtype, param_dtype=dims.param_dtype,
                       scale_init=ones((axis,)), rngs=rngs)


def _einsum(spec: str, shape: tuple[int, ...], axes: tuple[str | None, ...], dims: DeepseekDims, rngs: nnx.Rngs,
            einsum_op: Any = projection_einsum) -> nnx.Einsum:
    return nnx.Einsum(spec, shape, kernel_init=normal(INIT_STD, axes), dtype=dims.dtype,
                      param_dtype=dims.param_dtype, einsum_op=einsum_op, rngs=rngs)


def _padded(x: jax.Array, width: int) -> jax.Array:
    """``x`` with zero features appended up to ``width``."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class Attention(nnx.Module):
    """Multi-head latent attention; returns ``(out, cache)`` when decoding with a :class:`LatentCache`."""

    def __init__(self, dims: DeepseekDims, *, rngs: nnx.Rngs):
        h, n, dq = dims.hidden, dims.heads, dims.qk_head_dim
        self.dims = dims
        if dims.q_lora_rank is None:
            self.q_proj = _einsum("bse,ehd->bshd", (h, n, dq), ("embed", "heads", "head_dim"), dims, rngs,
                                  column_parallel(("embed", "heads", "head_dim")))
        else:
            r = dims.q_lora_rank
            self.q_a_proj = _einsum("bse,er->bsr", (h, r), ("embed", None), dims, rngs, column_parallel(("embed", None)))
            self.q_a_layernorm = _norm(r, LATENT_NORM_EPS, dims, rngs, axis=None)
            self.q_b_proj = _einsum("bsr,rhd->bshd", (r, n, dq), (None, "heads", "head_dim"), dims, rngs)
        self.kv_a_proj_with_mqa = _einsum("bse,er->bsr", (h, dims.latent_dim), ("embed", None), dims, rngs,
                                          column_parallel(("embed", None)))
        self.kv_a_layernorm = _norm(dims.kv_lora_rank, LATENT_NORM_EPS, dims, rngs, axis=None)
        self.kv_b_proj = _einsum("bsr,rhd->bshd", (dims.kv_lora_rank, n, dims.qk_nope_head_dim + dims.v_head_dim),
                                 (None, "heads", "head_dim"), dims, rngs)
        self.o_proj = _einsum("bshd,hde->bse", (n, dims.v_head_dim, h), ("heads", "head_dim", "embed"), dims, rngs,
                              row_parallel(("heads", "head_dim", "embed")))

    def queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each head's query features without and with rotary positions, ``[b, s, heads, ...]``."""
        d = self.dims
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = constrain(q, HEADS)
        return q[..., :d.qk_nope_head_dim], d.rope(q[..., d.qk_nope_head_dim:], positions).astype(q.dtype)

    def latent(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Each token's ``[b, s, kv_lora_rank + qk_rope_head_dim]``: its normalized key/value latent and its
        rotated shared key -- what the decoding cache holds."""
        d = self.dims
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :d.kv_lora_rank])
        shared_key = d.rope(compressed[:, :, None, d.kv_lora_rank:], positions)[:, :, 0]
        return jnp.concatenate([latent, shared_key.astype(latent.dtype)], axis=-1)

    def keys_values(self, latent: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every head's keys ``[b, s, heads, qk_head_dim]`` and values ``[b, s, heads, v_head_dim]`` from latents."""
        d = self.dims
        expanded = constrain(self.kv_b_proj(latent[..., :d.kv_lora_rank]), HEADS)
        shared_key = latent[:, :, None, d.kv_lora_rank:]
        shared_key = jnp.broadcast_to(shared_key, (*expanded.shape[:3], d.qk_rope_head_dim))
        k = jnp.concatenate([expanded[..., :d.qk_nope_head_dim], shared_key.astype(expanded.dtype)], axis=-1)
        return k, expanded[..., d.qk_nope_head_dim:]

    def __call__(self, x: jax.Array, ctx: Context):
        d = self.dims
        q_nope, q_rope = self.queries(x, ctx.positions)
        latent = self.latent(x, ctx.positions)
        if ctx.cache is not None:
            return latent_attention(self, q_nope, q_rope, latent, ctx.positions, ctx.cache)
        k, v = self.keys_values(latent)
        width = max(d.qk_head_dim, d.v_head_dim)
        q = _padded(jnp.concatenate([q_nope, q_rope], axis=-1), width) * (d.scale * math.sqrt(width))
        q, k, v = (constrain(_padded(t, width), HEADS) for t in (q.astype(k.dtype), k, v))
        return self.o_proj(causal_attention(q, k, v)[..., :d.v_head_dim])


def latent_attention(attn: Attention, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array,
                     positions: jax.Array, cache: LatentCache) -> tuple[jax.Array, LatentCache]:
    """Cached decoding: ``latent`` (the new tokens') written at ``positions[0, 0] ..`` (contiguous
    positions, the same start in every row: :meth:`meshtron.models.blocks.Context.for_sequence`), then
    every query attends to the cached positions ``<=`` its own; returns the attention block's output and
    the new cache. With a plain ``kv_b_proj`` its key part is absorbed into the queries and its value
    part applied to each head's latent output; a hook-wrapped one expands the cache through the module."""
    d = attn.dims
    start = positions[0, 0].astype(jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    rows = jax.lax.dynamic_update_slice(cache.latent, latent.astype(cache.latent.dtype), (zero, start, zero))
    max_len = rows.shape[1]
    visible = (jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= positions.astype(jnp.int32)[:, :, None])
    mask = visible[:, None, :, :]  # [b, 1, s, max_len], broadcast over heads
    implementation = current().attention
    if hasattr(attn.kv_b_proj, "added_output"):
        k, v = attn.keys_values(rows.astype(q_nope.dtype))
        width = max(d.qk_head_dim, d.v_head_dim)
        q = _padded(jnp.concatenate([q_nope, q_rope], axis=-1), width).astype(k.dtype)
        out = dot_product_attention(q, _padded(k, width), _padded(v, width), mask=mask, scale=d.scale,
                                    implementation=implementation)[..., :d.v_head_dim]
        return attn.o_proj(out.astype(q_nope.dtype)), LatentCache(rows)
    kernel = attn.kv_b_proj.kernel[...].astype(q_nope.dtype)  # [kv_lora_rank, heads, qk_nope + v]
    key_part, value_part = kernel[..., :d.qk_nope_head_dim], kernel[..., d.qk_nope_head_dim:]
    q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, key_part)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    keys = rows[:, :, None, :].astype(q.dtype)  # one key head every query head shares
    values = keys.at[..., d.kv_lora_rank:].set(0)  # the latent part; the rotary part contributes nothing
    out = dot_product_attention(q, keys, values, mask=mask, scale=d.scale, implementation=implementation)
    out = jnp.einsum("bshr,rhv->bshv", out[..., :d.kv_lora_rank], value_part)
    return attn.o_proj(constrain(out, HEADS)), LatentCache(rows)


class Block(nnx.Module):
    """Pre-RMSNorm block: latent attention, then the mixture of experts (``experts``) or a dense SwiGLU MLP."""

    def __init__(self, dims: DeepseekDims, *, experts: bool, rngs: nnx.Rngs):
        self.input_layernorm = _norm(dims.hidden, dims.norm_eps, dims, rngs)
        self.self_attn = Attention(dims, rngs=rngs)
        self.post_attention_layernorm = _norm(dims.hidden, dims.norm_eps, dims, rngs)
        if experts:
            assert dims.moe is not None
            self.mlp = MoE(dims.moe, rngs=rngs)
        else:
            self.mlp = MLP(dims, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context):
        """``x`` after the block; ``(x, cache)`` when decoding with ``ctx.cache``."""
        return pre_norm_block(x, ctx, self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)


class PredictionDepths(nnx.Module):
    """The multi-token prediction modules (:mod:`meshtron.models.mtp`), ``depth1`` .. ``depthD``: each
    block a mixture of experts when the model has experts (DeepSeek-V3's), else a dense block."""

    def __init__(self, dims: DeepseekDims, *, rngs: nnx.Rngs):
        self.count = dims.mtp_layers
        for k in range(1, dims.mtp_layers + 1):
            setattr(self, f"depth{k}", mtp.PredictionDepth(
                dims.hidden, Block(dims, experts=dims.moe is not None, rngs=rngs),
                lambda: _norm(dims.hidden, dims.norm_eps, dims, rngs), dtype=dims.dtype,
                param_dtype=dims.param_dtype, rngs=rngs))

    def __iter__(self):
        return (getattr(self, f"depth{k}") for k in range(1, self.count + 1))


class Deepseek(nnx.Module):
    """Token embedding, the dense blocks (``prefix``: with experts and ``first_k_dense`` > 0), the stacked
    blocks, final RMSNorm, untied LM head; with ``mtp_layers``, the multi-token prediction modules after
    them (``mtp``: their own subtree of the parameters, which generation never reads)."""

    def __init__(self, dims: DeepseekDims, *, rngs: nnx.Rngs):
        self.dims = dims
        self.embedding = nnx.Param(
            padded_vocab_init(dims.vocab_size)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype))
        experts = dims.moe is not None
        if experts and dims.first_k_dense:
            self.prefix = stack_blocks(lambda r: Block(dims, experts=False, rngs=r), dims.first_k_dense, rngs,
                                       axis=PREFIX_LAYERS)
        self.blocks = stack_blocks(lambda r: Block(dims, experts=experts, rngs=r), dims.layers - self.prefix_layers,
                                   rngs)
        self.norm = _norm(dims.hidden, dims.norm_eps, dims, rngs)
        self.lm_head = nnx.Param(
            padded_vocab_init(dims.vocab_size)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype))
        if dims.mtp_layers:
            self.mtp = PredictionDepths(dims, rngs=rngs)

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def prefix_layers(self) -> int:
        """How many of the model's layers its ``prefix`` holds (the dense ones before the experts; 0: no prefix)."""
        return self.dims.first_k_dense if self.dims.moe is not None else 0

    def embed(self, tokens: jax.Array, ctx: Context) -> jax.Array:
        del ctx  # positions enter through the rotary embedding in every block
        x = jnp.take(self.embedding[...], tokens, axis=0)
        return exit_parallel_region(constrain(x.astype(self.dims.dtype), WHOLE_SEQUENCE))

    def head(self, x: jax.Array) -> jax.Array:
        """Logits over the padded vocabulary, left split over ``vocab`` (fp32 for the loss)."""
        return self.projected(self.norm(x))

    def projected(self, x: jax.Array) -> jax.Array:
        """The output projection of a normed hidden state ``x``: the head after its norm, which the
        multi-token prediction modules share."""
        x = enter_parallel_region(x)
        logits = jnp.einsum("bse,ve->bsv", x, self.lm_head[...].astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def extra_loss(self, x: jax.Array, tokens: jax.Array) -> ExtraLoss | None:
        """The multi-token prediction loss (the contract's further loss) of the last block's output ``x``
        for the batch ``tokens``; ``None`` without ``mtp_layers``."""
        if not self.dims.mtp_layers:
            return None
        value = mtp.prediction_loss(list(self.mtp), self.norm(x), tokens, embed=self.embed, logits=self.projected,
                                    token_losses=lambda logits, targets: token_losses(self, logits, targets))
        return ExtraLoss(mtp.METRIC, value, self.dims.mtp_loss_weight)

    def init_cache(self, batch: int, max_len: int) -> LatentCache | PrefixedCaches:
        """Zeroed latent caches for every layer, stacked ``[layers, batch, max_len, kv_lora_rank +
        qk_rope_head_dim]``; with a prefix, its layers' and the blocks' (:class:`PrefixedCaches`)."""
        d = self.dims

        def caches(layers: int) -> LatentCache:
            return LatentCache(jnp.zeros((layers, batch, max_len, d.latent_dim), d.dtype))

        if not self.prefix_layers:
            return caches(d.layers)
        return PrefixedCaches(caches(self.prefix_layers), caches(d.layers - self.prefix_layers))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return logits_of(self, tokens)


def dims_from_config(cfg: ModelConfig, tensor: int = 1) -> DeepseekDims:
    """Static shape; the vocabulary is padded to a multiple of 128 x tensor as in Megatron."""
    a = cfg.mla
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
    return DeepseekDims(
        vocab_size=cfg.vocab_size, vocab_padded=padded_vocab_size(cfg.vocab_size, tensor), hidden=cfg.hidden,
        heads=cfg.heads, layers=cfg.layers, mlp_dim=cfg.mlp_dim, q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, rope=rope_from_config(a.qk_rope_head_dim, cfg.rope_theta, scaling, a.rope_interleave),
        scale=softmax_scale(a.qk_nope_head_dim + a.qk_rope_head_dim, scaling),
        first_k_dense=cfg.first_k_dense_replace, norm_eps=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype), moe=moe_dims_from_config(cfg), mtp_layers=cfg.mtp.layers,
        mtp_loss_weight=float(cfg.mtp.loss_weight),
    )


def build(cfg: ModelConfig, rngs: nnx.Rngs, *, tensor: int = 1) -> Deepseek:
    """The ``model.family=deepseek`` factory."""
    return Deepseek(dims_from_config(cfg, tensor), rngs=rngs)
