"""A config on a number of devices, resolved once: the mesh's sizes (a -1 axis given its size), the
ZeRO choice, the pipeline's stage layout, schedule and compiled program, and every check that
combines two features or depends on the mesh's sizes (:func:`check_features`; a field's own checks
are the config's, :func:`meshtron.config.validate`).

The trainer, ``describe``, the parity oracle and the CLI take a :class:`Run` instead of re-deriving
any of it. Pure Python (no JAX): the CLI resolves a run before JAX starts, so a layout or schedule
that cannot work is one line before any device is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshtron.config import Config, MeshConfig, ModelConfig
from meshtron.errors import ConfigError
from meshtron.execution import Execution
from meshtron.mesh import mesh_shape, resolve_sizes
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.layout import LayoutError, StageLayout
from meshtron.pipeline.program import Program, compile_program
from meshtron.pipeline.schedules import SCHEDULES, Schedule, ScheduleError, is_schedule_file, make_schedule

__all__ = ["MeshSizes", "Run", "ZeroChoice", "check_features", "resolve_run", "run_for_model", "stage_layout"]

RING_IN_PIPELINE = (
    "ring runs pipeline stages in lockstep (XLA's collective-permute waits for every device of the mesh), which an "
    "uneven parallel.layout's per-stage layer counts cannot; use an even layout or parallel.context_attention=gathered "
    "(or ulysses)")
RING_EXCHANGES = ("ring", "hybrid")  # the exchanges that pass blocks round a ring of collective-permutes


@dataclass(frozen=True)
class MeshSizes:
    """A mesh's resolved sizes by axis name (none is -1)."""

    data: int
    pipe: int
    tensor: int
    context: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.tensor * self.context

    @property
    def replicas(self) -> int:
        """The gradient group: every data and context rank holds its own gradient of the same parameters."""
        return self.data * self.context


@dataclass(frozen=True)
class ZeroChoice:
    """What ``parallel.zero`` splits over the gradient group: ``level`` 0 nothing, 1 the optimizer state
    (the distributed optimizer), 3 the parameters too (FSDP); ``gather_once`` (level 3): each
    parameter gathered once per step, not before each use; ``gather_dtype`` and ``reduce_dtype``
    (level 3): what the gathered parameters and their gradients' reduce-scatter are cast to, resolved
    (``parallel.gather_dtype`` or ``model.dtype``, ``parallel.reduce_dtype`` or ``model.param_dtype``).
    The JAX side lays it out on a mesh (:meth:`meshtron.optim.zero.ZeroPlan.for_mesh`)."""

    level: int = 0
    gather_once: bool = False
    gather_dtype: str = "float32"
    reduce_dtype: str = "float32"


@dataclass(frozen=True)
class Run:
    """What a config means on a device count. ``cfg`` has the mesh's real sizes (no -1) and, for a
    model of the user's own, its real depth; ``stage_layout``, ``schedule`` and ``program`` (the
    training program: stage inputs kept and recomputed, or every layer's residuals kept, as
    ``parallel.recompute`` says) are None without a pipeline."""

    cfg: Config
    stage_layout: StageLayout | None = None
    schedule: Schedule | None = None
    program: Program | None = None

    @property
    def sizes(self) -> MeshSizes:
        mesh = self.cfg.mesh
        return MeshSizes(mesh.data, mesh.pipe, mesh.tensor, mesh.context)

    @property
    def zero(self) -> ZeroChoice:
        t, m = self.cfg.train, self.cfg.model
        return ZeroChoice(t.zero, t.gather_once, t.gather_dtype or m.dtype, t.reduce_dtype or m.param_dtype)

    @property
    def pipeline(self) -> PipelinePlan | None:
        """How the pipeline runtime executes the training program (None without a pipeline or a program)."""
        return None if self.program is None else PipelinePlan(self.program, self.stage_layout)

    def pipeline_on(self, platform: str) -> PipelinePlan | None:
        """:attr:`pipeline` as it runs on ``platform``'s devices (a JAX platform name: ``cpu``, ``gpu``). On
        GPUs with ``gpu.overlap=on`` a tick issues each send as soon as its payload is computed
        (``PipelinePlan.early_sends``), so the activation's transfer can run under the backward's GEMMs:
        XLA:GPU executes a program in its one schedule order on every device, which keeps the order of the
        collectives the runtime's ordering chain otherwise fixes. Elsewhere, the chain as it is."""
        plan = self.pipeline
        if plan is None or platform != "gpu" or self.cfg.gpu.overlap != "on":
            return plan
        return replace(plan, early_sends=True)

    @property
    def execution(self) -> Execution:
        """How this run executes the model's code: ``model.remat``, ``model.attention``,
        ``parallel.context_attention`` and ``model.seq_len`` as generation's window."""
        return Execution.of_model_config(self.cfg.model)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's sizes in :data:`meshtron.mesh.AXES` order (context included)."""
        return mesh_shape(self.cfg.mesh)


def resolve_run(cfg: Config, devices: int, *, layers: int | None = None, program: bool = True) -> Run:
    """``cfg`` on ``devices`` devices, checked and built once. ``layers``: the model's own depth when it
    is not ``model.layers`` (a model of the user's own decides its pipeline split). ``program``: also
    compile the schedule into the runtime's instructions (planning needs only the table)."""
    cfg = replace(cfg, mesh=resolve_sizes(cfg.mesh, devices))
    pipe = cfg.mesh.pipe
    if layers is not None and layers != stacked_layers(cfg.model):
        cfg = replace(cfg, model=replace(cfg.model, layers=layers))
    check_features(cfg)
    layout = _check_pipeline(cfg)
    if layout is None:
        return Run(cfg)
    pl = cfg.pipeline
    try:
        schedule = make_schedule(pl.schedule, pipe, cfg.train.microbatches, pl.chunks)
    except ScheduleError as err:
        raise ConfigError(f"parallel.schedule: {err}") from None
    # A ring attention runs the stages in lockstep: every stage computes every slot of every tick, so a
    # rerun hoisted into the tick before balances nothing there.
    ring = cfg.mesh.context > 1 and cfg.model.context_attention in RING_EXCHANGES
    compiled = compile_program(schedule, keep_residuals=not pl.recompute, hoist=not ring) if program else None
    return Run(cfg, layout, schedule, compiled)


def stacked_layers(m: ModelConfig) -> int:
    """The layers a built-in family stacks in its ``blocks``, which pipeline parallelism splits over its
    stages: ``model.layers`` less the dense ones a model with experts runs first, in its ``prefix``
    (``model.first_k_dense_replace``: :mod:`meshtron.models.contract`)."""
    return m.layers - (m.first_k_dense_replace if m.moe.experts else 0)


def run_for_model(cfg: Config, devices: int, layers: int, run: Run | None = None) -> Run:
    """``run`` (resolved before the model was built, as the CLI does before JAX starts) when it holds for
    a model of ``layers`` layers on ``devices`` devices; else ``cfg`` resolved for them. A model of the
    user's own decides its own depth, and with it the pipeline split."""
    if run is not None and stacked_layers(run.cfg.model) == layers and run.sizes.devices <= devices:
        return run
    return resolve_run(cfg, devices, layers=layers)


def _need(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def check_features(cfg: Config) -> None:
    """The checks that combine two features, or a feature and the mesh's sizes, for the sizes ``cfg``
    gives (a -1 axis is checked once :func:`resolve_run` gives it its size; the pipeline's are
    :func:`resolve_run`'s). A caller that cannot resolve the run yet (a -1 axis before JAX starts,
    the planner, the launcher) runs them itself."""
    t = cfg.train
    _need(not t.gather_once or t.zero == 3, "parallel.gather_once",
          f"gathers parameters split by parallel.zero=3, and this run has parallel.zero={t.zero}; set "
          "parallel.zero=3 or drop it")
    for name in ("gather_dtype", "reduce_dtype"):
        _need(getattr(t, name) is None or t.zero == 3, f"parallel.{name}",
              f"sets the dtypes of parameters gathered by parallel.zero=3, and this run has parallel.zero={t.zero}; "
              "set parallel.zero=3 or drop it")
    _need(t.zero == 0 or t.optimizer != "onebit_lamb", "parallel.zero",
          "1-bit LAMB's error feedback compresses each worker's whole local momentum (its server error is "
          "already split over data), and splitting the rest would cost more than the compression saves: an fp32 "
          "all-gather of the parameters every step (zero=1, 16x its 1-bit exchange) or fp32 gathers and "
          "reduce-scatters per layer (zero=3); use parallel.zero=0 with onebit_lamb, or adamw/lamb with parallel.zero")
    _need(not t.lora.rank or cfg.model.moe.experts == 0, "train.lora",
          "adapts the matrices of dense blocks; a mixture of experts (model.moe.experts > 0) is not supported")
    _need(t.objective != "dpo" or not t.dpo.precompute_reference or cfg.data.source == "indexed",
          "train.dpo.precompute_reference", f"keys each pair's reference log-probabilities by its index in an indexed "
          f"dataset, and data.source={cfg.data.source} streams pairs without one; use the frozen copy "
          "(train.dpo.precompute_reference=false), or preprocess the pairs with meshtron preprocess --preference")
    if cfg.data.pairs_per_window > 1:
        _need(t.objective == "dpo", "data.pairs_per_window",
              f"packs preference pairs, and train.objective={t.objective} trains on no pairs; set it to 1 or train "
              "with train.objective=dpo")
        _need(cfg.data.source == "indexed", "data.pairs_per_window",
              f"packs the pairs of an indexed dataset, and data.source={cfg.data.source} streams them one a window; "
              "set it to 1, or preprocess the pairs with meshtron preprocess --preference")
    m = cfg.model
    _need(not m.mtp.layers or cfg.mesh.context <= 1, "model.mtp.layers",
          f"multi-token prediction reads each position's tokens k places on, which a sequence split over "
          f"parallel.context={cfg.mesh.context} ranks keeps on another rank; use parallel.context=1 or "
          "model.mtp.layers=0")
    check_collective_matmul(cfg)
    _check_sizes(cfg)


def _check_sizes(cfg: Config) -> None:
    """The checks that depend on the mesh's sizes, for those it has: the tensor split of the model,
    sequence parallelism, the sequence over the context ranks, the batch over the data shards."""
    m, mesh = cfg.model, cfg.mesh
    if mesh.tensor != -1:
        check_sequence_parallel(m, mesh.tensor)
    check_tensor_split(m, mesh)
    if mesh.context > 1:
        _check_context_split(m, mesh)
    if mesh.data > 0:
        _check_batch_divisible(cfg, mesh.data)


def check_collective_matmul(cfg: Config) -> None:
    """``parallel.collective_matmul``: the rings replace sequence parallelism's collectives, so it needs
    them (and more than one tensor rank, which sequence parallelism checks); its rings multiply in the
    model's dtype, not by FP8 GEMMs, and a LoRA adapter's own product would gather the region's input
    again beside the ring."""
    m = cfg.model
    if not m.collective_matmul:
        return
    _need(m.sequence_parallel, "parallel.collective_matmul",
          "overlaps sequence parallelism's all-gathers and reduce-scatters with the projections, and this run has "
          "parallel.sequence_parallel=false; set parallel.sequence_parallel=true (with parallel.tensor > 1) or drop it")
    _need(cfg.mesh.tensor == -1 or cfg.mesh.tensor > 1, "parallel.collective_matmul",
          "passes sequence chunks round the tensor ranks and needs parallel.tensor > 1; set it or drop "
          "parallel.collective_matmul")
    _need(m.fp8 == "off", "parallel.collective_matmul",
          f"multiplies in model.dtype and does not compose with model.fp8={m.fp8}; use one of the two")
    _need(not cfg.train.lora.rank, "parallel.collective_matmul",
          "does not compose with train.lora (the adapters would gather each region's input again beside the "
          "ring); drop one of the two")


def check_sequence_parallel(m: ModelConfig, tensor: int) -> None:
    """``parallel.sequence_parallel`` on ``tensor`` tensor ranks: for a config's sizes and for a model
    definition built for a tensor size directly (:func:`meshtron.train.state.model_def_from_config`)."""
    if not m.sequence_parallel:
        return
    _need(tensor > 1, "parallel.sequence_parallel",
          f"splits activations over the tensor ranks and needs parallel.tensor > 1 (this mesh has tensor={tensor}); "
          "set parallel.tensor or turn it off")
    _need(m.seq_len % tensor == 0, "parallel.sequence_parallel",
          f"model.seq_len={m.seq_len} must be divisible by parallel.tensor={tensor} (each tensor rank holds "
          "seq_len/tensor positions)")


def _check_context_split(m: ModelConfig, mesh: MeshConfig) -> None:
    """A sequence split over ``parallel.context`` ranks, each holding a front chunk and its mirror."""
    _need(m.seq_len % (2 * mesh.context) == 0, "parallel.context",
          f"model.seq_len={m.seq_len} must be divisible by 2 x parallel.context = {2 * mesh.context} (each context "
          "rank holds two equal chunks of every sequence); use a seq_len or context size that fits")
    if m.sequence_parallel and mesh.tensor > 1:
        _need(m.seq_len % (2 * mesh.context * mesh.tensor) == 0, "parallel.sequence_parallel",
              f"model.seq_len={m.seq_len} must be divisible by 2 x parallel.context x parallel.tensor = "
              f"{2 * mesh.context * mesh.tensor} (the residual stream is split over both)")
    _need(not m.moe.experts, "parallel.context",
          "a mixture of experts is split over data ranks only, not over a split sequence; use parallel.context=1 "
          "with model.moe.experts")
    _check_ulysses(m, mesh)


def _check_ulysses(m: ModelConfig, mesh: MeshConfig) -> None:
    """The all-to-all exchanges: ``hybrid``'s groups of ``parallel.ulysses_degree`` ranks divide the context
    ranks, leaving a ring of two or more; the query heads of a tensor rank (a built-in family's: a user's
    model is checked when its attention is traced) split evenly over the ranks an all-to-all joins."""
    c, u, exchange = mesh.context, m.ulysses_degree, m.context_attention
    if exchange != "hybrid":
        _need(u == 1, "parallel.ulysses_degree", f"{u} sets the hybrid exchange's all-to-all ranks, and this run has "
              f"parallel.context_attention={exchange}; use parallel.context_attention=hybrid or drop it")
    else:
        _need(1 < u < c and c % u == 0, "parallel.ulysses_degree",
              f"the hybrid exchange needs 1 < parallel.ulysses_degree < parallel.context={c}, dividing it (an "
              f"all-to-all over each group of that many ranks, a ring across the groups), got {u}; use "
              "parallel.context_attention=ulysses or ring for all-to-alls or a ring alone")
    if m.factory is not None or exchange not in ("ulysses", "hybrid") or mesh.tensor < 1 or m.heads % mesh.tensor:
        return
    heads = m.heads // mesh.tensor
    if exchange == "ulysses":
        _need(heads % c == 0, "parallel.context_attention",
              f"ulysses splits the {heads} query heads of each tensor rank over parallel.context={c} ranks, which must "
              f"divide them; use parallel.context_attention=hybrid with a parallel.ulysses_degree that divides {heads} "
              "(the rest of the ranks a ring)")
    else:
        _need(heads % u == 0, "parallel.ulysses_degree",
              f"{u} must divide the {heads} query heads of each tensor rank (the all-to-all splits them); use a "
              f"divisor of {heads} that divides parallel.context={c}")


def check_tensor_split(m: ModelConfig, mesh: MeshConfig) -> None:
    """Megatron's tensor-parallel split needs whole heads and equal MLP slices on every shard (for the
    built-in families; a user's model is checked parameter by parameter when it is laid out)."""
    if mesh.tensor > 1 and m.factory is None:
        _need(
            m.heads % mesh.tensor == 0,
            "model.heads",
            f"{m.heads} heads cannot be split over parallel.tensor={mesh.tensor}; use a multiple of {mesh.tensor} "
            "or a tensor size that divides the head count",
        )
        _need(
            m.mlp_dim % mesh.tensor == 0,
            "model.mlp_dim",
            f"{m.mlp_dim} is not divisible by parallel.tensor={mesh.tensor}; use a multiple of {mesh.tensor}",
        )
        if m.moe.experts and m.moe.mlp_dim is not None:
            _need(m.moe.mlp_dim % mesh.tensor == 0, "model.moe.mlp_dim",
                  f"{m.moe.mlp_dim} is not divisible by parallel.tensor={mesh.tensor}; use a multiple of {mesh.tensor}")
        kv = m.kv_heads or m.heads
        _need(
            kv % mesh.tensor == 0 or mesh.tensor % kv == 0,
            "model.kv_heads",
            f"{kv} key/value heads can be neither split over nor replicated across parallel.tensor={mesh.tensor}; "
            f"use a divisor or a multiple of {mesh.tensor}",
        )


def _check_batch_divisible(cfg: Config, data: int) -> None:
    """The global batch splits into ``data`` shards of ``microbatches`` equal microbatches."""
    t = cfg.train
    unit = "pairs" if t.objective == "dpo" else "sequences"  # DPO's batch counts pairs (window pairs if packed)
    _need(
        t.batch_size % (data * t.microbatches) == 0,
        "train.batch_size",
        f"{t.batch_size} {unit} cannot be split over parallel.data={data} x parallel.microbatches={t.microbatches}; "
        f"use a multiple of {data * t.microbatches}",
    )


def _check_pipeline(cfg: Config) -> StageLayout | None:
    """The schedule constraints (Megatron's), each named by the field that fixes it: a known schedule,
    layers split over p·v (or a ``parallel.layout`` that fits), enough microbatches to fill. Returns
    the parsed stage layout, None without a pipeline."""
    pipe, pl = cfg.mesh.pipe, cfg.pipeline
    layers, m = stacked_layers(cfg.model), cfg.train.microbatches
    _need(
        pl.schedule in SCHEDULES or is_schedule_file(pl.schedule),
        "parallel.schedule",
        f"must be one of {', '.join(repr(name) for name in SCHEDULES)} or a PyTorch action CSV file, "
        f"got {pl.schedule!r}",
    )
    _need(
        pl.chunks == 1 or pl.schedule == "interleaved" or is_schedule_file(pl.schedule),
        "parallel.chunks",
        f"{pl.chunks} model chunks per stage need parallel.schedule=interleaved (got {pl.schedule!r}); "
        "set parallel.chunks=1 or use the interleaved schedule",
    )
    if pipe == 1:
        _need(pl.layout is None, "parallel.layout", "is set but parallel.pipe=1 (no pipeline); remove it or use "
              "parallel.pipe > 1")
        return None
    if pl.layout is None:
        _need(pipe <= layers, "parallel.pipe", f"{pipe} stages for {layers} layers: a stage would have no layer; "
              f"use parallel.pipe <= {layers}")
        virtual = pipe * pl.chunks
        _need(
            layers % virtual == 0,
            "model.layers",
            f"{layers}{'' if layers == cfg.model.layers else ' pipelined'} layers cannot be split evenly over parallel.pipe={pipe} x parallel.chunks={pl.chunks}; "
            f"use a multiple of {virtual}, or say which stage runs how many with parallel.layout (e.g. "
            f"{_example_layout(layers, virtual)})",
        )
    try:
        layout = stage_layout(pl.layout, layers, pipe, pl.chunks)
    except ConfigError as err:
        if layers == cfg.model.layers:
            raise
        raise ConfigError(f"{err} (the pipelined layers: model.layers={cfg.model.layers} less the "
                          f"model.first_k_dense_replace={cfg.model.first_k_dense_replace} dense ones, which run "
                          "with the embedding on the first stage)") from None
    _need(cfg.mesh.context == 1 or cfg.model.context_attention not in RING_EXCHANGES or layout.is_even,
          "parallel.context_attention", RING_IN_PIPELINE)
    _need(not cfg.model.collective_matmul or layout.is_even, "parallel.collective_matmul",
          "runs pipeline stages in lockstep (XLA's collective-permute waits for every device of the mesh), which an "
          "uneven parallel.layout's per-stage layer counts cannot; use an even layout or parallel.collective_matmul=false")
    if not is_schedule_file(pl.schedule):  # a CSV's own stages, microbatches and chunks: make_schedule checks
        _need(m >= pipe, "parallel.microbatches",
              f"{m} microbatches cannot fill {pipe} pipeline stages; use parallel.microbatches >= {pipe}")
        if pl.schedule == "interleaved":
            _need(m % pipe == 0, "parallel.microbatches",
                  f"the interleaved schedule needs a multiple of parallel.pipe={pipe} microbatches, got {m}")
    return layout


def stage_layout(spec: Any, layers: int, pipe: int, chunks: int) -> StageLayout:
    """``parallel.layout`` as a :class:`StageLayout` for this model and mesh (even when ``spec`` is
    None); a layout that does not fit is a :class:`ConfigError` naming the field."""
    if spec is not None and not isinstance(spec, str):
        spec = list(spec)
    try:
        return StageLayout.parse(spec, layers, pipe, chunks)
    except LayoutError as err:
        raise ConfigError(f"parallel.layout: {err}") from None


def _example_layout(layers: int, virtual: int) -> str:
    """Counts as even as possible, the extra layers on the middle stages, leaning to the first: the
    last stage also runs the head and the loss, the heavier of the two ends."""
    if layers < virtual:
        return f"{[1] * layers + [0] * (virtual - layers)}"
    base, extra = divmod(layers, virtual)
    counts = [base] * virtual
    for i in range(extra):
        counts[(virtual - extra) // 2 + i] += 1
    return str(counts)
