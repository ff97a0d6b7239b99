"""One SPMD runtime that executes any valid pipeline schedule table.

Runs inside a ``shard_map`` that is manual over the pipeline axis (the caller may also hold other
axes manual, e.g. ``data``; ``tensor`` stays with the compiler). Every device is one stage. The
compiled :class:`~meshtron.pipeline.schedules.Program` says, for every tick and stage, which
(microbatch, chunk) runs forward and which runs backward and which buffer slots they use; the
runtime is a ``lax.scan`` over ticks that, on each device, picks its own column:

* forward: the stage input comes from the stash (an activation received from the previous stage)
  or, on the first virtual stage, from the embedding of the microbatch's tokens; the output is
  sent to the next stage with one ``ppermute`` (the ring edge included, for interleaving). The
  last virtual stage computes the loss instead.
* backward: the stage is *recomputed* from its stashed input under ``jax.vjp`` (Megatron's
  activation recomputation: only stage inputs are kept between forward and backward), seeded by
  the gradient received from the next stage (or by the loss on the last virtual stage); the
  input gradient is sent to the previous stage with the reverse ``ppermute``; parameter
  gradients are accumulated over microbatches. A program compiled with ``keep_residuals`` (no
  recomputation) instead has the forward keep each layer's matmul outputs in residual slots and
  the backward run the layers' pullbacks from them.
* a split backward (zero bubble) runs B, the input gradient, in the backward slot, and W, the
  weight gradient, in a weight slot of the same or a later tick, from what B left in a buffer
  (and, when the forward keeps residuals, from them: their slot then lives until W, and B leaves
  only what depends on the output gradient, part of it written over residuals only B reads).
* an uneven ``pipeline.layout`` pads every chunk to the largest; a chunk runs its own number of
  layers (``layer_counts``) and skips the padding.

Idle slots are *skipped*: each device runs its forward/backward under a ``lax.cond`` on its own
instruction, so a stage with nothing to do does no compute. The stage's layers are one piece of
code for every kind of virtual stage (the embedding and the head + loss are small ``cond``-s
around it). Ticks are grouped into segments with one static shape (does any stage run a forward?
a backward? send?), one ``scan`` per segment, so phases in which no stage sends have no
``ppermute`` and the HLO's loop trip counts are the transfers made; neighbouring
segments are merged while the extra transfers stay within the bubble's share (:func:`segments`),
since every segment compiles its own copy of the stage code. Parameters shared across stages
(embedding, final norm) get their gradients summed over the pipeline axis once, after the loop.

**Why it cannot deadlock.** A collective completes only when every device of its group has
entered it, so two devices that start the same two collectives in opposite orders wait for each
other forever. Per-device ``cond``-s put the tensor-parallel all-reduces of a stage inside
device-divergent control flow, and an XLA runtime schedules a ``conditional`` (a nested executor)
as soon as its operands are ready -- concurrently with, and on different devices in a different
order than, the ``ppermute``-s around it (jaxlib 0.10.2's CPU runtime did exactly that: one
device of a tensor group entered the all-reduce of the last stage's loss while its partner entered
the next ``ppermute``). ``optimization_barrier`` does not help: XLA removes it before scheduling.
The rule this runtime follows instead:

    every operation that runs collectives is ordered after the previous one by a *data*
    dependency, so the order is one chain that every device must follow: per tick, the
    messages received -> the forward ``cond`` -> the backward ``cond`` -> the forward send -> the
    backward send -> the next tick; after the loop, the one reduction over ``axis``.

The chain is a scalar ``seq``, always exactly zero, that each step reads (``x + seq``) and extends with a
token of its own output (one element times zero, which XLA cannot fold for floating point).
Collectives *inside* a ``cond`` are the tensor all-reduces of that stage, whose devices all take
the same branch. :func:`meshtron.hlo.order.unordered_collectives` checks the rule on the
optimized HLO of every compiled step (tests/test_deadlock.py); a stress test runs schedules x
meshes under a timeout.

**Held-out evaluation** (:func:`run_pipeline_forward`) runs a forward-only program
(:func:`meshtron.pipeline.schedules.forward_only`) through the same tick loop with the backward half
switched off: no gradient buffer, no ``vjp``, no backward ``ppermute``, the same ``seq`` chain.
Evaluating with the unpipelined model instead would gather every pipe-sharded layer onto every
device.

The runtime knows nothing about GPT: the model enters as three functions (:class:`StageFunctions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshtron.pipeline.schedules import Program
from meshtron.pipeline.split_backward import SplitPullback, residuals

PyTree = Any

_FORWARD_FIELDS = ("fwd_mb", "fwd_chunk", "fwd_slot", "recv_fwd_slot")
_ROW_FIELDS = (*_FORWARD_FIELDS, "bwd_mb", "bwd_chunk", "bwd_stash_slot", "bwd_grad_slot", "recv_bwd_slot",
               "bwd_weight_slot", "wgt_mb", "wgt_chunk", "wgt_slot", "fwd_res_slot", "bwd_res_slot",
               "wgt_res_slot")


@dataclass(frozen=True)
class StageFunctions:
    """The model, cut for pipelining.

    ``embed(shared, tokens) -> x`` builds the first virtual stage's input from a microbatch of
    tokens; ``stage(chunk_params, x) -> y`` runs one chunk of layers; ``loss(shared, y, tokens)``
    is the scalar loss after the last virtual stage. ``layout(x) -> x`` pins an activation (or its
    gradient) to the layout the stages produce over the compiler-managed axes; the runtime applies
    it to everything it stores, reads and sends, so its buffers and messages keep that layout
    (under sequence parallelism a ``seq/t`` slice) instead of one the compiler's propagation picks.

    ``layer(layer_params, x) -> y`` is one layer of a chunk (``stage`` applied to a chunk equals
    ``layer`` applied to each of its layers in order, the chunk's leaves being ``[layers, ...]``);
    schedules with a split backward (zero bubble) need it, to cut each layer's backward into the
    input gradient and the weight gradient (:mod:`meshtron.pipeline.split_backward`).
    """

    embed: Callable[[PyTree, jax.Array], jax.Array]
    stage: Callable[[PyTree, jax.Array], jax.Array]
    loss: Callable[[PyTree, jax.Array, jax.Array], jax.Array]
    layout: Callable[[jax.Array], jax.Array] = lambda x: x
    layer: Callable[[PyTree, jax.Array], jax.Array] | None = None


@dataclass(frozen=True)
class _Segment:
    start: int
    stop: int
    forward: bool
    backward: bool
    send_forward: bool
    send_backward: bool
    weight: bool = False


def exact_segments(program: Program) -> list[_Segment]:
    """Maximal runs of ticks with the same static work/communication pattern."""
    fwd = (program.fwd_mb >= 0).any(axis=1)
    bwd = (program.bwd_mb >= 0).any(axis=1)
    send_f = (program.fwd_send > 0).any(axis=1)
    send_b = (program.bwd_send > 0).any(axis=1)
    wgt = (program.wgt_mb >= 0).any(axis=1)
    keys = list(zip(fwd, bwd, send_f, send_b, wgt))
    out, tick = [], 0
    for key, group in itertools.groupby(keys):
        length = len(list(group))
        out.append(_Segment(tick, tick + length, *(bool(k) for k in key)))
        tick += length
    return out


def _sends(seg: _Segment) -> int:
    return (seg.stop - seg.start) * (int(seg.send_forward) + int(seg.send_backward))


def _merged(a: _Segment, b: _Segment) -> _Segment:
    return _Segment(a.start, b.stop, a.forward or b.forward, a.backward or b.backward,
                    a.send_forward or b.send_forward, a.send_backward or b.send_backward, a.weight or b.weight)


def segments(program: Program) -> list[_Segment]:
    """The runtime's segments: :func:`exact_segments`, with neighbours merged while the extra
    transfers stay within the bubble's share of Megatron's minimum.

    Every segment compiles its own copy of the stage's forward and/or backward, which is most of
    the step's compile time. Merging two neighbours saves a copy and costs the sends the merged
    segment makes in ticks where the exact table sends nothing (the receiver ignores them: its
    ``recv`` slot is -1 there). Minimum: each microbatch crosses each of its ``v`` boundaries once
    each way, ``2·m·v`` transfers per device (``m·v``, one way, for a forward-only program); the
    budget is ``(1 + bubble)`` times that, bubble ``(p - 1)/(v·m)``, i.e. ``2·(p - 1)`` (``p - 1``)
    extra transfers -- what the table's ramp-up and ramp-down cost in compute anyway. Cheapest
    merges first.
    """
    sched = program.schedule
    directions = 1 if sched.forward_only else 2
    minimum = directions * sched.microbatches * sched.chunks
    budget = minimum + directions * (sched.stages - 1)
    out = exact_segments(program)
    sent = sum(_sends(seg) for seg in out)
    while len(out) > 1:
        costs = [_sends(_merged(a, b)) - _sends(a) - _sends(b) for a, b in itertools.pairwise(out)]
        best = min(range(len(costs)), key=costs.__getitem__)
        if sent + costs[best] > budget:
            break
        sent += costs[best]
        out[best : best + 2] = [_merged(out[best], out[best + 1])]
    return out


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buffer[slot] = value`` when ``slot >= 0``; unchanged otherwise."""
    index = jnp.maximum(slot, 0)
    current = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, current), index, 0)


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


def _get(buffer: jax.Array, index: tuple[jax.Array, ...]) -> jax.Array:
    """``buffer[index]`` for leading indices ``index`` (each in range)."""
    start = (*index, *(0,) * (buffer.ndim - len(index)))
    return jax.lax.dynamic_slice(buffer, start, (*(1,) * len(index), *buffer.shape[len(index):])).reshape(
        buffer.shape[len(index):])


def _put(buffer: jax.Array, index: tuple[jax.Array, ...], value: jax.Array) -> jax.Array:
    """``buffer[index] = value`` for leading indices ``index`` (each in range): in place in a loop."""
    start = (*index, *(0,) * (buffer.ndim - len(index)))
    return jax.lax.dynamic_update_slice(buffer, value.reshape((1,) * len(index) + value.shape).astype(buffer.dtype),
                                        start)


def _index_after(index: jax.Array, seq: jax.Array) -> jax.Array:
    """``index`` unchanged in value, but computed after ``seq`` (exactly zero) exists: reads at it wait
    for ``seq`` without a pass over the values they read."""
    return index + seq.astype(index.dtype)


def _accumulate(g_stage: PyTree, index: tuple[jax.Array, ...], flat: list[jax.Array]) -> PyTree:
    """``g_stage[index] += d`` for every leaf, in place in a loop: ``index`` is ``(chunk,)`` with a
    chunk's gradients or ``(chunk, layer)`` with one layer's (``flat``: in leaf order; ``None``
    leaves that one as it is)."""
    leaves, treedef = jax.tree.flatten(g_stage)
    return treedef.unflatten([g if d is None else _put(g, index, _get(g, index) + d) for g, d in zip(leaves, flat)])


def _chunk(stage_params: PyTree, chunk: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, chunk, keepdims=False), stage_params)


def _token(tree: PyTree) -> jax.Array:
    """``0.0`` as an f32 scalar that *depends on* ``tree`` (one element of its first leaf, made finite,
    times zero). XLA does not fold ``x * 0`` for floating point (NaN semantics), so whatever consumes
    the token is ordered after whatever produced ``tree``; the value is exactly zero (or -0.0)."""
    leaf = jax.tree.leaves(tree)[0]
    # One element by index, not ``ravel(leaf)[0]``: flattening an array split over an auto axis (a
    # sequence-parallel activation) would make the compiler gather all of it first.
    v = leaf[(0,) * leaf.ndim].astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0) * 0.0


def _after(tree: PyTree, seq: jax.Array) -> PyTree:
    """``tree`` unchanged in value (``x + 0.0``), but computed after ``seq`` exists."""
    return jax.tree.map(lambda x: x + seq.astype(x.dtype), tree)


def run_pipeline(
    program: Program,
    fns: StageFunctions,
    stage_params: PyTree,
    shared_params: PyTree,
    tokens: jax.Array,
    *,
    axis: str = "pipe",
    check_vma: bool = True,
    layer_counts: tuple[int, ...] | None = None,
) -> tuple[jax.Array, PyTree, PyTree]:
    """Mean loss over the microbatches and the gradients of it, on this stage.

    Call inside ``shard_map`` manual over ``axis``. ``stage_params`` leaves are this stage's
    ``[chunks, layers_per_chunk, ...]``; ``shared_params`` are replicated over ``axis``;
    ``tokens`` is ``[microbatches, rows, seq + 1]`` (the same on every stage). Returns
    ``(loss, stage_grads, shared_grads)``: the loss and shared gradients are identical on every
    stage (summed over ``axis``), stage gradients are this stage's own.

    ``layer_counts[k]``: an uneven layout's layers of virtual stage ``k`` (``chunk·p + stage``); each
    chunk's ``layers_per_chunk`` slots then hold that many layers and padding, which is skipped
    (needs ``StageFunctions.stage(chunk_params, x, active)``). ``None``: every slot is a layer.
    """
    if program.schedule.forward_only:
        raise ValueError("run_pipeline: a forward-only program computes no gradients; "
                         "use run_pipeline_forward")
    return _run(program, fns, stage_params, shared_params, tokens, axis, check_vma, layer_counts)


def run_pipeline_forward(
    program: Program,
    fns: StageFunctions,
    stage_params: PyTree,
    shared_params: PyTree,
    tokens: jax.Array,
    *,
    axis: str = "pipe",
    check_vma: bool = True,
    layer_counts: tuple[int, ...] | None = None,
) -> jax.Array:
    """Mean loss over the microbatches, computed stage by stage: held-out evaluation with pipe > 1.

    ``program`` must be compiled from :func:`meshtron.pipeline.schedules.forward_only` (a training
    table would idle through its backward ticks and keep its stash for them). Arguments as for
    :func:`run_pipeline`; the layers stay on their stage, only activations move (one forward
    ``ppermute`` per tick that sends), and the loss is identical on every stage after one sum over
    ``axis``.
    """
    if not program.schedule.forward_only:
        raise ValueError(
            f"run_pipeline_forward: needs a forward-only program (schedules.forward_only), got a "
            f"{program.schedule.name!r} training program"
        )
    loss, _, _ = _run(program, fns, stage_params, shared_params, tokens, axis, check_vma, layer_counts)
    return loss


def _run(
    program: Program,
    fns: StageFunctions,
    stage_params: PyTree,
    shared_params: PyTree,
    tokens: jax.Array,
    axis: str,
    check_vma: bool,
    layer_counts: tuple[int, ...] | None = None,
) -> tuple[jax.Array, PyTree | None, PyTree | None]:
    """The tick loop of both entry points. With a forward-only program the backward half (gradient
    buffer, backward message, gradient accumulators) is ``None`` in the carry and never traced, so
    the forward-only step holds no gradient-sized state and runs no ``vjp``."""
    schedule = program.schedule
    train = not schedule.forward_only
    p, m = schedule.stages, schedule.microbatches
    last_virtual = p * schedule.chunks - 1
    stage_index = jax.lax.axis_index(axis)
    inv_m = 1.0 / m
    counts = None if layer_counts is None else jnp.asarray(layer_counts, jnp.int32)

    def active(chunk):
        """Layers the virtual stage of ``chunk`` runs (None: all of its slots)."""
        return None if counts is None else counts[chunk * p + stage_index]

    def run_stage(chunk_params, x, chunk):
        return fns.stage(chunk_params, x) if counts is None else fns.stage(chunk_params, x, active(chunk))

    # Whatever a stage computes varies over every manual axis (its parameters vary over `pipe`, its
    # data over `data`); fresh zeros (idle slots, initial carries) are cast to match.
    manual = tuple(sorted(jax.sharding.get_abstract_mesh().manual_axes)) if check_vma else ()

    def zeros(tree):
        def make(x):
            z = jnp.zeros(x.shape, x.dtype)
            return jax.lax.pcast(z, manual, to="varying") if manual else z

        return jax.tree.map(make, tree)

    if check_vma:
        # Local copies on every stage: differentiating w.r.t. a value replicated over `axis` would
        # make autodiff insert its own psum inside the stage's branch; gradients are summed once below.
        # (Forward-only runs need no copies, but a cast moves no data, so both modes share it.)
        shared_params = jax.lax.pcast(shared_params, axis, to="varying")
    act = jax.eval_shape(fns.embed, shared_params, tokens[0])
    pin = fns.layout
    zeros_act = pin(zeros(act))
    zero_loss = zeros(jax.ShapeDtypeStruct((), jnp.float32))

    def virtual_stage(chunk_params, shared, x_stash, chunk, tok):
        """One virtual stage, (y, loss): the embedding replaces the stashed input on the first virtual
        stage and the head + loss run after the last; the layers are the same code for every kind,
        so each segment compiles them once."""
        virtual = chunk * p + stage_index
        x = pin(jax.lax.cond(virtual == 0, lambda: fns.embed(shared, tok), lambda: x_stash))
        y = pin(run_stage(chunk_params, x, chunk))
        loss = jax.lax.cond(virtual == last_virtual,
                            lambda: fns.loss(shared, y, tok).astype(jnp.float32), lambda: zero_loss)
        return y, loss

    def forward(row, stash, seq):
        chunk = row["fwd_chunk"]
        y, loss = virtual_stage(_chunk(stage_params, chunk), shared_params,
                                pin(_after(_read(stash, row["fwd_slot"]), seq)), chunk, tokens[row["fwd_mb"]])
        return y, loss, seq + _token((y, loss))

    keep = program.keeps_residuals
    layers = (_LayerBackward(program, fns, stage_params, zeros_act, pin, zeros)
              if keep or schedule.split_backward else None)

    def forward_keeping(row, stash, rbuf, seq):
        """The forward when nothing is recomputed: the layers run one by one under ``jax.vjp`` and
        write their residuals (and the chunk output, which the loss's backward needs) straight into
        this microbatch's slot of the residual buffers ``rbuf``, which the branch returns updated."""
        chunk = row["fwd_chunk"]
        tok = tokens[row["fwd_mb"]]
        virtual = chunk * p + stage_index
        x_stash = pin(_after(_read(stash, row["fwd_slot"]), seq))
        x = pin(jax.lax.cond(virtual == 0, lambda: fns.embed(shared_params, tok), lambda: x_stash))
        slot = row["fwd_res_slot"]
        y, stored = layers.forward_into(_chunk(stage_params, chunk), x, active(chunk), rbuf[:-1], slot)
        loss = jax.lax.cond(virtual == last_virtual,
                            lambda: fns.loss(shared_params, y, tok).astype(jnp.float32), lambda: zero_loss)
        return y, loss, [*stored, _put(rbuf[-1], (slot,), y)], seq + _token((y, loss))

    def backward(row, stash, gbuf, g_stage, g_shared, seq):
        """The whole backward of a virtual stage, recomputed from its stashed input; the parameter
        gradients are added to the accumulators ``g_stage`` / ``g_shared`` in the branch."""
        chunk = row["bwd_chunk"]
        tok = tokens[row["bwd_mb"]]
        is_last = chunk * p + stage_index == last_virtual
        x = pin(_after(_read(stash, row["bwd_stash_slot"]), seq))
        _, pullback = jax.vjp(lambda cp, sh, xs: virtual_stage(cp, sh, xs, chunk, tok),
                              _chunk(stage_params, chunk), shared_params, x)
        dy = pin(jnp.where(is_last, zeros_act, _read(gbuf, row["bwd_grad_slot"])))
        d_params, d_shared, d_x = pullback((dy, jnp.where(is_last, zero_loss + inv_m, zero_loss)))
        d_x = pin(d_x)
        g_stage = _accumulate(g_stage, (chunk,), jax.tree.leaves(d_params))
        return d_x, g_stage, jax.tree.map(jnp.add, g_shared, d_shared), seq + _token((d_x, g_stage))

    def backward_by_layer(row, stash, gbuf, rbuf, g_shared, seq, walk):
        """A virtual stage's backward, one layer at a time from stored residuals: the kept ones (this
        microbatch's slot of the residual buffers ``rbuf``, read layer by layer where they are used)
        or, recomputing, those of the chunk's forward rerun from its stashed input. The embedding and
        head + loss gradients are added to ``g_shared`` here; ``walk(chunk_params, residual_of, dy,
        active) -> (dx, buffer)`` walks the layers back, writing what it produces into the buffer it
        carries (the split backward's B: what W will need; the whole pullback: the layers' gradients)."""
        chunk = row["bwd_chunk"]
        tok = tokens[row["bwd_mb"]]
        virtual = chunk * p + stage_index
        is_last = virtual == last_virtual
        chunk_params = _chunk(stage_params, chunk)
        # The stage input matters only to recompute from: the embedding's pullback needs the tokens
        # alone, and the pass-through branch's is the identity, whatever ``x``.
        x = zeros_act if keep else pin(_after(_read(stash, row["bwd_stash_slot"]), seq))
        x0, pull_in = jax.vjp(
            lambda sh, xs: pin(jax.lax.cond(virtual == 0, lambda: fns.embed(sh, tok), lambda: xs)), shared_params, x)
        if keep:
            # The slot index carries the ordering token, so every read of the buffers waits for `seq`
            # without a pass over the values (``_after`` on them would add zero to every element).
            slot = _index_after(row["bwd_res_slot"], seq)
            y = _get(rbuf[-1], (slot,))

            def residual_of(i):
                return [_get(b, (slot, i)) for b in rbuf[:-1]]
        else:
            y, stored = layers.layers_forward(chunk_params, x0, active(chunk))

            def residual_of(i):
                return [jax.lax.dynamic_index_in_dim(s, i, keepdims=False) for s in stored]
        _, pull_out = jax.vjp(lambda sh, yy: jax.lax.cond(
            is_last, lambda: fns.loss(sh, yy, tok).astype(jnp.float32), lambda: zero_loss), shared_params, y)
        d_shared_out, dy_loss = pull_out(jnp.where(is_last, zero_loss + inv_m, zero_loss))
        dy = pin(jnp.where(is_last, dy_loss, _read(gbuf, row["bwd_grad_slot"])))
        dx0, buffer = walk(chunk_params, residual_of, dy, active(chunk))
        d_shared_in, d_x = pull_in(pin(dx0))
        d_x = pin(d_x)
        g_shared = jax.tree.map(lambda g, a, b: g + a + b, g_shared, d_shared_out, d_shared_in)
        return d_x, buffer, g_shared, seq + _token(d_x)

    def backward_input(row, stash, gbuf, rbuf, wbuf, g_stage, g_shared, seq):
        """The split backward's B: input gradient (sent at once) and the embedding/head gradients;
        the layers' weight gradients are left to W, with what they need written into this
        microbatch's slot of the B-to-W buffers ``wbuf`` (and, when the forward keeps residuals,
        partly over residuals of its slot in ``rbuf`` that only B reads); the few layer gradients B
        computes itself (norms) are added to ``g_stage``. Returns ``(dx, wbuf, rbuf, g_stage,
        g_shared, seq)``."""
        slot = row["bwd_weight_slot"]
        chunk = row["bwd_chunk"]
        kept = None if rbuf is None else (rbuf[:-1], _index_after(row["bwd_res_slot"], seq))
        d_x, (wbuf, rlayers, g_stage), g_shared, seq = backward_by_layer(
            row, stash, gbuf, rbuf, g_shared, seq,
            lambda cp, res, dy, act: layers.input_gradient_into(cp, res, dy, act, wbuf, slot, g_stage, chunk, kept))
        return d_x, wbuf, None if rbuf is None else [*rlayers, rbuf[-1]], g_stage, g_shared, seq

    def backward_kept(row, gbuf, rbuf, g_stage, g_shared, seq):
        """The whole backward from kept residuals (no recomputation, not split)."""
        chunk = row["bwd_chunk"]
        return backward_by_layer(row, None, gbuf, rbuf, g_shared, seq,
                                 lambda cp, res, dy, act: layers.backward_into(cp, res, dy, act, g_stage, chunk))

    def weight_gradient(row, wbuf, rbuf, g_stage, seq):
        """The split backward's W: this chunk's layer gradients, from what its B left in ``wbuf``
        (and, when the forward keeps residuals, from this microbatch's residual slot of ``rbuf``),
        added to ``g_stage``."""
        chunk = row["wgt_chunk"]
        kept = None if rbuf is None else (rbuf[:-1], _index_after(row["wgt_res_slot"], seq))
        g_stage = layers.weight_gradient_into(_chunk(stage_params, chunk), wbuf, _index_after(row["wgt_slot"], seq),
                                              active(chunk), g_stage, chunk, kept)
        return g_stage, seq + _token(g_stage)

    def make_tick(seg: _Segment):
        def tick(carry, row_all):
            stash, gbuf, wbuf, rbuf, f_msg, b_msg, g_stage, g_shared, loss_sum, seq = carry
            row = {k: jax.lax.dynamic_index_in_dim(row_all[k], stage_index, keepdims=False) for k in row_all}
            stash = _write(stash, row["recv_fwd_slot"], f_msg)
            # `seq` threads one data dependency through every collective-bearing operation of the
            # tick, in one fixed order (see the module docstring): forward, backward, send forward,
            # send backward, then the next tick.
            seq = seq + _token(f_msg)
            if train:
                gbuf = _write(gbuf, row["recv_bwd_slot"], b_msg)
                seq = seq + _token(b_msg)
            y_out, dx_out = f_msg, b_msg
            # Large state (residual and B-to-W buffers, gradient accumulators) enters a ``cond`` whole
            # and leaves it updated in place: an idle branch returns it as it came. Returning a
            # slot's worth of values instead would make every idle branch materialise zeros of that
            # size and every tick copy them into the buffer.
            if seg.forward and keep:
                y_out, loss, rbuf, seq = jax.lax.cond(
                    row["fwd_mb"] >= 0,
                    lambda: forward_keeping(row, stash, rbuf, seq),
                    lambda: (zeros_act, zero_loss, rbuf, seq),
                )
                loss_sum = loss_sum + loss
            elif seg.forward:
                y_out, loss, seq = jax.lax.cond(
                    row["fwd_mb"] >= 0,
                    lambda: forward(row, stash, seq),
                    lambda: (zeros_act, zero_loss, seq),
                )
                loss_sum = loss_sum + loss
            if seg.backward and not schedule.split_backward:
                dx_out, g_stage, g_shared, seq = jax.lax.cond(
                    row["bwd_mb"] >= 0,
                    (lambda: backward_kept(row, gbuf, rbuf, g_stage, g_shared, seq)) if keep
                    else (lambda: backward(row, stash, gbuf, g_stage, g_shared, seq)),
                    lambda: (zeros_act, g_stage, g_shared, seq),
                )
            elif seg.backward:
                dx_out, wbuf, rbuf, g_stage, g_shared, seq = jax.lax.cond(
                    row["bwd_mb"] >= 0,
                    lambda: backward_input(row, stash, gbuf, rbuf, wbuf, g_stage, g_shared, seq),
                    lambda: (zeros_act, wbuf, rbuf, g_stage, g_shared, seq),
                )
            if seg.weight:
                g_stage, seq = jax.lax.cond(
                    row["wgt_mb"] >= 0,
                    lambda: weight_gradient(row, wbuf, rbuf, g_stage, seq),
                    lambda: (g_stage, seq),
                )
            if seg.send_forward:
                f_msg = pin(jax.lax.ppermute(pin(_after(y_out, seq)), axis, [(i, (i + 1) % p) for i in range(p)]))
                seq = seq + _token(f_msg)
            if seg.send_backward:
                b_msg = pin(jax.lax.ppermute(pin(_after(dx_out, seq)), axis, [(i, (i - 1) % p) for i in range(p)]))
            return (stash, gbuf, wbuf, rbuf, f_msg, b_msg, g_stage, g_shared, loss_sum, seq), None

        return tick

    def buffer(slots: int) -> jax.Array:
        return zeros(jax.ShapeDtypeStruct((max(slots, 1), *act.shape), act.dtype))

    def filled(buffers: list[jax.Array]) -> list[jax.Array]:
        """The loop's large buffers, each zero-filled on its own. XLA treats ``jnp.zeros`` of equal
        shapes as one value, materialises it once and copies it into every buffer of the loop: two
        passes over each. A zero it cannot prove equal to another (``(stage + k) * 0.0``, which it
        does not fold for floating point) gives each buffer a single fill of its own."""
        base = stage_index.astype(jnp.float32)
        return [b + ((base + k) * 0.0).astype(b.dtype) for k, b in enumerate(buffers)]

    carry = (
        buffer(program.stash_slots),
        buffer(program.grad_slots) if train else None,
        filled(layers.buffers(program.weight_slots)) if schedule.split_backward else None,
        filled(layers.residual_buffers(program.residual_slots)) if keep else None,
        zeros_act,
        zeros_act if train else None,
        zeros(stage_params) if train else None,
        zeros(shared_params) if train else None,
        zero_loss,
        zero_loss,
    )
    fields = _ROW_FIELDS if train else _FORWARD_FIELDS
    rows = {name: np.asarray(getattr(program, name), np.int32) for name in fields}
    for seg in segments(program):
        xs = {name: jnp.asarray(arr[seg.start : seg.stop]) for name, arr in rows.items()}
        carry, _ = jax.lax.scan(make_tick(seg), carry, xs)
    *_, f_msg, b_msg, g_stage, g_shared, loss_sum, seq = carry
    # The loss lives on the last stage and the shared gradients on the first and last: one sum of
    # both, after everything the loop ran (the last messages included).
    seq = seq + _token(f_msg)
    if train:
        seq = seq + _token(b_msg) + _token(g_stage)
    loss, g_shared = jax.lax.psum(_after((loss_sum * inv_m, g_shared), seq), axis)
    return loss, g_stage, g_shared


class _LayerBackward:
    """A stage's backward taken one layer at a time, from each layer's ``jax.vjp`` residuals.

    Used by split-backward (zero-bubble) schedules and whenever the forward keeps its residuals
    instead of recomputing. Built once per program from the first layer of chunk 0 (every layer of
    a uniform stack has the same pullback): ``layers_forward`` runs a chunk keeping each layer's
    residuals as its outputs (the recomputing B); ``forward_into`` writes them into a slot of the
    residual buffers instead; ``backward_into`` walks the layers back through their whole
    pullbacks, adding each layer's parameter gradients to the accumulator it carries;
    ``input_gradient_into`` computes only the input gradient and writes per layer what the weight
    gradient will need into a slot of the B-to-W buffers, from which ``weight_gradient_into``
    computes the weight gradients, in any later tick. Every buffer is carried through the layer
    loop and updated in place, one layer's slice at a time.
    """

    def __init__(self, program: Program, fns: StageFunctions, stage_params: PyTree, example_x: jax.Array,
                 pin: Callable[[jax.Array], jax.Array], zeros: Callable[[PyTree], PyTree]):
        if fns.layer is None:
            why = ("splits the backward per layer" if program.schedule.split_backward
                   else "keeps each layer's residuals (no recomputation)")
            raise ValueError(f"schedule {program.schedule.name!r} {why}: "
                             "StageFunctions.layer (one layer of a chunk) is required")
        self._layer, self._pin, self._zeros = fns.layer, pin, zeros
        if program.keeps_residuals:
            # What a layer keeps from its forward to its backward: the matmul outputs. Everything
            # elementwise (norms, GELU/SiLU, softmax) is recomputed from them in the backward, as XLA
            # does when a forward and its backward are one program: jax.vjp's own residuals keep every
            # intermediate (GELU's tanh pieces, ...), 4x the bytes, and moving those through the
            # residual buffers costs more time than recomputing them.
            self._layer = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.dots_saveable)
        first = jax.tree.map(lambda a: a[0, 0], stage_params)  # chunk 0, layer 0
        self._layers = jax.tree.leaves(stage_params)[0].shape[1]
        self._example_x = jax.ShapeDtypeStruct(example_x.shape, example_x.dtype)
        y, stored, treedef, self._slots = residuals(self._layer, first, example_x)
        self._stored_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stored]
        # Kept residuals live until W (the program frees their slot there), so W reads them rather
        # than B storing the activations W multiplies a second time: B leaves W only what depends on
        # the cotangent (GPT: 9 of the 26 s·b·h per layer it stored before).
        # On CPU, W's matmuls (and the same matmuls in an unsplit backward from kept residuals) get
        # operands XLA's fast GEMM accepts (W 15% faster at width 256) and produce the gradient in
        # the weight's own layout where that copies less (16% more at width 256, 43% at 1024); GPU
        # GEMMs read transposed operands as they are, so elsewhere the pullback is JAX's own.
        self._pullback = SplitPullback(treedef, self._slots, stored, jax.tree.leaves(first), y,
                                       weight_reads_residuals=program.keeps_residuals,
                                       contiguous_weight_matmuls=jax.default_backend() == "cpu")
        # A boundary value with a home (a residual of its shape that only B reads) is written over
        # that residual in the microbatch's residual slot, which lives until W anyway; the B-to-W
        # buffers hold the others. GPT: the QKV cotangent takes the QKV output's place (9 -> 6 s·b·h).
        self._homes = self._pullback.boundary_homes
        # Parameter gradients B computes itself (a norm's scale and bias) go to the
        # accumulator at B, not through the B-to-W buffers.
        self._at_b = self._pullback.boundary_gradients
        self._to_w = [k for k, (home, g) in enumerate(zip(self._homes, self._at_b))
                      if home is None and g is None]  # boundary index per B-to-W buffer

    def _residuals(self, layer_params: PyTree, x: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        y, stored, _, slots = residuals(self._layer, layer_params, x)
        if slots != self._slots:  # a layer whose pullback differs from the first one's
            raise ValueError("split backward: the layers of a chunk must share one structure "
                             f"(residuals that are parameters: {slots} vs {self._slots})")
        return self._pin(y), stored

    def _scan(self, step, init, xs, active, skip, reverse=False):
        """``lax.scan(step, init, xs)`` over a chunk's layer slots; with ``active``, slots from
        ``active`` on (an uneven chunk's padding) run ``skip`` instead, which passes the carry
        through and outputs zeros."""
        if active is None:
            return jax.lax.scan(step, init, xs, reverse=reverse)
        layers = jax.tree.leaves(xs)[0].shape[0]

        def maybe(carry, indexed):
            i, x = indexed
            return jax.lax.cond(i < active, lambda: step(carry, x), lambda: skip(carry, x))

        return jax.lax.scan(maybe, init, (jnp.arange(layers), xs), reverse=reverse)

    def layers_forward(self, chunk_params: PyTree, x: jax.Array,
                       active: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array]]:
        return self._scan(lambda h, lp: self._residuals(lp, h), x, chunk_params, active,
                          lambda h, lp: (h, self._zeros(self._stored_avals)))

    def _walk(self, step, carry, chunk_params: PyTree, active: jax.Array | None, reverse: bool = False):
        """``carry = step(carry, i, layer_params)`` for each layer slot ``i`` of a chunk (the last first
        with ``reverse``); with ``active``, slots from ``active`` on (an uneven chunk's padding) are
        skipped. What a layer produces goes into buffers the carry holds, so a skipped slot costs
        nothing (no zeros to output)."""
        def body(c, xs):
            i, lp = xs
            if active is None:
                return step(c, i, lp), None
            return jax.lax.cond(i < active, lambda: step(c, i, lp), lambda: c), None

        return jax.lax.scan(body, carry, (jnp.arange(self._layers), chunk_params), reverse=reverse)[0]

    def forward_into(self, chunk_params: PyTree, x: jax.Array, active: jax.Array | None,
                     buffers: list[jax.Array], slot: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """The chunk's forward, each layer's residuals written to ``buffers[j][slot, layer]``."""
        def step(c, i, lp):
            h, bufs = c
            y, stored = self._residuals(lp, h)
            return y, [_put(b, (slot, i), v) for b, v in zip(bufs, stored)]

        return self._walk(step, (x, list(buffers)), chunk_params, active)

    def backward_into(self, chunk_params: PyTree, residual_of: Callable[[jax.Array], list[jax.Array]],
                      dy: jax.Array, active: jax.Array | None, g_stage: PyTree,
                      chunk: jax.Array) -> tuple[jax.Array, PyTree]:
        """The layers' whole pullbacks, last layer first, from ``residual_of(layer)``: the input
        gradient, and each layer's parameter gradients added to ``g_stage[chunk, layer]``."""
        def step(c, i, lp):
            d, g = c
            flat, dx = self._pullback.pullback(residual_of(i), jax.tree.leaves(lp), d)
            return self._pin(dx), _accumulate(g, (chunk, i), flat)

        return self._walk(step, (dy, g_stage), chunk_params, active, reverse=True)

    def input_gradient_into(self, chunk_params: PyTree, residual_of: Callable[[jax.Array], list[jax.Array]],
                            dy: jax.Array, active: jax.Array | None, buffers: list[jax.Array], slot: jax.Array,
                            g_stage: PyTree, chunk: jax.Array,
                            kept: tuple[list[jax.Array], jax.Array] | None = None,
                            ) -> tuple[jax.Array, tuple[list[jax.Array], list[jax.Array], PyTree]]:
        """B: the input gradient, last layer first; what each layer's weight gradient will need is
        written to ``buffers[j][slot, layer]``, and the parameter gradients B computes itself are
        added to ``g_stage[chunk, layer]``. With ``kept = (residual_buffers, residual_slot)`` the
        residuals are read from those buffers, which the walk carries, and the boundary values that
        have a home there are written over it (see ``__init__``). Returns ``(dx, (buffers,
        residual_buffers, g_stage))`` updated."""
        def step(c, i, lp):
            d, bufs, rbufs, g = c
            res = residual_of(i) if kept is None else [_get(b, (kept[1], i)) for b in rbufs]
            dx, boundary = self._pullback.input_gradient(res, jax.tree.leaves(lp), d)
            if kept is not None:
                rbufs = list(rbufs)
                for value, home in zip(boundary, self._homes):
                    if home is not None:
                        rbufs[home] = _put(rbufs[home], (kept[1], i), value)
            at_b = [None] * len(jax.tree.leaves(g))
            for value, k in zip(boundary, self._at_b):
                if k is not None:
                    at_b[k] = value
            if any(v is not None for v in at_b):
                g = _accumulate(g, (chunk, i), at_b)
            return self._pin(dx), [_put(b, (slot, i), boundary[k]) for b, k in zip(bufs, self._to_w)], rbufs, g

        dx, bufs, rbufs, g_stage = self._walk(
            step, (dy, list(buffers), [] if kept is None else list(kept[0]), g_stage), chunk_params, active,
            reverse=True)
        return dx, (bufs, rbufs, g_stage)

    def weight_gradient_into(self, chunk_params: PyTree, buffers: list[jax.Array], slot: jax.Array,
                             active: jax.Array | None, g_stage: PyTree, chunk: jax.Array,
                             kept: tuple[list[jax.Array], jax.Array] | None = None) -> PyTree:
        """W: each layer's parameter gradients from what its B left in ``buffers[j][slot, layer]``
        (and, ``kept = (residual_buffers, residual_slot)``, from the forward's residuals), added to
        ``g_stage[chunk, layer]``."""
        def step(g, i, lp):
            res = None if kept is None else [_get(b, (kept[1], i)) for b in kept[0]]
            boundary: list = [None] * len(self._homes)  # None: a gradient B has accumulated
            for b, k in zip(buffers, self._to_w):
                boundary[k] = _get(b, (slot, i))
            for k, home in enumerate(self._homes):
                if home is not None:
                    boundary[k] = res[home]
            flat = self._pullback.weight_gradient(jax.tree.leaves(lp), boundary, res)
            return _accumulate(g, (chunk, i), flat)

        return self._walk(step, g_stage, chunk_params, active)

    def _stacked(self, avals: list, slots: int | None) -> list[jax.ShapeDtypeStruct]:
        lead = (self._layers,) if slots is None else (max(slots, 1), self._layers)
        return [jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype) for a in avals]

    def _kept(self, slots: int | None) -> list[jax.ShapeDtypeStruct]:
        """Every layer's residuals, then the chunk's output (the head's input on the last stage)."""
        lead = () if slots is None else (max(slots, 1),)
        x = self._example_x
        return [*self._stacked(self._stored_avals, slots), jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype)]

    def buffers(self, slots: int) -> list[jax.Array]:
        """The B-to-W buffers: ``slots`` chunks' boundary values per stage (those without a home in
        the residual slot)."""
        avals = self._pullback.boundary_avals
        return self._zeros(self._stacked([avals[k] for k in self._to_w], slots))

    def residual_buffers(self, slots: int) -> list[jax.Array]:
        """The forward-to-backward buffers when nothing is recomputed: ``slots`` chunks' residuals."""
        return self._zeros(self._kept(slots))
