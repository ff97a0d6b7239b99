"""A mixture-of-experts feed-forward layer any contract model can use in place of its MLP.

Each token goes to ``top_k`` of ``experts`` SwiGLU experts, chosen by a linear router (Mixtral's:
softmax over the experts, top-k, the k probabilities renormalised to sum to 1 unless
``normalize_top_k`` is off), and its output is the probability-weighted sum of theirs, plus the
output of ``shared_mlp_dim``-wide shared experts when there are any (DeepSeek's always-on experts,
applied to every token as one SwiGLU).

**DeepSeek-V3's router** is the same layer with other choices (:func:`route`): sigmoid scores, selection
limited to the best ``topk_group`` of ``n_group`` expert groups, combine weights times
``routed_scaling_factor``, and, with ``bias_update_rate`` > 0, aux-loss-free balancing: a per-expert
selection bias (:data:`BIAS`) that each step moves towards the mean load (:class:`BiasBalancing`). The
bias is training state, not a weight; the step learns the load from the gradient of a probe beside it
(:data:`LOAD`, :mod:`meshtron.models.probed_state`). With ``selection_bias`` and a rate of 0 the bias
is there but stays as it is (an imported DeepSeek-V3's, which chooses its experts). :func:`moe_dims_from_config` maps ``model.moe`` to
the layer's :class:`MoEDims` for every family that has experts.

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
loss plus the weighted sum over layers, and no block returns anything new. DeepSeek-V3's sequence-wise
balance loss (``sequence_aux_loss_weight``) is the load-balancing loss of each sequence alone, averaged.

**Layout.** Expert weights are ``[experts, embed, mlp]`` (gate, up) and ``[experts, mlp, embed]``
(down). The rules table says where ``experts`` and ``mlp`` go: by default ``mlp`` splits over
``tensor`` (each rank holds a column slice of every expert, Megatron's expert-tensor parallelism:
the layer's output is a partial sum that the block's :func:`exit_parallel_region` all-reduces,
as for a dense MLP). The router is replicated. Nothing here names a mesh axis. With ``experts`` on a
manual axis, rows travel to their experts' devices and back: padded all-to-alls of each destination's
worst case (:func:`expert_parallel_dropless`), or with ``dispatch="ragged"`` ragged exchanges of the
routed rows alone (:func:`expert_parallel_ragged`).

Each call reports its :class:`RoutingStatistics` (:func:`meshtron.models.auxiliary.report`): expert
load, dropped assignments and the unweighted losses, which a run's logged steps record
(:meth:`RoutingStatistics.metrics`) and :func:`routing_statistics` returns for a whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtron.config import ModelConfig
from meshtron.models.auxiliary import attach_auxiliary_loss, carry_out, report
from meshtron.models.contract import layer_reports
from meshtron.models.fp8 import projection_einsum, projection_ragged_dot
from meshtron.models.grouped_matmul import grouped_matmul
from meshtron.models.layers import INIT_STD, normal
from meshtron.models.probed_state import PROBED, ProbedState, StepTotals
from meshtron.models.ragged_exchange import expert_plans, ragged_all_to_all
from meshtron.sharding import constrain, logical_to_spec, varying_like
from meshtron.trace_context import current

EXPERTS = "experts"
BIAS = "e_score_correction_bias"  # Hugging Face's name of DeepSeek-V3's selection bias
LOAD = "expert_load"  # the bias's probe: zeros whose gradient is the step's expert load


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
    router: str = "softmax"  # scores of the router's logits: softmax (Mixtral) or sigmoid (DeepSeek-V3)
    routed_scaling_factor: float = 1.0  # multiplies the combine weights
    n_group: int = 1  # expert groups for group-limited routing
    topk_group: int = 1  # groups each token may use (n_group: no limit)
    bias_update_rate: float = 0.0  # aux-loss-free balancing's bias step (0: the bias, if any, stays as it is)
    selection_bias: bool = False  # a per-expert bias on the scores for selection (BIAS)
    sequence_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
    dispatch: str = "padded"  # expert-parallel exchange: padded (all-to-all) or ragged (ragged_all_to_all)
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def capacity(self, assignments: int) -> int:
        """Rows per expert with a capacity factor: ``ceil(capacity_factor · assignments / experts)``."""
        return max(1, math.ceil(self.capacity_factor * assignments / self.experts))


def moe_dims_from_config(cfg: ModelConfig) -> MoEDims | None:
    """The mixture of experts of ``model.moe`` (None: a dense model), for every family that has one."""
    e = cfg.moe
    if not e.experts:
        return None
    width = e.mlp_dim or cfg.mlp_dim
    return MoEDims(
        hidden=cfg.hidden, experts=e.experts, top_k=e.top_k, mlp_dim=width, capacity_factor=e.capacity_factor,
        aux_loss_weight=e.aux_loss_weight, z_loss_weight=e.z_loss_weight, shared_mlp_dim=e.shared_experts * width,
        normalize_top_k=e.normalize_top_k, router=e.router, routed_scaling_factor=e.routed_scaling_factor,
        n_group=e.n_group, topk_group=e.n_group if e.topk_group is None else e.topk_group,
        bias_update_rate=e.bias_update_rate, selection_bias=e.selection_bias or e.bias_update_rate > 0,
        sequence_aux_loss_weight=e.sequence_aux_loss_weight, dispatch=e.dispatch,
        dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
    )


class Routing(NamedTuple):
    """A batch of ``T`` tokens routed: ``experts``/``weights`` ``[T, k]`` (chosen experts, their
    combine weights), ``probs`` ``[T, E]`` and ``logits`` ``[T, E]`` (fp32)."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array
    logits: jax.Array


class RoutingStatistics(NamedTuple):
    """One MoE layer's routing of one batch: assignments per expert ``[E]`` (before any drop), per
    expert-parallel rank ``[n]`` (the ``E/n`` experts each holds; ``[1]`` without expert
    parallelism), assignments dropped for capacity, the load-balancing loss and the z-loss
    (unweighted), and the selection bias ``[E]`` (``[0]`` without aux-loss-free balancing). Stacked
    over layers, each field gains a leading ``[layers]`` axis."""

    load: jax.Array
    rank_load: jax.Array
    dropped: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    bias: jax.Array

    def metrics(self, groups: int = 1) -> dict[str, float]:
        """A run's record of these statistics, stacked over the layers and summed over ``groups``
        routing groups (microbatches × data shards, each routed and balanced on its own): the
        losses as their mean over layers and groups, the dropped fraction of all assignments, the
        busiest expert's load over the mean (``load_imbalance``, the worst layer; 1 is balanced),
        each expert-parallel rank's share of all assignments and, with aux-loss-free balancing, the
        selection bias's smallest and largest entry over all layers."""
        load, ranks = np.asarray(self.load, np.float64), np.asarray(self.rank_load, np.float64)
        record = {
            "moe/aux_loss": float(np.mean(self.aux_loss)) / groups,
            "moe/z_loss": float(np.mean(self.z_loss)) / groups,
            "moe/dropped_fraction": float(np.sum(self.dropped) / max(np.sum(load), 1.0)),
            "moe/load_imbalance": float(np.max(load.max(-1) / np.maximum(load.mean(-1), 1e-9))),
        }
        bias = np.asarray(self.bias, np.float64)
        if bias.shape[-1]:
            record.update({"moe/bias_min": float(bias.min()) / groups, "moe/bias_max": float(bias.max()) / groups})
        shares = ranks.reshape(-1, ranks.shape[-1]).sum(0) / max(ranks.sum(), 1.0)
        if len(shares) > 1:
            record.update({f"moe/rank_load/{r}": float(share) for r, share in enumerate(shares)})
        return record


def _whole(x: jax.Array) -> jax.Array:
    """``x`` pinned whole on every device of the compiler-managed axes. The layer's input is the whole
    sequence on every tensor rank (the block entered its tensor-parallel region), so its routing and
    the index arrays that sort tokens by expert are the same everywhere; left to propagation, the
    compiler may split them over ``tensor`` and gather them back (collectives the pipeline's
    ordering does not know about)."""
    return constrain(x, (None,) * x.ndim)


def route(logits: jax.Array, top_k: int, normalize: bool = True, *, scores: str = "softmax",
          bias: jax.Array | None = None, n_group: int = 1, topk_group: int | None = None,
          scaling: float = 1.0) -> Routing:
    """The routing of router ``logits`` [T, E]: Mixtral's by default (softmax, top-k, renormalised weights).

    ``scores``: ``softmax`` or ``sigmoid`` (DeepSeek-V3) of the logits, in fp32. Selection ranks
    ``scores + bias`` (``bias`` [E]: aux-loss-free balancing's, none by default); with ``n_group`` > 1 the
    experts form that many groups, each scored by the sum of its two best, and only the ``topk_group``
    best groups' experts may be chosen (DeepSeek-V3's ``noaux_tc``). The combine weights are the chosen
    experts' scores without the bias, renormalised to sum to 1 when ``normalize``, times ``scaling``.
    ``probs`` (what the balance losses average) are the scores normalised to sum to 1 over the experts.
    """
    logits = logits.astype(jnp.float32)
    if scores == "softmax":
        values = probs = jax.nn.softmax(logits, axis=-1)
    else:
        values = jax.nn.sigmoid(logits)
        probs = values / jnp.sum(values, axis=-1, keepdims=True)
    choice = values if bias is None else values + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if n_group > 1 and (topk_group or n_group) < n_group:
        count, experts = choice.shape
        grouped = choice.reshape(count, n_group, experts // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        kept_groups = jax.lax.top_k(group_scores, topk_group)[1]
        kept = jnp.sum(jax.nn.one_hot(kept_groups, n_group, dtype=jnp.int32), axis=1) > 0
        choice = jnp.where(jnp.repeat(kept, experts // n_group, axis=1), choice, -jnp.inf)
    if choice is values:  # no bias, every group: the top k of the scores are the weights
        weights, experts = jax.lax.top_k(values, top_k)
    else:
        experts = jax.lax.top_k(choice, top_k)[1]
        weights = jnp.take_along_axis(values, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return Routing(_whole(experts), _whole(weights), probs, logits)


def expert_load(routing: Routing, experts: int) -> jax.Array:
    """Assignments per expert [E] (int32)."""
    return jnp.bincount(routing.experts.reshape(-1), length=experts).astype(jnp.int32)


def load_balancing_loss(routing: Routing, experts: int) -> jax.Array:
    """``(E/k) · Σ_e f_e · P_e``: 1 when every expert gets ``T·k/E`` assignments and probability ``1/E``."""
    tokens, k = routing.experts.shape
    fraction = jax.lax.stop_gradient(expert_load(routing, experts).astype(jnp.float32)) / tokens
    return experts / k * jnp.sum(fraction * jnp.mean(routing.probs, axis=0))


def sequence_balance_loss(routing: Routing, experts: int, sequences: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss: :func:`load_balancing_loss` of each of the ``sequences``
    (the routed tokens in order, one sequence after another), averaged over them."""
    per_sequence = jax.tree.map(lambda a: a.reshape(sequences, a.shape[0] // sequences, *a.shape[1:]), routing)
    return jnp.mean(jax.vmap(lambda r: load_balancing_loss(r, experts))(per_sequence))


@dataclass(frozen=True)
class BiasBalancing:
    """DeepSeek-V3's aux-loss-free balancing as a :class:`~meshtron.models.probed_state.ProbedState`'s
    advance: after each step every expert's selection bias moves by ``rate`` towards balance,
    ``bias += rate · sign(mean load - load)``, the load being the assignments to each expert over the
    whole global batch (every microbatch and data rank)."""

    rate: float

    def __call__(self, bias: jax.Array, load: jax.Array, totals: StepTotals) -> jax.Array:
        # the probe's gradient is the mean load per microbatch; counts are whole numbers, so rounding
        # the total undoes the order in which a schedule summed them
        load = totals.reduce(jax.lax.psum, jnp.round(load.astype(jnp.float32) * totals.microbatches))
        return bias + self.rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


class ExpertBias(nnx.Param):
    """A layer's selection bias ``[E]`` (aux-loss-free balancing): state, not a trained weight."""


class ExpertLoad(nnx.Param):
    """Zeros ``[E]`` whose gradient is the step's assignments per expert; never trained."""


def router_z_loss(routing: Routing) -> jax.Array:
    """ST-MoE's z-loss: the mean over tokens of ``logsumexp(logits)²``."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))


def _swiglu_rows(rows: jax.Array, gate, up, down, matmul) -> jax.Array:
    hidden = jax.nn.silu(matmul(rows, gate)) * matmul(rows, up)
    return matmul(hidden, down)


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes ``order``."""
    return _whole(jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype)))


def _rank_in_group(groups: jax.Array, count: int) -> jax.Array:
    """For each element of ``groups`` (ids below ``count``), how many earlier elements share its id."""
    order = jnp.argsort(groups, stable=True)
    sizes = jnp.bincount(groups, length=count)
    starts = jnp.cumsum(sizes) - sizes
    within = jnp.arange(groups.shape[0], dtype=groups.dtype) - starts[groups[order]]
    return jnp.zeros_like(groups).at[order].set(within)


def _assignment_rows(tokens: jax.Array, k: int) -> jax.Array:
    """Each token repeated once per assignment: row ``t·k + j`` is token ``t``."""
    return jnp.take(tokens, jnp.arange(tokens.shape[0] * k) // k, axis=0)


def _combined(out: jax.Array, routing: Routing) -> jax.Array:
    """The assignments' outputs ``[T·k, h]`` weighted by their routing weights and summed per token."""
    count, k = routing.experts.shape
    out = out.reshape(count, k, -1)
    return jnp.einsum("tkh,tk->th", out, routing.weights.astype(out.dtype))


def _expert_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """The experts' grouped matmul in ``lhs``'s dtype: FP8 GEMMs under ``model.fp8``
    (:func:`~meshtron.models.fp8.projection_ragged_dot`), else
    :func:`~meshtron.models.grouped_matmul.grouped_matmul` -- a grouped-GEMM kernel on Hopper GPUs where
    ``jax.lax.ragged_dot`` would be a masked dense product over every expert."""
    if current().fp8 != "off":
        return projection_ragged_dot(lhs, rhs.astype(lhs.dtype), sizes)
    return grouped_matmul(lhs, rhs, sizes)


def dropless_experts(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array,
                     down: jax.Array) -> jax.Array:
    """Every assignment through its expert: rows sorted by expert, grouped matmuls, unsorted, combined.

    ``tokens`` [T, h]; ``gate``/``up`` [E, h, f]; ``down`` [E, f, h]. Returns [T, h].
    """
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = _whole(jnp.argsort(flat, stable=True))  # assignments grouped by expert, token order inside each
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = jnp.take(tokens, order // k, axis=0)

    def grouped(lhs, rhs):
        return _expert_matmul(lhs, rhs, sizes)

    out = _swiglu_rows(rows, gate, up, down, grouped)
    return _combined(jnp.take(out, _inverse(order), axis=0), routing)


def capacity_slots(routing: Routing, experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's row in the ``[E·capacity]`` buffer (``E·capacity`` when dropped), and whether
    it is kept: an expert takes its assignments in token order until it is full."""
    flat = routing.experts.reshape(-1)
    rank = _rank_in_group(flat, experts)
    kept = rank < capacity
    return _whole(jnp.where(kept, flat * capacity + rank, experts * capacity)), _whole(kept)


def capacity_experts(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array,
                     capacity: int, axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Assignments up to ``capacity`` per expert through a ``[E, capacity, h]`` buffer; the rest
    dropped. Returns the combined output [T, h] and the number of dropped assignments.

    With the experts split over the manual mesh ``axis`` (``gate`` etc. hold this device's ``E/n``),
    the buffer is exchanged by one all-to-all (GShard's dispatch), each device runs its experts on the
    ``n · capacity`` rows every device sent each of them, and a second all-to-all brings them back."""
    n, local, h = (1 if axis is None else jax.lax.axis_size(axis)), gate.shape[0], tokens.shape[-1]
    experts = n * local
    slots, kept = capacity_slots(routing, experts, capacity)
    buffer = jnp.zeros((experts * capacity + 1, h), tokens.dtype).at[slots].set(
        _assignment_rows(tokens, routing.experts.shape[1]))[:-1]
    if axis is not None:
        buffer = jax.lax.all_to_all(buffer, axis, 0, 0, tiled=True)  # [source, local expert, capacity, h]
    by_expert = buffer.reshape(n, local, capacity, h).transpose(1, 0, 2, 3).reshape(local, n * capacity, h)

    def batched(lhs, rhs):
        return projection_einsum("ecx,exy->ecy", lhs, rhs.astype(lhs.dtype))

    out = _swiglu_rows(by_expert, gate, up, down, batched)
    out = out.reshape(local, n, capacity, h).transpose(1, 0, 2, 3).reshape(experts * capacity, h)
    if axis is not None:
        out = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    out = jnp.concatenate([out, jnp.zeros((1, h), out.dtype)])  # the dropped assignments' row
    return _combined(jnp.take(out, slots, axis=0), routing), jnp.sum(~kept).astype(jnp.int32)


def all_to_all_bytes(dims: MoEDims, tokens: int, ranks: int, forwards: int = 1, itemsize: int = 4) -> float:
    """Bytes one device sends over the expert axis (``ranks`` devices, ring all-to-all: ``(n-1)/n`` of
    each buffer) per MoE layer and microbatch of ``tokens`` routed tokens: dispatch and combine in each
    of ``forwards`` forward passes (2 when the layer is recomputed for its backward), and the rows'
    two transposes in the backward. Dropless, each destination's block holds ``T · min(k, E/n)`` rows
    and their int32 expert ids travel with them; with a capacity the buffer is ``E · capacity`` rows.

    With ``dispatch="ragged"`` each trip sends the ``T · k`` routed rows themselves, of which the
    ``(n-1)/n`` routed to other devices leave when the routing is balanced (what this counts: the real
    figure is the routing's, known only when the step runs); each forward also gathers the ``[E]``
    int32 counts from every device, and each backward trip exchanges two ``[E]`` int32 offset arrays."""
    if ranks <= 1:
        return 0.0
    if dims.dispatch == "ragged":
        rows = tokens * dims.top_k
        rows_bytes = (ranks - 1) / ranks * (2 * forwards + 2) * rows * dims.hidden * itemsize
        return rows_bytes + (ranks - 1) * forwards * dims.experts * 4 + (ranks - 1) / ranks * 2 * 2 * dims.experts * 4
    if dims.capacity_factor:
        rows, ids = dims.experts * dims.capacity(tokens * dims.top_k), 0
    else:
        rows, ids = ranks * tokens * min(dims.top_k, dims.experts // ranks), 1
    return (ranks - 1) / ranks * ((2 * forwards + 2) * rows * dims.hidden * itemsize + ids * forwards * rows * 4)


def expert_axis() -> str | None:
    """The mesh axis the rules put ``experts`` on, when it is manual here (inside the trainer's
    ``shard_map``) and splits them: each device then holds ``experts / size`` of them and tokens must
    travel to their experts. ``None``: every expert is on every device of this program (it may still
    be split over an axis the compiler manages, which then moves the weights instead)."""
    spec = logical_to_spec((EXPERTS,))
    name = spec[0] if len(spec) else None
    mesh = jax.sharding.get_abstract_mesh()
    if name is None or mesh.empty or name not in mesh.manual_axes or mesh.shape[name] == 1:
        return None
    return name


def expert_parallel_dropless(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array,
                             axis: str) -> jax.Array:
    """:func:`dropless_experts` with the experts split over the manual mesh ``axis`` (``gate`` etc. hold
    this device's ``E/n``): the assignments travel to the device of their expert and back in two
    all-to-alls, and each device runs grouped matmuls over the rows it received.

    A device may receive any number of rows, and the buffers of an all-to-all have one shape, so each
    destination's block holds the most it can be sent without dropping: ``T · min(k, E/n)`` rows (a
    token's k experts are distinct). :func:`expert_parallel_ragged` sends only the rows that exist.
    """
    count, k = routing.experts.shape
    n, local = jax.lax.axis_size(axis), gate.shape[0]
    rows = count * min(k, local)
    flat = routing.experts.reshape(-1)
    destination = flat // local
    slots = _whole(destination * rows + _rank_in_group(destination, n))  # its destination's block, in order
    h = tokens.shape[-1]
    send = jnp.zeros((n * rows, h), tokens.dtype).at[slots].set(_assignment_rows(tokens, k))
    ids = jnp.full((n * rows,), local, jnp.int32).at[slots].set((flat % local).astype(jnp.int32))
    received = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
    received_ids = _whole(jax.lax.all_to_all(ids, axis, 0, 0, tiled=True))
    order = _whole(jnp.argsort(received_ids, stable=True))  # by local expert; the empty rows (id = local) last
    sizes = jnp.bincount(received_ids, length=local + 1)[:local].astype(jnp.int32)

    def grouped(lhs, rhs):
        return _expert_matmul(lhs, rhs, sizes)

    out = _swiglu_rows(jnp.take(received, order, axis=0), gate, up, down, grouped)
    out = jnp.where((jnp.take(received_ids, order) < local)[:, None], out, 0.0)
    back = jax.lax.all_to_all(jnp.take(out, _inverse(order), axis=0), axis, 0, 0, tiled=True)
    return _combined(jnp.take(back, slots, axis=0), routing)


def expert_parallel_ragged(tokens: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array,
                           axis: str) -> jax.Array:
    """:func:`expert_parallel_dropless` with ragged exchanges: each device sends each other device exactly
    the rows routed to its experts (:mod:`meshtron.models.ragged_exchange`), and they arrive grouped by
    local expert, so the grouped matmuls need no sort.

    The rows leave sorted by expert (``[T·k, h]``, no padding); what each device routes to each expert
    (``[n, E]`` int32) is gathered over ``axis`` first, so every device knows every offset. The receive
    buffer's shape is static and must hold the most a device can be sent without a drop, all ``n``
    devices sending it ``T · min(k, E/n)`` rows: ``[n · T · min(k, E/n), h]``, as large as the padded
    exchange's; only the routed rows are written into it, and rows past them stay zero.
    """
    count, k = routing.experts.shape
    n, local = jax.lax.axis_size(axis), gate.shape[0]
    block = count * min(k, local)  # the most rows one device sends another
    flat = routing.experts.reshape(-1)
    order = _whole(jnp.argsort(flat, stable=True))  # assignments sorted by expert, so by destination too
    counts = jax.lax.all_gather(jnp.bincount(flat, length=n * local).astype(jnp.int32), axis)  # [n, E]
    plans = expert_plans(counts, jax.lax.axis_index(axis), local)
    send = jnp.take(tokens, order // k, axis=0)
    received = ragged_all_to_all(send, varying_like(jnp.zeros((n * block, tokens.shape[-1]), tokens.dtype), send),
                                 plans.dispatch, axis, block)

    def grouped(lhs, rhs):
        return _expert_matmul(lhs, rhs, plans.group_sizes)

    out = _swiglu_rows(received, gate, up, down, grouped)
    out = jnp.where((jnp.arange(n * block) < jnp.sum(plans.group_sizes))[:, None], out, 0.0)
    back = ragged_all_to_all(out, varying_like(jnp.zeros_like(send), out), plans.combine, axis, block)
    return _combined(jnp.take(back, _inverse(order), axis=0), routing)


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
        if dims.selection_bias:  # kept by the step's ProbedState, which moves it by bias_update_rate (0: not at all)
            def zeros(kind):
                return kind(nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))(None, (e,), jnp.float32))

            setattr(self, BIAS, zeros(ExpertBias))
            setattr(self, LOAD, zeros(ExpertLoad))
            setattr(self, PROBED, (ProbedState(BIAS, LOAD, BiasBalancing(dims.bias_update_rate)),))

    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dims
        b, s, h = x.shape
        tokens = _whole(x.reshape(b * s, h))
        bias = getattr(self, BIAS)[...] if d.selection_bias else None
        routing = route(tokens @ self.router[...].astype(x.dtype), d.top_k, d.normalize_top_k, scores=d.router,
                        bias=bias, n_group=d.n_group, topk_group=d.topk_group, scaling=d.routed_scaling_factor)
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        dropped = varying_like(jnp.int32(0), x)  # (typed like what a capacity would count, for a padding slot's cond)
        axis = expert_axis()
        if d.capacity_factor > 0:
            capacity = d.capacity(b * s * d.top_k)
            y, dropped = capacity_experts(tokens, routing, gate, up, down, capacity, axis)
        elif axis is None:
            y = dropless_experts(tokens, routing, gate, up, down)
        elif d.dispatch == "ragged":
            y = expert_parallel_ragged(tokens, routing, gate, up, down, axis)
        else:
            y = expert_parallel_dropless(tokens, routing, gate, up, down, axis)
        y = y.reshape(b, s, h)
        if d.shared_mlp_dim:
            def project(spec, v, w):
                return projection_einsum(spec, v, w[...].astype(v.dtype))

            hidden = jax.nn.silu(project("bsh,hf->bsf", x, self.shared_gate)) * project("bsh,hf->bsf", x, self.shared_up)
            y = y + project("bsf,fh->bsh", constrain(hidden, ("batch", "seq", "mlp")), self.shared_down)
        aux, z = load_balancing_loss(routing, d.experts), router_z_loss(routing)
        load = expert_load(routing, d.experts)
        ranks = 1 if axis is None else jax.lax.axis_size(axis)
        shown = varying_like(jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32), x)
        report(RoutingStatistics(load, load.reshape(ranks, -1).sum(-1), dropped, aux, z, shown))
        if bias is not None:
            y = carry_out(y, getattr(self, LOAD)[...], load.astype(jnp.float32))
        if d.sequence_aux_loss_weight:
            y = attach_auxiliary_loss(y, sequence_balance_loss(routing, d.experts, b), d.sequence_aux_loss_weight)
        y = attach_auxiliary_loss(y, aux, d.aux_loss_weight)
        return attach_auxiliary_loss(y, z, d.z_loss_weight)


def routing_statistics(model: nnx.Module, tokens: jax.Array) -> RoutingStatistics | None:
    """The MoE layers' :class:`RoutingStatistics` for ``tokens`` [b, s], stacked over the layers
    (``load`` [layers, E], the rest [layers]; None for a model without them): a contract model whose
    every block has one MoE layer, run forward once on one program (jit the caller). Training reports the same per step and
    microbatch group on any mesh: :meth:`meshtron.train.step.TrainSteps.routing`."""
    found = layer_reports(model, tokens)
    return found[0] if found else None
