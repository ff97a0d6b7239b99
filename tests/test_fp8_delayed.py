"""Delayed FP8 scaling (``model.fp8=delayed``): the history's arithmetic against hand-computed values, a
delayed GEMM against an independent quantization at the history's scales, the state in the training step
(the largest amax over microbatches, data ranks, stages and tensor ranks), and that it is not a weight."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshtron.config import ConfigError, load_config
from meshtron.models.fp8 import fp8_dot_general, projection_einsum
from meshtron.models.fp8_scaling import (
    BINS,
    LayerScaling,
    delayed_scales,
    exponent_bins,
    observed_bounds,
    rolled,
)
from meshtron.trace_context import using
from meshtron.train.state import model_def_from_config
from meshtron.train.trainable import Trainable

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DIMS = (((1,), (0,)), ((), ()))


def bound(amax: float) -> float:
    """The power of two a history records for ``amax``: the smallest ``2^e`` above it."""
    return float(2.0 ** np.frexp(np.float32(amax))[1])


def quantized_at(x: np.ndarray, dtype, scale: float) -> np.ndarray:
    fmax = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x.astype(np.float32) / np.float32(scale), -fmax, fmax).astype(dtype).astype(np.float64)


def test_the_history_records_power_of_two_bounds_and_scales_below_the_formats_maximum():
    assert int(jnp.argmax(exponent_bins(jnp.float32(3.0)))) == int(jnp.argmax(exponent_bins(jnp.float32(2.0))))
    assert not np.any(exponent_bins(jnp.float32(0.0)))
    # a histogram summed over microbatches and averaged over ranks keeps its highest bin: the maximum
    summed = (exponent_bins(jnp.float32(3.0)) + exponent_bins(jnp.float32(0.1)) + exponent_bins(jnp.float32(0.0))) / 8
    assert float(observed_bounds(summed)) == 4.0 == bound(3.0)
    assert float(observed_bounds(jnp.zeros(BINS))) == 0.0  # nothing seen
    assert np.isinf(float(observed_bounds(exponent_bins(jnp.float32(np.inf)))))
    assert float(observed_bounds(exponent_bins(jnp.float32(2.0 ** -100)))) == 2.0 ** -99
    history = rolled(jnp.array([[4.0, 0.5, 0.0]] * 3), jnp.array([1.0, 2.0, 0.0]))
    np.testing.assert_array_equal(history, [[1.0, 4.0, 0.5], [2.0, 4.0, 0.5], [0.0, 4.0, 0.5]])
    # the largest of the history over 2^8 (e4m3: 256 <= 448) and 2^15 (e5m2: 32768 <= 57344)
    np.testing.assert_array_equal(delayed_scales(history), [4.0 / 256, 4.0 / 256, 4.0 / 32768])
    assert list(np.asarray(delayed_scales(jnp.zeros((3, 4))))) == [0.0, 0.0, 0.0]  # empty: the tensor's own amax
    assert np.isnan(np.asarray(delayed_scales(jnp.array([[np.inf, 1.0]] * 3)))).all()


def _delayed(history: np.ndarray):
    """A delayed FP8 GEMM of one site with this history, its probe's gradient returned beside the others."""
    def product(x, w, probe):
        with using(fp8="delayed", fp8_layer=LayerScaling(jnp.asarray(history)[None], probe[None])):
            return fp8_dot_general(x, w, DIMS)
    return product


def test_a_delayed_gemm_casts_at_the_historys_scales_and_reports_its_operands_amaxes(operands):
    x, w, c = operands
    # the history says x's amax was below 4 (x's own is about 9: it saturates at 448), w's below 1/8,
    # the output gradient's below 2^-8
    history = np.zeros((3, 16), np.float32)
    history[:, 3] = [4.0, 0.125, 2.0 ** -8]
    sx, sw, sc = 4.0 / 256, 0.125 / 256, 2.0 ** -8 / 32768
    y, pullback = jax.vjp(_delayed(history), jnp.asarray(x), jnp.asarray(w), jnp.zeros((3, BINS), jnp.float32))
    dx, dw, probe = pullback(jnp.asarray(c))
    qx, qw, qc = quantized_at(x, E4M3, sx), quantized_at(w, E4M3, sw), quantized_at(c, E5M2, sc)
    assert np.abs(qx).max() == 448.0  # saturated, not infinite
    np.testing.assert_allclose(y, qx @ qw * (sx * sw), rtol=1e-6, atol=1e-6 * np.abs(qx @ qw * (sx * sw)).max())
    np.testing.assert_allclose(dx, qc @ qw.T * (sc * sw), rtol=1e-6, atol=1e-6 * np.abs(dx).max())
    np.testing.assert_allclose(dw, qx.T @ qc * (sc * sx), rtol=1e-6, atol=1e-6 * np.abs(dw).max())
    # the probe's gradient: each operand's amax exponent, for the next step's history
    np.testing.assert_array_equal(observed_bounds(probe), [bound(np.abs(a).max()) for a in (x, w, c)])


def test_an_empty_history_scales_each_tensor_by_its_own_amax_as_current_scaling_does(operands):
    x, w, c = operands
    y, pullback = jax.vjp(_delayed(np.zeros((3, 16), np.float32)), jnp.asarray(x), jnp.asarray(w),
                          jnp.zeros((3, BINS), jnp.float32))
    now, now_pullback = jax.vjp(lambda a, b: fp8_dot_general(a, b, DIMS), jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(y, now)
    for a, b in zip(pullback(jnp.asarray(c))[:2], now_pullback(jnp.asarray(c)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_two_projections_of_one_shape_read_their_own_sites(operands):
    """``jnp.einsum`` caches its trace per shape; each projection must still read its own history."""
    x, w, _ = operands
    history = np.zeros((2, 3, 4), np.float32)
    history[0, :, 0], history[1, :, 0] = [16.0, 1.0, 1.0], [0.5, 1.0, 1.0]  # the second saturates x
    with using(fp8="delayed", fp8_layer=LayerScaling(jnp.asarray(history), jnp.zeros((2, 3, BINS)))):
        first, second = projection_einsum("se,ef->sf", x, w), projection_einsum("se,ef->sf", x, w)
    assert not np.array_equal(first, second)
    sx, sw = 0.5 / 256, 1.0 / 256
    np.testing.assert_allclose(second, quantized_at(x, E4M3, sx) @ quantized_at(w, E4M3, sw) * (sx * sw), rtol=1e-5,
                               atol=1e-5)


def test_model_fp8_amax_history_is_a_number_of_steps():
    assert load_config(None, ["model.fp8=delayed", "model.fp8_amax_history=4"]).model.fp8_amax_history == 4
    with pytest.raises(ConfigError, match=r"^model.fp8_amax_history: must be a whole number of steps >= 1"):
        load_config(None, ["model.fp8=delayed", "model.fp8_amax_history=0"])


def test_the_state_sits_in_the_blocks_per_projection_and_is_neither_a_weight_nor_trained():
    cfg = load_config("llama_cpu8", ["model.fp8=delayed", "model.fp8_amax_history=8"])
    delayed, plain = model_def_from_config(cfg.model), model_def_from_config(load_config("llama_cpu8").model)
    blocks = delayed.shapes()["blocks"]
    # seven projections per block (query, key, value, output, gate, up, down), whether a layout joins some
    assert blocks["fp8_history"].shape == (4, 7, 3, 8) and blocks["fp8_observed"].shape == (4, 7, 3, BINS)
    assert delayed.parameter_count() == plain.parameter_count()
    trainable = Trainable.of_model(delayed)
    assert trainable.mask["blocks"]["fp8_history"] is False and trainable.mask["blocks"]["fp8_observed"] is False
    assert trainable.observed["blocks"]["fp8_observed"] is True and trainable.mask["blocks"]["mlp"]["down"]["kernel"]
    mixtral = model_def_from_config(load_config("mixtral_cpu8", ["model.fp8=delayed"]).model)
    assert mixtral.shapes()["blocks"]["fp8_history"].shape[1] == 7  # q, k, v, output, three grouped expert GEMMs


def _one_step_history(*overrides: str):
    """The history after one step of llama_cpu8 (4 steps of history) on a layout, and the weights it started from."""
    from meshtron.train.loop import Trainer

    cfg = load_config("llama_cpu8", ["model.fp8=delayed", "model.fp8_amax_history=4", "train.steps=1",
                                     "train.eval_every=1000", "train.eval_batches=1", "train.batch_size=8",
                                     *overrides])
    trainer = Trainer.from_config(cfg)
    history = trainer.run().params["blocks"]["fp8_history"]
    return np.asarray(jax.device_get(history)), jax.device_get(trainer.canonical_params(trainer.init_params()))


QKV, GATE_UP = slice(0, 3), slice(4, 6)  # Llama's sites that a tensor-parallel layout joins into one GEMM each


def joined(history: np.ndarray) -> np.ndarray:
    """``history`` as a layout that joins query/key/value and gate/up records it: each joined GEMM's
    amaxes (the largest of its matrices', of their output gradients') for every one of its sites."""
    history = history.copy()
    for group in (QKV, GATE_UP):
        history[:, group] = history[:, group].max(axis=1, keepdims=True)
    return history


def assert_same_bounds(got: np.ndarray, expected: np.ndarray, layout: str) -> None:
    """The same power-of-two bounds, but for an amax that a layout's rounding (its own order of sums) moves
    across a power of two: that bound is one binade off. Inputs and weights of the first layer are exact."""
    assert not np.any(got[..., 1:]) and not np.any(expected[..., 1:]), layout  # one step recorded
    ratio = got[..., 0] / expected[..., 0]
    assert np.all(np.isin(ratio, [0.5, 1.0, 2.0])), (layout, got[..., 0][ratio != 1], expected[..., 0][ratio != 1])
    assert np.mean(ratio == 1.0) > 0.95, layout
    np.testing.assert_array_equal(got[0, :, :2], expected[0, :, :2], err_msg=layout)


@pytest.mark.slow
def test_a_step_records_the_largest_amax_over_microbatches_data_stages_and_tensor_ranks():
    """One step of the same batch from the same weights on four layouts records the same history: each
    operand's amax over the whole batch, however the batch and the layers are split; layouts that split
    matrices over ``tensor`` join query/key/value and gate/up into one GEMM each, which records its amaxes
    for all of its projections. The weights' are their own amaxes' power-of-two bounds."""
    alone, weights = _one_step_history("parallel.data=1", "parallel.pipe=1", "parallel.tensor=1",
                                       "parallel.microbatches=1")
    assert np.all(alone[..., 0] > 0) and not np.any(alone[..., 1:])
    attn, mlp = weights["blocks"]["attn"], weights["blocks"]["mlp"]
    matrices = [attn["wq"], attn["wk"], attn["wv"], attn["wo"], mlp["gate"], mlp["up"], mlp["down"]]
    for layer in range(4):
        for site, matrix in enumerate(matrices):
            assert alone[layer, site, 1, 0] == bound(np.abs(matrix["kernel"][layer]).max()), (layer, site)
    for layout, expected in (
            (["parallel.data=2", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=2"], alone),
            (["parallel.data=2", "parallel.pipe=1", "parallel.tensor=2", "parallel.zero=3",
              "parallel.microbatches=1"], joined(alone)),
            ([], joined(alone))):  # llama_cpu8's own: 2x2x2 interleaved, 4 microbatches
        assert_same_bounds(_one_step_history(*layout)[0], expected, str(layout))


@pytest.mark.slow
# Mixtral's steps compiled at LLVM's first level (gpu.xla_flags: every program of the run), not the tests'
# level 0 (conftest.py): at level 0 its FP8 expert GEMMs run three times slower, and three steps took
# longer than the compile (the test: 44 -> 33 CPU seconds).
@pytest.mark.parametrize("config, extra", [pytest.param("mixtral_cpu8", ["gpu.xla_flags=--xla_backend_optimization_level=1"],
                                                        marks=pytest.mark.extended),
                                           ("llama_cpu8", ["train.lora.rank=4"])], ids=["experts", "lora"])
def test_experts_and_lora_train_with_delayed_scaling(config, extra):
    """Mixtral's grouped expert GEMMs (experts split over data) and LoRA's frozen base take their scales
    from the history; both train."""
    from meshtron.train.loop import Trainer

    cfg = load_config(config, ["model.fp8=delayed", "train.steps=3", "train.eval_every=1000", "train.eval_batches=1",
                               "train.batch_size=8", *extra])
    result = Trainer.from_config(cfg).run()
    assert all(np.isfinite(result.losses)) and result.losses[-1] < result.losses[0], result.losses
    history = np.asarray(jax.device_get(result.params["blocks"]["fp8_history"]))
    assert np.all(history[..., :3] > 0) and not np.any(history[..., 3:])


@pytest.mark.slow
def test_the_history_is_checkpointed_and_restored_onto_another_mesh(tmp_path):
    """Saved at step 2 on llama_cpu8's 2x2x2 interleaved layout, resumed for step 3 on 4x1x2 (zero=3: every
    other parameter split over data, the history whole) and on 1x4x2 1F1B: the restored history rolls on,
    and step 3's loss is the straight run's."""
    import shutil

    from meshtron.train.loop import Trainer

    def run(directory, *overrides):
        cfg = load_config("llama_cpu8", ["model.fp8=delayed", "model.fp8_amax_history=4", "train.steps=3",
                                         "train.eval_every=1000", "train.eval_batches=1", "train.batch_size=8",
                                         f"checkpoint.dir={directory}", *overrides])
        result = Trainer.from_config(cfg).run()
        return result, np.asarray(jax.device_get(result.params["blocks"]["fp8_history"]))

    straight, history = run(tmp_path / "saved", "checkpoint.every=2", "checkpoint.keep=5")
    assert np.all(history[..., :3] > 0) and not np.any(history[..., 3])
    for name, layout in (("4x1x2", ["parallel.data=4", "parallel.pipe=1", "parallel.tensor=2", "parallel.zero=3",
                                    "parallel.microbatches=2"]),
                         ("1x4x2", ["parallel.data=1", "parallel.pipe=4", "parallel.tensor=2",
                                    "parallel.schedule=1f1b", "parallel.chunks=1", "parallel.microbatches=4"])):
        directory = tmp_path / name
        shutil.copytree(tmp_path / "saved", directory)
        shutil.rmtree(directory / "3")  # resume from step 2
        resumed, rolled_on = run(directory, "checkpoint.every=100", *layout)
        assert resumed.first_step == 3, name
        np.testing.assert_array_equal(rolled_on[..., 1:3], history[..., 1:3], err_msg=name)  # steps 1 and 2, restored
        np.testing.assert_allclose(resumed.losses[0], straight.losses[2], rtol=1e-4, err_msg=name)


def test_a_block_calling_more_projections_than_were_counted_is_one_line(operands):
    x, w, _ = operands
    with using(fp8="delayed", fp8_layer=LayerScaling(jnp.zeros((1, 3, 4)), jnp.zeros((1, 3, BINS)))):
        projection_einsum("se,ef->sf", x, w)
        with pytest.raises(ConfigError, match=r"^model.fp8=delayed: a block multiplied by more than the 1 projections "
                                              r"counted when the model was built"):
            projection_einsum("se,ef->sf", x, w)
