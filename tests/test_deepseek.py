"""The deepseek family: multi-head latent attention (MLA), YaRN, dense blocks (the prefix) then expert
blocks, the latent decoding cache -- against one device on the parallel layouts, against the full-window forward, and
its config's errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtron.config import ConfigError, MlaConfig, ModelConfig, MoEConfig, MtpConfig, load_config
from meshtron.execution import Execution
from meshtron.gpu.targets import prepare_environment
from meshtron.models import deepseek
from meshtron.models.blocks import Context
from meshtron.models.contract import PrefixedCaches, final_hidden
from meshtron.testing import Layout, check_parity
from meshtron.train.state import model_def_from_config

prepare_environment()  # before JAX's backends start: the CUDA plugin loads without CUDA (GPU-target compiles)

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707}


def small(q_lora_rank=24, layers=5, experts=8, **kw) -> ModelConfig:
    """MLA with a query latent, 8 experts top-2 and a shared expert after one dense block (the prefix; the
    four expert blocks split over every pipeline layout here)."""
    return ModelConfig(family="deepseek", vocab_size=256, hidden=64, heads=8, layers=layers, mlp_dim=96, seq_len=16,
                       moe=MoEConfig(experts=experts, top_k=2, mlp_dim=16, shared_experts=1, aux_loss_weight=0.01),
                       first_k_dense_replace=1 if experts else 0, rope_scaling=YARN,
                       mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
                                     qk_rope_head_dim=4, v_head_dim=12), **kw)


def built(cfg: ModelConfig) -> deepseek.Deepseek:
    with nnx.use_eager_sharding(False):
        return deepseek.build(cfg, nnx.Rngs(0))


def test_dense_blocks_are_the_prefix_and_only_expert_blocks_route():
    model = built(small())
    prefix = nnx.to_pure_dict(nnx.state(model.prefix, nnx.Param))
    blocks = nnx.to_pure_dict(nnx.state(model.blocks, nnx.Param))
    assert sorted(prefix["mlp"]) == ["down", "gate", "up"] and prefix["mlp"]["gate"]["kernel"].shape == (1, 64, 96)
    assert sorted(blocks["mlp"]) == ["down", "gate", "router", "shared_down", "shared_gate", "shared_up", "up"]
    assert blocks["mlp"]["router"].shape[0] == 4
    from meshtron.models.moe import routing_statistics

    stats = routing_statistics(model, jnp.zeros((2, 8), jnp.int32))
    assert np.asarray(stats.load).shape == (4, 8) and (np.asarray(stats.load).sum(-1) == 2 * 8 * 2).all()
    assert not hasattr(built(small(experts=0)), "prefix")
    assert not hasattr(built(dataclasses.replace(small(), first_k_dense_replace=0)), "prefix")


def test_the_prefix_follows_the_contract_and_a_prefix_on_the_layers_axis_is_refused():
    from meshtron.models.blocks import stack_blocks
    from meshtron.models.contract import ModelContractError, check_model
    from meshtron.sharding import MEGATRON_RULES

    model = built(small())
    check_model(model, MEGATRON_RULES)
    with nnx.use_eager_sharding(False):
        model.prefix = stack_blocks(lambda r: deepseek.Block(model.dims, experts=False, rngs=r), 1, nnx.Rngs(1))
    with pytest.raises(ModelContractError, match="^model: parameter prefix.* is under prefix but its first axis is 'layers', not 'prefix_layers'.*axis=PREFIX_LAYERS"):
        check_model(model, MEGATRON_RULES)


def test_the_model_holds_exactly_its_counted_parameters():
    # Dense layers hold no expert weights and expert layers no dense MLP: the model is the dense blocks'
    # count (deepseek_counts), the expert blocks' attention and norms, their experts, and the rest.
    from meshtron.config import padded_vocab_size
    from meshtron.models import deepseek_counts
    from meshtron.plan.step_memory import StepShape

    cfg = small()
    shape, e = StepShape.from_config(cfg), cfg.moe
    experts = e.experts * cfg.hidden + 3 * e.experts * cfg.hidden * e.mlp_dim + 3 * cfg.hidden * e.shared_experts * e.mlp_dim
    expert_block = deepseek_counts.attention_parameters(shape, 1) + 2 * cfg.hidden + experts
    counted = (deepseek_counts.block_parameters(shape, 1) * cfg.first_k_dense_replace
               + expert_block * (cfg.layers - cfg.first_k_dense_replace)
               + deepseek_counts.other_parameters(shape, padded_vocab_size(cfg.vocab_size, 1), 1))
    held = sum(a.size for a in jax.tree.leaves(nnx.state(built(cfg), nnx.Param)))
    assert held == counted


def test_yarn_matches_the_formula_of_hugging_face():
    rope = deepseek.rope_from_config(4, 10000.0, YARN, True)
    # dim 4: two frequencies, base^-0 and base^-1/2; the correction range [0, 3] ramps them
    low = max(np.floor(4 * np.log(8 / (32 * 2 * np.pi)) / (2 * np.log(10000.0))), 0)
    high = min(np.ceil(4 * np.log(8 / (1 * 2 * np.pi)) / (2 * np.log(10000.0))), 3)
    ramp = np.clip((np.arange(2) - low) / (high - low), 0, 1)
    base = 10000.0 ** (-np.arange(0, 4, 2) / 4)
    np.testing.assert_allclose(rope.inv_freq, base / 4 * ramp + base * (1 - ramp), rtol=1e-6)
    mscale = 0.1 * np.log(4.0) + 1
    assert rope.attention_factor == pytest.approx(mscale / (0.1 * 0.707 * np.log(4.0) + 1))
    assert deepseek.softmax_scale(12, YARN) == pytest.approx(12 ** -0.5 * (0.1 * 0.707 * np.log(4.0) + 1) ** 2)


# CI keeps the query latent with the interleaved rotary layout, expanded through a hook, and no query latent.
@pytest.mark.parametrize("q_lora_rank, interleave, expanded", [
    pytest.param(24, True, False, marks=pytest.mark.extended, id="24-True-False"),
    pytest.param(None, False, False, id="None-False-False"), pytest.param(24, True, True, id="24-True-True")])
def test_latent_cache_decoding_equals_the_full_window(q_lora_rank, interleave, expanded):
    cfg = small(q_lora_rank)
    cfg.mla.rope_interleave = interleave
    model = built(cfg)
    if expanded:  # a kv_b_proj a layer hook wrapped (adding nothing here): the cache expanded through it
        model.blocks.self_attn.kv_b_proj.added_output = lambda x, dtype: jnp.zeros((), dtype)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    full = model(tokens)
    cache = model.init_cache(2, 16)
    assert isinstance(cache, PrefixedCaches)
    assert (cache.prefix.latent.shape, cache.blocks.latent.shape) == ((1, 2, 16, 16 + 4), (4, 2, 16, 16 + 4))
    ctx = Context.for_sequence(2, 5, 0, cache)
    x, cache = final_hidden(model, tokens[:, :5], ctx)
    steps = [model.head(x)]
    for p in range(5, 12):
        ctx = Context.for_sequence(2, 1, p, cache)
        x, cache = final_hidden(model, tokens[:, p:p + 1], ctx)
        steps.append(model.head(x))
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-6)


def test_greedy_generation_with_the_latent_cache_equals_the_full_window():
    from meshtron.config import MeshConfig
    from meshtron.generate import Sampler
    from meshtron.mesh import build_mesh

    md = model_def_from_config(small(layers=2))
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    params = md.init(mesh, seed=0)
    runs = [Sampler(md, mesh, context=16, use_cache=cached).sample(params, [5, 7, 11], max_new_tokens=20)
            for cached in (True, False)]
    assert runs[0].new_tokens == runs[1].new_tokens and len(runs[0].new_tokens) == 20


REQUIRED = [Layout(1, 1, 8), Layout(8, 1, 1), Layout(2, 2, 2, "interleaved", 2),
            Layout(4, 2, 1, "zb-h1", microbatches=2)]


def oracle() -> ModelConfig:
    """DeepSeek-V3's pieces at toy widths: latent attention with a query latent, one dense block (the
    prefix), 8 experts top-2 with sigmoid scores chosen in 4 groups of which 2 are kept (renormalised,
    scaled by 2.5), a shared expert, the selection bias, and one multi-token prediction depth."""
    base = small()
    moe = dataclasses.replace(base.moe, router="sigmoid", normalize_top_k=True, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, selection_bias=True, aux_loss_weight=0.0,
                              sequence_aux_loss_weight=0.01)
    return dataclasses.replace(base, moe=moe, mtp=MtpConfig(layers=1))


# One check_parity call per tensor size (the vocabulary is padded by it): its one-device reference is computed
# once for its layouts. CI keeps 2×2×2 interleaved (data, pipeline chunks, tensor and experts at once).
@pytest.mark.slow
@pytest.mark.parametrize("tensor", [
    pytest.param(1, marks=pytest.mark.extended, id="8x1x1, 4x2x1 zb-h1"),
    pytest.param(2, id="2x2x2 interleaved"),
    pytest.param(8, marks=pytest.mark.extended, id="1x1x8"),
])
def test_deepseek_loss_and_gradients_equal_one_device(tensor):
    """The oracle on 1×1×8, 8×1×1 (8-way expert parallelism), 2×2×2 interleaved and 4×2×1 zb-h1, against
    one one-device reference per tensor size."""
    layouts = [layout for layout in REQUIRED if layout.tensor == tensor]
    for report in check_parity(model_def_from_config(oracle(), tensor), layouts, grouped_loss=True):
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), report


@pytest.mark.slow
@pytest.mark.parametrize("layouts, documents", [
    pytest.param([Layout(2, 1, 2, context=2), Layout(2, 1, 2, context=2, context_attention="ring")], False,
                 marks=pytest.mark.extended, id="context gathered and ring"),
    pytest.param([Layout(2, 1, 2, context=2, context_attention="ulysses"), Layout(2, 1, 2)], True,
                 id="context ulysses and packed documents")])
def test_latent_attention_over_split_sequences_and_packed_documents_equals_one_device(layouts, documents):
    # Without the load-balancing loss: over a sequence split on context ranks each rank routes (and
    # balances) its own tokens, so that loss's groups are not one device's -- the experts', not MLA's.
    # One check_parity call per batch kind: its one-device references are computed once for its layouts.
    cfg = small()
    cfg.moe.aux_loss_weight = 0.0
    reports = check_parity(model_def_from_config(cfg, layouts[0].tensor), layouts, grouped_loss=True,
                           documents=documents)
    assert [r.layout for r in reports] == layouts
    for report in reports:
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), str(report.layout)


@pytest.mark.slow
@pytest.mark.parametrize("collective_matmul", [pytest.param(False, marks=pytest.mark.extended, id="sequence parallel"),
                                               pytest.param(True, id="collective matmul")])
def test_sequence_parallel_equals_one_device(collective_matmul):
    md = model_def_from_config(small(), 4, rules={"residual_seq": "tensor"})
    [report] = check_parity(md, [Layout(2, 1, 4)], grouped_loss=True,
                            execution=Execution(collective_matmul=collective_matmul))
    assert report.ok


@pytest.mark.slow
@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.extended, id="full"), "selective"])
def test_recomputed_blocks_equal_one_device(remat):
    md = model_def_from_config(small(), 2)
    [report] = check_parity(md, [Layout(2, 2, 2, "1f1b")], grouped_loss=True, execution=Execution(remat=remat))
    assert report.ok


@pytest.mark.parametrize("overrides, message", [
    (["model.mla.kv_lora_rank=0"], "model.mla.kv_lora_rank: must be >= 1"),
    (["model.mla.q_lora_rank=0"], "model.mla.q_lora_rank: must be >= 1, or null"),
    (["model.mla.qk_rope_head_dim=3"], "model.mla.qk_rope_head_dim: must be even"),
    (["model.kv_heads=2"], "model.kv_heads: the deepseek family has no key/value heads"),
    (["model.first_k_dense_replace=9"], "model.first_k_dense_replace: must be between 0 and model.layers=4"),
    (["model.rope_scaling={type: linear, factor: 2.0, original_max_position_embeddings: 8}"],
     "model.rope_scaling.type: must be 'yarn'"),
    (["model.rope_scaling={type: yarn, factor: 0.5, original_max_position_embeddings: 8}"],
     "model.rope_scaling.factor: must be a number >= 1"),
    (["model.rope_scaling={type: yarn, factor: 2.0}"], "model.rope_scaling.original_max_position_embeddings"),
    (["model.rope_scaling={type: yarn, factor: 2.0, original_max_position_embeddings: 8, betta: 1}"],
     "model.rope_scaling.betta: not a YaRN parameter"),
])
def test_bad_deepseek_settings_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_config(None, ["model.family=deepseek", "model.layers=4", *overrides])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.family=llama", "model.first_k_dense_replace=1"], "model.first_k_dense_replace: only the deepseek family"),
    (["model.family=llama", "model.rope_scaling={type: yarn, factor: 2.0, original_max_position_embeddings: 8}"],
     "model.rope_scaling: only the deepseek family"),
])
def test_deepseek_fields_elsewhere_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


DEEPSEEK = ["model.family=deepseek", "model.layers=5", "model.hidden=32", "model.heads=4", "model.mlp_dim=64",
            "model.seq_len=16", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=16",
            "model.moe.shared_experts=1", "model.moe.aux_loss_weight=0.01", "model.first_k_dense_replace=1",
            "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
            "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "train.batch_size=16", "train.eval_every=1000",
            "train.eval_batches=1"]


def deepseek_trainer(*overrides):
    from meshtron.train.loop import Trainer

    return Trainer.from_config(load_config(None, [*DEEPSEEK, *overrides]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=interleaved", "parallel.chunks=2",
     "parallel.microbatches=4"],
    pytest.param(["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1"],
                 marks=pytest.mark.extended, id="8x1x1"),
], ids=["2x2x2 interleaved", "8x1x1"])
def test_routing_reports_equal_one_devices_and_come_from_the_expert_blocks(layout):
    trainer = deepseek_trainer(*layout)
    groups = trainer.steps.report_groups
    one = deepseek_trainer("parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", f"parallel.microbatches={groups}")
    tokens = np.asarray(trainer.train_stream().next(trainer.steps.batch_sharding))
    [got] = trainer.steps.layer_reports(trainer.init_params(), tokens)
    [want] = one.steps.layer_reports(one.init_params(), tokens)
    np.testing.assert_array_equal(got.load, want.load)
    np.testing.assert_allclose(got.aux_loss, want.aux_loss, rtol=1e-5)
    assert got.load.shape[0] == 4 and (got.load.sum(-1) == tokens[:, :-1].size * 2).all()


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_counts_are_the_dense_models_parameters(q_lora_rank):
    from meshtron.config import padded_vocab_size
    from meshtron.models import deepseek_counts
    from meshtron.plan.step_memory import StepShape

    cfg = small(q_lora_rank, experts=0)
    params = nnx.to_pure_dict(nnx.state(built(cfg), nnx.Param))
    per_layer = sum(a.size for a in jax.tree.leaves(params["blocks"])) / cfg.layers
    rest = sum(a.size for k, v in params.items() if k != "blocks" for a in jax.tree.leaves(v))
    shape = StepShape.from_config(cfg)
    assert deepseek_counts.block_parameters(shape, 1) == per_layer
    assert deepseek_counts.other_parameters(shape, padded_vocab_size(cfg.vocab_size, 1), 1) == rest
    # the latent cache: kv_lora_rank + qk_rope_head_dim per token and layer, against heads x (q/k + v) for K/V
    assert deepseek_counts.cache_elements_per_token(cfg) == {"latent": 16 + 4, "keys_values": 8 * (8 + 4 + 12)}


# CI keeps delayed scaling (its amax history is state) with the prefix in a pipeline's first stage.
@pytest.mark.parametrize("fp8, layout", [
    pytest.param("current", ["parallel.pipe=1"], marks=pytest.mark.extended, id="one device-current"),
    pytest.param("delayed", ["parallel.pipe=1"], marks=pytest.mark.extended, id="one device-delayed"),
    pytest.param("current", ["parallel.pipe=2", "parallel.microbatches=2"], marks=pytest.mark.extended,
                 id="pipe 2-current"),
    pytest.param("delayed", ["parallel.pipe=2", "parallel.microbatches=2"], id="pipe 2-delayed"),
])
def test_fp8_trains_the_dense_prefix_and_the_expert_blocks(fp8, layout):
    # The prefix's projections scale by their own amax (delayed scaling's state is the blocks'), the expert
    # blocks' as the recipe says; both train, on one device and with the prefix in a pipeline's first stage.
    trainer = deepseek_trainer("parallel.data=1", "parallel.tensor=1", *layout, f"model.fp8={fp8}", "train.steps=2",
                               "train.batch_size=4")
    start = jax.device_get(trainer.canonical_params(trainer.init_params()))  # the run's own first weights
    result = trainer.run()
    assert np.isfinite(result.losses).all()
    for part in ("prefix", "blocks"):
        moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), result.params[part]["mlp"],
                             start[part]["mlp"])
        assert all(jax.tree.leaves(moved)), (part, moved)


def _hf_state_dict(params: dict, layers: int, q_lora_rank: int | None) -> dict:
    """transformers' DeepseekV3 tensor names and [out, in] layouts for a dense deepseek's parameters."""
    import torch

    def t(a):
        return torch.tensor(np.ascontiguousarray(a))

    def flat_in(k):  # [in, heads, d] -> [heads·d, in]
        return t(k.reshape(k.shape[0], -1).T)

    sd = {"model.embed_tokens.weight": t(params["embedding"][:256]), "lm_head.weight": t(params["lm_head"][:256]),
          "model.norm.weight": t(params["norm"]["scale"])}
    b, a = params["blocks"], params["blocks"]["self_attn"]
    for i in range(layers):
        at = f"model.layers.{i}."
        sd[at + "input_layernorm.weight"] = t(b["input_layernorm"]["scale"][i])
        sd[at + "post_attention_layernorm.weight"] = t(b["post_attention_layernorm"]["scale"][i])
        if q_lora_rank:
            sd[at + "self_attn.q_a_proj.weight"] = t(a["q_a_proj"]["kernel"][i].T)
            sd[at + "self_attn.q_a_layernorm.weight"] = t(a["q_a_layernorm"]["scale"][i])
            sd[at + "self_attn.q_b_proj.weight"] = flat_in(a["q_b_proj"]["kernel"][i])
        else:
            sd[at + "self_attn.q_proj.weight"] = flat_in(a["q_proj"]["kernel"][i])
        sd[at + "self_attn.kv_a_proj_with_mqa.weight"] = t(a["kv_a_proj_with_mqa"]["kernel"][i].T)
        sd[at + "self_attn.kv_a_layernorm.weight"] = t(a["kv_a_layernorm"]["scale"][i])
        sd[at + "self_attn.kv_b_proj.weight"] = flat_in(a["kv_b_proj"]["kernel"][i])
        o = a["o_proj"]["kernel"][i]
        sd[at + "self_attn.o_proj.weight"] = t(o.reshape(-1, o.shape[-1]).T)
        for name in ("gate", "up", "down"):
            sd[at + f"mlp.{name}_proj.weight"] = t(b["mlp"][name]["kernel"][i].T)
    return sd


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank, interleave, yarn", [(24, True, True), (None, True, False), (24, False, True)])
def test_latent_attention_and_yarn_give_transformers_logits(q_lora_rank, interleave, yarn):
    # Dense blocks only (transformers' router is DeepSeek-V3's sigmoid one): MLA, YaRN and the rotary
    # layouts against DeepseekV3ForCausalLM with the same weights, large enough to make every term count.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    scaling = YARN if yarn else None
    cfg = ModelConfig(family="deepseek", vocab_size=256, hidden=64, heads=4, layers=2, mlp_dim=96, seq_len=32,
                      norm_eps=1e-6, rope_scaling=scaling,
                      mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=12, rope_interleave=interleave))
    model = built(cfg)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + rng.normal(0, 0.2, a.shape).astype(np.float32) if "scale" in jax.tree_util.keystr(path)
        else a * 6, params)
    nnx.update(model, params)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **{k: v for k, v in YARN.items() if k != "type"}} if yarn \
        else {"rope_type": "default", "rope_theta": 10000.0}
    reference = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=2, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=32, rope_interleave=interleave,
        rope_parameters=rope, tie_word_embeddings=False)).eval()
    missing, unexpected = reference.load_state_dict(_hf_state_dict(params, 2, q_lora_rank), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = rng.integers(0, 256, (2, 32))
    with torch.no_grad():
        want = reference(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(model(jnp.asarray(tokens)))[..., :256]
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_cudnn_latent_attention_compiles_into_the_fused_kernel(gpu_target):
    # Keys of 8 + 8 features per head, values of 16: cuDNN's one head width for both is the padded 16.
    from meshtron.train.loop import Trainer

    cfg = load_config(None, [*DEEPSEEK, "parallel.data=2", "parallel.pipe=1", "parallel.tensor=4",
                             "model.dtype=bfloat16", "model.attention=cudnn", "model.heads=8", "model.seq_len=128",
                             "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16", "parallel.microbatches=2"])
    trainer = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    text = trainer.steps.compile(*trainer.abstract_step_arguments(), trainer.steps.stages[0]).as_text()
    assert "__cudnn$fmha" in text
