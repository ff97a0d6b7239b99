"""Tokens/s and model-FLOPs utilisation of the default model, meshtron vs a plain Flax + optax loop.

Both run in one process on this machine: meshtron's train step on the default simulated
8-device CPU mesh (data=2, pipe=2, tensor=2, interleaved 1F1B), and a plain single-device ``jax.jit`` training step of the
same NNX GPT with the same optax optimizer and batch (one step per batch, no microbatching). Medians over the timed steps (first step,
which compiles, excluded). MFU = model FLOPs (Megatron eq. 3 without recomputation) per second /
the peak FP32 matmul rate measured here on one device.

    .venv/bin/python benchmarks/throughput.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshtron import megatron
from meshtron.config import load_config
from meshtron.data import BatchStream, Corpus
from meshtron.optim import build_optimizer
from meshtron.train.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu8.yaml"


def peak_matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best observed FP32 matmul rate on one device (the denominator of MFU)."""
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    best = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def meshtron_step_times(cfg, steps: int) -> list[float]:
    return trainer_step_times(Trainer.from_config(cfg), steps)


def trainer_step_times(trainer: Trainer, steps: int) -> list[float]:
    """Seconds of each of ``steps`` train steps from fresh parameters (the first, which compiles, left out)."""
    params = trainer.init_params()
    opt_state = trainer.steps.init_opt_state(params)
    stream = trainer.train_stream()
    times = []
    for _ in range(steps + 1):
        batch = stream.next(trainer.steps.batch_sharding)
        start = time.perf_counter()
        params, opt_state, metrics = trainer.steps.train(params, opt_state, batch)
        metrics.loss.block_until_ready()
        times.append(time.perf_counter() - start)
    return times[1:]


def plain_step_times(cfg, steps: int) -> list[float]:
    """The baseline: one device, no mesh, the textbook Flax NNX + optax jit step."""
    trainer = Trainer.from_config(cfg)  # only for the model definition and the corpus
    md, execution = trainer.model_def, trainer.execution
    device = jax.devices()[0]
    params = jax.device_put(jax.device_get(md.init(trainer.mesh, cfg.train.seed)), device)
    tx = build_optimizer(cfg.train, md.logical_axes())
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p, t: md.loss(p, t, execution))(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    corpus = Corpus.from_config(cfg.data, seq_len=cfg.model.seq_len, batch_size=cfg.train.batch_size,
                                vocab_size=cfg.model.vocab_size)
    stream = BatchStream(corpus.train, batch_size=cfg.train.batch_size, seq_len=cfg.model.seq_len, seed=0)
    times = []
    for i in range(steps + 1):
        tokens = jax.device_put(stream.global_batch(i), device)
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cfg = load_config(CONFIG)
    m, t = cfg.model, cfg.train
    flops = megatron.megatron_figures(
        vocab_size=m.vocab_size, hidden=m.hidden, layers=m.layers, seq_len=m.seq_len, heads=m.heads,
        global_batch=t.batch_size, data=cfg.mesh.data, pipe=1, tensor=cfg.mesh.tensor,
        microbatches=t.microbatches, remat=False,
    ).flops_per_iteration_no_remat
    peak = peak_matmul_flops()
    tokens = t.batch_size * m.seq_len
    mesh = "x".join(str(n) for n in (cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor))
    runs = {f"meshtron ({mesh} simulated mesh, {cfg.pipeline.schedule})": meshtron_step_times(cfg, args.steps),
            "plain Flax + optax (1 device)": plain_step_times(cfg, args.steps)}
    rows, results = [], {}
    for name, times in runs.items():
        median = statistics.median(times)
        results[name] = {"median_step_s": median, "tokens_per_s": tokens / median,
                         "mfu": flops / median / peak, "step_times_s": times}
        rows.append([name, f"{median * 1e3:.1f}", f"{tokens / median:,.0f}", f"{100 * flops / median / peak:.1f}%"])
    names = list(runs)
    ratio = results[names[0]]["tokens_per_s"] / results[names[1]]["tokens_per_s"]
    print(f"default model {m.layers}x{m.hidden}, batch {t.batch_size}x{m.seq_len} tokens, "
          f"{flops / 1e9:.2f} GFLOP/step, peak {peak / 1e9:.1f} GFLOP/s (measured matmul)")
    _common.print_table(["run", "median step ms", "tokens/s", "MFU"], rows)
    print(f"meshtron / plain throughput ratio: {ratio:.2f}")
    path = _common.write_results("throughput", {"config": str(CONFIG.name), "flops_per_step": flops,
                                                "peak_flops": peak, "ratio": ratio, "runs": results})
    plot(results)
    print(f"wrote {path}")


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, r in results.items():
        ax.plot(np.arange(1, len(r["step_times_s"]) + 1), np.array(r["step_times_s"]) * 1e3, label=name)
    ax.set_xlabel("step (after compilation)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("default model: step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "throughput.png", dpi=120)


if __name__ == "__main__":
    main()
