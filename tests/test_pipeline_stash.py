"""The pipeline stash holds what the table needs and no more, counted from the table alone, and how that
compares with Megatron's 1F1B.

A stage input is *needed* on its stage from the tick it arrives (it is written into a stash slot at the
tick's start) through its last read: the backward that recomputes from it (a tick earlier where the
program hoists that recomputation; with a split backward, the weight gradient, which recomputes the
layers' residuals from it), or, when nothing is recomputed (a forward-only table, kept residuals), its
forward. A slot freed in a tick is reused by a
later tick's arrival. Every stage gets the same buffer (one SPMD program), so the program's
``stash_slots`` is the most any stage needs.
"""

from __future__ import annotations

import pytest

from meshtron.pipeline.schedules import check, compile_program, make_schedule
from meshtron.pipeline.table import hoisted_recomputes


def stash_needed(name: str, p: int, m: int, chunks: int = 1, keep: bool = False) -> int:
    """Most stage inputs any stage holds at once, from the table alone."""
    sched = make_schedule(name, p, m, chunks)
    last = p * sched.chunks - 1
    arrival, last_read = {}, {}
    reader = (sched.forward if sched.forward_only or keep
              else sched.weight if sched.split_backward else sched.backward)
    early = frozenset() if keep else hoisted_recomputes(sched)
    for tick in range(sched.ticks):
        for stage in range(p):
            sent = sched.forward[tick][stage]
            if sent is not None and sent.chunk * p + stage < last:
                arrival[(sent.microbatch, sent.chunk * p + stage + 1)] = tick + 1
            work = reader[tick][stage]
            if work is not None:
                last_read[(work.microbatch, work.chunk * p + stage)] = tick - ((tick, stage) in early)
    return max(sum(1 for key, t in arrival.items() if key[1] % p == stage and t <= tick <= last_read[key])
               for stage in range(p) for tick in range(sched.ticks))


CASES = [(name, p, m) for name in ("1f1b", "1f1b-p", "zb-h1", "gpipe") for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("case", CASES + [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)], ids=str)
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_stash_slots_are_what_the_table_needs(case, keep):
    program = compile_program(make_schedule(*case), keep_residuals=keep)
    assert program.stash_slots == stash_needed(*case, keep=keep)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_lockstep_1f1b_stashes_2p_minus_3_stage_inputs_where_megatron_holds_p(p):
    # The 2p - 3 is the table's, not the buffer's: stage 0 recomputes from tokens (no stash), and stage 1
    # holds 2(p - 1) - 1 microbatches in lockstep, since a gradient's round trip from stage 1 to the last
    # stage and back takes 2(p - 2) ticks of one forward each. Megatron's asynchronous 1F1B holds p on
    # stage 0 and p - 1 on stage 1; the tables with that bound (1f1b-p, zb-h1) pay for it in ticks.
    for m in (2 * p, 4 * p):
        stats = check(make_schedule("1f1b", p, m))
        assert stats.peak_in_flight == tuple(2 * (p - s) - 1 for s in range(p))
        assert stats.megatron_peak_in_flight_stage0 == p
        assert compile_program(make_schedule("1f1b", p, m)).stash_slots == max(2 * p - 3, 1)


@pytest.mark.parametrize("name", ["1f1b-p", "zb-h1"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_megatron_bound_tables_hold_p_minus_s_in_flight(name, p):
    # Megatron's bound, p - s on stage s. ZB-H1's stash also holds an arrival that waits for its forward
    # while the stage is at its bound: p slots (p - 1 in flight on stage 1 and one waiting), 2 at p = 2.
    # 1F1B-p's arrivals come just in time and its reruns, hoisted a tick early, free their slot there:
    # p - 1 (stage 1's in flight).
    stats = check(make_schedule(name, p, 4 * p))
    assert stats.peak_in_flight == tuple(p - s for s in range(p))
    assert compile_program(make_schedule(name, p, 4 * p)).stash_slots == (p - 1 if name == "1f1b-p" else p)


def test_a_run_hoists_1f1b_ps_reruns_unless_a_ring_attention_runs_the_stages_in_lockstep():
    # In lockstep every stage computes every slot of every tick: a hoisted rerun would balance nothing.
    from meshtron.config import load_config
    from meshtron.run import resolve_run

    base = ["parallel.schedule=1f1b-p", "parallel.chunks=1", "parallel.data=1", "parallel.context=2"]
    gathered = resolve_run(load_config("llama_cpu8", base), 8).program
    ring = resolve_run(load_config("llama_cpu8", [*base, "parallel.context_attention=ring"]), 8).program
    kept = resolve_run(load_config("llama_cpu8", [*base, "parallel.recompute=false"]), 8).program
    assert gathered.hoists_recompute and gathered.recompute_slots == 1
    assert not ring.hoists_recompute and not kept.hoists_recompute and kept.keeps_residuals
