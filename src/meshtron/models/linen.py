"""Flax Linen models through the contract: three Linen modules -- embed, one block, head -- become a
contract model (:mod:`meshtron.models.contract`) that trains on any mesh, checkpoints, evaluates,
generates and passes the parity oracle like an NNX model.

Annotate the Linen modules the Linen way, with ``nn.with_logical_partitioning(init, names)`` on
their initialisers (and ``nn.with_logical_constraint`` on activations, if you like); then::

    from meshtron.models.linen import LinenLM

    def build(model_config, rngs):
        return LinenLM(Embed(...), Block(...), Head(...), layers=model_config.layers,
                       vocab_size=model_config.vocab_size, rngs=rngs)

The Linen modules are called as ``embed(tokens, positions) -> x``, ``block(x, positions) -> x``
and ``head(x) -> logits`` (``positions`` [batch, seq] are the tokens' absolute positions, what
rotary embeddings or a position table need).

A head tied to the embedding (GPT-2's, a tied Llama's: ``logits = x @ table.T``) is asked for with
``tie_head=True``. Split into three modules, the head cannot reach the embedding's table the way one
Linen model would (``self.embed.attend(x)``), so it is handed the embedding's ``attend`` instead: the
head is called as ``head(x, attend)``, and ``attend(y)`` runs ``embed.attend(y)`` on the embedding's
own parameters (``nn.Embed.attend``, or an ``attend`` method of the user's embed module)::

    class TiedHead(nn.Module):
        @nn.compact
        def __call__(self, x, attend):
            return attend(nn.LayerNorm(...)(x))

The table stays one parameter of the embedding, with its logical axes: the gradients of both uses
add up in it, and checkpoints, optimizer sharding and pipelines see one leaf. Under pipeline
parallelism the embedding runs on the first stage and the head on the last, like a tied NNX model:
every parameter outside ``blocks`` is replicated over the pipeline and its gradient summed over it.

Only the ``params`` collection is supported (no ``batch_stats``, no dropout RNGs): the contract's
model is a deterministic function of its parameters.

Each module is wrapped with Flax's own bridge (``flax.nnx.bridge.ToNNX``), with three things the
bridge alone gets wrong for meshtron:

* **Initialisation runs without sharding constraints.** Linen applies a parameter's logical
  constraint whenever it is read, also inside its initialiser -- where ``nn.DenseGeneral`` holds its
  kernel flattened to rank 2 under rank-3 names, which fails on a mesh. The parameters are created
  sharded anyway (meshtron's ``jit`` with ``out_shardings``), so no constraint is needed there.
* **No RNG state is kept.** The bridge keeps its ``nnx.Rngs`` in the module after initialisation;
  a contract model holds parameters only.
* **Parameters are read as plain arrays, and Linen applies no constraints.** Stacking blocks on a
  ``layers`` axis adds ``layers`` to every block parameter's names; handed back to Linen as
  ``nn.LogicallyPartitioned`` boxes, each layer's slice would be constrained by names one longer
  than its rank inside the layer scan. And on every call Linen re-runs each initialiser abstractly
  to check the parameter's shape, where ``nn.DenseGeneral`` constrains its kernel flattened to rank 2
  by names of the full rank (google/flax#3676). So the Linen modules run with Linen's logical rules
  switched off: parameters arrive laid out by meshtron (``jit`` in-shardings from their names), the
  residual stream is pinned between blocks by :func:`meshtron.models.blocks.run_blocks`, and the
  compiler propagates the rest from there. ``nn.with_logical_constraint`` calls inside the Linen
  code are therefore no-ops; a model that needs an activation layout pinned inside a block (for
  sequence parallelism beyond the block boundaries) is written in NNX.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from meshtron.models.blocks import Context, stack_blocks
from meshtron.models.contract import ModelContractError

__all__ = ["LinenLM", "from_linen"]

_LINEN_META = "linen_meta_type"


def from_linen(module: nn.Module, *sample_args, rngs: nnx.Rngs) -> nnx.Module:
    """``module`` (a Linen module) as an NNX module holding its parameters, initialised by calling it
    on ``sample_args`` (arrays, or ``jax.ShapeDtypeStruct`` s: only their shapes matter)."""
    if not isinstance(module, nn.Module):
        raise ModelContractError(f"model: from_linen takes a flax.linen.Module, got a {type(module).__name__}; "
                                 "pass the Linen module instance (an NNX module needs no adapter)")
    part = bridge.ToNNX(module, rngs=rngs)
    sample = [jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a for a in sample_args]
    with nn.logical_axis_rules(()):  # Linen's constraints off (see the module docstring)
        bridge.lazy_init(part, *sample)
    part.to_nnx__rngs = None
    for path, variable in nnx.to_flat_state(nnx.state(part)):
        if not isinstance(variable, nnx.Param):
            where = ".".join(str(p) for p in path)
            raise ModelContractError(
                f"model: the Linen module {type(module).__name__} keeps {where} in the collection "
                f"{type(variable).__name__!r}; meshtron trains parameters only (the 'params' collection), so leave "
                "out batch statistics and caches")
    for _, variable in nnx.to_flat_state(nnx.state(part, nnx.Param)):
        metadata = variable.get_metadata()
        if metadata.pop(_LINEN_META, None) is not None:  # read back as plain arrays (see the module docstring)
            variable.set_metadata(metadata)
    return part


class _Block(nnx.Module):
    """One Linen block as the contract calls a block: ``block(x, ctx) -> x``."""

    def __init__(self, block: nn.Module, x: jax.ShapeDtypeStruct, positions: jax.Array, *, rngs: nnx.Rngs):
        self.linen = from_linen(block, x, positions, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: Context) -> jax.Array:
        with nn.logical_axis_rules(()):
            return self.linen(x, ctx.positions)


class LinenLM(nnx.Module):
    """A contract model made of Linen modules: ``embed(tokens, positions) -> x``, a ``block(x,
    positions) -> x`` stacked ``layers`` times, ``head(x) -> logits``.

    ``vocab_size``: the real vocabulary (the head's logits may be padded beyond it). ``max_len``: the
    longest sequence the model can attend over, if it has one (a learned position table).
    ``sample_len``: the sequence length the modules are initialised on (their parameters must not
    depend on it; a position table sized by the input would). ``tie_head``: the head is tied to the
    embedding, called as ``head(x, attend)`` with the embed module's ``attend`` (see the module
    docstring); the table stays the embedding's one parameter.
    """

    def __init__(self, embed: nn.Module, block: nn.Module, head: nn.Module, *, layers: int, vocab_size: int,
                 rngs: nnx.Rngs, max_len: int | None = None, sample_len: int = 8, tie_head: bool = False):
        for role, module in (("embed", embed), ("block", block), ("head", head)):
            if not isinstance(module, nn.Module):
                raise ModelContractError(f"model: LinenLM's {role} is a {type(module).__name__}, not a "
                                         "flax.linen.Module; pass a Linen module instance")
        self.vocab_size = vocab_size
        if max_len is not None:
            self.max_len = max_len
        tokens = jnp.zeros((1, sample_len), jnp.int32)
        positions = jnp.arange(sample_len, dtype=jnp.int32)[None]
        self.linen_embed = from_linen(embed, tokens, positions, rngs=rngs)
        x = jax.eval_shape(lambda t, p: self.linen_embed(t, p), tokens, positions)
        self.blocks = stack_blocks(lambda r: _Block(block, x, positions, rngs=r), layers, rngs)
        self.tie_head = tie_head
        if tie_head:
            _check_tied(embed, x, self._attend)
        self.linen_head = from_linen(head, x, *self._head_extras(), rngs=rngs)
        _check_logits(jax.eval_shape(self.head, x), vocab_size, head)

    def embed(self, tokens: jax.Array, ctx: Context) -> jax.Array:
        with nn.logical_axis_rules(()):
            return self.linen_embed(tokens, ctx.positions)

    def head(self, x: jax.Array) -> jax.Array:
        with nn.logical_axis_rules(()):
            return self.linen_head(x, *self._head_extras())

    def _head_extras(self) -> tuple:
        """What the head takes after ``x``: the embedding's ``attend`` when the head is tied."""
        return (self._attend,) if self.tie_head else ()

    def _attend(self, y: jax.Array) -> jax.Array:
        """``embed.attend(y)`` on the embedding's own parameters: the tied head's projection.
        ``mutable=False``: the bridge otherwise takes mutability from the enclosing Linen call (the
        head's: every collection while it initialises) and would write the embedding's variables back
        from inside the head."""
        with nn.logical_axis_rules(()):
            return self.linen_embed(y, method="attend", mutable=False)


def _check_tied(embed: nn.Module, x: jax.ShapeDtypeStruct, attend: Callable[[jax.Array], jax.Array]) -> None:
    """One line, not a trace, when the embedding cannot serve as the head's projection."""
    name = type(embed).__name__
    if not callable(getattr(type(embed), "attend", None)):
        raise ModelContractError(
            f"model: LinenLM(tie_head=True) projects with the embed module's attend(x) -> logits, and {name} has no "
            "attend method; add one (nn.Embed.attend computes x @ table.T) or pass tie_head=False with a head of its own")
    try:
        jax.eval_shape(attend, x)
    except (TypeError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelContractError(
            f"model: LinenLM(tie_head=True): {name}.attend cannot take the blocks' output of shape {tuple(x.shape)} "
            f"({reason}); tie only a table as wide as the residual stream, or pass tie_head=False") from None


def _check_logits(logits: jax.ShapeDtypeStruct, vocab_size: int, head: nn.Module) -> None:
    """A head narrower than the vocabulary would leave targets no logit (their loss silently wrong)."""
    if logits.shape[-1] < vocab_size:
        raise ModelContractError(
            f"model: LinenLM's head {type(head).__name__} returns {logits.shape[-1]} logits per token, fewer than "
            f"vocab_size={vocab_size}; make the head (or the tied embedding's table) at least vocab_size wide")
