"""LoRA: adapters beside the block matrices of any contract model, laid out like their base; the base
frozen (no optimizer state, nothing reduced over data); gradients equal one device's on every kind of
layout; a fine-tune from a checkpoint without adapters; merged exports and generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import ConfigError, MeshConfig, load_config
from meshtron.mesh import build_mesh
from meshtron.models.lora import LoraSpec, input_axes, is_adapter, merged, without_adapters
from meshtron.testing import Layout, check_parity
from meshtron.train.loop import Trainer
from meshtron.trees import leaf_names

SEQ = 32
SPEC = LoraSpec(4, alpha=8.0)


def family(name: str, tensor: int = 1, lora: LoraSpec | None = SPEC):
    from families import small

    from meshtron.train.state import ModelDef

    md = small(name, SEQ, tensor)
    return md if lora is None else ModelDef.create(md.factory, rules=md.rules, window=md.window, lora=lora)


def params_of(md, seed=0):
    return jax.device_get(md.init(build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), seed))


def test_a_matrix_reads_as_inputs_by_outputs_beside_the_residual_width():
    assert input_axes(("layers", "embed", "heads", "head_dim")) == 1  # column-parallel: embed in
    assert input_axes(("layers", "heads", "head_dim", "embed")) == 2  # row-parallel: embed out
    assert input_axes(("layers", "embed")) is None  # a norm's scale, a bias
    assert input_axes(("layers", "qkv", "heads", "head_dim")) is None


@pytest.mark.parametrize("name", ["gpt", "llama", "user"])
def test_adapters_sit_beside_every_block_matrix_laid_out_like_it_and_start_as_the_base(name, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    md, base = family(name), family(name, lora=None)
    names = leaf_names(md.shapes())
    adapters = [n for n in names if is_adapter(n)]
    matrices = [n for n, axes in zip(leaf_names(base.shapes()), jax.tree.leaves(
        base.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))) if n.startswith("blocks.") and input_axes(axes)]
    assert sorted(adapters) == sorted([m + "_lora_a" for m in matrices] + [m + "_lora_b" for m in matrices])
    axes = dict(zip(names, jax.tree.leaves(md.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))))
    for m in matrices:
        k = input_axes(axes[m])
        assert axes[m + "_lora_a"] == (*axes[m][: 1 + k], "lora_rank")
        assert axes[m + "_lora_b"] == ("layers", "lora_rank", *axes[m][1 + k :])
    params = params_of(md)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(4, SEQ + 1)), jnp.int32)
    with md.scope():
        with_lora = float(jax.jit(md.loss)(params, tokens))
    plain = {k: v for k, v in merged(params, SPEC).items()}
    with base.scope():
        without = float(jax.jit(base.loss)(plain, tokens))
    assert with_lora == without  # B starts at zero: the adapted model is its base


def test_targets_choose_by_path_or_logical_axis(monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    attn = family("llama", lora=LoraSpec(2, targets=("*attn*",)))
    assert {n.rsplit(".", 1)[0] for n in leaf_names(attn.shapes()) if is_adapter(n)} == {
        "blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", "blocks.attn.wo"}
    mlp = family("llama", lora=LoraSpec(2, targets=("axis:mlp",)))
    assert {n.rsplit(".", 1)[0] for n in leaf_names(mlp.shapes()) if is_adapter(n)} == {
        "blocks.mlp.gate", "blocks.mlp.up", "blocks.mlp.down"}
    with pytest.raises(ConfigError, match="train.lora.targets: .* choose none"):
        family("llama", lora=LoraSpec(2, targets=("nothing",)))


LAYOUTS = {
    "2x1x2": Layout(2, 1, 2),
    "1x2x4-zbh1": Layout(1, 2, 4, "zb-h1"),
    "2x2x2-interleaved": Layout(2, 2, 2, "interleaved", 2),
    "1x2x1-1f1b-kept": Layout(1, 2, 1, "1f1b", recompute=False),
    "2x1x1-context2": Layout(2, 1, 1, context=2),
}


def _lora_layouts():
    for n in ("gpt", "llama", "user"):
        for k in LAYOUTS:
            marks = [] if (n, k) in {("llama", "1x2x4-zbh1"), ("gpt", "2x1x2")} else [pytest.mark.slow]
            if (n, k) == ("llama", "1x2x4-zbh1"):
                marks.append(pytest.mark.both_stacks)
            yield pytest.param(n, k, marks=marks)


@pytest.mark.parametrize("name, key", list(_lora_layouts()))
def test_adapter_gradients_equal_one_device(name, key, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    layout = LAYOUTS[key]
    [report] = check_parity(family(name, layout.tensor), [layout], seq_len=SEQ, documents=True)
    assert report.ok


MODEL = ["model.family=llama", "model.kv_heads=2", "model.layers=4", "model.hidden=32", "model.heads=4",
         "model.mlp_dim=64", "model.seq_len=32", "model.vocab_size=256", "train.batch_size=8", "train.warmup_steps=1",
         "train.eval_every=1000", "train.eval_batches=1", "train.microbatches=2", "train.lr=1e-2"]
LORA = ["train.lora.rank=4", "train.lora.alpha=8"]


def trainer(*overrides: str) -> Trainer:
    return Trainer.from_config(load_config(None, [*MODEL, *overrides]))


def test_the_base_is_frozen_and_only_the_adapters_have_optimizer_state():
    t = trainer(*LORA, "mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "train.steps=3")
    start = jax.device_get(t.init_params())
    params, opt_state, _tokens = t.abstract_step_arguments()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    adapter_bytes = sum(x.size * x.dtype.itemsize for n, x in zip(leaf_names(params), jax.tree.leaves(params))
                        if is_adapter(n))
    assert state_bytes <= 2 * adapter_bytes + 1024  # AdamW's two moments of the adapters, and counters
    result = t.run()
    end = jax.device_get(result.params)
    for name, a, b in zip(leaf_names(start), jax.tree.leaves(start), jax.tree.leaves(end), strict=True):
        if is_adapter(name) and name.endswith("_lora_b"):
            assert np.abs(b).max() > 0, name  # trained away from zero
        elif not is_adapter(name):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_lora_with_zero_or_dropout_is_one_line():
    with pytest.raises(ConfigError, match="train.zero: is 1 with train.lora"):
        trainer(*LORA, "train.zero=1")
    with pytest.raises(ConfigError, match="train.lora.dropout"):
        trainer(*LORA, "train.lora.dropout=0.1")


def compiled_data_bytes(t: Trainer, stage: str | None = None) -> float:
    params, opt_state, tokens = t.abstract_step_arguments()
    t.steps.compile(params, opt_state, tokens, stage)
    return t.steps.data_bytes(stage)


@pytest.mark.slow
def test_one_bit_lamb_compresses_the_adapters_alone():
    layout = ["mesh.data=4", "mesh.pipe=1", "mesh.tensor=2", "train.optimizer=onebit_lamb", "optim.freeze_step=2"]
    lora = trainer(*LORA, *layout, "train.steps=4")
    full = trainer(*layout, "train.steps=4")
    for stage in ("warmup", "compression"):
        # (a tiny model: the embedding and head, which train in neither, are most of it)
        assert compiled_data_bytes(lora, stage) < 0.3 * compiled_data_bytes(full, stage), stage
    start = jax.device_get(lora.init_params())
    result = lora.run()
    assert np.isfinite(result.losses).all()
    for name, a, b in zip(leaf_names(start), jax.tree.leaves(start), jax.tree.leaves(jax.device_get(result.params))):
        if not is_adapter(name):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.slow
@pytest.mark.both_stacks
def test_generation_runs_the_adapters_as_the_merged_model_does(tmp_path):
    from meshtron.generate import Sampler
    from meshtron.pretrained import load_pretrained

    trainer(*LORA, "mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "train.steps=3", "train.lr=5e-2",
            f"checkpoint.dir={tmp_path}").run()
    pretrained = load_pretrained(tmp_path, MeshConfig(1, 1, 1), jax.devices()[:1])
    md = pretrained.model_def
    assert md.lora == LoraSpec(4, 8.0)
    prompt = list(range(5, 15))
    ids = Sampler(md, pretrained.mesh).sample(pretrained.params, prompt, max_new_tokens=12).new_tokens
    assert Sampler(md, pretrained.mesh, use_cache=False).sample(pretrained.params, prompt,
                                                                max_new_tokens=12).new_tokens == ids
    # greedy decoding (KV cache) picks what the adapted model's own forward pass ranks first, wherever
    # that is not a near tie
    with md.scope():
        logits = np.asarray(md.bind(pretrained.params)(jnp.asarray([prompt + list(ids)])))[0, :, :md.vocab_size]
    checked = 0
    for i, token in enumerate(ids):
        row = logits[len(prompt) - 1 + i]
        top = np.sort(row)[-2:]
        if top[1] - top[0] > 1e-4:
            assert int(np.argmax(row)) == token
            checked += 1
    assert checked >= 6
    base = type(md).create(md.factory.__wrapped__, rules=md.rules, window=md.window)
    with base.scope():
        plain = np.asarray(base.bind(without_adapters(pretrained.params))(jnp.asarray([prompt + list(ids)])))
    assert np.max(np.abs(plain[0, :, :md.vocab_size] - logits)) > 1e-3  # the adapters matter


@pytest.mark.slow
def test_a_lora_run_resumes_bit_for_bit(tmp_path):
    layout = [*LORA, "mesh.data=2", "mesh.pipe=2", "mesh.tensor=2", "checkpoint.every=2", "checkpoint.async_save=false"]
    straight = trainer(*layout, "train.steps=4", f"checkpoint.dir={tmp_path / 'a'}").run()
    trainer(*layout, "train.steps=2", f"checkpoint.dir={tmp_path / 'b'}").run()
    resumed = trainer(*layout, "train.steps=4", f"checkpoint.dir={tmp_path / 'b'}").run()
    assert resumed.losses == straight.losses[2:]
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.params)), jax.tree.leaves(jax.device_get(straight.params))):
        np.testing.assert_array_equal(a, b)
