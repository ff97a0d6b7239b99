"""DPO with preference pairs packed into windows (``data.pairs_per_window``) against one pair a window: the
padding each saves, pairs per window, and the step's compute per pair, on a small Llama with LoRA.

    .venv/bin/python benchmarks/dpo_packing.py     # [--pairs N] [--seq-len S] [--repeats R]

* **Pairs** -- ``--pairs`` (default 600) made-up pairs whose prompt and answers have a log-uniform number of
  words (prompt 2 to 30, each answer 1 to 20 words of 2 to 8 letters), so conversations run from about 30 to
  about 300 byte tokens, most of them short; ``meshtron preprocess --preference``, byte
  tokens, the chat template.
* **Layouts** -- one pair a window (``data.pairs_per_window=1``) and packed up to 2, 4 and 8 pairs a window
  pair, ``model.seq_len`` ``--seq-len`` (default 512). For each: the window pairs of the first epoch, pairs
  per window pair, and the share of window tokens that are padding.
* **Compute** -- ``llama_cpu8``'s model (hidden 128, 4 layers), LoRA rank 16 (the reference the frozen base:
  a second forward), one device. The step's forward and backward (``TrainSteps.gradients``) over a batch of
  8 window pairs, timed ``--repeats`` times after a first (compiling) call, the layouts taking turns;
  the median, and the pairs per second it makes (the batch's real pairs over the median). The loss of a
  packed batch is checked against one pair a window's over the same pairs.

Writes ``results/dpo_packing.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _common
import jax
import numpy as np

from meshtron.config import load_config
from meshtron.data.preference import PackedPairs, preprocess_preference
from meshtron.train.loop import Trainer

LETTERS = "abcdefghijklmnop"
WINDOWS = 8  # window pairs a batch


def phrase(rng: np.random.Generator, low: int, high: int) -> str:
    count = int(np.exp(rng.uniform(np.log(low), np.log(high + 1))))
    return " ".join("".join(rng.choice(list(LETTERS), size=int(rng.integers(2, 9)))) for _ in range(count))


def write_pairs(root: Path, count: int) -> Path:
    rng = np.random.default_rng(0)
    lines = [{"prompt": phrase(rng, 2, 30), "chosen": phrase(rng, 1, 20), "rejected": phrase(rng, 1, 20)}
             for _ in range(count)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    preprocess_preference(root / "pairs.jsonl", "bytes", root / "pairs", progress=False)
    return root / "pairs"


def config(data: Path, root: Path, seq_len: int, per_window: int, batch_size: int):
    return load_config("llama_cpu8", [
        "parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1",
        f"model.seq_len={seq_len}", f"model.max_position_embeddings={seq_len}", f"data.path={data}",
        "data.holdout_fraction=0.1", f"data.pairs_per_window={per_window}", f"train.batch_size={batch_size}",
        "train.objective=dpo", "train.lora.rank=16", "train.lora.alpha=32", "train.steps=1",
        f"checkpoint.dir={root / f'run-{per_window}'}"])


def epoch_layout(trainer: Trainer) -> dict:
    """The first epoch's window pairs, pairs per window pair and padding share of the training split."""
    pairs = trainer.corpus.train
    windows = pairs.samples_per_epoch if isinstance(pairs, PackedPairs) else pairs.num_pairs
    real = int(np.sum(np.minimum(pairs._lengths, pairs.seq_len + 1)))
    total = 2 * windows * (pairs.seq_len + 1)
    return {"pairs": pairs.num_pairs, "window_pairs": windows, "pairs_per_window": pairs.num_pairs / windows,
            "padding": 1 - real / total, "tokens_real": real, "tokens_windows": total}


def moved(params):
    """``params`` with random LoRA ``b`` matrices, so that the policy is off its reference (the loss check)."""
    rng = np.random.default_rng(1)

    def move(path, leaf):
        leaf = np.asarray(leaf)
        if getattr(path[-1], "key", None) == "kernel_lora_b":
            return leaf + 0.02 * rng.standard_normal(leaf.shape).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(move, jax.device_get(params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=600)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshtron-dpo-packing-"))
    data = write_pairs(root, args.pairs)
    layouts = (1, 2, 4, 8)
    trainers = {k: Trainer.from_config(config(data, root, args.seq_len, k, WINDOWS)) for k in layouts}
    params = jax.device_put(moved(trainers[1].starting_state(None)[0]), trainers[1].steps.param_shardings)
    found = {k: epoch_layout(t) for k, t in trainers.items()}
    batches = {k: t.train_stream().global_batch(0) for k, t in trainers.items()}
    held = {k: (WINDOWS if k == 1 else sum(len(trainers[k].corpus.train.window_pairs(i)) for i in range(WINDOWS)))
            for k in layouts}
    times: dict[int, list[float]] = {k: [] for k in layouts}
    for k in layouts:  # compile, and the loss against one pair a window over the same pairs
        loss, _ = trainers[k].steps.gradients(params, jax.numpy.asarray(batches[k]))
        found[k]["loss"] = float(loss)
        if k > 1:
            pairs = trainers[k].corpus.train
            plain = np.concatenate([pairs.pair(int(p)) for i in range(WINDOWS) for p in pairs.window_pairs(i)])
            probe = Trainer.from_config(config(data, root / "probe", args.seq_len, 1, held[k]))
            want, _ = probe.steps.gradients(params, jax.numpy.asarray(plain))
            found[k]["loss_one_pair_a_window"] = float(want)
    for _ in range(args.repeats):
        for k in layouts:
            start = time.perf_counter()
            jax.block_until_ready(trainers[k].steps.gradients(params, jax.numpy.asarray(batches[k])))
            times[k].append(time.perf_counter() - start)
    base = held[1] / statistics.median(times[1])
    rows = []
    for k in layouts:
        median = statistics.median(times[k])
        found[k].update(batch_pairs=held[k], step_seconds=times[k], median_seconds=median,
                        pairs_per_second=held[k] / median)
        rows.append([k, found[k]["window_pairs"], f"{found[k]['pairs_per_window']:.2f}",
                     f"{100 * found[k]['padding']:.1f}%", held[k], f"{median:.3f}",
                     f"{held[k] / median:.1f}", f"{held[k] / median / base:.2f}x",
                     f"{abs(found[k].get('loss_one_pair_a_window', found[k]['loss']) - found[k]['loss']):.1e}"])
    _common.print_table(["pairs_per_window", "window pairs (epoch)", "pairs / window pair", "padding",
                         f"pairs in {WINDOWS} window pairs", "step s (median)", "pairs/s", "vs 1",
                         "|loss - unpacked|"], rows)
    path = _common.write_results("dpo_packing", {"pairs": args.pairs, "seq_len": args.seq_len,
                                                 "repeats": args.repeats, "window_pairs_a_batch": WINDOWS,
                                                 "layouts": {str(k): v for k, v in found.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
