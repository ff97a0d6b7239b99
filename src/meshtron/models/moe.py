"""A mixture-of-experts feed-forward layer any contract model can use in place of its MLP.

Each token goes to ``top_k`` of ``experts`` SwiGLU experts, chosen by a linear router (Mixtral's:
softmax over the experts, top-k, the k probabilities renormalised to sum to 1 unless
``normalize_top_k`` is off), and its output is the probability-weighted sum of theirs, plus the
output of ``shared_mlp_dim``-wide shared experts when there are any (DeepSeek's always-on experts,
applied to every token as one SwiGLU).

**Dropless by default.** The ``T·k`` (token, expert) assignments are sorted by expert and each
expert multiplies exactly its own rows, with ``jax.lax.ragged_dot`` grouped matmuls: no capacity,
no padding, no token dropped. With ``capacity_factor`` > 0 each expert takes at most
``ceil(capacity_factor · T·k / E)`` assignments, earliest tokens first (Megatron's ``position``
policy), into a ``[E, capacity, h]`` buffer multiplied as one batched matmul; assignments beyond it
are dropped (the token keeps its residual and the other experts' outputs) and counted.

**Losses.** The load-balancing loss is Switch/Megatron's ``(E/k) · Σ_e f_e · P_e`` (``f_e``: the
fraction of tokens assigned to expert e, ``P_e``: its mean router probability; 1 when perfectly
balanced); the router z-loss is ST-MoE's mean squared log-sum-exp of the router logits. Their
weights are ``aux_loss_weight`` and ``z_loss_weight``; each layer attaches its own to its output
(:func:`meshtron.models.auxiliary.attach_auxiliary_loss`), so the objective is the language-model
loss plus the weighted sum over layers, and no block returns anything new.

**Layout.** Expert weights are ``[experts, embed, mlp]`` (gate, up) and ``[experts, mlp, embed]``
(down). The rules table says where ``experts`` and ``mlp`` go: by default ``mlp`` splits over
``tensor`` (each rank holds a column slice of every expert, Megatron's expert-tensor parallelism:
the layer's output is a partial sum that the block's :func:`exit_parallel_region` all-reduces,
as for a dense MLP). The router is replicated. Nothing here names a mesh axis.

:func:`routing_statistics` runs a model's layers one by one and returns each MoE layer's expert
load, dropped assignments and losses -- what a run reports.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtron.models.auxiliary import attach_auxiliary_loss
from meshtron.models.contract import RESIDUAL, Context
from meshtron.models.layers import INIT_STD, normal
from meshtron.sharding import constrain

EXPERTS = "experts"


@dataclass(frozen=True)
class MoEDims:
    """The layer's static shape and routing choices."""

    hidden: int
    experts: int
    top_k: int
    mlp_dim: int  # each expert's SwiGLU inner width
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0
    shared_mlp_dim: int = 0  # total inner width of the shared experts (0: none)
    normalize_top_k: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def capacity(self, assignments: int) -> int:
        """Rows per expert with a capacity factor: ``ceil(capacity_factor · assignments / experts)``."""
        return max(1, math.ceil(self.capacity_factor * assignments / self.experts))


class Routing(NamedTuple):
    """A batch of ``T`` tokens routed: ``experts``/``weights`` ``[T, k]`` (chosen experts, their
    combine weights), ``probs`` ``[T, E]`` and ``logits`` ``[T, E]`` (fp32)."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


class RoutingStatistics(NamedTuple):
    """One MoE layer's routing of one batch: assignments per expert ``[E]`` (before any drop),
    assignments dropped for capacity, the load-balancing loss and the z-loss (unweighted)."""

    load: jax.Array
    dropped: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


def route(logits: jax.Array, top_k: int, normalize: bool = True) -> Routing:
    """Mixtral's routing of router ``logits`` [T, E]: softmax, top-k, renormalised weights."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts, weights, probs, logits)


def expert_load(routing: Routing, experts: int) -> jax.Array:
    """Assignments per expert [E] (int32)."""
    return jnp.bincount(routing.experts.reshape(-1), length=experts).astype(jnp.int32)


def load_balancing_loss(routing: Routing, experts: int) -> jax.Array:
    """``(E/k) · Σ_e f_e · P_e``: 1 when every expert gets ``T·k/E`` assignments and probability ``1/E``."""
    tokens, k = routing.experts.shape
    fraction = jax.lax.stop_gradient(expert_load(routing, experts).astype(jnp.float32)) / tokens
    return experts / k * jnp.sum(fraction * jnp.mean(routing.probs, axis=0))


def router_z_loss(routing: Routing) -> jax.Array:
    """ST-MoE's z-loss: the mean over tokens of ``logsumexp(logits)²``."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def _swiglu_rows(rows: jax.Array, gate, up, down, matmul) -> jax.Array:
    hidden = jax.nn.silu(matmul(rows, gate)) * matmul(rows, up)
    return matmul(hidden, down)


def dropless_experts(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array,
                     down: jax.Array) -> jax.Array:
    """Every assignment through its expert: rows sorted by expert, grouped matmuls, unsorted, combined.

    ``tokens`` [T, h]; ``gate``/``up`` [E, h, f]; ``down`` [E, f, h]. Returns [T, h].
    """
    count, k = routing.experts.shape
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, token order inside each
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = jnp.take(tokens, order // k, axis=0)

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), sizes)

    out = _swiglu_rows(rows, gate, up, down, grouped)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = jnp.take(out, inverse, axis=0).reshape(count, k, -1)
    return jnp.einsum("tkh,tk->th", out, routing.weights.astype(out.dtype))


def capacity_slots(routing: Routing, experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's row in the ``[E·capacity]`` buffer (``E·capacity`` when dropped), and whether
    it is kept: an expert takes its assignments in token order until it is full."""
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0], dtype=flat.dtype) - starts[flat[order]])
    kept = rank < capacity
    return jnp.where(kept, flat * capacity + rank, experts * capacity), kept


def capacity_experts(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array,
                     capacity: int) -> tuple[jax.Array, jax.Array]:
    """Assignments up to ``capacity`` per expert through a ``[E, capacity, h]`` buffer; the rest
    dropped. Returns the combined output [T, h] and the number of dropped assignments."""
    count, k = routing.experts.shape
    experts, h = gate.shape[0], tokens.shape[-1]
    slots, kept = capacity_slots(routing, experts, capacity)
    rows = jnp.take(tokens, jnp.arange(count * k) // k, axis=0)
    buffer = jnp.zeros((experts * capacity + 1, h), tokens.dtype).at[slots].set(rows)
    buffer = buffer[:-1].reshape(experts, capacity, h)

    def batched(lhs, rhs):
        return jnp.einsum("ecx,exy->ecy", lhs, rhs.astype(lhs.dtype))

    out = _swiglu_rows(buffer, gate, up, down, batched).reshape(experts * capacity, h)
    out = jnp.concatenate([out, jnp.zeros((1, h), out.dtype)])  # the dropped assignments' row
    out = jnp.take(out, slots, axis=0).reshape(count, k, h)
    dropped = jnp.sum(~kept).astype(jnp.int32)
    return jnp.einsum("tkh,tk->th", out, routing.weights.astype(out.dtype)), dropped


_collectors: list[list[RoutingStatistics] | None] = [None]


@contextlib.contextmanager
def collecting_statistics() -> Iterator[list[RoutingStatistics]]:
    """MoE layers called (not under a scan) inside the block append their :class:`RoutingStatistics`."""
    found: list[RoutingStatistics] = []
    _collectors.append(found)
    try:
        yield found
    finally:
        _collectors.pop()


class MoE(nnx.Module):
    """Router, ``experts`` SwiGLU experts and optional shared experts; ``x`` [b, s, h] -> [b, s, h]."""

    def __init__(self, dims: MoEDims, *, rngs: nnx.Rngs):
        h, e, f = dims.hidden, dims.experts, dims.mlp_dim
        self.dims = dims

        def param(shape, axes):
            return nnx.Param(normal(INIT_STD, axes)(rngs.params(), shape, dims.param_dtype))

        self.router = param((h, e), ("embed", None))
        self.gate = param((e, h, f), (EXPERTS, "embed", "mlp"))
        self.up = param((e, h, f), (EXPERTS, "embed", "mlp"))
        self.down = param((e, f, h), (EXPERTS, "mlp", "embed"))
        if dims.shared_mlp_dim:
            fs = dims.shared_mlp_dim
            self.shared_gate = param((h, fs), ("embed", "mlp"))
            self.shared_up = param((h, fs), ("embed", "mlp"))
            self.shared_down = param((fs, h), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dims
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        routing = route(tokens @ self.router[...].astype(x.dtype), d.top_k, d.normalize_top_k)
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        dropped = jnp.int32(0)
        if d.capacity_factor > 0:
            y, dropped = capacity_experts(tokens, routing, gate, up, down, d.capacity(b * s * d.top_k))
        else:
            y = dropless_experts(tokens, routing, gate, up, down)
        y = y.reshape(b, s, h)
        if d.shared_mlp_dim:
            hidden = jax.nn.silu(x @ self.shared_gate[...].astype(x.dtype)) * (x @ self.shared_up[...].astype(x.dtype))
            y = y + constrain(hidden, ("batch", "seq", "mlp")) @ self.shared_down[...].astype(x.dtype)
        aux, z = load_balancing_loss(routing, d.experts), router_z_loss(routing)
        if _collectors[-1] is not None:
            _collectors[-1].append(RoutingStatistics(expert_load(routing, d.experts), dropped, aux, z))
        y = attach_auxiliary_loss(y, aux, d.aux_loss_weight)
        return attach_auxiliary_loss(y, z, d.z_loss_weight)


def routing_statistics(model: nnx.Module, tokens: jax.Array) -> list[RoutingStatistics]:
    """Every MoE layer's :class:`RoutingStatistics` for ``tokens`` [b, s] (a contract model's layers
    run one at a time, unrolled, so each layer's routing can be read; jit the caller)."""
    ctx = Context.for_sequence(*tokens.shape)
    x = model.embed(tokens, ctx)
    graphdef, state = nnx.split(model.blocks)
    layers = jax.tree.leaves(state)[0].shape[0]
    with collecting_statistics() as found:
        for i in range(layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x = constrain(layer(x, ctx), RESIDUAL)
    return found
