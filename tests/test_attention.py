"""meshtron.models.attention: the shared causal attention equals an explicit softmax reference (values
and gradients, MHA and GQA, fp32 and bf16), scores are fp32 for bf16 inputs, cached decoding
reproduces full-sequence attention position by position, grouped-query attention never repeats the
key/value heads in the compiled program, and head-sharded attention equals the unsharded one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtron.models.attention import KVCache, causal_attention

pytestmark = pytest.mark.both_stacks

HEADS = 8
HEAD_DIM = 16


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """The textbook computation, everything in fp32: repeat each kv head for its group of query heads,
    ``softmax(q k^T / sqrt(d))`` over the keys allowed by ``mask`` [q_len, k_len] (or [b, q_len, k_len]),
    times ``v``. Returns fp32 [b, q_len, heads, d]."""
    q, k, v = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
    mask = mask[None, None] if mask.ndim == 2 else mask[:, None]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision="highest")


def causal_mask(seq: int) -> jax.Array:
    return jnp.tril(jnp.ones((seq, seq), bool))


def qkv(batch: int, seq: int, kv_heads: int, dtype=jnp.float32, seed: int = 0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, seq, HEADS, HEAD_DIM), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, HEAD_DIM), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, HEAD_DIM), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Values and gradients against the reference


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("seq", [1, 7, 32])
def test_fp32_equals_reference(kv_heads, seq):
    q, k, v = qkv(2, seq, kv_heads)
    out = jax.jit(causal_attention)(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal_mask(seq)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("seq", [5, 32])
def test_bf16_close_to_fp32_reference(kv_heads, seq):
    """bf16 in, bf16 out; against the fp32 reference on the same (bf16-rounded) inputs the error is
    that of rounding the probabilities and the output to bf16 (relative 2^-8 each)."""
    q, k, v = qkv(2, seq, kv_heads, jnp.bfloat16)
    out = jax.jit(causal_attention)(q, k, v)
    assert out.dtype == jnp.bfloat16
    expected = reference_attention(q, k, v, causal_mask(seq))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=2e-2)


def test_bf16_scores_are_fp32():
    """Two logits 1 apart near 2048, where bf16's spacing is 16: with fp32 scores the later key gets
    sigmoid(1) = 0.73 of the weight; scores rounded to bf16 would tie (0.5)."""
    q = np.zeros((1, 2, 1, 4), np.float32)
    k = np.zeros((1, 2, 1, 4), np.float32)
    v = np.zeros((1, 2, 1, 4), np.float32)
    q[0, 1, 0, :2] = [64, 1]
    k[0, 0, 0, :2] = [64, -1]  # q.k / sqrt(4) = 2047.5
    k[0, 1, 0, :2] = [64, 1]  # 2048.5
    v[0, 1, 0, 0] = 1.0  # out[position 1, 0] = the weight of key 1
    out = causal_attention(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)))
    weight = float(out[0, 1, 0, 0])
    assert abs(weight - 1 / (1 + np.exp(-1.0))) < 1e-2, weight


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_gradients_equal_reference(kv_heads):
    seq = 9
    q, k, v = qkv(2, seq, kv_heads, seed=1)
    cotangent = jax.random.normal(jax.random.key(2), q.shape)

    def ours(q, k, v):
        return jnp.sum(causal_attention(q, k, v) * cotangent)

    def theirs(q, k, v):
        return jnp.sum(reference_attention(q, k, v, causal_mask(seq)) * cotangent)

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(theirs, argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"d/d{name}")


def test_bad_shapes_are_named():
    q, k, v = qkv(1, 4, 3)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        causal_attention(q, k, v)
    q, k, v = qkv(1, 4, 2)
    with pytest.raises(ValueError, match="needs the queries' positions"):
        causal_attention(q, k, v, cache=KVCache.zeros(1, 8, 2, HEAD_DIM))
    positions = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"cache k .* must be"):
        causal_attention(q, k, v, positions=positions, cache=KVCache.zeros(1, 8, 4, HEAD_DIM))
    with pytest.raises(ValueError, match="do not fit"):
        causal_attention(q, k, v, positions=positions, cache=KVCache.zeros(1, 3, 2, HEAD_DIM))


# ---------------------------------------------------------------------------------------------
# Cached decoding


def positions_for(batch: int, start: int, seq: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + seq, dtype=jnp.int32), (batch, seq))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_cached_decoding_reproduces_full_attention(kv_heads, dtype):
    """Prefill the first ``prompt`` tokens, then one token per step: every position's output equals the
    full-sequence causal attention's, and the cache ends up holding every key and value. The cache is
    longer than the sequence (unwritten zero entries must not be attended to) and pre-filled with
    garbage beyond the prompt to show that stale entries are masked, not merely zero."""
    batch, seq, prompt, max_len = 2, 12, 5, 16
    q, k, v = qkv(batch, seq, kv_heads, dtype, seed=3)
    full = jax.jit(causal_attention)(q, k, v)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2

    garbage = jnp.full((batch, max_len, kv_heads, HEAD_DIM), 1e4, dtype)
    cache = KVCache(garbage, garbage)
    step = jax.jit(lambda q, k, v, positions, cache: causal_attention(q, k, v, positions=positions, cache=cache))

    out, cache = step(q[:, :prompt], k[:, :prompt], v[:, :prompt], positions_for(batch, 0, prompt), cache)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(full[:, :prompt], np.float32),
                               rtol=tol, atol=tol, err_msg="prefill")
    for p in range(prompt, seq):
        sl = slice(p, p + 1)
        out, cache = step(q[:, sl], k[:, sl], v[:, sl], positions_for(batch, p, 1), cache)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(full[:, sl], np.float32),
                                   rtol=tol, atol=tol, err_msg=f"position {p}")
    np.testing.assert_array_equal(cache.k[:, :seq], k)
    np.testing.assert_array_equal(cache.v[:, :seq], v)


def test_kv_cache_is_a_pytree_that_stacks():
    """Models stack one cache per layer ([layers, ...]) and scan over them."""
    one = KVCache.zeros(2, 16, 2, HEAD_DIM, jnp.bfloat16)
    assert one.k.shape == (2, 16, 2, HEAD_DIM) and one.v.dtype == jnp.bfloat16
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (3, *a.shape)), one)
    assert isinstance(stacked, KVCache) and stacked.k.shape == (3, 2, 16, 2, HEAD_DIM)
    assert len(jax.tree.leaves(stacked)) == 2


def test_cached_decoding_in_a_layer_scan():
    """The way models decode: caches stacked [layers, ...], a ``lax.scan`` hands each layer its own."""
    layers, batch, seq, kv_heads, max_len = 3, 2, 6, 2, 8
    q, k, v = qkv(batch, seq, kv_heads, seed=4)
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (layers, *a.shape)),
                          KVCache.zeros(batch, max_len, kv_heads, HEAD_DIM))

    @jax.jit
    def decode(q, k, v, positions, caches):
        def layer(x, cache):
            out, cache = causal_attention(x, k, v, positions=positions, cache=cache)
            return out, cache
        return jax.lax.scan(layer, q, caches)

    out, caches = decode(q, k, v, positions_for(batch, 0, seq), caches)
    expected = q
    for _ in range(layers):
        expected = causal_attention(expected, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert caches.k.shape == (layers, batch, max_len, kv_heads, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Grouped-query attention keeps kv_heads heads: a dataflow check on the compiled HLO


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)=\{?([^}),]*(?:,\s*%[\w.\-]+)*)\}?")


@dataclass
class _Instruction:
    name: str
    elements: int  # of its largest array (a tuple's largest member)
    opcode: str
    operands: list[str]
    parameter: int | None
    called: list[tuple[str, str]] = field(default_factory=list)  # (attribute, computation)


def _split_type(rest: str) -> tuple[str, str]:
    """``'bf16[3,5]{1,0} add(%a, %b), ...'`` -> (type, remainder); tuple types are parenthesised."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    type_, _, remainder = rest.partition(" ")
    return type_, remainder


def _parse_hlo(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                computations[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        type_, rest = _split_type(m.group(2))
        opcode, _, args = rest.partition("(")
        depth, end = 1, 0
        for end, ch in enumerate(args):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        operand_text, attributes = args[:end], args[end + 1:]
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for dims in _ARRAY.findall(type_)]
        called = [(attr, name.strip().lstrip("%")) for attr, names in _CALLED.findall(attributes)
                  for name in names.split(",") if name.strip()]
        computations[current].append(_Instruction(
            name=m.group(1), elements=max(sizes, default=1), opcode=opcode.strip(),
            operands=re.findall(r"%([\w.\-]+)", operand_text),
            parameter=int(operand_text) if opcode.strip() == "parameter" else None, called=called,
        ))
    assert entry, "no ENTRY computation found"
    return computations, entry


def kv_only_arrays(hlo: str, kv_params: set[int], q_params: set[int]) -> list[tuple[str, int]]:
    """Every array of the compiled program (fused computations' insides too) computed from the entry
    parameters in ``kv_params`` and from none in ``q_params``, with its element count.

    Why dataflow and not shapes: a repeated key can appear in any layout -- [b, s, heads, d],
    [b, kv_heads, group, s, d], flattened by a bitcast, inside a fusion -- and in self-attention it
    has exactly q's shape. What cannot change is what it is computed from: the keys (or values) alone,
    with ``heads / kv_heads`` times their elements. A product with q (scores, dq, dk) is excluded.
    """
    computations, entry = _parse_hlo(hlo)
    found: list[tuple[str, int]] = []

    def walk(name: str, parameter_deps: list[frozenset[int]] | frozenset[int]) -> None:
        deps: dict[str, frozenset[int]] = {}
        for ins in computations[name]:
            if ins.parameter is not None:
                d = parameter_deps if isinstance(parameter_deps, frozenset) else parameter_deps[ins.parameter]
            else:
                d = frozenset().union(*(deps.get(o, frozenset()) for o in ins.operands))
            deps[ins.name] = d
            if d & kv_params and not d & q_params:
                found.append((f"{name}/{ins.name} ({ins.opcode})", ins.elements))
            for attr, callee in ins.called:
                if callee not in computations:
                    continue
                operand_deps = [deps.get(o, frozenset()) for o in ins.operands]
                if attr == "calls":  # fusion / call: parameter i is operand i
                    walk(callee, operand_deps)
                elif attr != "to_apply":  # while, conditional...: every parameter sees every operand
                    walk(callee, frozenset().union(*operand_deps))
                # to_apply (reduce, scatter, sort...): scalar combiners, nothing to see

    entry_params = [frozenset({i}) for i in range(64)]
    walk(entry, entry_params)
    return found


def assert_no_repeated_kv(hlo: str, kv_params: set[int], q_params: set[int], kv_elements: int) -> None:
    arrays = kv_only_arrays(hlo, kv_params, q_params)
    assert arrays, "found no array computed from k/v: the HLO text was not understood"
    big = [(name, n) for name, n in arrays if n > kv_elements]
    assert not big, f"arrays computed from k/v alone larger than k/v ({kv_elements} elements): {big}"


def _repeating_attention(q, k, v):
    """A GQA that does repeat k/v: what the HLO check must catch."""
    group = q.shape[2] // k.shape[2]
    return causal_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_does_not_repeat_kv_heads(kv_heads):
    """Forward, backward and a decoding step: nothing computed from k or v alone (not mixed with q)
    has more elements than k or v. Dimensions are all different (batch 3, seq 5, group 8/kv_heads,
    head_dim 16), and the check is shown to fire on an implementation that repeats the heads."""
    batch, seq = 3, 5
    q, k, v = qkv(batch, seq, kv_heads, jnp.bfloat16)
    kv_elements = k.size

    # The backward pass takes the output's cotangent as an argument (parameter 3), as it does inside a
    # model: with a constant cotangent (``out.sum()``) the compiler would fold it, and
    # ``d probs = cotangent v^T`` -- scores-sized, [b, heads, seq, seq] -- would be a function of v alone.
    def vjp(q, k, v, cotangent):
        return jax.vjp(causal_attention, q, k, v)[1](cotangent)

    forward = jax.jit(causal_attention).lower(q, k, v).compile().as_text()
    assert_no_repeated_kv(forward, {1, 2}, {0}, kv_elements)
    backward = jax.jit(vjp).lower(q, k, v, q).compile().as_text()
    assert_no_repeated_kv(backward, {1, 2}, {0, 3}, kv_elements)

    # Decoding: arguments (q, k, v, positions, cache.k, cache.v); the bound is the cache's size.
    max_len = 16
    cache = KVCache.zeros(batch, max_len, kv_heads, HEAD_DIM, jnp.bfloat16)
    step = jax.jit(lambda q, k, v, positions, cache: causal_attention(q, k, v, positions=positions, cache=cache))
    decode = step.lower(q[:, :1], k[:, :1], v[:, :1], positions_for(batch, seq, 1), cache).compile().as_text()
    assert_no_repeated_kv(decode, {1, 2, 4, 5}, {0}, cache.k.size)

    # The check is not vacuous: repeating the heads is caught, in the forward and the backward pass.
    repeated = jax.jit(_repeating_attention).lower(q, k, v).compile().as_text()
    assert any(n > kv_elements for _, n in kv_only_arrays(repeated, {1, 2}, {0}))
    repeated_vjp = jax.jit(lambda q, k, v, ct: jax.vjp(_repeating_attention, q, k, v)[1](ct))
    repeated_grad = repeated_vjp.lower(q, k, v, q).compile().as_text()
    assert any(n > kv_elements for _, n in kv_only_arrays(repeated_grad, {1, 2}, {0, 3}))


# ---------------------------------------------------------------------------------------------
# Heads sharded over a tensor axis


_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_head_sharded_equals_unsharded(mesh_shape, kv_heads):
    """q split over heads on ``tensor`` (and batch over ``data``); k/v split over kv_heads when
    ``tensor`` divides them, else replicated. Same result as on one device, and no communication:
    every device attends with its own heads."""
    tensor = mesh_shape[1]
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(mesh_shape), ("data", "tensor"))
    batch = 2
    q, k, v = qkv(batch, 7, kv_heads, seed=5)
    expected = jax.jit(causal_attention)(q, k, v)

    q_spec = P("data", None, "tensor", None)
    kv_spec = P("data", None, "tensor" if kv_heads % tensor == 0 else None, None)
    shardings = (NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec), NamedSharding(mesh, kv_spec))
    sharded = jax.jit(causal_attention, in_shardings=shardings, out_shardings=NamedSharding(mesh, q_spec))
    out = sharded(*(jax.device_put(a, s) for a, s in zip((q, k, v), shardings, strict=True)))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

    hlo = sharded.lower(q, k, v).compile().as_text()
    assert not [c for c in _COLLECTIVES if c in hlo], "head-sharded attention should need no communication"


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_head_sharded_cached_decoding(kv_heads):
    """Decoding with q over heads and the cache over kv_heads (replicated when tensor does not divide
    them) matches the unsharded full-sequence attention."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    batch, seq, prompt, max_len = 2, 6, 4, 8
    q, k, v = qkv(batch, seq, kv_heads, seed=6)
    full = causal_attention(q, k, v)

    heads_axis = "tensor" if kv_heads % 4 == 0 else None
    q_sharding = NamedSharding(mesh, P("data", None, "tensor", None))
    kv_sharding = NamedSharding(mesh, P("data", None, heads_axis, None))
    cache_sharding = KVCache(kv_sharding, kv_sharding)
    step = jax.jit(
        lambda q, k, v, positions, cache: causal_attention(q, k, v, positions=positions, cache=cache),
        in_shardings=(q_sharding, kv_sharding, kv_sharding, NamedSharding(mesh, P("data", None)), cache_sharding),
        out_shardings=(q_sharding, cache_sharding),
    )
    cache = jax.device_put(KVCache.zeros(batch, max_len, kv_heads, HEAD_DIM), cache_sharding)
    out, cache = step(q[:, :prompt], k[:, :prompt], v[:, :prompt], positions_for(batch, 0, prompt), cache)
    np.testing.assert_allclose(out, full[:, :prompt], rtol=1e-5, atol=1e-5)
    for p in range(prompt, seq):
        out, cache = step(q[:, p:p + 1], k[:, p:p + 1], v[:, p:p + 1], positions_for(batch, p, 1), cache)
        np.testing.assert_allclose(out, full[:, p:p + 1], rtol=1e-5, atol=1e-5, err_msg=f"position {p}")
