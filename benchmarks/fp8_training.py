"""Does FP8 train as well as bf16? The default run and ``llama_cpu8`` for their 300 steps, each at
``model.dtype=bfloat16`` with the blocks' projections in bf16 and as FP8 GEMMs, scaled by each tensor's
own amax (``model.fp8=current``) and by an amax history (``model.fp8=delayed``).

    .venv/bin/python benchmarks/fp8_training.py       # about 30 minutes on 2 cores

Both runs of a config see the same data in the same order from the same initial weights; only the
projections' arithmetic differs. XLA:CPU has no FP8 units: it runs the float8 GEMMs by widening their
operands after the cast, so the numbers are FP8's (every operand rounded to e4m3, every output gradient
to e5m2) while the speed is not -- tokens/s here says nothing about a GPU (``docs/gpu.md`` does).

Prints a table (held-out loss at each evaluation, FP8 against bf16) and writes
``results/fp8_training.{json,png}``.
"""

from __future__ import annotations

import argparse

import _common

from meshtron.config import load_config
from meshtron.plotting import pyplot, save
from meshtron.train.loop import Trainer

CONFIGS = ("cpu8", "llama_cpu8")
ARITHMETIC = {"bf16": ["model.dtype=bfloat16"], "fp8": ["model.dtype=bfloat16", "model.fp8=current"],
              "fp8-delayed": ["model.dtype=bfloat16", "model.fp8=delayed"]}


def run(config: str, overrides: list[str], steps: int) -> dict:
    trainer = Trainer.from_config(load_config(config, [*overrides, f"train.steps={steps}", "train.eval_every=50"]))
    result = trainer.run()
    return {"losses": result.losses, "evaluations": result.evaluations, "heldout_loss": result.heldout_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for config in CONFIGS:
        results[config] = {name: run(config, overrides, args.steps) for name, overrides in ARITHMETIC.items()}
    rows = []
    for config, runs in results.items():
        bf16, fp8, delayed = (runs[name]["heldout_loss"] for name in ARITHMETIC)
        runs["fp8_over_bf16"], runs["fp8_delayed_over_bf16"] = fp8 / bf16, delayed / bf16
        rows.append([config, f"{bf16:.4f}", f"{fp8:.4f}", f"{100 * (fp8 / bf16 - 1):+.2f}%", f"{delayed:.4f}",
                     f"{100 * (delayed / bf16 - 1):+.2f}%"])
    _common.print_table(["config", "held-out loss bf16", "fp8 (current)", "vs bf16", "fp8 (delayed)", "vs bf16"], rows)
    _common.write_results("fp8_training", {"steps": args.steps, "arithmetic": ARITHMETIC, "runs": results})
    plt = pyplot("the FP8 training plot")
    fig, axes = plt.subplots(1, len(CONFIGS), figsize=(5 * len(CONFIGS), 3.5))
    for ax, (config, runs) in zip(axes, results.items()):
        for name in ARITHMETIC:
            steps, losses = zip(*runs[name]["evaluations"])
            ax.plot(steps, losses, marker="o", label=name)
        ax.set_title(config)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.legend()
    save(fig, _common.RESULTS / "fp8_training.png")


if __name__ == "__main__":
    main()
