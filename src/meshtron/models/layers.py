"""What the built-in families share: initializers that attach logical axis names to their parameter,
and the pre-norm residual block body."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models.contract import Context
from meshtron.sharding import constrain

INIT_STD = 0.02


def normal(std: float, axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.normal(std), axes)


def zeros(axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), axes)


def ones(axes: tuple[str | None, ...]):
    return nnx.with_partitioning(nnx.initializers.ones_init(), axes)


def padded_vocab_init(vocab_size: int, std: float = INIT_STD):
    """N(0, std) rows for the real vocabulary and zero rows for Megatron's padding, axes (vocab, embed).

    Padded rows get no gradient (their logits are masked, their ids never looked up), so at zero
    they stay inert under AdamW and LAMB; and the real rows are drawn at ``[vocab_size, hidden]``,
    so one seed gives the same model whatever padding the tensor-parallel size asks for.
    """

    def init(key: jax.Array, shape: tuple[int, int], dtype=jnp.float32) -> jax.Array:
        real = nnx.initializers.normal(std)(key, (vocab_size, shape[1]), dtype)
        return jnp.pad(real, ((0, shape[0] - vocab_size), (0, 0)))

    return nnx.with_partitioning(init, ("vocab", "embed"))


def pre_norm_block(x: jax.Array, ctx: Context, attn_norm: Callable, attn: Callable, mlp_norm: Callable,
                   mlp: Callable):
    """``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``; ``(x, cache)`` when ``attn`` decodes with
    ``ctx.cache`` (it then returns its output and the layer's new cache)."""
    attended = attn(attn_norm(x), ctx)
    attended, cache = attended if ctx.cache is not None else (attended, None)
    x = x + attended
    x = constrain(x + mlp(mlp_norm(x)), ("batch", "seq", "embed"))
    return x if cache is None else (x, cache)
