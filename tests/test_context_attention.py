"""Causal attention over a sequence split across devices: the load-balanced layout gives every rank
the same attention work, and the all-gathered-keys attention equals unsplit attention in values and
gradients, with grouped-query heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from meshtron.hlo.collectives import collectives
from meshtron.models.attention import causal_attention
from meshtron.models.context_attention import (
    balanced_order,
    context_exchange,
    exchange_bytes,
    gathered_kv_attention,
    ring_attention,
    sequence_order,
    split_attention,
)
from meshtron.sharding import MEGATRON_RULES, axis_rules, constrain, extend_rules

pytestmark = pytest.mark.both_stacks


def test_balanced_order_gives_each_rank_a_front_and_a_mirrored_back_chunk_and_equal_causal_work():
    order = balanced_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # a query at position p attends to p + 1 keys: every rank's sum is the same
    work = (order + 1).reshape(4, -1).sum(axis=1)
    assert len(set(work.tolist())) == 1
    contiguous = (np.arange(16) + 1).reshape(4, -1).sum(axis=1)
    assert contiguous.max() / contiguous.mean() > 1.7  # without balancing: 58 against the mean 34
    with pytest.raises(ValueError, match="seq_len=12 must be divisible by 2 x ranks = 8"):
        balanced_order(12, 4)


@pytest.mark.parametrize("exchange", ["gathered", "ring"])
# (4, 4, 4, balanced) runs on the first stack: the second has 4 ranks (contiguous) and a balanced ring of 8.
@pytest.mark.parametrize("ranks, heads, kv_heads, balanced", [
    pytest.param(4, 4, 4, True, marks=pytest.mark.first_stack_only), (8, 8, 2, True), (2, 6, 3, True),
    (4, 8, 2, False)])
def test_split_attention_equals_unsplit_attention_with_its_gradients(exchange, ranks, heads, kv_heads, balanced):
    # (the ring computes only the visible half of other ranks' blocks under the balanced layout; any
    # other layout, here contiguous slices, goes through the masked blocks)
    b, s, d = 2, 32, 8
    q, k, v, w = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(0), 4), [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d),
                                                  (b, s, heads, d)]))
    order = balanced_order(s, ranks) if balanced else np.arange(s)
    attention = gathered_kv_attention if exchange == "gathered" else ring_attention
    mesh = jax.make_mesh((ranks,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ranks])

    def split(q, k, v):
        inputs = [jnp.take(x, order, axis=1) for x in (q, k, v)]
        out = jax.shard_map(
            lambda q, k, v: attention(q, k, v, order, "context"), mesh=mesh,
            in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"),
        )(*inputs)
        return jnp.take(out, np.argsort(order), axis=1)  # back to sequence order

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    with jax.set_mesh(mesh):
        out = jax.jit(split)(q, k, v)
        got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, causal_attention(q, k, v), rtol=1e-5, atol=1e-6)
    want = jax.grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def compiled_gradient(attention, ranks: int, local: int, heads: int = 4, kv_heads: int = 4, d: int = 32):
    """The compiled gradient of split attention over ``ranks`` x ``local`` tokens, and its mesh."""
    seq = ranks * local
    mesh = jax.make_mesh((ranks,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ranks])
    order = balanced_order(seq, ranks)

    def loss(q, k, v):
        return jnp.sum(jax.shard_map(
            lambda q, k, v: attention(q, k, v, order, "context"), mesh=mesh,
            in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"))(q, k, v))

    q = jax.ShapeDtypeStruct((1, seq, heads, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, d), jnp.float32)
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile(), mesh


def compiled_temp_bytes(attention, ranks: int, local: int) -> int:
    """Temporary bytes per device of the gradient of split attention over ``ranks`` x ``local`` tokens."""
    return compiled_gradient(attention, ranks, local)[0].memory_analysis().temp_size_in_bytes


def test_the_ring_holds_the_same_memory_whatever_the_ring_size_and_gathering_grows_with_it():
    # The same 256 tokens per rank on 2 and on 8 ranks: the ring's forward and backward hold two key/value
    # blocks and one block's scores at a time; all-gathered keys hold the whole sequence and its scores.
    ring = [compiled_temp_bytes(ring_attention, ranks, 256) for ranks in (2, 8)]
    gathered = [compiled_temp_bytes(gathered_kv_attention, ranks, 256) for ranks in (2, 8)]
    assert ring[1] <= 1.05 * ring[0]  # (XLA schedules the 8-rank ring a few percent tighter)
    assert gathered[1] > 3 * gathered[0] and ring[1] < gathered[1] / 3


@pytest.mark.parametrize("exchange, attention", [("gathered", gathered_kv_attention), ("ring", ring_attention)])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_bytes_over_the_sequence_axis_are_the_formula(exchange, attention, ranks):
    # one attention layer's forward and backward, grouped-query heads (4 query heads over 2 key/value heads)
    compiled, mesh = compiled_gradient(attention, ranks, local=64, heads=4, kv_heads=2, d=16)
    sent = sum(c.total_wire_bytes for c in collectives(compiled, mesh) if c.axes == ("context",))
    formula = sum(exchange_bytes(exchange, ranks, tokens=64, kv_heads=2, head_dim=16))
    if exchange == "ring" and ranks == 2:
        # A ring of 2 runs one step each way: XLA drops both one-trip loops, and the backward's first move (the
        # rank's own keys and values to the other) is the forward's, computed once -- one key/value block pair
        # less than the formula wherever a layer's forward (or its recomputation) and backward are one program
        formula -= 2 * 64 * 2 * 16 * 4
    assert sent == pytest.approx(formula)
    with pytest.raises(ValueError, match="exchange: must be one of gathered, ring, ulysses, hybrid, got 'a2a'"):
        exchange_bytes("a2a", ranks, 64, 2, 16)



@pytest.mark.parametrize("kv_heads, pinned", [(1, False), (2, True)])
def test_gathered_keys_keep_the_heads_each_tensor_rank_holds(kv_heads, pinned):
    # Query heads split over two tensor ranks, key/value heads whole on both: one head that the rules'
    # kv_heads would split unevenly (left unpinned by the model), or two under a name of the model's own
    # kept whole (pinned). Values and gradients equal unsplit attention, and every device gathers all
    # the heads it holds: the bytes over context are the formula's for the whole head count.
    b, s, heads, d, ranks = 1, 32, 4, 8, 2
    q, k, v, w = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(1), 4), [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d),
                                                  (b, s, heads, d)]))
    order = balanced_order(s, ranks)
    mesh = jax.make_mesh((ranks, 2), ("context", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:2 * ranks])
    kv_axes = ("batch", "seq", "kv_pair", "head_dim")

    def attend(q, k, v):
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        if pinned:
            k, v = constrain(k, kv_axes), constrain(v, kv_axes)
        return gathered_kv_attention(q, k, v, order, "context")

    def loss(q, k, v):  # of the tokens as the ranks hold them (balanced order)
        out = jax.shard_map(attend, mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"),
                            axis_names={"context"})(q, k, v)
        return jnp.sum(out * jnp.take(w, order, axis=1))

    stored = [jnp.take(x, order, axis=1) for x in (q, k, v)]
    with jax.set_mesh(mesh), axis_rules(extend_rules(MEGATRON_RULES, {"kv_pair": None})):
        gradient = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        sent = sum(c.total_wire_bytes for c in collectives(gradient.lower(*stored).compile(), mesh)
                   if c.axes == ("context",) and c.kind != "all-reduce")  # (not the loss's sum)
        value, grads = gradient(*stored)
    want, want_grads = jax.value_and_grad(lambda q, k, v: jnp.sum(causal_attention(q, k, v) * w),
                                          argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(jnp.take(g, np.argsort(order), axis=1), r, rtol=1e-5, atol=1e-5)
    assert sent == pytest.approx(sum(exchange_bytes("gathered", ranks, tokens=b * s // ranks, kv_heads=kv_heads,
                                                    head_dim=d)))


def test_the_all_to_all_exchanges_store_the_sequence_in_the_order_their_groups_attend_it():
    # Ulysses joins every rank: the sequence in order. The hybrid of 2 rings x 2: ranks 0, 1 hold ring rank 0's
    # balanced part (chunks 0 and 3 of 4), one contiguous half each; ranks 2, 3 ring rank 1's.
    assert sequence_order(16, 4, 4).tolist() == list(range(16))
    assert sequence_order(16, 4, 2).reshape(4, 4).tolist() == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7],
                                                                [8, 9, 10, 11]]
    assert sequence_order(16, 4).tolist() == balanced_order(16, 4).tolist()
    with pytest.raises(ValueError, match="ulysses=3 must divide ranks=4"):
        sequence_order(16, 4, 3)


def split_by(exchange: str, ranks: int, ulysses: int, mesh, segments: bool):
    """Attention of a whole sequence split over ``ranks`` context ranks by ``exchange``, back in sequence order."""
    order = sequence_order(32, ranks, ranks if exchange == "ulysses" else ulysses)

    def split(q, k, v, seg):
        inputs = [jnp.take(x, order, axis=1) for x in (q, k, v, seg)]
        with context_exchange(exchange, ulysses):
            out = jax.shard_map(lambda q, k, v, s: split_attention(q, k, v, segments=s if segments else None),
                                mesh=mesh, in_specs=(P(None, "context"),) * 4, out_specs=P(None, "context"))(*inputs)
        return jnp.take(out, np.argsort(order), axis=1)

    return split


@pytest.mark.parametrize("exchange, ranks, ulysses, heads, kv_heads, segments", [
    ("ulysses", 4, 4, 8, 2, True),  # key/value heads fewer than the ranks: repeated
    pytest.param("ulysses", 8, 8, 8, 8, False, marks=pytest.mark.slow),
    pytest.param("ulysses", 4, 4, 12, 3, False, marks=pytest.mark.slow),  # 3 heads repeated to lcm(3, 4) = 12
    ("hybrid", 8, 2, 8, 2, True),
    pytest.param("hybrid", 8, 4, 8, 8, False, marks=pytest.mark.slow),
])
def test_ulysses_and_hybrid_equal_unsplit_attention_with_its_gradients(exchange, ranks, ulysses, heads, kv_heads,
                                                                       segments):
    b, s, d = 2, 32, 8
    q, k, v, w = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(0), 4), [(b, s, heads, d), (b, s, kv_heads, d), (b, s, kv_heads, d),
                                                  (b, s, heads, d)]))
    documents = jnp.asarray([[0] * 10 + [1] * 22, [0] * 3 + [1] * 20 + [2] * 9], jnp.int32)
    mesh = jax.make_mesh((ranks,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ranks])
    split = split_by(exchange, ranks, ulysses, mesh, segments)

    def whole(q, k, v, seg):
        return causal_attention(q, k, v, segments=seg if segments else None)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, documents) * w)

    with jax.set_mesh(mesh), axis_rules(MEGATRON_RULES):
        out = jax.jit(split)(q, k, v, documents)
        got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, whole(q, k, v, documents), rtol=1e-5, atol=1e-6)
    want = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exchange, ranks, ulysses, kv_heads", [
    ("ulysses", 4, 4, 2), ("hybrid", 8, 2, 4), pytest.param("ulysses", 4, 4, 4, marks=pytest.mark.slow)])
def test_bytes_of_the_all_to_all_exchanges_are_the_formula(exchange, ranks, ulysses, kv_heads):
    # one attention layer's forward and backward: the all-to-alls (and, hybrid, the ring's permutes) over context
    heads, local, d = 8, 64, 16
    mesh = jax.make_mesh((ranks,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ranks])

    def split(q, k, v):  # the tokens as the ranks hold them
        with context_exchange(exchange, ulysses):
            return jax.shard_map(lambda q, k, v: split_attention(q, k, v), mesh=mesh,
                                 in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"))(q, k, v)

    q = jax.ShapeDtypeStruct((1, ranks * local, heads, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, ranks * local, kv_heads, d), jnp.float32)
    with jax.set_mesh(mesh), axis_rules(MEGATRON_RULES):
        # (the loss kept, and weighted: the gradient of a plain sum is a constant, whose all-to-all XLA folds away)
        loss = jax.value_and_grad(lambda q, k, v, w: jnp.sum(split(q, k, v) * w), argnums=(0, 1, 2))
        compiled = jax.jit(loss).lower(q, kv, kv, q).compile()
    exchanged = [c for c in collectives(compiled, mesh) if c.axes == ("context",) and c.kind != "all-reduce"]
    sent = sum(c.total_wire_bytes for c in exchanged)  # (the all-reduce: the loss's sum)
    kinds = {c.kind for c in exchanged}
    assert "all-to-all" in kinds and ("collective-permute" in kinds) == (exchange == "hybrid"), kinds
    want = sum(exchange_bytes(exchange, ranks, tokens=local, kv_heads=kv_heads, head_dim=d, heads=heads,
                              ulysses_degree=ulysses))
    assert sent == pytest.approx(want, rel=0.01)
