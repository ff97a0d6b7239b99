"""Schedule tables: exact bubbles, bounded in-flight activations, a checker that catches broken
tables, and per-tick programs verified by a symbolic simulation of the ring."""

import dataclasses

import pytest

from meshtron.pipeline.schedules import (
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

CASES = [(name, p, m, v) for p in (2, 4) for m in (p, 2 * p, 4 * p)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))]


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_generated_tables_are_valid_with_exact_bubbles(name, p, m, v):
    stats = check(make_schedule(name, p, m, v))
    assert stats.bubble_fraction == pytest.approx((p - 1) / (v * m), abs=1e-12)
    assert stats.ideal_bubble == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p", [2, 4])
def test_in_flight_activations(p):
    # GPipe holds all m microbatches; 1F1B and interleaved hold a bounded number whatever m is.
    for m in (p, 2 * p, 4 * p):
        assert check(gpipe(p, m)).peak_in_flight[0] == m
    assert check(one_f_one_b(p, 2 * p)).peak_in_flight == check(one_f_one_b(p, 8 * p)).peak_in_flight
    assert check(one_f_one_b(p, 8 * p)).peak_in_flight[0] == 2 * p - 1  # lockstep; Megatron's async: p
    assert check(one_f_one_b(p, 8 * p)).megatron_peak_in_flight_stage0 == p
    stats = check(interleaved(p, 8 * p, 2))
    assert stats.peak_in_flight == check(interleaved(p, 2 * p, 2)).peak_in_flight
    assert stats.peak_in_flight[0] == stats.megatron_peak_in_flight_stage0 == 2 * (p - 1) + p + 1


def test_interleaved_with_one_chunk_is_1f1b():
    a, b = interleaved(4, 8, 1), one_f_one_b(4, 8)
    assert (a.forward, a.backward) == (b.forward, b.backward)


def edit(schedule, table, tick, stage, work):
    rows = [list(r) for r in getattr(schedule, table)]
    rows[tick][stage] = work
    return dataclasses.replace(schedule, **{table: tuple(map(tuple, rows))})


def find(schedule, table, work, stage):
    return next(t for t, row in enumerate(getattr(schedule, table)) if row[stage] == work)


def test_checker_rejects_broken_tables():
    s = one_f_one_b(2, 4)
    # Stage 1 runs microbatch 0's forward in the same tick stage 0 produces its input: too early.
    t0 = find(s, "forward", Work(0, 0), 0)
    broken = edit(edit(s, "forward", find(s, "forward", Work(0, 0), 1), 1, None), "forward", t0, 1, Work(0, 0))
    with pytest.raises(ScheduleError, match="before its input arrives"):
        check(broken)
    # A backward before its own forward.
    tb = find(s, "backward", Work(3, 0), 1)
    broken = edit(edit(s, "backward", tb, 1, None), "backward", 0, 1, Work(3, 0))
    with pytest.raises(ScheduleError, match="before its own forward"):
        check(broken)
    # Swap stage 0's backwards of microbatches 0 and 1: microbatch 1's now runs in the very tick
    # stage 1 produces its output gradient.
    t0, t1 = find(s, "backward", Work(0, 0), 0), find(s, "backward", Work(1, 0), 0)
    assert find(s, "backward", Work(1, 0), 1) == t0
    broken = edit(edit(s, "backward", t0, 0, Work(1, 0)), "backward", t1, 0, Work(0, 0))
    with pytest.raises(ScheduleError, match="before its output gradient arrives"):
        check(broken)
    with pytest.raises(ScheduleError, match="backward of microbatch 2 .* never runs"):
        check(edit(s, "backward", find(s, "backward", Work(2, 0), 0), 0, None))
    with pytest.raises(ScheduleError, match="runs twice"):
        check(edit(s, "forward", s.ticks - 1, 0, Work(0, 0)))


@pytest.mark.parametrize(
    "args, message",
    [
        (("1f1b", 4, 2), "m=2 < p=4"),
        (("1f1b", 2, 4, 2), "use the interleaved schedule"),
        (("interleaved", 4, 6, 2), "multiple of p=4"),
        (("zero-bubble", 2, 4), "unknown 'zero-bubble'"),
    ],
)
def test_bad_requests(args, message):
    with pytest.raises(ScheduleError, match=message):
        make_schedule(*args)


def simulate(program):
    """Run the program on symbolic values: an activation is ("act", mb, k), a gradient ("grad", mb, k)."""
    sched = program.schedule
    p, last = sched.stages, sched.stages * sched.chunks - 1
    stash = [[None] * max(program.stash_slots, 1) for _ in range(p)]
    gbuf = [[None] * max(program.grad_slots, 1) for _ in range(p)]
    f_msg, b_msg = [None] * p, [None] * p
    done_f, done_b = set(), set()
    for t in range(sched.ticks):
        for s in range(p):
            if program.recv_fwd_slot[t, s] >= 0:
                assert stash[s][program.recv_fwd_slot[t, s]] is None, "stash slot overwritten while live"
                stash[s][program.recv_fwd_slot[t, s]] = f_msg[(s - 1) % p]
            if program.recv_bwd_slot[t, s] >= 0:
                assert gbuf[s][program.recv_bwd_slot[t, s]] is None, "grad slot overwritten while live"
                gbuf[s][program.recv_bwd_slot[t, s]] = b_msg[(s + 1) % p]
        out_f, out_b = [None] * p, [None] * p
        for s in range(p):
            mb, c = program.fwd_mb[t, s], program.fwd_chunk[t, s]
            if mb >= 0:
                k = c * p + s
                x = ("tokens", mb) if k == 0 else stash[s][program.fwd_slot[t, s]]
                assert x == (("tokens", mb) if k == 0 else ("act", mb, k - 1))
                done_f.add((mb, k))
                out_f[s] = ("act", mb, k) if program.fwd_send[t, s] else None
            mb, c = program.bwd_mb[t, s], program.bwd_chunk[t, s]
            if mb >= 0:
                k = c * p + s
                assert (mb, k) in done_f
                if k > 0:
                    slot = program.bwd_stash_slot[t, s]
                    assert stash[s][slot] == ("act", mb, k - 1)
                    stash[s][slot] = None
                if k < last:
                    slot = program.bwd_grad_slot[t, s]
                    assert gbuf[s][slot] == ("grad", mb, k + 1)
                    gbuf[s][slot] = None
                done_b.add((mb, k))
                out_b[s] = ("grad", mb, k) if program.bwd_send[t, s] else None
        f_msg, b_msg = out_f, out_b
    everything = {(mb, k) for mb in range(sched.microbatches) for k in range(last + 1)}
    assert done_f == everything and done_b == everything


@pytest.mark.parametrize("name, p, m, v", CASES)
def test_compiled_programs_move_the_right_values(name, p, m, v):
    simulate(compile_program(make_schedule(name, p, m, v)))


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2)])
def test_buffer_sizes_do_not_grow_with_microbatches(name, v):
    small, large = compile_program(make_schedule(name, 2, 4, v)), compile_program(make_schedule(name, 2, 16, v))
    assert (small.stash_slots, small.grad_slots) == (large.stash_slots, large.grad_slots)


def test_render_draws_ticks_by_stages():
    assert render(one_f_one_b(2, 4)).splitlines() == [
        "stage 0: F0   F1   F2B0 F3B1 B2   B3",
        "stage 1: .    F0B0 F1B1 F2B2 F3B3 .",
    ]
