"""Supervised fine-tuning of a small Llama on a task its base cannot do: exact-match accuracy on held-out
prompts through generation, before and after, with the cost of each way of fine-tuning.

    .venv/bin/python benchmarks/fine_tune.py          # about 25 minutes on 2 cores

* **The task** -- instructions on short strings of the letters a-h: ``reverse``, ``sort`` or ``copy``
  a word of 3 to 6 letters (``{"prompt": "reverse bdca", "response": "acdb"}``). Training and held-out
  words never overlap. Written as JSON lines and preprocessed with ``meshtron preprocess --sft``
  (meshtron's chat template; the loss counts the answers alone), packed whole into 128-token windows.
* **The base** -- ``llama_cpu8`` (hidden 128, 4 layers, grouped-query attention; data x pipeline x
  tensor = 2 x 2 x 2, interleaved) pretrained on the built-in corpus for its 300 steps.
* **Fine-tuning** -- from the base's checkpoint (``train.init_from``), on the 8 simulated devices: the
  whole model (AdamW, lr 1e-3), or LoRA of rank 4, 16 and 64 (alpha = 2 x rank, lr 3e-3, 2e-3 and 1e-3)
  on every block matrix, and rank 16 with adapter dropout 0.1; gradients clipped at norm 1. Trainable parameters, optimizer state per device and bytes sent over ``data`` per step are
  read from each compiled train step; tokens/s is the whole run's (compilation included).
* **Accuracy** -- greedy generation (KV cache, one device) of each held-out prompt, its answer cut at
  the template's end marker, compared with the expected answer exactly.

Writes ``results/fine_tune.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common
import jax
import numpy as np

from meshtron.config import MeshConfig, load_config
from meshtron.data.sft import ChatTemplate, preprocess_sft
from meshtron.generate import Sampler
from meshtron.pretrained import load_pretrained
from meshtron.train.loop import Trainer

LETTERS = "abcdefgh"
TASKS = {"reverse": lambda w: w[::-1], "sort": lambda w: "".join(sorted(w)), "copy": lambda w: w}


def task_examples(words: list[str], rng: np.random.Generator) -> list[dict]:
    """One example per word, each with a task drawn at random."""
    names = list(TASKS)
    out = []
    for word in words:
        task = names[int(rng.integers(len(names)))]
        out.append({"prompt": f"{task} {word}", "response": TASKS[task](word)})
    return out


def split_words(train: int, heldout: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Distinct random words of 3-6 letters: ``train`` for fine-tuning, ``heldout`` never seen in it."""
    rng = np.random.default_rng(seed)
    words: dict[str, None] = {}
    while len(words) < train + heldout:
        words["".join(rng.choice(list(LETTERS), size=int(rng.integers(3, 7))))] = None
    ordered = list(words)
    return ordered[:train], ordered[train:]


def accuracy(checkpoint: Path, examples: list[dict]) -> float:
    """Exact-match accuracy of greedy answers (one device, KV cache) on ``examples``."""
    pretrained = load_pretrained(checkpoint, MeshConfig(1, 1, 1), jax.devices()[:1])
    template = ChatTemplate(pretrained.tokenizer)
    sampler = Sampler(pretrained.model_def, pretrained.mesh, execution=pretrained.execution)
    right = 0
    for example in examples:
        result = sampler.sample(pretrained.params, template.prompt(example["prompt"]), max_new_tokens=16)
        right += template.answer(result.new_tokens) == example["response"]
    return right / len(examples)


def train(overrides: list[str]) -> tuple[Trainer, float]:
    """Run ``llama_cpu8`` with ``overrides``: the trainer and its wall time (s)."""
    trainer = Trainer.from_config(load_config("llama_cpu8", overrides))
    start = time.perf_counter()
    trainer.run()
    return trainer, time.perf_counter() - start


def step_costs(overrides: list[str]) -> dict:
    """From the compiled train step of ``llama_cpu8`` with ``overrides`` (nothing runs): trainable
    parameters, optimizer state bytes per device, bytes each device sends over ``data`` per step."""
    trainer = Trainer.from_config(load_config("llama_cpu8", overrides), read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    trainer.steps.compile(params, opt_state, tokens)
    flags = trainer.steps.trainable.mask
    total = sum(x.size for x in jax.tree.leaves(params))
    trained = total if flags is None else sum(x.size for x, f in zip(jax.tree.leaves(params), jax.tree.leaves(flags))
                                              if f)

    def per_device(x) -> int:
        return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize

    return {"parameters": total, "trainable": trained, "trainable_fraction": trained / total,
            "optimizer_bytes_per_device": sum(per_device(x) for x in jax.tree.leaves(opt_state)),
            "data_bytes_per_step": trainer.steps.data_bytes()}


RUNS = {  # name: (train overrides, learning rate); alpha = 2 x rank, the peak rate falling with the rank
    "full": ([], 1e-3),
    "lora r=4": (["train.lora.rank=4", "train.lora.alpha=8"], 3e-3),
    "lora r=16": (["train.lora.rank=16", "train.lora.alpha=32"], 2e-3),
    "lora r=64": (["train.lora.rank=64", "train.lora.alpha=128"], 1e-3),
    "lora r=16, dropout 0.1": (["train.lora.rank=16", "train.lora.alpha=32", "train.lora.dropout=0.1"], 2e-3),
}


def checkpoint_bytes(directory: Path) -> int:
    """Bytes on disk of the newest step of a checkpoint directory (a LoRA run's: its adapters, their
    optimizer state and the pointer to its base)."""
    newest = max((p for p in directory.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    runs = [results["runs"][n] for n in names]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [("held-out exact match", [r["accuracy"] * 100 for r in runs], "%"),
              ("optimizer state per device", [r["optimizer_bytes_per_device"] / 1e6 for r in runs], "MB"),
              ("sent over data per step", [r["data_bytes_per_step"] / 1e6 for r in runs], "MB"),
              ("training throughput", [r["tokens_per_s"] / 1e3 for r in runs], "k tokens/s")]
    for ax, (title, values, unit) in zip(axes, panels):
        ax.bar(names, values, color=["#888"] + ["#3a7"] * (len(names) - 1))
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", rotation=30)
    axes[0].axhline(results["base_accuracy"] * 100, color="k", ls=":", label="base")
    axes[0].legend()
    fig.suptitle(f"fine-tuning llama_cpu8 on reverse/sort/copy ({results['steps']} steps, 2x2x2 mesh)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="fine-tuning steps (default 600)")
    parser.add_argument("--heldout", type=int, default=150, help="held-out prompts (default 150)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from results/fine_tune.json")
    args = parser.parse_args()
    png = _common.RESULTS / "fine_tune.png"
    if args.plot_only:
        plot(json.loads((_common.RESULTS / "fine_tune.json").read_text()), png)
        return
    work = Path(tempfile.mkdtemp(prefix="meshtron-finetune-"))
    rng = np.random.default_rng(0)
    train_words, heldout_words = split_words(6000, args.heldout)
    heldout = task_examples(heldout_words, rng)
    (work / "sft.jsonl").write_text("".join(json.dumps(e) + "\n" for e in task_examples(train_words, rng)))
    preprocess_sft(work / "sft.jsonl", "bytes", work / "sft", progress=False)

    base = work / "base"
    train([f"checkpoint.dir={base}", "train.eval_every=1000"])
    results = {"steps": args.steps, "heldout_prompts": len(heldout), "base_accuracy": accuracy(base, heldout),
               "runs": {}}
    rows = [["base (pretrained)", f"{results['base_accuracy']:.1%}", "-", "-", "-", "-", "-", "-"]]
    for name, (extra, lr) in RUNS.items():
        out = work / name.replace(" ", "").replace("=", "")
        common = [f"data.path={work / 'sft'}", f"train.steps={args.steps}", f"train.lr={lr}", "train.grad_clip=1.0",
                  *extra]
        costs = step_costs(common)
        _, seconds = train([f"train.init_from={base}", f"checkpoint.dir={out}", "train.warmup_steps=20",
                            "train.eval_every=200", "data.holdout_fraction=0.02", *common])
        tokens = args.steps * 32 * 128
        run = {"accuracy": accuracy(out, heldout), "seconds": seconds, "tokens_per_s": tokens / seconds, "lr": lr,
               "checkpoint_bytes": checkpoint_bytes(out), **costs}
        results["runs"][name] = run
        rows.append([name, f"{run['accuracy']:.1%}", f"{run['trainable_fraction']:.2%}",
                     f"{run['optimizer_bytes_per_device'] / 1e6:.2f}", f"{run['data_bytes_per_step'] / 1e6:.3f}",
                     f"{run['tokens_per_s']:,.0f}", f"{run['checkpoint_bytes'] / 1e6:.2f}", f"{lr:g}"])
    _common.print_table(["fine-tuning", "held-out exact match", "trainable", "optimizer MB/device",
                         "data MB/step", "tokens/s", "checkpoint MB", "lr"], rows)
    print(f"results: {_common.write_results('fine_tune', results)}")
    plot(results, png)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
