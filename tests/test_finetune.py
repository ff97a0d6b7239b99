"""Fine-tuning what you were given: the import's ``config.yaml`` starts a new run from the imported
weights (``train.init_from``) into a directory of its own, rotation removes only what the run wrote,
and nothing of the import -- or of another run -- is ever deleted, overwritten or written into.

The imported model is a tiny Llama written with NumPy in Hugging Face's layout (no torch needed)."""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_huggingface import LLAMA_CONFIG, llama_tensors, tiny_tokenizer, write_config

from meshtron.checkpoint import CheckpointError, CheckpointStore
from meshtron.cli import main
from meshtron.config import ConfigError, MeshConfig, load_config
from meshtron.huggingface import CONFIG_FILE, import_hf
from meshtron.pretrained import load_pretrained
from meshtron.train.loop import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

SMALL = ["train.batch_size=4", "train.eval_batches=1", "train.log_every=1", "train.warmup_steps=0"]


def hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("import")
    hf_dir = write_config(root / "hf", LLAMA_CONFIG)
    tensors = llama_tensors()
    for name, value in tensors.items():  # unit norm scales and a sharp head: logits far from uniform
        tensors[name] = np.ones_like(value) if name.endswith("norm.weight") else value * (
            20 if name in ("model.embed_tokens.weight", "lm_head.weight") else 3)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer(hf_dir)
    return import_hf(hf_dir, root / "imported")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_readme_fine_tune_flow_starts_from_the_import_and_leaves_it_untouched(imported, tmp_path, capsys):
    before = hashes(imported)
    config = (imported / CONFIG_FILE).read_text()
    assert str(imported) not in config  # no absolute path to itself: ${config_dir:} stands for it
    metrics = tmp_path / "m.jsonl"
    finetune = imported.parent / "imported-finetune"
    assert main(["train", "--config", str(imported / CONFIG_FILE), "--metrics", str(metrics), "train.steps=3",
                 *SMALL]) == 0
    assert f"weights: initialised from {imported}/0 (train.init_from" in capsys.readouterr().err
    start, *steps = records(metrics)
    assert start == {"step": 0, "event": "start",
                     "weights": f"initialised from {imported}/0 (train.init_from; a fresh optimizer state, step 0 "
                                "of 3)"}
    assert CheckpointStore(finetune, read_only=True).steps() == [3]
    assert hashes(imported) == before

    # The first step's loss is the imported model's on that batch, not a random model's.
    cfg = load_config(imported / CONFIG_FILE, ["train.steps=3", *SMALL])
    trainer = Trainer.from_config(cfg)
    batch = trainer.train_stream(0).next(trainer.steps.batch_sharding)
    pretrained = load_pretrained(imported)

    def loss_of(md, execution):
        return jax.jit(md.traced(lambda p, t: md.loss(p, t, execution), execution))

    with jax.set_mesh(pretrained.mesh):
        reference = float(loss_of(pretrained.model_def, pretrained.execution)(pretrained.params, batch))
        fresh = float(loss_of(trainer.model_def, trainer.execution)(trainer.init_params(), batch))
    np.testing.assert_allclose(steps[0]["loss"], reference, rtol=1e-5)
    assert abs(steps[0]["loss"] - fresh) > 0.5  # a random model is far off
    shutil.rmtree(finetune)


# Which steps rotation keeps and deletes is meshtron's file handling, the same whatever the JAX version
# (the fine-tune flow from an import runs on both stacks).
@pytest.mark.first_stack_only
def test_rotation_with_the_defaults_never_touches_the_import(imported, tmp_path):
    """300+ steps with checkpoint.every=100 and keep=3 (the defaults): the fine-tune keeps its three newest,
    the import keeps its step 0 and every byte."""
    before = hashes(imported)
    out = tmp_path / "ft"
    assert main(["train", "--config", str(imported / CONFIG_FILE), f"checkpoint.dir={out}", "train.steps=400",
                 "train.batch_size=2", "train.eval_batches=1", "train.eval_every=400"]) == 0
    assert CheckpointStore(out, read_only=True).steps() == [200, 300, 400]
    assert hashes(imported) == before


def test_a_copied_import_is_self_contained(imported, tmp_path):
    """Its config.yaml names the copy, never the original: training it reads and writes beside the copy."""
    before = hashes(imported)
    copy = tmp_path / "copy"
    shutil.copytree(imported, copy)
    cfg = load_config(copy / CONFIG_FILE)
    assert (cfg.train.init_from, cfg.checkpoint.dir, cfg.data.tokenizer) == (
        str(copy), f"{copy}-finetune", str(copy / "tokenizer.json"))
    # (3 steps: the README flow's program, compiled once)
    assert main(["train", "--config", str(copy / CONFIG_FILE), "train.steps=3", *SMALL]) == 0
    assert CheckpointStore(tmp_path / "copy-finetune", read_only=True).steps() == [3]
    assert hashes(imported) == before and not (imported.parent / "imported-finetune").exists()


def test_a_run_never_trains_into_an_import(imported, capsys):
    before = hashes(imported)
    assert main(["train", "--config", str(imported / CONFIG_FILE), f"checkpoint.dir={imported}", "train.steps=1",
                 *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"meshtron: error: checkpoint.dir: {imported} holds an imported model (step 0), which a run never "
                   f"writes into; start from it with train.init_from={imported} and give the new run its own "
                   "checkpoint.dir")
    assert hashes(imported) == before


def test_init_from_a_step_of_another_run_with_its_optimizer_continues_that_run(tmp_path):
    """``train.init_from=DIR/STEP`` with ``init_optimizer``: the new run continues at that step with that
    run's optimizer state and data position, bit for bit like the run itself, into its own directory."""
    common = ["parallel.data=2", "parallel.pipe=1", "parallel.tensor=1", "model.layers=2", "model.hidden=32", "model.mlp_dim=64",
              "model.seq_len=32", "train.batch_size=4", "train.eval_batches=1", "train.steps=4"]
    first = tmp_path / "first"
    straight = Trainer.from_config(load_config(None, [*common, f"checkpoint.dir={first}", "checkpoint.every=2"])).run()
    before = hashes(first)
    branch = Trainer.from_config(load_config(None, [*common, f"checkpoint.dir={tmp_path / 'branch'}",
                                                    f"train.init_from={first / '2'}", "train.init_optimizer=true"]))
    result = branch.run()
    assert result.first_step == 3 and result.losses == straight.losses[2:]
    assert CheckpointStore(tmp_path / "branch", read_only=True).steps() == [4]
    assert hashes(first) == before

    # Without init_optimizer: the parameters of that step, a fresh optimizer, step 0.
    fresh = Trainer.from_config(load_config(None, [*common, f"train.init_from={first / '2'}", "train.steps=1"]))
    store_params, _, position, weights = fresh.starting_state(None)
    assert position.step == 0 and weights.startswith(f"weights: initialised from {first}/2 (train.init_from;")
    saved = load_pretrained(first, MeshConfig(2, 1, 1))  # the newest, step 4: not what was asked for
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(store_params)),
                                                        jax.tree.leaves(jax.device_get(saved.params)), strict=True))


@pytest.mark.parametrize("overrides, error, message", [
    (["train.init_from=/nonexistent/run"], ConfigError,
     r"^train.init_from: '/nonexistent/run' is not a directory; give a checkpoint directory"),
    (["train.init_from=null", "train.init_optimizer=true"], ConfigError,
     r"^train.init_optimizer: takes the optimizer state of train.init_from, which is not set"),
    (["train.init_from={tmp}", "checkpoint.dir={tmp}"], ConfigError,
     r"^train.init_from: '.*' is this run's checkpoint.dir: a run resumes from its own checkpoints by itself"),
    (["train.init_from={imported}", "train.init_optimizer=true"], ConfigError,
     r"^train.init_optimizer: .* is an imported model, which holds parameters only; set train.init_optimizer=false"),
    (["train.init_from={imported}", "model.family=llama", "model.hidden=32"], CheckpointError,
     (r"^checkpoint .*/imported/0: tensor params.blocks.attn.w[kq].kernel is float32\[2, 64, \d, 16\] in the "
     r"checkpoint but this run's model needs float32\[2, 32, \d, 8\]; use the model config it was trained with or "
     r"another train.init_from$")),
], ids=["missing", "optimizer-without-init", "own-directory", "import-optimizer", "other-model"])
def test_what_init_from_cannot_use_is_one_line(imported, tmp_path, overrides, error, message):
    overrides = [o.format(imported=imported, tmp=tmp_path) for o in overrides]
    with pytest.raises(error, match=message) as caught:
        cfg = load_config(imported / CONFIG_FILE, [f"checkpoint.dir={tmp_path / 'run'}", "train.steps=1", *SMALL,
                                                   *overrides])
        Trainer.from_config(cfg).run()
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_delayed_fp8_fine_tunes_an_import_from_an_empty_history_and_exports_the_weights_alone(imported, tmp_path):
    """An import holds no amax history: ``model.fp8=delayed`` starts it empty (the first step scales by each
    tensor's own amax) and records from there; ``export-hf`` writes the weights, not the history."""
    from safetensors.numpy import load_file

    from meshtron.huggingface import export_hf

    finetune = tmp_path / "fp8"
    cfg = load_config(imported / CONFIG_FILE, ["train.steps=2", "model.fp8=delayed", f"checkpoint.dir={finetune}",
                                               *SMALL])
    result = Trainer.from_config(cfg).run()
    history = np.asarray(jax.device_get(result.params["blocks"]["fp8_history"]))
    assert np.all(history[..., :2] > 0) and not np.any(history[..., 2:])
    exported = load_file(export_hf(finetune, tmp_path / "hf") / "model.safetensors")
    assert exported and not [name for name in exported if "fp8" in name]
    assert set(exported) == set(load_file(imported.parent / "hf" / "model.safetensors"))
