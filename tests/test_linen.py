"""Flax Linen models through ``meshtron.models.linen``: a Linen GPT annotated the Linen way passes the
parity oracle on every kind of layout (the README's example), trains, checkpoints and generates from
the CLI by ``model.factory``; what cannot work is one line."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent / "models"))

import linen_gpt
from test_readme import run_example

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.models.blocks import Context, run_blocks
from meshtron.models.contract import ModelContractError, next_token_pairs, token_losses
from meshtron.models.linen import LinenLM, from_linen
from meshtron.train.loop import Trainer
from meshtron.train.state import ModelDef

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

SMALL = ["model.layers=4", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=16", "train.batch_size=8",
         "train.eval_batches=1", "train.log_every=1"]


@pytest.mark.first_stack_only  # the second stack trains and generates with a Linen model through the CLI
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
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "def ", "--max-tokens", "5", "parallel.pipe=1",
                 "parallel.data=4"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_parameters_keep_their_linen_names_and_axes():
    trainer = Trainer.from_config(load_config("cpu8", ["model.factory=linen_gpt:build", *SMALL]), read_data=False)
    axes = trainer.model_def.logical_axes()
    assert axes["blocks"]["linen"]["DenseGeneral_0"]["kernel"] == ("layers", "embed", "qkv", "heads", "head_dim")
    assert axes["linen_embed"]["wte"] == ("vocab", "embed") and axes["linen_head"]["Dense_0"]["kernel"] == (
        "embed", "vocab")
    qkv = trainer.steps.param_shardings["blocks"]["linen"]["DenseGeneral_0"]["kernel"].spec
    assert tuple(qkv) == ("pipe", None, None, "tensor", None)  # layers over pipe, heads over tensor


@pytest.mark.fusion_emitters  # the two uses' gradients summed against the whole one, to 1e-7
@pytest.mark.first_stack_only  # the Linen bridge's representative cases run on both stacks
def test_a_tied_head_is_the_embedding_table_and_passes_the_oracle_with_a_pipeline():
    """The guide's tied example: one table and no head kernel, logits ``norm(x) @ table.T``, the
    table's gradient the sum of its embedding and head uses, and parity on a pipelined layout."""
    namespace = run_example("linen_tied")
    reports = namespace["reports"]
    assert [str(r.layout) for r in reports] == ["2x1x4", "2x2x2 1f1b v=1 m=4"] and all(r.ok for r in reports)
    md = ModelDef.create(namespace["gpt"])
    axes = md.logical_axes()
    assert axes["linen_embed"] == {"wte": {"embedding": ("vocab", "embed")}, "wpe": ("pos", "embed")}
    assert axes["linen_head"] == {"LayerNorm_0": {"scale": ("embed",), "bias": ("embed",)}}  # no kernel of its own
    params = jax.jit(lambda: _parameters(namespace["gpt"]))()  # built eagerly, op by op, it takes seconds
    table, norm = params["linen_embed"]["wte"]["embedding"], params["linen_head"]["LayerNorm_0"]
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    inputs, targets = next_token_pairs(tokens)
    ctx = Context.for_sequence(*inputs.shape)

    def split_loss(embed_table, head_table):
        """The loss with the table's two uses given separately; at (table, table), the model's."""
        embedder, header = (md.bind(_with_table(params, t)) for t in (embed_table, head_table))
        x = run_blocks(embedder.blocks, embedder.embed(inputs, ctx), ctx)
        return token_losses(header, header.head(x), targets).mean(), x

    @jax.jit
    def measured(params):
        (from_embed, from_head), x = jax.grad(split_loss, argnums=(0, 1), has_aux=True)(table, table)
        whole = jax.grad(md.loss)(params, tokens)["linen_embed"]["wte"]["embedding"]
        return x, md.bind(params).head(x), from_embed, from_head, whole

    x, logits, from_embed, from_head, whole = measured(params)
    normed = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6) * norm["scale"] + norm["bias"]
    np.testing.assert_allclose(logits, normed @ table.T, atol=1e-5)
    assert jnp.abs(from_embed).max() > 0 and jnp.abs(from_head).max() > 0
    np.testing.assert_allclose(whole, from_embed + from_head, atol=1e-7)


def _parameters(factory):
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(factory(nnx.Rngs(0)), nnx.Param))


def _with_table(params, table):
    return {**params, "linen_embed": {**params["linen_embed"], "wte": {"embedding": table}}}


class FactoredEmbed(nn.Module):
    """ALBERT's factorised embedding: a 16-wide table projected up to the 32-wide residual stream."""

    def setup(self):
        self.wte = nn.Embed(256, 16, embedding_init=linen_gpt.annotated(linen_gpt.NORMAL, ("vocab", "embed")))
        self.up = nn.Dense(32, use_bias=False, kernel_init=linen_gpt.annotated(linen_gpt.NORMAL, ("embed", "mlp")))

    def __call__(self, tokens, positions):
        return self.up(self.wte(tokens))

    def attend(self, x):
        return self.wte.attend(x)


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
    (lambda rngs: LinenLM(linen_gpt.Embed(256, 32, 16), linen_gpt.Block(32, 4, 64), linen_gpt.Head(256), layers=2,
                          vocab_size=256, tie_head=True, rngs=rngs),
     (r"^model: LinenLM\(tie_head=True\) projects with the embed module's attend\(x\) -> logits, and Embed has no "
      r"attend method; add one")),
    (lambda rngs: LinenLM(FactoredEmbed(), linen_gpt.Block(32, 4, 64), linen_gpt.Head(256), layers=2, vocab_size=256,
                          tie_head=True, rngs=rngs),
     (r"^model: LinenLM\(tie_head=True\): FactoredEmbed.attend cannot take the blocks' output of shape \(1, 8, 32\) "
      r"\(.+\); tie only a table as wide as the residual stream")),
    (lambda rngs: LinenLM(linen_gpt.Embed(256, 32, 16), linen_gpt.Block(32, 4, 64), linen_gpt.Head(200), layers=2,
                          vocab_size=256, rngs=rngs),
     r"^model: LinenLM's head Head returns 200 logits per token, fewer than vocab_size=256; make the head"),
], ids=["linen-module", "nnx-block", "batch-stats", "class", "tie-without-attend", "tie-narrow-table",
        "head-narrower-than-vocab"])
def test_what_cannot_be_a_contract_model_is_one_line(make, message):
    with pytest.raises(ModelContractError, match=message) as caught:
        Trainer.from_config(load_config("cpu8", SMALL), model=make, read_data=False)
    assert "\n" not in str(caught.value)
