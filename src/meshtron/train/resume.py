"""Where a run's weights come from and where they go: its own checkpoints (resumed), ``train.init_from``
(initialised), or a new model; and the checkpoints it writes.

Training holds the block layers in stage order (padded by an uneven ``parallel.layout``), a checkpoint
in model order: :class:`WeightsIO` moves them between the two, so a checkpoint reads back onto any
mesh. 1-bit LAMB's per-device error buffers are the exception -- they never move, and come back only
onto the layout that wrote them. A LoRA run that saves its adapters alone records where its frozen
base came from.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshtron.checkpoint import CheckpointError, CheckpointStore, RunPosition, abstract_like
from meshtron.checkpoint_dirs import checkpoint_location, imported_step, is_import, read_step_meta
from meshtron.config import Config, to_dict, upgraded, writing_into_an_import
from meshtron.data.tokenizers import save_tokenizer
from meshtron.errors import ConfigError
from meshtron.models.lora import adapters_only
from meshtron.optim.layout import merge_error_buffers, split_error_buffers
from meshtron.run import Run
from meshtron.train.frozen_base import (
    BASE_KEY,
    BasePointer,
    absent_modules,
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
from meshtron.train.state import ModelDef, Params
from meshtron.train.step import TrainSteps


@dataclass
class WeightsIO:
    """A run's weights in and out: what it starts from, what its checkpoints hold, and the two layouts
    (training's stage order, the checkpoints' model order) between which they move."""

    run: Run  # the config resolved for this mesh
    mesh: jax.sharding.Mesh
    model_def: ModelDef
    steps: TrainSteps
    freeze_step: int | None = None  # 1-bit LAMB: updates before its error buffers are in use
    programs: dict[Any, Any] = field(default_factory=dict, repr=False)  # jitted layer moves, compiled once per run
    base: BasePointer | None = None  # LoRA: where the frozen base came from (adapter-only checkpoints point to it)

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    # ---- the two layouts -----------------------------------------------------------------------

    def training_shapes(self, shapes: Params) -> Params:
        """Shapes of the parameters as training holds them (stage order; padded by an uneven layout)."""
        layout = self.run.stage_layout
        if layout is None:
            return shapes
        return jax.eval_shape(lambda p: to_stage_order(p, self.model_def.layers, layout.stages, layout.chunks, layout),
                              shapes)

    def init_params(self) -> Params:
        """Fresh parameters, sharded; with pipelining, block layers are put in stage order."""
        pipe = self.mesh.shape["pipe"]
        shardings = self.steps.param_shardings
        if pipe == 1:
            return self.model_def.init(self.mesh, self.cfg.train.seed, shardings=shardings)
        reorder = partial(to_stage_order, layers=self.model_def.layers, stages=pipe, chunks=self.cfg.pipeline.chunks,
                          layout=self.run.stage_layout)
        return self.model_def.init(self.mesh, self.cfg.train.seed, into=reorder, shardings=shardings)

    def reference_params(self) -> Params:
        """The weights the run starts from (``train.init_from``'s parameters, else the new model of
        ``train.seed``), read afresh in the training layout: DPO's frozen reference copy, the same on a
        resumed run as on its first."""
        t = self.cfg.train
        if t.init_from is None:
            return self.init_params()
        directory, step = checkpoint_location(t.init_from)
        source = CheckpointStore(directory, read_only=True)
        try:
            return self._read_params(source, step, "train.init_from")[0]
        finally:
            source.close()

    def _canonical_shardings(self, shardings):
        """Where the model-order (checkpoint) state lives: as in training, except that with an uneven
        ``parallel.layout`` the layer axis -- unpadded there, and maybe not divisible by ``pipe`` -- is
        not split over ``pipe`` (only layer-stacked leaves name ``pipe``)."""
        layout = self.run.stage_layout
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
                          layout=self.run.stage_layout)
        with jax.set_mesh(self.mesh):
            return jax.jit(reorder, out_shardings=self._canonical_shardings(self.steps.param_shardings))(params)

    def _layer_perm(self, to_stage: bool) -> np.ndarray | None:
        pipe = self.mesh.shape["pipe"]
        if pipe == 1:
            return None
        order = stage_order(self.model_def.layers, pipe, self.cfg.pipeline.chunks, self.run.stage_layout)
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
        stages = self.run.stage_layout
        if stages is not None and not stages.is_even:  # the buffers are padded as the layout says
            layout["layers_per_virtual_stage"] = list(stages.counts)
        return layout

    # ---- checkpoints ---------------------------------------------------------------------------

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
            if restored.position.updates >= (self.freeze_step or 0):
                note(f"1-bit LAMB error buffers restart from zero (checkpoint layout {restored.meta.get('layout')}, "
                     f"this run {layout})")
        state = with_base(restored.state, pointer, self.model_def, self.mesh, shardings, source)
        params, opt_state = self.training_state(state, errors or [])
        return params, opt_state, restored.position, restored.meta

    def _read_params(self, store: CheckpointStore, step: int | None, source: str) -> tuple[Params, dict[str, Any]]:
        """The parameters (only) of a checkpoint in ``store``, in this run's training layout, and its meta."""
        params, meta = read_params(store, self.model_def, self.mesh,
                                   self._canonical_shardings(self.steps.param_shardings), step=step, source=source,
                                   seed=self.cfg.train.seed, new_modules=True)
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
            meta = newest_meta(store)
            other = another_run(meta, self.cfg)
            if other is None:
                raise
            modules = absent_modules(meta, self.model_def.shapes())
            start = (f"; its weights have no {', '.join(modules)} parameters: to add them, start a new run from them "
                     f"(train.init_from={store.directory} and a checkpoint.dir of its own), where they begin from "
                     "their initializer") if modules else ""
            raise ConfigError(
                f"checkpoint.dir: {store.directory} holds the checkpoints of another run ({other}), which this run "
                f"cannot resume{start}; give this run a directory of its own (checkpoint.dir={store.directory}-2, "
                "say), or resume that run with its settings") from err
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

    def save(self, store: CheckpointStore, params: Params, opt_state, position: RunPosition, tokenizer=None) -> None:
        """A checkpoint of the training state at ``position``, in model order; ``tokenizer`` (when the
        data has one) beside it, for ``generate`` to decode with."""
        state, errors = self.canonical_state(params, opt_state)
        # (with one data shard the buffers are empty: nothing to keep, and orbax refuses empty arrays)
        keep_errors = self.cfg.checkpoint.onebit_errors == "keep" and any(x.size for x in jax.tree.leaves(errors))
        meta = {"seed": self.cfg.train.seed, "layout": self.layout(), "config": to_dict(self.cfg)}
        if self.model_def.adaptation is not None and not self.cfg.train.lora.save_base:  # the adapters, and where the base is
            state = {**state, "params": adapters_only(state["params"])}
            meta[BASE_KEY] = (self.base or self._configured_base()).to_meta(store.directory)
        store.save(position, state, errors if keep_errors else None, self.mesh, meta)
        if tokenizer is not None and jax.process_index() == 0:
            save_tokenizer(tokenizer, store.directory)


def finish_saving(store: CheckpointStore | None) -> list[int]:
    """Closes ``store`` once a save in flight has completed (or its error surfaced); the steps of the
    complete checkpoints it holds then ([] without a store)."""
    if store is None:
        return []
    store.wait()
    saved = store.steps()
    store.close()
    return saved


# What makes a checkpoint's tensors: a run that differs in these cannot resume another's checkpoints.
# (parallel.sequence_parallel and parallel.context_attention were model.* keys, and are kept here with them.
# parallel.ulysses_degree, newer, is not: it changes no tensor, and checkpoints written before it record none.)
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


def note(message: str) -> None:
    """One ``meshtron:`` line on stderr, from the lead process only."""
    if jax.process_index() == 0:
        print(f"meshtron: {message}", file=sys.stderr)
