"""Compile MaxText 0.2.5's own train step for GPUs this machine does not have (run with MaxText's venv).

MaxText's ``train_compile`` builds the step for a named topology, but for GPUs it asks ``jax.devices()``
for the targets -- the GPUs of the machine it runs on. This script hands MaxText's mesh compile-only
devices instead: JAX's CUDA plugin (installed into MaxText's venv) returns ``--devices`` of them from a
``GpuTargetConfigProto`` (meshtron's ``gpu/descriptions/<target>.txtpb``), with no GPU and no CUDA
libraries. Everything else is MaxText's: its config (``base.yml`` with the overrides after ``--``), its
device mesh from those devices, its abstract state, train step and shardings, its jit and compile.

``compile_topology=a3`` (MaxText's name for an 8-GPU H100 node) with ``compile_topology_num_slices`` =
devices / 8 tells MaxText's config how many devices the batch and mesh are sized for; ``num_slices=1``
keeps the mesh one ICI mesh (the plugin's devices carry no slice index for a hybrid mesh).

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/maxtext_try/venv/bin/python \\
        benchmarks/maxtext_gpu_compile.py --devices 8 --hlo /tmp/mt51/x.hlo.txt -- model_name=llama2-7b ...

Prints one JSON line: compile seconds, memory analysis (argument/output/temp/alias bytes), the mesh's
axis sizes in mesh order and MaxText's layout; the scheduled GPU HLO goes to ``--hlo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("NO_GCE_CHECK", "True")

DEFAULT_DESCRIPTION = Path(__file__).resolve().parents[1] / "src" / "meshtron" / "gpu" / "descriptions" / "h100.txtpb"
GPUS_PER_NODE = 8  # MaxText's "a3" system: one node of 8 H100s


def target_devices(description: Path, target: str, count: int) -> list:
    """``count`` compile-only GPUs of the chip ``description`` names, one process."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(target, "cuda", target_config=description.read_text(),
                                            topology=f"1x1x{count}")
    return list(topology.devices)


def maxtext_config(devices: int, overrides: list[str]):
    """MaxText's config: its ``base.yml`` with ``overrides``, sized for ``devices`` GPUs."""
    from maxtext.configs import pyconfig

    base = Path(pyconfig.__file__).resolve().parent / "base.yml"
    sizing = ["compile_topology=a3", f"compile_topology_num_slices={max(devices // GPUS_PER_NODE, 1)}", "num_slices=1"]
    return pyconfig.initialize([sys.argv[0], str(base), *sizing, *overrides])


def compile_step(config, devices: list):
    """MaxText's train step, lowered and compiled for a mesh of ``devices`` (its own functions throughout)."""
    import jax
    from flax.linen import partitioning as nn_partitioning
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    kind = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    mesh = Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
                axis_types=(kind,) * len(config.mesh_axes))
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    param_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, param_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, param_shardings)
    start = time.perf_counter()
    compiled = train_compile.jit_and_compile(func, args, kwargs, mesh, in_shard, out_shard, static, donate, config,
                                             nn_partitioning.axis_rules(config.logical_axis_rules))
    return compiled, time.perf_counter() - start, mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, required=True, help="GPUs to compile for")
    parser.add_argument("--target", default="h100", help="the chip's name for the CUDA plugin")
    parser.add_argument("--description", type=Path, default=DEFAULT_DESCRIPTION,
                        help="the chip's GpuTargetConfigProto (meshtron's gpu/descriptions/*.txtpb)")
    parser.add_argument("--hlo", type=Path, required=True, help="where the compiled step's HLO text goes")
    parser.add_argument("overrides", nargs="*", help="MaxText config overrides (key=value), after --")
    args = parser.parse_args()
    devices = target_devices(args.description, args.target, args.devices)
    config = maxtext_config(args.devices, args.overrides)
    compiled, seconds, mesh = compile_step(config, devices)
    args.hlo.parent.mkdir(parents=True, exist_ok=True)
    args.hlo.write_text(compiled.as_text())
    memory = compiled.memory_analysis()
    sizes = {str(a): int(n) for a, n in zip(mesh.axis_names, mesh.devices.shape)}
    layout = " x ".join(f"{a} {n}" for a, n in sizes.items() if n > 1) or "one device"
    print(json.dumps({
        "compile_seconds": round(seconds, 1), "hlo": str(args.hlo), "mesh_sizes": sizes, "layout": f"MaxText {layout}",
        "attention": config.attention, "remat_policy": config.remat_policy, "scan_layers": config.scan_layers,
        "global_batch": int(config.global_batch_size_to_train_on), "seq_len": int(config.max_target_length),
        "memory": {f: int(getattr(memory, f"{f}_size_in_bytes")) for f in ("argument", "output", "temp", "alias")},
    }))


if __name__ == "__main__":
    main()
