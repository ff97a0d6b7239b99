"""DeepSeek-V3 and -V2 through Hugging Face: logits of transformers' own ``DeepseekV3ForCausalLM`` and
``DeepseekV2ForCausalLM`` equal meshtron's after ``import_hf`` (on one device and restored onto
2x2x2), an export is the imported checkpoint tensor for tensor and loads in transformers with no
missing or unexpected weights, a meshtron-made DeepSeek exports too, and what meshtron cannot
represent is one line naming the config field.

The reference models are built from configs of unusual shapes (odd head widths, a query latent and
none, YaRN, grouped routing, a dense first block) and given large random weights -- the selection
bias too, large enough to change which experts are chosen -- so every tensor's layout matters."""

import json
import os
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from meshtron.checkpoint import CheckpointError
from meshtron.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, load_config
from meshtron.huggingface import export_hf, import_hf
from meshtron.models import deepseek_hf
from meshtron.models.moe import routing_statistics
from meshtron.pretrained import load_pretrained

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded (transformers is imported later)

VOCAB = 1000  # meshtron pads it to 1024
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
CASES = {
    # a query latent, odd head widths, 8 experts top-2 in 2 groups of which 1 is kept, a shared expert, two dense
    # first blocks (the prefix; the two expert blocks split over 2 pipeline stages), YaRN
    "v3": ("DeepseekV3", {**COMMON, "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
                          "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                          "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 2,
                          "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_parameters": YARN}),
    # V2-Lite's direct query projection, halves rotated, every block with experts, no groups, weights as
    # chosen (no renormalisation), a tied head
    "v3-lite": ("DeepseekV3", {**COMMON, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 10,
                               "qk_rope_head_dim": 6, "v_head_dim": 14, "n_routed_experts": 8, "num_experts_per_tok": 3,
                               "n_group": 1, "topk_group": 1, "n_shared_experts": 2, "first_k_dense_replace": 0,
                               "routed_scaling_factor": 1.5, "norm_topk_prob": False, "rope_interleave": False,
                               "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 50000.0}}),
    # softmax routing, greedy top-k, YaRN, two dense first blocks
    "v2": ("DeepseekV2", {**COMMON, "q_lora_rank": None, "kv_lora_rank": 20, "qk_nope_head_dim": 6,
                          "qk_rope_head_dim": 4, "v_head_dim": 10, "n_routed_experts": 8, "num_experts_per_tok": 2,
                          "n_shared_experts": 1, "first_k_dense_replace": 2, "routed_scaling_factor": 1.5,
                          "topk_method": "greedy", "rope_parameters": YARN}),
    # no block with experts: a dense DeepSeek
    "v3-dense": ("DeepseekV3", {**COMMON, "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8,
                                "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 4}),
}
MEASURED: dict[str, tuple[float, float]] = {}  # max|logit difference| per check, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return torch, transformers


def hf_logits(torch, model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def meshtron_logits(pretrained) -> np.ndarray:
    md = pretrained.model_def
    with jax.set_mesh(pretrained.mesh), md.scope(pretrained.execution):
        logits = jax.jit(lambda params, tokens: md.bind(params)(tokens))(pretrained.params, TOKENS)
    return np.asarray(logits)[..., :VOCAB]


def delta(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """max|got - want|, which must be within 1e-5 of the logits' scale (they are of order ten)."""
    worst, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    MEASURED[name] = (worst, scale)
    assert scale > 1.0  # the logits are not trivially small
    assert worst <= 1e-5 * scale, f"{name}: max|delta| {worst:.3g} (logits up to {scale:.3g})"
    return worst


def build_case(hf, name: str, root: Path):
    """``(hf_dir, reference logits)`` of one random Hugging Face model saved in ``root / name``: norm
    scales around 1, every weight N(0, 0.15), the selection biases N(0, 0.3) (sigmoid scores differ
    by about that much, so the bias changes the choice)."""
    torch, transformers = hf
    kind, fields = CASES[name]
    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**fields))
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in key else 0.15 * torch.randn_like(p))
        for key, b in model.named_buffers():
            if key.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.eval()
    model.save_pretrained(root / name)
    return root / name, hf_logits(torch, model)


@pytest.fixture(scope="module")
def cases(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    built: dict[str, tuple[Path, np.ndarray, Path]] = {}

    def get(name: str):
        if name not in built:
            directory, reference = build_case(hf, name, root)
            built[name] = (directory, reference, import_hf(directory, root / f"{name}-meshtron"))
        return built[name]

    yield get
    if MEASURED:
        print("\nmax|logit delta| (max|logit|): " + ", ".join(f"{k} {v:.2e} ({s:.1f})"
                                                             for k, (v, s) in sorted(MEASURED.items())))


def from_pretrained(hf, directory: Path):
    """``AutoModelForCausalLM.from_pretrained`` that must load every weight."""
    _, transformers = hf
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    return model.eval()


# ---- Hugging Face -> meshtron ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v3-lite", "v2", "v3-dense"])
def test_imported_logits_equal_transformers_on_any_mesh(cases, name):
    _, reference, output = cases(name)
    for shape in [(1, 1, 1), (2, 2, 2)]:
        pretrained = load_pretrained(output, MeshConfig(*shape))
        delta(f"import {name} {'x'.join(map(str, shape))}", meshtron_logits(pretrained), reference)


@pytest.mark.slow
def test_the_recorded_config_is_the_deepseek_and_keeps_its_selection_bias(cases):
    """The import records every field of the model (routing, latent attention, YaRN), and the V3's
    selection bias is there and fixed (bias_update_rate 0): the imported biases, which do change the
    experts chosen."""
    hf_dir, _, output = cases("v3")
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    m = pretrained.config.model
    assert (m.family, m.layers, m.first_k_dense_replace, m.rope_scaling["factor"], m.mla.q_lora_rank,
            m.mla.qk_nope_head_dim, m.mla.v_head_dim, m.mla.rope_interleave) == ("deepseek", 4, 2, 4.0, 24, 6, 10, True)
    e = m.moe
    assert (e.experts, e.top_k, e.mlp_dim, e.shared_experts, e.router, e.n_group, e.topk_group, e.routed_scaling_factor,
            e.normalize_top_k, e.selection_bias, e.bias_update_rate) == (8, 2, 24, 1, "sigmoid", 2, 1, 2.5, True, True,
                                                                          0.0)
    stored = load_file(str(hf_dir / "model.safetensors"))
    bias = np.asarray(pretrained.params["blocks"]["mlp"]["e_score_correction_bias"])
    assert bias.shape[0] == 2  # the expert layers 2 and 3; layers 0 and 1, dense, are the prefix
    for i in range(2, 4):
        np.testing.assert_array_equal(bias[i - 2], stored[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
    assert sorted(pretrained.params["prefix"]["mlp"]) == ["down", "gate", "up"]
    md = pretrained.model_def
    with jax.set_mesh(pretrained.mesh), md.scope(pretrained.execution):
        load = jax.jit(lambda p: routing_statistics(md.bind(p), TOKENS).load)(pretrained.params)
        unbiased = jax.tree.map(np.zeros_like, pretrained.params["blocks"]["mlp"]["e_score_correction_bias"])
        params = jax.tree.map(lambda x: x, pretrained.params)
        params["blocks"]["mlp"]["e_score_correction_bias"] = unbiased
        without = jax.jit(lambda p: routing_statistics(md.bind(p), TOKENS).load)(params)
    assert not np.array_equal(np.asarray(load), np.asarray(without))


@pytest.mark.slow
@pytest.mark.parametrize("override, field, fixed", [
    ("model.mla.kv_lora_rank=8", "mla.kv_lora_rank", "20"), ("model.first_k_dense_replace=1", "first_k_dense_replace", "2"),
    ("model.moe.selection_bias=false", "moe.selection_bias", "True"), ("model.moe.shared_experts=2", "moe.shared_experts", "1")])
def test_overrides_may_not_change_what_the_weights_fix(cases, tmp_path, override, field, fixed):
    hf_dir, _, _ = cases("v3")
    with pytest.raises(ConfigError, match=rf"^model\.{re.escape(field)}: the Hugging Face weights fix it at {fixed}"):
        import_hf(hf_dir, tmp_path / "out", overrides=[override])
    cfg = load_config(import_hf(hf_dir, tmp_path / "tuned", overrides=["model.moe.bias_update_rate=0.001"]) / "config.yaml")
    assert (cfg.model.moe.selection_bias, cfg.model.moe.bias_update_rate) == (True, 0.001)


def with_mtp_layer(hf_dir: Path, copy: Path, *, head_copy: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The V3 of ``hf_dir`` as DeepSeek's checkpoints store it, with one multi-token-prediction layer
    after its own (``model.layers.4``: an expert block of random weights, ``enorm``/``hnorm``/
    ``eh_proj``/``shared_head.norm``, and copies of the embedding and head), written to ``copy``."""
    rng = np.random.default_rng(1)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for key in [k for k in tensors if k.startswith("model.layers.3.")]:
        tensors[key.replace("model.layers.3.", "model.layers.4.")] = (
            0.15 * rng.standard_normal(tensors[key].shape)).astype(np.float32)
    for key, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("shared_head.norm.weight", (64,))):
        tensors[f"model.layers.4.{key}"] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    tensors["model.layers.4.eh_proj.weight"] = (0.15 * rng.standard_normal((64, 128))).astype(np.float32)
    tensors["model.layers.4.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.4.shared_head.head.weight"] = (tensors["lm_head.weight"].copy() if head_copy is None
                                                         else head_copy)
    copy.mkdir()
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


@pytest.mark.slow
def test_multi_token_prediction_layers_import_and_export_exactly(hf, cases, tmp_path, capsys):
    """A V3 with its multi-token-prediction layer: the import holds it as ``mtp.depth1`` (its block's
    tensors as a stacked layer's would be), the model's logits are unchanged, and the export is the
    original file tensor for tensor, bit for bit -- the layer's copies of the embedding and head too --
    which transformers loads with nothing missing, leaving out only that layer."""
    hf_dir, reference, _ = cases("v3")
    original = with_mtp_layer(hf_dir, tmp_path / "v3-mtp")
    output = import_hf(tmp_path / "v3-mtp", tmp_path / "imported")
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    assert pretrained.config.model.mtp.layers == 1
    depth = jax.device_get(pretrained.params["mtp"]["depth1"])
    np.testing.assert_array_equal(depth["eh_proj"]["kernel"], original["model.layers.4.eh_proj.weight"].T)
    np.testing.assert_array_equal(depth["norm"]["scale"], original["model.layers.4.shared_head.norm.weight"])
    np.testing.assert_array_equal(depth["block"]["mlp"]["up"][5], original["model.layers.4.mlp.experts.5.up_proj.weight"].T)
    delta("import v3 with an mtp layer", meshtron_logits(pretrained), reference)

    exported = export_hf(output, tmp_path / "hf")
    written = load_file(str(exported / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _, transformers = hf
    model, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    # (named as transformers converts them: its experts fused into one tensor)
    assert {k.split(".mlp.experts.")[0] for k in info["unexpected_keys"]} >= {"model.layers.4.eh_proj.weight"}
    assert all(k.startswith("model.layers.4.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    delta("export v3 with an mtp layer", hf_logits(hf[0], model.eval()), reference)


@pytest.mark.slow
def test_multi_token_prediction_layers_may_be_left_out_or_must_share_the_head(cases, tmp_path, capsys):
    """``model.mtp.layers=0`` leaves the stored layer out, saying so in one line, and the model is the
    same; a layer whose head is not the model's is refused in one line (meshtron's depths share it);
    a count the weights do not hold is refused too."""
    hf_dir, reference, _ = cases("v3")
    original = with_mtp_layer(hf_dir, tmp_path / "v3-mtp")
    capsys.readouterr()
    output = import_hf(tmp_path / "v3-mtp", tmp_path / "without", overrides=["model.mtp.layers=0"])
    said = capsys.readouterr().err
    assert re.search(r"tensors \(model\.layers\.4\..*\) left out: num_nextn_predict_layers=1: model.mtp.layers=0 "
                     r"leaves the multi-token-prediction layers out", said), said
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    assert pretrained.config.model.mtp.layers == 0 and "mtp" not in pretrained.params
    delta("import v3 leaving its mtp layer out", meshtron_logits(pretrained), reference)
    with pytest.raises(ConfigError, match=r"^model.mtp.layers: the Hugging Face weights hold 1 multi-token prediction "
                                          r"layers; keep them or leave them out with 0 \(got 2\)$"):
        import_hf(tmp_path / "v3-mtp", tmp_path / "two", overrides=["model.mtp.layers=2"])
    with_mtp_layer(hf_dir, tmp_path / "v3-other-head", head_copy=original["lm_head.weight"] + 1)
    with pytest.raises(CheckpointError, match=r"tensor model.layers.4.shared_head.head.weight differs from "
                                              r"lm_head.weight; meshtron's deepseek shares lm_head.weight there"):
        import_hf(tmp_path / "v3-other-head", tmp_path / "other")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_greedy_decoding_from_the_latent_cache_gives_transformers_tokens(hf, cases, name):
    """``meshtron.sample`` on an import (the latent cache, experts chosen with the imported selection
    bias) gives the tokens of transformers' model decoding greedily."""
    from meshtron.generate import sample

    torch, transformers = hf
    hf_dir, _, imported = cases(name)
    prompt = [int(t) for t in TOKENS[0, :8]]
    result = sample(load_pretrained(imported, MeshConfig(1, 1, 1)), prompt, max_new_tokens=12, stop=[])
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, reference(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert tuple(ids[0, len(prompt):].tolist()) == result.new_tokens


# ---- meshtron -> Hugging Face ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v3-lite", "v2", "v3-dense"])
def test_an_export_is_the_import_exactly_and_loads_in_transformers(hf, cases, name, tmp_path):
    """Every tensor written back bit for bit, no other (the prefix's dense layers and the blocks' expert
    layers each under their own layer numbers), the config's fields as they were, and transformers loads it
    with nothing missing."""
    hf_dir, reference, output = cases(name)
    exported = export_hf(output, tmp_path / "hf")
    original, written = load_file(str(hf_dir / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    before, after = (json.loads((d / "config.json").read_text()) for d in (hf_dir, exported))
    assert after["architectures"] == before["architectures"]
    routing = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
               "topk_group", "routed_scaling_factor", "norm_topk_prob")  # what a dense model has none of
    for field, value in before.items():
        if name == "v3-dense" and field in routing:
            continue
        if field in ("rope_parameters", "rope_scaling"):
            assert {k: v for k, v in after[field].items() if k != "type"} == {
                k: v for k, v in value.items() if k != "type"}, field
        elif field not in ("bos_token_id", "eos_token_id", "transformers_version", "num_nextn_predict_layers",
                           "pad_token_id", "output_router_logits", "pretraining_tp", "head_dim", "qk_head_dim",
                           "mlp_bias"):
            assert after.get(field) == value, field
    delta(f"export {name}", hf_logits(hf[0], from_pretrained(hf, exported)), reference)


@pytest.mark.slow
def test_a_fine_tune_of_an_import_keeps_its_selection_bias_and_exports_back(hf, cases, tmp_path):
    """A step from the V3 import (its config.yaml) trains the weights and leaves the selection bias as
    imported (bias_update_rate 0); the trained checkpoint exports with that bias and meshtron's logits."""
    from meshtron.train.loop import Trainer

    hf_dir, _, imported = cases("v3")
    cfg = load_config(imported / "config.yaml", [f"checkpoint.dir={tmp_path / 'run'}", "train.steps=1",
                                                "train.batch_size=2", "train.eval_batches=1", "train.warmup_steps=0",
                                                "train.lr=1e-3", "model.seq_len=32"])
    assert (cfg.model.moe.selection_bias, cfg.model.moe.bias_update_rate) == (True, 0.0)
    assert Trainer.from_config(cfg).run().checkpoints == [1]
    trained = load_pretrained(tmp_path / "run", MeshConfig(1, 1, 1))
    exported = export_hf(tmp_path / "run", tmp_path / "hf")
    original, written = load_file(str(hf_dir / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(written) == sorted(original)
    for key in original:
        same = np.array_equal(written[key], original[key])
        assert same == key.endswith("e_score_correction_bias"), key
    delta("export v3 (trained 1 step)", hf_logits(hf[0], from_pretrained(hf, exported)), meshtron_logits(trained))


@pytest.mark.slow
def test_a_meshtron_deepseek_without_a_selection_bias_exports_as_a_v3(hf, tmp_path):
    """A run's DeepSeek (sigmoid routing, no selection bias, a dense first block, trained on 2x1x2)
    exports as a ``DeepseekV3ForCausalLM`` whose biases are zeros; its logits are meshtron's."""
    from meshtron.checkpoint import RunPosition
    from meshtron.train.loop import Trainer

    cfg = load_config(None, [
        "model.family=deepseek", f"model.vocab_size={VOCAB}", "model.hidden=64", "model.heads=4", "model.layers=2",
        "model.mlp_dim=96", "model.seq_len=32", "model.norm_eps=1e-6", "model.first_k_dense_replace=1",
        "model.moe.experts=4", "model.moe.top_k=2", "model.moe.mlp_dim=16", "model.moe.shared_experts=1",
        "model.moe.router=sigmoid", "model.moe.routed_scaling_factor=2.5", "model.mla.q_lora_rank=16",
        "model.mla.kv_lora_rank=12", "model.mla.qk_nope_head_dim=6", "model.mla.qk_rope_head_dim=4",
        "model.mla.v_head_dim=10", "parallel.data=2", "parallel.pipe=1", "parallel.tensor=2",
        f"checkpoint.dir={tmp_path / 'run'}", "train.batch_size=2"])
    trainer = Trainer.from_config(cfg)
    rng = np.random.default_rng(1)

    def scrambled(path, x):
        key = jax.tree_util.keystr(path)
        if key.endswith(("['routed']", "['expert_load']")):
            return x
        norm = key.endswith("['scale']")
        return (1 + 0.1 * rng.standard_normal(x.shape) if norm else 0.15 * rng.standard_normal(x.shape)).astype(x.dtype)

    params = jax.tree_util.tree_map_with_path(scrambled, jax.device_get(trainer.init_params()))
    params = jax.device_put(params, trainer.steps.param_shardings)
    store = trainer.open_checkpoints()
    trainer.save(store, params, trainer.steps.init_opt_state(params), RunPosition(5, 5, 5))
    store.wait()
    store.close()

    saved = load_pretrained(tmp_path / "run", MeshConfig(1, 1, 1))
    exported = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["first_k_dense_replace"], config["n_routed_experts"]) == (
        ["DeepseekV3ForCausalLM"], 1, 4)
    np.testing.assert_array_equal(load_file(str(exported / "model.safetensors"))[
        "model.layers.1.mlp.gate.e_score_correction_bias"], 0)
    delta("export meshtron-made v3", hf_logits(hf[0], from_pretrained(hf, exported)), meshtron_logits(saved))


# ---- what meshtron cannot represent ----------------------------------------------------------------


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


V3_CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **CASES["v3"][1]}
V2_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **CASES["v2"][1]}


@pytest.mark.parametrize("config, message", [
    ({**V3_CONFIG, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
     r'rope_parameters=\{"rope_type": "llama3", "factor": 8.0\} is not supported; meshtron\'s deepseek has plain RoPE'),
    ({**V3_CONFIG, "attention_bias": True}, r"attention_bias=true is not supported; meshtron's deepseek has no biases"),
    ({**V3_CONFIG, "hidden_act": "gelu"}, r'hidden_act="gelu" is not supported; meshtron\'s deepseek MLPs are SwiGLU'),
    ({**V3_CONFIG, "num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported; a DeepSeek's keys and values"),
    ({**V3_CONFIG, "n_shared_experts": 0}, r"n_shared_experts=0 is not supported; meshtron's deepseek has at least one"),
    ({**V3_CONFIG, "scoring_func": "softmax"}, r'scoring_func="softmax" is not supported; a DeepSeek-V3 scores by sig'),
    ({**V3_CONFIG, "topk_method": "greedy"}, r'topk_method="greedy" is not supported; a DeepSeek-V3 routes by noaux_tc'),
    ({**V3_CONFIG, "moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
    ({**V3_CONFIG, "qk_rope_head_dim": 5}, r"qk_rope_head_dim=5 is not supported; rotary features turn in pairs"),
    ({**V3_CONFIG, "n_group": 3}, r"n_group=3, topk_group=1: expected groups of at least 2"),
    ({**V2_CONFIG, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
     r'topk_method="group_limited_greedy" is not supported; meshtron ranks expert groups by their two best'),
], ids=["rope", "attention_bias", "hidden_act", "kv_heads", "no-shared", "scoring_func", "topk_method",
        "moe_layer_freq", "odd-rope", "n_group", "v2-groups"])
def test_what_meshtron_cannot_represent_is_one_line(tmp_path, config, message):
    hf_dir = write_config(tmp_path / "hf", config)
    with pytest.raises(ConfigError, match=message) as caught:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(caught.value) and str(caught.value).startswith(str(hf_dir))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("moe, message", [
    (MoEConfig(experts=8, router="sigmoid", shared_experts=1, capacity_factor=1.0),
     "model.moe.capacity_factor: a DeepSeek's experts are dropless"),
    (MoEConfig(experts=8, router="sigmoid"), "model.moe.shared_experts: a DeepSeek has at least one shared expert"),
    (MoEConfig(experts=8, shared_experts=1), "model.moe.normalize_top_k: a softmax router is a DeepSeek-V2's"),
    (MoEConfig(experts=8, shared_experts=1, normalize_top_k=False, selection_bias=True),
     "model.moe.selection_bias: a softmax router is a DeepSeek-V2's"),
], ids=["capacity", "no-shared", "softmax-renormalised", "softmax-bias"])
def test_what_transformers_cannot_load_does_not_export(moe, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        deepseek_hf.hf_config(ModelConfig(family="deepseek", moe=moe), False, None)


def test_a_v2_routed_greedily_ignores_its_groups(tmp_path):
    """transformers' V2 ignores ``n_group``/``topk_group`` under ``greedy`` (and keeping every group is
    greedy): the import routes over every expert; a V3 keeps its group limit."""
    for config, groups in [({**V2_CONFIG, "n_group": 4, "topk_group": 2}, (1, 1)),
                           ({**V2_CONFIG, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 4}, (1, 1)),
                           (V3_CONFIG, (2, 1))]:
        moe = deepseek_hf.model_config(config, tmp_path / "config.json").moe
        assert (moe.n_group, moe.topk_group) == groups
