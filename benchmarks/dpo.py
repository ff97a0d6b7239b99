"""Supervised fine-tuning, then DPO with LoRA and of the whole model, of a small Llama on a preference task whose
preferred answer is known: held-out preference accuracy and reward margin, against the SFT model, and
``meshtron eval`` (lm-eval) on a local multiple-choice task before and after.

    .venv/bin/python benchmarks/dpo.py            # [--sft-steps N] [--dpo-steps N]

* **The task** -- ``reverse`` a word of 4 to 6 letters of a-h. The SFT data answers half its prompts with
  the reversal and half with the reversal's first two letters swapped, so the SFT model finds both about
  as likely; the pairs prefer the reversal (chosen) to that swap (rejected). Training and held-out words
  never overlap. SFT examples and pairs are written as JSON lines and preprocessed with
  ``meshtron preprocess --sft`` and ``--preference`` (byte tokens, the chat template).
* **SFT** -- ``llama_cpu8``'s model (hidden 128, 4 layers) from scratch on one device, on the SFT examples.
* **DPO** -- from the SFT checkpoint (``train.init_from``), beta 0.1, 16 pairs a step, the reference the SFT
  model: LoRA of rank 16 on every block matrix, lr 5e-3 (the reference is the frozen base); and the whole
  model, lr 2e-4 (``--full-lr``), against the SFT model's log-probabilities precomputed before training
  (``train.dpo.precompute_reference``).
* **Preference accuracy** -- the share of held-out pairs whose chosen answer has the higher summed
  log-probability, for the SFT model and after DPO; the reward margin -- the mean of
  ``beta·((pi - ref)_chosen - (pi - ref)_rejected)`` (TRL's ``rewards/margins``) over the held-out pairs,
  from the same summed log-probabilities; over the DPO steps, TRL's metrics of the training batches as the
  runs log them.
* **meshtron eval** -- an lm-eval multiple-choice task written from the held-out pairs (the prompt as the
  chat template renders it; the choices the chosen and the rejected answer, chosen the target), scored by
  ``meshtron.evaluation`` (the adapter behind ``meshtron eval``) on the SFT checkpoint and on both DPO
  runs' checkpoints: lm-eval's ``acc``.

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

from meshtron.config import MeshConfig, load_config
from meshtron.data.preference import preprocess_preference
from meshtron.data.sft import preprocess_sft
from meshtron.evaluation import MeshtronLM, evaluate
from meshtron.models.documents import document_features
from meshtron.models.preference import sequence_logps
from meshtron.pretrained import load_pretrained
from meshtron.train.loop import Trainer

LETTERS = "abcdefgh"
BETA = 0.1
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


def row_logps(trainer: Trainer, params, batches) -> np.ndarray:
    """``[pairs, 2]``: each held-out pair's (chosen, rejected) summed answer log-probabilities under ``params``."""
    md = trainer.model_def
    with jax.set_mesh(trainer.mesh), md.scope(trainer.execution):
        logps = jax.jit(lambda p, t: sequence_logps(md.bind(p), document_features(t)))
        return np.concatenate([np.asarray(logps(params, jnp.asarray(b))) for b in batches]).reshape(-1, 2)


def accuracy_and_margin(policy: np.ndarray, reference: np.ndarray, beta: float) -> tuple[float, float]:
    """The share of pairs whose chosen answer ``policy`` finds more likely, and TRL's mean reward margin."""
    rewards = beta * (policy - reference)
    return float(np.mean(policy[:, 0] > policy[:, 1])), float(np.mean(rewards[:, 0] - rewards[:, 1]))


CHOICE_TASK = """task: dpo_reverse_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def choice_task(root: Path, held_words: list[str]) -> Path:
    """A directory with an lm-eval multiple-choice task of the held-out pairs (module doc)."""
    tasks = root / "tasks"
    tasks.mkdir()
    docs = [{"prompt": f"<|user|>\nreverse {w}\n<|assistant|>\n", "choices": [w[::-1], near_miss(w[::-1])]}
            for w in held_words]
    write(tasks / "choice.jsonl", docs)
    (tasks / "choice.yaml").write_text(CHOICE_TASK.format(data=tasks / "choice.jsonl"))
    return tasks


def eval_accuracy(checkpoint: Path, tasks: Path) -> float:
    """lm-eval's ``acc`` of ``checkpoint`` on the held-out choice task (``meshtron eval``'s adapter)."""
    model = MeshtronLM(load_pretrained(checkpoint, MeshConfig(1, 1, 1)), batch_size=32)
    results = evaluate(model, ["dpo_reverse_choice"], include_path=str(tasks))
    return float(results["results"]["dpo_reverse_choice"]["acc,none"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10, help="log TRL's metrics every N DPO steps")
    parser.add_argument("--full-lr", type=float, default=2e-4, help="the learning rate of DPO of the whole model")
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
           "train.objective=dpo", f"train.dpo.beta={BETA}", f"train.init_from={root / 'sft-run'}"]
    probe = Trainer.from_config(load_config("llama_cpu8", [*dpo, "train.steps=1", f"checkpoint.dir={root / 'probe'}"]))
    held = probe.corpus.heldout_stream(batch_size=16, seq_len=48, seed=0)
    batches = [held.global_batch(i) for i in range(len(probe.corpus.heldout) // 16)]
    params, _, _, _ = probe.starting_state(None)  # the SFT model, its adapters at zero
    reference = row_logps(probe, params, batches)
    sft_accuracy, _ = accuracy_and_margin(reference, reference, BETA)
    print(f"SFT model: held-out preference accuracy {sft_accuracy:.3f} on {len(batches) * 16} pairs")
    tasks = choice_task(root, held_words)
    evals = {"sft": eval_accuracy(root / "sft-run", tasks)}

    runs = {"lora": [*dpo, "train.lr=5e-3", "train.lora.rank=16", "train.lora.alpha=32"],
            "full": [*dpo, f"train.lr={args.full_lr}", "train.dpo.precompute_reference=true"]}
    found = {}
    for name, overrides in runs.items():
        cfg = load_config("llama_cpu8", [*overrides, f"train.steps={args.dpo_steps}",
                                         f"checkpoint.dir={root / f'dpo-{name}'}", f"train.log_every={args.every}"])
        start_dpo = time.perf_counter()
        with open(root / f"metrics-{name}.jsonl", "w") as metrics:
            trainer = Trainer.from_config(cfg)
            result = trainer.run(metrics_file=metrics)
        seconds = time.perf_counter() - start_dpo
        logged = [json.loads(line) for line in (root / f"metrics-{name}.jsonl").read_text().splitlines()]
        curve = [{k: r[k] for k in ("step", "loss", "rewards/accuracies", "rewards/margins")} for r in logged
                 if "rewards/margins" in r]
        policy = row_logps(trainer, jax.device_put(result.params, trainer.steps.param_shardings), batches)
        accuracy, margin = accuracy_and_margin(policy, reference, BETA)
        evals[name] = eval_accuracy(root / f"dpo-{name}", tasks)
        found[name] = {"seconds": seconds, "heldout_accuracy": accuracy, "heldout_margin": margin,
                       "heldout_loss": result.heldout_loss, "eval_acc": evals[name], "train_curve": curve}
        print(f"{name} DPO, {args.dpo_steps} steps: held-out preference accuracy {accuracy:.3f}, reward margin "
              f"{margin:.3f}, meshtron eval acc {evals[name]:.3f}")
        print("training batches, as logged (TRL's metrics):")
        _common.print_table(["DPO step", "loss", "rewards/accuracies", "rewards/margins"],
                            [[c["step"], f"{c['loss']:.4f}", f"{c['rewards/accuracies']:.3f}",
                              f"{c['rewards/margins']:.3f}"] for c in curve])
    _common.print_table(
        ["held-out pairs", "preference accuracy", "reward margin", "held-out DPO loss", "meshtron eval acc"],
        [["SFT model", f"{sft_accuracy:.3f}", "0", f"{np.log(2):.4f}", f"{evals['sft']:.3f}"],
         *[[f"after {name} DPO ({args.dpo_steps} steps)", f"{r['heldout_accuracy']:.3f}", f"{r['heldout_margin']:.3f}",
            f"{r['heldout_loss']:.4f}", f"{r['eval_acc']:.3f}"] for name, r in found.items()]])
    path = _common.write_results("dpo", {
        "sft_steps": args.sft_steps, "sft_seconds": sft_seconds, "heldout_pairs": len(batches) * 16,
        "eval_docs": len(held_words), "sft_heldout_accuracy": sft_accuracy, "sft_eval_acc": evals["sft"],
        "dpo_steps": args.dpo_steps, "full_lr": args.full_lr, "dpo": found})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
