"""The training loop: data -> jitted step -> metrics, progress bar, periodic held-out evaluation.

Where the weights come from and go (checkpoints, ``train.init_from``, the training and checkpoint
layouts) is :mod:`meshtron.train.resume`; what the loop counts and its per-step rules (cadence,
non-finite steps, stage timing) are :mod:`meshtron.train.bookkeeping`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import jax
import numpy as np
from rich.console import Console

from meshtron.checkpoint import CheckpointStore, RunPosition, abstract_like
from meshtron.config import Config, TrainConfig, load_config, parse_profile_steps, to_dict
from meshtron.data.sources import TokenDatasets, load_training_data, packs_documents
from meshtron.data.text import Corpus
from meshtron.errors import ConfigError, RunStopped
from meshtron.execution import Execution
from meshtron.gpu.targets import devices_for_mesh
from meshtron.megatron import model_flops_per_token
from meshtron.mesh import build_mesh, resolve_sizes, shown_sizes, simulate_devices_for
from meshtron.models.contract import ModelFactory
from meshtron.models.lora import lora_spec
from meshtron.optim import OptimizerSetup, ZeroPlan, learning_rate_schedule, optimizer_setup
from meshtron.outputs import first_missing, remove_if_empty
from meshtron.pipeline.layout import StageLayout
from meshtron.run import Run, check_features, run_for_model
from meshtron.train.bookkeeping import Cadence, NonFinitePolicy, RunRecord, StageTiming
from meshtron.train.objective import check_objective_data, frozen_copy, objective_for, window_channels
from meshtron.train.reference_pass import REFERENCE_FILE, as_is, frozen_reference, prepare_reference
from meshtron.train.reporting import RunProgress, StepProfiler
from meshtron.train.resume import WeightsIO, finish_saving, note
from meshtron.train.sinks import Outcome
from meshtron.train.state import ModelDef, Params, model_def_from_config
from meshtron.train.step import TrainSteps, build_steps
from meshtron.train.stopping import STOP_REASONS, RunStopper
from meshtron.train.trainable import Trainable
from meshtron.units import format_bytes
from meshtron.xla_options import run_options


@dataclass
class TrainResult:
    """What a run produced, for the summary and for callers (tests, benchmarks)."""

    losses: list[float]
    heldout_loss: float
    unigram_loss: float
    tokens_per_s: float
    wall_time_s: float
    steps: int
    params: Any = None  # the trained parameters: canonical nested dict (layers in order), sharded on the mesh
    data_bytes: float = 0.0  # bytes one device sent over `data` in the whole run (from the compiled steps)
    stage_steps: dict[str, int] = field(default_factory=dict)  # optimizer steps run in each stage
    evaluations: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), the last at the end
    first_step: int = 1  # the step ``losses[0]`` belongs to (> 1 when the run resumed from a checkpoint)
    checkpoints: list[int] = field(default_factory=list)  # complete checkpoints in checkpoint.dir at the end


@dataclass
class Trainer:
    """Everything one run needs, built from a :class:`Config` (usable without the CLI)."""

    resolved: Run  # the config resolved for this mesh: sizes, stage layout, schedule, program
    mesh: jax.sharding.Mesh
    model_def: ModelDef
    steps: TrainSteps
    corpus: Corpus | TokenDatasets | None  # the training data (a text, an indexed dataset or a blend); None: not read
    optimizer: OptimizerSetup
    weights: WeightsIO = field(init=False, repr=False)  # where the weights come from and go
    referenced: Callable[[Any], Any] = field(init=False, repr=False)  # a batch as the step takes it (+ DPO's frozen copy)

    def __post_init__(self) -> None:
        self.weights = WeightsIO(self.resolved, self.mesh, self.model_def, self.steps, self.optimizer.freeze_step)
        # an instance attribute: a function kept on the class would be called as a method (with the trainer)
        self.referenced = as_is

    @classmethod
    def from_config(cls, cfg: Config | str | os.PathLike, devices=None, *, verbose: bool = False,
                    model: ModelFactory | None = None, rules: dict[str, str | None] | None = None,
                    read_data: bool = True, run: Run | None = None, target: str | None = None) -> Trainer:
        """The run ``cfg`` describes: a :class:`Config` (:func:`meshtron.load_config` makes one with
        overrides), or a config's file or bundled name as ``--config`` takes it (``"cpu8"``). ``model``: a
        factory ``rngs -> nnx.Module`` of your own model (any :mod:`meshtron.models.contract` model)
        instead of ``model.family``/``model.factory``; ``rules``: its logical axis names -> mesh axes, on
        top of Megatron's table and ``model.rules``. ``read_data=False``: no training data is read (the
        steps can be compiled and analysed, not run). ``run``: ``cfg`` already resolved for these
        devices (:func:`meshtron.run.resolve_run`), used when it fits the model."""
        if isinstance(cfg, (str, os.PathLike)):
            cfg = load_config(cfg)
        elif not isinstance(cfg, Config):
            raise ConfigError(f"cfg: Trainer.from_config takes a Config, or a config file or bundled name such as "
                              f"'cpu8', got a {type(cfg).__name__}")
        if run is None:  # the checks for the sizes it gives, before any device is touched
            check_features(cfg)
        if target is not None:
            devices = devices_for_mesh(cfg.mesh, target, devices)
        if devices is None:  # on a CPU, as many simulated devices as the mesh needs (if JAX has not started)
            simulate_devices_for(cfg.mesh)
        devices = list(jax.devices() if devices is None else devices)
        tensor = resolve_sizes(cfg.mesh, len(devices)).tensor
        model_def = model_def_from_config(cfg.model, tensor, rules=rules, factory=model, adaptation=lora_spec(cfg.train.lora),
                                          platform=devices[0].platform)
        run = run_for_model(cfg, len(devices), model_def.layers, run)
        cfg = run.cfg
        mesh = build_mesh(cfg.mesh, devices, verbose=verbose)
        if model_def.max_len is not None and model_def.max_len < cfg.model.seq_len:
            raise ConfigError(f"model.seq_len: {cfg.model.seq_len} is longer than the model's {model_def.max_len} "
                              f"positions; use model.seq_len <= {model_def.max_len}")
        layout = run.stage_layout
        model_def.check_mesh(mesh, layout.padded_layers if layout is not None else None)
        t = cfg.train
        corpus = None if not read_data else load_training_data(
            cfg.data, seq_len=cfg.model.seq_len, batch_size=t.batch_size, vocab_size=model_def.vocab_size,
            seed=t.seed, samples=t.steps * t.batch_size, eval_samples=t.eval_batches * t.batch_size,
            init_from=t.init_from, config_vocab_size=cfg.model.vocab_size,
        )
        specs = model_def.shardings(mesh)
        zero = ZeroPlan.for_mesh(run.zero.level, model_def.shapes(), specs, model_def.stacked(), mesh,
                                 gather_once=run.zero.gather_once, gather_dtype=run.zero.gather_dtype,
                                 reduce_dtype=run.zero.reduce_dtype, whole=model_def.probed_state())
        if run.zero.level and not zero.active:
            note(f"parallel.zero={run.zero.level}: the mesh has one data rank (parallel.data=1), so nothing is split over "
                 "it; this run is the same as parallel.zero=0")
        objective = objective_for(cfg, model_def)
        if corpus is not None:
            check_objective_data(t.objective, getattr(corpus, "preference", False))
        trainable = Trainable.of_model(model_def)
        optimizer = optimizer_setup(cfg, trainable.part(model_def.logical_axes()), param_specs=trainable.part(specs),
                                    zero=zero)
        steps = build_steps(
            model_def, mesh, optimizer.reduction, optimizer.transform,
            microbatches=cfg.train.microbatches, pipeline=run.pipeline_on(devices[0].platform), stages=optimizer.stages, trainable=trainable,
            skip_nonfinite=cfg.train.on_nonfinite == "skip", zero=zero, seed=t.seed, execution=run.execution,
            offload_optimizer=t.offload_optimizer,
            compiler_options=run_options(cfg.gpu.overlap, cfg.gpu.xla_flags), objective=objective,
            frozen_reference=frozen_copy(cfg),
        )
        return cls(run, mesh, model_def, steps, corpus, optimizer)

    @property
    def cfg(self) -> Config:
        """The run's config, with the mesh's real sizes."""
        return self.resolved.cfg

    @property
    def execution(self) -> Execution:
        """How this run executes the model's code (recomputation, attention, generation's window)."""
        return self.resolved.execution

    @property
    def stage_layout(self) -> StageLayout | None:
        """Layers per virtual stage (``parallel.layout``, else even); None without a pipeline."""
        return self.resolved.stage_layout

    def abstract_step_arguments(self) -> tuple[Any, Any, Any]:
        """The train step's arguments -- parameters, optimizer state, a batch of tokens (with DPO's frozen
        reference weights beside it, :class:`~meshtron.train.step.StepInputs`, where the run holds them) --
        as abstract arrays laid out as this run lays them out: what compiles the step for a mesh without
        allocating a model (``meshtron describe --compile``)."""
        params = abstract_like(self.weights.training_shapes(self.model_def.shapes()), self.steps.param_shardings)
        with jax.set_mesh(self.mesh):
            opt_state = abstract_like(jax.eval_shape(self.steps.init_state_fn, params), self.steps.opt_shardings)
        dpo = self.cfg.train.objective == "dpo"  # pairs: two rows each, windows of one conversation
        channels = window_channels(self.cfg.train, packs_documents(self.cfg.data))
        rows = self.cfg.train.batch_size * (2 if dpo else 1)
        tokens = jax.ShapeDtypeStruct((rows, self.cfg.model.seq_len + 1, *channels), np.int32,
                                      sharding=self.steps.batch_sharding)
        return params, opt_state, self.steps.abstract_inputs(tokens, self.weights.training_shapes(self.model_def.shapes()))

    def train_stream(self, position: int = 0, cursor: dict | None = None):
        """The training batches from batch ``position`` on (``cursor``: a streamed source's read
        position there, from the checkpoint)."""
        t = self.cfg.train
        return self.corpus.train_stream(batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed,
                                        position=position, cursor=cursor)

    def evaluate(self, params) -> float:
        t = self.cfg.train
        stream = self.corpus.heldout_stream(batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed)
        if self.steps.reference_shardings is not None and self.referenced is as_is:  # evaluated before a run
            self.referenced = frozen_reference(self)
        losses = [self.steps.eval(params, self.referenced(stream.batch(i, self.steps.batch_sharding))) for i in range(t.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    # ---- weights in and out (WeightsIO), for callers that hold the trainer ---------------------

    def init_params(self) -> Params:
        return self.weights.init_params()

    def canonical_params(self, params: Params) -> Params:
        return self.weights.canonical_params(params)

    def open_checkpoints(self) -> CheckpointStore | None:
        return self.weights.open_checkpoints()

    def starting_state(self, store: CheckpointStore | None) -> tuple[Params, Any, RunPosition, str]:
        return self.weights.starting_state(store)

    def restore(self, store: CheckpointStore) -> tuple[Params, Any, RunPosition] | None:
        return self.weights.restore(store)

    def save(self, store: CheckpointStore, params: Params, opt_state, position: RunPosition) -> None:
        self.weights.save(store, params, opt_state, position, self.corpus.tokenizer)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, *, metrics_file: IO[str] | None = None, console: Console | None = None,
            on_event: Callable[[str, int], None] | None = None) -> TrainResult:
        """Train to ``train.steps``, resuming from ``checkpoint.dir`` when it holds a checkpoint.

        ``on_event(event, step)`` is called at ``"dispatched"`` (the step is queued on the devices),
        ``"saving"`` (a checkpoint's arrays are on the host, files being written) and ``"done"``.

        SIGTERM and SIGINT (handled only while this runs, from the main thread), and
        ``train.max_minutes`` counted from this call, end the run after the step in flight: a
        checkpoint of that step is written and on disk (with ``checkpoint.dir``), its metrics record
        is written, one line says why, and :class:`~meshtron.errors.RunStopped` is raised.
        """
        if self.corpus is None:
            raise ConfigError("Trainer.run: this trainer was built with read_data=False (no training data); build it "
                              "with Trainer.from_config(cfg) to train")
        stopper = RunStopper(self.cfg.train.max_minutes, lead=jax.process_index() == 0,
                           saving=self.cfg.checkpoint.dir is not None)
        store = self.open_checkpoints()
        console = console or Console(stderr=True, quiet=jax.process_index() != 0)
        try:
            with stopper:
                return self._run(stopper, store, metrics_file, console, on_event or (lambda event, step: None))
        except BaseException:
            if store is not None:  # a run that failed before its first checkpoint leaves no empty directory
                store.discard_if_unused(leftovers=(REFERENCE_FILE,))
            raise

    def _run(self, stopper: RunStopper, store: CheckpointStore | None, metrics_file: IO[str] | None,
             console: Console, on_event: Callable[[str, int], None]) -> TrainResult:
        t = self.cfg.train
        params, opt_state, position, weights = _start(self, store)
        progress = self._progress(position.step, console, metrics_file)
        profiler = StepProfiler(parse_profile_steps(t.profile_steps), t.profile_dir)
        cadence, nonfinite = Cadence.of(self.cfg), NonFinitePolicy.of(t, store)
        record = RunRecord(position.updates, StageTiming.of(self.steps.stages, self.cfg), learning_rate_schedule(t))
        outcome: Outcome = "failed"  # how the run ended, for the records' sinks: until the steps are done, an error
        try:
            progress.started(position.step, weights)
            self.referenced = prepare_reference(self, params, store, position.step > 0, console.print)
            stream = self.train_stream(position.data_position, position.data_cursor)
            unigram, per_byte = baselines(t.objective, self.corpus)
            with progress, stream:
                record.timing.start()
                for step in range(position.step + 1, t.steps + 1):
                    stage = self.optimizer.stage_at(record.updates)
                    profiler.before(step)
                    batch = self.referenced(stream.next(self.steps.batch_sharding))
                    reported = self._layer_reports(params, batch) if cadence.logs(step) else {}
                    tick = time.perf_counter()
                    params, opt_state, metrics = self.steps.train(params, opt_state, batch, stage)
                    on_event("dispatched", step)
                    loss, grad_norm = metrics.mean()  # blocks until the step is done
                    elapsed, interval = record.timing.lap(tick)
                    profiler.after(step)
                    applied = nonfinite.applies(step, loss, grad_norm, metrics, progress.note)
                    stage_bytes = self.steps.data_bytes(stage)
                    first_of_stage = record.stepped(loss, applied, stage, elapsed, stage_bytes)
                    stop = stopper.poll() if step < t.steps else 0  # (multi-process: agreed by all processes)
                    held = record.evaluated(step, self.evaluate(params)) if cadence.evaluates(step, stop) else None
                    progress.stepped(step, loss=loss, grad_norm=grad_norm, tokens_per_s=record.timing.tokens_per_s,
                                     lr=record.lr(applied), stage=stage, data_bytes=stage_bytes,
                                     first_of_stage=first_of_stage, logged=cadence.logs(step, stop), heldout=held,
                                     unigram=unigram, bytes_per_token=per_byte,
                                     step_seconds=interval, reported=reported)
                    if store is not None and cadence.saves(step, stop):
                        self.save(store, params, opt_state, _position(step, record.updates, stream))
                        on_event("saving", step)
                    progress.advance()
                    on_event("done", step)
                    if stop:
                        record.stopped = (step, stop)
                        break
                if record.stopped is None and not record.evaluations:  # resumed at the last step
                    record.evaluated(t.steps, self.evaluate(params))  # the held-out loss of what was restored
            outcome = "finished" if record.stopped is None else "stopped"
        finally:
            saved = _finish(store, profiler, progress, outcome)
        if record.stopped is not None:  # the checkpoint is on disk (finish_saving), the progress bar closed
            raise _stopped(stopper, *record.stopped, t, store, console)
        timing = record.timing
        return TrainResult(record.losses, record.heldout, unigram, timing.tokens_per_s,
                           time.perf_counter() - record.start, t.steps, self.canonical_params(params),
                           timing.data_bytes, timing.stage_steps, record.evaluations, position.step + 1, saved)

    def _layer_reports(self, params: Params, batch) -> dict[str, Any]:
        """What the layers measure (a mixture of experts' routing) on a logged step: a forward pass over
        this batch with the parameters the step starts from, so the values are those of the step's own
        forward."""
        reported = {}
        for found in self.steps.layer_reports(params, batch):
            reported.update(found.metrics(self.steps.report_groups))
        reported.update(self.steps.objective_metrics(params, batch))
        return reported

    def _progress(self, step: int, console: Console, metrics_file: IO[str] | None) -> RunProgress:
        """Where the run's numbers go (bar, metrics lines, TensorBoard, trackers), from ``step`` on."""
        t, m = self.cfg.train, self.cfg.model
        return RunProgress(t.steps, step, console=console, lead=jax.process_index() == 0, metrics_file=metrics_file,
                           train=t, config=to_dict(self.cfg), memory=self.steps.memory, run_dir=self.cfg.checkpoint.dir,
                           staged=len(self.steps.stages) > 1,
                           peak_flops=t.peak_flops and t.peak_flops * self.mesh.size,
                           flops_per_token=model_flops_per_token(self.model_def.parameter_count(),
                                                                 self.model_def.layers, m.hidden, m.seq_len))


def _start(trainer: Trainer, store: CheckpointStore | None) -> tuple[Params, Any, RunPosition, str]:
    """The run's starting state (:meth:`Trainer.starting_state`), the store closed when it cannot be had."""
    try:
        return trainer.starting_state(store)
    except BaseException:
        if store is not None:
            store.close()
        raise


def _finish(store: CheckpointStore | None, profiler: StepProfiler, progress: RunProgress, outcome: Outcome) -> list[int]:
    """The run's end, however it ends: the profiler stopped, the checkpoint writes waited for (returns the
    complete checkpoints' steps), then the records' sinks closed with how the run ended -- failed, too,
    when the writes fail."""
    profiler.stop()
    try:
        return finish_saving(store)
    except BaseException:
        outcome = "failed"
        raise
    finally:
        progress.close(outcome)


def _position(step: int, updates: int, stream) -> RunPosition:
    """Where the run stands after ``step``: the next batch, and a streamed source's read position there."""
    return RunPosition(step, updates, stream.position, stream.cursor())


def _stopped(stopper: RunStopper, step: int, code: int, t: TrainConfig, store: CheckpointStore | None,
             console: Console) -> RunStopped:
    """A run stopped early (a signal, ``train.max_minutes``): says why in one line, and the error to raise."""
    message = stopper.describe(step, code, t, store.directory if store is not None else None)
    console.print(message, soft_wrap=True)
    return RunStopped(message, step=step, reason=STOP_REASONS[code],
                      checkpoint=f"{store.directory}/{step}" if store is not None else None)


def baselines(objective: str, corpus: Any) -> tuple[float, float]:
    """(unigram loss, held-out bytes per token) the progress compares the held-out loss with; none for DPO's
    loss over pairs."""
    if objective == "dpo":
        return math.nan, math.nan
    return corpus.unigram_loss(), corpus.heldout_bytes_per_token


def print_summary(result: TrainResult, trainer: Trainer, out=None) -> None:
    out = out or sys.stdout
    mesh = shown_sizes(trainer.mesh.shape)
    margin = result.unigram_loss - result.heldout_loss
    per_byte = trainer.corpus.heldout_bytes_per_token
    preference = trainer.cfg.train.objective == "dpo"
    lines = [
        "",
        (f"mesh {mesh}  model {trainer.model_def.describe()}  "
        f"steps {result.steps}  data {trainer.corpus.source}"),
        f"held-out loss     {result.heldout_loss:.4f} (train.dpo.loss={trainer.cfg.train.dpo.loss}, a mean over pairs)"
        if preference else
        f"held-out loss     {result.heldout_loss:.4f} nats/token" + (
            f", {result.heldout_loss / per_byte:.4f} nats/byte of text" if math.isfinite(per_byte) and per_byte != 1
            else ""),
        *([] if preference else [(f"unigram baseline  {result.unigram_loss:.4f} nats/token  (model is {abs(margin):.4f} "
                                  f"{'below' if margin > 0 else 'above'} it)")]),
        f"throughput        {result.tokens_per_s:,.0f} tokens/s (after compilation)",
        (f"sent over data    {format_bytes(result.data_bytes)} per device in the run ("
         + ", ".join(f"{name}: {n} steps" for name, n in result.stage_steps.items()) + ")"),
        f"wall time         {result.wall_time_s:.1f} s",
    ]
    if trainer.cfg.checkpoint.dir is not None:
        lines.append(f"checkpoints       {trainer.cfg.checkpoint.dir}: steps "
                     + (", ".join(map(str, result.checkpoints)) or "none"))
    print("\n".join(lines), file=out)


def train_from_config(cfg: Config, metrics_path: str | None = None, run: Run | None = None) -> TrainResult:
    """The CLI's run: train (resuming from ``checkpoint.dir``), print the summary; in a multi-process
    run only process 0 writes metrics and prints. ``run``: ``cfg`` already resolved."""
    trainer = Trainer.from_config(cfg, verbose=jax.process_index() == 0, run=run)
    if metrics_path and jax.process_index() == 0:
        created = first_missing(metrics_path)  # a run that fails before its first record leaves no file
        Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(metrics_path, "a+") as f:  # run() keeps the records of the steps it resumes after
                result = trainer.run(metrics_file=f)
        except BaseException:
            if created is not None and Path(metrics_path).stat().st_size == 0:
                Path(metrics_path).unlink()
                remove_if_empty(Path(metrics_path).parent, created)
            raise
    else:
        result = trainer.run()
    if jax.process_index() == 0:
        print_summary(result, trainer)
    return result
