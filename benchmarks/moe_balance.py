"""Training with the expert load recorded at every step, from a given or a skewed selection bias.

The fine-grained comparison (``moe.py --part c``) and the balancing figure (``--part d``) both need what
``Trainer.run`` does not hand back: the load of every step's batch, and a start whose selection bias was
set by hand. So this drives the trainer's compiled step itself: before each step the routing of that
step's batch (``TrainSteps.layer_reports``, the values the step's own forward computes), then the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import numpy as np

from meshtron.config import load_config
from meshtron.models.moe import BIAS
from meshtron.train.loop import Trainer

# A tiny Mixtral on 2 simulated devices, the experts split over data (expert parallelism, padded
# dispatch): 2 layers of hidden 64, sequence 64, batch 8 (512 tokens a step). XLA:CPU runs
# ``ragged_dot`` as a masked dense product, so 64 experts cost 64x their FLOPs here: this is the size at
# which 200 steps of a 64-expert model take about a minute on 2 shared cores.
TINY = ["model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.layers=2", "model.mlp_dim=192",
        "model.seq_len=64", "train.batch_size=8", "train.warmup_steps=20", "train.eval_batches=4",
        "parallel.data=2", "parallel.pipe=1", "parallel.tensor=1", "parallel.schedule=1f1b",
        "parallel.chunks=1", "parallel.microbatches=1"]


@dataclass
class BalanceRun:
    """One run's record: per step, the busiest expert's load over the mean (worst layer) and the
    selection bias's range; the held-out loss at the end; the dropped and routed assignments summed over
    every step; tokens/s of the steps alone (the first, which compiles, and the routing passes left out)."""

    name: str
    overrides: list[str]
    imbalance: list[float] = field(default_factory=list)
    bias_range: list[tuple[float, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    heldout_loss: float = float("nan")
    dropped: int = 0
    routed: int = 0
    expected_routed: int = 0
    tokens_per_s: float = float("nan")
    parameters: int = 0

    def crossing(self, threshold: float) -> int | None:
        """The first step (1-based) whose batch was routed with imbalance below ``threshold`` and stayed
        below it for every later step; None if the run never settles under it."""
        below = [x < threshold for x in self.imbalance]
        for step in range(len(below)):
            if all(below[step:]):
                return step + 1
        return None

    def first_below(self, threshold: float) -> int | None:
        return next((i + 1 for i, x in enumerate(self.imbalance) if x < threshold), None)

    def summary(self) -> dict:
        return {"overrides": self.overrides, "imbalance": self.imbalance, "bias_range": self.bias_range,
                "losses": self.losses, "heldout_loss": self.heldout_loss, "dropped": self.dropped,
                "routed": self.routed, "expected_routed": self.expected_routed, "tokens_per_s": self.tokens_per_s,
                "parameters": self.parameters, "first_below_1.3": self.first_below(1.3),
                "stays_below_1.3_from": self.crossing(1.3)}


def skewed(params, hot: int, offset: float):
    """``params`` with every layer's selection bias ``offset`` on its first ``hot`` experts and 0 elsewhere:
    those experts win every token's selection until the bias moves (sigmoid scores lie in (0, 1) and start
    near 0.5, the router's logits being small at initialisation)."""
    mlp = params["blocks"]["mlp"]
    bias = mlp[BIAS]
    values = np.zeros(bias.shape, np.float32)
    values[..., :hot] = offset
    mlp = {**mlp, BIAS: jax.device_put(values, bias.sharding)}
    return {**params, "blocks": {**params["blocks"], "mlp": mlp}}


def train_recording_load(name: str, overrides: list[str], steps: int, *, skew: tuple[int, float] | None = None,
                         log=print) -> BalanceRun:
    """``steps`` steps of ``mixtral_cpu8`` with :data:`TINY` and ``overrides``, recording every step's
    routing; ``skew`` = (hot experts, bias offset) starts from :func:`skewed` parameters."""
    cfg = load_config("mixtral_cpu8", [*TINY, f"train.steps={steps}", *overrides])
    trainer = Trainer.from_config(cfg)
    run = BalanceRun(name, overrides)
    params = trainer.init_params()
    run.parameters = int(sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                             if "e_score_correction_bias" not in jax.tree_util.keystr(path)
                             and "expert_load" not in jax.tree_util.keystr(path)))
    if skew is not None:
        params = skewed(params, *skew)
    opt_state = trainer.steps.init_opt_state(params)
    stream = trainer.train_stream()
    m = cfg.model
    tokens = cfg.train.batch_size * m.seq_len
    seconds = []
    for step in range(1, steps + 1):
        batch = stream.next(trainer.steps.batch_sharding)
        (stats,) = trainer.steps.layer_reports(params, batch)
        load = np.asarray(stats.load, np.float64)  # [layers, E], summed over the step's routing groups
        run.imbalance.append(float(np.max(load.max(-1) / load.mean(-1))))
        bias = np.asarray(stats.bias, np.float64)
        if bias.shape[-1]:
            groups = trainer.steps.report_groups  # the bias is summed over the groups like the rest
            run.bias_range.append((float(bias.min()) / groups, float(bias.max()) / groups))
        run.dropped += int(np.sum(stats.dropped))
        run.routed += int(load.sum())
        run.expected_routed += tokens * m.moe.top_k * m.layers
        start = time.perf_counter()
        params, opt_state, metrics = trainer.steps.train(params, opt_state, batch)
        loss = float(metrics.mean()[0])
        if step > 1:
            seconds.append(time.perf_counter() - start)
        run.losses.append(loss)
        if step == 1 or step % 25 == 0 or step == steps:
            log(f"    {name} step {step}: loss {loss:.4f}, busiest/mean {run.imbalance[-1]:.3f}")
    run.heldout_loss = trainer.evaluate(params)
    run.tokens_per_s = tokens * len(seconds) / sum(seconds) if seconds else float("nan")
    return run
