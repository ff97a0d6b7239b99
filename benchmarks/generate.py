"""Generation speed: KV-cache decoding vs re-running the full window, for both model families.

Default-size models (``ModelConfig`` defaults: 4 layers, hidden 128, 4 heads, MLP 512, byte
vocabulary; Llama with 2 key/value heads and MLP 384) with a context of 512 tokens
(``seq_len=512``). Greedy decoding of ``--new-tokens`` (256) tokens after a 64-token prompt, so the
window fills to 320 of 512 positions and never slides: after one prefill every step of the cached
path is a one-token step, while the full-window path runs the whole 512-token buffer for every
token. Each path: one warm-up call (compiles), then the median of ``--repeats`` (3) timed calls of
``Sampler.sample`` (prefill, all decoding chunks, tokens back on the host). Both paths must
produce identical tokens.

Mesh: ``--mesh 1,1,1`` by default -- one simulated device, which on this 2-core CPU is the fair
choice: XLA's intra-op threads give either path both cores, and no simulated collective (which
costs a thread rendezvous per all-reduce, dominating one-token steps) distorts the comparison.
Any mesh with ``pipe=1`` works (e.g. ``--mesh 1,1,2`` for the tensor-parallel cache).

    .venv/bin/python benchmarks/generate.py [--new-tokens N] [--repeats R] [--mesh D,P,T]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import jax
import numpy as np

from meshtron.config import MeshConfig, ModelConfig
from meshtron.execution import Execution
from meshtron.generate import Sampler
from meshtron.mesh import build_mesh
from meshtron.train.state import model_def_from_config

CONTEXT = 512
PROMPT = b"The quick brown fox jumps over the lazy dog; meshtron wrote it!!"
assert len(PROMPT) == 64
FAMILIES = {
    "gpt": ModelConfig(seq_len=CONTEXT),
    "llama": ModelConfig(family="llama", kv_heads=2, mlp_dim=384, seq_len=CONTEXT),
}
PATHS = {"KV cache": True, "full window": False}


def timed_runs(sampler: Sampler, params, new_tokens: int, repeats: int) -> tuple[list[float], tuple[int, ...]]:
    """Seconds per ``sample`` call after a warm-up (compilation) call, and the generated tokens."""
    tokens = sampler.sample(params, list(PROMPT), max_new_tokens=new_tokens).new_tokens
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        again = sampler.sample(params, list(PROMPT), max_new_tokens=new_tokens).new_tokens
        times.append(time.perf_counter() - start)
        assert again == tokens
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="1,1,1", help="data,pipe,tensor (pipe must be 1 for the KV cache)")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.mesh.split(","))
    mesh = build_mesh(MeshConfig(*shape), jax.devices()[: int(np.prod(shape))])
    mesh_name = "x".join(map(str, shape))
    assert len(PROMPT) + args.new_tokens <= CONTEXT, "the benchmark measures decoding without sliding"

    rows, results = [], {}
    for family, cfg in FAMILIES.items():
        md = model_def_from_config(cfg, shape[2])
        params = md.init(mesh, seed=0)
        runs, tokens = {}, {}
        for path, use_cache in PATHS.items():
            sampler = Sampler(md, mesh, execution=Execution.of_model_config(cfg), context=CONTEXT,
                              use_cache=use_cache)
            runs[path], tokens[path] = timed_runs(sampler, params, args.new_tokens, args.repeats)
        identical = tokens["KV cache"] == tokens["full window"]
        full_median = statistics.median(runs["full window"])
        results[family] = {"model": md.describe(), "identical_tokens": identical, "paths": {}}
        for path, times in runs.items():
            median = statistics.median(times)
            results[family]["paths"][path] = {
                "median_s": median, "tokens_per_s": args.new_tokens / median, "ms_per_token": 1e3 * median /
                args.new_tokens, "speedup_vs_full_window": full_median / median, "times_s": times,
            }
            rows.append([family, md.describe(), path, f"{median:.3f}", f"{args.new_tokens / median:,.1f}",
                         f"{1e3 * median / args.new_tokens:.2f}", f"{full_median / median:.1f}x",
                         "yes" if identical else "NO"])
    print(f"mesh {mesh_name}, context {CONTEXT}, prompt {len(PROMPT)} tokens, {args.new_tokens} new tokens (greedy), "
          f"median of {args.repeats} runs after a warm-up")
    _common.print_table(["family", "model", "path", "median s", "tokens/s", "ms/token", "speedup", "same tokens"],
                        rows)
    path = _common.write_results("generate", {
        "mesh": mesh_name, "context": CONTEXT, "prompt_tokens": len(PROMPT), "new_tokens": args.new_tokens,
        "repeats": args.repeats, "families": results,
    })
    plot(results, mesh_name, args.new_tokens)
    print(f"wrote {path}")
    if not all(r["identical_tokens"] for r in results.values()):
        raise SystemExit("KV-cache and full-window tokens differ")


def plot(results: dict, mesh_name: str, new_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 3.5))
    families = list(results)
    width = 0.38
    for i, path in enumerate(PATHS):
        rates = [results[f]["paths"][path]["tokens_per_s"] for f in families]
        bars = ax.bar(np.arange(len(families)) + (i - 0.5) * width, rates, width, label=path)
        ax.bar_label(bars, labels=[f"{r:,.0f}" for r in rates], fontsize=8)
    ax.set_xticks(np.arange(len(families)), families)
    ax.set_yscale("log")
    top = max(r["tokens_per_s"] for f in families for r in results[f]["paths"].values())
    ax.set_ylim(1, top * 10)  # room above the bars for the legend
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("tokens/s (log scale)")
    ax.set_title(f"greedy decoding, {new_tokens} new tokens, context {CONTEXT}, mesh {mesh_name}")
    ax.legend(loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "generate.png", dpi=120)


if __name__ == "__main__":
    main()
