"""The bundled DeepSeek configs (``mesh_configs/deepseek_v2_lite.yaml``, ``deepseek_v3.yaml``): they hold
the shapes of the published models' Hugging Face ``config.json``, pass every cross-feature check, and
(compile-only H100s) a shrunken V3 with every one of its features compiles through ``describe``.
Also ``describe``'s count of the parameters a token passes through."""

import io
import math
import re
from pathlib import Path

import jax
import pytest

from meshtron.config import load_config
from meshtron.describe import active_parameters, describe
from meshtron.run import check_features, resolve_run
from meshtron.train.state import model_def_from_config

CONFIGS = Path(__file__).resolve().parents[1] / "mesh_configs"

# deepseek-ai/DeepSeek-V2-Lite's and deepseek-ai/DeepSeek-V3's config.json, as meshtron names the fields
# (docs/deepseek.md's import table).
HF = {
    "deepseek_v2_lite": {
        "hidden": 2048, "layers": 27, "heads": 16, "vocab_size": 102400, "mlp_dim": 10944, "norm_eps": 1e-6,
        "max_position_embeddings": 163840, "rope_theta": 10000.0, "first_k_dense_replace": 1,
        "mla": {"q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128},
        "moe": {"experts": 64, "top_k": 6, "mlp_dim": 1408, "shared_experts": 2, "router": "softmax",
                "normalize_top_k": False, "routed_scaling_factor": 1.0, "n_group": 1},
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "mtp_layers": 0,
    },
    "deepseek_v3": {
        "hidden": 7168, "layers": 61, "heads": 128, "vocab_size": 129280, "mlp_dim": 18432, "norm_eps": 1e-6,
        "max_position_embeddings": 163840, "rope_theta": 10000.0, "first_k_dense_replace": 3,
        "mla": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128},
        "moe": {"experts": 256, "top_k": 8, "mlp_dim": 2048, "shared_experts": 1, "router": "sigmoid",
                "normalize_top_k": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "mtp_layers": 1,
    },
}


@pytest.mark.parametrize("name", sorted(HF))
def test_deepseek_config_holds_the_published_shapes_and_passes_every_check(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    check_features(cfg)
    devices = cfg.mesh.data * cfg.mesh.pipe * cfg.mesh.tensor * cfg.mesh.context
    resolve_run(cfg, devices)  # the pipeline layout against the pipelined (expert) layers, as the CLI checks it
    m, want = cfg.model, HF[name]
    assert m.family == "deepseek" and m.kv_heads is None
    for field in ("hidden", "layers", "heads", "vocab_size", "mlp_dim", "norm_eps", "max_position_embeddings",
                  "rope_theta", "first_k_dense_replace"):
        assert getattr(m, field) == want[field], field
    for field, value in want["mla"].items():
        assert getattr(m.mla, field) == value, f"mla.{field}"
    for field, value in want["moe"].items():
        assert getattr(m.moe, field) == value, f"moe.{field}"
    assert m.rope_scaling == want["rope_scaling"]
    assert m.mtp.layers == want["mtp_layers"]
    assert m.moe.capacity_factor == 1.0 and m.moe.dispatch == "padded"  # GShard's exchange of each expert's share
    assert (m.moe.bias_update_rate > 0) == (name == "deepseek_v3")  # V3's aux-loss-free balancing
    assert cfg.train.batch_size % (cfg.mesh.data * cfg.train.microbatches) == 0


def test_active_parameters_count_top_k_of_the_routed_experts():
    """On mixtral_cpu8 (every layer a mixture of 8 experts, top-2): every parameter but the experts'
    three matrices, and 2/8 of those."""
    cfg = load_config("mixtral_cpu8")
    m = cfg.model
    model_def = model_def_from_config(m, cfg.mesh.tensor)
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(model_def.shapes()))
    routed = m.layers * m.moe.experts * 3 * m.hidden * m.moe.mlp_dim
    assert active_parameters(model_def, m.moe.experts, m.moe.top_k) == total - routed + routed * 2 // 8
    assert active_parameters(model_def, 0, 0) == total


SHRUNK_V3 = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=2",
             "parallel.layout=[2,1]", "model.layers=4", "model.first_k_dense_replace=1", "model.hidden=64",
             "model.heads=4", "model.mlp_dim=128", "model.vocab_size=256", "model.seq_len=64",
             "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=32", "model.moe.n_group=4",
             "model.moe.topk_group=2", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=32",
             "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=16",
             "train.batch_size=8"]


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_shrunken_v3_compiles_for_h100s_through_describe(gpu_target):
    """deepseek_v3.yaml with its every feature (latent attention with a query latent, YaRN, a dense
    first block, sigmoid group-limited routing with the selection bias updated, a shared expert,
    experts with a capacity exchanged over data, a multi-token module, an uneven 1F1B pipeline, zero=1)
    at toy widths on 2x2x2 H100s: describe compiles it and prints the GPU program's memory, its bf16
    all-to-alls and the estimate."""
    out = io.StringIO()
    describe(load_config(CONFIGS / "deepseek_v3.yaml", SHRUNK_V3), out, target=gpu_target)
    text = out.getvalue()
    assert "compiled for 8 NVIDIA H100" in text
    assert re.search(r"^  peak +\d", text, re.MULTILINE)
    assert re.search(r"^all-to-all +data +bf16", text, re.MULTILINE), text.split("collectives per mesh axis")[-1]
    assert "active per token" in text and "MFU" in text
