"""A user's own model, defined in tests/ (not in src/), with a block meshtron has never seen and
logical names of its own: it trains through the public API on data=2 x pipe=2 x tensor=2
interleaved with 1-bit LAMB, checkpoints, restores on (1,1,8), generates, and the parity oracle
shows its loss and gradients equal one device's."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "models"))

import parallel_lm

import meshtron
from meshtron.checkpoint import CheckpointError
from meshtron.cli import main
from meshtron.config import MeshConfig
from meshtron.testing import Layout, ParityError, check_parity

pytestmark = pytest.mark.slow


def test_the_readme_oracle_example_passes_on_every_kind_of_layout(capsys):
    from test_readme import run_example

    namespace = run_example("parity")
    reports = namespace["reports"]
    assert [str(r.layout) for r in reports] == ["1x1x8", "2x2x2 interleaved v=2 m=4", "2x4x1 1f1b v=1 m=8",
                                                "1x2x4 gpipe v=1 m=4"]
    assert all(r.ok for r in reports) and len(capsys.readouterr().out.splitlines()) == 4


class BatchCoupledLM(parallel_lm.ParallelLM):
    """A classic data-parallel bug: a statistic over the batch (as BatchNorm takes) is computed from
    each data shard's own rows, so the model computes something else on a data-parallel mesh."""

    def embed(self, tokens, ctx):
        x = super().embed(tokens, ctx)
        return x - x.mean(axis=0, keepdims=True)


def test_oracle_catches_a_model_that_is_wrong_when_sharded():
    check_parity(lambda r: BatchCoupledLM(rngs=r), [Layout(1, 1, 8)], rules=parallel_lm.RULES, seq_len=16)
    with pytest.raises(ParityError, match=r"^2x1x4: (gradient of \S+ differs from one device|loss)"):
        check_parity(lambda r: BatchCoupledLM(rngs=r), [Layout(2, 1, 4)], rules=parallel_lm.RULES, seq_len=16)


def test_trains_checkpoints_restores_on_another_mesh_and_generates(tmp_path):
    cfg = meshtron.load_config("cpu8", [
        "train.optimizer=onebit_lamb", "optim.freeze_step=3", "train.steps=6", "train.batch_size=16",
        "parallel.microbatches=4", "model.seq_len=32", "train.eval_every=3", "train.eval_batches=1", "train.log_every=1",
        f"checkpoint.dir={tmp_path}", "checkpoint.every=3",
    ])
    assert (cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor, cfg.pipeline.schedule) == (2, 2, 2, "interleaved")
    trainer = meshtron.Trainer.from_config(cfg, model=parallel_lm.factory, rules=parallel_lm.RULES)
    result = trainer.run()
    assert result.checkpoints == [3, 6] and result.stage_steps == {"warmup": 3, "compression": 3}
    assert np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0]
    assert trainer.model_def.describe().startswith("ParallelLM")

    restored = meshtron.load_pretrained(tmp_path, MeshConfig(1, 1, 8), model=parallel_lm.factory,
                                        rules=parallel_lm.RULES)
    assert restored.step == 6 and dict(restored.mesh.shape) == {"data": 1, "context": 1, "pipe": 1, "tensor": 8}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(result.params))
    out = meshtron.sample(restored.model_def, restored.params, restored.mesh, "def ", max_new_tokens=8)
    assert len(out.new_tokens) == 8 and all(0 <= t < 256 for t in out.new_tokens)


def test_the_cli_takes_a_factory_and_its_rules(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "models"))
    status = main(["describe", "--config", "cpu8", "model.factory=parallel_lm:build", "model.hidden=64",
                   "model.mlp_dim=128", "model.rules={attn_heads: tensor, attn_dim: null, ffn: tensor}",
                   "train.steps=1"])
    out = capsys.readouterr()
    assert status == 0, out.err
    w_in = next(line for line in out.out.splitlines() if line.startswith("blocks/w_in"))
    assert "(layers, embed, ffn)" in w_in and w_in.rstrip().endswith("#1 layers->pipe, #17 ffn->tensor"), w_in
    assert main(["train", "--config", "cpu8", "model.factory=parallel_lm:nope", "train.steps=1"]) == 2
    assert "model.factory: 'parallel_lm' has no attribute 'nope'" in capsys.readouterr().err


def test_the_python_api_and_the_cli_say_what_they_want_in_one_line(tmp_path, capsys, monkeypatch):
    """A factory that is a class or has the wrong signature, a config named by its bundled name, a step
    directory where a run's directory belongs: each one line, naming the argument the caller used."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "models"))
    assert main(["train", "--config", "cpu8", "model.factory=parallel_lm:ParallelLM", "train.steps=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshtron: error: model.factory: parallel_lm:ParallelLM is a class; name a function build(model_config, rngs) "
        "-> model, called with the run's model config and an nnx.Rngs (it may construct ParallelLM)")
    assert main(["train", "--config", "cpu8", "model.factory=parallel_lm:factory", "train.steps=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "meshtron: error: model.factory: parallel_lm:factory(rngs: 'nnx.Rngs') -> 'ParallelLM' cannot be called as "
        "factory(model_config, rngs); name a function build(model_config, rngs) -> model, called with the run's model "
        "config and an nnx.Rngs")

    # Python: a bundled config's name is taken as --config takes it; a wrong type is one line
    tiny = ["train.steps=2", "train.batch_size=8", "model.seq_len=16", "train.eval_batches=1",
            f"checkpoint.dir={tmp_path / 'run'}", "checkpoint.every=1"]
    meshtron.Trainer.from_config(meshtron.load_config("cpu8", tiny), model=parallel_lm.factory,
                                 rules=parallel_lm.RULES).run()
    assert meshtron.Trainer.from_config("cpu8", read_data=False).cfg.mesh == MeshConfig(2, 2, 2)
    with pytest.raises(meshtron.ConfigError, match=r"^cfg: Trainer.from_config takes a Config, or a config file or "
                                                   r"bundled name such as 'cpu8', got a dict$"):
        meshtron.Trainer.from_config({"mesh": {}})
    with pytest.raises(meshtron.ConfigError, match=r"^model: the model factory ParallelLM is a class, called as "
                                                   r"ParallelLM\(rngs\), whose first argument is not rngs"):
        meshtron.Trainer.from_config("cpu8", model=parallel_lm.ParallelLM, read_data=False)

    # A step directory where the run's directory belongs: from Python the error names the argument, from the
    # CLI the flag.
    step = tmp_path / "run" / "2"
    capsys.readouterr()
    with pytest.raises(CheckpointError, match=rf"^directory {step}: is step 2 of the checkpoint directory "
                                              rf"{tmp_path / 'run'}; pass {tmp_path / 'run'} \(its newest intact"):
        meshtron.load_pretrained(step, model=parallel_lm.factory, rules=parallel_lm.RULES)
    with pytest.raises(CheckpointError, match=rf"^directory {tmp_path / 'none'}: no such directory"):
        meshtron.load_pretrained(tmp_path / "none")
    assert main(["generate", "--checkpoint", str(step), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"meshtron: error: --checkpoint {step}: is step 2 of the checkpoint directory {tmp_path / 'run'}; pass "
        f"{tmp_path / 'run'} (its newest intact step is used)")
