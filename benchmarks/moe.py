"""Mixture of experts against the dense model, and many small experts against a few large ones.

(a) **Quality at equal active parameters.** ``llama_cpu8`` (a dense SwiGLU of width 384) against
``mixtral_cpu8`` (8 experts of width 192, top-2: the same active width, 4x the feed-forward
parameters), the same steps on the default data and mesh (data 2 x pipe 2 x tensor 2, interleaved,
experts split over data): held-out loss, tokens/s, and the expert load of the trained model.

(b) **Throughput at equal active FLOPs.** 8 experts top-2 of width 192 against 64 experts top-8 of
width 48 (both 384 active) on the same mesh: median step time, the compiled step's FLOPs per device
(``cost_analysis``) and the bytes the step sends over ``data`` (all-to-alls and the gradient
reduction), which say where the time goes.

(c) **Fine-grained experts and aux-loss-free balancing** (:mod:`moe_balance`'s tiny model on data=2,
experts split over data): 64 experts of width 24, top-8, sigmoid scores balanced by the selection bias
alone (``bias_update_rate`` > 0, no balance loss), against the same 64 experts routed by a softmax with
the load-balancing loss, and against Mixtral's 8 experts of width 96, top-2, softmax and the loss: all
three 192 active feed-forward columns per token, as the tiny model's dense MLP. Held-out loss, every
step's busiest expert over the mean, dropped assignments (counted), tokens/s.

(d) **The balancing figure.** From a skewed start (every layer's selection bias 0.1 on expert 0 of 8,
top-2, so expert 0 takes every token: 4x the mean load), sigmoid routing with no balance loss: the bias
rule at ``bias_update_rate`` 0.01 against the same bias held fixed (rate 0). The step at which the
busiest expert falls under 1.3x the mean, and the final values.

    .venv/bin/python benchmarks/moe.py                 # (a) 300 steps each, (b) 20 steps each: ~20 minutes
    .venv/bin/python benchmarks/moe.py --steps 100     # shorter (a)
    .venv/bin/python benchmarks/moe.py --part c        # ~15 minutes
    .venv/bin/python benchmarks/moe.py --part d        # ~4 minutes

(a) and (b) write ``results/moe.json`` and ``results/moe.png``; (c) ``results/moe_fine_grained.{json,png}``;
(d) ``results/moe_balancing.{json,png}``.
"""

from __future__ import annotations

import argparse
import statistics

import _common  # sets the simulated devices before JAX is imported
import jax
import moe_balance
import numpy as np
import throughput as throughput_benchmark

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives
from meshtron.models.moe import routing_statistics
from meshtron.train.loop import Trainer

QUALITY = {"dense (mlp 384)": ("llama_cpu8", []),
           "8 experts top-2 (mlp 192)": ("mixtral_cpu8", [])}
THROUGHPUT = {"8 experts top-2 (mlp 192)": ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=192"],
              "64 experts top-8 (mlp 48)": ["model.moe.experts=64", "model.moe.top_k=8", "model.moe.mlp_dim=48"]}
FINE = ["model.moe.experts=64", "model.moe.top_k=8", "model.moe.mlp_dim=24"]
SOFTMAX_AUX = ["model.moe.router=softmax", "model.moe.aux_loss_weight=0.01", "model.moe.z_loss_weight=0.001"]
SIGMOID_BIAS = ["model.moe.router=sigmoid", "model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0"]
RATE = 0.01  # the bias's step: DeepSeek-V3 used 1e-3 over far more steps; 200 steps need a larger one
FINE_GRAINED = {"64 x 24 top-8, sigmoid + bias": [*FINE, *SIGMOID_BIAS, f"model.moe.bias_update_rate={RATE}"],
                "64 x 24 top-8, softmax + aux loss": [*FINE, *SOFTMAX_AUX],
                "8 x 96 top-2, softmax + aux loss": ["model.moe.experts=8", "model.moe.top_k=2",
                                                     "model.moe.mlp_dim=96", *SOFTMAX_AUX]}
SKEW = (1, 0.1)  # (hot experts, bias offset): expert 0 wins every token's selection at the start
BALANCING = {f"bias rule, rate {RATE}": [f"model.moe.bias_update_rate={RATE}"],
             "bias fixed, rate 0": ["model.moe.bias_update_rate=0", "model.moe.selection_bias=true"]}
BALANCING_BASE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.mlp_dim=96", *SIGMOID_BIAS,
                  "train.batch_size=32"]
THRESHOLD = 1.3


def expert_load(trainer: Trainer, params) -> dict | None:
    """Max and min over experts of the assignments each got, relative to the mean, per layer, on a
    held-out batch (None for a dense model)."""
    t = trainer.cfg.train
    stream = trainer.corpus.heldout_stream(batch_size=t.batch_size, seq_len=trainer.cfg.model.seq_len, seed=t.seed)
    tokens = np.asarray(stream.rows(0, slice(None)))[:, :-1]
    md = trainer.model_def
    with md.scope(trainer.execution):  # on one device: the canonical parameters, every expert whole
        stats = jax.jit(lambda p, x: routing_statistics(md.bind(p), x))(jax.device_get(params), tokens)
    if stats is None:
        return None
    loads = np.asarray(stats.load, np.float64)  # [layers, experts]
    return {"max_over_mean": (loads.max(-1) / loads.mean(-1)).tolist(),
            "min_over_mean": (loads.min(-1) / loads.mean(-1)).tolist(),
            "aux_loss": np.asarray(stats.aux_loss, np.float64).tolist()}


def quality(steps: int) -> dict:
    out = {}
    for name, (config, overrides) in QUALITY.items():
        cfg = load_config(config, [f"train.steps={steps}", f"train.eval_every={steps}", *overrides])
        trainer = Trainer.from_config(cfg)
        result = trainer.run()
        out[name] = {"config": config, "heldout_loss": result.heldout_loss, "unigram_loss": result.unigram_loss,
                     "tokens_per_s": result.tokens_per_s, "final_train_loss": result.losses[-1],
                     "parameters": int(sum(x.size for x in jax.tree.leaves(result.params))),
                     "load": expert_load(trainer, result.params)}
        print(f"  (a) {name}: held-out {result.heldout_loss:.4f}, {result.tokens_per_s:,.0f} tok/s", flush=True)
    return out


def throughput(steps: int) -> dict:
    out = {}
    for name, overrides in THROUGHPUT.items():
        trainer = Trainer.from_config(load_config("mixtral_cpu8", overrides))
        params = trainer.init_params()
        opt_state = trainer.steps.init_opt_state(params)
        batch = trainer.train_stream().next(trainer.steps.batch_sharding)
        compiled = trainer.steps.compile(params, opt_state, batch)
        flops = float(compiled.cost_analysis().get("flops", float("nan")))
        sent = {}
        for c in collectives(compiled, trainer.mesh):
            if "data" in c.axes:
                sent[c.kind] = sent.get(c.kind, 0.0) + c.total_wire_bytes
        times = throughput_benchmark.trainer_step_times(trainer, steps)
        out[name] = {"step_seconds": statistics.median(times), "times": times, "flops_per_device": flops,
                     "data_bytes_by_kind": sent}
        print(f"  (b) {name}: {statistics.median(times):.3f} s/step, {flops / 1e9:.2f} GFLOP/device, "
              f"{sum(sent.values()) / 2**20:.1f} MiB over data", flush=True)
    return out


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(results["quality"])
    left.bar(names, [results["quality"][n]["heldout_loss"] for n in names], color=["tab:gray", "tab:blue"])
    left.set_ylabel(f"held-out loss after {results['steps']} steps (nats/token)")
    left.set_ylim(bottom=min(results["quality"][n]["heldout_loss"] for n in names) * 0.9)
    names = list(results["throughput"])
    right.bar(names, [results["throughput"][n]["step_seconds"] for n in names], color=["tab:blue", "tab:orange"])
    right.set_ylabel("median step seconds (XLA:CPU, 8 simulated devices)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Mixture of experts on data 2 x pipe 2 x tensor 2: quality at equal active parameters, "
                 "throughput at equal active FLOPs", fontsize=9)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "moe.png", dpi=120)


def fine_grained(steps: int) -> dict:
    out = {}
    for name, overrides in FINE_GRAINED.items():
        run = moe_balance.train_recording_load(name, overrides, steps)
        out[name] = run.summary()
        print(f"  (c) {name}: held-out {run.heldout_loss:.4f}, {run.tokens_per_s:,.0f} tok/s, dropped {run.dropped} "
              f"of {run.routed:,} (expected {run.expected_routed:,})", flush=True)
    return out


def balancing(steps: int) -> dict:
    out = {}
    for name, overrides in BALANCING.items():
        run = moe_balance.train_recording_load(name, [*BALANCING_BASE, *overrides], steps, skew=SKEW)
        out[name] = run.summary()
        print(f"  (d) {name}: first under {THRESHOLD} at step {run.first_below(THRESHOLD)}, final "
              f"{run.imbalance[-1]:.3f}", flush=True)
    return out


def tail_mean(values: list[float], last: int = 50) -> float:
    return float(np.mean(values[-last:]))


def report_fine_grained(steps: int) -> None:
    results = {"steps": steps, "model": moe_balance.TINY, "rate": RATE, "runs": fine_grained(steps)}
    rows = [[name, f"{r['parameters']:,}", f"{r['heldout_loss']:.4f}", f"{r['imbalance'][0]:.2f}",
             f"{tail_mean(r['imbalance']):.2f}", f"{max(r['imbalance'][-50:]):.2f}", f"{r['dropped']}",
             f"{r['routed']:,}", f"{r['tokens_per_s']:,.0f}"] for name, r in results["runs"].items()]
    print(f"\n(c) {steps} steps, 192 active feed-forward columns per token")
    _common.print_table(["router", "parameters", "held-out loss", "busiest/mean step 1", "mean last 50",
                         "max last 50", "dropped", "routed", "tokens/s"], rows)
    _common.write_results("moe_fine_grained", results)
    plot_load("moe_fine_grained", results["runs"], f"(c) busiest expert / mean, every step's batch (worst layer), "
              f"{steps} steps")


def report_balancing(steps: int) -> None:
    results = {"steps": steps, "model": [*moe_balance.TINY, *BALANCING_BASE], "skew": SKEW, "threshold": THRESHOLD,
               "runs": balancing(steps)}
    rows = [[name, f"{r['imbalance'][0]:.2f}", str(r["first_below_1.3"]), str(r["stays_below_1.3_from"]),
             f"{tail_mean(r['imbalance']):.2f}", f"{r['imbalance'][-1]:.2f}",
             f"{r['bias_range'][-1][0]:.3f} .. {r['bias_range'][-1][1]:.3f}", f"{r['heldout_loss']:.4f}"]
            for name, r in results["runs"].items()]
    print(f"\n(d) {steps} steps from expert 0 of 8 taking every token, no balance loss")
    _common.print_table(["selection bias", "step 1", f"first < {THRESHOLD}", f"< {THRESHOLD} from", "mean last 50",
                         "final", "bias range at the end", "held-out loss"], rows)
    _common.write_results("moe_balancing", results)
    plot_load("moe_balancing", results["runs"], "(d) busiest expert / mean from a skewed start, no balance loss "
              "(8 experts top-2, sigmoid)", threshold=THRESHOLD)


def plot_load(name: str, runs: dict, title: str, threshold: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, r in runs.items():
        ax.plot(range(1, len(r["imbalance"]) + 1), r["imbalance"], label=f"{label} (held-out {r['heldout_loss']:.3f})",
                linewidth=1)
    if threshold is not None:
        ax.axhline(threshold, color="black", linestyle="--", linewidth=0.8, label=f"{threshold}")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's load / mean (worst layer)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["ab", "c", "d"], default="ab",
                        help="ab: quality and throughput; c: fine-grained experts; d: the balancing figure")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each model in (a)")
    parser.add_argument("--throughput-steps", type=int, default=20, help="timed steps of each model in (b)")
    parser.add_argument("--balance-steps", type=int, default=200, help="training steps of each run in (c) and (d)")
    args = parser.parse_args()
    if args.part == "c":
        return report_fine_grained(args.balance_steps)
    if args.part == "d":
        return report_balancing(args.balance_steps)
    results = {"steps": args.steps, "quality": quality(args.steps), "throughput": throughput(args.throughput_steps)}
    rows = [[name, f"{r['parameters']:,}", f"{r['heldout_loss']:.4f}", f"{r['tokens_per_s']:,.0f}",
             "-" if r["load"] is None else f"{max(r['load']['max_over_mean']):.2f}"]
            for name, r in results["quality"].items()]
    print(f"\n(a) {args.steps} steps on the default data and mesh")
    _common.print_table(["model", "parameters", "held-out loss", "tokens/s", "busiest expert / mean"], rows)
    rows = [[name, f"{r['step_seconds']:.3f}", f"{r['flops_per_device'] / 1e9:.2f}",
             f"{sum(r['data_bytes_by_kind'].values()) / 2**20:.1f}"] for name, r in results["throughput"].items()]
    print("\n(b) equal active FLOPs")
    _common.print_table(["experts", "step s", "compiled GFLOP / device", "MiB over data / step"], rows)
    _common.write_results("moe", results)
    plot(results)


if __name__ == "__main__":
    main()
