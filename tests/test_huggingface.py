"""Hugging Face import/export: logits of Hugging Face's own models equal meshtron's after
``import_hf`` (on one device and restored onto 2x2x2) and after ``export_hf`` (``from_pretrained``
with no missing or unexpected weights), training resumes from an import at step 0, the tokenizer
travels both ways, and what meshtron cannot represent is one line naming the config field.

The reference models are built from configs with ``transformers``' classes (nothing is
downloaded) and given large random weights (norm scales and biases too), so that the logits are of
order one and every tensor's layout matters. Tests that need torch/transformers skip without them.
"""

import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from meshtron.checkpoint import CheckpointError
from meshtron.config import ConfigError, MeshConfig, load_config
from meshtron.huggingface import CONFIG_FILE, export_hf, import_hf
from meshtron.pretrained import load_pretrained

pytestmark = pytest.mark.slow

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded (transformers is imported later)

VOCAB = 1000  # not a multiple of 128: meshtron pads it to 1024 (tensor 1 and 2)
TOLERANCE = 1e-4
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 24))
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
         "bos_token_id": 1, "eos_token_id": 2}
GPT2 = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "layer_norm_epsilon": 1e-6,
        "bos_token_id": 0, "eos_token_id": 0}
MEASURED: dict[str, float] = {}  # max|logit difference| per check, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return torch, transformers


def scramble(torch, model) -> None:
    """Large random weights: norm scales around 1, everything else (biases included) N(0, 0.15)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            p.copy_(1 + 0.1 * torch.randn_like(p) if norm else 0.15 * torch.randn_like(p))


def hf_logits(torch, model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def meshtron_logits(pretrained) -> np.ndarray:
    md = pretrained.model_def
    with jax.set_mesh(pretrained.mesh), md.scope(pretrained.execution):
        logits = jax.jit(lambda params, tokens: md.bind(params)(tokens))(pretrained.params, TOKENS)
    logits = np.asarray(logits)
    assert logits.shape[-1] == md.vocab_padded > md.vocab_size == VOCAB
    return logits[..., :VOCAB]


def delta(name: str, a: np.ndarray, b: np.ndarray) -> float:
    worst = float(np.max(np.abs(a - b)))
    MEASURED[name] = worst
    assert np.max(np.abs(b)) > 1.0  # the logits are not trivially small
    assert worst <= TOLERANCE, f"{name}: max|delta| {worst:.3g}"
    return worst


def tiny_tokenizer(directory: Path) -> Path:
    from meshtron.data.tokenizers import train_bpe

    text = directory / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog; the dog sleeps. " * 40)
    return train_bpe([text], 300, directory / "tokenizer.json", min_frequency=1).path


# ---- the Hugging Face models (built once) --------------------------------------------------------


def build_case(hf, name: str, root: Path):
    """``(hf_dir, reference logits)`` of one Hugging Face model saved in ``root / name``."""
    torch, transformers = hf
    directory = root / name
    if name == "llama":  # untied, saved in shards with an index
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, rope_theta=50000.0))
        save = {"max_shard_size": "100KB"}
    elif name == "llama-tied":  # Llama 3.2 style: tied head, bf16 weights, a tokenizer
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, rope_theta=250000.0,
                                                                      tie_word_embeddings=True))
        save = {}
    elif name == "mixtral":  # 8 experts, top-2
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **LLAMA, rope_theta=1e6, sliding_window=None, num_local_experts=8, num_experts_per_tok=2))
        save = {}
    elif name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA, rope_theta=1e6,
                                                                          sliding_window=None))
        save = {}
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
        save = {}
    scramble(torch, model)
    model.eval()
    if name == "llama-tied":
        model.to(torch.bfloat16).save_pretrained(directory, **save)
        # the reference: the saved bf16 weights computed in fp32 (a model cast back with .to() would keep
        # its RoPE frequencies rounded to bf16)
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        tiny_tokenizer(directory)
    else:
        model.save_pretrained(directory, **save)
    return directory, hf_logits(torch, model)


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
        print("\nmax|logit delta|: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(MEASURED.items())))


# ---- (a) Hugging Face -> meshtron ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2", "mixtral"])
def test_imported_logits_equal_hugging_face_on_any_mesh(cases, name):
    _, reference, output = cases(name)
    for shape in [(1, 1, 1), (2, 2, 2)]:
        pretrained = load_pretrained(output, MeshConfig(*shape))
        assert pretrained.step == 0 and dict(pretrained.mesh.shape) == {**dict(zip(("data", "pipe", "tensor"), shape)),
                                                                         "context": 1}
        delta(f"import {name} {'x'.join(map(str, shape))}", meshtron_logits(pretrained), reference)


def test_recorded_config_describes_the_model(cases):
    _, _, output = cases("llama")
    m = load_pretrained(output, MeshConfig(1, 1, 1)).config.model
    assert (m.family, m.vocab_size, m.hidden, m.heads, m.kv_heads, m.layers, m.mlp_dim, m.seq_len) == (
        "llama", VOCAB, 64, 4, 2, 2, 96, 64)
    assert (m.rope_theta, m.norm_eps) == (50000.0, 1e-6)
    _, _, output = cases("gpt2")
    m = load_pretrained(output, MeshConfig(1, 1, 1)).config.model
    assert (m.family, m.vocab_size, m.hidden, m.heads, m.layers, m.mlp_dim, m.seq_len, m.norm_eps) == (
        "gpt", VOCAB, 64, 4, 2, 256, 32, 1e-6)


def test_mistral_without_a_sliding_window_is_a_llama(cases):
    _, reference, output = cases("mistral")
    delta("import mistral 1x1x1", meshtron_logits(load_pretrained(output, MeshConfig(1, 1, 1))), reference)


def test_hub_layout_gpt2_and_a_parallel_import_mesh(cases, tmp_path):
    """GPT-2 as the Hub stores it (no ``transformer.`` prefix, causal-mask buffers ``attn.bias``) imports
    the same; an import written from a 2x2x2 mesh records it and restores onto one device."""
    from safetensors.numpy import load_file

    hf_dir, reference, _ = cases("gpt2")
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(hf_dir / "config.json", hub)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    tensors |= {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 32, 32), np.float32)) for i in range(2)}
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    output = import_hf(hub, tmp_path / "out", mesh=MeshConfig(2, 2, 2))
    pretrained = load_pretrained(output)  # the recorded mesh
    assert dict(pretrained.mesh.shape) == {"data": 2, "context": 1, "pipe": 2, "tensor": 2}
    delta("import gpt2 (hub layout, written 2x2x2) 1x1x1",
          meshtron_logits(load_pretrained(output, MeshConfig(1, 1, 1))), reference)


# ---- (b) meshtron -> Hugging Face --------------------------------------------------------------------


def from_pretrained(hf, directory: Path, capfd):
    """``AutoModelForCausalLM.from_pretrained`` that must load every weight and say nothing about it."""
    _, transformers = hf
    transformers.logging.set_verbosity_warning()
    try:
        capfd.readouterr()
        model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        said = "".join(capfd.readouterr())
    finally:
        transformers.logging.set_verbosity_error()
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert not re.search(r"newly initiali[sz]ed|not initiali[sz]ed|missing|unexpected", said, re.IGNORECASE), said
    return model.eval()


def test_a_fine_tune_starts_from_an_import_and_exports_back(hf, cases, tmp_path, capfd):
    """The import's config.yaml starts a run from the Hugging Face weights (``train.init_from``) with a
    fresh optimizer state, saving elsewhere; that run's checkpoint exports to Hugging Face."""
    from meshtron.checkpoint import RunPosition
    from meshtron.train.loop import Trainer

    _, _, imported = cases("llama")
    output = tmp_path / "run"
    cfg = load_config(imported / CONFIG_FILE, [f"checkpoint.dir={output}", "train.steps=1", "train.batch_size=2",
                                               "train.eval_batches=1", "train.warmup_steps=0", "train.lr=1e-3"])
    assert (cfg.model.family, cfg.model.norm_eps, cfg.model.kv_heads) == ("llama", 1e-6, 2)
    assert cfg.train.init_from == str(imported)
    trainer = Trainer.from_config(cfg)
    store = trainer.open_checkpoints()
    params, opt_state, position, weights = trainer.starting_state(store)
    store.close()
    assert position == RunPosition(0, 0, 0) and weights.startswith(f"weights: initialised from {imported}/0 (train.init_from")
    pretrained = load_pretrained(imported, MeshConfig(1, 1, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(pretrained.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = trainer.steps.init_opt_state(params)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    result = trainer.run()
    assert result.first_step == 1 and result.checkpoints == [1]
    trained = load_pretrained(output, MeshConfig(1, 1, 1))
    assert trained.step == 1
    exported = export_hf(output, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], VOCAB, False)
    model = from_pretrained(hf, exported, capfd)
    delta("export llama (trained 1 step)", hf_logits(hf[0], model), meshtron_logits(trained))


def test_a_lora_fine_tune_of_an_import_exports_merged(hf, cases, tmp_path, capfd):
    """LoRA from an import (which holds no adapters: they are made fresh, the weights are the import's):
    the base stays as imported, the export folds the adapters into their matrices, loads in
    transformers with every weight and nothing else, and gives the adapted model's logits."""
    from meshtron.models.lora import is_adapter
    from meshtron.train.loop import Trainer
    from meshtron.trees import leaf_names

    _, _, imported = cases("llama")
    output = tmp_path / "lora"
    cfg = load_config(imported / CONFIG_FILE, [f"checkpoint.dir={output}", "train.steps=3", "train.batch_size=2",
                                               "train.eval_batches=1", "train.warmup_steps=0", "train.lr=3e-2",
                                               "train.lora.rank=4", "train.lora.alpha=8"])
    Trainer.from_config(cfg).run()
    trained = load_pretrained(output, MeshConfig(1, 1, 1))
    base = load_pretrained(imported, MeshConfig(1, 1, 1))
    names = leaf_names(trained.params)
    assert any(is_adapter(n) for n in names)
    kept = {n: a for n, a in zip(names, jax.tree.leaves(trained.params)) if not is_adapter(n)}
    for n, a in zip(leaf_names(base.params), jax.tree.leaves(base.params), strict=True):
        np.testing.assert_array_equal(np.asarray(kept[n]), np.asarray(a), err_msg=n)  # the base is frozen
    adapted = meshtron_logits(trained)
    assert np.max(np.abs(adapted - meshtron_logits(base))) > 1e-3  # the adapters changed the model
    exported = export_hf(output, tmp_path / "hf")
    model = from_pretrained(hf, exported, capfd)
    worst = float(np.max(np.abs(hf_logits(hf[0], model) - adapted)))
    MEASURED["export llama with LoRA merged"] = worst
    assert worst <= 1e-4


def test_a_gpt_checkpoint_exports_to_gpt2(hf, tmp_path, capfd):
    """A checkpoint as a GPT run on data x tensor = 2 x 2 saves it (``Trainer.save``), with large random
    weights: exported, it gives Hugging Face's GPT-2 meshtron's logits."""
    from meshtron.checkpoint import RunPosition
    from meshtron.train.loop import Trainer

    cfg = load_config(None, ["model.family=gpt", f"model.vocab_size={VOCAB}", "model.hidden=64", "model.heads=4",
                             "model.layers=2", "model.mlp_dim=96", "model.seq_len=32", "model.norm_eps=1e-6",
                             "parallel.data=2", "parallel.pipe=1", "parallel.tensor=2", f"checkpoint.dir={tmp_path / 'run'}",
                             "train.batch_size=2"])
    trainer = Trainer.from_config(cfg)
    rng = np.random.default_rng(1)

    def scrambled(path, x):
        norm = jax.tree_util.keystr(path).endswith("['scale']")
        return (1 + 0.1 * rng.standard_normal(x.shape) if norm else 0.15 * rng.standard_normal(x.shape)).astype(x.dtype)

    params = jax.tree_util.tree_map_with_path(scrambled, jax.device_get(trainer.init_params()))
    params = jax.device_put(params, trainer.steps.param_shardings)
    store = trainer.open_checkpoints()
    trainer.save(store, params, trainer.steps.init_opt_state(params), RunPosition(5, 5, 5))
    store.wait()
    store.close()

    saved = load_pretrained(tmp_path / "run", MeshConfig(1, 1, 1))
    assert saved.step == 5
    exported = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["n_inner"], config["n_positions"], config["tie_word_embeddings"]) == (
        ["GPT2LMHeadModel"], 96, 32, True)
    assert config["layer_norm_epsilon"] == 1e-6 and config["torch_dtype"] == config["dtype"] == "float32"
    model = from_pretrained(hf, exported, capfd)
    delta("export gpt2", hf_logits(hf[0], model), meshtron_logits(saved))


def test_mixtral_imports_as_a_llama_with_experts_and_exports_back(hf, cases, tmp_path, capfd):
    _, _, output = cases("mixtral")
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    moe = pretrained.config.model.moe
    assert (moe.experts, moe.top_k, moe.mlp_dim, moe.capacity_factor, moe.aux_loss_weight) == (8, 2, 96, 0.0, 0.001)
    assert pretrained.params["blocks"]["mlp"]["gate"].shape == (2, 8, 64, 96)
    exported = export_hf(output, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (["MixtralForCausalLM"], 8, 2, 96)
    model = from_pretrained(hf, exported, capfd)
    delta("export mixtral (imported)", hf_logits(hf[0], model), meshtron_logits(pretrained))


def test_tied_llama_exports_tied_with_its_tokenizer(hf, cases, tmp_path, capfd):
    hf_dir, _, output = cases("llama-tied")
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    # the tokenizer travelled into the checkpoint and the recorded config names it
    assert (output / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert pretrained.config.data.tokenizer == str(output / "tokenizer.json")
    assert pretrained.tokenizer.kind == "huggingface" and 256 < pretrained.tokenizer.vocab_size <= 300
    exported = export_hf(output, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert config["tie_word_embeddings"] is True  # the head still equals the embedding
    assert (exported / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    model = from_pretrained(hf, exported, capfd)
    delta("export llama-tied (imported)", hf_logits(hf[0], model), meshtron_logits(pretrained))
    tokenizer = hf[1].AutoTokenizer.from_pretrained(exported)
    text = "the lazy fox sleeps"
    assert tokenizer.encode(text, add_special_tokens=False) == pretrained.tokenizer.encode(text)


def test_generate_samples_from_an_import(cases, capsys):
    from meshtron.cli import main

    _, _, output = cases("llama-tied")
    assert main(["generate", "--checkpoint", str(output), "--prompt", "the lazy dog", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("the lazy dog")


# ---- (c) what meshtron cannot represent --------------------------------------------------------------


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA}
GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **GPT2}


@pytest.mark.parametrize("config, error, message", [
    ({**LLAMA_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ConfigError,
     r'rope_scaling=\{"rope_type": "llama3", "factor": 8.0\} is not supported; meshtron\'s Llama has plain RoPE'),
    ({**LLAMA_CONFIG, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, ConfigError,
     r"rope_parameters=.* is not supported; meshtron's Llama has plain RoPE"),
    ({**LLAMA_CONFIG, "attention_bias": True}, ConfigError,
     r"attention_bias=true is not supported; meshtron's Llama has no biases \(false\)"),
    ({**LLAMA_CONFIG, "mlp_bias": True}, ConfigError, r"mlp_bias=true is not supported"),
    ({**LLAMA_CONFIG, "hidden_act": "gelu"}, ConfigError,
     r'hidden_act="gelu" is not supported; meshtron\'s Llama MLP is SwiGLU \(silu\)'),
    ({**LLAMA_CONFIG, "head_dim": 32}, ConfigError, r"head_dim=32 is not supported; meshtron's heads are"),
    ({**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}, ConfigError,
     r"sliding_window=4096 is not supported; meshtron attends to the whole context"),
    ({**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 32}, ConfigError,
     r"sliding_window=32 is not supported"),
    ({**GPT2_CONFIG, "activation_function": "relu"}, ConfigError,
     r'activation_function="relu" is not supported; meshtron\'s GPT uses the tanh-approximated GELU'),
    ({**GPT2_CONFIG, "tie_word_embeddings": False}, ConfigError, r"tie_word_embeddings=false is not supported"),
    ({**GPT2_CONFIG, "scale_attn_by_inverse_layer_idx": True}, ConfigError,
     r"scale_attn_by_inverse_layer_idx=true is not supported"),
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, ConfigError,
     r'architectures=\["BertForMaskedLM"\] is not supported; meshtron imports DeepseekV3ForCausalLM, Deepseek'),
    (LLAMA_CONFIG, CheckpointError, r"holds no \*.safetensors weights"),
], ids=["rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "hidden_act", "head_dim", "mistral-default",
        "sliding_window", "activation_function", "gpt2-untied", "inverse_layer_idx", "architecture", "no-weights"])
def test_what_meshtron_cannot_represent_is_one_line(tmp_path, config, error, message):
    hf_dir = write_config(tmp_path / "hf", config)
    with pytest.raises(error, match=message) as caught:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(caught.value) and str(caught.value).startswith(str(hf_dir))
    assert not (tmp_path / "out").exists()


def llama_tensors(layers: int = 2) -> dict[str, np.ndarray]:
    """A complete tiny Llama in Hugging Face names and layouts ([out, in] projections)."""
    rng = np.random.default_rng(0)
    h, f, n, k, d = 64, 96, 4, 2, 16

    def w(*shape):
        return rng.normal(0, 0.1, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(VOCAB, h), "model.norm.weight": w(h), "lm_head.weight": w(VOCAB, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
                    p + "self_attn.q_proj.weight": w(n * d, h), p + "self_attn.k_proj.weight": w(k * d, h),
                    p + "self_attn.v_proj.weight": w(k * d, h), p + "self_attn.o_proj.weight": w(h, n * d),
                    p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                    p + "mlp.down_proj.weight": w(h, f)}
    return tensors


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     r"has no tensor model.layers.1.mlp.up_proj.weight \(shape \[96, 64\]\); the safetensors files do not match"),
    (lambda t: t.pop("lm_head.weight"), r"has no tensor lm_head.weight \(shape \[1000, 64\]\)"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
     r"tensor model.layers.0.self_attn.k_proj.weight is \[64, 64\], config.json implies \[32, 64\]"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     r"tensor model.layers.0.self_attn.q_proj.bias \(1 in all\) has no place in meshtron's llama model"),
], ids=["missing", "missing-head", "wrong-shape", "unexpected"])
def test_weights_that_do_not_match_the_config_are_one_line(tmp_path, change, message):
    hf_dir = write_config(tmp_path / "hf", LLAMA_CONFIG)
    tensors = llama_tensors()
    change(tensors)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message) as caught:
        import_hf(hf_dir, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_overrides_may_not_change_what_the_weights_fix(tmp_path):
    hf_dir = write_config(tmp_path / "hf", GPT2_CONFIG)
    with pytest.raises(ConfigError, match=r"^model.hidden: the Hugging Face weights fix it at 64"):
        import_hf(hf_dir, tmp_path / "out", overrides=["model.hidden=32"])
    with pytest.raises(ConfigError, match=r"^model.max_position_embeddings: the Hugging Face weights fix it at 32"):
        import_hf(hf_dir, tmp_path / "out", overrides=["model.max_position_embeddings=64"])
    with pytest.raises(ConfigError, match=r"^model.max_position_embeddings: 32 is shorter than model.seq_len=64"):
        import_hf(hf_dir, tmp_path / "out", overrides=["model.seq_len=64"])  # GPT-2's 32 learned positions


def test_a_transformers_4_config_imports_without_torch(tmp_path):
    """``rope_theta`` at the top level (transformers 4.x spelling), weights written with NumPy: the
    parameters land in meshtron's layout, the vocabulary padding rows are zeros."""
    hf_dir = write_config(tmp_path / "hf", {**LLAMA_CONFIG, "rope_theta": 500000.0, "rope_scaling": None})
    tensors = llama_tensors()
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    output = import_hf(hf_dir, tmp_path / "out")
    pretrained = load_pretrained(output, MeshConfig(1, 1, 1))
    assert (pretrained.config.model.rope_theta, pretrained.config.model.norm_eps) == (500000.0, 1e-6)
    params = jax.device_get(pretrained.params)
    np.testing.assert_array_equal(params["blocks"]["attn"]["wq"]["kernel"][1],
                                  tensors["model.layers.1.self_attn.q_proj.weight"].T.reshape(64, 4, 16))
    np.testing.assert_array_equal(params["blocks"]["attn"]["wo"]["kernel"][0],
                                  tensors["model.layers.0.self_attn.o_proj.weight"].T.reshape(4, 16, 64))
    np.testing.assert_array_equal(params["blocks"]["mlp"]["down"]["kernel"][1],
                                  tensors["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(params["lm_head"][:VOCAB], tensors["lm_head.weight"])
    assert params["lm_head"].shape == (1024, 64) and not params["lm_head"][VOCAB:].any()


# ---- (d) the model's context, and sampling from an import ------------------------------------------


def test_export_keeps_the_models_context_after_a_shorter_fine_tune(hf, tmp_path, capfd):
    """Imported with 256 positions, fine-tuned on a 64-token window: the export still has 256 (config and
    tokenizer), and ``from_pretrained`` gives the fine-tune's logits."""
    from meshtron.cli import main

    torch, transformers = hf
    hf_dir = tmp_path / "hf"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "max_position_embeddings": 256}))
    scramble(torch, model)
    model.save_pretrained(hf_dir)
    tiny_tokenizer(hf_dir)
    imported = import_hf(hf_dir, tmp_path / "imported")
    assert load_pretrained(imported).config.model.max_position_embeddings == 256
    assert main(["train", "--config", str(imported / CONFIG_FILE), "model.seq_len=64", "train.steps=1",
                 "train.batch_size=2", "train.eval_batches=1", "train.warmup_steps=0"]) == 0
    tuned = tmp_path / "imported-finetune"
    assert load_pretrained(tuned).config.model.seq_len == 64
    exported = export_hf(tuned, tmp_path / "out")
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 256
    assert json.loads((exported / "tokenizer_config.json").read_text())["model_max_length"] == 256
    delta("export llama (fine-tuned at 64 of 256 positions)", hf_logits(torch, from_pretrained(hf, exported, capfd)),
          meshtron_logits(load_pretrained(tuned, MeshConfig(1, 1, 1))))


def test_import_says_when_it_caps_the_training_window(tmp_path, capsys):
    hf_dir = write_config(tmp_path / "hf", {**LLAMA_CONFIG, "max_position_embeddings": 131072})
    save_file(llama_tensors(), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    m = load_pretrained(import_hf(hf_dir, tmp_path / "out")).config.model
    assert (m.seq_len, m.max_position_embeddings) == (4096, 131072)
    assert capsys.readouterr().err.strip() == (
        "meshtron: model.seq_len=4096 (the training window, and generate's context); the model's own context, "
        "max_position_embeddings=131072, is kept and exported; model.seq_len=N chooses another window")


def test_the_readme_sample_example_gives_hugging_faces_greedy_tokens(hf, cases, tmp_path, monkeypatch, capsys):
    """The README's Python example, unchanged, on an imported Llama with a BPE tokenizer: the checkpoint's
    tokenizer and window, and the same greedy tokens as Hugging Face's model."""
    from test_readme import run_example

    torch, transformers = hf
    hf_dir, _, imported = cases("llama-tied")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "llama1b").symlink_to(imported)
    monkeypatch.chdir(tmp_path)
    namespace = run_example("sample")
    result = namespace["result"]
    assert capsys.readouterr().out == result.text + "\n" and result.text.startswith("The capital of France is")
    assert result.tokenizer.kind == "huggingface" and len(result.new_tokens) == 20

    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(result.prompt_tokens)])
    with torch.no_grad():
        for _ in range(20):  # greedy, written out: no generation config (end-of-text stops) in the way
            ids = torch.cat([ids, reference(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert tuple(ids[0, len(result.prompt_tokens):].tolist()) == result.new_tokens
