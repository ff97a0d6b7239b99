"""The ring attends block by block through a pair of kernels (:mod:`meshtron.models.attention_blocks`):
cuDNN's on GPUs (:mod:`meshtron.models.cudnn_blocks`), which cannot run here. So a plain-jnp pair written
to cuDNN's conventions (``BTNH`` arrays, log-sum-exp ``[b, heads, t]`` fp32 in natural log, output and
gradients in the inputs' dtype, a mask as an additive large negative bias, the backward from the whole
attention's output and log-sum-exp) stands in for it, called per device as cuDNN's are
(:func:`meshtron.models.fused_attention.manual_blocks`): the ring then equals unsplit attention in values
and gradients, alone and inside the train step. That the compiled step calls cuDNN's kernels is
tests/test_gpu_attention.py's."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from meshtron.errors import ConfigError
from meshtron.execution import DEFAULT_EXECUTION
from meshtron.models import context_attention, cudnn_blocks
from meshtron.models.attention import causal_attention
from meshtron.models.attention_blocks import XLA_KERNELS, BlockKernels, visible
from meshtron.models.context_attention import balanced_order, ring_attention
from meshtron.models.fused_attention import manual_blocks
from meshtron.sharding import MEGATRON_RULES, axis_rules, constrain
from meshtron.testing import Layout, check_parity

pytestmark = pytest.mark.both_stacks

BIG = -2.0 ** 41  # cuDNN's bias for a hidden score (JAX's get_large_negative_number for bf16)


def _reference_scores(q, k, scale, causal, mask):
    """``[b, heads, t, s]`` fp32, key/value heads repeated to the query heads, the mask added as a bias."""
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    shown = visible(causal, mask, q.shape[1], k.shape[1])
    return scores if shown is None else scores + jnp.where(shown, 0.0, BIG)


def reference_forward(q, k, v, *, scale, causal, mask):
    scores = _reference_scores(q, k, scale, causal, mask)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [b, heads, t]
    v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(scores - lse[..., None]), v.astype(jnp.float32))
    return out.astype(q.dtype), lse


def reference_backward(q, k, v, out, lse, d_out, *, scale, causal, mask):
    group = q.shape[2] // k.shape[2]
    p = jnp.exp(_reference_scores(q, k, scale, causal, mask) - lse[..., None])
    d_out, out = d_out.astype(jnp.float32), out.astype(jnp.float32)
    correction = jnp.einsum("bqhd,bqhd->bhq", d_out, out)
    dp = jnp.einsum("bqhd,bkhd->bhqk", d_out, jnp.repeat(v, group, axis=2).astype(jnp.float32))
    ds = p * (dp - correction[..., None])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(k, group, axis=2).astype(jnp.float32)) * scale

    def per_key_head(x):  # [b, s, heads, d] -> [b, s, kv_heads, d]: a key head's query heads summed
        b, s, h, d = x.shape
        return x.reshape(b, s, h // group, group, d).sum(axis=3)

    dk = per_key_head(jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32))) * scale
    dv = per_key_head(jnp.einsum("bhqk,bqhd->bkhd", p, d_out))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


REFERENCE = BlockKernels(reference_forward, reference_backward)


def _inputs(b, s, heads, kv_heads, d, seed=0):
    return (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(seed), 4), [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d),
                                                     (b, s, heads, d)]))


def _documents(b, s, seed=0):
    """Segment ids [b, s]: a few documents of random lengths per row."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 4, size=(b, s)), axis=1), jnp.int32)


@pytest.mark.parametrize("causal, masked", [(True, False), (False, True), (True, True)])
def test_xla_block_kernels_follow_the_reference_conventions(causal, masked):
    # the ring's XLA pair and the cuDNN-convention pair agree block by block, a fully hidden row included
    q, k, v, dout = _inputs(2, 8, 4, 2, 8, seed=3)
    mask = jnp.asarray(np.random.default_rng(0).random((2, 1, 8, 8)) > 0.4) if masked else None
    if masked:
        mask = mask.at[0, 0, 3].set(False)  # a query that sees no key of this block
    kw = {"scale": 0.3, "causal": causal, "mask": mask}
    (out, lse), (ref_out, ref_lse) = XLA_KERNELS.forward(q, k, v, **kw), REFERENCE.forward(q, k, v, **kw)
    shown = np.asarray(jnp.any(visible(causal, mask, 8, 8), axis=-1) & jnp.ones((2, 4, 8), bool))
    np.testing.assert_allclose(np.where(shown, lse, 0), np.where(shown, ref_lse, 0), rtol=1e-6)
    assert np.all(np.asarray(lse)[~shown] < -1e10) and np.all(np.asarray(ref_lse)[~shown] < -1e10)
    rows = np.moveaxis(shown, 1, 2)[..., None]  # [b, t, heads, 1]
    np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, ref_out, 0), rtol=1e-5, atol=1e-6)
    for got, want in zip(XLA_KERNELS.backward(q, k, v, out, lse, dout, **kw),
                         REFERENCE.backward(q, k, v, ref_out, ref_lse, dout, **kw), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks, tensor, heads, kv_heads, balanced, documents", [
    (4, 1, 4, 4, True, False),
    (2, 2, 4, 4, True, True),
    (2, 2, 4, 2, True, False),  # two key/value heads, one per tensor rank
    (2, 2, 4, 1, True, True),  # one key/value head, whole on both tensor ranks
    (4, 2, 4, 2, False, True),  # contiguous slices: every block masked by positions
], ids=["context4", "context2-tensor2-documents", "context2-tensor2-gqa", "context2-tensor2-mqa-documents",
        "context4-tensor2-contiguous-documents"])
def test_the_ring_with_per_device_block_kernels_equals_unsplit_attention(ranks, tensor, heads, kv_heads, balanced,
                                                                         documents):
    b, s, d = 2, 32, 8
    q, k, v, w = _inputs(b, s, heads, kv_heads, d)
    segments = _documents(b, s) if documents else None
    order = balanced_order(s, ranks) if balanced else np.arange(s)
    mesh = jax.make_mesh((ranks, tensor), ("context", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:ranks * tensor])
    kernels = manual_blocks(REFERENCE)

    def attend(q, k, v, seg):
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        return ring_attention(q, k, v, order, "context", segments=seg, kernels=kernels)

    def loss(q, k, v):  # of the tokens as the ranks hold them
        stored = [jnp.take(x, order, axis=1) for x in (q, k, v)]
        seg = None if segments is None else jnp.take(segments, order, axis=1)
        out = jax.shard_map(attend, mesh=mesh, in_specs=(P(None, "context"),) * 4, out_specs=P(None, "context"),
                            axis_names={"context"})(*stored, seg)
        return jnp.sum(out * jnp.take(w, order, axis=1)), out

    with jax.set_mesh(mesh), axis_rules(MEGATRON_RULES):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    want_grads = jax.grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v, segments=segments) * w),
                          argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(jnp.take(out, np.argsort(order), axis=1), causal_attention(q, k, v, segments=segments),
                               rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, documents", [
    # CI: the ring with documents on 4 context ranks; without documents on data x context x tensor, ``extended``
    pytest.param(Layout(2, 1, 2, context=2, context_attention="ring"), False, marks=pytest.mark.extended),
    (Layout(1, 1, 2, context=4, context_attention="ring"), True),
    (Layout(2, 1, 2, context=2, context_attention="ulysses"), True),
    pytest.param(Layout(1, 1, 2, context=4, context_attention="hybrid", ulysses_degree=2), True, marks=pytest.mark.slow),
], ids=["2x1x2x2", "1x1x4x2-documents", "2x1x2x2-ulysses-documents", "1x1x4x2-hybrid-documents"])
def test_cudnn_by_the_ring_keeps_parity_in_the_train_step(layout, documents, monkeypatch):
    """``model.attention=cudnn`` with the ring, its cuDNN kernels replaced by the reference pair (and the
    one-device reference's cuDNN attention by XLA's): the loss and every gradient equal one device's. With
    Ulysses, the whole sequence's attention goes through the same nested map as cuDNN's call; with the
    hybrid, the ring's blocks after the all-to-all."""
    monkeypatch.syspath_prepend("tests/models")
    from families import small

    monkeypatch.setattr(context_attention, "cudnn_kernels", lambda: REFERENCE)
    plain = jax.nn.dot_product_attention

    def xla_instead(*args, implementation=None, **kwargs):
        return plain(*args, implementation="xla" if implementation == "cudnn" else implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_instead)
    [report] = check_parity(small("llama", 32, layout.tensor), [layout], seq_len=32, documents=documents,
                            execution=replace(DEFAULT_EXECUTION, attention="cudnn"))
    assert report.ok and report.loss == pytest.approx(report.reference_loss, rel=1e-6)


def test_the_cudnn_pair_is_there_on_jax_0_12_and_one_line_elsewhere():
    if cudnn_blocks.missing() is None:
        assert jax.__version__.startswith("0.12")
        assert isinstance(cudnn_blocks.cudnn_kernels(), BlockKernels)
    else:
        with pytest.raises(ConfigError, match="install jax 0.12, or set parallel.context_attention=gathered"):
            cudnn_blocks.cudnn_kernels()
