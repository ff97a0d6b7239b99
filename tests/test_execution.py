"""meshtron.execution: the run's switches are one frozen value built from the run, apart from the model's
structure -- read from a config, checked with one line, entered as the trace context, and on the
ground floor (no JAX)."""

from pathlib import Path

import pytest
from test_model_contract import imported_modules

from meshtron.config import ModelConfig, load_config
from meshtron.execution import DEFAULT_EXECUTION, Execution
from meshtron.run import resolve_run
from meshtron.trace_context import current

SOURCE = Path(__file__).resolve().parents[1] / "src" / "meshtron" / "execution.py"


def test_a_runs_model_section_gives_its_switches():
    cfg = ModelConfig(remat="selective", attention="xla", context_attention="ring", seq_len=64)
    assert Execution.of_model_config(cfg) == Execution("selective", "xla", "ring", 64)
    run = resolve_run(load_config("cpu8", ["model.remat=full", "parallel.context_attention=ring"]), 8)
    assert run.execution == Execution("full", run.cfg.model.attention, "ring", run.cfg.model.seq_len)


def test_the_scope_sets_what_model_code_reads_and_leaving_it_restores():
    before = current()
    with Execution(remat="selective", attention="cudnn", context_attention="ring").scope():
        inside = current()
        assert (inside.attention, inside.recompute_core, inside.exchange) == ("cudnn", True, "ring")
    with Execution(context_attention="hybrid", ulysses_degree=4).scope():
        assert (current().exchange, current().ulysses_degree) == ("hybrid", 4)
    assert current() == before
    with Execution(remat="full").scope():
        assert not current().recompute_core  # full recomputation is run_blocks', not the attention core's
    with DEFAULT_EXECUTION.scope():
        assert (current().attention, current().recompute_core, current().exchange) == (None, False, "gathered")


def test_generations_default_context_is_the_window_within_the_models_limit():
    assert Execution(window=32).context(64) == 32
    assert Execution(window=128).context(64) == 64
    assert Execution(window=32).context(None) == 32
    assert Execution().context(64) == 64
    assert Execution().context(None) is None


@pytest.mark.parametrize("switches, message", [
    ({"remat": "some"}, r"^model.remat: must be one of none, full, selective, offload, got 'some'$"),
    ({"context_attention": "a2a"},
     r"^parallel.context_attention: must be one of gathered, ring, ulysses, hybrid, got 'a2a'$"),
    ({"context_attention": "hybrid", "ulysses_degree": 0}, r"^parallel.ulysses_degree: must be a whole number >= 1, got 0$"),
])
def test_an_unknown_switch_is_one_line(switches, message):
    with pytest.raises(ValueError, match=message):
        Execution(**switches)


def test_it_stands_on_the_ground_floor_without_jax():
    imported = imported_modules(SOURCE)
    assert not any(name == "jax" or name.startswith(("jax.", "flax")) for name in imported), imported
    packages = {".".join(name.split(".")[:2]) for name in imported if name.startswith("meshtron")}
    assert packages <= {"meshtron.trace_context", "meshtron.megatron"}, imported
