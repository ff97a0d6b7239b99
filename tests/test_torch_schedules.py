"""PyTorch's pipeline action lists: meshtron reads the CSVs torch's own schedules write (fixtures made
by torch's code, see fixtures/torch_schedules/generate.py; no torch needed here), runs those its
one-program runtime can run with the unpipelined model's gradients, refuses the others with the
reason, and writes its own tables in the same format."""

from pathlib import Path

import pytest

from meshtron.config import ConfigError, ModelConfig, load_config
from meshtron.pipeline.schedules import SCHEDULES, ScheduleError, check, make_schedule
from meshtron.pipeline.torch_actions import (
    Action,
    from_schedule,
    parse_action,
    read_csv,
    to_schedule,
    write_csv,
)
from meshtron.run import resolve_run
from meshtron.testing import Layout, check_parity
from meshtron.train.state import model_def_from_config

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "torch_schedules"
SMALL = ModelConfig(vocab_size=256, hidden=32, heads=4, layers=8, mlp_dim=64, seq_len=16)


def fixture(stem: str) -> str:
    return str(FIXTURES / f"{stem}.csv")


def test_cells_are_read_as_torch_writes_them():
    assert parse_action("2F0") == [Action(2, "F", 0)]
    assert parse_action(" 11I13 ") == [Action(11, "I", 13)]
    assert parse_action("(0F3;3B1)OVERLAP_F_B") == [Action(0, "F", 3), Action(3, "B", 1)]
    assert parse_action("") == [] and parse_action("0SEND_F1") == [] and parse_action("2REDUCE_GRAD") == []
    assert str(Action(3, "W", 7)) == "3W7"
    with pytest.raises(ScheduleError, match=r"'F0' is not PyTorch's \[stage\]\[kind\]\[microbatch\] form"):
        parse_action("F0")
    with pytest.raises(ScheduleError, match="a W action needs a microbatch index, e.g. 0W0"):
        parse_action("0W")


def test_bad_files_name_the_file_rank_and_column(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1\n1F0,1X1\n")
    with pytest.raises(ScheduleError, match=r"bad.csv: rank 1 \(row 2\), column 2: action '1X1'"):
        read_csv(bad)
    with pytest.raises(ScheduleError, match="cannot read a PyTorch action CSV"):
        read_csv(tmp_path / "missing.csv")
    (tmp_path / "empty.csv").write_text("\n")
    with pytest.raises(ScheduleError, match="no actions; expected one row of actions"):
        read_csv(tmp_path / "empty.csv")


CASES = [(name, p, m, 2 if name == "interleaved" else 1) for name in SCHEDULES for p, m in [(2, 4), (4, 8), (3, 5)]
         if not (name == "interleaved" and m % p)]


def stage_orders(table) -> list[list[tuple]]:
    """Each stage's work in the order it runs (forward, backward, weight gradient within a tick)."""
    kinds = [("F", table.forward), ("B", table.backward), ("W", table.weight_table)]
    return [[(kind, work.microbatch, work.chunk) for tick in range(table.ticks) for kind, cells in kinds
             if (work := cells[tick][stage]) is not None] for stage in range(table.stages)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_meshtrons_tables_round_trip_through_torchs_format(case, tmp_path):
    # Torch's format holds each rank's order, not ticks: read back, every stage keeps its order, and a
    # table laid out as soon as each op is ready comes back tick for tick. The phased 1f1b-p leaves a
    # tick between a stage's forwards on purpose (its p - s bound), which the order cannot say.
    table = make_schedule(*case)
    path = write_csv(from_schedule(table), tmp_path / "s.csv")
    back = to_schedule(read_csv(path), table.name)
    assert stage_orders(back) == stage_orders(table)
    if table.name != "1f1b-p":
        assert back == table


# Each fixture of torch's own schedules: runs here (its table passes the checker) or is refused with the reason.
VERDICTS = {
    "gpipe_p2_m4": "runs",
    "1f1b_p2_m4": "the forward of stage 1 (rank 1) never runs microbatch 0; runs microbatch 4 which stage 0 "
                  "never forwards (stage 0 forwards microbatches 0..3)",
    "1f1b_p4_m8": "the forward of stage 3 (rank 3) never runs microbatch 0; runs microbatch 8",
    "interleaved1f1b_p2_m4_v2": "runs",
    "interleaved1f1b_p4_m8_v2": "runs",
    "loopedbfs_p2_m4_v2": "runs",
    "interleavedzerobubble_p2_m4_v2": "runs",
    "interleavedzerobubble_p2_m4_v2_comms": "runs",
    "interleavedzerobubble_p4_m8_v2": "runs",
    "zbv_p2_m4": "rank 0 runs stage 3 (3F0, action 4 of its list), but meshtron runs stage k on rank k mod p = 1 "
                 "(loop placement: the ring carries stage k's output to rank k+1); this is a V placement",
    "dualpipev_p2_m4": "rank 0 runs stage 3 (3F0, action 4 of its list)",
}


def test_every_fixture_has_a_verdict():
    assert sorted(p.stem for p in FIXTURES.glob("*.csv")) == sorted(VERDICTS)


@pytest.mark.parametrize("stem", sorted(VERDICTS))
def test_torchs_schedules_run_or_are_refused_with_the_reason(stem):
    verdict = VERDICTS[stem]
    if verdict != "runs":
        with pytest.raises(ScheduleError) as err:
            to_schedule(read_csv(fixture(stem)), stem)
        assert str(err.value).startswith(f"{stem}: {verdict}")
        return
    rows = read_csv(fixture(stem))
    table = to_schedule(rows, stem)
    check(table)
    # Every rank runs its actions in torch's order; where torch's list keeps its idle steps (the
    # multi-stage schedules' compute-only form), in no more steps than torch's own timeline.
    back = from_schedule(table)
    assert [[a for a in row if a] for row in back] == [[a for a in row if a] for row in rows]
    if stem.endswith("_v2"):
        assert table.ticks <= max(len(row) for row in rows)
    assert table.split_backward == ("zerobubble" in stem)


@pytest.mark.parametrize("stem, name, p, m, v", [("gpipe_p2_m4", "gpipe", 2, 4, 1),
                                                 ("interleaved1f1b_p2_m4_v2", "interleaved", 2, 4, 2),
                                                 ("interleaved1f1b_p4_m8_v2", "interleaved", 4, 8, 2)])
def test_torchs_gpipe_and_interleaved_1f1b_are_meshtrons_tables(stem, name, p, m, v):
    # So the equivalence tests of meshtron's own gpipe and interleaved schedules cover them.
    assert to_schedule(read_csv(fixture(stem)), name) == make_schedule(name, p, m, v)


def test_lowered_csv_with_sends_and_receives_reads_as_the_compute_only_one():
    assert to_schedule(read_csv(fixture("interleavedzerobubble_p2_m4_v2_comms"))) == \
        to_schedule(read_csv(fixture("interleavedzerobubble_p2_m4_v2")))


def test_interleaved_zero_bubble_beats_zb_h1s_bubble_with_unit_costs():
    izb = check(to_schedule(read_csv(fixture("interleavedzerobubble_p4_m8_v2"))))
    zb = check(make_schedule("zb-h1", 4, 8))
    assert zb.bubble_fraction == pytest.approx(3 / 24)  # (p-1)/(3m)
    assert izb.bubble_fraction == pytest.approx(zb.bubble_fraction / 2)  # v = 2 halves it
    assert izb.peak_in_flight[0] == 8  # in chunk-microbatches: p per chunk


def test_an_order_that_cannot_finish_names_who_waits_for_what(tmp_path):
    own = tmp_path / "own.csv"
    own.write_text("0F0,0F1,0B0,0B1\n1B0,1F0,1F1,1B1\n")
    with pytest.raises(ScheduleError, match=r"deadlock\): rank 0 waits at 0B0 \(action 3\) for the input gradient "
                                            r"from 1B0, which rank 1 lists as action 1, after where it waits; "
                                            r"rank 1 waits at 1B0 \(action 1\) for its own 1F0, which rank 1 lists "
                                            r"as action 2"):
        to_schedule(read_csv(own), "own")
    crossed = tmp_path / "crossed.csv"
    crossed.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    with pytest.raises(ScheduleError, match=r"rank 1 waits at 1F1 \(action 1\) for the output of 0F1, which rank 0 "
                                            r"lists as action 3"):
        to_schedule(read_csv(crossed), "crossed")


def test_missing_and_repeated_work_is_named(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B0\n1F0,1B0,1F1,1B1\n")
    with pytest.raises(ScheduleError, match=r"the backward of stage 0 \(rank 0\) never runs microbatch 1; runs "
                                            "microbatch 0 twice"):
        to_schedule(read_csv(path), "s")


def test_config_takes_a_csv_whose_shape_is_the_runs(tmp_path):
    csv = fixture("interleavedzerobubble_p2_m4_v2")
    common = [f"parallel.schedule={csv}", "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "model.layers=8",
              "train.batch_size=8"]
    run = resolve_run(load_config("cpu8", [*common, "parallel.chunks=2", "parallel.microbatches=4"]), 8)
    assert run.cfg.pipeline.schedule == csv and run.schedule.name == Path(csv).name
    with pytest.raises(ConfigError, match=r"parallel.schedule: microbatches: .* schedules 4 microbatches, the run "
                                          r"has 2; set parallel.microbatches=4"):
        resolve_run(load_config("cpu8", [*common, "parallel.chunks=2", "parallel.microbatches=2"]), 8)
    with pytest.raises(ConfigError, match=r"parallel.schedule: chunks: .* set parallel.chunks=2"):
        resolve_run(load_config("cpu8", [*common, "parallel.chunks=1", "parallel.microbatches=4"]), 8)
    with pytest.raises(ConfigError, match="parallel.schedule: .*zbv_p2_m4.csv: rank 0 runs stage 3"):
        resolve_run(load_config("cpu8", [f"parallel.schedule={fixture('zbv_p2_m4')}", "parallel.data=2", "parallel.pipe=2",
                                         "parallel.tensor=2", "model.layers=8", "parallel.chunks=2",
                                         "parallel.microbatches=4", "train.batch_size=8"]), 8)


# What torch's schedules add to meshtron's own: a looped-BFS order (every microbatch through a chunk
# before the next chunk, backwards in reverse) and interleaved zero bubble (split backward, v = 2),
# both recomputing and keeping residuals.
RUNS = [
    Layout(2, 2, 2, fixture("loopedbfs_p2_m4_v2"), 2, 4),
    Layout(2, 2, 2, fixture("interleavedzerobubble_p2_m4_v2"), 2, 4),
    Layout(1, 2, 4, fixture("interleavedzerobubble_p2_m4_v2"), 2, 4, recompute=False),
]


# CI runs both orders on (2,2,2), recomputing; interleaved zero bubble keeping residuals on (1,2,4) is
# ``extended`` (a split backward keeping residuals stays in CI in tests/test_stage_layout.py and
# tests/test_deadlock.py).
@pytest.mark.parametrize("layout", [layout if layout.recompute else pytest.param(layout, marks=pytest.mark.extended)
                                    for layout in RUNS], ids=str)
def test_torchs_schedules_match_the_unpipelined_model(layout):
    [report] = check_parity(model_def_from_config(SMALL, layout.tensor), [layout], seq_len=16)
    assert report.ok
