"""A config on a number of devices, resolved once: the mesh's sizes (a -1 axis given its size), the
checks that depend on them, and the pipeline's stage layout, schedule and compiled program.

The trainer, ``describe``, the parity oracle and the CLI take a :class:`Run` instead of re-deriving
any of it. Pure Python (no JAX): the CLI resolves a run before JAX starts, so a layout or schedule
that cannot work is one line before any device is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshtron.config import RING_IN_PIPELINE, Config, validate_sizes
from meshtron.errors import ConfigError
from meshtron.execution import Execution
from meshtron.mesh import mesh_shape, resolve_sizes
from meshtron.pipeline.execution import PipelinePlan
from meshtron.pipeline.layout import LayoutError, StageLayout
from meshtron.pipeline.program import Program, compile_program
from meshtron.pipeline.schedules import SCHEDULES, Schedule, ScheduleError, is_schedule_file, make_schedule

__all__ = ["MeshSizes", "Run", "resolve_run", "run_for_model", "stage_layout"]


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
    def pipeline(self) -> PipelinePlan | None:
        """How the pipeline runtime executes the training program (None without a pipeline or a program)."""
        return None if self.program is None else PipelinePlan(self.program, self.stage_layout)

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
    if layers is not None and layers != cfg.model.layers:
        cfg = replace(cfg, model=replace(cfg.model, layers=layers))
    validate_sizes(cfg)
    layout = _check_pipeline(cfg)
    if layout is None:
        return Run(cfg)
    pl = cfg.pipeline
    try:
        schedule = make_schedule(pl.schedule, pipe, cfg.train.microbatches, pl.chunks)
    except ScheduleError as err:
        raise ConfigError(f"parallel.schedule: {err}") from None
    compiled = compile_program(schedule, keep_residuals=not pl.recompute) if program else None
    return Run(cfg, layout, schedule, compiled)


def run_for_model(cfg: Config, devices: int, layers: int, run: Run | None = None) -> Run:
    """``run`` (resolved before the model was built, as the CLI does before JAX starts) when it holds for
    a model of ``layers`` layers on ``devices`` devices; else ``cfg`` resolved for them. A model of the
    user's own decides its own depth, and with it the pipeline split."""
    if run is not None and run.cfg.model.layers == layers and run.sizes.devices <= devices:
        return run
    return resolve_run(cfg, devices, layers=layers)


def _need(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


def _check_pipeline(cfg: Config) -> StageLayout | None:
    """The schedule constraints (Megatron's), each named by the field that fixes it: a known schedule,
    layers split over p·v (or a ``parallel.layout`` that fits), enough microbatches to fill. Returns
    the parsed stage layout, None without a pipeline."""
    pipe, pl = cfg.mesh.pipe, cfg.pipeline
    layers, m = cfg.model.layers, cfg.train.microbatches
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
            f"{layers} layers cannot be split evenly over parallel.pipe={pipe} x parallel.chunks={pl.chunks}; "
            f"use a multiple of {virtual}, or say which stage runs how many with parallel.layout (e.g. "
            f"{_example_layout(layers, virtual)})",
        )
    layout = stage_layout(pl.layout, layers, pipe, pl.chunks)
    _need(cfg.mesh.context == 1 or cfg.model.context_attention != "ring" or layout.is_even,
          "parallel.context_attention", RING_IN_PIPELINE)
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
