"""Context parallelism: per-device memory, bytes over ``context`` and step time against the number of
context ranks c and the sequence length, and the causal load per rank with and without balancing.

    .venv/bin/python benchmarks/context_parallel.py          # about 15 minutes on 2 cores

Four measurements, all from compiled programs or runs on simulated CPU devices:

* **memory** -- Llama-2 7B (real dimensions, bf16 compute, fp32 parameters, full recomputation, one
  sequence): each context rank's forward and backward pass over its share of the sequence, compiled
  from abstract arrays for 8K to 32K tokens on c = 1, 2, 4, 8 devices of one context group; nothing
  is allocated. The rank's gradients are the program's outputs, so its temporaries are the
  activations and the working memory of the pass (the train step adds the gradient reduction's
  buffer and the optimizer, the same for every c). XLA:CPU materialises the attention scores (a GPU
  run would use cuDNN's fused attention).
* **bytes** -- the bytes each device sends over ``context`` per attention layer and microbatch, read
  from the compiled step's collectives, against :func:`meshtron.models.context_attention.exchange_bytes`.
* **step time** -- a small Llama (hidden 128, 4 layers, 4 heads, 2 key/value heads) on 8 simulated
  devices, data x context = 8, a batch of 8 sequences (one sequence's worth of tokens per device), for
  sequences of 512 to 2048 tokens: median of timed steps after a compiled warmup.
* **balance** -- the causal attention a rank must compute (query-key pairs not masked) with the
  balanced layout and with contiguous slices, and the blocks the ring computes per rank.

Writes ``results/context_parallel.{json,png}``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives
from meshtron.models.context_attention import balanced_order, exchange_bytes
from meshtron.train.data_shards import context_layout
from meshtron.train.loop import Trainer

GB = 1e9
RANKS = (1, 2, 4, 8)
SMALL = ["model.family=llama", "model.hidden=128", "model.heads=4", "model.kv_heads=2", "model.layers=4",
         "model.mlp_dim=256", "model.vocab_size=256", "parallel.pipe=1", "parallel.tensor=1", "train.warmup_steps=1",
         "train.eval_every=100000", "train.eval_batches=1", "train.log_every=100000"]


def compiled(trainer: Trainer):
    params, opt_state, tokens = trainer.abstract_step_arguments()
    return trainer.steps.compile(params, opt_state, tokens)


def seven_b(c: int, seq: int, exchange: str) -> float:
    """Compiled temporaries (bytes per device) of a Llama-2 7B forward and backward pass on one
    ``seq``-token sequence split over ``c`` context ranks: each rank's own gradients are the
    program's outputs (stacked over the ranks, not reduced), so what it holds besides them is the
    activations and the working memory of the pass."""
    cfg = load_config("llama2_7b", ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", f"parallel.context={c}",
                                    f"model.seq_len={seq}", f"model.max_position_embeddings={max(seq, 4096)}",
                                    "train.batch_size=1", "parallel.microbatches=1", "model.remat=full",
                                    f"parallel.context_attention={exchange}"])
    trainer = Trainer.from_config(cfg, jax.devices()[:c], read_data=False)
    md, mesh, execution = trainer.model_def, trainer.mesh, trainer.execution
    params, _, tokens = trainer.abstract_step_arguments()

    def per_rank(params, tokens):
        params = jax.tree.map(lambda x: jax.lax.pcast(x, "context", to="varying"), params)
        return jax.tree.map(lambda g: g[None], jax.grad(lambda p: md.loss(p, tokens, execution))(params))

    def local_gradients(params, tokens):
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(None, "context")), out_specs=P("context"),
                             axis_names={"context"})(params, context_layout(tokens, c))

    with jax.set_mesh(mesh):
        program = jax.jit(md.traced(local_gradients, execution)).lower(params, tokens).compile()
    return program.memory_analysis().temp_size_in_bytes


def memory(lengths: list[int]) -> list[dict]:
    rows = []
    for exchange in ("gathered", "ring"):
        for c in RANKS:
            for seq in lengths:
                temp = seven_b(c, seq, exchange)
                rows.append({"exchange": exchange, "c": c, "seq": seq, "activation_gb": temp / GB})
                print(f"  7B {exchange:8s} c={c} seq={seq}: {temp / GB:.1f} GB", flush=True)
    for row in rows:
        one = next(r for r in rows if r["exchange"] == row["exchange"] and r["seq"] == row["seq"] and r["c"] == 1)
        row["of_c1"] = row["activation_gb"] / one["activation_gb"]
    return rows


def small_trainer(c: int, seq: int, exchange: str, steps: int = 1) -> Trainer:
    cfg = load_config(None, [*SMALL, f"parallel.data={8 // c}", f"parallel.context={c}", f"model.seq_len={seq}",
                             "train.batch_size=8", "parallel.microbatches=1", f"parallel.context_attention={exchange}",
                             f"train.steps={steps}"])
    return Trainer.from_config(cfg, jax.devices()[:8], read_data=False)


def exchanged(lengths: list[int]) -> list[dict]:
    rows = []
    for exchange in ("gathered", "ring"):
        for c in RANKS[1:]:
            seq = lengths[0]
            trainer = small_trainer(c, seq, exchange)
            sent = sum(x.total_wire_bytes for x in collectives(compiled(trainer), trainer.mesh)
                       if x.axes == ("context",) and x.kind != "all-reduce")
            per_layer = sent / 4
            rows_per_rank = 8 // (8 // c)  # batch 8 over data = 8 / c
            forward, backward = exchange_bytes(exchange, c, rows_per_rank * seq // c, kv_heads=2, head_dim=32)
            rows.append({"exchange": exchange, "c": c, "seq": seq, "compiled_kib": per_layer / 1024,
                         "formula_kib": (forward + backward) / 1024})
    return rows


def step_times(lengths: list[int], steps: int) -> list[dict]:
    rows = []
    for seq in lengths:
        for exchange in ("gathered", "ring"):
            for c in RANKS:
                if c == 1 and exchange == "ring":
                    continue  # no split: the same program as gathered
                trainer = small_trainer(c, seq, exchange, steps)
                rng = np.random.default_rng(0)
                params = trainer.init_params()
                opt_state = trainer.steps.init_opt_state(params)
                tokens = jax.device_put(rng.integers(0, 256, (8, seq + 1), dtype=np.int32), trainer.steps.batch_sharding)
                params, opt_state, metrics = trainer.steps.train(params, opt_state, tokens)  # compile + warm up
                metrics.mean()
                times = []
                for _ in range(steps):
                    started = time.perf_counter()
                    params, opt_state, metrics = trainer.steps.train(params, opt_state, tokens)
                    metrics.mean()
                    times.append(time.perf_counter() - started)
                median = statistics.median(times)
                rows.append({"exchange": exchange if c > 1 else "none", "c": c, "seq": seq, "step_s": median,
                             "tokens_per_s": 8 * seq / median})
                print(f"  step {exchange if c > 1 else 'none':8s} c={c} seq={seq}: {median * 1e3:.0f} ms", flush=True)
    return rows


def balance() -> list[dict]:
    rows = []
    for c in RANKS[1:]:
        seq = 64 * c
        for name, order in (("balanced", balanced_order(seq, c)), ("contiguous", np.arange(seq))):
            pairs = (order + 1).reshape(c, -1).sum(axis=1)  # a query at position p sees p + 1 keys
            ring_blocks = [(c + 1) / 2] * c if name == "balanced" else [r + 1 for r in range(c)]
            rows.append({"layout": name, "c": c, "pairs_max_over_mean": float(pairs.max() / pairs.mean()),
                         "ring_blocks_per_rank": ring_blocks,
                         "ring_blocks_max_over_mean": float(max(ring_blocks) / np.mean(ring_blocks))})
    return rows


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sent, speed) = plt.subplots(1, 3, figsize=(15, 4.2))
    for exchange, style in (("gathered", "-o"), ("ring", "--s")):
        for seq in sorted({r["seq"] for r in results["memory"]}):
            rows = [r for r in results["memory"] if r["exchange"] == exchange and r["seq"] == seq]
            mem.plot([r["c"] for r in rows], [r["activation_gb"] for r in rows], style, label=f"{exchange} {seq // 1024}K")
    mem.plot(RANKS, [max(r["activation_gb"] for r in results["memory"]) / c for c in RANKS], ":", color="grey",
             label="1/c")
    mem.set(xscale="log", yscale="log", xlabel="context ranks c", ylabel="GB per device",
            title="Llama-2 7B activations, forward + backward (compiled)")
    mem.set_xticks(RANKS, [str(c) for c in RANKS])
    mem.minorticks_off()
    mem.legend(fontsize=7)
    for exchange, style in (("gathered", "o"), ("ring", "s")):
        rows = [r for r in results["bytes"] if r["exchange"] == exchange]
        sent.plot([r["c"] for r in rows], [r["compiled_kib"] for r in rows], style, label=f"{exchange}, compiled")
        sent.plot([r["c"] for r in rows], [r["formula_kib"] for r in rows], "-", label=f"{exchange}, formula")
    sent.set(xlabel="context ranks c", ylabel="KiB per device, layer and microbatch",
             title="bytes over context (small Llama)")
    sent.legend(fontsize=7)
    for seq in sorted({r["seq"] for r in results["step_time"]}):
        for exchange, style in (("gathered", "-o"), ("ring", "--s")):
            rows = [r for r in results["step_time"] if r["seq"] == seq and (r["exchange"] == exchange or r["c"] == 1)]
            speed.plot([r["c"] for r in rows], [r["step_s"] * 1e3 for r in rows], style, label=f"{exchange} {seq}")
    speed.set(xlabel="context ranks c (data = 8 / c)", ylabel="ms per step", title="step time, 8 simulated devices")
    speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "context_parallel.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768", help="7B sequence lengths to compile")
    parser.add_argument("--step-lengths", default="512,1024,2048", help="small model's timed sequence lengths")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from results/context_parallel.json")
    args = parser.parse_args()
    if args.plot_only:
        import json

        plot(json.loads((_common.RESULTS / "context_parallel.json").read_text()))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    step_lengths = [int(x) for x in args.step_lengths.split(",")]

    results = {"balance": balance()}
    print("causal load per rank: max / mean (pairs a rank must compute; blocks the ring computes)")
    _common.print_table(["c", "layout", "pairs max/mean", "ring blocks per rank", "ring max/mean"],
                        [[r["c"], r["layout"], f"{r['pairs_max_over_mean']:.2f}",
                          ", ".join(f"{b:g}" for b in r["ring_blocks_per_rank"]), f"{r['ring_blocks_max_over_mean']:.2f}"]
                         for r in results["balance"]])
    results["bytes"] = exchanged(step_lengths)
    print("\nbytes over context per device, attention layer and microbatch")
    _common.print_table(["exchange", "c", "compiled KiB", "formula KiB"],
                        [[r["exchange"], r["c"], f"{r['compiled_kib']:.1f}", f"{r['formula_kib']:.1f}"]
                         for r in results["bytes"]])
    results["memory"] = memory(lengths)
    print("\nLlama-2 7B, one sequence: activations and working memory per device of a forward and backward pass (GB)")
    _common.print_table(["exchange", "c", "seq", "GB", "of c=1", "1/c"],
                        [[r["exchange"], r["c"], r["seq"], f"{r['activation_gb']:.1f}", f"{r['of_c1']:.3f}",
                          f"{1 / r['c']:.3f}"] for r in results["memory"]])
    results["step_time"] = step_times(step_lengths, args.steps)
    print("\nsmall Llama step on 8 simulated devices (data x context = 8), median")
    _common.print_table(["exchange", "c", "seq", "ms/step", "tokens/s"],
                        [[r["exchange"], r["c"], r["seq"], f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}"]
                         for r in results["step_time"]])
    path = _common.write_results("context_parallel", results)
    plot(results)
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
