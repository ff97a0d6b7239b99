"""``meshtron plan`` beyond the paper's GPT with full recomputation: sequence parallelism with selective
recomputation (Korthikanti et al. 2022), the Llama family's shapes (grouped-query attention, SwiGLU, an
untied head) and zero levels -- each new term held to a hand computation, and the ranking moving where
it should.
"""

import dataclasses
import json

import pytest

from meshtron.cli import main
from meshtron.config import ConfigError, load_config
from meshtron.megatron import megatron_flops
from meshtron.plan import (
    Layout,
    ModelShape,
    estimate,
    load_cluster,
    make_plan,
    memory_per_gpu,
    render,
    search,
)
from meshtron.plan.model import (
    FP32_GRADIENTS,
    context_wire_bytes,
    flops_per_iteration,
    layer_activation_bytes,
    layer_matrix_parameters,
    parameter_count,
    stage_parameters_per_gpu,
    transformer_flops,
)
from meshtron.plan.timing import (
    ELEMENTWISE_PASSES,
    layer_gemms,
    layer_memory_seconds,
    optimizer_seconds,
    p2p_seconds,
    tensor_seconds,
)

A100, H100 = load_cluster("a100-80gb"), load_cluster("h100-80gb")
LLAMA2_7B = ModelShape(32, 4096, 32, 4096, 32000, "llama", None, 11008)
LLAMA2_70B = ModelShape(80, 8192, 64, 4096, 32000, "llama", 8, 28672)
GPT_18B = ModelShape(40, 6144, 48, 2048, 51200)
ZERO1, ZERO3 = (dataclasses.replace(FP32_GRADIENTS, zero=z) for z in (1, 3))


def gemm_flops(model, layout):
    return sum(flops for flops, _ in layer_gemms(model, layout))


# ---------------------------------------------------------------------------------------------
# The Llama family's shapes


def test_llama_parameters_are_the_published_counts():
    """Llama-2 7B and 70B as Hugging Face counts them: per layer the attention (70B: 8 key/value heads of
    128), SwiGLU's three matrices and two RMSNorm scales; the embedding and the untied head; a final norm."""
    assert parameter_count(LLAMA2_7B) == 6_738_415_616
    assert parameter_count(LLAMA2_70B) == 68_976_648_192
    assert layer_matrix_parameters(LLAMA2_70B) == 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert LLAMA2_7B.kv_heads == 32 and GPT_18B.kv_heads == 48 and GPT_18B.mlp_dim == 4 * 6144


def test_a_llama_layers_flops_are_two_per_weight_and_token_plus_the_attention():
    """One microbatch (b=1, s=4096) through a Llama-2 7B layer on one GPU, no recomputation: forward
    2·weights·tokens + 4·s²·h, backward twice that."""
    tokens, weights = 4096, 4 * 4096 * 4096 + 3 * 4096 * 11008
    forward = 2 * weights * tokens + 4 * 4096 * 4096 * 4096
    assert forward == 1_932_735_283_200
    assert gemm_flops(LLAMA2_7B, Layout(1, 1, 1, 1, 1, recompute="none")) == 3 * forward
    # 70B with GQA over 8 tensor ranks: the fused QKV GEMM is [h, (64 + 2·8)·128/8] per rank
    qkv_flops, qkv_dim = layer_gemms(LLAMA2_70B, Layout(8, 1, 1, 1, 1, recompute="none"))[0]
    assert qkv_flops == 3 * 2 * 4096 * 8192 * (64 + 16) * 128 / 8 and qkv_dim == 1280
    # 16 ranks do not divide the 8 key/value heads: each rank computes them whole
    qkv_flops, _ = layer_gemms(dataclasses.replace(LLAMA2_70B, heads=64), Layout(16, 1, 1, 1, 1, recompute="none"))[0]
    assert qkv_flops == 3 * 2 * 4096 * 8192 * (64 * 128 / 16 + 2 * 8 * 128)
    B = 512
    assert flops_per_iteration(LLAMA2_7B, B, "none") == 3 * 32 * B * forward + 6 * B * 4096 * 4096 * 32000


def test_the_counted_flops_of_the_gpt_are_eq_3():
    for mode in ("full", "selective", "none"):
        assert transformer_flops(GPT_18B, 1024, mode) == megatron_flops(
            vocab_size=51200, hidden=6144, layers=40, seq_len=2048, global_batch=1024, recompute=mode)


def test_the_untied_head_has_its_own_parameters_on_the_last_stage():
    h, V, layer = 4096, 32000, 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    whole = Layout(1, 1, 8, 1, 64)
    assert stage_parameters_per_gpu(LLAMA2_7B, whole) == 32 * layer + 2 * V * h + h
    assert stage_parameters_per_gpu(LLAMA2_7B, Layout(2, 4, 8, 1, 64)) == 8 * (
        2 * 4096 * 4096 / 2 + 2 * 4096 * 4096 / 2 + 3 * 4096 * 11008 / 2 + 2 * h) + V * h / 2 + h
    assert memory_per_gpu(LLAMA2_7B, whole).weights == 2 * parameter_count(LLAMA2_7B)
    tied = ModelShape(32, 4096, 32, 4096, 32000)  # the GPT of the same size keeps one V·h (and positions)
    assert stage_parameters_per_gpu(LLAMA2_7B, whole) - 32 * layer > stage_parameters_per_gpu(tied, whole) - 32 * (
        12 * h * h + 13 * h)


def test_grouped_query_attention_exchanges_k_over_a_of_the_keys_and_values():
    layout = Layout(8, 1, 1, 1, 8, context=2)
    mha = dataclasses.replace(LLAMA2_70B, kv_heads=64)
    assert context_wire_bytes(LLAMA2_70B, layout) == context_wire_bytes(mha, layout) / 8
    b, s, c = 1, 4096, 2  # (c−1) blocks of keys and values, forward, recomputed forward, backward
    assert context_wire_bytes(LLAMA2_70B, layout) == (c - 1) * 2 * (b * s / c * 8 * 128 / 8 * 2) * 3


def test_a_llama_layers_activations_count_its_own_tensors():
    """Megatron-LM's Llama layer, 16-bit, no dropout: norm inputs and outputs (8·s·b·h), queries and the
    attention output (4sbh/t), keys and values (4·s·b·k·d/t), SwiGLU (6sbf/t), the softmax (2·a·s²·b/t)."""
    s, b, h, f, k, d, a, t = 4096, 1, 8192, 28672, 8, 128, 64, 8
    layout = Layout(t, 1, 1, b, 1, recompute="none")
    expected = s * b * (8 * h + (4 * h + 6 * f) / t + 4 * k * d / t + 2 * a * s / t)
    assert layer_activation_bytes(LLAMA2_70B, layout, "none") == expected
    assert layer_activation_bytes(LLAMA2_70B, layout, "selective") == expected - s * b * 2 * a * s / t
    sp = dataclasses.replace(layout, sequence_parallel=True)
    assert layer_activation_bytes(LLAMA2_70B, sp, "selective") == expected - s * b * (2 * a * s / t + 7 * h)
    assert layer_activation_bytes(LLAMA2_70B, sp, "full") == 2 * s * b * h / t


def test_llama_configs_plan_and_what_the_planner_does_not_price_is_one_line():
    assert ModelShape.from_config(load_config("llama2_70b").model) == LLAMA2_70B
    with pytest.raises(ConfigError, match="model.moe.experts: the planner prices dense models"):
        ModelShape.from_config(load_config("llama2_7b", ["model.moe.experts=8"]).model)
    with pytest.raises(ConfigError, match="model.kv_heads: 5 does not divide model.heads=32"):
        ModelShape(32, 4096, 32, 4096, 32000, "llama", 5)
    with pytest.raises(ConfigError, match="price other shapes as model.family=llama"):
        ModelShape(32, 4096, 32, 4096, 32000, mlp_dim=11008)


# ---------------------------------------------------------------------------------------------
# Sequence parallelism and selective recomputation


def test_selective_recomputation_adds_the_attention_cores_flops_and_nothing_else():
    for model in (GPT_18B, LLAMA2_70B):
        b, s, h, t = 2, model.seq_len, model.hidden, 8
        selective, none = (Layout(t, 1, 1, b, b, recompute=mode) for mode in ("selective", "none"))
        assert gemm_flops(model, selective) - gemm_flops(model, none) == 4 * b * s * s * h / t
        assert flops_per_iteration(model, 64, "selective") - flops_per_iteration(model, 64, "none") == (
            4 * 64 * s * s * h * model.layers)


def test_sequence_parallelism_splits_the_norms_and_keeps_the_tensor_traffic():
    layout = Layout(8, 4, 2, 1, 64, recompute="selective")
    sp = dataclasses.replace(layout, sequence_parallel=True)
    for model in (GPT_18B, LLAMA2_70B):
        assert tensor_seconds(model, sp, A100) == tensor_seconds(model, layout, A100)  # RS + AG = one all-reduce
        residual = model.seq_len * model.hidden * sum(ELEMENTWISE_PASSES["residual"] if model.family == "gpt"
                                                      else (10.0, 12.0))
        saved = residual * (1 - 1 / 8) * 2 / (A100.hbm_gbps * 1e9 * A100.memory_efficiency)
        assert layer_memory_seconds(model, layout, A100) - layer_memory_seconds(model, sp, A100) == pytest.approx(saved)
        assert 0 < p2p_seconds(model, sp, A100) < p2p_seconds(model, layout, A100)  # no all-gather after a receive
    # Korthikanti et al., Table 2: sequence + tensor parallel with selective recomputation, 34·s·b·h/t
    assert layer_activation_bytes(GPT_18B, sp, "selective") == 2048 * 1 * 6144 * 34 / 8
    assert "sequence_parallel splits over the tensor ranks" in Layout(1, 1, 1, 1, 1, sequence_parallel=True).problem(
        GPT_18B)


def test_with_sequence_parallelism_a_70b_layout_recomputes_less():
    """Llama-2 70B on 64 H100s with t=4, p=4 and zero=1: without sequence parallelism only full
    recomputation fits; with it, the norms' activations split by t make room for selective recomputation,
    which spends a fifth as long recomputing and ranks the layout first."""
    plain = search(LLAMA2_70B, 64, 512, H100, gradients=ZERO1, tensor=4, pipe=4).best
    split = search(LLAMA2_70B, 64, 512, H100, gradients=ZERO1, tensor=4, pipe=4, sequence_parallel=True).best
    assert (plain.layout.recompute, split.layout.recompute) == ("full", "selective")
    assert split.recompute_seconds < plain.recompute_seconds / 4 and split.step_seconds < plain.step_seconds
    everything = search(LLAMA2_70B, 64, 512, H100, gradients=ZERO1, sequence_parallel=True).best
    assert everything.layout == split.layout and everything.layout.sequence_parallel
    bare = estimate(LLAMA2_70B, dataclasses.replace(split.layout, recompute="none"), H100, gradients=ZERO1)
    assert bare.recompute_seconds == 0


# ---------------------------------------------------------------------------------------------
# Zero levels


def test_zero_levels_split_the_update_and_price_the_gathers():
    model, layout = LLAMA2_7B, Layout(1, 1, 8, 1, 64)
    assert optimizer_seconds(model, layout, H100, "adamw", zero=1) == pytest.approx(
        optimizer_seconds(model, layout, H100, "adamw") / 8)
    P, m = parameter_count(model), layout.microbatches
    # zero=1: gradients reduce-scattered in fp32, 16-bit weights all-gathered: 7/8 of each
    assert estimate(model, layout, H100, gradients=ZERO1).data_bytes == pytest.approx(7 / 8 * P * (4 + 2))
    # zero=3: per microbatch the weights gathered in the forward and again in the backward (the recomputed
    # forward shares the backward's gather), and the gradients reduce-scattered
    assert estimate(model, layout, H100, gradients=ZERO3).data_bytes == pytest.approx(m * 7 / 8 * P * (4 + 2 + 2))
    memory = memory_per_gpu(model, layout, gradients=ZERO3)
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert memory.weights == pytest.approx(2 * P / 8 + 2 * layer)
    assert memory.optimizer == pytest.approx(12 * P / 8)


# ---------------------------------------------------------------------------------------------
# The report says which model priced each row


def test_every_row_says_what_priced_it(tmp_path, capsys):
    plan = make_plan(LLAMA2_70B, 64, 512, H100, gradients=ZERO1, sequence_parallel=True)
    assert {e.priced_by for e in plan.result.ranked} == {"analytical"}
    saved = plan.to_dict(3)
    assert [row["priced_by"] for row in saved["ranked"]] == ["analytical"] * 3
    assert saved["model"]["kv_heads"] == 8 and saved["ranked"][0]["sequence_parallel"] is True
    text = render(plan, 3)
    assert "priced by" in text and "64 heads (8 kv)" in text and "sequence parallelism on every layout" in text
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", "llama2_70b", "--gpus", "64", "--cluster", "h100-80gb", "--top", "2",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "zero=3" in printed and "sequence parallelism on every layout" in printed  # the config's
    assert json.loads(out.read_text())["ranked"][0]["priced_by"] == "analytical"
