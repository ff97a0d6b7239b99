"""Forward-only pipeline programs for held-out evaluation with pipe > 1.

Evaluating with the unpipelined model makes the compiler gather every pipe-sharded layer onto
every device; the forward-only program keeps layers on their stage and moves only activations.
Checked here: the table (each microbatch through every virtual stage once, in order, no backward),
its compiled buffer instructions, and the SPMD run on (data, pipe, tensor) meshes with a small
model-agnostic tanh-MLP (tensor-sharded matmuls, so stage ``cond``-s hold tensor all-reduces):
the loss is the unpipelined one, no collective is left unordered, nothing is all-gathered over
``pipe``, and ``pipe`` carries one activation per forward-sending tick in one direction only.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.hlo.collectives import collectives
from meshtron.hlo.order import unordered_collectives
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.runtime import StageFunctions, run_pipeline, run_pipeline_forward, segments
from meshtron.pipeline.schedules import (
    Program,
    Schedule,
    ScheduleError,
    Work,
    check,
    compile_program,
    forward_only,
    make_schedule,
)

# ---------------------------------------------------------------------------------------------
# The table


def forward_ticks(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(microbatch, virtual stage) -> the tick its forward runs in."""
    p = schedule.stages
    return {(w.microbatch, w.chunk * p + s): t
            for t, row in enumerate(schedule.forward) for s, w in enumerate(row) if w is not None}


TABLES = [(p, m, v) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in range(1, 10)]


@pytest.mark.parametrize("p, m, v", TABLES)
def test_each_microbatch_passes_its_virtual_stages_once_in_order(p, m, v):
    schedule = forward_only(p, m, v)
    stats = check(schedule)
    assert schedule.forward_only and all(w is None for row in schedule.backward for w in row)
    ticks = forward_ticks(schedule)
    assert sorted(ticks) == [(mb, k) for mb in range(m) for k in range(p * v)]  # each exactly once
    for mb in range(m):  # in order, each handed on the very next tick (one stash slot suffices)
        assert [ticks[mb, k + 1] - ticks[mb, k] for k in range(p * v - 1)] == [1] * (p * v - 1)
    assert stats.peak_in_flight == (1,) * p and stats.megatron_peak_in_flight_stage0 == 1
    if v == 1 or m % p == 0:  # whole groups of p: the textbook fill-and-drain, nothing more
        assert stats.ticks == m * v + p - 1
        assert stats.bubble_fraction == pytest.approx((p - 1) / (v * m)) == stats.ideal_bubble


@pytest.mark.parametrize("p, m, v", [(2, 2, 1), (2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_forward_order_is_the_training_schedules(p, m, v):
    # Same op order per stage as training, so stage-ordered (interleaved) parameters serve both.
    train = make_schedule("gpipe" if v == 1 else "interleaved", p, m, v)
    for stage in range(p):
        ops = [[row[stage] for row in s.forward if row[stage] is not None]
               for s in (train, forward_only(p, m, v))]
        assert ops[0] == ops[1]


def edit(schedule: Schedule, table: str, tick: int, stage: int, work: Work | None) -> Schedule:
    rows = [list(row) for row in getattr(schedule, table)]
    rows[tick][stage] = work
    return dataclasses.replace(schedule, **{table: tuple(map(tuple, rows))})


def test_checker_rejects_virtual_stages_out_of_order():
    s = forward_only(2, 2, 2)  # stage 0: F0.0 F1.0 F0.1 F1.1 . / stage 1: . F0.0 F1.0 F0.1 F1.1
    assert s.forward[2][0] == Work(0, 1) and s.forward[0][0] == Work(0, 0)
    swapped = edit(edit(s, "forward", 0, 0, Work(0, 1)), "forward", 2, 0, Work(0, 0))
    out_of_order = r"^tick 0, stage 0: forward of microbatch 0 chunk 1 .* runs before its input arrives"
    with pytest.raises(ScheduleError, match=out_of_order):
        check(swapped)


def test_checker_rejects_backward_work_and_missing_forwards():
    s = forward_only(2, 2)
    no_backward = r"tick 2, stage 1: a forward-only table runs no backward.*microbatch 0"
    with pytest.raises(ScheduleError, match=no_backward):
        check(edit(s, "backward", 2, 1, Work(0, 0)))
    with pytest.raises(ScheduleError, match=r"forward of microbatch 1 chunk 0 \(virtual stage 1\) never"):
        check(edit(s, "forward", 2, 1, None))


def test_bad_requests():
    with pytest.raises(ScheduleError, match="microbatches: need at least 1 microbatch, got 0"):
        forward_only(2, 0)
    with pytest.raises(ScheduleError, match="stages: need at least 1"):
        forward_only(0, 2)
    with pytest.raises(ScheduleError, match="chunks: need at least 1"):
        forward_only(2, 2, 0)


def simulate_forward(program: Program) -> None:
    """Run a forward-only program on symbolic activations ``("x", mb, k)``: every forward reads
    exactly its own input, every sent value is stored and consumed, nothing is left over."""
    sched = program.schedule
    p, last = sched.stages, sched.stages * sched.chunks - 1
    stash = [[None] * program.stash_slots for _ in range(p)]
    sent: list = [None] * p
    for t in range(sched.ticks):
        for s in range(p):
            value, slot = sent[(s - 1) % p], int(program.recv_fwd_slot[t, s])
            assert (value is None) == (slot == -1), f"tick {t} stage {s}: receive {value} into slot {slot}"
            if value is not None:
                assert stash[s][slot] is None, f"tick {t} stage {s}: {value} overwrites {stash[s][slot]}"
                stash[s][slot] = value
        sent = [None] * p
        for s in range(p):
            mb, chunk, slot = (int(a[t, s]) for a in (program.fwd_mb, program.fwd_chunk, program.fwd_slot))
            if mb < 0:
                continue
            k = chunk * p + s
            if k > 0:
                assert stash[s][slot] == ("x", mb, k), f"tick {t} stage {s}: forward input"
                stash[s][slot] = None  # consumed: nothing is recomputed
            else:
                assert slot == -1
            assert program.fwd_send[t, s] == int(k < last)
            if k < last:
                sent[s] = ("x", mb, k + 1)
    assert sent == [None] * p and all(x is None for buf in stash for x in buf)


@pytest.mark.parametrize("p, m, v", [(1, 3, 1), (1, 2, 2), (2, 1, 1), (2, 3, 2), (4, 2, 2), (4, 8, 2),
                                     (3, 7, 3)])
def test_compiled_program_has_one_stash_slot_and_no_backward(p, m, v):
    program = compile_program(forward_only(p, m, v))
    simulate_forward(program)
    assert program.stash_slots == int(p * v > 1) and program.grad_slots == 0
    for name in ("bwd_mb", "bwd_chunk", "bwd_stash_slot", "bwd_grad_slot", "recv_bwd_slot"):
        assert (getattr(program, name) == -1).all(), name
    assert not program.bwd_send.any()


def test_entry_points_refuse_the_other_kind_of_program():
    with pytest.raises(ValueError, match="use run_pipeline_forward"):
        run_pipeline(PipelinePlan(compile_program(forward_only(2, 2))), None, None, None, None)
    with pytest.raises(ValueError, match="needs a forward-only program"):
        run_pipeline_forward(PipelinePlan(compile_program(make_schedule("1f1b", 2, 2))), None, None, None, None)


# ---------------------------------------------------------------------------------------------
# The SPMD run

# ROWS: sequences per microbatch, over all data shards.
VOCAB, HIDDEN, MLP, SEQ, LAYERS, ROWS = 64, 16, 32, 8, 8, 4


def embed(shared, tokens):
    return shared["wte"][tokens[:, :-1]]


def stage(chunk, x, tokens):
    def layer(x, w):
        return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None

    return jax.lax.scan(layer, x, chunk)[0]


def loss(shared, y, tokens):
    logits = y @ shared["wte"].T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


FNS = StageFunctions(embed, stage, loss)


def init(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {"wte": jax.random.normal(keys[0], (VOCAB, HIDDEN)) * 0.5}, {
        "w1": jax.random.normal(keys[1], (LAYERS, HIDDEN, MLP)) / np.sqrt(HIDDEN),
        "w2": jax.random.normal(keys[2], (LAYERS, MLP, HIDDEN)) / np.sqrt(MLP),
    }


def unpipelined_loss(shared, blocks, tokens):
    flat = tokens.reshape(-1, SEQ + 1)
    return float(loss(shared, stage(blocks, embed(shared, flat), flat), flat))


def stage_ordered(blocks, p, v):
    """Canonical ``[layers, ...]`` -> ``[p, v, layers/(p·v), ...]``: stage ``s`` chunk ``c`` holds
    virtual stage ``c·p + s`` (Megatron's interleaved placement)."""
    return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1), blocks)


def mesh_of(shape) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("data", "pipe", "tensor"))


def evaluate(mesh: Mesh, program: Program):
    """The held-out loss as a jitted step: a shard_map manual over data and pipe (tensor left to
    the compiler); each stage runs the forward-only program on its own chunks."""

    def per_device(blocks, shared, tokens):
        local = jax.tree.map(lambda a: a[0], blocks)  # this stage's [v, layers/(p·v), ...]
        return jax.lax.pmean(run_pipeline_forward(PipelinePlan(program), FNS, local, shared, tokens), "data")

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("pipe"), P(), P(None, "data")),
                                 out_specs=P(), axis_names={"data", "pipe"}, check_vma=True))


def place(mesh: Mesh, shared, blocks, tokens):
    spec = {"w1": P("pipe", None, None, None, "tensor"), "w2": P("pipe", None, None, "tensor", None)}
    return (jax.device_put(blocks, {k: NamedSharding(mesh, s) for k, s in spec.items()}),
            jax.device_put(shared, NamedSharding(mesh, P())),
            jax.device_put(tokens, NamedSharding(mesh, P(None, "data"))))


def permute_pairs(hlo: str) -> list[tuple[int, int]]:
    pairs = []
    """(source, target) device ids of every collective-permute in the HLO text."""
    pattern = r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}"
    for found in re.finditer(pattern, hlo):
        pairs += [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", found.group(1))]
    return pairs


RUNS = [(mesh, v, m) for mesh in ((1, 2, 4), (2, 2, 2), (2, 4, 1)) for v in (1, 2) for m in (1, 2, 4, 8)]


def run_id(x) -> str:
    return "x".join(map(str, x)) if isinstance(x, tuple) else str(x)


@pytest.mark.parametrize("mesh_shape, v, m", RUNS, ids=run_id)
def test_forward_only_loss_and_communication(mesh_shape, v, m):
    d, p, _ = mesh_shape
    mesh = mesh_of(mesh_shape)
    program = compile_program(forward_only(p, m, v))
    shared, blocks = init()
    tokens = np.random.default_rng(m).integers(0, VOCAB, size=(m, ROWS, SEQ + 1), dtype=np.int32)
    args = place(mesh, shared, stage_ordered(blocks, p, v), tokens)
    compiled = evaluate(mesh, program).lower(*args).compile()

    assert float(compiled(*args)) == pytest.approx(unpipelined_loss(shared, blocks, tokens), rel=1e-5)

    # (a) the deadlock rule holds on what XLA runs (stage conds hold the tensor all-reduces).
    assert "conditional" in compiled.as_text(), "idle slots must still be skipped"
    assert unordered_collectives(compiled) == []
    colls = collectives(compiled, mesh)
    # (b) no parameter moves over pipe: the only other pipe collective is the one sum of the scalar loss.
    assert not [c for c in colls if c.kind == "all-gather" and "pipe" in c.axes]
    others = [c for c in colls if "pipe" in c.axes and c.kind != "collective-permute"]
    assert [(c.kind, c.bytes) for c in others] == [("all-reduce", 4)] and others[0].count == 1
    # (c) pipe traffic: one activation [local rows, seq, hidden] per ppermute, one ppermute per tick
    # of a forward-sending segment -- m·v per device at least (each of its m·v forwards but the last
    # virtual stage's is one transfer), at most m·v + p - 1 (the fill-and-drain bubble) when m
    # fills whole groups of p -- and all of them towards the next stage (no backward sends).
    permutes = [c for c in colls if c.kind == "collective-permute"]
    activation = ROWS // d * SEQ * HIDDEN * 4
    assert permutes and all(c.axes == ("pipe",) and c.bytes == activation for c in permutes)
    sent = sum(c.count for c in permutes)
    assert sent == sum(seg.stop - seg.start for seg in segments(program) if seg.send_forward)
    assert m * v <= sent <= program.schedule.ticks
    if v == 1 or m % p == 0:
        assert sent <= m * v + p - 1
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    for src, dst in permute_pairs(compiled.as_text()):
        (ds, ss, ts), (dd, sd, td) = coords[src], coords[dst]
        assert (dd, sd, td) == (ds, (ss + 1) % p, ts), f"{src}->{dst} is not a forward pipe send"
