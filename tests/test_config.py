"""Config loading: YAML + overrides, and one clear error for every kind of bad input."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from meshtron.config import (
    ALIASES,
    Config,
    ConfigError,
    MeshConfig,
    ParallelConfig,
    PipelineConfig,
    TrainConfig,
    _get,
    config_from_dict,
    load_config,
    padded_vocab_size,
    to_dict,
    upgraded,
)
from meshtron.run import check_features

CONFIGS = Path(__file__).resolve().parents[1] / "mesh_configs"


def test_defaults_yaml_and_overrides_compose(tmp_path):
    cfg = load_config(
        CONFIGS / "cpu8.yaml",
        ["parallel.tensor=4", "parallel.pipe=1", "model.layers=2", "train.steps=20", "parallel.schedule=1f1b",
         "parallel.chunks=1"],
    )
    assert (cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor) == (2, 1, 4)
    assert cfg.model.layers == 2 and cfg.train.steps == 20 and cfg.pipeline.schedule == "1f1b"
    assert cfg.model.hidden == 128  # from the file
    assert cfg.train.lr == pytest.approx(3e-3)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_loads(name):
    load_config(CONFIGS / name)


@pytest.mark.parametrize(
    "overrides, field, fix",
    [
        (["model.hiden=3"], "model.hiden", "valid keys"),
        (["trian.steps=3"], "trian", "sections are"),
        (["train.steps=abc"], "train.steps", "cannot use 'abc'"),
        (["model.remat=some"], "model.remat", "none, full, selective"),
        (["parallel.tensor=3"], "model.heads", "multiple of 3"),
        (["parallel.tensor=8", "model.heads=8", "model.mlp_dim=100"], "model.mlp_dim", "multiple of 8"),
        (["parallel.data=4", "train.batch_size=12", "parallel.microbatches=2"], "train.batch_size", "multiple of 8"),
        (["parallel.data=-1", "parallel.tensor=-1"], "parallel", "at most one"),
        (["data.path=/no/such/file.txt"], "data.path", "does not exist"),
        (["train.optimizer=sgd"], "train.optimizer", "must be one of adamw, lamb, onebit_lamb"),
        (["optim.freeze_step=0"], "optim.freeze_step", "null for 16% of train.steps"),
        (["optim.factor_min=5"], "optim.factor_min", "optim.factor_min <= optim.factor_max"),
        (["optim.coeff_beta=1.0"], "optim.coeff_beta", "[0, 1)"),
        (["optim.freez_step=3"], "optim.freez_step", "valid keys"),
        (["steps=3"], "steps=3", "section.key=value"),
    ],
)
def test_bad_input_is_one_clear_error(overrides, field, fix):
    with pytest.raises(ConfigError) as err:  # a field's own checks, then the run's (as the CLI makes them)
        check_features(load_config(CONFIGS / "cpu8.yaml", overrides))
    message = str(err.value)
    assert message.startswith(field) or field in message.split(":")[0]
    assert fix in message
    assert "\n" not in message


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text("model:\n  layers: two\n")
    with pytest.raises(ConfigError, match="model.layers"):
        load_config(wrong_type)


def test_vocab_padding_follows_megatron():
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(256, 8) == 1024
    assert padded_vocab_size(50257, 8) == 51200


def test_a_glob_on_the_command_line_is_text_and_a_list_setting_takes_one_value():
    """``train.lora.targets=*attn*`` is what a user types: not a YAML alias (a 25-line ScannerError before)."""
    assert load_config("cpu8", ["train.lora.targets=*attn*"]).train.lora.targets == ["*attn*"]
    assert load_config("cpu8", ["train.lora.targets=axis:mlp"]).train.lora.targets == ["axis:mlp"]
    assert load_config("cpu8", ['train.lora.targets=["*attn*", axis:mlp]']).train.lora.targets == ["*attn*", "axis:mlp"]
    assert load_config("cpu8", ["train.profile_steps=3:4"]).train.profile_steps == "3:4"
    with pytest.raises(ConfigError, match=r"^override 'data.blend=\[0.7,data/web': its value is not valid YAML "
                                          r"\(.*\); check its brackets and quotes") as caught:
        load_config("cpu8", ["train.steps=3", "data.blend=[0.7,data/web"])
    assert "\n" not in str(caught.value)


def test_a_config_file_that_is_not_yaml_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lora:\n    targets: *attn*\n")
    with pytest.raises(ConfigError, match=r"--config .*bad.yaml: not valid YAML \(") as caught:
        load_config(bad)
    assert "\n" not in str(caught.value)


# ---- the parallel section and its old spellings ------------------------------------------------------------------

# One old key of each family (mesh, pipeline, train, model), its new key and a value that is not the default.
ALIAS_FAMILIES = [("mesh.data", "parallel.data", 4), ("pipeline.schedule", "parallel.schedule", "gpipe"),
                  ("train.zero", "parallel.zero", 1), ("model.sequence_parallel", "parallel.sequence_parallel", True)]
TINY = ["parallel.pipe=2", "parallel.tensor=2", "model.layers=4", "train.batch_size=16"]


def _yaml_of(dotted: str, value) -> str:
    section, name = dotted.split(".")
    return yaml.safe_dump({section: {name: value}})


@pytest.mark.parametrize("old, new, value", ALIAS_FAMILIES, ids=[old for old, _, _ in ALIAS_FAMILIES])
def test_an_old_key_is_read_as_its_parallel_key_with_one_deprecation_line(old, new, value, tmp_path, capsys):
    written = f"{new}={str(value).lower() if isinstance(value, bool) else value}"
    expected = load_config(None, [*TINY, written])
    assert capsys.readouterr().err == ""  # the new spelling: no note
    assert _get(expected, new) == value == _get(expected, old)  # both hold it: parallel (written), the old copy (read)

    on_command_line = load_config(None, [*TINY, written.replace(new, old)])
    file = tmp_path / "old.yaml"
    file.write_text(_yaml_of(old, value))
    in_a_file = load_config(file, TINY)
    assert on_command_line == expected and in_a_file == expected
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"meshtron: {old} is deprecated; write {new}"] * 2  # one line per load, one per old key used


def test_several_old_keys_are_one_line_however_many_layers_use_them(tmp_path, capsys):
    file = tmp_path / "old.yaml"
    file.write_text("mesh:\n  data: 2\n  pipe: 2\n  tensor: 2\ntrain:\n  microbatches: 2\npipeline:\n  chunks: 1\n")
    cfg = load_config(file, ["mesh.data=2", "model.context_attention=ring", "train.batch_size=16"])
    assert (cfg.parallel.data, cfg.parallel.microbatches, cfg.parallel.context_attention) == (2, 2, "ring")
    err = capsys.readouterr().err
    assert err == ("meshtron: mesh.data, mesh.pipe, mesh.tensor, pipeline.chunks, train.microbatches, "
                   "model.context_attention are deprecated; write parallel.data, parallel.pipe, parallel.tensor, "
                   "parallel.chunks, parallel.microbatches, parallel.context_attention\n")
    load_config(file, ["train.batch_size=16"], notes=False)
    assert capsys.readouterr().err == ""


def test_an_old_key_and_its_new_key_set_apart_is_one_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["mesh.data=2", "parallel.data=4"])
    assert str(err.value) == ("mesh.data and parallel.data (command line): both set, to 2 and 4; mesh.data is the old "
                              "name of parallel.data: write only parallel.data")
    file = tmp_path / "both.yaml"
    file.write_text("parallel:\n  zero: 1\ntrain:\n  zero: 3\n")
    with pytest.raises(ConfigError, match=r"^train.zero and parallel.zero \(config file .*both.yaml\): both set"):
        load_config(file)
    # The same value twice is no conflict; a later layer overrides an earlier one in either spelling.
    assert load_config(None, ["mesh.data=2", "parallel.data=2"]).mesh.data == 2
    file.write_text("parallel:\n  zero: 1\n")
    assert load_config(file, ["train.zero=0"]).parallel.zero == 0


def test_a_config_made_or_changed_in_python_keeps_parallel_equal_to_the_old_copies():
    cfg = Config(mesh=MeshConfig(2, 2, 2), train=TrainConfig(microbatches=4, zero=1),
                 pipeline=PipelineConfig(schedule="interleaved", chunks=2))
    assert (cfg.parallel.data, cfg.parallel.microbatches, cfg.parallel.zero, cfg.parallel.chunks) == (2, 4, 1, 2)
    resized = dataclasses.replace(cfg, mesh=MeshConfig(4, 1, 2))
    assert (resized.parallel.data, resized.parallel.pipe) == (4, 1) and resized.parallel.schedule == "interleaved"
    with pytest.raises(ValueError, match="init=False"):  # parallel is derived: not passed, it cannot disagree
        dataclasses.replace(cfg, parallel=ParallelConfig())
    for old, new in ALIASES.items():
        assert _get(cfg, old) == _get(cfg, new)


def test_what_meshtron_writes_is_the_parallel_section_and_reads_back_silently(tmp_path, capsys):
    cfg = load_config(CONFIGS / "cpu8.yaml", ["parallel.zero=1", "parallel.sequence_parallel=true"])
    written = to_dict(cfg)
    assert "mesh" not in written and "pipeline" not in written
    assert not set(written["train"]) & {"microbatches", "zero", "gather_once", "gather_dtype", "reduce_dtype"}
    assert not set(written["model"]) & {"sequence_parallel", "context_attention"}
    assert written["parallel"] == dataclasses.asdict(cfg.parallel)
    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump(written))
    assert load_config(file) == cfg and config_from_dict(written, "test") == cfg
    # A config recorded by meshtron before the parallel section (a checkpoint's meta): read silently.
    old = {key: value for key, value in dataclasses.asdict(cfg).items() if key != "parallel"}
    assert config_from_dict(old, "old checkpoint") == cfg and upgraded(old) == written
    assert capsys.readouterr().err == ""


def test_an_imports_own_old_config_file_is_read_without_a_note(tmp_path, capsys):
    """import-hf writes config.yaml beside the imported model; one written before the parallel section
    is meshtron's writing, not the user's: no note (a file of the user's elsewhere gets one)."""
    (tmp_path / "0" / "meta").mkdir(parents=True)
    (tmp_path / "0" / "meta" / "metadata").write_text('{"imported": {"from": "hf"}}')
    (tmp_path / "config.yaml").write_text("mesh:\n  data: 1\n  pipe: 1\n  tensor: 1\n  context: 1\n")
    assert load_config(tmp_path / "config.yaml").parallel.data == 1
    assert capsys.readouterr().err == ""
    (tmp_path / "mine.yaml").write_text("mesh:\n  data: 1\n")
    load_config(tmp_path / "mine.yaml")
    assert capsys.readouterr().err == "meshtron: mesh.data is deprecated; write parallel.data\n"


def test_an_old_checkpoint_record_is_not_another_run():
    from meshtron.train.resume import another_run

    cfg = load_config(CONFIGS / "cpu8.yaml")
    old = {key: value for key, value in dataclasses.asdict(cfg).items() if key != "parallel"}
    assert another_run({"config": old}, cfg) is None and another_run({"config": to_dict(cfg)}, cfg) is None
    old["model"]["context_attention"] = "ring"  # a model.* setting then, still compared
    assert another_run({"config": old}, cfg) == "parallel.context_attention: 'ring' there, 'gathered' here"
