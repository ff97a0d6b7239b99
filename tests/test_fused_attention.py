"""The cuDNN call's wrapper, checked on CPU: :func:`meshtron.models.fused_attention.manual_attention` (a
``shard_map`` manual over the mesh axes still automatic, with its own backward) run with XLA's attention
inside a ``shard_map`` manual over ``data`` only, as the train step is. Its outputs and gradients must
equal plain attention's, for every split of the key/value heads over the ``tensor`` ranks: split like
the query heads, whole with each rank reading one group, and whole with a rank's heads straddling two
groups. cuDNN itself cannot run here; tests/test_gpu_attention.py compiles it for H100s."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from meshtron.models.fused_attention import manual_attention


def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:8])


def loss_and_grads(attention, q, k, v, mesh, mask):
    def loss(q, k, v):
        def per_data(q, k, v, mask):
            out = attention(q, k, v, mask)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32)), keepdims=True)[None, 0]

        batch = PartitionSpec("data")
        parts = jax.shard_map(per_data, mesh=mesh, in_specs=(batch, batch, batch, batch), out_specs=batch,
                              axis_names={"data"})(q, k, v, mask)
        return jnp.sum(parts)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 4), (8, 2), (12, 3)],
                         ids=["mha", "kv-split", "kv-whole-one-group", "kv-whole-straddling"])
def test_manual_attention_equals_plain_attention(heads, kv_heads):
    mesh = mesh_2x4()
    b, s, d = 4, 16, 8
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, heads, d))
    k = jax.random.normal(keys[1], (b, s, kv_heads, d))
    v = jax.random.normal(keys[2], (b, s, kv_heads, d))
    segments = jnp.repeat(jnp.arange(2), s // 2)[None].repeat(b, 0)
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]
    scale = 1.0 / np.sqrt(d)

    def wrapped(q, k, v, mask):
        return manual_attention(q, k, v, scale=scale, implementation="xla", mask=mask, is_causal=True)

    def plain(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale)

    with jax.set_mesh(mesh):
        got_loss, got_grads = loss_and_grads(wrapped, q, k, v, mesh, mask)
        want_loss, want_grads = loss_and_grads(plain, q, k, v, mesh, mask)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_manual_attention_with_a_loop_invariant_mask_in_a_scan():
    """Layers in a ``scan`` read one document mask: JAX's scan hoists what depends on it alone out of the
    loop, partially evaluating the nested ``shard_map``. A checked one names the split-off residuals over
    the surrounding ``data`` too, and the step failed to lower ("operates on axis data which is already
    bound by a parent"); the unchecked wrapper lowers, and equals plain attention."""
    mesh = mesh_2x4()
    b, s, heads, d = 4, 16, 8, 8
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (b, s, heads, d))
    weights = jax.random.normal(keys[1], (3, d, d)) / np.sqrt(d)
    segments = jnp.repeat(jnp.arange(2), s // 2)[None].repeat(b, 0)
    scale = 1.0 / np.sqrt(d)

    def loss_and_grad(attention):
        def loss(weights, x):
            def per_data(weights, x, segments):
                mask = (segments[:, :, None] == segments[:, None, :])[:, None]

                def layer(x, w):
                    return x + attention(x @ w, x, x, mask), None

                y, _ = jax.lax.scan(layer, x, weights)
                return jnp.sum(y * jnp.cos(y), keepdims=True)

            batch = PartitionSpec("data")
            parts = jax.shard_map(per_data, mesh=mesh, in_specs=(PartitionSpec(), batch, batch), out_specs=batch,
                                  axis_names={"data"})(weights, x, segments)
            return jnp.sum(parts)

        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss))(weights, x)

    got_loss, got_grad = loss_and_grad(lambda q, k, v, mask: manual_attention(
        q, k, v, scale=scale, implementation="xla", mask=mask, is_causal=True))
    want_loss, want_grad = loss_and_grad(lambda q, k, v, mask: jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, scale=scale))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want_grad))))


@pytest.mark.parametrize(("heads", "kv_heads", "documents"), [(8, 8, False), (8, 2, True), (4, 1, False)],
                         ids=["kv-split", "kv-whole-documents", "one-kv-head"])
def test_gathered_keys_through_the_manual_wrapper_equal_unsplit_attention(heads, kv_heads, documents, monkeypatch):
    """The gathered context exchange calls cuDNN through the wrapper: this rank's queries against the
    whole sequence's keys (two sequence lengths), under a position mask ``[1, 1, s, S]`` (and a document
    one ``[b, 1, s, S]``). Here the wrapper runs XLA's attention on a context 2 x tensor 4 mesh, manual
    over context as the train step is; outputs and gradients equal unsplit attention's."""
    from meshtron.models import context_attention
    from meshtron.models.attention import causal_attention
    from meshtron.models.context_attention import balanced_order, gathered_kv_attention
    from meshtron.sharding import MEGATRON_RULES, axis_rules, constrain

    shapes = []

    def wrapper(q, k, v, **kwargs):  # what dot_product_attention calls for cuDNN, with XLA's attention
        shapes.append((q.shape[1], k.shape[1], kwargs["mask"].shape))
        return manual_attention(q, k, v, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(context_attention, "dot_product_attention", wrapper)
    b, s, d, ranks = 2, 32, 8, 2
    q, k, v, w = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(2), 4), [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d),
                                                  (b, s, heads, d)]))
    segments = jnp.asarray(np.arange(s) >= (s // 3 if documents else s), jnp.int32)[None].repeat(b, 0)
    order = balanced_order(s, ranks)
    mesh = jax.make_mesh((ranks, 4), ("context", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])

    def attend(q, k, v, segments):
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        return gathered_kv_attention(q, k, v, order, "context", segments=segments if documents else None)

    def loss(q, k, v):  # of the tokens as the ranks hold them (balanced order)
        out = jax.shard_map(attend, mesh=mesh, in_specs=(PartitionSpec(None, "context"),) * 4,
                            out_specs=PartitionSpec(None, "context"), axis_names={"context"})(
            q, k, v, jnp.take(segments, order, axis=1))
        return jnp.sum(out * jnp.take(w, order, axis=1))

    stored = [jnp.take(x, order, axis=1) for x in (q, k, v)]
    with jax.set_mesh(mesh), axis_rules(MEGATRON_RULES):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*stored)
    want, want_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(causal_attention(q, k, v, segments=segments if documents else None) * w),
        argnums=(0, 1, 2))(q, k, v)
    assert shapes[0] == (s // ranks, s, ((b if documents else 1), 1, s // ranks, s))  # local queries, all keys
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(jnp.take(g, np.argsort(order), axis=1), r, rtol=1e-5, atol=1e-5)
