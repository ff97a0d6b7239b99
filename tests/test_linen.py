"""Flax Linen models through ``meshtron.models.linen``: a Linen GPT annotated the Linen way passes the
parity oracle on every kind of layout (the README's example), trains, checkpoints and generates from
the CLI by ``model.factory``; what cannot work is one line."""

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent / "models"))

import linen_gpt
from test_readme import run_example

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.models.contract import ModelContractError
from meshtron.models.linen import LinenLM, from_linen
from meshtron.train.loop import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

SMALL = ["model.layers=4", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=16", "train.batch_size=8",
         "train.eval_batches=1", "train.log_every=1"]


def test_the_readme_linen_example_passes_the_oracle_on_every_kind_of_layout(capsys):
    namespace = run_example("linen")
    reports = namespace["reports"]
    assert [str(r.layout) for r in reports] == ["1x1x8", "2x2x2 interleaved v=2 m=4", "2x4x1 1f1b v=1 m=8",
                                                "1x2x4 zb-h1 v=1 m=4"]
    assert all(r.ok for r in reports) and len(capsys.readouterr().out.splitlines()) == 4


def test_a_linen_model_trains_checkpoints_and_generates_from_the_cli(tmp_path, capsys):
    ckpt = tmp_path / "run"
    assert main(["train", "--config", "cpu8", "model.factory=linen_gpt:build", "train.steps=2", *SMALL,
                 f"checkpoint.dir={ckpt}"]) == 0
    out = capsys.readouterr().out
    assert "LinenLM" in out and f"checkpoints       {ckpt}: steps 2" in out
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def ", "--max-tokens", "5", "mesh.pipe=1",
                 "mesh.data=4"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_parameters_keep_their_linen_names_and_axes():
    trainer = Trainer.from_config(load_config("cpu8", ["model.factory=linen_gpt:build", *SMALL]), read_data=False)
    axes = trainer.model_def.logical_axes()
    assert axes["blocks"]["linen"]["DenseGeneral_0"]["kernel"] == ("layers", "embed", "qkv", "heads", "head_dim")
    assert axes["linen_embed"]["wte"] == ("vocab", "embed") and axes["linen_head"]["Dense_0"]["kernel"] == (
        "embed", "vocab")
    qkv = trainer.steps.param_shardings["blocks"]["linen"]["DenseGeneral_0"]["kernel"].spec
    assert tuple(qkv) == ("pipe", None, None, "tensor", None)  # layers over pipe, heads over tensor


class BatchNormed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(x)


@pytest.mark.parametrize("make, message", [
    (lambda rngs: linen_gpt.Head(256),
     (r"^model: the factory returned a Flax Linen module \(Head\), not an nnx.Module; wrap its embed, block and head "
     r"modules with meshtron.models.linen.LinenLM")),
    (lambda rngs: LinenLM(linen_gpt.Embed(256, 32, 16), nnx.Linear(32, 32, rngs=rngs), linen_gpt.Head(256), layers=2,
                          vocab_size=256, rngs=rngs),
     r"^model: LinenLM's block is a Linear, not a flax.linen.Module; pass a Linen module instance"),
    (lambda rngs: from_linen(BatchNormed(), jnp.zeros((2, 4)), rngs=rngs),
     (r"^model: the Linen module BatchNormed keeps BatchNorm_0.mean in the collection 'BatchStat'; meshtron trains "
     r"parameters only")),
    (linen_gpt.Embed, (r"^model: the model factory Embed is a class, called as Embed\(rngs\), whose first argument is "
                      r"not rngs; pass a function rngs -> model")),
], ids=["linen-module", "nnx-block", "batch-stats", "class"])
def test_what_cannot_be_a_contract_model_is_one_line(make, message):
    with pytest.raises(ModelContractError, match=message) as caught:
        Trainer.from_config(load_config("cpu8", SMALL), model=make, read_data=False)
    assert "\n" not in str(caught.value)
