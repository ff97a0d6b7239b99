"""The compiled train step communicates exactly as Megatron-LM does (measured from the HLO)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import MeshConfig, ModelConfig, TrainConfig
from meshtron.execution import Execution
from meshtron.hlo.collectives import collectives
from meshtron.megatron import megatron_figures
from meshtron.mesh import build_mesh
from meshtron.optim import build_optimizer, data_parallel_mean
from meshtron.train.state import model_def_from_config
from meshtron.train.step import build_steps

pytestmark = pytest.mark.slow

BATCH, SEQ, HIDDEN, LAYERS = 16, 16, 64, 2
F32 = 4


FAMILIES = {  # Llama: grouped-query attention, 8 query heads sharing 4 key/value heads (split over tensor=4)
    "gpt": {"family": "gpt", "heads": 4},
    "llama": {"family": "llama", "heads": 8, "kv_heads": 4},
}


@functools.cache
def compiled_step(mesh_shape, microbatches, remat, family="gpt"):
    """The collectives of one compiled step and a device's parameter bytes; cached, as several tests read
    the same step."""
    cfg = ModelConfig(hidden=HIDDEN, layers=LAYERS, mlp_dim=128, seq_len=SEQ, remat=remat, **FAMILIES[family])
    mesh = build_mesh(MeshConfig(*mesh_shape), jax.devices()[: int(np.prod(mesh_shape))])
    md = model_def_from_config(cfg, mesh.shape["tensor"])
    steps = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()), microbatches=microbatches,
                        execution=Execution.of_model_config(cfg))
    params = md.init(mesh, 0)
    opt_state = steps.init_opt_state(params)
    tokens = jax.device_put(jnp.zeros((BATCH, SEQ + 1), jnp.int32), steps.batch_sharding)
    local_param_bytes = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params))
    return collectives(steps.lower(params, opt_state, tokens).compile(), mesh), local_param_bytes


@pytest.mark.parametrize("family", FAMILIES)
# CI: 4 microbatches, recomputing or not; one microbatch is ``extended``.
@pytest.mark.parametrize("microbatches, remat", [pytest.param(1, "none", marks=pytest.mark.extended), (4, "none"),
                                                 (4, "full")])
def test_tensor_collectives_match_megatron(microbatches, remat, family):
    data = 2
    colls, _ = compiled_step((data, 1, 4), microbatches, remat, family)
    b = BATCH // (data * microbatches)  # microbatch rows per data shard
    bsh, bs = b * SEQ * HIDDEN * F32, b * SEQ * F32

    assert not [c for c in colls if c.kind != "all-reduce"], "no all-gather of weights or logits, nothing else"
    tensor = [c for c in colls if c.axes == ("tensor",)]
    assert {c.axes for c in colls} <= {("tensor",), ("data",)}

    # XLA's combiner may merge an activation all-reduce with others (several [b, s, h] terms, or one
    # with the gradient norm's scalars) into one: each collective counts its whole [b, s, h] multiples.
    activations = sum(c.count * (c.bytes // bsh) for c in tensor)
    # Per layer and microbatch: 2 forward (attention out-proj, fc2) + 2 backward (before QKV, fc1).
    # With full recomputation the re-run forward needs only the attention all-reduce: the block's
    # final (fc2) all-reduce feeds nothing in the backward pass, so XLA drops it (Megatron re-runs it).
    # (Llama's SwiGLU has two column-parallel inputs, gate and up, whose input gradients XLA sums
    # before the one all-reduce, as Megatron does with its fused gate/up projection.)
    per_layer = 4 + (1 if remat == "full" else 0)
    embedding_and_head = 2  # embedding forward (vocab-parallel lookup) + LM-head input gradient
    assert activations == microbatches * (LAYERS * per_layer + embedding_and_head)

    # The rest: three [b, s] reductions per microbatch in the vocab-parallel cross-entropy (max,
    # target logit, sum-exp) and, once per step, scalar partial sums of the global gradient norm.
    # XLA's combiner may fuse the last loss term with those scalars into one all-reduce, so the
    # terms are counted by bytes: the scalars are fewer than 64 floats, less than one [b, s] term.
    rest = [c for c in tensor if c.bytes % bsh]
    loss_terms, scalars = divmod(sum(c.count * (c.bytes % bsh) for c in rest), bs)
    assert loss_terms == microbatches * 3 and scalars < 64 * F32, rest
    assert all(c.bytes % bs == 0 for c in rest if c.count > 1), "only loss terms repeat per microbatch"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_data_parallel_reduction_happens_once_per_step(microbatches, family):
    colls, local_param_bytes = compiled_step((2, 1, 4), microbatches, "none", family)
    data = [c for c in colls if c.axes == ("data",)]
    assert data and all(c.count == 1 for c in data), "the data reduction must not sit inside the microbatch loop"
    # One gradient all-reduce of this device's parameter shard and nothing else (metrics are
    # returned per data shard and averaged on the host).
    assert sum(c.total_bytes for c in data) == local_param_bytes


def test_megatron_figures_match_the_measured_bytes():
    data, microbatches = 2, 4
    colls, _ = compiled_step((data, 1, 4), microbatches, "none", "gpt")
    fig = megatron_figures(
        vocab_size=256, hidden=HIDDEN, layers=LAYERS, seq_len=SEQ, heads=4, global_batch=BATCH,
        data=data, pipe=1, tensor=4, microbatches=microbatches, remat=False,
    )
    tensor = [c for c in colls if c.axes == ("tensor",) and c.bytes >= fig.microbatch_size * SEQ * F32]
    measured = sum(c.total_bytes for c in tensor)
    assert measured == fig.tensor_layer_bytes + fig.tensor_embedding_bytes + fig.tensor_loss_bytes
