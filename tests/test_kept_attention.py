"""A pipeline that keeps its layers' residuals keeps a fused attention kernel's outputs: the backward reads
them instead of running the attention forward kernel again."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshtron.config import load_config
from meshtron.pipeline import layer_backward, split_backward


class _Primitive:
    def __init__(self, name: str):
        self.name = name


def test_the_policy_keeps_matmuls_and_fused_attention_only():
    """The kept-residuals policy saves dot products and the cuDNN attention forward's outputs, and nothing
    element-wise."""
    policy = layer_backward.kept_residuals_policy
    assert all(policy(_Primitive(name)) for name in layer_backward.FUSED_ATTENTION_PRIMITIVES)
    assert not policy(_Primitive("exp")) and not policy(_Primitive("dot_product_attention_bwd_wrapper"))
    assert policy(jax.lax.dot_general_p, jnp.zeros((2, 3)), jnp.zeros((3, 4)),
                  dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=None)


@pytest.mark.both_stacks  # the varying-manual-axes types are JAX's, and move between versions
def test_a_replayed_cast_to_varying_skips_the_axes_a_value_varies_over():
    """Replaying a pullback, a residual the trace saw invariant over a manual axis may come back from a buffer
    that varies over it: the cast to varying then casts over the other axes only (here none), instead of
    failing."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])

    def body(x):
        varied = split_backward._pvary(x, axes=("d",))  # invariant in: cast
        again = split_backward._pvary(varied, axes=("d",))  # varying already: unchanged
        assert jax.typeof(varied).mat.varying == jax.typeof(again).mat.varying == frozenset({"d"})
        return again * (jax.lax.axis_index("d") + 1)

    x = jax.device_put(jnp.ones(3), NamedSharding(mesh, PartitionSpec()))
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec("d")))(x)
    np.testing.assert_array_equal(np.asarray(out), [1, 1, 1, 2, 2, 2])


_ATTENTION_FORWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmax"[^\n]*op_name="([^"]*)"')


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_h100_backward_runs_no_attention_forward(gpu_target):
    """On a compile-only H100 step (1F1B, kept residuals, data 2 x pipe 2 x tensor 2, cuDNN attention, selective
    recomputation), the cuDNN attention forward runs in the forward slots only: the backward reads its
    output and statistics from the residuals."""
    from meshtron.train.loop import Trainer

    cfg = load_config("cpu8", ["model.family=llama", "model.hidden=512", "model.heads=8", "model.kv_heads=4",
                               "model.mlp_dim=1024", "model.layers=4", "model.seq_len=256", "model.vocab_size=256",
                               "model.dtype=bfloat16", "model.attention=cudnn", "model.remat=selective",
                               "parallel.data=2", "parallel.pipe=2", "parallel.tensor=2", "parallel.microbatches=4",
                               "train.batch_size=8", "parallel.schedule=1f1b", "parallel.chunks=1",
                               "parallel.recompute=false"])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    text = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0]).as_text()
    where = _ATTENTION_FORWARD.findall(text)
    assert where and all("pipeline_backward" not in name for name in where), where
