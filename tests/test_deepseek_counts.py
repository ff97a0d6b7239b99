"""The deepseek family's counts (:mod:`meshtron.models.deepseek_counts`): what its block keeps for the
backward equals what JAX's autodiff saves, per token, for latent attention of unequal widths, with and
without a query latent, dense, with experts, and with dense layers before expert layers; the
multi-token prediction modules' parameters equal the built model's, DeepSeek-V3's 11.6B among them."""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import pytest

from meshtron.config import MlaConfig, ModelConfig, MoEConfig, MtpConfig, padded_vocab_size
from meshtron.execution import Execution
from meshtron.megatron import layer_activation_bytes
from meshtron.models import deepseek_counts
from meshtron.plan.step_memory import StepShape
from meshtron.train.state import model_def_from_config
from meshtron.trees import leaf_names

H, HEADS, MLP, S = 64, 8, 256, 32
EXPERTS = MoEConfig(experts=8, top_k=2, mlp_dim=16, shared_experts=1)
DENSE = MoEConfig()


def model(q_lora_rank=24, moe=DENSE, layers=1, first_dense=0, **kw) -> ModelConfig:
    return ModelConfig(family="deepseek", hidden=H, heads=HEADS, mlp_dim=MLP, seq_len=S, layers=layers,
                       first_k_dense_replace=first_dense, remat="selective", moe=moe,
                       mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                     v_head_dim=6), **kw)


def saved_elements(cfg: ModelConfig, batch: int) -> int:
    """Elements of every array autodiff keeps inside the block stack, as ``print_saved_residuals`` lists them."""
    from jax.ad_checkpoint import print_saved_residuals

    md, execution = model_def_from_config(cfg, 1), Execution.of_model_config(cfg)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), md.shapes())
    listing = io.StringIO()
    with md.scope(execution), contextlib.redirect_stdout(listing):
        print_saved_residuals(lambda p: md.loss(p, jnp.zeros((batch, S + 1), jnp.int32), execution), params)
    return sum(math.prod(int(d) for d in m.group(1).split(",") if d)
               for m in re.finditer(r"^\w+\[([\d,]*)\] .*\(run_blocks\)$", listing.getvalue(), re.MULTILINE))


@pytest.mark.parametrize("cfg", [model(), model(q_lora_rank=None), model(moe=EXPERTS),
                                 model(moe=EXPERTS, layers=2, first_dense=1)],
                         ids=["dense", "dense q_proj", "experts", "dense then experts"])
def test_block_activations_are_what_autodiff_keeps_per_token(cfg):
    """Per token: the difference between two microbatch sizes (what a layer keeps whatever the batch
    falls out); with dense layers first, the layer average of the two kinds."""
    per_token = (saved_elements(cfg, 5) - saved_elements(cfg, 3)) / (2 * S * cfg.layers)
    block = deepseek_counts.block_activations(StepShape.from_config(cfg))
    predicted = layer_activation_bytes(seq_len=S, microbatch=1, hidden=H, heads=HEADS, mlp_dim=MLP, remat="selective",
                                       bytes_per_element=1, block=block) / S
    assert per_token == pytest.approx(predicted, rel=1e-9)


@pytest.mark.parametrize("cfg", [model(moe=moe, mtp=MtpConfig(layers=2)) for moe in (DENSE, EXPERTS)],
                         ids=["dense", "experts"])
def test_the_mtp_modules_parameters_are_the_built_models(cfg):
    shapes = model_def_from_config(cfg, 1).shapes()
    sizes = {n: math.prod(s.shape) for n, s in zip(leaf_names(shapes), jax.tree.leaves(shapes))}
    mtp = sum(v for n, v in sizes.items() if n.startswith("mtp."))
    rest = sum(v for n, v in sizes.items() if not n.startswith("blocks."))
    shape = StepShape.from_config(cfg)
    assert deepseek_counts.mtp_parameters(shape, 1) == mtp > 0
    assert deepseek_counts.other_parameters(shape, padded_vocab_size(cfg.vocab_size, 1), 1) == rest


def test_deepseek_v3s_mtp_module_is_its_published_size():
    """DeepSeek-V3's weight notes: 11.5B unique parameters in its one module (the embedding and head shared)."""
    v3 = ModelConfig(family="deepseek", vocab_size=129280, hidden=7168, heads=128, layers=61, mlp_dim=18432,
                     mla=MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                   v_head_dim=128),
                     moe=MoEConfig(experts=256, top_k=8, mlp_dim=2048, shared_experts=1, router="sigmoid",
                                   selection_bias=True),
                     first_k_dense_replace=3, mtp=MtpConfig(layers=1))
    assert deepseek_counts.mtp_parameters(StepShape.from_config(v3), 1) == 11_610_068_480  # 11.6B
