"""FP8 projections (``model.fp8``): the GEMMs against an independent float64 reference of the same
quantization, the hook off and on, the parity oracle, users' models through the hook, LoRA's frozen base."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from meshtron.config import ConfigError, ModelConfig, load_config
from meshtron.execution import Execution
from meshtron.models.fp8 import (
    fp8_dot_general,
    power_of_two_scale,
    projection_dot_general,
    projection_einsum,
    projection_ragged_dot,
)
from meshtron.testing import Layout, check_parity
from meshtron.trace_context import using
from meshtron.train.state import model_def_from_config

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def quantized(x: np.ndarray, dtype) -> tuple[np.ndarray, float]:
    """``x`` rounded to ``dtype`` after division by its power-of-two scale, back in float64, and the scale."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    scale = 2.0 ** np.ceil(np.log2(np.abs(x).max() / fmax))
    q = np.clip(x.astype(np.float32) / np.float32(scale), -fmax, fmax).astype(dtype)
    return q.astype(np.float64), scale


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_fp8_gemm_and_both_gradients_equal_the_quantized_products(operands):
    x, w, c = operands
    dims = (((1,), (0,)), ((), ()))
    y, pullback = jax.vjp(lambda a, b: fp8_dot_general(a, b, dims), jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(c))
    (qx, sx), (qw, sw), (qc, sc) = quantized(x, E4M3), quantized(w, E4M3), quantized(c, E5M2)
    assert y.dtype == jnp.float32 and dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    assert rel(y, qx @ qw * (sx * sw)) < 1e-6
    assert rel(dx, qc @ qw.T * (sc * sw)) < 1e-6
    assert rel(dw, qx.T @ qc * (sc * sx)) < 1e-6
    # and it is FP8: the products differ from the exact ones by FP8's rounding, not by nothing
    assert 1e-3 < rel(y, x.astype(np.float64) @ w) < 0.1


def test_scales_are_powers_of_two_that_cover_the_largest_value():
    fmax = float(ml_dtypes.finfo(E4M3).max)  # 448
    assert float(power_of_two_scale(jnp.array([fmax, 1.0]), jnp.float8_e4m3fn)) == 1.0
    assert float(power_of_two_scale(jnp.array([fmax + 1]), jnp.float8_e4m3fn)) == 2.0
    assert float(power_of_two_scale(jnp.array([3.0]), jnp.float8_e4m3fn)) == 2.0 ** -7  # 3 / 2^-7 = 384 <= 448
    assert float(power_of_two_scale(jnp.zeros(4), jnp.float8_e4m3fn)) == 1.0
    assert np.isnan(float(power_of_two_scale(jnp.array([1.0, np.nan]), jnp.float8_e4m3fn)))


def test_grouped_fp8_gemm_equals_each_groups_quantized_product():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    w = (rng.standard_normal((3, 16, 8)) * 0.1).astype(np.float32)
    c = rng.standard_normal((10, 8)).astype(np.float32)
    sizes = np.array([3, 0, 7], np.int32)
    with using(fp8="current"):
        y, pullback = jax.vjp(lambda a, b: projection_ragged_dot(a, b, jnp.asarray(sizes)), jnp.asarray(x),
                              jnp.asarray(w))
        dx, dw = pullback(jnp.asarray(c))
    (qx, sx), (qw, sw), (qc, sc) = quantized(x, E4M3), quantized(w, E4M3), quantized(c, E5M2)
    groups = np.repeat(np.arange(3), sizes)
    assert rel(y, np.stack([qx[i] @ qw[g] for i, g in enumerate(groups)]) * (sx * sw)) < 1e-6
    assert rel(dx, np.stack([qc[i] @ qw[g].T for i, g in enumerate(groups)]) * (sc * sw)) < 1e-6
    expected_dw = np.stack([qx[groups == g].T @ qc[groups == g] for g in range(3)]) * (sc * sx)
    assert rel(dw, expected_dw) < 1e-6 and not np.any(np.asarray(dw[1]))


def test_the_hook_is_the_plain_product_when_fp8_is_off_and_fp8_when_on(operands):
    x, w, _ = operands
    plain = jnp.einsum("se,ef->sf", x, w)
    np.testing.assert_array_equal(projection_einsum("se,ef->sf", x, w), plain)
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(projection_dot_general(x, w, dims), jax.lax.dot_general(x, w, dims))
    with using(fp8="current"):
        on = projection_einsum("se,ef->sf", x, w)
        np.testing.assert_array_equal(projection_dot_general(x, w, dims), on)
    np.testing.assert_array_equal(on, fp8_dot_general(jnp.asarray(x), jnp.asarray(w), dims))


def test_a_users_nnx_model_takes_fp8_through_the_documented_hook():
    """An ``nnx.Einsum`` with ``einsum_op=projection_einsum`` and an ``nnx.Linear`` with
    ``dot_general=projection_dot_general`` run FP8 under the run's execution, and are untouched without."""
    rngs = nnx.Rngs(0)
    einsum = nnx.Einsum("bse,ef->bsf", (16, 8), einsum_op=projection_einsum, rngs=rngs)
    linear = nnx.Linear(16, 8, dot_general=projection_dot_general, rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (2, 4, 16))
    off = einsum(x), linear(x)
    with Execution(fp8="current").scope():
        on = einsum(x), linear(x)
        text = jax.jit(lambda v: einsum(v)).lower(x).as_text()
    np.testing.assert_array_equal(off[0], jnp.einsum("bse,ef->bsf", x, einsum.kernel[...]))
    for a, b in zip(off, on, strict=True):
        assert 1e-3 < rel(b, a) < 0.1
    assert "f8E4M3FN" in text


def test_model_fp8_takes_off_current_and_delayed_and_names_the_field_otherwise():
    assert load_config(None, ["model.fp8=current"]).model.fp8 == "current"
    assert load_config(None, ["model.fp8=delayed"]).model.fp8 == "delayed"
    with pytest.raises(ConfigError, match=r"^model.fp8: must be one of off, current, delayed \(off: projections in "
                                          r"model.dtype; current: FP8 GEMMs scaled per tensor by its amax; delayed: "
                                          r"by an amax history\), got 'e4m3'"):
        load_config(None, ["model.fp8=e4m3"])


def _llama(dtype: str, tensor: int, fp8: str = "off"):
    return model_def_from_config(ModelConfig(family="llama", vocab_size=256, hidden=64, heads=8, kv_heads=2, layers=4,
                                             mlp_dim=128, seq_len=16, dtype=dtype, fp8=fp8), tensor)


# Tolerances, as measured on these layouts. With float32 activations the FP8 products equal one device's
# to float32 rounding: each split quantizes its part of a tensor with a power-of-two scale, the same as
# the whole tensor's unless a part's largest value sits in another binade, so the oracle is as tight as
# without FP8. bf16 activations differ between layouts by bf16's rounding (1% of a gradient's norm
# here); an element that lands on the other side of an FP8 rounding step moves by a whole step (2^-3
# of it in e4m3, 2^-2 in e5m2), which turns those differences into about 10% of a gradient's norm,
# while the loss stays within 1e-4. Delayed scaling from a fresh history scales each tensor by its own amax
# too, here through the delayed GEMMs, their probes and the site counting of each layout (the history's own
# scales against an independent quantization, and across layouts: tests/test_fp8_delayed.py).
TOLERANCES = {
    ("float32", "current"): {"loss_rtol": 1e-5, "rtol": 1e-2, "atol": 1e-5},
    ("float32", "delayed"): {"loss_rtol": 1e-5, "rtol": 1e-2, "atol": 1e-5},
    ("bfloat16", "current"): {"loss_rtol": 1e-4, "norm_rtol": 0.2, "atol": 0.0},
    ("bfloat16", "off"): {"loss_rtol": 1e-4, "norm_rtol": 0.03, "atol": 0.0},
}
TENSOR8, INTERLEAVED, ZB_H1 = Layout(1, 1, 8), Layout(2, 2, 2, "interleaved", 2), Layout(2, 2, 2, "zb-h1", microbatches=2)
# Every layout runs FP8 (current scaling) and plain bf16 in bf16, the oracles a user compares; the float32
# settings, whose bounds are tight, once each where they matter: current scaling through the widest tensor
# split (tensor ranks' parts of each quantized tensor), delayed scaling through zb-h1, whose layers' pullbacks
# are split in two (B and W) and count their sites per pass.
PARITY_CASES = [*[(layout, "bfloat16", fp8) for layout in (TENSOR8, INTERLEAVED, ZB_H1) for fp8 in ("current", "off")],
                (TENSOR8, "float32", "current"), (ZB_H1, "float32", "delayed")]
# The CI tier keeps the interleaved layout's bf16 oracles and both float32 cases; the bf16 oracles of the
# tensor split and of zb-h1 are further layouts of the same claim (make test runs them).
EXTENDED_PARITY = {(TENSOR8, "bfloat16", "current"), (TENSOR8, "bfloat16", "off"),
                   (ZB_H1, "bfloat16", "current"), (ZB_H1, "bfloat16", "off")}


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype, fp8", [
    pytest.param(*case, marks=[pytest.mark.extended] if case in EXTENDED_PARITY else [], id=f"{case[0]}-{case[1]}-{case[2]}")
    for case in PARITY_CASES])
def test_parity_oracle_with_fp8_and_with_bf16(layout, dtype, fp8):
    """The loss and every gradient on each layout equal one device's, with FP8 projections and in bf16."""
    [report] = check_parity(_llama(dtype, layout.tensor, fp8), [layout], execution=Execution(fp8=fp8),
                            **TOLERANCES[dtype, fp8])
    assert report.ok


@pytest.mark.gpu_compile
@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["current", pytest.param("delayed", marks=pytest.mark.extended)])
def test_h100_program_runs_every_block_gemm_on_fp8_operands(gpu_target, fp8):
    """Compiled for 8 H100s (zb-h1 on 2x2x2: forward, input-gradient and weight-gradient passes): with FP8
    every GEMM of the layer loop has float8 operands -- e4m3 x e4m3 forward, e5m2 x e4m3 for both
    gradients -- and the head's stay bf16. Attention's cores are cuDNN's. One layer per stage and two
    microbatches already hold every kind of block GEMM in every pass. Without FP8 no GEMM is float8:
    tests/test_gpu_compile.py's zb-h1 program in bf16."""
    from meshtron.hlo.gemms import gemms
    from meshtron.train.loop import Trainer

    cfg = load_config("llama_cpu8", [
        "model.hidden=64", "model.heads=4", "model.mlp_dim=128", "model.seq_len=64", "model.vocab_size=256",
        "model.layers=2", "model.attention=cudnn", "model.dtype=bfloat16", f"model.fp8={fp8}",
        "parallel.schedule=zb-h1", "parallel.chunks=1", "parallel.microbatches=2", "train.batch_size=8"])
    trainer = Trainer.from_config(cfg, target=gpu_target, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    found = [g for g in gemms(trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0]))
             if not g.attention]
    head = [g for g in found if "bse,ve->bsv" in g.op_name]  # Llama's head: logits = x . lm_head
    in_blocks = [g for g in found if "bse,ve->bsv" not in g.op_name]
    assert in_blocks and head
    assert all(not g.f8 for g in head)
    assert all(g.f8 for g in in_blocks), [(g.lhs, g.rhs, g.op_name) for g in in_blocks if not g.f8][:3]
    pairs = {tuple(sorted((g.lhs, g.rhs))) for g in in_blocks}
    assert pairs == {("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")}


def test_a_bare_off_in_yaml_is_off(tmp_path):
    (tmp_path / "run.yaml").write_text("model:\n  fp8: off\n")
    assert load_config(tmp_path / "run.yaml").model.fp8 == "off"
    assert load_config(None, ["model.fp8=off"]).model.fp8 == "off"


@pytest.mark.slow
def test_lora_trains_its_adapters_over_a_frozen_base_multiplied_in_fp8():
    from meshtron.train.loop import Trainer

    def first_losses(fp8: str):
        cfg = load_config("llama_cpu8", ["train.steps=3", "train.eval_every=1000", "train.eval_batches=1",
                                         "train.batch_size=8", "train.lora.rank=4", f"model.fp8={fp8}"])
        return Trainer.from_config(cfg).run().losses

    off, on = first_losses("off"), first_losses("current")
    assert all(np.isfinite(on)) and on[-1] < on[0]
    assert 1e-6 < abs(on[0] / off[0] - 1) < 1e-2  # the same model, its base GEMMs rounded to FP8


@pytest.mark.parametrize("policy", ["everything_saveable", "dots_saveable", "nothing_saveable"])
def test_gradients_are_the_same_under_any_recomputation_policy(operands, policy):
    """A layer recomputed under ``jax.checkpoint`` keeps (or reruns) the quantized operands; what it keeps
    must come back as it was, including e4m3's top binade (256-448), which XLA's reduce-precision would
    turn to NaN if the kept operand were a float8 array."""
    x, w, c = operands

    def loss(a, b):
        with using(fp8="current"):
            return jnp.sum(jnp.tanh(projection_einsum("se,ef->sf", a, b)) * c)

    plain = jax.grad(loss, argnums=(0, 1))(x, w)
    recomputed = jax.grad(jax.checkpoint(loss, policy=getattr(jax.checkpoint_policies, policy)), argnums=(0, 1))(x, w)
    for a, b in zip(recomputed, plain, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_operands_get_their_products_and_gradients_in_their_dtype(operands, dtype):
    """bf16 and float16 operands: products and gradients returned in their dtype, equal to float64 GEMMs of
    the same float8 operands to that dtype's rounding -- float16's narrow range included (an output
    gradient of 1e-3 times a weight's scale is below its smallest normal). The operands are quantized as
    the module does (XLA:CPU's conversion from a bf16 or float16 tensor, whose values land on float8
    ties often, rounds some ties up where ml_dtypes rounds them to even); the float32 test above holds
    that quantization to an independent one."""
    from meshtron.models.fp8 import _quantized

    x, w, c = operands
    x16, w16, c16 = (jnp.asarray(a, dtype) for a in (x, w, c))
    dims = (((1,), (0,)), ((), ()))
    y, pullback = jax.vjp(lambda a, b: fp8_dot_general(a, b, dims), x16, w16)
    dx, dw = pullback(c16)
    assert y.dtype == dx.dtype == dw.dtype == jnp.dtype(dtype)

    def q(a, kind):
        values, scale = jax.jit(_quantized, static_argnums=1)(a, kind)
        return np.asarray(values.astype(jnp.float32), np.float64), float(scale)

    (qx, sx), (qw, sw), (qc, sc) = q(x16, jnp.float8_e4m3fn), q(w16, jnp.float8_e4m3fn), q(c16, jnp.float8_e5m2)
    tolerance = 2.0 ** -jnp.finfo(dtype).nmant
    assert rel(y, qx @ qw * (sx * sw)) < tolerance
    assert rel(dx, qc @ qw.T * (sc * sw)) < tolerance
    assert rel(dw, qx.T @ qc * (sc * sx)) < tolerance


@pytest.mark.parametrize("remat", ["full", "offload"])
def test_a_recomputed_block_keeps_its_fp8_weights_instead_of_quantizing_them_again(operands, remat):
    """Under ``model.remat=full``/``offload`` the rerun forward reuses the weight quantized in the forward
    (one amax reduction of it per step, not two: the input's is taken twice, the output gradient's once),
    with the same gradients; under a view that gathers each layer's parameters as it runs without recording
    their shares it quantizes again instead of holding every layer's gathered weights (zero=3's view records
    them and keeps the quantized shares: tests/test_fp8_recomputation.py)."""
    from meshtron.models.blocks import recomputed
    from meshtron.trace_context import LayerView

    x, w, c = operands

    def traced(views=()):
        with using(fp8="current", layer_views=views):
            block = recomputed(lambda h, b: jnp.tanh(projection_einsum("se,ef->sf", h, b)), remat)
            grad = jax.grad(lambda h, b: jnp.sum(block(h, b) * c), argnums=(0, 1))
            return str(jax.make_jaxpr(grad)(x, w)).count("reduce_max"), grad(x, w)

    kept, gradients = traced()
    gathered, _ = traced((LayerView(lambda layer: layer, None, None),))
    assert (kept, gathered) == (4, 5)
    with using(fp8="current"):
        plain = jax.grad(lambda h, b: jnp.sum(jnp.tanh(projection_einsum("se,ef->sf", h, b)) * c), argnums=(0, 1))(x, w)
    for a, b in zip(gradients, plain, strict=True):
        np.testing.assert_array_equal(a, b)
