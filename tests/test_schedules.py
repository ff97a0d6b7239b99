"""Pipeline schedule tables (meshtron.pipeline.schedules): exact bubbles, bounded in-flight
activations, a checker that names what is wrong with a broken table, and compiled per-tick
programs verified by an independent symbolic simulation of the ring."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from meshtron.pipeline.schedules import (
    Costs,
    Program,
    Schedule,
    ScheduleError,
    Work,
    check,
    compile_program,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    render,
)
from meshtron.pipeline.table import hoisted_recomputes, run_time
from meshtron.pipeline.torch_actions import read_csv, to_schedule

# (schedule, p, m, v) from the brief: gpipe/1f1b with one chunk, interleaved with two.
CASES = [
    (name, p, m, v)
    for p in (2, 4)
    for m in (p, 2 * p, 4 * p)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
]
# Odd corners the runtime may meet: a single stage, an odd stage count, more chunks.
EXTRA = [("1f1b", 1, 3, 1), ("interleaved", 1, 2, 3), ("gpipe", 3, 5, 1), ("1f1b", 3, 7, 1), ("interleaved", 3, 6, 3)]
# Zero bubble (ZB-H1) and Megatron's p-in-flight 1F1B: greedy tables with their own bounds.
BOUNDED = [(name, p, m, 1) for name in ("zb-h1", "1f1b-p") for p in (1, 2, 3, 4, 8) for m in (p, 2 * p, 4 * p, 2 * p + 1)]


def ids(case):
    return "{}-p{}-m{}-v{}".format(*case)


# ---------------------------------------------------------------------------------------------
# Generated tables


@pytest.mark.parametrize("case", CASES + EXTRA, ids=ids)
def test_tables_are_valid_and_the_bubble_is_exactly_the_textbook_one(case):
    name, p, m, v = case
    stats = check(make_schedule(name, p, m, v))
    assert abs(stats.bubble_fraction - (p - 1) / (v * m)) < 1e-12
    assert abs(stats.ideal_bubble - (p - 1) / (v * m)) < 1e-12
    # Lockstep length: ramp-up + all ops + drain; GPipe turns around only after all forwards.
    expected_ticks = 2 * m + 2 * p - 3 if name == "gpipe" else m * v + v * p + p - 2
    assert stats.ticks == expected_ticks


@pytest.mark.parametrize("p", [2, 4])
def test_gpipe_holds_every_microbatch_and_1f1b_does_not_grow_with_m(p):
    for m in (p, 2 * p, 4 * p):
        stats = check(gpipe(p, m))
        assert stats.peak_in_flight[0] == m == stats.megatron_peak_in_flight_stage0
    small, large = check(one_f_one_b(p, 2 * p)), check(one_f_one_b(p, 4 * p))
    assert small.peak_in_flight == large.peak_in_flight
    # Lockstep: stage 0 waits a full ring round trip (2p - 1 forwards) for its first gradient;
    # Megatron's asynchronous schedule gets away with p.
    assert large.peak_in_flight[0] == 2 * p - 1
    assert large.megatron_peak_in_flight_stage0 == p
    assert check(one_f_one_b(p, p)).peak_in_flight[0] == p  # m = p: never more than m


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_in_flight_does_not_grow_with_m_and_matches_megatron(p):
    v = 2
    small, large = check(interleaved(p, 2 * p, v)), check(interleaved(p, 4 * p, v))
    assert small.peak_in_flight == large.peak_in_flight
    # Megatron's rank 0 keeps warmup + 1 = 2(p-1) + (v-1)p + 1 chunk-microbatches; lockstep matches.
    assert large.megatron_peak_in_flight_stage0 == 2 * (p - 1) + (v - 1) * p + 1 == v * p + p - 1
    assert large.peak_in_flight[0] == large.megatron_peak_in_flight_stage0
    assert check(interleaved(p, p, v)).peak_in_flight[0] == p * v  # m = p: everything is in flight


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (2, 6), (4, 4), (4, 12)])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    a, b = interleaved(p, m, 1), one_f_one_b(p, m)
    assert (a.forward, a.backward, a.chunks) == (b.forward, b.backward, b.chunks)


def test_interleaved_uses_megatrons_microbatch_and_chunk_order():
    # Megatron: p = 4 consecutive microbatches through chunk 0, the same four through chunk 1, ...;
    # backwards walk the chunks in reverse.
    s = interleaved(4, 8, 2)
    for stage in range(4):
        fwd = [w for row in s.forward for w in [row[stage]] if w is not None]
        bwd = [w for row in s.backward for w in [row[stage]] if w is not None]
        assert [w.microbatch for w in fwd] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
        assert [w.chunk for w in fwd] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
        assert [w.microbatch for w in bwd] == [w.microbatch for w in fwd]
        assert [w.chunk for w in bwd] == [1 - w.chunk for w in fwd]


def test_every_stage_runs_the_same_order_shifted_by_one_tick():
    s = interleaved(4, 8, 2)
    for stage in range(1, 4):
        for t in range(1, s.ticks):
            assert s.forward[t][stage] == s.forward[t - 1][stage - 1]
            assert s.backward[t - 1][stage] == s.backward[t][stage - 1]


# ---------------------------------------------------------------------------------------------
# Hand-broken tables


def edit(schedule: Schedule, table: str, tick: int, stage: int, work: Work | None) -> Schedule:
    rows = [list(row) for row in getattr(schedule, table)]
    rows[tick][stage] = work
    return dataclasses.replace(schedule, **{table: tuple(map(tuple, rows))})


def move(schedule: Schedule, table: str, work: Work, stage: int, to_tick: int, to_stage: int | None = None):
    """Move ``work`` (running on ``stage``) to ``(to_tick, to_stage)``, whose cell must be idle."""
    to_stage = stage if to_stage is None else to_stage
    assert getattr(schedule, table)[to_tick][to_stage] is None
    return edit(edit(schedule, table, tick_of(schedule, table, work, stage), stage, None), table, to_tick, to_stage, work)


def tick_of(schedule: Schedule, table: str, work: Work, stage: int) -> int:
    return next(t for t, row in enumerate(getattr(schedule, table)) if row[stage] == work)


S = one_f_one_b(2, 4)  # stage 0: F0 F1 F2B0 F3B1 B2 B3 / stage 1: . F0B0 F1B1 F2B2 F3B3 .


def test_forward_in_the_same_tick_as_its_input_is_rejected():
    # Stage 1 runs microbatch 0 in tick 0, the tick in which stage 0 produces its input.
    with pytest.raises(ScheduleError, match=r"tick 0, stage 1: forward of microbatch 0 .* before its input arrives"):
        check(move(S, "forward", Work(0, 0), 1, 0))


def test_forward_across_the_ring_wrap_is_checked():
    # Interleaved p=2 v=2: stage 0 chunk 1 gets its input from stage 1 chunk 0 (virtual 1 -> 2).
    s = interleaved(2, 2, 2)
    t_input = tick_of(s, "forward", Work(0, 0), 1)
    t_fwd = tick_of(s, "forward", Work(0, 1), 0)
    assert t_fwd == t_input + 1  # as tight as possible
    swapped = edit(edit(s, "forward", t_fwd - 1, 0, Work(0, 1)), "forward", t_fwd, 0, Work(1, 0))
    with pytest.raises(ScheduleError, match=r"microbatch 0 chunk 1 \(virtual stage 2\) runs before its input"):
        check(swapped)


def test_backward_before_its_own_forward_is_rejected():
    with pytest.raises(ScheduleError, match=r"tick 0, stage 1: backward of microbatch 3 .* before its own forward"):
        check(move(S, "backward", Work(3, 0), 1, 0))


def test_backward_in_the_same_tick_as_its_output_gradient_is_rejected():
    # Stage 1 runs B0 in tick 1; stage 0 may use that gradient from tick 2, not tick 1.
    assert tick_of(S, "backward", Work(0, 0), 1) == 1
    with pytest.raises(ScheduleError, match=r"tick 1, stage 0: .* before its output gradient arrives.*from tick 2"):
        check(move(S, "backward", Work(0, 0), 0, 1))


def test_missing_backward_is_rejected():
    broken = edit(S, "backward", tick_of(S, "backward", Work(2, 0), 0), 0, None)
    with pytest.raises(ScheduleError, match=r"backward of microbatch 2 chunk 0 \(virtual stage 0\) never runs"):
        check(broken)


def test_duplicated_forward_is_rejected():
    with pytest.raises(ScheduleError, match=r"tick 5, stage 0: forward of microbatch 0 .* runs twice \(first at tick 0\)"):
        check(edit(S, "forward", 5, 0, Work(0, 0)))


def test_work_on_the_wrong_stage_is_rejected():
    # Stage 0's forward of microbatch 3 is put in stage 1's idle last tick instead.
    broken = move(S, "forward", Work(3, 0), 0, 5, to_stage=1)
    with pytest.raises(ScheduleError, match=r"stage 1: forward of microbatch 3 chunk 0 is on the wrong stage.*stage 0"):
        check(broken)


def test_the_first_violation_in_time_is_reported():
    # Two problems: stage 1's B3 moved to tick 0 and stage 0's B0 moved to tick 1; tick 0 comes first.
    broken = move(move(S, "backward", Work(0, 0), 0, 1), "backward", Work(3, 0), 1, 0)
    with pytest.raises(ScheduleError, match=r"^tick 0, stage 1"):
        check(broken)


def test_malformed_tables_are_rejected():
    with pytest.raises(ScheduleError, match="one entry per stage"):
        check(dataclasses.replace(S, forward=S.forward[:1] + (S.forward[1][:1],) + S.forward[2:]))
    with pytest.raises(ScheduleError, match="forward has 6 ticks but backward has 5"):
        check(dataclasses.replace(S, backward=S.backward[:-1]))
    with pytest.raises(ScheduleError, match="out of range"):
        check(edit(S, "forward", 5, 0, Work(4, 0)))


# ---------------------------------------------------------------------------------------------
# Bad requests


@pytest.mark.parametrize(
    "args, message",
    [
        (("1f1b", 4, 2), r"microbatches: m=2 < p=4: the pipeline cannot fill; use at least 4"),
        (("gpipe", 2, 1), r"m=1 < p=2"),
        (("interleaved", 4, 3, 2), r"m=3 < p=4"),
        (("1f1b", 2, 4, 2), r"chunks: 1f1b runs one chunk per stage; use the interleaved schedule"),
        (("gpipe", 2, 4, 3), r"chunks: gpipe runs one chunk per stage"),
        (("interleaved", 4, 6, 2), r"microbatches: .* multiple of p=4, got m=6; use 8"),
        (("interleaved", 2, 4, 0), r"chunks: need at least 1"),
        (("1f1b", 0, 4), r"stages: need at least 1"),
        (("1f1b", 2, 4.0), r"microbatches: must be an integer"),
        (("zero-bubble", 2, 4), r"schedule: unknown 'zero-bubble'; use one of 'gpipe', '1f1b', 'interleaved'"),
    ],
)
def test_bad_requests_name_the_parameter_and_the_fix(args, message):
    with pytest.raises(ScheduleError, match=message):
        make_schedule(*args)


def test_builders_validate_too():
    assert issubclass(ScheduleError, ValueError)
    with pytest.raises(ScheduleError, match="m=3 < p=4"):
        one_f_one_b(4, 3)
    with pytest.raises(ScheduleError, match="m=1 < p=2"):
        gpipe(2, 1)
    with pytest.raises(ScheduleError, match="multiple of p=2"):
        interleaved(2, 3, 2)


# ---------------------------------------------------------------------------------------------
# Compiled programs, executed by a symbolic simulator of the ring


def simulate(program: Program) -> tuple[int, int]:
    """Run ``program`` on symbolic values and return the most stash/grad slots live at once.

    A program that keeps residuals must consume each stashed input at its forward, park the
    forward's residuals ``("r", mb, k)`` in a residual slot and read them back at the backward.

    A stage's input activation is ``("x", mb, k)`` (``("tokens", mb)`` for virtual stage 0) and
    the gradient a stage needs is ``("dy", mb, k)``. Messages sent in tick t travel along the ring
    and are offered to the receiver at the start of tick t + 1; anything not stored is lost.
    """
    sched = program.schedule
    p, m, last = sched.stages, sched.microbatches, sched.stages * sched.chunks - 1
    stash = [[None] * program.stash_slots for _ in range(p)]
    grads = [[None] * program.grad_slots for _ in range(p)]
    weights = [[None] * program.weight_slots for _ in range(p)]  # split backward: what B leaves for W
    kept = [[None] * program.residual_slots for _ in range(p)]  # no recomputation: forward -> backward
    rerun = [[None] * program.recompute_slots for _ in range(p)]  # hoisted recomputation -> next tick's backward
    to_next: list = [None] * p  # to_next[s]: activation stage s sent to stage s + 1 last tick
    to_prev: list = [None] * p  # to_prev[s]: gradient stage s sent to stage s - 1 last tick
    forwarded, backwarded, weighted = set(), set(), set()
    peak_stash = peak_grads = 0

    def store(buffer, slot, value, what):
        if value is None:
            assert slot == -1, f"{what}: a slot is reserved but nothing arrives"
            return
        assert 0 <= slot < len(buffer), f"{what}: {value} arrives but no valid slot receives it ({slot})"
        assert buffer[slot] is None, f"{what}: {value} overwrites live {buffer[slot]}"
        buffer[slot] = value

    def take(buffer, slot, expected, what):
        assert 0 <= slot < len(buffer), f"{what}: needs {expected} but reads slot {slot}"
        assert buffer[slot] == expected, f"{what}: needs {expected}, slot {slot} holds {buffer[slot]}"
        buffer[slot] = None

    for t in range(sched.ticks):
        for s in range(p):
            store(stash[s], program.recv_fwd_slot[t, s], to_next[(s - 1) % p], f"tick {t} stage {s} recv fwd")
            store(grads[s], program.recv_bwd_slot[t, s], to_prev[(s + 1) % p], f"tick {t} stage {s} recv bwd")
        peak_stash = max(peak_stash, *(sum(x is not None for x in buf) for buf in stash))
        peak_grads = max(peak_grads, *(sum(x is not None for x in buf) for buf in grads))
        to_next, to_prev = [None] * p, [None] * p
        for s in range(p):
            where = f"tick {t} stage {s}"
            mb, chunk = int(program.fwd_mb[t, s]), int(program.fwd_chunk[t, s])
            if mb >= 0:
                k = chunk * p + s
                assert (mb, k) not in forwarded, f"{where}: forward of {(mb, k)} twice"
                if k == 0:
                    assert program.fwd_slot[t, s] == -1, f"{where}: virtual stage 0 reads tokens"
                elif program.keeps_residuals:  # consumed: the residuals replace it
                    take(stash[s], int(program.fwd_slot[t, s]), ("x", mb, k), f"{where}: forward input")
                else:  # read, but keep: the backward recomputes from the same input
                    slot = int(program.fwd_slot[t, s])
                    assert 0 <= slot < len(stash[s]) and stash[s][slot] == ("x", mb, k), f"{where}: forward input"
                if program.keeps_residuals:
                    store(kept[s], int(program.fwd_res_slot[t, s]), ("r", mb, k), f"{where}: forward residuals")
                else:
                    assert program.fwd_res_slot[t, s] == -1, f"{where}: nothing kept when recomputing"
                forwarded.add((mb, k))
                assert program.fwd_send[t, s] == int(k < last), f"{where}: fwd_send"
                if k < last:
                    to_next[s] = ("x", mb, k + 1)
            else:
                assert program.fwd_chunk[t, s] == program.fwd_slot[t, s] == -1 and program.fwd_send[t, s] == 0
            mb, chunk = int(program.pre_mb[t, s]), int(program.pre_chunk[t, s])
            if mb >= 0:  # a hoisted recomputation: next tick's backward, from the stash, after this forward
                k = chunk * p + s
                assert (mb, k) in forwarded, f"{where}: rerun of {(mb, k)} before its forward"
                assert sched.backward[t + 1][s] == Work(mb, chunk), f"{where}: rerun"
                assert not program.keeps_residuals and sched.backward[t][s] is None, f"{where}: rerun beside a B"
                if k == 0:
                    assert program.pre_stash_slot[t, s] == -1, f"{where}: virtual stage 0 reruns from tokens"
                else:
                    take(stash[s], int(program.pre_stash_slot[t, s]), ("x", mb, k), f"{where}: rerun input")
                store(rerun[s], int(program.pre_res_slot[t, s]), ("h", mb, k), f"{where}: rerun residuals")
            else:
                assert program.pre_chunk[t, s] == program.pre_stash_slot[t, s] == program.pre_res_slot[t, s] == -1
            mb, chunk = int(program.bwd_mb[t, s]), int(program.bwd_chunk[t, s])
            if mb >= 0:
                k = chunk * p + s
                assert (mb, k) in forwarded, f"{where}: backward of {(mb, k)} before its forward"
                assert (mb, k) not in backwarded, f"{where}: backward of {(mb, k)} twice"
                if program.keeps_residuals:
                    assert program.bwd_stash_slot[t, s] == -1, f"{where}: nothing to recompute from"
                    if sched.split_backward:  # B reads them; W reads them again and frees the slot
                        slot = int(program.bwd_res_slot[t, s])
                        assert 0 <= slot < len(kept[s]) and kept[s][slot] == ("r", mb, k), f"{where}: B's residuals"
                    else:
                        take(kept[s], int(program.bwd_res_slot[t, s]), ("r", mb, k), f"{where}: backward residuals")
                elif program.bwd_pre_slot[t, s] >= 0:
                    assert program.bwd_stash_slot[t, s] == -1, f"{where}: rerun last tick"
                    take(rerun[s], int(program.bwd_pre_slot[t, s]), ("h", mb, k), f"{where}: rerun residuals")
                elif k == 0:
                    assert program.bwd_stash_slot[t, s] == -1, f"{where}: virtual stage 0 recomputes from tokens"
                elif sched.split_backward:  # B recomputes from it; W recomputes from it again and frees the slot
                    slot = int(program.bwd_stash_slot[t, s])
                    assert 0 <= slot < len(stash[s]) and stash[s][slot] == ("x", mb, k), f"{where}: B's input"
                else:
                    take(stash[s], int(program.bwd_stash_slot[t, s]), ("x", mb, k), f"{where}: backward input")
                if k == last:
                    assert program.bwd_grad_slot[t, s] == -1, f"{where}: the last virtual stage seeds from the loss"
                else:
                    take(grads[s], int(program.bwd_grad_slot[t, s]), ("dy", mb, k), f"{where}: backward gradient")
                backwarded.add((mb, k))
                if sched.split_backward:
                    store(weights[s], int(program.bwd_weight_slot[t, s]), ("w", mb, k), f"{where}: B's boundary")
                else:
                    assert program.bwd_weight_slot[t, s] == -1, f"{where}: a fused backward leaves nothing for W"
                assert program.bwd_send[t, s] == int(k > 0), f"{where}: bwd_send"
                if k > 0:
                    to_prev[s] = ("dy", mb, k - 1)
            else:
                assert program.bwd_chunk[t, s] == program.bwd_stash_slot[t, s] == program.bwd_grad_slot[t, s] == -1
                assert program.bwd_send[t, s] == 0
            mb, chunk = int(program.wgt_mb[t, s]), int(program.wgt_chunk[t, s])
            if mb >= 0:  # W: after its own B (this tick or earlier), from the slot B filled
                k = chunk * p + s
                take(weights[s], int(program.wgt_slot[t, s]), ("w", mb, k), f"{where}: weight gradient")
                if program.keeps_residuals:
                    take(kept[s], int(program.wgt_res_slot[t, s]), ("r", mb, k), f"{where}: W's residuals")
                    assert program.wgt_stash_slot[t, s] == -1, f"{where}: W reads the kept residuals"
                else:
                    assert program.wgt_res_slot[t, s] == -1, f"{where}: no residuals when recomputing"
                    if k == 0:
                        assert program.wgt_stash_slot[t, s] == -1, f"{where}: virtual stage 0 recomputes from tokens"
                    else:
                        take(stash[s], int(program.wgt_stash_slot[t, s]), ("x", mb, k), f"{where}: W's input")
                weighted.add((mb, k))
    everything = {(mb, k) for mb in range(m) for k in range(last + 1)}
    assert forwarded == everything and backwarded == everything
    assert weighted == (everything if sched.split_backward else set())
    assert to_next == [None] * p and to_prev == [None] * p, "a value is sent in the last tick and lost"
    assert all(x is None for buf in stash + grads + weights + kept + rerun for x in buf), "a buffer slot is never freed"
    return peak_stash, peak_grads


@pytest.mark.parametrize("case", CASES + EXTRA + BOUNDED, ids=ids)
def test_compiled_program_moves_the_right_values(case):
    program = compile_program(make_schedule(*case))
    peak_stash, peak_grads = simulate(program)
    # The buffers are exactly as large as needed: no slot is allocated that is never used at once.
    assert (program.stash_slots, program.grad_slots) == (peak_stash, peak_grads)


@pytest.mark.parametrize("case", CASES + BOUNDED, ids=ids)
def test_program_keeping_residuals_moves_the_right_values(case):
    # parallel.recompute=false: each stashed input lives until its forward only, the residuals from
    # the forward to the backward (split: to the weight gradient, which reads them too), in as many
    # slots as the table has microbatches in flight (split: forwarded and not yet through W).
    program = compile_program(make_schedule(*case), keep_residuals=True)
    peak_stash, _ = simulate(program)
    assert program.stash_slots == peak_stash
    stats = check(program.schedule)
    assert program.residual_slots == max(stats.peak_until_weight)
    if not program.schedule.split_backward:
        assert stats.peak_until_weight == stats.peak_in_flight
    assert (program.bwd_stash_slot == -1).all()


def test_simulator_catches_a_wrong_slot():
    # Guard against a vacuous simulator: corrupt one read and it must object.
    program = compile_program(one_f_one_b(2, 4))
    fwd_slot = program.fwd_slot.copy()
    t = int(np.argwhere(fwd_slot[:, 1] >= 0)[1, 0])  # stage 1's second forward
    fwd_slot[t, 1] = 1 - fwd_slot[t, 1]
    with pytest.raises(AssertionError, match="forward input"):
        simulate(dataclasses.replace(program, fwd_slot=fwd_slot))


def test_program_arrays_are_read_only_int32_ticks_by_stages():
    program = compile_program(interleaved(2, 4, 2))
    for field in dataclasses.fields(Program):
        value = getattr(program, field.name)
        if isinstance(value, np.ndarray):
            assert value.dtype == np.int32 and value.shape == (program.schedule.ticks, 2), field.name
            assert not value.flags.writeable, field.name


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("p", [2, 4])
def test_buffer_sizes_do_not_grow_with_microbatches(name, v, p):
    small = compile_program(make_schedule(name, p, 2 * p, v))
    large = compile_program(make_schedule(name, p, 8 * p, v))
    assert (small.stash_slots, small.grad_slots) == (large.stash_slots, large.grad_slots)


def test_gpipe_buffers_grow_with_microbatches():
    assert compile_program(gpipe(2, 8)).stash_slots > compile_program(gpipe(2, 4)).stash_slots


# ---------------------------------------------------------------------------------------------
# Rendering


def test_render_1f1b():
    assert render(one_f_one_b(2, 4)).splitlines() == [
        "stage 0: F0   F1   F2B0 F3B1 B2   B3",
        "stage 1: .    F0B0 F1B1 F2B2 F3B3 .",
    ]


def test_render_shows_chunks_when_interleaved():
    # Stage 1 chunk 1 is the last virtual stage: it turns each microbatch around in one tick.
    assert render(interleaved(2, 2, 2)).splitlines() == [
        "stage 0: F0.0     F1.0     F0.1     F1.1     B0.1     B1.1     B0.0     B1.0",
        "stage 1: .        F0.0     F1.0     F0.1B0.1 F1.1B1.1 B0.0     B1.0     .",
    ]


# ---------------------------------------------------------------------------------------------
# Zero bubble and p-in-flight 1F1B


@pytest.mark.parametrize("case", [c for c in BOUNDED if c[0] == "zb-h1"], ids=ids)
def test_zb_h1_bubble_is_exactly_a_third_of_1f1bs_with_1f1bs_stash(case):
    _, p, m, _ = case
    schedule = make_schedule("zb-h1", p, m)
    stats = check(schedule)
    assert stats.ticks == 3 * m + p - 1
    assert abs(stats.bubble_fraction - (p - 1) / (3 * m)) < 1e-12 and abs(stats.ideal_bubble - (p - 1) / (3 * m)) < 1e-12
    assert stats.peak_in_flight == tuple(p - s for s in range(p))  # stage 0 holds p, as Megatron's 1F1B
    # The paper's memory claim: no stage holds more forwards awaiting their W than 1F1B's stage 0
    # holds awaiting their backward (residuals kept until W), and stage s defers s weight gradients.
    assert stats.peak_until_weight == (min(p, m),) * p
    assert stats.peak_weight_pending == tuple(min(s + 1, m) for s in range(p))
    assert schedule.split_backward and not make_schedule("1f1b", max(p, 1), m).split_backward


def test_zb_h1_bubble_follows_the_papers_formula_for_other_costs():
    # Qi et al.: (p-1)(t_F + t_B - t_W) over m(t_F + t_B + t_W); with t_W = 0 it is 1F1B's bubble.
    stats = check(make_schedule("zb-h1", 4, 8), Costs(forward=1.0, backward=1.0, weight=0.5))
    assert stats.ideal_bubble == pytest.approx(3 * 1.5 / (8 * 2.5))
    assert stats.bubble_fraction >= stats.ideal_bubble - 1e-12


@pytest.mark.parametrize("case", [c for c in BOUNDED if c[0] == "1f1b-p"], ids=ids)
def test_p_in_flight_1f1b_holds_at_most_p_microbatches_on_stage_0(case):
    _, p, m, _ = case
    stats = check(make_schedule("1f1b-p", p, m))
    assert stats.peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert stats.peak_in_flight[0] <= p == stats.megatron_peak_in_flight_stage0 or m < p


@pytest.mark.parametrize("case", [c for c in BOUNDED if c[0] == "1f1b-p" and c[1] > 1] + [("1f1b-p", 4, 32, 1)],
                         ids=ids)
def test_phased_1f1b_p_runs_as_fast_as_1f1b_when_recomputing(case):
    # Stage s alternates forward and backward ticks (forwards where tick - s is even), so a gradient's
    # round trip spans p - s forwards: Megatron's bound. With unit costs its backward ticks set the
    # pace; under full recomputation (t_R = t_F) every backward's rerun is hoisted into the forward
    # tick before it, and both kinds of tick cost 2 t_F: 4m + 3(p - 1), where the lockstep 1F1B,
    # whose every steady tick holds a forward, a rerun and a backward, takes 4m + 4(p - 1).
    _, p, m, _ = case
    phased, lockstep = make_schedule("1f1b-p", p, m), make_schedule("1f1b", p, m)
    assert check(phased).peak_in_flight == tuple(p - s for s in range(p))
    assert phased.ticks == 2 * (m + p - 1)
    assert check(phased).bubble_fraction == pytest.approx((m + 3 * p - 4) / (3 * m))
    backwards = {(t, s) for t, row in enumerate(phased.backward) for s, work in enumerate(row) if work is not None}
    assert hoisted_recomputes(phased) == backwards
    recompute = Costs(recompute=1.0)
    assert run_time(phased, recompute) == 4 * m + 3 * (p - 1)
    assert run_time(lockstep, recompute) == 4 * m + 4 * (p - 1)
    assert check(phased, recompute).bubble_fraction == pytest.approx(3 * (p - 1) / (4 * m))
    assert check(phased, recompute).bubble_fraction <= check(lockstep, recompute).bubble_fraction
    # Without the hoist a backward tick would cost t_R + t_B + t_W = 3: slower than 1F1B.
    assert run_time(phased, recompute, hoist=False) > run_time(lockstep, recompute)


@pytest.mark.parametrize("case", CASES + EXTRA + [c for c in BOUNDED if c[0] != "1f1b-p"], ids=ids)
def test_other_schedules_hoist_no_recomputation(case):
    # The lockstep 1F1B, GPipe and interleaved tables run a backward in every tick of their steady state
    # (hoisting their first backwards' reruns would save no time and cost a residual slot); a split
    # backward is never hoisted.
    program = compile_program(make_schedule(*case))
    assert not hoisted_recomputes(program.schedule) and program.recompute_slots == 0
    assert (program.pre_mb == -1).all() and (program.bwd_pre_slot == -1).all()


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_phased_1f1b_p_program_reruns_every_backward_a_tick_early_in_one_slot(p, m):
    program = compile_program(make_schedule("1f1b-p", p, m))
    backward = program.bwd_mb >= 0
    assert program.recompute_slots == 1 and (program.bwd_pre_slot[backward] == 0).all()
    assert (program.bwd_stash_slot == -1).all()  # the rerun read (and freed) the stash a tick earlier
    assert (program.pre_mb[:-1] == program.bwd_mb[1:]).all() and (program.pre_mb[-1] == -1).all()
    # The stash: stage 1 holds p - 1 stage inputs; stage 0 reruns from tokens.
    assert program.stash_slots == p - 1
    kept = compile_program(make_schedule("1f1b-p", p, m), keep_residuals=True)  # nothing recomputed
    assert kept.recompute_slots == 0 and kept.residual_slots == p


def test_weight_gradient_before_its_input_gradient_is_named():
    schedule = make_schedule("zb-h1", 2, 2)
    rows = [list(row) for row in schedule.weight]
    first_w = next(t for t, row in enumerate(rows) if row[1] is not None)
    work, rows[first_w][1] = rows[first_w][1], None
    rows[0][1] = work  # stage 1's first W moved to tick 0, before any backward
    broken = dataclasses.replace(schedule, weight=tuple(map(tuple, rows)))
    with pytest.raises(ScheduleError, match=r"^tick 0, stage 1: weight gradient of microbatch 0 .* before its own "
                                            r"input-gradient backward"):
        check(broken)


def test_render_shows_weight_gradients():
    text = render(make_schedule("zb-h1", 2, 2))
    assert text.splitlines()[0].split() == ["stage", "0:", "F0", "F1", ".", "B0", "W0", "B1", "W1"]


TORCH_TABLES = sorted(Path(__file__).parent.glob("fixtures/torch_schedules/*_v2.csv"))


@pytest.mark.parametrize("path", TORCH_TABLES, ids=lambda p: p.stem)
@pytest.mark.parametrize("keep", [False, True])
def test_torchs_tables_compile_into_programs_that_move_the_right_values(path, keep):
    # Interleaved zero bubble splits the backward with two chunks per stage; looped BFS runs every
    # microbatch through a chunk before the next: orders no built-in table has.
    program = compile_program(to_schedule(read_csv(path)), keep_residuals=keep)
    peak_stash, peak_grads = simulate(program)
    assert program.grad_slots == peak_grads and program.stash_slots == peak_stash


def test_the_lockstep_bound_search_admits_zb_h1_and_finds_its_ticks_optimal():
    # benchmarks/zero_bubble_bound.py's exact search over lockstep tables with ZB-H1's bounds: with
    # unit costs nothing beats ZB-H1's 3m + p - 1 ticks, with unequal costs it never prices above
    # ZB-H1 (whose table it admits), and ZB-H1's order run without ticks takes as long as its table.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import zero_bubble_bound as bound

    from meshtron.pipeline.schedules import zb_h1_order
    from meshtron.pipeline.table import run_time

    measured = Costs(forward=22.0, backward=31.1, weight=34.7)  # this machine's t_F, t_B, t_W (ms)
    for m in (2, 3, 4):
        assert bound.best_lockstep_time(2, m, Costs()) == 3 * m + 1
        assert bound.best_lockstep_time(2, m, measured) <= run_time(make_schedule("zb-h1", 2, m), measured) + 1e-9
        units = {"F": 1.0, "B": 1.0, "W": 1.0, "X": 2.0}
        assert bound.asynchronous_time([zb_h1_order(2, m, s) for s in range(2)], units) == 3 * m + 1
        assert bound.asynchronous_time([bound.one_f_one_b_order(2, m, s) for s in range(2)], units) == 3 * (m + 1)
