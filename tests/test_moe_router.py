"""DeepSeek-V3's router options of the mixture-of-experts layer (sigmoid scores, group-limited selection, a
scaling factor) against transformers' own gate, and aux-loss-free balancing: the bias rule by hand, the
bias as training state (no optimizer state, checkpointed, restored onto another mesh, the same through a
pipeline), and the config's checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import ConfigError, load_config
from meshtron.models.moe import BIAS, LOAD, BiasBalancing, route
from meshtron.models.probed_state import StepTotals

TINY = ["model.family=llama", "model.hidden=32", "model.heads=2", "model.layers=2", "model.mlp_dim=64",
        "model.seq_len=16", "model.vocab_size=256", "model.moe.experts=8", "model.moe.top_k=2",
        "model.moe.mlp_dim=32"]


def hf_gate(logits: np.ndarray, bias: np.ndarray, *, top_k: int, n_group: int, topk_group: int, normalize: bool,
            scaling: float):
    """transformers' DeepseekV3 gate on these router logits (its weight the identity, so its logits are
    the hidden states): the chosen experts and their weights."""
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    experts = logits.shape[1]
    config = DeepseekV3Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=top_k,
                              n_group=n_group, topk_group=topk_group, norm_topk_prob=normalize,
                              routed_scaling_factor=scaling)
    gate = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(experts))
        gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
        got_logits, weights, indices = gate(torch.from_numpy(logits))
    np.testing.assert_array_equal(got_logits.numpy(), logits)  # the identity leaves the logits as they are
    return indices.numpy(), weights.numpy()


def by_expert(indices: np.ndarray, weights: np.ndarray):
    """Each token's chosen experts in ascending order, with their weights (the gate's order is its own)."""
    order = np.argsort(indices, axis=1)
    return np.take_along_axis(indices, order, 1), np.take_along_axis(weights, order, 1)


@pytest.mark.parametrize("n_group, topk_group, top_k, normalize, scaling", [
    (4, 2, 4, True, 2.5), (8, 3, 6, False, 1.0), (1, 1, 2, True, 1.0), (4, 4, 3, True, 0.5)])
def test_sigmoid_routing_with_groups_and_bias_equals_transformers_deepseek_v3(n_group, topk_group, top_k, normalize,
                                                                               scaling):
    rng = np.random.default_rng(n_group * 10 + top_k)
    logits = rng.standard_normal((256, 32)).astype(np.float32) * 2
    bias = (rng.standard_normal(32) * 0.3).astype(np.float32)
    hf_indices, hf_weights = hf_gate(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                     normalize=normalize, scaling=scaling)
    r = route(jnp.asarray(logits), top_k, normalize, scores="sigmoid", bias=jnp.asarray(bias), n_group=n_group,
              topk_group=topk_group, scaling=scaling)
    ours = by_expert(np.asarray(r.experts), np.asarray(r.weights))
    theirs = by_expert(hf_indices, hf_weights)
    np.testing.assert_array_equal(ours[0], theirs[0])
    # the same experts; the weights within a few ulp (the libraries' sigmoids and sums round their own way)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6, atol=0)
    # the bias changed the choice of some tokens, and the weights are the unbiased scores
    plain = route(jnp.asarray(logits), top_k, normalize, scores="sigmoid", n_group=n_group, topk_group=topk_group,
                  scaling=scaling)
    assert np.any(np.sort(np.asarray(plain.experts), 1) != ours[0])


def test_group_limited_selection_keeps_the_best_groups_by_their_two_best_scores():
    # two groups of four; group 1 holds the single best score, group 0 the best two-best sum
    logits = np.log(np.array([[0.8, 0.8, 0.1, 0.1, 0.99, 0.1, 0.1, 0.1]]) / (1 - np.array(
        [[0.8, 0.8, 0.1, 0.1, 0.99, 0.1, 0.1, 0.1]]))).astype(np.float32)  # sigmoid^-1
    r = route(jnp.asarray(logits), 2, False, scores="sigmoid", n_group=2, topk_group=1)
    assert sorted(np.asarray(r.experts)[0].tolist()) == [0, 1]
    np.testing.assert_allclose(np.asarray(r.weights)[0], [0.8, 0.8], rtol=1e-6)
    assert np.asarray(route(jnp.asarray(logits), 2, False, scores="sigmoid").experts)[0].tolist() == [4, 0]


def test_softmax_routing_is_unchanged_by_default_and_scaled_by_the_factor():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)), jnp.float32)
    base, scaled = route(logits, 2), route(logits, 2, scaling=2.5)
    probs = jax.nn.softmax(logits)
    weights, experts = jax.lax.top_k(probs, 2)
    np.testing.assert_array_equal(base.experts, experts)
    np.testing.assert_array_equal(base.weights, weights / weights.sum(-1, keepdims=True))
    np.testing.assert_array_equal(scaled.weights, base.weights * np.float32(2.5))


def test_the_bias_moves_each_expert_by_the_rate_towards_the_mean_load_of_the_whole_batch():
    """``bias += rate · sign(mean - load)``, the load summed over the microbatches (the probe's gradient is
    their mean) and over the data ranks."""
    # two layers, four experts; three microbatches on this rank; another rank's loads added by the reduction
    loads = np.array([[7, 3, 5, 9], [6, 6, 6, 6]], np.float32)  # this rank's totals over 3 microbatches
    other = np.array([[1, 5, 3, 3], [2, 2, 8, 4]], np.float32)
    bias = np.array([[0.0, 0.1, -0.2, 0.3], [0.5, 0.0, 0.0, -0.5]], np.float32)
    totals = StepTotals(3, lambda fn, x: x + other)
    got = BiasBalancing(0.01)(jnp.asarray(bias), jnp.asarray(loads / 3), totals)
    whole = loads + other  # [[8, 8, 8, 12], [8, 8, 14, 10]]: means 9 and 10
    expected = bias + np.float32(0.01) * np.sign(whole.mean(-1, keepdims=True) - whole)
    np.testing.assert_array_equal(got, expected.astype(np.float32))
    np.testing.assert_array_equal(np.sign(whole.mean(-1, keepdims=True) - whole), [[1, 1, 1, -1], [1, 1, -1, 0]])


@pytest.mark.parametrize("override, message", [
    ("model.moe.router=relu", r"^model.moe.router: must be softmax or sigmoid"),
    ("model.moe.n_group=3", r"^model.moe.n_group: must be >= 1 and divide model.moe.experts=8, got 3"),
    ("model.moe.n_group=8", r"^model.moe.n_group: groups score their two best experts"),
    ("model.moe.topk_group=5", r"^model.moe.topk_group: must be between 1 and model.moe.n_group=4"),
    ("model.moe.bias_update_rate=-1", r"^model.moe.bias_update_rate: must be >= 0"),
    ("model.moe.routed_scaling_factor=0", r"^model.moe.routed_scaling_factor: must be > 0"),
    ("model.moe.sequence_aux_loss_weight=-0.1", r"^model.moe.sequence_aux_loss_weight: must be >= 0"),
])
def test_router_fields_are_checked_one_line_each(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, "model.moe.n_group=4", override])


def test_top_k_must_fit_in_the_kept_groups():
    with pytest.raises(ConfigError, match=r"^model.moe.topk_group: the 1 kept groups hold 2 experts, fewer than "
                                          r"model.moe.top_k=3"):
        load_config(None, [*TINY, "model.moe.n_group=4", "model.moe.topk_group=1", "model.moe.top_k=3"])


def test_the_bias_and_its_probe_are_state_with_no_optimizer_state_and_not_weights():
    from meshtron.train.state import model_def_from_config
    from meshtron.train.trainable import Trainable

    balanced = model_def_from_config(load_config(None, [*TINY, "model.moe.bias_update_rate=0.001"]).model)
    plain = model_def_from_config(load_config(None, TINY).model)
    mlp = balanced.shapes()["blocks"]["mlp"]
    assert mlp[BIAS].shape == (2, 8) and mlp[LOAD].shape == (2, 8) and BIAS not in plain.shapes()["blocks"]["mlp"]
    assert balanced.parameter_count() == plain.parameter_count()
    trainable = Trainable.of_model(balanced)
    assert trainable.mask["blocks"]["mlp"][BIAS] is False and trainable.mask["blocks"]["mlp"][LOAD] is False
    assert trainable.observed["blocks"]["mlp"][LOAD] is True and trainable.mask["blocks"]["mlp"]["router"]


RATE = 0.01


def balanced_run(*overrides: str, metrics=None):
    """A tiny Mixtral with sigmoid routing and aux-loss-free balancing, on mixtral_cpu8's 2x2x2 interleaved
    layout unless ``overrides`` say otherwise; returns the result and its bias ``[layers, E]``."""
    from meshtron.train.loop import Trainer

    cfg = load_config("mixtral_cpu8", [*TINY, "model.layers=4", "model.moe.router=sigmoid",
                                       f"model.moe.bias_update_rate={RATE}", "train.eval_every=1000",
                                       "train.eval_batches=1", "train.batch_size=8", "train.log_every=1", *overrides])
    trainer = Trainer.from_config(cfg)
    result = trainer.run(metrics_file=metrics)
    bias = result.params["blocks"]["mlp"].get(BIAS)
    return result, None if bias is None else np.asarray(jax.device_get(bias)), trainer


@pytest.mark.slow
def test_one_step_moves_the_bias_by_the_rate_against_the_whole_batchs_load(tmp_path):
    """After one step the bias is ``rate · sign(mean - load)`` of the load the first batch's routing gives
    (measured apart, by the step's own microbatches and data shards), the probe stays zeros, the bias has
    no optimizer state, and the metrics record the balance and the bias's range."""
    import json

    with open(tmp_path / "metrics.jsonl", "w") as metrics:
        result, bias, trainer = balanced_run("train.steps=1", metrics=metrics)
    params = trainer.init_params()
    batch = trainer.train_stream(0).next(trainer.steps.batch_sharding)
    (stats,) = trainer.steps.layer_reports(params, batch)
    load = np.asarray(stats.load, np.float64)
    assert load.sum() == 8 * 16 * 2 * 4  # every token's two assignments, in each of four layers
    np.testing.assert_array_equal(bias, (np.float32(RATE) * np.sign(load.mean(-1, keepdims=True) - load)).astype(
        np.float32))
    assert not np.any(jax.device_get(result.params["blocks"]["mlp"][LOAD]))
    opt_state = trainer.steps.init_opt_state(params)
    assert not any(BIAS in jax.tree_util.keystr(path) or LOAD in jax.tree_util.keystr(path)
                   for path, _ in jax.tree_util.tree_leaves_with_path(opt_state))
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    (record,) = [r for r in records if r.get("step") == 1 and "loss" in r]
    assert record["moe/load_imbalance"] == pytest.approx(float(np.max(load.max(-1) / load.mean(-1))))
    assert record["moe/bias_min"] == 0.0 and record["moe/bias_max"] == 0.0  # the bias the step started from


@pytest.fixture(scope="module")
def unpipelined_bias():
    """The bias after two unpipelined steps (2 microbatches, 2 data ranks, tensor 2)."""
    return balanced_run("train.steps=2", "parallel.pipe=1", "parallel.tensor=2", "parallel.schedule=1f1b",
                        "parallel.chunks=1", "parallel.microbatches=2")[1]


# CI keeps interleaved 2x2 virtual stages with tensor parallelism and ZB-H1 over an uneven layout.
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tensor=1", "parallel.data=4", "parallel.schedule=1f1b", "parallel.chunks=1",
                  "parallel.microbatches=2"], marks=pytest.mark.extended, id="1f1b"),
    pytest.param([], id="interleaved"),
    pytest.param(["parallel.tensor=1", "parallel.data=4", "parallel.schedule=zb-h1", "parallel.chunks=1",
                  "parallel.microbatches=2", "parallel.layout=[1,3]"], id="zb-h1 uneven"),
])
def test_a_pipelined_run_updates_the_bias_as_the_unpipelined_one(layout, unpipelined_bias):
    """The bias after two steps is the same whether the layers run unpipelined (2 microbatches, 2 data ranks)
    or as two stages of 1F1B (4 data ranks, 2 microbatches), interleaved over 2x2 virtual stages (with
    tensor parallelism), or zero-bubble ZB-H1 (its weight gradients, the probe's among them, in passes of
    their own) over an uneven layout of 1 and 3 layers."""
    assert np.any(unpipelined_bias != 0)
    np.testing.assert_array_equal(balanced_run("train.steps=2", *layout)[1], unpipelined_bias)


@pytest.fixture(scope="module")
def saved_balanced_run(tmp_path_factory):
    """Three steps on 2x2x2 interleaved, saved at step 2 (and 3): the run every resumption continues."""
    saved = tmp_path_factory.mktemp("balanced") / "saved"
    straight, bias, _ = balanced_run("train.steps=3", f"checkpoint.dir={saved}", "checkpoint.every=2",
                                     "checkpoint.keep=5")
    return saved, straight, bias


# CI keeps the bit-exact resumption on the same layout and the restore onto 4x1x2 with zero=3.
@pytest.mark.slow
@pytest.mark.parametrize("layouts", [
    pytest.param((("same", []),
                  ("4x1x2", ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.zero=3",
                             "parallel.microbatches=2"])), id="same, 4x1x2 zero 3"),
    pytest.param((("1x4x2", ["parallel.data=1", "parallel.pipe=4", "parallel.tensor=2", "parallel.schedule=1f1b",
                             "parallel.chunks=1", "parallel.microbatches=4"]),), marks=pytest.mark.extended,
                 id="1x4x2 1f1b"),
])
def test_the_bias_is_checkpointed_resumed_bit_exactly_and_restored_onto_another_mesh(layouts, saved_balanced_run,
                                                                                       tmp_path):
    """Saved at step 2 on 2x2x2 interleaved, resumed for step 3 on the same layout (bias and loss bit-exact
    with the straight run's), on 4x1x2 with zero=3 (every other parameter split over data, the bias whole)
    and on 1x4x2 1F1B: the restored bias moves on by one step of the rate."""
    import shutil

    saved, straight, bias = saved_balanced_run
    steps = bias / RATE  # three steps of -1, 0 or +1 each
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert np.any(steps) and np.abs(steps).max() <= 3 + 1e-4
    for name, layout in layouts:
        directory = tmp_path / name
        shutil.copytree(saved, directory)
        shutil.rmtree(directory / "3")  # resume from step 2
        resumed, moved_on, _ = balanced_run("train.steps=3", f"checkpoint.dir={directory}", "checkpoint.every=100",
                                            *layout)
        assert resumed.first_step == 3, name
        if name == "same":
            np.testing.assert_array_equal(moved_on, bias)
            assert resumed.losses[0] == straight.losses[2]
        else:  # the same step-2 bias, moved by +-rate (or held) at step 3 by this layout's own routing
            np.testing.assert_allclose(moved_on, bias, atol=2 * RATE + 1e-6, err_msg=name)
            assert np.mean(moved_on == bias) > 0.9, name
            np.testing.assert_allclose(resumed.losses[0], straight.losses[2], rtol=1e-4, err_msg=name)


@pytest.mark.slow
def test_a_step_the_nonfinite_guard_skips_keeps_the_bias():
    """With ``train.on_nonfinite=skip``, a step whose update is not finite (the head's weights NaN: the loss
    and every gradient NaN, the routing and its load unaffected) leaves the bias as it was; the experts split
    over data, each rank judging its own experts' updates, all ranks agree to skip."""
    from meshtron.train.loop import Trainer

    def one_step(poisoned: bool):
        cfg = load_config("mixtral_cpu8", [*TINY, "model.layers=4", "model.moe.router=sigmoid",
                                           f"model.moe.bias_update_rate={RATE}", "train.batch_size=8",
                                           "train.on_nonfinite=skip",
                                           "parallel.pipe=1", "parallel.data=4",
                                           "parallel.schedule=1f1b", "parallel.chunks=1", "parallel.microbatches=2"])
        trainer = Trainer.from_config(cfg)
        params = trainer.init_params()
        if poisoned:
            params = {**params, "lm_head": params["lm_head"] * np.nan}
        batch = trainer.train_stream(0).next(trainer.steps.batch_sharding)
        params, _, metrics = trainer.steps.train(params, trainer.steps.init_opt_state(params), batch)
        return metrics.was_applied(), np.asarray(jax.device_get(params["blocks"]["mlp"][BIAS]))

    applied, bias = one_step(poisoned=False)
    assert applied and np.any(bias)
    skipped, kept = one_step(poisoned=True)
    assert not skipped
    np.testing.assert_array_equal(kept, np.zeros_like(kept))


@pytest.mark.parametrize("override, field", [
    ("model.moe.router=sigmoid", "router"), ("model.moe.routed_scaling_factor=2.5", "routed_scaling_factor"),
    ("model.moe.topk_group=2", "topk_group"), ("model.moe.bias_update_rate=0.001", "bias_update_rate")])
def test_a_model_routed_otherwise_than_mixtral_is_not_exported_as_one(override, field):
    from meshtron.models.llama_hf import hf_config

    assert hf_config(load_config(None, [*TINY, "model.moe.n_group=4"]).model, False, None)["model_type"] == "mixtral"
    with pytest.raises(ConfigError, match=rf"^model.moe.{field}: a Mixtral routes by softmax top-k over every expert"):
        hf_config(load_config(None, [*TINY, "model.moe.n_group=4", override]).model, False, None)


@pytest.mark.slow
def test_a_model_trained_without_the_bias_is_fine_tuned_with_it_from_zeros(tmp_path):
    """``train.init_from`` a checkpoint without a selection bias (a run without balancing; an import is
    the same): the weights are read, the bias starts at zeros and moves by the rate."""
    base, none, _ = balanced_run("train.steps=1", "model.moe.bias_update_rate=0",
                                 f"checkpoint.dir={tmp_path / 'base'}", "checkpoint.every=1")
    assert none is None
    tuned, bias, _ = balanced_run("train.steps=1", f"train.init_from={tmp_path / 'base'}",
                                  f"checkpoint.dir={tmp_path / 'tuned'}")
    assert tuned.first_step == 1 and tuned.losses[0] != base.losses[0] and np.any(bias)
    np.testing.assert_array_equal(np.abs(bias)[bias != 0], np.float32(RATE))


def test_the_sequence_wise_balance_loss_is_each_sequences_balance_averaged():
    """DeepSeek-V3's ``Σ_i f_i P_i`` per sequence, ``f_i = E/(k·T) · count_i`` and ``P_i`` the mean of the
    scores normalised over the experts, averaged over the sequences; computed here by hand."""
    from meshtron.models.moe import sequence_balance_loss

    rng = np.random.default_rng(3)
    sequences, length, experts, k = 3, 16, 8, 2
    logits = rng.standard_normal((sequences * length, experts)).astype(np.float32)
    r = route(jnp.asarray(logits), k, scores="sigmoid")
    chosen = np.asarray(r.experts).reshape(sequences, length, k)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    normalised = (scores / scores.sum(-1, keepdims=True)).reshape(sequences, length, experts)
    expected = np.mean([np.sum(experts / (k * length) * np.bincount(chosen[s].ravel(), minlength=experts)
                               * normalised[s].mean(0)) for s in range(sequences)])
    np.testing.assert_allclose(sequence_balance_loss(r, experts, sequences), expected, rtol=1e-5)


def test_a_layer_with_balancing_selects_by_its_bias_and_hands_its_load_to_the_probe():
    """The layer's routing ranks scores plus its bias, and the backward gives the probe ``expert_load``
    the layer's assignments per expert (the statistic the step sums)."""
    from flax import nnx

    from meshtron.models.auxiliary import collecting_reports
    from meshtron.models.moe import MoE, moe_dims_from_config

    dims = moe_dims_from_config(load_config(None, [*TINY, "model.moe.router=sigmoid",
                                                   "model.moe.bias_update_rate=0.01"]).model)
    with nnx.use_eager_sharding(False):
        layer = MoE(dims, rngs=nnx.Rngs(0))
    getattr(layer, BIAS)[...] = jnp.asarray([5.0, 5.0, 0, 0, 0, 0, 0, 0])  # experts 0 and 1 win every token
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 32)), jnp.float32)
    graphdef, state = nnx.split(layer)

    def output(state):
        with collecting_reports() as found:
            y = nnx.merge(graphdef, state)(x)
        return jnp.sum(y), found[0]

    grads, found = jax.grad(output, has_aux=True)(state)
    np.testing.assert_array_equal(found.load, [32, 32, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(grads[LOAD][...], [32, 32, 0, 0, 0, 0, 0, 0])
    assert not np.any(grads[BIAS][...])


def test_the_progress_line_shows_the_balance_of_any_mixture_and_the_bias_range_with_balancing():
    import io

    from meshtron.train.reporting import PlainProgress

    out = io.StringIO()
    progress = PlainProgress(10, out)
    record = {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "moe/load_imbalance": 1.5}
    progress.line(1, record)
    progress.line(2, {**record, "moe/bias_min": -0.002, "moe/bias_max": 0.003})
    progress.line(3, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5})  # a dense model
    first, second, dense = out.getvalue().splitlines()
    assert "imbalance 1.50" in first and "bias" not in first
    assert "imbalance 1.50  bias -0.002..+0.003" in second
    assert "imbalance" not in dense
