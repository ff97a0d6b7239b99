"""cuDNN's flash-attention kernels as a :class:`~meshtron.models.attention_blocks.BlockKernels` pair,
for the ring of :mod:`meshtron.models.context_attention` (``model.attention=cudnn`` with
``parallel.context_attention=ring``).

A ring attends each key/value block separately and combines the blocks by their log-sum-exps, and its
backward needs each block's gradients from the *whole* attention's output and log-sum-exp. JAX's
public API gives neither half: ``jax.nn.dot_product_attention`` returns the log-sum-exp
(``return_residual=True``) but its backward drops that output's cotangent, so a ring cannot
differentiate through its combination, and no public function runs cuDNN's backward kernel on a given
output and log-sum-exp, though the kernel takes exactly those (``activation``, ``fwd_output``). So
the forward calls JAX's cuDNN attention function with ``return_residual=True`` and the backward binds
JAX's private cuDNN backward primitive. This module alone touches ``jax._src``: it imports on any JAX,
and :func:`cudnn_kernels` checks that what it binds has the signature it was written for (jax 0.12),
failing with one line that names the fix otherwise.

cuDNN's conventions are the pair's: ``[b, t, heads, d]`` arrays (``BTNH``), grouped-query heads read
natively, the log-sum-exp ``[b, heads, t]`` fp32 in natural log (JAX hands it out as the same quantity
as its XLA attention's ``logsumexp``), and a boolean mask sent as an additive bias of a large negative
number. Call the kernels where every mesh axis is manual
(:func:`meshtron.models.fused_attention.manual_blocks`): JAX's custom partitioner for them fails inside
a partly manual ``shard_map``.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from meshtron.errors import ConfigError
from meshtron.models.attention_blocks import BlockKernels

try:
    from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # a JAX without the module: cudnn_kernels says so
    _cudnn = None

_NAMES = ("dot_product_attention", "_dot_product_attention_bwd_p_wrapper", "_dot_product_attention_bwd_impl",
          "combine_bias_and_mask", "MaskType", "AttentionLayout")
_BACKWARD = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
             "page_table_v", "activation", "fwd_output", "grad_output", "score_mod_args", "scale", "seed",
             "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length", "score_mod")


def missing() -> str | None:
    """What of JAX's private cuDNN attention this module binds is absent or different; ``None`` if all
    is there as jax 0.12 has it."""
    if _cudnn is None:
        return "jax._src.cudnn.fused_attention_stablehlo"
    absent = [name for name in _NAMES if not hasattr(_cudnn, name)]
    if absent:
        return absent[0]
    if "return_residual" not in inspect.signature(_cudnn.dot_product_attention).parameters:
        return "dot_product_attention(return_residual=)"
    if tuple(inspect.signature(_cudnn._dot_product_attention_bwd_impl).parameters) != _BACKWARD:
        return "the backward primitive's parameters"
    return None


def cudnn_kernels() -> BlockKernels:
    """cuDNN's forward and backward flash-attention kernels for one block (see the module's doc)."""
    absent = missing()
    if absent is not None:
        raise ConfigError(f"model.attention: cudnn by the ring binds JAX's private cuDNN attention, and jax "
                          f"{jax.__version__} lacks {absent}; install jax 0.12, or set "
                          "parallel.context_attention=gathered")
    return BlockKernels(_forward, _backward)


def _mask_type(causal: bool):
    return _cudnn.MaskType.CAUSAL if causal else _cudnn.MaskType.NO_MASK


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool,
             mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(out [b, t, heads, d] in q's dtype, lse [b, heads, t] fp32)``."""
    out, lse = _cudnn.dot_product_attention(q, k, v, mask=mask, scale=scale, mask_type=_mask_type(causal),
                                            return_residual=True)
    return out, lse


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, d_out: jax.Array, *,
              scale: float, causal: bool, mask: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` in their inputs' dtypes, from the whole attention's ``out`` and ``lse``: cuDNN's
    backward kernel recomputes the block's probabilities as ``exp(scale · q·k + bias - lse)`` and the
    softmax correction as ``rowsum(d_out ∘ out)``, which is this block's share of the whole's gradients."""
    unused = jnp.zeros(0, q.dtype)
    bias = _cudnn.combine_bias_and_mask(None, mask, q.dtype)  # a boolean mask: a constant bias, no gradient
    grads = _cudnn._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused if bias is None else bias, unused, unused, unused, unused, unused, unused,
        lse.astype(jnp.float32), out.astype(q.dtype), d_out.astype(q.dtype),
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(bias is not None, False),
        mask_type=_mask_type(causal), layout=_cudnn.AttentionLayout.BTNH.value, sliding_window_length=None,
        score_mod=None)
    dq, dk, dv = grads[:3]
    return dq, dk, dv
