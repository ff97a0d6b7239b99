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
  the backward run the layers' pullbacks from them. Where the program hoists a backward's
  recomputation (``bwd_pre_slot``), the stage reruns its forward in the tick before, after that
  tick's forward, keeping the layers' residuals in a recompute slot, and the backward runs the
  pullbacks from them: a forward-only tick then costs the rerun, a backward-only tick no longer does.
* a split backward (zero bubble) runs B, the input gradient, in the backward slot, and W, the
  weight gradient, in a weight slot of the same or a later tick, from what B left in a buffer
  (and, when the forward keeps residuals, from them: their slot then lives until W, and B leaves
  only what depends on the output gradient, part of it written over residuals only B reads).
* an uneven ``parallel.layout`` pads every chunk to the largest; a chunk runs its own number of
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
    messages received -> the forward ``cond`` -> the hoisted recomputation's ``cond`` -> the
    backward ``cond`` -> the forward send -> the backward send -> the next tick; after the loop,
    the one reduction over ``axis``.

The chain is a scalar ``seq``, always exactly zero, that each step reads (``x + seq``) and extends with a
token of its own output (one element times zero, which XLA cannot fold for floating point). An
activation's token is read from each device's own shard (:func:`~meshtron.pipeline.buffers.local_token`):
reading one element of a sequence-parallel activation would be an all-reduce outside the chain. Inside
a backward, the layers read what they recompute from (the inputs ``model.remat=full`` keeps) after the
head's gradient, so a layer rerun with its collectives (tensor all-reduces, a mixture of experts'
all-to-alls over ``data``) follows the head's ``cond`` instead of racing it.
Collectives *inside* a ``cond`` are the tensor all-reduces of that stage, whose devices all take
the same branch. :func:`meshtron.hlo.order.unordered_collectives` checks the rule on the
optimized HLO of every compiled step (tests/test_deadlock.py); a stress test runs schedules x
meshes under a timeout.

**Early sends** (``PipelinePlan.early_sends``: GPU runs with ``gpu.overlap=on``). XLA:GPU issues a
computation's instructions one after another in its schedule order, ``conditional`` s included, the
same on every device, so there the sends need no data dependency on the ``cond`` s around them. A
tick then sends the last tick's input gradient (kept in ``TickState.b_out``) first, the forward ``cond``
runs while it is in flight, the message lands in its gradient slot before the backward ``cond`` reads
it, the forward's activation is sent next and the backward (B and W) runs while it is in flight; it
joins ``seq`` at the end of the tick. Each message joins ``seq`` before the next send: one send in
flight at a time, the two never overlapping each other (their pairs share two devices). A segment that
sends no input gradient gets the last one of the segment before between the ``scan`` s. The rule
checked then is :func:`~meshtron.hlo.order.unordered_collectives` with ``in_schedule_order=True``:
nothing that runs collectives under a send in flight shares more than one device with it.

**Held-out evaluation** (:func:`run_pipeline_forward`) runs a forward-only program
(:func:`meshtron.pipeline.schedules.forward_only`) through the same tick loop with the backward half
switched off: no gradient buffer, no ``vjp``, no backward ``ppermute``, the same ``seq`` chain.
Evaluating with the unpipelined model instead would gather every pipe-sharded layer onto every
device.

**Prepared once per step.** What a stage's layers would compute from their parameters again in every
forward, recomputation and W pass (a model's FP8 weights, quantized) the model may compute once, before
the loop (``StageFunctions.prepare``); every tick reads it, the ordering token starts after it (its
collectives -- a scale's maximum over a split weight -- come first), and nothing differentiates it.

The runtime knows nothing about GPT: the model enters as three functions (:class:`StageFunctions`).
The tick loop is :class:`_TickLoop`: one object per traced step holding what every tick reads (the
program, the stage's parameters, the microbatches), whose methods are the stage's bodies (forward,
backward, B, W) and whose carry is a :class:`TickState`; the layer-by-layer backward is
:mod:`meshtron.pipeline.layer_backward`, the buffers and the ordering token
:mod:`meshtron.pipeline.buffers`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec

from meshtron.pipeline.buffers import (
    accumulate,
    after,
    chunk_of,
    get,
    index_after,
    local_token,
    put,
    read_slot,
    token,
    write_slot,
)
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.layer_backward import LayerBackward
from meshtron.pipeline.program import Program
from meshtron.pipeline.stage import PyTree, StageFunctions
from meshtron.sharding import varying_like

__all__ = ["StageFunctions", "TickState", "exact_segments", "run_pipeline", "run_pipeline_forward", "segments"]

# The frontend attribute that asks XLA:GPU to run a collective on its point-to-point stream, apart from the
# stream of the other collectives (XLA's ``kCollectiveStreamAttrName``/``kCollectiveStreamP2P``).
P2P_STREAM = {"_xla_gpu_collective_stream": "p2p"}

_FORWARD_FIELDS = ("fwd_mb", "fwd_chunk", "fwd_slot", "recv_fwd_slot")
_ROW_FIELDS = (*_FORWARD_FIELDS, "bwd_mb", "bwd_chunk", "bwd_stash_slot", "bwd_grad_slot", "recv_bwd_slot",
               "bwd_weight_slot", "wgt_mb", "wgt_chunk", "wgt_slot", "fwd_res_slot", "bwd_res_slot",
               "wgt_res_slot", "pre_mb", "pre_chunk", "pre_stash_slot", "pre_res_slot", "bwd_pre_slot",
               "wgt_stash_slot")


@dataclass(frozen=True)
class _Segment:
    start: int
    stop: int
    forward: bool
    backward: bool
    send_forward: bool
    send_backward: bool
    weight: bool = False
    recompute: bool = False  # a stage reruns a forward for next tick's backward (hoisted recomputation)
    backward_kept: bool = False  # a backward reads a hoisted rerun's residuals
    backward_recomputes: bool = True  # a backward recomputes its stage itself


def exact_segments(program: Program) -> list[_Segment]:
    """Maximal runs of ticks with the same static work/communication pattern."""
    fwd = (program.fwd_mb >= 0).any(axis=1)
    bwd = (program.bwd_mb >= 0).any(axis=1)
    send_f = (program.fwd_send > 0).any(axis=1)
    send_b = (program.bwd_send > 0).any(axis=1)
    wgt = (program.wgt_mb >= 0).any(axis=1)
    pre = (program.pre_mb >= 0).any(axis=1)
    kept = (program.bwd_pre_slot >= 0).any(axis=1)
    recomputes = ((program.bwd_mb >= 0) & (program.bwd_pre_slot < 0)).any(axis=1)
    keys = list(zip(fwd, bwd, send_f, send_b, wgt, pre, kept, recomputes))
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
                    a.send_forward or b.send_forward, a.send_backward or b.send_backward, a.weight or b.weight,
                    a.recompute or b.recompute, a.backward_kept or b.backward_kept,
                    a.backward_recomputes or b.backward_recomputes)


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


def _after_residuals(pullback, seq: jax.Array, params: PyTree):
    """``pullback`` whose floating residuals (a ``jax.vjp`` pullback is a pytree of them) are computed
    after ``seq``; the parameters among them are left as they are (no copy)."""
    held = {id(p) for p in jax.tree.leaves(params)}
    leaves, treedef = jax.tree.flatten(pullback)
    return treedef.unflatten([r if id(r) in held or not jnp.issubdtype(r.dtype, jnp.floating) else after(r, seq)
                              for r in leaves])


def run_pipeline(
    plan: PipelinePlan,
    fns: StageFunctions,
    stage_params: PyTree,
    shared_params: PyTree,
    tokens: jax.Array,
    *,
    axis: str = "pipe",
) -> tuple[jax.Array, PyTree, PyTree]:
    """Mean loss over the microbatches and the gradients of it, on this stage.

    Call inside ``shard_map`` manual over ``axis``. ``stage_params`` leaves are this stage's
    ``[chunks, layers_per_chunk, ...]``; ``shared_params`` are replicated over ``axis``;
    ``tokens`` is ``[microbatches, rows, seq + 1]`` (the same on every stage). Returns
    ``(loss, stage_grads, shared_grads)``: the loss and shared gradients are identical on every
    stage (summed over ``axis``), stage gradients are this stage's own.

    ``plan.layer_counts[k]``: an uneven layout's layers of virtual stage ``k`` (``chunk·p + stage``); each
    chunk's ``layers_per_chunk`` slots then hold that many layers and padding, which is skipped
    (needs ``StageFunctions.stage(chunk_params, x, tokens, active)``). ``None``: every slot is a layer.

    ``plan.lockstep``: every stage runs the forward, backward and W work of every tick, idle or not, and
    keeps the result only where its instruction says so -- for stage code with collectives that must
    be entered by every device of the mesh at once (a ring attention's collective-permutes, which
    XLA rendezvous over all devices): idle ticks then compute and discard instead of skipping.
    """
    if plan.program.schedule.forward_only:
        raise ValueError("run_pipeline: a forward-only program computes no gradients; "
                         "use run_pipeline_forward")
    return _TickLoop(plan, fns, stage_params, shared_params, tokens, axis).run()


def run_pipeline_forward(
    plan: PipelinePlan,
    fns: StageFunctions,
    stage_params: PyTree,
    shared_params: PyTree,
    tokens: jax.Array,
    *,
    axis: str = "pipe",
    reports: bool = False,
    per_row: bool = False,
    row_shape: tuple[int, ...] = (),
) -> jax.Array | tuple[jax.Array, PyTree]:
    """Mean loss over the microbatches, computed stage by stage: held-out evaluation with pipe > 1.

    ``plan.program`` must be compiled from :func:`meshtron.pipeline.schedules.forward_only` (a training
    table would idle through its backward ticks and keep its stash for them). Arguments as for
    :func:`run_pipeline`; the layers stay on their stage, only activations move (one forward
    ``ppermute`` per tick that sends), and the loss is identical on every stage after one sum over
    ``axis``.

    ``reports=True`` (needs ``StageFunctions.reporting_stage``) returns ``(loss, reports)``: what this
    stage's layers reported, summed over the microbatches, stacked ``[chunks, layers_per_chunk, ...]``
    like ``stage_params`` (zeros in an uneven layout's padding slots).

    ``per_row=True``: ``fns.loss`` returns values per row of its microbatch (``[rows, *row_shape]``: DPO's
    summed answer log-probabilities, or of packed pairs one per document), and the result is those of every
    microbatch, ``[microbatches, rows, *row_shape]``, from the last stage (summed over ``axis``, where the
    other stages hold zeros) instead of a mean.
    """
    if not plan.program.schedule.forward_only:
        raise ValueError(
            f"run_pipeline_forward: needs a forward-only program (schedules.forward_only), got a "
            f"{plan.program.schedule.name!r} training program"
        )
    if reports and fns.reporting_stage is None:
        raise ValueError("run_pipeline_forward: reports=True needs StageFunctions.reporting_stage")
    loop = _TickLoop(plan, fns, stage_params, shared_params, tokens, axis, collect=reports, per_row=per_row,
                     row_shape=row_shape)
    loss, _, _ = loop.run()
    return (loss, loop.reports) if reports else loss


class TickState(NamedTuple):
    """What the tick loop carries from one tick to the next (``None``: a part the program does not use --
    a forward-only program has no backward half, only a split backward has B-to-W buffers, only a
    program that keeps residuals has residual buffers)."""

    stash: jax.Array  # activations received from the previous stage, by stash slot
    grads: jax.Array | None  # output gradients received from the next stage, by gradient slot
    weight_buffers: list[jax.Array] | None  # split backward: what each B left its W, by weight slot
    residuals: list[jax.Array] | None  # kept residuals (and the chunk output), by residual slot
    f_msg: jax.Array  # the activation sent forward at the end of the last tick
    b_msg: jax.Array | None  # the input gradient sent backward at the end of the last tick
    g_stage: PyTree | None  # this stage's parameter gradients, accumulated
    g_shared: PyTree | None  # the shared (embedding, head) parameter gradients, accumulated
    loss_sum: jax.Array
    seq: jax.Array  # the ordering token: exactly zero, threaded through every collective-bearing operation
    reports: PyTree | None = None  # forward-only with reports: what each chunk's layers reported, summed
    recomputed: list[jax.Array] | None = None  # hoisted recomputation: a rerun's residuals, by recompute slot
    b_out: jax.Array | None = None  # early sends: the input gradient of the last tick, sent at the next tick's start


class _TickLoop:
    """The tick loop of both entry points, for one stage (the device this is traced for). With a
    forward-only program the backward half (gradient buffer, backward message, gradient
    accumulators) is ``None`` in the state and never traced, so the forward-only step holds no
    gradient-sized state and runs no ``vjp``."""

    def __init__(self, plan: PipelinePlan, fns: StageFunctions, stage_params: PyTree, shared_params: PyTree,
                 tokens: jax.Array, axis: str, collect: bool = False, per_row: bool = False,
                 row_shape: tuple[int, ...] = ()):
        program, check_vma, layer_counts = plan.program, plan.check_vma, plan.layer_counts
        schedule = program.schedule
        self.lockstep = plan.lockstep
        self.early_sends = plan.early_sends
        self.collect = collect
        self.reports: PyTree | None = None  # after run(), with collect: the summed reports
        self.program, self.fns, self.tokens, self.axis = program, fns, tokens, axis
        self.schedule = schedule
        self.train = not schedule.forward_only
        self.p = schedule.stages
        self.last_virtual = self.p * schedule.chunks - 1
        self.stage_index = jax.lax.axis_index(axis)
        self.inv_m = 1.0 / schedule.microbatches
        self.counts = None if layer_counts is None else jnp.asarray(layer_counts, jnp.int32)
        # Whatever a stage computes varies over the manual axes its inputs vary over (its parameters over
        # `pipe` and `data`, its tokens over `data`, and `context` when the sequence is split); fresh
        # zeros (idle slots, initial carries) are typed to match: a zero scalar that varies like both.
        self.varies = None
        if check_vma:
            first = jax.tree.leaves(stage_params)[0]
            self.varies = varying_like(varying_like(jnp.zeros((), jnp.float32), tokens), first)
        if check_vma:
            # Local copies on every stage: differentiating w.r.t. a value replicated over `axis` would
            # make autodiff insert its own psum inside the stage's branch; gradients are summed once below.
            # (Forward-only runs need no copies, but a cast moves no data, so both modes share it.)
            shared_params = jax.lax.pcast(shared_params, axis, to="varying")
        self.stage_params, self.shared_params = stage_params, shared_params
        self.act = jax.eval_shape(fns.embed, shared_params, tokens[0])
        self.pin = fns.layout
        spec = None if fns.activation_spec is None else fns.activation_spec()
        self.token = lambda x: local_token(x, spec)  # an activation's, from each device's own shard
        self.chunk_specs = None if fns.chunk_specs is None else jax.tree.leaves(
            fns.chunk_specs(), is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.zeros_act = self.pin(self.zeros(self.act))
        self.zero_loss = self.zeros(jax.ShapeDtypeStruct((), jnp.float32))
        # What the last stage computes of a microbatch: its loss, or (per_row) one value per row; summed over
        # the microbatches, or (per_row) kept by microbatch.
        self.per_row = per_row
        self.zero_head = (self.zeros(jax.ShapeDtypeStruct((tokens.shape[1], *row_shape), jnp.float32)) if per_row
                          else self.zero_loss)
        self.keep = program.keeps_residuals
        self.hoist = program.hoists_recompute
        # The example microbatch's tokens vary like those a tick reads (picked by the stage's own row).
        example_tokens = tokens[0] if self.varies is None else varying_like(tokens[0], self.varies)
        # What the model prepares once per step (its FP8 weights quantized): every forward, recomputation and
        # W pass of the step (of a held-out evaluation: every microbatch's forward) reads it, none computes it again.
        self.weights = (fns.prepare(stage_params, self.zeros_act, example_tokens)
                        if fns.prepare is not None else None)
        self.layers = (LayerBackward(program, fns, stage_params, self.zeros_act, example_tokens, self.pin, self.zeros,
                                     self.weights)
                       if self.keep or self.hoist or schedule.split_backward else None)

    def gradients_token(self, grads: PyTree, stacked: bool = False) -> jax.Array:
        """A token of every leaf of a chunk's parameter gradients (``stacked``: the stage's gradient
        accumulators, one more leading axis for the chunks), each from its own shard: what follows
        it waits for all of them, the collectives that made them included (under sequence parallelism
        a norm's scale gradient is an all-reduce over ``tensor`` that nothing else reads). Zero
        without the specs (nothing is ordered)."""
        if self.chunk_specs is None:
            return self.zero_loss
        specs = [PartitionSpec(None, *spec) if stacked else spec for spec in self.chunk_specs]
        leaves = jax.tree.leaves(grads)
        return sum((local_token(g, spec) for g, spec in zip(leaves, specs, strict=True)), self.zero_loss)

    def zeros(self, tree: PyTree) -> PyTree:
        def make(x):
            z = jnp.zeros(x.shape, x.dtype)
            return z if self.varies is None else varying_like(z, self.varies)

        return jax.tree.map(make, tree)

    def active(self, chunk):
        """Layers the virtual stage of ``chunk`` runs (None: all of its slots)."""
        return None if self.counts is None else self.counts[chunk * self.p + self.stage_index]

    def run_stage(self, chunk_params, x, chunk, tok, stage=None):
        """The layers of ``chunk`` on ``x``, for the microbatch whose tokens are ``tok``."""
        stage = stage or self.fns.stage
        if self.weights is not None and stage is self.fns.stage:
            return stage(chunk_params, x, tok, self.active(chunk), chunk_of(self.weights, chunk))
        return stage(chunk_params, x, tok) if self.counts is None else stage(chunk_params, x, tok, self.active(chunk))

    # ---- the stage's bodies: forward, backward (whole, or B and W) ------------------------------

    def virtual_stage(self, chunk_params, shared, x_stash, chunk, tok, reporting: bool = False):
        """One virtual stage, (y, loss, reports): the embedding replaces the stashed input on the first
        virtual stage and the head + loss run after the last; the layers are the same code for every
        kind, so each segment compiles them once. ``reporting``: the layers run as
        ``reporting_stage`` and ``reports`` is what they reported (else None)."""
        fns, pin = self.fns, self.pin
        virtual = chunk * self.p + self.stage_index
        x = pin(jax.lax.cond(virtual == 0, lambda: fns.embed(shared, tok), lambda: x_stash))
        if reporting:
            y, found = self.run_stage(chunk_params, x, chunk, tok, fns.reporting_stage)
        else:
            y, found = self.run_stage(chunk_params, x, chunk, tok), None
        y = pin(y)
        loss = jax.lax.cond(virtual == self.last_virtual,
                            lambda: fns.loss(shared, y, tok).astype(jnp.float32), lambda: self.zero_head)
        return y, loss, found

    def forward(self, row, stash, seq, reports=None):
        """A forward: ``(y, loss, reports, seq)``. ``reports``: None, or the accumulators ``[chunks,
        layers_per_chunk, ...]`` of a forward-only program that collects them, returned with what this
        chunk's layers reported added in place."""
        chunk = row["fwd_chunk"]
        y, loss, found = self.virtual_stage(chunk_of(self.stage_params, chunk), self.shared_params,
                                            self.pin(after(read_slot(stash, row["fwd_slot"]), seq)), chunk,
                                            self.tokens[row["fwd_mb"]], reporting=reports is not None)
        if reports is not None:
            reports = accumulate(reports, (chunk,), jax.tree.leaves(found))
        return y, loss, reports, seq + token(loss) + self.token(y)

    def forward_keeping(self, row, stash, rbuf, seq):
        """The forward when nothing is recomputed: the layers run one by one under ``jax.vjp`` and
        write their residuals (and the chunk output, which the loss's backward needs) straight into
        this microbatch's slot of the residual buffers ``rbuf``, which the branch returns updated."""
        chunk = row["fwd_chunk"]
        tok = self.tokens[row["fwd_mb"]]
        y, rbuf = self.layers_into(chunk, tok, self.stage_input(chunk, tok, stash, row["fwd_slot"], seq), rbuf,
                                   row["fwd_res_slot"])
        loss = jax.lax.cond(chunk * self.p + self.stage_index == self.last_virtual,
                            lambda: self.fns.loss(self.shared_params, y, tok).astype(jnp.float32),
                            lambda: self.zero_head)
        return y, loss, rbuf, seq + token(loss) + self.token(y)

    def stage_input(self, chunk, tok, stash, stash_slot, seq):
        """A virtual stage's input: ``tok``'s embedding on the first virtual stage, else the stashed
        activation at ``stash_slot`` (read after ``seq``)."""
        x_stash = self.pin(after(read_slot(stash, stash_slot), seq))
        return self.pin(jax.lax.cond(chunk * self.p + self.stage_index == 0,
                                     lambda: self.fns.embed(self.shared_params, tok), lambda: x_stash))

    def layers_into(self, chunk, tok, x, buffers, slot):
        """The chunk's layers on ``x``, their residuals and the chunk output written into ``slot`` of the
        residual buffers ``buffers``: ``(y, buffers updated)``."""
        y, stored = self.layers.forward_into(chunk_of(self.stage_params, chunk), x, tok, self.active(chunk),
                                             buffers[:-1], slot, chunk)
        return y, [*stored, put(buffers[-1], (slot,), y)]

    def recompute_keeping(self, row, stash, hbuf, seq):
        """A hoisted recomputation: the stage forward of the microbatch whose backward runs next tick,
        rerun from its stashed input (or its tokens' embedding), its layers' residuals and output written
        into its slot of the recompute buffers ``hbuf``, which the branch returns updated."""
        chunk = row["pre_chunk"]
        tok = self.tokens[row["pre_mb"]]
        y, hbuf = self.layers_into(chunk, tok, self.stage_input(chunk, tok, stash, row["pre_stash_slot"], seq), hbuf,
                                   row["pre_res_slot"])
        return hbuf, seq + self.token(y)

    def backward_recomputed(self, row, gbuf, hbuf, g_stage, g_shared, seq):
        """The whole backward from the residuals a hoisted recomputation kept in ``hbuf`` last tick."""
        chunk = row["bwd_chunk"]
        return self.backward_by_layer(
            {**row, "bwd_res_slot": row["bwd_pre_slot"]}, None, gbuf, hbuf, g_shared, seq,
            lambda cp, res, dy, act: self.layers.backward_into(cp, res, dy, act, g_stage, chunk), keep=True)

    def embedding_vjp(self, virtual, tok, x):
        """The first virtual stage's input and its pullback: the embedding of ``tok`` there, ``x`` elsewhere."""
        fns, pin = self.fns, self.pin
        return jax.vjp(lambda sh, xs: pin(jax.lax.cond(virtual == 0, lambda: fns.embed(sh, tok), lambda: xs)),
                       self.shared_params, x)

    def head_gradient(self, row, gbuf, is_last, tok, y):
        """``(d_shared, dy)``: the head + loss gradients of the last virtual stage (seeded with ``1/m``) and
        the gradient at the layers' output ``y`` -- from the loss there, received from the next stage
        elsewhere."""
        fns, zero_loss = self.fns, self.zero_loss
        _, pull_out = jax.vjp(lambda sh, yy: jax.lax.cond(
            is_last, lambda: fns.loss(sh, yy, tok).astype(jnp.float32), lambda: zero_loss), self.shared_params, y)
        d_shared, dy_loss = pull_out(jnp.where(is_last, zero_loss + self.inv_m, zero_loss))
        return d_shared, self.pin(jnp.where(is_last, dy_loss, read_slot(gbuf, row["bwd_grad_slot"])))

    def backward(self, row, stash, gbuf, g_stage, g_shared, seq):
        """The whole backward of a virtual stage, recomputed from its stashed input; the parameter
        gradients are added to the accumulators ``g_stage`` / ``g_shared`` in the branch."""
        fns, pin = self.fns, self.pin
        chunk = row["bwd_chunk"]
        tok = self.tokens[row["bwd_mb"]]
        virtual = chunk * self.p + self.stage_index
        is_last = virtual == self.last_virtual
        chunk_params = chunk_of(self.stage_params, chunk)
        x = pin(after(read_slot(stash, row["bwd_stash_slot"]), seq))
        # The virtual stage's three parts (embedding, layers, head + loss) differentiated one by one,
        # so that the layers' pullback can be ordered after the head's (below).
        x0, pull_in = self.embedding_vjp(virtual, tok, x)
        y, pull_stage = jax.vjp(lambda cp, h: pin(self.run_stage(cp, h, chunk, tok)), chunk_params, x0)
        d_shared_out, dy = self.head_gradient(row, gbuf, is_last, tok, y)
        if fns.remat in ("full", "offload"):
            # What the pullback recomputes (each layer, with its collectives) reads its inputs after
            # ``dy``, so it follows the head's ``cond`` instead of racing it.
            pull_stage = _after_residuals(pull_stage, self.token(dy), chunk_params)
        d_params, dx0 = pull_stage(dy)
        d_shared_in, d_x = pull_in(pin(after(dx0, self.gradients_token(d_params))))
        d_x = pin(d_x)
        g_stage = accumulate(g_stage, (chunk,), jax.tree.leaves(d_params))
        g_shared = jax.tree.map(lambda g, a, b: g + a + b, g_shared, d_shared_out, d_shared_in)
        return d_x, g_stage, g_shared, seq + self.token(d_x)

    def backward_by_layer(self, row, stash, gbuf, rbuf, g_shared, seq, walk, gradients_of=lambda buffer: buffer,
                          keep: bool | None = None):
        """A virtual stage's backward, one layer at a time from stored residuals: the kept ones (this
        microbatch's slot of the residual buffers ``rbuf``, read layer by layer where they are used)
        or, recomputing, those of the chunk's forward rerun from its stashed input. The embedding and
        head + loss gradients are added to ``g_shared`` here; ``walk(chunk_params, residual_of, dy,
        active) -> (dx, buffer)`` walks the layers back, writing what it produces into the buffer it
        carries (the split backward's B: what W will need; the whole pullback: the layers' gradients).
        ``keep``: read the residuals from ``rbuf`` at ``row["bwd_res_slot"]`` (default: when the program
        keeps residuals)."""
        pin = self.pin
        keep = self.keep if keep is None else keep
        chunk = row["bwd_chunk"]
        tok = self.tokens[row["bwd_mb"]]
        virtual = chunk * self.p + self.stage_index
        is_last = virtual == self.last_virtual
        chunk_params = chunk_of(self.stage_params, chunk)
        # The stage input matters only to recompute from: the embedding's pullback needs the tokens
        # alone, and the pass-through branch's is the identity, whatever ``x``.
        x = self.zeros_act if keep else pin(after(read_slot(stash, row["bwd_stash_slot"]), seq))
        x0, pull_in = self.embedding_vjp(virtual, tok, x)
        if keep:
            # The slot index carries the ordering token, so every read of the buffers waits for `seq`
            # without a pass over the values (``after`` on them would add zero to every element).
            slot = index_after(row["bwd_res_slot"], seq)
            y = get(rbuf[-1], (slot,))
        else:
            y, stored = self.layers.layers_forward(chunk_params, x0, tok, self.active(chunk), chunk)
        d_shared_out, dy = self.head_gradient(row, gbuf, is_last, tok, y)
        # The layers' backward reads its residuals after ``dy``, so whatever it recomputes from them
        # (a layer rerun under ``model.remat=full``, with its collectives) follows the head's
        # ``cond`` instead of racing it.
        walk_seq = self.token(dy)
        if keep:
            def residual_of(i):
                return [get(b, (index_after(slot, walk_seq), i)) for b in rbuf[:-1]]
        else:
            def residual_of(i):
                return [jax.lax.dynamic_index_in_dim(s, index_after(i, walk_seq), keepdims=False) for s in stored]
        dx0, buffer = walk(chunk_params, residual_of, dy, self.active(chunk))
        d_shared_in, d_x = pull_in(pin(after(dx0, self.gradients_token(gradients_of(buffer), stacked=True))))
        d_x = pin(d_x)
        g_shared = jax.tree.map(lambda g, a, b: g + a + b, g_shared, d_shared_out, d_shared_in)
        return d_x, buffer, g_shared, seq + self.token(d_x)

    def backward_input(self, row, stash, gbuf, rbuf, wbuf, g_stage, g_shared, seq):
        """The split backward's B: input gradient (sent at once) and the embedding/head gradients;
        the layers' weight gradients are left to W, with what they need written into this
        microbatch's slot of the B-to-W buffers ``wbuf`` (and, when the forward keeps residuals,
        partly over residuals of its slot in ``rbuf`` that only B reads); the few layer gradients B
        computes itself (norms) are added to ``g_stage``. Returns ``(dx, wbuf, rbuf, g_stage,
        g_shared, seq)``."""
        slot = row["bwd_weight_slot"]
        chunk = row["bwd_chunk"]
        kept = None if rbuf is None else (rbuf[:-1], index_after(row["bwd_res_slot"], seq))
        d_x, (wbuf, rlayers, g_stage), g_shared, seq = self.backward_by_layer(
            row, stash, gbuf, rbuf, g_shared, seq,
            lambda cp, res, dy, act: self.layers.input_gradient_into(cp, res, dy, act, wbuf, slot, g_stage, chunk,
                                                                     kept),
            gradients_of=lambda buffer: buffer[2])
        return d_x, wbuf, None if rbuf is None else [*rlayers, rbuf[-1]], g_stage, g_shared, seq

    def backward_kept(self, row, gbuf, rbuf, g_stage, g_shared, seq):
        """The whole backward from kept residuals (no recomputation, not split)."""
        chunk = row["bwd_chunk"]
        return self.backward_by_layer(
            row, None, gbuf, rbuf, g_shared, seq,
            lambda cp, res, dy, act: self.layers.backward_into(cp, res, dy, act, g_stage, chunk))

    def weight_gradient(self, row, stash, wbuf, rbuf, g_stage, seq):
        """The split backward's W: this chunk's layer gradients, from what its B left in ``wbuf``
        and the layers' residuals -- this microbatch's residual slot of ``rbuf`` when the forward keeps
        them, else those of the chunk's forward rerun from its stashed input (the embedding on the
        first virtual stage) -- added to ``g_stage``."""
        chunk = row["wgt_chunk"]
        chunk_params = chunk_of(self.stage_params, chunk)
        slot = index_after(row["wgt_slot"], seq)
        if rbuf is not None:
            g_stage = self.layers.weight_gradient_into(chunk_params, wbuf, slot, self.active(chunk), g_stage, chunk,
                                                       (rbuf[:-1], index_after(row["wgt_res_slot"], seq)))
        else:
            tok = self.tokens[row["wgt_mb"]]
            x = self.stage_input(chunk, tok, stash, row["wgt_stash_slot"], seq)
            g_stage = self.layers.forward_weight_gradient_into(chunk_params, x, tok, wbuf, slot, self.active(chunk),
                                                               g_stage, chunk)
        return g_stage, seq + token(g_stage)

    # ---- one tick, and the loop ------------------------------------------------------------------

    def branch(self, slot: str, busy_if: jax.Array, busy, idle):
        """``busy()`` where this stage has work this tick, else ``idle()``: a ``cond`` (idle ticks skip),
        or, in lockstep, both computed and the result selected (every device runs the same collectives).
        The ``cond`` is traced under the named scope ``pipeline_<slot>`` (forward, backward, weight), so the
        compiled program's ``op_name`` says which slot a conditional is (the GPU step-time estimate reads it)."""
        with jax.named_scope(f"pipeline_{slot}"):
            if not self.lockstep:
                return jax.lax.cond(busy_if, busy, idle)
            return jax.tree.map(lambda b, i: jnp.where(busy_if, b, i), busy(), idle())

    def tick_of(self, seg: _Segment):
        """The body of the ``scan`` over one segment's ticks: receive, forward, backward (B), W, send."""
        zeros_act, zero_head = self.zeros_act, self.zero_head

        early = self.early_sends
        send_forward, send_backward = self.send_forward, self.send_backward

        def receive_backward(gbuf, b_msg, row, seq):
            return write_slot(gbuf, row["recv_bwd_slot"], b_msg), seq + self.token(b_msg)

        def tick(state: TickState, row_all):
            stash, gbuf, wbuf, rbuf, f_msg, b_msg, g_stage, g_shared, loss_sum, seq, reports, hbuf, b_out = state
            row = {k: jax.lax.dynamic_index_in_dim(row_all[k], self.stage_index, keepdims=False) for k in row_all}
            stash = write_slot(stash, row["recv_fwd_slot"], f_msg)
            # `seq` threads one data dependency through every collective-bearing operation of the
            # tick, in one fixed order (see the module docstring): forward, backward, send forward,
            # send backward, then the next tick. Early sends (GPU) reorder the sends, one in flight at a
            # time: the last tick's input gradient, under this tick's forward; the forward's activation,
            # under the backward (B and W).
            seq = seq + self.token(f_msg)
            if early and seg.send_backward:
                b_msg = send_backward(b_out, seq)
            if self.train and not early:
                gbuf, seq = receive_backward(gbuf, b_msg, row, seq)
            y_out, dx_out = f_msg, b_msg
            # Large state (residual and B-to-W buffers, gradient accumulators) enters a ``cond`` whole
            # and leaves it updated in place: an idle branch returns it as it came. Returning a
            # slot's worth of values instead would make every idle branch materialise zeros of that
            # size and every tick copy them into the buffer.
            if seg.forward and self.keep:
                y_out, loss, rbuf, seq = self.branch(
                    "forward", row["fwd_mb"] >= 0,
                    lambda: self.forward_keeping(row, stash, rbuf, seq),
                    lambda: (zeros_act, zero_head, rbuf, seq),
                )
                loss_sum = self.added(loss_sum, loss, row)
            elif seg.forward:
                y_out, loss, reports, seq = self.branch(
                    "forward", row["fwd_mb"] >= 0,
                    lambda: self.forward(row, stash, seq, reports),
                    lambda: (zeros_act, zero_head, reports, seq),
                )
                loss_sum = self.added(loss_sum, loss, row)
            if self.train and early:  # the backward reads what the last tick sent
                gbuf, seq = receive_backward(gbuf, b_msg, row, seq)
            if early and seg.send_forward:
                f_msg = send_forward(y_out, seq)
            if seg.recompute:
                hbuf, seq = self.branch(
                    "recompute", row["pre_mb"] >= 0,
                    lambda: self.recompute_keeping(row, stash, hbuf, seq),
                    lambda: (hbuf, seq),
                )
            if seg.backward and not self.schedule.split_backward:
                dx_out, g_stage, g_shared, seq = self.branch(
                    "backward", row["bwd_mb"] >= 0,
                    (lambda: self.backward_kept(row, gbuf, rbuf, g_stage, g_shared, seq)) if self.keep
                    else self.recomputing_backward(seg, row, stash, gbuf, hbuf, g_stage, g_shared, seq),
                    lambda: (zeros_act, g_stage, g_shared, seq),
                )
            elif seg.backward:
                dx_out, wbuf, rbuf, g_stage, g_shared, seq = self.branch(
                    "backward", row["bwd_mb"] >= 0,
                    lambda: self.backward_input(row, stash, gbuf, rbuf, wbuf, g_stage, g_shared, seq),
                    lambda: (zeros_act, wbuf, rbuf, g_stage, g_shared, seq),
                )
            if seg.weight:
                g_stage, seq = self.branch(
                    "weight", row["wgt_mb"] >= 0,
                    lambda: self.weight_gradient(row, stash, wbuf, rbuf, g_stage, seq),
                    lambda: (g_stage, seq),
                )
            if seg.send_forward:
                if not early:
                    f_msg = send_forward(y_out, seq)
                seq = seq + self.token(f_msg)
            if seg.send_backward and not early:
                b_msg = send_backward(dx_out, seq)
            if early and seg.backward:
                b_out = dx_out
            return TickState(stash, gbuf, wbuf, rbuf, f_msg, b_msg, g_stage, g_shared, loss_sum, seq, reports,
                             hbuf, b_out), None

        return tick

    def added(self, loss_sum: jax.Array, loss: jax.Array, row) -> jax.Array:
        """``loss_sum`` with a tick's head value added: the sum of the losses, or (``per_row``) the rows'
        values at their microbatch (an idle tick's are zeros, added to the first)."""
        if not self.per_row:
            return loss_sum + loss
        return jax.lax.dynamic_update_index_in_dim(
            loss_sum, jax.lax.dynamic_index_in_dim(loss_sum, jnp.maximum(row["fwd_mb"], 0), keepdims=False) + loss,
            jnp.maximum(row["fwd_mb"], 0), axis=0)

    def send(self, x: jax.Array, seq: jax.Array, step: int) -> jax.Array:
        """``x`` (read after ``seq``) sent ``step`` stages along the ring: one ``ppermute`` over the pipeline
        axis. With early sends it asks XLA:GPU for its point-to-point stream (:data:`P2P_STREAM`): the GPU
        scheduler counts a ``conditional`` as using the collective stream when a branch does (a stage's tensor
        all-reduces) and keeps one collective in flight there, so a send on that stream could not stay in
        flight across a stage's ``conditional``."""
        p, pin = self.p, self.pin
        pairs = [(i, (i + step) % p) for i in range(p)]
        if not self.early_sends:
            return pin(jax.lax.ppermute(pin(after(x, seq)), self.axis, pairs))
        with set_xla_metadata(**P2P_STREAM):
            return pin(jax.lax.ppermute(pin(after(x, seq)), self.axis, pairs))

    def send_forward(self, y: jax.Array, seq: jax.Array) -> jax.Array:
        return self.send(y, seq, 1)

    def send_backward(self, dx: jax.Array, seq: jax.Array) -> jax.Array:
        return self.send(dx, seq, -1)

    def recomputing_backward(self, seg: _Segment, row, stash, gbuf, hbuf, g_stage, g_shared, seq):
        """The unsplit backward under recomputation, as a thunk: from a hoisted rerun's residuals where the
        row says so (``bwd_pre_slot``), else rerunning the stage itself; a segment holding only one kind
        compiles only that one."""
        def hoisted():
            return self.backward_recomputed(row, gbuf, hbuf, g_stage, g_shared, seq)

        def itself():
            return self.backward(row, stash, gbuf, g_stage, g_shared, seq)

        if not seg.backward_kept:
            return itself
        if not seg.backward_recomputes:
            return hoisted
        return lambda: self.branch("backward", row["bwd_pre_slot"] >= 0, hoisted, itself)

    def buffer(self, slots: int) -> jax.Array:
        return self.zeros(jax.ShapeDtypeStruct((max(slots, 1), *self.act.shape), self.act.dtype))

    def filled(self, buffers: list[jax.Array]) -> list[jax.Array]:
        """The loop's large buffers, each zero-filled on its own. XLA treats ``jnp.zeros`` of equal
        shapes as one value, materialises it once and copies it into every buffer of the loop: two
        passes over each. A zero it cannot prove equal to another (``(stage + k) * 0.0``, which it
        does not fold for floating point) gives each buffer a single fill of its own."""
        base = self.stage_index.astype(jnp.float32)
        return [b + ((base + k) * 0.0).astype(b.dtype) for k, b in enumerate(buffers)]

    def initial_state(self) -> TickState:
        program, train = self.program, self.train
        return TickState(
            stash=self.buffer(program.stash_slots),
            grads=self.buffer(program.grad_slots) if train else None,
            weight_buffers=(self.filled(self.layers.buffers(program.weight_slots))
                            if self.schedule.split_backward else None),
            residuals=self.filled(self.layers.residual_buffers(program.residual_slots)) if self.keep else None,
            f_msg=self.zeros_act,
            b_msg=self.zeros_act if train else None,
            g_stage=self.zeros(self.stage_params) if train else None,
            g_shared=self.zeros(self.shared_params) if train else None,
            loss_sum=(self.zeros(jax.ShapeDtypeStruct((self.schedule.microbatches, *self.zero_head.shape), jnp.float32))
                      if self.per_row else self.zero_loss),
            seq=self.prepared_token(),
            reports=self.zero_reports() if self.collect else None,
            recomputed=self.filled(self.layers.residual_buffers(program.recompute_slots)) if self.hoist else None,
            b_out=self.zeros_act if train and self.early_sends else None,
        )

    def prepared_token(self) -> jax.Array:
        """The ordering token's start: after what :attr:`StageFunctions.prepare` made (its floating leaves --
        the FP8 weights' scales, which its collectives make -- not a pass over its bytes)."""
        if self.weights is None:
            return self.zero_loss
        floating = [w for w in jax.tree.leaves(self.weights) if jnp.issubdtype(w.dtype, jnp.floating)]
        return sum(map(token, floating), self.zero_loss)

    def zero_reports(self) -> PyTree:
        """Zeros shaped like one chunk's reports, for every chunk: ``[chunks, layers_per_chunk, ...]``."""
        chunk = jax.tree.map(lambda a: a[0], self.stage_params)
        x = self.zeros_act
        found = jax.eval_shape(lambda: self.run_stage(chunk, x, 0, self.tokens[0], self.fns.reporting_stage)[1])
        chunks = self.schedule.chunks
        return self.zeros(jax.tree.map(lambda r: jax.ShapeDtypeStruct((chunks, *r.shape), r.dtype), found))

    def run(self) -> tuple[jax.Array, PyTree | None, PyTree | None]:
        """``(loss, stage_grads, shared_grads)``: every segment's ``scan``, then the one sum over ``axis``."""
        state = self.initial_state()
        fields = _ROW_FIELDS if self.train else _FORWARD_FIELDS
        rows = {name: np.asarray(getattr(self.program, name), np.int32) for name in fields}
        before = None
        for seg in segments(self.program):
            if self.early_sends and self.train and before is not None and before.send_backward and not seg.send_backward:
                # Early sends deliver a tick's input gradient at the next tick's start; a segment that sends
                # none gets the last one of the segment before here, between the loops.
                state = state._replace(b_msg=self.send_backward(state.b_out, state.seq))
            xs = {name: jnp.asarray(arr[seg.start : seg.stop]) for name, arr in rows.items()}
            state, _ = jax.lax.scan(self.tick_of(seg), state, xs)
            before = seg
        # The loss lives on the last stage and the shared gradients on the first and last: one sum of
        # both, after everything the loop ran (the last messages included).
        seq = state.seq + self.token(state.f_msg)
        if self.train:
            seq = seq + self.token(state.b_msg) + token(state.g_stage)
        head = state.loss_sum if self.per_row else state.loss_sum * self.inv_m
        loss, g_shared = jax.lax.psum(after((head, state.g_shared), seq), self.axis)
        self.reports = state.reports
        return loss, state.g_stage, g_shared
