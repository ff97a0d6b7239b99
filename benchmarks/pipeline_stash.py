"""Stash slots of each pipeline schedule against Megatron's, and the compiled step's temporaries.

    PYTHONPATH=src python benchmarks/pipeline_stash.py      # a small Llama on 4 stages, m=8, seq 512

The model is chosen so the pipeline stash dominates the temporaries: many rows per microbatch of short
sequences (activations large against weights and against XLA:CPU's f32 attention scores), one layer per
stage, ``model.remat=full``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from meshtron.config import load_config
from meshtron.pipeline.schedules import check, compile_program, make_schedule
from meshtron.pipeline.table import RECOMPUTE_COSTS
from meshtron.train.loop import Trainer

P, M, SEQ, ROWS, HIDDEN = 4, 8, 128, 32, 256


def table_counts(name: str, p: int = P, m: int = M) -> dict[str, object]:
    """The table's stage inputs in flight per stage, the program's stash slots (and recompute slots: hoisted
    reruns' residuals) and Megatron's count, the bubble with unit costs and recomputing (t_R = t_F)."""
    program = compile_program(make_schedule(name, p, m))
    stats = check(program.schedule)
    return {"in_flight": stats.peak_in_flight, "stash_slots": program.stash_slots,
            "megatron_stage0": stats.megatron_peak_in_flight_stage0, "megatron_stage1": p - 1,
            "weight_slots": program.weight_slots, "recompute_slots": program.recompute_slots,
            "ticks": program.schedule.ticks, "bubble": round(stats.bubble_fraction, 3),
            "bubble_recompute": round(check(program.schedule, RECOMPUTE_COSTS).bubble_fraction, 3)}


def compiled_temp_bytes(name: str) -> int:
    cfg = load_config("llama_cpu8", [
        "parallel.data=1", f"parallel.pipe={P}", "parallel.tensor=1", f"parallel.schedule={name}", "parallel.chunks=1",
        f"parallel.microbatches={M}", f"model.seq_len={SEQ}", f"model.hidden={HIDDEN}", "model.heads=2",
        "model.kv_heads=1", f"model.layers={P}", "model.mlp_dim=512", "model.remat=full",
        f"train.batch_size={M * ROWS}"])
    tr = Trainer.from_config(cfg, devices=__import__("jax").devices()[:P], read_data=False)
    params, opt_state, tokens = tr.abstract_step_arguments()
    compiled = tr.steps.compile(params, opt_state, tokens, tr.steps.stages[0])
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    names = sys.argv[1:] or ["1f1b", "1f1b-p", "zb-h1"]
    act = ROWS * SEQ * HIDDEN * 4  # one stage input (f32)
    print(f"p={P} m={M} seq={SEQ} rows/microbatch={ROWS} hidden={HIDDEN}: one stage input {act / 2**20:.2f} MiB")
    for name in names:
        counts = table_counts(name)
        temp = compiled_temp_bytes(name)
        print(f"{name:7s} {counts}  temp {temp} B ({temp / 2**20:.2f} MiB)  stash {counts['stash_slots'] * act / 2**20:.1f} MiB",
              flush=True)


if __name__ == "__main__":
    main()
