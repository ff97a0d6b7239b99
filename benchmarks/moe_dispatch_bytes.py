"""Padded against ragged expert-parallel dispatch: the bytes of the compiled H100 program.

A fine-grained mixture of experts at a GPU's sizes (64 experts of width 256, top-8, sigmoid routing with
the selection bias, hidden 1024, 4 layers, bf16) compiled (compile-only, :mod:`meshtron.gpu.targets`) as one training
step on 8 H100s with the experts split over ``data`` = 8, once with ``model.moe.dispatch=padded`` and once
with ``ragged``. From each compiled program, per device and step: the plain all-to-alls over ``data``
(:func:`meshtron.hlo.collectives.collectives`) and the ragged ones
(:func:`meshtron.hlo.collectives.ragged_all_to_alls`): their send buffers bound what they can send; with
balanced routing each trip sends the smaller of its two buffers' rows (the routed rows), ``(n-1)/n`` of
them to other devices. And the layer's own count
(:func:`meshtron.models.moe.all_to_all_bytes`) for comparison.

Needs the ``gpu-compile`` extra (JAX's CUDA plugin; the Python 3.12 stack):

    .venv-py312/bin/python benchmarks/moe_dispatch_bytes.py      # ~5 minutes; results/moe_dispatch_bytes.json
"""

from __future__ import annotations

import argparse

from meshtron.gpu.targets import prepare_environment

prepare_environment()  # before JAX starts

import _common  # sets the simulated devices too

from meshtron.config import load_config
from meshtron.hlo.collectives import collectives, ragged_all_to_alls
from meshtron.models.moe import all_to_all_bytes, moe_dims_from_config
from meshtron.train.loop import Trainer

TARGET = "h100"
# 64 experts of width 256, top-8 (2,048 active columns), hidden 1024, 4 layers, bf16; 8 sequences of 1,024
# tokens per step: one per device, 1,024 routed tokens x 8 = 8,192 assignments per device and layer
MODEL = ["model.hidden=1024", "model.heads=8", "model.kv_heads=8", "model.layers=4", "model.mlp_dim=2048",
         "model.seq_len=1024", "model.vocab_size=32000", "model.dtype=bfloat16", "model.moe.experts=64",
         "model.moe.top_k=8", "model.moe.mlp_dim=256", "model.moe.router=sigmoid", "model.moe.aux_loss_weight=0",
         "model.moe.z_loss_weight=0", "model.moe.bias_update_rate=0.001", "parallel.data=8", "parallel.pipe=1",
         "parallel.tensor=1", "parallel.schedule=1f1b", "parallel.chunks=1", "parallel.microbatches=1",
         "train.batch_size=8", "train.steps=10", "train.warmup_steps=1"]
MIB = 2**20


def measure(dispatch: str) -> dict:
    cfg = load_config("mixtral_cpu8", [*MODEL, f"model.moe.dispatch={dispatch}"])
    trainer = Trainer.from_config(cfg, target=TARGET, read_data=False)
    params, opt_state, tokens = trainer.abstract_step_arguments()
    compiled = trainer.steps.compile(params, opt_state, tokens, trainer.steps.stages[0])
    plain = [c for c in collectives(compiled, trainer.mesh) if c.axes == ("data",)]
    ragged = [c for c in ragged_all_to_alls(compiled, trainer.mesh) if c.axes == ("data",)]
    by_kind: dict[str, float] = {}
    for c in plain:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.total_wire_bytes
    dims = moe_dims_from_config(cfg.model)
    per_device_tokens = cfg.train.batch_size * cfg.model.seq_len // cfg.parallel.data
    return {
        "dispatch": dispatch,
        "all_to_all_wire_bytes": by_kind.get("all-to-all", 0.0),
        "all_to_all_count": sum(c.count for c in plain if c.kind == "all-to-all"),
        "other_wire_bytes_over_data": {k: v for k, v in by_kind.items() if k != "all-to-all"},
        "ragged_count": sum(c.count for c in ragged),
        "ragged_send_buffer_bytes": sum(c.total_bytes for c in ragged),
        "ragged_receive_buffer_bytes": sum(c.total_receive_bytes for c in ragged),
        "ragged_balanced_wire_bytes": sum(c.total_wire_bytes for c in ragged),
        "ragged_buffers": sorted({(c.bytes, c.receive_bytes) for c in ragged}),
        "layer_count_bytes": cfg.model.layers * all_to_all_bytes(dims, per_device_tokens, cfg.parallel.data,
                                                                 itemsize=2),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    results = {"target": TARGET, "model": MODEL, "runs": [measure(d) for d in ("padded", "ragged")]}
    rows = []
    for r in results["runs"]:
        sent = r["all_to_all_wire_bytes"] + r["ragged_balanced_wire_bytes"]
        rows.append([r["dispatch"], f"{r['all_to_all_count']}", f"{r['all_to_all_wire_bytes'] / MIB:.1f}",
                     f"{r['ragged_count']}", f"{r['ragged_send_buffer_bytes'] / MIB:.1f}",
                     f"{r['ragged_balanced_wire_bytes'] / MIB:.1f}", f"{sent / MIB:.1f}",
                     f"{r['layer_count_bytes'] / MIB:.1f}"])
    print(f"\nall-to-all MiB per device and step over data=8, {TARGET}, 64 experts top-8, 4 layers")
    _common.print_table(["dispatch", "all-to-alls", "all-to-all MiB", "ragged", "ragged send buffers MiB",
                         "ragged balanced MiB", "sent MiB", "layer's count MiB"], rows)
    _common.write_results("moe_dispatch_bytes", results)


if __name__ == "__main__":
    main()
