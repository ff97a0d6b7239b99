"""Supervised fine-tuning, then DPO with LoRA, of a small Llama on a preference task whose preferred answer is
known: held-out preference accuracy and reward margin over the DPO steps, against the SFT model.

    .venv/bin/python benchmarks/dpo.py            # [--sft-steps N] [--dpo-steps N]

* **The task** -- ``reverse`` a word of 4 to 6 letters of a-h. The SFT data answers half its prompts with
  the reversal and half with the reversal's first two letters swapped, so the SFT model finds both about
  as likely; the pairs prefer the reversal (chosen) to that swap (rejected). Training and held-out words
  never overlap. SFT examples and pairs are written as JSON lines and preprocessed with
  ``meshtron preprocess --sft`` and ``--preference`` (byte tokens, the chat template).
* **SFT** -- ``llama_cpu8``'s model (hidden 128, 4 layers) from scratch on one device, on the SFT examples.
* **DPO** -- from the SFT checkpoint (``train.init_from``), LoRA of rank 16 on every block matrix, beta 0.1,
  lr 5e-3, 16 pairs a step; the reference is the SFT model (the frozen base).
* **Preference accuracy** -- the share of held-out pairs whose chosen answer has the higher summed
  log-probability, for the SFT model and after DPO; the reward margin -- the mean of
  ``beta·((pi - ref)_chosen - (pi - ref)_rejected)`` (TRL's ``rewards/margins``) over the held-out pairs,
  read with ``TrainSteps.objective_metrics``; over the DPO steps, TRL's metrics of the training batches
  as the run logs them.

Writes ``results/dpo.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np

from meshtron.config import load_config
from meshtron.data.preference import preprocess_preference
from meshtron.data.sft import preprocess_sft
from meshtron.models.documents import document_features
from meshtron.models.preference import pairs, sequence_logps
from meshtron.train.loop import Trainer

LETTERS = "abcdefgh"
MODEL = ["parallel.data=1", "parallel.pipe=1", "parallel.tensor=1", "parallel.microbatches=1", "model.seq_len=48",
         "train.warmup_steps=10", "train.eval_batches=12", "train.log_every=10"]


def words(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        word = "".join(rng.choice(list(LETTERS), size=int(rng.integers(4, 7))))
        if word[-1] != word[-2]:  # (the swap of two equal letters would change nothing)
            found[word] = None
    return list(found)


def near_miss(answer: str) -> str:
    """``answer`` with its first two letters swapped: the systematic mistake the SFT data teaches half the time."""
    return answer[1] + answer[0] + answer[2:]


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def preference_accuracy(trainer: Trainer, params, batches) -> float:
    """The share of pairs whose chosen answer the model finds more likely (summed log-probabilities)."""
    md = trainer.model_def
    with jax.set_mesh(trainer.mesh), md.scope(trainer.execution):
        logps = jax.jit(lambda p, t: sequence_logps(md.bind(p), document_features(t)))
        wins = [np.asarray(jnp.greater(*pairs(logps(params, jnp.asarray(b))))) for b in batches]
    return float(np.mean(np.concatenate(wins)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10, help="log TRL's metrics every N DPO steps")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    train_words, held_words = words(1200)[:1000], words(1200)[1000:]
    root = Path(tempfile.mkdtemp(prefix="meshtron-dpo-"))
    sft = write(root / "sft.jsonl", [{"prompt": f"reverse {w}", "response": near_miss(w[::-1]) if rng.random() < 0.5
                                      else w[::-1]} for w in train_words])
    preprocess_sft(sft, "bytes", root / "sft", progress=False)
    pair_words = train_words[:800] + held_words  # the held-out split (the last 20%) is the held-out words
    pair_lines = [{"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": near_miss(w[::-1])}
                  for w in pair_words]
    preprocess_preference(write(root / "pairs.jsonl", pair_lines), "bytes", root / "pairs", progress=False)

    start = time.perf_counter()
    sft_cfg = load_config("llama_cpu8", [*MODEL, f"data.path={root / 'sft'}", f"train.steps={args.sft_steps}",
                                         "train.batch_size=32", "train.lr=3e-3", f"checkpoint.dir={root / 'sft-run'}"])
    Trainer.from_config(sft_cfg).run()
    sft_seconds = time.perf_counter() - start

    dpo = [*MODEL, f"data.path={root / 'pairs'}", "data.holdout_fraction=0.2", "train.batch_size=16",
           "train.lr=5e-3", "train.objective=dpo", "train.dpo.beta=0.1", "train.lora.rank=16", "train.lora.alpha=32",
           f"train.init_from={root / 'sft-run'}"]
    probe = Trainer.from_config(load_config("llama_cpu8", [*dpo, "train.steps=1", f"checkpoint.dir={root / 'probe'}"]))
    held = probe.corpus.heldout_stream(batch_size=16, seq_len=48, seed=0)
    batches = [held.global_batch(i) for i in range(len(probe.corpus.heldout) // 16)]
    params, _, _, _ = probe.starting_state(None)  # the SFT model, its adapters at zero
    sft_accuracy = preference_accuracy(probe, params, batches)
    print(f"SFT model: held-out preference accuracy {sft_accuracy:.3f} on {len(batches) * 16} pairs")
    cfg = load_config("llama_cpu8", [*dpo, f"train.steps={args.dpo_steps}", f"checkpoint.dir={root / 'dpo-run'}",
                                     f"train.log_every={args.every}"])
    start_dpo = time.perf_counter()
    with open(root / "metrics.jsonl", "w") as metrics:
        result = Trainer.from_config(cfg).run(metrics_file=metrics)
    dpo_seconds = time.perf_counter() - start_dpo
    logged = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    curve = [{k: r[k] for k in ("step", "loss", "rewards/accuracies", "rewards/margins")} for r in logged
             if "rewards/margins" in r]
    params = jax.device_put(result.params, probe.steps.param_shardings)
    margin = float(np.mean([probe.steps.objective_metrics(params, b)["rewards/margins"] for b in batches]))
    accuracy = preference_accuracy(probe, params, batches)
    print(f"after {args.dpo_steps} DPO steps: held-out preference accuracy {accuracy:.3f}, reward margin {margin:.3f}")
    print("training batches, as logged (TRL's metrics):")
    _common.print_table(["DPO step", "loss", "rewards/accuracies", "rewards/margins"],
                        [[c["step"], f"{c['loss']:.4f}", f"{c['rewards/accuracies']:.3f}",
                          f"{c['rewards/margins']:.3f}"] for c in curve])
    _common.print_table(["held-out pairs", "preference accuracy", "reward margin", "held-out DPO loss"],
                        [["SFT model", f"{sft_accuracy:.3f}", "0", f"{np.log(2):.4f}"],
                         [f"after DPO ({args.dpo_steps} steps)", f"{accuracy:.3f}", f"{margin:.3f}",
                          f"{result.heldout_loss:.4f}"]])
    path = _common.write_results("dpo", {
        "sft_steps": args.sft_steps, "sft_seconds": sft_seconds, "heldout_pairs": len(batches) * 16,
        "sft_heldout_accuracy": sft_accuracy, "dpo_steps": args.dpo_steps, "dpo_seconds": dpo_seconds,
        "dpo_heldout_accuracy": accuracy, "dpo_heldout_margin": margin, "dpo_heldout_loss": result.heldout_loss,
        "train_curve": curve})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
