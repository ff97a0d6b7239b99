"""Measured vs analytical communication per mesh axis for the compiled train step.

For several (data, pipe, tensor) meshes, compiles the train step of the default model and counts
the bytes that cross each mesh axis per step and device (from the optimized HLO, loops expanded
by their trip counts), next to Megatron-LM's analytical figures for the same configuration.

    .venv/bin/python benchmarks/comm_volume.py
"""

from __future__ import annotations

import _common
import jax
import numpy as np

from meshtron import megatron
from meshtron.config import MeshConfig, ModelConfig, TrainConfig
from meshtron.execution import Execution
from meshtron.hlo.collectives import bytes_by_axes, collectives
from meshtron.mesh import build_mesh
from meshtron.optim import build_optimizer, data_parallel_mean
from meshtron.train.state import model_def_from_config
from meshtron.train.step import build_steps
from meshtron.units import format_bytes

MESHES = [(8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)]
MODEL = ModelConfig(hidden=128, heads=8, layers=4, mlp_dim=512, seq_len=128)
BATCH, MICROBATCHES = 32, 2


def measure(mesh_shape, remat: str) -> dict:
    mesh = build_mesh(MeshConfig(*mesh_shape))
    cfg = ModelConfig(**{**MODEL.__dict__, "remat": remat})
    md = model_def_from_config(cfg, mesh.shape["tensor"])
    steps = build_steps(md, mesh, data_parallel_mean(), build_optimizer(TrainConfig(), md.logical_axes()), microbatches=MICROBATCHES,
                        execution=Execution.of_model_config(cfg))
    params = md.init(mesh, 0)
    opt_state = steps.init_opt_state(params)
    tokens = jax.device_put(np.zeros((BATCH, cfg.seq_len + 1), np.int32), steps.batch_sharding)
    colls = collectives(steps.lower(params, opt_state, tokens).compile(), mesh)
    measured = bytes_by_axes(colls)
    fig = megatron.megatron_figures(
        vocab_size=md.vocab_padded, hidden=cfg.hidden, layers=cfg.layers, seq_len=cfg.seq_len,
        heads=cfg.heads, global_batch=BATCH, data=mesh_shape[0], pipe=1, tensor=mesh_shape[2],
        microbatches=MICROBATCHES, remat=remat == "full",
    )
    return {
        "mesh": list(mesh_shape),
        "remat": remat,
        "measured": {"tensor": measured.get(("tensor",), 0), "data": measured.get(("data",), 0)},
        "analytical": {"tensor": fig.tensor_bytes, "data": fig.data_bytes},
        "other_axes": {"/".join(k): v for k, v in measured.items() if k not in (("tensor",), ("data",))},
    }


def main() -> None:
    results = [measure(m, remat) for remat in ("none", "full") for m in MESHES]
    rows = []
    for r in results:
        mt, at = r["measured"]["tensor"], r["analytical"]["tensor"]
        md, ad = r["measured"]["data"], r["analytical"]["data"]
        rows.append([
            "x".join(map(str, r["mesh"])), r["remat"],
            format_bytes(mt), format_bytes(at), f"{mt / at:.3f}" if at else "-",
            format_bytes(md), format_bytes(ad), f"{md / ad:.3f}" if ad else "-",
        ])
    print(f"model {MODEL.layers}x{MODEL.hidden}, batch {BATCH}, {MICROBATCHES} microbatches; bytes per device per step")
    _common.print_table(
        ["mesh d x p x t", "remat", "tensor measured", "tensor Megatron", "ratio",
         "data measured", "data Megatron", "ratio"], rows,
    )
    path = _common.write_results("comm_volume", {"model": MODEL.__dict__, "batch": BATCH,
                                                  "microbatches": MICROBATCHES, "results": results})
    plot(results)
    print(f"wrote {path}")


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, axis in zip(axes, ("tensor", "data")):
        chosen = [r for r in results if r["remat"] == "none"]
        labels = ["x".join(map(str, r["mesh"])) for r in chosen]
        x = np.arange(len(chosen))
        ax.bar(x - 0.2, [r["measured"][axis] / 2**20 for r in chosen], 0.4, label="measured (HLO)")
        ax.bar(x + 0.2, [r["analytical"][axis] / 2**20 for r in chosen], 0.4, label="Megatron analytical")
        ax.set_xticks(x, labels)
        ax.set_xlabel("mesh data x pipe x tensor")
        ax.set_ylabel("MiB per device per step")
        ax.set_title(f"bytes over '{axis}'")
        ax.legend()
    fig.tight_layout()
    fig.savefig(_common.RESULTS / "comm_volume.png", dpi=120)


if __name__ == "__main__":
    main()
