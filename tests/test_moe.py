"""Mixture of experts (meshtron.models.moe): the dropless layer equals every expert applied densely,
drops nothing, a capacity drops what an independent count says, the auxiliary losses' gradients are
those of the losses added to the objective, and a Mixtral's loss and gradients on parallel layouts
equal one device's. Expert parallelism: experts and their optimizer state split over data, training
equal to replicated experts under AdamW, LAMB and 1-bit LAMB and at every zero level, checkpoints
restored on any expert split, and the all-to-all bytes of the compiled step equal to their formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtron.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, load_config
from meshtron.mesh import build_mesh
from meshtron.models.auxiliary import collecting_reports
from meshtron.models.contract import lm_loss
from meshtron.models.moe import MoE, MoEDims, route, routing_statistics
from meshtron.models.moe import all_to_all_bytes as moe_all_to_all_bytes
from meshtron.run import check_features
from meshtron.testing import Layout, check_parity
from meshtron.train.state import model_def_from_config

H, E, K, F = 16, 8, 2, 24


def layer(**kw) -> MoE:
    with nnx.use_eager_sharding(False):
        return MoE(MoEDims(hidden=H, experts=kw.pop("experts", E), top_k=kw.pop("top_k", K), mlp_dim=F, **kw),
                   rngs=nnx.Rngs(0))


def dense_reference(moe: MoE, x: np.ndarray, kept: np.ndarray | None = None) -> np.ndarray:
    """Every expert on every token in numpy, each weighted by its routing weight (0 if not chosen or dropped)."""
    tokens = np.asarray(x, np.float64).reshape(-1, H)
    r = route(jnp.asarray(tokens @ np.asarray(moe.router[...], np.float64), jnp.float32), moe.dims.top_k)
    chosen, weights = np.asarray(r.experts), np.asarray(r.weights, np.float64)
    if kept is not None:
        weights = weights * kept.reshape(chosen.shape)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (moe.gate, moe.up, moe.down))
    out = np.zeros_like(tokens)
    for e in range(gate.shape[0]):
        a = tokens @ gate[e]
        hidden = a / (1 + np.exp(-a)) * (tokens @ up[e])
        out += np.sum(np.where(chosen == e, weights, 0.0), axis=1, keepdims=True) * (hidden @ down[e])
    return out.reshape(x.shape)


def test_dropless_equals_every_expert_applied_densely_and_drops_nothing():
    moe = layer()
    x = jax.random.normal(jax.random.key(1), (3, 7, H))
    np.testing.assert_allclose(np.asarray(moe(x)), dense_reference(moe, x), rtol=1e-5, atol=1e-6)
    # Routing everything to one expert (a router that prefers expert 3 by far) still drops nothing.
    moe.router[...] = moe.router[...].at[:, 3].add(50.0)
    out = moe(x)
    np.testing.assert_allclose(np.asarray(out), dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def independent_kept(experts: np.ndarray, n_experts: int, capacity: int) -> np.ndarray:
    """Which assignments an expert of ``capacity`` rows keeps, taking them token by token."""
    taken = np.zeros(n_experts, int)
    kept = np.zeros(experts.size, bool)
    for i, e in enumerate(experts.reshape(-1)):
        kept[i] = taken[e] < capacity
        taken[e] += 1
    return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_capacity_drops_what_an_independent_count_drops(factor):
    moe = layer(capacity_factor=factor)
    moe.router[...] = moe.router[...].at[:, 0].add(0.05)  # a little imbalance, so factor 1 drops some
    x = jax.random.normal(jax.random.key(2), (4, 8, H))
    tokens = x.reshape(-1, H)
    r = route(tokens @ moe.router[...], K)
    capacity = moe.dims.capacity(tokens.shape[0] * K)
    kept = independent_kept(np.asarray(r.experts), E, capacity)
    [stats] = routing_statistics_of_layer(moe, x)
    assert int(stats.dropped) == int((~kept).sum())
    assert np.asarray(stats.load).sum() == tokens.shape[0] * K
    if factor == 0.5:
        assert int(stats.dropped) > 0
    np.testing.assert_allclose(np.asarray(moe(x)), dense_reference(moe, x, kept), rtol=1e-5, atol=1e-6)


def routing_statistics_of_layer(moe: MoE, x: jax.Array):
    with collecting_reports() as found:
        moe(x)
    return found


def mixtral(experts=E, top_k=K, layers=4, **moe) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=2, layers=layers, mlp_dim=128,
                       seq_len=16, moe=MoEConfig(experts=experts, top_k=top_k, mlp_dim=32, **moe))


def test_auxiliary_losses_have_the_gradients_of_the_losses_added_to_the_objective():
    weighted, plain = (model_def_from_config(mixtral(layers=2, aux_loss_weight=a, z_loss_weight=z))
                       for a, z in ((0.3, 0.05), (0.0, 0.0)))
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    params = weighted.init(mesh, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, 17)), jnp.int32)

    def explicit(p):
        model = plain.bind(p)
        stats = routing_statistics(model, tokens[:, :-1])
        return lm_loss(model, tokens) + 0.3 * jnp.sum(stats.aux_loss) + 0.05 * jnp.sum(stats.z_loss)

    got = jax.grad(lambda p: weighted.loss(p, tokens))(params)
    want = jax.grad(explicit)(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    # The router's gradient is where they differ from the language-model loss alone.
    alone = jax.grad(lambda p: plain.loss(p, tokens))(params)
    assert not np.allclose(got["blocks"]["mlp"]["router"], alone["blocks"]["mlp"]["router"], atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.experts=4", "model.moe.top_k=5"], r"^model.moe.top_k: must be between 1 and model.moe.experts=4, got 5"),
    (["model.moe.experts=4", "model.family=gpt", "model.kv_heads=null"],
     r"^model.moe.experts: the gpt family has no mixture of experts; use model.family=llama"),
    (["model.moe.experts=4", "model.moe.capacity_factor=-1"], r"^model.moe.capacity_factor: must be >= 0"),
    (["model.moe.experts=4", "model.moe.mlp_dim=33", "parallel.tensor=2"],
     r"^model.moe.mlp_dim: 33 is not divisible by parallel.tensor=2"),
])
def test_bad_moe_settings_are_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_features(load_config("llama_cpu8", overrides))


_FIRST = pytest.mark.first_stack_only
# zb-h1 at m = p = 2 (m = 2p compiled twice the ticks): B and W still split, stage 1's W deferred past
# its next B; zb-h1's steady state at m = 2p: tests/test_pipeline.py's every-schedule grid.
REQUIRED = [Layout(1, 1, 8), Layout(8, 1, 1), Layout(2, 2, 2, "interleaved", 2), Layout(4, 2, 1, "zb-h1", microbatches=2)]
KEPT = Layout(1, 2, 4, "1f1b", recompute=False)


def _case(layouts, experts, top_k, capacity, *marks):
    name = f"e{experts}k{top_k}" + (f"-capacity{capacity:g}" if capacity else "")
    return pytest.param(layouts, experts, top_k, capacity, marks=marks,
                        id=f"{', '.join(map(str, layouts))} {name}")


# Dropless 8 experts top-2 on every kind of layout (the second stack: 8-way expert parallelism, and
# expert parallelism inside the zero-bubble pipeline), 64 experts top-8 on the three layouts that split
# the experts over data (on 1x1x8, data=1: no expert parallelism, the experts' columns split over tensor
# as for 8 experts there), a capacity with and without a pipeline. Layouts of one model (tensor 1 and 2
# pad the vocabulary alike, to 256, and keep the 2 key/value heads split) share one check_parity call, which
# computes its one-device references once for them all.
# CI keeps the second stack's case (8-way expert parallelism, and inside zero-bubble) and the capacity case
# (2x2x2 interleaved, 4 experts a rank): between them the three layouts of the 64 experts' case, which is
# extended with the single layouts of 8 experts.
_EXTENDED = pytest.mark.extended
CASES = ([_case([REQUIRED[1], REQUIRED[3]], 8, 2, 0.0)]
         + [_case([layout], 8, 2, 0.0, _FIRST, _EXTENDED) for layout in (REQUIRED[0], REQUIRED[2], KEPT)]
         + [_case(REQUIRED[1:], 64, 8, 0.0, _FIRST, _EXTENDED)]
         + [_case(REQUIRED[1:3], 8, 2, 1.0, _FIRST)])


@pytest.mark.slow
@pytest.mark.both_stacks
@pytest.mark.parametrize("layouts, experts, top_k, capacity", CASES)
def test_mixtral_loss_and_gradients_equal_one_device(layouts, experts, top_k, capacity):
    # Experts split over data (8-, 2- and 4-way on the layouts with data > 1), over tensor by columns.
    md = model_def_from_config(mixtral(experts, top_k, aux_loss_weight=0.01, z_loss_weight=0.001,
                                       capacity_factor=capacity), layouts[0].tensor)
    reports = check_parity(md, layouts, grouped_loss=True)
    assert [r.layout for r in reports] == layouts
    for report in reports:
        assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6), str(report.layout)


# ---- expert parallelism in training -------------------------------------------------------------------

MIXTRAL = ["model.family=llama", "model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
           "model.mlp_dim=64", "model.seq_len=16", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=16",
           "model.moe.z_loss_weight=0.001", "train.batch_size=16", "train.warmup_steps=2", "train.eval_every=1000",
           "train.eval_batches=1"]
REPLICATED = "model.rules={experts: null}"


def mixtral_trainer(*overrides):
    from meshtron.train.loop import Trainer

    return Trainer.from_config(load_config(None, [*MIXTRAL, *overrides]))


def test_experts_split_over_data_by_default_and_their_state_with_them():
    trainer = mixtral_trainer("parallel.data=4", "parallel.pipe=1", "parallel.tensor=2")
    spec = trainer.steps.param_shardings["blocks"]["mlp"]["gate"].spec
    assert spec == jax.sharding.PartitionSpec("pipe", "data", None, "tensor")
    assert trainer.steps.param_shardings["blocks"]["mlp"]["router"].spec == jax.sharding.PartitionSpec("pipe", None, None)
    params = trainer.init_params()
    state = trainer.steps.init_opt_state(params)
    moments = [x for x in jax.tree.leaves(state.optimizer) if x.shape == params["blocks"]["mlp"]["gate"].shape]
    assert moments and all(m.sharding.spec == spec for m in moments)
    assert trainer.steps.zero.has_native and not trainer.steps.zero.active


@pytest.mark.slow
# CI keeps 1-bit LAMB (its error-feedback state over what is replicated beside the split experts).
@pytest.mark.parametrize("optimizer", [pytest.param("adamw", marks=pytest.mark.extended, id="adamw"),
                                       pytest.param("lamb", marks=pytest.mark.extended, id="lamb"), "onebit_lamb"])
def test_expert_parallel_training_equals_replicated_experts(optimizer):
    # The same run with every expert on every data rank (their gradients all-reduced) and with the
    # experts split over data (tokens sent to them): 1-bit LAMB in its warmup, where nothing is compressed.
    run = ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "train.steps=3", f"train.optimizer={optimizer}",
           "optim.freeze_step=10"]
    split = mixtral_trainer(*run).run()
    whole = mixtral_trainer(*run, REPLICATED).run()
    np.testing.assert_allclose(split.losses, whole.losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(split.params), jax.device_get(whole.params))


@pytest.mark.slow
def test_expert_parallel_runs_at_every_zero_level_and_restore_on_any_expert_split(tmp_path):
    from meshtron.checkpoint import CheckpointStore

    run = ["model.layers=4", "train.steps=3", "checkpoint.every=3", f"checkpoint.dir={tmp_path / 'ep'}"]
    layout = ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=interleaved", "parallel.chunks=2",
              "parallel.microbatches=4"]
    first = mixtral_trainer(*layout, *run).run()
    for zero in ("parallel.zero=1", "parallel.zero=3"):
        other = mixtral_trainer(*layout, "model.layers=4", "train.steps=3", zero).run()
        np.testing.assert_allclose(other.losses, first.losses, rtol=1e-5, err_msg=zero)
    # 2-way expert split -> 8-way, and -> every expert on one device
    for mesh in (["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1"], ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1"]):
        other = mixtral_trainer(*mesh, *run)
        params, _, position = other.restore(CheckpointStore(tmp_path / "ep", keep=3))
        assert position.step == 3
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(other.canonical_params(params)),
                     jax.device_get(first.params))


# ---- routing in the run's metrics ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.schedule=interleaved", "parallel.chunks=2",
     "parallel.microbatches=4"],
    ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1"],
    ["parallel.data=4", "parallel.pipe=2", "parallel.tensor=1", "parallel.schedule=zb-h1", "parallel.microbatches=2",
     "parallel.layout=[1,3]", "model.moe.capacity_factor=1.0"],
], ids=["2x2x2 interleaved", "8x1x1", "4x2x1 zb-h1 uneven capacity"])
def test_routing_reports_equal_one_devices_over_the_same_groups(layout):
    # Each data shard's microbatch is routed (and load-balanced) on its own: one device with as many
    # microbatches routes the same groups of rows, whatever the pipeline, expert split or layer layout.
    run = ["model.layers=4", "model.moe.aux_loss_weight=0.01", *layout]
    trainer = mixtral_trainer(*run)
    groups = trainer.steps.report_groups
    one = mixtral_trainer(*[o for o in run if not o.startswith("parallel.")],
                          "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", f"parallel.microbatches={groups}")
    assert groups == 8 and one.steps.report_groups == 8
    tokens = np.asarray(trainer.train_stream().next(trainer.steps.batch_sharding))
    [got] = trainer.steps.layer_reports(trainer.init_params(), tokens)
    [want] = one.steps.layer_reports(one.init_params(), tokens)
    np.testing.assert_array_equal(got.load, want.load)
    np.testing.assert_array_equal(got.dropped, want.dropped)
    assert got.load.shape == (4, 8) and got.load.sum() == 4 * tokens[:, :-1].size * 2
    np.testing.assert_allclose(got.aux_loss, want.aux_loss, rtol=1e-5)
    np.testing.assert_allclose(got.z_loss, want.z_loss, rtol=1e-5)
    ranks = trainer.mesh.shape["data"]  # experts split over data: each rank's E/d experts' assignments
    np.testing.assert_array_equal(got.rank_load, got.load.reshape(4, ranks, -1).sum(-1))
    if "capacity" in layout[-1]:
        assert got.dropped.sum() > 0


@pytest.mark.slow
def test_a_run_records_routing_on_logged_steps_and_a_dense_run_does_not(tmp_path):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = {}
    for name, extra in (("moe", []), ("dense", ["model.moe.experts=0"])):
        path = tmp_path / f"{name}.jsonl"
        with open(path, "w") as f:
            mixtral_trainer("parallel.data=2", "parallel.pipe=1", "parallel.tensor=1", "train.steps=2", "train.log_every=1",
                            f"train.tensorboard={tmp_path / name}", *extra).run(metrics_file=f)
        records[name] = [json.loads(line) for line in path.read_text().splitlines()][1:]
    for record in records["moe"]:
        assert record["moe/dropped_fraction"] == 0.0 and record["moe/load_imbalance"] >= 1.0
        assert 0.5 < record["moe/aux_loss"] < 2.0 and record["moe/z_loss"] > 0  # 1 when balanced
        assert record["moe/rank_load/0"] + record["moe/rank_load/1"] == pytest.approx(1.0)
    assert not any(key.startswith("moe/") for record in records["dense"] for key in record)
    # TensorBoard gets them under the same names
    events = EventAccumulator(str(tmp_path / "moe"))
    events.Reload()
    assert [e.value for e in events.Scalars("moe/aux_loss")] == pytest.approx([r["moe/aux_loss"] for r in records["moe"]])
    assert {"moe/z_loss", "moe/rank_load/1"} <= set(events.Tags()["scalars"])


def test_onebit_lamb_compresses_only_what_is_replicated_over_data():
    from meshtron.optim.compression import error_lengths

    trainer = mixtral_trainer("parallel.data=4", "parallel.pipe=1", "parallel.tensor=1", "train.optimizer=onebit_lamb")
    params = trainer.init_params()
    state = trainer.steps.init_opt_state(params).optimizer
    onebit = next(s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "worker_error"))
                  if hasattr(s, "worker_error"))
    experts = sum(params["blocks"]["mlp"][k].size for k in ("gate", "up", "down"))
    replicated = sum(x.size for x in jax.tree.leaves(params)) - experts
    assert onebit.worker_error.shape[-1] == error_lengths([replicated], 4)[0]


def all_to_all_bytes(data: int, tensor: int, microbatches: int, remat: str, capacity: float = 0.0) -> tuple[float, int]:
    """(wire bytes over data per device and step, all-to-alls run) of a Mixtral step, from the compiled program."""
    from meshtron.hlo.collectives import collectives

    trainer = mixtral_trainer(f"parallel.data={data}", "parallel.pipe=1", f"parallel.tensor={tensor}",
                              f"parallel.microbatches={microbatches}", f"model.remat={remat}",
                              f"model.moe.capacity_factor={capacity}")
    params = trainer.init_params()
    batch = trainer.train_stream().next(trainer.steps.batch_sharding)
    compiled = trainer.steps.compile(params, trainer.steps.init_opt_state(params), batch)
    found = [c for c in collectives(compiled, trainer.mesh) if c.kind == "all-to-all"]
    assert all(c.axes == ("data",) for c in found)
    return sum(c.total_wire_bytes for c in found), sum(c.count for c in found)


@pytest.mark.slow
# CI keeps full recomputation on 4x2 with 2 microbatches (the dropless formula, recomputed) and the capacity's.
@pytest.mark.parametrize("data, tensor, microbatches, remat, capacity", [
    pytest.param(8, 1, 1, "none", 0.0, marks=pytest.mark.extended, id="8-1-1-none-0.0"),
    pytest.param(4, 2, 2, "none", 0.0, marks=pytest.mark.extended, id="4-2-2-none-0.0"),
    pytest.param(4, 2, 2, "full", 0.0, id="4-2-2-full-0.0"), pytest.param(4, 1, 2, "none", 1.0, id="4-1-2-none-1.0")])
def test_all_to_all_bytes_per_layer_and_microbatch_are_the_formula(data, tensor, microbatches, remat, capacity):
    # Per layer and microbatch, each device's all-to-alls over data send (n-1)/n of their buffers:
    # dispatch (rows, and their int32 expert ids), combine, and the rows' two transposes backward;
    # full recomputation dispatches and combines again. Dropless, a destination's block is
    # T·min(k, E/n) rows; with a capacity the buffer is E·capacity rows, and carries no ids.
    layers, hidden, experts, k, batch, seq = 2, 32, 8, 2, 16, 16
    tokens = batch // data // microbatches * seq  # T, per microbatch and data rank
    if capacity:
        rows, ids = experts * math.ceil(capacity * tokens * k / experts), 0
    else:
        rows, ids = data * tokens * min(k, experts // data), 1
    forwards = 2 if remat == "full" else 1
    per_layer = (data - 1) / data * ((2 * forwards + 2) * rows * hidden * 4 + ids * forwards * rows * 4)
    sent, count = all_to_all_bytes(data, tensor, microbatches, remat, capacity)
    assert sent == pytest.approx(layers * microbatches * per_layer)
    assert count == layers * microbatches * (2 * forwards + 2 + ids * forwards)
    # What describe prints as the formula is this one.
    dims = MoEDims(hidden=hidden, experts=experts, top_k=k, mlp_dim=16, capacity_factor=capacity)
    assert moe_all_to_all_bytes(dims, tokens, data, forwards) == pytest.approx(per_layer)


@pytest.mark.slow
def test_describe_prints_the_all_to_all_per_layer_and_microbatch_and_the_compiled_step_agrees():
    import io

    from meshtron.describe import describe

    out = io.StringIO()
    describe(load_config("mixtral_cpu8", ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=2",
                                          "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=64",
                                          "model.moe.mlp_dim=16", "model.seq_len=16", "train.batch_size=16"]), out)
    text = out.getvalue()
    dims = MoEDims(hidden=32, experts=8, top_k=2, mlp_dim=16)
    formula = moe_all_to_all_bytes(dims, tokens=16, ranks=8)  # 16 rows / 8 ranks / 2 microbatches x 16 positions
    from meshtron.units import format_bytes

    assert (f"split over data (8 ranks, 1 expert each): all-to-all {format_bytes(formula)} per device, layer and "
            "microbatch of 16 tokens") in text
    assert f"all-to-all over data: {format_bytes(formula)} per layer and microbatch in the compiled step" in text
    assert "by the formula (+0.0%)" in text

