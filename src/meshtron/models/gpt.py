"""A GPT in Flax NNX, annotated with logical axes only (no mesh axis appears here).

Megatron-LM's tensor-parallel split follows from the annotations plus the rules table in
:mod:`meshtron.sharding`:

* attention: the fused QKV projection is column-parallel (split by ``heads``), attention runs
  on local heads, the output projection is row-parallel (one all-reduce forward);
* MLP: ``fc1`` is column-parallel (split on ``mlp``), GELU is local, ``fc2`` is row-parallel;
* the word embedding is vocab-parallel and tied to the LM head, so logits stay split over
  ``vocab`` and the cross-entropy (:func:`vocab_parallel_cross_entropy`) never gathers them.

Blocks are stacked along a leading ``layers`` axis (one pytree leaf per parameter kind, shape
``[layers, ...]``): the canonical layout that pipeline placement and checkpoints rely on. The
forward pass scans over that axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.sharding import constrain

_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTDims:
    """The model's static shape. ``vocab_padded`` >= ``vocab_size``; padded ids never win the softmax."""

    vocab_size: int
    vocab_padded: int
    hidden: int
    heads: int
    layers: int
    mlp_dim: int
    seq_len: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    remat: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _normal(std: float, axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def _zeros(axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), axes)


def _padded_vocab_init(dims: GPTDims):
    """N(0, 0.02) rows for the real vocabulary and zero rows for Megatron's padding.

    Padded rows get no gradient (their logits are masked, their ids never looked up), so at zero
    they stay inert under AdamW and LAMB; and the real rows are drawn at ``[vocab_size, hidden]``,
    so one seed gives the same model whatever padding the tensor-parallel size asks for.
    """

    def init(key: jax.Array, shape: tuple[int, int], dtype=jnp.float32) -> jax.Array:
        real = nnx.initializers.normal(_INIT_STD)(key, (dims.vocab_size, shape[1]), dtype)
        return jnp.pad(real, ((0, shape[0] - dims.vocab_size), (0, 0)))

    return nnx.with_partitioning(init, ("vocab", "embed"))


def _layer_norm(dims: GPTDims, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        dims.hidden,
        epsilon=1e-5,
        dtype=dims.dtype,
        param_dtype=dims.param_dtype,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
        bias_init=_zeros(("embed",)),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads are the tensor-parallel unit."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        h, n, d = dims.hidden, dims.heads, dims.head_dim
        out_std = _INIT_STD / math.sqrt(2 * dims.layers)
        common = {"dtype": dims.dtype, "param_dtype": dims.param_dtype, "rngs": rngs}
        self.qkv = nnx.Einsum(
            "bse,ethd->bsthd",
            (h, 3, n, d),
            (3, n, d),
            kernel_init=_normal(_INIT_STD, ("embed", "qkv", "heads", "kv")),
            bias_init=_zeros(("qkv", "heads", "kv")),
            **common,
        )
        self.out = nnx.Einsum(
            "bshd,hde->bse",
            (n, d, h),
            (h,),
            kernel_init=_normal(out_std, ("heads", "kv", "embed")),
            bias_init=_zeros(("embed",)),
            **common,
        )
        self.head_dim = d

    def __call__(self, x: jax.Array) -> jax.Array:
        qkv = constrain(self.qkv(x), ("batch", "seq", "qkv", "heads", "kv"))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
        seq = x.shape[1]
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        context = constrain(jnp.einsum("bhqk,bkhd->bqhd", probs, v), ("batch", "seq", "heads", "kv"))
        return self.out(context)


class MLP(nnx.Module):
    """fc1 (column-parallel) -> GELU -> fc2 (row-parallel)."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        out_std = _INIT_STD / math.sqrt(2 * dims.layers)
        common = {"dtype": dims.dtype, "param_dtype": dims.param_dtype, "rngs": rngs}
        self.fc1 = nnx.Einsum(
            "bse,em->bsm",
            (dims.hidden, dims.mlp_dim),
            (dims.mlp_dim,),
            kernel_init=_normal(_INIT_STD, ("embed", "mlp")),
            bias_init=_zeros(("mlp",)),
            **common,
        )
        self.fc2 = nnx.Einsum(
            "bsm,me->bse",
            (dims.mlp_dim, dims.hidden),
            (dims.hidden,),
            kernel_init=_normal(out_std, ("mlp", "embed")),
            bias_init=_zeros(("embed",)),
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

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return constrain(x, ("batch", "seq", "embed"))


def stacked_blocks(dims: GPTDims, rngs: nnx.Rngs) -> Block:
    """``layers`` independent blocks whose parameters are stacked on a leading ``layers`` axis."""
    keys = jax.random.split(rngs.params(), dims.layers)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(key: jax.Array) -> Block:
        return Block(dims, rngs=nnx.Rngs(params=key))

    return make(keys)


def run_blocks(blocks: Block, x: jax.Array, remat: bool = False) -> jax.Array:
    """Apply stacked blocks in order with a ``lax.scan`` over the ``layers`` axis.

    With ``remat`` each block's activations are recomputed in the backward pass (Megatron's full
    activation recomputation): only the block inputs are kept.
    """
    graphdef, state = nnx.split(blocks)

    def one_layer(h: jax.Array, layer_state) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, layer_state)(h), None

    if remat:
        one_layer = jax.checkpoint(one_layer, prevent_cse=False)
    x, _ = jax.lax.scan(one_layer, x, state)
    return x


class GPT(nnx.Module):
    """Token + learned position embedding, stacked pre-LN blocks, final LayerNorm, tied LM head."""

    def __init__(self, dims: GPTDims, *, rngs: nnx.Rngs):
        self.dims = dims
        self.wte = nnx.Param(
            _padded_vocab_init(dims)(rngs.params(), (dims.vocab_padded, dims.hidden), dims.param_dtype)
        )
        self.wpe = nnx.Param(
            _normal(_INIT_STD, ("pos", "embed"))(rngs.params(), (dims.seq_len, dims.hidden), dims.param_dtype)
        )
        self.blocks = stacked_blocks(dims, rngs)
        self.ln_f = _layer_norm(dims, rngs)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Vocab-parallel lookup: each tensor shard holds a vocabulary slice; results are summed."""
        seq = tokens.shape[1]
        x = jnp.take(self.wte[...], tokens, axis=0) + self.wpe[...][:seq]
        return constrain(x.astype(self.dims.dtype), ("batch", "seq", "embed"))

    def head(self, x: jax.Array) -> jax.Array:
        """Logits over the padded vocabulary, left split over ``vocab`` (fp32 for the loss)."""
        x = self.ln_f(x)
        logits = jnp.einsum("bse,ve->bsv", x, self.wte[...].astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = run_blocks(self.blocks, self.embed(tokens), remat=self.dims.remat)
        return self.head(x)


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
    """Per-token cross-entropy computed on vocabulary shards, as Megatron's ``_VocabParallelCrossEntropy``.

    Written so that every reduction over the vocabulary is a plain max/sum: with logits split over
    ``vocab`` the compiler turns them into three small all-reduces of [batch, seq] (max, target
    logit, sum of exponentials), and the full logits are never gathered. Padded vocabulary entries
    (ids >= ``vocab_size``) are masked out of the softmax.
    """
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    logits = jnp.where(ids < vocab_size, logits, jnp.finfo(logits.dtype).min)
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    target_logit = jnp.sum(jnp.where(ids == targets[..., None], shifted, 0.0), axis=-1)
    return log_normaliser - target_logit


def lm_loss(model: GPT, tokens: jax.Array) -> jax.Array:
    """Mean next-token loss of ``tokens`` [batch, seq_len + 1]."""
    logits = model(tokens[:, :-1])
    return jnp.mean(vocab_parallel_cross_entropy(logits, tokens[:, 1:], model.dims.vocab_size))
