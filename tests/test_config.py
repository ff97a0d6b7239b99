"""Config loading: YAML + overrides, and one clear error for every kind of bad input."""

from pathlib import Path

import pytest

from meshtron.config import ConfigError, load_config, padded_vocab_size

CONFIGS = Path(__file__).resolve().parents[1] / "mesh_configs"


def test_defaults_yaml_and_overrides_compose(tmp_path):
    cfg = load_config(
        CONFIGS / "cpu8.yaml",
        ["mesh.tensor=4", "mesh.pipe=1", "model.layers=2", "train.steps=20", "pipeline.schedule=1f1b",
         "pipeline.chunks=1"],
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
        (["mesh.tensor=3"], "model.heads", "multiple of 3"),
        (["mesh.tensor=8", "model.heads=8", "model.mlp_dim=100"], "model.mlp_dim", "multiple of 8"),
        (["mesh.data=4", "train.batch_size=12", "train.microbatches=2"], "train.batch_size", "multiple of 8"),
        (["mesh.data=-1", "mesh.tensor=-1"], "mesh", "at most one"),
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
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "cpu8.yaml", overrides)
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
