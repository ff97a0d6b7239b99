"""Multi-token prediction (DeepSeek-V3 §2.2) in the deepseek family: the loss against an explicit
computation on the same parameters, its gradient, what is reported, parity over layouts, and what
stays as it was (no modules, generation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtron.config import ConfigError, MlaConfig, ModelConfig, MoEConfig, MtpConfig, load_config
from meshtron.models import deepseek, documents
from meshtron.models.blocks import Context, run_blocks
from meshtron.models.contract import (
    batch_reports,
    embed_tokens,
    lm_loss,
    logits_of,
    token_losses,
    vocab_parallel_cross_entropy,
)
from meshtron.testing import Layout, check_parity, packed_windows
from meshtron.train.state import model_def_from_config

EPS = 1e-6


def small(mtp_layers=1, experts=8, loss_weight=0.3, layers=2, **kw) -> ModelConfig:
    return ModelConfig(family="deepseek", vocab_size=256, hidden=64, heads=8, layers=layers, mlp_dim=96, seq_len=16,
                       moe=MoEConfig(experts=experts, top_k=2, mlp_dim=16, shared_experts=1, aux_loss_weight=0.01),
                       first_k_dense_replace=1 if experts else 0, norm_eps=EPS,
                       mla=MlaConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                     v_head_dim=12),
                       mtp=MtpConfig(layers=mtp_layers, loss_weight=loss_weight), **kw)


def built(cfg: ModelConfig) -> deepseek.Deepseek:
    with nnx.use_eager_sharding(False):
        return deepseek.build(cfg, nnx.Rngs(0))


def plain_tokens(batch=2, seq=16, seed=1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, 256)


def document_batch(batch=4, seq=16, seed=3) -> tuple[np.ndarray, jax.Array]:
    windows = packed_windows(np.random.default_rng(seed), batch, seq, 256)
    return windows, documents.document_features(jnp.asarray(windows))


def rms(x, scale):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def explicit_mtp_loss(params, model, y, windows_or_tokens, ctx):
    """The MTP loss written out: per depth k the norms, the concatenation [emb(t_{i+k}); h], eh_proj,
    the module's block, its norm, the shared head, and cross-entropy against t_{i+k+1}, summed where the
    target is in the window (and, for documents, in position i's document and counted) and divided by
    b·s (plain) or by the batch's counted next-token targets (documents); the mean over depths."""
    w = np.asarray(windows_or_tokens)
    if w.ndim == 2:
        tokens, segments, mask = w, np.ones_like(w), np.ones_like(w)
        norm = w.shape[0] * (w.shape[1] - 1)
    else:
        tokens, segments, mask = w[..., 0], w[..., 1], w[..., 2]
        counted = (mask[:, 1:] != 0) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] != 0)
        norm = counted.sum()
    b, s = tokens.shape[0], tokens.shape[1] - 1
    h = rms(y, params["norm"]["scale"])
    losses = []
    for k in range(1, model.dims.mtp_layers + 1):
        p = params["mtp"][f"depth{k}"]
        ahead = np.zeros((b, s), np.int32)
        target = np.zeros((b, s), np.int32)
        valid = np.zeros((b, s), bool)
        for r in range(b):
            for i in range(s):
                if i + k < s:
                    ahead[r, i], target[r, i] = tokens[r, i + k], tokens[r, i + k + 1]
                    valid[r, i] = (mask[r, i + k + 1] != 0 and segments[r, i] == segments[r, i + k + 1]
                                   and segments[r, i] != 0 and segments[r, i + k] == segments[r, i])
        emb = params["embedding"][ahead]
        x = jnp.concatenate([rms(emb, p["enorm"]["scale"]), rms(h, p["hnorm"]["scale"])], axis=-1)
        x = x @ p["eh_proj"]["kernel"]
        with documents.document_segments(ctx.segments):
            x = getattr(model.mtp, f"depth{k}").block(x, ctx)
        h = rms(x, p["norm"]["scale"])
        logits = jnp.einsum("bse,ve->bsv", h, params["lm_head"])
        ce = vocab_parallel_cross_entropy(logits, jnp.asarray(target), model.vocab_size)
        losses.append(jnp.sum(jnp.where(jnp.asarray(valid), ce, 0.0)) / norm)
    return sum(losses) / len(losses)


def main_and_blocks(model, tokens):
    seen, ctx = documents.view(tokens), Context.for_tokens(tokens)
    y = run_blocks(model.blocks, embed_tokens(model, seen.inputs, ctx), ctx)
    main = documents.weighted_mean(token_losses(model, model.head(y), seen.targets), seen.weights)
    return main, y, ctx


def pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def with_params(model, params):
    graphdef, state = nnx.split(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("mtp_layers, experts, docs", [
    pytest.param(1, 8, False, marks=pytest.mark.extended, id="1 depth experts"),
    pytest.param(2, 0, False, id="2 depths dense"), pytest.param(2, 8, True, id="2 depths documents")])
def test_mtp_loss_and_its_report_equal_the_explicit_computation(mtp_layers, experts, docs):
    model = built(small(mtp_layers, experts))
    if docs:
        windows, tokens = document_batch()
    else:
        tokens = plain_tokens()
        windows = tokens
    params = pure(model)
    main, y, ctx = main_and_blocks(model, tokens)
    want = explicit_mtp_loss(params, model, y, windows, ctx)
    got = model.extra_loss(y, tokens)
    assert got.name == "mtp/loss" and got.weight == 0.3
    np.testing.assert_allclose(got.value, want, rtol=2e-6)
    assert 1.0 < float(want) < 7.0  # a real cross-entropy (ln 256 per counted target), not zeros
    # the objective's value is the next-token loss alone; the report is the unweighted MTP loss
    np.testing.assert_array_equal(lm_loss(model, tokens), main)
    [*_, report] = batch_reports(model, tokens)
    assert report.metrics(1) == {"mtp/loss": pytest.approx(float(want), rel=2e-6)}


@pytest.mark.parametrize("experts, docs", [pytest.param(0, False, marks=pytest.mark.extended, id="dense"),
                                           pytest.param(8, True, id="experts documents")])
def test_gradient_is_the_main_loss_plus_the_weighted_explicit_mtp_loss(experts, docs):
    model = built(small(2, experts, loss_weight=0.25))
    windows, tokens = document_batch() if docs else (plain_tokens(),) * 2

    def objective(params):
        return lm_loss(with_params(model, params), tokens)

    def explicit(params):
        m = with_params(model, params)
        main, y, ctx = main_and_blocks(m, tokens)
        return main + 0.25 * explicit_mtp_loss(params, m, y, windows, ctx)

    params = pure(model)
    got, want = jax.grad(objective)(params), jax.grad(explicit)(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    mtp_grads = jax.tree.leaves(got["mtp"])
    assert all(np.any(np.asarray(g) != 0) for g in (got["mtp"]["depth2"]["eh_proj"]["kernel"], got["embedding"]))
    assert len(mtp_grads) > 10


def test_without_mtp_layers_nothing_changes():
    model = built(small(0))
    params = pure(model)
    assert "mtp" not in params and model.extra_loss(jnp.zeros((1, 4, 64)), plain_tokens()) is None
    tokens = plain_tokens()

    def before(params):  # the objective as the contract computed it without further losses
        m = with_params(model, params)
        seen = documents.view(tokens)
        return documents.weighted_mean(token_losses(m, logits_of(m, seen.inputs), seen.targets), seen.weights)

    def now(params):
        return lm_loss(with_params(model, params), tokens)

    np.testing.assert_array_equal(jax.jit(now)(params), jax.jit(before)(params))
    for g, w in zip(jax.tree.leaves(jax.jit(jax.grad(now))(params)), jax.tree.leaves(jax.jit(jax.grad(before))(params)),
                    strict=True):
        np.testing.assert_array_equal(g, w)
    assert len(batch_reports(model, tokens)) == 1  # the routing statistics alone


def test_the_same_weights_generate_the_same_tokens_with_and_without_mtp_modules():
    from meshtron.config import MeshConfig
    from meshtron.generate import Sampler
    from meshtron.mesh import build_mesh

    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with_mtp, without = model_def_from_config(small(1)), model_def_from_config(small(0))
    params = with_mtp.init(mesh, seed=0)
    plain = {k: v for k, v in params.items() if k != "mtp"}
    runs = [Sampler(md, mesh, context=16).sample(p, [5, 7, 11], max_new_tokens=8)
            for md, p in ((with_mtp, params), (without, plain))]
    assert runs[0].new_tokens == runs[1].new_tokens and len(runs[0].new_tokens) == 8


@pytest.mark.parametrize("overrides, message", [
    (["model.family=deepseek", "model.mtp.layers=-1"], "model.mtp.layers: must be a whole number >= 0"),
    (["model.family=deepseek", "model.mtp.loss_weight=-0.1"], "model.mtp.loss_weight: must be a number >= 0"),
    (["model.family=llama", "model.mtp.layers=1"],
     "model.mtp.layers: multi-token prediction is built by the deepseek family only, got family 'llama'"),
    (["model.family=deepseek", "model.seq_len=4", "model.mtp.layers=4"], "model.mtp.layers: 4 depths predict past"),
])
def test_bad_mtp_settings_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_mtp_over_a_sequence_split_on_context_ranks_is_refused():
    from meshtron.run import check_features

    cfg = load_config(None, ["model.family=deepseek", "model.mtp.layers=1", "parallel.context=2"])
    with pytest.raises(ConfigError, match="model.mtp.layers: multi-token prediction reads each position's tokens"):
        check_features(cfg)


# One check_parity call per model: its one-device references (over 1 and over 8 groups of rows) are computed
# once for every layout of the call. Tensor 1 and 2 pad the vocabulary alike (to 256), so the pipelined
# layouts could share one model; tensor 8 pads it to 1,024. CI keeps 2×2×2 interleaved (data, pipeline
# chunks and tensor at once); 1F1B stays in CI under packed documents below.
@pytest.mark.slow
@pytest.mark.parametrize("layouts", [
    pytest.param([Layout(1, 1, 8)], marks=pytest.mark.extended),
    [Layout(2, 2, 2, "interleaved", 2)],
    pytest.param([Layout(2, 2, 2, "1f1b"), Layout(4, 2, 1, "zb-h1", microbatches=2)], marks=pytest.mark.extended),
], ids=lambda layouts: ", ".join(map(str, layouts)))
def test_mtp_loss_and_gradients_equal_one_device(layouts):
    md = model_def_from_config(small(1, layers=5), layouts[0].tensor)
    reports = check_parity(md, layouts, grouped_loss=True)
    assert [r.layout for r in reports] == layouts
    for report in reports:
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), str(report.layout)


@pytest.mark.slow
def test_mtp_under_sequence_parallelism_equals_one_device():
    md = model_def_from_config(small(1), 4, rules={"residual_seq": "tensor"})
    [report] = check_parity(md, [Layout(2, 1, 4)], grouped_loss=True)
    assert report.ok


@pytest.mark.slow
def test_mtp_over_packed_documents_equals_one_device():
    md = model_def_from_config(small(2, layers=5), 2)
    [report] = check_parity(md, [Layout(2, 2, 2, "1f1b")], grouped_loss=True, documents=True)
    assert report.ok


DEEPSEEK = ["model.family=deepseek", "model.layers=5", "model.hidden=32", "model.heads=4", "model.mlp_dim=64",
            "model.seq_len=16", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=16",
            "model.moe.shared_experts=1", "model.first_k_dense_replace=1", "model.mla.q_lora_rank=16",
            "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4",
            "model.mla.v_head_dim=8", "model.mtp.layers=1", "train.batch_size=16", "train.eval_every=1000",
            "train.eval_batches=1"]


def deepseek_trainer(*overrides):
    from meshtron.train.loop import Trainer

    return Trainer.from_config(load_config(None, [*DEEPSEEK, *overrides]))


@pytest.mark.slow
def test_the_reported_mtp_loss_of_a_pipelined_step_equals_one_devices():
    trainer = deepseek_trainer("parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                               "parallel.schedule=interleaved", "parallel.chunks=2", "parallel.microbatches=4")
    groups = trainer.steps.report_groups
    one = deepseek_trainer("parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", f"parallel.microbatches={groups}")
    tokens = np.asarray(trainer.train_stream().next(trainer.steps.batch_sharding))
    got = {k: v for r in trainer.steps.layer_reports(trainer.init_params(), tokens) for k, v in r.metrics(groups).items()}
    want = {k: v for r in one.steps.layer_reports(one.init_params(), tokens) for k, v in r.metrics(groups).items()}
    assert got["mtp/loss"] == pytest.approx(want["mtp/loss"], rel=1e-5) and 4.0 < got["mtp/loss"] < 7.0
    assert got["moe/aux_loss"] == pytest.approx(want["moe/aux_loss"], rel=1e-5)


ZERO_LAYOUT = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=2", "train.steps=2",
               "train.log_every=1"]


@pytest.fixture(scope="module")
def unsharded_mtp_run():
    """The 2×2×2 run at zero level 0 and its metrics records: the reference of every zero level's case."""
    import io
    import json

    records = io.StringIO()
    reference = deepseek_trainer(*ZERO_LAYOUT).run(metrics_file=records)
    return reference, [json.loads(line) for line in records.getvalue().splitlines()]


# CI keeps level 3 (parameters, gradients and optimizer state split); tests/test_moe.py keeps both levels
# in CI for the experts.
@pytest.mark.slow
@pytest.mark.parametrize("zero", [pytest.param("parallel.zero=1", marks=pytest.mark.extended, id="zero 1"),
                                  pytest.param("parallel.zero=3", id="zero 3")])
def test_mtp_trains_alike_at_every_zero_level_and_is_recorded(zero, unsharded_mtp_run):
    reference, logged = unsharded_mtp_run
    assert [r["step"] for r in logged if "mtp/loss" in r] == [1, 2]
    result = deepseek_trainer(*ZERO_LAYOUT, zero).run()
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-5, err_msg=zero)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=zero),
                 jax.device_get(result.params["mtp"]), jax.device_get(reference.params["mtp"]))


@pytest.mark.slow
def test_the_mtp_blocks_experts_are_balanced_without_an_auxiliary_loss_too():
    result = deepseek_trainer("parallel.data=2", "parallel.pipe=1", "parallel.tensor=1",
                              "model.moe.bias_update_rate=0.001", "train.steps=2").run()
    bias = np.asarray(jax.device_get(result.params["mtp"]["depth1"]["block"]["mlp"]["e_score_correction_bias"]))
    assert np.all(np.isin(np.round(bias / 0.001), [-2, -1, 0, 1, 2])) and np.any(bias != 0)  # two steps of ±rate


@pytest.mark.slow
def test_a_run_that_adds_mtp_starts_from_weights_without_it_and_cannot_resume_them(tmp_path, capsys):
    """A checkpoint of a run without the modules: resuming it with ``model.mtp.layers=1`` is one line
    naming the missing ``mtp`` parameters and the way to add them; ``train.init_from`` it instead
    reads every other parameter as saved and starts the modules from the initializer -- the values a
    new model of the run's seed has -- and trains them."""
    base = tmp_path / "base"
    one = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "train.steps=1", "checkpoint.every=1"]
    saved = deepseek_trainer(*one, "model.mtp.layers=0", f"checkpoint.dir={base}").run()
    with pytest.raises(ConfigError) as err:
        deepseek_trainer(*one, "train.steps=2", f"checkpoint.dir={base}").run()
    said = str(err.value)
    assert "\n" not in said and "model.mtp.layers: 0 there, 1 here" in said, said
    assert (f"its weights have no mtp parameters: to add them, start a new run from them (train.init_from={base} and "
            "a checkpoint.dir of its own), where they begin from their initializer") in said, said

    capsys.readouterr()
    trainer = deepseek_trainer(*one, f"train.init_from={base}")
    params, _, position, line = trainer.starting_state(None)
    assert position.step == 0 and "initialised from" in line
    assert f"train.init_from: {base} has no mtp parameters" in capsys.readouterr().err
    fresh = jax.device_get(trainer.canonical_params(trainer.init_params()))
    got = jax.device_get(trainer.canonical_params(params))
    jax.tree.map(np.testing.assert_array_equal, got["mtp"], fresh["mtp"])
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in got.items() if k != "mtp"},
                 jax.device_get(saved.params))
