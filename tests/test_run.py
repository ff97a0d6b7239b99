"""The resolved run: a config on a device count is resolved once -- mesh sizes, stage layout, schedule
and program -- and the trainer, describe and the CLI take it instead of re-deriving any of it."""

from collections import Counter

import pytest

import meshtron.run
from meshtron.config import load_config
from meshtron.errors import ConfigError
from meshtron.pipeline.layout import StageLayout
from meshtron.run import MeshSizes, ZeroChoice, resolve_run
from meshtron.train.loop import Trainer

SMALL = ["model.layers=4", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=16", "train.batch_size=8"]


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """How many times the stage layout is parsed, the schedule made and the program compiled."""
    calls: Counter = Counter()
    parse, make, compile_ = StageLayout.parse.__func__, meshtron.run.make_schedule, meshtron.run.compile_program

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(StageLayout, "parse", classmethod(counting("stage_layout", parse)))
    monkeypatch.setattr(meshtron.run, "make_schedule", counting("make_schedule", make))
    monkeypatch.setattr(meshtron.run, "compile_program", counting("compile_program", compile_))
    return calls


@pytest.mark.parametrize("mesh", [["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"], ["parallel.data=-1", "parallel.pipe=2",
                                                                                     "parallel.tensor=2"]],
                         ids=["2x2x2", "-1x2x2"])
def test_a_trainer_resolves_its_run_once(counted, mesh):
    trainer = Trainer.from_config(load_config("cpu8", [*SMALL, *mesh, "parallel.layout=[1,1,1,1]"]),
                                  read_data=False)
    assert counted == {"stage_layout": 1, "make_schedule": 1, "compile_program": 1}
    run = trainer.resolved
    assert run.sizes == MeshSizes(data=2, pipe=2, tensor=2, context=1) and trainer.cfg is run.cfg and trainer.stage_layout is run.stage_layout
    assert run.schedule.name == "interleaved" and run.program.schedule is run.schedule
    trainer.init_params()  # the stage order of the layers: from the run, not parsed again
    assert counted["stage_layout"] == 1


def test_the_clis_run_is_the_trainers(counted):
    """The CLI resolves the run before JAX starts (a layout that cannot work is one line then); the
    trainer takes that run instead of resolving it again."""
    cfg = load_config("cpu8", SMALL)
    run = resolve_run(cfg, 8)
    Trainer.from_config(cfg, read_data=False, run=run)
    assert counted == {"stage_layout": 1, "make_schedule": 1, "compile_program": 1}


def test_a_mesh_axis_left_to_the_devices_is_checked_once_it_has_a_size():
    cfg = load_config("cpu8", [*SMALL, "parallel.data=-1", "parallel.pipe=1", "parallel.tensor=2", "train.batch_size=6",
                               "parallel.microbatches=1"])
    with pytest.raises(ConfigError, match=r"^train.batch_size: 6 sequences cannot be split over parallel.data=4"):
        resolve_run(cfg, 8)
    assert resolve_run(cfg, 6).sizes == MeshSizes(data=3, pipe=1, tensor=2)


def test_the_run_names_every_mesh_size_context_included():
    sizes = resolve_run(load_config("llama_cpu8", ["parallel.data=-1", "parallel.pipe=1", "parallel.context=2"]), 8).sizes
    assert (sizes.data, sizes.pipe, sizes.tensor, sizes.context) == (2, 1, 2, 2)
    assert sizes.devices == 8 and sizes.replicas == 4


def test_the_run_carries_the_zero_choice_and_checks_what_combines_features():
    run = resolve_run(load_config("cpu8", [*SMALL, "parallel.zero=3", "parallel.gather_once=true"]), 8)
    assert run.zero == ZeroChoice(level=3, gather_once=True)
    # a field's own checks are the config's, at load; one that combines two features is the run's
    cfg = load_config("cpu8", [*SMALL, "parallel.zero=1", "parallel.gather_once=true"])
    with pytest.raises(ConfigError, match=r"^parallel.gather_once: gathers parameters split by parallel.zero=3"):
        resolve_run(cfg, 8)
