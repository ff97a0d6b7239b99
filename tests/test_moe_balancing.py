"""Aux-loss-free balancing undoes a skewed router: from a selection bias that sends every token to one
expert, the bias rule (``bias_update_rate`` > 0, no balance loss) brings the busiest expert's load down
towards the mean within a few steps, while the same bias held fixed (rate 0) keeps the skew. The loads are
those of each step's own batch, as the step's forward routes it (``TrainSteps.layer_reports``)."""

import jax
import numpy as np
import pytest

from meshtron.config import load_config
from meshtron.models.moe import BIAS

TINY = ["model.hidden=32", "model.heads=2", "model.kv_heads=2", "model.layers=2", "model.mlp_dim=64",
        "model.seq_len=16", "model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=32",
        "model.moe.router=sigmoid", "model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0",
        "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.schedule=1f1b", "parallel.chunks=1",
        "parallel.microbatches=1", "train.batch_size=16", "train.steps=8", "train.warmup_steps=1"]
SKEW = 0.1  # expert 0's selection bias at the start: above every sigmoid score's spread at initialisation
STEPS = 10


def busiest_over_mean(*overrides: str) -> tuple[list[float], np.ndarray]:
    """Each step's busiest expert over the mean load (worst layer), from every layer's bias ``SKEW`` on
    expert 0 and 0 elsewhere; and the bias after the last step ``[layers, E]``."""
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(load_config("mixtral_cpu8", [*TINY, *overrides]))
    params = trainer.init_params()
    mlp = params["blocks"]["mlp"]
    start = np.zeros(mlp[BIAS].shape, np.float32)
    start[..., 0] = SKEW
    params = {**params, "blocks": {**params["blocks"], "mlp": {**mlp, BIAS: jax.device_put(start, mlp[BIAS].sharding)}}}
    opt_state = trainer.steps.init_opt_state(params)
    stream = trainer.train_stream()
    imbalance = []
    for _ in range(STEPS):
        batch = stream.next(trainer.steps.batch_sharding)
        (stats,) = trainer.steps.layer_reports(params, batch)
        load = np.asarray(stats.load, np.float64)
        assert load.sum() == 16 * 16 * 2 * 2  # every token's two assignments in both layers: none dropped
        imbalance.append(float(np.max(load.max(-1) / load.mean(-1))))
        params, opt_state, _ = trainer.steps.train(params, opt_state, batch)
    return imbalance, np.asarray(jax.device_get(params["blocks"]["mlp"][BIAS]))


@pytest.mark.slow  # two tiny runs' compiles: about 30 s on 2 cores
def test_the_bias_rule_balances_a_skewed_router_and_a_fixed_bias_does_not():
    rate = 0.01
    balancing, bias = busiest_over_mean(f"model.moe.bias_update_rate={rate}")
    fixed, kept = busiest_over_mean("model.moe.bias_update_rate=0", "model.moe.selection_bias=true")
    # top-2 of 8 with expert 0 in every token's pair: expert 0 takes 4x the mean load
    assert balancing[0] == fixed[0] == 4.0
    assert all(x == 4.0 for x in fixed)  # the fixed bias keeps expert 0 in every selection
    np.testing.assert_array_equal(kept[:, 0], np.float32(SKEW))
    # the rule lowers expert 0's bias and raises the idle experts' until expert 0 no longer wins every token
    assert np.all(bias[:, 0] < SKEW) and np.all(bias[:, 1:].max(-1) > 0)
    # once the bias has closed the 0.1 gap (a 2 x rate step each step) no step is as skewed as at the start,
    # and the second half is nearer the mean; the per-step load of 256 tokens still swings by the rate's moves
    later = balancing[STEPS // 2:]
    assert max(later) < 3.0 and np.mean(later) < 2.6
