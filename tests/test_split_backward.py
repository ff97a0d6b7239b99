"""The split backward (meshtron.pipeline.split_backward): B then W equals the layer's pullback
exactly, W does only weight-gradient work, and parameters are never stored as residuals."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtron.config import MeshConfig, ModelConfig
from meshtron.execution import Execution
from meshtron.mesh import build_mesh
from meshtron.pipeline.split_backward import SplitPullback, residuals
from meshtron.train.pipelined import stage_functions
from meshtron.train.state import model_def_from_config

H, S, B = 32, 16, 4


def one_layer(family, remat="none", mlp_dim=64):
    """(scope, mesh, layer, its parameters, x, dy) for one layer of a small model: ``scope()`` traces it as
    its run would (its rules, and ``remat``)."""
    cfg = ModelConfig(family=family, vocab_size=256, hidden=H, heads=4, layers=2, mlp_dim=mlp_dim, seq_len=S,
                      remat=remat)
    md = model_def_from_config(cfg, tensor=1)
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    params = jax.tree.map(lambda a: a[0], md.init(mesh, seed=0)["blocks"])
    x = jax.random.normal(jax.random.key(1), (B, S, H))
    dy = jax.random.normal(jax.random.key(2), (B, S, H))
    layer = stage_functions(md).layer

    def one_sequence_per_row(p, h):  # the microbatch's tokens (a layer reads their positions)
        return layer(p, h, jnp.zeros((h.shape[0], h.shape[1] + 1), jnp.int32))

    return partial(md.scope, Execution.of_model_config(cfg)), mesh, one_sequence_per_row, params, x, dy


@pytest.mark.parametrize("family, remat", [("gpt", "none"), ("llama", "none"), ("gpt", "selective")])
def test_input_then_weight_gradient_is_the_pullback_exactly(family, remat):
    scope, mesh, layer, params, x, dy = one_layer(family, remat)
    seen = {}

    def both(params, x, dy):
        _, stored, treedef, slots = residuals(layer, params, x)
        flat = jax.tree.leaves(params)
        split = SplitPullback(treedef, slots, stored, flat, dy)
        dx, boundary = split.input_gradient(stored, flat, dy)
        d_params = split.weight_gradient(flat, boundary)
        ref_params, ref_x = jax.vjp(layer, params, x)[1](dy)
        seen.update(params_as_residuals=sum(s is not None for s in slots), n_params=len(flat),
                    boundary=sum(int(np.prod(a.shape)) for a in split.boundary_avals),
                    w_dots=sum(op.primitive.name == "dot_general" for op in split._w_ops),
                    b_dots=sum(op.primitive.name == "dot_general" for op in split._b_ops))
        return dx, d_params, ref_x, jax.tree.leaves(ref_params)

    with jax.set_mesh(mesh), scope():
        dx, d_params, ref_x, ref_params = jax.jit(both)(params, x, dy)
    np.testing.assert_array_equal(dx, ref_x)
    for got, want in zip(d_params, ref_params, strict=True):
        np.testing.assert_array_equal(got, want)
    # Every matrix is read from the parameters, not stored again per microbatch as a residual.
    assert seen["params_as_residuals"] >= 4
    # W multiplies activations by cotangents (one matmul per weight matrix), B the rest of the chain.
    assert seen["w_dots"] >= 4 and seen["b_dots"] > seen["w_dots"]
    assert seen["boundary"] < 20 * B * S * H  # what W keeps: about 16 s·b·h per layer


def test_w_needs_a_boundary_only_for_what_depends_on_weights():
    def layer(p, x):
        return jnp.tanh(x @ p["w"]) + x

    p = {"w": jnp.eye(3) * 0.5}
    x = jnp.arange(6.0).reshape(2, 3) / 6
    y, stored, treedef, slots = residuals(layer, p, x)
    split = SplitPullback(treedef, slots, stored, jax.tree.leaves(p), y)
    dx, boundary = split.input_gradient(stored, jax.tree.leaves(p), jnp.ones_like(y))
    [dw] = split.weight_gradient(jax.tree.leaves(p), boundary)
    ref_p, ref_x = jax.vjp(layer, p, x)[1](jnp.ones_like(y))
    np.testing.assert_array_equal(dx, ref_x)
    np.testing.assert_array_equal(dw, ref_p["w"])
    assert sorted(a.shape for a in split.boundary_avals) == [(2, 3), (2, 3)]  # x and the cotangent at x @ w


@pytest.mark.fusion_emitters  # B and W against autodiff's pullback, bit for bit
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_weight_gradient_reading_the_residuals_keeps_only_cotangents_between_b_and_w(family):
    # A pipeline that keeps residuals (parallel.recompute=false) holds them until W, so W recomputes
    # the activations it multiplies from them: B leaves only what depends on the output gradient.
    scope, mesh, layer, params, x, dy = one_layer(family, mlp_dim=4 * H)
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)  # as the runtime keeps residuals
    sizes = {}

    def both(params, x, dy):
        _, stored, treedef, slots = residuals(layer, params, x)
        flat = jax.tree.leaves(params)
        outs = []
        for reads in (False, True):
            split = SplitPullback(treedef, slots, stored, flat, dy, weight_reads_residuals=reads)
            # What W costs beyond the residuals it keeps: the boundary values without a home there.
            sizes[reads] = sum(int(np.prod(a.shape)) for a, home in zip(split.boundary_avals, split.boundary_homes)
                               if home is None)
            if reads:
                paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
                sizes["early"] = sorted(paths[k] for k in split.early)
            dx, boundary = split.input_gradient(stored, flat, dy)
            outs.append((dx, split.weight_gradient(flat, boundary, stored if reads else None)))
        if reads:
            with pytest.raises(ValueError, match="pass res="):
                split.weight_gradient(flat, boundary)
        ref_params, ref_x = jax.vjp(layer, params, x)[1](dy)
        return outs, ref_x, jax.tree.leaves(ref_params)

    with jax.set_mesh(mesh), scope():
        outs, ref_x, ref_params = jax.jit(both)(params, x, dy)
    for dx, d_params in outs:
        np.testing.assert_array_equal(dx, ref_x)
        for got, want in zip(d_params, ref_params, strict=True):
            np.testing.assert_array_equal(got, want)
    sbh = B * S * H
    # GPT: 26 s·b·h -> 6 (the first MLP matmul's cotangent 4, the projection's and the layer output's 1
    # each; the QKV cotangent lives in the QKV output's place) plus the norms' gradients, which B
    # computes ([h] each, instead of keeping their s·b·h inputs); Llama's gated MLP has two
    # cotangents of width 4h: 10.
    assert sizes[True] <= {"gpt": 6, "llama": 10}[family] * sbh + 4 * H
    assert sizes[True] < 0.4 * sizes[False], sizes
    norms = {"gpt": ["['ln1']['bias']", "['ln1']['scale']", "['ln2']['bias']", "['ln2']['scale']"],
             "llama": ["['attn_norm']['scale']", "['mlp_norm']['scale']"]}[family]
    assert sizes["early"] == norms


@pytest.mark.fusion_emitters  # B and W against autodiff's pullback, bit for bit
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_boundary_values_may_replace_residuals_only_b_reads(family):
    # With the residuals kept until W, B writes a boundary value over a residual of its shape that W
    # does not read (the QKV cotangent over the QKV output, which only the attention backward reads),
    # and W, reading both from the overwritten residuals, still gives the pullback bit for bit.
    scope, mesh, layer, params, x, dy = one_layer(family, mlp_dim=4 * H)
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)
    homed = []

    def both(params, x, dy):
        _, stored, treedef, slots = residuals(layer, params, x)
        flat = jax.tree.leaves(params)
        split = SplitPullback(treedef, slots, stored, flat, dy, weight_reads_residuals=True)
        homes = split.boundary_homes
        freed_at_b = SplitPullback(treedef, slots, stored, flat, dy)  # residuals not kept until W: no homes
        assert freed_at_b.boundary_homes == (None,) * len(freed_at_b.boundary_avals)
        dx, boundary = split.input_gradient(stored, flat, dy)
        overwritten = list(stored)
        for value, home in zip(boundary, homes):
            if home is not None:
                assert overwritten[home] is stored[home]  # each residual hosts one value at most
                overwritten[home] = value
        homed.extend(int(np.prod(v.shape)) for v, home in zip(boundary, homes) if home is not None)
        from_slot = [v if home is None else overwritten[home] for v, home in zip(boundary, homes)]
        ref_params, ref_x = jax.vjp(layer, params, x)[1](dy)
        return dx, split.weight_gradient(flat, from_slot, overwritten), ref_x, jax.tree.leaves(ref_params)

    with jax.set_mesh(mesh), scope():
        dx, d_params, ref_x, ref_params = jax.jit(both)(params, x, dy)
    np.testing.assert_array_equal(dx, ref_x)
    for got, want in zip(d_params, ref_params, strict=True):
        np.testing.assert_array_equal(got, want)
    # The QKV cotangent: 3 of GPT's 9 s·b·h (Llama's 13) cost nothing more -- GPT's joined projection's as
    # one value; on one tensor rank Llama projects q, k and v separately (joining saves no all-reduce there).
    assert homed == {"gpt": [3 * B * S * H], "llama": [B * S * H] * 3}[family]


def test_a_gradient_b_computes_never_takes_a_residuals_place():
    # The scale's gradient needs no matmul, so B computes it ([h], like a norm's); a residual of the
    # same shape that only B reads (cos(s)) must not host it: the caller adds it to the accumulator
    # at B, and a copy in the residual slot would be added again by W.
    def layer(p, x):
        return (x * jnp.sin(p["s"])) @ p["w"]

    p = {"s": jnp.linspace(0.1, 0.9, 3), "w": jnp.arange(9.0).reshape(3, 3) / 9}
    x = jnp.arange(12.0).reshape(4, 3) / 12
    seen = {}

    def both(p, x):  # one compiled program, as the runtime's: B, W and the reference pullback
        y, stored, treedef, slots = residuals(layer, p, x)
        flat = jax.tree.leaves(p)
        split = SplitPullback(treedef, slots, stored, flat, y, weight_reads_residuals=True)
        seen.update(early=split.early, stored=[a.shape for a in stored],
                    homes=[h for h, k in zip(split.boundary_homes, split.boundary_gradients) if k is not None])
        dy = jnp.ones_like(y)
        dx, boundary = split.input_gradient(stored, flat, dy)
        at_b = [v for v, k in zip(boundary, split.boundary_gradients) if k is not None]
        handed = [None if k is not None else v for v, k in zip(boundary, split.boundary_gradients)]
        d_s, d_w = split.weight_gradient(flat, handed, stored)
        seen["d_s_from_w"] = d_s
        ref_p, ref_x = jax.vjp(layer, p, x)[1](dy)
        return dx, at_b, d_w, ref_x, ref_p

    dx, at_b, d_w, ref_x, ref_p = jax.jit(both)(p, x)
    assert seen["early"] == (0,)  # "s" (leaves in key order: s, w)
    assert (3,) in seen["stored"]  # cos(s), read by B only
    assert seen["homes"] == [None]
    assert seen["d_s_from_w"] is None  # B's: not returned by W a second time
    np.testing.assert_array_equal(at_b[0], ref_p["s"])
    np.testing.assert_array_equal(d_w, ref_p["w"])
    np.testing.assert_array_equal(dx, ref_x)


def _dot_contractions(hlo: str) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """(lhs rank, rhs rank, lhs contracting dims, rhs contracting dims) of every dot in an optimized
    HLO module (instruction names are unique in a module, so operand shapes are looked up by name)."""
    shapes = dict(re.findall(r"%([\w.-]+) = \w+\[([\d,]*)\]", hlo))
    dots = re.findall(r"= \w+\[[\d,]*\]\S* dot\(%([\w.-]+), %([\w.-]+)\), "
                      r"lhs_contracting_dims=\{([\d,]*)\}, rhs_contracting_dims=\{([\d,]*)\}", hlo)

    def rank(name):
        return len(shapes[name].split(",")) if shapes[name] else 0

    def dims(text):
        return tuple(int(d) for d in text.split(",") if d)

    return [(rank(lhs), rank(rhs), dims(lc), dims(rc)) for lhs, rhs, lc, rc in dots]


def _relaid_out(hlo: str, shapes: list[tuple[int, ...]]) -> list[str]:
    """The copies and transposes in an optimized HLO module whose result is one of ``shapes`` with its
    dimensions in any order: arrays of those shapes moved to another layout."""
    wanted = {tuple(sorted(s)) for s in shapes}
    found = re.findall(r"= \w+\[([\d,]*)\]\S* (?:copy|transpose)\(", hlo)
    return [dims for dims in found if tuple(sorted(int(d) for d in dims.split(",") if d)) in wanted]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_contiguous_weight_matmuls_reach_the_compiled_program(family):
    # A weight gradient contracts over the tokens, the leading dimensions of both operands. XLA's CPU
    # backend runs such a product in a generic loop instead of its GEMM unless the left operand's
    # contracted dimensions are its last and the right one's its first, and folds a plain transpose
    # back into the product. With contiguous_weight_matmuls (the runtime's choice on CPU) every
    # product W compiles to has that form, and B + W is still the pullback the runtime runs unsplit,
    # bit for bit; against jax.vjp's own pullback only rounding differs.
    scope, mesh, layer, params, x, dy = one_layer(family, mlp_dim=4 * H)
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)  # as the runtime keeps residuals
    flat = jax.tree.leaves(params)

    def split_of(p, contiguous, x=x, dy=dy):
        _, stored, treedef, slots = residuals(layer, p, x)
        return stored, SplitPullback(treedef, slots, stored, jax.tree.leaves(p), dy, weight_reads_residuals=True,
                                     contiguous_weight_matmuls=contiguous)

    def both(params):
        stored, split = split_of(params, True)
        dx, boundary = split.input_gradient(stored, flat, dy)
        d_params = split.weight_gradient(flat, boundary, stored)
        unsplit, unsplit_x = split.pullback(stored, flat, dy)
        ref_params, ref_x = jax.vjp(layer, params, x)[1](dy)
        return dx, d_params, unsplit_x, unsplit, ref_x, jax.tree.leaves(ref_params)

    def weight_gradient_hlo(contiguous, x=x, dy=dy):
        def w(params, boundary, stored):
            return split_of(params, contiguous, x, dy)[1].weight_gradient(jax.tree.leaves(params), boundary, stored)

        def b(params):
            stored, split = split_of(params, contiguous, x, dy)
            return split.input_gradient(stored, jax.tree.leaves(params), dy)[1], stored

        boundary, stored = jax.eval_shape(b, params)  # W compiled alone: its inputs as B leaves them
        return jax.jit(w).lower(params, boundary, stored).compile().as_text()

    with jax.set_mesh(mesh), scope():
        dx, d_params, unsplit_x, unsplit, ref_x, ref_params = jax.jit(both)(params)
        hlo_of_w = weight_gradient_hlo(True)
        few_tokens = weight_gradient_hlo(True, x[:1], dy[:1])
        contiguous, as_traced = _dot_contractions(hlo_of_w), _dot_contractions(weight_gradient_hlo(False))
    np.testing.assert_array_equal(dx, unsplit_x)
    for got, want, ref in zip(d_params, unsplit, ref_params, strict=True):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, ref_x, rtol=1e-5, atol=1e-6)
    assert len(contiguous) >= 4  # QKV, the attention output, the MLP's two (Llama: gate and up in one)
    for lhs_rank, _, lhs_contract, rhs_contract in contiguous:
        assert lhs_contract == tuple(range(lhs_rank - len(lhs_contract), lhs_rank)), contiguous
        assert rhs_contract == tuple(range(len(rhs_contract))), contiguous
    # As traced, XLA keeps some products in the form its GEMM does not take: what the option is for.
    assert any(lc != tuple(range(lr - len(lc), lr)) or rc != tuple(range(len(rc))) for lr, _, lc, rc in as_traced)
    # JAX's pullback computes a weight gradient as (dyᵀ·x)ᵀ, and XLA copies that product to transpose
    # it: weight-sized (16 MB per MLP matrix at width 1024). W computes xᵀ·dy, in the weight's own
    # layout, where that copies fewer elements: with 16 tokens per microbatch (width 32) for every
    # matrix, so W copies no array of a weight's shape; with 64 for all but the MLP's second matrix,
    # whose input is 4x wider than its output gradient -- there the weight-shaped copy is cheaper.
    matrices = [tuple(p.shape) for p in flat if p.ndim >= 2]
    assert not _relaid_out(few_tokens, matrices), _relaid_out(few_tokens, matrices)
    kept = _relaid_out(hlo_of_w, matrices)
    assert kept and {tuple(sorted(int(d) for d in dims.split(","))) for dims in kept} == {(H, 4 * H)}, kept


def test_a_jitted_helper_called_twice_in_the_pullback_is_split_as_two_calls():
    # jnp.take normalises its indices in a jitted helper; JAX traces that helper's body once for both
    # calls below, so the flattened pullback must give each inlined copy its own variables.
    def layer(w, x):
        y = x @ w
        return jnp.take(y, jnp.argsort(y[:, 0]), axis=0) * 2.0 + jnp.take(y, jnp.argsort(y[:, 1]), axis=0)

    w = jax.random.normal(jax.random.key(0), (8, 8))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    dy = jax.random.normal(jax.random.key(2), (16, 8))
    ref_w, ref_x = jax.vjp(layer, w, x)[1](dy)
    _, stored, treedef, slots = residuals(layer, w, x)
    for keep in (False, True):
        split = SplitPullback(treedef, slots, stored, [w], dy, weight_reads_residuals=keep,
                              contiguous_weight_matmuls=True)
        [d_w], d_x = split.pullback(stored, [w], dy)
        np.testing.assert_allclose(np.asarray(d_w), np.asarray(ref_w), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(d_x), np.asarray(ref_x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep"])
def test_zb_h1_b_to_w_buffers_hold_only_the_projections_cotangents(family, keep):
    # W reads the layers' residuals however they reach it -- kept until W (parallel.recompute=false), or
    # recomputed in W from the stashed stage input, which the program keeps until W -- so B's buffer holds
    # only what depends on the output gradient: each weight-bearing projection's output cotangent, as
    # the step-memory model counts them (Llama 8h per token per layer here, 13h when B kept each
    # projection's input too). Kept residuals also host the QKV cotangent (only B reads the QKV output).
    from meshtron.families import FAMILIES
    from meshtron.pipeline.layer_backward import LayerBackward
    from meshtron.pipeline.schedules import check, compile_program, make_schedule
    from meshtron.plan.step_memory import StepShape

    cfg = ModelConfig(family=family, vocab_size=256, hidden=H, heads=4, kv_heads=2 if family == "llama" else None,
                      layers=2, mlp_dim=2 * H, seq_len=S)
    md = model_def_from_config(cfg, tensor=1)
    mesh = build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    program = compile_program(make_schedule("zb-h1", 2, 4), keep_residuals=keep)
    # Recomputing, a stage input lives from its arrival until its W: p slots, what the table keeps until
    # W, and as many as the B-to-W buffers.
    if not keep:
        assert program.stash_slots == max(check(program.schedule).peak_until_weight) == program.weight_slots == 2
    found = []

    def buffers(blocks):
        lb = LayerBackward(program, stage_functions(md), blocks, jnp.zeros((B, S, H)),
                           jnp.zeros((B, S + 1), jnp.int32), lambda x: x,
                           lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree))
        found.extend(a.shape for a in lb.buffers(program.weight_slots))
        return 0

    blocks = jax.tree.map(lambda a: a[None], md.init(mesh, seed=0)["blocks"])  # [chunk, layer, ...]
    with jax.set_mesh(mesh), md.scope(Execution.of_model_config(cfg)):
        jax.eval_shape(buffers, blocks)
    assert all(shape[:2] == (2, 2) for shape in found)  # [slot, layer, ...]
    per_token = sum(int(np.prod(shape[2:])) for shape in found) / (B * S)
    cotangents = FAMILIES[family].load_counts().weight_boundary(StepShape.from_config(cfg), 1)
    qkv = {"gpt": 3 * H, "llama": (4 + 2 * 2) * (H // 4)}[family]
    assert per_token == cotangents - (qkv if keep else 0)
    assert cotangents == {"gpt": 2 * H + 3 * H + 2 * H, "llama": 2 * H + 2 * H + 4 * H}[family]
