"""FP8 weights quantized once, whatever recomputes the layer: under zero=3 a projection quantizes its weight's
share and gathers the float8 bytes (kept through recomputation, gathered again in the backward), with the
same numbers as quantizing the gathered weight. The compiled programs say so: which loop quantizes a weight,
and the dtype each layer weight crosses ``data`` in."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives
from meshtron.hlo.text import call_edges, leaves, parse_hlo_module
from meshtron.models.fp8 import joined_weight, projection_einsum
from meshtron.trace_context import GatheredShard, using

# A tiny model whose layer weights and activations differ in size, so a value's element count says which it is.
# 2 layers, hidden 64, 4 heads of 16, MLP 224; tensor 2, data 4, 2 rows of 20 tokens per data rank.
MODEL = ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.mlp_dim=224", "model.seq_len=20",
         "model.vocab_size=256", "model.layers=2", "model.dtype=bfloat16", "parallel.data=4", "parallel.pipe=1",
         "parallel.tensor=2", "parallel.microbatches=1", "train.batch_size=8", "train.eval_every=1000",
         "train.eval_batches=1"]
# Each layer weight's elements on one tensor rank (whole, as gathered over data), and its share (a quarter).
LAYER_WEIGHTS = {
    "gpt": {64 * 3 * 2 * 16, 2 * 16 * 64, 64 * 112, 112 * 64},  # qkv, out, fc1, fc2
    "llama": {64 * 2 * 16, 64 * 1 * 16, 2 * 16 * 64, 64 * 112, 112 * 64},  # wq, wk/wv, wo, gate/up, down
}
JOINED = {"gpt": set(), "llama": {64 * 1 * 4 * 16, 64 * 2 * 112}}  # Llama's fused q/k/v and gate/up kernels


def _trainer(family: str, fp8: str, remat: str, zero: int, steps: int = 2):
    from meshtron.train.loop import Trainer

    cfg = load_config("cpu8", [*MODEL, f"model.family={family}", f"model.fp8={fp8}", f"model.remat={remat}",
                               f"parallel.zero={zero}", f"train.steps={steps}"])
    return Trainer.from_config(cfg)


def _compiled(trainer):
    params, opt_state, tokens = trainer.abstract_step_arguments()
    return trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])


def weight_quantizations_by_loop(text: str, sizes: set[int]) -> list[list[int]]:
    """For every ``while`` loop of the program (the layer scans: forward, backward), the element counts of
    the values of ``sizes`` elements it (or anything it calls) casts to e4m3, sorted."""
    module = parse_hlo_module(text)

    def reached(name: str) -> set[str]:
        seen, stack = {name}, [name]
        while stack:
            for instruction in module.computations[stack.pop()].instructions:
                for edge in call_edges(instruction):
                    if edge.callee in module.computations and edge.callee not in seen:
                        seen.add(edge.callee)
                        stack.append(edge.callee)
        return seen

    loops = []
    for computation in module.computations.values():
        for loop in (i for i in computation.instructions if i.opcode == "while"):
            body = re.search(r"body=%?([\w.\-]+)", loop.attributes).group(1)
            loops.append(sorted(
                leaves(i.shape)[0].elements for c in reached(body) for i in module.computations[c].instructions
                if i.opcode == "convert" and str(leaves(i.shape)[0].dtype) == "f8e4m3fn"
                and leaves(i.shape)[0].elements in sizes))
    return loops


@pytest.mark.slow
@pytest.mark.parametrize("family, remat", [("gpt", "full"), ("llama", "none")])  # each family, each kind of backward
def test_zero3_gathers_float8_shares_and_no_backward_quantizes_a_weight_again(family, remat):
    """zero=3 with each layer gathered as it runs: every layer weight crosses ``data`` as one byte per element
    (not bf16's two), the forward layer loop quantizes shares (a quarter of a weight) and never a gathered
    weight, and the backward loop -- which gathers the layer again -- quantizes none."""
    trainer = _trainer(family, "current", remat, 3)
    compiled = _compiled(trainer)
    whole = LAYER_WEIGHTS[family] | JOINED[family]
    shares = {n // 4 for n in LAYER_WEIGHTS[family]}
    gathers = [c for c in collectives(compiled, trainer.mesh) if c.kind == "all-gather" and c.axes == ("data",)]
    layer = [c for c in gathers if c.bytes in whole or c.bytes // 2 in whole or c.bytes // 4 in whole]
    assert {c.dtype for c in layer} == {"u8"} and {c.bytes for c in layer} == set(LAYER_WEIGHTS[family])
    loops = [q for q in weight_quantizations_by_loop(compiled.as_text(), whole | shares) if q]
    assert len(loops) == 1, loops  # the forward layer scan's; the backward scan's quantizes nothing
    assert set(loops[0]) == shares


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["current", pytest.param("delayed", marks=pytest.mark.extended)])
def test_zero3_trains_as_zero1_with_fp8_weights_gathered_as_shares(fp8):
    """The same model and batches at zero=1 (weights quantized whole) and zero=3 (shares quantized, their
    bytes gathered): the same losses, to the reductions' order."""
    losses = {zero: _trainer("llama", fp8, "full", zero, steps=3).run().losses for zero in (1, 3)}
    np.testing.assert_allclose(losses[3], losses[1], rtol=1e-5)


def _pipelined_losses(schedule: str, fp8: str, zero: int) -> list[float]:
    from meshtron.train.loop import Trainer

    chunks = 2 if schedule == "interleaved" else 1  # one layer per stage and chunk, two microbatches: the
    # smallest pipelined step (zb-h1's program grows with the microbatches it unrolls)
    cfg = load_config("llama_cpu8", [*MODEL, f"model.layers={2 * chunks}", "parallel.data=2", "parallel.pipe=2",
                                     f"parallel.schedule={schedule}", f"parallel.chunks={chunks}",
                                     "parallel.microbatches=2", "train.batch_size=8", "train.steps=2",
                                     f"model.fp8={fp8}", f"parallel.zero={zero}"])
    return Trainer.from_config(cfg).run().losses


@pytest.mark.slow
@pytest.mark.parametrize("schedule, fp8", [pytest.param("interleaved", "current", marks=pytest.mark.extended),
                                           ("zb-h1", "delayed")])
def test_pipelined_zero3_trains_as_zero1_with_fp8_weights_gathered_as_shares(schedule, fp8):
    """On 2x2x2 pipelines (interleaved 1F1B recomputes each stage from its input; zb-h1 replays each layer's
    pullback split in two), zero=3's shares quantized and gathered as float8 bytes give zero=1's losses."""
    np.testing.assert_allclose(_pipelined_losses(schedule, fp8, 3), _pipelined_losses(schedule, fp8, 1), rtol=1e-5)


def _shares_and_gather(mesh, w: np.ndarray, dim: int):
    """``w`` split over ``data`` along ``dim``, and what gathers it whole inside a region manual over ``data``."""
    return (jax.device_put(w, jax.NamedSharding(mesh, P(*[None] * dim, "data"))),
            lambda a: jax.lax.all_gather(a, "data", axis=dim, tiled=True))


def test_a_gathered_weights_fp8_gemm_and_gradients_equal_the_whole_weights(operands):
    """Quantizing each share at the whole weight's scale and gathering the bytes is what quantizing the
    gathered weight gives: the product and both gradients are bit for bit those of the whole weight's FP8
    GEMM; the weight's gradient reaches the gathered weight (and through its gather, the share)."""
    x, w, c = operands
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    shares, gather = _shares_and_gather(mesh, w, 1)

    def gathered(x, share, c):
        def loss(x, share):
            whole = gather(share)
            with using(fp8="current", gathered={}) as ctx:
                ctx.gathered[id(whole)] = (whole, GatheredShard(share, gather, lambda s: jax.lax.pmax(s, "data")))
                return jnp.sum(projection_einsum("se,ef->sf", x, whole) * c)

        return jax.value_and_grad(loss, argnums=(0, 1))(x, share)

    run = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=(P(), P(None, "data"), P()),
                                out_specs=(P(), (P(), P(None, "data"))), check_vma=False))
    loss, (dx, dw) = run(x, shares, c)

    def whole_loss(x, w):
        with using(fp8="current"):
            return jnp.sum(projection_einsum("se,ef->sf", x, w) * c)

    expected, (ex, ew) = jax.value_and_grad(whole_loss, argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(loss, expected)
    np.testing.assert_array_equal(dx, ex)
    np.testing.assert_array_equal(dw, 4 * ew)  # the gather's transpose sums the four ranks' (equal) gradients


def test_a_joined_kernel_of_gathered_weights_is_quantized_from_their_shares(operands):
    """A projection by several gathered matrices joined into one (Llama's fused q/k/v): the shares quantized
    at the joined kernel's scale, their bytes gathered and joined -- the same product and gradients as the
    joined whole kernel's FP8 GEMM, and no e4m3 cast of a gathered value in the program."""
    x, w, c = operands
    a, b = w[:, :16], w[:, 16:] * 4  # the joined kernel's scale is b's
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    (sa, gather), (sb, _) = _shares_and_gather(mesh, a, 0), _shares_and_gather(mesh, b, 0)
    fuse = lambda p, q: jnp.concatenate([p, q], axis=1)

    def gathered(x, sa, sb):
        def loss(x, sa, sb):
            wa, wb = gather(sa), gather(sb)
            with using(fp8="current", gathered={}) as ctx:
                for whole, share in ((wa, sa), (wb, sb)):
                    ctx.gathered[id(whole)] = (whole, GatheredShard(share, gather, lambda s: jax.lax.pmax(s, "data")))
                joined = joined_weight(fuse, (wa, wb), x.dtype)
                return jnp.sum(projection_einsum("se,ef->sf", x, joined, projections=2) * c)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, sa, sb)

    run = jax.jit(jax.shard_map(gathered, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                out_specs=(P(), (P(), P("data"), P("data"))), check_vma=False))
    loss, (dx, da, db) = run(x, sa, sb)
    text = run.lower(x, sa, sb).compile().as_text()
    cast = {leaves(i.shape)[0].elements for comp in parse_hlo_module(text).computations.values()
            for i in comp.instructions if i.opcode == "convert" and str(leaves(i.shape)[0].dtype) == "f8e4m3fn"}
    assert a.size not in cast and w.size not in cast and a.size // 4 in cast  # shares, not gathered values

    def whole_loss(x, a, b):
        with using(fp8="current"):
            return jnp.sum(projection_einsum("se,ef->sf", x, fuse(a, b)) * c)

    expected, (ex, ea, eb) = jax.value_and_grad(whole_loss, argnums=(0, 1, 2))(x, a, b)
    np.testing.assert_array_equal(loss, expected)
    for got, want in ((dx, ex), (da, 4 * ea), (db, 4 * eb)):  # four ranks' equal gradients summed
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_h100_zero3_gathers_each_layers_fp8_weights_as_bytes_half_of_bf16s(gpu_target):
    """Compiled for 8 H100s (Llama, bf16 compute, zero=3): with FP8 each layer's projection weights cross
    ``data`` as one byte per element, in the forward and again in the backward, and the layers' gathers move
    half the bytes of the same step's bf16 gathers without FP8 (the norms' scales still gather in bf16)."""
    from meshtron.train.loop import Trainer

    def layer_gathers(fp8: str):
        cfg = load_config("cpu8", ["model.family=llama", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
                                   "model.mlp_dim=128", "model.seq_len=64", "model.vocab_size=256", "model.layers=2",
                                   "model.dtype=bfloat16", f"model.fp8={fp8}", "parallel.data=8", "parallel.pipe=1",
                                   "parallel.tensor=1", "parallel.zero=3", "parallel.microbatches=2",
                                   "train.batch_size=32"])
        trainer = Trainer.from_config(cfg, target=gpu_target, read_data=False)
        return [c for c in collectives(_compiled(trainer), trainer.mesh)
                if c.kind == "all-gather" and c.axes == ("data",) and c.count >= 2]  # in the layer loops

    bf16, fp8 = layer_gathers("off"), layer_gathers("current")
    assert {c.dtype for c in bf16} == {"bf16"}
    # XLA:GPU combines a layer's gathers into one (its dtype reads "bf16+u8": the [64] norm scales stay bf16)
    assert fp8 and all("u8" in c.dtype.split("+") for c in fp8)
    assert sum(c.total_bytes for c in fp8) < 0.51 * sum(c.total_bytes for c in bf16)
