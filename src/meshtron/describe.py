"""``meshtron describe``: the mesh, every parameter's layout, and what the compiled step communicates.

Works for planning too: with a mesh larger than the devices present (the paper's presets), the
parameter table is computed from the rules and the mesh shape alone and the analytical Megatron
figures are printed; the compiled step is analysed only when the mesh fits on this machine.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import jax
import numpy as np

from meshtron import analysis
from meshtron.config import Config, MeshConfig
from meshtron.mesh import AXES, resolve_sizes
from meshtron.sharding import logical_to_spec
from meshtron.train.state import ModelDef, dims_from_config


def parameter_rows(model_def: ModelDef, mesh_sizes: dict[str, int]) -> list[tuple[str, tuple, str, str, int]]:
    """(name, shape, logical axes, mesh spec, bytes per device) for every parameter."""
    rows = []
    shapes = jax.tree_util.tree_leaves_with_path(model_def.shapes())
    axes = jax.tree.leaves(model_def.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    for (path, shape), names in zip(shapes, axes, strict=True):
        spec = logical_to_spec(names)
        split = math.prod(mesh_sizes[a] for a in spec if a is not None)
        per_device = math.prod(shape.shape) * shape.dtype.itemsize // split
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        logical = "(" + ", ".join(str(n) for n in names) + ")"
        rows.append((name, tuple(shape.shape), logical, str(spec), per_device))
    return rows


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [header] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(cfg: Config, out=None) -> None:
    out = out or sys.stdout
    devices = jax.devices()
    requested = [cfg.mesh.data, cfg.mesh.pipe, cfg.mesh.tensor]
    fits = -1 in requested or math.prod(requested) <= len(devices)
    sizes = resolve_sizes(cfg.mesh, len(devices)) if fits else tuple(requested)
    mesh_sizes = dict(zip(AXES, sizes))
    cfg = replace(cfg, mesh=MeshConfig(*sizes))
    model_def = ModelDef.create(dims_from_config(cfg.model, mesh_sizes["tensor"]))
    dims = model_def.dims

    print(f"mesh      {mesh_sizes}  ({math.prod(sizes)} devices; this machine has {len(devices)} "
          f"{devices[0].platform.upper()} devices)", file=out)
    print(f"model     {dims.layers} layers, hidden {dims.hidden}, {dims.heads} heads, mlp {dims.mlp_dim}, "
          f"seq {dims.seq_len}, vocab {dims.vocab_size} (padded to {dims.vocab_padded}), "
          f"dtype {cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.model.remat}", file=out)
    rows = parameter_rows(model_def, mesh_sizes)
    total = sum(math.prod(r[1]) for r in rows)
    print(f"\nparameters ({total:,} in all, {analysis.format_bytes(sum(r[4] for r in rows))} per device)", file=out)
    print(_table(("name", "shape", "logical axes", "mesh spec", "bytes/device"), rows), file=out)

    t = cfg.train
    fig = analysis.megatron_figures(
        vocab_size=dims.vocab_padded, hidden=dims.hidden, layers=dims.layers, seq_len=dims.seq_len,
        heads=dims.heads, global_batch=t.batch_size, data=sizes[0], pipe=sizes[1], tensor=sizes[2],
        microbatches=t.microbatches, remat=dims.remat, bytes_per_element=np.dtype(dims.dtype).itemsize,
    )
    print("\nMegatron analytical figures per step and device (Narayanan et al. 2021)", file=out)
    print(f"  parameters (eq. 2)       {fig.params:,}", file=out)
    print(f"  FLOPs per iteration      {fig.flops_per_iteration:.4g} (eq. 3, with recomputation); "
          f"{fig.flops_per_iteration_no_remat:.4g} without", file=out)
    for axes, nbytes in fig.bytes_by_axes.items():
        print(f"  {'/'.join(axes):8s} bytes            {analysis.format_bytes(nbytes)}", file=out)

    if not fits:
        print(f"\ncompiled step: not analysed, the mesh needs {math.prod(sizes)} devices and this machine "
              f"has {len(devices)} (planning mode)", file=out)
        return
    from meshtron.train.loop import Trainer

    trainer = Trainer.from_config(cfg, devices)
    params = trainer.init_params()
    opt_state = trainer.steps.init_opt_state(params)
    tokens = jax.device_put(
        np.zeros((t.batch_size, dims.seq_len + 1), np.int32), trainer.steps.batch_sharding
    )
    staged = len(trainer.steps.stages) > 1
    for stage in trainer.steps.stages:  # 1-bit LAMB: warmup and compression communicate differently
        step = analysis.analyze(trainer.steps.compile(params, opt_state, tokens, stage), trainer.mesh)
        label = f" ({stage} stage)" if staged else ""
        print(f"\ncompiled train step{label}: collectives per mesh axis (bytes = per device, per step)", file=out)
        print(step.table(), file=out)
