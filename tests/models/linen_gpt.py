"""A GPT written in Flax Linen the way Linen users write one, annotated the Linen way
(``nn.with_logical_partitioning`` on every initialiser, ``nn.DenseGeneral`` with multi-axis kernels):
an embedding, a pre-LN block, a head. ``meshtron.models.linen.LinenLM`` makes it a contract model.

Not in src/: the tests and the README use it as a user's model (``model.factory=linen_gpt:build``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from meshtron.models.linen import LinenLM


def annotated(init, names):
    return nn.with_logical_partitioning(init, names)


NORMAL = nn.initializers.normal(0.02)


def layer_norm() -> nn.LayerNorm:
    return nn.LayerNorm(scale_init=annotated(nn.initializers.ones, ("embed",)),
                        bias_init=annotated(nn.initializers.zeros, ("embed",)))


class Embed(nn.Module):
    vocab: int
    hidden: int
    max_len: int

    @nn.compact
    def __call__(self, tokens, positions):
        wte = self.param("wte", annotated(NORMAL, ("vocab", "embed")), (self.vocab, self.hidden))
        wpe = self.param("wpe", annotated(NORMAL, ("pos", "embed")), (self.max_len, self.hidden))
        return jnp.take(wte, tokens, axis=0) + jnp.take(wpe, positions, axis=0)


class Block(nn.Module):
    hidden: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x, positions):
        d = self.hidden // self.heads
        qkv = nn.DenseGeneral((3, self.heads, d),
                              kernel_init=annotated(NORMAL, ("embed", "qkv", "heads", "head_dim")),
                              bias_init=annotated(nn.initializers.zeros, ("qkv", "heads", "head_dim")))(layer_norm()(x))
        attention = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + nn.DenseGeneral(self.hidden, axis=(-2, -1),
                                kernel_init=annotated(NORMAL, ("heads", "head_dim", "embed")),
                                bias_init=annotated(nn.initializers.zeros, ("embed",)))(attention)
        h = nn.Dense(self.mlp, kernel_init=annotated(NORMAL, ("embed", "mlp")),
                     bias_init=annotated(nn.initializers.zeros, ("mlp",)))(layer_norm()(x))
        return x + nn.Dense(self.hidden, kernel_init=annotated(NORMAL, ("mlp", "embed")),
                            bias_init=annotated(nn.initializers.zeros, ("embed",)))(jax.nn.gelu(h))


class Head(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.vocab, use_bias=False, kernel_init=annotated(NORMAL, ("embed", "vocab")))(layer_norm()(x))


def build(model_config, rngs):
    """``model.factory=linen_gpt:build``: the config's sizes (``model.vocab_size`` ... ``model.seq_len``)."""
    c = model_config
    return LinenLM(Embed(c.vocab_size, c.hidden, c.seq_len), Block(c.hidden, c.heads, c.mlp_dim), Head(c.vocab_size),
                   layers=c.layers, vocab_size=c.vocab_size, max_len=c.seq_len, rngs=rngs)
