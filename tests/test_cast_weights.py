"""``parallel.cast_once``: a pipeline stage casts its projection weights to the compute dtype (and joins fused
projections' kernels) once per step, before its tick loop (:mod:`meshtron.models.cast_weights`). The loss and
every gradient are the per-use casts' bit for bit, through a 1F1B pipeline that keeps its residuals (with
gradient-accumulation fusion) and through zb-h1's separate W pass; the stage did prepare the weights (one
entry per projection, in the compute dtype); on a compile-only H100 the tick loop then casts no block
weight; and where the weights cannot be prepared, or a layer runs other projections than it recorded, the
run says so in one line or casts per use."""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import MeshConfig, ModelConfig, load_config
from meshtron.errors import ConfigError
from meshtron.execution import DEFAULT_EXECUTION
from meshtron.mesh import build_mesh
from meshtron.models import cast_weights
from meshtron.testing import Layout, _gradients
from meshtron.trace_context import using
from meshtron.train import pipelined
from meshtron.train.state import model_def_from_config

# CI runs the 1F1B case; zb-h1's W pass, a further consumer of the same entries, is an extended case
CASES = [(Layout(1, 2, 4, "1f1b", recompute=False), True),
         pytest.param(Layout(2, 2, 2, "zb-h1", microbatches=2), False, marks=pytest.mark.extended)]


@pytest.mark.slow
@pytest.mark.parametrize("layout,fusion", CASES, ids=lambda c: str(c))
def test_gradients_equal_casting_per_use(layout, fusion, monkeypatch):
    md = model_def_from_config(ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=2, layers=4,
                                           mlp_dim=128, seq_len=16, dtype="bfloat16"), layout.tensor)
    devices = jax.devices()
    params = jax.device_get(md.init(build_mesh(MeshConfig(1, 1, 1), devices[:1]), 0))
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 17), dtype=np.int32)
    prepared = []

    def recorded(*args):
        entries = cast_weights.cast_weights(*args)
        prepared.append(entries)
        return entries

    monkeypatch.setattr(pipelined, "cast_weights", recorded)
    execution = replace(DEFAULT_EXECUTION, gradient_accumulation_fusion=fusion)
    per_use = _gradients(md, layout, params, tokens, devices, execution)
    assert prepared == []  # off by default: nothing prepared
    once = _gradients(md, layout, params, tokens, devices, replace(execution, cast_once=True))
    # every projection matrix of a block, each once (joined or not), in bf16
    kernels = sum(int(np.prod(a.shape[1:])) for path, a in jax.tree_util.tree_flatten_with_path(params["blocks"])[0]
                  if "kernel" in jax.tree_util.keystr(path))
    assert prepared and all(e is not None and sum(int(np.prod(a.shape)) for a in e) == kernels for e in prepared)
    assert {jnp.dtype(a.dtype) for e in prepared for a in e} == {jnp.dtype(jnp.bfloat16)}
    assert once[0] == per_use[0]
    for a, b in zip(jax.tree.leaves(once[1]), jax.tree.leaves(per_use[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.both_stacks  # cast_weights keeps a pruned jaxpr of the layer: JAX's internals, which move between versions
def test_entries_are_the_cast_weights_in_the_order_they_run():
    w1 = jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7
    w2 = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 3

    def layer(params, x):
        y = x @ cast_weights.prepared(params[0].astype(jnp.bfloat16))
        return y @ cast_weights.prepared(jnp.concatenate([params[1], params[1]], axis=1).astype(jnp.bfloat16))

    x = jnp.ones((5, 2), jnp.bfloat16)
    entries = cast_weights.cast_weights(layer, (w1, w2), x)
    assert [e.shape for e in entries] == [(2, 3), (3, 8)]
    np.testing.assert_array_equal(np.asarray(entries[0]), np.asarray(w1.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(entries[1][:, 4:]), np.asarray(w2.astype(jnp.bfloat16)))

    def prepared_layer(params, x):
        with using(cast_weights=cast_weights.PreparedCasts(entries)):
            return layer(params, x)

    # the same product and, through the entries, the same gradients as casting per use
    assert jnp.array_equal(prepared_layer((w1, w2), x), layer((w1, w2), x))
    grads = jax.grad(lambda p: prepared_layer(p, x).astype(jnp.float32).sum())((w1, w2))
    expected = jax.grad(lambda p: layer(p, x).astype(jnp.float32).sum())((w1, w2))
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_weight_computed_from_activations_is_not_prepared():
    def layer(params, x):
        return x @ cast_weights.prepared((params * x.sum()).astype(jnp.bfloat16))

    assert cast_weights.cast_weights(layer, jnp.ones((2, 2)), jnp.ones((2, 2), jnp.bfloat16)) is None


@pytest.mark.parametrize("nested", ["checkpoint", "cond"])
def test_a_projection_in_a_nested_trace_is_not_prepared(nested):
    def project(p, x):
        return x @ cast_weights.prepared(p.astype(jnp.bfloat16))

    def layer(params, x):
        if nested == "checkpoint":
            return jax.checkpoint(project)(params, x)
        return jax.lax.cond(x.sum() > 0, lambda: project(params, x), lambda: x)

    assert cast_weights.cast_weights(layer, jnp.ones((2, 2)), jnp.ones((2, 2), jnp.bfloat16)) is None


def test_a_layer_running_other_projections_is_one_line():
    casts = cast_weights.PreparedCasts([jnp.zeros((2, 3), jnp.bfloat16)])
    with pytest.raises(ValueError, match="another order than it was prepared in"):
        casts.next(jnp.zeros((3, 2), jnp.bfloat16))
    casts = cast_weights.PreparedCasts([])
    with pytest.raises(ValueError, match="weights cast beforehand for 0 projections; the layer runs more"):
        casts.next(jnp.zeros((3, 2), jnp.bfloat16))


def test_the_setting_is_checked():
    with pytest.raises(ConfigError, match=r"parallel.cast_once .*'maybe' is not a valid bool"):
        load_config("cpu8", ["parallel.cast_once=maybe"])


# a tensor rank's block weights in the small step below: the attention output [4 heads, 64, 512], down
# [512, 512], gate and up joined [512, 2, 512]
_WEIGHT_SHAPES = ("4,64,512]", "512,512]", "512,2,512]")
_PER_USE = re.compile(r'= bf16\[([\d,]*)\][^\n]*op_name="[^"]*pipeline_(?:forward|backward)[^"]*/'
                      r'(?:convert_element_type|stack|concatenate)"')


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("once", [False, True])
def test_h100_tick_loop_casts_no_weight(gpu_target, once):
    """On a compile-only H100 step (1F1B, kept residuals, 2 stages x 2 tensor ranks), the tick loop's forward
    and backward slots cast and join block weights per use; cast once, none of them does (the stage's
    weights are cast before the loop)."""
    from meshtron.train.loop import Trainer

    cfg = load_config("cpu8", ["model.family=llama", "model.hidden=512", "model.heads=8", "model.kv_heads=4",
                               "model.mlp_dim=1024", "model.layers=4", "model.seq_len=256", "model.vocab_size=256",
                               "model.dtype=bfloat16", "model.attention=cudnn", "parallel.data=1", "parallel.pipe=2",
                               "parallel.tensor=2", "parallel.microbatches=4", "train.batch_size=4",
                               "parallel.schedule=1f1b", "parallel.chunks=1", "parallel.recompute=false",
                               f"parallel.cast_once={str(once).lower()}"])
    tr = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    text = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0]).as_text()
    per_use = {shape + "]" for shape in _PER_USE.findall(text)}
    weights = {shape for shape in per_use if shape.endswith(_WEIGHT_SHAPES)}
    assert (not weights) if once else weights, sorted(per_use)
