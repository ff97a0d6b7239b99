"""1-bit LAMB against LAMB on the built-in corpus: convergence and the bytes sent over ``data``.

For each mesh, two runs from the same seed on the same batches (same samples): the trainer's LAMB
(``train.optimizer=lamb``, fp32 gradient all-reduce every step) and 1-bit LAMB
(``train.optimizer=onebit_lamb``, uncompressed for the first 16% of the steps, then the 1-bit
compressed momentum all-reduce), each with its default gradient clipping (LAMB: global norm 1.0;
1-bit LAMB: none, see ``meshtron.optim.grad_clip_norm``). On the data=8 mesh two more runs swap
the clipping (LAMB unclipped; 1-bit LAMB clipping each shard's local gradient at 1.0), to show
what clipping does to each. Bytes are what one device sends over ``data`` per step, counted from
each compiled step's collectives (ring algorithms), times the steps run in each stage.

    .venv/bin/python benchmarks/onebit_lamb.py [--steps 300] [--lr 0.02]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common
import numpy as np
from rich.console import Console

from meshtron.config import freeze_step, load_config
from meshtron.optim import grad_clip_norm
from meshtron.train.loop import Trainer
from meshtron.units import format_bytes

CONFIG = Path(__file__).resolve().parents[1] / "mesh_configs" / "cpu8.yaml"
MESHES = {
    "8x1x1": ["parallel.data=8", "parallel.pipe=1", "parallel.tensor=1", "parallel.chunks=1", "parallel.microbatches=1"],
    "2x2x2": ["parallel.data=2", "parallel.pipe=2", "parallel.tensor=2"],  # cpu8.yaml: interleaved 1F1B, v=2, m=4
}
OPTIMIZERS = ("lamb", "onebit_lamb")
ABLATION = {"8x1x1": {"lamb": 0.0, "onebit_lamb": 1.0}}  # mesh -> optimizer -> swapped train.grad_clip


def run(mesh: str, optimizer: str, steps: int, lr: float, grad_clip: float | None = None) -> dict:
    clip = [] if grad_clip is None else [f"train.grad_clip={grad_clip}"]
    cfg = load_config(CONFIG, [*MESHES[mesh], f"train.optimizer={optimizer}", f"train.lr={lr}",
                               f"train.steps={steps}", f"train.eval_every={max(steps // 6, 1)}", *clip])
    trainer = Trainer.from_config(cfg)
    result = trainer.run(console=Console(stderr=True))
    per_step = {stage: trainer.steps.data_bytes(stage) for stage, n in result.stage_steps.items() if n}
    return {
        "mesh": mesh, "optimizer": optimizer, "steps": steps, "lr": lr, "grad_clip": grad_clip_norm(cfg.train),
        "ablation": grad_clip is not None,
        "freeze_step": freeze_step(cfg) if optimizer == "onebit_lamb" else None,
        "losses": result.losses, "heldout_loss": result.heldout_loss, "evaluations": result.evaluations,
        "data_bytes": result.data_bytes, "data_bytes_per_step": per_step, "stage_steps": result.stage_steps,
        "tokens_per_s": result.tokens_per_s, "wall_time_s": result.wall_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.02)
    args = parser.parse_args()
    runs = [run(mesh, opt, args.steps, args.lr) for mesh in MESHES for opt in OPTIMIZERS]
    runs += [run(mesh, opt, args.steps, args.lr, clip) for mesh, swaps in ABLATION.items() for opt, clip in swaps.items()]
    rows, summary = [], {}
    for mesh in MESHES:
        lamb, onebit = (next(r for r in runs if (r["mesh"], r["optimizer"], r["ablation"]) == (mesh, o, False))
                        for o in OPTIMIZERS)
        loss_change = onebit["heldout_loss"] / lamb["heldout_loss"] - 1
        volume = lamb["data_bytes"] / onebit["data_bytes"]
        stage_ratio = onebit["data_bytes_per_step"]["warmup"] / onebit["data_bytes_per_step"]["compression"]
        summary[mesh] = {"heldout_change": loss_change, "run_bytes_ratio": volume, "compression_stage_ratio": stage_ratio}
        for r in [lamb, onebit] + [r for r in runs if r["mesh"] == mesh and r["ablation"]]:
            per_step = " / ".join(format_bytes(b) for b in r["data_bytes_per_step"].values())
            rows.append([
                mesh, r["optimizer"], f"{r['grad_clip']:g}" + (" (swapped)" if r["ablation"] else ""),
                f"{r['heldout_loss']:.4f}", "-" if r is lamb else f"{100 * (r['heldout_loss'] / lamb['heldout_loss'] - 1):+.1f}%",
                per_step, format_bytes(r["data_bytes"]),
                "-" if r["optimizer"] == "lamb" else f"{lamb['data_bytes'] / r['data_bytes']:.2f}x",
                f"{r['tokens_per_s']:,.0f}",
            ])
    print(f"default GPT, built-in corpus, {args.steps} steps, lr {args.lr}, same seed and batches; "
          f"bytes = sent per device over data (warmup / compression per step)")
    _common.print_table(["mesh d×p×t", "optimizer", "grad clip", "held-out loss", "vs LAMB", "bytes/step",
                         "bytes/run", "LAMB / 1-bit", "tokens/s"], rows)
    for mesh, s in summary.items():
        print(f"{mesh}: compression stage sends {s['compression_stage_ratio']:.1f}x less per step than warmup; "
              f"whole run {s['run_bytes_ratio']:.2f}x less than LAMB; held-out loss {100 * s['heldout_change']:+.2f}%")
    path = _common.write_results("onebit_lamb", {"config": CONFIG.name, "summary": summary, "runs": runs})
    plot(runs)
    print(f"wrote {path}")


def smooth(values: list[float], window: int = 10) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def plot(runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MESHES), figsize=(6 * len(MESHES), 4), sharey=True)
    for ax, mesh in zip(np.atleast_1d(axes), MESHES):
        for r in (r for r in runs if r["mesh"] == mesh and not r["ablation"]):
            label = "LAMB" if r["optimizer"] == "lamb" else "1-bit LAMB"
            steps = np.arange(10, len(r["losses"]) + 1)
            line, = ax.plot(steps, smooth(r["losses"]), label=f"{label} (train, mean of 10 steps)")
            evals = np.array(r["evaluations"])
            ax.plot(evals[:, 0], evals[:, 1], "o--", color=line.get_color(), label=f"{label} (held-out)")
            if r["freeze_step"]:
                ax.axvline(r["freeze_step"], color="grey", linestyle=":", label="compression starts")
        ax.set_title(f"mesh {mesh} (data × pipe × tensor)")
        ax.set_xlabel("step (same samples for both)")
        ax.set_ylabel("loss (nats/token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "onebit_lamb.png", dpi=120)


if __name__ == "__main__":
    main()
