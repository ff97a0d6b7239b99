"""Training throughput from a streamed source against the same text pre-tokenised.

The default model (``mesh_configs/cpu8.yaml``, what ``make train`` runs: 8 simulated CPU devices, 2-way
data x 2-stage interleaved pipeline x 2-way tensor, byte tokens) trains on the built-in corpus split
into its paragraphs (one example each), read two ways:

* **pre-tokenised**: the paragraphs as JSON lines, through ``meshtron preprocess`` into an indexed
  dataset (``data.path=PREFIX``), read by memory map;
* **streamed**: the same paragraphs as a Parquet file read with ``data.source=hf`` (``datasets``'
  streaming reader), tokenized and packed by the background thread while the run trains.

Both trainers are built (and compiled) first; then ``--rounds`` rounds alternate them, each a fresh
run of ``--steps`` steps (evaluation and checkpoints off). A step's time is the wall time between the
ends of consecutive steps (the first ``--skip`` steps of each run left out: the thread's first batches
and the first dispatch); tokens/s is ``batch x seq_len`` over the median step time of all rounds.

    .venv/bin/python benchmarks/streaming.py [--steps 30] [--rounds 3] [--skip 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _common
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from meshtron.config import load_config
from meshtron.data.preprocess import preprocess
from meshtron.data.text import builtin_text
from meshtron.train.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu8.yaml"
KINDS = ("pre-tokenised", "streamed")


def corpus(root: Path) -> dict[str, list[str]]:
    """The built-in corpus's paragraphs as an indexed dataset and as Parquet: the overrides of each."""
    texts = [p for p in (q.strip() for q in builtin_text().split("\n\n")) if p]
    jsonl = root / "paragraphs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(jsonl)], "bytes", root / "paragraphs", progress=False)
    pq.write_table(pa.table({"text": texts}), root / "paragraphs.parquet")
    return {"pre-tokenised": [f"data.path={root / 'paragraphs'}"],
            "streamed": ["data.source=hf", f"data.path={root / 'paragraphs.parquet'}"]}


def step_times(trainer: Trainer, skip: int) -> list[float]:
    ends: list[float] = []
    trainer.run(console=Console(quiet=True), on_event=lambda event, step: ends.append(time.perf_counter())
                if event == "done" else None)
    return [b - a for a, b in zip(ends[skip:], ends[skip + 1:])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = corpus(Path(tmp))
        common = [f"train.steps={args.steps}", "train.eval_every=100000", "train.eval_batches=1",
                  "train.log_every=100000"]
        trainers = {k: Trainer.from_config(load_config(CONFIG, [*common, *overrides[k]])) for k in KINDS}
        cfg = trainers["streamed"].cfg
        tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        for kind in KINDS:  # compile and warm both before measuring
            step_times(trainers[kind], args.skip)
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        per_round: list[dict[str, float]] = []
        for _ in range(args.rounds):
            medians = {}
            for kind in KINDS:
                measured = step_times(trainers[kind], args.skip)
                times[kind].extend(measured)
                medians[kind] = tokens_per_step / statistics.median(measured)
            per_round.append(medians)
    rates = {k: tokens_per_step / statistics.median(times[k]) for k in KINDS}
    ratio = rates["streamed"] / rates["pre-tokenised"]
    rows = [[k, f"{statistics.median(times[k]) * 1e3:.0f}", f"{rates[k]:,.0f}", len(times[k])] for k in KINDS]
    _common.print_table(["data", "median step ms", "tokens/s", "steps timed"], rows)
    print(f"streamed / pre-tokenised tokens/s: {ratio:.3f}")
    payload = {"config": "mesh_configs/cpu8.yaml", "tokens_per_step": tokens_per_step, "steps": args.steps,
               "rounds": args.rounds, "skip": args.skip, "tokens_per_s": rates, "ratio": ratio,
               "per_round_tokens_per_s": per_round, "step_seconds": times}
    print(f"wrote {_common.write_results('streaming', payload)}")
    plot(times, ratio)


def plot(times: dict[str, list[float]], ratio: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([[t * 1e3 for t in times[k]] for k in KINDS], tick_labels=list(KINDS))
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"default model, cpu8: streamed / pre-tokenised tokens/s = {ratio:.3f}")
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "streaming.png", dpi=120)


if __name__ == "__main__":
    main()
