"""Multi-token prediction (DeepSeek-V3 §2.2): ``D`` sequential modules after the last block, each
predicting one token further ahead through the model's own embedding and output head.

Module ``k`` (1-based) at position ``i`` takes the previous depth's hidden state ``h^{k-1}_i`` and the
embedding of token ``i + k``, RMSNorms each (``hnorm``, ``enorm``), projects their concatenation
``[enorm(emb); hnorm(h)]`` (``2·hidden -> hidden``, ``eh_proj``), runs one transformer block of the
model's kind, and RMSNorms the result (``norm``, DeepSeek's ``shared_head.norm``): that is ``h^k_i``,
which the shared head projects to logits for token ``i + k + 1``. ``h^0`` is what the main head
projects (the last block's output after the final norm), so every depth's hidden state is the same
kind of representation; the parameter names are Hugging Face's and DeepSeek's (``enorm``, ``hnorm``,
``eh_proj``, the block, ``shared_head.norm`` as ``norm``), the concatenation in their checkpoints'
order (embedding first).

**Targets.** Depth ``k`` at position ``i`` reads input token ``i + k`` and predicts the next-token
target of position ``i + k``; its loss weight is that target's (:func:`depth_view`): zero where
``i + k`` is past the window, and, for packed documents, where ``i`` and ``i + k`` are not of one
document (the target must continue the document position ``i`` sees). Each depth's loss is the mean
over all ``b·s`` positions of the weighted cross-entropy, as the main loss is: the paper's
``1/T · Σ`` over the positions that have a target, and for documents the same normalisation by the
batch's counted next-token targets, so the depths' losses add up over microbatches and data shards
exactly as the main loss does. The multi-token loss is the mean over depths.

**Where it runs.** The modules' parameters sit outside the block stack (the model's ``mtp``
subtree), like the head's, and they run where the head runs -- after the last block, on the last
pipeline stage -- through the contract's ``extra_loss`` (:mod:`meshtron.models.contract`), which
adds ``loss_weight ·`` their loss to the objective's gradient and reports it as ``mtp/loss``.
Generation never calls them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models import documents
from meshtron.models.blocks import RESIDUAL, Context
from meshtron.models.documents import TokenView
from meshtron.models.fp8 import projection_einsum
from meshtron.models.layers import INIT_STD, normal
from meshtron.sharding import constrain

__all__ = ["METRIC", "PredictionDepth", "depth_view", "prediction_loss"]

METRIC = "mtp/loss"  # the name the multi-token loss is reported under (unweighted)


class PredictionDepth(nnx.Module):
    """One multi-token prediction module: ``enorm``, ``hnorm``, ``eh_proj``, ``block``, ``norm`` (module doc).

    ``block``: one transformer block of the model's kind (called ``block(x, ctx)``); ``make_norm()``:
    a fresh RMSNorm over the hidden features, like the model's final norm."""

    def __init__(self, hidden: int, block: nnx.Module, make_norm: Callable[[], nnx.Module], *, dtype: jnp.dtype,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.enorm = make_norm()
        self.hnorm = make_norm()
        self.eh_proj = nnx.Einsum("bsi,ie->bse", (2 * hidden, hidden), kernel_init=normal(INIT_STD, (None, "embed")),
                                  dtype=dtype, param_dtype=param_dtype, einsum_op=projection_einsum, rngs=rngs)
        self.block = block
        self.norm = make_norm()

    def __call__(self, hidden: jax.Array, embedded: jax.Array, ctx: Context) -> jax.Array:
        """``h^k`` [b, s, hidden] from ``h^{k-1}`` (``hidden``) and the embedded tokens ``k`` places on."""
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1)
        x = constrain(self.eh_proj(x), RESIDUAL)
        with documents.document_segments(ctx.segments):  # the block's attention keeps to each document
            x = constrain(self.block(x, ctx), RESIDUAL)
        return self.norm(x)


def depth_view(view: TokenView, k: int) -> TokenView:
    """What depth ``k`` reads and predicts at each of the ``[b, s]`` positions of a batch's ``view``:
    input token ``i + k``, the next-token target of ``i + k`` with its loss weight where ``i + k`` is in
    the window (and, for packed documents, in the document of ``i``), weight 0 elsewhere (and token 0
    past the window). Positions and
    segments stay those of ``i`` (the block runs at position ``i``)."""
    s = view.inputs.shape[1]

    inside = (jnp.arange(s) < s - k)[None, :]

    def ahead(a: jax.Array) -> jax.Array:
        return jnp.roll(a, -k, axis=1)  # (the last k positions wrap around: masked below)

    if view.weights is None:
        weights = jnp.broadcast_to(inside, view.inputs.shape).astype(jnp.float32)
    else:
        same = view.segments == ahead(view.segments)
        weights = jnp.where(inside & same, ahead(view.weights), 0.0)
    # past the window the input is token 0, as Megatron-Core fills its rolled ids: those positions have no
    # target, but what they hold still reaches a mixture of experts' routing and balance
    inputs, targets = (jnp.where(inside, ahead(a), jnp.zeros((), a.dtype)) for a in (view.inputs, view.targets))
    return TokenView(inputs, targets, view.positions, view.segments, weights)


def prediction_loss(depths: list[PredictionDepth], hidden: jax.Array, tokens: jax.Array, *,
                    embed: Callable[[jax.Array, Context], jax.Array],
                    logits: Callable[[jax.Array], jax.Array],
                    token_losses: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The multi-token loss of a batch ``tokens`` (plain windows or packed documents' features) whose
    last block output, after the final norm, is ``hidden`` [b, s, h]: the mean over ``depths`` of each
    depth's weighted mean cross-entropy. ``embed(tokens, ctx)``, ``logits(h)`` (the output projection
    of a normed hidden state) and ``token_losses(logits, targets)`` are the model's own, shared with
    its main prediction."""
    view, ctx = documents.view(tokens), Context.for_tokens(tokens)
    if tokens.ndim == 3 and view.positions is None:
        raise ValueError("multi-token prediction needs whole windows (plain [b, s+1] tokens or packed documents' "
                         "features), not a sequence split over context ranks")
    losses = []
    for k, depth in enumerate(depths, start=1):
        seen = depth_view(view, k)
        hidden = depth(hidden, embed(seen.inputs, ctx), ctx)
        losses.append(documents.weighted_mean(token_losses(logits(hidden), seen.targets), seen.weights))
    return sum(losses[1:], losses[0]) / len(losses)
