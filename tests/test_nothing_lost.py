"""Nothing a user gave is lost: imports and exports are written whole into new directories and never over
what is there, a failed run leaves no directory behind, a checkpoint that cannot be read is named with what
failed (and a good one is never set aside as damaged), and a directory that holds another run's checkpoints
is refused as such. Every refusal is one line, and every file that was there is byte-identical after it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from subprocess_env import subprocess_env

from meshtron.checkpoint import CheckpointError, CheckpointStore, RunPosition, abstract_like
from meshtron.config import ConfigError, MeshConfig, load_config
from meshtron.huggingface import export_hf, import_hf
from meshtron.mesh import build_mesh
from meshtron.train.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": True}


def hashes(*roots: Path) -> dict[str, str]:
    """Every file under ``roots``, by path, with its sha256."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(Path(root).rglob("*")) if p.is_file()}


def llama_dir(directory: Path) -> Path:
    """A tiny tied Llama in Hugging Face's layout, written with NumPy."""
    from meshtron.models.llama_hf import head_tied, model_config, tensors

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(LLAMA))
    model = model_config(LLAMA, directory / "config.json")
    rng = np.random.default_rng(0)
    weights = {spec.hf.format(i=i): rng.normal(0, 0.1, spec.hf_shape).astype(np.float32)
               for spec in tensors(model) if not (spec.path == "lm_head" and head_tied(LLAMA))
               for i in range(model.layers if spec.per_layer else 1)}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def meshtron(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshtron.cli", *args], check=False, cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)


def one_line_error(run: subprocess.CompletedProcess, pattern: str) -> None:
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron: error: "), run.stderr
    assert re.search(pattern, lines[0]), lines[0]


# ---- imports and exports -------------------------------------------------------------------------


def test_an_import_into_a_directory_that_holds_files_is_refused(tmp_path):
    hf = llama_dir(tmp_path / "hf")
    taken = tmp_path / "mine"
    taken.mkdir()
    (taken / "tokenizer.json").write_text('{"my": "tokenizer"}')
    before = hashes(taken, hf)
    with pytest.raises(ConfigError, match=r"^output: .*/mine already holds files \(tokenizer.json, \.\.\.\); give a "
                                          r"new or empty directory for the checkpoint \(nothing is overwritten\)$"):
        import_hf(hf, taken)
    with pytest.raises(ConfigError, match=r"is inside the input .*hf, which is never written into"):
        import_hf(hf, hf / "meshtron")
    assert hashes(taken, hf) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]


def test_a_truncated_safetensors_file_is_one_line_and_writes_nothing(tmp_path):
    hf = llama_dir(tmp_path / "hf")
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file \(.*\); it may be "
                                              r"truncated: download or copy it again$") as caught:
        import_hf(hf, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_import_and_export_write_new_directories_whole_and_never_replace_one(tmp_path):
    """As a user runs them: an import with an override after its flag, an export, then the mistakes --
    exporting again over it, into the checkpoint itself or below it -- each one line, nothing changed."""
    hf = llama_dir(tmp_path / "hf")
    imported = meshtron("import-hf", str(hf), "--output", "runs/imp", "model.seq_len=32", cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert load_config(tmp_path / "runs" / "imp" / "config.yaml").model.seq_len == 32
    old_umask = os.umask(0o022)
    try:
        exported = meshtron("export-hf", "runs/imp", "--output", "out", cwd=tmp_path)
    finally:
        os.umask(old_umask)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    before = hashes(tmp_path / "out", tmp_path / "runs")
    one_line_error(meshtron("export-hf", "runs/imp", "--output", "out", cwd=tmp_path),
                   r"--output: out already holds files \(config.json, \.\.\.\); give a new or empty directory for "
                   r"the export \(nothing is overwritten\)")
    for inside in ("runs/imp", "runs/imp/hf"):
        one_line_error(meshtron("export-hf", "runs/imp", "--output", inside, cwd=tmp_path),
                       rf"--output: {inside} is inside the input runs/imp, which is never written into")
    one_line_error(meshtron("import-hf", str(hf), "--output", "out", cwd=tmp_path), r"--output: out already holds")
    assert hashes(tmp_path / "out", tmp_path / "runs") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out", "runs"]  # no partial directory left
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["imp"]
    # an export into an empty directory made for it is fine
    (tmp_path / "empty").mkdir()
    assert export_hf(tmp_path / "runs" / "imp", tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "empty" / "model.safetensors").is_file()


# ---- runs ----------------------------------------------------------------------------------------


def test_a_failed_run_leaves_no_directory_behind(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = load_config("cpu8", ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1",
                               f"checkpoint.dir={tmp_path / 'runs' / 'new' / 'ckpt'}",
                               f"train.init_from={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match=r"train.init_from: .*empty holds no checkpoint"):
        Trainer.from_config(cfg, jax.devices()[:1]).run()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_zero_on_one_data_rank_says_it_splits_nothing(capsys):
    cfg = load_config("cpu8", ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=2", "parallel.zero=1", "parallel.microbatches=1"])
    Trainer.from_config(cfg, jax.devices()[:2], read_data=False)
    assert ("parallel.zero=1: the mesh has one data rank (parallel.data=1), so nothing is split over it; this run is the "
            "same as parallel.zero=0") in capsys.readouterr().err


@pytest.mark.slow
def test_a_directory_with_another_runs_checkpoints_is_refused_naming_what_differs(tmp_path):
    """The fine-tuning guide's order: a full fine-tune, then LoRA from the same config into the same directory."""
    common = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=2", "parallel.microbatches=1", "train.batch_size=4",
              "model.layers=2", f"checkpoint.dir={tmp_path / 'ft'}", "train.eval_batches=1"]
    Trainer.from_config(load_config("llama_cpu8", [*common, "train.steps=1"]), jax.devices()[:2]).run()
    before = hashes(tmp_path)
    lora = load_config("llama_cpu8", [*common, "train.steps=2", "train.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"^checkpoint.dir: .*/ft holds the checkpoints of another run "
                                          r"\(train.lora.rank: 0 there, 4 here\), which this run cannot resume; give "
                                          r"this run a directory of its own \(checkpoint.dir=.*/ft-2, say\)"):
        Trainer.from_config(lora, jax.devices()[:2]).run()
    wider = load_config("llama_cpu8", [*common, "train.steps=2", "model.vocab_size=300"])
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 300 differs from the 256 of the run this checkpoint.dir "
                                          r"\(.*/ft\) resumes; set model.vocab_size=256"):
        Trainer.from_config(wider, jax.devices()[:2]).run()
    assert hashes(tmp_path) == before


# ---- checkpoints that cannot be read -------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """A store with steps 1 and 2 of a small state, and a restore target for it."""
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    state = {"params": {"w": jax.numpy.arange(4096, dtype=jax.numpy.float32)}}
    store = CheckpointStore(tmp_path / "ckpt", keep=2, async_save=False)
    for step in (1, 2):
        store.save(RunPosition(step, step, step), state, None, mesh, {})
    store.close()
    target = abstract_like(state, jax.tree.map(lambda x: x.sharding, state))
    return tmp_path / "ckpt", mesh, target


def _truncate(step_dir: Path) -> None:
    data = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])


def test_every_damaged_checkpoint_is_named_with_what_failed(saved):
    directory, mesh, target = saved
    for step in (1, 2):
        _truncate(directory / str(step))
    store = CheckpointStore(directory, read_only=True)
    with pytest.raises(CheckpointError, match=r"^checkpoint.dir .*ckpt: every checkpoint is damaged or incomplete "
                                              r"\(step 2: .+; step 1: .+\); move them away") as caught:
        store.restore_newest(target, None, mesh)
    assert "\n" not in str(caught.value)


def test_a_failure_that_is_not_damage_sets_nothing_aside(saved, monkeypatch):
    directory, mesh, target = saved
    before = hashes(directory)
    store = CheckpointStore(directory)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.0 GiB")

    monkeypatch.setattr(store._manager, "restore", out_of_memory)
    with pytest.raises(CheckpointError, match=r"ckpt/2: reading it failed \(MemoryError: RESOURCE_EXHAUSTED: Out of "
                                              r"memory .*\); that is not damage to its files, so nothing was skipped "
                                              r"or moved"):
        store.restore_newest(target, None, mesh)
    store.close()
    assert hashes(directory) == before and sorted(p.name for p in directory.iterdir()) == ["1", "2"]


# ---- as a user runs them: the command line ---------------------------------------------------------


@pytest.mark.slow
def test_the_command_line_refuses_what_cannot_work_in_one_line_and_changes_nothing(tmp_path):
    """Each mistake as a user makes it: one ``meshtron: error:`` line, exit status 2, every file that was there
    byte-identical and nothing new written."""
    from meshtron.data.tokenizers import train_bpe

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(40)))
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": "x " * 60, "response": "yes"}) + "\n" for _ in range(40)))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"prompt": "hi", "response": ""}) + "\n")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 50)
    train_bpe([text], 280, tmp_path / "tok.json", min_frequency=1)
    for args in (["--input", str(corpus), "--output", "data/web"], ["--sft", "--input", str(sft), "--output", "data/sft"]):
        made = meshtron("preprocess", *args, "--tokenizer", "bytes", cwd=tmp_path)
        assert made.returncode == 0, made.stderr
    before = hashes(tmp_path)
    small = ["--config", "cpu8", "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1",
             "train.batch_size=4", "train.steps=1"]
    mistakes = [
        (["preprocess", "--input", "empty.jsonl", "--tokenizer", "bytes", "--output", "data/web"],
         r"--input: .*empty.jsonl holds no document \(empty, or blank lines only\); give files with text"),
        (["preprocess", "--sft", "--input", "empty.jsonl", "--tokenizer", "bytes", "--output", "data/sft"],
         r"--input: .*empty.jsonl holds no example"),
        (["preprocess", "--sft", "--input", "no_answer.jsonl", "--tokenizer", "bytes", "--output", "data/sft"],
         r"--input: .*no_answer.jsonl:1: 'response' is empty, so there is no answer to learn"),
        (["train", *small, "data.path=data/sft", "model.seq_len=64", "checkpoint.dir=runs/sft"],
         r"data.path: every one of the \d+ training examples of .*data/sft loses its answer at model.seq_len=64"),
        (["train", *small, "data.path=data/web", "data.tokenizer=tok.json", "model.vocab_size=512",
          "checkpoint.dir=runs/tok"],
         r"data.path: .*data/web was tokenized with bytes but this run's tokenizer is .*tok.json"),
        (["train", *small, "checkpoint.dir=runs/new/ckpt", "train.init_from=data"],
         r"train.init_from: .*data holds no checkpoint"),
        (["export-hf", "data", "--output", "out", "train.steps=3"], None),  # argparse's own usage line
    ]
    for args, pattern in mistakes:
        run = meshtron(*args, cwd=tmp_path)
        if pattern is None:
            assert run.returncode == 2 and "unrecognized arguments: train.steps=3" in run.stderr
        else:
            one_line_error(run, pattern)
        assert hashes(tmp_path) == before, args
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["corpus.jsonl", "sft.jsonl", "empty.jsonl", "no_answer.jsonl", "text.txt", "tok.json", "data"])
    globbed = meshtron("train", "--config", "cpu8", "train.lora.rank=4", "train.lora.targets=*attn*", "--print-config",
                       cwd=tmp_path)
    assert globbed.returncode == 0 and "- '*attn*'" in globbed.stdout, globbed.stderr
