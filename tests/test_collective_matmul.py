"""Collective matmul: the all-gather-matmul and matmul-reduce-scatter rings equal the plain einsum with
its collectives in values and gradients, and a run with ``parallel.collective_matmul`` trains as one
without it while its compiled blocks move the residual stream by collective-permutes only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.models.collective_matmul import (
    allgather_matmul,
    collective_matmul,
    matmul_reduce_scatter,
    sequence_ring,
)
from meshtron.sharding import MEGATRON_RULES, axis_rules, extend_rules

pytestmark = pytest.mark.both_stacks

SEQUENCE_PARALLEL = extend_rules(MEGATRON_RULES, {"residual_seq": "tensor"})


def _mesh(data: int, tensor: int):
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:data * tensor])


def _random(shapes):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _ring_equals_einsum(primitive, spec, operand, w, w_axes, probe, mesh, operand_spec, w_spec):
    """``primitive(spec, operand, w, w_axes)``, its value under ``sum(y * probe)`` and both gradients, equal to
    the plain einsum's, the operands laid out ``operand_spec`` and ``w_spec`` on ``mesh``."""
    def loss(ring):
        def f(a, w):
            y = primitive(spec, a, w, w_axes) if ring else jnp.einsum(spec, a, w)
            assert y is not None
            return jnp.sum(y * probe), y
        return f

    with jax.set_mesh(mesh), axis_rules(SEQUENCE_PARALLEL), collective_matmul():
        a = jax.device_put(operand, NamedSharding(mesh, operand_spec))
        w = jax.device_put(w, NamedSharding(mesh, w_spec))
        (want, y_want), g_want = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1), has_aux=True))(a, w)
        (got, y_got), g_got = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1), has_aux=True))(a, w)
    np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for got_gradient, want_gradient in zip(g_got, g_want):
        np.testing.assert_allclose(got_gradient, want_gradient, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("data, tensor", [(1, 4), (2, 2)])
@pytest.mark.parametrize("spec, w_shape, w_axes", [
    ("bse,ef->bsf", (8, 16), ("embed", "mlp")),
    ("bse,ekgd->bskgd", (8, 4, 3, 2), ("embed", "kv_heads", None, "head_dim")),
])
def test_allgather_matmul_equals_the_einsum_of_the_gathered_input_with_its_gradients(data, tensor, spec, w_shape,
                                                                                     w_axes):
    b, s = 4, 16
    x, w, probe = _random([(b, s, 8), w_shape, (b, s, *w_shape[1:])])
    _ring_equals_einsum(allgather_matmul, spec, x, w, w_axes, probe, _mesh(data, tensor), P("data", "tensor"), P())


@pytest.mark.parametrize("data, tensor", [(1, 4), (2, 2)])
@pytest.mark.parametrize("spec, w_shape, w_axes", [
    ("bsf,fe->bse", (16, 8), ("mlp", "embed")),
    ("bshd,hde->bse", (4, 2, 8), ("heads", "head_dim", "embed")),
])
def test_matmul_reduce_scatter_equals_the_summed_einsum_with_its_gradients(data, tensor, spec, w_shape, w_axes):
    b, s = 4, 16
    h, w, probe = _random([(b, s, *w_shape[:-1]), w_shape, (b, s, 8)])
    _ring_equals_einsum(matmul_reduce_scatter, spec, h, w, w_axes, probe, _mesh(data, tensor),
                        P("data", None, "tensor"), P("tensor"))


def test_no_ring_without_the_switch_a_split_residual_stream_or_a_divisible_sequence():
    mesh = _mesh(1, 4)
    with jax.set_mesh(mesh), axis_rules(SEQUENCE_PARALLEL):
        assert sequence_ring(16) is None  # the switch is off
        with collective_matmul():
            assert sequence_ring(16) == "tensor"
            assert sequence_ring(6) is None
            with axis_rules(MEGATRON_RULES):
                assert sequence_ring(16) is None  # no sequence parallelism


# ---- the switch in a run ------------------------------------------------------------------------------

MODEL = ["model.layers=2", "model.hidden=32", "model.heads=8", "model.mlp_dim=64", "model.seq_len=16",
         "train.batch_size=8", "train.warmup_steps=1", "train.eval_every=1000", "train.eval_batches=1",
         "parallel.sequence_parallel=true", "train.steps=3"]


def _losses(layout: list[str], *overrides: str):
    from meshtron.config import load_config
    from meshtron.train.loop import Trainer

    result = Trainer.from_config(load_config(None, [*MODEL, *layout, *overrides])).run()
    return result.losses, jax.device_get(result.params)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.data=2", "parallel.tensor=4"], marks=pytest.mark.extended),
    ["parallel.data=1", "parallel.pipe=2", "parallel.tensor=4", "parallel.microbatches=2", "model.family=llama",
     "model.kv_heads=4"],
], ids=["2x1x4-gpt", "1x2x4-llama"])
def test_a_run_with_collective_matmul_trains_as_one_without(layout):
    reference, reference_params = _losses(layout)
    losses, params = _losses(layout, "parallel.collective_matmul=true")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, reference_params)


def _per_layer_collectives(family: str, collective: bool):
    """``(kind, bytes) -> executions`` one layer adds to the compiled gradient on a (1, 1, 4) mesh (4
    layers minus 2, halved), and the ring wire bytes it adds."""
    from collections import Counter

    import jax.numpy as jnp

    from meshtron.config import MeshConfig, ModelConfig
    from meshtron.execution import Execution
    from meshtron.hlo.collectives import collectives
    from meshtron.mesh import build_mesh
    from meshtron.train.state import model_def_from_config

    mesh = build_mesh(MeshConfig(1, 1, 4), jax.devices()[:4])
    counts, wire = [], []
    for layers in (2, 4):
        cfg = ModelConfig(family=family, hidden=32, heads=8, mlp_dim=64, seq_len=16, layers=layers,
                          sequence_parallel=True, collective_matmul=collective,
                          **({"kv_heads": 4} if family == "llama" else {}))
        md, execution = model_def_from_config(cfg, 4), Execution.of_model_config(cfg)
        params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), md.shapes(),
                              md.shardings(mesh))
        tokens = jax.ShapeDtypeStruct((4, 17), jnp.int32, sharding=NamedSharding(mesh, P()))
        loss = jax.value_and_grad(lambda p, t, md=md, execution=execution: md.loss(p, t, execution))
        with jax.set_mesh(mesh):
            compiled = jax.jit(md.traced(loss, execution)).lower(params, tokens).compile()
        found = collectives(compiled, mesh)
        counts.append(Counter())
        for c in found:
            counts[-1][(c.kind, c.bytes)] += c.count
        wire.append(sum(c.total_wire_bytes for c in found))
    layer = Counter({key: (counts[1][key] - counts[0][key]) // 2 for key in counts[1] | counts[0]})
    return +layer, (wire[1] - wire[0]) / 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", pytest.param("llama", marks=pytest.mark.first_stack_only)])
def test_the_blocks_move_the_residual_stream_by_collective_permutes_only(family):
    t, activation = 4, 4 * 16 * 32 * 4  # one batch's residual stream [4, 16, 32], fp32
    chunk = activation // t
    rings, ring_wire = _per_layer_collectives(family, True)
    plain, plain_wire = _per_layer_collectives(family, False)
    big = {k: n for k, n in rings.items() if k[1] >= chunk}
    # Per layer: forward, two all-gather-matmuls and two matmul-reduce-scatters of t - 1 steps each;
    # backward, each all-gather-matmul's reduce-scatter ring (its weight gradient reads the input it
    # gathered in the forward) and each matmul-reduce-scatter's all-gather ring: 8 rings of 3 chunks.
    assert big == {("collective-permute", chunk): 8 * (t - 1)}
    # what else runs per layer: the all-reduce of the norms' (and biases') gradients, a few hidden-sized vectors
    assert all(kind == "all-reduce" and nbytes <= 8 * 32 * 4 for kind, nbytes in rings if nbytes < chunk), rings
    # The same bytes over the tensor axis as sequence parallelism's four all-gathers and four reduce-scatters.
    assert plain[("all-gather", activation)] == 4
    assert ring_wire == pytest.approx(plain_wire, rel=0.01)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=4"], ("parallel.collective_matmul: overlaps sequence parallelism's all-gathers and "
                             "reduce-scatters with the projections, and this run has parallel.sequence_parallel=false")),
    (["parallel.sequence_parallel=true", "parallel.tensor=4", "model.fp8=current"],
     "parallel.collective_matmul: multiplies in model.dtype and does not compose with model.fp8=current"),
    (["parallel.sequence_parallel=true", "parallel.tensor=4", "train.lora.rank=4"],
     "parallel.collective_matmul: does not compose with train.lora"),
    (["parallel.sequence_parallel=true", "parallel.tensor=1"], "parallel.collective_matmul: passes sequence chunks"),
])
def test_settings_collective_matmul_cannot_run_with_are_one_line(overrides, message):
    from meshtron.config import ConfigError, load_config
    from meshtron.run import check_features

    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_features(load_config(None, ["parallel.collective_matmul=true", *overrides]))
    with pytest.raises(ConfigError, match="^parallel.collective_matmul .*'maybe' is not a valid bool"):
        load_config(None, ["parallel.collective_matmul=maybe"])


def _tensor_permutes(text: str, sizes: dict[str, int]) -> list[tuple[str, bool]]:
    """The tensor axis's collective-permutes, each with whether it is asynchronous with a GEMM scheduled
    between its start and done."""
    from meshtron.hlo.gemms import GemmFinder, gemms_launched
    from meshtron.hlo.schedule import collective_windows, module_of

    module = module_of(text)
    finder = GemmFinder(module)
    return [(w.start, not w.synchronous and gemms_launched(w.between, module.computations[w.computation], finder) > 0)
            for w in collective_windows(module, sizes)
            if w.collective.axes == ("tensor",) and w.collective.kind == "collective-permute"]


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_the_rings_permutes_run_under_the_gemms_on_h100(gpu_target):
    """Compiled for 8 H100s (data 2 x tensor 4, sequence parallelism): with collective matmul the blocks'
    tensor traffic is collective-permutes (in the forward and the backward layer loops' bodies),
    every one in flight while a GEMM of its ring runs, and the step-time estimate hides more of the tensor
    axis's communication than with sequence parallelism's all-gathers and reduce-scatters (read from the
    schedule, not timed)."""
    from meshtron.config import load_config
    from meshtron.gpu.step_time import estimate_step
    from meshtron.train.loop import Trainer

    model = ["model.hidden=512", "model.heads=8", "model.mlp_dim=2048", "model.seq_len=512", "model.vocab_size=256",
             "model.dtype=bfloat16", "model.layers=2", "model.family=llama", "train.batch_size=4",
             "parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"]
    hidden, under = {}, {}
    for setting in ("false", "true"):
        trainer = Trainer.from_config(load_config(None, [*model, f"parallel.collective_matmul={setting}"]),
                                      target=gpu_target, read_data=False)
        params, opt_state, tokens = trainer.abstract_step_arguments()
        text = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]).as_text()
        sizes = dict(trainer.mesh.shape)
        estimate = estimate_step(text, sizes, gpu_target, tokens_per_step=1, model_flops_per_step=1.0)
        hidden[setting] = estimate.hidden_fraction_by_axes[("tensor",)]
        under[setting] = _tensor_permutes(text, sizes)
    assert under["false"] == []
    assert len(under["true"]) >= 24 and all(overlapped for _, overlapped in under["true"]), under["true"]
    assert hidden["true"] > hidden["false"]


@pytest.mark.slow
@pytest.mark.first_stack_only
def test_a_users_model_without_the_hook_runs_as_it_did_with_the_switch_on():
    import sys
    from pathlib import Path

    from meshtron.execution import Execution
    from meshtron.testing import Layout, check_parity

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    import parallel_lm

    rules = {**parallel_lm.RULES, "residual_seq": "tensor"}
    [report] = check_parity(parallel_lm.factory, [Layout(2, 1, 4)], rules=rules, seq_len=16,
                            execution=Execution(collective_matmul=True))
    assert report.ok


@pytest.mark.slow
@pytest.mark.first_stack_only
@pytest.mark.parametrize("use_cache", [False, True])
def test_a_model_samples_the_same_tokens_with_the_switch_on(use_cache):
    # (the sampler keeps the residual stream whole on every tensor rank: no ring runs, and a saved run's switch
    # changes nothing in what it samples)
    from meshtron.config import MeshConfig, ModelConfig
    from meshtron.execution import Execution
    from meshtron.generate import Sampler
    from meshtron.mesh import build_mesh
    from meshtron.train.state import model_def_from_config

    mesh = build_mesh(MeshConfig(1, 1, 4), jax.devices()[:4])
    md = model_def_from_config(ModelConfig(family="llama", hidden=32, heads=8, kv_heads=4, mlp_dim=64, seq_len=16,
                                           layers=2, sequence_parallel=True), 4)
    params = md.init(mesh, seed=1)
    tokens = [Sampler(md, mesh, chunk=8, context=16, use_cache=use_cache, execution=Execution(collective_matmul=on))
              .sample(params, "collective", max_new_tokens=8, temperature=1.0, seed=3).new_tokens for on in (False, True)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.slow
@pytest.mark.first_stack_only
def test_a_mixture_of_experts_keeps_its_gradients_with_the_switch_on():
    # the attention's projections ring; the experts' MLP runs as it does without the switch
    from meshtron.config import ModelConfig, MoEConfig
    from meshtron.execution import Execution
    from meshtron.testing import Layout, check_parity
    from meshtron.train.state import model_def_from_config

    cfg = ModelConfig(family="llama", hidden=64, heads=8, kv_heads=4, mlp_dim=128, seq_len=32, layers=2,
                      sequence_parallel=True, collective_matmul=True, moe=MoEConfig(experts=4, top_k=2))
    [report] = check_parity(model_def_from_config(cfg, 4), [Layout(2, 1, 4)], seq_len=32,
                            execution=Execution.of_model_config(cfg), grouped_loss=True)
    assert report.ok


@pytest.mark.slow
def test_a_pipelined_step_with_the_rings_orders_every_collective():
    # the rings' collective-permutes run inside the stages' work, in lockstep (meshtron.pipeline.runtime)
    from meshtron.config import load_config
    from meshtron.hlo.order import unordered_collectives
    from meshtron.train.loop import Trainer

    cfg = load_config("llama_cpu8", ["model.hidden=64", "model.mlp_dim=128", "model.seq_len=32", "train.batch_size=8",
                                     "parallel.sequence_parallel=true", "parallel.collective_matmul=true"])
    assert cfg.mesh.pipe > 1 and cfg.mesh.tensor > 1
    trainer = Trainer.from_config(cfg)
    params = trainer.init_params()
    batch = jax.device_put(np.zeros((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32),
                           trainer.steps.batch_sharding)
    compiled = trainer.steps.lower(params, trainer.steps.init_opt_state(params), batch).compile()
    assert "collective-permute" in compiled.as_text()
    assert unordered_collectives(compiled) == []
