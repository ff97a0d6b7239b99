"""The training loop: data -> jitted step -> metrics, progress bar, periodic held-out evaluation."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console

from meshtron.checkpoint import CheckpointError, CheckpointStore, RunPosition, abstract_like
from meshtron.checkpoint_dirs import checkpoint_location, imported_step, is_import, read_step_meta
from meshtron.config import (
    Config,
    load_config,
    parse_profile_steps,
    to_dict,
    upgraded,
    writing_into_an_import,
)
from meshtron.data.sources import TokenDatasets, load_training_data, packs_documents
from meshtron.data.text import Corpus
from meshtron.data.tokenizers import save_tokenizer
from meshtron.errors import ConfigError, NonFiniteLossError, RunStopped
from meshtron.megatron import model_flops_per_token
from meshtron.mesh import build_mesh, resolve_sizes, shown_sizes, simulate_devices_for
from meshtron.models.contract import ModelFactory
from meshtron.models.lora import adapters_only
from meshtron.optim import OptimizerSetup, ZeroPlan, learning_rate_schedule, optimizer_setup
from meshtron.optim.layout import merge_error_buffers, split_error_buffers
from meshtron.outputs import first_missing, remove_if_empty
from meshtron.pipeline.layout import StageLayout
from meshtron.run import Run, run_for_model
from meshtron.train.frozen_base import (
    BASE_KEY,
    BasePointer,
    adapters_only_target,
    check_read_alike,
    newest_meta,
    params_digest,
    read_params,
    with_base,
)
from meshtron.train.pipelined import (
    canonical_positions,
    permute_layers,
    permute_state_layers,
    stage_order,
    to_canonical,
    to_stage_order,
)
from meshtron.train.reporting import RunProgress, StepProfiler
from meshtron.train.state import ModelDef, Params, lora_spec, model_def_from_config
from meshtron.train.step import TrainSteps, build_steps
from meshtron.train.stopping import STOP_REASONS, RunStopper
from meshtron.units import format_bytes


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
    programs: dict[Any, Any] = field(default_factory=dict, repr=False)  # jitted helpers, compiled once per run
    base: BasePointer | None = None  # LoRA: where the frozen base came from (adapter-only checkpoints point to it)

    @classmethod
    def from_config(cls, cfg: Config | str | os.PathLike, devices=None, *, verbose: bool = False,
                    model: ModelFactory | None = None, rules: dict[str, str | None] | None = None,
                    read_data: bool = True, run: Run | None = None) -> Trainer:
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
        if devices is None:  # on a CPU, as many simulated devices as the mesh needs (if JAX has not started)
            simulate_devices_for(cfg.mesh)
        devices = list(jax.devices() if devices is None else devices)
        tensor = resolve_sizes(cfg.mesh, len(devices)).tensor
        model_def = model_def_from_config(cfg.model, tensor, rules=rules, factory=model, lora=lora_spec(cfg.train.lora))
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
        zero = ZeroPlan.for_mesh(t.zero, model_def.shapes(), specs, model_def.stacked(), mesh, gather_once=t.gather_once)
        if t.zero and not zero.active:
            _note(f"parallel.zero={t.zero}: the mesh has one data rank (parallel.data=1), so nothing is split over "
                  "it; this run is the same as parallel.zero=0")
        optimizer = optimizer_setup(cfg, model_def.trainable_part(model_def.logical_axes()),
                                    param_specs=model_def.trainable_part(specs), zero=zero)
        steps = build_steps(
            model_def, mesh, optimizer.reduction, optimizer.transform,
            microbatches=cfg.train.microbatches, pipeline=run.pipeline, stages=optimizer.stages,
            skip_nonfinite=cfg.train.on_nonfinite == "skip", zero=zero, seed=t.seed,
        )
        return cls(run, mesh, model_def, steps, corpus, optimizer)

    @property
    def cfg(self) -> Config:
        """The run's config, with the mesh's real sizes."""
        return self.resolved.cfg

    @property
    def stage_layout(self) -> StageLayout | None:
        """Layers per virtual stage (``parallel.layout``, else even); None without a pipeline."""
        return self.resolved.stage_layout

    def training_shapes(self, shapes: Params) -> Params:
        """Shapes of the parameters as training holds them (stage order; padded by an uneven layout)."""
        layout = self.stage_layout
        if layout is None:
            return shapes
        return jax.eval_shape(lambda p: to_stage_order(p, self.model_def.layers, layout.stages, layout.chunks, layout),
                              shapes)

    def abstract_step_arguments(self) -> tuple[Any, Any, jax.ShapeDtypeStruct]:
        """The train step's arguments -- parameters, optimizer state, a batch of tokens -- as abstract
        arrays laid out as this run lays them out: what compiles the step for a mesh without allocating
        a model (``meshtron describe --compile``)."""
        params = abstract_like(self.training_shapes(self.model_def.shapes()), self.steps.param_shardings)
        with jax.set_mesh(self.mesh):
            opt_state = abstract_like(jax.eval_shape(self.steps.init_state_fn, params), self.steps.opt_shardings)
        channels = (3,) if packs_documents(self.cfg.data) else ()  # windows of packed documents
        tokens = jax.ShapeDtypeStruct((self.cfg.train.batch_size, self.cfg.model.seq_len + 1, *channels), np.int32,
                                      sharding=self.steps.batch_sharding)
        return params, opt_state, tokens

    def init_params(self) -> Params:
        """Fresh parameters, sharded; with pipelining, block layers are put in stage order."""
        pipe = self.mesh.shape["pipe"]
        shardings = self.steps.param_shardings
        if pipe == 1:
            return self.model_def.init(self.mesh, self.cfg.train.seed, shardings=shardings)
        reorder = partial(to_stage_order, layers=self.model_def.layers, stages=pipe, chunks=self.cfg.pipeline.chunks,
                          layout=self.stage_layout)
        return self.model_def.init(self.mesh, self.cfg.train.seed, into=reorder, shardings=shardings)

    def _canonical_shardings(self, shardings):
        """Where the model-order (checkpoint) state lives: as in training, except that with an uneven
        ``parallel.layout`` the layer axis -- unpadded there, and maybe not divisible by ``pipe`` -- is
        not split over ``pipe`` (only layer-stacked leaves name ``pipe``)."""
        layout = self.stage_layout
        if layout is None or layout.is_even:
            return shardings

        def unpiped(sharding):
            def drop(entry):
                if entry == "pipe":
                    return None
                if isinstance(entry, tuple):
                    kept = tuple(a for a in entry if a != "pipe")
                    return kept or None
                return entry

            return NamedSharding(sharding.mesh, PartitionSpec(*map(drop, sharding.spec)))

        return jax.tree.map(unpiped, shardings)

    def canonical_params(self, params: Params) -> Params:
        """Training-layout parameters back in canonical layer order (undoes :meth:`init_params`' reorder)."""
        pipe = self.mesh.shape["pipe"]
        if pipe == 1:
            return params
        reorder = partial(to_canonical, layers=self.model_def.layers, stages=pipe, chunks=self.cfg.pipeline.chunks,
                          layout=self.stage_layout)
        with jax.set_mesh(self.mesh):
            return jax.jit(reorder, out_shardings=self._canonical_shardings(self.steps.param_shardings))(params)

    def train_stream(self, position: int = 0):
        t = self.cfg.train
        return self.corpus.train_stream(batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed,
                                        position=position)

    def evaluate(self, params) -> float:
        t = self.cfg.train
        stream = self.corpus.heldout_stream(batch_size=t.batch_size, seq_len=self.cfg.model.seq_len, seed=t.seed)
        losses = [self.steps.eval(params, stream.batch(i, self.steps.batch_sharding)) for i in range(t.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    # ---- checkpoints -------------------------------------------------------------------------

    def _layer_perm(self, to_stage: bool) -> np.ndarray | None:
        pipe = self.mesh.shape["pipe"]
        if pipe == 1:
            return None
        order = stage_order(self.model_def.layers, pipe, self.cfg.pipeline.chunks, self.stage_layout)
        return order if to_stage else canonical_positions(order)

    def _move_layers(self, params: Params, opt_state, *, to_stage: bool):
        """Parameters and optimizer state (without 1-bit LAMB's per-device error buffers, which never
        move) with the stacked layer axis moved to stage order (or back); the jitted program is kept,
        so periodic saves compile it once."""
        key = ("move_layers", to_stage)
        if key not in self.programs:
            perm, treedef = self._layer_perm(to_stage), jax.tree.structure(params)
            shardings = (self.steps.param_shardings, split_error_buffers(self.steps.opt_shardings)[0])
            self.programs[key] = jax.jit(
                lambda p, s: (permute_layers(p, perm), permute_state_layers(s, treedef, perm)),
                out_shardings=shardings if to_stage else self._canonical_shardings(shardings),
                donate_argnums=(0, 1) if to_stage else (),  # restored arrays are not needed twice
            )
        with jax.set_mesh(self.mesh):
            return self.programs[key](params, opt_state)

    def canonical_state(self, params: Params, opt_state) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """What a checkpoint stores: ``{"params", "opt_state"}`` with block layers in model order, and
        1-bit LAMB's per-device error buffers apart (a new array is made only where layers move)."""
        opt_state, errors = split_error_buffers(opt_state)
        if self._layer_perm(to_stage=False) is not None:
            params, opt_state = self._move_layers(params, opt_state, to_stage=False)
        return {"params": params, "opt_state": opt_state}, errors

    def training_state(self, state: dict[str, Any], errors: list[dict[str, Any]]):
        """Inverse of :meth:`canonical_state`: ``(params, opt_state)`` laid out for this run's steps."""
        params, opt_state = state["params"], state["opt_state"]
        if self._layer_perm(to_stage=True) is not None:
            params, opt_state = self._move_layers(params, opt_state, to_stage=True)
        return params, merge_error_buffers(opt_state, errors)

    def layout(self) -> dict[str, Any]:
        """What the per-device error buffers depend on: restored only onto the same layout."""
        layout = {"mesh": [int(self.mesh.shape[a]) for a in ("data", "pipe", "tensor")],
                  "chunks": self.cfg.pipeline.chunks if self.mesh.shape["pipe"] > 1 else 1}
        if self.mesh.shape["context"] > 1:  # the buffers are per device of data x context
            layout["context"] = int(self.mesh.shape["context"])
        stages = self.stage_layout
        if stages is not None and not stages.is_even:  # the buffers are padded as the layout says
            layout["layers_per_virtual_stage"] = list(stages.counts)
        return layout

    def open_checkpoints(self) -> CheckpointStore | None:
        c = self.cfg.checkpoint
        if c.dir is None:
            return None
        store = CheckpointStore(c.dir, keep=c.keep, async_save=c.async_save)
        steps = store.steps()
        if not c.resume and steps:
            store.close()
            raise ConfigError(
                f"checkpoint.dir: {c.dir} already holds checkpoints (newest step {steps[-1]}) and "
                "checkpoint.resume=false; resume from them (checkpoint.resume=true) or choose another directory"
            )
        imported = imported_step(store.directory)
        if imported is not None:
            store.close()
            raise writing_into_an_import(c.dir, imported)
        return store

    def restore(self, store: CheckpointStore) -> tuple[Params, Any, RunPosition] | None:
        """The newest intact checkpoint in ``store``, laid out for this run; ``None`` if there is none.

        Parameters and optimizer state are read straight onto this run's shardings (any mesh). 1-bit
        LAMB's error buffers come back only onto the layout that wrote them (with
        ``checkpoint.onebit_errors=keep``); otherwise they restart from zero (reference section 2.9).
        The optimizer's stage follows from the restored update count.
        """
        read = self._read_state(store)
        return None if read is None else read[:3]

    def _read_state(self, store: CheckpointStore, step: int | None = None, source: str = "checkpoint.dir"):
        """``(params, opt_state, position, meta)`` of a checkpoint in ``store`` (the newest intact one, or
        ``step``), laid out for this run; None if the store holds none."""
        shapes = self.model_def.shapes()
        with jax.set_mesh(self.mesh):
            abstract = jax.eval_shape(self.steps.init_state_fn, shapes)
            # The error buffers are per device, in the training layout: sized by the stage-ordered
            # parameters, which an uneven parallel.layout pads.
            trained = jax.eval_shape(self.steps.init_state_fn, self.training_shapes(shapes))
        opt_target, _ = split_error_buffers(abstract_like(abstract, self._canonical_shardings(self.steps.opt_shardings)))
        _, error_target = split_error_buffers(abstract_like(trained, self.steps.opt_shardings))
        shardings = self._canonical_shardings(self.steps.param_shardings)
        state_target = {"params": abstract_like(shapes, shardings), "opt_state": opt_target}
        # an adapter-only checkpoint: its base is elsewhere
        pointer = BasePointer.from_meta(newest_meta(store, step), store.directory)
        state_target = adapters_only_target(state_target, pointer)
        layout = self.layout()
        restored = store.restore_newest(
            state_target, error_target if any(x.size for x in jax.tree.leaves(error_target)) else None, self.mesh,
            use_errors=lambda meta: meta.get("layout") == layout and self.cfg.checkpoint.onebit_errors == "keep",
            resizable=self.model_def.resizable_in(state_target), only=step, source=source,
        )
        if restored is None:
            return None
        check_read_alike(restored, pointer, store, source)
        errors = restored.errors
        if errors is None and error_target:
            errors = jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), error_target),
                             out_shardings=jax.tree.map(lambda t: t.sharding, error_target))()
            if restored.position.updates >= (self.optimizer.freeze_step or 0):
                _note(f"1-bit LAMB error buffers restart from zero (checkpoint layout {restored.meta.get('layout')}, "
                      f"this run {layout})")
        state = with_base(restored.state, pointer, self.model_def, self.mesh, shardings, source)
        params, opt_state = self.training_state(state, errors or [])
        return params, opt_state, restored.position, restored.meta

    def _read_params(self, store: CheckpointStore, step: int | None, source: str) -> tuple[Params, dict[str, Any]]:
        """The parameters (only) of a checkpoint in ``store``, in this run's training layout, and its meta."""
        params, meta = read_params(store, self.model_def, self.mesh,
                                   self._canonical_shardings(self.steps.param_shardings), step=step, source=source,
                                   seed=self.cfg.train.seed)
        perm = self._layer_perm(to_stage=True)
        if perm is not None:
            with jax.set_mesh(self.mesh):
                params = jax.jit(lambda p: permute_layers(p, perm), out_shardings=self.steps.param_shardings)(params)
        return params, meta

    def starting_state(self, store: CheckpointStore | None) -> tuple[Params, Any, RunPosition, str]:
        """Where the run starts, and one line saying where its weights came from: its own newest
        checkpoint in ``checkpoint.dir`` (resumed), else ``train.init_from`` (initialised), else a new
        model from ``train.seed``. Sets the store's run id (rotation deletes only this run's steps)."""
        t = self.cfg.train
        try:
            resumed = self._read_state(store) if store is not None else None
        except CheckpointError as err:
            other = another_run(newest_meta(store), self.cfg)
            if other is None:
                raise
            raise ConfigError(
                f"checkpoint.dir: {store.directory} holds the checkpoints of another run ({other}), which this run "
                f"cannot resume; give this run a directory of its own (checkpoint.dir={store.directory}-2, say), or "
                "resume that run with its settings") from err
        if resumed is not None:
            params, opt_state, position, meta = resumed
            saved_vocab = ((meta.get("config") or {}).get("model") or {}).get("vocab_size")
            if saved_vocab is not None and saved_vocab != self.cfg.model.vocab_size:  # (restored padded or cut)
                raise ConfigError(
                    f"model.vocab_size: {self.cfg.model.vocab_size} differs from the {saved_vocab} of the run this "
                    f"checkpoint.dir ({store.directory}) resumes; set model.vocab_size={saved_vocab}, or give a new "
                    "vocabulary's run a directory of its own")
            if position.step > t.steps:
                raise ConfigError(
                    f"train.steps: {t.steps} is below the step of the newest checkpoint in {store.directory} "
                    f"({position.step}); raise train.steps to train on from it, or use another checkpoint.dir")
            store.adopt(meta)
            self.base = BasePointer.from_meta(meta, store.directory) or self._configured_base()
            line = f"weights: resumed from {store.directory}/{position.step} (step {position.step} of {t.steps})"
            if t.init_from is not None:
                line += "; train.init_from is used only when checkpoint.dir holds no checkpoint"
            return params, opt_state, position, line
        if store is not None:
            store.adopt({})
        if t.init_from is None:
            params = self.init_params()
            self.base = BasePointer(None, None, t.seed)
            return params, self.steps.init_opt_state(params), RunPosition(0, 0, 0), f"weights: a new model from seed {t.seed}"
        return self._initial_state(*checkpoint_location(t.init_from))

    def _configured_base(self, meta: dict[str, Any] | None = None) -> BasePointer:
        """Where this run's frozen base comes from by its config: ``train.init_from`` (the step whose meta
        record is ``meta``, default its newest -- or, if that checkpoint points to its own base, that
        base), with the digest of its parameters' recorded checksums (readers refuse another model put
        there), else a new model from ``train.seed``."""
        t = self.cfg.train
        if t.init_from is None:
            return BasePointer(None, None, t.seed)
        directory, step = checkpoint_location(t.init_from)
        if meta is None:
            source = CheckpointStore(directory, read_only=True)
            try:
                meta = newest_meta(source, step) or {}
            finally:
                source.close()
        return BasePointer.from_meta(meta, directory) or BasePointer(
            str(Path(directory).resolve()), meta.get("step", step), t.seed, params_digest(meta))

    def _initial_state(self, directory: Path, step: int | None) -> tuple[Params, Any, RunPosition, str]:
        """``train.init_from``: its parameters with a fresh optimizer state at step 0, or with
        ``train.init_optimizer`` its whole training state and position."""
        t = self.cfg.train
        source = CheckpointStore(directory, read_only=True)
        try:
            if not t.init_optimizer:
                params, meta = self._read_params(source, step, "train.init_from")
                self.base = self._configured_base(meta)
                line = (f"weights: initialised from {source.directory}/{meta['step']} (train.init_from; a fresh "
                        f"optimizer state, step 0 of {t.steps})")
                return params, self.steps.init_opt_state(params), RunPosition(0, 0, 0), line
            newest = step if step is not None else (source.steps() or [None])[-1]
            if newest is not None and is_import(read_step_meta(source.directory, newest)):
                raise ConfigError(f"train.init_optimizer: {t.init_from} is an imported model, which holds parameters "
                                  "only; set train.init_optimizer=false")
            read = self._read_state(source, step, "train.init_from")
        finally:
            source.close()
        if read is None:
            raise ConfigError(f"train.init_from: {directory} holds no checkpoint; give a run's checkpoint.dir, an "
                              "import, or one of their step directories")
        params, opt_state, position, meta = read
        self.base = self._configured_base(meta)
        if position.step > t.steps:
            raise ConfigError(f"train.steps: {t.steps} is below the step of train.init_from's checkpoint "
                              f"({position.step}), which train.init_optimizer=true continues from; raise train.steps")
        line = (f"weights: initialised from {source.directory}/{position.step} (train.init_from with its optimizer "
                f"state: continues that run at step {position.step} of {t.steps})")
        return params, opt_state, position, line

    def save(self, store: CheckpointStore, params: Params, opt_state, position: RunPosition) -> None:
        state, errors = self.canonical_state(params, opt_state)
        # (with one data shard the buffers are empty: nothing to keep, and orbax refuses empty arrays)
        keep_errors = self.cfg.checkpoint.onebit_errors == "keep" and any(x.size for x in jax.tree.leaves(errors))
        meta = {"seed": self.cfg.train.seed, "layout": self.layout(), "config": to_dict(self.cfg)}
        if self.model_def.lora is not None and not self.cfg.train.lora.save_base:  # the adapters, and where the base is
            state = {**state, "params": adapters_only(state["params"])}
            meta[BASE_KEY] = (self.base or self._configured_base()).to_meta(store.directory)
        store.save(position, state, errors if keep_errors else None, self.mesh, meta)
        if self.corpus.tokenizer is not None and jax.process_index() == 0:  # generate decodes with it
            save_tokenizer(self.corpus.tokenizer, store.directory)

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
        try:
            with stopper:
                return self._run(stopper, store, metrics_file, console, on_event)
        except BaseException:
            if store is not None:  # a run that failed before its first checkpoint leaves no empty directory
                store.discard_if_unused()
            raise

    def _run(self, stopper: RunStopper, store: CheckpointStore | None, metrics_file: IO[str] | None,
             console: Console | None, on_event: Callable[[str, int], None] | None) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        lead = jax.process_index() == 0
        console = console or Console(stderr=True, quiet=not lead)
        schedule = learning_rate_schedule(t)
        try:
            params, opt_state, position, weights = self.starting_state(store)
        except BaseException:
            if store is not None:
                store.close()
            raise
        progress = RunProgress(t.steps, position.step, console=console, lead=lead, metrics_file=metrics_file,
                               tensorboard=t.tensorboard, staged=len(self.steps.stages) > 1,
                               peak_flops=t.peak_flops and t.peak_flops * self.mesh.size,
                               flops_per_token=model_flops_per_token(self.model_def.parameter_count(),
                                                                     self.model_def.layers, cfg.model.hidden,
                                                                     cfg.model.seq_len))
        profiler = StepProfiler(parse_profile_steps(t.profile_steps), t.profile_dir)
        tokens_per_step = t.batch_size * cfg.model.seq_len
        on_event = on_event or (lambda event, step: None)
        losses: list[float] = []
        heldout = float("nan")
        timed_steps, timed_seconds = 0, 0.0
        data_bytes, stage_steps = 0.0, {name: 0 for name in self.steps.stages}
        evaluations: list[tuple[int, float]] = []
        updates, skipped_in_row = position.updates, 0
        stopped: tuple[int, int] | None = None  # (step, stop code) when the run stops early
        start = time.perf_counter()
        try:
            progress.started(position.step, weights)
            stream = self.train_stream(position.data_position)
            unigram = self.corpus.unigram_loss()
            with progress:
                last_done = time.perf_counter()
                for step in range(position.step + 1, t.steps + 1):
                    stage = self.optimizer.stage_at(updates)
                    profiler.before(step)
                    batch = stream.next(self.steps.batch_sharding)
                    # What the layers measure (a mixture of experts' routing) on a logged step: a forward
                    # pass over this batch with the parameters the step starts from, so the values are
                    # those of the step's own forward.
                    reported = {}
                    if step % t.log_every == 0 or step == t.steps:
                        for found in self.steps.layer_reports(params, batch):
                            reported.update(found.metrics(self.steps.report_groups))
                    tick = time.perf_counter()
                    params, opt_state, metrics = self.steps.train(params, opt_state, batch, stage)
                    on_event("dispatched", step)
                    loss, grad_norm = metrics.mean()  # blocks until the step is done
                    done = time.perf_counter()
                    elapsed, interval, last_done = done - tick, done - last_done, done
                    profiler.after(step)
                    finite = math.isfinite(loss) and math.isfinite(grad_norm) and metrics.was_applied()
                    if not finite:
                        if t.on_nonfinite == "stop" or skipped_in_row + 1 >= t.max_skipped_steps:
                            raise NonFiniteLossError(self._nonfinite_message(step, loss, grad_norm, store,
                                                                             skipped_in_row + 1))
                        skipped_in_row += 1
                        progress.note(f"step {step}: loss {loss}, gradient norm {grad_norm}: update skipped")
                    else:
                        skipped_in_row = 0
                        updates += 1
                    if stage_steps[stage] > 0:  # a stage's first step includes its compilation
                        timed_steps += 1
                        timed_seconds += elapsed
                    stage_bytes = self.steps.data_bytes(stage)
                    data_bytes += stage_bytes
                    stage_steps[stage] += 1
                    losses.append(loss)
                    tps = tokens_per_step * timed_steps / timed_seconds if timed_seconds else float("nan")
                    lr = float(schedule(updates - 1 if finite else updates))
                    stop = stopper.poll() if step < t.steps else 0  # (multi-process: agreed by all processes)
                    held = None
                    if (step % t.eval_every == 0 or step == t.steps) and not stop:
                        heldout = held = self.evaluate(params)
                        evaluations.append((step, heldout))
                    progress.stepped(step, loss=loss, grad_norm=grad_norm, tokens_per_s=tps, lr=lr, stage=stage,
                                     data_bytes=stage_bytes, first_of_stage=stage_steps[stage] == 1,
                                     logged=step % t.log_every == 0 or step == t.steps or bool(stop),
                                     heldout=held, unigram=unigram,
                                     bytes_per_token=self.corpus.heldout_bytes_per_token, step_seconds=interval,
                                     reported=reported)
                    if store is not None and (step % cfg.checkpoint.every == 0 or step == t.steps or stop):
                        self.save(store, params, opt_state, RunPosition(step, updates, stream.position))
                        on_event("saving", step)
                    progress.advance()
                    on_event("done", step)
                    if stop:
                        stopped = (step, stop)
                        break
                else:
                    if not evaluations:  # resumed at the last step: the held-out loss of what was restored
                        heldout = self.evaluate(params)
                        evaluations.append((t.steps, heldout))
        finally:
            profiler.stop()
            progress.close()
            if store is not None:
                store.wait()  # a save in flight completes (or the error surfaces) before we return
                saved = store.steps()
                store.close()
        if stopped is not None:  # the checkpoint is on disk (the wait above), the progress bar closed
            message = stopper.describe(*stopped, t, store.directory if store is not None else None)
            console.print(message, soft_wrap=True)
            raise RunStopped(message, step=stopped[0], reason=STOP_REASONS[stopped[1]],
                             checkpoint=f"{store.directory}/{stopped[0]}" if store is not None else None)
        wall = time.perf_counter() - start
        tps = tokens_per_step * timed_steps / timed_seconds if timed_seconds else float("nan")
        return TrainResult(
            losses, heldout, unigram, tps, wall, t.steps, self.canonical_params(params), data_bytes, stage_steps,
            evaluations, first_step=position.step + 1, checkpoints=saved if store is not None else [],
        )

    def _nonfinite_message(self, step: int, loss: float, grad_norm: float, store, in_row: int) -> str:
        saved = store.steps() if store is not None else []
        where = f"the newest checkpoint (step {saved[-1]}) is intact" if saved else "no checkpoint was written"
        if self.cfg.train.on_nonfinite == "skip":
            return (f"step {step}: {in_row} non-finite steps in a row (loss {loss}, gradient norm {grad_norm}), "
                    f"train.max_skipped_steps={self.cfg.train.max_skipped_steps}; stopped, {where}; lower train.lr")
        return (f"step {step}: loss {loss}, gradient norm {grad_norm} is not finite; stopped, {where}. "
                "Lower train.lr (or raise train.warmup_steps), or set train.on_nonfinite=skip to skip such steps")


# What makes a checkpoint's tensors: a run that differs in these cannot resume another's checkpoints.
# (parallel.sequence_parallel and parallel.context_attention were model.* keys, and are kept here with them.)
_STATE_SETTINGS = ("model", "parallel.sequence_parallel", "parallel.context_attention", "train.optimizer",
                   "train.lora.rank", "train.lora.targets", "train.lora.save_base")


def another_run(meta: dict[str, Any] | None, cfg: Config, shown: int = 3) -> str | None:
    """The settings (``key: theirs -> ours``) in which the run that wrote the checkpoint ``meta`` differs
    from ``cfg`` in what its tensors are made of; ``None`` when it does not (or records no config)."""
    saved = (meta or {}).get("config")
    if not isinstance(saved, dict):
        return None
    try:
        saved = upgraded(saved, "checkpoint's config")
    except ConfigError:
        return None
    theirs, ours = _flat(saved), _flat(to_dict(cfg))
    keys = [k for k in sorted(set(theirs) | set(ours)) if k.startswith(_STATE_SETTINGS)]
    differ = [f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys if theirs.get(k) != ours.get(k)]
    if not differ:
        return None
    return ", ".join(differ[:shown]) + (f" and {len(differ) - shown} more" if len(differ) > shown else "")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _note(message: str) -> None:
    if jax.process_index() == 0:
        print(f"meshtron: {message}", file=sys.stderr)


def print_summary(result: TrainResult, trainer: Trainer, out=None) -> None:
    out = out or sys.stdout
    mesh = shown_sizes(trainer.mesh.shape)
    margin = result.unigram_loss - result.heldout_loss
    per_byte = trainer.corpus.heldout_bytes_per_token
    lines = [
        "",
        (f"mesh {mesh}  model {trainer.model_def.describe()}  "
        f"steps {result.steps}  data {trainer.corpus.source}"),
        f"held-out loss     {result.heldout_loss:.4f} nats/token" + (
            f", {result.heldout_loss / per_byte:.4f} nats/byte of text" if math.isfinite(per_byte) and per_byte != 1
            else ""),
        (f"unigram baseline  {result.unigram_loss:.4f} nats/token  (model is {abs(margin):.4f} "
         f"{'below' if margin > 0 else 'above'} it)"),
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
