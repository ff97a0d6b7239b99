"""1-bit LAMB in the trainer: what the compiled warmup and compression steps send over ``data``
(measured from the HLO), the stage switch, and tensor + pipeline parallelism with only ``data``
communicated and every replica of every parameter kept bit-identical."""

import jax
import numpy as np
import pytest

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives
from meshtron.train.loop import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.both_stacks]

FREEZE = 2


def onebit_trainer(*overrides):
    cfg = load_config("mesh_configs/cpu8.yaml", [
        "train.optimizer=onebit_lamb", f"optim.freeze_step={FREEZE}", "train.lr=0.01",
        "train.warmup_steps=0", *overrides,
    ])
    return Trainer.from_config(cfg)


def run_steps(trainer, steps):
    """Train ``steps`` steps by hand; return losses, final params/state and each stage's collectives."""
    params = trainer.init_params()
    opt_state = trainer.steps.init_opt_state(params)
    stream = trainer.train_stream()
    losses, colls = [], {}
    for step in range(steps):
        stage = trainer.optimizer.stage_at(step)
        batch = stream.next(trainer.steps.batch_sharding)
        colls.setdefault(stage, collectives(trainer.steps.compile(params, opt_state, batch, stage), trainer.mesh))
        params, opt_state, metrics = trainer.steps.train(params, opt_state, batch, stage)
        losses.append(metrics.mean()[0])
    return losses, params, opt_state, colls


@pytest.fixture(scope="module")
def data8():
    trainer = onebit_trainer("parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.chunks=1", "parallel.microbatches=4")
    return trainer, run_steps(trainer, FREEZE + 2)


def over_data(colls):
    return [c for c in colls if "data" in c.axes]


def test_compression_sends_32x_less_over_data_with_exactly_the_algorithms_collectives(data8):
    trainer, (losses, _, _, colls) = data8
    warmup, compression = colls["warmup"], colls["compression"]
    # Pure data parallelism: nothing else is communicated at all, and each stage reduces once per
    # step although the step accumulates 4 microbatches.
    assert over_data(warmup) == warmup and over_data(compression) == compression
    assert {(c.kind, c.dtype) for c in warmup} == {("all-reduce", "f32")}
    assert sorted((c.kind, c.dtype) for c in compression) == [
        ("all-gather", "f32"), ("all-gather", "f32"), ("all-gather", "u8"), ("all-to-all", "u8")
    ]
    assert all(c.count == 1 and c.axes == ("data",) for c in warmup + compression)
    params = sum(x.size for x in jax.tree.leaves(trainer.model_def.shapes()))
    assert sum(c.bytes for c in warmup) == 4 * params  # the whole fp32 gradient, once
    sent_warmup = sum(c.total_wire_bytes for c in warmup)
    sent_compression = sum(c.total_wire_bytes for c in compression)
    assert sent_warmup / sent_compression >= 28, (sent_warmup, sent_compression)
    assert trainer.steps.data_bytes("warmup") == sent_warmup
    assert trainer.steps.data_bytes("compression") == sent_compression
    assert all(np.isfinite(losses))


def replicas_agree(tree):
    """Every device's copy of every shard of every leaf is bit-identical to the others'."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        copies = {}
        for shard in leaf.addressable_shards:
            key = str(shard.index)
            data = np.asarray(shard.data)
            if key in copies:
                assert np.array_equal(copies[key], data), f"{jax.tree_util.keystr(path)} differs between replicas"
            copies[key] = data


@pytest.fixture(scope="module")
def mesh222():
    trainer = onebit_trainer("parallel.data=2", "parallel.pipe=2", "parallel.tensor=2")  # interleaved 1F1B, v=2, m=4
    return trainer, run_steps(trainer, FREEZE + 2)


def test_tensor_and_pipeline_parallel_reduce_only_data_and_keep_replicas_identical(data8, mesh222):
    _, (flat_losses, _, _, _) = data8
    _, (losses, params, opt_state, colls) = mesh222
    # Warmup is LAMB on the data-parallel mean gradient: the same numbers on any mesh.
    np.testing.assert_allclose(losses[:FREEZE + 1], flat_losses[:FREEZE + 1], rtol=2e-5)
    compression = over_data(colls["compression"])
    assert sorted((c.kind, c.dtype) for c in compression) == [
        ("all-gather", "f32"), ("all-gather", "f32"), ("all-gather", "u8"), ("all-to-all", "u8")
    ]
    assert all(c.axes == ("data",) and c.count == 1 for c in compression)
    # Each device compresses its own shard: the sign bytes are those of its local parameters
    # (split over pipe and tensor), not of a gathered momentum.
    local = sum(leaf.addressable_shards[0].data.size for leaf in jax.tree.leaves(params))
    signs = sum(c.bytes for c in compression if c.dtype == "u8")
    assert local / 4 <= signs <= local / 4 + 1024, (signs, local)
    # Compression adds no traffic over pipe or tensor beyond per-layer scalars (factor maxima).
    def other_axes(stage):
        return sum(c.total_bytes for c in colls[stage] if "data" not in c.axes)
    assert other_axes("compression") - other_axes("warmup") < 4096
    # Parameters replicated over tensor or pipe (LayerNorms, biases, embeddings) and all
    # optimizer state except the per-device error buffers stay identical on every replica.
    replicas_agree(params)
    replicas_agree(opt_state.optimizer._replace(worker_error=None, server_error=None))
    assert losses[-1] < losses[0] and all(np.isfinite(losses))


@pytest.mark.first_stack_only  # 1-bit LAMB's stages on the second stack: the two tests above
@pytest.mark.extended  # (CI runs them; this one, 2x2x2 again with sequence parallelism, in make test)
def test_sequence_parallelism_changes_neither_the_numbers_nor_what_crosses_data(mesh222):
    # Sequence parallelism lays activations out differently over ``tensor``; the losses and 1-bit
    # LAMB's compressed exchange over ``data`` are the same, warmup and compression alike.
    _, (losses, _, _, colls) = mesh222
    trainer = onebit_trainer("parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.sequence_parallel=true")
    sp_losses, _, sp_opt_state, sp_colls = run_steps(trainer, FREEZE + 2)
    np.testing.assert_allclose(sp_losses, losses, rtol=2e-5)
    # Parameters are not compared elementwise: where the true gradient is zero (the key biases:
    # softmax ignores a shift of every score in a row) it is rounding noise, which sums differently
    # here, and 1-bit compression turns the noise's sign into a full step either way.
    for stage in ("warmup", "compression"):
        assert sorted((c.kind, c.dtype, c.bytes) for c in over_data(sp_colls[stage])) == \
            sorted((c.kind, c.dtype, c.bytes) for c in over_data(colls[stage]))
    replicas_agree(sp_opt_state.optimizer._replace(worker_error=None, server_error=None))
