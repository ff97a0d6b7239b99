"""An adapter-only LoRA checkpoint and its frozen base: the pointer records the base's identity (a digest of
its parameters' checksums) and its path relative to the checkpoint as well as the absolute one. Another
model put where the base was is refused in one line, every file left as it was; a base and a run moved
together still read, bit for bit; the base itself reads as before."""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_lora import LORA, trainer

from meshtron.checkpoint import CheckpointError, checksums
from meshtron.checkpoint_dirs import read_step_meta
from meshtron.config import MeshConfig
from meshtron.mesh import build_mesh
from meshtron.train.frozen_base import BasePointer, params_digest
from meshtron.trees import leaf_names

LAYOUT = ["parallel.data=2", "checkpoint.async_save=false", "train.steps=1"]


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under ``root`` by its relative path, with its SHA-256 (directories as ``dir``)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def fake_base(directory: Path, step: int, sums: dict[str, int]) -> Path:
    """A directory whose step ``step`` has a meta record holding ``sums`` (all a pointer's lookup reads)."""
    (directory / str(step) / "meta").mkdir(parents=True)
    (directory / str(step) / "meta" / "metadata").write_text(json.dumps({"step": step, "checksums": sums}))
    return directory


def test_the_digest_is_the_same_on_any_mesh_and_vocabulary_padding_and_leaves_out_the_adapters():
    rng = np.random.default_rng(0)
    wte, w = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)
    one = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    eight = build_mesh(MeshConfig(8, 1, 1), jax.devices())

    def digest(mesh, spec, wte, extra=None):
        params = {"wte": wte, "w": w, **(extra or {})}
        placed = jax.device_put(params, jax.tree.map(lambda _: NamedSharding(mesh, spec), params))
        return params_digest({"checksums": checksums({"state": {"params": placed}}, mesh)[0]})

    reference = digest(one, P(), wte)
    assert len(reference) == 64
    padded = np.pad(wte, ((0, 2), (0, 0)))  # the vocabulary padded for another tensor size: zero rows
    assert digest(eight, P("data"), padded) == reference
    assert digest(one, P(), wte, {"kernel_lora_a": jnp.ones((8, 4))}) == reference  # not the base's
    changed = wte.copy()
    changed[0, 0] = 1.0
    assert digest(one, P(), changed) != reference  # another model
    assert params_digest({"step": 3}) is None  # a record without checksums: nothing to check


def test_the_pointer_is_read_relative_first_then_absolute_and_old_pointers_still_read(tmp_path):
    base = fake_base(tmp_path / "a" / "base", 1, {"state.params.w": 7})
    digest = params_digest(read_step_meta(base, 1))
    run = tmp_path / "a" / "run"
    run.mkdir()
    written = BasePointer(str(base), 1, 0, digest).to_meta(run)
    assert written == {"dir": str(base), "dir_relative": "../base", "step": 1, "seed": 0, "params_sha256": digest}
    assert BasePointer(None, None, 3).to_meta(run) == {"dir": None, "step": None, "seed": 3}  # a seed is its identity
    meta = {"lora_base": written}
    assert BasePointer.from_meta(meta, run).directory == str(base)
    moved = tmp_path / "b"
    shutil.move(tmp_path / "a", moved)
    assert BasePointer.from_meta(meta, moved / "run").directory == str(moved / "base")  # moved together
    assert BasePointer.from_meta(meta, tmp_path / "elsewhere").directory == str(base)  # gone: the recorded path
    # the relative path holds another model, the absolute one the base: the base
    fake_base(tmp_path / "a" / "base", 1, {"state.params.w": 7})
    fake_base(tmp_path / "c" / "base", 1, {"state.params.w": 8})
    assert BasePointer.from_meta(meta, tmp_path / "c" / "run").directory == str(base)
    old = BasePointer.from_meta({"lora_base": {"dir": str(base), "step": 1, "seed": 0}}, run)
    assert (old.directory, old.digest) == (str(base), None)  # written before the digest: read, not checked


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """``base`` (a 1-step run, seed 0), ``run`` (a LoRA run from it: adapters and a pointer), ``other`` (the
    same model from seed 1: another base of the same shape at the same step), and the LoRA run's parameters."""
    root = tmp_path_factory.mktemp("pair")
    trainer(*LAYOUT, f"checkpoint.dir={root / 'base'}").run()
    result = trainer(*LORA, *LAYOUT, f"train.init_from={root / 'base'}", f"checkpoint.dir={root / 'run'}").run()
    trainer(*LAYOUT, "train.seed=1", f"checkpoint.dir={root / 'other'}").run()
    return root, jax.device_get(result.params)


def assert_same(a, b) -> None:
    for name, x, y in zip(leaf_names(a), jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.slow
def test_the_base_it_was_trained_on_loads_bit_for_bit(pair):
    from meshtron.pretrained import load_pretrained

    root, trained = pair
    recorded = read_step_meta(root / "run", 1)["lora_base"]
    assert recorded == {"dir": str((root / "base").resolve()), "dir_relative": "../base", "step": 1, "seed": 0,
                        "params_sha256": params_digest(read_step_meta(root / "base", 1))}
    assert recorded["params_sha256"] != params_digest(read_step_meta(root / "other", 1))
    assert_same(load_pretrained(root / "run").params, trained)


@pytest.mark.slow
def test_another_model_where_the_base_was_is_one_line_and_leaves_every_file_as_it_was(pair):
    from meshtron.pretrained import load_pretrained

    root, _ = pair
    shutil.move(root / "base", root / "base.kept")
    try:
        shutil.copytree(root / "other", root / "base")  # re-imported / retrained: same shape, other weights
        before = tree_hashes(root)
        message = (r"^--checkpoint: the frozen base of the adapter-only LoRA checkpoint .*/run, .*/base/1, is not the "
                   r"model it was trained on \(its parameter checksums differ from lora_base.params_sha256\); put the "
                   r"original base back there, or use a checkpoint written with train.lora.save_base=true$")
        with pytest.raises(CheckpointError, match=message):
            load_pretrained(root / "run", argument="--checkpoint")
        with pytest.raises(CheckpointError, match=r"^checkpoint.dir: the frozen base .* is not the model"):
            trainer(*LORA, *LAYOUT, "train.steps=2", f"checkpoint.dir={root / 'run'}").run()  # resuming
        assert tree_hashes(root) == before
    finally:
        shutil.rmtree(root / "base", ignore_errors=True)
        shutil.move(root / "base.kept", root / "base")


@pytest.mark.slow
def test_a_base_and_run_moved_together_load_bit_for_bit(pair):
    from meshtron.pretrained import load_pretrained

    root, trained = pair
    before = jax.device_get(load_pretrained(root / "run").params)
    moved = root / "elsewhere"
    moved.mkdir()
    for name in ("base", "run"):
        shutil.move(root / name, moved / name)
    try:
        assert not (root / "base").exists()  # only the relative path can find it
        after = load_pretrained(moved / "run").params
        assert_same(after, before)
        assert_same(after, trained)
    finally:
        for name in ("base", "run"):
            shutil.move(moved / name, root / name)
        moved.rmdir()
