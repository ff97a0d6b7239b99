"""FP8 weights quantized once per step in the pipeline runtime: each stage's layers are quantized before the
tick loop (:attr:`meshtron.pipeline.stage.StageFunctions.prepare`) and every forward, recomputation and W pass
multiplies by those bytes, a mixture of experts' grouped expert weights included. The compiled step says each
weight is cast to e4m3 once per step, and training gives bit for bit what quantizing at every use gives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import load_config
from meshtron.hlo.text import execution_counts, leaves, parse_hlo_module
from meshtron.models.fp8 import PreparedWeights, projection_einsum, projection_ragged_dot, quantized_weights
from meshtron.trace_context import using

# Llama, hidden 64 (4 heads of 16, 2 key/value heads), MLP 224, on a 1x2x1 mesh (pipe 2): one layer per stage and
# chunk, two microbatches -- the smallest pipelined step. Each layer's weights by element count: wq and wo
# 64x64, wk and wv 64x32, gate, up and down 64x224 (activations and the vocabulary's matrices have other sizes).
MODEL = ["model.family=llama", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=224",
         "model.seq_len=20", "model.vocab_size=256", "model.dtype=bfloat16", "parallel.tensor=1", "parallel.pipe=2",
         "parallel.microbatches=2", "train.batch_size=8", "train.eval_every=1000", "train.eval_batches=1"]
LAYER_WEIGHTS = {64 * 64: 2, 64 * 32: 2, 64 * 224: 3}  # element count: weights of that size per layer


# The same model as a Mixtral: 4 experts (top 2) of width 56 in place of the MLP. On a 2x2x1 mesh the experts
# split over data, so each device holds 2 of each of gate, up [2, 64, 56] and down [2, 56, 64] (7168 elements;
# the rows the experts multiply, 160x64 and 160x56, have other sizes).
EXPERTS = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.mlp_dim=56"]
EXPERT_LAYER_WEIGHTS = {64 * 64: 2, 64 * 32: 2, 2 * 64 * 56: 3}


def _trainer(schedule: str, fp8: str, zero: int = 0, data: int = 1, steps: int = 2, extra: tuple[str, ...] = ()):
    from meshtron.train.loop import Trainer

    chunks = 2 if schedule == "interleaved" else 1
    cfg = load_config("llama_cpu8", [*MODEL, f"model.layers={2 * chunks}", f"parallel.schedule={schedule}",
                                     f"parallel.chunks={chunks}", f"parallel.data={data}", f"parallel.zero={zero}",
                                     f"model.fp8={fp8}", f"train.steps={steps}", *extra])
    return Trainer.from_config(cfg)


def weight_quantizations(text: str, sizes: set[int]) -> dict[int, int]:
    """Per element count in ``sizes``: how many times a run of the program casts a value of that size to e4m3
    (each cast instruction times the runs of the computation holding it)."""
    module = parse_hlo_module(text)
    runs = execution_counts(module)
    found: dict[int, int] = {}
    for name, computation in module.computations.items():
        for i in computation.instructions:
            shape = leaves(i.shape)[0] if i.opcode == "convert" else None
            if shape is not None and str(shape.dtype) == "f8e4m3fn" and shape.elements in sizes and name in runs:
                count, unknown = runs[name]
                assert not unknown, f"{name}: a loop without a known trip count"
                found[shape.elements] = found.get(shape.elements, 0) + count
    return found


def _expected(layers_per_stage: int) -> dict[int, int]:
    return {size: n * layers_per_stage for size, n in LAYER_WEIGHTS.items()}


def step_quantizations(trainer, sizes: set[int]) -> dict[int, int]:
    """:func:`weight_quantizations` of ``trainer``'s compiled train step (the one its run compiled, if it ran)."""
    params, opt_state, tokens = trainer.abstract_step_arguments()
    return weight_quantizations(trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text(),
                                sizes)


# Where a step quantizes is the runtime's: it calls the stage's ``prepare`` once before the tick loop, for any
# ``model.fp8``, and the schedule decides how often the layers then run (1F1B's forward and recomputation,
# interleaved's two chunks per stage, zb-h1's W pass). The mode changes only how a scale is taken (the weight's
# amax, or its history) inside the same cast. So each schedule once, and each mode at least once: 1F1B
# (``current``) and interleaved (``delayed``) are counted in the steps that train at zero=1 below, zb-h1 here.
@pytest.mark.slow
def test_a_pipelined_zero_bubble_step_quantizes_each_weight_once():
    """Each stage's layer weights are cast to e4m3 once per step, however often the schedule runs a layer on
    them (each microbatch's forward and recomputation; zb-h1's W pass reruns the forward too)."""
    assert step_quantizations(_trainer("zb-h1", "delayed"), set(LAYER_WEIGHTS)) == _expected(1)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("interleaved", marks=pytest.mark.slow)])
def test_a_pipelined_evaluation_quantizes_each_weight_once(schedule):
    """Held-out evaluation's forward-only program quantizes each stage's weights once too, not once per
    microbatch."""
    trainer = _trainer(schedule, "delayed")
    params, _, tokens = trainer.abstract_step_arguments()
    layers_per_stage = 2 if schedule == "interleaved" else 1
    found = weight_quantizations(trainer.steps.lower_eval(params, tokens).compile().as_text(), set(LAYER_WEIGHTS))
    assert found == _expected(layers_per_stage)


def _run(schedule: str, fp8: str, zero: int, prepared: bool, monkeypatch, extra: tuple[str, ...] = ()):
    """Losses, the closing held-out loss and parameters after two steps on a 2x2x1 mesh, the stages' FP8
    weights quantized once per step (``prepared``) or at every use; and the trainer that ran them."""
    from meshtron.train import pipelined

    with monkeypatch.context() as patch:
        if not prepared:
            cut = pipelined.stage_functions
            patch.setattr(pipelined, "stage_functions",
                          lambda *a, **k: dataclasses.replace(cut(*a, **k), prepare=None))
        trainer = _trainer(schedule, fp8, zero=zero, data=2, extra=extra)
        result = trainer.run()
    return [*result.losses, result.heldout_loss], jax.device_get(result.params), trainer


# What is prepared depends on the mode and the zero level together -- at zero=1 the whole weight, its scale (and
# under ``delayed`` its amax's one-hot); at zero=3 this device's share at the whole weight's scale, from the
# shares' largest amax -- and the schedule decides how often each use reads it. So every mode x zero pair once,
# and every schedule among them.
@pytest.mark.parametrize("schedule, fp8, zero", [
    pytest.param("1f1b", "current", 1, marks=pytest.mark.extended),
    pytest.param("interleaved", "current", 3, marks=[pytest.mark.slow, pytest.mark.extended]),
    pytest.param("interleaved", "delayed", 1, marks=[pytest.mark.slow, pytest.mark.extended]),
    ("zb-h1", "delayed", 3),  # the CI tier's case: the split backward, delayed histories, gathered shares
])
def test_weights_quantized_once_train_as_weights_quantized_at_every_use(schedule, fp8, zero, monkeypatch):
    """Weights and (``delayed``) histories do not change within a step, so multiplying by the bytes quantized
    before the tick loop is bit for bit what quantizing at every use gives: the same losses, held-out loss,
    parameters and amax histories (zero=3: the shares quantized, their bytes gathered at each use). At zero=1
    each device holds whole weights, and the compiled step casts each stage's to e4m3 once (as
    :func:`test_a_pipelined_zero_bubble_step_quantizes_each_weight_once` counts)."""
    losses, params, trainer = _run(schedule, fp8, zero, True, monkeypatch)
    if zero == 1:
        assert step_quantizations(trainer, set(LAYER_WEIGHTS)) == _expected(2 if schedule == "interleaved" else 1)
    per_use_losses, per_use_params, _ = _run(schedule, fp8, zero, False, monkeypatch)
    assert losses == per_use_losses
    jax.tree.map(np.testing.assert_array_equal, params, per_use_params)


@pytest.mark.parametrize("schedule, fp8", [("1f1b", "current"),
                                           pytest.param("zb-h1", "delayed", marks=pytest.mark.extended)])
def test_expert_weights_quantized_once_train_as_quantized_at_every_use(schedule, fp8, monkeypatch):
    """A mixture of experts' grouped expert weights, split over data (each device's own experts), are cast to
    e4m3 once per step, with the attention weights beside them; the grouped expert GEMMs multiply by those
    bytes, at the scales each use takes (each device's experts by their own amax, or the history's), so
    training is bit for bit the same: losses, parameters and (``delayed``) the experts' amax histories."""
    losses, params, trainer = _run(schedule, fp8, 1, True, monkeypatch, EXPERTS)
    assert step_quantizations(trainer, set(EXPERT_LAYER_WEIGHTS)) == EXPERT_LAYER_WEIGHTS
    per_use_losses, per_use_params, _ = _run(schedule, fp8, 1, False, monkeypatch, EXPERTS)
    assert losses == per_use_losses
    jax.tree.map(np.testing.assert_array_equal, params, per_use_params)


def _prepared_equals_per_use(layer, x, w):
    """``layer(x, w)`` traced with ``w`` quantized beforehand (:func:`quantized_weights`, handed back through
    :class:`PreparedWeights`) gives the value and both gradients of the layer quantizing ``w`` itself, bit for
    bit, and the weight's gradient still reaches the high-precision weight."""
    def loss(x, w, entries=None):
        with using(fp8="current", fp8_weights=None if entries is None else PreparedWeights(entries)):
            return jnp.sum(layer(x, w))

    with using(fp8="current"):
        entries = quantized_weights(layer, x, w)
    assert [e[0][0].shape for e in entries] == [w.shape] and entries[0][0][0].dtype == jnp.uint8
    got = jax.value_and_grad(loss, argnums=(0, 1))(x, w, entries)
    expected = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    assert np.abs(got[1][1]).max() > 0


def test_a_layers_prepared_weights_give_its_product_and_gradients(operands):
    """A dense projection multiplies by its weight quantized beforehand as by the weight it quantizes itself."""
    x, w, c = operands
    _prepared_equals_per_use(lambda x, w: projection_einsum("se,ef->sf", x, w) * c, x, w)


def _expert_operands(operands):
    """A grouped GEMM's operands: ``operands``' activations as rows of 3 experts (2, none and 4 rows), a weight
    [3, 32, 24] of 0.02, and ``operands``' output gradient."""
    x, _, c = operands
    w = (np.random.default_rng(1).standard_normal((3, 32, 24)) * 0.02).astype(np.float32)
    return x, w, jnp.asarray([2, 0, 4], jnp.int32), c


def test_a_layers_prepared_expert_weights_give_its_grouped_product_and_gradients(operands):
    """A grouped expert GEMM multiplies by its [experts, k, n] weight quantized beforehand as by the weight it
    quantizes itself."""
    x, w, sizes, c = _expert_operands(operands)
    _prepared_equals_per_use(lambda x, w: projection_ragged_dot(x, w, sizes) * c, x, w)


def test_a_grouped_gemm_given_another_projections_weight_says_so(operands):
    """Entries prepared for another layer (a dense projection's weight) are refused by the grouped GEMM, naming
    both shapes."""
    x, w, sizes, _ = _expert_operands(operands)
    with using(fp8="current"):
        entries = quantized_weights(lambda x, w: projection_einsum("se,ef->sf", x, w), x, w[0])
    with using(fp8="current", fp8_weights=PreparedWeights(entries)), pytest.raises(
            ValueError, match=r"prepared as \[\(32, 24\)\] for a grouped expert projection by \[\(3, 32, 24\)\]"):
        projection_ragged_dot(x, w, sizes)
