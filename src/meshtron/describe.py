"""``meshtron describe``: the mesh, every parameter's layout, the run's memory per device, and what
the compiled step communicates.

Nothing is allocated and no data is read: the model is traced abstractly, and the train step is
compiled from abstract arrays. Planning mode -- the parameter table from the rules and the mesh
shape alone, the analytical Megatron figures and the planner's price of the layout, no compiled
step -- is taken whenever the run could not be held on this machine: a mesh with more devices than
it has (or simulates: the CLI simulates up to 64 CPU devices), or a predicted memory (every
device's share, as :func:`run_memory` counts it) above half of its available memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import jax
import numpy as np

from meshtron import megatron
from meshtron.config import Config
from meshtron.errors import ConfigError
from meshtron.families import FACTORY_STAND_IN, FAMILIES
from meshtron.gpu.targets import TARGETS, devices_for_mesh
from meshtron.hlo.summary import analyze
from meshtron.mesh import AXES, mesh_shape, resolve_sizes, shown_sizes
from meshtron.models.lora import is_adapter, lora_spec
from meshtron.plan.step_memory import BACKENDS, StepMemory, StepRun, StepShape, block_activations, step_memory
from meshtron.run import MeshSizes, Run, run_for_model
from meshtron.sharding import logical_to_spec, placing_rules
from meshtron.train.state import ModelDef, model_def_from_config
from meshtron.units import format_bytes
from meshtron.xla_options import as_flags


def parameter_rows(model_def: ModelDef, mesh_sizes: dict[str, int]) -> list[tuple[str, tuple, str, str, int, str]]:
    """(name, shape, logical axes, mesh spec, bytes per device, rules) for every parameter; ``rules``
    names the rules-table entries (``#index name->axis``) that placed its split dimensions."""
    rows = []
    shapes = jax.tree_util.tree_leaves_with_path(model_def.shapes())
    axes = jax.tree.leaves(model_def.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    table = model_def.rules
    for (path, shape), names in zip(shapes, axes, strict=True):
        spec = logical_to_spec(names, table)
        split = math.prod(mesh_sizes[a] for a in spec if a is not None)
        per_device = math.prod(shape.shape) * shape.dtype.itemsize // split
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        logical = "(" + ", ".join(str(n) for n in names) + ")"
        placed = [f"#{i} {table[i][0]}->{table[i][1]}" for i in placing_rules(names, table)
                  if i is not None and table[i][1] is not None]
        rows.append((name, tuple(shape.shape), logical, str(spec), per_device, ", ".join(placed) or "replicated"))
    return rows


def active_parameters(model_def: ModelDef, experts: int, top_k: int) -> int:
    """The parameters one token passes through: every parameter, except that each array laid out over the
    logical ``experts`` axis (the routed experts' weights, of every layer and module that routes) counts
    ``top_k / experts`` of its elements. Shared experts, routers and everything else count whole. Read
    from the model's own arrays, so it follows the model's mix of dense and expert layers (a DeepSeek's
    dense ``prefix`` counts whole)."""
    from meshtron.models.moe import EXPERTS

    shapes = jax.tree.leaves(model_def.shapes())
    axes = jax.tree.leaves(model_def.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    active = 0
    for shape, names in zip(shapes, axes, strict=True):
        count = math.prod(shape.shape)
        active += count * top_k // experts if experts and EXPERTS in names else count
    return active


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [header] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def megatron_remat(remat: str) -> str:
    """``model.remat`` as Megatron's formulas name it: ``offload`` recomputes as ``full`` does (what
    it keeps is the same bytes, in host memory instead)."""
    return "full" if remat == "offload" else remat


def activation_figures(run: Run, model_def: ModelDef) -> tuple[list[tuple[str, str]], float]:
    """(label, value) lines of the activation-memory model for this run, and its bytes per device.

    Without a pipeline one microbatch's activations live at a time (gradient accumulation runs them in
    turn): ``layers × per-layer``. With one, the runtime stashes stage inputs of the in-flight
    microbatches (the schedule table's ``stash_slots``) and recomputes one chunk at a time
    (:func:`meshtron.megatron.pipeline_activation_bytes`); with ``parallel.recompute=false`` it keeps
    the layers' activations of every in-flight microbatch (the program's ``residual_slots``), as
    Megatron does (:func:`meshtron.megatron.megatron_stage_activation_bytes`).
    """
    cfg = run.cfg
    m, t = cfg.model, cfg.train
    sizes = run.sizes
    data, pipe, tensor = sizes.data, sizes.pipe, sizes.tensor
    sp = m.sequence_parallel and tensor > 1
    itemsize = np.dtype(m.dtype).itemsize
    microbatch = t.batch_size // (data * t.microbatches)
    block = block_activations(_step_shape(m))
    layer = megatron.layer_activation_bytes(
        seq_len=m.seq_len, microbatch=microbatch, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
        mlp_dim=m.mlp_dim, tensor=tensor, sequence_parallel=sp, remat=megatron_remat(m.remat),
        bytes_per_element=itemsize, block=block)
    held = ", the inputs in host memory" if m.remat == "offload" else ""
    layout = f"remat {m.remat}{held}, {'sequence' if sp else 'no sequence'} parallelism, microbatch {microbatch}"
    lines = [("per layer", f"{format_bytes(layer)} ({layout})")]
    if m.factory is not None:
        lines[0] = ("per layer", lines[0][1] + "; the built-in blocks' constants, a model of your own may differ")
    if pipe == 1:
        total = model_def.layers * layer
        lines.append(("per step", f"{format_bytes(total)} ({model_def.layers} layers, one microbatch at a time)"))
        return lines, total
    program = run.program
    chunk_layers = run.stage_layout.per_chunk  # the largest chunk (an uneven parallel.layout pads the others to it)
    stage_input = m.seq_len * microbatch * m.hidden * itemsize / (tensor if sp else 1)
    if program.keeps_residuals:
        total = megatron.megatron_stage_activation_bytes(layer_bytes=layer, layers_per_stage=chunk_layers,
                                                         in_flight=program.residual_slots)
        kept = f"{program.residual_slots} in-flight chunks' activations of {chunk_layers} layers kept"
        lines.append(("per step", f"{format_bytes(total)} ({kept}, parallel.recompute=false)"))
        return lines, total
    total = megatron.pipeline_activation_bytes(layer_bytes=layer, input_bytes=stage_input,
                                               layers_per_chunk=chunk_layers, in_flight=program.stash_slots)
    stash = f"{program.stash_slots} stashed stage inputs of {format_bytes(stage_input)}"
    lines.append(("per step", f"{format_bytes(total)} ({stash} + one chunk of {chunk_layers} layers recomputed)"))
    return lines, total


STEP_TERMS = (("parameters", "parameters"), ("optimizer", "optimizer state"), ("gradients", "gradients"),
              ("stash", "stash"), ("layers_kept", "layers kept"), ("working", "one layer's backward"),
              ("logits", "logits"), ("mtp", "multi-token prediction"), ("weight_buffers", "B-to-W buffers"),
              ("reference", "DPO frozen reference"), ("cast_weights", "weights cast once"), ("peak", "peak"),
              ("host", "host (pinned, not in peak)"))
""":class:`meshtron.plan.step_memory.StepMemory`'s terms as describe prints them."""


def _step_shape(m) -> StepShape:
    """The model's :class:`StepShape`; a model of the user's own is shaped as the stand-in family's."""
    return StepShape(m.family if m.factory is None else FACTORY_STAND_IN, m.layers, m.hidden, m.heads,
                     m.kv_heads or m.heads, m.mlp_dim, m.vocab_size, m.seq_len, m.max_position_embeddings or m.seq_len,
                     m.mla, m.moe, m.first_k_dense_replace, m.mtp.layers)


def modelled_step_memory(run: Run, rows: list[tuple], backend: str) -> StepMemory:
    """:func:`meshtron.plan.step_memory.step_memory` of this run, with the real model's parameter bytes
    per device (:func:`parameter_rows`: the stacked ``blocks`` hold the stage's layers), so a model of
    the user's own is priced by its own parameters (its activations by the built-in blocks' constants)."""
    m = run.cfg.model
    layers = m.layers
    per_stage = layers // run.sizes.pipe

    def per_layer_and_rest(chosen: list[tuple]) -> tuple[float, float]:
        blocks = sum(r[4] for r in chosen if r[0].split("/")[0] == "blocks")
        return blocks / per_stage, sum(r[4] for r in chosen) - blocks

    # with LoRA only the adapters have gradients and optimizer state
    trainable = per_layer_and_rest([r for r in rows if is_adapter(r[0])]) if run.cfg.train.lora.rank else None
    return step_memory(_step_shape(m), StepRun.from_config(run.cfg, run.program), backend,
                       stage_bytes=per_layer_and_rest(rows), trainable_bytes=trainable)


def dpo_reference_line(cfg: Config, param_bytes: float) -> str | None:
    """What DPO's reference model adds to a device's memory (``param_bytes``: the frozen copy's per device,
    which the terms above count); ``None`` for the next-token loss. The terms above count its rows (two a
    pair, four where a pipeline runs LoRA's frozen base on copies of them)."""
    t = cfg.train
    if t.objective != "dpo":
        return None
    if t.dpo.precompute_reference:
        return ("DPO reference: no weights held (each pair's log-probabilities computed before training, "
                "8 bytes a pair on the host); the terms count 2 rows a pair")
    if t.lora.rank:
        return ("DPO reference: LoRA's frozen base, the same weights (no second copy); its forward runs under no "
                "gradient" + (" on copies of each microbatch's rows, counted in the terms (4 rows a pair)"
                              if cfg.mesh.pipe > 1 else "; the terms count 2 rows a pair"))
    return (f"DPO reference: a frozen copy of the starting weights, {format_bytes(param_bytes)} more, an argument of "
            "the step (no gradient or optimizer state; its term above, in the peak), whose forward runs inside the step"
            + (", through the forward-only pipeline schedule" if cfg.mesh.pipe > 1 else ""))


def available_host_memory() -> int:
    """Bytes of memory this machine can still give (Linux's MemAvailable; else its physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def planned_step(run: Run, cluster: str = "a100-80gb") -> list[str]:
    """This run's layout priced by :mod:`meshtron.plan` on a bundled cluster (the same memory and
    time formulas ``meshtron plan`` ranks layouts with), or nothing when the planner's model does not
    cover the run (a mixture of experts, or a layout Megatron's schedules cannot run)."""
    from meshtron.plan import Layout, ModelShape, estimate, load_cluster
    from meshtron.plan.model import MEMORY_MODEL, context_exchange_of

    cfg, sizes, t = run.cfg, run.sizes, run.cfg.train
    try:
        model = ModelShape.from_config(cfg.model)
        layout = Layout(sizes.tensor, sizes.pipe, sizes.data, t.batch_size // (sizes.data * t.microbatches),
                        t.batch_size, cfg.pipeline.chunks, megatron_remat(cfg.model.remat), sizes.context,
                        sequence_parallel=cfg.model.sequence_parallel and sizes.tensor > 1,
                        **context_exchange_of(cfg.model))
        layout.check(model)
    except ConfigError as err:
        return [f"plan: not priced ({err})"]
    from meshtron.plan.model import FP32_GRADIENTS

    machine = load_cluster(cluster)
    step = estimate(model, layout, machine, t.optimizer, dataclasses.replace(FP32_GRADIENTS, zero=run.zero.level))
    mem = step.memory
    gb = 1e9
    fits = "fits" if mem.total <= machine.usable_memory_bytes else "does NOT fit"
    return [
        f"plan on {machine.name} (meshtron plan's model of Megatron-LM, Narayanan et al. 2021)",
        f"counts                   {MEMORY_MODEL}",
        (f"memory per GPU           {mem.total / gb:.1f} GB: weights {mem.weights / gb:.1f}, gradients "
        f"{mem.gradients / gb:.1f}, {t.optimizer} state {mem.optimizer / gb:.1f}, activations "
        f"{mem.activations / gb:.1f} ({fits} in {machine.memory_gb - machine.reserved_gb:g} GB usable)"),
        (f"predicted step           {step.step_seconds:.3g} s, {step.tflops_per_gpu:.0f} TF/s per GPU (eq. 3), "
        f"bubble {step.bubble:.1%}, communication {step.communication_share:.1%} of the step"),
    ]


def bytes_per_device(shapes, shardings) -> float:
    """Bytes one device holds of arrays shaped ``shapes`` laid out by ``shardings`` (trees alike), e.g.
    a compiled program's ``input_shardings``."""
    return float(sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                     for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)))


def print_estimate(program, mesh, target: str, cfg: Config, model_def: ModelDef, params: int, out,
                   run: Run | None = None) -> None:
    """The GPU program's overlap and estimated step time (:mod:`meshtron.gpu.step_time`): the
    collectives each mesh axis hides under compute, tokens/s per GPU and MFU. ``params``: the parameters
    a token passes through (:func:`active_parameters`). ``run``: the run the program was compiled for; a
    pipelined one's tick table prices each tick at the slots its stages run."""
    from meshtron.gpu.pipeline_ticks import tick_table
    from meshtron.gpu.step_time import estimate_step, model_flops

    m = cfg.model
    tokens = cfg.train.batch_size * m.seq_len
    flops, attention = model_flops(params=params, layers=model_def.prefix_layers + model_def.layers, hidden=m.hidden, seq_len=m.seq_len,
                                   tokens=tokens)
    ticks = tick_table(run.program) if run is not None and run.program is not None else None
    estimate = estimate_step(program, mesh, target, tokens_per_step=tokens, model_flops_per_step=flops,
                             causal_attention_flops_per_step=attention, ticks=ticks)
    print("\nestimated step on the GPU program (meshtron.gpu.step_time: the schedule priced at the target's rates; "
          "MFU counts 6N + 12 L h s FLOPs per token)", file=out)
    for line in estimate.lines():
        print(f"  {line}", file=out)
    if estimate.per_tick:
        print("  a pipelined step: each tick priced at the slots its slowest stage runs (docs/gpu.md)", file=out)
    elif dict(mesh.shape).get("pipe", 1) > 1 and ticks is None:
        print("  a pipelined step: every pipeline slot is priced at its costliest branch, an upper bound (docs/gpu.md)",
              file=out)
    elif dict(mesh.shape).get("pipe", 1) > 1:  # a table, but no slot branches: the lockstep runtime
        print("  a lockstep pipelined step: every stage runs every slot of every tick, as priced (docs/gpu.md)",
              file=out)


def host_bytes(memory) -> int:
    """Bytes a compiled program holds in host memory per device (``memory_analysis()``): its host
    arguments (an offloaded optimizer state, returned in place) and host temporaries (offloaded layer
    inputs)."""
    return getattr(memory, "host_argument_size_in_bytes", 0) + getattr(memory, "host_temp_size_in_bytes", 0)


def compiler_name(device) -> str:
    """The compiler a program for ``device`` comes from, as the memory lines name it."""
    return "XLA:GPU" if device.platform == "gpu" else f"XLA:{device.platform.upper()}"


def print_compiled_memory(program, params, opt_state, seconds: float, trainer, out,
                          model: StepMemory | None = None, compiler: str = "XLA:CPU", reference=None) -> None:
    """Memory per device of the compiled train step: what its arguments hold (read from the shardings
    the program takes; ``reference``: DPO's frozen reference weights, where the step takes them), its
    temporaries, and the peak of the two -- next to ``model``'s (the step memory model for the same
    compiler), when given. What the program keeps in host memory
    (``model.remat=offload``, ``train.offload_optimizer``) is on a ``host`` line of its own, apart
    from the device's arguments, temporaries and peak."""
    param_in, opt_in = program.input_shardings[0][:2]
    memory = program.memory_analysis()
    zero = trainer.steps.zero
    fmt = format_bytes
    print(f"\ncompiled train step: memory per device (compiled in {seconds:.1f} s from abstract arrays; "
          f"zero={trainer.resolved.zero.level})", file=out)
    print(f"  {'parameters':24s} {fmt(bytes_per_device(params, param_in))}", file=out)
    offloaded = trainer.cfg.train.offload_optimizer
    print(f"  {'optimizer state':24s} {fmt(bytes_per_device(opt_state, opt_in))}"
          + (" (held in pinned host memory between steps)" if offloaded else ""), file=out)
    if reference is not None:
        print(f"  {'DPO frozen reference':24s} {fmt(bytes_per_device(reference, program.input_shardings[0][2].reference))}"
              " (an argument of the step, not donated)", file=out)
    if memory is not None:
        peak = memory.argument_size_in_bytes + memory.temp_size_in_bytes
        print(f"  {'temporaries':24s} {fmt(memory.temp_size_in_bytes)} (activations, gradients, communication "
              f"buffers; {compiler}'s buffer assignment)", file=out)
        print(f"  {'peak':24s} {fmt(peak)} (arguments + temporaries on the device; outputs reuse the donated "
              "arguments)", file=out)
        host = host_bytes(memory)
        if host or offloaded or trainer.execution.remat == "offload":
            print(f"  {'host':24s} {fmt(host)} (pinned host memory: arguments "
                  f"{fmt(getattr(memory, 'host_argument_size_in_bytes', 0))}, temporaries "
                  f"{fmt(getattr(memory, 'host_temp_size_in_bytes', 0))}"
                  + ("; XLA:CPU has one memory, what is offloaded stays in the device figures" if compiler == "XLA:CPU"
                     else "") + ")", file=out)
        if model is not None:
            print(f"  {'modelled (' + compiler + ')':24s} temporaries {fmt(model.temporaries)}, peak {fmt(model.peak)} "
                  f"({model.peak / peak - 1:+.1%} against the compiled peak)"
                  + (f", host {fmt(model.host)}" if model.host else ""), file=out)
    if zero is not None and zero.replicated():
        kept = sum(b for _, b in zero.replicated())
        print(f"  {'whole on every data rank':24s} {len(zero.replicated())} leaves, {fmt(kept)} in all (no dimension "
              "free of tensor/pipe that data divides)", file=out)


@dataclasses.dataclass(frozen=True)
class ExpertExchange:
    """A mixture of experts' all-to-alls over its expert axis, per device, MoE layer and microbatch."""

    axis: str | None  # the mesh axis the rules put ``experts`` on (None: every expert on every device)
    ranks: int
    experts: int
    tokens: int  # routed per microbatch and data rank
    forwards: int  # forward passes per layer and step: 1, +1 under model.remat=full, +1 recomputing a stage
    layers: int  # MoE layers a device runs per microbatch
    microbatches: int
    per_layer: float  # the formula's bytes sent per layer and microbatch
    dispatch: str = "padded"  # model.moe.dispatch: padded all-to-alls, or ragged ones of the routed rows

    def line(self) -> str:
        if self.ranks <= 1:
            return "experts on every device (no expert parallelism): no all-to-all"
        each = self.experts // self.ranks
        kind = "ragged all-to-all of the routed rows (balanced routing)" if self.dispatch == "ragged" else "all-to-all"
        return (f"split over {self.axis} ({self.ranks} ranks, {each} expert{'s' if each > 1 else ''} each): {kind} "
                f"{format_bytes(self.per_layer)} per device, layer and microbatch of {self.tokens} tokens (dispatch and "
                f"combine in {self.forwards} forward{'s' if self.forwards > 1 else ''}, their transposes backward)")

    def measured(self, collectives) -> str:
        if self.dispatch == "ragged":  # what a ragged exchange sends is set by the routing, when the step runs
            return (f"ragged all-to-all over {self.axis}: its sizes are the routing's, known only when the step runs; "
                    f"{format_bytes(self.per_layer)} per layer and microbatch by the formula at balanced routing")
        sent = sum(c.total_wire_bytes for c in collectives if c.kind == "all-to-all" and c.axes == (self.axis,))
        per_layer = sent / (self.layers * self.microbatches)
        return (f"all-to-all over {self.axis}: {format_bytes(per_layer)} per layer and microbatch in the compiled step, "
                f"{format_bytes(self.per_layer)} by the formula ({per_layer / self.per_layer - 1:+.1%})")


@dataclasses.dataclass(frozen=True)
class ContextExchange:
    """What attention sends over ``context`` per device, attention layer and microbatch, when sequences
    are split there (:func:`meshtron.models.context_attention.exchange_bytes`)."""

    exchange: str  # parallel.context_attention: gathered, ring, ulysses or hybrid
    ranks: int
    tokens: int  # a rank's tokens per microbatch: rows x seq_len / ranks
    kv_heads: int  # key/value heads on one device (split over tensor when it divides them)
    forwards: int  # attention forwards per layer and step: 1, +1 recomputed (remat, a pipeline stage)
    layers: int  # attention layers a device runs per microbatch
    microbatches: int
    forward: float  # the formula's bytes of one forward
    backward: float
    widened: float | None = None  # per layer, the formula with 16-bit values sent as fp32 (XLA:CPU's collectives)
    ulysses_degree: int = 1  # the ranks of one all-to-all group: c for ulysses, parallel.ulysses_degree for hybrid

    @property
    def per_layer(self) -> float:
        return self.forwards * self.forward + self.backward

    def line(self) -> str:
        c, u = self.ranks, self.ulysses_degree
        ring = c // u  # the ring's ranks: the groups of u under the hybrid
        balanced = f"rank r holds chunks r and {2 * c - 1}-r of {2 * c} of every sequence"
        held = {"gathered": balanced, "ring": balanced,
                "ulysses": f"rank r holds the r-th of {c} contiguous slices of every sequence",
                "hybrid": (f"group g of {u} consecutive ranks holds chunks g and {2 * ring - 1}-g of {2 * ring} of every "
                           f"sequence, each of its ranks 1/{u} of them in order")}[self.exchange]
        how = {"gathered": "keys and values all-gathered",
               "ring": "key/value blocks passed around a ring of the ranks",
               "ulysses": (f"an all-to-all turns queries, keys and values into the whole sequence for 1/{c} of the "
                           "heads (each rank attends over all of it), a second brings the output back"),
               "hybrid": (f"an all-to-all within each group turns queries, keys and values into the group's tokens "
                          f"for 1/{u} of the heads, whose key/value blocks pass around a ring of the {ring} groups "
                          f"(ranks {u} apart), and a second brings the output back")}[self.exchange]
        return (f"split over context ({c} ranks, {self.tokens} tokens each per microbatch: {held}), {how}: "
                f"{format_bytes(self.per_layer)} per device, layer and "
                f"microbatch ({self.forwards} x {format_bytes(self.forward)} forward, {format_bytes(self.backward)} "
                "backward)")

    def measured(self, collectives) -> str:
        # Attention's own: the gradient reduction over the group is an all-reduce (or ZeRO's, not measured here)
        sent = sum(c.total_wire_bytes for c in collectives if c.axes == ("context",) and c.kind != "all-reduce")
        per_layer = sent / (self.layers * self.microbatches)
        line = (f"{self.exchange} exchange over context: {format_bytes(per_layer)} per layer and microbatch in the "
                f"compiled step, {format_bytes(self.per_layer)} by the formula ({per_layer / self.per_layer - 1:+.1%})")
        if self.widened is not None and jax.default_backend() == "cpu":
            line += (f"; XLA:CPU sends 16-bit collectives as fp32: {format_bytes(self.widened)} "
                     f"({per_layer / self.widened - 1:+.1%})")
        return line


def context_exchange(cfg: Config, model_def: ModelDef) -> ContextExchange:
    """What ``cfg``'s attention exchanges over ``context`` (a resolved mesh with ``context`` > 1)."""
    from meshtron.models.context_attention import exchange_bytes
    from meshtron.models.ulysses import key_heads_per_rank
    from meshtron.plan.model import context_exchange_of, ulysses_ranks

    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    family = FAMILIES.get(m.family)
    kv = family.load_counts().kv_heads(m) if family is not None else m.heads
    heads_local = m.heads // mesh.tensor
    kv_local = kv // mesh.tensor if kv % mesh.tensor == 0 else kv  # gathered, ring: the keys as laid out
    if kv % mesh.tensor and m.context_attention in ("ulysses", "hybrid"):  # each device's own key heads only
        kv_local = key_heads_per_rank(m.heads, kv, mesh.tensor)
    u = ulysses_ranks(**context_exchange_of(m), context=mesh.context)  # the all-to-alls' group
    tokens = t.batch_size // mesh.data // t.microbatches * m.seq_len // mesh.context
    forwards = 1 + (m.remat in ("full", "selective", "offload")) + (mesh.pipe > 1 and cfg.pipeline.recompute)
    def per_layer(itemsize: int) -> tuple[float, float]:
        return exchange_bytes(m.context_attention, mesh.context, tokens, kv_local, m.hidden // m.heads, itemsize,
                              heads=heads_local, ulysses_degree=u if m.context_attention == "hybrid" else None)

    forward, backward = per_layer(np.dtype(m.dtype).itemsize)
    wide = per_layer(4)
    widened = forwards * wide[0] + wide[1] if np.dtype(m.dtype).itemsize == 2 else None
    return ContextExchange(m.context_attention, mesh.context, tokens, kv_local, forwards, model_def.layers // mesh.pipe,
                           t.microbatches, forward, backward, widened, u)


def expert_exchange(cfg: Config, sizes: MeshSizes, model_def: ModelDef) -> ExpertExchange:
    """What the expert-parallel all-to-alls of ``cfg``'s step send (:func:`meshtron.models.moe.all_to_all_bytes`)."""
    from meshtron.models.moe import EXPERTS, all_to_all_bytes, moe_dims_from_config

    m, t = cfg.model, cfg.train
    mesh_sizes = dict(zip(AXES, mesh_shape(cfg.mesh)))
    spec = logical_to_spec((EXPERTS,), model_def.rules)
    axis = spec[0] if len(spec) and isinstance(spec[0], str) else None
    ranks = mesh_sizes[axis] if axis else 1
    tokens = t.batch_size // sizes.data // t.microbatches * m.seq_len
    forwards = 1 + (m.remat in ("full", "offload")) + (sizes.pipe > 1 and cfg.pipeline.recompute)
    dims = moe_dims_from_config(m)
    per_layer = all_to_all_bytes(dims, tokens, ranks, forwards, np.dtype(m.dtype).itemsize)
    return ExpertExchange(axis, ranks, dims.experts, tokens, forwards, model_def.layers // sizes.pipe, t.microbatches,
                          per_layer, dims.dispatch)


def describe(cfg: Config, out=None, *, memory_budget: float | None = None, run: Run | None = None,
             force_compile: bool = False, target: str | None = None) -> None:
    """Print the run ``cfg`` describes (``run``: already resolved). ``memory_budget``: the bytes this
    machine may give the compiled analysis (default: half of its available memory); above it,
    planning mode -- unless ``force_compile``: the step is then compiled for the mesh from abstract
    arrays whatever the model's size (nothing is allocated), and its memory per device printed.
    ``target``: compile for GPUs of that kind instead (``"h100"``, ``"h200"``, ``"a100"``:
    :mod:`meshtron.gpu.targets`; as many as the mesh names, none needed here): the memory, the
    collectives and their overlap, and the estimated step time are the GPU program's."""
    out = out or sys.stdout
    devices = jax.devices() if target is None else devices_for_mesh(cfg.mesh, target)
    requested = list(mesh_shape(cfg.mesh))
    on_devices = -1 in requested or math.prod(requested) <= len(devices)
    count = len(devices) if on_devices else math.prod(requested)  # planning: the mesh as written
    model_def = model_def_from_config(cfg.model, resolve_sizes(cfg.mesh, count).tensor, adaptation=lora_spec(cfg.train.lora),
                                      platform=devices[0].platform)
    run = run_for_model(cfg, count, model_def.layers, run)
    cfg, sizes = run.cfg, run.sizes
    mesh_sizes = dict(zip(AXES, run.mesh_shape))
    m = cfg.model

    machine = (f"compiled for {len(devices)} {devices[0].device_kind} (compile-only: {TARGETS[target].chip} "
               "described to XLA's GPU compiler, no GPU needed)" if target is not None else
               f"this machine has {len(devices)} {devices[0].platform.upper()} devices")
    print(f"mesh      {shown_sizes(mesh_sizes)}  ({math.prod(run.mesh_shape)} devices; {machine})", file=out)
    family = f"{m.family}" if m.factory is None else f"factory {m.factory}"
    kv = f" ({m.kv_heads} kv)" if m.kv_heads and m.factory is None else ""
    depth = (f"{model_def.layers} layers" if not model_def.prefix_layers else
             f"{model_def.prefix_layers + model_def.layers} layers (a prefix of {model_def.prefix_layers}, then "
             f"{model_def.layers} blocks)")
    print(f"model     {family}: {depth}, hidden {m.hidden}, {m.heads} heads{kv}, mlp {m.mlp_dim}, "
          f"seq {m.seq_len}, vocab {model_def.vocab_size} (padded to {model_def.vocab_padded}), "
          f"dtype {m.dtype}, params {m.param_dtype}, remat {m.remat}, sequence parallel {m.sequence_parallel}", file=out)
    exchange = expert_exchange(cfg, sizes, model_def) if m.moe.experts and m.factory is None else None
    if exchange is not None:
        e = m.moe
        routing = "dropless" if not e.capacity_factor else f"capacity factor {e.capacity_factor}"
        print(f"experts   {e.experts} per layer, top-{e.top_k}, mlp {e.mlp_dim or m.mlp_dim} each, {routing}"
              + (f", {e.shared_experts} shared" if e.shared_experts else "")
              + "; the analytical figures below count a dense MLP of width mlp", file=out)
        print(f"          {exchange.line()}", file=out)
    split = context_exchange(cfg, model_def) if sizes.context > 1 and m.factory is None else None
    if split is not None:
        print(f"context   {split.line()}; the analytical figures below count a whole sequence per device, the "
              "compiled step what a context rank holds", file=out)
    rows = parameter_rows(model_def, mesh_sizes)
    total = sum(math.prod(r[1]) for r in rows)
    active = active_parameters(model_def, m.moe.experts, m.moe.top_k)
    routed = (f", {active:,} active per token (the routed experts' arrays counted top-{m.moe.top_k} of "
              f"{m.moe.experts})") if m.moe.experts and active != total else ""
    print(f"\nparameters ({total:,} in all{routed}, {format_bytes(sum(r[4] for r in rows))} per device)", file=out)
    print(_table(("name", "shape", "logical axes", "mesh spec", "bytes/device", "placed by rule"), rows), file=out)

    t = cfg.train
    busiest = None
    if sizes.pipe > 1:  # an uneven parallel.layout: the stage with the most layers sets the pace
        stages = run.stage_layout
        busiest = max(sum(stages.counts[c * sizes.pipe + s] for c in range(stages.chunks)) for s in range(sizes.pipe))
    fig = megatron.megatron_figures(
        vocab_size=model_def.vocab_padded, hidden=m.hidden, layers=model_def.layers, seq_len=m.seq_len,
        heads=m.heads, global_batch=t.batch_size, data=sizes.data, pipe=sizes.pipe, tensor=sizes.tensor,
        microbatches=t.microbatches, remat=run.execution.remat in ("full", "offload"), bytes_per_element=np.dtype(m.dtype).itemsize,
        layers_per_stage=busiest,
    )
    print("\nMegatron analytical figures per step and device (Narayanan et al. 2021)", file=out)
    print(f"  parameters (eq. 2)       {fig.params:,}", file=out)
    print(f"  FLOPs per iteration      {fig.flops_per_iteration:.4g} (eq. 3, with recomputation); "
          f"{fig.flops_per_iteration_no_remat:.4g} without", file=out)
    for axes, nbytes in fig.bytes_by_axes.items():
        print(f"  {'/'.join(axes):8s} bytes            {format_bytes(nbytes)}", file=out)

    activation, _ = activation_figures(run, model_def)
    print("\nactivation memory per device (Korthikanti et al. 2022, Table 2, with meshtron's block constants)",
          file=out)
    for label, value in activation:
        print(f"  {label:24s} {value}", file=out)

    modelled = {backend: modelled_step_memory(run, rows, backend) for backend in BACKENDS}
    fmt = format_bytes
    print(f"\nmemory per device, this run as configured ({m.param_dtype} parameters, gradients and optimizer state; "
          f"{m.dtype} activations; meshtron's step as XLA compiles it, on the fullest device)", file=out)
    print(_table(("term", "GPU", "XLA:CPU (describe --compile)"),
                 [(label, fmt(getattr(modelled["gpu"], name)), fmt(getattr(modelled["cpu"], name)))
                  for name, label in STEP_TERMS if getattr(modelled["cpu"], name) or getattr(modelled["gpu"], name)]),
          file=out)
    reference = dpo_reference_line(cfg, modelled["gpu"].reference)
    if reference:
        print(f"  {reference}", file=out)
    if m.attention == "xla":
        fused = modelled_step_memory(dataclasses.replace(run, cfg=dataclasses.replace(
            cfg, model=dataclasses.replace(m, attention="cudnn"))), rows, "gpu")
        print(f"  on a GPU with model.attention=cudnn (fused attention keeps no [s, s] scores): one layer's backward "
              f"{fmt(fused.working)}, peak {fmt(fused.peak)}", file=out)

    budget = available_host_memory() / 2 if memory_budget is None else memory_budget
    held = modelled["cpu"].peak * sizes.devices
    force_compile = force_compile or target is not None  # a target's devices hold nothing here
    if force_compile and not on_devices:
        raise ConfigError(f"--compile: the mesh needs {sizes.devices} devices and this process has {len(devices)}; "
                          "the CLI simulates up to 64 CPU devices, so use a mesh of at most 64")
    if not force_compile and (not on_devices or held > budget):
        plan_lines = planned_step(run)
        print(f"\n{plan_lines[0]}", file=out)
        for line in plan_lines[1:]:
            print(f"  {line}", file=out)
        why = (f"the mesh needs {sizes.devices} devices and this machine has {len(devices)}" if not on_devices else
               f"its {sizes.devices} devices would hold {fmt(held)}, more than the {fmt(budget)} this machine can "
               "give")
        print(f"\ncompiled step: not analysed, {why} (planning mode: nothing is built; meshtron plan ranks other "
              "layouts)", file=out)
        return
    from meshtron.train.loop import Trainer

    started = time.perf_counter()
    trainer = Trainer.from_config(cfg, devices, read_data=False, run=run)  # a target's devices, when given
    params, opt_state, tokens = trainer.abstract_step_arguments()
    options = as_flags(trainer.steps.compiler_options)
    print(f"\nXLA compiler options (gpu.overlap={cfg.gpu.overlap}, gpu.xla_flags): {options or 'none, the defaults'}",
          file=out)
    staged = len(trainer.steps.stages) > 1
    for stage in trainer.steps.stages:  # 1-bit LAMB: warmup and compression communicate differently
        program = trainer.steps.compile(params, opt_state, tokens, stage)
        if stage == trainer.steps.stages[0]:
            print_compiled_memory(program, params, opt_state, time.perf_counter() - started, trainer, out,
                                  modelled["cpu" if target is None else "gpu"], compiler=compiler_name(devices[0]),
                                  reference=getattr(tokens, "reference", None))
        step = analyze(program, trainer.mesh)
        label = f" ({stage} stage)" if staged else ""
        print(f"\ncompiled train step{label}: collectives per mesh axis (bytes = per device, per step)", file=out)
        print(step.table(), file=out)
        if exchange is not None and exchange.ranks > 1 and sizes.pipe == 1:
            print(exchange.measured(step.collectives), file=out)
        if split is not None and sizes.pipe == 1 and not trainer.steps.zero.active:
            print(split.measured(step.collectives), file=out)
        if target is not None:
            print_estimate(program, trainer.mesh, target, cfg, model_def, active, out, trainer.resolved)
