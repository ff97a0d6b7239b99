"""A checked schedule table compiled into what the SPMD runtime executes: per tick and stage, which
(microbatch, chunk) runs and which buffer slot every value it reads, writes and sends lives in
(:class:`Program`). No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshtron.pipeline.table import Schedule, ScheduleError, check, hoisted_recomputes

# --------------------------------------------------------------------------------------------
# Compiling tables into per-tick buffer instructions


# eq=False: the fields are numpy arrays, whose == is elementwise, so a generated __eq__/__hash__
# would raise rather than compare; identity is the meaningful equality for a compiled program.
@dataclass(frozen=True, eq=False)
class Program:
    """Per-tick, per-stage instructions for the runtime; read-only int32 arrays ``[ticks, stages]``,
    -1 = none. Received values wait in per-stage slot buffers (``stash`` for activations, ``grad``
    for output gradients) whose sizes are ``stash_slots`` and ``grad_slots``. A forward-only
    program has no backward instructions (all -1 / 0) and ``grad_slots == 0``.

    ``keeps_residuals``: compiled with ``keep_residuals=True``, the forward keeps what each layer's
    backward needs (its ``jax.vjp`` residuals) in ``residual_slots`` per-stage slots from the forward
    (``fwd_res_slot``) to the backward (``bwd_res_slot``) -- with a split backward to the weight
    gradient (``wgt_res_slot``), which reads them too -- and the backward recomputes nothing; the
    stash then holds a received activation only until its forward (``bwd_stash_slot`` is -1).
    Otherwise (the default: Megatron's full recomputation) the stash keeps the stage input until
    the backward, which recomputes the stage from it -- or, for a backward the table hoists
    (:func:`~meshtron.pipeline.table.hoisted_recomputes`), the tick before: there the stage's forward
    is rerun from the stash (``pre_stash_slot``) keeping the layers' residuals in one of
    ``recompute_slots`` per-stage slots (``pre_res_slot``), and the backward reads them from that slot
    (``bwd_pre_slot``) instead of recomputing. A recompute slot lives one tick. With a split backward
    (never hoisted) the stash keeps the stage input until the weight gradient (``wgt_stash_slot``),
    which recomputes the stage's residuals from it too, so that B leaves W only what depends on the
    output gradient."""

    schedule: Schedule
    fwd_mb: np.ndarray
    fwd_chunk: np.ndarray
    fwd_slot: np.ndarray  # stash slot with the forward's input; -1 on virtual stage 0 (tokens)
    fwd_send: np.ndarray  # 1 if the output goes to the next stage (all but the last virtual stage)
    recv_fwd_slot: np.ndarray  # stash slot for the activation arriving at the start of the tick
    bwd_mb: np.ndarray
    bwd_chunk: np.ndarray
    bwd_stash_slot: np.ndarray  # stash slot with the stage input to recompute from; -1 on virtual stage 0
    bwd_grad_slot: np.ndarray  # gradient-buffer slot with d(output); -1 on the last virtual stage (loss)
    bwd_send: np.ndarray  # 1 if the input gradient goes to the previous stage (all but virtual stage 0)
    recv_bwd_slot: np.ndarray  # gradient-buffer slot for the gradient arriving at the start of the tick
    bwd_weight_slot: np.ndarray  # split backward: weight-buffer slot where B leaves what W needs; else -1
    wgt_mb: np.ndarray  # split backward: the weight gradient (W) of this tick
    wgt_chunk: np.ndarray
    wgt_slot: np.ndarray  # weight-buffer slot W reads (and frees)
    stash_slots: int
    grad_slots: int
    weight_slots: int = 0  # split backward: B-to-W buffers per stage (the table's peak_weight_pending)
    fwd_res_slot: np.ndarray | None = None  # keep_residuals: residual slot the forward fills; else -1
    bwd_res_slot: np.ndarray | None = None  # keep_residuals: residual slot the backward reads (and frees, unsplit)
    residual_slots: int = 0  # keep_residuals: forward-to-backward (split: to-W) residual buffers per stage
    wgt_res_slot: np.ndarray | None = None  # keep_residuals, split backward: residual slot W reads and frees
    pre_mb: np.ndarray | None = None  # hoisted recompute: the microbatch whose backward runs next tick; else -1
    pre_chunk: np.ndarray | None = None
    pre_stash_slot: np.ndarray | None = None  # stash slot it reruns from (and frees); -1 on virtual stage 0
    pre_res_slot: np.ndarray | None = None  # recompute slot it fills with the layers' residuals
    bwd_pre_slot: np.ndarray | None = None  # recompute slot the backward reads (and frees); -1: it recomputes
    recompute_slots: int = 0  # hoisted recomputes: residual buffers per stage (one: each lives one tick)
    wgt_stash_slot: np.ndarray | None = None  # recomputing, split backward: stash slot W recomputes from and frees

    @property
    def keeps_residuals(self) -> bool:
        return self.residual_slots > 0

    @property
    def hoists_recompute(self) -> bool:
        """Some backward reads residuals its stage's rerun kept the tick before (``recompute_slots``)."""
        return self.recompute_slots > 0

    @property
    def keeps_layer_residuals(self) -> bool:
        """Some backward runs from per-layer residuals kept by a forward or by a hoisted rerun."""
        return self.keeps_residuals or self.hoists_recompute


_COLUMNS = (
    "fwd_mb", "fwd_chunk", "fwd_slot", "fwd_send", "recv_fwd_slot",
    "bwd_mb", "bwd_chunk", "bwd_stash_slot", "bwd_grad_slot", "bwd_send", "recv_bwd_slot",
    "bwd_weight_slot", "wgt_mb", "wgt_chunk", "wgt_slot", "fwd_res_slot", "bwd_res_slot", "wgt_res_slot",
    "pre_mb", "pre_chunk", "pre_stash_slot", "pre_res_slot", "bwd_pre_slot", "wgt_stash_slot",
)


class _Slots:
    """A free list of buffer slots that remembers how many were ever live at once."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.size = 0
        self.owner: dict[tuple[int, int], int] = {}  # (microbatch, virtual stage) -> slot

    def take(self, key: tuple[int, int]) -> int:
        slot = self.free.pop() if self.free else self.size
        self.size = max(self.size, slot + 1)
        self.owner[key] = slot
        return slot

    def release(self, key: tuple[int, int]) -> int:
        """The slot ``key`` lived in, now free for values arriving in later ticks; -1 if none."""
        slot = self.owner.pop(key, -1)
        if slot >= 0:
            self.free.append(slot)
        return slot


def _compile_stage(schedule: Schedule, stage: int, keep: bool,
                   hoisted: frozenset[tuple[int, int]]) -> tuple[dict[str, list[int]], int, int, int, int, int]:
    """One stage's instruction columns plus its stash, grad, weight, residual and recompute buffer sizes.

    A slot is taken when a value arrives (start of tick ``t``) and released by the backward that
    consumes it -- by the weight gradient of a split backward, which recomputes from it too; by the
    forward in a forward-only table or when the forward ``keep``-s the residuals, where nothing is
    recomputed; since
    arrivals are handled before that tick's work, a released slot is first reused by a value
    arriving in a later tick, so nothing is overwritten while live.
    """
    p, ticks = schedule.stages, schedule.ticks
    last = p * schedule.chunks - 1
    prev, nxt = (stage - 1) % p, (stage + 1) % p
    col = {name: [-1] * ticks for name in _COLUMNS}
    col["fwd_send"] = [0] * ticks
    col["bwd_send"] = [0] * ticks
    stash, grads, weights, kept, rerun = _Slots(), _Slots(), _Slots(), _Slots(), _Slots()
    for tick in range(ticks):
        if tick > 0:
            sent = schedule.forward[tick - 1][prev]
            if sent is not None and sent.chunk * p + prev < last:
                col["recv_fwd_slot"][tick] = stash.take((sent.microbatch, sent.chunk * p + prev + 1))
            sent = schedule.backward[tick - 1][nxt]
            if sent is not None and sent.chunk * p + nxt > 0:
                col["recv_bwd_slot"][tick] = grads.take((sent.microbatch, sent.chunk * p + nxt - 1))
        work = schedule.forward[tick][stage]
        if work is not None:
            key = (work.microbatch, work.chunk * p + stage)
            col["fwd_mb"][tick], col["fwd_chunk"][tick] = work.microbatch, work.chunk
            consumed = schedule.forward_only or keep
            col["fwd_slot"][tick] = stash.release(key) if consumed else stash.owner.get(key, -1)
            if keep:
                col["fwd_res_slot"][tick] = kept.take(key)
            col["fwd_send"][tick] = int(key[1] < last)
        if (tick + 1, stage) in hoisted:  # next tick's backward recomputes here, after the forward
            work = schedule.backward[tick + 1][stage]
            key = (work.microbatch, work.chunk * p + stage)
            col["pre_mb"][tick], col["pre_chunk"][tick] = work.microbatch, work.chunk
            col["pre_stash_slot"][tick] = stash.release(key)
            col["pre_res_slot"][tick] = rerun.take(key)
        work = schedule.backward[tick][stage]
        if work is not None:
            key = (work.microbatch, work.chunk * p + stage)
            col["bwd_mb"][tick], col["bwd_chunk"][tick] = work.microbatch, work.chunk
            # -1 when the forward or a hoisted rerun consumed it; a split backward's W recomputes from it
            # too and frees it
            until_weight = schedule.split_backward and not keep
            col["bwd_stash_slot"][tick] = stash.owner.get(key, -1) if until_weight else stash.release(key)
            col["bwd_pre_slot"][tick] = rerun.release(key)
            if keep:  # a split backward's W reads the residuals too and frees them
                col["bwd_res_slot"][tick] = kept.owner[key] if schedule.split_backward else kept.release(key)
            col["bwd_grad_slot"][tick] = grads.release(key)
            col["bwd_send"][tick] = int(key[1] > 0)
            if schedule.split_backward:
                col["bwd_weight_slot"][tick] = weights.take(key)
        work = schedule.weight[tick][stage] if schedule.split_backward else None
        if work is not None:
            # W runs after B in its tick, so a slot W frees is first reused by the next tick's B.
            key = (work.microbatch, work.chunk * p + stage)
            col["wgt_mb"][tick], col["wgt_chunk"][tick] = work.microbatch, work.chunk
            col["wgt_slot"][tick] = weights.release(key)
            if keep:
                col["wgt_res_slot"][tick] = kept.release(key)
            else:
                col["wgt_stash_slot"][tick] = stash.release(key)  # -1 on virtual stage 0 (tokens)
    return col, stash.size, grads.size, weights.size, kept.size, rerun.size


def compile_program(schedule: Schedule, keep_residuals: bool = False, hoist: bool = True) -> Program:
    """Turn a table into buffer-slot instructions (the table is checked first, so a compiled
    program never reads a value before it arrives).

    ``keep_residuals``: the forward keeps every layer's backward residuals until the backward
    (no recomputation; ``parallel.recompute=false``) instead of the stage input alone. Otherwise the
    backwards the table hoists (:func:`~meshtron.pipeline.table.hoisted_recomputes`) get their
    recomputation in the tick before (``hoist=False``: none does)."""
    check(schedule)
    if keep_residuals and schedule.forward_only:
        raise ScheduleError("keep_residuals: a forward-only table has no backward to keep residuals for")
    hoisted = frozenset() if keep_residuals or not hoist else hoisted_recomputes(schedule)
    per_stage = [_compile_stage(schedule, s, keep_residuals, hoisted) for s in range(schedule.stages)]
    arrays = {}
    for name in _COLUMNS:
        array = np.array([col[name] for col, *_ in per_stage], np.int32).T.copy()  # [ticks, stages]
        array.setflags(write=False)
        arrays[name] = array
    return Program(
        schedule,
        **arrays,
        stash_slots=max(sizes[1] for sizes in per_stage),
        grad_slots=max(sizes[2] for sizes in per_stage),
        weight_slots=max(sizes[3] for sizes in per_stage),
        residual_slots=max(sizes[4] for sizes in per_stage),
        recompute_slots=max(sizes[5] for sizes in per_stage),
    )
