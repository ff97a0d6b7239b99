"""A model meshtron has never seen, written the way a user would: a GPT-J / PaLM-style *parallel*
block (attention and MLP read the same normalised input and are added together), with logical
axis names of its own (``attn_heads``, ``attn_dim``, ``ffn``) that a user maps with rules.

It follows the public contract only (meshtron.models) and uses meshtron's attention helper,
so it also decodes with a KV cache. Not in src/: the tests and the README use it as a user's model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models import (
    RESIDUAL,
    WHOLE_SEQUENCE,
    Context,
    attention,
    enter_parallel_region,
    exit_parallel_region,
    stack_blocks,
)
from meshtron.sharding import constrain

RULES = {"attn_heads": "tensor", "attn_dim": None, "ffn": "tensor"}


def _param(rngs, shape, axes, std=0.02):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(std), axes)(rngs.params(), shape))


class ParallelBlock(nnx.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
        d = hidden // heads
        self.norm = nnx.LayerNorm(hidden, rngs=rngs,
                                  scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)))
        self.wq = _param(rngs, (hidden, heads, d), ("embed", "attn_heads", "attn_dim"))
        self.wk = _param(rngs, (hidden, heads, d), ("embed", "attn_heads", "attn_dim"))
        self.wv = _param(rngs, (hidden, heads, d), ("embed", "attn_heads", "attn_dim"))
        self.wo = _param(rngs, (heads, d, hidden), ("attn_heads", "attn_dim", "embed"))
        self.w_in = _param(rngs, (hidden, ffn), ("embed", "ffn"))
        self.w_out = _param(rngs, (ffn, hidden), ("ffn", "embed"))

    def __call__(self, x, ctx: Context):
        h = enter_parallel_region(self.norm(x))  # sequence parallelism: gathered here
        q, k, v = (jnp.einsum("bse,ehd->bshd", h, w[...]) for w in (self.wq, self.wk, self.wv))
        q, k, v = (constrain(t, ("batch", "seq", "attn_heads", "attn_dim")) for t in (q, k, v))
        cache = None
        if ctx.cache is None:
            att = attention.causal_attention(q, k, v)
        else:
            att, cache = attention.causal_attention(q, k, v, positions=ctx.positions, cache=ctx.cache)
        mlp = constrain(jax.nn.gelu(jnp.einsum("bse,ef->bsf", h, self.w_in[...])), ("batch", "seq", "ffn"))
        out = jnp.einsum("bshd,hde->bse", att, self.wo[...]) + jnp.einsum("bsf,fe->bse", mlp, self.w_out[...])
        x = constrain(x + exit_parallel_region(out), RESIDUAL)  # ... and reduce-scattered here
        return x if cache is None else (x, cache)


class ParallelLM(nnx.Module):
    """Learned positions, parallel blocks, tied embedding."""

    def __init__(self, vocab: int = 256, hidden: int = 64, heads: int = 8, ffn: int = 128, layers: int = 4,
                 max_len: int = 64, *, rngs: nnx.Rngs):
        self.vocab_size, self.max_len, self.heads, self.layers = vocab, max_len, heads, layers
        self.tok = _param(rngs, (vocab, hidden), ("vocab", "embed"))
        self.pos = _param(rngs, (max_len, hidden), (None, "embed"))
        self.blocks = stack_blocks(lambda r: ParallelBlock(hidden, heads, ffn, rngs=r), layers, rngs)
        self.final_norm = nnx.LayerNorm(hidden, rngs=rngs,
                                        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",)),
                                        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)))

    def embed(self, tokens, ctx: Context):
        # looked up by position: a split sequence's are not contiguous, packed documents' restart per row
        pos = jnp.take(self.pos[...], ctx.positions if ctx.segments is not None else ctx.positions[0], axis=0)
        x = constrain(jnp.take(self.tok[...], tokens, axis=0) + pos, WHOLE_SEQUENCE)
        return exit_parallel_region(x)

    def head(self, x):
        logits = jnp.einsum("bse,ve->bsv", enter_parallel_region(self.final_norm(x)), self.tok[...])
        return constrain(logits, ("batch", "seq", "vocab"))

    def init_cache(self, batch: int, max_len: int):
        hidden = self.tok.shape[1]
        return attention.stacked_caches(self.layers, batch, max_len, self.heads, hidden // self.heads)


def factory(rngs: nnx.Rngs) -> ParallelLM:
    """For the Python API: ``Trainer.from_config(cfg, model=factory, rules=RULES)``."""
    return ParallelLM(rngs=rngs)


def build(cfg, rngs: nnx.Rngs) -> ParallelLM:
    """For the CLI: ``model.factory=parallel_lm:build`` sized by the config's model section."""
    return ParallelLM(cfg.vocab_size, cfg.hidden, cfg.heads, cfg.mlp_dim, cfg.layers, cfg.seq_len, rngs=rngs)
