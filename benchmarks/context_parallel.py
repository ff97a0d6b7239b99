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

``--exchanges`` runs, instead, the comparison of the four exchanges at long context (about 8 minutes on 2
cores for the CPU grid; ``--compilers h100`` on the py3.12 environment for compile-only H100s):

* **Llama-2 7B at 32K and 128K tokens** (real dimensions, 32 heads, bf16 compute, full recomputation,
  one sequence), the same per-rank forward and backward pass as **memory**, compiled for c context
  ranks with ``gathered``, ``ring``, ``ulysses`` (c = 2 .. 32: every rank then attends over the whole
  sequence for 32/c heads) and ``hybrid`` (Ulysses over u ranks x a ring over c/u; u = 2 .. c/2,
  c = 4 .. 32): each rank's activations and working memory, and the bytes it sends over ``context``
  per attention layer and microbatch, read from the compiled program's collectives beside
  :func:`meshtron.models.context_attention.exchange_bytes`. On XLA:CPU with XLA's attention (the
  scores materialised); for H100 with cuDNN's fused attention.
* **where each wins**: the causal attention FLOPs each rank computes per layer (forward, the
  recomputed forward and the backward: ``4 · 2·S²·h·d / c``, half the score matrix masked) over its
  bytes, against an H100's peak FLOPs over its NVLink and its InfiniBand bandwidth per GPU
  (``src/meshtron/plan/clusters/h100-80gb.yaml``): above those, the exchange can hide behind the
  attention it feeds.

Those write the ``exchanges`` section of ``results/context_parallel.json`` (the other sections are kept)
and ``results/context_parallel_exchanges.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--exchanges" in sys.argv:  # hybrid and Ulysses to 32 context ranks; compile-only H100s need the plugin's setup
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=32")
    from meshtron.gpu.targets import prepare_environment

    prepare_environment()

import _common
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives
from meshtron.models.context_attention import balanced_order, exchange_bytes
from meshtron.plan import load_cluster
from meshtron.plan.model import ulysses_ranks
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
    return seven_b_pass(c, seq, exchange)[0].memory_analysis().temp_size_in_bytes


def seven_b_pass(c: int, seq: int, exchange: str, ulysses_degree: int = 1, compiler: str = "cpu",
                 attention: str = "xla"):
    """``(compiled program, mesh)`` of :func:`seven_b`'s pass, for ``exchange`` (``ulysses_degree``: the
    hybrid's all-to-all group), on simulated CPU devices or compile-only GPUs of the target ``compiler``."""
    cfg = load_config("llama2_7b", ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", f"parallel.context={c}",
                                    f"model.seq_len={seq}", f"model.max_position_embeddings={max(seq, 4096)}",
                                    "train.batch_size=1", "parallel.microbatches=1", "model.remat=full",
                                    f"parallel.context_attention={exchange}", f"model.attention={attention}",
                                    *([f"parallel.ulysses_degree={ulysses_degree}"] if exchange == "hybrid" else [])])
    if compiler == "cpu":
        trainer = Trainer.from_config(cfg, jax.devices("cpu")[:c], read_data=False)
    else:
        trainer = Trainer.from_config(cfg, target=compiler, read_data=False)
    md, mesh, execution = trainer.model_def, trainer.mesh, trainer.execution
    params, _, tokens = trainer.abstract_step_arguments()
    u = ulysses_ranks(exchange, c, ulysses_degree)

    def per_rank(params, tokens):
        params = jax.tree.map(lambda x: jax.lax.pcast(x, "context", to="varying"), params)
        return jax.tree.map(lambda g: g[None], jax.grad(lambda p: md.loss(p, tokens, execution))(params))

    def local_gradients(params, tokens):
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P(None, "context")), out_specs=P("context"),
                             axis_names={"context"})(params, context_layout(tokens, c, u))

    with jax.set_mesh(mesh):
        program = jax.jit(md.traced(local_gradients, execution)).lower(params, tokens).compile()
    return program, mesh


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


SEVEN_B = {"layers": 32, "heads": 32, "kv_heads": 32, "head_dim": 128}
EXCHANGES = ("gathered", "ring", "ulysses", "hybrid")


def exchange_grid(ranks: list[int]) -> list[tuple[str, int, int]]:
    """``(exchange, c, u)``: gathered, ring and Ulysses at every c; the hybrid at every u with 1 < u < c."""
    grid = [(exchange, c, ulysses_ranks(exchange, c)) for exchange in EXCHANGES[:3] for c in ranks]
    grid += [("hybrid", c, u) for c in ranks for u in range(2, c) if c % u == 0]
    return grid


def attention_flops(seq: int, c: int) -> float:
    """Causal attention FLOPs one of ``c`` ranks computes per layer of the 7B pass, as much on every rank
    (the layouts balance it): a forward's two matmuls of ``2·S·S·h·d`` each, half of them masked, and
    four forwards' worth in all (the forward, its recomputation, the backward's twice as many)."""
    forward = 2 * (2 * seq * seq * SEVEN_B["heads"] * SEVEN_B["head_dim"]) / 2
    return 4 * forward / c


def exchanges(lengths: list[int], ranks: list[int], compilers: list[str]) -> list[dict]:
    """Every (exchange, c, u) of :func:`exchange_grid` at every length, per compiler: the compiled pass's
    temporaries and bytes over context per layer, the formula's, and the attention FLOPs per byte."""
    rows = []
    h100 = load_cluster("h100-80gb")
    for compiler in compilers:
        attention = "xla" if compiler == "cpu" else "cudnn"
        for seq in lengths:
            for exchange, c, u in exchange_grid(ranks):
                started = time.perf_counter()
                try:
                    program, mesh = seven_b_pass(c, seq, exchange, u, compiler, attention)
                except Exception as err:  # noqa: BLE001 - a shape one exchange cannot compile is a row, not the end
                    first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
                    print(f"  {compiler} {exchange:8s} c={c} u={u} seq={seq}: not compiled ({first})", flush=True)
                    rows.append({"compiler": compiler, "exchange": exchange, "c": c, "u": u, "seq": seq,
                                 "error": first})
                    continue
                seconds = time.perf_counter() - started
                temp = program.memory_analysis().temp_size_in_bytes
                sent = sum(x.total_wire_bytes for x in collectives(program, mesh)
                           if x.axes == ("context",) and x.kind != "all-reduce") / SEVEN_B["layers"]
                del program
                jax.clear_caches()  # fifty 7B programs would not fit in the machine's memory together
                forward, backward = exchange_bytes(exchange, c, seq // c, SEVEN_B["kv_heads"], SEVEN_B["head_dim"], 2,
                                                   heads=SEVEN_B["heads"],
                                                   ulysses_degree=u if exchange == "hybrid" else None)
                formula = 2 * forward + backward  # full recomputation reruns the forward's exchange
                wide = exchange_bytes(exchange, c, seq // c, SEVEN_B["kv_heads"], SEVEN_B["head_dim"], 4,
                                      heads=SEVEN_B["heads"], ulysses_degree=u if exchange == "hybrid" else None)
                flops = attention_flops(seq, c)
                rows.append({"compiler": compiler, "attention": attention, "exchange": exchange, "c": c, "u": u,
                             "seq": seq, "activation_gb": temp / GB, "compiled_mb_per_layer": sent / 1e6,
                             "formula_mb_per_layer": formula / 1e6,
                             "formula_fp32_mb_per_layer": (2 * wide[0] + wide[1]) / 1e6,  # XLA:CPU widens 16 bits
                             "attention_gflops": flops / 1e9,
                             "flops_per_byte": flops / formula, "compile_seconds": round(seconds, 1)})
                print(f"  {compiler} {exchange:8s} c={c:2d} u={u:2d} seq={seq}: {temp / GB:.1f} GB, "
                      f"{sent / 1e6:.0f} MB/layer (formula {formula / 1e6:.0f}), {flops / formula:,.0f} FLOPs/byte, "
                      f"{seconds:.0f} s", flush=True)
    thresholds = {"nvlink": h100.peak_tflops * 1e12 / (h100.nvlink_gbps * 1e9),
                  "network": h100.peak_tflops * 1e12 / (h100.network_gbps * 1e9 / h100.gpus_per_node)}
    for row in rows:
        row["h100_flops_per_byte"] = thresholds
    return rows


def exchange_rows(rows: list[dict]) -> list[list]:
    return [[r["compiler"], r["seq"] // 1024, r["exchange"], r["c"], r["u"] if r["exchange"] == "hybrid" else "",
             f"{r['activation_gb']:.1f}" if "error" not in r else "-",
             f"{r['compiled_mb_per_layer']:.0f}" if "error" not in r else "-",
             f"{r['formula_mb_per_layer']:.0f}" if "error" not in r else "-",
             (f"{r['formula_fp32_mb_per_layer']:.0f}" if r["compiler"] == "cpu" else "") if "error" not in r else "-",
             f"{r['flops_per_byte']:,.0f}" if "error" not in r else r["error"][:60]] for r in rows]


EXCHANGE_HEADER = ["compiler", "K tokens", "exchange", "c", "u", "GB/device", "MB/layer compiled", "MB/layer formula",
                   "as fp32 (XLA:CPU)", "attention FLOPs/byte"]


def plot_exchanges(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["seq"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    mem, sent, ratio = axes
    styles = {"gathered": "-o", "ring": "--s", "ulysses": "-^", "hybrid": ":D"}

    def series(exchange: str, seq: int, compiler: str, key: str):
        chosen = [r for r in rows if r["exchange"] == exchange and r["seq"] == seq and r["compiler"] == compiler
                  and "error" not in r]
        if exchange == "hybrid":  # the largest Ulysses group below c: u = c/2
            chosen = [r for r in chosen if r["u"] == r["c"] // 2]
        return [r["c"] for r in chosen], [r[key] for r in chosen]

    compiler = "cpu" if any(r["compiler"] == "cpu" for r in rows) else rows[0]["compiler"]
    for exchange, style in styles.items():
        for seq in lengths:
            label = f"{exchange}{' u=c/2' if exchange == 'hybrid' else ''} {seq // 1024}K"
            mem.plot(*series(exchange, seq, compiler, "activation_gb"), style, label=label)
            sent.plot(*series(exchange, seq, compiler, "formula_mb_per_layer"), style, label=label)
            ratio.plot(*series(exchange, seq, compiler, "flops_per_byte"), style, label=label)
    thresholds = rows[0]["h100_flops_per_byte"]
    ratio.axhline(thresholds["nvlink"], color="grey", lw=0.8)
    ratio.text(2, thresholds["nvlink"] * 1.1, "H100 peak / NVLink", fontsize=7)
    ratio.axhline(thresholds["network"], color="grey", lw=0.8, ls="--")
    ratio.text(2, thresholds["network"] * 1.1, "H100 peak / InfiniBand per GPU", fontsize=7)
    for ax, title, ylabel in ((mem, f"Llama-2 7B activations per device ({compiler}, compiled)", "GB"),
                              (sent, "bytes over context per layer and microbatch", "MB"),
                              (ratio, "causal attention FLOPs per byte sent", "FLOPs / byte")):
        ax.set(xscale="log", yscale="log", xlabel="context ranks c", ylabel=ylabel, title=title)
        ax.set_xticks(sorted({r["c"] for r in rows}), [str(c) for c in sorted({r["c"] for r in rows})])
        ax.minorticks_off()
    mem.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "context_parallel_exchanges.png", dpi=120)


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
    parser.add_argument("--exchanges", action="store_true",
                        help="instead: the four exchanges on Llama-2 7B at long context (the 'exchanges' section)")
    parser.add_argument("--exchange-lengths", default="32768,131072", help="--exchanges: 7B sequence lengths")
    parser.add_argument("--ranks", default="2,4,8,16,32", help="--exchanges: context sizes c")
    parser.add_argument("--compilers", default="cpu", help="--exchanges: cpu (simulated devices), h100 (compile-only)")
    args = parser.parse_args()
    if args.plot_only:
        import json

        plot(json.loads((_common.RESULTS / "context_parallel.json").read_text()))
        return
    if args.exchanges:
        import json

        compilers = args.compilers.split(",")
        rows = exchanges([int(x) for x in args.exchange_lengths.split(",")], [int(x) for x in args.ranks.split(",")],
                         compilers)
        path = _common.RESULTS / "context_parallel.json"  # read now: a run for another compiler may have written it
        previous = json.loads(path.read_text()) if path.exists() else {}
        previous.pop("machine", None)
        kept = [r for r in previous.get("exchanges", []) if r["compiler"] not in compilers]  # another compiler's run
        previous["exchanges"] = kept + rows
        print("\nLlama-2 7B, one sequence: per device activations, bytes over context per layer and microbatch, "
              "attention FLOPs per byte")
        _common.print_table(EXCHANGE_HEADER, exchange_rows(previous["exchanges"]))
        thresholds = rows[0]["h100_flops_per_byte"]
        print(f"H100 peak FLOPs per byte of NVLink: {thresholds['nvlink']:,.0f}; of InfiniBand per GPU: "
              f"{thresholds['network']:,.0f}")
        path = _common.write_results("context_parallel", previous)
        plot_exchanges(previous["exchanges"])
        print(f"\nwrote {path} (exchanges) and {path.with_name('context_parallel_exchanges.png')}")
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
