"""LoRA: adapters beside the block matrices of any contract model, laid out like their base; the base
frozen (no optimizer state, nothing reduced over data); gradients equal one device's on every kind of
layout; a fine-tune from a checkpoint without adapters; merged exports and generation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtron.config import ConfigError, MeshConfig, load_config
from meshtron.describe import bytes_per_device
from meshtron.hlo.collectives import collectives
from meshtron.mesh import build_mesh
from meshtron.models.lora import (
    LoraSpec,
    adapter_dropout,
    adapter_hook,
    input_axes,
    is_adapter,
    lora_spec,
    merged,
    without_adapters,
)
from meshtron.testing import Layout, check_parity
from meshtron.train.frozen_base import params_digest
from meshtron.train.loop import Trainer
from meshtron.train.state import model_def_from_config
from meshtron.trees import leaf_names

SEQ = 32
SPEC = LoraSpec(4, alpha=8.0)


def family(name: str, tensor: int = 1, lora: LoraSpec | None = SPEC):
    from families import small

    from meshtron.train.state import ModelDef

    md = small(name, SEQ, tensor)
    return md if lora is None else ModelDef.create(md.factory, rules=md.rules, adaptation=lora)


def params_of(md, seed=0):
    return jax.device_get(md.init(build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), seed))


def test_a_matrix_reads_as_inputs_by_outputs_beside_the_residual_width():
    assert input_axes(("layers", "embed", "heads", "head_dim")) == 1  # column-parallel: embed in
    assert input_axes(("layers", "heads", "head_dim", "embed")) == 2  # row-parallel: embed out
    assert input_axes(("layers", "embed")) is None  # a norm's scale, a bias
    assert input_axes(("layers", "qkv", "heads", "head_dim")) is None


# GPT's and Llama's projections are the same nnx.Einsum modules: CI runs Llama and the user's model
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.extended), "llama", "user"])
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


# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
LAYOUTS = {
    "2x1x2": Layout(2, 1, 2),
    "1x2x4-zbh1": Layout(1, 2, 4, "zb-h1", microbatches=2),
    "2x2x2-interleaved": Layout(2, 2, 2, "interleaved", 2),
    "1x2x1-1f1b-kept": Layout(1, 2, 1, "1f1b", recompute=False),
    "2x1x1-context2": Layout(2, 1, 1, context=2),
    "1x1x1-context4-ulysses": Layout(1, 1, 1, context=4, context_attention="ulysses"),
}


# CI runs one case per family and every schedule: llama on 2x2x2 interleaved (with 2x1x2) and on 1x2x4 zb-h1,
# gpt on 2x1x2, the user's model on 1f1b with recomputation kept, context ring and Ulysses; make test the rest.
EXTENDED_LORA_LAYOUTS = {"gpt-1x2x4-zbh1", "user-1x2x4-zbh1", "gpt-2x2x2-interleaved", "user-2x1x2+2x2x2-interleaved",
                         "gpt-1x2x1-1f1b-kept+2x1x1-context2+1x1x1-context4-ulysses",
                         "llama-1x2x1-1f1b-kept+2x1x1-context2+1x1x1-context4-ulysses"}


def _lora_marks(name: str, key: str) -> tuple[str, ...]:
    """The names of the tiers one family's layout runs in."""
    marks = () if (name, key) in {("llama", "1x2x4-zbh1"), ("gpt", "2x1x2")} else ("slow",)
    return marks + (("both_stacks",) if (name, key) == ("llama", "1x2x4-zbh1") else ())


def _lora_layouts():
    """One case per family, tensor size and tier: the oracle runs the one-device reference once and
    compares every layout of the case with it (the batch, 8 rows, is the same for every layout)."""
    for n in ("gpt", "llama", "user"):
        groups: dict[tuple, list[str]] = {}
        for k, layout in LAYOUTS.items():
            groups.setdefault((layout.tensor, _lora_marks(n, k)), []).append(k)
        for (_, marks), keys in groups.items():
            case = f"{n}-{'+'.join(keys)}"
            extended = [pytest.mark.extended] if case in EXTENDED_LORA_LAYOUTS else []
            yield pytest.param(n, keys, id=case, marks=[getattr(pytest.mark, m) for m in marks] + extended)


@pytest.mark.parametrize("name, keys", list(_lora_layouts()))
def test_adapter_gradients_equal_one_device(name, keys, monkeypatch):
    monkeypatch.syspath_prepend("tests/models")
    layouts = [LAYOUTS[key] for key in keys]
    reports = check_parity(family(name, layouts[0].tensor), layouts, seq_len=SEQ, documents=True)
    assert len(reports) == len(keys) and all(report.ok for report in reports), reports


MODEL = ["model.family=llama", "model.kv_heads=2", "model.layers=4", "model.hidden=32", "model.heads=4",
         "model.mlp_dim=64", "model.seq_len=32", "model.vocab_size=256", "train.batch_size=8", "train.warmup_steps=1",
         "train.eval_every=1000", "train.eval_batches=1", "parallel.microbatches=2", "train.lr=1e-2"]
LORA = ["train.lora.rank=4", "train.lora.alpha=8"]


def trainer(*overrides: str) -> Trainer:
    return Trainer.from_config(load_config(None, [*MODEL, *overrides]))


ON_2X2X2 = [*LORA, "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "train.steps=3", "train.lr=5e-2"]


@pytest.fixture(scope="module")
def run_2x2x2(tmp_path_factory):
    """One LoRA run on 2x2x2, 3 steps (zero=0) at a learning rate at which the adapters matter, with a
    checkpoint: its trainer, starting parameters, result and checkpoint directory, shared by the
    frozen-base, zero-level and generation tests (each ran this training on its own before)."""
    directory = tmp_path_factory.mktemp("lora-2x2x2")
    t = trainer(*ON_2X2X2, f"checkpoint.dir={directory}")
    start = jax.device_get(t.init_params())
    return t, start, t.run(), directory


def test_the_base_is_frozen_and_only_the_adapters_have_optimizer_state(run_2x2x2):
    t, start, result, _ = run_2x2x2
    params, opt_state, _tokens = t.abstract_step_arguments()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    adapter_bytes = sum(x.size * x.dtype.itemsize for n, x in zip(leaf_names(params), jax.tree.leaves(params))
                        if is_adapter(n))
    assert state_bytes <= 2 * adapter_bytes + 1024  # AdamW's two moments of the adapters, and counters
    end = jax.device_get(result.params)
    for name, a, b in zip(leaf_names(start), jax.tree.leaves(start), jax.tree.leaves(end), strict=True):
        if is_adapter(name) and name.endswith("_lora_b"):
            assert np.abs(b).max() > 0, name  # trained away from zero
        elif not is_adapter(name):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_bad_dropout_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"train.lora.dropout: must be in \[0, 1\), got 1.0"):
        load_config(None, [*MODEL, *LORA, "train.lora.dropout=1.0"])
    # a user's model reading its matrices itself: its adapters are merged, which cannot drop inputs
    monkeypatch.syspath_prepend("tests/models")
    md = family("user", lora=LoraSpec(4, dropout=0.1))
    with md.scope(), adapter_dropout(0.1, 0), pytest.raises(ConfigError, match=(
            r"train.lora.dropout: is 0.1, and blocks.w_in is a matrix the model reads itself .* set "
            r"train.lora.dropout=0 or narrow train.lora.targets")):
        jax.eval_shape(md.loss, md.shapes(), jax.ShapeDtypeStruct((2, SEQ + 1), jnp.int32))


def with_random_b(params, seed=1):
    """``params`` with every adapter's B drawn at random (trained adapters, not the zeros they start as)."""
    key = jax.random.key(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, x) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        out.append(0.05 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
                   if name.endswith("_lora_b']") else x)
    return jax.tree.unflatten(treedef, out)


# CI: Llama's Einsum projections (GPT's are the same modules) and the user's merged matrices
@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.extended), "llama", "user"])
def test_adapters_on_activations_equal_the_merged_matrices(name, monkeypatch):
    """GPT's and Llama's projections are nnx.Einsum modules: their adapters run on the activations; the user's
    model reads its matrices itself: merged. Either way the loss is the merged model's, and the adapters'
    gradients are those of W + (alpha/r)·A B."""
    monkeypatch.syspath_prepend("tests/models")
    md, base = family(name), family(name, lora=None)
    params = with_random_b(params_of(md))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(4, SEQ + 1)), jnp.int32)
    with md.scope():
        loss, grads = jax.jit(jax.value_and_grad(md.loss))(params, tokens)

    def through_merged(p):
        with base.scope():
            return base.loss(merged(p, SPEC), tokens)

    expected_loss, expected = jax.jit(jax.value_and_grad(through_merged))(params)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for n, g, e in zip(leaf_names(params), jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        if is_adapter(n):
            np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-6, err_msg=n)
        elif n.startswith("blocks.") and input_axes(dict(zip(leaf_names(params), jax.tree.leaves(
                md.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))))[n]):
            assert not np.any(g), n  # the frozen matrices have no gradient


def step_flops(*overrides: str) -> float:
    t = Trainer.from_config(load_config(None, [*MODEL, "model.family=gpt", "model.hidden=128", "model.mlp_dim=512",
                                               "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", *overrides]),
                            jax.devices()[:1], read_data=False)
    return t.steps.compile(*t.abstract_step_arguments()).cost_analysis()["flops"]


def test_the_step_forms_no_gradient_of_the_frozen_matrices():
    """The backward of a block matrix is two matmuls the size of its forward (the input's gradient and
    the matrix's): with the adapters on the activations the second is not formed, so a LoRA step costs
    about 2/3 of a full one in the blocks (the head, which does not train, also skips its matrix's)."""
    full, lora = step_flops(), step_flops(*LORA)
    assert lora < 0.75 * full, (lora, full)


def test_dropout_drops_the_adapters_inputs_at_its_rate():
    def block_with(hook, x):
        """A block of one bias-free zero nnx.Linear with A = B = I and scale 1: it computes drop(x)."""
        block = type("Block", (nnx.Module,), {})()
        block.proj = nnx.Linear(256, 256, use_bias=False, kernel_init=nnx.initializers.zeros, rngs=nnx.Rngs(0))
        block.proj.kernel_lora_a, block.proj.kernel_lora_b = nnx.Param(jnp.eye(256)), nnx.Param(jnp.eye(256))
        hook(block, x)
        return np.asarray(block.proj(x))

    hook = adapter_hook(LoraSpec(256, alpha=256.0, dropout=0.25))
    x = jnp.ones((8, 256), jnp.float32)
    with adapter_dropout(0.25, seed=3):
        y = block_with(hook, x)
        again = block_with(hook, x)
        other = block_with(hook, 2 * x)
    assert 0.22 < np.mean(y == 0) < 0.28
    np.testing.assert_allclose(y[y != 0], 1 / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(again, y)  # the same block input: the same mask (its recomputation)
    assert np.mean((other == 0) != (y == 0)) > 0.2  # another input: another mask
    np.testing.assert_allclose(block_with(hook, x), 1.0, rtol=1e-6)  # outside training: nothing dropped


def test_reading_an_adapted_kernel_gives_the_merged_matrix_and_is_refused_with_dropout():
    def linear_block():
        block = type("Block", (nnx.Module,), {})()
        block.proj = nnx.Linear(4, 4, use_bias=False, rngs=nnx.Rngs(0))
        block.proj.kernel_lora_a = nnx.Param(jnp.arange(8.0).reshape(4, 2))
        block.proj.kernel_lora_b = nnx.Param(jnp.arange(8.0).reshape(2, 4) / 10)
        return block

    block = linear_block()
    w, a, b = block.proj.kernel[...], block.proj.kernel_lora_a[...], block.proj.kernel_lora_b[...]
    adapter_hook(LoraSpec(2, alpha=4.0))(block, None)
    np.testing.assert_allclose(block.proj.kernel[...], w + 2.0 * a @ b, rtol=1e-6)  # W + (alpha/r)·A B
    block = linear_block()
    with adapter_dropout(0.1, 0):
        adapter_hook(LoraSpec(2, alpha=4.0, dropout=0.1))(block, jnp.ones((1, 4)))
    with pytest.raises(ConfigError, match=r"train.lora.dropout: is 0.1, and the model reads the adapted "
                                          r"matrix Linear.kernel itself instead of calling its module"):
        block.proj.kernel[...]


@pytest.mark.slow
@pytest.mark.fusion_emitters  # rtol 1e-4 holds the default emitters' rounding: one adapter value is 2e-4 apart under
# the element-wise ones on some CPUs (tests/run_suite.py)
def test_lora_trains_alike_at_every_zero_level_with_the_base_frozen(run_2x2x2):
    _, start, expected, _ = run_2x2x2  # the zero=0 reference: the frozen-base test's run
    for zero in (["parallel.zero=1"], ["parallel.zero=3"]):  # (gather_once: tests/test_zero.py)
        result = trainer(*ON_2X2X2, *zero).run()
        np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-5, err_msg=str(zero))
        for name, a, b, s in zip(leaf_names(start), jax.tree.leaves(jax.device_get(result.params)),
                                 jax.tree.leaves(jax.device_get(expected.params)), jax.tree.leaves(start), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"{zero} {name}")
            if not is_adapter(name):
                np.testing.assert_array_equal(a, s, err_msg=f"{zero} {name}")


def compiled_bytes(*overrides: str):
    """Per device: parameter and optimizer-state bytes the compiled step takes, and bytes sent over data."""
    t = Trainer.from_config(load_config(None, [*MODEL, "parallel.data=8", "parallel.pipe=1", "parallel.tensor=1",
                                               "train.batch_size=16", *overrides]), read_data=False)
    params, opt_state, tokens = t.abstract_step_arguments()
    program = t.steps.compile(params, opt_state, tokens)
    param_in, opt_in = program.input_shardings[0][:2]
    data = sum(c.total_wire_bytes for c in collectives(program, t.mesh) if "data" in c.axes)
    return t, bytes_per_device(params, param_in), bytes_per_device(opt_state, opt_in), data


@pytest.mark.slow
def test_zero_splits_the_adapters_state_and_the_frozen_base_and_reduces_only_the_adapters():
    """zero=1: the adapters' moments split over data, the traffic zero=0's (their gradients alone).
    zero=3: the frozen base split too, each layer's matrices all-gathered as it runs (forward, and
    again for the backward) -- and only the adapters' gradients reduce-scattered: nothing of the base
    is reduced."""
    _, params0, opt0, data0 = compiled_bytes(*LORA)
    _, params1, opt1, data1 = compiled_bytes(*LORA, "parallel.zero=1")
    t3, params3, opt3, data3 = compiled_bytes(*LORA, "parallel.zero=3")
    d, m, gathers = 8, 2, 2
    shapes = t3.model_def.shapes()
    sizes = {n: math.prod(x.shape) * x.dtype.itemsize for n, x in zip(leaf_names(shapes), jax.tree.leaves(shapes))}
    whole = {n for n, _ in t3.steps.zero.replicated()}  # adapters no data-divisible free dimension of which is left
    assert whole and all(is_adapter(n) for n in whole)
    kept = sum(sizes[n] for n in whole)
    adapters = sum(b for n, b in sizes.items() if is_adapter(n))
    assert data1 == pytest.approx(data0, rel=0.01)
    assert data0 == pytest.approx(2 * (d - 1) / d * adapters, rel=0.01)  # an all-reduce of the adapters alone
    assert params1 == params0 and opt1 == pytest.approx((opt0 - 2 * kept) / d + 2 * kept, rel=0.02)
    assert params3 == pytest.approx((params0 - kept) / d + kept, rel=0.02) and opt3 == opt1
    blocks = sum(b for n, b in sizes.items() if n.startswith("blocks.") and n not in whole)
    split_adapters = sum(b for n, b in sizes.items() if is_adapter(n) and n not in whole)
    shared = sum(b for n, b in sizes.items() if not n.startswith("blocks."))  # embedding, head, norm: frozen
    ring = (d - 1) / d
    expected = ring * (m * gathers * blocks + m * split_adapters + shared) + 2 * ring * kept
    assert data3 == pytest.approx(expected, rel=0.01)


def compiled_data_bytes(t: Trainer, stage: str | None = None) -> float:
    params, opt_state, tokens = t.abstract_step_arguments()
    t.steps.compile(params, opt_state, tokens, stage)
    return t.steps.data_bytes(stage)


@pytest.mark.slow
def test_one_bit_lamb_compresses_the_adapters_alone():
    layout = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "train.optimizer=onebit_lamb", "optim.freeze_step=2"]
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


@pytest.mark.slow  # generation on the second stack: test_generate.py; LoRA there: the adapter gradients
def test_generation_runs_the_adapters_as_the_merged_model_does(run_2x2x2):
    from meshtron.generate import Sampler
    from meshtron.pretrained import load_pretrained

    pretrained = load_pretrained(run_2x2x2[3], MeshConfig(1, 1, 1), jax.devices()[:1])
    md = pretrained.model_def
    assert md.adaptation == LoraSpec(4, 8.0)
    prompt = list(range(5, 15))
    execution = pretrained.execution
    ids = Sampler(md, pretrained.mesh, execution=execution).sample(pretrained.params, prompt,
                                                                   max_new_tokens=12).new_tokens
    assert Sampler(md, pretrained.mesh, execution=execution, use_cache=False).sample(
        pretrained.params, prompt, max_new_tokens=12).new_tokens == ids
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
    base = type(md).create(md.factory.__wrapped__, rules=md.rules)
    with base.scope():
        plain = np.asarray(base.bind(without_adapters(pretrained.params))(jnp.asarray([prompt + list(ids)])))
    assert np.max(np.abs(plain[0, :, :md.vocab_size] - logits)) > 1e-3  # the adapters matter


@pytest.mark.slow
def test_a_lora_run_with_dropout_resumes_bit_for_bit_and_trains_differently_from_none(tmp_path):
    # One zb-h1 run with dropout serves both properties (they were two tests, with 1F1B for the resume):
    # under zb-h1 a layer's mask must be redrawn alike in its forward, its B and its W recomputations.
    import shutil

    layout = [*LORA, "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=zb-h1",
              "checkpoint.every=2", "checkpoint.async_save=false"]
    directory = tmp_path / "a"
    straight = trainer(*layout, "train.lora.dropout=0.2", "train.steps=4", f"checkpoint.dir={directory}").run()
    none = trainer(*layout, "train.steps=4").run()
    # B is zero until the first update with a learning rate above 0 (after the warmup's first step): the
    # third step is the first whose adapters add anything to drop
    assert straight.losses[:2] == none.losses[:2] and abs(straight.losses[2] - none.losses[2]) > 1e-5
    assert straight.heldout_loss != none.heldout_loss and np.isfinite(straight.heldout_loss)
    # resumed from the run's own step-2 checkpoint (a run of train.steps=2 would compile another
    # program: the learning-rate schedule ends at train.steps)
    shutil.rmtree(directory / "4")
    resumed = trainer(*layout, "train.lora.dropout=0.2", "train.steps=4", f"checkpoint.dir={directory}").run()
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.params)), jax.tree.leaves(jax.device_get(straight.params))):
        np.testing.assert_array_equal(a, b)


def tensor_bytes(saved: dict) -> int:
    """Bytes of the tensors a checkpoint step holds (``CheckpointStore.saved_tensors``)."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in saved.values())


@pytest.mark.slow
def test_checkpoints_hold_the_adapters_and_point_to_the_base(tmp_path):
    """A LoRA run from a base checkpoint writes the adapters (and their optimizer state) and a pointer to
    the base; resuming, generation's loading and init_from follow it back, bit for bit; a base that is
    gone is one line; train.lora.save_base=true writes self-contained checkpoints."""
    import shutil

    from meshtron.checkpoint import CheckpointError, CheckpointStore
    from meshtron.checkpoint_dirs import read_step_meta
    from meshtron.pretrained import load_pretrained

    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "checkpoint.async_save=false"]
    base = tmp_path / "base"
    trainer(*layout, "train.steps=2", f"checkpoint.dir={base}").run()
    lora = [*LORA, *layout, f"train.init_from={base}", "checkpoint.every=2"]
    # the straight run also writes the self-contained checkpoints (save_base changes what is saved, not the training)
    straight = trainer(*lora, "train.steps=4", "train.lora.save_base=true", f"checkpoint.dir={tmp_path / 'a'}").run()
    # the adapter-only run trains to step 4 too (the straight run's program: a run of train.steps=2 would
    # compile another, its learning-rate schedule ending at step 2), and resumes from its step 2 below
    trainer(*lora, "train.steps=4", f"checkpoint.dir={tmp_path / 'b'}").run()
    shutil.rmtree(tmp_path / "b" / "4")
    meta = read_step_meta(tmp_path / "b", 2)
    assert meta["lora_base"] == {"dir": str(base.resolve()), "dir_relative": "../base", "step": 2, "seed": 0,
                                 "params_sha256": params_digest(read_step_meta(base, 2))}
    stores = CheckpointStore(tmp_path / "b", read_only=True), CheckpointStore(base, read_only=True)
    held, whole = (store.saved_tensors(2) for store in stores)
    for store in stores:
        store.close()
    saved = sorted(n.removeprefix("params.") for n in held if n.startswith("params."))
    assert saved == sorted(n for n in leaf_names(straight.params) if is_adapter(n))  # nothing of the base
    assert tensor_bytes(held) < 0.2 * tensor_bytes(whole)  # the adapters and their moments, against the model's
    resumed = trainer(*lora, "train.steps=4", f"checkpoint.dir={tmp_path / 'b'}").run()
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]
    loaded = load_pretrained(tmp_path / "b", argument="--checkpoint")
    assert loaded.step == 4
    for name, a, b, c in zip(leaf_names(loaded.params), jax.tree.leaves(jax.device_get(loaded.params)),
                             jax.tree.leaves(jax.device_get(straight.params)),
                             jax.tree.leaves(jax.device_get(resumed.params)), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_array_equal(c, b, err_msg=name)
    # a run from the adapter-only checkpoint points to the same base, not to that checkpoint
    trainer(*LORA, *layout, f"train.init_from={tmp_path / 'b'}", "train.steps=4",  # (the straight run's program)
            f"checkpoint.dir={tmp_path / 'c'}").run()
    assert read_step_meta(tmp_path / "c", 4)["lora_base"] == meta["lora_base"]

    assert "lora_base" not in read_step_meta(tmp_path / "a", 2)
    shutil.move(base, tmp_path / "moved")
    with pytest.raises(CheckpointError, match=r"--checkpoint: an adapter-only LoRA checkpoint whose frozen base, "
                                              r".*base/2, is gone; put the base back there"):
        load_pretrained(tmp_path / "b", argument="--checkpoint")
    assert jax.tree.leaves(load_pretrained(tmp_path / "a").params)  # self-contained


def test_a_rank_above_the_matrices_rank_is_one_line():
    cfg = load_config("llama_cpu8", ["train.lora.rank=400"])  # hidden 128: no block matrix has rank 400
    with pytest.raises(ConfigError, match=r"^train.lora.rank: 400 is above the rank of blocks\..* \(\d+ x \d+ per "
                                          r"layer: (\d+)\); use a rank of at most \1, or train the whole model"):
        model_def_from_config(cfg.model, 1, adaptation=lora_spec(cfg.train.lora)).shapes()
