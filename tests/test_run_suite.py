"""``make test``'s runner (tests/run_suite.py): which tests each session selects, where the second
session's report goes, which exit codes fail, and that only the first session's processes get XLA:CPU's
element-wise emitters."""

import pytest
import run_suite
import subprocess_env


def test_each_session_narrows_the_tier_it_is_given():
    assert run_suite.narrowed("", "not fusion_emitters") == "not fusion_emitters"
    assert run_suite.narrowed("not extended", "fusion_emitters") == "(fusion_emitters) and (not extended)"


def test_the_second_session_writes_its_own_report():
    moved = run_suite.second_report(["--durations=25", "--junitxml=/logs/leg1.xml", "-x"])
    assert moved == ["--durations=25", "--junitxml=/logs/leg1.fusion-emitters.xml", "-x"]


@pytest.mark.parametrize(("codes", "expected"), [
    ([0, 0], 0),
    ([0, 5], 0),   # every test of the selection runs in the first session
    ([5, 0], 0),   # ... or in the second
    ([5, 5], 1),   # nothing collected anywhere is a failure, not a pass
    ([1, 0], 1),
    ([0, 2], 2),
])
def test_a_failed_or_empty_run_fails(monkeypatch, codes, expected):
    monkeypatch.setenv("MESHTRON_TEST_EMITTERS", "elemental")  # set by the caller: the second session drops it
    calls = []

    def session(arguments, markers, env=None):
        calls.append((markers, env.get("MESHTRON_TEST_EMITTERS")))
        return codes[len(calls) - 1]

    monkeypatch.setattr(run_suite, "pytest", session)
    monkeypatch.setattr(run_suite, "has_emitter_switch", lambda: True)
    assert run_suite.main(["not extended"]) == expected
    assert calls == [("(not fusion_emitters) and (not extended)", "elemental"),
                     ("(fusion_emitters) and (not extended)", None)]


def test_without_the_switch_one_session_runs_everything(monkeypatch):
    calls = []
    monkeypatch.setattr(run_suite, "pytest", lambda arguments, markers, env=None: calls.append(markers) or 0)
    monkeypatch.setattr(run_suite, "has_emitter_switch", lambda: False)
    assert run_suite.main(["not slow"]) == 0
    assert calls == ["not slow"]


@pytest.mark.parametrize(("variable", "switch", "flag"), [
    ("elemental", True, True), (None, True, False), ("elemental", False, False)])
def test_only_the_first_sessions_processes_compile_with_the_element_wise_emitters(monkeypatch, variable, switch,
                                                                                     flag):
    if variable is None:
        monkeypatch.delenv("MESHTRON_TEST_EMITTERS", raising=False)
    else:
        monkeypatch.setenv("MESHTRON_TEST_EMITTERS", variable)
    monkeypatch.setattr(subprocess_env, "has_emitter_switch", lambda: switch)
    assert ("--xla_cpu_use_fusion_emitters=false" in subprocess_env._emitters()) is flag
