"""Sequence parallelism and selective recomputation (Korthikanti et al. 2022): what the compiled step
communicates per layer, that losses and gradients do not change on any layout, what autodiff keeps
per layer against the activation-memory model, and clear errors for impossible settings."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.config import ConfigError, MeshConfig, ModelConfig, load_config
from meshtron.execution import Execution
from meshtron.families import FAMILIES
from meshtron.hlo.collectives import collectives, ring_wire_bytes
from meshtron.megatron import (
    layer_activation_bytes,
    megatron_stage_activation_bytes,
    paper_layer_activation_bytes,
    pipeline_activation_bytes,
)
from meshtron.mesh import build_mesh
from meshtron.run import check_features
from meshtron.testing import Layout, check_parity
from meshtron.train.state import model_def_from_config
from meshtron.units import format_bytes

pytestmark = pytest.mark.slow

B, S, H, HEADS, MLP = 4, 32, 64, 8, 256
SHAPES = {"gpt": {}, "llama": {"kv_heads": 4}}
GPT_BLOCK = FAMILIES["gpt"].load_counts().BLOCK


def config(family: str, **overrides) -> ModelConfig:
    return ModelConfig(family=family, hidden=H, heads=HEADS, mlp_dim=MLP, seq_len=S, **SHAPES[family], **overrides)


def compiled_gradient(family: str, tensor: int, layers: int, **overrides):
    """The compiled value-and-gradient of the loss on a (1, 1, tensor) mesh (abstract inputs)."""
    mesh = build_mesh(MeshConfig(1, 1, tensor), jax.devices()[:tensor])
    cfg = config(family, layers=layers, **overrides)
    md, execution = model_def_from_config(cfg, tensor), Execution.of_model_config(cfg)
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), md.shapes(),
                          md.shardings(mesh))
    tokens = jax.ShapeDtypeStruct((B, S + 1), jnp.int32, sharding=NamedSharding(mesh, P()))
    loss = jax.value_and_grad(lambda p, t: md.loss(p, t, execution))
    with jax.set_mesh(mesh):
        return jax.jit(md.traced(loss, execution)).lower(params, tokens).compile(), mesh


def per_layer_collectives(family: str, tensor: int, sequence_parallel: bool) -> tuple[Counter, float]:
    """(kind, bytes) -> executions, and ring wire bytes, added by one layer (4 layers minus 2, halved)."""
    counts, wire = [], []
    for layers in (2, 4):
        exe, mesh = compiled_gradient(family, tensor, layers, sequence_parallel=sequence_parallel)
        colls = collectives(exe, mesh)
        assert all(c.axes == ("tensor",) for c in colls)
        counts.append(Counter({(c.kind, c.bytes): 0 for c in colls}))
        for c in colls:
            counts[-1][(c.kind, c.bytes)] += c.count
        wire.append(sum(c.total_wire_bytes for c in colls))
    layer = Counter({key: (counts[1][key] - counts[0][key]) // 2 for key in counts[1] | counts[0]})
    return +layer, (wire[1] - wire[0]) / 2


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_each_tensor_all_reduce_becomes_a_reduce_scatter_and_an_all_gather_with_the_same_bytes(family):
    t = 4
    activation = B * S * H * 4  # one microbatch's residual stream, fp32
    tp, tp_wire = per_layer_collectives(family, t, False)
    sp, sp_wire = per_layer_collectives(family, t, True)
    # Tensor parallelism: Megatron's four all-reduces per layer (f and g, forward and backward).
    assert tp == Counter({("all-reduce", activation): 4})
    # Sequence parallelism: none of them is left; each is a reduce-scatter to the device's seq/t slice
    # plus an all-gather back (forward after/before each region, backward the conjugates). What else
    # runs per layer is the all-reduce of the norm parameters' gradients (hidden-sized).
    big = {k: n for k, n in sp.items() if k[1] >= activation // t}
    assert big == {("reduce-scatter", activation // t): 4, ("all-gather", activation): 4}
    small = [k for k in sp if k[1] < activation // t]
    assert all(kind == "all-reduce" and nbytes <= 4 * 4 * H for kind, nbytes in small), small
    # Ring wire bytes: reduce-scatter + all-gather = all-reduce exactly; the whole layer within 1%.
    conjugates = sum(ring_wire_bytes(kind, nbytes, t) * n for (kind, nbytes), n in big.items())
    assert conjugates == pytest.approx(4 * ring_wire_bytes("all-reduce", activation, t))
    assert sp_wire == pytest.approx(tp_wire, rel=0.01)


def test_stage_boundaries_send_a_sequence_slice():
    from meshtron.config import TrainConfig
    from meshtron.optim import build_optimizer, data_parallel_mean
    from meshtron.pipeline.execution import PipelinePlan
    from meshtron.pipeline.schedules import compile_program, make_schedule
    from meshtron.train.step import build_steps

    sent = {}
    for sp in (False, True):
        mesh = build_mesh(MeshConfig(1, 2, 2), jax.devices()[:4])
        md = model_def_from_config(config("gpt", layers=4, sequence_parallel=sp), 2)
        steps = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()),
                            microbatches=4, pipeline=PipelinePlan(compile_program(make_schedule("1f1b", 2, 4, 1))))
        params = jax.device_put(jax.device_get(md.init(mesh, 0)), steps.param_shardings)
        batch = jax.device_put(np.zeros((4 * B, S + 1), np.int32), steps.batch_sharding)
        exe = steps.lower(params, steps.init_opt_state(params), batch).compile()
        sent[sp] = {c.bytes for c in collectives(exe, mesh) if c.kind == "collective-permute"}
    assert sent == {False: {B * S * H * 4}, True: {B * S * H * 4 // 2}}


LAYOUTS = [Layout(1, 1, 8), Layout(2, 2, 2, "interleaved", 2), Layout(1, 2, 4, "1f1b")]


# Both families on every layout without recomputation; each recomputation on one family: what it changes
# is where the block's backward starts (the whole block rerun, or attention's shared checkpoints kept), not
# the families' layers (Llama with selective recomputation: the zero-bubble cut below).
# CI: the Llama without and with full recomputation, GPT with selective; GPT without recomputation is ``extended``.
@pytest.mark.parametrize("family, remat", [pytest.param("gpt", "none", marks=pytest.mark.extended), ("llama", "none"),
                                           ("gpt", "selective"), ("llama", "full")])
def test_loss_and_gradients_equal_one_device_on_every_layout(family, remat):
    # The oracle compares each layout with one device, where sequence parallelism has nothing to split.
    cfg = config(family, layers=4, sequence_parallel=True, remat=remat)
    md = model_def_from_config(cfg, 8)
    layouts = LAYOUTS if remat == "none" else LAYOUTS[1:2]  # recomputation: the pipelined layout suffices
    reports = check_parity(md, layouts, seq_len=S, execution=Execution.of_model_config(cfg))
    assert [str(r.layout) for r in reports] == [str(layout) for layout in layouts] and all(r.ok for r in reports)


# Each family cut once, each way of starting B once: GPT's block recomputed from the stage input;
# Llama's (gated MLP, grouped-query attention, more of sequence parallelism's collectives) with selective
# recomputation's checkpoint and from the residuals the forward kept.
# CI: the Llama recomputing (selective) and keeping residuals; GPT recomputing is ``extended``.
@pytest.mark.parametrize("family, remat, recompute", [pytest.param("gpt", "none", True, marks=pytest.mark.extended),
                                                      ("llama", "selective", True),
                                                      ("llama", "none", False)])
def test_zero_bubble_splits_the_backward_of_a_sequence_parallel_model(family, remat, recompute):
    # B and W are cut from the layer's own pullback: the reduce-scatters and all-gathers of sequence
    # parallelism and selective recomputation's checkpoint must land on the right side of the cut,
    # also when B starts from residuals the forward kept (parallel.recompute=false).
    cfg = config(family, layers=4, sequence_parallel=True, remat=remat)
    [report] = check_parity(model_def_from_config(cfg, 4), [Layout(1, 2, 4, "zb-h1", recompute=recompute)], seq_len=S,
                            execution=Execution.of_model_config(cfg))
    assert report.ok


def test_a_users_model_gets_sequence_parallelism_from_the_contract():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    import parallel_lm

    rules = {**parallel_lm.RULES, "residual_seq": "tensor"}  # what parallel.sequence_parallel adds
    reports = check_parity(parallel_lm.factory, [Layout(1, 1, 8), Layout(1, 2, 4, "1f1b")], rules=rules, seq_len=16)
    assert all(r.ok for r in reports)


def saved_per_layer(family: str, remat: str) -> int:
    """Elements autodiff keeps for one block of a one-layer model, as JAX's public
    ``print_saved_residuals`` lists them, counting the arrays at least as large as a key/value-head
    activation (not per-row statistics or norm scales)."""
    import contextlib
    import io
    import math
    import re

    from jax.ad_checkpoint import print_saved_residuals

    cfg = config(family, layers=1, remat=remat)
    md, execution = model_def_from_config(cfg, 1), Execution.of_model_config(cfg)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), md.shapes())
    tokens = jnp.zeros((B, S + 1), jnp.int32)
    listing = io.StringIO()
    with md.scope(execution), contextlib.redirect_stdout(listing):
        print_saved_residuals(lambda p: md.loss(p, tokens, execution), params)
    smallest = B * S * H * SHAPES[family].get("kv_heads", HEADS) // HEADS
    sizes = [math.prod(int(d) for d in m.group(1).split(",") if d)
             for m in re.finditer(r"^\w+\[([\d,]*)\] .*\(run_blocks\)$", listing.getvalue(), re.MULTILINE)]
    assert sizes, listing.getvalue()
    return sum(n for n in sizes if n >= smallest)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("remat", ["none", "selective"])
def test_block_constants_are_what_autodiff_keeps(family, remat):
    predicted = layer_activation_bytes(seq_len=S, microbatch=B, hidden=H, heads=HEADS, mlp_dim=MLP,
                                       kv_heads=SHAPES[family].get("kv_heads"), remat=remat,
                                       bytes_per_element=1, block=FAMILIES[family].load_counts().BLOCK)
    assert saved_per_layer(family, remat) == predicted


# CI: every recomputation level with sequence parallelism, and none without; selective and full without
# it are ``extended``.
@pytest.mark.parametrize("remat, sequence_parallel", [
    (remat, sp) if sp or remat == "none" else pytest.param(remat, sp, marks=pytest.mark.extended, id=f"{remat}-{sp}")
    for remat in ("none", "selective", "full") for sp in (False, True)])
def test_compiled_memory_per_layer_is_the_models(remat, sequence_parallel):
    # What one more layer adds to XLA's temporary memory: the layer's activations, nothing else.
    # Layers far apart, so buffer-assignment noise is small next to full recomputation's small stash.
    t, depths = 4, (2, 18)
    temps = [compiled_gradient("gpt", t, layers, remat=remat, sequence_parallel=sequence_parallel)[0]
             .memory_analysis().temp_size_in_bytes for layers in depths]
    measured = (temps[1] - temps[0]) / (depths[1] - depths[0])
    predicted = layer_activation_bytes(seq_len=S, microbatch=B, hidden=H, heads=HEADS, mlp_dim=MLP,
                                       tensor=t, sequence_parallel=sequence_parallel, remat=remat,
                                       block=GPT_BLOCK)
    assert measured == pytest.approx(predicted, rel=0.05)


def test_paper_formula_gives_the_papers_five_fold_saving():
    # GPT-3 175B, t = 8 (Korthikanti et al. §5): tensor parallelism alone keeps sbh(10 + 24/8 + 5·a·s/(h·8))
    # bytes per layer; sequence parallelism with selective recomputation keeps sbh·34/8 -- about 5x less.
    gpt3 = {"seq_len": 2048, "microbatch": 1, "hidden": 12288, "heads": 96, "tensor": 8}
    sbh = 2048 * 12288
    assert paper_layer_activation_bytes(**gpt3) == pytest.approx(sbh * (10 + 3 + 10))
    saved = paper_layer_activation_bytes(**gpt3, sequence_parallel=True, remat="selective")
    assert saved == pytest.approx(sbh * 34 / 8)
    assert paper_layer_activation_bytes(**{**gpt3, "tensor": 1}) == pytest.approx(sbh * (34 + 5 * 96 * 2048 / 12288))
    assert paper_layer_activation_bytes(**gpt3, remat="full") == 2 * sbh
    assert 5 < paper_layer_activation_bytes(**gpt3) / saved < 6


def test_pipeline_memory_counts_stashed_stage_inputs_and_one_chunk():
    layer = layer_activation_bytes(seq_len=S, microbatch=B, hidden=H, heads=HEADS, tensor=2,
                                   sequence_parallel=True, block=GPT_BLOCK)
    stage_input = S * B * H * 4 / 2
    assert pipeline_activation_bytes(layer_bytes=layer, input_bytes=stage_input, layers_per_chunk=2,
                                     in_flight=3) == 3 * stage_input + 2 * layer
    assert megatron_stage_activation_bytes(layer_bytes=layer, layers_per_stage=4, in_flight=2) == 8 * layer
    with pytest.raises(ValueError, match="remat must be one of none, full, selective"):
        layer_activation_bytes(seq_len=S, microbatch=B, hidden=H, heads=HEADS, remat="some", block=GPT_BLOCK)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.sequence_parallel=true", "parallel.tensor=1", "parallel.data=4"], "needs parallel.tensor > 1"),
        (["parallel.sequence_parallel=true", "model.seq_len=127"], "seq_len=127 must be divisible by parallel.tensor=2"),
        (["parallel.sequence_parallel=yes please"], "not a valid bool"),
    ],
)
def test_impossible_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_features(load_config("mesh_configs/cpu8.yaml", overrides))
    assert str(err.value).startswith("parallel.sequence_parallel") and "\n" not in str(err.value)


def test_a_sequence_parallel_model_definition_on_one_tensor_rank_is_refused():
    with pytest.raises(ConfigError, match=r"^parallel.sequence_parallel: .*tensor=1"):
        model_def_from_config(config("gpt", layers=2, sequence_parallel=True), 1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_sequence_parallel_model_generates_what_it_would_without(use_cache):
    from meshtron.generate import Sampler

    mesh = build_mesh(MeshConfig(1, 1, 4), jax.devices()[:4])
    plain = model_def_from_config(config("llama", layers=2), 4)
    split = model_def_from_config(config("llama", layers=2, sequence_parallel=True), 4)
    params = plain.init(mesh, seed=1)
    tokens = [Sampler(md, mesh, chunk=8, context=S, use_cache=use_cache).sample(
        params, "sequence parallel", max_new_tokens=2 * S, temperature=1.0, seed=3).new_tokens for md in (plain, split)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2 * S


def test_describe_prints_the_activation_model_next_to_compiled_memory(capsys):
    from meshtron.cli import main

    overrides = ["parallel.sequence_parallel=true", "model.remat=selective", "train.batch_size=16"]
    assert main(["describe", "--config", "cpu8", *overrides]) == 0
    out = capsys.readouterr().out
    cfg = load_config("mesh_configs/cpu8.yaml", overrides)
    m, t = cfg.model, cfg.train
    layer = layer_activation_bytes(
        seq_len=m.seq_len, microbatch=t.batch_size // (cfg.mesh.data * t.microbatches), hidden=m.hidden, heads=m.heads,
        mlp_dim=m.mlp_dim, tensor=cfg.mesh.tensor, sequence_parallel=True, remat="selective",
        block=FAMILIES[m.family].load_counts().BLOCK)
    assert f"per layer                {format_bytes(layer)} (remat selective, sequence parallelism" in out
    assert "stashed stage inputs" in out and "modelled (XLA:CPU)" in out
    assert "reduce-scatter      tensor" in out
